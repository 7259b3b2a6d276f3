"""Matching: grow a fusible region from each GEMM anchor over the canonical graph, and prove it legal.

Entry point: ``find_region(gm, anchor, canon, facts) -> (Region | None, [NearMiss])``.

A region is the anchor (``linear``) plus epilogue ops reachable from it. Growth admits, in graph order, the
users of region values whose canonical op is in the vocabulary and whose other operands are outside tensors
that do not depend on the region (else fusing would create a cycle), numbers, or None. Each admitted
prefix is a candidate; the largest one whose only value used outside it is its last one is kept. Before
fusing, ``prove_legal`` checks that the region is convex and has a single output with networkx.
"""
from __future__ import annotations

import functools
import heapq
import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import networkx as nx
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .canonicalize import (COVERED, FEATURE_POOL, IDENTITY, LINEAR, PREVIOUS, Attr, Canonical, OperandOf,
                           SizeExpression, augmented_assignment, has_call_hooks, signatures_of, surely_not_tensor)
from .library import FUSED_OPS
from .epilogue import EPILOGUE_OPS, NORM, POINTWISE, REDUCTION
from .program import Instruction, Param, Program, Value

logger = logging.getLogger("fxfuse")

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Canonical attributes that steer matching but are not part of the op's program signature.
MATCHING_ATTRS = ("transpose_weight", "addmm_bias", "rank_needed", "dtype_needed", "normalized_size",
                  "matrix_input", "writes_out", "steps", "backward_refused")


@dataclass
class Region:
    anchor: fx.Node
    members: list[fx.Node]           # every fx node the fused op replaces
    output: fx.Node
    x: Any
    weight: Any                      # fx.Node | Attr
    transpose_weight: bool
    bias: Any                        # fx.Node | Attr | None
    params: list[Any]                # fx.Node | Attr, in $k order
    program: Program
    check_matrix: bool = False       # mm / addmm: the rewritten graph checks at every call that x is 2-D
    # The rank of x the program holds for (group_norm's channels are dim 1 of a 2-D value, softmax(dim=1) is over
    # the features of a 2-D one): the rewritten graph checks it at every call. None: any rank.
    x_rank: int | None = None
    # The dtypes an idiom of the program is its op in (the dtype the epilogue computes in, checked at every call
    # of optimize()'s graph), and those idioms' ops. None: any.
    dtypes: tuple | None = None
    dtype_ops: tuple = ()
    # The program holds numbers computed from the GEMM's feature count (`h * h.size(-1) ** -0.5`): the rewritten graph
    # checks at every call that the weight still has that many.
    reads_features: bool = False
    # An op of the program that eager calls with `out=` (`torch.add(h, b, out=h)`), and how many params the region has
    # read up to the last such: eager raises for it where autograd would record it, which the rewritten graph checks.
    out_write: tuple[str, int] | None = None
    # The least rank of x a whole view in the program needs (`h[:, :]`: eager raises for fewer dims), where the
    # value's rank is unknown: the rewritten graph checks it at every call. None: any.
    x_rank_at_least: int | None = None
    # Forward arguments of unknown dtype that an op scales before it reads the region's value (`torch.sub(h, y,
    # alpha=2)` is `mul($0,2.0)` of y first), and a forward argument that is addmm's input (eager's addmm takes a
    # tensor of its matrices' dtype there, and promotes none), as (argument, the GEMM's dtype, what it is to its op):
    # the program holds where each is a tensor of that dtype, which the rewritten graph checks before any op.
    scaled_arguments: tuple = ()
    # avg_pool1d's kernel where the GEMM's output is average-pooled over its features first (FEATURE_POOL): the
    # rewritten graph averages the weight's rows (and the bias) in groups of that many, and the program reads the
    # pooled features. None: no pool.
    pool: int | None = None
    pooled_params: tuple = ()        # the params the program adds before the pool (biases): averaged as the weight
    # The pool reads the GEMM output's rows (dim -2) as avg_pool1d's channels (no unsqueeze(1) first): eager's pool
    # raises where there are none (a 2-D input of no rows), which the rewritten graph checks.
    pool_reads_rows: bool = False


class Boundary(str):
    """A reason a node is not admitted that is a natural end of the region, not a near miss (another GEMM)."""


@dataclass
class NearMiss:
    anchor: fx.Node
    node: fx.Node
    reason: str


# ---------------------------------------------------------------- facts about tensors

# Every torch function that sets grad, inference or autocast state, as (owner, name, the mode it switches), where
# this torch has it. Dynamo's graphs hold them (a `with torch.autocast(...)` block as `_enter_autocast`, a setter
# called as a function as itself) and optimize() watches them while fx traces (torch.set_grad_enabled and
# torch.no_grad call `_set_grad_enabled`): a fused op runs under one state, that of the region's last op.
_AUTOCAST_SETTERS = ("set_autocast_enabled", "set_autocast_dtype", "set_autocast_cache_enabled",
                     "autocast_increment_nesting", "autocast_decrement_nesting", "clear_autocast_cache",
                     *(f"set_autocast_{device}_{setting}" for device in ("cpu", "gpu", "ipu", "xla")
                       for setting in ("enabled", "dtype")))
_SETTER_GROUPS = (  # (where they live, their names, the mode they switch)
    ((torch._C,), ("_set_grad_enabled", "_set_fwd_grad_enabled"), "grad mode"),
    ((torch._C,), ("_InferenceMode",), "inference mode"),
    ((torch.autograd.grad_mode,), ("_enter_inference_mode", "_exit_inference_mode"), "inference mode"),
    ((torch.amp.autocast_mode,), ("_enter_autocast", "_exit_autocast"), "autocast"),
    ((torch, torch._C), (*_AUTOCAST_SETTERS, *("_" + name for name in _AUTOCAST_SETTERS)), "autocast"),
)
MODE_SETTERS = tuple((owner, name, mode)
                     for owners, names, mode in _SETTER_GROUPS
                     for owner in owners
                     for name in names
                     if hasattr(owner, name))
_MODE_SWITCHES = [(getattr(owner, name), mode) for owner, name, mode in MODE_SETTERS]


def _mode_switched_by(node: fx.Node) -> str | None:
    """The mode that `node` switches, if it calls a setter (by identity: a target need not be hashable)."""
    if node.op != "call_function":
        return None
    return next((mode for setter, mode in _MODE_SWITCHES if setter is node.target), None)


@dataclass
class Facts:
    """What is known of a graph's tensors: module attributes always; shapes when example inputs were given."""
    gm: fx.GraphModule
    position: dict[fx.Node, int] = field(default_factory=dict)
    # The graph may be differentiated (what a fused op keeps for its backward matters: any of optimize()'s, a
    # backend's training graph), and its inputs' ranks are guarded, as Dynamo guards them (its example values then
    # also tell which inputs are one tensor).
    differentiated: bool = True
    inputs_guarded: bool = False
    # Region outputs already replaced by a fused node: canonical records made before still name the old node.
    replaced: dict[fx.Node, fx.Node] = field(default_factory=dict)
    # Without example inputs, the values that tensor ops make of forward arguments (rewrite's
    # _ranks_following_arguments: `y.unsqueeze(-1)`, `x.sum(-1, keepdim=True)`): a tensor where those are, a number
    # where one is, which the rewritten graph makes a tensor (number_as_tensor), as it does a forward argument.
    made_of_arguments: frozenset = frozenset()
    # optimize()'s graphs: the checks (function, args) the rewritten graph can run before any op to tell that a value
    # has a rank at a call (rewrite's _first_rank_checks; none: only a check where the value is made could tell).
    # None where ranks are guarded, as Dynamo guards them.
    rank_checks_before_any_op: Callable[[Any, int], list] | None = None
    # optimize()'s graphs: the values whose rank an op may change in place (`v.unsqueeze_(0)`, `out=v`), which no
    # check before any op tells, with the first such op (rewrite's _values_whose_rank_may_change_in_place)
    rank_changed_in_place: dict = field(default_factory=dict)
    # optimize()'s graphs: rewrite's _ranks_following_arguments (with items): value -> ({argument: its offset}, the
    # fewest dims it has), whose first check (require_broadcast_rank) finds at least those dims
    following_ranks: dict = field(default_factory=dict)
    # optimize()'s graphs without example inputs: what the vocabulary's ops make of module tensors and numbers alone
    # (`self.logit_scale.exp()`), as meta tensors of their shapes and dtypes (values_of_module_tensors)
    module_values: dict = field(default_factory=dict)

    def resolve(self, obj):
        return self.replaced.get(obj, obj) if isinstance(obj, fx.Node) else obj

    def record_replacement(self, output: fx.Node, fused: fx.Node) -> None:
        """`fused` now computes a region's `output`: what was known of that value holds for it (a later region may
        take it as an operand, as a transformer block's second residual add takes the first's)."""
        self.replaced[output] = fused
        if output in self.made_of_arguments:
            self.made_of_arguments = self.made_of_arguments | {fused}
        if output in self.rank_changed_in_place:
            self.rank_changed_in_place[fused] = self.rank_changed_in_place[output]

    def mutations(self, canon) -> list[tuple[fx.Node, list]]:
        """(node, the tensors it may change in place) for each such node of the graph as traced, in order: found
        once, not for every region (fused ops change nothing)."""
        if "_mutations" not in self.__dict__:
            self.__dict__["_mutations"] = [(node, mutated) for node in self.gm.graph.nodes
                                           if (mutated := _mutated_by(node, canon, self.gm))]
        return self.__dict__["_mutations"]

    def module_storages(self, path: str) -> frozenset:
        """The storages of the parameters and buffers of the module at `path` (found once a module)."""
        from torch.multiprocessing.reductions import StorageWeakRef

        cache = self.__dict__.setdefault("_module_storages", {})
        if path not in cache:
            module = _get_attr(self.gm, path) if path else self.gm
            tensors = (*module.parameters(), *module.buffers()) if isinstance(module, nn.Module) else ()
            cache[path] = frozenset(StorageWeakRef(t.untyped_storage()) for t in tensors if t.device.type != "meta")
        return cache[path]

    @functools.cached_property
    def mode_switches(self) -> list[fx.Node]:
        """The nodes that start or end an autocast block or change grad mode (Dynamo's graphs hold them)."""
        return [n for n in self.gm.graph.nodes if _mode_switched_by(n)]

    def tensor(self, obj) -> torch.Tensor | None:
        """A real or fake tensor with the shape and dtype of `obj`, or None if unknown."""
        if isinstance(obj, Attr):
            return _known_tensor(_get_attr(self.gm, obj.path))
        if not isinstance(obj, fx.Node):
            return None
        if obj.op == "get_attr":
            return _known_tensor(_get_attr(self.gm, obj.target))
        for key in ("val", "example_value"):
            value = obj.meta.get(key)
            if isinstance(value, torch.Tensor):
                return value
        meta = obj.meta.get("tensor_meta")
        if meta is not None and hasattr(meta, "shape"):
            return torch.empty(meta.shape, dtype=meta.dtype, device="meta")
        return self.module_values.get(obj)

    def is_tensor(self, obj) -> bool | None:
        """True/False when known, None when it can't be told without example inputs."""
        if self.tensor(obj) is not None:
            return True
        if isinstance(obj, fx.Node) and any(k in obj.meta for k in ("val", "example_value", "tensor_meta")):
            return False
        if isinstance(obj, fx.Node) and obj.op == "get_attr":
            return False
        if isinstance(obj, fx.Node) and obj.op == "placeholder" and _declared_not_tensor(obj):
            return False
        return None

    def rank(self, obj) -> int | None:
        t = self.tensor(obj)
        return None if t is None else t.dim()


def _declared_not_tensor(placeholder: fx.Node) -> bool:
    """A forward argument whose annotation (`scale: float`) or default (`scale=2.0`) says it is no tensor."""
    if placeholder.args and placeholder.args[0] is not None and not isinstance(placeholder.args[0], torch.Tensor):
        return True
    annotation = placeholder.type
    return isinstance(annotation, type) and not issubclass(annotation, torch.Tensor)


def _known_tensor(value) -> torch.Tensor | None:
    """A module attribute as a tensor whose shape is known: not a lazy module's uninitialized parameter."""
    lazy = isinstance(value, (nn.parameter.UninitializedParameter, nn.parameter.UninitializedBuffer))
    return value if isinstance(value, torch.Tensor) and not lazy else None


def module_tensor(gm: fx.GraphModule, path: str) -> torch.Tensor | None:
    """The module tensor at `path` of `gm`, if its shape is known."""
    return _known_tensor(_get_attr(gm, path))


def values_of_module_tensors(gm: fx.GraphModule, canon, mutations: list) -> dict[fx.Node, torch.Tensor]:
    """The values that the vocabulary's ops make out of place of module tensors and numbers alone
    (`self.logit_scale.exp()`, `torch.sigmoid(self.gate) * 2`), each as a meta tensor of its shape and dtype, found by
    running their ops on meta tensors of the module's. Such a value is a tensor at every call, and its ops, which stay
    in the graph, make it of the module's tensors as they are then, as a module tensor read directly is (after
    `.double()`, a float64 one). Not through a module's call (its hooks), nor of a module tensor that an op of the
    graph may change (`mutations`: Facts.mutations'), which may change its shape too (`unsqueeze_`, a hook's code)."""
    changing = {node for node, _ in mutations}
    changed, changed_modules = _changed_module_tensors(gm, canon, mutations)
    covering = {covered: node for node, c in canon.items() for covered in c.covers}
    values: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            tensor = module_tensor(gm, node.target)
            if tensor is not None and id(tensor) not in changed and \
                    not any(state.covers(node.target) for state in changed_modules):
                values[node] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
            continue
        # (a node that an op of the vocabulary stands for with others runs as part of it: `relu6(t + 3)` of hardswish)
        if node.op not in ("call_function", "call_method") or node in changing or not node.all_input_nodes or \
                not _makes_a_tensor_of_its_own(canon.get(covering.get(node, node))) or \
                any(source not in values for source in node.all_input_nodes):
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
        try:
            if node.op == "call_method":
                values[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                values[node] = node.target(*args, **kwargs)
        except Exception:  # (eager raises for it too, or a meta kernel is missing: unknown)
            continue
    return {node: value for node, value in values.items()
            if node.op != "get_attr" and node in canon and isinstance(value, torch.Tensor)}


def _changed_module_tensors(gm: fx.GraphModule, canon, mutations: list) -> tuple[dict, list]:
    """What an op of the graph may change in place of the module's tensors (`mutations`: Facts.mutations'): the
    tensors, by id (a tied one is changed under each of its paths), and the modules whose code may change any of
    theirs (ModuleState)."""
    tensors, modules = {}, []
    for _, mutated in mutations:
        for target in mutated:
            target = target.tensor if isinstance(target, OwnState) else target
            if isinstance(target, ModuleState):
                modules.append(target)
                continue
            for base in ([target] if isinstance(target, Attr) else _bases(target, canon)):
                path = module_tensor_path(base)
                tensor = None if path is None else module_tensor(gm, path)
                if tensor is not None:
                    tensors[id(tensor)] = tensor
    return tensors, modules


def _makes_a_tensor_of_its_own(c: Canonical | None) -> bool:
    """Whether canonical op `c` is one of the vocabulary's that makes a tensor of its own, changing none: not
    detach, whose result is its input's memory, nor an op with `out=`."""
    if c is None or c.problem or c.op not in EPILOGUE_OPS or c.inplace_of is not None or c.attrs.get("writes_out"):
        return False
    return not EPILOGUE_OPS[c.op].gradient_free


def _module_value_problem(operand: fx.Node, canon) -> str:
    """Why `operand`, made of no forward argument, is not taken for a tensor without example inputs: it is not among
    values_of_module_tensors'."""
    c = canon.get(operand)
    if c is not None and c.inplace_of is not None:
        return (f"operand {describe(operand)} changes {describe(c.inplace_of)} in place: without example inputs, only "
                "what the vocabulary's ops make out of place of module tensors and numbers is taken for a tensor")
    return (f"cannot prove that {describe(operand)} is a tensor without example inputs (of module tensors and numbers "
            "alone, only what the vocabulary's ops make out of place is, not detach, which returns its input's memory, "
            "not through a module's call, and not of a module tensor that an op of the forward may change in place): "
            "pass example inputs")


def _get_attr(gm: fx.GraphModule, path: str):
    value: Any = gm
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def describe(obj) -> str:
    return f"`{obj.name}`" if isinstance(obj, fx.Node) else f"`{obj}`"


# ---------------------------------------------------------------- growth

class _Growth:
    """The state of one region while it grows from its anchor."""

    def __init__(self, gm, anchor, canon, facts: Facts):
        self.gm, self.anchor, self.canon, self.facts = gm, anchor, canon, facts
        self.members: list[fx.Node] = []
        self.member_set: set[fx.Node] = set()
        self.value: dict[fx.Node, int] = {}     # fx node -> program value index
        self.rank: dict[int, int | None] = {}   # value index -> rank, when known
        self.reduced: set[int] = set()          # values that are one number per row
        self.dropped: set[int] = set()          # reduced values without the features dim (keepdim=False)
        self.one_feature: set[int] = set()      # reduced values whose features dim is provably one value
        self.min_rank: dict[int, int] = {}      # value index -> the least rank it can have (a GEMM output: 1)
        # value index -> the least rank it has at every call, whatever the example inputs' ranks: what the tensors it
        # broadcasts with that no input makes (module tensors, constants) give it (a GEMM output: 1)
        self.least_rank: dict[int, int] = {}
        # value index -> how many dims fewer than x it may have (the dims that reductions without keepdim dropped);
        # None for a value of params alone
        self.dims_below_x: dict[int, int | None] = {}
        # (x's rank that an admitted op's meaning depends on, the member count before that op)
        self.x_rank: tuple[int, int] | None = None
        self.dtypes: list[tuple[tuple, int, str]] = []  # (an admitted idiom's dtypes, the members before it, its op)
        self.feature_reads: list[int] = []  # the member count before each op that reads a number of the features
        self.out_writes: list[tuple[int, str, int]] = []  # (the member count before an out= op, its op, params so far)
        self.x_ranks_at_least: list[tuple[int, int]] = []  # (the member count before the op that needs it, the rank)
        # (the member count before the op that reads a forward argument that must be a tensor of a dtype, it, the
        # dtype, what it is to that op): one an op scales first, addmm's input
        self.scaled_arguments: list[tuple[int, fx.Node, torch.dtype, str]] = []
        # (a feature pool's kernel, the member count before it, and before it: the features, the values, and the
        # params of the biases added to the GEMM's output, which the pool averages too; whether it was unsqueezed)
        self.pool: tuple[int, int, int, dict, tuple, bool] | None = None
        self.instructions: list[Instruction] = []
        self.params: list[Any] = []
        self.misses: list[NearMiss] = []

    # -- operands

    def param(self, obj) -> Param:
        pooled = self.pool[4] if self.pool is not None else ()  # (a bias the pool averaged: its own param)
        for i, known in enumerate(self.params):
            if (known is obj or (isinstance(obj, Attr) and known == obj)) and i not in pooled:
                return Param(i)
        self.params.append(obj)
        return Param(len(self.params) - 1)

    def depends_on_region(self, node: fx.Node) -> fx.Node | None:
        """A region member that `node` is computed from (so fusing would make a cycle), or None."""
        start = self.facts.position[self.anchor]
        seen, stack = set(), [node]
        while stack:
            current = stack.pop()
            for source in current.all_input_nodes:
                if source in self.member_set:
                    return current
                if source not in seen and self.facts.position.get(source, -1) > start:
                    seen.add(source)
                    stack.append(source)
        return None

    def outside_operand_problem(self, operand, dtype, in_place: bool = False, promotes: bool = True,
                                raised_by: str | None = None) -> str | None:
        """Why `operand`, a tensor from outside the region, can't be a param of its fused op, or None. `in_place`:
        it is an operand of an in-place op, whose value keeps its dtype in eager (`h += b64` stays float32);
        `promotes`: its op promotes its operands' dtypes, as binary ops do; `raised_by`: the op, which raises for
        another dtype instead (prelu)."""
        if isinstance(operand, fx.Node):
            through = self.depends_on_region(operand)
            if through is not None:
                return (f"operand {describe(operand)} depends on the region's own output through "
                        f"{describe(through)}, so fusing would create a cycle")
            known = self.facts.is_tensor(operand)
            if known is False and isinstance(operand.meta.get("example_value", operand.meta.get("val")),
                                              (torch.SymInt, torch.SymFloat)):
                return (f"operand {describe(operand)} is not a tensor but a number known at run time only (a "
                        "dynamic size, or a tensor's item), which a program cannot hold")
            if known is False:
                return f"operand {describe(operand)} is not a tensor"
            # Without example inputs, a graph input (with no default), a module's result, or what tensor ops make of
            # graph inputs is taken as a tensor.
            if known is None and operand.op not in ("placeholder", "call_module") and \
                    operand not in self.facts.made_of_arguments:
                if not _reads_input(operand):
                    return _module_value_problem(operand, self.canon)
                return (f"cannot prove that {describe(operand)} is a tensor without example inputs (of forward "
                        "arguments, only what pointwise ops, norms, reductions over one dim, unsqueeze, flatten, "
                        "view and reshape make is, and a squeeze of an argument, or of pointwise ops of it and "
                        "numbers, that no op before it may change in place)")
        tensor = self.facts.tensor(operand)
        if tensor is not None and tensor.dtype != dtype:
            value = torch.empty(0, dtype=dtype, device="meta")
            promoted = promotes and not in_place and \
                torch.result_type(value, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")) != dtype
            effect = ("eager would promote the result" if promoted
                      else f"eager's {raised_by} raises for a tensor of another dtype" if raised_by is not None
                      else "the fused op takes params in the GEMM's dtype only")
            return (f"operand {describe(operand)} is {_dtype_name(tensor.dtype)} while the GEMM is "
                    f"{_dtype_name(dtype)} ({effect})")
        return None

    # -- admission

    def admit_anchor(self) -> str | None:
        c: Canonical = self.canon[self.anchor]
        x, weight, bias = (self.facts.resolve(o) for o in c.operands)
        weight_tensor = self.facts.tensor(weight)
        if weight_tensor is None or weight_tensor.dim() != 2:
            return f"the weight {describe(weight)} is not a known 2-D tensor"
        self.dtype = weight_tensor.dtype
        if self.dtype not in SUPPORTED_DTYPES:
            return f"{_dtype_name(self.dtype)} is not supported"
        x_tensor = self.facts.tensor(x)
        if x_tensor is not None:
            if x_tensor.dtype != self.dtype:
                return f"the input is {_dtype_name(x_tensor.dtype)} but the weight is {_dtype_name(self.dtype)}"
            if x_tensor.dim() < 2:
                return f"the input has {x_tensor.dim()} dim; a GEMM anchor needs 2 or more"
            if c.attrs.get("matrix_input") and x_tensor.dim() != 2:
                return f"mm and addmm take matrices; the input has {x_tensor.dim()} dims (eager raises)"
        self.features = weight_tensor.shape[1 if c.attrs["transpose_weight"] else 0]
        for name, obj in (("bias", bias), ("input", x)):
            if isinstance(obj, fx.Node) and self.facts.is_tensor(obj) is False:
                return f"the {name} {describe(obj)} is not a tensor"
        bias_tensor = self.facts.tensor(bias)
        if bias_tensor is not None and tuple(bias_tensor.shape) != (self.features,):  # F.linear broadcasts any
            return f"the bias {describe(bias)} has shape {tuple(bias_tensor.shape)}, not ({self.features},)"
        self.x, self.weight, self.bias = x, weight, bias
        self.transpose_weight = c.attrs["transpose_weight"]
        self.add_member(self.anchor, c)
        self.value[self.anchor] = 0
        self.rank[0] = None if x_tensor is None else x_tensor.dim()
        self.least_rank[0] = 2 if c.attrs.get("matrix_input") else 1  # linear takes a 1-D input
        self.dims_below_x[0] = 0
        self.min_rank[0] = self.rank[0] or self.least_rank[0]
        addmm_bias = self.facts.resolve(c.attrs.get("addmm_bias"))
        if addmm_bias is not None:  # addmm's input broadcasts like an added tensor
            problem = self.outside_operand_problem(addmm_bias, self.dtype)
            if problem:
                return problem
            if not self.facts.inputs_guarded and isinstance(addmm_bias, fx.Node) and _reads_input(addmm_bias):
                # eager's addmm takes a tensor of its matrices' dtype there, and promotes none: a later call's None,
                # number or other dtype raises, where the fused op took None for no bias and added another dtype
                if addmm_bias.op != "placeholder":
                    return (f"addmm's input {describe(addmm_bias)} is made of forward arguments, whose dtype may "
                            "differ at a later call, where eager's addmm raises (it promotes none)")
                self.scaled_arguments.append((0, addmm_bias, self.dtype, f"`{addmm_bias.target}`, addmm's input"))
            bias_tensor = self.facts.tensor(addmm_bias)
            if bias_tensor is not None and bias_tensor.dim() > 2:
                return (f"addmm's input {describe(addmm_bias)} has {bias_tensor.dim()} dims, not 2 or less "
                        "(eager raises)")
            if bias_tensor is not None and tuple(bias_tensor.shape) == (self.features,):
                self.bias = addmm_bias  # linear's own bias: the GEMM's, cast with it under autocast as addmm's is
            else:
                self.emit(self.anchor, "add", (Value(0), self.param(addmm_bias)), (), rank=self.rank[0])
        return None

    def add_member(self, node, c: Canonical):
        for member in (node, *c.covers):
            self.members.append(member)
            self.member_set.add(member)

    def emit(self, node, op, operands, attrs, rank, reduced=False, dropped=False, drops_dim=False, in_place=False,
             one_feature=False, broadcast=None):
        """Append instruction `op` of `operands` as `node`'s value, of `rank` where known; its least ranks are those
        of the operands that broadcast it (`broadcast`, all by default: not prelu's slopes)."""
        self.instructions.append(Instruction(op, tuple(operands), tuple(attrs), in_place))
        index = len(self.instructions)
        self.value[node] = index
        self.rank[index] = rank
        broadcast = operands if broadcast is None else broadcast
        least = max([self.min_rank[o.index] for o in broadcast if isinstance(o, Value)] +
                    [self.facts.rank(self.params[o.index]) or 0 for o in broadcast if isinstance(o, Param)])
        self.min_rank[index] = rank if rank is not None else least - drops_dim
        least_at_every_call = max([self.least_rank[o.index] for o in broadcast if isinstance(o, Value)] +
                                  [self.facts.rank(self.params[o.index]) or 0 for o in broadcast
                                   if isinstance(o, Param) and not _reads_input(self.params[o.index])],
                                  default=0)
        self.least_rank[index] = max(least_at_every_call - drops_dim, 0)
        # (a value of params alone, addcmul's `mul($0,2.0)`, has no dims of x's: None, which the min leaves out)
        below_x = [self.dims_below_x[o.index] for o in operands
                   if isinstance(o, Value) and self.dims_below_x[o.index] is not None]
        self.dims_below_x[index] = min(below_x) + drops_dim if below_x else None
        if reduced:
            self.reduced.add(index)
        if dropped:
            self.dropped.add(index)
        if one_feature:
            self.one_feature.add(index)

    def mode_switch_before(self, node: fx.Node) -> fx.Node | None:
        """The first node that switches autocast or grad mode after the GEMM and before `node`, if any."""
        low, high = self.facts.position[self.anchor], self.facts.position[node]
        return next((s for s in self.facts.mode_switches if low < self.facts.position[s] < high), None)

    def admit(self, node: fx.Node) -> str | None:
        """Add `node` to the region, or say why it can't be added."""
        c = self.canon.get(node)
        if c is None and node.op == "call_function" and node.target in FUSED_OPS:
            return Boundary(f"{describe(node)} is another region's fused op")
        if c is None:
            return f"{describe(node)} ({_target_name(node)}) is not an epilogue op"
        if c.problem:
            return c.problem
        if c.attrs.get("backward_refused") and self.facts.differentiated:  # eager's backward raises for it
            return c.attrs["backward_refused"]
        if c.op == LINEAR:
            return Boundary(f"{describe(node)} is another GEMM")
        # (an unread name of a value stays a member: `v = h[:]; h.mul_(2); v.relu()`, where the mul_ took v's readers)
        if not node.users and c.inplace_of is None and c.op != IDENTITY:
            # rewrite drops such an op only where eager cannot raise for it at a later call: one that eager raises
            # for must stay, and one taken in would give its params zero gradients where eager gives none
            if c.covers:  # (kept with the nodes it stands for)
                return f"the value of {describe(node)} is never used"
            if any(key in node.meta for key in ("val", "example_value", "tensor_meta")):
                return f"the value of {describe(node)} is never used, and another shape may make eager raise for it"
            return f"the value of {describe(node)} is never used (with example inputs it would be dropped)"
        switch = self.mode_switch_before(node)
        if switch is not None:  # the fused op runs where the region's last op was, under that op's modes
            return f"{describe(switch)} switches {_mode_switched_by(switch)} between the GEMM and {describe(node)}"
        mutated = self.facts.resolve(c.inplace_of)
        if mutated is not None and mutated not in self.member_set:
            return f"in-place {describe(node)} mutates {describe(mutated)}, which is outside the region"
        if c.op == FEATURE_POOL:
            return self.admit_feature_pool(node, c)
        operands = []
        for operand in map(self.facts.resolve, c.operands):
            if isinstance(operand, fx.Node) and operand in self.member_set and operand not in self.value:
                return (f"{describe(node)} reads {describe(operand)}, of which the fused op computes no value (the "
                        "GEMM's output before a pool that its weight took)")
            if isinstance(operand, fx.Node) and operand in self.value:
                operands.append(Value(self.value[operand]))
            elif isinstance(operand, SizeExpression):
                number, problem = self.size_expression_value(node, operand)
                if problem:
                    return problem
                operands.append(number)
            elif isinstance(operand, (fx.Node, Attr)):
                spec = EPILOGUE_OPS.get(c.op)
                problem = self.outside_operand_problem(
                    operand, self.dtype, in_place=mutated is not None, promotes=spec is None or spec.is_binary,
                    raised_by=c.op if spec is not None and spec.raises_for_another_dtype else None)
                if problem:
                    return problem
                operands.append(self.param(operand))
            else:
                operands.append(operand)
        values = [o for o in operands if isinstance(o, Value)]
        if not values:
            return f"{describe(node)} reads no value of the region"
        if mutated is not None:
            problem = self.in_place_problem(node, mutated, operands)
            if problem:
                return problem
        problem = self.number_promotion_problem(node, c, operands, values)
        if problem:
            return problem
        if c.op == IDENTITY:
            least, rank = c.attrs.get("rank_at_least"), self.rank.get(values[0].index)
            if least is not None and rank is not None and rank < least:
                return f"{describe(node)} indexes {least} dims of a {rank}-D value (eager raises)"
            # (x of that many dims gives its value them; the example inputs' ranks hold for them only)
            if least is not None and self.least_rank[values[0].index] < least and not self.facts.inputs_guarded:
                self.x_ranks_at_least.append((len(self.members), least + self.dims_below_x[values[0].index]))
            self.add_member(node, c)
            self.value[node] = values[0].index
            return None
        spec = EPILOGUE_OPS[c.op]
        dtype_needed = c.attrs.get("dtype_needed")
        if dtype_needed is not None and dtype_needed != self.dtype:
            return (f"{c.op} with dtype={_dtype_name(dtype_needed)} makes its {_dtype_name(self.dtype)} value "
                    f"{_dtype_name(dtype_needed)}")
        if dtype_needed is not None:  # a no-op as traced, but under autocast the GEMM output is autocast's dtype
            return (f"{c.op} with dtype={_dtype_name(dtype_needed)} pins its result's dtype, which the fused op "
                    "would not under autocast")
        rank = self.result_rank(_broadcasting(spec, operands))
        problem = (self.row_local_problem(node, c, spec, values[0].index, rank)
                   or self.rank_dependence(node, c, spec, rank, values[0].index))
        if problem:
            return problem
        over_one = self.over_one_feature(c, spec, values[0].index)
        if over_one is not None:
            self.add_member(node, c)
            self.emit_over_one_feature(node, over_one, values[0], rank)
            return None
        attrs = tuple(c.attrs[name] for name in spec.attrs)
        reduces = spec.kind == REDUCTION
        if reduces and rank is not None and not c.attrs["keepdim"]:
            rank -= 1
        if c.dtypes is not None:
            self.dtypes.append((c.dtypes, len(self.members), c.op))
        # (a normalized_shape of the features: the program normalizes over the last dim, whatever its size)
        if any(isinstance(o, SizeExpression) for o in c.operands) or c.attrs.get("normalized_size") is not None:
            self.feature_reads.append(len(self.members))
        if c.attrs.get("writes_out"):
            self.out_writes.append((len(self.members), c.op, len(self.params)))
        self.add_member(node, c)
        # A pointwise op is one number per row only if all its region operands are: `h * h.sum(-1, keepdim=True)`
        # broadcasts the reduced value back onto full rows.
        drops_dim = reduces and not c.attrs["keepdim"]
        dropped = drops_dim if reduces else all(v.index in self.dropped for v in values)
        # An in-place op keeps the changed value's dtype (program.py), where autocast may promote its out-of-place
        # form: a 16-bit value plus a float32 param, or on CUDA `h.exp_()`, whose `exp` runs in float32
        in_place = mutated is not None and operands[0] == Value(self.value.get(mutated, -1))
        # (computed as steps or not, a pointwise op broadcasts all its operands: its rank and flags above are theirs)
        one_feature = c.attrs["keepdim"] if reduces else self.keeps_one_feature(spec, operands)
        if "steps" in c.attrs:  # `h.add_(b, alpha=2)`: b * 2 first, as eager computes it
            operands, problem = self.emit_steps(node, c.attrs["steps"][:-1], c.attrs["steps"][-1][1], operands,
                                                at=len(self.members) - 1 - len(c.covers))
            if problem:
                return problem
        self.emit(node, c.op, operands, attrs, rank, reduced=reduces or all(v.index in self.reduced for v in values),
                  dropped=dropped, drops_dim=drops_dim, in_place=in_place, one_feature=one_feature,
                  broadcast=_broadcasting(spec, operands))
        return None

    def admit_feature_pool(self, node: fx.Node, c: Canonical) -> str | None:
        """An average pool of the GEMM's output over its features, in windows that tile them: each window's mean of
        the GEMM's columns is the GEMM of the weight's rows (and the bias's values) averaged over that window, which
        the rewritten graph computes before the fused op (a GEMM `kernel` times smaller); the program then reads the
        pooled features. The pool must come first: the program's values are of the pooled width."""
        pooled = self.facts.resolve(c.operands[0])
        if pooled in self.member_set and pooled not in self.value:  # (a second pool of the GEMM's output)
            return (f"{describe(node)} pools {describe(pooled)}, of which the fused op computes no value (the GEMM's "
                    "output before a pool that its weight took)")
        biases, at = self.bias_adds(), self.value.get(pooled)
        if at is not None and at < len(self.instructions) and self.bias_adds(at) is not None and self.pool is None:
            return (f"{describe(node)} pools {describe(pooled)} after other ops of the region: only a pool that comes "
                    "first (after adds of biases of the GEMM's features) folds into its weight, as the fused op then "
                    "computes the pooled values alone")
        if at != len(self.instructions) or biases is None or self.pool is not None:
            return (f"{describe(node)} pools a value the region computed: only the GEMM's own output, or it plus "
                    "biases of its features, folds into its weight")
        kernel = c.attrs["kernel"]
        if kernel > self.features:
            return f"{describe(node)}'s kernel_size {kernel} is more than the {self.features} features (eager raises)"
        for what, tensor in (("weight", self.weight), ("bias", self.bias)):
            if not self.facts.inputs_guarded and _reads_input(tensor):  # (Dynamo's guards keep its shape)
                return (f"{describe(node)} would average the {what} {describe(tensor)}, made of forward arguments, "
                        "whose shape may differ at a later call (where eager's pool raises, or its add broadcasts)")
        if self.dtype == torch.float16:
            return (f"{describe(node)} in float16: a GEMM column may overflow where its window's mean, which the "
                    "folded GEMM computes, does not")
        rank = self.rank.get(0)
        pooled_rank = None if rank is None else rank + c.attrs["unsqueezed"]
        if pooled_rank not in (None, 2, 3):
            return (f"{describe(node)} pools a {pooled_rank}-D value, where avg_pool1d takes 2-D or 3-D ones "
                    "(eager raises)")
        needed = 2 if c.attrs["unsqueezed"] or rank is None else rank  # (without example inputs: a 2-D x, checked)
        problem = self.need_x_rank(node, needed, rank, 0)
        if problem:
            return problem
        # (under autocast, the GEMM's dtype is checked at every call, as an idiom's)
        self.dtypes.append(((torch.float32, torch.bfloat16), len(self.members), "avg_pool1d"))
        # (the values so far are the pooled ones now: the GEMM's own output, and its sums with biases, are computed
        # nowhere)
        self.pool = (kernel, len(self.members), self.features, dict(self.value), biases, c.attrs["unsqueezed"])
        self.features //= kernel
        self.add_member(node, c)
        self.value.clear()
        self.value[node] = len(self.instructions)
        return None

    def bias_adds(self, count: int | None = None) -> tuple[int, ...] | None:
        """The params of the program so far (of its first `count` instructions) where each instruction adds a bias
        tensor (is_bias_tensor) of the GEMM's features, (N,), to the value before it (`x @ W.t() + b`): a pool of
        their sum is the sum of their pools, so they pool with the weight (their param indices); None where another
        op came first."""
        params = []
        for index, instruction in enumerate(self.instructions[:count]):
            operands = set(instruction.operands)
            param = next((o for o in operands if isinstance(o, Param)), None)
            tensor = None if param is None else self.facts.tensor(self.params[param.index])
            if instruction.op.rstrip("_") != "add" or instruction.attrs or operands != {Value(index), param} or \
                    not self.is_bias_tensor(self.params[param.index]) or tensor is None or \
                    tuple(tensor.shape) != (self.features,):
                return None
            params.append(param.index)
        return tuple(dict.fromkeys(params))  # (a tensor added twice is one param, averaged once)

    def is_bias_tensor(self, obj) -> bool:
        """Whether `obj` may be a bias that a pool averages with the weight: a module tensor, or a graph input of a
        Dynamo graph (where the module's parameters are inputs, and guards keep their shapes)."""
        if module_tensor_path(obj) is not None:
            return True
        return self.facts.inputs_guarded and isinstance(obj, fx.Node) and obj.op == "placeholder"

    def emit_steps(self, node, steps, last_args, operands, at: int) -> tuple[list, str | None]:
        """Emit the steps before a canonical op computed as several (canonicalize.computed_as) on its resolved
        `operands`, and give the last step's operands; or say why not. A step may read outside tensors only
        (`mul($0,2.0)`, a param scaled by alpha) where their dtypes are known, and so the region's
        (outside_operand_problem): eager computes the whole op in the dtype all its operands promote to, where an
        integer one scaled first would become float32 (and addcdiv raises for two integer ones); or where they are
        forward arguments, whose dtype the rewritten graph checks before any op (`scaled_arguments`; `at`: the
        member count before `node`). One of numbers only would compute in Python's precision, where eager rounds the
        numbers to the value's dtype first."""
        def resolve(arg):
            if isinstance(arg, OperandOf):
                return operands[arg.position]
            return Value(len(self.instructions)) if arg == PREVIOUS else arg

        of_params = set()  # the steps that read no region value (`mul($0,2.0)`, then `mul(%1,$1)` of addcmul)
        for op, args in steps:
            step = [resolve(a) for a in args]
            if not any(isinstance(o, (Value, Param)) for o in step):
                return [], f"{describe(node)} computes {op} of the numbers {', '.join(map(repr, step))} first"
            values = [o for o in step if isinstance(o, Value) and o.index not in of_params]
            unknown = [self.params[o.index] for o in step
                       if isinstance(o, Param) and self.facts.tensor(self.params[o.index]) is None]
            # (a forward argument's dtype is checked before any op: in another, the model's own forward runs)
            unchecked = next((p for p in unknown if not (isinstance(p, fx.Node) and p.op == "placeholder" and
                                                         not self.facts.inputs_guarded)), None)
            if not values and unchecked is not None:
                return [], (f"{describe(node)} computes {op} of {describe(unchecked)}, whose dtype is unknown, before "
                            "it reads the region's value: eager's dtype and errors for an integer one would differ, and "
                            "only a forward argument's dtype is checked before any op (pass example inputs)")
            if not values:
                self.scaled_arguments.extend(
                    (at, p, self.dtype, f"`{p.target}`, which `{node.name}` scales before it reads the GEMM's value")
                    for p in unknown)
            self.emit(node, op, step, (), self.result_rank(step),
                      reduced=bool(values) and all(v.index in self.reduced for v in values),
                      dropped=bool(values) and all(v.index in self.dropped for v in values))
            if not values:
                of_params.add(len(self.instructions))
        return [resolve(a) for a in last_args], None

    def keeps_one_feature(self, spec, operands) -> bool:
        """Whether a pointwise op of values whose features dim is one value provably keeps it one value: its
        outside tensors' shapes are known, and their last dim is 1."""
        if spec.kind != POINTWISE:
            return False
        for o in operands:
            if isinstance(o, Value) and o.index not in self.one_feature:
                return False
            if isinstance(o, Param) and self.param_may_be_wider_than_one_feature(o.index):
                return False
        return True

    def param_may_be_wider_than_one_feature(self, index: int) -> bool:
        """Whether param `index` may broadcast a value of one feature to more: its shape is not known, or its last
        dim is not 1, or it is the caller's (a forward argument, or made of one), whose example shape a later call
        need not keep (Dynamo's guards keep it)."""
        param = self.params[index]
        if not self.facts.inputs_guarded and _reads_input(param):
            return True
        tensor = self.facts.tensor(param)
        return tensor is None or (tensor.dim() > 0 and tensor.shape[-1] != 1)

    def over_one_feature(self, c: Canonical, spec, index: int):
        """The pointwise steps that stand for a norm or reduction whose input's features dim an earlier keepdim
        reduction left at one value (epilogue.py's over_one_feature), or None. Reductions keep the dim: the program
        has no op that only drops it."""
        if index not in self.one_feature or spec.over_one_feature is None:
            return None
        if spec.kind == REDUCTION and not c.attrs["keepdim"]:
            return None
        return spec.over_one_feature

    def emit_over_one_feature(self, node, steps, value: Value, rank) -> None:
        """`node` as `steps`, each on the value ("x") or the previous step's result ("y"); none: the value itself."""
        result = value
        for op, args in steps:
            count = len(EPILOGUE_OPS[op].operands)
            operands = [value if a == "x" else result if a == "y" else a for a in args[:count]]
            self.emit(node, op, operands, args[count:], rank, reduced=True, one_feature=True)
            result = Value(len(self.instructions))
        self.value[node] = result.index

    def size_expression_value(self, node: fx.Node, expression: SizeExpression) -> tuple[Any, str | None]:
        """The number a size expression computes, where every dim it reads is the features of a region value, which
        the GEMM's weight fixes (a batch dim is the caller's, and may change at a later call); or why not."""
        source = self.facts.resolve(expression.source)
        index = self.value.get(source)
        if index is None:
            return None, f"{describe(expression)} is computed from a size of {describe(source)}, no value of the region"
        if index in self.reduced or (self.features == 1 and index != 0):  # (1 feature: broadcasting may widen it)
            return None, (f"{describe(expression)} reads a size of {describe(source)}, whose last dim need not be the "
                          "GEMM's features")
        if module_tensor_path(self.weight) is None and not self.facts.inputs_guarded:
            return None, (f"{describe(expression)} reads the feature count, which the weight {describe(self.weight)}, "
                          "no module tensor, may change at a later call")
        rank = self.rank.get(index)
        for dim in expression.dims:
            if dim == -1:
                continue
            batch = f"{describe(expression)} reads dim {dim} of {describe(source)}"
            if dim < -1 or (rank is not None and dim != rank - 1):
                return None, (f"{batch}, a batch dim{f' of a {rank}-D value' if rank is not None else ''}, not the "
                              "features: its size is the caller's, and may change at a later call")
            if dim == 0:  # the features of a 1-D value only
                return None, (f"{batch}, the features of a 1-D value only, else a batch dim, whose size may change at "
                              "a later call (pass example inputs)")
            problem = self.need_x_rank(node, dim + 1, rank, index)
            if problem:
                return None, problem
        try:
            number = expression.value(self.features)
        except (ArithmeticError, ValueError) as error:
            return None, f"{describe(expression)} raises for {self.features} features ({error})"
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            return None, f"{describe(expression)} is {type(number).__name__}, not a number"
        return number, None

    def number_promotion_problem(self, node: fx.Node, c: Canonical, operands, values) -> str | None:
        """A forward argument may be a number at a call, which the fused op reads as a 0-d tensor (rewrite's
        number_as_tensor, float64 for a float): a binary op of it and a value of no dims (`fc(x).amax(-1) / s` of a
        1-D x) would then promote the result to float64, where eager's number keeps the value's dtype. Where x is a
        forward argument, a first check of its rank keeps every such value 1-D or more (a call of fewer dims runs the
        model's own forward); else the operand is left out of the region."""
        spec = EPILOGUE_OPS.get(c.op)
        if self.facts.inputs_guarded or spec is None or not spec.is_binary:
            return None
        may_have_no_dims = [v for v in values if self.least_rank[v.index] == 0]
        if not may_have_no_dims:
            return None
        for operand in operands:
            outside = self.params[operand.index] if isinstance(operand, Param) else None
            if not (isinstance(outside, fx.Node) and _reads_input(outside)):
                continue
            if isinstance(self.x, fx.Node) and self.x.op == "placeholder":
                least = max(self.dims_below_x[v.index] for v in may_have_no_dims) + 1
                self.x_ranks_at_least.append((len(self.members), least))
                return None
            return (f"{describe(node)} reads {describe(outside)}, which may be a number at a call, with a value "
                    "that may have no dims: the number's 0-d tensor would promote it")
        return None

    def in_place_problem(self, node: fx.Node, mutated: fx.Node, operands) -> str | None:
        """An in-place op keeps the mutated value's shape and dtype, where the fused op's result would broadcast
        and promote like an out-of-place op's: its other operands must provably fit the mutated value. An outside
        tensor computed from a graph input may have another shape or dtype at a later call, unless the graph's
        inputs are guarded (Dynamo's) or it is the input of a GEMM of a module weight (whose dtype the GEMM takes
        and whose shape differs from the GEMM output's in the weight's sizes only, `out += x`). Else the example
        inputs prove it by running the op (`node` then has a shape), at their sizes (`_fits_the_example_sizes_only`
        for the others); without them an outside tensor must be known,
        in the GEMM's dtype (outside_operand_problem), and broadcast into one row's features; a region value must
        not outgrow the mutated one (`h.sum(-1, keepdim=True).mul_(h)`). The dtype needs no proof: the program's
        in-place instruction keeps the mutated value's (program.py), as under autocast, where the mutated value may
        be 16-bit and the other operand float32."""
        for operand in operands:
            outside = self.params[operand.index] if isinstance(operand, Param) else None
            gemm_input = outside is self.x and module_tensor_path(self.weight) is not None  # `out += x`: as fixed
            if not self.facts.inputs_guarded and self.facts.tensor(outside) is not None and _reads_input(outside) \
                    and not gemm_input:
                return (f"in-place {describe(node)} reads {describe(outside)}, whose shape and dtype may differ at a "
                        "later call, where eager keeps the mutated value's (or raises)")
        target = self.value.get(mutated)
        if self.facts.tensor(node) is not None:
            return self._fits_the_example_sizes_only(node, operands, target)
        if target is None:
            return f"in-place {describe(node)} mutates {describe(mutated)}, which the region does not compute"
        for operand in operands:
            if isinstance(operand, Param):
                tensor = self.facts.tensor(self.params[operand.index])
                if tensor is None:
                    return (f"in-place {describe(node)}: without example inputs, "
                            f"{describe(self.params[operand.index])} might change the mutated value's shape or dtype")
                shape = tuple(tensor.shape)
                target_rank = self.rank.get(target) or self.min_rank[target]  # known, or the least it can be
                if any(d != 1 for d in shape[:-1]) or (shape and shape[-1] not in (1, self.features)) or \
                        (shape and shape[-1] != 1 and target in self.reduced) or len(shape) > target_rank:
                    return (f"in-place {describe(node)} may broadcast {describe(self.params[operand.index])} of "
                            f"shape {shape} beyond the mutated value, which eager raises for (its shape is unknown)")
            elif isinstance(operand, Value) and operand.index != target:
                if operand.index not in self.reduced and target in self.reduced:
                    return f"in-place {describe(node)} would broadcast a full row into a reduced value (eager raises)"
                if (operand.index in self.dropped) != (target in self.dropped):  # (M,) and (M, 1) make (M, M)
                    return (f"in-place {describe(node)} would broadcast a value reduced with keepdim="
                            f"{operand.index not in self.dropped} into one reduced with keepdim="
                            f"{target not in self.dropped} (eager raises)")
                rank, target_rank = self.rank.get(operand.index), self.rank.get(target)
                if rank is not None and target_rank is not None and rank > target_rank:
                    return f"in-place {describe(node)} would broadcast a {rank}-D value into a {target_rank}-D one"
                if target_rank is None and self.min_rank[operand.index] > self.min_rank[target]:  # h.mul_(h + b3d)
                    return (f"in-place {describe(node)}: its operand has {self.min_rank[operand.index]} dims or more, "
                            "the mutated value may have fewer (pass example inputs)")
        return None

    def _fits_the_example_sizes_only(self, node: fx.Node, operands, target: int | None) -> str | None:
        """The example inputs ran the in-place op, which proves that an outside tensor fits the mutated value at their
        sizes only: the value's dims before the features are the caller's (the rows of x), so a tensor with a size
        other than 1 there (`h.mul_(self.row_scale)` of a (batch, 1) buffer) makes eager raise at another batch size,
        where the fused op would broadcast the value to the tensor's rows; and one of more dims than x has at a
        later call would give the value more, where eager raises: x must have as many (`require_rank_at_least`),
        unless the module tensors the mutated value (`target`) broadcasts with give it as many at every call.
        Dynamo's graphs are guarded on their inputs' sizes; the GEMM's own input has the value's leading dims
        (`out += x`)."""
        if self.facts.inputs_guarded:
            return None
        for operand in operands:
            if not isinstance(operand, Param):
                continue
            outside = self.params[operand.index]
            tensor = self.facts.tensor(outside)
            if tensor is None or (outside is self.x and module_tensor_path(self.weight) is not None):
                continue
            shape = tuple(tensor.shape)
            if any(d != 1 for d in shape[:-1]):
                return (f"in-place {describe(node)} reads {describe(outside)} of shape {shape}, which fits the mutated "
                        "value at the example inputs' sizes only (eager raises at others)")
            # (x has a dim at least: the value has its rank, or more after a broadcast)
            if len(shape) > 1 and (target is None or len(shape) > self.least_rank.get(target, 0)):
                self.x_ranks_at_least.append((len(self.members), len(shape) + self.dims_below_x.get(target, 0)))
        return None

    def result_rank(self, operands) -> int | None:
        ranks = []
        for o in operands:
            if isinstance(o, Value):
                ranks.append(self.rank[o.index])
            elif isinstance(o, Param):
                ranks.append(self.facts.rank(self.params[o.index]))
        return None if any(r is None for r in ranks) else max(ranks, default=None)

    def rank_dependence(self, node, c: Canonical, spec, rank: int | None, index: int) -> str | None:
        """Record the rank of x that `node`'s meaning depends on: group_norm and batch_norm take the features as dim
        1 of a 2-D value, instance_norm takes the ranks it names, an op over an explicit dim takes it as the
        features. That is x's rank where the value has it (it works on unreduced values); where a param of more
        dims broadcast the value up, its rank follows x's only past the param's, which no check of x's rank says:
        a problem. At run time another rank must raise, not compute what the program says. Conflicting needs make
        a problem."""
        if c.op in ("group_norm", "batch_norm"):
            needed = 2
        elif c.attrs.get("rank_needed"):
            needed = rank
        elif spec.feature_dim_attr and c.attrs[spec.feature_dim_attr] != -1:
            needed = c.attrs[spec.feature_dim_attr] + 1
        else:
            return None
        return self.need_x_rank(node, needed, rank, index)

    def need_x_rank(self, node, needed: int, rank: int | None, index: int) -> str | None:
        """Record that `node` holds for `needed`-D inputs only (its value, `index`, of rank `rank` where known, has x's
        rank), or say why that can't be told."""
        x_rank = self.rank.get(0)
        if (rank is not None and x_rank is not None and rank != x_rank) or \
                (x_rank is None and self.min_rank.get(index, 2) > 2):
            return (f"{describe(node)} depends on its value's rank, which a param of more dims than the GEMM's "
                    "input set")
        if rank is None and self.may_outrank_x(index):
            return (f"{describe(node)} depends on its value's rank, which an outside tensor of a rank not known may "
                    "make more than the GEMM input's (pass example inputs)")
        if self.x_rank is not None and self.x_rank[0] != needed:
            return (f"{describe(node)} holds for {needed}-D inputs, an earlier op of the region for "
                    f"{self.x_rank[0]}-D ones")
        if self.x_rank is None:
            self.x_rank = (needed, len(self.members))
        return None

    def may_outrank_x(self, index: int) -> bool:
        """Whether value `index` may have more dims than x: an outside tensor of a rank not known (a forward argument
        without example inputs) broadcast into it, or into a value it is made of."""
        outranking: set[int] = set()
        for value, instruction in enumerate(self.instructions[:index], start=1):
            for operand in instruction.operands:
                if isinstance(operand, Value) and operand.index in outranking:
                    outranking.add(value)
                elif isinstance(operand, Param) and self.params[operand.index] is not self.x and \
                        self.facts.rank(self.params[operand.index]) is None:
                    outranking.add(value)
        return index in outranking

    def may_have_more_features(self, index: int) -> bool:
        """Whether value `index` may have more than the GEMM's features in its last dim: a GEMM of one feature
        broadcasts with an outside tensor of more, or of a count not known, to its size (`fc(x) + x` of a
        Linear(k, 1)), up to a reduction over the features."""
        if self.features != 1 or index == 0:
            return False
        instruction = self.instructions[index - 1]
        if EPILOGUE_OPS[instruction.op.rstrip("_")].kind == REDUCTION:
            return False
        for operand in instruction.operands:
            if isinstance(operand, Value) and self.may_have_more_features(operand.index):
                return True
            if isinstance(operand, Param) and self.param_may_be_wider_than_one_feature(operand.index):
                return True
        return False

    def row_local_problem(self, node, c: Canonical, spec, input_index: int, rank: int | None) -> str | None:
        """Norms and reductions must work within each row of the GEMM output; say why not if they don't."""
        if spec.kind == POINTWISE and c.op != "batch_norm":
            return None
        name = c.op
        if input_index in self.reduced and self.over_one_feature(c, spec, input_index) is None:
            kept = " with keepdim=False" if input_index in self.one_feature and spec.over_one_feature else ""
            return (f"{name}{kept} of {describe(node.args[0] if node.args else node)} works on an already reduced "
                    "value")
        if c.op in ("group_norm", "batch_norm") and rank is not None and rank != 2:
            return f"{name} on a {rank}-D output normalizes over dim 1, not the features"
        if c.op == "group_norm":
            groups = c.attrs["num_groups"]
            if groups <= 0 or self.features % groups:
                return f"group_norm: {self.features} channels not divisible by {groups} groups"
        size = c.attrs.get("normalized_size")
        if size is not None and size != self.features:
            return f"{name}'s normalized_shape is ({size},) but the GEMM has {self.features} features (eager raises)"
        if size is not None and self.may_have_more_features(input_index):
            return (f"{name}'s normalized_shape is ({size},) but its value may have more features after a broadcast "
                    "with an outside tensor (eager raises)")
        if size is not None and module_tensor_path(self.weight) is None and not self.facts.inputs_guarded:
            # the program normalizes over the last dim, whatever its size: eager raises for another
            return (f"{name}'s normalized_shape is ({size},) but the GEMM's weight {describe(self.weight)} is no "
                    "module tensor, so its feature count may differ at a later call (eager raises there)")
        problem = _rank_problem(node, c.attrs.get("rank_needed"), rank)
        if problem:
            return problem
        for name_ in spec.operands:
            if name_ in spec.feature_operands:
                operand = self.facts.resolve(c.operands[spec.operands.index(name_)])
                t = self.facts.tensor(operand)
                if t is not None and tuple(t.shape) != (self.features,):
                    return f"{c.op}'s {name_} has shape {tuple(t.shape)}, not ({self.features},)"
        if spec.feature_dim_attr:
            dim = c.attrs[spec.feature_dim_attr]
            if dim != -1 and rank is not None and dim != rank - 1:
                return f"{c.op} over dim {dim} of a {rank}-D value, not the features (dim {rank - 1})"
            if dim == 0 or dim < -1:  # a GEMM output has 2 or more dims; its features are the last one
                return f"{c.op} over dim {dim}, which is never the features of a GEMM output (the last dim)"
        return None

    # -- prefixes: every admission can be undone, and the best valid prefix is kept

    def snapshot(self) -> tuple[int, int, int]:
        return len(self.members), len(self.instructions), len(self.params)

    def restore(self, snapshot: tuple[int, int, int]) -> None:
        n_members, n_instructions, n_params = snapshot
        for member in self.members[n_members:]:
            self.member_set.discard(member)
            self.value.pop(member, None)
        del self.members[n_members:]
        del self.instructions[n_instructions:]
        del self.params[n_params:]
        for index in [i for i in self.rank if i > n_instructions]:
            del self.rank[index]
            self.min_rank.pop(index, None)
            self.least_rank.pop(index, None)
            self.dims_below_x.pop(index, None)
            self.reduced.discard(index)
            self.dropped.discard(index)
            self.one_feature.discard(index)
        if self.x_rank is not None and self.x_rank[1] >= n_members:
            self.x_rank = None
        self.dtypes = [entry for entry in self.dtypes if entry[1] < n_members]
        self.feature_reads = [at for at in self.feature_reads if at < n_members]
        self.out_writes = [entry for entry in self.out_writes if entry[0] < n_members]
        self.x_ranks_at_least = [entry for entry in self.x_ranks_at_least if entry[0] < n_members]
        self.scaled_arguments = [entry for entry in self.scaled_arguments if entry[0] < n_members]
        if self.pool is not None and self.pool[1] >= n_members:
            self.value = {node: index for node, index in self.pool[3].items() if node in self.member_set}
            self.features, self.pool = self.pool[2], None

    # -- validity of the current prefix

    def escaping(self) -> list[tuple[fx.Node, fx.Node]]:
        """(member, outside user) pairs: values that leave the region."""
        return [(m, u) for m in self.members for u in m.users if u not in self.member_set]

    def output_if_valid(self) -> fx.Node | None:
        if not self.instructions and self.pool is None:  # (a pool alone: a GEMM that many times smaller)
            return None
        last = next(m for m in reversed(self.members) if m in self.value)
        leaving = {m for m, _ in self.escaping()}
        if leaving - {last} or self.value[last] != len(self.instructions):
            return None
        return last


def _reads_input(obj) -> bool:
    """Whether `obj` is a graph input or computed from one (its shape and dtype are then the caller's)."""
    seen, stack = set(), [obj] if isinstance(obj, fx.Node) else []
    while stack:
        node = stack.pop()
        if node.op == "placeholder":
            return True
        for source in node.all_input_nodes:
            if source not in seen:
                seen.add(source)
                stack.append(source)
    return False


def _rank_problem(node: fx.Node, needed, rank: int | None) -> str | None:
    """An op that takes only some ranks (`rank_needed`): why this one can't be fused, or None."""
    if needed is None or rank in needed:
        return None
    return (f"{describe(node)} takes only {' or '.join(f'{r}-D' for r in needed)} values here; the rank is "
            f"{'unknown (pass example inputs)' if rank is None else rank}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _target_name(node: fx.Node) -> str:
    if node.op == "output":
        return "the graph output"
    target = node.target
    return getattr(target, "__name__", str(target))


def find_region(gm: fx.GraphModule, anchor: fx.Node, canon, facts: Facts):
    """Grow the largest legal region from `anchor`. Returns (Region or None, near misses)."""
    growth = _Growth(gm, anchor, canon, facts)
    problem = growth.admit_anchor()
    if problem:
        logger.debug("anchor %s: not fusible: %s", anchor.name, problem)
        return None, [NearMiss(anchor, anchor, problem)]
    candidates = []  # every admitted prefix with a single output, smallest first: (snapshot, output)
    first_cut_reason = None
    rejected: dict[fx.Node, str] = {}
    heap = [(facts.position[u], u) for u in anchor.users]
    heap += [(facts.position[u], u) for m in growth.members for u in m.users if u not in growth.member_set]
    heapq.heapify(heap)
    while heap:
        position, node = heapq.heappop(heap)
        covering = canon.get(node)
        if covering is not None and covering.op == COVERED:  # e.g. torch.min(...) is fused through its [0]
            node = covering.operands[0]
            if facts.position.get(node, -1) > position:  # in graph order: after the operands it reads (`d * relu(h)`)
                heapq.heappush(heap, (facts.position[node], node))
                continue
        if node in growth.member_set or node in rejected:
            continue
        snapshot = growth.snapshot()
        problem = growth.admit(node)
        if problem:
            rejected[node] = problem
            growth.restore(snapshot)
            logger.debug("anchor %s: %s not admitted: %s", anchor.name, node.name, problem)
            continue
        logger.debug("anchor %s: admitted %s", anchor.name, node.name)
        for member in growth.members[snapshot[0]:]:
            for user in member.users:
                if user not in growth.member_set:
                    heapq.heappush(heap, (facts.position[user], user))
        output = growth.output_if_valid()
        if output is not None:
            candidates.append((growth.snapshot(), output))
            first_cut_reason = None
        elif first_cut_reason is None and candidates:
            first_cut_reason = _escape_reason(growth)
    best = candidates[-1] if candidates else None
    kept = set(growth.members[:best[0][0]]) if best else set()
    misses = [NearMiss(anchor, node, reason) for node, reason in rejected.items()
              if node.op != "output" and not isinstance(reason, Boundary) and node not in kept]
    if best is None:
        if len(growth.members) > 1 and not growth.instructions:  # only no-ops (eval dropout, contiguous) follow
            misses.insert(0, NearMiss(anchor, anchor, "no epilogue op follows the GEMM, only no-ops"))
        elif len(growth.members) > 1:  # ops were admitted, but no prefix of them has a single output
            misses.insert(0, NearMiss(anchor, anchor, _escape_reason(growth)))
        if not misses:  # (a Boundary: another GEMM, the output, or an op an earlier GEMM's region took)
            taken = next((n for n in rejected if n.op == "call_function" and n.target in FUSED_OPS), None)
            reason = "no epilogue op follows the GEMM" if taken is None else \
                f"the epilogue op that follows it was fused into another GEMM's region, whose {describe(taken)} " \
                "reads it"
            misses = [NearMiss(anchor, anchor, reason)]
        return None, _keep_relevant(misses, growth)
    n_members = best[0][0]
    if n_members < len(growth.members) and first_cut_reason:
        misses.insert(0, NearMiss(anchor, growth.members[n_members], first_cut_reason))
    # The largest legal prefix: one that spans an op changing what it reads may be legal without its last ops.
    largest_problem = None
    for snapshot, output in reversed(candidates):
        region = _region_of(growth, snapshot, output)
        problem = _gradient_problem(region) or _unchecked_rank_problem(region, facts) or \
            prove_legal(gm, region, facts) or _mutation_problem(region, canon, facts)
        if problem is None:
            if largest_problem is not None:
                misses.insert(0, NearMiss(anchor, growth.members[snapshot[0]], largest_problem))
            return region, _keep_relevant(misses, growth, region)
        largest_problem = largest_problem or problem
    return None, [NearMiss(anchor, anchor, largest_problem)]


def _gradient_problem(region: Region) -> str | None:
    """A result that depends on the GEMM only through detach has no gradient from it in eager (the GEMM's weight gets
    none, and with no other param the result requires none), where the fused op's would be zeros."""
    reaches = {0}  # the values the GEMM output's gradient reaches
    for index, ins in enumerate(region.program.instructions, start=1):
        spec = EPILOGUE_OPS[ins.op.rstrip("_")]
        if not spec.gradient_free and any(isinstance(o, Value) and o.index in reaches for o in ins.operands):
            reaches.add(index)
    if len(region.program.instructions) in reaches:
        return None
    return f"{describe(region.output)} depends on the GEMM only through detach, so eager gives the GEMM no gradient"


def _broadcasting(spec, operands) -> list:
    """The operands of an op (of `spec`) that its value broadcasts with: not its feature operands, prelu's slopes or
    a norm's affines, which keep the value's shape (prelu of a 0-d value is 0-d)."""
    return [o for i, o in enumerate(operands)
            if i >= len(spec.operands) or spec.operands[i] not in spec.feature_operands]


def _unchecked_rank_problem(region: Region, facts: Facts) -> str | None:
    """A program that holds for one rank of x (region.x_rank), or for x of some dims or more (region.x_rank_at_least:
    a whole view `h[:, :]`, which eager raises IndexError for where h has fewer, unless an operand broadcast gives it
    them), is fused in optimize()'s graphs where a check before any op can tell x's rank at a call, so that a call of
    another rank runs the model's own forward. Where none can (x is what an op makes whose result's rank does not
    follow from the forward arguments', such as a hooked module, which may change its inputs and return any rank, and
    no example inputs gave ranks), the check could only come after that op: it would raise where eager computes
    (softmax over dim 1 of a 3-D value) or raises another error, and handing the call to the model's forward there
    would run what ran before it, a hook, twice."""
    least = region.x_rank_at_least if region.x_rank_at_least is not None and \
        (region.x_rank or 0) < region.x_rank_at_least else None
    if (region.x_rank is None and least is None) or facts.rank_checks_before_any_op is None:
        return None
    needed = f"a {region.x_rank}-D input only" if region.x_rank is not None else f"an input of {least} dims or more"
    changed_by = facts.rank_changed_in_place.get(region.x)
    if changed_by is not None and facts.position.get(changed_by, -1) < max(facts.position[m] for m in region.members):
        return (f"the fused op holds for {needed}, and an op may change the rank of {describe(region.x)} in place "
                "(`unsqueeze_`, `out=`, a hooked module): no check before the model's first op can tell it at a call, "
                "and a later one would raise where eager computes for another rank")
    if region.x_rank is not None and region.x in facts.following_ranks:  # (a first check that fails at every call)
        made_of, fewest = facts.following_ranks[region.x]
        fixed = all(offset is None for offset in made_of.values())
        if fewest > region.x_rank or (fixed and fewest != region.x_rank):
            return (f"the fused op holds for {needed}, and {describe(region.x)} has "
                    f"{fewest if fixed else f'{fewest} or more'} dims at every call")
    if facts.rank_checks_before_any_op(region.x, region.x_rank if region.x_rank is not None else least):
        return None
    return (f"the fused op holds for {needed}, and no check before the model's first op can tell the rank of "
            f"{describe(region.x)} at a call (a later one would raise where eager computes for another rank, or "
            "raises another error): pass example inputs")


def _region_of(growth: _Growth, snapshot: tuple, output: fx.Node) -> Region:
    """The region of the growth's first members, up to a snapshot taken when they had one output."""
    n_members, n_instructions, n_params = snapshot
    return Region(growth.anchor, growth.members[:n_members], output, growth.x, growth.weight,
                  growth.transpose_weight, growth.bias, growth.params[:n_params],
                  Program(tuple(growth.instructions[:n_instructions])),
                  check_matrix=growth.canon[growth.anchor].attrs.get("matrix_input", False),
                  x_rank=growth.x_rank[0] if growth.x_rank is not None and growth.x_rank[1] < n_members else None,
                  dtypes=_common_dtypes([dtypes for dtypes, at, _ in growth.dtypes if at < n_members]),
                  dtype_ops=tuple(sorted({op for _, at, op in growth.dtypes if at < n_members})),
                  reads_features=any(at < n_members for at in growth.feature_reads),
                  out_write=next(((op, n) for at, op, n in reversed(growth.out_writes) if at < n_members), None),
                  x_rank_at_least=max((rank for at, rank in growth.x_ranks_at_least if at < n_members), default=None),
                  scaled_arguments=tuple(dict.fromkeys((argument, dtype, what)
                                                       for at, argument, dtype, what in growth.scaled_arguments
                                                       if at < n_members)),
                  pool=growth.pool[0] if growth.pool is not None and growth.pool[1] < n_members else None,
                  pooled_params=growth.pool[4] if growth.pool is not None and growth.pool[1] < n_members else (),
                  pool_reads_rows=growth.pool is not None and growth.pool[1] < n_members and not growth.pool[5])


def _common_dtypes(each: list[tuple]) -> tuple | None:
    """The dtypes every one of the region's idioms holds for, in the first one's order; None if none restricts."""
    if not each:
        return None
    return tuple(dtype for dtype in each[0] if all(dtype in dtypes for dtypes in each[1:]))


def _keep_relevant(misses, growth, region=None):
    """Keep the misses that stopped the region: ops fed by the region, not every later node."""
    members = set(region.members) if region else growth.member_set

    def fed_by_region(node):
        # A node that stands for others (`[0]` of `torch.min(h, 1)`) is fed through its canonical operands.
        c = growth.canon.get(node)
        operands = [o for o in c.operands if isinstance(o, fx.Node)] if c is not None else []
        return any(i in members for i in [*node.all_input_nodes, *operands])

    return [m for m in misses if m.node is m.anchor or fed_by_region(m.node)]


def _escape_reason(growth: _Growth) -> str:
    for member, user in growth.escaping():
        if member is not growth.members[-1]:
            return f"intermediate {describe(member)} is also used by {describe(user)}"
    return "the region would have more than one output"


# ---------------------------------------------------------------- legality proof


def _mutated_by(node: fx.Node, canon, gm: fx.GraphModule) -> list:
    """The tensors that `node` may change in place: an in-place op's input, `out=`, item assignment
    (`y[0] = 1`), `inplace=True` on any call or module; else none."""
    c = canon.get(node)
    if c is not None and c.inplace_of is not None:
        return [c.inplace_of]
    mutated = []
    if node.op in ("call_method", "call_function", "call_module"):
        out = node.kwargs.get("out")
        if isinstance(out, (tuple, list)):
            mutated.extend(out)
        elif out is not None:
            mutated.append(out)
        inplace_module = node.op == "call_module" and getattr(gm.get_submodule(node.target), "inplace", False)
        if (_inplace_argument(node) or inplace_module) and node.args:
            mutated.append(node.args[0])
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if isinstance(node.target, torch._ops.OpOverload):  # aten.relu_.default
        name = node.target.overloadpacket.__name__
    in_place_name = isinstance(name, str) and (name.endswith("_") and not name.endswith("__")  # relu_, _foreach_mul_
                                               or name.startswith("__i") and name.endswith("__"))  # __imul__
    if node.op in ("call_method", "call_function") and node.args and (
            in_place_name or node.target is operator.setitem or node.target in _OPERATOR_IN_PLACE):
        first = node.args[0]
        mutated.extend(first if isinstance(first, (tuple, list)) else [first])  # _foreach_*_ take lists
    if node.op == "call_function" and node.target is augmented_assignment and \
            getattr(operator, node.args[0]) in _OPERATOR_IN_PLACE and not surely_not_tensor(node.args[1]):
        mutated.append(node.args[1])  # (`n *= 2` of an int changes nothing)
    if node.op == "call_function":
        mutated.extend(_written_by_schema(node))
        if _opaque(node.target):  # a Python function of the user's (torch.fx.wrap): it may change any tensor given,
            mutated.extend(node.all_input_nodes)  # and any module's while a region runs
            mutated.append(OwnState(ModuleState("", while_running_only=True)))
        mutated.extend(OwnState(s) for s in _running_statistics_updated(node) if s is not None)
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if has_call_hooks(module) or not _torch_module(module) or "forward" in vars(module):
            # a hooked module, an optimized model inside, a forward of the user's: code that may change its inputs
            mutated.extend(node.all_input_nodes)
            mutated.append(OwnState(ModuleState(str(node.target))))  # and its own tensors, and (a hook's code) any
            mutated.append(OwnState(ModuleState("", while_running_only=True)))  # module's while a region runs
        elif getattr(module, "running_mean", None) is not None:  # BatchNorm, InstanceNorm: updated in train mode
            mutated.extend(OwnState(Attr(f"{node.target}.{name}")) for name, _ in module.named_buffers())
    return [m for m in mutated if m is not None]


@dataclass(frozen=True)
class ModuleState:
    """Every parameter and buffer of the module at `path` ("": the whole model's). `while_running_only`: a change
    that matters between a region's ops only (user code may change another module's tensors, say a bias a region
    reads, but one that did so after every region would stop them all)."""
    path: str
    while_running_only: bool = False

    def covers(self, path: str) -> bool:
        return not self.path or path.startswith(self.path + ".")

    def __str__(self):
        return f"{self.path}'s tensors" if self.path else "the model's tensors"


@dataclass(frozen=True)
class OwnState:
    """A change of a module's own state (a norm's running statistics, a hooked module's tensors): tensors that
    view no other, so they share memory with what a region reads only where the storages are one, known at match
    time; where a storage is unknown (an optimize() graph's inputs) they are taken apart. `tensor`: a graph node
    (Dynamo's lifted buffer), an Attr or a ModuleState."""
    tensor: Any


def _torch_module(module: nn.Module) -> bool:
    return type(module).__module__.startswith(("torch.nn.", "torch.ao.nn."))


# Calls that update their running statistics in training mode, and their training flag's name (in every spelling
# the statistics are `running_mean` and `running_var`); aten's batch_norm schemas do not mark them written, and
# Dynamo records nn.BatchNorm1d as F.batch_norm(x, mean, var, ..., True).
_RUNNING_STATISTICS = {
    F.batch_norm: "training", torch.batch_norm: "training", torch.native_batch_norm: "training",
    torch.ops.aten.batch_norm: "training", torch.ops.aten.native_batch_norm: "training",
    F.instance_norm: "use_input_stats", torch.instance_norm: "use_input_stats",
    torch.ops.aten.instance_norm: "use_input_stats",
}
_RUNNING_STATISTICS.update({getattr(torch, name): "training" for name in (
    "_native_batch_norm_legit", "cudnn_batch_norm", "miopen_batch_norm") if hasattr(torch, name)})


def _running_statistics_updated(node: fx.Node) -> list:
    """The running statistics a batch or instance norm call updates in place: those it is given, unless its
    training flag is literally False."""
    packet = node.target.overloadpacket if isinstance(node.target, torch._ops.OpOverload) else node.target
    try:
        flag = _RUNNING_STATISTICS.get(packet)
    except TypeError:  # an unhashable target
        return []
    if flag is None:
        return []
    for arguments in _bindings(node):
        if arguments.get(flag) is False:
            return []
        return [arguments.get("running_mean"), arguments.get("running_var")]
    return []


def _bindings(node: fx.Node):
    """The call's arguments by name (defaults filled in), for each signature or schema of its target that takes
    them: an aten operator's from its schemas."""
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        overloads = [target] if isinstance(target, torch._ops.OpOverload) else \
            [getattr(target, name) for name in target.overloads()]
        for schema in (overload._schema for overload in overloads):
            names = [argument.name for argument in schema.arguments]
            if len(node.args) > len(names) or not set(node.kwargs) <= set(names):
                continue
            arguments = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
            yield {**arguments, **dict(zip(names, node.args)), **node.kwargs}
        return
    for signature in signatures_of(target):
        try:
            bound = signature.bind(*node.args, **node.kwargs)
        except TypeError:
            continue
        bound.apply_defaults()
        yield bound.arguments


# Dynamo records `x //= 2` as operator.ifloordiv(x, 2), optimize()'s trace as augmented_assignment: every
# augmented assignment changes a tensor in place (but `@=`: a tensor has no `__imatmul__`, eager makes a new one).
_OPERATOR_IN_PLACE = frozenset((operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                                operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                                operator.ilshift, operator.irshift))
_PURE_MODULES = ("torch", "operator", "_operator", "builtins", "math", "fxfuse")


def _written_by_schema(node: fx.Node) -> list:
    """The arguments an operator's schema marks as written (`Tensor(a!) t`): custom ops and aten's alike. For an
    overload packet, those of any of its overloads."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schemas = [target._schema]
    elif isinstance(target, torch._ops.OpOverloadPacket):
        schemas = [getattr(target, name)._schema for name in target.overloads()]
    else:
        return []
    written = []
    for schema in schemas:
        for index, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            if argument.name in node.kwargs:
                written.append(node.kwargs[argument.name])
            elif index < len(node.args) and not argument.kwarg_only:
                written.append(node.args[index])
    return [w for w in written if isinstance(w, fx.Node)]


def _opaque(target) -> bool:
    """Whether a call_function target is a Python function fxfuse knows nothing of: not torch's, not an operator
    (whose schema tells what it writes), not a builtin."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    module = getattr(target, "__module__", None) or ""
    return not any(module == name or module.startswith(name + ".") for name in _PURE_MODULES)


def _inplace_argument(node: fx.Node) -> bool:
    """`inplace=True` given by keyword or by position (Dynamo records nn.Dropout(inplace=True) as
    F.dropout(x, p, training, True))."""
    if node.kwargs.get("inplace") is True:
        return True
    return node.op == "call_function" and any(arguments.get("inplace") is True for arguments in _bindings(node))


def _bases(tensor, canon, through_in_place=True, stop=None) -> set:
    """`tensor` and every tensor it may be a view of: back through the inputs of every op but the epilogue ops and
    GEMMs of the vocabulary, which make tensors of their own (`y[:, :]`, `y.view(-1)`, `nn.Identity()(y)`,
    `torch.broadcast_tensors(t, y)[1]` lead to `y`), and (`through_in_place`) their in-place spellings, to the
    tensor they change alone (`out += x` is `out`); not back through `stop` (what it returns is read after its
    changes), nor through clone, nor through fused ops, whose outputs are their own (an earlier region's: matching
    stays linear)."""
    bases, stack = set(), [tensor]
    while stack:
        node = stack.pop()
        if node in bases:
            continue
        bases.add(node)
        if node is stop or not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method",
                                                                            "call_module") or node.target in FUSED_OPS:
            continue
        c = canon.get(node)
        if c is not None and c.op == IDENTITY and c.attrs.get("copy"):
            continue
        if c is not None and c.op not in (IDENTITY, COVERED) and not c.problem:
            if c.inplace_of is not None and through_in_place:
                stack.append(c.inplace_of)
            continue
        stack.extend(node.all_input_nodes)
    return bases


def _mutation_problem(region: Region, canon, facts: Facts) -> str | None:
    """The fused op runs where the region's last op was: an op between the region's ops must not change a tensor
    the region reads (in place, through a view of it, by `out=` or by item assignment), or the fused op would read
    it changed where eager read it unchanged."""
    members = set(region.members)
    first = min(facts.position[m] for m in members)
    last = max(facts.position[m] for m in members)
    reads = _region_reads(region, canon)
    for node, mutations in facts.mutations(canon):
        position = facts.position.get(node)  # None: fused into an earlier region
        if node in members or position is None or position <= first:
            continue
        between = position < last
        problem = _change_problem(node, mutations, reads, between, canon, facts)
        if problem is not None:  # again without what the region reads of `node`'s own result, which sees its changes
            problem = _change_problem(node, mutations, _region_reads(region, canon, stop=node), between, canon, facts)
        if problem is not None:
            return problem
    return None


def _region_reads(region: Region, canon, stop=None) -> dict:
    """What the region reads (x, the weight, bias and params, and what they view) and keeps for its backward (its
    epilogue operands and bias, where eager's ops may keep none: one changed after the region would make its
    backward raise): {"read": (nodes, paths), "kept": (nodes, paths)}. x = buf[:4] reads buf; z.add_(1) read after
    it ran is not a read of z before it."""
    def bases(objs):
        return {base for o in objs if isinstance(o, fx.Node) for base in _bases(o, canon, False, stop)}

    def paths(objs, nodes):
        return {o.path for o in objs if isinstance(o, Attr)} | \
            {n.target for n in nodes if isinstance(n, fx.Node) and n.op == "get_attr"}

    read, kept = (region.x, region.weight, region.bias, *region.params), (region.bias, *region.params)
    read_nodes, kept_nodes = bases(read), bases(kept)
    return {"read": (read_nodes, paths(read, read_nodes)), "kept": (kept_nodes, paths(kept, kept_nodes))}


def _change_problem(node: fx.Node, mutations: list, reads: dict, between: bool, canon, facts: Facts) -> str | None:
    """Why `node`'s changes (`mutations`, _mutated_by's) break a region whose reads are `reads`, or None."""
    nodes, paths = reads["read" if between else "kept"]
    when = "between the region's ops, which read" if between else \
        "after the region, whose fused op keeps for its backward"
    for mutated in mutations:
        exact = isinstance(mutated, OwnState)
        target = mutated.tensor if exact else mutated
        if isinstance(target, ModuleState):
            if target.while_running_only and not between:
                continue
            hit = next((p for p in sorted(paths) if target.covers(p)), None)
            if hit is not None:
                return f"{describe(node)} may change `{hit}` {when} it"
            shared = _shares_module_storage(target, nodes, paths, facts)
            if shared is not None:
                return f"{describe(node)} may change {target} {when} {shared}: they share memory"
            continue
        for base in _bases(facts.resolve(target), canon):  # an earlier region's value: its fused op's now
            if base in nodes or module_tensor_path(base) in paths:
                if between:
                    return f"{describe(node)} changes {describe(base)} between the region's ops, which read it"
                return (f"{describe(node)} changes {describe(base)} after the region, whose fused op keeps it "
                        "for its backward")
            shared = _may_share_memory(base, nodes, paths, between, facts, exact)
            if shared is not None:
                return f"{describe(node)} changes {describe(base)} {when} {shared}: they may share memory"
    return None


def _shares_module_storage(state: ModuleState, nodes: set, paths: set, facts: Facts) -> str | None:
    """What the region reads or keeps whose storage, known at match time, is one of the module's tensors'."""
    storages = facts.module_storages(state.path)
    if not storages:
        return None
    candidates = [n for n in nodes if isinstance(n, fx.Node) and n.op in ("placeholder", "get_attr")]
    for candidate in candidates + [Attr(path) for path in sorted(paths)]:
        storage = _storage_of(candidate, facts)
        if storage is not None and storage[0] in storages:
            return describe(candidate) if isinstance(candidate, fx.Node) else f"`{candidate.path}`"
    return None


def _may_share_memory(base, nodes: set, paths: set, between: bool, facts: Facts, exact: bool = False) -> str | None:
    """What the region reads (`between`) or keeps for its backward (in a graph that will be differentiated) that a
    changed tensor `base`, a graph input or module tensor, may be or view at run time though the graph does not
    show it: two graph inputs (`f(t, t)`), two module tensors (tied weights, views of one buffer); between the
    region's ops also an input and a module tensor. Tensors the graph makes are new; tensors of different dtypes
    are taken not to share memory (an int64 step counter, float params). Module tensors share memory exactly where
    their storages are one; a guarded graph's inputs (Dynamo's example values) do where theirs are one, and may
    where they are not (a view of another input is not guarded). `exact` (OwnState): only where storages are known
    to be one."""
    is_input = isinstance(base, fx.Node) and base.op == "placeholder"
    if not (is_input or module_tensor_path(base) is not None) or not (between or facts.differentiated):
        return None
    candidates = [n for n in nodes if isinstance(n, fx.Node) and n.op in ("placeholder", "get_attr") and n is not base]
    candidates += [Attr(path) for path in sorted(paths) if path != module_tensor_path(base)]
    for candidate in candidates:
        what = describe(candidate) if isinstance(candidate, fx.Node) else f"`{candidate.path}`"
        changed, read = _storage_of(base, facts), _storage_of(candidate, facts)
        if changed is not None and read is not None:
            if changed[0] == read[0]:
                return what
            if exact or (not is_input and module_tensor_path(candidate) is not None):
                continue  # two module tensors of their own storages (running statistics): fixed for the graph's life
            # Dynamo guards an input passed twice, not a view of another: other storages prove nothing there
        elif exact:
            continue  # a module's own state views nothing else
        dtypes = {getattr(t, "dtype", None) for t in (facts.tensor(base), facts.tensor(candidate))}
        if len(dtypes) == 2 and None not in dtypes:
            continue
        both_inputs = is_input and isinstance(candidate, fx.Node) and candidate.op == "placeholder"
        if both_inputs or between:
            return what
    return None


def module_tensor_path(obj) -> str | None:
    """The dotted path of a module tensor (an Attr, or a get_attr node), else None."""
    if isinstance(obj, Attr):
        return obj.path
    return obj.target if isinstance(obj, fx.Node) and obj.op == "get_attr" else None


def _storage_of(obj, facts: Facts):
    """(The storage of a tensor whose memory is known at match time, its dtype): a module tensor's, or a guarded
    graph input's example value's; None for anything else. Found once an object (every region asks of every later
    change)."""
    cache = facts.__dict__.setdefault("_storages", {})
    key = ("path", obj.path) if isinstance(obj, Attr) else obj
    if key not in cache:
        cache[key] = _find_storage(obj, facts)
    return cache[key]


def _find_storage(obj, facts: Facts):
    from torch.multiprocessing.reductions import StorageWeakRef

    if isinstance(obj, Attr) or obj.op == "get_attr":
        tensor = facts.tensor(obj)  # the module's own
    elif obj.op == "placeholder" and facts.inputs_guarded:
        tensor = obj.meta.get("example_value", obj.meta.get("val"))
    else:
        return None
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
        return None
    try:
        return StorageWeakRef(tensor.untyped_storage()), tensor.dtype
    except (RuntimeError, NotImplementedError):
        return None


def prove_legal(gm: fx.GraphModule, region: Region, facts: Facts) -> str | None:
    """Convexity (no path leaves the region and re-enters it) and a single output, checked with networkx."""
    members = set(region.members)
    first = min(members, key=facts.position.get)
    high = max(facts.position[m] for m in members)
    window = [first]
    while facts.position[window[-1]] < high:
        window.append(window[-1].next)
    dag = nx.DiGraph()
    dag.add_nodes_from(window)
    dag.add_edges_from((source, n) for n in window for source in n.all_input_nodes if source in dag)
    downstream = set().union(*(nx.descendants(dag, m) for m in members)) - members
    upstream = set().union(*(nx.ancestors(dag, m) for m in members)) - members
    between = downstream & upstream
    if between:
        node = min(between, key=facts.position.get)
        return f"the region is not convex: {describe(node)} lies on a path between its members"
    leaving = {m for m in members for u in m.users if u not in members}
    if leaving - {region.output}:
        node = next(iter(leaving - {region.output}))
        return f"intermediate {describe(node)} is used outside the region"
    return None
