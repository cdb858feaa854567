"""zkern's CPU side: the fused CPU Adam (a pybind11 extension, AVX-512 / AVX2 / scalar, OpenMP).

    python -m zkern.env_report          # is the extension built, which ISA path runs, and why

zkern.ops.adam_step_ on host tensors runs here; CPUAdam is the same kernel as a torch optimizer; the engine
steps offloaded optimizer states (zero_optimization.offload_optimizer) with it.
"""

from zkern.cpu._ext import active_isa, available, status
from zkern.cpu.adam import CPUAdam

__all__ = ["CPUAdam", "active_isa", "available", "status"]
