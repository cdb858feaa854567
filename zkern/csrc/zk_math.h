// zkern/csrc/zk_math.h: the per-element arithmetic every native kernel of zkern shares, written once for the host
// compiler and for nvcc (__host__ __device__ there). The CPU Adam extension (zkern/cpu/csrc) compiles it into all
// three of its instruction-set paths and the CUDA kernels (zkern/cuda/csrc) into theirs, so the tests that check
// the CPU extension against zkern/reference.py check the CUDA kernels' arithmetic too.
//
//   conversions   fp16 and bf16 to and from fp32 as torch does them, bit for bit: bf16 rounds to nearest even and
//                 writes every NaN as 0xFFFF; fp16 rounds to nearest even, NaN quieted with its payload's top bits.
//   rounding      bf16 rounding of a kept state by adding 0x7fff plus the kept lsb (nearest even) or 16 random bits
//                 (stochastic) to the fp32 bits and keeping the top half; the random bits are lowbias32 of
//                 (seed ^ index * golden ratio): the same bits for an element on every path, thread count and split.
//   adam_update   torch.optim.Adam/AdamW's single-tensor formulas on one value (or one vector of values: T is
//                 float here, the CPU paths' Vec there; the operations are found by overloading).
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define ZK_HD __host__ __device__ __forceinline__
#else
#define ZK_HD inline
#endif

namespace zk_math {

// The golden-ratio step between consecutive element indices before hashing, and the constant that derives an
// element's second 32 random bits (one hash gives exp_avg and exp_avg_sq 16 bits each, the second a bf16 master's).
constexpr uint32_t kIndexStep = 0x9e3779b1u;
constexpr uint32_t kSecondStream = 0x68e31da4u;

ZK_HD uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

ZK_HD float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

ZK_HD float bf16_to_f32(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

// The bf16 rounding of f is the top half of bf16_add_bits(f, add): f's bits plus 0x7fff and the kept lsb (to
// nearest even, rne_add) or 16 random bits (stochastically); a NaN is 0xffff0000 (the bf16 NaN torch writes).
ZK_HD uint32_t bf16_add_bits(float f, uint32_t add) {
  uint32_t x = bits_of(f);
  return (x & 0x7fffffffu) > 0x7f800000u ? 0xffff0000u : x + add;
}
ZK_HD uint32_t rne_add(float f) { return 0x7fffu + ((bits_of(f) >> 16) & 1u); }

ZK_HD uint16_t f32_to_bf16(float f) { return static_cast<uint16_t>(bf16_add_bits(f, rne_add(f)) >> 16); }

// The fp32 value of x rounded to bf16 (bf16_add_bits' top half, the low half zero).
ZK_HD float round_bf16_bits(float x, uint32_t add) { return float_of(bf16_add_bits(x, add) & 0xffff0000u); }

ZK_HD float f16_to_f32(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));  // exact, as the host code below
#else
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return float_of(sign | 0x7f800000u | (m << 13));
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in fp32
    float v = static_cast<float>(m) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return float_of(sign | ((e + 112u) << 23) | (m << 13));
#endif
}

ZK_HD uint16_t f32_to_f16(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));  // round to nearest even, as the host code below
#else
  uint32_t x = bits_of(f);
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u | ((a >> 13) & 0x3ffu);  // NaN: quiet, payload truncated
  if (a >= 0x477ff000u) return sign | 0x7c00u;                       // 65520 and up (ties to even) -> inf
  if (a >= 0x38800000u) {                                           // normal in fp16
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u;       // round at bit 13, rebias 127 -> 15
    return sign | static_cast<uint16_t>(r >> 13);
  }
  uint32_t e = a >> 23;
  if (e < 102) return sign;  // below 2^-25 (or exactly it: a tie, to even) -> signed zero
  uint32_t mant = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;  // subnormal: units of 2^-24
  uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return sign | static_cast<uint16_t>(q);
#endif
}

// lowbias32 (a 32-bit integer finaliser with full avalanche): the random bits of stochastic rounding.
ZK_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// An element's first 32 random bits (exp_avg: the low 16, exp_avg_sq: the high 16) and its second (a bf16
// master's low 16).
ZK_HD uint32_t hash_of(uint32_t seed, uint32_t index) { return mix32(seed ^ (index * kIndexStep)); }
ZK_HD uint32_t rehash(uint32_t h) { return mix32(h ^ kSecondStream); }

// One value's operations, for adam_update on T = float. fma: the hardware's fused multiply-add on a GPU; on the
// host no FMA instruction is assumed (the scalar path's build has none), so the product, exact in double, and one
// double sum rounded to float stand in: within an ulp of a true fused multiply-add, where a float product and sum
// would lose the low bits that a cancelling sum (grad + weight_decay * param, the lerp) exposes.
ZK_HD float vmul(float a, float b) { return a * b; }
ZK_HD float vsub(float a, float b) { return a - b; }
ZK_HD float vdiv(float a, float b) { return a / b; }
ZK_HD float vsqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);  // correctly rounded, as the host's sqrt (not the approximate sqrtf of --use_fast_math)
#else
  return std::sqrt(a);
#endif
}
ZK_HD float vfma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return static_cast<float>(static_cast<double>(a) * static_cast<double>(b) + static_cast<double>(c));
#endif
}

// The step's scalars, each already in T (a vector of copies on the CPU paths).
template <class T>
struct AdamCoeffs {
  T grad_scale, lr_decay, l2, one_minus_beta1, one_minus_beta2, beta2, inv_bc2_sqrt, eps, neg_step_size;
};

// One Adam/AdamW update of p with gradient g (as loaded, before grad_scale) and moments m, v, all fp32 values:
// torch's single-tensor formulas, the moments' lerp and addcmul as fused multiply-adds; the update reads the
// moments as computed here, before any storage rounding.
template <bool AdamW, class T>
ZK_HD void adam_update(T g, T& p, T& m, T& v, const AdamCoeffs<T>& c) {
  g = vmul(g, c.grad_scale);
  if constexpr (AdamW) p = vmul(p, c.lr_decay);
  else g = vfma(c.l2, p, g);
  m = vfma(c.one_minus_beta1, vsub(g, m), m);  // lerp(m, g, 1 - beta1), as torch writes it
  v = vfma(vmul(c.one_minus_beta2, g), g, vmul(v, c.beta2));
  T denom = vfma(vsqrt(v), c.inv_bc2_sqrt, c.eps);
  p = vfma(c.neg_step_size, vdiv(m, denom), p);
}

}  // namespace zk_math
