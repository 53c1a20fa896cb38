// The torch operator over int4_mma.cu's launcher: torch.ops.lmforge_cuda.int4_mma, which
// writes `out` (lmforge/generate/kernels/int4_mma.py checks shapes and picks the config).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <stdexcept>
#include <string>

const char* lmforge_int4_mma(int config, const void* x, const int32_t* q, const int32_t* sz,
                             void* out, float* workspace, int* counters, int M, int N, int K,
                             int group, int splits, void* cuda_stream);

namespace {

void int4_mma(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sz, at::Tensor& out,
              at::Tensor& workspace, at::Tensor& counters, int64_t group, int64_t splits,
              int64_t config, int64_t stream) {
  const char* error = lmforge_int4_mma(
      static_cast<int>(config), x.data_ptr(), q.data_ptr<int32_t>(), sz.data_ptr<int32_t>(),
      out.data_ptr(), workspace.data_ptr<float>(), counters.data_ptr<int32_t>(),
      static_cast<int>(x.size(0)), static_cast<int>(out.size(1)), static_cast<int>(x.size(1)),
      static_cast<int>(group), static_cast<int>(splits), reinterpret_cast<void*>(stream));
  // (a std::runtime_error reaches Python as a RuntimeError)
  if (error != nullptr) throw std::runtime_error(std::string("lmforge int4_mma: ") + error);
}

}  // namespace

TORCH_LIBRARY(lmforge_cuda, m) {
  m.def(
      "int4_mma(Tensor x, Tensor q, Tensor sz, Tensor(a!) out, Tensor(b!) workspace, "
      "Tensor(c!) counters, int group, int splits, int config, int stream) -> ()");
}

TORCH_LIBRARY_IMPL(lmforge_cuda, CUDA, m) { m.impl("int4_mma", &int4_mma); }
