"""Training through the fused ops: gradients for the input, the GEMM and every epilogue parameter match eager
(gradcheck in float64, and optimized / compiled models against eager in float32), an optimizer step is the
same step as eager's, and train-mode-only ops (Dropout with p > 0, train-mode BatchNorm) keep eager's
behaviour. Training graphs call ``gemm_epilogue_train``, whose backward reuses the GEMM output it kept
(``epilogue_backward``, then the linear's gradients: no recompute GEMM); an inference graph's ``gemm_epilogue``
stays differentiable by recomputing its forward (``gemm_epilogue_backward``).
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from fxfuse.modelfile import example_files, load_model_file
from fxfuse.program import run_program, run_reference
from fxfuse.testing import assert_close_report, assert_gradients_match, fused_op_count

gemm_epilogue = torch.ops.fxfuse.gemm_epilogue
gemm_epilogue_train = torch.ops.fxfuse.gemm_epilogue_train
FUSED = {"gemm_epilogue": gemm_epilogue, "gemm_epilogue_train": gemm_epilogue_train}

M, K, N = 3, 5, 8

# (program, shapes of params): each epilogue parameter kind the issue names, plus broadcasting and reductions.
GRADCHECK_PROGRAMS = {
    "group_norm_affine": ("group_norm(%0,$0,$1,4,1e-05);clamp(%1,-2.0,2.0)", [(N,), (N,)]),
    "added_bias_vector_then_mish": ("add(%0,$0);clamp(%1,-1.0,1.0);mish(%2);group_norm(%3,$1,$2,2,1e-05)",
                                    [(N,), (N,), (N,)]),
    "scale_vector": ("mul(%0,$0);silu(%1);sub(%2,$1)", [(N,), (N,)]),
    "row_min_then_broadcast_bias": ("group_norm(%0,$0,$1,4,1e-05);amin(%1,1,True);add(%2,$2)",
                                    [(N,), (N,), (1, N, 1, 1)]),
    "layer_norm_gelu_logsumexp": ("layer_norm(%0,$0,$1,1e-05);gelu(%1,'tanh');logsumexp(%2,-1,False)",
                                  [(N,), (N,)]),
    "rms_norm_softmax": ("rms_norm(%0,$0,1e-06);softmax(%1,-1)", [(N,)]),
    "residual_and_outside_input": ("leaky_relu(%0,0.1);add(%1,%1);mul(%2,$0);div(%3,$1)", [(M, N), (N,)]),
    "eval_batch_norm": ("batch_norm(%0,$0,$1,$2,$3,1e-05);elu(%1,1.0,1.0,1.0)", [(N,), (N,), (N,), (N,)]),
    "prelu_per_feature_then_one_slope": ("prelu(%0,$0);prelu(%1,$1)", [(N,), (1,)]),
}


def _op_inputs(param_shapes, x_shape=(M, K), bias=True):
    torch.manual_seed(0)
    make = lambda *shape: torch.randn(*shape, dtype=torch.float64, requires_grad=True)  # noqa: E731
    params = [make(*shape) for shape in param_shapes]
    return make(*x_shape), make(N, K), make(N) if bias else None, params


def _gradcheck_inputs(case):
    program, shapes = GRADCHECK_PROGRAMS[case]
    x, weight, bias, params = _op_inputs(shapes)
    if case == "eval_batch_norm":  # running statistics are buffers: no gradient, and the variance is positive
        params[0].requires_grad_(False)
        params[1] = params[1].detach().abs() + 0.5
    return program, x, weight, bias, params


@pytest.mark.parametrize("kind", sorted(FUSED))
@pytest.mark.parametrize("case", sorted(GRADCHECK_PROGRAMS))
def test_gradcheck_float64(case, kind):
    """The training op is checked on both outputs: the result, and the GEMM output it keeps."""
    program, x, weight, bias, params = _gradcheck_inputs(case)

    def op(x, weight, bias, *params):
        return FUSED[kind](x, weight, bias, list(params), program)

    assert torch.autograd.gradcheck(op, (x, weight, bias, *params))


@pytest.mark.parametrize("kind", sorted(FUSED))
def test_gradcheck_without_bias_and_with_leading_dims(kind):
    x, weight, _, params = _op_inputs([(N,), (N,)], x_shape=(2, M, K), bias=False)
    program = "layer_norm(%0,$0,$1,1e-05);hardswish(%1)"
    assert torch.autograd.gradcheck(lambda x, w, g, b: FUSED[kind](x, w, None, [g, b], program),
                                    (x, weight, *params))


@pytest.mark.parametrize("kind", sorted(FUSED))
@pytest.mark.parametrize("case", ["added_bias_vector_then_mish", "residual_and_outside_input"])
def test_gradgradcheck_float64(case, kind):
    program, shapes = GRADCHECK_PROGRAMS[case]
    x, weight, bias, params = _op_inputs(shapes)
    assert torch.autograd.gradgradcheck(lambda *args: FUSED[kind](args[0], args[1], args[2], list(args[3:]),
                                                                  program), (x, weight, bias, *params))


@pytest.mark.parametrize("case", sorted(GRADCHECK_PROGRAMS))
def test_epilogue_backward_matches_finite_differences(case):
    """epilogue_backward's gradients, projected on a random direction, equal the central difference of the
    epilogue's reference along it (float64)."""
    program, x, weight, bias, params = _gradcheck_inputs(case)
    gemm_out = torch.nn.functional.linear(x, weight, bias).detach()
    params = [p.detach() for p in params]
    needs = [True] + [case != "eval_batch_norm" or i >= 2 for i in range(len(params))]  # no running statistics
    inputs = [gemm_out, *params]
    grad_output = torch.randn_like(run_program(gemm_out, params, program))
    grads = iter(torch.ops.fxfuse.epilogue_backward(grad_output, gemm_out, params, program, needs))
    directions = [torch.randn_like(t) if need else torch.zeros_like(t) for t, need in zip(inputs, needs)]
    eps = 1e-6

    def along(step):
        moved = [t + step * d for t, d in zip(inputs, directions)]
        return (run_program(moved[0], moved[1:], program) * grad_output).sum()

    numeric = (along(eps) - along(-eps)) / (2 * eps)
    analytic = sum((next(grads) * d).sum() for d, need in zip(directions, needs) if need)
    assert_close_report(analytic, numeric, rtol=1e-6, atol=1e-6, what="directional derivative")


def _backward_calls():
    """A dispatch mode that records, in order, the fxfuse backward ops it sees (with their needs_grad) and GEMMs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    gemms = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
    backward_ops = {torch.ops.fxfuse.gemm_epilogue_backward.default, torch.ops.fxfuse.epilogue_backward.default}

    class RecordBackwardCalls(TorchDispatchMode):
        calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in backward_ops:
                self.calls.append((func._opname, list(args[-1])))
            elif func in gemms:
                self.calls.append(("gemm", None))
            return func(*args, **(kwargs or {}))

    return RecordBackwardCalls()


@pytest.mark.parametrize("trained", ["all", "x", "weight", "bias", "params"])
def test_training_op_backward_reuses_the_gemm_output(trained):
    """No recompute GEMM: one epilogue_backward, then a GEMM for x's gradient and one for weight's, if asked."""
    program, shapes = GRADCHECK_PROGRAMS["group_norm_affine"]
    x, weight, bias, params = _op_inputs(shapes)
    if trained != "all":
        x, weight, bias = [t if name == trained else t.detach() for name, t in zip(("x", "weight", "bias"),
                                                                                   (x, weight, bias))]
        params = params if trained == "params" else [p.detach() for p in params]
    wanted = [t for t in (x, weight, bias, *params) if t.requires_grad]
    grad_output = torch.randn(M, N, dtype=torch.float64)
    out, _ = gemm_epilogue_train(x, weight, bias, params, program)
    with _backward_calls() as recorder:
        grads = torch.autograd.grad(out, wanted, grad_output)
    expected = torch.autograd.grad(run_reference(x, weight, bias, params, program), wanted, grad_output)
    for actual, wanted_grad in zip(grads, expected):
        assert_close_report(actual, wanted_grad, rtol=1e-10, atol=1e-10)
    linear_trained = trained in ("all", "x", "weight", "bias")
    gemms = (trained in ("all", "x")) + (trained in ("all", "weight"))
    assert recorder.calls == [("epilogue_backward", [linear_trained] + [trained in ("all", "params")] * 2)] \
        + [("gemm", None)] * gemms


class SharedScale(nn.Module):
    """Two linears whose epilogues read one parameter, so one fused op's input depends on it too."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 8), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        return torch.tanh(self.fc2(torch.relu(self.fc1(x)) * self.scale)) * self.scale


def check_second_order_gradients(kind, device):
    """backward(create_graph=True) through two fused ops of `kind` gives eager's second-order gradients."""
    model = SharedScale().to(device).train(kind == "gemm_epilogue_train")
    x = torch.randn(4, 5, device=device)
    optimized = fxfuse.optimize(model, (x,))
    assert [row.op for row in optimized.fxfuse_report.fused] == [kind] * 2
    params = list(model.parameters())
    results = []
    for net in (model, optimized):
        grads = torch.autograd.grad(net(x).square().sum(), params, create_graph=True)
        results.append(torch.autograd.grad(sum(g.square().sum() for g in grads), params))
    for (name, _), actual, expected in zip(model.named_parameters(), *reversed(results)):
        assert_close_report(actual, expected, rtol=1e-4, atol=1e-5, what=f"second-order gradient of {name}")


@pytest.mark.parametrize("kind", sorted(FUSED))
def test_double_backward_with_a_parameter_shared_by_two_fused_ops(kind):
    """backward(create_graph=True) differentiates each op's reference alone: a parameter that both epilogues
    read gets its gradient once."""
    check_second_order_gradients(kind, "cpu")


def test_only_requested_gradients_are_computed():
    """The backward op is asked only for the gradients autograd needs (no dX GEMM for a frozen input)."""
    program, shapes = GRADCHECK_PROGRAMS["group_norm_affine"]
    x, weight, bias, params = _op_inputs(shapes)
    out = gemm_epilogue(x.detach(), weight.detach(), bias, params, program)
    with _backward_calls() as recorder:
        grads = torch.autograd.grad(out.sum(), [bias, params[1]])
    assert all(g is not None for g in grads)
    # x and weight are detached: no dX or dW. gamma was not asked for, but it requires grad, and that is all
    # the Python formula is told (ctx.needs_input_grad says the same), so it is computed too. (The C++ formula on
    # CUDA asks the engine, which leaves gamma out: tests/test_cpp_autograd.py.)
    assert recorder.calls == [("gemm_epilogue_backward", [False, False, True, True, True])]


# ---------------------------------------------------------------- whole models against eager, float32

EXAMPLES = {path.stem: path for path in example_files()}


def _example(name, seed=0):
    model, inputs = load_model_file(EXAMPLES[name], small=True).build(seed)
    return model, inputs


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_optimized_example_gradients_match_eager(name, mode):
    """A train-mode model gets the training op; an eval-mode one the inference op, which trains all the same."""
    model, inputs = _example(name)
    optimized = fxfuse.optimize(model.train(mode == "train"), inputs)
    assert fused_op_count(optimized) == 1
    expected_op = "gemm_epilogue_train" if mode == "train" else "gemm_epilogue"
    assert [row.op for row in optimized.fxfuse_report.fused] == [expected_op]
    assert_gradients_match(model, optimized, inputs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("inputs_require_grad", [False, True])
def test_frozen_model_gets_the_inference_op_unless_an_example_input_requires_grad(inputs_require_grad):
    model, inputs = _example("linear_groupnorm_hardtanh")
    model.train().requires_grad_(False)
    inputs = [t.clone().requires_grad_(inputs_require_grad) for t in inputs]
    optimized = fxfuse.optimize(model, inputs)
    expected_op = "gemm_epilogue_train" if inputs_require_grad else "gemm_epilogue"
    assert [row.op for row in optimized.fxfuse_report.fused] == [expected_op]
    assert_gradients_match(model, optimized, inputs, params=[])


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_compiled_example_gradients_match_eager(name, inner):
    torch._dynamo.reset()
    model, inputs = _example(name)
    backend = fxfuse.make_backend(inner=inner)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    assert_gradients_match(model, compiled, inputs, rtol=1e-4, atol=1e-5)
    assert [len(r.fused) for r in backend.reports] == [1]


class MLP(nn.Module):
    """Two fused GEMM blocks with every kind of epilogue parameter, trained end to end."""

    def __init__(self, features=16, hidden=32):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.shift = nn.Parameter(torch.randn(hidden) * 0.1)
        self.norm = nn.GroupNorm(4, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.scale = nn.Parameter(torch.rand(hidden) + 0.5)
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, 3)

    def forward(self, x):
        h = self.norm(torch.nn.functional.mish(self.fc1(x) + self.shift))
        h = self.ln(torch.relu(self.fc2(h)) * self.scale)
        return self.head(h)


def _train(model, steps, optimizer_class, data, **optimizer_args):
    optimizer = optimizer_class(model.parameters(), **optimizer_args)
    losses = []
    for x, target in data[:steps]:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("how", ["optimize", "compile"])
@pytest.mark.parametrize("optimizer", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                       (torch.optim.AdamW, {"lr": 1e-2})], ids=["sgd", "adamw"])
def test_optimizer_steps_match_eager(how, optimizer):
    torch._dynamo.reset()
    eager = MLP().train()
    fused_copy = copy.deepcopy(eager)
    data = [(torch.randn(6, 16), torch.randint(0, 3, (6,))) for _ in range(3)]
    if how == "optimize":
        model = fxfuse.optimize(fused_copy, (data[0][0],))
        assert fused_op_count(model) == 2
        assert [row.op for row in model.fxfuse_report.fused] == ["gemm_epilogue_train"] * 2
    else:
        backend = fxfuse.make_backend(inner="eager")
        model = torch.compile(fused_copy, backend=backend)
    optimizer_class, args = optimizer
    expected = _train(eager, 3, optimizer_class, data, **args)
    actual = _train(model, 3, optimizer_class, data, **args)
    if how == "compile":
        assert [row.op for r in backend.reports for row in r.fused] == ["gemm_epilogue_train"] * 2
    assert actual == pytest.approx(expected, rel=1e-5, abs=1e-6)
    for (name, p_eager), p_fused in zip(eager.named_parameters(), fused_copy.parameters()):
        assert_close_report(p_fused, p_eager, rtol=1e-4, atol=1e-5, what=f"parameter {name} after 3 steps")


def test_optimized_parameters_are_the_trained_ones():
    model = MLP().train()
    optimized = fxfuse.optimize(model, (torch.randn(4, 16),))
    _train(optimized, 1, torch.optim.SGD, [(torch.randn(4, 16), torch.randint(0, 3, (4,)))], lr=0.5)
    assert all(p.grad is not None for p in model.parameters())


# ---------------------------------------------------------------- train-mode-only ops

class WithTrainModeOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return torch.relu(self.drop(self.bn(self.fc(x))))


def test_train_mode_dropout_and_batch_norm_are_not_fused_and_behave_as_eager():
    eager = WithTrainModeOps().train()
    fused_copy = copy.deepcopy(eager)
    x = torch.randn(8, 16)
    optimized = fxfuse.optimize(fused_copy, (x,))
    assert fused_op_count(optimized) == 0
    torch.manual_seed(3)
    expected = eager(x)
    torch.manual_seed(3)
    actual = optimized(x)
    assert_close_report(actual, expected)
    assert (expected == 0).float().mean() > 0.3  # dropout did drop
    assert_close_report(fused_copy.bn.running_mean, eager.bn.running_mean, what="running_mean")
    assert_close_report(fused_copy.bn.running_var, eager.bn.running_var, what="running_var")


def test_train_mode_ops_under_compile_behave_as_eager_in_both_modes():
    torch._dynamo.reset()
    eager = WithTrainModeOps().train()
    fused_copy = copy.deepcopy(eager)
    backend = fxfuse.make_backend(inner="eager")
    compiled = torch.compile(fused_copy, backend=backend)
    x = torch.randn(8, 16)
    torch.manual_seed(3)
    expected = eager(x)
    torch.manual_seed(3)
    assert_close_report(compiled(x), expected)
    assert_close_report(fused_copy.bn.running_mean, eager.bn.running_mean, what="running_mean")
    assert len(backend.reports[-1].fused) == 0
    eager.eval(), fused_copy.eval()
    assert_close_report(compiled(x), eager(x))
    assert len(backend.reports[-1].fused) == 1  # eval mode: BatchNorm folded, Dropout is the identity


def test_eval_mode_fusion_refuses_to_run_in_train_mode():
    model = WithTrainModeOps().eval()
    x = torch.randn(8, 16)
    optimized = fxfuse.optimize(model, (x,))
    assert fused_op_count(optimized) == 1
    assert_close_report(optimized(x), model(x))
    optimized.train()
    with pytest.raises(RuntimeError, match="was in eval mode when it was fused"):
        optimized(x)


def test_backward_op_passes_opcheck_and_matches_autograd():
    program, shapes = GRADCHECK_PROGRAMS["residual_and_outside_input"]
    x, weight, bias, params = _op_inputs(shapes)
    detached = [t.detach() for t in (x, weight, bias, *params)]
    grad_output = torch.randn(M, N, dtype=torch.float64)
    needs = [True, True, False, True, True]
    args = (grad_output, *detached[:3], detached[3:], program, needs)
    torch.library.opcheck(torch.ops.fxfuse.gemm_epilogue_backward.default, args)
    grads = torch.ops.fxfuse.gemm_epilogue_backward(*args)
    expected = torch.autograd.grad(gemm_epilogue(x, weight, bias, params, program), [x, weight, *params], grad_output)
    assert len(grads) == 4
    for actual, wanted in zip(grads, expected):
        assert_close_report(actual, wanted, rtol=1e-10, atol=1e-10)


def test_backward_runs_under_a_dispatch_mode():
    """The backward op re-enables autograd inside its kernel, so a TorchDispatchMode above it is no problem."""
    from torch.utils.flop_counter import FlopCounterMode

    model = nn.Sequential(nn.Linear(16, 32), nn.GroupNorm(4, 32), nn.ReLU())
    optimized = fxfuse.optimize(model, (torch.randn(4, 16),))
    x = torch.randn(4, 16)
    cotangent = torch.randn(4, 32)
    grads = []
    for net in (model, optimized):
        model.zero_grad()
        with FlopCounterMode(display=False):
            (net(x) * cotangent).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for (name, _), expected, actual in zip(model.named_parameters(), *grads):
        assert_close_report(actual, expected, what=f"gradient of {name}")


def test_eval_mode_fusion_check_survives_torch_compile():
    torch._dynamo.reset()
    model = WithTrainModeOps().eval()
    x = torch.randn(8, 16)
    compiled = torch.compile(fxfuse.optimize(model, (x,)), backend=fxfuse.make_backend(inner="eager"))
    assert_close_report(compiled(x), model(x))
    model.train()  # the modules are shared: the optimized graph sees the change
    with pytest.raises(RuntimeError, match="was in eval mode when it was fused"):
        compiled(x)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_mixed_precision_step_is_as_close_to_float64_as_eager(mode):
    """The usual AMP loop: the forward under autocast (the GEMM in bf16, the weights kept in fp32), the backward
    outside it. The gradients come back in the weights' dtype, as autocast's casts give them, and no further from
    float64's than eager's (in eval mode the inference op's backward recomputes its forward, in fp32)."""
    torch.manual_seed(0)
    x, target = torch.randn(64, 32), torch.randn(64, 16)
    model = nn.Sequential(nn.Linear(32, 16), nn.GELU(), nn.LayerNorm(16)).train(mode == "train")
    optimized = fxfuse.optimize(model, (x,))
    assert fused_op_count(optimized) == 1
    reference = copy.deepcopy(model).double()
    (reference(x.double()) * target.double()).sum().backward()
    errors = {}
    for name, module in (("eager", model), ("fxfuse", optimized)):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        (out.float() * target).sum().backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        errors[name] = [((p.grad.double() - r.grad).norm() / r.grad.norm()).item()
                        for p, r in zip(model.parameters(), reference.parameters())]
    for fused, eager in zip(errors["fxfuse"], errors["eager"]):
        assert fused <= 2 * eager + 1e-3, (errors["fxfuse"], errors["eager"])


class _OnBoundsAndTies(nn.Module):
    """Integer weights and inputs: the GEMM output is small integers, so Hardtanh(-2, 2) and ReLU6 see values
    exactly on their bounds, and the rows' max and min are tied between several features."""

    def __init__(self, tail):
        super().__init__()
        self.fc = nn.Linear(6, 12)
        self.tail = tail
        with torch.no_grad():
            self.fc.weight.copy_(torch.randint(-1, 2, self.fc.weight.shape))
            self.fc.bias.copy_(torch.randint(-1, 2, self.fc.bias.shape))

    def forward(self, x):
        return self.tail(self.fc(x))


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("spelling, canonical", [
    (lambda h: nn.functional.hardtanh(h, -2.0, 2.0), "hardtanh"),
    (lambda h: nn.functional.relu6(h * 3.0), "hardtanh"),
    (lambda h: torch.clamp(h, -2.0, 2.0), "clamp"),
    (lambda h: torch.max(h, 1).values, "max_dim"),
    (lambda h: torch.min(h, -1, keepdim=True)[0] * 2.0, "min_dim"),
    (lambda h: torch.amax(h, 1), "amax"),
    (nn.PReLU(12, init=-0.5), "prelu"),
], ids=["hardtanh", "relu6", "clamp", "max.values", "min[0]", "amax", "prelu"])
def test_gradients_on_bounds_and_ties_are_eagers(spelling, canonical, mode):
    """Hardtanh's gradient is 0 on its bounds and clamp's is 1; torch.max(h, dim) gives a tied row's gradient
    to the first extreme element and amax splits it: each spelling keeps its own, exactly."""
    torch.manual_seed(0)
    model = _OnBoundsAndTies(spelling).train(mode == "train")
    x = torch.randint(-2, 3, (16, 6)).float()
    h = model.fc(x)
    assert (h == 2).any() and (h == -2).any(), "values on the bounds"
    assert ((h == h.amax(1, keepdim=True)).sum(1) > 1).any() and ((h == h.amin(1, keepdim=True)).sum(1) > 1).any()
    optimized = fxfuse.optimize(model, (x,))
    (program,) = [row.program for row in optimized.fxfuse_report.fused]
    assert f"{canonical}(" in program, program
    assert_gradients_match(model, optimized, [x], rtol=0, atol=0)


class LinearPReLU(nn.Module):
    def __init__(self, slopes):
        super().__init__()
        self.fc = nn.Linear(6, 12)
        self.act = nn.PReLU(slopes, init=0.1)
        with torch.no_grad():
            self.act.weight.uniform_(-1.0, 1.0)

    def forward(self, x):
        return self.act(self.fc(x))


@pytest.mark.parametrize("how", ["optimize", "compile"])
@pytest.mark.parametrize("slopes, x_shape", [(1, (16, 6)), (12, (16, 6)), (5, (4, 5, 6))],
                         ids=["one-slope", "per-feature", "per-token-of-3d"])
def test_prelu_slopes_get_eagers_gradients(slopes, x_shape, how):
    """The slopes' gradient is eager's (x * grad where x <= 0, summed over what each slope covers), in training."""
    torch._dynamo.reset()
    model = LinearPReLU(slopes).train()
    x = torch.randn(*x_shape)
    if how == "optimize":
        candidate = fxfuse.optimize(model, (x,))
        assert [row.program for row in candidate.fxfuse_report.fused] == ["prelu(%0,$0)"]
    else:
        backend = fxfuse.make_backend(inner="eager")
        candidate = torch.compile(model, backend=backend, fullgraph=True)
    assert_gradients_match(model, candidate, [x])
    if how == "compile":
        assert [row.program for r in backend.reports for row in r.fused] == ["prelu(%0,$0)"]


class RowMaxWithoutGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 12)

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            m = h.amax(-1, keepdim=True)
        return torch.exp(h - m)


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_region_never_spans_a_grad_mode_switch():
    """Dynamo's graph holds `_set_grad_enabled` around the no_grad block: the amax inside it is not fused with
    the ops after it, so no gradient flows through the max, as in eager."""
    torch.manual_seed(0)
    model, x = RowMaxWithoutGrad().train(), torch.randn(5, 6)
    backend = fxfuse.make_backend(inner="eager")
    compiled = torch.compile(model, backend=backend)
    assert_gradients_match(model, compiled, [x], rtol=1e-5, atol=1e-6)
    reasons = [row.reason for report in backend.reports for row in report.near_misses]
    assert any("switches grad mode" in reason for reason in reasons), reasons


def test_optimize_leaves_a_forward_that_switches_grad_mode_to_its_children():
    """fx records the ops of a `torch.no_grad()` block, not the mode they ran under: a traced graph would give the
    row max a gradient. optimize() says so and leaves the model's own forward (its children are tried)."""
    torch.manual_seed(0)
    model, x = RowMaxWithoutGrad().train(), torch.randn(5, 6)
    optimized = fxfuse.optimize(model, (x,))
    assert_gradients_match(model, optimized, [x], rtol=1e-5, atol=1e-6)
    (skipped,) = optimized.fxfuse_report.skipped
    assert "switches grad mode" in skipped.reason, skipped.reason


class _ClampGradient(torch.autograd.Function):
    """Identity forward whose backward clamps the incoming gradient: an fx trace records only the forward."""

    @staticmethod
    def forward(ctx, h):
        return h.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.clamp(-0.01, 0.01)


class LinearThroughAnAutogradFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 8)

    def forward(self, x):
        return torch.relu(self.linear(_ClampGradient.apply(x)) * 2.0)


_clamp_gradient = _ClampGradient.apply  # an alias made before any trace, as `grad_reverse = GradReverse.apply` is


class LinearThroughAnAliasedAutogradFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 8)

    def forward(self, x):
        return _clamp_gradient(torch.relu(self.linear(x) * 2.0))


@pytest.mark.parametrize("model_class", [LinearThroughAnAutogradFunction, LinearThroughAnAliasedAutogradFunction])
@pytest.mark.parametrize("with_inputs", [True, False])
def test_optimize_leaves_a_forward_that_calls_an_autograd_function_to_its_children(model_class, with_inputs):
    """fx traces an autograd.Function's forward as plain ops and drops its backward, so a traced graph would train
    with other gradients. optimize() says so and leaves the model's own forward (its children are tried); also where
    `Function.apply` was bound before the trace (a module-level alias, which a patched `Function.apply` missed)."""
    torch.manual_seed(0)
    model, x = model_class().train(), torch.randn(5, 6, requires_grad=True)
    optimized = fxfuse.optimize(model, (x,) if with_inputs else None)
    assert_gradients_match(model, optimized, [x], rtol=1e-5, atol=1e-6)
    (skipped,) = optimized.fxfuse_report.skipped
    assert "autograd.Function _ClampGradient" in skipped.reason, skipped.reason


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_forward_that_calls_an_autograd_function_fuses_and_keeps_its_backward():
    torch.manual_seed(0)
    model, x = LinearThroughAnAutogradFunction().train(), torch.randn(5, 6, requires_grad=True)
    compiled, report = _optimized_or_compiled(model, x, "compile")
    assert_gradients_match(model, compiled, [x], rtol=1e-5, atol=1e-6)
    assert len(report().fused) == 1, report()


@pytest.mark.parametrize("in_features, out_features", [(0, 6), (8, 0)])
def test_a_linear_with_no_features_trains(in_features, out_features):
    """The linear's gradients reshaped y's gradient to (-1, 0) rows: ambiguous for a tensor of no elements."""
    model = nn.Sequential(nn.Linear(in_features, out_features), nn.ReLU()).train()
    reference = copy.deepcopy(model)
    x = torch.randn(5, in_features)
    optimized = fxfuse.optimize(model, (x,))
    assert fused_op_count(optimized) == 1
    optimized(x).sum().backward()
    reference(x).sum().backward()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert_close_report(mine.grad, theirs.grad, what="gradient")


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "vmap"])
def test_torch_func_transforms_raise_instead_of_missing_the_fused_op(transform):
    """Under torch.func.jvp a torch.library op without a forward-mode rule gets a zero tangent, silently."""
    model = nn.Sequential(nn.Linear(K, N), nn.ReLU()).eval()
    x = torch.randn(M, K)
    optimized = fxfuse.optimize(model, (x,))
    run = {"jvp": lambda f: torch.func.jvp(f, (x,), (torch.randn_like(x),)),
           "jacfwd": lambda f: torch.func.jacfwd(f)(x),
           "vmap": lambda f: torch.func.vmap(f)(x.unsqueeze(0))}[transform]
    run(model)  # eager takes it
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        run(optimized)


def test_optimize_leaves_a_parametrized_weights_state_as_it_was():
    """Matching read spectral_norm's weight, whose parametrization ran power iterations on the model's buffers."""
    from torch.nn.utils.parametrizations import spectral_norm

    model = nn.Sequential(spectral_norm(nn.Linear(K, N)), nn.ReLU()).train()
    reference = copy.deepcopy(model)
    x = torch.randn(M, K)
    optimized = fxfuse.optimize(model, (x,))
    assert fused_op_count(optimized) == 1
    for (name, mine), theirs in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(mine, theirs), name
    assert_close_report(optimized(x), reference(x))


class _AddsAnInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.ln = nn.LayerNorm(8)

    def forward(self, x, y):
        return self.ln(torch.nn.functional.silu(self.fc(x) + y))


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("made_in_inference_mode", ["x", "y"])
def test_an_inference_tensor_that_eager_does_not_save_trains(mode, made_in_inference_mode):
    """A tensor made under torch.inference_mode can't be saved for the backward: eager's add keeps nothing of y, nor
    a frozen linear of x, so eager trains; the fused op keeps its copy instead of raising."""
    check_an_inference_tensor_that_eager_does_not_save_trains(mode, made_in_inference_mode)


def check_an_inference_tensor_that_eager_does_not_save_trains(mode, made_in_inference_mode):
    """(Also run over the C++ autograd formulas by tests/cpp_autograd_checks.py.)"""
    torch.manual_seed(0)
    model = _AddsAnInput().train(mode == "train")
    model.fc.weight.requires_grad_(False)
    eager = copy.deepcopy(model)
    optimized = fxfuse.optimize(model, (torch.randn(4, 6), torch.randn(4, 8)))
    assert fused_op_count(optimized) == 1
    with torch.inference_mode():
        inputs = {"x": torch.randn(4, 6), "y": torch.randn(4, 8)}
    inputs = [t if name == made_in_inference_mode else t.clone() for name, t in inputs.items()]
    eager(*inputs).pow(2).sum().backward()
    optimized(*inputs).pow(2).sum().backward()
    for (name, p_eager), p_fused in zip(eager.named_parameters(), model.parameters()):
        if p_eager.requires_grad:
            assert_close_report(p_fused.grad, p_eager.grad, rtol=1e-4, atol=1e-5, what=f"{name}'s gradient")


# ---------------------------------------------------------------- in-place activations whose backward eager refuses

class _InPlaceTail(nn.Module):
    """A Linear, then `tail` (a function of h, or a module) on its output."""

    def __init__(self, tail):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.tail = tail

    def forward(self, x):
        return self.tail(self.fc(x))


class _EvalRReLU(nn.RReLU):
    """An RReLU that stays in eval mode (leaky_relu with the bounds' mean) when its model trains."""

    def train(self, mode=True):
        return super().train(False)


# Eager computes these in place and differentiates them from their result: with a negative slope or alpha (or a
# negative mean of rrelu's bounds outside training) its backward raises; there is no Tensor method of these ops.
BACKWARD_REFUSED = {
    "F.leaky_relu(inplace=True)": lambda: (lambda h: F.leaky_relu(h, -0.1, inplace=True)),
    "F.leaky_relu_": lambda: (lambda h: F.leaky_relu_(h, -0.1)),
    "nn.LeakyReLU(inplace=True)": lambda: nn.LeakyReLU(-0.1, inplace=True),
    "leaky_relu(nan slope, inplace=True)": lambda: (lambda h: F.leaky_relu(h, float("nan"), inplace=True)),
    "F.elu(inplace=True)": lambda: (lambda h: F.elu(h, -0.5, inplace=True)),
    "F.elu_": lambda: (lambda h: F.elu_(h, -0.5)),
    "nn.ELU(inplace=True)": lambda: nn.ELU(-0.5, inplace=True),
    "F.celu(inplace=True)": lambda: (lambda h: F.celu(h, -0.5, inplace=True)),
    "torch.celu_": lambda: (lambda h: torch.celu_(h, -0.5)),
    "nn.CELU(inplace=True)": lambda: nn.CELU(-0.5, inplace=True),
    "F.rrelu(training=False, inplace=True)": lambda: (lambda h: F.rrelu(h, -0.3, -0.1, False, True)),
    "torch.rrelu_(training=False)": lambda: (lambda h: torch.rrelu_(h, -0.3, -0.1, False)),
    "nn.RReLU(inplace=True) in eval mode": lambda: _EvalRReLU(-0.3, -0.1, inplace=True),
}
# The same ops where eager's backward takes them: a slope or alpha of 0 or more (-0.0 too); and ops of the same
# family that eager differentiates from their result in place without raising.
BACKWARD_TAKEN = {
    "F.leaky_relu(0.0, inplace=True)": (lambda h: F.leaky_relu(h, 0.0, inplace=True), "leaky_relu_("),
    "F.leaky_relu_(-0.0)": (lambda h: F.leaky_relu_(h, -0.0), "leaky_relu_("),
    "nn.LeakyReLU(0.2, inplace=True)": (nn.LeakyReLU(0.2, inplace=True), "leaky_relu_("),
    "F.elu(0.0, inplace=True)": (lambda h: F.elu(h, 0.0, inplace=True), "elu_("),
    "nn.ELU(inplace=True)": (nn.ELU(inplace=True), "elu_("),
    "torch.celu_(0.5)": (lambda h: torch.celu_(h, 0.5), "elu_("),
    "F.selu(inplace=True)": (lambda h: F.selu(h, inplace=True), "elu_("),
    "F.rrelu_(training=False)": (lambda h: F.rrelu_(h, 0.1, 0.3, False), "leaky_relu_("),
    "F.hardtanh_": (lambda h: F.hardtanh_(h, -0.5, 0.5), "hardtanh_("),
    "F.threshold_": (lambda h: F.threshold_(h, 0.1, -2.0), "threshold_("),
    "F.silu(inplace=True)": (lambda h: F.silu(h, inplace=True), "silu_("),
    "F.mish(inplace=True)": (lambda h: F.mish(h, inplace=True), "mish_("),
    "F.hardswish(inplace=True)": (lambda h: F.hardswish(h, inplace=True), "hardswish_("),
    "F.hardsigmoid(inplace=True)": (lambda h: F.hardsigmoid(h, inplace=True), "hardsigmoid_("),
}


def _backward_error(model, x) -> str | None:
    try:
        model(x).sum().backward()
    except RuntimeError as error:
        return str(error)
    return None


def _optimized_or_compiled(model, x, how: str):
    """The model optimized ("optimize", with x as example input) or compiled with fxfuse's backend ("compile"), and
    a function that gives its report (the compiled model's exists once it has run)."""
    if how == "optimize":
        optimized = fxfuse.optimize(model, (x,))
        return optimized, lambda: optimized.fxfuse_report
    backend = fxfuse.make_backend(inner="eager")
    return torch.compile(model, backend=backend), lambda: backend.reports[0]


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("how", ["optimize", "compile"])
@pytest.mark.parametrize("spelling", sorted(BACKWARD_REFUSED))
def test_an_in_place_activation_whose_backward_eager_refuses_raises_as_eager(spelling, how, mode):
    """In place, eager differentiates leaky_relu and elu (celu, rrelu outside training) from their result, which it
    can't with a negative slope or alpha: its backward raises. A fused op's backward would compute gradients, so the
    op is not fused where the graph may be differentiated (any of optimize()'s: an eval model's parameters still
    require grad), and explain() says why."""
    model, x = _InPlaceTail(BACKWARD_REFUSED[spelling]()).train(mode == "train"), torch.randn(4, 16)
    expected = _backward_error(model, x)
    assert expected is not None and "In-place" in expected, expected
    candidate, report_of = _optimized_or_compiled(model, x, how)
    assert _backward_error(candidate, x) == expected
    report = report_of()
    assert not any("_(" in row.program for row in report.fused), report
    reasons = [row.reason for row in report.near_misses]
    assert any("eager's backward raises" in reason for reason in reasons), report


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("spelling", sorted(BACKWARD_REFUSED))
def test_an_in_place_activation_whose_backward_eager_refuses_fuses_in_a_graph_without_grad(spelling):
    """Dynamo's graph for a call without grad is never differentiated (it guards grad mode): the op fuses there."""
    model, x = _InPlaceTail(BACKWARD_REFUSED[spelling]()).eval(), torch.randn(4, 16)
    backend = fxfuse.make_backend(inner="eager")
    with torch.no_grad():
        expected = model(x.clone())
        actual = torch.compile(model, backend=backend)(x.clone())
    assert_close_report(actual, expected)
    (report,) = backend.reports
    assert [row.program.split("(")[0] for row in report.fused] in (["leaky_relu_"], ["elu_"]), report


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("how", ["optimize", "compile"])
@pytest.mark.parametrize("spelling", sorted(BACKWARD_TAKEN))
def test_an_in_place_activation_whose_backward_eager_takes_fuses_in_training(spelling, how):
    tail, op = BACKWARD_TAKEN[spelling]
    model, x = _InPlaceTail(tail).train(), torch.randn(4, 16)
    candidate, report_of = _optimized_or_compiled(model, x, how)
    assert_gradients_match(model, candidate, [x])
    report = report_of()
    assert [op in row.program for row in report.fused] == [True], report
