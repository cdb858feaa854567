// The CPU Adam for the scalar instruction set; setup.py compiles this file alone with that set's flags.
#define ZK_ISA_SCALAR
#define ZK_NS zk_scalar
#include "adam_kernel.h"
