// zkern/cpu/csrc/adam_kernel.h: the fused Adam/AdamW pass, written once over simd.h's Vec and included by
// each ISA translation unit inside its own namespace (ZK_NS). One pass per element touches each byte once:
// read grad (any dtype, upcast here) and param/exp_avg/exp_avg_sq, write param/exp_avg/exp_avg_sq and the
// optional fp16/bf16 copy. The formulas are torch.optim.Adam/AdamW's (single-tensor path); the fused
// multiply-adds and the reciprocal of sqrt(bias_correction2) move results by at most a few units in the
// last place.
#pragma once

#include <omp.h>

#include <algorithm>

#include "adam.h"
#include "simd.h"

namespace ZK_NS {
namespace {

template <int GradDtype>
inline Vec load_grad(const void* g, int64_t i) {
  if constexpr (GradDtype == ZK_F32) return vload(static_cast<const float*>(g) + i);
  else if constexpr (GradDtype == ZK_F16) return vload_f16(static_cast<const uint16_t*>(g) + i);
  else return vload_bf16(static_cast<const uint16_t*>(g) + i);
}

template <int OutDtype, bool Stream>
inline void store_out(void* o, int64_t i, Vec p) {
  if constexpr (Stream) {
    if constexpr (OutDtype == ZK_F32) vstream(static_cast<float*>(o) + i, p);
    else if constexpr (OutDtype == ZK_F16) vstream_f16(static_cast<uint16_t*>(o) + i, p);
    else if constexpr (OutDtype == ZK_BF16) vstream_bf16(static_cast<uint16_t*>(o) + i, p);
  } else {
    if constexpr (OutDtype == ZK_F32) vstore(static_cast<float*>(o) + i, p);
    else if constexpr (OutDtype == ZK_F16) vstore_f16(static_cast<uint16_t*>(o) + i, p);
    else if constexpr (OutDtype == ZK_BF16) vstore_bf16(static_cast<uint16_t*>(o) + i, p);
  }
}

// One vector of W elements at offset i of the given buffers.
template <int GradDtype, int OutDtype, bool AdamW, bool Stream = false>
inline void step_vec(float* param, const void* grad, float* m, float* v, void* out, int64_t i, const AdamArgs& a) {
  Vec g = vmul(load_grad<GradDtype>(grad, i), vset(a.grad_scale));
  Vec p = vload(param + i);
  if constexpr (AdamW) p = vmul(p, vset(a.lr_decay));
  else g = vfma(vset(a.l2), p, g);
  Vec mv = vload(m + i);
  mv = vfma(vset(a.one_minus_beta1), vsub(g, mv), mv);  // lerp(m, g, 1 - beta1), as torch writes it
  Vec vv = vfma(vmul(vset(a.one_minus_beta2), g), g, vmul(vload(v + i), vset(a.beta2)));
  Vec denom = vfma(vsqrt(vv), vset(a.inv_bc2_sqrt), vset(a.eps));
  p = vfma(vset(a.neg_step_size), vdiv(mv, denom), p);
  vstore(m + i, mv);
  vstore(v + i, vv);
  vstore(param + i, p);
  store_out<OutDtype, Stream>(out, i, p);
}

constexpr int elem_size(int dtype) { return dtype == ZK_F32 ? 4 : 2; }

// Software prefetch this many elements (2 KB of fp32) ahead in every input stream. The hardware prefetcher
// alone kept one core at ~24 GB/s over these four streams on a 2-core AVX-512 machine; with this, the
// 50M-parameter step went from ~1,600 to ~1,900 M params/s on two cores (bench/run.py --suite adam).
constexpr int64_t kPrefetchElems = 512;

// The whole vectors of [i, hi); returns where they end.
template <int GradDtype, int OutDtype, bool AdamW, bool Stream>
int64_t run_body(const AdamArgs& a, int64_t i, int64_t hi) {
  constexpr int W = Vec::W;
  for (; i + W <= hi; i += W) {
    __builtin_prefetch(a.param + i + kPrefetchElems);
    __builtin_prefetch(a.exp_avg + i + kPrefetchElems);
    __builtin_prefetch(a.exp_avg_sq + i + kPrefetchElems);
    __builtin_prefetch(static_cast<const char*>(a.grad) + (i + kPrefetchElems) * elem_size(GradDtype));
    step_vec<GradDtype, OutDtype, AdamW, Stream>(a.param, a.grad, a.exp_avg, a.exp_avg_sq, a.out, i, a);
  }
  if constexpr (Stream) vstream_fence();  // order the weakly-ordered stores before the caller reads the copy
  return i;
}

template <int GradDtype, int OutDtype, bool AdamW>
void run_range(const AdamArgs& a, int64_t lo, int64_t hi) {
  constexpr int W = Vec::W;
  // The output copy is write-only: stream it past the cache when its vectors are aligned (torch's buffers
  // are 64-byte aligned and thread ranges start at multiples of 16 elements, so they usually are).
  constexpr int64_t kOutVecBytes = OutDtype == ZK_NONE ? 1 : W * elem_size(OutDtype);
  bool stream = kHasStream && OutDtype != ZK_NONE &&
                (reinterpret_cast<uintptr_t>(a.out) + lo * (OutDtype == ZK_NONE ? 0 : elem_size(OutDtype))) %
                        kOutVecBytes == 0;
  int64_t i = stream ? run_body<GradDtype, OutDtype, AdamW, true>(a, lo, hi)
                     : run_body<GradDtype, OutDtype, AdamW, false>(a, lo, hi);
  if (i == hi) return;
  // The tail (< W elements) goes through the same vector code on zero-padded copies, so its numerics are the
  // body's exactly; zeros are harmless (sqrt(0) + eps > 0).
  int64_t r = hi - i;
  alignas(64) float p[W] = {}, m[W] = {}, v[W] = {};
  alignas(64) unsigned char g[W * 4] = {}, o[W * 4] = {};
  std::memcpy(p, a.param + i, r * 4);
  std::memcpy(m, a.exp_avg + i, r * 4);
  std::memcpy(v, a.exp_avg_sq + i, r * 4);
  std::memcpy(g, static_cast<const unsigned char*>(a.grad) + i * elem_size(GradDtype), r * elem_size(GradDtype));
  step_vec<GradDtype, OutDtype, AdamW>(p, g, m, v, o, 0, a);
  std::memcpy(a.param + i, p, r * 4);
  std::memcpy(a.exp_avg + i, m, r * 4);
  std::memcpy(a.exp_avg_sq + i, v, r * 4);
  if constexpr (OutDtype != ZK_NONE)
    std::memcpy(static_cast<unsigned char*>(a.out) + i * elem_size(OutDtype), o, r * elem_size(OutDtype));
}

template <int GradDtype, int OutDtype, bool AdamW>
void run(const AdamArgs& a) {
  // Each thread takes one contiguous range whose bounds are multiples of 16 elements (64 bytes of fp32), so no
  // two threads write the same cache line of param, exp_avg or exp_avg_sq.
  constexpr int64_t kAlign = 16, kMinPerThread = 1 << 15;
  int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(a.threads, a.n / kMinPerThread)));
  if (threads == 1) {
    run_range<GradDtype, OutDtype, AdamW>(a, 0, a.n);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t per = (a.n + nt - 1) / nt;
    per = (per + kAlign - 1) / kAlign * kAlign;
    int64_t lo = std::min<int64_t>(a.n, per * t), hi = std::min<int64_t>(a.n, lo + per);
    if (lo < hi) run_range<GradDtype, OutDtype, AdamW>(a, lo, hi);
  }
}

template <int GradDtype, bool AdamW>
void by_out(const AdamArgs& a) {
  switch (a.out_dtype) {
    case ZK_F32: return run<GradDtype, ZK_F32, AdamW>(a);
    case ZK_F16: return run<GradDtype, ZK_F16, AdamW>(a);
    case ZK_BF16: return run<GradDtype, ZK_BF16, AdamW>(a);
    default: return run<GradDtype, ZK_NONE, AdamW>(a);
  }
}

template <bool AdamW>
void by_grad(const AdamArgs& a) {
  switch (a.grad_dtype) {
    case ZK_F16: return by_out<ZK_F16, AdamW>(a);
    case ZK_BF16: return by_out<ZK_BF16, AdamW>(a);
    default: return by_out<ZK_F32, AdamW>(a);
  }
}

}  // namespace

void adam_step(const AdamArgs& a) {
  if (a.l2 == 0.0f) by_grad<true>(a);  // AdamW, or Adam without weight decay (lr_decay is then 1)
  else by_grad<false>(a);
}

}  // namespace ZK_NS
