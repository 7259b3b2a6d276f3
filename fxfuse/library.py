"""The fused op as torch.library ops: schema, reference implementation, fake implementation and autograd.

Entry points: ``torch.ops.fxfuse.gemm_epilogue`` (what rewritten graphs call) and
``torch.ops.fxfuse.gemm_epilogue_fallback`` (the same op pinned to the reference, plus the reason; the CUDA
implementation calls it for inputs its kernels don't take, and it logs that reason at debug level), and
``torch.ops.fxfuse.gemm_epilogue_backward`` (the gradients, which the registered autograd calls; its
reference recomputes the forward with the reference ops under autograd).

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

# The gradients for the inputs flagged in needs_grad (x, weight, bias, *params), in that order.
BACKWARD_SCHEMA = f"(Tensor grad_output, {ARGS}, bool[] needs_grad) -> Tensor[]"

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


def _shares_memory(a: torch.Tensor, others) -> bool:
    return any(o is not None and torch._C._is_alias_of(a, o) for o in others)


def run_reference_backward(grad_output, x, weight, bias, params, program, needs_grad):
    """The gradients of the reference for the inputs flagged in `needs_grad` (order: x, weight, bias, *params).

    Each is a fresh contiguous tensor (what the fake implementation promises), zeros where the input is unused.
    """
    inputs = [x, weight, bias, *params]
    # A kernel may run with autograd excluded (below the Autograd key, under a dispatch mode): re-include it.
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.AutogradFunctionality, False), \
            torch.enable_grad():
        leaves = [t.detach().requires_grad_(bool(need)) if t is not None else None
                  for t, need in zip(inputs, needs_grad)]
        wanted = [leaf for leaf, need in zip(leaves, needs_grad) if need]
        out = run_reference(leaves[0], leaves[1], leaves[2], leaves[3:], program)
        grads = torch.autograd.grad(out, wanted, grad_output, allow_unused=True) if wanted else ()
    result = []
    for leaf, grad in zip(wanted, grads):
        if grad is None:
            grad = torch.zeros_like(leaf, memory_format=torch.contiguous_format)
        elif not grad.is_contiguous() or _shares_memory(grad, [grad_output, *inputs]):
            grad = grad.clone(memory_format=torch.contiguous_format)
        result.append(grad)
    return result


def fake_backward(grad_output, x, weight, bias, params, program, needs_grad):
    return [t.new_empty(t.shape) for t, need in zip([x, weight, bias, *params], needs_grad) if need]


def _backward(ctx, grad_output):
    """Gradients through ``gemm_epilogue_backward``, which recomputes the forward with the reference.

    Being an op of its own, the backward stays one opaque call under AOTAutograd and Inductor (which would
    otherwise re-derive and re-round the recomputation, e.g. making bfloat16 amin's tie mask empty), and it is
    where fused CUDA backward kernels plug in. Under ``backward(create_graph=True)`` (grad mode on here) the
    saved inputs are differentiated in place instead, so the gradients are differentiable in turn.
    """
    x, weight, bias, *params = ctx.saved_tensors
    inputs = [x, weight, bias, *params]
    needs = [t is not None and t.is_floating_point() and t.requires_grad for t in inputs]
    if not any(needs):
        result = [None] * len(inputs)
    elif torch.is_grad_enabled():
        wanted = [t for t, need in zip(inputs, needs) if need]
        out = run_reference(x, weight, bias, params, ctx.program)
        grads = iter(torch.autograd.grad(out, wanted, grad_output, allow_unused=True, create_graph=True))
        result = [next(grads) if need else None for need in needs]
    else:
        grads = iter(gemm_epilogue_backward(grad_output, x, weight, bias, params, ctx.program, needs))
        result = [next(grads) if need else None for need in needs]
    return (result[0], result[1], result[2], result[3:], None) + (None,) * (ctx.num_inputs - 5)


for _name, _schema in SCHEMAS.items():
    _library.define(_name + _schema)
    _library.impl(_name, IMPLEMENTATIONS[_name], "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{_name}", IMPLEMENTATIONS[_name], lib=_library)
    torch.library.register_autograd(f"{NAMESPACE}::{_name}", _backward, setup_context=_setup_context, lib=_library)

_library.define("gemm_epilogue_backward" + BACKWARD_SCHEMA)
_library.impl("gemm_epilogue_backward", run_reference_backward, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::gemm_epilogue_backward", fake_backward, lib=_library)

gemm_epilogue = torch.ops.fxfuse.gemm_epilogue.default
gemm_epilogue_backward = torch.ops.fxfuse.gemm_epilogue_backward.default
