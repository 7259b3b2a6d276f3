"""Helpers for pattern unit tests: prove that a model fuses, and that the fused model is right.

Entry points: ``assert_fuses(model, inputs, regions=1)``, ``assert_not_fused(model, inputs)``,
``fused_op_count(module)``, ``exported_ops_reading_inputs(program)``, ``assert_close_report(actual, expected)``,
and for training ``gradients(model, inputs, params)`` and ``assert_gradients_match(model, candidate, inputs)``.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from .api import optimize
from .library import FUSED_OPS

DEFAULT_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-7, 1e-7),
                     torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1e-3, 1e-3)}


def fused_op_count(module: nn.Module) -> int:
    """How many fused ops (``gemm_epilogue`` or ``gemm_epilogue_train``) the graphs of `module` (and its
    submodules) call."""
    return sum(1 for m in module.modules() if isinstance(m, fx.GraphModule)
               for n in m.graph.nodes if n.op == "call_function" and n.target in FUSED_OPS)


def exported_ops_reading_inputs(program: torch.export.ExportedProgram) -> list:
    """The targets of the exported program's calls that read a user input (a pool's weight averaging, which
    reads only parameters, is left out)."""
    user_inputs = set(program.graph_signature.user_inputs)
    return [n.target for n in program.graph.nodes if n.op == "call_function" and
            any(a.name in user_inputs for a in n.all_input_nodes)]


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


def gradients(model, inputs: Sequence, params: Sequence[torch.Tensor], seed: int = 1234) -> list:
    """Gradients of ``(model(*inputs) * cotangent).sum()`` for each floating input, then each of `params`.

    The cotangent is random (fixed by `seed`), not ones: the gradient of a plain ``sum()`` through a norm is
    zero in exact arithmetic, which would hide wrong gradients.
    """
    inputs = [t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
              for t in inputs]
    outputs = _outputs(model(*inputs))
    generator = torch.Generator(device="cpu").manual_seed(seed)
    loss = sum((out * torch.randn(out.shape, generator=generator, dtype=out.dtype).to(out.device)).sum()
               for out in outputs)
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad] + list(params)
    return list(torch.autograd.grad(loss, wanted, allow_unused=True))


def assert_gradients_match(model: nn.Module, candidate, inputs: Sequence, rtol=None, atol=None,
                           params: Sequence[torch.Tensor] | None = None) -> None:
    """The gradients of `candidate` (an optimized or compiled `model`) for the inputs and for every
    parameter of `model` (shared with `candidate`, or given as `params`) equal eager's."""
    params = [p for p in model.parameters() if p.requires_grad] if params is None else list(params)
    expected = gradients(model, inputs, params)
    actual = gradients(candidate, inputs, params)
    names = [f"input {i}" for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    by_identity = {id(p): name for name, p in model.named_parameters()}
    names += [f"parameter {by_identity.get(id(p), '?')}" for p in params]
    for name, a, e in zip(names, actual, expected):
        assert (a is None) == (e is None), f"gradient of {name}: {'missing' if a is None else 'unexpected'}"
        if a is not None:
            assert_close_report(a, e, rtol, atol, what=f"gradient of {name}")
