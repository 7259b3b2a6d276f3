"""The user-facing entry points: ``optimize(model, example_inputs=None)`` and ``explain(model, example_inputs=None)``.

Capture: the model is traced with ``torch.fx.symbolic_trace``. If the whole model can't be traced, each
child module is tried in turn and what can't be traced stays in eager. The traced GraphModule shares the
model's submodules, parameters and buffers (so state_dict keys and tensors are unchanged, and an optimizer
step on the original parameters is seen by the optimized module). With example inputs, shapes and dtypes
are propagated on fake tensors, which lets the matcher prove more (ranks, dims, operand dtypes); what a module with
hooks returns is learned from one real run of the model, hooks and all (the fake run sets its hooks aside). A model
in train mode with anything to train gets the training form of the fused op (``fuse_graph(..., training=True)``).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import operator
import re
import types
from typing import Any, NamedTuple, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from .report import MissRow, Report
from .match import MODE_SETTERS
from .canonicalize import CALL_HOOK_DICTS, augmented_assignment, has_call_hooks, hooks_of, signatures_of
from .rewrite import FIRST_CHECKS, GRAPH_HELPERS, NotOptimizedForThisCall, fuse_graph, require_traced_as_tensor

logger = logging.getLogger("fxfuse")

_FX_ASSERT_IS_NONE = getattr(torch.fx._symbolic_trace, "_assert_is_none", None)


class FusedGraphModule(fx.GraphModule):
    """What optimize() makes of a traceable model: a GraphModule whose state is exactly the model's.

    A GraphModule rebuilds itself from what its graph reads when it is deep-copied or unpickled, and registers
    every tensor it reads as a persistent buffer (fx's tensor constants included); these overrides give the
    rebuilt module the model's state again, so that its state_dict keys stay those of the model."""

    # (each module's mode when the graph was traced, the call that fixed one or None), where the forward passed a
    # module's self.training on (F.dropout(h, p, training=self.training)) or branched on it in Python (None): any mode
    # change makes the graph wrong
    traced_training: tuple[dict[str, bool], str | None] | None = None
    # (path, module) of each module the trace ran through rather than calling it: a hook added to one later would
    # never run (one it had kept it a call of its own)
    inlined: tuple[tuple[str, nn.Module], ...] = ()

    def __call__(self, *args, **kwargs):
        if any(self._inlined_hook_dicts()):  # (each call: only the dicts' truth, then the message)
            path, module = next((path, m) for path, m in self.inlined if has_call_hooks(m))
            raise RuntimeError(f"fxfuse: `{path}` has {hooks_of(module, own_only=True)} now; the optimized model "
                               "runs its ops without calling it, so they would never run: run fxfuse.optimize() on "
                               "the model again")
        child = self.__dict__.get("_stands_for")
        if child is not None and any(getattr(child, name) for name in CALL_HOOK_DICTS) and _hooks_added(child, self):
            raise RuntimeError(f"fxfuse: the {type(child).__name__} that this optimized module replaced in its parent "
                               f"has {hooks_of(child, own_only=True)} now, which the parent, calling this module "
                               "instead, would never run: register them on this module, or run fxfuse.optimize() "
                               "on the model again")
        if self.traced_training is not None:
            modes, call = self.traced_training
            for path, module in self.named_modules():
                if modes.get(path, module.training) != module.training:
                    what = f"`{path}`" if path else "this model"
                    fixed = f"its graph fixed `{call}`'s training argument" if call is not None else \
                        "its trace kept the code its forward ran for the modules' `training` values"
                    raise RuntimeError(f"fxfuse: {what} was in {'train' if modes[path] else 'eval'} mode when the "
                                       f"model was optimized, and {fixed} then; run fxfuse.optimize() on the model "
                                       "in the modes you use (or torch.compile(model, backend='fxfuse'), which "
                                       "recompiles on a mode change)")
        return super().__call__(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            # A child fused inside a parent that could not be traced (`_stands_for`, set by _optimize): the parent's
            # own code may read the child's plain attributes or call its methods, which are the child's.
            child = self.__dict__.get("_stands_for")
            if child is None:
                raise
            return getattr(child, name)

    def _inlined_hook_dicts(self) -> tuple:
        """The call-hook dicts of the inlined modules, flat: one `any` over them took 3.6 µs for 200 modules on a
        2-core CPU machine, a loop of hook checks per module 32 µs, at every call. Found again whenever `inlined` is
        another tuple (a copy, an unpickled model)."""
        cached = self.__dict__.get("_inlined_hooks_cache")
        if cached is None or cached[0] is not self.inlined:
            dicts = tuple(getattr(m, name) for _, m in self.inlined for name in CALL_HOOK_DICTS)
            cached = self.__dict__["_inlined_hooks_cache"] = (self.inlined, dicts)
        return cached[1]

    def recompile(self):
        python_code = super().recompile()
        if any(node.op == "call_function" and node.target in FIRST_CHECKS for node in self.graph.nodes):
            # (each instance has a class of its own, whose forward recompile() just set)
            type(self).forward = _model_forward_where_refused(type(self).forward)
        return python_code

    def _run_model_forward(self, *args, **kwargs):
        """The model's own forward (its class's, `_eager_class`), on this module's children, tensors, mode and plain
        attributes: what eager computes for a call that this graph's first checks refuse."""
        model_class = self.__dict__["_eager_class"]
        model = object.__new__(model_class)  # (not the class's __new__: a GraphModule's makes a class of its own)
        model.__dict__.update(self.__dict__)
        return model_class.forward(model, *args, **kwargs)

    def __deepcopy__(self, memo):
        copied = super().__deepcopy__(memo)
        attributes = copy.deepcopy(self.__dict__, memo)
        _adopt_state(copied, _state_of(attributes))
        # The model's plain attributes, which its root hooks and its own forward read, and fxfuse's (traced_training,
        # inlined, _stands_for, _eager_class); GraphModule's copy keeps only what the graph reads.
        for name in (k for k in attributes if k not in copied.__dict__):
            copied.__dict__[name] = attributes[name]
        return copied

    def __reduce__(self):
        rebuild, (attributes, imports) = super().__reduce__()
        # Unpickling re-traces the forward's code: with fx's own tracer the checks the graph calls (require_settings,
        # require_rank...) would run once, then, and be gone from the graph.
        attributes["_tracer_cls"] = _Tracer
        return _unpickle_fused, (rebuild, (attributes, imports))

    def __copy__(self):
        copied = super().__copy__()  # a plain GraphModule of what the graph reads, sharing this graph
        fused = FusedGraphModule(copied, copied.graph, class_name=type(self).__name__)
        _adopt_state(fused, self)
        for name in ("meta", *(k for k in self.__dict__ if k not in fused.__dict__)):
            fused.__dict__[name] = self.__dict__[name]
        return fused


def _model_forward_where_refused(forward):
    """A graph's `forward` that runs the model's own forward instead for a call its first checks refuse (an input of
    another rank or dtype, None for an argument traced as a tensor): they ran before any op, so nothing ran twice."""
    @functools.wraps(forward)
    def forward_or_the_models(self, *args, **kwargs):
        try:
            return forward(self, *args, **kwargs)
        except NotOptimizedForThisCall as refusal:
            logger.debug("%s; this call runs the model's own forward", refusal)
            return self._run_model_forward(*args, **kwargs)
    return forward_or_the_models


def _hooks_added(module: nn.Module, fused: FusedGraphModule) -> bool:
    """Whether `module` has a call hook that `fused`, optimized from it, did not copy (one registered since)."""
    return any(set(getattr(module, name)) - set(getattr(fused, name)) for name in CALL_HOOK_DICTS)


def _state_of(attributes: dict):
    """The state _adopt_state takes from a module's attributes: its children, tensors, mode and own hooks (the
    root's hooks run around the optimized forward, in a copy or an unpickled model too)."""
    names = ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set", "training")
    hooks = {name: attributes[name] for name in (*_HOOK_DICTS, "_is_full_backward_hook") if name in attributes}
    return types.SimpleNamespace(**{name: attributes[name] for name in names}, **hooks)


def _unpickle_fused(rebuild, args) -> FusedGraphModule:
    plain = rebuild(*args)
    attributes = args[0]
    fused = FusedGraphModule(plain, plain.graph, class_name=type(plain).__name__)
    _adopt_state(fused, _state_of(attributes))
    for name in ("meta", *(k for k in attributes if k not in fused.__dict__)):
        fused.__dict__[name] = attributes[name]
    return fused


@contextlib.contextmanager
def _watching_mode_switches():
    """Collects the modes a forward switches while fx traces it. The trace records the ops, not the mode they ran
    under: a model whose forward has a `torch.no_grad()` or `torch.autocast(...)` block can't be traced whole.
    The setters are wrapped for the trace's duration (a call from another thread meanwhile counts too: the
    model is then tried child by child, which is never wrong)."""
    switched: list[str] = []
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in MODE_SETTERS]

    def recording(function, what):
        def record(*args, **kwargs):
            switched.append(what)
            return function(*args, **kwargs)
        return record

    for (owner, name, function), (_, _, what) in zip(originals, MODE_SETTERS):
        setattr(owner, name, recording(function, what))
    try:
        yield switched
    finally:
        for owner, name, function in originals:
            setattr(owner, name, function)


@contextlib.contextmanager
def _watching_autograd_functions():
    """Collects the autograd.Functions a forward applies while fx traces it. The trace runs a Function's forward on
    proxies and records its ops as plain ones: the graph would train with autograd's gradients of those ops, not
    the Function's own backward. Each application makes a context, an instance of the Function's backward class
    (a BackwardCFunction), whose `__init__` is wrapped for the trace's duration: that also sees `Function.apply`
    bound before the trace (`grad_reverse = GradReverse.apply`). A call from another thread meanwhile counts too:
    the model is then tried child by child, which is never wrong."""
    applied: list[str] = []
    contexts = torch.autograd.function.BackwardCFunction
    own_init = vars(contexts).get("__init__")

    def __init__(ctx, *args, **kwargs):
        applied.append(type(ctx)._forward_cls.__name__)
        if own_init is not None:
            own_init(ctx, *args, **kwargs)
        else:
            super(contexts, ctx).__init__(*args, **kwargs)

    contexts.__init__ = __init__
    try:
        yield applied
    finally:
        if own_init is not None:
            contexts.__init__ = own_init
        else:
            del contexts.__init__


def _none_defaults(model: nn.Module, given: int | None) -> dict[str, None]:
    """The forward's parameters past the `given` example inputs whose default is None: traced as None (fx checks
    at every call that they still are), not as a tensor that the trace would take `is not None` branches for.
    Without example inputs (None) every parameter stays a graph input."""
    if given is None:
        return {}
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    return {p.name: None for p in parameters[given:]
            if p.default is None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


# Functions whose `training` argument the trace fixes at the value `self.training` had (F.dropout(x, p,
# training=self.training)): a graph that calls one is only right in the mode it was traced in. Asked of a GraphModule
# given to optimize() only, which can't be traced in the other modes (a forward is: _traced_otherwise_in_the_other_modes
# tells a constant `training=False` from a mode).
def _mode_dependent_call(graph: fx.Graph, modes: set[bool]) -> fx.Node | None:
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for signature in signatures_of(node.target):
            try:
                bound = signature.bind(*node.args, **node.kwargs)
            except TypeError:
                continue
            value = bound.arguments.get("training", bound.arguments.get("train"))  # torch.dropout(x, p, train)
            if isinstance(value, bool) and value in modes:  # some module's self.training, maybe
                return node
    return None


class _Proxy(fx.Proxy):
    """fx's Proxy, with Python's augmented assignments recorded as what they are (canonicalize's
    augmented_assignment): fx's own falls back to `t = t + b`, so `t += b` in a helper left the caller's tensor
    unchanged in the graph."""

    def __getattr__(self, name: str):
        return _Attribute(self, name)


class _Attribute(fx.proxy.Attribute, _Proxy):
    """fx's proxy of an attribute (`h.T`, `r.values`), whose augmented assignments are recorded as _Proxy's: `t = h.T;
    t += 1` changes h."""


def _recorded_in_place(function):
    def method(self, other):
        return self.tracer.create_proxy("call_function", augmented_assignment, (function.__name__, self, other), {})
    return method


for _function in (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
                  operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift):
    setattr(_Proxy, f"__{_function.__name__}__", _recorded_in_place(_function))


def assert_is_none(value, message: str) -> None:
    """fx's check, in a traced graph, that an argument traced as None still is (its `_assert_is_none`), under a name
    of fxfuse's: traced again on unpickling, fx's own is recorded as a wrapped function by its dotted name, which fx's
    process-wide registry then can't look up, and every later fx trace raised KeyError."""
    if value is not None:
        raise AssertionError(message)


class _Tracer(fx.Tracer):
    """fx's tracer, with these kept as one call each: a model fxfuse already optimized (its graph checks at each
    call that the modules it folded keep their modes and settings, which tracing through it would run once, at
    trace time), and a module with hooks (which a trace through it would run once, on proxies). It records the
    modules it traces through (`inlined`), whose hooks the optimized model can't run."""

    def __init__(self):
        # Calls of their own in a graph traced again.
        super().__init__(autowrap_functions=(*GRAPH_HELPERS, assert_is_none))
        # Buffers as graph reads, not their trace-time values: fx otherwise runs `self.buf.exp()` once, at trace
        # time, and keeps the result as a constant that load_state_dict, fill_ or .half() never reach.
        self.proxy_buffer_attributes = True
        self.inlined: dict[str, nn.Module] = {}

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def create_arg(self, a: Any):
        # A NumPy scalar (`h * np.float32(2)`, `torch.sum(h, np.int64(1))`) is recorded as the Python number eager's
        # ops read it as; fx's trace raised NotImplementedError for those that are no Python number subclass.
        if type(a).__module__ == "numpy" and type(a).__name__ != "ndarray" and hasattr(a, "item"):
            a = a.item()
        return super().create_arg(a)

    def trace(self, root, concrete_args=None) -> fx.Graph:
        graph = super().trace(root, concrete_args)
        for node in graph.nodes:
            if node.op == "call_function" and node.target is _FX_ASSERT_IS_NONE:
                node.target = assert_is_none
        return graph

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return isinstance(module, FusedGraphModule) or has_call_hooks(module) or \
            super().is_leaf_module(module, qualified_name)

    def call_module(self, module: nn.Module, forward, args, kwargs):
        path = self.path_of_module(module)
        if not self.is_leaf_module(module, path):
            self.inlined[path] = module
        return super().call_module(module, forward, args, kwargs)


def _trace(model: nn.Module, given_inputs: int | None, given_nones: Sequence[str] = ()) -> fx.GraphModule:
    if isinstance(model, fx.GraphModule):
        gm = FusedGraphModule(model, copy.deepcopy(model.graph), class_name=type(model).__name__)
        gm.traced_training = getattr(model, "traced_training", None)
        gm.inlined = getattr(model, "inlined", ())
        if gm.traced_training is None:  # (no trace in the other modes to compare with: any bool that is a mode counts)
            dependent = _mode_dependent_call(gm.graph, {m.training for m in model.modules()})
            if dependent is not None:
                gm.traced_training = ({path: m.training for path, m in model.named_modules()}, dependent.name)
    else:
        if type(model).train is not nn.Module.train:  # (a child's runs: GraphModule.train calls its children's)
            raise RuntimeError(f"its class overrides train(), which the optimized model (a GraphModule, no "
                               f"{type(model).__name__}) would not run")
        concrete = {**_none_defaults(model, given_inputs), **{name: None for name in given_nones}}
        attributes = set(vars(model))
        try:
            tracer, graph = _traced(model, concrete)
            if given_inputs is None:
                _check_optional_arguments(model, graph)
            else:
                _guard_optional_arguments(model, graph, concrete)
            gm = FusedGraphModule(tracer.root, graph, class_name=type(model).__name__)  # (takes the constants)
            if _traced_otherwise_in_the_other_modes(model, concrete, graph):
                gm.traced_training = ({path: m.training for path, m in model.named_modules()}, None)
        finally:  # fx's tracer stows the tensors a forward makes on the traced root, the user's model
            for name in [k for k in vars(model) if k not in attributes and k.startswith("_tensor_constant")]:
                delattr(model, name)
        gm.inlined = tuple(tracer.inlined.items())
    _adopt_state(gm, model)
    return gm


def _traced(model: nn.Module, concrete: dict) -> tuple[_Tracer, fx.Graph]:
    """fx's trace of `model` with the `concrete` arguments fixed, or a RuntimeError saying what it can't keep."""
    tracer = _Tracer()
    with _model_kept_as_it_was(model) as changed, _watching_mode_switches() as switched, \
            _watching_autograd_functions() as applied:
        graph = tracer.trace(model, concrete_args=concrete or None)
    if changed:  # an fx trace runs what a forward does to its model once, at trace time, and records none of it
        raise RuntimeError(f"its forward {' and '.join(changed[:3])}, which an fx trace would run once, at "
                           "trace time (torch.compile(model, backend='fxfuse') keeps it)")
    if applied:
        raise RuntimeError(f"its forward applies the autograd.Function {' and '.join(sorted(set(applied)))}, whose "
                           "backward an fx trace would drop (torch.compile(model, backend='fxfuse') keeps it)")
    _keep_argument_names(graph, concrete)
    if switched:
        raise RuntimeError(f"its forward switches {' and '.join(sorted(set(switched)))}, which an fx trace "
                           "would drop (torch.compile(model, backend='fxfuse') keeps it)")
    return tracer, graph


def _traced_otherwise_in_the_other_modes(model: nn.Module, concrete: dict, graph: fx.Graph) -> bool:
    """Whether a trace with every module's mode flipped records other code than `graph`: the forward's Python code
    read a `training` (`if self.training:`, a helper's `training` argument), and the trace kept the branch it took.
    A forward that can't be traced in the other modes counts too."""
    modules = list(model.modules())
    modes = [module.training for module in modules]
    try:
        for module, mode in zip(modules, modes):
            module.training = not mode
        _, flipped = _traced(model, concrete)
    except Exception:
        return True
    finally:
        for module, mode in zip(modules, modes):
            module.training = mode
    return _code_of(flipped) != _code_of(graph)


def _code_of(graph: fx.Graph) -> str:
    """A graph's Python code, with fx's tensor constants unnumbered (each trace numbers its own)."""
    return re.sub(r"_tensor_constant\d+", "_tensor_constant", graph.python_code("self").src)


def _check_optional_arguments(model: nn.Module, graph: fx.Graph) -> None:
    """Without example inputs an argument that defaults to None is traced as a tensor: a forward that runs other
    code for None (`if mask is not None:`) would then raise on its default call, where eager runs. Where the graph
    reads such an argument, a trace with it None must run the same ops (`h + y` records an add either way)."""
    read = [node.target for node in graph.nodes
            if node.op == "placeholder" and node.target in _none_defaults(model, 0) and node.users]
    if not read:
        return
    try:
        _, with_none = _traced(model, {name: None for name in read})
    except Exception:  # (no trace with None: a call with None raises in eager too)
        return
    if _ops_run(with_none) != _ops_run(graph, as_none=read):
        raise RuntimeError(f"its forward runs other code for `{read[0]}` None (its default) and for a tensor, "
                           "which a trace without example inputs can't tell apart (pass example inputs)")


def _guard_optional_arguments(model: nn.Module, graph: fx.Graph, concrete: dict) -> None:
    """With example inputs, an argument that defaults to None and was given a tensor is traced as a tensor: where a
    trace with it None runs other ops (or none can be made), `graph` checks first at each call that it is no None."""
    placeholders = {node.target: node for node in graph.nodes if node.op == "placeholder"}
    for name in _none_defaults(model, 0):
        node = placeholders.get(name)
        if name in concrete or node is None or not node.users:
            continue
        try:
            _, with_none = _traced(model, {**concrete, name: None})
            same = _ops_run(with_none) == _ops_run(graph, as_none=[name])
        except Exception:
            same = False
        if not same:
            with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):
                graph.call_function(require_traced_as_tensor, (node, name))


def _ops_run(graph: fx.Graph, as_none=()) -> list:
    """The ops a graph runs, in order, with what each reads (a graph input by name, an op's value by its place), and
    what it returns; without fx's checks that a concrete argument is still None. The inputs named in `as_none` read
    as None, as in a trace with them None: `h * mask` there is `h * None`, `h * self.scale` is another op."""
    ops = [node for node in graph.nodes if node.op != "placeholder"
           and "assert_is_none" not in getattr(node.target, "__name__", "")]
    place = {node: i for i, node in enumerate(ops)}

    def read(node: fx.Node):
        if node.op == "placeholder":
            return None if node.target in as_none else ("input", node.target)
        return place.get(node, node.name)

    return [(node.op, node.target, fx.node.map_arg(node.args, read), fx.node.map_arg(node.kwargs, read))
            for node in ops]


def _keep_argument_names(graph: fx.Graph, concrete: dict) -> None:
    """fx names the input of an argument traced as None `mask_1`: the optimized forward takes `mask=None` again."""
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    targets = {node.target for node in placeholders}
    for node in placeholders:
        base = node.target.rsplit("_", 1)[0]
        if base in concrete and base not in targets and node.target == f"{base}_1":
            node.target = base
            targets.add(base)


@contextlib.contextmanager
def _model_kept_as_it_was(model: nn.Module):
    """Runs of `model`'s forward inside (a trace, the run that finds the children's inputs) leave it as it was:
    buffers changed in place or assigned are restored, attributes set are put back or removed (fx's own tensor
    constants aside). Yields a list that says, on exit, what had changed."""
    buffers = {name: (b, b._version, b.detach().clone()) for name, b in model.named_buffers()}
    attributes = {name: dict(vars(m)) for name, m in model.named_modules()}
    # A forward that assigns a buffer (`self.calls = self.calls + 1`) replaces it in the module's _buffers.
    buffer_slots = {name: dict(m._buffers) for name, m in model.named_modules()}
    # A forward that appends its activations to `self.acts` (a list, dict or set of the module's) changes it in place.
    containers = {(name, key): (value, copy.copy(value)) for name, m in model.named_modules()
                  for key, value in vars(m).items() if not key.startswith("_") and isinstance(value, (list, dict, set))}
    changed: list[str] = []
    try:
        yield changed
    finally:
        for (name, key), (container, saved) in containers.items():
            if not _same_contents(container, saved):
                changed.append(f"changes `{f'{name}.' if name else ''}{key}` in place")
                container.clear()
                if isinstance(container, list):
                    container.extend(saved)
                else:
                    container.update(saved)
        for name, module in model.named_modules():
            before = buffer_slots.get(name, {})
            for key in [k for k in module._buffers if k not in before or module._buffers[k] is not before[k]]:
                changed.append(f"sets buffer `{f'{name}.' if name else ''}{key}`")
                if key in before:
                    module._buffers[key] = before[key]
                else:
                    del module._buffers[key]
        with torch.no_grad():
            for name, (buffer, version, saved) in buffers.items():
                # (BatchNorm's kernel updates its statistics without bumping the version counter)
                same = (torch.allclose(buffer, saved, rtol=0, atol=0, equal_nan=True) if buffer.is_floating_point()
                        else torch.equal(buffer, saved))
                if buffer._version != version or not same:
                    buffer.copy_(saved)
                    changed.append(f"changes buffer `{name}` in place")
        for name, module in model.named_modules():
            before = attributes.get(name, {})
            for key in [k for k in vars(module) if k not in before or vars(module)[k] is not before[k]]:
                if key.startswith("_tensor_constant") or key == "_inlined_hooks_cache":  # the tracer's own tensors;
                    continue  # a nested optimized model's hook lookup, filled at its first call
                changed.append(f"sets `{f'{name}.' if name else ''}{key}`")
                if key in before:
                    vars(module)[key] = before[key]
                else:
                    del vars(module)[key]


def _same_contents(container, saved) -> bool:
    """Whether a list, dict or set holds the same objects it held (identity: a tensor's == is elementwise)."""
    if len(container) != len(saved):
        return False
    if isinstance(container, dict):
        return container.keys() == saved.keys() and all(container[k] is saved[k] for k in saved)
    if isinstance(container, set):
        return {id(v) for v in container} == {id(v) for v in saved}
    return all(a is b for a, b in zip(container, saved))


_MISSING = object()


def _attribute(root: nn.Module, path: str):
    value: Any = root
    for part in path.split("."):
        value = getattr(value, part, _MISSING)
        if value is _MISSING:
            break
    return value


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def _adopt_state(gm: fx.GraphModule, model: nn.Module) -> None:
    """Give `gm` the model's own children, parameters and buffers: the same objects, in the same order, with the
    same persistence, used by the graph or not. GraphModule copies only what the graph reads (so nested unused
    parameters went missing) and registers every tensor it copies as a persistent buffer, so the state_dict
    would differ from the model's."""
    read = {node.target: _attribute(gm, node.target) for node in gm.graph.nodes if node.op == "get_attr"}
    gm._modules = dict(model._modules)
    gm._parameters = dict(model._parameters)
    gm._buffers = dict(model._buffers)
    gm._non_persistent_buffers_set = set(model._non_persistent_buffers_set)
    gm.training = model.training
    for name in _HOOK_DICTS:  # the root's own hooks run around the optimized forward as around the model's
        if hasattr(model, name):
            setattr(gm, name, type(getattr(model, name))(getattr(model, name)))
    # (whether its backward hooks are full ones: torch runs those of neither kind, None, nowhere)
    gm._is_full_backward_hook = getattr(model, "_is_full_backward_hook", None)
    for name, value in vars(model).items():  # plain attributes, which the root's hooks may read (`mod.scale`)
        if name != "forward":
            gm.__dict__.setdefault(name, value)
    for path, value in read.items():
        # Tensors the tracer made constants of, or plain tensor attributes of the model: not state.
        if _attribute(gm, path) is _MISSING and "." not in path:
            object.__setattr__(gm, path, value)


@contextlib.contextmanager
def _fake_buffers(gm: fx.GraphModule, mode):
    """Swap every buffer of `gm` for a fake copy while shapes propagate: a forward that updates its buffers
    (BatchNorm's statistics and batch count) must leave the user's model as it was."""
    swapped = []
    for module in gm.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                swapped.append((module, name, buffer))
    # Plain tensor attributes too: a hook may set one on the fake run (the old weight_norm's `weight`).
    attributes = {module: {k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}
                  for module in gm.modules()}
    try:
        for module, name, buffer in swapped:
            module._buffers[name] = mode.from_tensor(buffer)
        yield
    finally:
        for module, name, buffer in swapped:
            module._buffers[name] = buffer
        for module, before in attributes.items():
            for name in [k for k, v in vars(module).items() if isinstance(v, torch.Tensor) and k not in before]:
                delattr(module, name)
            for name, value in before.items():
                object.__setattr__(module, name, value)


@contextlib.contextmanager
def _autocast_cache_off():
    """Autocast's cache of weight casts off for a run of optimize()'s: under the caller's autocast it keeps each cast
    until the outermost block ends, and the caller's model would then read the run's (a fake bf16 weight from the
    shapes run; from a real run under no_grad, one without autograd history on a torch that caches those,
    pytorch#112583). The casts still run: the dtypes found are autocast's."""
    if not hasattr(torch, "set_autocast_cache_enabled"):
        yield
        return
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


def _propagate_shapes(gm: fx.GraphModule, model: nn.Module, example_inputs: Sequence[Any]) -> None:
    """Record each node's shape and dtype (node.meta['val']) by running the graph on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in gm.parameters()):
        # A lazy module would initialize its parameters on the fake tensors, leaving the model's own on "meta".
        logger.info("fxfuse: no shapes (the model has uninitialized lazy parameters); matching without them")
        return
    hooked = [module for module in gm.modules() if module is not gm and has_call_hooks(module)]
    # What a hooked module returns after its hooks, learned from a real run: its nodes get that, not their own.
    known_outputs = _hooked_outputs(gm, model, example_inputs)
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with _fake_buffers(gm, mode), _call_hooks_set_aside(hooked), _autocast_cache_off():
            _FakeTensorPropWithKnownOutputs(gm, mode, known_outputs).propagate(*example_inputs)
    except Exception as error:  # shapes are a help, not a need: the matcher proves less without them
        logger.info("fxfuse: no shapes (%s: %s); matching without them", type(error).__name__, error)
        for node in gm.graph.nodes:
            node.meta.pop("val", None)
    # What a hooked module returns where the run did not tell, and all that follows from it, is unknown: its hooks
    # did not run on the fake tensors.
    unknown: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if (node.op == "call_module" and gm.get_submodule(node.target) in hooked and node not in known_outputs) or \
                any(source in unknown for source in node.all_input_nodes):
            unknown.add(node)
            node.meta.pop("val", None)


class _TensorMetadata(NamedTuple):
    """What the shapes run needs of a tensor a hooked module returned."""
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def _plain_tensor_metadata(value) -> _TensorMetadata | None:
    """The metadata of a plain dense tensor; None for anything else (a tuple, a subclass, a sparse tensor...)."""
    if type(value) is not torch.Tensor or value.layout != torch.strided or value.is_quantized or value.is_nested:
        return None
    return _TensorMetadata(value.shape, value.stride(), value.dtype, value.device)


def _fake_tensor_of(metadata: _TensorMetadata) -> torch.Tensor:
    """A tensor of that metadata: a fake one when called under a FakeTensorMode."""
    return torch.empty_strided(metadata.shape, metadata.stride, dtype=metadata.dtype, device=metadata.device)


class _FakeTensorPropWithKnownOutputs(FakeTensorProp):
    """FakeTensorProp, except that the nodes of `known_outputs` give a fake tensor of their known metadata instead
    of calling their module."""

    def __init__(self, gm: fx.GraphModule, mode, known_outputs: dict[fx.Node, _TensorMetadata]):
        super().__init__(gm, mode)
        self.known_outputs = known_outputs

    def run_node(self, node: fx.Node) -> Any:
        metadata = self.known_outputs.get(node)
        if metadata is None:
            return super().run_node(node)
        node.meta["val"] = _fake_tensor_of(metadata)  # a tensor of its own: a later in-place op leaves it as it is
        return _fake_tensor_of(metadata)


def _hooked_outputs(gm: fx.GraphModule, model: nn.Module, example_inputs) -> dict[fx.Node, _TensorMetadata]:
    """The metadata of what each call of a hooked module of `gm` returns, its hooks' replacements included, found
    on one run of `model` on the example inputs; by node. Left out: a module whose calls in that run are not its
    nodes one for one, a call that returned no plain tensor, and everything if the run failed or would have written
    into a parameter or an example input. No run where `gm` calls no hooked module."""
    nodes: dict[nn.Module, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if has_call_hooks(module):
            nodes.setdefault(module, []).append(node)
    if not nodes:
        return {}
    calls: dict[nn.Module, list[_TensorMetadata | None]] = {module: [] for module in nodes}

    def record(module, args, output) -> None:
        calls[module].append(_plain_tensor_metadata(output))

    # Registered last, each sees the output after the user's hooks replaced it.
    handles = [module.register_forward_hook(record) for module in nodes]
    try:
        ran = _run_leaving_it_as_it_was(model, example_inputs, "learn what its hooked modules return")
    finally:
        for handle in handles:
            handle.remove()
    if not ran:
        return {}
    known: dict[fx.Node, _TensorMetadata] = {}
    for module, module_nodes in nodes.items():
        if len(calls[module]) != len(module_nodes):  # also called elsewhere (inside another call, by a hook)
            continue
        for node, metadata in zip(module_nodes, calls[module]):
            if metadata is not None:
                known[node] = metadata
    return known


class _RefusingWritesInto(TorchDispatchMode):
    """Raises before any op that would write into the memory of the given tensors (the model's parameters, the
    example inputs: what optimize()'s runs of the model must leave as they were; its buffers are put back)."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        super().__init__()
        self.storages = {_storage_of(t) for t in tensors} - {None}
        self.refused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            for tensor in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(tensor, torch.Tensor) and _storage_of(tensor) in self.storages:
                    self.refused = True
                    raise RuntimeError(f"{func} would write into a parameter or an example input")
        return func(*args, **kwargs)


def _storage_of(tensor: torch.Tensor):
    """The storage of a dense tensor with memory, as a key; None for others (sparse, meta)."""
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        return None
    return StorageWeakRef(tensor.untyped_storage())


@contextlib.contextmanager
def _call_hooks_set_aside(modules: list[nn.Module]):
    """The shapes run calls the graph's modules on fake tensors: their hooks, the user's code, must not see them."""
    saved = [(module, name, getattr(module, name)) for module in modules for name in CALL_HOOK_DICTS]
    try:
        for module, name, hooks in saved:
            setattr(module, name, type(hooks)())
        yield
    finally:
        for module, name, hooks in saved:
            setattr(module, name, hooks)


def _kind_of_inputs(inputs: tuple | None):
    """What a child's trace takes from its example inputs: their structure, which are None, numbers of which type,
    tensors of which rank, dtype and device (not their sizes: an optimized child takes any batch)."""
    if inputs is None:
        return None
    leaves, spec = pytree.tree_flatten(inputs)
    return str(spec), tuple((t.dim(), t.dtype, t.device.type) if isinstance(t, torch.Tensor) else type(t)
                            for t in leaves)


def _children_inputs(model: nn.Module, example_inputs) -> dict[str, tuple]:
    """The inputs each direct child module sees on a run of `model` on `example_inputs` (its first call's), or None
    for a child called twice with inputs of different kinds (`block(x)` then `block(x, mask)`, a 2-D then a 3-D x):
    one call's would make the optimized child raise for the other's, where eager does not."""
    seen: dict[str, tuple | None] = {}

    def record(name, module, args, kwargs) -> None:
        inputs = _as_positional(module, args, kwargs)
        if name not in seen:
            seen[name] = inputs
        elif seen[name] is not None and _kind_of_inputs(inputs) != _kind_of_inputs(seen[name]):
            seen[name] = None

    hooks = [child.register_forward_pre_hook(functools.partial(record, name), with_kwargs=True)
             for name, child in model.named_children()]
    try:
        _run_leaving_it_as_it_was(model, example_inputs, "find its children's inputs")
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _run_leaving_it_as_it_was(model: nn.Module, example_inputs, purpose: str) -> bool:
    """Run `model` once on `example_inputs`, for what the hooks registered on it beforehand record. False (logged)
    if it raised, or would have written into a parameter or an example input (it stops there)."""
    # The run must change neither the model nor the random streams of the devices it touches (a dropout would
    # move the caller's stream on) nor autocast's cache; buffers and attributes are put back, parameters and inputs
    # never written.
    inputs = [t for t in pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor)]
    guard = _RefusingWritesInto([*model.parameters(), *inputs])
    tensors = [*model.parameters(), *model.buffers(), *inputs]
    cuda_devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    try:
        with _model_kept_as_it_was(model), torch.no_grad(), torch.random.fork_rng(devices=cuda_devices), \
                _autocast_cache_off():
            with guard:
                model(*example_inputs)
    except Exception as error:
        logger.info("fxfuse: could not run the model to %s: %s", purpose, error)
        return False
    return not guard.refused  # (a forward that caught the refusal ran on without that write)


def _as_positional(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """A call's arguments as example inputs: positional, the keywords in their places where they fill the
    forward's first parameters (`block(x, mask=m)` is (x, m)); else None, no example inputs."""
    if not kwargs:
        return args
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        names = [p.name for p in inspect.signature(module.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return None
    if list(bound.arguments) != names[:len(bound.arguments)]:
        return None
    return tuple(bound.arguments.values())


def _shallow_copy(model: nn.Module) -> nn.Module:
    """`model` itself again, for a model left unfused: the same children, parameters, buffers and hooks, in dicts
    of its own (as an optimized model's), so that registering on it leaves the model alone."""
    result = copy.copy(model)
    for name, value in vars(model).items():  # a GraphModule's copy keeps no plain attribute (what its hooks read)
        result.__dict__.setdefault(name, value)
    for name in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set", *_HOOK_DICTS):
        if name in vars(model):
            setattr(result, name, copy.copy(getattr(model, name)))
    return result


def _nones_given(model: nn.Module, example_inputs) -> list[str]:
    """The forward's parameters whose example input is None: traced as None, as its defaults to None are."""
    if not example_inputs or all(value is not None for value in example_inputs):
        return []
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return []
    return [p.name for p, value in zip(parameters, example_inputs)
            if value is None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)]


def _single_torch_module(module: nn.Module) -> bool:
    """A torch.nn module that tracing treats as one op (nn.Linear, nn.Dropout...), containers aside."""
    containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
    return not isinstance(module, containers) and fx.Tracer().is_leaf_module(module, "")


def _trains(model: nn.Module, example_inputs) -> bool:
    """Whether `model`'s graph is for training: train mode, and a parameter or example input requires grad."""
    tensors = [*model.parameters(), *(t for t in example_inputs or () if isinstance(t, torch.Tensor))]
    return model.training and any(t.requires_grad for t in tensors)


def _optimize(model: nn.Module, example_inputs, path: str, report: Report) -> nn.Module:
    try:
        gm = _trace(model, None if example_inputs is None else len(example_inputs), _nones_given(model, example_inputs))
    except Exception as error:
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        logger.info("fxfuse: %s can't be traced (%s); trying its children", path or "the model", reason)
        report.skipped.append(MissRow(path or "<model>", type(model).__name__, reason))
        inputs = _children_inputs(model, example_inputs) if example_inputs is not None else {}
        result = _shallow_copy(model)
        for name, child in model.named_children():
            if _single_torch_module(child):
                continue  # no chain to fuse inside it, and tracing it alone would freeze its train/eval behaviour
            fused_before = len(report.fused)
            optimized = _optimize(child, inputs.get(name), f"{path}.{name}" if path else name, report)
            if len(report.fused) > fused_before:  # else the child stays itself: its type, its modes
                if isinstance(optimized, FusedGraphModule):  # the parent's code may read the child's attributes
                    optimized.__dict__["_stands_for"] = child
                result._modules[name] = optimized
        return result
    if example_inputs is not None:
        _propagate_shapes(gm, model, example_inputs)
    fused_before = len(report.fused)
    try:
        # Matching reads module tensors: a parametrized one (spectral_norm) runs its parametrization, which may
        # change the model's buffers (its power iteration's vectors); they are put back.
        with _model_kept_as_it_was(model):
            report.extend(fuse_graph(gm, path, training=_trains(model, example_inputs)))
    except Exception as error:  # never fail a model that runs in eager: keep it unfused, and say why
        logger.warning("fxfuse: fusing %s failed (%s: %s); it runs unfused", path or "the model",
                       type(error).__name__, error, exc_info=logger.isEnabledFor(logging.DEBUG))
        report.skipped.append(MissRow(path or "<model>", type(model).__name__,
                                      f"fxfuse error, left unfused: {type(error).__name__}: {error}"))
        return _shallow_copy(model)
    if any(node.target in FIRST_CHECKS for node in gm.graph.nodes):  # (only then: a local class can't be pickled)
        gm.__dict__["_eager_class"] = model.__dict__.get("_eager_class", type(model))
    if len(report.fused) == fused_before:
        # Nothing to fuse: the model's own forward, not its trace, which would fix what Python decided while
        # tracing (a torch.no_grad() block, `training=self.training`).
        return _shallow_copy(model)
    return gm


def _load_kernels_for(example_inputs, model: nn.Module) -> None:
    tensors = list(model.parameters()) + [t for t in (example_inputs or ()) if isinstance(t, torch.Tensor)]
    if any(t.is_cuda for t in tensors):
        from .kernels import load
        load()


def _as_inputs(example_inputs) -> tuple | None:
    """The example inputs as a tuple: a single tensor is one input (not a sequence of its rows)."""
    if example_inputs is None:
        return None
    return (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)


def optimize(model: nn.Module, example_inputs: Sequence[Any] | None = None, **options) -> nn.Module:
    """Return `model` with every fusible GEMM-epilogue chain replaced by one fxfuse op.

    The result computes what `model` computes (within the dtype's tolerance) and shares its parameters.
    `example_inputs` (optional: the forward's arguments, or one tensor) lets the matcher prove more. Options:
    ``load_kernels`` (default True) builds or loads the CUDA kernels now when the model or its inputs are on a GPU
    (else the fused ops' first CUDA call does).
    The report of what was fused is kept as ``result.fxfuse_report``.
    """
    unknown = set(options) - {"load_kernels"}
    if unknown:
        raise TypeError(f"fxfuse.optimize() got unexpected options {sorted(unknown)}")
    example_inputs = _as_inputs(example_inputs)
    if options.get("load_kernels", True):
        _load_kernels_for(example_inputs, model)
    report = Report()
    optimized = _optimize(model, example_inputs, "", report)
    optimized.fxfuse_report = report
    if isinstance(optimized, fx.GraphModule):
        # GraphModule's deepcopy rebuilds the module and keeps, of its plain attributes, only these.
        preserved = getattr(fx.graph_module, "_USER_PRESERVED_ATTRIBUTES_KEY", "_user_preserved_attributes")
        optimized.meta.setdefault(preserved, {})["fxfuse_report"] = report
    logger.info("%s", report)
    return optimized


def explain(model: nn.Module, example_inputs: Sequence[Any] | None = None) -> Report:
    """Report what `optimize(model, example_inputs)` would fuse, and why anything near a GEMM would not."""
    report = Report()
    _optimize(model, _as_inputs(example_inputs), "", report)
    return report
