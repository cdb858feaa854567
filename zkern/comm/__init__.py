"""Collectives: the Comm wrapper with timeouts and byte counters (collectives.py), the fixed reduce schedule shared
by stages 1-3 (schedule.py), the tags and signatures that find ranks out of step (divergence.py), whole-model gathers
to the host (whole.py) and ZeRO++'s quantized paths (zeropp.py)."""
