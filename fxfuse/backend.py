"""The torch.compile backend "fxfuse": fuse the GEMM-epilogue chains of Dynamo's graphs, then compile them.

Entry points:

- ``torch.compile(model, backend="fxfuse")``: Inductor compiles the fused graph. The name is registered
  when fxfuse is imported, and through the ``torch_dynamo_backends`` entry point without importing it.
- ``torch.compile(model, backend="fxfuse", options={"inner": "eager"})``: choose the inner compiler (a
  backend name or a callable); the other options and ``mode`` (or ``options["mode"]``, since torch.compile
  refuses both at once) go to it, as torch.compile would pass them.
- ``fxfuse.make_backend(inner="inductor", mode=None, **inner_options)``: the same, as a backend callable.

Each graph Dynamo hands over is rewritten in place by ``fuse_graph``, the pass behind ``optimize()``, in its
training form where the graph will be differentiated (``is_training_graph``). The
fused op is a torch.library custom op with a fake implementation and registered autograd, so Dynamo,
AOTAutograd and Inductor (as an extern kernel) take it like any aten op: it adds no graph break, guard or
recompile of its own.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .rewrite import fuse_graph

logger = logging.getLogger("fxfuse")

BACKEND_NAME = "fxfuse"
DEFAULT_INNER = "inductor"

CompilerFn = Callable[[fx.GraphModule, Sequence[Any]], Callable]


def _load_kernels_for(example_inputs: Sequence[Any]) -> None:
    """Load the CUDA kernels before a graph with CUDA inputs is compiled (its op then dispatches to them)."""
    if not any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs):
        return
    try:
        from .kernels import load
    except ImportError as error:
        logger.info("fxfuse: CUDA kernels unavailable (%s); the fused op runs its reference", error)
        return
    load()


@functools.lru_cache(maxsize=1)
def implementation_hash() -> str:
    """A hash of the sources that define the fused op's semantics, autograd and fake implementation."""
    package = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in ("library.py", "program.py", "epilogue.py"):
        digest.update((package / name).read_bytes())
    return digest.hexdigest()


def _implementation_stamp():
    """A no-op Inductor pass whose uuid is ``implementation_hash()``.

    Inductor's and AOTAutograd's on-disk caches key on the graph and on each custom pass's uuid, not on the
    Python behind a custom op. With this pass installed, a changed fxfuse op gets fresh compiled code
    instead of a stale cached backward.
    """
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class FxfuseImplementationStamp(CustomGraphPass):
        def __call__(self, graph):
            return None

        def uuid(self):
            return implementation_hash()

    return FxfuseImplementationStamp()


def _inner_compiler(inner: str | CompilerFn, mode: str | None, inner_options: dict[str, Any]) -> CompilerFn:
    """The compiler that takes the fused graph, chosen by name or given as a callable."""
    if callable(inner):
        if inner_options or mode:
            raise TypeError("fxfuse: options and mode are for a named inner compiler, not a callable")
        return inner
    if inner == BACKEND_NAME:
        raise ValueError("fxfuse: the inner compiler can't be fxfuse itself")
    if inner == "inductor":
        # torch.compile's own Inductor wrapper: it applies `mode` and checks each option against the config.
        if torch._inductor.config.post_grad_custom_post_pass is None:  # never in place of the user's own pass
            inner_options.setdefault("post_grad_custom_post_pass", _implementation_stamp())
        return torch._TorchCompileInductorWrapper(mode, inner_options, None)
    from torch._dynamo.backends.registry import lookup_backend

    backend = lookup_backend(inner)
    kwargs = {}
    if mode and mode != "default":
        kwargs["mode"] = mode
    if inner_options:
        kwargs["options"] = inner_options
    return (lambda gm, example_inputs: backend(gm, example_inputs, **kwargs)) if kwargs else backend


def _is_real_tensor(value) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(value, torch.Tensor) and not is_fake(value)


# An attribute of an object the frame holds (the module, `self.scale`, `L['self'].scale` or, through torch.compile's
# wrapper, `L['fn']._modules['act'].negative_slope`), as opposed to a forward argument (`L['scale']`), an item
# of one (`L['cfg']['scale']`, `L['args'][1]`) or a global (`G['K']`).
_ATTRIBUTE_OF_A_LOCAL = re.compile(r"^L\['[^']+'\]\.")


def pin_traced_scalars(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Turn the module floats that Dynamo passes as graph inputs (``dynamic=True``) back into constants.

    Dynamo hands such a float (GroupNorm's eps, a LeakyReLU slope) over as a 0-d float64 tensor that the
    graph reads with ``.item()``. The fused op's program needs the number itself, so each read is replaced
    by its value at compile time, and its traced SymFloat is specialized, so that Dynamo guards on the value and
    recompiles for another (as Inductor's trace of the check would make it do; an "eager" inner compiler traces
    nothing); the in-graph check (``_assert_async``) stays, should a graph ever run with another value. Only
    reads that feed ops of the fxfuse vocabulary are pinned, and only of attributes (`_ATTRIBUTE_OF_A_LOCAL`): a
    float the caller passes (`forward(x, scale)`, `cfg["scale"]`, `*args`) or a global changes from call to call
    and stays a traced value (the op that reads it is then not fused). So does the ``.item()`` of a 0-d tensor
    attribute (a learnable temperature, with ``capture_scalar_outputs``): Dynamo passes the tensor itself, not a
    float (its grapharg's ``pass_arg_as_tensor`` is False), and its value changes with no recompile. Returns how
    many were.
    """
    from .canonicalize import canonical_of

    def pinnable(placeholder):
        grapharg = placeholder.meta.get("grapharg")
        if not getattr(grapharg, "pass_arg_as_tensor", False):  # a real tensor, or unknown: never pinned
            return False
        name = getattr(getattr(grapharg, "source", None), "name", None)
        name = name() if callable(name) else name  # a method before torch 2.12, a property since
        return isinstance(name, str) and bool(_ATTRIBUTE_OF_A_LOCAL.match(name))

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    value_of = dict(zip(placeholders, example_inputs))
    pinned = 0
    for node in list(gm.graph.nodes):
        if not (node.op == "call_method" and node.target == "item" and node.args[0] in value_of):
            continue
        source = value_of[node.args[0]]
        if not (_is_real_tensor(source) and source.dim() == 0 and source.is_floating_point()):
            continue
        if not pinnable(node.args[0]):
            continue
        if not node.users or any(canonical_of(user, gm) is None for user in node.users):
            continue
        value = source.item()
        traced = node.meta.get("example_value")
        if isinstance(traced, torch.SymFloat):  # Dynamo's guard on the value: another value recompiles
            float(traced)
        with gm.graph.inserting_before(node):
            same = gm.graph.call_function(torch.eq, (node.args[0], value))
            gm.graph.call_function(torch._assert_async, (same, f"fxfuse: {node.args[0].name} was {value!r} when "
                                                               "this graph was compiled; call torch._dynamo.reset()"))
        node.replace_all_uses_with(value)
        gm.graph.erase_node(node)
        pinned += 1
    if pinned:
        gm.recompile()
    return pinned


def is_training_graph(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Whether autograd will differentiate this graph: grad mode is on and an input or parameter requires grad.

    Dynamo guards grad mode and each input's requires_grad, so a call that differs recompiles.
    """
    tensors = [*gm.parameters(), *(t for t in example_inputs if isinstance(t, torch.Tensor))]
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class FxfuseBackend:
    """A torch.compile backend: ``fuse_graph`` on each graph, then the inner compiler.

    ``reports`` keeps the fxfuse report of every graph this backend compiled, in order.
    """

    def __init__(self, inner: str | CompilerFn = DEFAULT_INNER, mode: str | None = None, **inner_options):
        self.inner = inner
        self.mode = mode
        self.inner_options = inner_options
        self.compile_inner = _inner_compiler(inner, mode, dict(inner_options))
        self.reports = []
        inner_name = inner if isinstance(inner, str) else getattr(inner, "__name__", type(inner).__name__)
        self.__name__ = f"{BACKEND_NAME}[{inner_name}]"

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **compile_settings):
        if compile_settings:  # torch.compile(..., mode=..., options=...) with this object as its backend
            raise TypeError(f"fxfuse: torch.compile's {' and '.join(sorted(compile_settings))} can't reach a backend "
                            "object: give them to fxfuse.make_backend(inner, mode, **options), or use "
                            "backend='fxfuse' with options={'inner': ...}")
        _load_kernels_for(example_inputs)
        pin_traced_scalars(gm, example_inputs)
        report = fuse_graph(gm, training=is_training_graph(gm, example_inputs), shapes_guarded=True)
        self.reports.append(report)
        logger.info("fxfuse backend: %s", report)
        return self.compile_inner(gm, example_inputs)

    def __eq__(self, other):  # equal backends share Dynamo's compiled code
        return (isinstance(other, FxfuseBackend) and (self.inner, self.mode, self.inner_options)
                == (other.inner, other.mode, other.inner_options))

    def __hash__(self):
        return hash((BACKEND_NAME, repr(self.inner), self.mode))


def make_backend(inner: str | CompilerFn = DEFAULT_INNER, mode: str | None = None, **inner_options) -> FxfuseBackend:
    """A backend for ``torch.compile(model, backend=...)`` that fuses, then compiles with `inner`.

    `inner` is a torch.compile backend name ("inductor", "eager", "aot_eager", ...) or a callable
    ``(gm, example_inputs) -> callable``. `mode` and `inner_options` go to a named inner compiler, as
    torch.compile's ``mode`` and ``options`` would (for Inductor: its config options).
    """
    return FxfuseBackend(inner, mode, **inner_options)


def fxfuse_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                   options: dict[str, Any] | None = None):
    """The backend registered as "fxfuse". ``options["inner"]`` picks the inner compiler (default Inductor);
    the other options and `mode` go to it. torch.compile takes `mode` or `options`, not both, so
    ``options["mode"]`` stands for `mode`."""
    inner_options = dict(options or {})
    inner = inner_options.pop("inner", DEFAULT_INNER)
    mode = inner_options.pop("mode", mode)
    return FxfuseBackend(inner, mode, **inner_options)(gm, example_inputs)


def register() -> None:
    """Register "fxfuse" with Dynamo, unless it is registered or Dynamo is loading it from the entry point."""
    try:
        from torch._dynamo.backends import registry
    except Exception as error:  # a torch build without a working Dynamo: optimize() still works
        logger.info("fxfuse: torch.compile backend not registered (%s: %s)", type(error).__name__, error)
        return

    compilers = getattr(registry, "_COMPILER_FNS", {})
    pending_entry_point = getattr(registry, "_BACKENDS", {}).get(BACKEND_NAME)
    if BACKEND_NAME in compilers or pending_entry_point is not None:
        # lookup_backend() registers what the entry point loads right after this import returns.
        return
    registry.register_backend(fxfuse_backend, name=BACKEND_NAME)
