// zkern/cpu/csrc/adam.h: the CPU Adam's interface between the pybind11 module (compiled with no ISA flags)
// and the three kernel translation units (adam_avx512.cpp, adam_avx2.cpp, adam_scalar.cpp).
#pragma once

#include <cstdint>

// The dtype codes the Python side passes (zkern/cpu/_ext.py keeps the same table).
enum ZkDtype : int { ZK_F32 = 0, ZK_F16 = 1, ZK_BF16 = 2, ZK_NONE = -1 };

struct AdamArgs {
  void* param;           // the master (param_dtype), updated in place
  int param_dtype;       // ZK_F32, or ZK_BF16 (bf16_master_weights_and_grads)
  const void* grad;      // grad_dtype elements, read only
  int grad_dtype;        // ZK_F32 / ZK_F16 / ZK_BF16
  void* exp_avg;         // state_dtype, in place
  void* exp_avg_sq;      // state_dtype, in place
  int state_dtype;       // ZK_F32, or ZK_BF16 (bf16_optimizer_states)
  void* out;             // optional copy of the updated param: fp16/bf16, or fp32 for an offloaded fp32 run
  int out_dtype;         // ZK_F32 / ZK_F16 / ZK_BF16 / ZK_NONE
  int64_t n;             // elements
  float beta2;
  float one_minus_beta1, one_minus_beta2;  // computed in double, as torch does, then rounded once
  float lr_decay;        // AdamW: param *= lr_decay (1 - lr * weight_decay) before the update
  float l2;              // Adam: grad += l2 * param (weight_decay), 0 for AdamW
  float neg_step_size;   // -lr / (1 - beta1^step)
  float inv_bc2_sqrt;    // 1 / sqrt(1 - beta2^step)
  float eps;
  float grad_scale;      // multiplies the upcast gradient first (unscale, clip and average folded in)
  bool stochastic;       // bf16 state rounds stochastically (else to nearest even)
  uint32_t sr_seed;      // stochastic rounding: the hash seed of this call
  int64_t sr_base;       // and the hashed index of its first element
  int threads;           // OpenMP threads for this call
  // Optional: the master's and the moments' values before this step, stored exactly as read (the speculative step,
  // offload/speculative.py, restores them if the step's decision comes out otherwise). All three or none.
  void* save_param;      // param_dtype
  void* save_exp_avg;    // state_dtype
  void* save_exp_avg_sq; // state_dtype
};

namespace zk_avx512 { void adam_step(const AdamArgs& a); }
namespace zk_avx2 { void adam_step(const AdamArgs& a); }
namespace zk_scalar { void adam_step(const AdamArgs& a); }
