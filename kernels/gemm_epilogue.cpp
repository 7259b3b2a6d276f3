// The CUDA implementation of torch.ops.fxfuse.gemm_epilogue(x, weight, bias, params, program), and of
// gemm_epilogue_train (the same, returning y beside the result for the backward).
//
//   y = linear(x, weight, bias); then each instruction of `program` (fxfuse/program.py) in order.
//   Reference: fxfuse/program.py::run_reference (fxfuse/library.py::run_reference_train), op by op
//   fxfuse/epilogue.py.
//
// Strategy: the GEMM runs through cuBLASLt with its bias epilogue on x viewed as [M, K] (torch's TF32 flags, as
// eager; at::linear where cuBLASLt does not take the problem), then ONE launch of the epilogue interpreter
// (interpreter.cuh) reads y once and writes it once, in place (gemm_epilogue_train: into a tensor of its own, as
// y is returned too). The program text is parsed once per distinct string and cached; each call binds it to the
// shapes at hand (a few hundred host instructions; program_binding.cuh, shared with the backward,
// epilogue_backward.cpp) into a compact instruction array that the kernel receives by value. A program whose
// value outgrows the rows by broadcasting (row min + a (1, N, 1, 1) bias gives (1, N, M, 1)) runs its row
// phase, then a second launch for its pointwise tail.
//
// Host code only, so a .cpp for the C++ compiler: as a .cu, nvcc's device passes parsed torch's headers once per
// arch for no device code (98 s of compile on a 2-core machine, 22 s as a .cpp). The kernels' launchers are in
// the .cu files, declared in program_format.cuh.
//
// Limits (anything else runs the reference through fxfuse::gemm_epilogue_fallback, or gemm_epilogue_train_fallback,
// with the reason logged):
// fp32 / bf16 / fp16, every tensor of one dtype, contiguous weight and bias (an x of other strides, such as x.t(),
// is copied to rows first), on one CUDA device; M >= 1;
// N <= 16384; norms and reductions over the last dim of a full row (group_norm and batch_norm of a 2-D x only);
// group sizes off the lanes' power-of-2 grid need N <= 12288 (a row in 48 KB of shared memory); at most 16
// instructions, 8 param uses, 2 live extra values; every instruction reads a value (`mul($0,2.0)` runs before the op:
// program.py's hoist_param_steps); no NaN among a pointwise op's numbers (a clamp bound of None is NaN to the
// functors); prelu's slopes a param, one or one per channel (dim 1: per row of a (1, T, N) output, not of a (B, T, N)
// one); a broadcast tail of pointwise ops only, reading the row phase's last value, at most 3 params, 4 merged dims,
// 1 to 2^31 outputs.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>
#if __has_include(<cublasLt.h>)  // the GEMM below runs through cuBLASLt where the toolkit has cuBLAS's headers
#include <cublasLt.h>
#endif

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "program_binding.cuh"

namespace fxfuse {
namespace {

// ================================================================ the GEMM

// y = x @ weight^T + bias, [M, K] x [N, K] -> [M, N], through cuBLASLt with its bias epilogue: the algorithm its
// heuristic ranks first when offered a 32 MB workspace. For 1024 x 8192 -> 8192 in fp32 IEEE that is a 64x256
// SIMT kernel, 0.5-0.7% faster than the 128x128 one F.linear launches (2.702 against 2.715 ms); tf32 and bf16
// get F.linear's kernel (dev/cublaslt_probe.py). Precision: TF32 only where torch allows it for cuBLAS, as eager;
// 16-bit products accumulate, and split-K partials are reduced, in fp32 whatever torch's reduced-precision flags
// allow. Returns an undefined tensor where cuBLASLt does not take the problem (or a bias is not 16-byte aligned:
// cuBLASLt has no alignment hint for it); the caller then runs at::linear. A toolkit without cuBLAS's headers (the CI
// machines' compile check) builds at::linear alone.
#if __has_include(<cublasLt.h>)
struct LtProblem {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t weight = nullptr, x = nullptr, y = nullptr;

  ~LtProblem() {
    if (y) cublasLtMatrixLayoutDestroy(y);
    if (x) cublasLtMatrixLayoutDestroy(x);
    if (weight) cublasLtMatrixLayoutDestroy(weight);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

struct LtChoice {
  bool found;
  cublasLtMatmulAlgo_t algo;
  size_t workspace_bytes;
};

constexpr size_t kLtWorkspaceOffered = 32u << 20;

// One cuBLASLt handle per device, made on first use (a handle belongs to the device current when it is made).
cublasLtHandle_t lt_handle(int device) {
  static std::mutex mutex;
  static std::map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(mutex);
  auto known = handles.find(device);
  if (known == handles.end()) {
    cublasLtHandle_t handle = nullptr;
    if (cublasLtCreate(&handle) != CUBLAS_STATUS_SUCCESS) handle = nullptr;
    known = handles.emplace(device, handle).first;
  }
  return known->second;
}

// The largest power of 2 up to 256 that divides a pointer (what the heuristic must assume of the operands).
uint32_t alignment_of(const void* pointer) {
  uint32_t alignment = 256;
  while (reinterpret_cast<uintptr_t>(pointer) % alignment != 0) alignment /= 2;
  return alignment;
}

bool describe(LtProblem& p, const at::Tensor& x, const at::Tensor& weight, const void* bias, bool tf32) {
  const cudaDataType_t type = x.scalar_type() == at::kFloat      ? CUDA_R_32F
                              : x.scalar_type() == at::kBFloat16 ? CUDA_R_16BF
                                                                 : CUDA_R_16F;
  const cublasComputeType_t compute = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  // Column-major, as cuBLAS sees row-major tensors: y^T [n, m] = weight^T' [n, k] x^T [k, m], bias along n.
  const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
  const cublasLtEpilogue_t epilogue = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  return cublasLtMatmulDescCreate(&p.desc, compute, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)) ==
             CUBLAS_STATUS_SUCCESS &&
         cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof(none)) ==
             CUBLAS_STATUS_SUCCESS &&
         cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)) ==
             CUBLAS_STATUS_SUCCESS &&
         (!bias || cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                  sizeof(bias)) == CUBLAS_STATUS_SUCCESS) &&
         cublasLtMatrixLayoutCreate(&p.weight, type, k, n, k) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatrixLayoutCreate(&p.x, type, k, m, k) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatrixLayoutCreate(&p.y, type, n, m, n) == CUBLAS_STATUS_SUCCESS;
}

// The heuristic's first algorithm for this problem, asked once per shape, dtype, precision and alignment. A process
// that meets ever new batch sizes (a server) forgets them all after kLtChoicesKept, rather than growing without end.
constexpr size_t kLtChoicesKept = 4096;

LtChoice choose_algorithm(const LtProblem& p, const at::Tensor& x, const at::Tensor& weight, bool has_bias, bool tf32,
                          const at::Tensor& y, cublasLtHandle_t handle) {
  static std::mutex mutex;
  static std::map<std::vector<int64_t>, LtChoice> choices;
  const std::vector<int64_t> key{x.size(0), x.size(1), weight.size(0), static_cast<int64_t>(x.scalar_type()),
                                 tf32, has_bias, x.device().index(), alignment_of(weight.data_ptr()),
                                 alignment_of(x.data_ptr()), alignment_of(y.data_ptr())};
  std::lock_guard<std::mutex> lock(mutex);
  const auto known = choices.find(key);
  if (known != choices.end()) return known->second;

  LtChoice choice{false, {}, 0};
  cublasLtMatmulPreference_t preference = nullptr;
  if (cublasLtMatmulPreferenceCreate(&preference) == CUBLAS_STATUS_SUCCESS) {
    size_t workspace = kLtWorkspaceOffered;
    const uint32_t reduce_in_fp32 = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | CUBLASLT_REDUCTION_SCHEME_NONE;
    const uint32_t alignments[] = {static_cast<uint32_t>(key[7]), static_cast<uint32_t>(key[8]),
                                   static_cast<uint32_t>(key[9]), static_cast<uint32_t>(key[9])};  // D is C: y
    const cublasLtMatmulPreferenceAttributes_t alignment_attributes[] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES};
    bool ready = cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &workspace, sizeof(workspace)) == CUBLAS_STATUS_SUCCESS;
    if (x.scalar_type() != at::kFloat)
      ready = ready && cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                            &reduce_in_fp32, sizeof(reduce_in_fp32)) ==
                           CUBLAS_STATUS_SUCCESS;
    for (int i = 0; i < 4; ++i)
      ready = ready && cublasLtMatmulPreferenceSetAttribute(preference, alignment_attributes[i], &alignments[i],
                                                            sizeof(alignments[i])) == CUBLAS_STATUS_SUCCESS;
    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    if (ready && cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.weight, p.x, p.y, p.y, preference, 1, &result,
                                                &returned) == CUBLAS_STATUS_SUCCESS &&
        returned > 0 && result.state == CUBLAS_STATUS_SUCCESS)
      choice = {true, result.algo, result.workspaceSize};
    cublasLtMatmulPreferenceDestroy(preference);
  }
  if (choices.size() >= kLtChoicesKept) choices.clear();
  choices.emplace(key, choice);
  return choice;
}

at::Tensor lt_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  constexpr int64_t kLargest = 65535 * 32;  // ATen's bounds for its own cuBLASLt path, sizes of 1 excluded
  if (m <= 1 || k <= 1 || n <= 1 || m >= kLargest || k >= kLargest || n >= kLargest) return at::Tensor();
  const void* bias_pointer = bias.has_value() ? bias->data_ptr() : nullptr;
  if (bias_pointer && alignment_of(bias_pointer) < 16) return at::Tensor();
  // Only fp32 asks torch's TF32 flag: its accessor raises where old and new settings disagree, as eager's fp32
  // matmul does, and eager's 16-bit linear never asks it.
  const bool tf32 = x.scalar_type() == at::kFloat && at::globalContext().allowTF32CuBLAS();
  LtProblem problem;
  if (!describe(problem, x, weight, bias_pointer, tf32)) return at::Tensor();
  const cublasLtHandle_t handle = lt_handle(x.device().index());
  if (!handle) return at::Tensor();
  at::Tensor y = at::empty({m, n}, x.options());
  const LtChoice choice = choose_algorithm(problem, x, weight, bias_pointer != nullptr, tf32, y, handle);
  if (!choice.found) return at::Tensor();
  at::Tensor workspace;
  try {
    workspace = at::empty({static_cast<int64_t>(choice.workspace_bytes)}, x.options().dtype(at::kByte));
  } catch (const c10::OutOfMemoryError&) {
    return at::Tensor();  // at::linear may need less
  }
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t status =
      cublasLtMatmul(handle, problem.desc, &alpha, weight.data_ptr(), problem.weight, x.data_ptr(), problem.x, &beta,
                     y.data_ptr(), problem.y, y.data_ptr(), problem.y, &choice.algo, workspace.data_ptr(),
                     choice.workspace_bytes, c10::cuda::getCurrentCUDAStream());
  return status == CUBLAS_STATUS_SUCCESS ? y : at::Tensor();
}
#else
at::Tensor lt_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) { return at::Tensor(); }
#endif

at::Tensor gemm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  at::Tensor y = lt_linear(x, weight, bias);
  return y.defined() ? y : at::linear(x, weight, bias);
}

// ================================================================ the launcher

// Output dims of the tail with every operand's strides, size-1 dims dropped and mergeable neighbours merged.
bool coalesce_tail(const Shape& out_shape, const std::vector<at::Tensor>& operands, TailProgram& tail) {
  struct Dim {
    int64_t size;
    std::vector<int64_t> strides;
  };
  std::vector<Dim> dims;
  for (size_t d = 0; d < out_shape.size(); ++d) {
    if (out_shape[d] == 1) continue;
    Dim dim{out_shape[d], {}};
    for (const at::Tensor& t : operands) dim.strides.push_back(t.stride(d));
    if (!dims.empty()) {
      Dim& outer = dims.back();
      bool mergeable = true;
      for (size_t k = 0; k < operands.size(); ++k)
        mergeable = mergeable && outer.strides[k] == dim.strides[k] * dim.size;
      if (mergeable) {
        outer.size *= dim.size;
        outer.strides = dim.strides;
        continue;
      }
    }
    dims.push_back(dim);
  }
  if (dims.empty()) dims.push_back(Dim{1, std::vector<int64_t>(operands.size(), 0)});
  if (dims.size() > static_cast<size_t>(kMaxTailDims)) return false;
  int64_t numel = 1;  // checked before the sizes are cast to 32 bits: a dim of 2^32 would divide by 0 below
  for (const Dim& dim : dims) numel *= dim.size;
  if (numel >= (int64_t{1} << 31)) return false;
  tail.ndim = static_cast<int32_t>(dims.size());
  for (size_t d = 0; d < dims.size(); ++d) {
    tail.sizes[d] = static_cast<uint32_t>(dims[d].size);
    tail.divisors[d].set(tail.sizes[d]);
  }
  tail.numel = static_cast<uint32_t>(numel);
  const int64_t vec = 16 / operands[0].element_size();
  for (size_t k = 0; k < operands.size(); ++k) {
    int64_t last_offset = 0;
    TailOperand& operand = tail.operands[k];
    operand.ptr = operands[k].data_ptr();
    operand.vector_loads = reinterpret_cast<uintptr_t>(operand.ptr) % 16 == 0 && dims.back().size % vec == 0;
    for (size_t d = 0; d < dims.size(); ++d) {
      operand.strides[d] = static_cast<uint32_t>(dims[d].strides[k]);
      last_offset += (dims[d].size - 1) * dims[d].strides[k];
      const bool innermost = d + 1 == dims.size();
      operand.vector_loads = operand.vector_loads && (innermost ? dims[d].strides[k] == 1 : dims[d].strides[k] % vec == 0);
    }
    if (last_offset >= (int64_t{1} << 31)) return false;
  }
  return true;
}

using FallbackFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::TensorList,
                              c10::string_view, c10::string_view);

at::Tensor run_fallback(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        at::TensorList params, c10::string_view program, const std::string& reason) {
  static const auto fallback = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("fxfuse::gemm_epilogue_fallback", "")
                                   .typed<FallbackFn>();
  return fallback.call(x, weight, bias, params, program, reason);
}

using Outputs = std::tuple<at::Tensor, at::Tensor>;  // (out, gemm_out) of gemm_epilogue_train
using TrainFallbackFn = Outputs(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::TensorList,
                                c10::string_view, c10::string_view);

Outputs run_train_fallback(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           at::TensorList params, c10::string_view program, const std::string& reason) {
  static const auto fallback = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("fxfuse::gemm_epilogue_train_fallback", "")
                                   .typed<TrainFallbackFn>();
  return fallback.call(x, weight, bias, params, program, reason);
}

// Why the kernels cannot take these tensors, or "".
std::string check_inputs(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         at::TensorList params) {
  const auto dtype = x.scalar_type();
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf)
    return std::string("dtype ") + c10::toString(dtype);
  if (x.dim() < 2) return "x has fewer than 2 dims";
  if (weight.dim() != 2 || weight.size(1) != x.size(-1)) return "weight does not match x";
  if (x.numel() == 0 || weight.size(0) == 0) return "empty input";
  if (!weight.is_contiguous()) return "weight is not contiguous";
  std::vector<const at::Tensor*> tensors{&weight};
  if (bias.has_value()) {
    if (bias->dim() != 1 || bias->size(0) != weight.size(0) || !bias->is_contiguous()) return "bias is not [N]";
    tensors.push_back(&*bias);
  }
  for (const at::Tensor& p : params) tensors.push_back(&p);
  for (const at::Tensor* t : tensors) {
    if (t->scalar_type() != dtype) return "dtypes differ";
    if (t->device() != x.device()) return "devices differ";
  }
  return "";
}

// Whether the fast row kernel and the broadcast tail launch as programmatic dependents of the kernel before them
// (launch_kernel, interpreter.cuh): on sm_90 and later, for 16-bit storage: bf16 op/GEMM 1.097 -> 1.090
// (min_bias), 1.077 -> 1.069 (hardtanh). In fp32 IEEE the next call's SIMT GEMM then loses the 1.6% it otherwise
// gains after the tail (2662 against 2705 us alone), so fp32 keeps plain launches (variants 76-78, dev/NOTES.md).
bool epilogue_launches_early(const at::Tensor& x) {
  if (x.scalar_type() == at::kFloat) return false;
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, x.device().index()));
  return major >= 9;
}

// The fast row kernel's build of `values` a thread (fp32 has one, of kRowValues).
template <class Storage>
bool launch_fast_row(const RowProgram& row, const RowLaunch& row_launch, int values, cudaStream_t stream) {
  if constexpr (!std::is_same_v<Storage, Fp32Storage>) {
    if (values == kLongRowValues) return launch_fast_row_program<Storage, kLongRowValues>(row, row_launch, stream);
  }
  return launch_fast_row_program<Storage, kRowValues>(row, row_launch, stream);
}

// The row kernel (the fast one where lay_out_for_fast_kernel gave its values a thread, `fast_values`; else the
// general interpreter, with or without slots) and the broadcast tail, where the program has them; false, with
// nothing launched, where the row kernel cannot have its shared memory on this device.
template <class Storage>
bool launch(const Binding& binding, const RowProgram& row, const std::optional<RowLayout>& layout,
            int64_t shared_bytes, int fast_values, const TailProgram& tail, bool early, cudaStream_t stream) {
  if (!binding.row_code.empty()) {
    const RowLaunch row_launch{layout->rows_per_block, shared_bytes, early};
    const bool general = needs_general_row_kernel(row);
    bool launched;
    if (fast_values > 0) {
      launched = launch_fast_row<Storage>(row, row_launch, fast_values, stream);
    } else if (binding.slots_used > 0) {
      launched = general ? launch_row_program<Storage, kMaxSlots, true>(row, row_launch, stream)
                         : launch_row_program<Storage, kMaxSlots, false>(row, row_launch, stream);
    } else {
      launched = general ? launch_row_program<Storage, 0, true>(row, row_launch, stream)
                         : launch_row_program<Storage, 0, false>(row, row_launch, stream);
    }
    if (!launched) return false;
  }
  if (binding.has_tail) launch_broadcast_tail<Storage>(tail, early, stream);
  return true;
}

// The fast row kernel's values a thread where it runs `row`, laid out for it (0 where it does not): its own
// (fast_row_values), which for long 16-bit rows differ from the general kernel's, so that the layout and the
// groups are placed again.
int lay_out_for_fast_kernel(RowProgram& row, std::optional<RowLayout>& layout, int vec, int slots_used) {
  const int values = fast_row_values(vec, row.features, uses_libm_op(row));
  if (values == kRowValues) return fits_fast_row_kernel(row, slots_used, values) ? values : 0;
  const std::optional<RowLayout> fast_layout = choose_row_layout(row.features, values);
  if (!fast_layout) return 0;
  RowProgram relaid = row;
  std::vector<Instruction> code(row.code, row.code + row.num_instructions);
  if (place_groups(code, *fast_layout, vec, row.features) != 0) return 0;  // groups in shared memory
  std::copy(code.begin(), code.end(), relaid.code);
  relaid.threads_per_row = fast_layout->threads_per_row;
  relaid.group_shared_floats = 0;
  if (!fits_fast_row_kernel(relaid, slots_used, values)) return 0;
  row = relaid;
  layout = fast_layout;
  return values;
}

// The memory of `t` (from its start) as a contiguous tensor of `shape`, one of its own rather than a view: autograd
// refuses in-place ops on an op's outputs that are views of tensors the op made, where eager's results take them.
at::Tensor contiguous_over(const at::Tensor& t, c10::IntArrayRef shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * shape[d + 1];
  at::Tensor output = at::empty({0}, t.options());
  output.set_(t.storage(), t.storage_offset(), shape, strides);
  return output;
}

// The broadcast tail's output. Where the row phase wrote elsewhere and y is not returned, y is dead once the row
// kernel has read it: the tail writes into y's memory instead, and its dirty lines in L2 are overwritten rather
// than written back beside the output's (the min + bias example: 16 MB less DRAM traffic per call).
at::Tensor tail_output(const std::vector<int64_t>& shape, const at::Tensor& y, const at::Tensor& row_result,
                       bool keep_gemm_output) {
  if (keep_gemm_output || row_result.is_alias_of(y) || c10::multiply_integers(shape) > y.numel())
    return at::empty(shape, y.options());
  return contiguous_over(y, shape);
}

// The fused op: (out, an undefined tensor), or with keep_gemm_output (gemm_epilogue_train) (out, y), where the
// epilogue writes a tensor of its own instead of y.
Outputs run_gemm_epilogue(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          at::TensorList params, c10::string_view program_text, bool keep_gemm_output) {
  const auto fallback = [&](const std::string& why) -> Outputs {
    if (keep_gemm_output) return run_train_fallback(x, weight, bias, params, program_text, why);
    return {run_fallback(x, weight, bias, params, program_text, why), at::Tensor()};
  };
  std::string reason = check_inputs(x, weight, bias, params);
  if (!reason.empty()) return fallback(reason);
  const auto program = cached_program(std::string(program_text));
  if (!program->error.empty()) return fallback(program->error);

  const c10::cuda::CUDAGuard device_guard(x.device());
  const int64_t features = weight.size(0);
  const int64_t in_features = x.size(-1);
  const int vec = static_cast<int>(16 / x.element_size());
  Context ctx{*program, x, params, x.sizes().vec(), {}, features, vec};
  ctx.lead.pop_back();
  ctx.full = ctx.lead;
  ctx.full.push_back(features);
  const int64_t rows = x.numel() / in_features;

  Binding binding;
  reason = bind(ctx, binding);
  if (!reason.empty()) return fallback(reason);
  const auto& shape = binding.output_shape;  // a param with a dim of 0 broadcasts the output to nothing
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return fallback("empty output");

  std::optional<RowLayout> layout;
  int64_t shared_bytes = 0;
  int fast_values = 0;  // > 0: the fast row kernel runs the row phase, at that many values a thread
  if (!binding.row_code.empty()) {
    layout = choose_row_layout(features);
    if (!layout) return fallback("rows too long for registers");
    shared_bytes = place_groups(binding.row_code, *layout, vec, features);
    if (shared_bytes < 0) return fallback("group layout needs > 48 KB");
  }

  // (a strided x, x.t() or a permuted view, costs one copy here: the reference would run every op on its own)
  const at::Tensor y = gemm(x.reshape({rows, in_features}).contiguous(), weight, bias);
  at::Tensor row_result = y;

  RowProgram row{};
  if (!binding.row_code.empty()) {
    std::copy(binding.row_code.begin(), binding.row_code.end(), row.code);
    std::copy(binding.row_params.begin(), binding.row_params.end(), row.params);
    row.num_instructions = static_cast<int32_t>(binding.row_code.size());
    row.input = y.data_ptr();
    row.output_per_row = binding.row_result_kind != RowShape::Full;
    if (row.output_per_row) row_result = at::empty({rows}, y.options());
    else if (keep_gemm_output) row_result = at::empty_like(y);  // y is returned: the rows go elsewhere
    row.output = row_result.data_ptr();
    row.rows = rows;
    row.features = static_cast<int32_t>(features);
    row.threads_per_row = layout->threads_per_row;
    row.group_shared_floats = static_cast<int32_t>(shared_bytes / sizeof(float));
    row.vector_io = features % vec == 0;
    row.tail_follows = binding.has_tail;
    fast_values = lay_out_for_fast_kernel(row, layout, vec, binding.slots_used);
  }

  at::Tensor output;
  TailProgram tail{};
  if (binding.has_tail) {
    output = tail_output(binding.output_shape, y, row_result, keep_gemm_output);
    std::vector<at::Tensor> operands{row_result.view(binding.row_result_shape).expand(binding.output_shape)};
    for (const at::Tensor& param : binding.tail_params) operands.push_back(param.expand(binding.output_shape));
    tail.num_operands = static_cast<int32_t>(operands.size());
    while (operands.size() < static_cast<size_t>(kMaxTailOperands)) operands.push_back(operands[0]);
    if (!coalesce_tail(binding.output_shape, operands, tail))
      return fallback("broadcast output too large or too many dims");
    std::copy(binding.tail_code.begin(), binding.tail_code.end(), tail.code);
    tail.num_instructions = static_cast<int32_t>(binding.tail_code.size());
    tail.output = output.data_ptr();
  } else {
    // An empty program's result is y itself: the training op returns a copy beside it.
    output = contiguous_over(keep_gemm_output && binding.row_code.empty() ? y.clone() : row_result,
                             binding.output_shape);
  }

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool early = epilogue_launches_early(x);
  bool launched;
  if (x.scalar_type() == at::kFloat)
    launched = launch<Fp32Storage>(binding, row, layout, shared_bytes, fast_values, tail, early, stream);
  else if (x.scalar_type() == at::kBFloat16)
    launched = launch<Bf16Storage>(binding, row, layout, shared_bytes, fast_values, tail, early, stream);
  else launched = launch<Fp16Storage>(binding, row, layout, shared_bytes, fast_values, tail, early, stream);
  // (the GEMM ran for nothing: only cards with less shared memory a block than the H100's 227 KB get here)
  if (!launched) return fallback("the row kernel needs more shared memory than this device gives a block");
  return {output, keep_gemm_output ? contiguous_over(y, ctx.full) : at::Tensor()};
}

at::Tensor gemm_epilogue_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              at::TensorList params, c10::string_view program_text) {
  return std::get<0>(run_gemm_epilogue(x, weight, bias, params, program_text, false));
}

Outputs gemm_epilogue_train_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 at::TensorList params, c10::string_view program_text) {
  return run_gemm_epilogue(x, weight, bias, params, program_text, true);
}

}  // namespace
}  // namespace fxfuse

TORCH_LIBRARY_FRAGMENT(fxfuse, m) {
  m.def("cuda_supported_ops() -> str", [] { return fxfuse::supported_ops(); });
  m.def("cuda_row_chains() -> str", [] { return fxfuse::row_chains(); });
  m.def("cuda_tail_chains() -> str", [] { return fxfuse::tail_chains(); });
}

TORCH_LIBRARY_IMPL(fxfuse, CUDA, m) {
  m.impl("gemm_epilogue", &fxfuse::gemm_epilogue_cuda);
  m.impl("gemm_epilogue_train", &fxfuse::gemm_epilogue_train_cuda);
}
