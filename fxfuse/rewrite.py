"""Rewriting: the pass that replaces each legal region of a GraphModule with one fused-op call.

Entry point: ``fuse_graph(gm, training=False) -> Report``; it rewrites ``gm`` in place. The same pass serves
``optimize()`` (graphs from symbolic tracing) and the torch.compile backend (graphs from Dynamo). Training graphs
get ``gemm_epilogue_train`` (whose backward reuses the GEMM output it keeps), others ``gemm_epilogue``.
"""
from __future__ import annotations

import importlib
import itertools
import logging
import math
import numbers
import operator
import re
import warnings

import torch
import torch.fx as fx
import torch.nn as nn

from .canonicalize import (FEATURE_POOL, IDENTITY, LINEAR, SQUEEZED, Attr, augmented_assignment, canonicalize,
                           has_call_hooks, hooks_of, joined_argument, joined_tensors, rank_change,
                           restore_readers_outside_regions, shape_after, shape_step)
from .epilogue import EPILOGUE_OPS, NORM, POINTWISE, REDUCTION
from .library import gemm_epilogue, gemm_epilogue_train, mean_of_row_groups
from .match import (_OPERATOR_IN_PLACE, Facts, Region, find_region, module_tensor, module_tensor_path,
                    values_of_module_tensors)
from .program import Param, drop_unread_params, hoist_param_steps
from .report import FusedRow, MissRow, Report

logger = logging.getLogger("fxfuse")


def location_of(node: fx.Node) -> str:
    """The module path a node belongs to, for reports."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1]
        path = path[0] if isinstance(path, tuple) else path
        # Dynamo names the compiled module L['self'] (or L['fn'] for a compiled Sequential): drop that root.
        return re.sub(r"^L\['\w+'\]\.?", "", str(path)).replace("L__self___", "") or "<model>"
    return "<model>"


def _tensor_node(graph: fx.Graph, obj):
    if not isinstance(obj, Attr):
        return obj
    with warnings.catch_warnings():  # a parametrized weight (spectral_norm) is a property: read as eager reads it
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node with no underlying reference")
        return graph.get_attr(obj.path)


def _behaves_differently_in_training(module: nn.Module) -> bool:
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    return isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.RReLU))  # RReLU: random slopes in training


def require_eval_mode(x, module: nn.Module, path: str) -> None:
    """Called by rewritten graphs for each eval-mode Dropout, BatchNorm or RReLU module folded into a fused op. `x`, the
    fused op's input, is unused: an argument that is a proxy keeps the call in the graph when fx traces the code
    again (unpickling), which otherwise runs it once, then, and drops it."""
    if module.training:
        raise RuntimeError(f"fxfuse: `{path}` was in eval mode when it was fused, so this graph has none of its "
                           "train-mode behaviour; to train, run fxfuse.optimize() on the model in train mode "
                           "(or use torch.compile(model, backend='fxfuse'), which recompiles on a mode change)")


# Settings that don't change what a folded module computes: whether it writes its input (which only the region
# reads), and BatchNorm's momentum (used in training only, which require_eval_mode guards).
_NOT_COMPUTED_WITH = {"training", "inplace", "momentum"}


def settings_of(module: nn.Module) -> dict:
    """A module's plain settings (LeakyReLU's slope, GroupNorm's eps, RMSNorm's eps of None, Dropout's p), which a
    fused op's program holds as they were when it was fused, and the parameters and buffers it had none of (a
    Linear's bias, LayerNorm's weight without affine), which the program leaves out."""
    def python_value(value):  # the graph's code writes the settings as Python literals: NumPy's as Python's
        return value.item() if isinstance(value, numbers.Number) and hasattr(value, "item") else value

    plain = (numbers.Number, str, tuple, type(None))
    settings = {name: python_value(value) for name, value in vars(module).items()
                if not name.startswith("_") and name not in _NOT_COMPUTED_WITH and isinstance(value, plain)}
    return settings | missing_tensors_of(module)


def missing_tensors_of(module: nn.Module) -> dict:
    """{name: None} for each parameter or buffer slot the module holds None in (a Linear without a bias)."""
    return {name: None for slots in (module._parameters, module._buffers) for name, value in slots.items()
            if value is None}


def kind_of(module: nn.Module) -> str:
    """The module's class, as the graph's code writes it: a folded module replaced by another kind (a LoRA-style
    Linear, a Tanh for a ReLU) computes something else."""
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _same_setting(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def require_settings(x, module: nn.Module, path: str, settings: dict, kind: str, tensors: tuple = ()) -> None:
    """Called by rewritten graphs for each module folded into a fused op: it is still of its kind, with the class's
    forward, its settings are still the program's, the `tensors` the fused op reads of it are still tensors (not
    None), and it has no hooks of its own (the fused op would skip them; every module's, such as a profiler's, are the
    caller's to know). `x`: as require_eval_mode's."""
    if has_call_hooks(module):
        hooks = hooks_of(module, own_only=True)  # (each call: only the dicts' truth, then the message)
        raise RuntimeError(f"fxfuse: `{path}` has {hooks} now, which its fused op would skip; run fxfuse.optimize() "
                           "on the model again")
    if kind_of(module) != kind or "forward" in vars(module):
        now = kind_of(module) + (" with a forward of its own" if "forward" in vars(module) else "")
        raise RuntimeError(f"fxfuse: `{path}` was a {kind} when it was fused and is now a {now}; run "
                           "fxfuse.optimize() on the model again")
    for name, value in settings.items():
        now = getattr(module, name, None)
        if not _same_setting(now, value):
            shown = f"a tensor of shape {tuple(now.shape)}" if isinstance(now, torch.Tensor) else repr(now)
            raise RuntimeError(f"fxfuse: `{path}`.{name} was {value!r} when it was fused and is now {shown}; "
                               "run fxfuse.optimize() on the model again")
    for name in tensors:
        if getattr(module, name, None) is None:
            raise RuntimeError(f"fxfuse: `{path}`.{name} was a tensor when it was fused and is now None; run "
                               "fxfuse.optimize() on the model again")


# Stand-ins in the op that require_param and number_as_tensor replay: the param (None or the number there) and the
# op's other tensors.
_PARAM, _TENSOR = "<fxfuse: the param>", "<fxfuse: a tensor>"


def require_param(x, value, what: str, op: str, args: tuple, kwargs: dict) -> None:
    """Called by optimize()'s rewritten graphs for each param of a fused op that is a forward argument or a tensor of
    no folded module (the root's `self.bias`), as the op `op` (a dotted name, or `.name` for a method of its first
    argument) read it: for None, eager's own error, raised by that op on `args` and `kwargs` with None for the param
    and a 0-d tensor for the others; else, where the op takes None (it computes something else then), fxfuse's."""
    if value is not None:
        return
    _replay((op, args, kwargs), None, x.new_zeros(()))  # eager's error for None there
    again = "with None for it in the example inputs" if what.startswith("the forward argument") else \
        "on the model again"
    raise RuntimeError(f"fxfuse: {what} was a tensor when it was fused and is now None, which its fused op can't "
                       f"take; run fxfuse.optimize() {again}")


def _replay(read: tuple, param, tensor) -> None:
    """Run the op of `read` (op, args, kwargs: _param_read's) with `param` for the param and `tensor` for its other
    tensors: eager's TypeError, where its op takes no such param, propagates; anything else it raises is not ours."""
    op, args, kwargs = read

    def stand_in(a):
        if isinstance(a, (tuple, list)):
            return type(a)(stand_in(b) for b in a)
        return param if a == _PARAM else tensor if a == _TENSOR else a

    args, kwargs = stand_in(args), {name: stand_in(a) for name, a in kwargs.items()}
    try:
        if op is None:
            pass
        elif op.startswith("."):
            getattr(args[0], op[1:])(*args[1:], **kwargs)
        else:
            module, name = op.rsplit(".", 1)
            getattr(importlib.import_module(module), name)(*args, **kwargs)
    except TypeError:
        raise
    except Exception:
        pass


def _dotted_name(function) -> str | None:
    """The name require_param finds `function` by again (`operator.add`, `torch.add`); None if there is none."""
    module, name = getattr(function, "__module__", None), getattr(function, "__name__", None)
    if not isinstance(module, str) or not isinstance(name, str):
        return None
    for prefix in (module, module.lstrip("_")):  # (operator's functions are _operator's)
        try:
            if getattr(importlib.import_module(prefix), name, None) is function:
                return f"{prefix}.{name}"
        except ImportError:
            pass
    return None


def _param_read(member: fx.Node, param: fx.Node) -> tuple:
    """(op, args, kwargs) of `member`, which reads `param`, as require_param replays them; None for a module's call."""
    if member.op == "call_method":
        op = "." + member.target
    else:
        op = _dotted_name(member.target) if member.op == "call_function" else None

    def marked(a):
        return _PARAM if a is param else _TENSOR

    return op, fx.node.map_arg(member.args, marked), fx.node.map_arg(member.kwargs, marked)


# The GEMM spellings a forward argument can be the input of, by the name require_tensor takes.
_GEMM_CALLS = {"linear": torch.nn.functional.linear, "matmul": torch.matmul, "@": operator.matmul, "mm": torch.mm,
               "addmm": lambda x, weight: torch.addmm(weight, x, weight)}


def require_tensor(x, gemm: str) -> None:
    """Called by optimize()'s rewritten graphs first where a forward argument is a fused GEMM's input: for anything
    but a tensor (None, a list, a number), eager's own error, raised by the GEMM as the model spells it (`gemm`: a
    key of _GEMM_CALLS, or `.name` for a method of x) on an empty weight; the guards after it would read x.dim()."""
    if isinstance(x, torch.Tensor):
        return
    weight = torch.empty(0, 0)
    if gemm.startswith("."):
        getattr(x, gemm[1:])(weight)
    else:
        _GEMM_CALLS[gemm](x, weight)
    raise TypeError(f"{gemm}: the input must be a tensor, not {type(x).__name__}")  # (eager's op raised above)


def _gemm_spelling(anchor: fx.Node) -> str:
    """How the model spelled its GEMM, as require_tensor names it (a Linear module, F.linear and the rest: linear)."""
    if anchor.op == "call_method":
        return "." + anchor.target
    if anchor.op == "call_function":
        return {operator.matmul: "@", torch.matmul: "matmul", torch.mm: "mm", torch.addmm: "addmm"}.get(anchor.target,
                                                                                                         "linear")
    return "linear"


def require_matrix(x: torch.Tensor, op: str = "mm") -> None:
    """Called by rewritten graphs before a fused op whose GEMM was torch.mm or addmm (`op`): eager's error for an
    input that is no matrix (the fused op itself takes any leading dims), raised by that op itself on empty tensors
    of x's rank, dtype and device (its meta kernel words it otherwise). x is a tensor: require_tensor came first."""
    if x.dim() == 2:
        return
    _GEMM_CALLS[op](x.new_empty((0,) * x.dim()), x.new_empty((0, 0)))
    raise RuntimeError(f"{op}: the input must be a matrix")  # (eager's op raised above)


class NotOptimizedForThisCall(RuntimeError):
    """Raised by the checks an optimize()'d graph runs before any op of its own, for a call its fused ops were not made
    for (an input of another rank or dtype, None for an argument traced as a tensor): the optimized model then runs
    its model's own forward for that call (api.FusedGraphModule), which computes, or raises, what eager does."""


def _rank_message(got: int, rank: int, what: str) -> str:
    return (f"fxfuse: this part of the model was optimized for a {rank}-D {what}, for which its fused op computes "
            f"what its ops do; got a {got}-D one: run fxfuse.optimize() with example inputs of these ranks "
            "(or use torch.compile(model, backend='fxfuse'))")


def require_rank(tensor: torch.Tensor, rank: int, what: str) -> None:
    """Called by optimize()'s rewritten graphs before a fused op that holds for one rank of x only (group_norm's
    channels are dim 1 of a 2-D value; softmax(dim=1) is over the features of a 2-D one), or whose weight is a
    forward argument (a 3-D one would make eager's matmul batched): eager computes something else for another
    rank, or raises. (Dynamo guards ranks itself.)"""
    if tensor.dim() != rank:
        raise RuntimeError(_rank_message(tensor.dim(), rank, what))


def require_traced_as_tensor(value, name: str) -> None:
    """Called by optimize()'s graphs first for an argument that defaults to None, was a tensor in the example
    inputs, and picks the forward's code by being None (`if mask is not None:`): the graph ran the tensor's, so for
    None the optimized model runs its model's forward instead (NotOptimizedForThisCall)."""
    if value is None:
        raise NotOptimizedForThisCall(
            f"fxfuse: `{name}` was a tensor in the example inputs, so the model was optimized for the code its forward "
            f"runs for a tensor there, not for None (run fxfuse.optimize() with None for `{name}` in the example "
            "inputs to optimize the calls without it)")


def _is_numpy_scalar(value) -> bool:
    """A NumPy scalar (np.float32(2.0), np.bool_), which torch's ops read as a number; not an array, 0-d ones too."""
    return type(value).__module__ == "numpy" and type(value).__name__ != "ndarray" and \
        getattr(value, "ndim", None) == 0


def require_tensor_or_number(value, name: str) -> None:
    """Called by optimize()'s graphs first for a forward argument that a fused op reads as a param, or that one is made
    of by tensor ops (`y * 2 + 1`): a tensor, a number (number_as_tensor) or None (require_param) is what the graph was
    made for. Anything else, a NumPy array, a list, is what eager's ops compute with or raise for in their own ways
    (`h + array` through NumPy where nothing requires grad, `torch.add(h, array)`'s TypeError), where the fused op's
    schema would raise its own: the optimized model runs its model's forward instead (NotOptimizedForThisCall)."""
    if value is None or isinstance(value, (torch.Tensor, numbers.Number)) or _is_numpy_scalar(value):
        return
    raise NotOptimizedForThisCall(
        f"fxfuse: `{name}` is a {type(value).__module__}.{type(value).__qualname__}, where this part of the model was "
        "optimized for a tensor or a number")


def require_argument_rank(value, rank: int, what: str) -> None:
    """require_rank for a forward argument, called before the graph runs any op: for a tensor of another rank the
    optimized model runs its model's forward instead (NotOptimizedForThisCall). Anything but a tensor is left to
    require_tensor, which raises eager's error."""
    if isinstance(value, torch.Tensor) and value.dim() != rank:
        raise NotOptimizedForThisCall(_rank_message(value.dim(), rank, what))


def require_broadcast_rank(values: tuple, least: int, rank: int, what: str, offsets: tuple | None = None) -> None:
    """require_argument_rank for a value that the graph makes of forward arguments by ops that keep their rank, with
    module tensors of up to `least` dims (`self.fc(x + 1)`), or change it by a fixed amount (`offsets`, one per
    value, None where its rank does not count: `self.fc(x.unsqueeze(0))` is 1 more than x's), or by what its sizes
    tell (an offset (SQUEEZED, dims, more[, steps]): `self.fc(x.squeeze(0).unsqueeze(0))` is x.squeeze(0)'s rank, 1
    more; `steps`, the squeezes and unsqueezes of x before that squeeze, `x.unsqueeze(1).squeeze(0)`), or by what
    the value passed for it is (an offset (ITEM, index, more) of an argument whose item it reads, `self.fc(x[0])`: a
    tensor's rank but one, a list's item's own: _item_rank; index None, of an argument whose items it joins,
    `self.fc(torch.cat(xs, 1))`: the most dims of its items, _items_rank): it has the most dims of them, which,
    where not `rank`, runs the model's forward instead (NotOptimizedForThisCall), as it does where eager's squeeze or
    indexing raises. Anything but a tensor (or a list or tuple whose item it reads) has no dims to broadcast."""
    made = _broadcast_rank(values, least, offsets)
    if made != rank:
        raise NotOptimizedForThisCall(_rank_message(made, rank, what))


def require_broadcast_rank_at_least(values: tuple, least: int, rank: int, what: str, offsets: tuple) -> None:
    """require_rank_at_least's check, made before any op, for a value that the graph makes of forward arguments as
    require_broadcast_rank's: where it has fewer than `rank` dims, the model's forward runs instead
    (NotOptimizedForThisCall), which computes what eager does (another argument may give the fused op's value the
    dims it needs: `torch.minimum(fc(x.squeeze()), y)` of a (1, 1, K) x and a (1, 1, 1) y), or raises eager's error."""
    made = _broadcast_rank(values, least, offsets)
    if made < rank:
        raise NotOptimizedForThisCall(f"fxfuse: this part of the model was optimized for an {what} of {rank} dims or "
                                      f"more; got a {made}-D one")


def _broadcast_rank(values: tuple, least: int, offsets: tuple | None) -> int:
    """The rank of the value that require_broadcast_rank's `values`, `least` and `offsets` make at this call; raises
    NotOptimizedForThisCall where eager's squeeze raises."""
    offsets = (0,) * len(values) if offsets is None else offsets
    made = [least]
    for value, offset in zip(values, offsets):
        if isinstance(offset, tuple) and offset[0] == ITEM:  # (ITEM, index, more): `x[index]`, `more` dims more
            _, index, more = offset
            rank = _items_rank(value) if index is None else _item_rank(value, index)
            if rank is not None:
                made.append(rank + more)
            continue
        if not isinstance(value, torch.Tensor) or offset is None:
            continue
        if isinstance(offset, tuple):
            _, dims, more, *before = offset
            squeezed = shape_after(value.shape, (*(before[0] if before else ()), (SQUEEZED, dims)))
            if squeezed is None:
                raise NotOptimizedForThisCall(f"fxfuse: eager's squeeze or unsqueeze raises for an input of shape "
                                              f"{tuple(value.shape)} (squeezing dims {dims})")
            made.append(len(squeezed) + more)
        else:
            made.append(value.dim() + offset)
    return max(made)


def _item_rank(value, index: int) -> int | None:
    """The rank of `value[index]`, an item of a forward argument, at this call: a tensor's rank but one, or the rank of
    a list's or tuple's item (None for an item that is no tensor, which has no dims to broadcast).
    NotOptimizedForThisCall where eager's indexing raises (a 0-d tensor, an index out of range), or for an argument
    of another kind (a dict, an object whose indexing is its own code, a list subclass's too): the model's forward
    computes what eager does."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or not -value.shape[0] <= index < value.shape[0]:
            raise NotOptimizedForThisCall(f"fxfuse: eager's indexing raises for [{index}] of a tensor of shape "
                                          f"{tuple(value.shape)}")
        return value.dim() - 1
    # (a subclass whose indexing is its own code would run it here and in the graph: eager runs it once)
    if not isinstance(value, (list, tuple)) or type(value).__getitem__ not in (list.__getitem__, tuple.__getitem__):
        raise NotOptimizedForThisCall(f"fxfuse: this part of the model was optimized for an item of a tensor, list or "
                                      f"tuple; got a {type(value).__module__}.{type(value).__qualname__}")
    if not -len(value) <= index < len(value):
        raise NotOptimizedForThisCall(f"fxfuse: eager's indexing raises for [{index}] of a {type(value).__name__} of "
                                      f"{len(value)} items")
    item = value[index]
    return item.dim() if isinstance(item, torch.Tensor) else None


def _items_rank(value) -> int:
    """The most dims of the items of `value`, a forward argument that a join reads (`torch.cat(xs, 1)`), at this call:
    the rank of what torch.cat makes of them (it skips 1-D empty ones; it raises for any other mix), one fewer than
    torch.stack's. NotOptimizedForThisCall where eager's join raises for the argument (not a list or tuple, no items,
    an item that is no tensor): the model's forward raises it."""
    if not isinstance(value, (list, tuple)):
        raise NotOptimizedForThisCall("fxfuse: this part of the model was optimized for a join of a list or tuple; "
                                      f"got a {type(value).__module__}.{type(value).__qualname__}")
    # (as eager's joins read them: a subclass's own iteration or indexing does not run)
    items = list.__iter__(value) if isinstance(value, list) else tuple.__iter__(value)
    ranks = [item.dim() if isinstance(item, torch.Tensor) else None for item in items]
    if not ranks or None in ranks:
        raise NotOptimizedForThisCall(f"fxfuse: eager's join raises for a {type(value).__name__} of {len(ranks)} "
                                      "items, not all of them tensors")
    return max(ranks)


def require_features(x, weight: torch.Tensor, features: int, dim: int, what: str, pool: int = 1) -> None:
    """Called by optimize()'s rewritten graphs before a fused op whose program holds numbers computed from the GEMM's
    feature count (`h * h.size(-1) ** -0.5`) or a norm whose normalized_shape is the features (which the program
    normalizes over the last dim, of any size): the weight, dim `dim` of which is the features, still has that many.
    `pool`: the kernel of a feature pool folded into the GEMM, whose output has the weight's rows // pool features
    (fewer rows than the kernel are left to the op mean_of_row_groups, which raises eager's pool error).
    (Dynamo guards the weight's shape itself.) `x`: as require_eval_mode's."""
    rows = weight.shape[dim]
    if pool > 1 and rows < pool:
        return  # (no window: the op mean_of_row_groups raises eager's pool error)
    if rows // pool != features:
        pooled = f" (its rows averaged by {pool})" if pool > 1 else ""
        raise RuntimeError(f"fxfuse: the weight {what} had {features} features{pooled} when it was fused, and its "
                           f"fused op holds numbers computed from them (`h.size(-1)`, a normalized_shape); it now has "
                           f"{rows // pool}: run fxfuse.optimize() on the model again")


def require_rank_at_least(tensor: torch.Tensor, rank: int, what: str) -> None:
    """Called by optimize()'s rewritten graphs before a fused op whose program holds a whole view that indexes `rank`
    dims (`h[:, :]`), for which eager raises where its value has fewer: an x of `rank` dims or more gives it that many.
    (Dynamo guards ranks itself.)"""
    if tensor.dim() < rank:
        raise RuntimeError(f"fxfuse: this part of the model was optimized for an {what} of {rank} dims or more, for "
                           f"which its fused op computes what its ops do; got a {tensor.dim()}-D one: run "
                           "fxfuse.optimize() with example inputs of this rank")


def require_argument_rank_at_least(value, rank: int, what: str) -> None:
    """require_rank_at_least for a forward argument, called before the graph runs any op: for a tensor of fewer dims
    the optimized model runs its model's forward instead (NotOptimizedForThisCall), which gives eager's error (or, where
    a forward argument's broadcast gave the value the dims after all, eager's result)."""
    if isinstance(value, torch.Tensor) and value.dim() < rank:
        raise NotOptimizedForThisCall(f"fxfuse: this part of the model was optimized for an {what} of {rank} dims or "
                                      f"more; got a {value.dim()}-D one")


def _dtype_problem(x: torch.Tensor, dtypes: tuple, ops: str) -> str | None:
    """Why a program whose idioms are their ops in `dtypes` only does not hold for the dtype the epilogue computes in
    now, x's or autocast's; None where it holds."""
    device = x.device.type
    autocast_known = torch.amp.is_autocast_available(device) if hasattr(torch.amp, "is_autocast_available") else \
        device in ("cpu", "cuda")
    dtype = torch.get_autocast_dtype(device) if autocast_known and torch.is_autocast_enabled(device) else x.dtype
    name = str(dtype).removeprefix("torch.")
    if name in dtypes:
        return None
    return (f"fxfuse: this part of the model was optimized for {' or '.join(dtypes)} values, in which its spelled-out "
            f"{ops} is that op; in {name} it is not (eager's formula overflows): run fxfuse.optimize() with example "
            "inputs in this dtype, or use torch.compile(model, backend='fxfuse')")


def require_dtype(x: torch.Tensor, dtypes: tuple, ops: str) -> None:
    """Called by optimize()'s rewritten graphs before a fused op whose program holds an idiom that is its op only in
    some dtypes (x * relu6(x + 3) / 6 overflows in fp16 where hardswish does not): the dtype the epilogue computes
    in now, x's or autocast's, must be one of them. (Dynamo guards dtypes and autocast itself.) For an x that is a
    forward argument, require_argument_dtype."""
    problem = _dtype_problem(x, dtypes, ops)
    if problem is not None:
        raise RuntimeError(problem)


def require_argument_dtype(value, dtypes: tuple, ops: str, scaled: bool = False) -> None:
    """require_dtype for a forward argument, called before the graph runs any op: in another dtype (or under another
    autocast) the optimized model runs its model's forward instead (NotOptimizedForThisCall). Anything but a tensor
    is left to require_tensor, which raises eager's error. `scaled`: the argument is one that an op (`ops` says which)
    scales before it reads the region's value (`torch.sub(h, y, alpha=2)`), and must itself be a tensor of `dtypes`,
    autocast or not: eager computes the op in the dtype all its operands promote to (an integer y scaled first would
    become float32), rounds a number to the value's dtype first, and raises for None or a bool."""
    if scaled:
        got = str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else None
        if got not in dtypes:
            what = f"a tensor of {got}" if got is not None else f"a {type(value).__name__}"
            raise NotOptimizedForThisCall(
                f"fxfuse: this part of the model was optimized for a {' or '.join(dtypes)} tensor as {ops}, which "
                f"eager computes in that dtype; got {what}: run fxfuse.optimize() with example inputs of this kind")
        return
    problem = _dtype_problem(value, dtypes, ops) if isinstance(value, torch.Tensor) else None
    if problem is not None:
        raise NotOptimizedForThisCall(problem)


def require_no_function_transform(x: torch.Tensor) -> None:
    """Called by optimize()'s rewritten graphs before each fused op: torch.func's transforms (jvp, jacfwd, vmap,
    grad) do not reach into a torch.library op without rules of its own, and jvp would give it a zero tangent
    silently. (Dynamo sees the transform itself, compiling this graph or the backend's.) `x`: as
    require_eval_mode's."""
    if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
        raise RuntimeError("fxfuse: torch.func transforms (jvp, jacfwd, vmap, grad) do not go through fxfuse's fused "
                           "ops, which have no forward-mode or batching rule; use torch.autograd, or apply the "
                           "transform to the model as it was before fxfuse.optimize()")


def require_out_without_grad(x: torch.Tensor, op: str, tensors: list) -> None:
    """Called by optimize()'s rewritten graphs before a fused op that holds an op eager calls with `out=`
    (`torch.add(h, b, out=h)`): eager raises for it where autograd would record it, that is where grad mode is on and
    x or any of `tensors` (the weight, bias and params read up to it) requires grad. (Dynamo guards grad mode and
    requires_grad itself.)"""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (x, *tensors)):
        raise RuntimeError(f"{op}(): functions with out=... arguments don't support automatic differentiation, but "
                           "one of the arguments requires grad.")


def require_pool_channels(x: torch.Tensor, weight: torch.Tensor, kernel: int) -> None:
    """Called by optimize()'s rewritten graphs before a fused op whose GEMM took an avg_pool1d over its output's
    features, where the pool reads the output's rows (dim -2) as its channels: eager's pool raises for none (a 2-D
    input of no rows), the folded GEMM does not. Eager's own error, from its pool of an empty output of the GEMM's
    shape. (Dynamo guards sizes of 0 itself.)"""
    if x.dim() >= 2 and x.shape[-2] == 0:
        torch.avg_pool1d(x.new_empty((*x.shape[:-1], weight.shape[0])), kernel)


def mean_of_feature_groups(tensor: torch.Tensor, size: int, weight: torch.Tensor) -> torch.Tensor:
    """Called by rewritten graphs for a tensor that a GEMM output adds before its average pool over the features (its
    bias, a module tensor of its features), averaged as the pool averages the sum: over its last dim in groups of
    `size` where that dim is the features, the (N, K) `weight`'s rows; as it is where it broadcasts over them (0-d, or
    a last dim of 1: each window's mean is that value). Another size raises, as eager's add does. Its leading dims
    (a (B, N) tensor, which eager broadcasts across rows) are kept."""
    if tensor.dim() == 0 or tensor.shape[-1] == 1:
        return tensor
    torch.broadcast_shapes(tensor.shape, weight.shape[:1])  # (other features than the weight's: eager raises)
    if tensor.dim() == 1:  # (a bias, each call: no two movedim dispatches for nothing)
        return mean_of_row_groups(tensor, size)
    return mean_of_row_groups(tensor.movedim(-1, 0), size).movedim(0, -1)


def number_as_tensor(value, refused_by: tuple = (), reads: tuple = ()):
    """Called by rewritten graphs for a forward argument that the matcher took for a tensor (optimize()'s: a number
    may be passed where the example input was a tensor) or that it could not tell without example inputs: a number
    passed there (Python's or NumPy's) becomes a 0-d CPU tensor, which torch's ops read at full precision
    as they read a number, and which does not promote the result's dtype; the fused op's tensor params take it
    (on a GPU, its reference runs). NumPy's bool_ is no numbers.Number: its scalars are told by their module. A
    float becomes a float64 tensor (a complex one complex128), as precise as Python's number: a float32 one made
    1e40 inf in a float64 model. `refused_by`: (op, operand position) pairs of the program's ops that take no number
    there (torch.maximum, prelu's slopes), whose references then raise eager's own TypeError; `reads`: the region's
    ops that read it (_param_read's), replayed with the number, which raise eager's TypeError where a program op that
    takes one stands for an op that does not (addcmul's `value * tensor1` is a mul)."""
    if not (isinstance(value, numbers.Number) or _is_numpy_scalar(value)):
        return value
    for op, position in refused_by:
        spec = EPILOGUE_OPS[op]
        args = [torch.zeros(()) for _ in spec.operands]
        args[position] = value
        spec.reference(*args)
    for read in reads:
        _replay(read, value, torch.zeros(()))
    if isinstance(value, float):  # (NumPy's float64 is a float too; its float32 keeps its own dtype)
        return torch.tensor(value, dtype=torch.float64)
    if isinstance(value, complex):
        return torch.tensor(value, dtype=torch.complex128)
    return torch.tensor(value)


def _taking_no_number(program, param: int) -> tuple:
    """(op, operand position) of each pointwise op of `program` that reads param `param` where torch's op takes a
    tensor only: an operand of torch.maximum, or prelu's slopes (a feature operand)."""
    uses = []
    for ins in program.instructions:
        spec = EPILOGUE_OPS[ins.op.rstrip("_")]
        for position, operand in enumerate(ins.operands[:len(spec.operands)]):
            if operand == Param(param) and spec.kind == POINTWISE and not spec.attrs and \
                    (position not in spec.number_operands or spec.operands[position] in spec.feature_operands):
                uses.append((spec.name, position))
    return tuple(uses)


def _maybe_number(node, shapes_guarded: bool, following: dict, gm: fx.GraphModule) -> bool:
    """A graph input that may be a number at a call: of unknown type (no example inputs, no annotation or default
    that says it is no tensor), or any forward argument of optimize()'s graphs (an example input that was a tensor
    says nothing of a later call's; Dynamo guards the types of its graph's inputs); or what pointwise ops make of
    such inputs (`y * 2` of a number y is one: `following`), but modules' results other than nn.Identity's (which
    returns what it is given: `self.skip(y)`)."""
    known = ("val", "example_value", "tensor_meta")
    if isinstance(node, fx.Node) and node.op not in ("placeholder", "call_module") and node in following:
        return True
    if _identity_of_arguments(node, following, gm):
        return True
    return isinstance(node, fx.Node) and node.op == "placeholder" and \
        (not shapes_guarded or not any(k in node.meta for k in known))


def _identity_of_arguments(node, following: dict, gm: fx.GraphModule) -> bool:
    """Whether `node` calls an nn.Identity on what is made of forward arguments (`self.skip(y)`): it returns what it
    is given, which may be a number or None at a call, as the argument may."""
    return isinstance(node, fx.Node) and node.op == "call_module" and node in following and \
        isinstance(gm.get_submodule(node.target), nn.Identity)


# The checks optimize()'s graphs run before any op: where one fails, the optimized model runs its model's forward.
FIRST_CHECKS = (require_traced_as_tensor, require_argument_rank, require_broadcast_rank, require_argument_dtype,
                require_tensor_or_number, require_argument_rank_at_least, require_broadcast_rank_at_least)
# What a rewritten graph calls beside its fused ops.
GRAPH_HELPERS = (require_tensor, require_param, require_eval_mode, require_settings, require_matrix, require_rank,
                 require_features, require_out_without_grad, require_rank_at_least, require_dtype, *FIRST_CHECKS,
                 require_no_function_transform, number_as_tensor, require_pool_channels, mean_of_row_groups,
                 mean_of_feature_groups, augmented_assignment)


def _copy_meta(node: fx.Node, source: fx.Node, keys) -> None:
    node.meta.update({k: v for k, v in source.meta.items() if k in keys})


def _is_argument(value) -> bool:
    return isinstance(value, fx.Node) and value.op == "placeholder"


# The offset of an argument whose item the value is made of (`x[0]`): (ITEM, index, more), the rank of the argument's
# item `index` (a tensor's rank but one, a list's or tuple's item's own: _item_rank), and `more` dims more; index None:
# the most dims of its items, which a join reads (`torch.cat(xs, 1)`: _items_rank).
ITEM = "item"


def _item_of_argument(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(argument, index) where `node` is `x[index]` of a forward argument x and an int index (negative too), of which
    canonicalize.rank_change tells no rank: x may be a list or tuple, whose item is of its own rank, or a tensor, whose
    item is one dim fewer. None for any other node."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2 or node.kwargs:
        return None
    argument, index = node.args
    if not _is_argument(argument) or not isinstance(index, int) or isinstance(index, bool):
        return None
    return argument, index


def _items_only_read(argument: fx.Node) -> bool:
    """Whether no op may change which value forward argument `argument`'s items are before one is read (the first
    checks read them as the call passed them): every reader reads it only, an item (`x[0]`), its length or a torch
    function's argument; not a method of it (`x.insert(0, y)`, `x.reverse()`, `x.unsqueeze_(0)`), item assignment,
    `out=` or user code."""
    for reader in argument.users:
        if reader.op != "call_function" or "out" in reader.kwargs:
            return False
        if reader.target is not operator.getitem and reader.target is not len and \
                not getattr(reader.target, "__module__", "").startswith("torch"):
            return False
    return True


def _shifted(offset, more: int):
    """An argument's offset (_ranks_following_arguments') of a value that an op makes `more` dims larger."""
    if isinstance(offset, tuple):  # (SQUEEZED, dims, more[, steps]) or (ITEM, index, more)
        return (*offset[:2], offset[2] + more, *offset[3:])
    return offset + more


_UNKNOWN = object()


def _larger_offset(a, b):
    """Of two offsets of one argument that a value reads twice, the one that gives the more dims whatever its sizes
    (a squeeze's gives its `more` dims past the argument's rank at most); _UNKNOWN where that depends on them."""
    if a is None or a == b:
        return b
    if b is None:
        return a
    if ITEM in (a[0] if isinstance(a, tuple) else None, b[0] if isinstance(b, tuple) else None):
        return _UNKNOWN  # (an item's rank is no fixed amount off its argument's)
    most_a, most_b = (offset[2] if isinstance(offset, tuple) else offset for offset in (a, b))
    if not isinstance(a, tuple) and a >= most_b:
        return a
    if not isinstance(b, tuple) and b >= most_a:
        return b
    return _UNKNOWN


def _ranks_following_arguments(gm: fx.GraphModule, canon: dict, mutations: list,
                               items: bool = False) -> dict[fx.Node, tuple[dict, int]]:
    """The values whose rank follows from forward arguments' ranks alone, whatever the call: value -> ({argument: its
    offset}, least); the value has max(least, each argument's rank + its offset) dims (an offset of None: the
    argument's rank does not count). These are values made of arguments, numbers and module tensors by ops that keep
    their value's rank (pointwise ops, no-ops, norms, reductions that keep the dim, average pools over the features,
    folded or not, and GEMMs with a module weight: an x of 1 dim or more keeps its rank; the most dims of their
    operands, module tensors' included), and by ops that change it by a fixed amount: a reduction over one dim
    without keepdim (one fewer, of 1 dim or more), canonicalize.rank_change's (`unsqueeze`, `flatten`), and by
    canonicalize.joined_tensors' (`torch.cat`: the most dims of what it joins; `torch.stack`: one more); a view or
    reshape to a given shape, of anything (`conv(x).view(b, -1)`, made of no argument: ({}, its rank)); and a squeeze
    of an argument, or of what ops that keep its shape, squeezes and unsqueezes make of it alone
    (`x.relu().squeeze(0)`, `x.unsqueeze(1).squeeze(0)`), whose rank the argument's sizes tell (an offset (SQUEEZED,
    dims, more[, steps])), where no op before it may change the argument in place (`x.t_()`: the sizes the first
    checks see are the call's). `mutations`: Facts.mutations'. `items`: also what is made of an int item of an
    argument (`x[0]`, an offset (ITEM, index, more)), whose rank the first checks can tell, but which may be a list's
    item, of any kind (not a tensor or number to take as a param), and a join of an argument's items
    (`torch.cat(xs, 1)`, an offset (ITEM, None, more))."""
    following = {}
    changing = dict(mutations)
    made_from = {}  # node -> the arguments it is made of (any of which it may be, `x.contiguous()`)
    changed = set()  # the arguments that an op so far may have changed in place, or a value that may be one
    # node -> (the argument, the squeeze and unsqueeze steps (shape_step's) that make its shape of the argument's):
    # the argument, those steps of it, and pointwise ops with numbers and no-ops of such a value
    shaped_as = {}
    for node in gm.graph.nodes:
        c = canon.get(node)
        inputs = [made_from[n] for n in node.all_input_nodes if n in made_from]
        made_from[node] = frozenset({node}) if node.op == "placeholder" else \
            inputs[0] if len(inputs) == 1 else frozenset().union(*inputs)
        changed.update(*(made_from.get(m, ()) for m in changing.get(node, ()) if isinstance(m, fx.Node)))
        if node.op == "placeholder":
            following[node] = ({node: 0}, 0)
            shaped_as[node] = (node, ())
            continue
        item = _item_of_argument(node) if items else None
        if item is not None and _items_only_read(item[0]):
            argument, index = item
            following[node] = ({argument: (ITEM, index, 0)}, 0)
            continue
        joined = joined_argument(node) if items else None
        if joined is not None and _items_only_read(joined[0]):  # (eager's joins make 1 dim or more)
            argument, more = joined
            following[node] = ({argument: (ITEM, None, more)}, 1)
            continue
        if _keeps_its_operands_shape(c) and c.operands[0] in shaped_as:
            shaped_as[node] = shaped_as[c.operands[0]]
        step = shape_step(node) if c is None else None
        if step is not None and step[0] in shaped_as:
            argument, steps = shaped_as[step[0]]
            shaped_as[node] = (argument, (*steps, step[1]))
        reshaped = rank_change(node) if c is None else None
        if reshaped is not None and reshaped[1] is None and reshaped[0] not in following:
            following[node] = ({}, reshaped[2])  # (a rank of its own whatever its input's: `conv(x).view(b, -1)`)
            continue
        if reshaped is not None and reshaped[0] in following:
            source, offset, least = reshaped
            if isinstance(offset, tuple):  # (a squeeze: of an argument's own sizes, as the call gave them)
                argument, steps = shaped_as.get(source, (None, ()))
                if argument is not None and argument not in changed:
                    following[node] = ({argument: (*offset, steps) if steps else offset}, least)
                continue
            made_of, most = following[source]
            following[node] = ({argument: None if offset is None or known is None else _shifted(known, offset)
                                for argument, known in made_of.items()},
                               max(least, most + (offset or 0)) if offset is not None else least)
            continue
        joined = joined_tensors(node) if c is None else None
        if joined is not None:  # (the most dims of what it joins, `more` dims more)
            tensors, more = joined
            made_of = _merged_offsets(following, tensors) if all(t in following for t in tensors) else None
            if made_of is not None:
                following[node] = ({argument: None if offset is None else _shifted(offset, more)
                                    for argument, offset in made_of.items()},
                                   max(following[t][1] for t in tensors) + more)
            continue
        if c is None or (c.problem and not _pool_of_its_inputs_rank(gm, node, c)):
            continue
        spec = EPILOGUE_OPS.get(c.op)
        drops_dim = spec is not None and spec.kind == REDUCTION and c.attrs.get("keepdim") is False
        if c.op == LINEAR and module_tensor_path(c.operands[1]) is not None:
            operands = (c.operands[0], *c.operands[2:])  # (the weight does not broadcast with x)
        elif c.op in (IDENTITY, FEATURE_POOL) or (spec is not None and spec.kind in (POINTWISE, NORM)) or \
                (spec is not None and spec.kind == REDUCTION and isinstance(c.attrs.get("keepdim"), bool) and
                 c.op not in ("max_dim", "min_dim")):
            operands = c.operands  # (max_dim and min_dim make (values, indices); a feature pool keeps its rank)
        else:
            continue
        values = [o for o in operands if isinstance(o, fx.Node) and module_tensor_path(o) is None]
        tensors = [module_tensor(gm, path) if (path := module_tensor_path(o)) is not None else None
                   for o in operands if isinstance(o, (fx.Node, Attr)) and o not in values]
        if values and all(value in following for value in values) and all(t is not None for t in tensors):
            made_of = _merged_offsets(following, values)
            if made_of is None:
                continue
            most = max([*(following[value][1] for value in values), *(tensor.dim() for tensor in tensors)])
            if drops_dim:  # one dim fewer, of 1 dim or more (a 0-d value stays 0-d)
                made_of = {argument: None if offset is None else _shifted(offset, -1)
                           for argument, offset in made_of.items()}
                most = max(most - 1, 0)
            following[node] = (made_of, most)
    return following


# In-place methods that keep their tensor's rank (eager's pointwise in-place ops keep its shape, or raise)
_RANK_KEEPING_IN_PLACE = frozenset(("transpose_", "t_", "swapdims_", "swapaxes_", "copy_", "fill_", "zero_",
                                    "masked_fill_", "requires_grad_"))


def _values_whose_rank_may_change_in_place(gm: fx.GraphModule, canon: dict, mutations: list,
                                            following: dict) -> dict[fx.Node, fx.Node]:
    """The values whose rank an op may change in place (`v.unsqueeze_(0)`, `out=v`, which resizes v, a hooked
    module or a function of the user's given v), the values that may be the same tensor as one of them (each value
    and the values it is made of, but through GEMMs, views, reshapes, unsqueezes and joins, which make tensors of
    their own; each forward argument and the others, which a call may pass as one tensor), and the values whose rank
    the first checks tell (`following`: _ranks_following_arguments') that ops after it make of them
    (`v.unsqueeze(0)`, not `v.view(b, -1)`, of a rank of its own), each with the first such op: the first checks
    tell such a value's rank as the graph makes it, not as that op leaves it. `mutations`: Facts.mutations' (in
    graph order)."""
    changing = [(node, [m for m in values if isinstance(m, fx.Node)]) for node, values in mutations
                if not _keeps_rank_in_place(node, canon)]
    if not any(values for _, values in changing):
        return {}
    same_tensor = {}  # node -> the nodes it may be the same tensor as, either way
    for node in gm.graph.nodes:
        if _makes_a_tensor_of_its_own(node, canon):
            continue
        for value in node.all_input_nodes:
            same_tensor.setdefault(node, set()).add(value)
            same_tensor.setdefault(value, set()).add(node)
    # (a call may pass one tensor as two forward arguments, or as one and a list's item: `forward(x, y)` of (v, v))
    arguments = [node for node in gm.graph.nodes if node.op == "placeholder"]
    for argument in arguments:
        same_tensor.setdefault(argument, set()).update(other for other in arguments if other is not argument)
    first_change = {}
    for op, values in changing:  # (in graph order: the first op that may change a value is kept)
        stack = [value for value in values if value not in first_change]
        first_change.update((value, op) for value in stack)
        while stack:
            for value in same_tensor.get(stack.pop(), ()):
                if value not in first_change:
                    first_change[value] = op
                    stack.append(value)
    # A value whose rank the first checks tell, made after that op of such a value, has a rank of that op's making
    # too (`v.unsqueeze(0)`, `torch.cat([v, w])`), unless its rank is its own whatever its input's (`v.view(b, -1)`)
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        reshaped = rank_change(node) if node not in canon else None
        if node not in following or (reshaped is not None and reshaped[1] is None):
            continue
        ops = [first_change[value] for value in node.all_input_nodes
               if value in first_change and position[first_change[value]] < position[node]]
        if node in first_change:
            ops.append(first_change[node])
        if ops:
            first_change[node] = min(ops, key=position.get)
    return first_change


def _keeps_rank_in_place(node: fx.Node, canon: dict) -> bool:
    """Whether `node`, which changes tensors in place, surely keeps their ranks: an in-place pointwise op, item
    assignment, an augmented assignment, a transpose or fill; not `unsqueeze_`, `resize_`, `out=`, user code."""
    if "out" in node.kwargs:
        return False
    c = canon.get(node)
    if c is not None and c.inplace_of is not None:
        return True
    if node.op == "call_function":
        return node.target is operator.setitem or node.target is augmented_assignment or \
            node.target in _OPERATOR_IN_PLACE
    return node.op == "call_method" and node.target in _RANK_KEEPING_IN_PLACE


def _makes_a_tensor_of_its_own(node: fx.Node, canon: dict) -> bool:
    """Whether `node` surely makes a tensor other than any of its inputs: a GEMM, a view, reshape, unsqueeze or
    squeeze (not flatten, which returns its input where it changes nothing, nor an item of a list), a join."""
    c = canon.get(node)
    if c is not None:
        return c.op == LINEAR
    changed = rank_change(node)
    if changed is not None:
        return node.target not in (operator.getitem, "flatten", torch.flatten)
    return joined_tensors(node) is not None


def _merged_offsets(following: dict, values) -> dict | None:
    """The offsets of the arguments that `values` (each in `following`) are made of, for a value of their most dims:
    an argument read twice counts with its larger offset; None where which is larger depends on its sizes."""
    made_of = {}
    for value in values:
        for argument, offset in following[value][0].items():
            made_of[argument] = _larger_offset(made_of.get(argument), offset)
    return None if _UNKNOWN in made_of.values() else made_of


def _pool_of_its_inputs_rank(gm: fx.GraphModule, node: fx.Node, c) -> bool:
    """Whether `node`, a feature pool refused for its windows (a stride other than its kernel, padding, ceil_mode),
    still makes a value of its input's rank, as avg_pool1d does: not through a module whose hooks or forward of its
    own may make something else of it."""
    if c.op != FEATURE_POOL:
        return False
    modules = [gm.get_submodule(n.target) for n in (node, *c.covers) if n.op == "call_module"]  # (covers: unsqueezed)
    return all(type(m) is nn.AvgPool1d and not hooks_of(m) and "forward" not in vars(m) for m in modules)


def _keeps_its_operands_shape(c) -> bool:
    """Whether canonical op `c` makes a value of its one tensor operand's shape: a pointwise op or a no-op whose
    other operands are numbers (a tensor among them may broadcast it to more dims)."""
    if c is None or c.problem or not c.operands or not isinstance(c.operands[0], fx.Node):
        return False
    spec = EPILOGUE_OPS.get(c.op)
    if c.op != IDENTITY and (spec is None or spec.kind != POINTWISE):
        return False
    return all(isinstance(o, (int, float)) and not isinstance(o, bool) for o in c.operands[1:])


def _first_rank_checks(graph: fx.Graph, x, x_rank: int, following: dict) -> list[tuple]:
    """The checks (function, args) that, before any op, make x of `x_rank` as when traced, or hand the call to the
    model's forward: x's own rank where it is a forward argument; where x was made inside the graph and the example
    inputs gave it a rank, every tensor argument's example rank (the ranks of what a graph makes follow from its
    inputs' ranks, but for ops such as squeeze(), which require_rank still catches), and where x's rank follows from
    a squeeze of an argument, or an item of one (`following`, with items), the rank that its sizes or its item make;
    without them, the rank that the arguments x's rank follows from make (`following`); else none (then the matcher
    does not fuse a program that holds for one rank of x: match._unchecked_rank_problem)."""
    if _is_argument(x):
        return [(require_argument_rank, (x, x_rank, "input"))]
    checks = []
    arguments = list(itertools.takewhile(lambda node: node.op == "placeholder", graph.nodes))  # (the graph's first)
    if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor) and \
            all("val" in node.meta for node in arguments):
        checks = [(require_argument_rank, (node, node.meta["val"].dim(), "input"))
                  for node in arguments if isinstance(node.meta["val"], torch.Tensor)]
        # (the arguments' ranks leave a squeeze's sizes open, and an item's rank: a list may come where a tensor was)
        squeezed_or_item = x in following and any(isinstance(offset, tuple) for offset in following[x][0].values())
        if not squeezed_or_item:
            return checks
    if x in following:
        made_of, most = following[x]
        offsets = tuple(made_of.values())
        # (a graph of rank-keeping ops alone calls it as before this took offsets: unpickled graphs call it so too)
        checks.append((require_broadcast_rank, (tuple(made_of), most, x_rank, "input",
                                                *((offsets,) if any(offset != 0 for offset in offsets) else ()))))
    return checks


def _check_first(graph: fx.Graph, position: dict, check, args: tuple) -> None:
    """A call of `check` before the graph's first op (once), where a failed check can still hand the call to the
    model's own forward: nothing has run yet."""
    first = next(node for node in graph.nodes if node.op != "placeholder")
    checks = []
    while first.op == "call_function" and first.target in FIRST_CHECKS:
        checks.append(first)
        first = first.next
    if any(node.target is check and node.args == args for node in checks):
        return
    with graph.inserting_before(first):
        node = graph.call_function(check, args)
    before = position.get(node.prev, position[first] - 1)
    position[node] = (before + position[first]) / 2


def _input_read_again(member: fx.Node, region: Region) -> bool:
    """Whether the input of module call `member` may be read by more than `member`: it, or a region value it is made
    of back to the GEMM output (which may be an alias: eval-mode dropout and `contiguous()` return their input), has
    another user. Then the module's `inplace` decides what that reader sees (`kept - act(h)` of the same h)."""
    members = set(region.members)
    value = member.args[0] if member.args else None
    while isinstance(value, fx.Node):
        if len(value.users) > 1:
            return True
        if value is region.anchor or value not in members:
            return False
        value = value.args[0] if value.args else None
    return value is None


def _replace(gm: fx.GraphModule, region: Region, position: dict, training: bool, shapes_guarded: bool,
             following: dict[fx.Node, tuple[tuple, int]], ranks: dict[fx.Node, tuple[tuple, int]]) -> fx.Node:
    """Replace `region` with one fused-op call, after the checks it needs. `following`: _ranks_following_arguments';
    `ranks`: the same with items of arguments (`x[0]`), whose ranks the first checks follow (only they)."""
    graph = gm.graph
    # After the region's last op, not after a stand-in that nothing reads and that reads only the region (the unread
    # indices of `torch.max(h, 1)`, which fx may record after what reads the values: `r = h.max(1); y = r[0]...; r[1]`)
    members = set(region.members)
    last = max((m for m in region.members if m.users or not set(m.all_input_nodes) <= members), key=position.get)
    after = last.next
    with graph.inserting_before(after):
        if isinstance(region.x, fx.Node) and region.x.op == "placeholder" and not shapes_guarded:
            graph.call_function(require_tensor, (region.x, _gemm_spelling(region.anchor)))
        # The region relied on these modules' mode and settings: a later .train() or change must not go unnoticed.
        read = {module_tensor_path(p) for p in (*region.params, region.bias)} - {None}
        checked = set()  # the paths of `read` that require_settings checks
        for member in region.members:
            if member.op != "call_module":
                continue
            module = gm.get_submodule(member.target)
            if _behaves_differently_in_training(module):
                graph.call_function(require_eval_mode, (region.x, graph.get_attr(member.target), member.target))
            # The GEMM's weight and bias are read at each call: only a bias it had none of is in its program.
            settings = missing_tensors_of(module) if member is region.anchor else settings_of(module)
            # (whether it writes its input computes nothing, unless that input, or a value it may alias, is read again;
            # where it did, the graph's later readers of the input read its result instead, and can't be told apart)
            if member is not region.anchor and "inplace" in vars(module) and \
                    (module.inplace is True or _input_read_again(member, region)):
                settings["inplace"] = module.inplace
            # (the GEMM's weight and bias are the op's own arguments: None there raises eager's error, or has no bias)
            tensors = () if member is region.anchor else \
                tuple(name for name in (*module._parameters, *module._buffers) if f"{member.target}.{name}" in read)
            checked.update(f"{member.target}.{name}" for name in tensors)
            graph.call_function(require_settings, (region.x, graph.get_attr(member.target), member.target, settings,
                                                   kind_of(module), *((tensors,) if tensors else ())))
        # A forward argument the fused op reads as a param, or that one is made of: a tensor or a number, checked first
        if not shapes_guarded:
            for argument in dict.fromkeys(a for p in region.params if p in following for a in following[p][0]):
                _check_first(graph, position, require_tensor_or_number, (argument, argument.target))
        # A param the fused op reads of no folded module (whose require_settings checks it), or a forward argument
        # (or nn.Identity's of one): None there reached the op's Tensor[] params, where eager's op raises (or computes
        # without it).
        for p in region.params:
            argument = not shapes_guarded and (_is_argument(p) or _identity_of_arguments(p, following, gm))
            if not isinstance(p, fx.Node) or not (argument or (p.op == "get_attr" and p.target not in checked)):
                continue
            reader = next((m for m in region.members if p in m.all_input_nodes), None)
            op, args, kwargs = _param_read(reader, p) if reader is not None else (None, (), {})
            what = f"the forward argument `{p.target}`" if p.op == "placeholder" else f"`{p.target}`"
            graph.call_function(require_param, (region.x, p, what, op, args, kwargs))
        if region.check_matrix:
            op = "addmm" if region.anchor.target is torch.addmm else "mm"
            graph.call_function(require_matrix, (region.x, op))
        # A forward argument of another rank at a call runs the model's own forward, checked before any op; the check
        # here stays (an op between may change the argument's rank in place, `x.unsqueeze_(0)`).
        if region.x_rank is not None and not shapes_guarded:
            for check, args in _first_rank_checks(graph, region.x, region.x_rank, ranks):
                _check_first(graph, position, check, args)
            graph.call_function(require_rank, (region.x, region.x_rank, "input"))
        if region.x_rank_at_least is not None and (region.x_rank or 0) < region.x_rank_at_least and not shapes_guarded:
            # (first, for a forward argument, where a call of fewer dims can still run the model's own forward; the
            # check here stays: an op between may change its rank in place)
            if _is_argument(region.x):
                _check_first(graph, position, require_argument_rank_at_least,
                             (region.x, region.x_rank_at_least, "input"))
            elif region.x in ranks:  # (x made of forward arguments: its rank, of theirs and their sizes or items)
                made_of, most = ranks[region.x]
                _check_first(graph, position, require_broadcast_rank_at_least,
                             (tuple(made_of), most, region.x_rank_at_least, "input", tuple(made_of.values())))
            else:  # (the example inputs' ranks, for which x had the dims: the matcher fused it for no other call)
                for check, args in _first_rank_checks(graph, region.x, region.x_rank_at_least, ranks):
                    _check_first(graph, position, check, args)
            graph.call_function(require_rank_at_least, (region.x, region.x_rank_at_least, "input"))
        if _is_argument(region.weight) and not shapes_guarded:
            _check_first(graph, position, require_argument_rank, (region.weight, 2, "weight"))
            graph.call_function(require_rank, (region.weight, 2, "weight"))
        if not shapes_guarded:
            graph.call_function(require_no_function_transform, (region.x,))
        if region.dtypes is not None and not shapes_guarded:
            names = tuple(str(dtype).removeprefix("torch.") for dtype in region.dtypes)
            dtype_args = (region.x, names, " and ".join(region.dtype_ops))
            if _is_argument(region.x):  # (no op changes a tensor's dtype in place, nor autocast's within a forward)
                _check_first(graph, position, require_argument_dtype, dtype_args)
            else:
                graph.call_function(require_dtype, dtype_args)
        # A forward argument that an op scales before it reads the region's value, or addmm's input: a tensor in the
        # GEMM's dtype, checked first.
        if not shapes_guarded:
            for argument, dtype, what in region.scaled_arguments:
                dtypes = (str(dtype).removeprefix("torch."),)
                _check_first(graph, position, require_argument_dtype, (argument, dtypes, what, True))
        weight = _tensor_node(graph, region.weight)
        if region.reads_features and not shapes_guarded:
            path, dim = module_tensor_path(region.weight), 1 if region.transpose_weight else 0
            # (of a folded pool, the pooled width: the program's numbers are of it)
            pool = region.pool or 1
            features = module_tensor(gm, path).shape[dim] // pool
            graph.call_function(require_features, (region.x, weight, features, dim, f"`{path}`",
                                                   *((pool,) if pool > 1 else ())))
        if region.transpose_weight:
            weight = graph.call_function(torch.t, (weight,))
        params = [graph.call_function(number_as_tensor, (p, _taking_no_number(region.program, k),
                                                         tuple(_param_read(m, p) for m in region.members
                                                               if p in m.all_input_nodes)))
                  if _maybe_number(p, shapes_guarded, following, gm) else _tensor_node(graph, p)
                  for k, p in enumerate(region.params)]
        bias = _tensor_node(graph, region.bias)
        if region.pool is not None and region.pool_reads_rows and not shapes_guarded:
            graph.call_function(require_pool_channels, (region.x, weight, region.pool))
        if region.pool is not None:
            unpooled_weight = weight
            weight = graph.call_function(mean_of_row_groups, (weight, region.pool))
            # (the tensors added before the pool: of the weight's features, or broadcast over them, at a later call)
            if bias is not None:
                bias = graph.call_function(mean_of_feature_groups, (bias, region.pool, unpooled_weight))
            for k in region.pooled_params:
                params[k] = graph.call_function(mean_of_feature_groups, (params[k], region.pool, unpooled_weight))
        if region.out_write is not None and not shapes_guarded:
            op, read = region.out_write
            graph.call_function(require_out_without_grad, (region.x, op, [weight, bias, *params[:read]]))
        # What the program computes of params and numbers alone (an outside tensor scaled by alpha) runs before it, by
        # the op's reference, as eager computes it: the fused op's kernels then bind the rest
        program, taken = hoist_param_steps(region.program, len(params))
        for instruction in taken:
            operands = tuple(params[o.index] if isinstance(o, Param) else o for o in instruction.operands)
            params.append(graph.call_function(EPILOGUE_OPS[instruction.op].reference, operands, instruction.attr_dict))
        program, params = drop_unread_params(program, params)
        args = (region.x, weight, bias, params, str(program))
        if training:
            pair = graph.call_function(gemm_epilogue_train, args)
            fused = graph.call_function(operator.getitem, (pair, 0))
            _copy_meta(pair, region.output, ("nn_module_stack", "stack_trace"))
            for key in ("val", "example_value"):  # the GEMM output has the anchor's shape (pooled) and dtype
                if key in region.output.meta and key in region.anchor.meta:
                    gemm_out = region.anchor.meta[key]
                    if region.pool is not None:  # (a tensor of its own, as the op returns: contiguous)
                        gemm_out = gemm_out.new_empty((*gemm_out.shape[:-1], gemm_out.shape[-1] // region.pool))
                    pair.meta[key] = (region.output.meta[key], gemm_out)
        else:
            fused = graph.call_function(gemm_epilogue, args)
    _copy_meta(fused, region.output, ("val", "tensor_meta", "example_value", "nn_module_stack", "stack_trace"))
    region.output.replace_all_uses_with(fused)
    # New nodes get fractional positions between `last` and `after`, so graph order stays known.
    new_nodes, node = [], last.next
    while node is not after:
        new_nodes.append(node)
        node = node.next
    for i, new in enumerate(new_nodes, 1):
        position[new] = position[last] + i / (len(new_nodes) + 1)
    for member in sorted(region.members, key=position.get, reverse=True):
        graph.erase_node(member)
        del position[member]
    return fused


def _dims_in_range(c) -> bool:
    """Whether an op's `dim` fits its input's rank (fake tensors let `h.softmax(5)` of a 2-D h through)."""
    dim, operand = c.attrs.get("dim"), c.operands[0] if c.operands else None
    value = operand.meta.get("val", operand.meta.get("example_value")) if isinstance(operand, fx.Node) else None
    if not isinstance(dim, int) or not isinstance(value, torch.Tensor):
        return dim is None
    return -max(value.dim(), 1) <= dim < max(value.dim(), 1)


def _cannot_raise(c, canon: dict) -> bool:
    """A pointwise op of a GEMM's output and numbers, with no text attribute (`h * 3`, `h.relu()`): eager computes it
    for any shape of that float tensor (not so `F.gelu(h, approximate="bad")`, `h - True`, or an op of an int input)."""
    if c.op not in EPILOGUE_OPS or EPILOGUE_OPS[c.op].kind != POINTWISE or c.op == "batch_norm":
        return False
    tensors = [o for o in c.operands if isinstance(o, (fx.Node, Attr))]
    numbers_only = all(o in tensors or (isinstance(o, (int, float)) and not isinstance(o, bool)) for o in c.operands)
    gemm = canon.get(tensors[0]) if len(tensors) == 1 and isinstance(tensors[0], fx.Node) else None
    return numbers_only and gemm is not None and gemm.op == LINEAR and gemm.problem is None and \
        not any(isinstance(value, str) for value in c.attrs.values())


def _shape_proof(c, canon: dict, gm: fx.GraphModule) -> bool:
    """Whether eager's raising for `c` cannot depend on the batch or the rank, which an optimize()'d graph does not
    fix: a pointwise op, or a reduction or softmax over dim -1, of one value as wide as a GEMM's output (the output,
    or pointwise ops of it), numbers and module tensors that broadcast along the features only ((N,), (1, N))."""
    op = EPILOGUE_OPS.get(c.op)  # (batch_norm, pointwise with per-feature operands, reads dim 1: rank-bound)
    if op is None or op.feature_operands or \
            not (op.kind == POINTWISE or op.feature_dim_attr and c.attrs.get(op.feature_dim_attr) == -1):
        return False
    wide = [o for o in c.operands if isinstance(o, fx.Node) and _gemm_wide(o, canon, gm)]
    for operand in c.operands:
        if operand in wide or not isinstance(operand, (fx.Node, Attr)):
            continue  # the value, a number or None
        path = module_tensor_path(operand)
        tensor = module_tensor(gm, path) if path is not None else None
        if tensor is None or any(size != 1 for size in tensor.shape[:-1]):
            return False
    return len(wide) == 1


def _gemm_wide(node: fx.Node, canon: dict, gm: fx.GraphModule) -> bool:
    """A GEMM's output whose weight is the model's (a forward argument's width may change), or pointwise ops of it."""
    c = canon.get(node)
    if c is None or c.problem:
        return False
    if c.op == LINEAR:
        return module_tensor_path(c.operands[1]) is not None
    return EPILOGUE_OPS.get(c.op) is not None and EPILOGUE_OPS[c.op].kind == POINTWISE and _shape_proof(c, canon, gm)


def _drop_unused_epilogue_ops(gm: fx.GraphModule, canon: dict, shapes_guarded: bool) -> None:
    """Epilogue ops whose values nothing reads (`aux = h + self.b`, never used) go: they change nothing eager
    returns, and a region that took them in would give their params zero gradients where eager gives none. Only
    those that cannot raise, or that ran on Dynamo's example values (whose guards hold the shapes), or on
    optimize()'s where no later shape can make them raise: one eager raises for (`h + b` with b of another width,
    `F.layer_norm(h, (13,))`, `h + y` for a forward argument y of another batch) must stay to raise."""
    covered = {n for c in canon.values() for n in c.covers}  # stand-ins of another op (max's unused indices)
    for node in reversed(list(gm.graph.nodes)):
        c = canon.get(node)
        if c is None or node.users or node in covered or c.problem or c.inplace_of is not None or c.op == LINEAR \
                or c.covers:  # (the nodes it stands for, such as a size it reads, would be left without it)
            continue
        ran = any(key in node.meta for key in ("val", "example_value", "tensor_meta")) and _dims_in_range(c)
        if not _cannot_raise(c, canon) and not (ran and (shapes_guarded or _shape_proof(c, canon, gm))):
            continue
        gm.graph.erase_node(node)
        del canon[node]


def fuse_graph(gm: fx.GraphModule, where: str = "", training: bool = False, shapes_guarded: bool = False) -> Report:
    """Fuse every legal GEMM-epilogue region of `gm`, in graph order. Returns what was done and not done.

    `training`: the graph will be differentiated, so each region becomes ``gemm_epilogue_train``, which keeps
    its GEMM output for the backward; else ``gemm_epilogue``, whose epilogue runs in place. `shapes_guarded`: the
    graph runs only for inputs of the ranks and aliasing it was made for (Dynamo's guards), so it needs no rank
    checks, and its example values tell which inputs share memory.
    """
    report = Report()
    canon = canonicalize(gm)
    canonical_graph = set(gm.graph.nodes)
    _drop_unused_epilogue_ops(gm, canon, shapes_guarded)
    facts = Facts(gm, differentiated=training or not shapes_guarded, inputs_guarded=shapes_guarded)
    facts.position = {node: i for i, node in enumerate(gm.graph.nodes)}
    following = {} if shapes_guarded else _ranks_following_arguments(gm, canon, facts.mutations(canon))
    # (not what is made of no argument, `conv(x).view(b, -1)`: a rank of its own, no tensor that a check first tells)
    facts.made_of_arguments = frozenset(node for node, (made_of, _) in following.items() if made_of)
    # (an item of an argument, `x[0]`, may be a list's, of any kind, and a join's argument `torch.cat(xs, 1)` is a
    # list: their ranks are for the first checks only)
    has_items = not shapes_guarded and any(_item_of_argument(node) or joined_argument(node) for node in gm.graph.nodes)
    ranks = _ranks_following_arguments(gm, canon, facts.mutations(canon), items=True) if has_items else following
    if not shapes_guarded:
        # (nor where an op may change x's rank in place, `x.unsqueeze_(0)`: the first checks would see it before)
        facts.rank_changed_in_place = _values_whose_rank_may_change_in_place(gm, canon, facts.mutations(canon), ranks)
        facts.following_ranks = ranks
        facts.module_values = values_of_module_tensors(gm, canon, facts.mutations(canon))

        def rank_checks_before_any_op(x, x_rank: int) -> list[tuple]:
            """_first_rank_checks' of x, at this point of the rewrite: where there are none, the matcher does not fuse
            a program that holds for one rank of x (match._unchecked_rank_problem)."""
            return _first_rank_checks(gm.graph, x, x_rank, ranks)
        facts.rank_checks_before_any_op = rank_checks_before_any_op
    prefix = f"{where}." if where else ""
    anchors = [n for n, c in canon.items() if c.op == LINEAR and c.problem is None]
    for anchor in anchors:
        if anchor not in facts.position:  # replaced as part of an earlier region
            continue
        region, misses = find_region(gm, anchor, canon, facts)
        location = prefix + location_of(anchor)
        for miss in misses:
            report.near_misses.append(MissRow(f"{location} ({anchor.name})", miss.node.name, miss.reason))
        if region is None:
            continue
        replaced = [m.name for m in sorted(region.members, key=facts.position.get)]
        fused = _replace(gm, region, facts.position, training, shapes_guarded, following, ranks)
        facts.record_replacement(region.output, fused)
        for followed in (following, ranks):  # (the fused op's value is the output's: the same rank)
            if region.output in followed:
                followed[fused] = followed[region.output]
        logger.info("fused %s at %s: %s", ", ".join(replaced), location, region.program)
        report.fused.append(FusedRow(f"{location} ({anchor.name})", replaced, str(region.program), fused.name,
                                     "gemm_epilogue_train" if training else "gemm_epilogue", region.pool))
    for node, c in canon.items():
        if c.op == LINEAR and c.problem and node in facts.position:
            report.near_misses.append(MissRow(prefix + location_of(node), node.name, c.problem))
    restore_readers_outside_regions(gm.graph, canonical_graph, facts.replaced)
    gm.graph.lint()
    gm.recompile()
    return report
