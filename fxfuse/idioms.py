"""Idioms: small multi-node spellings of one canonical op (``x * torch.sigmoid(x)`` is silu).

Entry points: ``idiom`` (the decorator that declares one; ``fxfuse.patterns`` holds the built-in ones and
user code may declare more, without editing fxfuse) and ``apply_idioms`` (called by canonicalization).

An idiom is a plain function. Its positional parameters stand for any tensor; its keyword-only parameters
stand for any finite Python number and are captured as the canonical op's attributes. ``idiom``'s keywords fix the
op's other attributes, or operands that the spelling leaves out (``weight=None``). The function is traced with
torch.fx and canonicalized like a model, so it matches every spelling of the ops it is written with. The
match is a subgraph monomorphism (networkx) of the idiom's DAG into the model's DAG around each candidate
root, with operand positions on the edges (ignored for commutative ops).
"""
from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import networkx as nx
import torch.fx as fx
from networkx.algorithms.isomorphism import DiGraphMatcher

from .canonicalize import Canonical, canonical_of, plain_call
from .epilogue import EPILOGUE_OPS

logger = logging.getLogger("fxfuse")

COMMUTATIVE = {"add", "mul"}


@dataclass
class Idiom:
    op: str                       # the canonical op it stands for
    attrs: dict[str, Any]         # fixed attributes of that op
    fixed_operands: dict[str, Any]  # operands of that op the spelling leaves out (a norm's weight=None)
    function: Callable
    graph: nx.DiGraph             # pattern nodes: fx nodes of the traced function; placeholders are wildcards
    root: fx.Node
    tensor_inputs: list[fx.Node]  # placeholders standing for tensors, in the function's order
    scalar_inputs: dict[fx.Node, str]  # placeholders standing for numbers -> the attribute they become
    canon: dict[fx.Node, Canonical]
    depth: int                    # longest operand path from the root to an input
    # the value dtypes it is exact for (known from example inputs; optimize()'s graph checks them at each call, as
    # autocast or .half() may change them); None: every one
    dtypes: tuple | None = None


IDIOMS: list[Idiom] = []


def idiom(op: str, dtypes: tuple | None = None, **attrs):
    """Declare that the decorated function spells canonical op `op` (with fixed `attrs`: attributes, or
    operands the function has no parameter for). `dtypes`: where the spelled-out formula equals the op only for
    some dtypes (its intermediates overflow in fp16), those; it then applies only where example inputs show one.

    >>> @idiom("silu")
    ... def silu_spelled_out(x):
    ...     return x * torch.sigmoid(x)
    """

    def declare(function):
        IDIOMS.append(_build(op, attrs, function, dtypes))
        return function

    return declare


def _label(node: fx.Node, canon: dict[fx.Node, Canonical]):
    c = canon.get(node)
    if c is not None and c.problem is None:
        return ("op", c.op)
    plain = plain_call(node)
    if plain is not None:
        return ("call_function", plain[0])
    if node.op in ("call_function", "call_method", "call_module"):
        return (node.op, node.target)
    return (node.op, None)


@dataclass(frozen=True)
class _Keyword:
    """A keyword argument of an op outside the vocabulary, which idioms match by position: it equals no
    positional operand (torch.where(c, other=h, input=y) is where(c, y, h), not where(c, h, y))."""
    name: str
    value: Any


def _operands(node: fx.Node, canon) -> list:
    c = canon.get(node)
    if c is not None and c.problem is None:
        return list(c.operands)
    _, args, kwargs = plain_call(node) or (None, node.args, node.kwargs)
    return list(args) + [_Keyword(name, value) for name, value in kwargs.items()]


def _dag(nodes, canon, leave_out=()) -> nx.DiGraph:
    graph = nx.DiGraph()
    for node in nodes:
        graph.add_node(node, label=_label(node, canon))
    for node in nodes:
        for operand in _operands(node, canon):
            if isinstance(operand, fx.Node) and operand not in leave_out:
                if operand not in graph:
                    graph.add_node(operand, label=_label(operand, canon))
                graph.add_edge(operand, node)
    return graph


def _build(op: str, attrs: dict, function: Callable, dtypes: tuple | None = None) -> Idiom:
    if op not in EPILOGUE_OPS:
        raise ValueError(f"idiom {function.__name__}: {op!r} is not an epilogue op ({', '.join(sorted(EPILOGUE_OPS))})")
    spec = EPILOGUE_OPS[op]
    unknown = sorted(set(attrs) - set(spec.operands) - set(spec.attrs))
    if unknown:
        raise TypeError(f"idiom {function.__name__}: {op} has no operand or attribute {', '.join(unknown)} "
                        f"(operands {spec.operands}, attributes {spec.attrs})")
    not_none = sorted(name for name in set(attrs) & set(spec.operands) if attrs[name] is not None)
    if not_none:
        raise TypeError(f"idiom {function.__name__}: a fixed operand can only be None ({', '.join(not_none)})")
    gm = fx.symbolic_trace(function)
    canon = {n: c for n in gm.graph.nodes if (c := canonical_of(n, gm)) is not None}
    params = inspect.signature(function).parameters
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = [n for n in placeholders if params[n.target].kind is not inspect.Parameter.KEYWORD_ONLY]
    scalars = {n: n.target for n in placeholders if n not in tensors}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    root = output.args[0]
    body = [n for n in gm.graph.nodes if n.op != "output" and n not in scalars]
    graph = _dag(body, canon, leave_out=scalars)
    depth = max(nx.shortest_path_length(graph.reverse(copy=False), root).values())
    operand_names = EPILOGUE_OPS[op].operands
    fixed = {name: value for name, value in attrs.items() if name in operand_names}
    attrs = {name: value for name, value in attrs.items() if name not in fixed}
    if len(tensors) + len(fixed) != len(operand_names):
        raise TypeError(f"idiom {function.__name__}: {op} takes operands {operand_names}; give each a positional "
                        f"parameter or a fixed value")
    return Idiom(op, attrs, fixed, function, graph, root, tensors, scalars, canon, depth, dtypes)


def _same_number(a, b) -> bool:
    # Relative only: a 0 (a where's threshold) is exactly 0, as `h > 1e-12` is another function than `h > 0`.
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b


def _match_scalars(idiom: Idiom, mapping: dict, canon) -> dict[str, Any] | None:
    """Check literal operands and attributes; capture the idiom's scalar parameters. None if they differ."""
    captured: dict[str, Any] = {}
    for pattern_node, model_node in mapping.items():
        if pattern_node.op == "placeholder":
            continue
        p_ops, m_ops = _operands(pattern_node, idiom.canon), _operands(model_node, canon)
        if len(p_ops) != len(m_ops):
            return None
        pairs = list(zip(p_ops, m_ops))
        if _label(pattern_node, idiom.canon)[1] in COMMUTATIVE and len(pairs) == 2:
            swapped = [(p_ops[0], m_ops[1]), (p_ops[1], m_ops[0])]
            if not _pairs_agree(pairs, mapping, idiom, dict(captured)):
                pairs = swapped
        if not _pairs_agree(pairs, mapping, idiom, captured):
            return None
        pc, mc = idiom.canon.get(pattern_node), canon.get(model_node)
        if pc is not None and mc is not None:
            if set(mc.attrs) != set(pc.attrs):  # e.g. the model's mean has a dtype= the idiom's has not
                return None
            for key, value in pc.attrs.items():
                if not _same_number(value, mc.attrs.get(key)):
                    return None
    return captured


def _pairs_agree(pairs, mapping, idiom: Idiom, captured: dict) -> bool:
    for p, m in pairs:
        if isinstance(p, fx.Node) and p in idiom.scalar_inputs:
            if isinstance(m, bool) or not isinstance(m, (int, float)):
                return False
            m = int(m) if isinstance(m, int) else float(m)  # NumPy's numbers as Python's
            if not math.isfinite(m):  # inf * 0 or a NaN in a discarded branch: the formula's values part from the op's
                return False
            name = idiom.scalar_inputs[p]
            if name in captured and not _same_number(captured[name], m):
                return False
            captured[name] = m
        elif isinstance(p, fx.Node):
            if mapping.get(p) is not m:
                return False
        elif not _same_number(p, m):
            return False
    return True


def _root_operands_fit(idiom: Idiom, root: fx.Node, canon) -> bool:
    """A cheap necessary condition before VF2: the idiom root's operand ops appear among the node's."""
    wanted = {idiom.graph.nodes[p]["label"] for p in idiom.graph.predecessors(idiom.root)}
    wanted.discard(("placeholder", None))
    have = {_label(o, canon) for o in _operands(root, canon) if isinstance(o, fx.Node)}
    return wanted <= have


def _find(idiom: Idiom, root: fx.Node, canon) -> tuple[dict, dict] | None:
    if not _root_operands_fit(idiom, root, canon):
        return None
    local = {root}
    frontier = [root]
    for _ in range(idiom.depth):
        frontier = [o for n in frontier for o in _operands(n, canon) if isinstance(o, fx.Node) and o not in local]
        local.update(frontier)
    model = _dag(local, canon)

    def node_match(model_attrs, pattern_attrs):
        return pattern_attrs["label"][0] == "placeholder" or model_attrs["label"] == pattern_attrs["label"]

    # Operand positions (and commutativity) are checked on the mapping, in _match_scalars.
    matcher = DiGraphMatcher(model, idiom.graph, node_match=node_match)
    for inverse in matcher.subgraph_monomorphisms_iter():
        mapping = {p: m for m, p in inverse.items()}
        if mapping.get(idiom.root) is not root:
            continue
        captured = _match_scalars(idiom, mapping, canon)
        if captured is not None:
            return mapping, captured
    return None


def _value_dtype(node: fx.Node):
    """The dtype of a node's value where example inputs (or Dynamo) recorded it; else None."""
    for key in ("val", "example_value"):
        value = node.meta.get(key)
        if hasattr(value, "dtype"):
            return value.dtype
    meta = node.meta.get("tensor_meta")
    return getattr(meta, "dtype", None)


def apply_idioms(gm: fx.GraphModule, canon: dict[fx.Node, Canonical]) -> None:
    """Record each idiom found in `gm` as one canonical op at its root, covering its interior nodes."""
    from . import patterns  # noqa: F401  (registers the built-in idioms)

    by_root_label: dict[Any, list[Idiom]] = {}
    for known in IDIOMS:
        by_root_label.setdefault(_label(known.root, known.canon), []).append(known)
    for node in list(gm.graph.nodes):
        for candidate in by_root_label.get(_label(node, canon), ()):
            if candidate.dtypes is not None and _value_dtype(node) not in candidate.dtypes:
                logger.debug("idiom %s at %s: exact for %s only, and the dtype is %s", candidate.op, node.name,
                             candidate.dtypes, _value_dtype(node) or "unknown")
                continue
            found = _find(candidate, node, canon)
            if found is None:
                continue
            mapping, captured = found
            interior = [m for p, m in mapping.items() if p.op != "placeholder" and m is not node]
            if any(user not in interior and user is not node for m in interior for user in m.users):
                logger.debug("idiom %s at %s: an interior value is used elsewhere", candidate.op, node.name)
                continue
            if any(canon.get(m) is not None and canon[m].inplace_of is not None for m in interior):
                logger.debug("idiom %s at %s: an interior op is in place", candidate.op, node.name)
                continue  # its mutation would be lost inside the idiom's op
            tensors = iter(mapping[p] for p in candidate.tensor_inputs)
            operands = tuple(candidate.fixed_operands[name] if name in candidate.fixed_operands else next(tensors)
                             for name in EPILOGUE_OPS[candidate.op].operands)
            root = canon.get(node)
            canon[node] = Canonical(candidate.op, operands, {**candidate.attrs, **captured}, covers=tuple(interior),
                                    inplace_of=None if root is None else root.inplace_of,  # b *= sigmoid(b)
                                    dtypes=candidate.dtypes)
            logger.debug("idiom %s found at %s", candidate.op, node.name)
            break
