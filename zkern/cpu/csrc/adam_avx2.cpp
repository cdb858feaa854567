// The CPU Adam for the avx2 instruction set; setup.py compiles this file alone with that set's flags.
#define ZK_ISA_AVX2
#define ZK_NS zk_avx2
#include "adam_kernel.h"
