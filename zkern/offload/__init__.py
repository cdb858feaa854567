"""ZeRO-Offload and ZeRO-Infinity: the optimizer step on the host (host.py), the optimizer states in files on NVMe
(nvme.py) and stage 3's parameter shard in a file (nvme_params.py)."""
