// zkern/cpu/csrc/shared_host.h: the CUDA kernels' per-element math (zkern/csrc/zk_adam.h, zk_quant.h) run on the
// host, element by element in the kernels' order: the pybind11 module exposes these so the tests hold the CUDA
// arithmetic to zkern/reference.py without a GPU. Not a fast path (the CPU Adam is adam_kernel.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "adam.h"
#include "zk_adam.h"
#include "zk_quant.h"

namespace zk_quant_host {

inline float load(const void* x, int dtype, int64_t i) {
  if (dtype == ZK_F32) return static_cast<const float*>(x)[i];
  uint16_t h = static_cast<const uint16_t*>(x)[i];
  return dtype == ZK_F16 ? zk_math::f16_to_f32(h) : zk_math::bf16_to_f32(h);
}

// Codes of one element into `codes` (int8: one byte each; int4: a nibble of byte i / 2).
inline void put_code(uint8_t* codes, int64_t i, int code, int bits) {
  if (bits == 8) {
    codes[i] = static_cast<uint8_t>(static_cast<int8_t>(code));
  } else if (i % 2 == 0) {
    codes[i / 2] = zk_quant::pack4(code, 0);  // the high nibble (code 0 = 8) is the next element's, or padding
  } else {
    codes[i / 2] = static_cast<uint8_t>((codes[i / 2] & 0x0f) | ((code + 8) << 4));
  }
}

inline int get_code(const uint8_t* codes, int64_t i, int bits) {
  if (bits == 8) return static_cast<int8_t>(codes[i]);
  return i % 2 == 0 ? zk_quant::low4(codes[i / 2]) : zk_quant::high4(codes[i / 2]);
}

// Quantize the n values of one group source: value(i) for i in [lo, hi).
template <class Value>
void quantize_group(Value value, int64_t lo, int64_t hi, int bits, uint8_t* codes, float* scale) {
  float absmax = 0.0f;
  bool all_finite = true;
  for (int64_t i = lo; i < hi; ++i) {
    float x = value(i);
    all_finite = all_finite && zk_quant::finite(x);
    absmax = std::max(absmax, std::fabs(x));
  }
  *scale = zk_quant::scale_of(absmax, all_finite, bits);
  float inverse = zk_quant::inverse_of(*scale);
  for (int64_t i = lo; i < hi; ++i) put_code(codes, i, zk_quant::code_of(value(i), inverse, bits), bits);
}

// quantize: n values of dtype x_dtype into codes (n bytes for int8, ceil(n / 2) for int4: an odd n's last high
// nibble is the padding code 0) and one scale per group.
inline void quantize(const void* x, int x_dtype, int64_t n, int bits, int64_t group, uint8_t* codes, float* scales) {
  for (int64_t lo = 0, g = 0; lo < n; lo += group, ++g)
    quantize_group([&](int64_t i) { return load(x, x_dtype, i); }, lo, std::min(n, lo + group), bits, codes,
                   scales + g);
}

// qgZ's hop in one pass: the fp32 sum over `world` quantized chunks (rank order) of n elements each (in_bits,
// codes_per_chunk bytes and groups_per_chunk scales a chunk), written to sum, then requantized with out_bits.
inline void dequant_sum_requant(const uint8_t* q, const float* scales, int world, int64_t codes_per_chunk,
                                int64_t groups_per_chunk, int in_bits, int64_t group, int64_t n, float* sum,
                                int out_bits, uint8_t* codes, float* out_scales) {
  for (int64_t i = 0; i < n; ++i) {
    float total = 0.0f;
    for (int r = 0; r < world; ++r)
      total += zk_quant::dequant(get_code(q + r * codes_per_chunk, i, in_bits),
                                 scales[r * groups_per_chunk + i / group]);
    sum[i] = total;
  }
  quantize(sum, ZK_F32, n, out_bits, group, codes, out_scales);
}

}  // namespace zk_quant_host

namespace zk_adam_host {

inline float load(const void* x, int dtype, int64_t i) { return zk_quant_host::load(x, dtype, i); }

inline void store(void* x, int dtype, int64_t i, uint32_t bits) {
  if (dtype == ZK_F32) static_cast<uint32_t*>(x)[i] = bits;
  else static_cast<uint16_t*>(x)[i] = static_cast<uint16_t>(bits);
}

template <int O, bool AdamW, int M, int S>
void run(const AdamArgs& a) {
  const zk_math::AdamCoeffs<float> c{a.grad_scale, a.lr_decay,     a.l2,  a.one_minus_beta1, a.one_minus_beta2,
                                     a.beta2,      a.inv_bc2_sqrt, a.eps, a.neg_step_size};
  for (int64_t i = 0; i < a.n; ++i) {
    uint32_t pb, mb, vb, ob;
    zk_adam::step_element<O, AdamW, M, S>(load(a.grad, a.grad_dtype, i), load(a.param, M, i),
                                          load(a.exp_avg, S, i), load(a.exp_avg_sq, S, i),
                                          static_cast<uint32_t>(a.sr_base + i), c, a.stochastic, a.sr_seed, pb, mb,
                                          vb, ob);
    store(a.param, M, i, pb);
    store(a.exp_avg, S, i, mb);
    store(a.exp_avg_sq, S, i, vb);
    if (O != ZK_NONE) store(a.out, O, i, ob);
  }
}

template <int O, bool AdamW>
void by_state(const AdamArgs& a) {
  if (a.param_dtype == ZK_F32 && a.state_dtype == ZK_F32) return run<O, AdamW, ZK_F32, ZK_F32>(a);
  if (a.param_dtype == ZK_F32) return run<O, AdamW, ZK_F32, ZK_BF16>(a);
  if (a.state_dtype == ZK_F32) return run<O, AdamW, ZK_BF16, ZK_F32>(a);
  return run<O, AdamW, ZK_BF16, ZK_BF16>(a);
}

template <bool AdamW>
void by_out(const AdamArgs& a) {
  switch (a.out_dtype) {
    case ZK_F32: return by_state<ZK_F32, AdamW>(a);
    case ZK_F16: return by_state<ZK_F16, AdamW>(a);
    case ZK_BF16: return by_state<ZK_BF16, AdamW>(a);
    default: return by_state<ZK_NONE, AdamW>(a);
  }
}

// The CUDA kernel's step (zk_adam::step_element per element), on the host.
inline void adam_step(const AdamArgs& a, bool adamw) { adamw ? by_out<true>(a) : by_out<false>(a); }

}  // namespace zk_adam_host
