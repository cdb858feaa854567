// zkern/csrc/zk_adam.h: one element of the fused Adam/AdamW step, from the loaded values to the bits each output
// stores, for the host compiler and nvcc alike: the CUDA kernel (zkern/cuda/csrc/adam.cu) runs it per element, and
// the CPU extension's adam_step_shared runs it on the host so the tests check the CUDA arithmetic without a GPU.
// Dtype codes: 0 fp32, 1 fp16, 2 bf16, -1 none (zkern/cpu/csrc/adam.h's ZkDtype).
#pragma once

#include "zk_math.h"

namespace zk_adam {

constexpr int kF32 = 0, kF16 = 1, kBf16 = 2, kNone = -1;

// A kept state's stored bits: fp32 as is; bf16 rounded by rne_add (to nearest even) or 16 random bits, the top half.
template <int D>
ZK_HD uint32_t state_bits(float x, bool stochastic, uint32_t random16) {
  if constexpr (D == kF32) return zk_math::bits_of(x);
  else return zk_math::bf16_add_bits(x, stochastic ? random16 : zk_math::rne_add(x)) >> 16;
}

// One element: the gradient g as loaded (before grad_scale), the master p and the moments m, v as fp32 values;
// out the stored bits of the master (M: its dtype), the moments (S) and the optional copy (O: the stored master's
// value in that dtype; a bf16 master's bf16 copy is its own bits). index: the element's stochastic-rounding index.
template <int O, bool AdamW, int M, int S>
ZK_HD void step_element(float g, float p, float m, float v, uint32_t index, const zk_math::AdamCoeffs<float>& c,
                        bool stochastic, uint32_t seed, uint32_t& p_bits, uint32_t& m_bits, uint32_t& v_bits,
                        uint32_t& o_bits) {
  zk_math::adam_update<AdamW>(g, p, m, v, c);
  uint32_t r1 = 0, r2 = 0;
  if ((M == kBf16 || S == kBf16) && stochastic) {
    r1 = zk_math::hash_of(seed, index);
    if (M == kBf16) r2 = zk_math::rehash(r1);
  }
  p_bits = state_bits<M>(p, stochastic, r2 & 0xffffu);
  m_bits = state_bits<S>(m, stochastic, r1 & 0xffffu);
  v_bits = state_bits<S>(v, stochastic, r1 >> 16);
  const float stored = M == kBf16 ? zk_math::float_of(p_bits << 16) : p;
  if constexpr (O == kF32) o_bits = zk_math::bits_of(stored);
  else if constexpr (O == kF16) o_bits = zk_math::f32_to_f16(stored);
  else if constexpr (O == kBf16) o_bits = M == kBf16 ? p_bits : zk_math::f32_to_bf16(stored);
  else o_bits = 0;
}

}  // namespace zk_adam
