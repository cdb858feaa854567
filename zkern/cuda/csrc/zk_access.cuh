// zkern/cuda/csrc/zk_access.cuh: the global-memory reads the CUDA kernels share: one value of a float stream, or E
// values (16-byte aligned) as float4s / uint4s, each upcast to fp32 through zk_math's exact conversions.
#pragma once

#include <cstdint>

#include "zk_cuda.h"
#include "zk_math.h"

namespace zk_cuda {

template <int D>
__device__ __forceinline__ float load_one(const void* x, int64_t i) {
  if constexpr (D == F32) return static_cast<const float*>(x)[i];
  uint16_t h = static_cast<const uint16_t*>(x)[i];
  return D == F16 ? zk_math::f16_to_f32(h) : zk_math::bf16_to_f32(h);
}

// E values from element i (16-byte aligned; E a multiple of 8): fp32 in float4s, 16-bit in uint4s.
template <int D, int E>
__device__ __forceinline__ void load_vec(const void* x, int64_t i, float (&v)[E]) {
  if constexpr (D == F32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(x) + i);
#pragma unroll
    for (int k = 0; k < E / 4; ++k) {
      float4 a = p[k];
      v[4 * k] = a.x, v[4 * k + 1] = a.y, v[4 * k + 2] = a.z, v[4 * k + 3] = a.w;
    }
  } else {
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(x) + i);
#pragma unroll
    for (int k = 0; k < E / 8; ++k) {
      uint4 u = p[k];
      uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint16_t lo = static_cast<uint16_t>(w[j] & 0xffffu), hi = static_cast<uint16_t>(w[j] >> 16);
        v[8 * k + 2 * j] = D == F16 ? zk_math::f16_to_f32(lo) : zk_math::bf16_to_f32(lo);
        v[8 * k + 2 * j + 1] = D == F16 ? zk_math::f16_to_f32(hi) : zk_math::bf16_to_f32(hi);
      }
    }
  }
}

// Whether a pointer may be read and written 16 bytes at a time (an absent one, nullptr, does not hold that back).
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace zk_cuda
