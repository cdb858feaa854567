// zkern/cuda/csrc/bindings.cpp: the CUDA kernels bound to torch tensors (built by zkern/cuda/__init__.py with
// torch.utils.cpp_extension, only where torch has CUDA). The Python side checks dtypes, shapes, devices and
// contiguity and computes the step's scalars; this file passes pointers and the current stream.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <vector>

#include "zk_cuda.h"

namespace {

int code_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return zk_cuda::F32;
    case torch::kFloat16: return zk_cuda::F16;
    case torch::kBFloat16: return zk_cuda::BF16;
    default: TORCH_CHECK(false, "zkern CUDA kernels take float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

void check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "zkern CUDA ", what, ": ", cudaGetErrorString(err));
}

// tensors: lists of equal length (outs may be empty: no copy); every list shares its dtype.
void adam_step(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
               const std::vector<torch::Tensor>& exp_avgs, const std::vector<torch::Tensor>& exp_avg_sqs,
               const std::vector<torch::Tensor>& outs, const std::vector<int64_t>& sr_bases,
               std::vector<double> scalars, bool adamw, bool stochastic, int64_t sr_seed) {
  TORCH_CHECK(!params.empty() && scalars.size() == 9, "adam_step: no tensors, or not 9 scalars");
  const c10::cuda::CUDAGuard guard(params[0].device());
  std::vector<zk_cuda::AdamTensor> list(params.size());
  for (size_t k = 0; k < params.size(); ++k)
    list[k] = {params[k].data_ptr(), grads[k].data_ptr(), exp_avgs[k].data_ptr(), exp_avg_sqs[k].data_ptr(),
               outs.empty() ? nullptr : outs[k].data_ptr(), params[k].numel(), sr_bases[k]};
  // zkern.cuda.adam_scalars' order; each computed in double there, rounded once here
  const auto f = [&](int k) { return static_cast<float>(scalars[k]); };
  const zk_cuda::AdamScalars s{f(0), f(1), f(2), f(3), f(4), f(5), f(6), f(7), f(8), stochastic,
                                static_cast<uint32_t>(sr_seed)};
  check(zk_cuda::adam_step(list.data(), static_cast<int>(list.size()), code_of(grads[0]), code_of(params[0]),
                           code_of(exp_avgs[0]), outs.empty() ? zk_cuda::NONE : code_of(outs[0]), adamw, s,
                           c10::cuda::getCurrentCUDAStream()),
        "adam_step");
}

void quantize(const torch::Tensor& x, int64_t bits, int64_t group, torch::Tensor& codes, torch::Tensor& scales) {
  const c10::cuda::CUDAGuard guard(x.device());
  check(zk_cuda::quantize(x.data_ptr(), code_of(x), x.numel(), static_cast<int>(bits), group,
                          static_cast<uint8_t*>(codes.data_ptr()), scales.data_ptr<float>(),
                          c10::cuda::getCurrentCUDAStream()),
        "quantize");
}

void dequant_sum_requant(const torch::Tensor& q, const torch::Tensor& scales, int64_t in_bits, int64_t group,
                         int64_t n, torch::Tensor& sum, int64_t out_bits, torch::Tensor& codes,
                         torch::Tensor& out_scales) {
  const c10::cuda::CUDAGuard guard(q.device());
  check(zk_cuda::dequant_sum_requant(static_cast<const uint8_t*>(q.data_ptr()), q.stride(0), scales.data_ptr<float>(),
                                     scales.stride(0), static_cast<int>(q.size(0)), static_cast<int>(in_bits), group,
                                     n, sum.data_ptr<float>(), static_cast<int>(out_bits),
                                     out_bits ? static_cast<uint8_t*>(codes.data_ptr()) : nullptr,
                                     out_bits ? out_scales.data_ptr<float>() : nullptr,
                                     c10::cuda::getCurrentCUDAStream()),
        "dequant_sum_requant");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_step", &adam_step, "fused multi-tensor Adam/AdamW (zkern/cuda/csrc/adam.cu)");
  m.def("quantize", &quantize, "blockwise int8/int4 quantization (zkern/cuda/csrc/quant.cu)");
  m.def("dequant_sum_requant", &dequant_sum_requant, "qgZ's hop in one pass (zkern/cuda/csrc/quant.cu)");
}
