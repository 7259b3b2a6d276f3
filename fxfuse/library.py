"""The fused op as torch.library ops: schema, reference implementation, fake implementation and autograd.

Entry points: ``torch.ops.fxfuse.gemm_epilogue`` (what rewritten graphs call) and
``torch.ops.fxfuse.gemm_epilogue_fallback`` (the same op pinned to the reference, plus the reason; the CUDA
implementation calls it for inputs its kernels don't take, and it logs that reason at debug level).

    gemm_epilogue(Tensor x, Tensor weight, Tensor? bias, Tensor[] params, str program) -> Tensor

computes ``linear(x, weight, bias)`` followed by ``program`` (``fxfuse.program``). Every device runs the
reference interpreter, except CUDA once ``fxfuse.kernels`` has loaded its kernels, whose
``TORCH_LIBRARY_IMPL(fxfuse, CUDA, ...)`` takes precedence. The fake implementation is the same reference
run on fake tensors, so shapes, dtypes and broadcasting are eager's by construction.
"""
from __future__ import annotations

import logging

import torch

from .program import run_reference

logger = logging.getLogger("fxfuse")

NAMESPACE = "fxfuse"
ARGS = "Tensor x, Tensor weight, Tensor? bias, Tensor[] params, str program"
SCHEMAS = {
    "gemm_epilogue": f"({ARGS}) -> Tensor",
    "gemm_epilogue_fallback": f"({ARGS}, str reason) -> Tensor",
}

_library = torch.library.Library(NAMESPACE, "DEF")


def run_fallback(x, weight, bias, params, program, reason):
    logger.debug("gemm_epilogue runs the reference: %s", reason)
    return run_reference(x, weight, bias, params, program)


IMPLEMENTATIONS = {"gemm_epilogue": run_reference, "gemm_epilogue_fallback": run_fallback}


def _setup_context(ctx, inputs, output):
    x, weight, bias, params, program = inputs[:5]
    ctx.program = program
    ctx.has_bias = bias is not None
    ctx.num_inputs = len(inputs)
    ctx.save_for_backward(x, weight, bias, *params)


def _backward(ctx, grad_output):
    """Recompute the forward with the reference under autograd and differentiate it.

    Under ``backward(create_graph=True)`` (grad mode on here) the saved inputs themselves are differentiated,
    so the gradients are differentiable in turn (double backward, gradgradcheck).
    """
    x, weight, bias, *params = ctx.saved_tensors
    inputs = [x, weight, bias, *params]
    needs = [t is not None and t.is_floating_point() and t.requires_grad for t in inputs]
    create_graph = torch.is_grad_enabled()
    with torch.enable_grad():
        if create_graph:
            leaves = inputs
        else:
            leaves = [t.detach().requires_grad_(need) if t is not None else None for t, need in zip(inputs, needs)]
        out = run_reference(leaves[0], leaves[1], leaves[2], leaves[3:], ctx.program)
        wanted = [leaf for leaf, need in zip(leaves, needs) if need]
        grads = iter(torch.autograd.grad(out, wanted, grad_output, allow_unused=True, create_graph=create_graph)
                     if wanted else ())
    result = [next(grads) if need else None for need in needs]
    return (result[0], result[1], result[2], result[3:], None) + (None,) * (ctx.num_inputs - 5)


for _name, _schema in SCHEMAS.items():
    _library.define(_name + _schema)
    _library.impl(_name, IMPLEMENTATIONS[_name], "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{_name}", IMPLEMENTATIONS[_name], lib=_library)
    torch.library.register_autograd(f"{NAMESPACE}::{_name}", _backward, setup_context=_setup_context, lib=_library)

gemm_epilogue = torch.ops.fxfuse.gemm_epilogue.default
