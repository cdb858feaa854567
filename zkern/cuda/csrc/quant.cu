// zkern/cuda/csrc/quant.cu: ZeRO++'s blockwise quantization on CUDA: quantize (int8 for qwZ's weights, int4 for
// qgZ's gradients) and qgZ's hop fused in one pass (dequantize every rank's chunk, sum in rank order, requantize
// for the next hop). Per-element rules: zkern/csrc/zk_quant.h, which the CPU extension compiles too.
//
// One warp per group (four groups a block): a first pass finds the group's absmax (and whether all its values are
// finite), a warp reduction makes its scale, a second pass writes the codes. Each lane takes kE consecutive
// elements a pass, so that its codes are one 16-byte store (16 int8 codes, or 32 int4 codes in 16 bytes) and its
// loads 16-byte vectors, when the pointers are 16-byte aligned and the group and n are multiples of kE; element by
// element otherwise.
#include <cuda_fp16.h>

#include "zk_cuda.h"
#include "zk_access.cuh"
#include "zk_quant.h"

namespace zk_cuda {
namespace {

constexpr int kWarps = 4;
constexpr unsigned kAll = 0xffffffffu;

// E codes (int8: E bytes; int4: E / 2 bytes) from element i, as 16-byte loads.
template <int Bits, int E>
__device__ __forceinline__ void load_codes(const uint8_t* q, int64_t i, int (&c)[E]) {
  const uint4* p = reinterpret_cast<const uint4*>(q + (Bits == 8 ? i : i / 2));
  constexpr int kBytes = Bits == 8 ? E : E / 2;
#pragma unroll
  for (int k = 0; k < kBytes / 16; ++k) {
    uint4 u = p[k];
    uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int b = 0; b < 16; ++b) {
      uint8_t byte = static_cast<uint8_t>(w[b / 4] >> (8 * (b % 4)));
      if constexpr (Bits == 8) {
        c[16 * k + b] = static_cast<int8_t>(byte);
      } else {
        c[32 * k + 2 * b] = zk_quant::low4(byte);
        c[32 * k + 2 * b + 1] = zk_quant::high4(byte);
      }
    }
  }
}

template <int Bits, int E>
__device__ __forceinline__ void store_codes(uint8_t* q, int64_t i, const int (&c)[E]) {
  uint4* p = reinterpret_cast<uint4*>(q + (Bits == 8 ? i : i / 2));
  constexpr int kBytes = Bits == 8 ? E : E / 2;
#pragma unroll
  for (int k = 0; k < kBytes / 16; ++k) {
    uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int b = 0; b < 16; ++b) {
      uint32_t byte = Bits == 8 ? static_cast<uint8_t>(static_cast<int8_t>(c[16 * k + b]))
                                : zk_quant::pack4(c[32 * k + 2 * b], c[32 * k + 2 * b + 1]);
      w[b / 4] |= byte << (8 * (b % 4));
    }
    p[k] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

__device__ __forceinline__ int code_at(const uint8_t* q, int64_t i, int bits) {
  return bits == 8 ? static_cast<int8_t>(q[i]) : (i % 2 == 0 ? zk_quant::low4(q[i / 2]) : zk_quant::high4(q[i / 2]));
}

// The group's scale from every lane's absmax and finiteness; lane 0 stores it.
__device__ __forceinline__ float group_scale(float absmax, bool finite, int bits, float* scale_out, int lane) {
#pragma unroll
  for (int off = 16; off; off >>= 1) absmax = fmaxf(absmax, __shfl_xor_sync(kAll, absmax, off));
  finite = __all_sync(kAll, finite);
  float scale = zk_quant::scale_of(absmax, finite, bits);
  if (lane == 0) *scale_out = scale;
  return scale;
}

// Codes of elements [g0, g1) of value source src (already quantized scale known): element by element.
template <class Src>
__device__ __forceinline__ void codes_scalar(Src src, int64_t g0, int64_t g1, int64_t n, float inverse, int bits,
                                             uint8_t* codes, int lane) {
  if (bits == 8) {
    for (int64_t i = g0 + lane; i < g1; i += 32) codes[i] = static_cast<uint8_t>(static_cast<int8_t>(
                                                      zk_quant::code_of(src(i), inverse, bits)));
  } else {  // one byte per lane: elements 2j and 2j + 1 (a group is an even count, so a byte never straddles two;
            // past n is the padding code 0)
    for (int64_t j = g0 / 2 + lane; 2 * j < g1; j += 32) {
      int lo = zk_quant::code_of(src(2 * j), inverse, bits);
      int hi = 2 * j + 1 < n ? zk_quant::code_of(src(2 * j + 1), inverse, bits) : 0;
      codes[j] = zk_quant::pack4(lo, hi);
    }
  }
}

template <int D, int Bits>
__global__ void __launch_bounds__(32 * kWarps) quantize_kernel(const void* x, int64_t n, int64_t group,
                                                               uint8_t* codes, float* scales, bool aligned) {
  constexpr int E = Bits == 8 ? 16 : 32;
  const int lane = threadIdx.x % 32;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t g0 = g * group;
  if (g0 >= n) return;  // the whole warp leaves together
  const int64_t g1 = min(n, g0 + group);
  float absmax = 0.0f;
  bool finite = true;
  if (aligned) {
    for (int64_t i = g0 + lane * E; i < g1; i += 32 * E) {
      float v[E];
      load_vec<D, E>(x, i, v);
#pragma unroll
      for (int k = 0; k < E; ++k) absmax = fmaxf(absmax, fabsf(v[k])), finite = finite && zk_quant::finite(v[k]);
    }
  } else {
    for (int64_t i = g0 + lane; i < g1; i += 32) {
      float v = load_one<D>(x, i);
      absmax = fmaxf(absmax, fabsf(v)), finite = finite && zk_quant::finite(v);
    }
  }
  const float inverse = zk_quant::inverse_of(group_scale(absmax, finite, Bits, scales + g, lane));
  if (aligned) {
    for (int64_t i = g0 + lane * E; i < g1; i += 32 * E) {
      float v[E];
      int c[E];
      load_vec<D, E>(x, i, v);  // the group was just read: from the cache
#pragma unroll
      for (int k = 0; k < E; ++k) c[k] = zk_quant::code_of(v[k], inverse, Bits);
      store_codes<Bits, E>(codes, i, c);
    }
  } else {
    codes_scalar([&](int64_t i) { return load_one<D>(x, i); }, g0, g1, n, inverse, Bits, codes, lane);
  }
}

// qgZ's hop. OutBits 0: the sum only.
template <int InBits, int OutBits>
__global__ void __launch_bounds__(32 * kWarps) dequant_sum_requant_kernel(
    const uint8_t* q, int64_t codes_stride, const float* scales, int64_t scales_stride, int world, int64_t group,
    int64_t n, float* sum, uint8_t* codes, float* out_scales, bool aligned) {
  constexpr int E = (InBits == 4 || OutBits == 4) ? 32 : 16;
  const int lane = threadIdx.x % 32;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t g0 = g * group;
  if (g0 >= n) return;
  const int64_t g1 = min(n, g0 + group);
  float absmax = 0.0f;
  bool finite = true;
  if (aligned) {
    for (int64_t i = g0 + lane * E; i < g1; i += 32 * E) {
      float total[E];
#pragma unroll
      for (int k = 0; k < E; ++k) total[k] = 0.0f;
      for (int r = 0; r < world; ++r) {  // rank order, as reference.dequant_sum adds
        int c[E];
        load_codes<InBits, E>(q + r * codes_stride, i, c);
        const float scale = scales[r * scales_stride + g];
#pragma unroll
        for (int k = 0; k < E; ++k) total[k] += zk_quant::dequant(c[k], scale);
      }
      float4* out = reinterpret_cast<float4*>(sum + i);
#pragma unroll
      for (int k = 0; k < E / 4; ++k) out[k] = make_float4(total[4 * k], total[4 * k + 1], total[4 * k + 2], total[4 * k + 3]);
#pragma unroll
      for (int k = 0; k < E; ++k) absmax = fmaxf(absmax, fabsf(total[k])), finite = finite && zk_quant::finite(total[k]);
    }
  } else {
    for (int64_t i = g0 + lane; i < g1; i += 32) {
      float total = 0.0f;
      for (int r = 0; r < world; ++r)
        total += zk_quant::dequant(code_at(q + r * codes_stride, i, InBits), scales[r * scales_stride + g]);
      sum[i] = total;
      absmax = fmaxf(absmax, fabsf(total)), finite = finite && zk_quant::finite(total);
    }
  }
  if constexpr (OutBits != 0) {
    __syncwarp();  // the sums other lanes wrote are read below (a byte of int4 codes takes two of them)
    const float inverse = zk_quant::inverse_of(group_scale(absmax, finite, OutBits, out_scales + g, lane));
    if (aligned) {
      for (int64_t i = g0 + lane * E; i < g1; i += 32 * E) {
        int c[E];
        const float4* in = reinterpret_cast<const float4*>(sum + i);
#pragma unroll
        for (int k = 0; k < E / 4; ++k) {
          float4 a = in[k];
          c[4 * k] = zk_quant::code_of(a.x, inverse, OutBits), c[4 * k + 1] = zk_quant::code_of(a.y, inverse, OutBits);
          c[4 * k + 2] = zk_quant::code_of(a.z, inverse, OutBits), c[4 * k + 3] = zk_quant::code_of(a.w, inverse, OutBits);
        }
        store_codes<OutBits, E>(codes, i, c);
      }
    } else {
      codes_scalar([&](int64_t i) { return sum[i]; }, g0, g1, n, inverse, OutBits, codes, lane);
    }
  }
}

int blocks_for(int64_t n, int64_t group) { return static_cast<int>(((n + group - 1) / group + kWarps - 1) / kWarps); }

template <int InBits>
cudaError_t hop_by_out(int out_bits, dim3 grid, cudaStream_t st, const uint8_t* q, int64_t cs, const float* s,
                       int64_t ss, int world, int64_t group, int64_t n, float* sum, uint8_t* codes, float* os,
                       bool aligned) {
  dim3 block(32 * kWarps);
  if (out_bits == 0)
    dequant_sum_requant_kernel<InBits, 0><<<grid, block, 0, st>>>(q, cs, s, ss, world, group, n, sum, codes, os, aligned);
  else if (out_bits == 4)
    dequant_sum_requant_kernel<InBits, 4><<<grid, block, 0, st>>>(q, cs, s, ss, world, group, n, sum, codes, os, aligned);
  else if (out_bits == 8)
    dequant_sum_requant_kernel<InBits, 8><<<grid, block, 0, st>>>(q, cs, s, ss, world, group, n, sum, codes, os, aligned);
  else
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}

bool valid_group(int64_t group) { return group >= 2 && (group & (group - 1)) == 0; }

}  // namespace

cudaError_t quantize(const void* x, int x_dtype, int64_t n, int bits, int64_t group, uint8_t* codes, float* scales,
                     cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (!valid_group(group) || (bits != 8 && bits != 4)) return cudaErrorInvalidValue;
  const int E = bits == 8 ? 16 : 32;
  const bool aligned = aligned16(x) && aligned16(codes) && group % E == 0 && n % E == 0;
  dim3 grid(blocks_for(n, group)), block(32 * kWarps);
#define ZK_QUANTIZE(D, B) quantize_kernel<D, B><<<grid, block, 0, stream>>>(x, n, group, codes, scales, aligned)
  if (x_dtype == F32 && bits == 8) ZK_QUANTIZE(F32, 8);
  else if (x_dtype == F32) ZK_QUANTIZE(F32, 4);
  else if (x_dtype == F16 && bits == 8) ZK_QUANTIZE(F16, 8);
  else if (x_dtype == F16) ZK_QUANTIZE(F16, 4);
  else if (x_dtype == BF16 && bits == 8) ZK_QUANTIZE(BF16, 8);
  else if (x_dtype == BF16) ZK_QUANTIZE(BF16, 4);
  else return cudaErrorInvalidValue;
#undef ZK_QUANTIZE
  return cudaGetLastError();
}

cudaError_t dequant_sum_requant(const uint8_t* q, int64_t codes_stride, const float* scales, int64_t scales_stride,
                                int world, int in_bits, int64_t group, int64_t n, float* sum, int out_bits,
                                uint8_t* codes, float* out_scales, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (!valid_group(group) || world < 1) return cudaErrorInvalidValue;
  const int E = (in_bits == 4 || out_bits == 4) ? 32 : 16;
  const bool aligned = aligned16(q) && codes_stride % 16 == 0 && aligned16(sum) &&
                       (out_bits == 0 || aligned16(codes)) && group % E == 0 && n % E == 0;
  dim3 grid(blocks_for(n, group));
  if (in_bits == 8)
    return hop_by_out<8>(out_bits, grid, stream, q, codes_stride, scales, scales_stride, world, group, n, sum, codes,
                         out_scales, aligned);
  if (in_bits == 4)
    return hop_by_out<4>(out_bits, grid, stream, q, codes_stride, scales, scales_stride, world, group, n, sum, codes,
                         out_scales, aligned);
  return cudaErrorInvalidValue;
}

}  // namespace zk_cuda
