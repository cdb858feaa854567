"""zkern's build: `pip install -e ".[test]"` (what `make test` runs).

The package is pure Python today; the CPU Adam extension (pybind11, no libtorch) joins here as an
ext_module when it lands.
"""

from setuptools import find_packages, setup

setup(
    name="zkern",
    version="0.1.0",
    description="ZeRO training on torch.distributed with DeepSpeed-compatible configs",
    packages=find_packages(include=["zkern", "zkern.*"]),
    python_requires=">=3.10",
    # A range, not a pin: with torch 2.13.0 (CPU) already installed, pip adds nothing. The Makefile installs
    # torch==2.13.0 first where none is present, because an unpinned torch pulls gigabytes of CUDA packages.
    install_requires=["torch>=2.4"],
    extras_require={"test": ["pytest>=8", "ruff>=0.5", "numpy", "matplotlib"]},
)
