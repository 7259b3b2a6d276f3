"""GPU training through the fused ops (``pytest -m cuda``): float32 and bfloat16 gradients of the four examples
match eager, under optimize() of the model in train mode (the training op, gemm_epilogue_train: its CUDA forward
keeps the GEMM output, the backward reuses it) and in eval mode (the inference op, whose backward recomputes the
forward), and under torch.compile(backend="fxfuse") (the training op, through Inductor); an optimizer step on
the GPU is eager's step. Skipped without a GPU (tests/conftest.py).

bfloat16 is judged against a float64 reference: the fused gradients may be no further from it than twice
eager bfloat16's own distance, plus a small floor.
"""
import copy

import pytest
import torch
import torch.nn as nn

import fxfuse
from fxfuse.modelfile import example_files, load_model_file
from fxfuse.testing import assert_close_report, assert_gradients_match, fused_op_count, gradients

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
