// zkern/cpu/csrc/simd.h: the few vector operations the CPU Adam needs, for one instruction set per
// translation unit. The including file defines exactly one of ZK_ISA_AVX512, ZK_ISA_AVX2 or ZK_ISA_SCALAR and
// is compiled with that set's flags (setup.py gives each file its own, never the build host's native set), so every type
// and function here is instantiated once per ISA inside that file's own namespace (no ODR clash between files).
//
// Conversions follow torch bit for bit, because the engine compares its low-precision parameter copies with
// torch's param.to(dtype): fp16 rounds to nearest even as the F16C instructions do (NaN quieted, payload kept
// in its top 10 bits); bf16 rounds to nearest even and writes every NaN as 0xFFFF, as torch's vectorised cast
// does. Loads of fp16/bf16 are exact.
//
// bf16 optimizer state (the master or the moments kept in bf16) is rounded with vround_bf16 (to nearest even, as
// torch's cast) or vround_bf16_sr (stochastically: the 16 discarded bits get a uniform 16-bit number added before
// truncation, so the expected stored value is the fp32 value). The random bits come from vhash, a counter-based
// hash of (seed, element index): the same bits on every ISA, thread count and chunking (zkern/reference.py
// implements the same hash for the torch path).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "adam.h"
#include "zk_math.h"

#if defined(ZK_ISA_AVX512) || defined(ZK_ISA_AVX2)
#include <immintrin.h>
#endif

// The scalar bit-level helpers (conversions, bf16 rounding, the hash) are zkern/csrc/zk_math.h's, shared with the
// CUDA kernels; the vector versions below compute the same bits lane by lane.
using zk_math::kIndexStep;
using zk_math::kSecondStream;

#if defined(ZK_ISA_AVX512)

struct Vec {
  static constexpr int W = 16;
  __m512 v;
};
inline Vec vset(float x) { return {_mm512_set1_ps(x)}; }
inline Vec vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline Vec vload_f16(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline Vec vload_bf16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
inline __m256i to_f16(Vec a) { return _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT); }
// zk_math::bf16_add_bits and rne_add, per lane: the bf16 rounding is the top half of the result.
inline __m512i bf16_add_bits(Vec a, __m512i add) {
  __m512i r = _mm512_add_epi32(_mm512_castps_si512(a.v), add);
  __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}
inline __m512i rne_add(Vec a) {
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(a.v), 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
}
inline __m256i top_halves_of(__m512i r) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)); }
inline __m256i to_bf16(Vec a) { return top_halves_of(bf16_add_bits(a, rne_add(a))); }
inline void vstore_f16(uint16_t* p, Vec a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_f16(a)); }
inline void vstore_bf16(uint16_t* p, Vec a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(a)); }
// Non-temporal stores for the write-only output: its lines are not read for ownership first. The address
// must be aligned to the stored width (the caller checks).
constexpr bool kHasStream = true;
inline void vstream(float* p, Vec a) { _mm512_stream_ps(p, a.v); }
inline void vstream_f16(uint16_t* p, Vec a) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_f16(a)); }
inline void vstream_bf16(uint16_t* p, Vec a) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_bf16(a)); }
// A value vround_bf16 / vround_bf16_sr returned is a bf16 already: its top 16 bits are the bf16.
inline __m256i top_halves(Vec a) { return top_halves_of(_mm512_castps_si512(a.v)); }
inline void vstore_bf16_exact(uint16_t* p, Vec a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), top_halves(a)); }
inline void vstream_bf16_exact(uint16_t* p, Vec a) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), top_halves(a)); }
inline void vstream_fence() { _mm_sfence(); }
inline Vec vadd(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec vsub(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec vmul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec vdiv(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c, one rounding
inline Vec vsqrt(Vec a) { return {_mm512_sqrt_ps(a.v)}; }

struct VecI {
  __m512i v;
};
inline VecI vmix32(VecI a) {
  __m512i x = a.v;
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  return {x};
}
// mix32(seed ^ ((index + lane) * kIndexStep)) for the W lanes from `index`.
inline VecI vhash(uint32_t seed, uint32_t index) {
  __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i i = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(index)), lane);
  __m512i x = _mm512_mullo_epi32(i, _mm512_set1_epi32(static_cast<int>(kIndexStep)));
  return vmix32({_mm512_xor_si512(x, _mm512_set1_epi32(static_cast<int>(seed)))});
}
inline VecI vrehash(VecI h) { return vmix32({_mm512_xor_si512(h.v, _mm512_set1_epi32(static_cast<int>(kSecondStream)))}); }
inline VecI vlow16(VecI h) { return {_mm512_and_si512(h.v, _mm512_set1_epi32(0xffff))}; }
inline VecI vhigh16(VecI h) { return {_mm512_srli_epi32(h.v, 16)}; }
inline Vec round_bf16_add(Vec a, __m512i add) {
  return {_mm512_castsi512_ps(_mm512_and_si512(bf16_add_bits(a, add), _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
}
inline Vec vround_bf16(Vec a) { return round_bf16_add(a, rne_add(a)); }
inline Vec vround_bf16_sr(Vec a, VecI r) { return round_bf16_add(a, r.v); }

#elif defined(ZK_ISA_AVX2)

struct Vec {
  static constexpr int W = 8;
  __m256 v;
};
inline Vec vset(float x) { return {_mm256_set1_ps(x)}; }
inline Vec vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void vstore(float* p, Vec a) { _mm256_storeu_ps(p, a.v); }
inline Vec vload_f16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline Vec vload_bf16(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
}
inline __m128i to_f16(Vec a) { return _mm256_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT); }
// zk_math::bf16_add_bits and rne_add, per lane: the bf16 rounding is the top half of the result.
inline __m256i bf16_add_bits(Vec a, __m256i add) {
  __m256i r = _mm256_add_epi32(_mm256_castps_si256(a.v), add);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u)), nan);
}
inline __m256i rne_add(Vec a) {
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(a.v), 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
}
// Every lane is <= 0xffff after the shift, so the unsigned-saturating pack is exact; it packs within 128-bit halves.
inline __m128i top_halves_of(__m256i r) {
  r = _mm256_srli_epi32(r, 16);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8));
}
inline __m128i to_bf16(Vec a) { return top_halves_of(bf16_add_bits(a, rne_add(a))); }
inline void vstore_f16(uint16_t* p, Vec a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_f16(a)); }
inline void vstore_bf16(uint16_t* p, Vec a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(a)); }
constexpr bool kHasStream = true;
inline void vstream(float* p, Vec a) { _mm256_stream_ps(p, a.v); }
inline void vstream_f16(uint16_t* p, Vec a) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_f16(a)); }
inline void vstream_bf16(uint16_t* p, Vec a) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_bf16(a)); }
inline __m128i top_halves(Vec a) { return top_halves_of(_mm256_castps_si256(a.v)); }
inline void vstore_bf16_exact(uint16_t* p, Vec a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), top_halves(a)); }
inline void vstream_bf16_exact(uint16_t* p, Vec a) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), top_halves(a)); }
inline void vstream_fence() { _mm_sfence(); }
inline Vec vadd(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec vsub(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec vmul(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec vdiv(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec vsqrt(Vec a) { return {_mm256_sqrt_ps(a.v)}; }

struct VecI {
  __m256i v;
};
inline VecI vmix32(VecI a) {
  __m256i x = a.v;
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  return {x};
}
inline VecI vhash(uint32_t seed, uint32_t index) {
  __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i i = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(index)), lane);
  __m256i x = _mm256_mullo_epi32(i, _mm256_set1_epi32(static_cast<int>(kIndexStep)));
  return vmix32({_mm256_xor_si256(x, _mm256_set1_epi32(static_cast<int>(seed)))});
}
inline VecI vrehash(VecI h) { return vmix32({_mm256_xor_si256(h.v, _mm256_set1_epi32(static_cast<int>(kSecondStream)))}); }
inline VecI vlow16(VecI h) { return {_mm256_and_si256(h.v, _mm256_set1_epi32(0xffff))}; }
inline VecI vhigh16(VecI h) { return {_mm256_srli_epi32(h.v, 16)}; }
inline Vec round_bf16_add(Vec a, __m256i add) {
  return {_mm256_castsi256_ps(_mm256_and_si256(bf16_add_bits(a, add), _mm256_set1_epi32(static_cast<int>(0xffff0000u))))};
}
inline Vec vround_bf16(Vec a) { return round_bf16_add(a, rne_add(a)); }
inline Vec vround_bf16_sr(Vec a, VecI r) { return round_bf16_add(a, r.v); }

#elif defined(ZK_ISA_SCALAR)

struct Vec {
  static constexpr int W = 1;
  float v;
};
inline Vec vset(float x) { return {x}; }
inline Vec vload(const float* p) { return {*p}; }
inline void vstore(float* p, Vec a) { *p = a.v; }
inline Vec vload_f16(const uint16_t* p) { return {zk_math::f16_to_f32(*p)}; }
inline Vec vload_bf16(const uint16_t* p) { return {zk_math::bf16_to_f32(*p)}; }
inline void vstore_f16(uint16_t* p, Vec a) { *p = zk_math::f32_to_f16(a.v); }
inline void vstore_bf16(uint16_t* p, Vec a) { *p = zk_math::f32_to_bf16(a.v); }
constexpr bool kHasStream = false;  // plain stores only on this path
inline void vstream(float* p, Vec a) { vstore(p, a); }
inline void vstream_f16(uint16_t* p, Vec a) { vstore_f16(p, a); }
inline void vstream_bf16(uint16_t* p, Vec a) { vstore_bf16(p, a); }
inline void vstore_bf16_exact(uint16_t* p, Vec a) { *p = static_cast<uint16_t>(zk_math::bits_of(a.v) >> 16); }
inline void vstream_bf16_exact(uint16_t* p, Vec a) { vstore_bf16_exact(p, a); }
inline void vstream_fence() {}
inline Vec vadd(Vec a, Vec b) { return {a.v + b.v}; }
inline Vec vsub(Vec a, Vec b) { return {a.v - b.v}; }
inline Vec vmul(Vec a, Vec b) { return {a.v * b.v}; }
inline Vec vdiv(Vec a, Vec b) { return {a.v / b.v}; }
// No FMA instruction is assumed on this path: zk_math's host fma (see there).
inline Vec vfma(Vec a, Vec b, Vec c) { return {zk_math::vfma(a.v, b.v, c.v)}; }
inline Vec vsqrt(Vec a) { return {zk_math::vsqrt(a.v)}; }

struct VecI {
  uint32_t v;
};
inline VecI vhash(uint32_t seed, uint32_t index) { return {zk_math::hash_of(seed, index)}; }
inline VecI vrehash(VecI h) { return {zk_math::rehash(h.v)}; }
inline VecI vlow16(VecI h) { return {h.v & 0xffffu}; }
inline VecI vhigh16(VecI h) { return {h.v >> 16}; }
inline Vec vround_bf16(Vec a) { return {zk_math::round_bf16_bits(a.v, zk_math::rne_add(a.v))}; }
inline Vec vround_bf16_sr(Vec a, VecI r) { return {zk_math::round_bf16_bits(a.v, r.v)}; }

#else
#error "define one of ZK_ISA_AVX512, ZK_ISA_AVX2, ZK_ISA_SCALAR before including simd.h"
#endif
