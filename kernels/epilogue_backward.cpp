// The CUDA implementation of torch.ops.fxfuse.epilogue_backward(grad_output, gemm_out, params, program, needs_grad):
// the gradients of `program` (fxfuse/program.py) at the GEMM output gemm_out, for the tensors flagged in needs_grad
// (order: gemm_out, *params).
//
//   Reference: fxfuse/library.py::run_epilogue_backward (torch's autograd through the reference interpreter).
//
// Strategy: the program is bound to gemm_out's shape as the forward binds it (program_binding.cuh), then ONE
// launch of the backward row kernel (backward_interpreter.cuh) reads gemm_out and grad_output once and writes
// gemm_out's gradient once. The gradients of params that every row shares come out as per-block partial sums in
// fp32, which one more launch sums and stores in the params' dtype (finish_summed_grads_kernel; ATen's sum and
// cast per param where a param has several uses or a single value). A broadcast tail of adds and subtracts (the
// min + bias example's (1, N, M, 1) result) passes the gradient through unchanged but for its sign: ATen sums
// grad_output down to the row phase's result and to each of the tail's params first.
//
// Limits (anything else runs the reference through fxfuse::epilogue_backward_fallback, with the reason logged):
// those of the backward row kernel (backward_interpreter.cuh) and of the forward's binding; every tensor of one
// dtype (fp32, bf16, fp16) on one CUDA device; a param that is not shared by all rows must be read whole (one
// value per row, or per element), not broadcast over some leading dims.
//
// Host code only, compiled by the C++ compiler (gemm_epilogue.cpp says why); the kernels are in row_backward_*.cu.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "program_binding.cuh"

namespace fxfuse {
namespace {

using Tensors = std::vector<at::Tensor>;
using FallbackFn = Tensors(const at::Tensor&, const at::Tensor&, at::TensorList, c10::string_view,
                           const c10::List<bool>&, c10::string_view);

Tensors run_fallback(const at::Tensor& grad_output, const at::Tensor& gemm_out, at::TensorList params,
                     c10::string_view program, const c10::List<bool>& needs_grad, const std::string& reason) {
  static const auto fallback = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("fxfuse::epilogue_backward_fallback", "")
                                   .typed<FallbackFn>();
  return fallback.call(grad_output, gemm_out, params, program, needs_grad, reason);
}

// Why the backward kernel cannot take these tensors, or "".
std::string check_backward_inputs(const at::Tensor& grad_output, const at::Tensor& gemm_out, at::TensorList params,
                                  const c10::List<bool>& needs_grad) {
  const auto dtype = gemm_out.scalar_type();
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf)
    return std::string("dtype ") + c10::toString(dtype);
  if (gemm_out.dim() < 2 || gemm_out.numel() == 0) return "gemm_out is empty or not [rows, features]";
  if (!gemm_out.is_contiguous()) return "gemm_out is not contiguous";
  // the kernel copies rows in 16-byte pieces (a view such as buf[1:].view(M, N) is contiguous but not aligned)
  if (reinterpret_cast<uintptr_t>(gemm_out.data_ptr()) % 16 != 0) return "gemm_out is not 16-byte aligned";
  if (needs_grad.size() != params.size() + 1) return "needs_grad does not match the tensors";
  std::vector<const at::Tensor*> tensors{&grad_output};
  for (const at::Tensor& p : params) tensors.push_back(&p);
  for (const at::Tensor* t : tensors) {
    if (t->scalar_type() != dtype) return "dtypes differ";
    if (t->device() != gemm_out.device()) return "devices differ";
  }
  return "";
}

// Whether a broadcast tail only adds or subtracts params and numbers to the row phase's result, so that its
// backward is sums of grad_output.
bool is_additive_tail(const Binding& binding) {
  for (const Instruction& ins : binding.tail_code) {
    const bool add_or_sub = ins.op == OP_add || ins.op == OP_sub;
    if (!add_or_sub || (ins.other != OTHER_PARAM && ins.other != OTHER_SCALAR)) return false;
  }
  return true;
}

// Why the backward kernel cannot run this bound program, or "" (limits: backward_interpreter.cuh).
std::string check_backward_program(const Binding& binding, const RowLayout& layout, int64_t group_shared_bytes,
                                   int64_t features, int vec) {
  if (binding.has_tail && !is_additive_tail(binding))
    return "the result broadcasts beyond the rows through more than adds and subtracts";
  if (binding.slots_used > 0) return "a value is read again later (the backward keeps no slots)";
  if (layout.threads_per_row > kMaxBackwardThreads) return "rows longer than the backward's registers";
  if (group_shared_bytes > 0) return "a group size off the lanes' grid";
  if (features % vec != 0) return "rows that are not whole 16-byte vectors";
  int row_ops = 0;
  for (const Instruction& ins : binding.row_code) {
    if (ins.group_size > 0) ++row_ops;
    // (the kept statistics are one pair per chunk: groups inside a chunk have several)
    if (ins.group_size > 0 && ins.group_mode == GROUP_IN_VECTOR) return "a group size off the lanes' grid";
    if (is_feature_affine(ins.op)) return "batch_norm has no backward kernel";
  }
  if (row_ops > kMaxBackwardRowOps) return "more than " + std::to_string(kMaxBackwardRowOps) + " norms and reductions";
  return "";
}

// A param gradient's fp32 buffer and how the kernel fills it; `reason` says why it cannot.
struct GradBuffer {
  ParamGrad grad{GRAD_NONE, -1, nullptr};
  at::Tensor buffer;
  std::string reason;
};

// `partials`: every GRAD_SUMMED param's partial rows, [accumulator, partial row, feature] in fp32.
GradBuffer make_grad_buffer(const RowParam& view, const at::Tensor& param, int64_t rows, int64_t features,
                            const at::Tensor& partials, int accumulator) {
  GradBuffer b;
  const auto fp32 = param.options().dtype(at::kFloat);
  if (view.row_stride == 0) {  // the same for every row: per feature, or one value
    const int64_t expected = view.feature_stride != 0 ? features : 1;
    if (param.numel() != expected) return b.reason = "a param broadcast within a feature", b;
    if (accumulator >= kMaxGradAccumulators)
      return b.reason = "more than " + std::to_string(kMaxGradAccumulators) + " params summed over rows", b;
    b.buffer = partials.select(0, accumulator);
    b.grad = ParamGrad{GRAD_SUMMED, static_cast<int8_t>(accumulator), b.buffer.data_ptr<float>()};
  } else if (view.feature_stride == 0) {
    if (param.numel() != rows) return b.reason = "a per-row param broadcast over some leading dims", b;
    b.buffer = at::zeros({rows}, fp32);
    b.grad = ParamGrad{GRAD_PER_ROW, -1, b.buffer.data_ptr<float>()};
  } else {
    if (param.numel() != rows * features) return b.reason = "a param broadcast over some leading dims", b;
    b.buffer = at::zeros({rows, features}, fp32);
    b.grad = ParamGrad{GRAD_FULL, -1, b.buffer.data_ptr<float>()};
  }
  return b;
}

// A row param's fp32 gradient buffer as the param's flat fp32 gradient: GRAD_SUMMED partial rows summed (in
// fp32: at::sum with a 16-bit dtype would round the partials to it first).
at::Tensor fp32_gradient(const GradBuffer& b, const at::Tensor& param) {
  if (b.grad.kind != GRAD_SUMMED) return b.buffer.view({-1});
  return param.numel() == 1 ? b.buffer.sum().view({1}) : b.buffer.sum(0);
}

// Whether every summed gradient is a whole param's (its only use that needs a gradient, one value per feature,
// none from the tail): then one launch sums the partial rows of all of them and stores them in the params' dtype,
// where the host would run a sum and a cast per param (the examples' two norm params: four ATen ops, 94 of the
// backward's 200 µs of host time on one H100's host, dev/step_host_probe.py).
bool finishes_on_device(const Binding& binding, const std::vector<GradBuffer>& buffers, at::TensorList params,
                        const std::vector<std::pair<int, at::Tensor>>& tail_grads, int64_t features) {
  for (size_t k = 0; k < buffers.size(); ++k) {
    if (buffers[k].grad.kind != GRAD_SUMMED) continue;
    const int source = binding.row_param_sources[k];
    if (params[source].numel() != features) return false;
    for (size_t other = 0; other < buffers.size(); ++other)
      if (other != k && buffers[other].grad.kind != GRAD_NONE && binding.row_param_sources[other] == source)
        return false;
    for (const auto& [index, grad] : tail_grads)
      if (index == source) return false;
  }
  return true;
}

void finish_summed_on_device(at::ScalarType dtype, const SummedGrads& grads) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (dtype == at::kFloat) launch_finish_summed_grads<Fp32Storage>(grads, stream);
  else if (dtype == at::kBFloat16) launch_finish_summed_grads<Bf16Storage>(grads, stream);
  else launch_finish_summed_grads<Fp16Storage>(grads, stream);
}

int64_t backward_blocks(at::ScalarType dtype, const BackwardProgram& prog, int threads) {
  if (dtype == at::kFloat) return row_backward_blocks<Fp32Storage>(prog, threads);
  if (dtype == at::kBFloat16) return row_backward_blocks<Bf16Storage>(prog, threads);
  return row_backward_blocks<Fp16Storage>(prog, threads);
}

void launch_backward(at::ScalarType dtype, const BackwardProgram& prog, int64_t blocks, int threads) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (dtype == at::kFloat) launch_row_backward<Fp32Storage>(prog, blocks, threads, stream);
  else if (dtype == at::kBFloat16) launch_row_backward<Bf16Storage>(prog, blocks, threads, stream);
  else launch_row_backward<Fp16Storage>(prog, blocks, threads, stream);
}

Tensors epilogue_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gemm_out, at::TensorList params,
                               c10::string_view program_text, const c10::List<bool>& needs_grad) {
  const auto fallback = [&](const std::string& why) {
    return run_fallback(grad_output, gemm_out, params, program_text, needs_grad, why);
  };
  std::string reason = check_backward_inputs(grad_output, gemm_out, params, needs_grad);
  if (!reason.empty()) return fallback(reason);
  const auto program = cached_program(std::string(program_text));
  if (!program->error.empty()) return fallback(program->error);

  const c10::cuda::CUDAGuard device_guard(gemm_out.device());
  const int64_t features = gemm_out.size(-1);
  const int64_t rows = gemm_out.numel() / features;
  const int vec = static_cast<int>(16 / gemm_out.element_size());
  Context ctx{*program, gemm_out, params, gemm_out.sizes().vec(), gemm_out.sizes().vec(), features, vec};
  ctx.lead.pop_back();
  Binding binding;
  reason = bind(ctx, binding);
  if (!reason.empty()) return fallback(reason);
  if (binding.row_code.empty()) return fallback("an empty program");
  const std::optional<RowLayout> layout = choose_row_layout(features);
  if (!layout) return fallback("rows too long for registers");
  const int64_t group_shared_bytes = place_groups(binding.row_code, *layout, vec, features);
  reason = check_backward_program(binding, *layout, group_shared_bytes, features, vec);
  if (!reason.empty()) return fallback(reason);
  if (grad_output.sizes() != c10::IntArrayRef(binding.output_shape)) return fallback("grad_output's shape");

  // The additive tail's backward: sums of grad_output, signed (x - p flips p's sign; p - x flips that of x, and
  // so of everything before it in the tail).
  at::Tensor grad_row_result = grad_output;
  std::vector<std::pair<int, at::Tensor>> tail_grads;  // (program param, its gradient from the tail, fp32)
  if (binding.has_tail) {
    float sign = 1.0f;
    for (auto ins = binding.tail_code.rbegin(); ins != binding.tail_code.rend(); ++ins) {
      const bool subtracts_param = ins->op == OP_sub && !ins->reversed;
      const int tail_param = ins->param[0] - 1;  // tail operand 0 is the row phase's result
      if (ins->other == OTHER_PARAM && needs_grad.get(binding.tail_param_sources[tail_param] + 1)) {
        const at::Tensor& param = binding.tail_params[tail_param];
        at::Tensor sum = grad_output.sum_to_size(param.sizes()).to(at::kFloat);
        tail_grads.emplace_back(binding.tail_param_sources[tail_param], subtracts_param != (sign < 0) ? -sum : sum);
      }
      if (ins->op == OP_sub && ins->reversed) sign = -sign;
    }
    grad_row_result = grad_output.sum_to_size(binding.row_result_shape);
    if (sign < 0) grad_row_result = -grad_row_result;
  }

  // The row phase's gradient: one more row param, read per element or, after a reduction, once per row.
  const RowShape result_kind = binding.row_result_kind;
  RowParam grad_view;
  if (!row_param_view(ctx, grad_row_result, binding.row_result_shape, result_kind, grad_view))
    return fallback("grad_output has strides that are not (row, feature)");
  const int grad_output_param = add_row_param(binding, grad_view, -1);
  if (grad_output_param < 0) return fallback("more than " + std::to_string(kMaxParams) + " param uses");

  BackwardProgram prog{};
  RowProgram& row = prog.row;
  std::copy(binding.row_code.begin(), binding.row_code.end(), row.code);
  std::copy(binding.row_params.begin(), binding.row_params.end(), row.params);
  for (RowParam& p : row.params) p.shared_index = -1;
  row.num_instructions = static_cast<int32_t>(binding.row_code.size());
  row.input = gemm_out.data_ptr();
  row.rows = rows;
  row.features = static_cast<int32_t>(features);
  row.threads_per_row = layout->threads_per_row;
  row.vector_io = true;
  prog.grad_output_param = grad_output_param;
  prog.stage_grad_output = grad_view.vector_loads && grad_view.row_stride == features && result_kind == RowShape::Full;
  prog.rows_per_block = layout->rows_per_block;
  int row_ops = 0;
  for (size_t i = 0; i < binding.row_code.size(); ++i) {
    BackwardStep& step = prog.steps[i];
    step.row_op = static_cast<int8_t>(binding.row_code[i].group_size > 0 ? row_ops++ : -1);
    step.input_per_row = classify(ctx, binding.value_shapes[i]) != RowShape::Full;
    step.output_per_row = classify(ctx, binding.value_shapes[i + 1]) != RowShape::Full;
  }

  // Which row params need a gradient, and their buffers (the partial rows' count needs the grid first).
  const int threads = layout->rows_per_block * layout->threads_per_row;
  for (size_t k = 0; k < binding.row_params.size(); ++k) {
    const int source = binding.row_param_sources[k];
    if (source >= 0 && needs_grad.get(source + 1) && binding.row_params[k].row_stride == 0)
      prog.grads[k].accumulator = static_cast<int8_t>(prog.accumulators++);
  }
  if (prog.accumulators > kMaxGradAccumulators)
    return fallback("more than " + std::to_string(kMaxGradAccumulators) + " params summed over rows");
  const int64_t blocks = backward_blocks(gemm_out.scalar_type(), prog, threads);
  if (blocks == 0) return fallback("the accumulators need more shared memory than this device gives a block");
  const int64_t partial_rows = blocks * layout->rows_per_block;
  const at::Tensor partials =
      at::empty({prog.accumulators, partial_rows, features}, gemm_out.options().dtype(at::kFloat));
  std::vector<GradBuffer> buffers(binding.row_params.size());
  for (size_t k = 0; k < binding.row_params.size(); ++k) {
    const int source = binding.row_param_sources[k];
    if (source < 0 || !needs_grad.get(source + 1)) continue;
    buffers[k] = make_grad_buffer(binding.row_params[k], params[source], rows, features, partials,
                                  prog.grads[k].accumulator);
    if (!buffers[k].reason.empty()) return fallback(buffers[k].reason);
    prog.grads[k] = buffers[k].grad;
  }

  at::Tensor grad_gemm_out;
  if (needs_grad.get(0)) {
    grad_gemm_out = at::empty_like(gemm_out, at::MemoryFormat::Contiguous);
    row.output = grad_gemm_out.data_ptr();
  }
  launch_backward(gemm_out.scalar_type(), prog, blocks, threads);

  std::vector<at::Tensor> finished(params.size());  // per param: its gradient from finish_summed_on_device, if so
  if (prog.accumulators > 0 && finishes_on_device(binding, buffers, params, tail_grads, features)) {
    SummedGrads summed{partials.data_ptr<float>(), {}, partial_rows, static_cast<int32_t>(features),
                       prog.accumulators};
    for (size_t k = 0; k < buffers.size(); ++k) {
      if (buffers[k].grad.kind != GRAD_SUMMED) continue;
      const int source = binding.row_param_sources[k];
      finished[source] = at::empty({features}, params[source].options());
      summed.out[buffers[k].grad.accumulator] = finished[source].data_ptr();
    }
    finish_summed_on_device(gemm_out.scalar_type(), summed);
  }

  // Each other flagged param's gradient: its uses summed in fp32, then cast to its dtype once (zeros where it has
  // none).
  Tensors grads;
  if (needs_grad.get(0)) grads.push_back(grad_gemm_out);
  for (size_t source = 0; source < params.size(); ++source) {
    if (!needs_grad.get(source + 1)) continue;
    const at::Tensor& param = params[source];
    if (finished[source].defined()) {
      grads.push_back(finished[source].view(param.sizes()));
      continue;
    }
    at::Tensor total;
    const auto add = [&](const at::Tensor& part) { total = total.defined() ? total + part : part; };
    for (size_t k = 0; k < binding.row_params.size(); ++k)
      if (binding.row_param_sources[k] == static_cast<int>(source)) add(fp32_gradient(buffers[k], param));
    for (const auto& [index, grad] : tail_grads)
      if (index == static_cast<int>(source)) add(grad.reshape({-1}));
    if (!total.defined()) total = at::zeros({param.numel()}, param.options());
    at::Tensor grad = total.to(param.scalar_type()).view(param.sizes());
    // A tail param of the output's shape and dtype: its sum_to_size is grad_output itself, which a Tensor[] of the
    // op's may not return
    grads.push_back(grad.is_alias_of(grad_output) ? grad.clone() : grad);
  }
  return grads;
}

}  // namespace
}  // namespace fxfuse

TORCH_LIBRARY_IMPL(fxfuse, CUDA, m) { m.impl("epilogue_backward", &fxfuse::epilogue_backward_cuda); }
