"""Helpers for pattern unit tests: prove that a model fuses, and that the fused model is right.

Entry points: ``assert_fuses(model, inputs, regions=1)``, ``assert_not_fused(model, inputs)``,
``fused_op_count(module)`` and ``assert_close_report(actual, expected)``.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from .api import optimize
from .library import gemm_epilogue

DEFAULT_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-7, 1e-7),
                     torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1e-3, 1e-3)}


def fused_op_count(module: nn.Module) -> int:
    """How many fxfuse ops the graphs of `module` (and its submodules) call."""
    return sum(1 for m in module.modules() if isinstance(m, fx.GraphModule)
               for n in m.graph.nodes if n.op == "call_function" and n.target is gemm_epilogue)


def assert_close_report(actual: torch.Tensor, expected: torch.Tensor, rtol=None, atol=None, what="output"):
    """assert_close that names the worst element (index, both values) when it fails."""
    default = DEFAULT_TOLERANCE.get(expected.dtype, (1e-5, 1e-5))
    rtol = default[0] if rtol is None else rtol
    atol = default[1] if atol is None else atol
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != eager's {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != eager's {expected.dtype}"
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError:
        a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
        error = ((a - e).abs() - rtol * e.abs()).nan_to_num(nan=float("inf"))
        flat = int(error.flatten().argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), e.shape)) if e.dim() else ()
        raise AssertionError(f"{what} differs from eager; worst at index {index}: "
                             f"fused {a[index].item()!r} vs eager {e[index].item()!r}") from None


def _outputs(result):
    return result if isinstance(result, (tuple, list)) else (result,)


def assert_fuses(model: nn.Module, inputs: Sequence, regions: int = 1, rtol=None, atol=None,
                 example_inputs: Sequence | None = None) -> nn.Module:
    """Optimize `model`; check the fused-op count, that nothing of the fused chains is left, and numerics.

    Returns the optimized module. `example_inputs` defaults to `inputs`; ``example_inputs=False`` optimizes
    without shapes.
    """
    with torch.no_grad():
        expected = model(*inputs)
    shapes = inputs if example_inputs is None else (None if example_inputs is False else example_inputs)
    optimized = optimize(model, shapes)
    count = fused_op_count(optimized)
    report = optimized.fxfuse_report
    assert count == regions, f"expected {regions} fused region(s), found {count}\n{report}"
    left = {n.name for m in optimized.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes}
    for row in report.fused:
        stale = [name for name in row.replaced if name in left]
        assert not stale, f"nodes {stale} of a fused chain are still in the graph\n{optimized.code}"
    with torch.no_grad():
        actual = optimized(*inputs)
    for i, (a, e) in enumerate(zip(_outputs(actual), _outputs(expected))):
        assert_close_report(a, e, rtol, atol, what=f"output {i}")
    return optimized


def assert_not_fused(model: nn.Module, inputs: Sequence, reason: str | None = None) -> nn.Module:
    """Optimize `model`; check that nothing was fused, that results still match, and (optionally) that
    explain() gives a reason containing `reason`."""
    optimized = assert_fuses(model, inputs, regions=0)
    if reason is not None:
        reasons = [m.reason for m in optimized.fxfuse_report.near_misses + optimized.fxfuse_report.skipped]
        assert any(reason in r for r in reasons), f"no near miss says {reason!r}; got {reasons}"
    return optimized
