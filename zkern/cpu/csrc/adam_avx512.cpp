// The CPU Adam for the avx512 instruction set; setup.py compiles this file alone with that set's flags.
#define ZK_ISA_AVX512
#define ZK_NS zk_avx512
#include "adam_kernel.h"
