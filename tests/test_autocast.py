"""Optimized and compiled models under torch.autocast: the fused op runs its GEMM and epilogue in autocast's
lower precision, as eager's linear does, and returns the dtype eager's ops would (bf16 after a GELU, fp32 after
an fp32 parameter is added, or after an op autocast runs in fp32 on CUDA), with gradients in the weights' dtype.
"""
import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fxfuse
from fxfuse.testing import assert_close_report, fused_op_count

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class LinearThen(nn.Module):
    def __init__(self, tail, in_features=32, out_features=24):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.shift = nn.Parameter(torch.randn(out_features))
        self.norm = nn.GroupNorm(4, out_features)
        self.tail = tail

    def forward(self, x):
        return self.tail(self, self.fc(x))


TAILS = {
    "gelu": lambda m, h: F.gelu(h),                                     # bf16 under autocast
    "plus an fp32 parameter": lambda m, h: F.silu(h) + m.shift,          # promoted to fp32
    "group_norm-hardtanh": lambda m, h: F.hardtanh(m.norm(h), -2.0, 2.0),  # fp32 on CUDA (group_norm's policy)
    "row min plus bias": lambda m, h: torch.min(m.norm(h), 1, keepdim=True)[0] + 1.5,
}


class FusedOpDtypes(TorchDispatchMode):
    """Records the dtypes of (x, weight) of every fused-op call, as the kernels get them (below autocast)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fxfuse":
            self.seen.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def _models(name, device, mode):
    torch.manual_seed(0)
    model = LinearThen(TAILS[name]).to(device).train(mode == "train")
    x = torch.randn(16, 32, device=device)
    return model, x


def _check_under_autocast(model, candidate, x, device, spy=True):
    """`candidate` under autocast returns eager's dtype and values; with `spy`, its fused op got bf16 x and weight
    (a dispatch mode would stop torch.compile's code from running: compiled models are checked without it)."""
    with torch.autocast(device, dtype=torch.bfloat16):
        expected = model(x)
        with FusedOpDtypes() if spy else contextlib.nullcontext() as spied:
            actual = candidate(x)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    if spy:
        assert spied.seen and all(seen == (torch.bfloat16, torch.bfloat16) for seen in spied.seen), spied.seen
    assert_close_report(actual.float(), expected.float(), rtol=1e-2, atol=1e-2)
    return actual


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", sorted(TAILS))
def test_optimized_model_under_autocast(name, mode):
    model, x = _models(name, "cpu", mode)
    optimized = fxfuse.optimize(model, (x,))
    assert fused_op_count(optimized) == 1
    actual = _check_under_autocast(model, optimized, x, "cpu")
    if mode == "train":  # the casts are autograd's: the gradients come back in the weights' dtype
        actual.float().sum().backward()
        assert model.fc.weight.grad.dtype == torch.float32 and model.fc.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", sorted(TAILS))
def test_compiled_model_under_autocast(name, inner):
    model, x = _models(name, "cpu", "eval")
    backend = fxfuse.make_backend(inner=inner)
    compiled = torch.compile(model, backend=backend)
    _check_under_autocast(model, compiled, x, "cpu", spy=False)
    assert [len(report.fused) for report in backend.reports] == [1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(TAILS))
def test_optimized_model_under_cuda_autocast_runs_the_kernels(name, caplog):
    """On CUDA autocast runs group_norm in fp32: eager's result is fp32 there, and so is fxfuse's; the fused op
    gets bf16 tensors only, which the kernels take (no fallback logged)."""
    model, x = _models(name, "cuda", "eval")
    optimized = fxfuse.optimize(model, (x,))
    with caplog.at_level("DEBUG", logger="fxfuse"):
        _check_under_autocast(model, optimized, x, "cuda")
    assert not [r for r in caplog.records if "runs the reference" in r.getMessage()]
