// zkern/cpu/csrc/module.cpp: the pybind11 module zkern.cpu._adam_ext. Not linked against libtorch: the Python
// side (zkern/cpu/_ext.py) checks tensors and passes data pointers, sizes and dtype codes. This file is
// compiled with no ISA flags and picks a kernel at run time with __builtin_cpu_supports.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstring>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam.h"
#include "aio.h"
#include "shared_host.h"

namespace py = pybind11;

namespace {

bool cpu_supports(const std::string& isa) {
#if ZK_HAVE_X86_KERNELS
  __builtin_cpu_init();
  if (isa == "avx512") return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  if (isa == "avx2")
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  if (isa == "avx512" || isa == "avx2") return false;  // not compiled off x86-64
#endif
  if (isa == "scalar") return true;
  throw std::invalid_argument("unknown ISA '" + isa + "': expected avx512, avx2 or scalar");
}

using Kernel = void (*)(const AdamArgs&);

Kernel kernel_for(const std::string& isa) {
  if (!cpu_supports(isa)) throw std::invalid_argument("this CPU does not support the " + isa + " path");
#if ZK_HAVE_X86_KERNELS
  if (isa == "avx512") return zk_avx512::adam_step;
  if (isa == "avx2") return zk_avx2::adam_step;
#endif
  return zk_scalar::adam_step;
}

void adam_step(const std::string& isa, uintptr_t param, int param_dtype, uintptr_t grad, int grad_dtype,
               uintptr_t exp_avg, uintptr_t exp_avg_sq, int state_dtype, uintptr_t out, int out_dtype, int64_t n,
               int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
               double grad_scale, bool stochastic, uint32_t sr_seed, int64_t sr_base, int threads,
               uintptr_t save_param, uintptr_t save_exp_avg, uintptr_t save_exp_avg_sq) {
  // "shared": the CUDA kernel's per-element code (zkern/csrc/zk_adam.h) on the host, for the tests.
  Kernel kernel = isa == "shared" ? nullptr : kernel_for(isa);
  if (step < 1) throw std::invalid_argument("step counts from 1");
  for (int dtype : {param_dtype, state_dtype})
    if (dtype != ZK_F32 && dtype != ZK_BF16)
      throw std::invalid_argument("the master and the moments are float32 or bfloat16");
  AdamArgs a{};
  a.param = reinterpret_cast<void*>(param);
  a.param_dtype = param_dtype;
  a.grad = reinterpret_cast<const void*>(grad);
  a.grad_dtype = grad_dtype;
  a.exp_avg = reinterpret_cast<void*>(exp_avg);
  a.exp_avg_sq = reinterpret_cast<void*>(exp_avg_sq);
  a.state_dtype = state_dtype;
  a.stochastic = stochastic;
  a.sr_seed = sr_seed;
  a.sr_base = sr_base;
  a.out = out ? reinterpret_cast<void*>(out) : nullptr;
  a.out_dtype = out ? out_dtype : ZK_NONE;
  a.n = n;
  // Scalars in double, rounded once to fp32, as torch's tensor ops receive them.
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.lr_decay = static_cast<float>(adamw ? 1.0 - lr * weight_decay : 1.0);
  a.l2 = static_cast<float>(adamw ? 0.0 : weight_decay);
  a.neg_step_size = static_cast<float>(-lr / (1.0 - std::pow(beta1, static_cast<double>(step))));
  a.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  a.eps = static_cast<float>(eps);
  a.grad_scale = static_cast<float>(grad_scale);
  a.threads = threads < 1 ? 1 : threads;
  if ((save_param == 0) != (save_exp_avg == 0) || (save_param == 0) != (save_exp_avg_sq == 0))
    throw std::invalid_argument("the saved master and moments go together: give all three buffers or none");
  a.save_param = reinterpret_cast<void*>(save_param);
  a.save_exp_avg = reinterpret_cast<void*>(save_exp_avg);
  a.save_exp_avg_sq = reinterpret_cast<void*>(save_exp_avg_sq);
  if (n > 0) {
    py::gil_scoped_release release;
    if (kernel) {
      kernel(a);
    } else {  // the per-element code has no save: copy the values before the step first
      if (a.save_param) {
        const int64_t ps = param_dtype == ZK_F32 ? 4 : 2, ss = state_dtype == ZK_F32 ? 4 : 2;
        std::memcpy(a.save_param, a.param, n * ps);
        std::memcpy(a.save_exp_avg, a.exp_avg, n * ss);
        std::memcpy(a.save_exp_avg_sq, a.exp_avg_sq, n * ss);
      }
      zk_adam_host::adam_step(a, a.l2 == 0.0f);  // AdamW, or Adam without weight decay, as the kernels decide
    }
  }
}

}  // namespace

PYBIND11_MODULE(_adam_ext, m) {
  m.doc() = "zkern's fused CPU Adam (AVX-512 / AVX2 / scalar, OpenMP); called through zkern.cpu";
  m.def("compiled_isas", [] {
#if ZK_HAVE_X86_KERNELS
    return std::vector<std::string>{"avx512", "avx2", "scalar"};
#else
    return std::vector<std::string>{"scalar"};
#endif
  },
        "the ISA paths in this build, fastest first");
  m.def("cpu_supports", &cpu_supports, py::arg("isa"), "whether this CPU can run the given path");
  m.def("adam_step", &adam_step, "one fused Adam/AdamW step over raw buffers (see zkern/cpu/_ext.py)",
        py::arg("isa"), py::arg("param"), py::arg("param_dtype"), py::arg("grad"), py::arg("grad_dtype"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("state_dtype"), py::arg("out"), py::arg("out_dtype"),
        py::arg("n"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("adamw"), py::arg("grad_scale"), py::arg("stochastic"), py::arg("sr_seed"),
        py::arg("sr_base"), py::arg("threads"), py::arg("save_param") = 0, py::arg("save_exp_avg") = 0,
        py::arg("save_exp_avg_sq") = 0);
  // ZeRO++'s quantization over zkern/csrc/zk_quant.h, the CUDA kernels' per-element rules (see shared_host.h).
  m.def(
      "quantize",
      [](uintptr_t x, int x_dtype, int64_t n, int bits, int64_t group, uintptr_t codes, uintptr_t scales) {
        py::gil_scoped_release release;
        zk_quant_host::quantize(reinterpret_cast<const void*>(x), x_dtype, n, bits, group,
                                reinterpret_cast<uint8_t*>(codes), reinterpret_cast<float*>(scales));
      },
      "blockwise symmetric quantization over raw buffers (see zkern/cpu/_ext.py)", py::arg("x"), py::arg("x_dtype"),
      py::arg("n"), py::arg("bits"), py::arg("group"), py::arg("codes"), py::arg("scales"));
  m.def(
      "dequant_sum_requant",
      [](uintptr_t q, uintptr_t scales, int world, int64_t codes_per_chunk, int64_t groups_per_chunk, int in_bits,
         int64_t group, int64_t n, uintptr_t sum, int out_bits, uintptr_t codes, uintptr_t out_scales) {
        py::gil_scoped_release release;
        zk_quant_host::dequant_sum_requant(reinterpret_cast<const uint8_t*>(q), reinterpret_cast<const float*>(scales),
                                           world, codes_per_chunk, groups_per_chunk, in_bits, group, n,
                                           reinterpret_cast<float*>(sum), out_bits,
                                           reinterpret_cast<uint8_t*>(codes), reinterpret_cast<float*>(out_scales));
      },
      "qgZ's hop: dequantize, sum over ranks, requantize, over raw buffers (see zkern/cpu/_ext.py)", py::arg("q"),
      py::arg("scales"), py::arg("world"), py::arg("codes_per_chunk"), py::arg("groups_per_chunk"),
      py::arg("in_bits"), py::arg("group"), py::arg("n"), py::arg("sum"), py::arg("out_bits"), py::arg("codes"),
      py::arg("out_scales"));
  // The NVMe path's I/O pool (aio.h). submit and wait release the GIL: the Python side overlaps reads and
  // writes with the CPU Adam, which releases it too.
  py::class_<zk_aio::Pool>(m, "AioPool", "a pool of I/O threads over pread/pwrite (see zkern/cpu/aio.py)")
      .def(py::init<int, int64_t, int>(), py::arg("threads"), py::arg("block_size"), py::arg("queue_depth"))
      .def("submit", &zk_aio::Pool::submit, py::call_guard<py::gil_scoped_release>(), py::arg("write"),
           py::arg("fd"), py::arg("ptr"), py::arg("nbytes"), py::arg("offset"))
      .def("done", &zk_aio::Pool::done, py::arg("ticket"))
      .def(
          "wait",
          [](zk_aio::Pool& pool, int64_t ticket) {
            zk_aio::Outcome outcome;
            {
              py::gil_scoped_release release;
              outcome = pool.wait(ticket);
            }
            return py::make_tuple(outcome.err, outcome.offset);
          },
          py::arg("ticket"), "(errno or -1 for an unexpected end of file or 0, byte offset of the failure)")
      .def_property_readonly("threads", &zk_aio::Pool::threads)
      .def_property_readonly("block_size", &zk_aio::Pool::block_size);
}
