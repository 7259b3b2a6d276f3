"""GPU training through the fused ops (``pytest -m cuda``): float32 and bfloat16 gradients of the four examples
match eager, under optimize() of the model in train mode (the training op, gemm_epilogue_train: its CUDA forward
keeps the GEMM output, the backward reuses it) and in eval mode (the inference op, whose backward recomputes the
forward), and under torch.compile(backend="fxfuse") (the training op, through Inductor); an optimizer step on
the GPU is eager's step; the C++ autograd formulas that CUDA tensors get (kernels/autograd.cpp) pass opcheck and
give the Python ones' gradients, second-order ones included. Skipped without a GPU (tests/conftest.py).

bfloat16 is judged against a float64 reference: the fused gradients may be no further from it than twice
eager bfloat16's own distance, plus a small floor.
"""
import copy

import pytest
import torch
import torch.nn as nn

import fxfuse
from fxfuse import kernels
from fxfuse.modelfile import example_files, load_model_file
from fxfuse.testing import assert_close_report, assert_gradients_match, fused_op_count, gradients
from test_cuda_kernels import relative_error
from test_opcheck import make_args
from test_training import check_second_order_gradients

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]

EXAMPLES = {path.stem: path for path in example_files()}


def _example_on(name, device, dtype=torch.float32):
    model, inputs = load_model_file(EXAMPLES[name], small=True).build()
    return model.to(device, dtype), [t.to(device, dtype) for t in inputs]


HOW = ["optimize-train", "optimize-eval", "compile"]


def _ops(report) -> list[str]:
    return [row.op for row in report.fused]


class _CheckedCompile:
    """torch.compile with the fxfuse backend (Inductor on the GPU) that checks, once called, what was fused: one
    training op per graph, as the graphs are compiled under grad mode."""

    def __init__(self, model):
        self.backend = fxfuse.make_backend()
        self.compiled = torch.compile(model, backend=self.backend)

    def __call__(self, *inputs):
        out = self.compiled(*inputs)
        assert self.backend.reports and all(_ops(r) == ["gemm_epilogue_train"] for r in self.backend.reports)
        return out


def _fused(model, inputs, how):
    if how == "compile":
        return _CheckedCompile(model)
    optimized = fxfuse.optimize(model.train(how == "optimize-train"), inputs)
    assert fused_op_count(optimized) == 1
    assert _ops(optimized.fxfuse_report) == ["gemm_epilogue_train" if how == "optimize-train" else "gemm_epilogue"]
    return optimized


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_float32_gradients_match_eager(name, how, device="cuda"):
    model, inputs = _example_on(name, device)
    assert_gradients_match(model, _fused(model, inputs, how), inputs, rtol=1e-4, atol=1e-4)


def _relative_errors(grads, reference):
    return [((g.double() - r).abs().max() / r.abs().max().clamp_min(1e-12)).item() for g, r in zip(grads, reference)]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("slopes, x_shape", [(1, (64, 96)), (256, (64, 96)), (40, (1, 40, 96)), (40, (2, 40, 96))],
                         ids=["one-slope", "per-feature", "per-row-of-3d", "per-token-of-3d"])
def test_prelu_gradients_match_eager(slopes, x_shape, how):
    """The slopes' gradients too: summed over rows on the device (one, per feature), per row, or by the reference."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 256), nn.PReLU(slopes, init=-0.3)).cuda()
    x = torch.randn(*x_shape, device="cuda")
    assert_gradients_match(model, _fused(model, [x], how), [x], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_bfloat16_gradients_as_close_to_float64_as_eager(name, how, device="cuda"):
    model, inputs = _example_on(name, device, torch.bfloat16)
    reference_model = copy.deepcopy(model).double()
    reference = gradients(reference_model, [t.double() for t in inputs], list(reference_model.parameters()))
    params = list(model.parameters())
    eager_errors = _relative_errors(gradients(model, inputs, params), reference)
    fused_errors = _relative_errors(gradients(_fused(model, inputs, how), inputs, params), reference)
    names = ["input"] + [name for name, _ in model.named_parameters()]
    for what, fused_error, eager_error in zip(names, fused_errors, eager_errors):
        assert fused_error <= 2 * eager_error + 2e-3, \
            f"{what}: bf16 gradient off float64 by {fused_error:.2e} (eager bf16: {eager_error:.2e})"


@pytest.mark.parametrize("program", ["layer_norm(%0,$0,$1,1e-05);amin(%1,-1,True)",
                                     "group_norm(%0,$0,$1,16,1e-05);hardtanh(%1,-1.0,1.0)"])
@pytest.mark.parametrize("kind", ["gemm_epilogue", "gemm_epilogue_train"])
def test_autocast_gradients_as_close_to_float64_as_eager(kind, program):
    """Under CUDA's bf16 autocast, with bf16 params, the fused kernels compute the norm in fp32 as eager does. The
    inference op's backward recomputed the forward by the reference's ops in bf16, rounding each op's result: a
    row min's gradient went to the ties of the rounded values (8-14% off float64, against eager's 0.2%)."""
    from fxfuse.program import run_reference

    torch.manual_seed(0)
    m, k, n = 64, 96, 1024
    x = torch.randn(m, k, device="cuda", requires_grad=True)
    weight = (torch.randn(n, k, device="cuda") * k ** -0.5).requires_grad_()
    bias = torch.randn(n, device="cuda", requires_grad=True)
    params = [torch.randn(n, device="cuda").bfloat16().requires_grad_() for _ in range(2)]
    leaves = [x, weight, bias, *params]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = run_reference(x, weight, bias, params, program)
        fused = getattr(torch.ops.fxfuse, kind)(x, weight, bias, params, program)
    fused = fused[0] if kind == "gemm_epilogue_train" else fused
    grad_output = torch.randn_like(eager)
    eager_grads = torch.autograd.grad(eager, leaves, grad_output)
    fused_grads = torch.autograd.grad(fused, leaves, grad_output)
    exact = [t.detach().bfloat16().double().requires_grad_() for t in leaves]  # what autocast computes with
    reference = torch.autograd.grad(run_reference(*exact[:3], exact[3:], program), exact, grad_output.double())
    for what, fused_grad, eager_grad, exact_grad in zip(["x", "weight", "bias", "p0", "p1"], fused_grads,
                                                        eager_grads, reference):
        fused_error = relative_error(fused_grad, exact_grad)
        eager_error = relative_error(eager_grad, exact_grad)
        assert fused_error <= 2 * eager_error + 2e-3, \
            f"{what}: gradient off float64 by {fused_error:.2e} (eager under autocast: {eager_error:.2e})"


class MLP(nn.Module):
    def __init__(self, features=256, hidden=512):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.shift = nn.Parameter(torch.randn(hidden) * 0.1)
        self.norm = nn.GroupNorm(16, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.scale = nn.Parameter(torch.rand(hidden) + 0.5)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x):
        h = self.norm(nn.functional.mish(self.fc1(x) + self.shift))
        return self.head(nn.functional.hardtanh(self.fc2(h) * self.scale))


@pytest.mark.parametrize("how", ["optimize", "compile"])
def test_adamw_steps_match_eager(how, device="cuda"):
    eager = MLP().to(device)
    fused_copy = copy.deepcopy(eager)
    data = [(torch.randn(64, 256, device=device), torch.randint(0, 10, (64,), device=device)) for _ in range(3)]
    if how == "optimize":
        model = fxfuse.optimize(fused_copy, (data[0][0],))
        assert _ops(model.fxfuse_report) == ["gemm_epilogue_train"] * 2
    else:
        model = torch.compile(fused_copy, backend="fxfuse")
    for net in (eager, model):
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        for x, target in data:
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x), target).backward()
            optimizer.step()
    for (name, expected), actual in zip(eager.named_parameters(), fused_copy.parameters()):
        assert_close_report(actual, expected, rtol=1e-3, atol=1e-4, what=f"{name} after 3 AdamW steps")


# ---------------------------------------------------------------- the C++ autograd formulas (kernels/autograd.cpp)

def _cuda_op_args(name, requires_grad):
    assert kernels.load()
    x, weight, bias, params, program = make_args(name, requires_grad=requires_grad)
    to_cuda = lambda t: None if t is None else t.detach().cuda().requires_grad_(requires_grad)  # noqa: E731
    return to_cuda(x), to_cuda(weight), to_cuda(bias), [to_cuda(p) for p in params], program


@pytest.mark.parametrize("kind", ["gemm_epilogue", "gemm_epilogue_train"])
def test_cuda_tensors_get_the_cpp_autograd_formula(kind):
    x, weight, bias, params, program = _cuda_op_args("workload-1", requires_grad=True)
    out = getattr(torch.ops.fxfuse, kind)(x, weight, bias, params, program)
    node = (out[0] if isinstance(out, tuple) else out).grad_fn.name()
    expected = "GemmEpilogueTrain" if kind == "gemm_epilogue_train" else "GemmEpilogue"
    assert node.startswith("torch::autograd::CppNode<") and node.endswith(f"::{expected}>"), \
        f"{kind}'s backward node is {node}"


@pytest.mark.parametrize("requires_grad", [True, False], ids=["grad", "no-grad"])
@pytest.mark.parametrize("name", ["workload-1", "workload-2-broadcast", "rms_norm-silu", "outside-operand",
                                  "layer_norm-gelu-tanh"])
@pytest.mark.parametrize("kind", ["gemm_epilogue", "gemm_epilogue_train"])
def test_fused_ops_pass_opcheck_on_the_gpu(kind, name, requires_grad):
    torch.library.opcheck(getattr(torch.ops.fxfuse, kind).default, _cuda_op_args(name, requires_grad))


@pytest.mark.parametrize("kind", ["gemm_epilogue", "gemm_epilogue_train"])
def test_double_backward_on_the_gpu(kind):
    assert kernels.load()
    check_second_order_gradients(kind, "cuda")


def test_training_op_gradients_without_bias_and_with_leading_dims_and_only_some_wanted():
    assert kernels.load()
    x, weight, _, params, program = make_args("rms_norm-silu")  # x: (2, 3, K)
    cases = {"all": (True, True, True), "params only": (False, False, True), "x only": (True, False, False)}
    for case, (x_grad, weight_grad, params_grad) in cases.items():
        results = []
        for device in ("cpu", "cuda"):
            leaves = [x.detach().to(device).requires_grad_(x_grad),
                      weight.detach().to(device).requires_grad_(weight_grad),
                      *(p.detach().to(device).requires_grad_(params_grad) for p in params)]
            out, gemm_out = torch.ops.fxfuse.gemm_epilogue_train(leaves[0], leaves[1], None, leaves[2:], program)
            wanted = [leaf for leaf in leaves if leaf.requires_grad]
            results.append(torch.autograd.grad((out.square().sum(), gemm_out.sum()), wanted))
        for i, (actual, expected) in enumerate(zip(results[1], results[0])):
            assert_close_report(actual.cpu(), expected, rtol=1e-4, atol=1e-4, what=f"{case}: gradient {i}")
