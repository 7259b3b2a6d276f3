// The CUDA implementation of torch.ops.fxfuse.mean_of_row_groups(tensor, size): a tensor's rows (dim 0) averaged
// in groups of `size`, a partial group at the end dropped; what a feature pool folded into the GEMM takes of its
// weight and bias at every call.
//
// Reference: fxfuse/library.py::mean_of_row_groups_reference. Kernel: row_group_mean.cu. Autograd: the Python
// registration in fxfuse/library.py (its gradient is ATen ops).
//
// Limits (anything else runs the reference through fxfuse::mean_of_row_groups_fallback, with the reason logged):
// a contiguous fp32, bf16 or fp16 tensor of at least one dim and at least `size` rows (fewer: the reference raises
// eager's pool error), size >= 1; groups of more than 128 rows only where the output fills the GPU
// (launch_row_group_mean, row_group_mean.cu).
//
// Host code only, compiled by the C++ compiler (gemm_epilogue.cpp says why).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "program_format.cuh"

namespace fxfuse {
namespace {

using FallbackFn = at::Tensor(const at::Tensor&, int64_t, c10::string_view);

at::Tensor run_fallback(const at::Tensor& tensor, int64_t size, const std::string& reason) {
  static const auto fallback = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("fxfuse::mean_of_row_groups_fallback", "")
                                   .typed<FallbackFn>();
  return fallback.call(tensor, size, reason);
}

// Why the kernel cannot take this tensor, or "".
std::string check_input(const at::Tensor& tensor, int64_t size) {
  const auto dtype = tensor.scalar_type();
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf)
    return std::string("dtype ") + c10::toString(dtype);
  if (tensor.dim() == 0) return "a 0-d tensor";
  if (size < 1 || tensor.size(0) < size) return "no whole group of rows";
  if (!tensor.is_contiguous()) return "not contiguous";
  return "";
}

at::Tensor mean_of_row_groups_cuda(const at::Tensor& tensor, int64_t size) {
  const std::string reason = check_input(tensor, size);
  if (!reason.empty()) return run_fallback(tensor, size, reason);
  const int64_t groups = tensor.size(0) / size;
  std::vector<int64_t> shape = tensor.sizes().vec();
  shape[0] = groups;
  const c10::cuda::CUDAGuard device_guard(tensor.device());
  at::Tensor out = at::empty(shape, tensor.options());
  if (out.numel() == 0) return out;
  const int64_t columns = out.numel() / groups;
  const bool aligned = reinterpret_cast<uintptr_t>(tensor.data_ptr()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  const RowGroupMean job{tensor.data_ptr(), out.data_ptr(), groups, columns, size,
                         aligned && columns * tensor.element_size() % 16 == 0};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  bool launched = false;
  switch (tensor.scalar_type()) {
    case at::kFloat:
      launched = launch_row_group_mean<Fp32Storage>(job, stream);
      break;
    case at::kBFloat16:
      launched = launch_row_group_mean<Bf16Storage>(job, stream);
      break;
    default:
      launched = launch_row_group_mean<Fp16Storage>(job, stream);
      break;
  }
  if (!launched) return run_fallback(tensor, size, "groups of many rows over too few columns to fill the GPU");
  return out;
}

}  // namespace
}  // namespace fxfuse

TORCH_LIBRARY_IMPL(fxfuse, CUDA, m) { m.impl("mean_of_row_groups", &fxfuse::mean_of_row_groups_cuda); }
