// zkern/cuda/csrc/zk_cuda.h: the CUDA kernels' launchers, over raw device pointers and a stream: no libtorch here,
// so `nvcc` compiles adam.cu and quant.cu alone (the static gate: python -m zkern.cuda.static) and bindings.cpp
// binds them to torch where torch has CUDA.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace zk_cuda {

// The dtype codes of zkern/cpu/csrc/adam.h (the Python side passes the same).
enum Dtype : int { F32 = 0, F16 = 1, BF16 = 2, NONE = -1 };

// One tensor of a multi-tensor Adam step: param (the master, F32 or BF16), grad, the moments (F32 or BF16) and the
// optional 16-bit (or fp32) copy of the updated master, all n elements; sr_base: the index stochastic rounding
// hashes for element 0 (the tensor's offset in its flat shard).
struct AdamTensor {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* out;
  int64_t n;
  int64_t sr_base;
};

// The step's scalars, each computed in double and rounded once (as zkern/cpu/csrc/module.cpp does).
struct AdamScalars {
  float grad_scale, lr_decay, l2, one_minus_beta1, one_minus_beta2, beta2, inv_bc2_sqrt, eps, neg_step_size;
  bool stochastic;
  uint32_t sr_seed;
};

// One fused Adam/AdamW step over `count` tensors sharing dtypes, in as few launches as fit the kernel's argument
// space. A tensor whose pointers are all 16-byte aligned is stepped with 128-bit loads and stores.
cudaError_t adam_step(const AdamTensor* tensors, int count, int grad_dtype, int param_dtype, int state_dtype,
                      int out_dtype, bool adamw, const AdamScalars& s, cudaStream_t stream);

// ZeRO++'s blockwise quantization (zkern/csrc/zk_quant.h): n values of x_dtype into codes (n bytes for 8 bits,
// ceil(n / 2) for 4) and one fp32 scale per group of `group` elements (a power of two).
cudaError_t quantize(const void* x, int x_dtype, int64_t n, int bits, int64_t group, uint8_t* codes, float* scales,
                     cudaStream_t stream);

// qgZ's hop in one pass: the fp32 sum over `world` quantized chunks of n elements (rank order; chunk r's codes at
// q + r * codes_stride bytes, its scales at scales + r * scales_stride), written to sum, and when out_bits is 4 or 8
// requantized into codes / out_scales (out_bits 0: the sum only, i.e. dequant_sum; world 1: dequantize).
cudaError_t dequant_sum_requant(const uint8_t* q, int64_t codes_stride, const float* scales, int64_t scales_stride,
                                int world, int in_bits, int64_t group, int64_t n, float* sum, int out_bits,
                                uint8_t* codes, float* out_scales, cudaStream_t stream);

}  // namespace zk_cuda
