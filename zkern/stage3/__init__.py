"""ZeRO stage 3: parameters partitioned at rest and gathered per fetch unit while a module needs them (runtime.py
says which file holds which piece)."""
