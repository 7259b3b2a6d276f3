"""The fused ops as torch.library ops: schemas, reference implementations, fake implementations and autograd.

Entry points:

- ``torch.ops.fxfuse.gemm_epilogue``: what inference graphs call; ``linear(x, weight, bias)``, then ``program``
  (``fxfuse.program``). Its autograd recomputes the forward, GEMM included, through
  ``torch.ops.fxfuse.gemm_epilogue_backward``, so an inference graph can still be differentiated.
- ``torch.ops.fxfuse.gemm_epilogue_train``: what training graphs call; the same result, plus the GEMM output
  itself (a tensor of its own), which its autograd keeps: the backward runs the epilogue's gradients through
  ``torch.ops.fxfuse.epilogue_backward`` from it, then the linear's gradients, with no recompute GEMM.
- ``gemm_epilogue_fallback``, ``gemm_epilogue_train_fallback`` and ``epilogue_backward_fallback``: those ops
  pinned to the reference, plus the reason; the CUDA implementations call them for inputs their kernels don't
  take, and they log that reason at debug level.
- ``gemm_epilogue_vjp`` and ``epilogue_vjp``: the two backward ops' gradients as differentiable ops, for
  ``backward(create_graph=True)``.
- ``torch.ops.fxfuse.mean_of_row_groups``: a tensor's rows averaged in groups, for a feature pool that folded into
  the GEMM (its weight and bias, before gemm_epilogue); ``mean_of_row_groups_fallback`` is its reference, as above.

Autograd: the formulas below (``_backward``, ``_train_backward``), and for CUDA tensors, once ``fxfuse.kernels``
has loaded, the same formulas in C++ (``kernels/autograd.cpp``, ``TORCH_LIBRARY_IMPL(fxfuse, AutogradCUDA, ...)``),
which cost a call that records gradients about half the host time.

    gemm_epilogue(Tensor x, Tensor weight, Tensor? bias, Tensor[] params, str program) -> Tensor
    gemm_epilogue_train(Tensor x, Tensor weight, Tensor? bias, Tensor[] params, str program) -> (Tensor, Tensor)
    epilogue_backward(Tensor grad_output, Tensor gemm_out, Tensor[] params, str program, bool[] needs_grad)
        -> Tensor[]
    mean_of_row_groups(Tensor tensor, int size) -> Tensor

Under torch.autocast the two fused ops have autocast kernels (``_autocast_kernel``; the fallback and backward ops
have none: autocast is off in a backward, and the fallbacks are called below it).

Every device runs the reference interpreter, except CUDA once ``fxfuse.kernels`` has loaded its kernels, whose
``TORCH_LIBRARY_IMPL(fxfuse, CUDA, ...)`` takes precedence (the first CUDA call of a fused op loads them). The
fake implementations are the same references run on fake tensors, so shapes, dtypes and broadcasting are eager's
by construction.
"""
from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F

from .epilogue import EPILOGUE_OPS
from .program import Param, Program, run_program, run_reference

logger = logging.getLogger("fxfuse")

NAMESPACE = "fxfuse"
ARGS = "Tensor x, Tensor weight, Tensor? bias, Tensor[] params, str program"

_library = torch.library.Library(NAMESPACE, "DEF")


def _shares_memory(a: torch.Tensor, others) -> bool:
    return any(o is not None and torch._C._is_alias_of(a, o) for o in others)


def run_reference_train(x, weight, bias, params, program):
    """``(out, gemm_out)``: the reference's result and the GEMM output it was computed from, never one memory."""
    gemm_out = F.linear(x, weight, bias)
    out = run_program(gemm_out, params, program)
    return (out.clone() if _shares_memory(out, [gemm_out]) else out), gemm_out


def run_reference_fresh(x, weight, bias, params, program):
    """gemm_epilogue's reference: ``run_reference``'s result as a tensor of its own. An empty program (a pool that
    folded into the GEMM, alone) returns linear's output, which for an x of 3 dims or more is a view of its 2-D GEMM:
    autograd forbids changing a custom op's view in place (`h.mul_(s)` after it), where eager's is no custom op's."""
    out = run_reference(x, weight, bias, params, program)
    return out.clone() if out._is_view() else out


def _logged(reference, name: str):
    """`reference` with a trailing `reason` argument, logged at debug level: the fallback of op `name`."""

    def run_fallback(*args):
        *arguments, reason = args
        logger.debug("%s runs the reference: %s", name, reason)
        return reference(*arguments)

    return run_fallback


def _ignoring_reason(function):
    return lambda *args: function(*args[:-1])


def _gemm_epilogue_of(program: str):
    """gemm_epilogue's reference as a function of its tensors (x, weight, bias, *params)."""
    return lambda x, weight, bias, *params: run_reference(x, weight, bias, params, program)


def _epilogue_of(program: str):
    """The epilogue's reference as a function of its tensors (gemm_out, *params)."""
    return lambda gemm_out, *params: run_program(gemm_out, params, program)


def _reference_gradients(function, grad_output, inputs, needs_grad):
    """The gradients of ``function(*inputs)`` for the inputs flagged in `needs_grad`, by autograd on the reference.

    Each is a fresh contiguous tensor (what the fake implementations promise), zeros where the input is unused.
    """
    # A kernel may run with autograd excluded (below the Autograd key, under a dispatch mode): re-include it.
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.AutogradFunctionality, False), \
            torch.enable_grad():
        leaves = [t.detach().requires_grad_(bool(need)) if t is not None else None
                  for t, need in zip(inputs, needs_grad)]
        wanted = [leaf for leaf, need in zip(leaves, needs_grad) if need]
        out = function(*leaves)
        # (a program whose result is detached from every input has no gradient: zeros)
        grads = torch.autograd.grad(out, wanted, grad_output, allow_unused=True) if wanted and out.requires_grad \
            else [None] * len(wanted)
    result = []
    for leaf, grad in zip(wanted, grads):
        if grad is None:
            grad = torch.zeros_like(leaf, memory_format=torch.contiguous_format)
        elif not grad.is_contiguous() or _shares_memory(grad, [grad_output, *inputs]):
            grad = grad.clone(memory_format=torch.contiguous_format)
        result.append(grad)
    return result


def run_reference_backward(grad_output, x, weight, bias, params, program, needs_grad):
    """gemm_epilogue's gradients for the inputs flagged in `needs_grad` (order: x, weight, bias, *params)."""
    return _reference_gradients(_gemm_epilogue_of(program), grad_output, [x, weight, bias, *params], needs_grad)


def run_epilogue_backward(grad_output, gemm_out, params, program, needs_grad):
    """The epilogue's gradients for the inputs flagged in `needs_grad` (order: gemm_out, *params)."""
    return _reference_gradients(_epilogue_of(program), grad_output, [gemm_out, *params], needs_grad)


def _fake_gradients(inputs, needs_grad):
    return [t.new_empty(t.shape) for t, need in zip(inputs, needs_grad) if need]


def fake_backward(grad_output, x, weight, bias, params, program, needs_grad):
    return _fake_gradients([x, weight, bias, *params], needs_grad)


def fake_epilogue_backward(grad_output, gemm_out, params, program, needs_grad):
    return _fake_gradients([gemm_out, *params], needs_grad)


def _vjp(function, grad_output, inputs, needs) -> list:
    """The gradients of ``function(*inputs)`` for the inputs flagged in `needs`, as differentiable ops: by
    ``torch.func.vjp``, which sees `function` alone (``autograd.grad`` would also run the graph behind a non-leaf
    input, the kept GEMM output, whenever it reaches another wanted input, a param of the same op)."""
    positions = [i for i, need in enumerate(needs) if need]

    def of_wanted(*wanted):
        args = list(inputs)
        for i, tensor in zip(positions, wanted):
            args[i] = tensor
        return function(*args)

    _, pullback = torch.func.vjp(of_wanted, *(inputs[i] for i in positions))
    return list(pullback(grad_output))


def _gradients(grad_output, inputs, needs, function, backward_op):
    """The gradients of ``function(*inputs)`` for the inputs flagged in `needs` (None for the others).

    They come from ``backward_op(needs)``, an op of its own, so the backward stays one opaque call under
    AOTAutograd and Inductor (which would otherwise re-derive and re-round the recomputation, e.g. making
    bfloat16 amin's tie mask empty), and it is where fused CUDA backward kernels plug in. Under
    ``backward(create_graph=True)`` (grad mode on here) `function` is differentiated on the saved inputs
    themselves instead (``_vjp``), so the gradients are differentiable in turn.
    """
    if grad_output is None or not any(needs):
        return [None] * len(inputs)
    grads = iter(_vjp(function, grad_output, inputs, needs) if torch.is_grad_enabled() else backward_op(needs))
    return [next(grads) if need else None for need in needs]


def epilogue_vjp(grad_output, gemm_out, params, program, needs_grad):
    """epilogue_backward's gradients as differentiable ops: what the C++ autograd formula of gemm_epilogue_train
    (kernels/autograd.cpp) runs under ``backward(create_graph=True)``."""
    return _vjp(_epilogue_of(program), grad_output, [gemm_out, *params], needs_grad)


def gemm_epilogue_vjp(grad_output, x, weight, bias, params, program, needs_grad):
    """gemm_epilogue_backward's gradients as differentiable ops (the same, for gemm_epilogue)."""
    return _vjp(_gemm_epilogue_of(program), grad_output, [x, weight, bias, *params], needs_grad)


def _flat_needs(ctx) -> list[bool]:
    """Which of (x, weight, bias, *params) autograd asks gradients for."""
    return [*ctx.needs_input_grad[:3], *ctx.needs_input_grad[3]]


def _kept(t):
    """`t` as saved for the backward: an inference tensor (made under ``torch.inference_mode``) can't be saved, where
    eager's op that reads it may keep nothing of it (``h + y``, a frozen linear's input): its copy is."""
    return t.clone() if t is not None and t.is_inference() else t


def _setup_context(ctx, inputs, output):
    x, weight, bias, params, program = inputs[:5]
    ctx.program = program
    ctx.num_inputs = len(inputs)
    # What eager's linear keeps (x for the weight's gradient, the weight for x's) is kept as it is, to raise as there.
    ctx.save_for_backward(x if weight.requires_grad else _kept(x), weight if x.requires_grad else _kept(weight),
                          _kept(bias), *map(_kept, params))


def _backward(ctx, grad_output):
    """gemm_epilogue's gradients: the forward, GEMM included, recomputed and differentiated (``_gradients``)."""
    x, weight, bias, *params = ctx.saved_tensors
    grads = _gradients(grad_output, [x, weight, bias, *params], _flat_needs(ctx), _gemm_epilogue_of(ctx.program),
                       lambda needs: gemm_epilogue_backward(grad_output, x, weight, bias, params, ctx.program, needs))
    return (grads[0], grads[1], grads[2], grads[3:], None) + (None,) * (ctx.num_inputs - 5)


def _setup_train_context(ctx, inputs, output):
    x, weight, bias, params, program = inputs[:5]
    ctx.program = program
    ctx.num_inputs = len(inputs)
    ctx.set_materialize_grads(False)  # gemm_out's gradient is mostly undefined: no zeros tensor for it
    ctx.linear_dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
    needs_x, needs_weight = x.requires_grad, weight.requires_grad
    ctx.save_for_backward(x if needs_weight else None, weight if needs_x else None, output[1], *map(_kept, params))


def _linear_gradients(grad_y, x, weight, needs, dtypes):
    """The gradients of ``y = linear(x, weight, bias)`` for those of (x, weight, bias) flagged in `needs`, from
    y's gradient; x may have leading dims. (x is read only for weight's gradient, weight only for x's.) Under
    autocast the GEMM ran in a lower precision than `dtypes`, those of (x, weight, bias): its gradients are
    computed in that precision and returned in theirs, as autocast's casts would."""
    needs_x, needs_weight, needs_bias = needs
    if grad_y is None:
        return None, None, None
    x_dtype, weight_dtype, bias_dtype = dtypes
    compute = grad_y.dtype
    rows = math.prod(grad_y.shape[:-1])  # not -1: a reshape of no elements to (-1, 0) is ambiguous
    grad_rows = grad_y.reshape(rows, grad_y.shape[-1])
    grad_x = (grad_y @ weight.to(compute)).to(x_dtype) if needs_x else None
    grad_weight = (grad_rows.t() @ x.reshape(rows, x.shape[-1]).to(compute)).to(weight_dtype) if needs_weight else None
    grad_bias = grad_rows.sum(0).to(bias_dtype) if needs_bias else None
    return grad_x, grad_weight, grad_bias


def _train_backward(ctx, grad_output, grad_gemm_out):
    """gemm_epilogue_train's gradients: the epilogue's from the kept GEMM output (``_gradients`` through
    ``epilogue_backward``), then the linear's with aten ops; no recompute GEMM."""
    x, weight, gemm_out, *params = ctx.saved_tensors
    needs = _flat_needs(ctx)
    linear_needs = needs[:3]
    grad_y, *grad_params = _gradients(
        grad_output, [gemm_out, *params], [any(linear_needs), *needs[3:]], _epilogue_of(ctx.program),
        lambda epilogue_needs: epilogue_backward(grad_output, gemm_out, params, ctx.program, epilogue_needs))
    if grad_gemm_out is not None and any(linear_needs):
        grad_y = grad_gemm_out if grad_y is None else grad_y + grad_gemm_out
    grad_x, grad_weight, grad_bias = _linear_gradients(grad_y, x, weight, linear_needs, ctx.linear_dtypes)
    return (grad_x, grad_weight, grad_bias, grad_params, None) + (None,) * (ctx.num_inputs - 5)


# ---------------------------------------------------------------- autocast

_AUTOCAST_DEVICES = ("cuda", "cpu")
_autocast_result_dtypes: dict = {}


def _in_lower_precision(t, device_type, dtype):
    """What autocast makes of an operand of the GEMM (or of an op it runs in its lower dtype, prelu) for `dtype`: a
    floating tensor on its device, but float64, cast."""
    if t is None or t.device.type != device_type or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)


@functools.lru_cache(maxsize=4096)
def _params_autocast_casts(program: str) -> frozenset[int]:
    """The params that eager's ops cast under autocast themselves: those read by ops that autocast runs in its lower
    dtype only (prelu's slopes); a param that another op reads too (an add promotes) is not."""
    readers: dict[int, list[str]] = {}
    for instruction in Program.parse(program).instructions:
        for operand in instruction.operands:
            if isinstance(operand, Param):
                readers.setdefault(operand.index, []).append(instruction.op)
    return frozenset(k for k, ops in readers.items() if all(EPILOGUE_OPS[op].autocast_lower_precision for op in ops))


def _eager_result_dtype(program, x, weight, bias, params, device_type, dtype) -> torch.dtype:
    """The dtype the program's ops give its result under autocast: linear in `dtype`, then each op by autocast's
    own policy for it (on CUDA layer_norm, group_norm, softmax, exp... run in float32). Found once per program,
    dtypes and ranks, by running the reference on fake tensors under autocast (of the real sizes, which broadcast
    as the real ones do and make groups of group_norm's size, with a symbolic size, Dynamo's, as 1), with every
    mode of the caller's set aside."""
    tensors = [x, weight, bias, *params]
    key = (program, device_type, dtype, tuple(None if t is None else (t.dtype, t.dim()) for t in tensors))
    if key not in _autocast_result_dtypes:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils._python_dispatch import _disable_current_modes

        size = lambda d: d if isinstance(d, int) else 1  # noqa: E731
        x_shape = [size(d) for d in x.shape[:-1]] + [weight.shape[1]]
        shapes = [x_shape, weight.shape, None if bias is None else bias.shape]
        shapes += [[size(d) for d in p.shape] for p in params]
        with _disable_current_modes(), FakeTensorMode():
            fake_x, fake_weight, fake_bias, *fake_params = [
                None if t is None else torch.empty(shape, dtype=t.dtype, device=t.device)
                for t, shape in zip(tensors, shapes)]
            with torch.autocast(device_type, dtype=dtype):
                result = run_reference(fake_x, fake_weight, fake_bias, fake_params, program)
        _autocast_result_dtypes[key] = result.dtype
    return _autocast_result_dtypes[key]


def _autocast_kernel(op, reference, device_type: str):
    """op's kernel for autocast on `device_type`.

    Where every param is already a tensor of autocast's dtype on that device (or there is none), the GEMM and
    the epilogue run fused in that dtype, as eager's linear would (x, weight and bias cast), and the result comes
    back in the dtype the program's ops give it under autocast (bf16 after a GELU; fp32 after an op that CUDA's
    autocast runs in fp32, such as group_norm). A param in another dtype (an fp32 norm affine, an fp32 residual)
    is not rounded to fit the kernels: the program's ops then run unfused, under autocast as eager's did; one that
    eager's op casts under autocast (prelu's slopes) is cast so first. The casts are autograd's to record, as
    autocast's own are."""
    autocast_key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type))

    def run(x, weight, bias, params, program):
        dtype = torch.get_autocast_dtype(device_type)
        cast = _params_autocast_casts(program)
        params = [_in_lower_precision(p, device_type, dtype) if k in cast else p for k, p in enumerate(params)]
        if any(p.device.type != device_type or p.dtype != dtype for p in params):
            return reference(x, weight, bias, params, program)
        result_dtype = _eager_result_dtype(program, x, weight, bias, params, device_type, dtype)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(autocast_key)):
            low = lambda t: _in_lower_precision(t, device_type, dtype)  # noqa: E731
            result = op(low(x), low(weight), low(bias), params, program)
        if isinstance(result, tuple):  # the training op: (out, the GEMM output in `dtype`, as eager's linear's)
            return result[0].to(result_dtype), result[1]
        return result.to(result_dtype)

    return run


def _define(name: str, schema: str, implementation, fake=None, backward=None, setup_context=None,
            autocast=False) -> None:
    """One op: its schema, its reference for every device, its fake implementation, its autograd and (`autocast`)
    its autocast kernels, if any."""
    _library.define(name + schema)
    _library.impl(name, implementation, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake or implementation, lib=_library)
    if backward is not None:
        torch.library.register_autograd(f"{NAMESPACE}::{name}", backward, setup_context=setup_context, lib=_library)
    if autocast:
        op = getattr(torch.ops.fxfuse, name).default
        for device_type in _AUTOCAST_DEVICES:
            key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
            _library.impl(name, _autocast_kernel(op, implementation, device_type), key)


def _loading_cuda_kernels(name: str, reference):
    """`reference`, which runs wherever op `name` has no kernel of its own; for CUDA tensors the first call in a
    process loads fxfuse's kernels and, if they load, runs the op again, on them (a model optimized on the CPU and
    then moved to the GPU ran the reference at every call: only optimize() and the backend loaded them)."""
    def run(x, *args):
        if x.is_cuda and not isinstance(x, torch._subclasses.FakeTensor):
            from fxfuse import kernels
            if not kernels.loaded() and kernels.load():
                return getattr(torch.ops.fxfuse, name).default(x, *args)
        return reference(x, *args)
    return run


_inference = functools.partial(_define, backward=_backward, setup_context=_setup_context)
_training = functools.partial(_define, backward=_train_backward, setup_context=_setup_train_context)
_inference("gemm_epilogue", f"({ARGS}) -> Tensor", _loading_cuda_kernels("gemm_epilogue", run_reference_fresh),
           fake=run_reference_fresh, autocast=True)
_inference("gemm_epilogue_fallback", f"({ARGS}, str reason) -> Tensor",
           _logged(run_reference_fresh, "gemm_epilogue"))
_training("gemm_epilogue_train", f"({ARGS}) -> (Tensor, Tensor)",
          _loading_cuda_kernels("gemm_epilogue_train", run_reference_train), fake=run_reference_train, autocast=True)
_training("gemm_epilogue_train_fallback", f"({ARGS}, str reason) -> (Tensor, Tensor)",
          _logged(run_reference_train, "gemm_epilogue_train"))
# The gradients for the inputs flagged in needs_grad, in the order of the tensors before it.
_define("gemm_epilogue_backward", f"(Tensor grad_output, {ARGS}, bool[] needs_grad) -> Tensor[]",
        run_reference_backward, fake_backward)
EPILOGUE_BACKWARD_ARGS = "Tensor grad_output, Tensor gemm_out, Tensor[] params, str program, bool[] needs_grad"
_define("epilogue_backward", f"({EPILOGUE_BACKWARD_ARGS}) -> Tensor[]", run_epilogue_backward, fake_epilogue_backward)
# The same gradients as differentiable ops (composite: autograd records the ops they run).
_library.define(f"gemm_epilogue_vjp(Tensor grad_output, {ARGS}, bool[] needs_grad) -> Tensor[]")
_library.impl("gemm_epilogue_vjp", gemm_epilogue_vjp, "CompositeImplicitAutograd")
_library.define(f"epilogue_vjp({EPILOGUE_BACKWARD_ARGS}) -> Tensor[]")
_library.impl("epilogue_vjp", epilogue_vjp, "CompositeImplicitAutograd")
_define("epilogue_backward_fallback", f"({EPILOGUE_BACKWARD_ARGS}, str reason) -> Tensor[]",
        _logged(run_epilogue_backward, "epilogue_backward"), _ignoring_reason(fake_epilogue_backward))


# ---------------------------------------------------------------- a feature pool's weight averaging

def mean_of_row_groups_reference(tensor, size):
    """mean_of_row_groups's reference (the CPU implementation, the fake one and the CUDA kernel's oracle): `tensor`
    with each `size` consecutive rows (dim 0) averaged, a partial group at the end dropped, as avg_pool1d of kernel
    and stride `size` drops a partial window; 16-bit values accumulate in fp32 (ATen's mean). Fewer rows than `size`
    raise eager's pool error: there is no window."""
    if tensor.shape[0] < size:
        torch.avg_pool1d(tensor.new_empty(1, 1, tensor.shape[0]), size)
    groups = tensor.shape[0] // size
    return tensor[:groups * size].unflatten(0, (groups, size)).mean(1)


def _setup_row_groups_context(ctx, inputs, output):
    tensor, size = inputs[:2]
    ctx.size, ctx.rows = size, tensor.shape[0]


def _row_groups_backward(ctx, grad_output, *unused):
    """mean_of_row_groups's gradient: each group's gradient over its `size` rows, divided by `size` (ATen's mean
    backward), and zeros for the rows of a dropped partial group."""
    groups = grad_output.shape[0]
    spread = (grad_output / ctx.size).unsqueeze(1).expand(groups, ctx.size, *grad_output.shape[1:]).flatten(0, 1)
    dropped = ctx.rows - groups * ctx.size
    if dropped:
        spread = torch.cat([spread, spread.new_zeros(dropped, *spread.shape[1:])])
    return (spread,) + (None,) * (len(ctx.needs_input_grad) - 1)


# A feature pool folded into the GEMM (match's FEATURE_POOL): its weight's rows, and its bias's values, averaged.
_define("mean_of_row_groups", "(Tensor tensor, int size) -> Tensor",
        _loading_cuda_kernels("mean_of_row_groups", mean_of_row_groups_reference), fake=mean_of_row_groups_reference,
        backward=_row_groups_backward, setup_context=_setup_row_groups_context)
_define("mean_of_row_groups_fallback", "(Tensor tensor, int size, str reason) -> Tensor",
        _logged(mean_of_row_groups_reference, "mean_of_row_groups"), _ignoring_reason(mean_of_row_groups_reference),
        backward=_row_groups_backward, setup_context=_setup_row_groups_context)

gemm_epilogue = torch.ops.fxfuse.gemm_epilogue.default
gemm_epilogue_train = torch.ops.fxfuse.gemm_epilogue_train.default
gemm_epilogue_backward = torch.ops.fxfuse.gemm_epilogue_backward.default
epilogue_backward = torch.ops.fxfuse.epilogue_backward.default
mean_of_row_groups = torch.ops.fxfuse.mean_of_row_groups.default
FUSED_OPS = (gemm_epilogue, gemm_epilogue_train)
