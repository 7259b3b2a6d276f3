// The autograd formulas of torch.ops.fxfuse.gemm_epilogue and gemm_epilogue_train for CUDA tensors, in C++
// (the AutogradCUDA kernels of the two ops; every other device keeps the Python registration).
//
//   gemm_epilogue_train -> (out, gemm_out): the epilogue's gradients at the kept GEMM output
//     (fxfuse::epilogue_backward), then the linear's: grad_x = grad_y weight, grad_weight = grad_y^T x,
//     grad_bias = the sum of grad_y's rows, each in grad_y's dtype and then the input's.
//   gemm_epilogue -> out: the GEMM output recomputed (at::linear), then the same as gemm_epilogue_train's.
//   Reference: fxfuse/library.py::_train_backward and _backward, which run wherever these kernels are not loaded.
//   Under backward(create_graph=True) the gradients come from the reference's own ops instead
//   (fxfuse::epilogue_vjp, gemm_epilogue_vjp: composite ops, so differentiable in turn), as there.
//   gemm_epilogue's epilogue gradients come from epilogue_backward's kernel, as the training op's, rather than from
//   the reference's ops recomputed in the storage dtype: those round each op's result to bf16, where the kernels
//   compute in fp32 as eager's do under CUDA's autocast (layer_norm then amin: a row min's gradient went to the ties
//   of the rounded values, 8-14% off against eager's 0.2%).
//
// Why C++: with the Python registration (torch.library.register_autograd) a call that records gradients cost
// 156-258 µs of host time, against 73-112 µs with these (bf16, 64 x 256 -> 512; dev/host_breakdown.py against
// variant 94, two alternating passes on one H100), where its GPU work takes a few µs.
//
// Host code only, compiled by the C++ compiler (gemm_epilogue.cpp says why).
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace fxfuse {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Tensors = std::vector<at::Tensor>;

// ================================================================ the ops these formulas call

using TrainFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                   const std::optional<at::Tensor>&, at::TensorList, c10::string_view);
using InferenceFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::TensorList,
                               c10::string_view);
using EpilogueGradientsFn = Tensors(const at::Tensor&, const at::Tensor&, at::TensorList, c10::string_view,
                                    const c10::List<bool>&);
using GemmEpilogueGradientsFn = Tensors(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const std::optional<at::Tensor>&, at::TensorList, c10::string_view,
                                        const c10::List<bool>&);

template <class Fn>
c10::TypedOperatorHandle<Fn> fxfuse_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

// The fused ops' kernels below autograd (CUDA, or a dispatch mode's).
std::tuple<at::Tensor, at::Tensor> train_below_autograd(const at::Tensor& x, const at::Tensor& weight,
                                                        const std::optional<at::Tensor>& bias, at::TensorList params,
                                                        c10::string_view program) {
  static const auto op = fxfuse_op<TrainFn>("fxfuse::gemm_epilogue_train");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(x, weight, bias, params, program);
}

at::Tensor inference_below_autograd(const at::Tensor& x, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, at::TensorList params,
                                    c10::string_view program) {
  static const auto op = fxfuse_op<InferenceFn>("fxfuse::gemm_epilogue");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(x, weight, bias, params, program);
}

// The gradients of the epilogue at gemm_out for the tensors flagged in `needs` (order: gemm_out, *params), one per
// flag: epilogue_backward's, or under create_graph=True the reference's own differentiable ones.
Tensors epilogue_gradients(const at::Tensor& grad_output, const at::Tensor& gemm_out, at::TensorList params,
                           const std::string& program, const c10::List<bool>& needs) {
  static const auto fused = fxfuse_op<EpilogueGradientsFn>("fxfuse::epilogue_backward");
  static const auto differentiable = fxfuse_op<EpilogueGradientsFn>("fxfuse::epilogue_vjp");
  return (at::GradMode::is_enabled() ? differentiable : fused).call(grad_output, gemm_out, params, program, needs);
}

// The reference's differentiable gradients of the whole op (order: x, weight, bias, *params), the forward
// recomputed: gemm_epilogue's under create_graph=True.
Tensors gemm_epilogue_vjp(const at::Tensor& grad_output, const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, at::TensorList params, const std::string& program,
                          const c10::List<bool>& needs) {
  static const auto differentiable = fxfuse_op<GemmEpilogueGradientsFn>("fxfuse::gemm_epilogue_vjp");
  return differentiable.call(grad_output, x, weight, bias, params, program, needs);
}

// ================================================================ inputs and their gradients

// Whether autograd has anything to record: grad mode on and some input requiring grad. Otherwise the op runs
// below autograd at once, without a graph node.
bool records_gradients(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       at::TensorList params) {
  if (!at::GradMode::is_enabled()) return false;
  if (x.requires_grad() || weight.requires_grad() || (bias.has_value() && bias->requires_grad())) return true;
  for (const at::Tensor& p : params)
    if (p.requires_grad()) return true;
  return false;
}

// Which of (x, weight, bias, *params) autograd asks gradients for. Autograd numbers only the tensors it was given:
// without a bias, the params follow the weight.
c10::List<bool> needs_of(AutogradContext* ctx, bool has_bias, size_t num_params) {
  c10::List<bool> needs;
  size_t edge = 0;
  needs.push_back(ctx->needs_input_grad(edge++));
  needs.push_back(ctx->needs_input_grad(edge++));
  needs.push_back(has_bias && ctx->needs_input_grad(edge++));
  for (size_t i = 0; i < num_params; ++i) needs.push_back(ctx->needs_input_grad(edge++));
  return needs;
}

bool any_of(const c10::List<bool>& flags, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i)
    if (flags.get(i)) return true;
  return false;
}

// `t` as saved for the backward (library.py::_kept): an inference tensor (made under torch.inference_mode) can't
// be saved, where eager's op that reads it may keep nothing of it (`h + y`, a frozen linear's input): its copy is.
at::Tensor kept(const at::Tensor& t) { return t.defined() && t.is_inference() ? t.clone() : t; }

// What backward returns: one entry per forward argument (x, weight, bias, each param, program), each flagged
// gradient in the order of `grads`, the rest undefined.
variable_list by_argument(const c10::List<bool>& needs, const Tensors& grads) {
  variable_list result;
  size_t next = 0;
  for (size_t i = 0; i < needs.size(); ++i) result.push_back(needs.get(i) ? grads.at(next++) : at::Tensor());
  result.emplace_back();  // program
  return result;
}

// The gradients of y = linear(x, weight, bias) flagged in needs[0:3], from y's (x may have leading dims), as
// library.py::_linear_gradients: computed in grad_y's dtype, returned in each input's.
Tensors linear_gradients(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                         const c10::List<bool>& needs, const std::vector<int64_t>& dtypes) {
  const auto dtype = [&](int i) { return static_cast<at::ScalarType>(dtypes[i]); };
  const at::ScalarType compute = grad_y.scalar_type();
  // the rows counted, not -1: a reshape of no elements to (-1, 0) is ambiguous (no input or output features)
  const int64_t rows = c10::multiply_integers(grad_y.sizes().slice(0, grad_y.dim() - 1));
  const at::Tensor grad_rows = grad_y.reshape({rows, grad_y.size(-1)});
  Tensors grads;
  if (needs.get(0)) grads.push_back(at::matmul(grad_y, weight.to(compute)).to(dtype(0)));
  if (needs.get(1)) grads.push_back(grad_rows.t().mm(x.reshape({rows, x.size(-1)}).to(compute)).to(dtype(1)));
  if (needs.get(2)) grads.push_back(grad_rows.sum(0).to(dtype(2)));
  return grads;
}

// The gradients flagged in `needs` (x, weight, bias, *params) from out's (grad_output) through the epilogue at
// gemm_out, plus gemm_out's own where defined; `dtypes`: x's, weight's and bias's.
Tensors gradients_at_gemm_out(const at::Tensor& grad_output, const at::Tensor& grad_gemm_out, const at::Tensor& x,
                              const at::Tensor& weight, const at::Tensor& gemm_out, const Tensors& params,
                              const std::string& program, const c10::List<bool>& needs,
                              const std::vector<int64_t>& dtypes) {
  const bool linear_needs = any_of(needs, 0, 3);
  c10::List<bool> epilogue_needs{linear_needs};
  for (size_t i = 3; i < needs.size(); ++i) epilogue_needs.push_back(needs.get(i));
  Tensors epilogue_grads;
  if (grad_output.defined() && any_of(epilogue_needs, 0, epilogue_needs.size()))
    epilogue_grads = epilogue_gradients(grad_output, gemm_out, params, program, epilogue_needs);
  size_t next = 0;
  at::Tensor grad_y = linear_needs && !epilogue_grads.empty() ? epilogue_grads[next++] : at::Tensor();
  if (linear_needs && grad_gemm_out.defined()) grad_y = grad_y.defined() ? grad_y.add(grad_gemm_out) : grad_gemm_out;

  Tensors grads;
  if (grad_y.defined()) grads = linear_gradients(grad_y, x, weight, needs, dtypes);
  else if (linear_needs) grads.resize(static_cast<size_t>(needs.get(0)) + needs.get(1) + needs.get(2));
  for (size_t i = 3; i < needs.size(); ++i)
    if (needs.get(i)) grads.push_back(next < epilogue_grads.size() ? epilogue_grads[next++] : at::Tensor());
  return grads;
}

// x's, weight's and bias's dtypes (x's for a missing bias), as the backward's linear gradients return them.
std::vector<int64_t> linear_dtypes(const at::Tensor& x, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias) {
  const bool has_bias = bias.has_value() && bias->defined();
  return {static_cast<int64_t>(x.scalar_type()), static_cast<int64_t>(weight.scalar_type()),
          static_cast<int64_t>(has_bias ? bias->scalar_type() : x.scalar_type())};
}

// ================================================================ gemm_epilogue_train

struct GemmEpilogueTrain : torch::autograd::Function<GemmEpilogueTrain> {
  static constexpr bool is_traceable = true;  // compiled autograd traces the backward instead of breaking there

  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, at::TensorList params,
                               c10::string_view program) {
    const auto [out, gemm_out] = train_below_autograd(x, weight, bias, params, program);
    ctx->set_materialize_grads(false);  // gemm_out's gradient is mostly undefined: no zeros tensor for it
    ctx->saved_data["program"] = std::string(program);
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["dtypes"] = linear_dtypes(x, weight, bias);
    // x is read only for weight's gradient, weight only for x's.
    variable_list saved{weight.requires_grad() ? x : at::Tensor(), x.requires_grad() ? weight : at::Tensor(),
                        gemm_out};
    for (const at::Tensor& p : params) saved.push_back(kept(p));
    ctx->save_for_backward(saved);
    return {out, gemm_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &gemm_out = saved[2];
    const Tensors params(saved.begin() + 3, saved.end());
    const c10::List<bool> needs = needs_of(ctx, ctx->saved_data["has_bias"].toBool(), params.size());
    const Tensors grads = gradients_at_gemm_out(grad_outputs[0], grad_outputs[1], x, weight, gemm_out, params,
                                                ctx->saved_data["program"].toStringRef(), needs,
                                                ctx->saved_data["dtypes"].toIntVector());
    return by_argument(needs, grads);
  }
};

std::tuple<at::Tensor, at::Tensor> gemm_epilogue_train_autograd(const at::Tensor& x, const at::Tensor& weight,
                                                               const std::optional<at::Tensor>& bias,
                                                               at::TensorList params, c10::string_view program) {
  if (!records_gradients(x, weight, bias, params)) return train_below_autograd(x, weight, bias, params, program);
  const variable_list outputs = GemmEpilogueTrain::apply(x, weight, bias, params, program);
  return {outputs[0], outputs[1]};
}

// ================================================================ gemm_epilogue

struct GemmEpilogue : torch::autograd::Function<GemmEpilogue> {
  static constexpr bool is_traceable = true;

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, at::TensorList params, c10::string_view program) {
    const at::Tensor out = inference_below_autograd(x, weight, bias, params, program);
    ctx->saved_data["program"] = std::string(program);
    // What eager's linear keeps (x for the weight's gradient, the weight for x's) is kept as it is, to raise as there.
    variable_list saved{weight.requires_grad() ? x : kept(x), x.requires_grad() ? weight : kept(weight),
                        bias.has_value() ? kept(*bias) : at::Tensor()};
    for (const at::Tensor& p : params) saved.push_back(kept(p));
    ctx->save_for_backward(saved);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const std::optional<at::Tensor> bias = saved[2].defined() ? std::optional<at::Tensor>(saved[2]) : std::nullopt;
    const Tensors params(saved.begin() + 3, saved.end());
    const c10::List<bool> needs = needs_of(ctx, bias.has_value(), params.size());
    if (!any_of(needs, 0, needs.size())) return by_argument(needs, {});
    const std::string& program = ctx->saved_data["program"].toStringRef();
    const at::Tensor &x = saved[0], &weight = saved[1];
    if (at::GradMode::is_enabled())
      return by_argument(needs, gemm_epilogue_vjp(grad_outputs[0], x, weight, bias, params, program, needs));
    const at::Tensor gemm_out = at::linear(x, weight, bias);
    return by_argument(needs, gradients_at_gemm_out(grad_outputs[0], at::Tensor(), x, weight, gemm_out, params,
                                                    program, needs, linear_dtypes(x, weight, bias)));
  }
};

at::Tensor gemm_epilogue_autograd(const at::Tensor& x, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, at::TensorList params,
                                  c10::string_view program) {
  if (!records_gradients(x, weight, bias, params)) return inference_below_autograd(x, weight, bias, params, program);
  return GemmEpilogue::apply(x, weight, bias, params, program);
}

}  // namespace
}  // namespace fxfuse

// tests/test_cpp_autograd.py builds this file alone with FXFUSE_AUTOGRAD_KEY=AutogradCPU, so that the CPU-only CI
// runs these formulas (over the ops' CPU references).
#ifndef FXFUSE_AUTOGRAD_KEY
#define FXFUSE_AUTOGRAD_KEY AutogradCUDA
#endif
TORCH_LIBRARY_IMPL(fxfuse, FXFUSE_AUTOGRAD_KEY, m) {
  m.impl("gemm_epilogue", &fxfuse::gemm_epilogue_autograd);
  m.impl("gemm_epilogue_train", &fxfuse::gemm_epilogue_train_autograd);
}
