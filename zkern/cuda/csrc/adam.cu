// zkern/cuda/csrc/adam.cu: the fused multi-tensor Adam/AdamW step on CUDA, with the 16-bit copy-out and bf16
// optimizer state (round to nearest even, or stochastic). The arithmetic is zkern/csrc/zk_math.h's, which the
// CPU extension compiles too: zk_adam.h's step_element is what each element goes through here, and what
// zkern.cpu._ext.adam_step_shared runs on the host for tests/kernels/test_cuda_shared.py to hold to zkern/reference.py.
//
// One launch steps up to kMaxTensors tensors: each block takes one kChunk-element chunk of one tensor (the
// block table rides in the kernel's arguments, as a multi-tensor apply does), each thread kVec consecutive
// elements per pass: 128-bit loads and stores for every stream (two for fp32, one for 16-bit) when the tensor's
// pointers are 16-byte aligned, element by element otherwise and in a chunk's last partial vector.
#include <cuda_fp16.h>

#include <algorithm>

#include "zk_cuda.h"
#include "zk_access.cuh"
#include "zk_adam.h"

namespace zk_cuda {
namespace {

constexpr int kMaxTensors = 24;
constexpr int kMaxBlocks = 320;  // with the pointer table: under the 4 KB of kernel arguments every arch takes
constexpr int kThreads = 256;
constexpr int kVec = 8;
constexpr int64_t kChunk = 16384;

struct AdamList {
  void* param[kMaxTensors];
  const void* grad[kMaxTensors];
  void* exp_avg[kMaxTensors];
  void* exp_avg_sq[kMaxTensors];
  void* out[kMaxTensors];
  int64_t n[kMaxTensors];
  int64_t sr_base[kMaxTensors];
  int32_t chunk_of[kMaxBlocks];
  uint8_t tensor_of[kMaxBlocks];
  uint8_t aligned[kMaxTensors];
};

// Stores take each value's stored bits: fp32 bits, or a 16-bit pattern in the low half.
template <int D>
__device__ __forceinline__ void store_vec(void* base, int64_t i, const uint32_t (&bits)[kVec]) {
  if constexpr (D == F32) {
    float4* p = reinterpret_cast<float4*>(static_cast<float*>(base) + i);
    p[0] = make_float4(__uint_as_float(bits[0]), __uint_as_float(bits[1]), __uint_as_float(bits[2]),
                       __uint_as_float(bits[3]));
    p[1] = make_float4(__uint_as_float(bits[4]), __uint_as_float(bits[5]), __uint_as_float(bits[6]),
                       __uint_as_float(bits[7]));
  } else {
    uint4 u;
    u.x = bits[0] | (bits[1] << 16), u.y = bits[2] | (bits[3] << 16);
    u.z = bits[4] | (bits[5] << 16), u.w = bits[6] | (bits[7] << 16);
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + i) = u;
  }
}

template <int D>
__device__ __forceinline__ void store_one(void* base, int64_t i, uint32_t bits) {
  if constexpr (D == F32) static_cast<uint32_t*>(base)[i] = bits;
  else static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(bits);
}

template <int G, int O, int M, int S>
__global__ void __launch_bounds__(kThreads) adam_kernel(AdamList L, AdamScalars s, bool adamw) {
  const int t = L.tensor_of[blockIdx.x];
  const int64_t lo = static_cast<int64_t>(L.chunk_of[blockIdx.x]) * kChunk;
  const int64_t hi = min(L.n[t], lo + kChunk);
  void* param = L.param[t];
  const void* grad = L.grad[t];
  void* m = L.exp_avg[t];
  void* v = L.exp_avg_sq[t];
  void* out = L.out[t];
  const uint32_t base = static_cast<uint32_t>(L.sr_base[t]);
  const zk_math::AdamCoeffs<float> c{s.grad_scale, s.lr_decay,  s.l2,           s.one_minus_beta1, s.one_minus_beta2,
                                     s.beta2,      s.inv_bc2_sqrt, s.eps, s.neg_step_size};
  int64_t scalar_from = lo;
  if (L.aligned[t]) {
    const int64_t vec_hi = lo + (hi - lo) / kVec * kVec;
    for (int64_t i = lo + threadIdx.x * kVec; i < vec_hi; i += kThreads * kVec) {
      float g[kVec], p[kVec], mm[kVec], vv[kVec];
      load_vec<G, kVec>(grad, i, g);
      load_vec<M, kVec>(param, i, p);
      load_vec<S, kVec>(m, i, mm);
      load_vec<S, kVec>(v, i, vv);
      uint32_t pb[kVec], mb[kVec], vb[kVec], ob[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        uint32_t index = base + static_cast<uint32_t>(i + k);
        if (adamw)
          zk_adam::step_element<O, true, M, S>(g[k], p[k], mm[k], vv[k], index, c, s.stochastic, s.sr_seed, pb[k], mb[k], vb[k],
                                  ob[k]);
        else
          zk_adam::step_element<O, false, M, S>(g[k], p[k], mm[k], vv[k], index, c, s.stochastic, s.sr_seed, pb[k], mb[k], vb[k],
                                   ob[k]);
      }
      store_vec<M>(param, i, pb);
      store_vec<S>(m, i, mb);
      store_vec<S>(v, i, vb);
      if constexpr (O != NONE) store_vec<O>(out, i, ob);
    }
    scalar_from = vec_hi;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < hi; i += kThreads) {
    uint32_t pb, mb, vb, ob, index = base + static_cast<uint32_t>(i);
    float g = load_one<G>(grad, i), p = load_one<M>(param, i), mm = load_one<S>(m, i), vv = load_one<S>(v, i);
    if (adamw) zk_adam::step_element<O, true, M, S>(g, p, mm, vv, index, c, s.stochastic, s.sr_seed, pb, mb, vb, ob);
    else zk_adam::step_element<O, false, M, S>(g, p, mm, vv, index, c, s.stochastic, s.sr_seed, pb, mb, vb, ob);
    store_one<M>(param, i, pb);
    store_one<S>(m, i, mb);
    store_one<S>(v, i, vb);
    if constexpr (O != NONE) store_one<O>(out, i, ob);
  }
}

template <int G, int O, int M, int S>
cudaError_t launch_all(const AdamTensor* tensors, int count, bool adamw, const AdamScalars& s, cudaStream_t stream) {
  AdamList L{};
  int slots = 0, blocks = 0;
  for (int k = 0; k < count; ++k) {
    const AdamTensor& x = tensors[k];
    if (x.n <= 0) continue;
    if (slots == kMaxTensors) {  // the table is full: launch what it holds, start a fresh one
      adam_kernel<G, O, M, S><<<blocks, kThreads, 0, stream>>>(L, s, adamw);
      slots = blocks = 0;
    }
    L.param[slots] = x.param, L.grad[slots] = x.grad, L.exp_avg[slots] = x.exp_avg;
    L.exp_avg_sq[slots] = x.exp_avg_sq, L.out[slots] = x.out, L.n[slots] = x.n, L.sr_base[slots] = x.sr_base;
    L.aligned[slots] = aligned16(x.param) && aligned16(x.grad) && aligned16(x.exp_avg) && aligned16(x.exp_avg_sq) &&
                       aligned16(x.out);
    const int64_t chunks = (x.n + kChunk - 1) / kChunk;
    for (int64_t ch = 0; ch < chunks; ++ch) {
      if (blocks == kMaxBlocks) {  // the block table is full: launch, keep this tensor's slot for the rest
        adam_kernel<G, O, M, S><<<blocks, kThreads, 0, stream>>>(L, s, adamw);
        L.param[0] = L.param[slots], L.grad[0] = L.grad[slots], L.exp_avg[0] = L.exp_avg[slots];
        L.exp_avg_sq[0] = L.exp_avg_sq[slots], L.out[0] = L.out[slots], L.n[0] = L.n[slots];
        L.sr_base[0] = L.sr_base[slots], L.aligned[0] = L.aligned[slots];
        slots = blocks = 0;
      }
      L.tensor_of[blocks] = static_cast<uint8_t>(slots);
      L.chunk_of[blocks] = static_cast<int32_t>(ch);
      ++blocks;
    }
    ++slots;
  }
  if (blocks) adam_kernel<G, O, M, S><<<blocks, kThreads, 0, stream>>>(L, s, adamw);
  return cudaGetLastError();
}

template <int G, int M, int S>
cudaError_t by_out(int out_dtype, const AdamTensor* t, int count, bool adamw, const AdamScalars& s, cudaStream_t st) {
  switch (out_dtype) {
    case F32: return launch_all<G, F32, M, S>(t, count, adamw, s, st);
    case F16: return launch_all<G, F16, M, S>(t, count, adamw, s, st);
    case BF16: return launch_all<G, BF16, M, S>(t, count, adamw, s, st);
    case NONE: return launch_all<G, NONE, M, S>(t, count, adamw, s, st);
    default: return cudaErrorInvalidValue;
  }
}

template <int G>
cudaError_t by_state(int param_dtype, int state_dtype, int out_dtype, const AdamTensor* t, int count, bool adamw,
                     const AdamScalars& s, cudaStream_t st) {
  if (param_dtype == F32 && state_dtype == F32) return by_out<G, F32, F32>(out_dtype, t, count, adamw, s, st);
  if (param_dtype == F32 && state_dtype == BF16) return by_out<G, F32, BF16>(out_dtype, t, count, adamw, s, st);
  if (param_dtype == BF16 && state_dtype == BF16) return by_out<G, BF16, BF16>(out_dtype, t, count, adamw, s, st);
  if (param_dtype == BF16 && state_dtype == F32) return by_out<G, BF16, F32>(out_dtype, t, count, adamw, s, st);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t adam_step(const AdamTensor* tensors, int count, int grad_dtype, int param_dtype, int state_dtype,
                      int out_dtype, bool adamw, const AdamScalars& s, cudaStream_t stream) {
  for (int k = 0; k < count; ++k)  // the block table indexes chunks with int32
    if (tensors[k].n > static_cast<int64_t>(INT32_MAX) * kChunk) return cudaErrorInvalidValue;
  switch (grad_dtype) {
    case F32: return by_state<F32>(param_dtype, state_dtype, out_dtype, tensors, count, adamw, s, stream);
    case F16: return by_state<F16>(param_dtype, state_dtype, out_dtype, tensors, count, adamw, s, stream);
    case BF16: return by_state<BF16>(param_dtype, state_dtype, out_dtype, tensors, count, adamw, s, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace zk_cuda
