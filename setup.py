"""zkern's build: `pip install -e ".[test]"` (what `make test` runs).

Builds one extension, zkern.cpu._adam_ext: the fused CPU Adam (pybind11, OpenMP, no libtorch), the NVMe
path's I/O thread pool (aio.cpp: pread/pwrite, no system library beyond libc) and a host run of the CUDA kernels'
per-element math (zkern/csrc, shared_host.h) for the tests. The CUDA kernels themselves (zkern/cuda) are built on
first use, where torch has CUDA. Each kernel
file gets its own instruction-set flags (never the build host's native set: the wheel must run on any x86-64 CPU, which
picks its path at run time), so the build works on a machine without AVX-512 and the AVX-512 path still
exists for the machine that has it. On a CPU other than x86-64 only the scalar path is compiled.
"""

import platform

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

CSRC = "zkern/cpu/csrc"
SHARED = "zkern/csrc"  # the per-element math the CUDA kernels (zkern/cuda/csrc) compile too
# The Tritons zkern's kernels are checked under (make gate's gpu-static: compiled, spill-free, 128-bit access): 3.6
# (the GPU image's, which ran them compiled on an H100), 3.7.1 (what torch 2.13's public wheel pins) and 3.9 (the
# newest). 3.6's interpreter, the CPU test path, needs numpy < 2.4: it turns a one-element array into a loop bound.
TRITON = "triton>=3.6,<3.10; platform_system == 'Linux' and platform_machine == 'x86_64'"
HF = ["transformers>=5.23,<6", "accelerate>=1.1"]
X86 = platform.machine().lower() in ("x86_64", "amd64")
# Per-file flags: the file name says which instruction set it may use.
ISA_FLAGS = {
    # GCC 12 warns inside its own avx512fintrin.h (an intrinsic's undefined source operand); not ours.
    "adam_avx512.cpp": ["-mavx512f", "-mavx2", "-mfma", "-mf16c", "-Wno-maybe-uninitialized"],
    "adam_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    "adam_scalar.cpp": [],
    "module.cpp": [],
    "aio.cpp": [],
}
KERNELS = ["adam_avx512.cpp", "adam_avx2.cpp"] if X86 else []


# The extension's five sources compile in parallel, one per core (ZKERN_BUILD_JOBS caps it): 58 s serially on the
# first GPU machine's bare start, most of it the AVX-512 and AVX2 files, each alone about a third of that.
ParallelCompile("ZKERN_BUILD_JOBS", default=0).install()


class BuildWithIsaFlags(build_ext):
    """build_ext that adds each source's ISA flags to that source's compile line only."""

    def build_extensions(self):
        compile_one = self.compiler._compile

        def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts):
            name = src.replace("\\", "/").rsplit("/", 1)[-1]
            flags = ISA_FLAGS.get(name, [])
            return compile_one(obj, src, ext, cc_args, list(extra_postargs) + flags, pp_opts)

        self.compiler._compile = _compile
        super().build_extensions()


adam_ext = Pybind11Extension(
    "zkern.cpu._adam_ext",
    sources=[f"{CSRC}/module.cpp", f"{CSRC}/adam_scalar.cpp", f"{CSRC}/aio.cpp"] + [f"{CSRC}/{k}" for k in KERNELS],
    depends=[f"{CSRC}/{h}" for h in ("adam.h", "adam_kernel.h", "simd.h", "aio.h", "shared_host.h")]
    + [f"{SHARED}/{h}" for h in ("zk_math.h", "zk_adam.h", "zk_quant.h")],
    include_dirs=[SHARED],
    define_macros=[("ZK_HAVE_X86_KERNELS", "1" if X86 else "0")],
    cxx_std=17,
    extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno"],
    extra_link_args=["-fopenmp"],
)

setup(
    name="zkern",
    version="0.1.0",
    description="ZeRO training on torch.distributed with DeepSpeed-compatible configs",
    packages=find_packages(include=["zkern", "zkern.*"]),
    # the CUDA kernels' sources and the math they share with the CPU extension: built on the user's machine
    package_data={"zkern": ["csrc/*.h"], "zkern.cuda": ["csrc/*.cu", "csrc/*.cuh", "csrc/*.h", "csrc/*.cpp"]},
    python_requires=">=3.10",
    # A range, not a pin: with torch 2.13.0 (CPU) already installed, pip adds nothing. The Makefile installs
    # torch==2.13.0 first where none is present, because an unpinned torch pulls gigabytes of CUDA packages.
    install_requires=["torch>=2.4"],
    # Triton: zkern's GPU kernels; the tests run them on a CPU under TRITON_INTERPRET=1, so the test extra has it.
    # transformers: the tests train Hugging Face's GPT-2 (built from a config; nothing is downloaded) and
    # zkern.hf.Trainer against transformers.Trainer.
    # hf: zkern.hf (Trainer, from_pretrained) overrides Trainer methods of transformers 5.x, which needs accelerate.
    # trl: the tests train TRL's SFTTrainer and DPOTrainer through zkern.hf.Trainer against TRL on DDP.
    # deepspeed: the test-only peer whose own config parser and schedulers the config tests run side by side with
    # zkern's (it installs on a CPU); tensorboard: the tensorboard monitor's package (torch.utils.tensorboard).
    extras_require={"triton": [TRITON],
                    "hf": HF,
                    "monitors": ["tensorboard"],
                    "test": ["pytest>=8", "ruff>=0.5", "numpy", "matplotlib", *HF, TRITON, "deepspeed>=0.19,<0.20",
                             "trl>=1.16,<2",
                             "tensorboard"]},
    ext_modules=[adam_ext],
    cmdclass={"build_ext": BuildWithIsaFlags},
)
