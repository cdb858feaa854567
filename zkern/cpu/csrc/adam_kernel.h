// zkern/cpu/csrc/adam_kernel.h: the fused Adam/AdamW pass, written once over simd.h's Vec and included by
// each ISA translation unit inside its own namespace (ZK_NS). One pass per element touches each byte once:
// read grad (any dtype, upcast here) and param/exp_avg/exp_avg_sq (fp32, or bf16 where the config keeps them
// so), write param/exp_avg/exp_avg_sq and the optional fp16/bf16 copy. The formulas are torch.optim.Adam/AdamW's (single-tensor path); the fused
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

// Exact: p is a bf16 value already (a bf16 master), so a bf16 copy is its top half, with no rounding to do.
template <int OutDtype, bool Stream, bool Exact = false>
inline void store_out(void* o, int64_t i, Vec p) {
  auto* half = static_cast<uint16_t*>(o) + i;
  if constexpr (Stream) {
    if constexpr (OutDtype == ZK_F32) vstream(static_cast<float*>(o) + i, p);
    else if constexpr (OutDtype == ZK_F16) vstream_f16(half, p);
    else if constexpr (OutDtype == ZK_BF16 && Exact) vstream_bf16_exact(half, p);
    else if constexpr (OutDtype == ZK_BF16) vstream_bf16(half, p);
  } else {
    if constexpr (OutDtype == ZK_F32) vstore(static_cast<float*>(o) + i, p);
    else if constexpr (OutDtype == ZK_F16) vstore_f16(half, p);
    else if constexpr (OutDtype == ZK_BF16 && Exact) vstore_bf16_exact(half, p);
    else if constexpr (OutDtype == ZK_BF16) vstore_bf16(half, p);
  }
}

// The optimizer's own state (master, exp_avg, exp_avg_sq) is fp32 or bf16 (bf16_master_weights_and_grads,
// bf16_optimizer_states): loaded exactly, computed in fp32, stored rounded (nearest even, or stochastic).
template <int Dtype>
inline Vec load_state(const void* s, int64_t i) {
  if constexpr (Dtype == ZK_F32) return vload(static_cast<const float*>(s) + i);
  else return vload_bf16(static_cast<const uint16_t*>(s) + i);
}

// x as the state stores it: unchanged in fp32; in bf16 rounded by the call's mode (r: the random bits).
template <int Dtype>
inline Vec round_state(Vec x, bool stochastic, VecI r) {
  if constexpr (Dtype == ZK_F32) return x;
  else return stochastic ? vround_bf16_sr(x, r) : vround_bf16(x);
}

// Stores a value round_state already rounded: exact in either dtype (bf16: its top half).
template <int Dtype>
inline void store_state(void* s, int64_t i, Vec x) {
  if constexpr (Dtype == ZK_F32) vstore(static_cast<float*>(s) + i, x);
  else vstore_bf16_exact(static_cast<uint16_t*>(s) + i, x);
}

// The call's scalars as vectors, made once per range and held in registers across the loop.
struct Coeffs {
  zk_math::AdamCoeffs<Vec> k;
  bool stochastic;
  uint32_t sr_seed;
  int64_t sr_base;
};

inline Coeffs coeffs_of(const AdamArgs& a) {
  return {{vset(a.grad_scale), vset(a.lr_decay), vset(a.l2), vset(a.one_minus_beta1), vset(a.one_minus_beta2),
           vset(a.beta2), vset(a.inv_bc2_sqrt), vset(a.eps), vset(a.neg_step_size)},
          a.stochastic, a.sr_seed, a.sr_base};
}

// A moment's store: nothing reads the rounded value back in this step, so rounding to nearest is the fused
// rounding store (one pass fewer than rounding, then storing the top half).
template <int Dtype>
inline void store_moment(void* s, int64_t i, Vec x, bool stochastic, VecI r) {
  if constexpr (Dtype == ZK_F32) vstore(static_cast<float*>(s) + i, x);
  else if (stochastic) vstore_bf16_exact(static_cast<uint16_t*>(s) + i, vround_bf16_sr(x, r));
  else vstore_bf16(static_cast<uint16_t*>(s) + i, x);
}

// One vector of W elements at offset i of the given buffers; `at` is the first element's index in the call
// (with sr_base: the index the stochastic rounding hashes, so it does not depend on how a range is split).
// save (optional, with sp/sm/sv): the loaded master and moments are stored there first, exactly.
template <int GradDtype, int OutDtype, bool AdamW, int MasterDtype, int StateDtype, bool Stream = false>
inline void step_vec(void* param, const void* grad, void* m, void* v, void* out, int64_t i, int64_t at,
                     const Coeffs& c, bool save = false, void* sp = nullptr, void* sm = nullptr,
                     void* sv = nullptr) {
  Vec p = load_state<MasterDtype>(param, i);
  Vec mv = load_state<StateDtype>(m, i);
  Vec vv = load_state<StateDtype>(v, i);
  if (save) {
    store_state<MasterDtype>(sp, i, p);
    store_state<StateDtype>(sm, i, mv);
    store_state<StateDtype>(sv, i, vv);
  }
  // zkern/csrc/zk_math.h, the CUDA kernel's arithmetic too; the moments are stored rounded after it.
  zk_math::adam_update<AdamW>(load_grad<GradDtype>(grad, i), p, mv, vv, c.k);
  // Stochastic rounding's bits: one hash gives exp_avg and exp_avg_sq 16 each; a bf16 master takes a second.
  constexpr bool kAnyBf16 = MasterDtype == ZK_BF16 || StateDtype == ZK_BF16;
  VecI r1{}, r2{};
  if (kAnyBf16 && c.stochastic) {
    r1 = vhash(c.sr_seed, static_cast<uint32_t>(c.sr_base + at));
    if constexpr (MasterDtype == ZK_BF16) r2 = vrehash(r1);
  }
  p = round_state<MasterDtype>(p, c.stochastic, vlow16(r2));
  store_moment<StateDtype>(m, i, mv, c.stochastic, vlow16(r1));
  store_moment<StateDtype>(v, i, vv, c.stochastic, vhigh16(r1));
  store_state<MasterDtype>(param, i, p);
  store_out<OutDtype, Stream, MasterDtype == ZK_BF16>(out, i, p);  // the stored master's value, in the copy's dtype
}

constexpr int elem_size(int dtype) { return dtype == ZK_F32 ? 4 : 2; }

// Software prefetch this many elements (2 KB of fp32) ahead in every input stream. The hardware prefetcher
// alone kept one core at ~24 GB/s over these four streams on a 2-core AVX-512 machine; with this, the
// 50M-parameter step went from ~1,600 to ~1,900 M params/s on two cores (bench/run.py --suite adam).
constexpr int64_t kPrefetchElems = 512;

// The whole vectors of [i, hi); returns where they end.
template <int GradDtype, int OutDtype, bool AdamW, int MasterDtype, int StateDtype, bool Stream>
int64_t run_body(const AdamArgs& args, int64_t i, int64_t hi) {
  constexpr int W = Vec::W;
  // Locals, not the caller's struct: the intrinsics' integer stores may alias anything, so read through a reference
  // every pointer and scalar would be reloaded after each store (the AVX2 bf16-state loop ran ~1.1x slower so).
  const Coeffs c = coeffs_of(args);
  void* const param = args.param;
  void* const m = args.exp_avg;
  void* const v = args.exp_avg_sq;
  void* const out = args.out;
  const void* const grad = args.grad;
  void* const sp = args.save_param;
  void* const sm = args.save_exp_avg;
  void* const sv = args.save_exp_avg_sq;
  const bool save = sp != nullptr;
  for (; i + W <= hi; i += W) {
    __builtin_prefetch(static_cast<const char*>(param) + (i + kPrefetchElems) * elem_size(MasterDtype));
    __builtin_prefetch(static_cast<const char*>(m) + (i + kPrefetchElems) * elem_size(StateDtype));
    __builtin_prefetch(static_cast<const char*>(v) + (i + kPrefetchElems) * elem_size(StateDtype));
    __builtin_prefetch(static_cast<const char*>(grad) + (i + kPrefetchElems) * elem_size(GradDtype));
    step_vec<GradDtype, OutDtype, AdamW, MasterDtype, StateDtype, Stream>(param, grad, m, v, out, i, i, c, save, sp,
                                                                         sm, sv);
  }
  if constexpr (Stream) vstream_fence();  // order the weakly-ordered stores before the caller reads the copy
  return i;
}

template <int GradDtype, int OutDtype, bool AdamW, int MasterDtype, int StateDtype>
void run_range(const AdamArgs& a, int64_t lo, int64_t hi) {
  constexpr int W = Vec::W;
  // The output copy is write-only: stream it past the cache when its vectors are aligned (torch's buffers
  // are 64-byte aligned and thread ranges start at multiples of 16 elements, so they usually are).
  constexpr int64_t kOutVecBytes = OutDtype == ZK_NONE ? 1 : W * elem_size(OutDtype);
  bool stream = kHasStream && OutDtype != ZK_NONE &&
                (reinterpret_cast<uintptr_t>(a.out) + lo * (OutDtype == ZK_NONE ? 0 : elem_size(OutDtype))) %
                        kOutVecBytes == 0;
  int64_t i = stream ? run_body<GradDtype, OutDtype, AdamW, MasterDtype, StateDtype, true>(a, lo, hi)
                     : run_body<GradDtype, OutDtype, AdamW, MasterDtype, StateDtype, false>(a, lo, hi);
  if (i == hi) return;
  // The tail (< W elements) goes through the same vector code on zero-padded copies, so its numerics are the
  // body's exactly; zeros are harmless (sqrt(0) + eps > 0).
  int64_t r = hi - i;
  constexpr int64_t ps = elem_size(MasterDtype), ss = elem_size(StateDtype);
  alignas(64) unsigned char p[W * 4] = {}, m[W * 4] = {}, v[W * 4] = {}, g[W * 4] = {}, o[W * 4] = {};
  std::memcpy(p, static_cast<const unsigned char*>(a.param) + i * ps, r * ps);
  std::memcpy(m, static_cast<const unsigned char*>(a.exp_avg) + i * ss, r * ss);
  std::memcpy(v, static_cast<const unsigned char*>(a.exp_avg_sq) + i * ss, r * ss);
  std::memcpy(g, static_cast<const unsigned char*>(a.grad) + i * elem_size(GradDtype), r * elem_size(GradDtype));
  if (a.save_param != nullptr) {  // the values before the step, as the body saves them
    std::memcpy(static_cast<unsigned char*>(a.save_param) + i * ps, p, r * ps);
    std::memcpy(static_cast<unsigned char*>(a.save_exp_avg) + i * ss, m, r * ss);
    std::memcpy(static_cast<unsigned char*>(a.save_exp_avg_sq) + i * ss, v, r * ss);
  }
  step_vec<GradDtype, OutDtype, AdamW, MasterDtype, StateDtype>(p, g, m, v, o, 0, i, coeffs_of(a));
  std::memcpy(static_cast<unsigned char*>(a.param) + i * ps, p, r * ps);
  std::memcpy(static_cast<unsigned char*>(a.exp_avg) + i * ss, m, r * ss);
  std::memcpy(static_cast<unsigned char*>(a.exp_avg_sq) + i * ss, v, r * ss);
  if constexpr (OutDtype != ZK_NONE)
    std::memcpy(static_cast<unsigned char*>(a.out) + i * elem_size(OutDtype), o, r * elem_size(OutDtype));
}

template <int GradDtype, int OutDtype, bool AdamW, int MasterDtype, int StateDtype>
void run(const AdamArgs& a) {
  // Each thread takes one contiguous range whose bounds are multiples of 16 elements (64 bytes of fp32), so no
  // two threads write the same cache line of param, exp_avg or exp_avg_sq.
  constexpr int64_t kAlign = 16, kMinPerThread = 1 << 15;
  int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(a.threads, a.n / kMinPerThread)));
  if (threads == 1) {
    run_range<GradDtype, OutDtype, AdamW, MasterDtype, StateDtype>(a, 0, a.n);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t per = (a.n + nt - 1) / nt;
    per = (per + kAlign - 1) / kAlign * kAlign;
    int64_t lo = std::min<int64_t>(a.n, per * t), hi = std::min<int64_t>(a.n, lo + per);
    if (lo < hi) run_range<GradDtype, OutDtype, AdamW, MasterDtype, StateDtype>(a, lo, hi);
  }
}

template <int GradDtype, bool AdamW, int MasterDtype, int StateDtype>
void by_out(const AdamArgs& a) {
  switch (a.out_dtype) {
    case ZK_F32: return run<GradDtype, ZK_F32, AdamW, MasterDtype, StateDtype>(a);
    case ZK_F16: return run<GradDtype, ZK_F16, AdamW, MasterDtype, StateDtype>(a);
    case ZK_BF16: return run<GradDtype, ZK_BF16, AdamW, MasterDtype, StateDtype>(a);
    default: return run<GradDtype, ZK_NONE, AdamW, MasterDtype, StateDtype>(a);
  }
}

template <bool AdamW, int MasterDtype, int StateDtype>
void by_grad(const AdamArgs& a) {
  switch (a.grad_dtype) {
    case ZK_F16: return by_out<ZK_F16, AdamW, MasterDtype, StateDtype>(a);
    case ZK_BF16: return by_out<ZK_BF16, AdamW, MasterDtype, StateDtype>(a);
    default: return by_out<ZK_F32, AdamW, MasterDtype, StateDtype>(a);
  }
}

template <bool AdamW>
void by_state(const AdamArgs& a) {
  bool bf16_master = a.param_dtype == ZK_BF16, bf16_states = a.state_dtype == ZK_BF16;
  if (bf16_master && bf16_states) return by_grad<AdamW, ZK_BF16, ZK_BF16>(a);
  if (bf16_master) return by_grad<AdamW, ZK_BF16, ZK_F32>(a);
  if (bf16_states) return by_grad<AdamW, ZK_F32, ZK_BF16>(a);
  return by_grad<AdamW, ZK_F32, ZK_F32>(a);
}

}  // namespace

void adam_step(const AdamArgs& a) {
  if (a.l2 == 0.0f) by_state<true>(a);  // AdamW, or Adam without weight decay (lr_decay is then 1)
  else by_state<false>(a);
}

}  // namespace ZK_NS
