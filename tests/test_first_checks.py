"""optimize() without example inputs: values that the graph makes of forward arguments, whose rank or dtype only a
check before any op can tell (rewrite.py's FIRST_CHECKS), fuse, and a call of another rank or dtype gives eager's
result or eager's error (the optimized model runs its model's own forward).

Covered: the GEMM's input made by ops that change the rank by a fixed amount (`x.unsqueeze(0)`, `x.sum(1)`,
`x[None]`, `x[:, 0]`) or keep it (`x.transpose(1, 2)`), by a view or reshape to a given shape, whose rank is its own
(`x.view(x.shape[0], -1)`, `x.reshape(-1, IN)`, `x.view(x.numel())`), by torch.cat or torch.stack of such values or
of a list argument's items (`torch.cat(xs, 1)`, with example inputs too), by an item of a forward argument that may
be a list, whose rank the call's argument tells (`xs[0]`, with example inputs too), or by a squeeze of a forward
argument, whose rank its sizes tell (`x.squeeze(0)`, with example inputs too), an outside
operand made of forward arguments (`h + x.sum(-1, keepdim=True).unsqueeze(0)`, `h + y.unsqueeze(-1)`), and a forward
argument that an add's or sub's alpha scales before the region reads it (`torch.sub(h, y, alpha=2)`).
"""
import pickle
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from epilogue_models import IN, OUT, GemmThen, GemmThenTwoArguments, assert_reason, leftover_compute
from fxfuse.library import FUSED_OPS
from fxfuse.rewrite import (require_argument_dtype, require_argument_rank, require_broadcast_rank,
                            require_broadcast_rank_at_least)
from fxfuse.testing import assert_close_report, assert_gradients_match, fused_op_count


def _eager_or_its_error(model, optimized, *inputs):
    """The optimized model returns eager's result, or raises eager's error (type and message)."""
    try:
        with torch.no_grad():
            expected = model(*inputs)
    except Exception as error:
        with pytest.raises(type(error), match=re.escape(str(error))), torch.no_grad():
            optimized(*inputs)
        return
    with torch.no_grad():
        actual = optimized(*inputs)
    assert_close_report(actual, expected)


def _calls_of(optimized, check) -> int:
    return sum(1 for node in optimized.graph.nodes if node.op == "call_function" and node.target is check)


def _read_by_the_fused_op(optimized) -> set[str]:
    """The names of the nodes that the fused op's input and params are computed from (`x.unsqueeze(0)`, which
    stay): none of the chain it replaced."""
    fused = next(node for node in optimized.graph.nodes if node.target in FUSED_OPS)
    seen, stack = set(), list(fused.all_input_nodes)
    while stack:
        node = stack.pop()
        if isinstance(node, torch.fx.Node) and node.name not in seen:
            seen.add(node.name)
            stack.extend(node.all_input_nodes)
    return seen


def _whole_chain_fused(model, inputs, dtype=torch.float32):
    """optimize() without example inputs makes one fused op and nothing else (but what makes its input and params);
    it computes eager's result."""
    model = model.to(dtype)
    inputs = tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs)
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1, optimized.fxfuse_report
    assert not optimized.fxfuse_report.near_misses, optimized.fxfuse_report
    left = [name for name in leftover_compute(optimized) if name.split()[0] not in _read_by_the_fused_op(optimized)]
    assert not left, f"not fused: {left}\n{optimized.code}"
    _eager_or_its_error(model, optimized, *inputs)
    return optimized


# ---------------------------------------------------------------- the GEMM's input: ranks that change by a fixed amount

# (epilogue, the rank of x it fuses for, inputs of other ranks: eager computes, or raises, something else)
_X_MADE_BY_RANK_CHANGES = [
    (lambda m, x, y: F.group_norm(m.fc(x.unsqueeze(0)), 5), (IN,), [(4, IN), (3, IN), (2, 4, IN)]),
    (lambda m, x, y: m.fc(torch.unsqueeze(x, dim=0)).amax(1), (IN,), [(5, IN), (2, 5, IN)]),
    (lambda m, x, y: m.fc(x.unsqueeze(-2).relu()).softmax(1), (IN,), [(5, IN), (2, 5, IN)]),
    (lambda m, x, y: m.fc(x.sum(1)).softmax(1), (3, 5, IN), [(3, 4, 5, IN), (5, IN)]),
    (lambda m, x, y: F.group_norm(m.fc(x.flatten(0, 1)), 5), (2, 3, IN), [(2, 3, 4, IN), (6, IN)]),
    (lambda m, x, y: m.fc(x.unsqueeze(0).sum(0)).amax(1), (3, IN), [(2, 3, IN), (IN,)]),
    (lambda m, x, y: m.fc(x.t()).softmax(1), (IN, 5), [(IN,), (2, IN, 5)]),
    (lambda m, x, y: m.fc(x.transpose(1, 2).flatten(0, 1)).amax(1), (2, IN, 5), [(3, 2, IN, 5), (IN, 5)]),
    (lambda m, x, y: F.group_norm(m.fc(torch.swapaxes(x, 0, 1)), 5), (IN, 4), [(3, IN, 4), (IN,)]),
    (lambda m, x, y: m.fc(x.permute(1, 0)).softmax(1), (IN, 5), [(2, IN, 5), (IN,)]),
    (lambda m, x, y: m.fc(x[None]).softmax(1), (IN,), [(5, IN), (2, 5, IN)]),
    (lambda m, x, y: F.group_norm(m.fc(x[..., None, :]), 5), (IN,), [(4, IN), (2, 4, IN)]),
    (lambda m, x, y: m.fc(x[:, 0]).amax(1), (5, 3, IN), [(5, IN), (4, 5, 3, IN)]),
    (lambda m, x, y: m.fc(x[1:, None, 0]).amax(-1, keepdim=True).softmax(1), (IN, 3, IN),
     [(IN, 3, 4, IN), (IN, IN)]),
]
_X_IDS = ["unsqueeze-group_norm", "unsqueeze-amax", "unsqueeze-relu-softmax", "sum-softmax", "flatten-group_norm",
          "unsqueeze-sum", "t-softmax", "transpose-flatten-amax", "swapaxes-group_norm", "permute-softmax",
          "index-None-softmax", "index-ellipsis-None-group_norm", "index-int-amax", "index-slice-None-int-softmax"]


@pytest.mark.parametrize("forward, shape, others", _X_MADE_BY_RANK_CHANGES, ids=_X_IDS)
def test_an_input_made_by_rank_changes_is_checked_first_and_other_ranks_give_eagers_result(forward, shape, others):
    """`fc(x.unsqueeze(0))` is 2-D for a 1-D x only: group_norm and softmax(1) hold for that rank. The check before any
    op knows the rank after unsqueeze (one more), a reduction without keepdim (one less) or flatten; it checked x's
    rank after the ops only (require_rank), and raised fxfuse's error where eager computes, or raises its own."""
    model = GemmThen(forward).eval()
    optimized = _whole_chain_fused(model, (torch.randn(shape),))
    assert _calls_of(optimized, require_broadcast_rank) == 1, optimized.code
    for other in others:
        _eager_or_its_error(model, optimized, torch.randn(other))


# ---------------------------------------------------------------- the GEMM's input: a view or reshape to a given shape

# (epilogue, an input it fuses for without example inputs, inputs of other ranks and shapes: eager computes, or raises)
_X_OF_A_GIVEN_SHAPE = [
    (lambda m, x, y: F.group_norm(m.fc(x.view(x.shape[0], -1)), 5), (3, 4, 6), [(3, IN), (2, 2, 2, 6), (3, 5), (0, IN)]),
    (lambda m, x, y: m.fc(x.reshape(-1, IN)).softmax(1), (3, IN), [(2, 3, IN), (IN,), (5, 7)]),
    (lambda m, x, y: F.group_norm(m.fc(x.view((x.size(0), IN))), 5), (3, IN), [(3, 4, 6), (2, 3, IN)]),
    (lambda m, x, y: m.fc(x.view(size=[-1, IN])).softmax(1), (3, IN), [(2, 3, IN), (IN,)]),
    (lambda m, x, y: m.fc(x.reshape(shape=(-1, IN))).amax(1), (3, IN), [(2, 3, IN), (IN,)]),
    (lambda m, x, y: F.group_norm(m.fc(torch.reshape(x, (-1, IN))), 5), (2, 3, IN), [(3, IN), (IN, 5)]),
    (lambda m, x, y: m.fc(torch.reshape(input=x, shape=[2, -1, IN])).softmax(2), (2, 3, IN), [(6, IN), (IN,)]),
    (lambda m, x, y: m.fc(x.reshape(-1, IN).relu()).softmax(1), (3, IN), [(2, 3, IN)]),
]
_SHAPE_IDS = ["view-batch-group_norm", "reshape-softmax", "view-tuple-group_norm", "view-size-keyword-softmax",
              "reshape-shape-keyword-amax", "torch-reshape-group_norm", "torch-reshape-keywords-softmax",
              "reshape-relu-softmax"]


@pytest.mark.parametrize("forward, shape, others", _X_OF_A_GIVEN_SHAPE, ids=_SHAPE_IDS)
def test_an_input_of_a_given_shape_fuses_and_other_ranks_give_eagers_result(forward, shape, others):
    """`fc(x.view(b, -1))` is 2-D whatever x's rank: group_norm and softmax(1) hold for it, with no check before any
    op but a trivial one. Without example inputs it was not fused (no check could tell x's rank); a call of any rank
    gives eager's result, or eager's error (a view that eager can't make, a size that fc raises for)."""
    model = GemmThen(forward).eval()
    optimized = _whole_chain_fused(model, (torch.randn(shape),))
    for other in others:
        _eager_or_its_error(model, optimized, torch.randn(other))


@pytest.mark.parametrize("forward", [
    lambda m, x, y: F.group_norm(m.fc(x.view(torch.float32)), 5),
    lambda m, x, y: F.group_norm(m.fc(x.view(dtype=torch.float32)), 5),
    lambda m, x, y: F.group_norm(m.fc(x.view(y.shape)), 5),
    lambda m, x, y: F.group_norm(m.fc(x.reshape(y.shape)), 5),
    lambda m, x, y: F.group_norm(m.fc(torch.reshape(x, y.shape)), 5),
    lambda m, x, y: F.group_norm(m.fc(x.view(y.shape[1:])), 5),
    lambda m, x, y: F.group_norm(m.fc(x.reshape(y.size())), 5),
    lambda m, x, y: F.group_norm(m.fc(x.view(y)), 5),
], ids=["view-dtype", "view-dtype-keyword", "view-shape-of-y", "reshape-shape-of-y", "torch-reshape-shape-of-y",
        "view-slice-of-a-shape", "reshape-size-of-y", "view-argument"])
def test_a_view_whose_rank_is_not_given_is_not_fused_without_example_inputs(forward):
    """`x.view(torch.float32)` keeps x's rank, and `x.view(y.shape)`'s is y's, which may be a number's or a Size's
    (and a forward argument `x.view(y)` may be either): no check before any op tells it, and group_norm is not fused;
    calls of either rank give eager's result."""
    model = GemmThen(forward).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 0, optimized.fxfuse_report
    assert_reason(optimized, "pass example inputs")
    for x, y in ((torch.randn(4, IN), torch.randn(4, IN)), (torch.randn(2, 2, IN), torch.randn(2, 2, IN)),
                 (torch.randn(4, IN), torch.randn(2, 2, IN))):
        _eager_or_its_error(model, optimized, x, y)


def _viewed_as_its_count_then_unsqueezed(m, x, y):
    n = x.numel()
    n //= 1
    return m.fc(x.view(n).unsqueeze(0)).softmax(1)


# (epilogue, an input it fuses for without example inputs, inputs of other ranks and shapes: eager computes, or raises)
_X_VIEWED_AS_ONE_COUNTED_SIZE = [
    (lambda m, x, y: m.fc(x.view(x.numel()).unsqueeze(0)).softmax(1), (4, 6), [(IN,), (2, 3, 4), (3, IN)]),
    (lambda m, x, y: m.fc(x.reshape(x.shape[0] * x.shape[1])[None]).amax(1), (4, 6), [(2, 12), (2, 3, 4), (IN,)]),
    (lambda m, x, y: F.group_norm(m.fc(torch.stack([x.view(x.size(-1) % 25), x[0, :]])), 5), (3, IN),
     [(IN,), (2, 3, IN), (3, 5)]),
    (lambda m, x, y: m.fc(x.reshape(-x.dim() * -(x.nelement() // x.ndim))[None]).softmax(1), (2, 12),
     [(IN,), (2, 3, 4)]),
    (_viewed_as_its_count_then_unsqueezed, (IN,), [(4, 6), (2, 3, 4), (3, IN)]),
]
_COUNTED_IDS = ["view-numel-unsqueeze-softmax", "reshape-size-product-index-None-amax",
                "view-size-mod-stack-group_norm", "reshape-dim-times-numel-floordiv-ndim-softmax",
                "view-numel-augmented-floordiv-softmax"]


@pytest.mark.parametrize("forward, shape, others", _X_VIEWED_AS_ONE_COUNTED_SIZE, ids=_COUNTED_IDS)
def test_a_view_to_one_counted_size_is_1d_and_fuses(forward, shape, others):
    """`x.view(n)` of an int n (a size of a tensor, its element count, int arithmetic of those) is 1-D whatever x's
    rank: `fc(x.view(x.numel()).unsqueeze(0))` is 2-D, for which softmax(1) holds. It was refused without example
    inputs (one node as the shape may be a Size of any length); a call of any rank gives eager's result or error."""
    model = GemmThen(forward).eval()
    optimized = _whole_chain_fused(model, (torch.randn(shape),))
    for other in others:
        _eager_or_its_error(model, optimized, torch.randn(other))


def test_a_view_to_one_counted_size_is_not_fused_where_the_program_needs_2d():
    """`fc(x.view(y.shape[0]))` is 1-D at every call, and group_norm holds for 2-D inputs only: not fused, and the near
    miss says why (it said "pass example inputs", which would not help)."""
    model = GemmThen(lambda m, x, y: F.group_norm(m.fc(x.view(y.shape[0])), 5)).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 0, optimized.fxfuse_report
    assert_reason(optimized, "has 1 dims at every call")
    for x, y in ((torch.randn(IN), torch.randn(IN, 2)), (torch.randn(4, 6), torch.randn(IN))):
        _eager_or_its_error(model, optimized, x, y)


@pytest.mark.parametrize("forward", [
    lambda m, x, y: m.fc(x.view(x.size(0), 1, -1)).softmax(1),
    lambda m, x, y: F.group_norm(m.fc(x.reshape(3, -1, IN)), 5),
    lambda m, x, y: m.fc(torch.stack([x.view(-1, IN), y])).softmax(1),
], ids=["view-3d-softmax", "reshape-3d-group_norm", "stack-of-a-view-softmax"])
def test_an_input_of_more_dims_than_the_program_holds_for_is_not_fused(forward):
    """`fc(x.view(b, 1, -1))` is 3-D at every call, and softmax(1) holds for a 2-D input: its first check failed at
    every call, which ran the model's own forward, while the report said it fused. It is a near miss that says why."""
    model = GemmThen(forward).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 0, optimized.fxfuse_report
    assert_reason(optimized, "dims at every call")
    for x, y in ((torch.randn(3, IN), torch.randn(3, IN)), (torch.randn(3, 2, IN // 2), torch.randn(3, IN))):
        _eager_or_its_error(model, optimized, x, y)


def test_an_outside_operand_of_a_given_shape_is_taken_for_a_tensor():
    """`h + y.reshape(-1, OUT)` is a tensor where eager computes (a number has no reshape): it fuses without example
    inputs, where it was refused ("cannot prove that ... is a tensor"), and computes eager's result, or error, for y
    of other ranks and dtypes."""
    model = GemmThen(lambda m, x, y: m.fc(x) + y.reshape(-1, OUT)).eval()
    _whole_chain_fused(model, (torch.randn(3, IN), torch.randn(3, OUT)))
    optimized = fxfuse.optimize(model)
    for y in (torch.randn(3, 1, OUT), torch.randn(3, OUT, dtype=torch.float64), torch.randn(6, OUT), 2.0):
        _eager_or_its_error(model, optimized, torch.randn(3, IN), y)


class ConvolutionHead(nn.Module):
    """A CNN's head: a convolution's output made rows (`h.view(h.size(0), -1)`, `torch.flatten(h, 1)`,
    `h.reshape(-1, 64)`), then fc and softmax over its features."""

    def __init__(self, rows):
        super().__init__()
        self.conv, self.fc, self.rows = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(64, OUT), rows

    def forward(self, x):
        return torch.softmax(self.fc(self.rows(self.conv(x))), dim=1)


@pytest.mark.parametrize("rows", [lambda h: h.view(h.size(0), -1), lambda h: torch.flatten(h, 1),
                                  lambda h: h.reshape(-1, 64)], ids=["view", "flatten", "reshape"])
def test_a_convolutions_output_of_a_given_shape_fuses(rows):
    """The convolution's output is of no rank the checks follow, but its view to 2 dims is 2-D whatever it is:
    softmax(1) fuses without example inputs (it was refused), and a call of either rank of x gives eager's result, or
    eager's error (an unbatched x makes 4 rows of 16 features for view, 1 of 64 for reshape)."""
    model = ConvolutionHead(rows).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1, optimized.fxfuse_report
    for x in (torch.randn(2, 3, 4, 4), torch.randn(3, 4, 4)):
        _eager_or_its_error(model, optimized, x)


# ---------------------------------------------------------------- the GEMM's input: joined tensors

# (epilogue, inputs it fuses for without example inputs, inputs of other ranks: eager computes, or raises)
_X_JOINED = [
    (lambda m, x, y: F.group_norm(m.fc(torch.cat([x, y], 1)), 5), ((3, 20), (3, 4)),
     [((2, 3, 20), (2, 3, 4)), ((3, 20), (3, 1, 4)), ((3, IN), (0,)), ((IN,), (0,))]),
    (lambda m, x, y: m.fc(torch.concat((x, y), dim=-1)).softmax(1), ((3, 20), (3, 4)),
     [((2, 3, 20), (2, 3, 4)), ((20,), (4,))]),
    (lambda m, x, y: m.fc(torch.concatenate([x, y.relu()], axis=0)).amax(1), ((2, IN), (3, IN)),
     [((2, 2, IN), (1, 2, IN)), ((IN,), (IN,))]),
    (lambda m, x, y: F.group_norm(m.fc(torch.stack([x, y])), 5), ((IN,), (IN,)),
     [((3, IN), (3, IN)), ((IN,), (3, IN))]),
    (lambda m, x, y: m.fc(torch.cat([x.unsqueeze(0), y], 0)).softmax(1), ((IN,), (3, IN)),
     [((2, IN), (1, 2, IN)), ((IN,), (IN,))]),
]
_JOINED_IDS = ["cat-group_norm", "concat-softmax", "concatenate-relu-amax", "stack-group_norm", "cat-unsqueeze-softmax"]


@pytest.mark.parametrize("forward, shapes, others", _X_JOINED, ids=_JOINED_IDS)
def test_an_input_made_by_joining_arguments_is_checked_first_and_other_ranks_give_eagers_result(forward, shapes,
                                                                                                 others):
    """`torch.cat([x, y], 1)` has its inputs' rank (eager raises where they differ, and skips 1-D empty ones), and
    torch.stack one more: group_norm and softmax(1) of fc of it hold for one rank, which the check before any op
    tells of x's and y's. Without example inputs it was not fused; a call of another rank gives eager's result, or
    eager's error."""
    model = GemmThen(forward).eval()
    optimized = _whole_chain_fused(model, tuple(torch.randn(shape) for shape in shapes))
    assert _calls_of(optimized, require_broadcast_rank) == 1, optimized.code
    for other in others:
        _eager_or_its_error(model, optimized, *(torch.randn(shape) for shape in other))


def test_an_outside_operand_made_by_cat_is_taken_for_a_tensor():
    """`h + torch.cat([y, y], -1)` is a tensor where eager computes: it fuses without example inputs, and computes
    eager's result, or error, for y of other ranks and dtypes, or a number."""
    model = GemmThen(lambda m, x, y: m.fc(x) + torch.cat([y, y], -1)).eval()
    _whole_chain_fused(model, (torch.randn(3, IN), torch.randn(3, OUT // 2)))
    optimized = fxfuse.optimize(model)
    for y in (torch.randn(2, 3, OUT // 2), torch.randn(3, OUT // 2, dtype=torch.float64), torch.randn(OUT // 2), 2.0):
        _eager_or_its_error(model, optimized, torch.randn(3, IN), y)


def test_cat_into_a_tensor_is_not_followed():
    """`torch.cat([x, y], 1, out=z)` writes into z: what it makes is not followed, and group_norm is not fused."""
    model = GemmThen(lambda m, x, y: F.group_norm(m.fc(torch.cat([x, x], 1, out=y)), 5), in_features=2 * IN).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 0, optimized.fxfuse_report
    for x in (torch.randn(3, IN), torch.randn(2, 3, IN)):
        _eager_or_its_error(model, optimized, x, torch.empty(0))


# ---------------------------------------------------------------- the GEMM's input: an item of a forward argument

def _items(*shapes, kind=list):
    return kind(torch.randn(shape) for shape in shapes)


# (epilogue, an input it fuses for without example inputs, inputs of any kind: a tensor, whose item is one dim fewer,
# a list or tuple, whose item is of its own rank, or what eager's indexing raises for)
_OTHER_ITEMS = [torch.randn(1, 4, IN), torch.randn(2, 3, 5, IN), torch.randn(2, 3, 4, IN), torch.randn(4, IN),
                torch.randn(()), torch.randn(0, IN), _items((4, IN)), _items((3, 4, IN), (IN,)), _items((IN,)),
                _items((2, IN), kind=tuple), [], [1.5], [[1.0] * IN], {0: torch.randn(4, IN)}]
_X_AN_ITEM = [
    (lambda m, xs, y: F.group_norm(m.fc(xs[0]), 5), _items((4, IN))),
    (lambda m, xs, y: m.fc(xs[-1]).softmax(1), _items((IN,), (4, IN))),
    (lambda m, xs, y: m.fc(xs[0][1]).amax(1), _items((2, 4, IN))),
    (lambda m, xs, y: F.group_norm(m.fc(xs[1].unsqueeze(0) * 2), 5), _items((IN,), (IN,), kind=tuple)),
    (lambda m, xs, y: m.fc(xs[0].sum(0)).softmax(1), torch.randn(2, 3, 4, IN)),
]
_ITEM_IDS = ["item-group_norm", "negative-item-softmax", "item-of-item-amax", "item-unsqueeze-mul-group_norm",
             "item-sum-softmax"]


def _refusals(caplog) -> int:
    return sum("runs the model's own forward" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("forward, traced", _X_AN_ITEM, ids=_ITEM_IDS)
def test_an_input_made_of_an_item_of_a_forward_argument_is_checked_first(forward, traced, caplog):
    """`fc(xs[0])` is 2-D for a 3-D tensor xs, or for a list or tuple whose item 0 is 2-D: group_norm and softmax(1)
    hold for that rank. The check before any op tells the item's rank of what the call passes; it checked the
    rank after the ops only (require_rank), and raised fxfuse's error where eager computes, or raises its own. A call
    the graph was made for runs the fused op (the check was left out, lest every call with a list run unfused)."""
    model = GemmThen(forward).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1 and not optimized.fxfuse_report.near_misses, optimized.fxfuse_report
    assert _calls_of(optimized, require_broadcast_rank) == 1, optimized.code
    with caplog.at_level("DEBUG", logger="fxfuse"):
        _eager_or_its_error(model, optimized, traced)
    assert _refusals(caplog) == 0
    for other in _OTHER_ITEMS:
        _eager_or_its_error(model, optimized, other)


def test_an_input_made_of_an_item_of_a_list_is_checked_first_with_example_inputs():
    """The example inputs' ranks are checked first for tensors only: a list's item of another rank slipped through
    to require_rank."""
    model = GemmThen(lambda m, xs, y: F.group_norm(m.fc(xs[0]), 5)).eval()
    optimized = fxfuse.optimize(model, (_items((4, IN)),))
    assert fused_op_count(optimized) == 1 and _calls_of(optimized, require_broadcast_rank) == 1, optimized.code
    for other in _OTHER_ITEMS:
        _eager_or_its_error(model, optimized, other)


def test_an_input_made_of_an_item_gives_eagers_gradients_in_train_mode():
    model = GemmThen(lambda m, xs, y: F.group_norm(m.fc(xs[0]), 5)).train()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1, optimized.fxfuse_report
    for x in (torch.randn(1, 4, IN), torch.randn(2, 3, 5, IN)):
        assert_gradients_match(model, optimized, (x,))


class ItemThenGroupNorm(nn.Module):
    """(a class of the module's own: pickle takes no lambda)"""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, xs):
        return F.group_norm(self.fc(xs[-1]), 5)


def test_the_check_of_an_item_survives_pickling():
    """The check's offset, ("item", index, more), is written in the graph's code, which unpickling traces again."""
    model = ItemThenGroupNorm().eval()
    restored = pickle.loads(pickle.dumps(fxfuse.optimize(model)))
    assert fused_op_count(restored) == 1 and _calls_of(restored, require_broadcast_rank) == 1, restored.code
    for inputs in (_items((4, IN)), torch.randn(2, 3, 4, IN), _items((IN,)), torch.randn(1, 4, IN)):
        _eager_or_its_error(model, restored, inputs)


def test_an_item_of_a_tensor_example_input_is_checked_first_for_a_list_too():
    """With a tensor as the example input, its rank is checked first, which a list passed later has none of: its
    item's rank is checked too."""
    model = ItemThenGroupNorm().eval()
    optimized = fxfuse.optimize(model, (torch.randn(1, 4, IN),))
    assert fused_op_count(optimized) == 1 and _calls_of(optimized, require_broadcast_rank) == 1, optimized.code
    assert _calls_of(optimized, require_argument_rank) == 1, optimized.code
    for other in _OTHER_ITEMS:
        _eager_or_its_error(model, optimized, other)


def test_an_input_made_of_an_item_for_a_whole_view_is_checked_first():
    """`fc(xs[0])[:, :]` needs 2 dims or more (require_rank_at_least): the check before any op tells the item's."""
    model = GemmThen(lambda m, xs, y: m.fc(xs[0])[:, :].relu()).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1, optimized.fxfuse_report
    assert _calls_of(optimized, require_broadcast_rank_at_least) == 1, optimized.code
    for inputs in (torch.randn(2, 3, IN), torch.randn(3, IN), _items((IN,)), _items((3, IN)), torch.randn(2, 3, 4, IN)):
        _eager_or_its_error(model, optimized, inputs)


def _inserted_first(xs, value):
    """`xs` after `xs.insert(0, value)`."""
    xs.insert(0, value)
    return xs


def _reversed_in_place(xs):
    """`xs` after `xs.reverse()`."""
    xs.reverse()
    return xs


@pytest.mark.parametrize("forward, inputs", [
    (lambda m, xs, y: m.fc(_inserted_first(xs, y)[0]).softmax(1), (_items((3, IN)), torch.randn(2, 3, IN))),
    (lambda m, xs, y: m.fc(_reversed_in_place(xs)[0]).softmax(1), (_items((3, IN), (2, 3, IN)), None)),
], ids=["insert", "reverse"])
def test_an_item_of_an_argument_that_a_method_may_change_is_not_fused(forward, inputs):
    """`xs.insert(0, y)` before `fc(xs[0])`: the check before any op read the item that was first at the call, and
    require_rank raised fxfuse's rank error where eager computes for the item that is first after the method."""
    model = GemmThen(forward).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 0, optimized.fxfuse_report
    assert_reason(optimized, "no check before the model's first op can tell the rank of `getitem`")
    with torch.no_grad():
        assert_close_report(optimized(*(list(t) if isinstance(t, list) else t for t in inputs)),
                            model(*(list(t) if isinstance(t, list) else t for t in inputs)))


def test_an_item_of_an_argument_that_a_method_may_change_is_not_fused_with_example_inputs():
    """With example inputs a list argument has no rank check but its item's, which read the item before `reverse()`."""
    model = GemmThen(lambda m, xs, y: m.fc(_reversed_in_place(xs)[0]).softmax(1)).eval()
    optimized = fxfuse.optimize(model, (_items((3, IN), (3, IN)),))
    assert fused_op_count(optimized) == 0, optimized.fxfuse_report
    items = _items((3, IN), (2, 3, IN))
    with torch.no_grad():
        assert_close_report(optimized(list(items)), model(list(items)))


class CountedItems(list):
    """A list whose indexing is code of its own: it counts its calls."""
    reads = 0

    def __getitem__(self, index):
        CountedItems.reads += 1
        return super().__getitem__(index)


def test_a_list_whose_indexing_is_its_own_code_is_indexed_once():
    """The check before any op read `xs[0]` of a list subclass with its own __getitem__, which the graph reads again:
    its code ran twice where eager runs it once. Such a list runs the model's own forward, which indexes it once."""
    model = ItemThenGroupNorm().eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1, optimized.fxfuse_report
    items = [torch.randn(4, IN), torch.randn(4, IN)]
    CountedItems.reads = 0
    with torch.no_grad():
        actual = optimized(CountedItems(items))
        assert CountedItems.reads == 1
        assert_close_report(actual, model(items))


def test_an_input_made_of_two_items_of_one_argument_is_not_fused():
    """`xs[0] + xs[1]`: each item's rank is of its own, no fixed amount off xs's: no check before any op tells the
    sum's, and one after the ops raised fxfuse's error where eager computes for another rank: group_norm is not
    fused."""
    model = GemmThen(lambda m, xs, y: F.group_norm(m.fc(xs[0] + xs[1]), 5)).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 0, optimized.fxfuse_report
    assert_reason(optimized, "no check before the model's first op can tell the rank of `add`")
    for inputs in (_items((4, IN), (4, IN)), _items((2, 5, IN), (2, 5, IN)), torch.randn(2, 4, IN)):
        _eager_or_its_error(model, optimized, inputs)


def test_an_input_made_by_rank_changes_fuses_in_bfloat16():
    """(float64 models do not fuse: match.SUPPORTED_DTYPES)"""
    model = GemmThen(lambda m, x, y: F.group_norm(m.fc(x.unsqueeze(0)), 4)).eval()
    optimized = _whole_chain_fused(model, (torch.randn(IN),), dtype=torch.bfloat16)
    _eager_or_its_error(model, optimized, torch.randn(4, IN, dtype=torch.bfloat16))


# ---------------------------------------------------------------- the GEMM's input: a join of a list argument

class ItemsJoined(list):
    """A list whose indexing and iteration are code of their own: torch.cat reads its items without them."""

    def __getitem__(self, index):
        raise AssertionError("indexed")

    def __iter__(self):
        raise AssertionError("iterated")


# (epilogue, a list argument it fuses for without example inputs, others: eager computes, or raises)
_X_JOINED_OF_A_LIST = [
    (lambda m, xs, y: m.fc(torch.cat(xs, 1)).softmax(1), _items((3, 20), (3, 4)),
     [_items((2, 3, IN), (2, 1, IN)), _items((2, 3, 20), (2, 3, 4)), _items((20,), (4,)), _items((3, IN)),
      _items((3, IN), (0,)), _items((0,), (3, IN)), _items((2, 3, 10), (2, 3, 14), kind=tuple),
      ItemsJoined(_items((2, 3, 20), (2, 3, 4))), ItemsJoined(_items((3, 20), (3, 4))), [],
      [torch.randn(3, 20), 1.0], torch.randn(3, IN), _items((3, 1), ())]),
    (lambda m, xs, y: F.group_norm(m.fc(torch.stack(xs)), 5), _items((IN,), (IN,)),
     [_items((3, IN), (3, IN)), _items((IN,)), _items((IN,), (3, IN)), ()]),
    (lambda m, xs, y: m.fc(torch.concat(tensors=xs, dim=-1).relu()).amax(1), _items((2, IN)),
     [_items((2, 2, IN)), _items((IN,))]),
]
_JOINED_OF_A_LIST_IDS = ["cat-softmax", "stack-group_norm", "concat-keywords-relu-amax"]


@pytest.mark.parametrize("forward, traced, others", _X_JOINED_OF_A_LIST, ids=_JOINED_OF_A_LIST_IDS)
@pytest.mark.parametrize("example_inputs", [False, True], ids=["no-example-inputs", "example-inputs"])
def test_an_input_joined_of_a_list_argument_is_checked_first(forward, traced, others, example_inputs):
    """`torch.cat(xs, 1)` of a list argument has its items' rank (the most dims of them: it skips 1-D empty ones),
    torch.stack one more: softmax(1) of fc of it holds for one rank, which the check before any op tells of the items
    the call passes. It was not fused, with example inputs too; a call of other items, or of anything eager's join
    raises for, gives eager's result or error."""
    model = GemmThen(forward).eval()
    optimized = fxfuse.optimize(model, (list(traced),) if example_inputs else None)
    assert fused_op_count(optimized) == 1 and not optimized.fxfuse_report.near_misses, optimized.fxfuse_report
    assert _calls_of(optimized, require_broadcast_rank) == 1, optimized.code
    for inputs in (traced, *others):
        _eager_or_its_error(model, optimized, inputs)


def _item_unsqueezed_in_place_then_joined(m, xs, y):
    xs[0].unsqueeze_(0)
    return m.fc(torch.cat(xs, 1)).softmax(1)


@pytest.mark.parametrize("forward", [
    lambda m, xs, y: m.fc(torch.cat(_inserted_first(xs, y), 1)).softmax(1),
    lambda m, xs, y: m.fc(torch.cat(xs + [y], 1)).softmax(1),
], ids=["insert", "list-plus"])
def test_a_join_of_a_list_argument_that_a_method_may_change_is_not_fused(forward):
    """`xs.insert(0, y)` before `torch.cat(xs, 1)`: the check before any op would read the items the call passed."""
    model = GemmThen(forward).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 0, optimized.fxfuse_report
    assert_reason(optimized, "no check before the model's first op can tell the rank of `cat`")
    xs, y = _items((2, 3, IN)), torch.randn(2, 1, IN)
    with torch.no_grad():
        assert_close_report(optimized(list(xs), y), model(list(xs), y))


def test_a_join_of_a_list_argument_whose_item_may_change_rank_in_place_is_not_fused():
    """`xs[0].unsqueeze_(0)` before `torch.cat(xs, 1)`: the check before any op would see the item's rank before it."""
    model = GemmThen(_item_unsqueezed_in_place_then_joined).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 0, optimized.fxfuse_report
    assert_reason(optimized, "in place (`unsqueeze_`, `out=`, a hooked module)")
    xs = _items((3, IN), (1, 2, IN))
    with torch.no_grad():
        assert_close_report(optimized([t.clone() for t in xs]), model([t.clone() for t in xs]))


# ---------------------------------------------------------------- the GEMM's input: squeeze, whose rank a size tells

# (epilogue, the shape of x it fuses for, inputs of other shapes: of another rank after the squeeze, or of the same)
_X_MADE_BY_SQUEEZE = [
    (lambda m, x, y: F.group_norm(m.fc(x.squeeze(0)), 5), (1, 4, IN),
     [(2, 4, IN), (2, 5, IN), (4, IN), (IN,), (1, 1, IN)]),
    (lambda m, x, y: m.fc(x.squeeze()).softmax(1), (1, 5, 1, IN), [(2, 5, 1, IN), (5, IN), (1, 1, IN), (1, 5, IN)]),
    (lambda m, x, y: m.fc(torch.squeeze(x, dim=0)).amax(1), (1, 5, IN), [(3, 5, IN), (5, IN)]),
    (lambda m, x, y: F.group_norm(m.fc(x.squeeze((0, 2))), 5), (1, 4, 1, IN), [(1, 4, 2, IN), (2, 4, 1, IN),
                                                                               (4, 1, 1, IN), (1, 4, IN), (4, IN)]),
    (lambda m, x, y: m.fc(x.squeeze(0, 2).relu()).softmax(1), (1, 5, 1, IN), [(2, 5, 1, IN), (1, 5, IN)]),
    (lambda m, x, y: m.fc(x.squeeze(-2).unsqueeze(0)).softmax(1), (1, IN), [(5, IN), (5, 1, IN), (IN,)]),
    (lambda m, x, y: F.group_norm(m.fc(x.squeeze(0).unsqueeze(1).flatten(1)), 5), (1, 4, IN),
     [(2, 4, IN), (4, IN)]),
    (lambda m, x, y: m.fc(x.relu().mul(2).contiguous().squeeze(0)).softmax(1), (1, 5, IN),
     [(2, 5, IN), (5, IN), (1, 1, IN)]),
    (lambda m, x, y: F.group_norm(m.fc(torch.squeeze(F.silu(x) - 1.5, 0)), 5), (1, 4, IN), [(2, 4, IN), (4, IN)]),
    (lambda m, x, y: F.group_norm(m.fc(x.unsqueeze(1).squeeze(0)), 5), (1, IN), [(4, IN), (1, 4, IN), (IN,)]),
    (lambda m, x, y: m.fc(x.squeeze(0).squeeze()).softmax(1), (1, 1, 5, IN),
     [(1, 2, 5, IN), (5, IN), (2, 1, IN), (1, 5, 1, IN), (IN,)]),
    (lambda m, x, y: m.fc(x.squeeze(0).relu().unsqueeze(0).squeeze((0, 1))).softmax(1), (1, 1, 5, IN),
     [(1, 2, 5, IN), (5, IN), (1, 5, IN), (IN,)]),
]
_SQUEEZE_IDS = ["squeeze-group_norm", "squeeze-all-softmax", "torch.squeeze-amax", "squeeze-dims-group_norm",
                "squeeze-varargs-relu-softmax", "squeeze-unsqueeze-softmax", "squeeze-unsqueeze-flatten-group_norm",
                "relu-mul-contiguous-squeeze-softmax", "silu-sub-squeeze-group_norm", "unsqueeze-squeeze-group_norm",
                "squeeze-squeeze-softmax", "squeeze-relu-unsqueeze-squeeze-softmax"]


@pytest.mark.parametrize("forward, shape, others", _X_MADE_BY_SQUEEZE, ids=_SQUEEZE_IDS)
def test_an_input_made_by_squeeze_is_checked_first_on_the_arguments_sizes(forward, shape, others):
    """`fc(x.squeeze(0))` is 2-D for a 3-D x whose dim 0 is of size 1, or for a 2-D x of any sizes: the check before
    any op computes the rank squeeze makes of x's sizes at each call. It was checked after the squeeze only
    (require_rank), which raised fxfuse's error where eager computes, or raises its own."""
    model = GemmThen(forward).eval()
    optimized = _whole_chain_fused(model, (torch.randn(shape),))
    assert _calls_of(optimized, require_broadcast_rank) == 1, optimized.code
    for other in others:
        _eager_or_its_error(model, optimized, torch.randn(other))


@pytest.mark.parametrize("forward, shape, others", _X_MADE_BY_SQUEEZE, ids=_SQUEEZE_IDS)
def test_an_input_made_by_squeeze_is_checked_first_with_example_inputs(forward, shape, others):
    """With example inputs the forward arguments' ranks were checked first: a squeeze of an argument of that rank
    but another size of 1 slipped through to require_rank, which raised fxfuse's error."""
    model = GemmThen(forward).eval()
    x = torch.randn(shape)
    optimized = fxfuse.optimize(model, (x,))
    assert fused_op_count(optimized) == 1, optimized.fxfuse_report
    assert _calls_of(optimized, require_broadcast_rank) == 1, optimized.code
    for other in (shape, *others):
        _eager_or_its_error(model, optimized, torch.randn(other))


@pytest.mark.parametrize("example_inputs", [None, (torch.randn(1, 4, IN),)], ids=["without", "with-example-inputs"])
def test_an_input_made_by_squeeze_gives_eagers_gradients_in_train_mode(example_inputs):
    model = GemmThen(lambda m, x, y: F.group_norm(m.fc(x.squeeze(0)), 5)).train()
    optimized = fxfuse.optimize(model, example_inputs)
    assert fused_op_count(optimized) == 1 and not optimized.fxfuse_report.near_misses, optimized.fxfuse_report
    for shape in ((1, 4, IN), (2, 5, IN), (4, IN)):
        assert_gradients_match(model, optimized, (torch.randn(shape),))


class SqueezeThenGroupNorm(nn.Module):
    """(a class of the module's own: pickle takes no lambda)"""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x):
        return F.group_norm(self.fc(x.squeeze(0)), 5)


def test_the_check_of_a_squeeze_survives_pickling():
    """The check's offset, ("squeeze", dims, more), is written in the graph's code, which unpickling traces again."""
    model = SqueezeThenGroupNorm().eval()
    restored = pickle.loads(pickle.dumps(fxfuse.optimize(model)))
    assert fused_op_count(restored) == 1 and _calls_of(restored, require_broadcast_rank) == 1, restored.code
    for shape in ((1, 4, IN), (2, 5, IN), (4, IN)):
        _eager_or_its_error(model, restored, torch.randn(shape))


def _minimum_with_a_row_then_add_a_row_param_in_place(m, x, y):
    h = torch.minimum(m.fc(x.squeeze()), y)
    h.add_(m.shift)  # (eager raises where h has fewer than 2 dims)
    return h


@pytest.mark.parametrize("example_inputs", [False, True], ids=["no-example-inputs", "example-inputs"])
def test_an_input_made_by_squeeze_of_too_few_dims_for_an_in_place_op_is_checked_first(example_inputs):
    """An in-place add of a (1, N) param needs a value of 2 dims or more, which x of 2 dims or more gives
    (require_rank_at_least); where x.squeeze() is 1-D (an x of (1, 1, K)), a forward argument y of more dims may
    still give the value its dims, and eager computes: the check of the squeeze's rank ran after it only, and raised
    fxfuse's error. It runs first, on x's sizes, and hands such a call to the model's own forward."""
    model = GemmThen(_minimum_with_a_row_then_add_a_row_param_in_place, shift=nn.Parameter(torch.randn(1, OUT)))
    examples = (torch.randn(3, 1, IN), torch.randn(3, 1, 1)) if example_inputs else None
    optimized = fxfuse.optimize(model.eval(), examples)
    assert fused_op_count(optimized) == 1, optimized.fxfuse_report
    for x_shape, y_shape in (((3, 1, IN), (3, 1, 1)), ((1, 1, IN), (1, 1, 1)), ((1, IN), (1, 1)), ((1, IN), (1,))):
        _eager_or_its_error(model, optimized, torch.randn(x_shape), torch.randn(y_shape))


@pytest.mark.parametrize("forward, shape", [
    (lambda m, x, y: F.group_norm(m.fc((x.transpose_(0, 1), x)[1].squeeze(0)), 5), (4, 1, IN)),
    (lambda m, x, y: F.group_norm(m.fc((x.contiguous().unsqueeze_(0), x)[1].squeeze(0)), 5), (4, IN)),
    (lambda m, x, y: F.group_norm(m.fc((x.resize_(1, 4, IN), x)[1].squeeze(0)), 5), (4, IN)),
    (lambda m, x, y: F.group_norm(m.fc((x.unsqueeze_(0), x.relu())[1].squeeze(0)), 5), (4, IN)),
], ids=["transpose_", "unsqueeze_-of-contiguous", "resize_", "unsqueeze_-then-relu"])
def test_squeeze_after_an_op_that_may_change_the_arguments_shape_in_place_is_not_fused(forward, shape):
    """A check before any op would see x's sizes before the in-place op (`x.contiguous()` is x itself where x is
    contiguous), and one after it would raise where eager computes for another rank (handing the call to the model's
    forward there would run the in-place op twice): group_norm is not fused."""
    model = GemmThen(forward).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 0, optimized.fxfuse_report
    assert_reason(optimized, "no check before the model's first op can tell the rank of `squeeze`")
    x = torch.randn(shape)
    with torch.no_grad():
        assert_close_report(optimized(x.clone()), model(x.clone()))


def _unsqueezed_in_place(value, through=lambda v: v):
    """`value`, after `through(value).unsqueeze_(0)`, which changes value's rank where `through` returns value."""
    through(value).unsqueeze_(0)
    return value


def _written_into(value, source):
    """`value`, after `torch.add(source, 1, out=value)`, which resizes value to source's shape."""
    torch.add(source, 1, out=value)
    return value


@pytest.mark.parametrize("forward, shapes", [
    (lambda m, x, y: m.fc(_unsqueezed_in_place(x)).softmax(1), ((3, IN), (1,))),
    (lambda m, x, y: m.fc(_unsqueezed_in_place(x.view(x.size(0), -1))).softmax(1), ((3, IN), (1,))),
    (lambda m, x, y: m.fc(_unsqueezed_in_place(x.flatten(1))).softmax(1), ((3, IN), (1,))),
    (lambda m, x, y: m.fc(_unsqueezed_in_place(x.relu(), lambda v: v.contiguous())).softmax(1), ((3, IN), (1,))),
    (lambda m, x, y: F.group_norm(m.fc(_unsqueezed_in_place(torch.cat([x, y], 0))), 5), ((3, IN), (2, IN))),
    (lambda m, x, y: m.fc(_written_into(x.view(-1, IN), y)).softmax(1), ((3, IN), (2, 3, IN))),
    (lambda m, x, y: m.fc(_unsqueezed_in_place(x.view(x.size(0), -1)).unsqueeze(0)).softmax(2), ((3, IN), (1,))),
    (lambda m, x, y: m.fc(torch.cat([_unsqueezed_in_place(x), _unsqueezed_in_place(y)], 1)).softmax(1),
     ((3, IN), (2, IN))),
    (lambda m, x, y: m.fc(_unsqueezed_in_place(x).relu()).softmax(1), ((3, IN), (1,))),
], ids=["argument-unsqueeze_", "view-unsqueeze_", "flatten-unsqueeze_", "relu-contiguous-unsqueeze_",
        "cat-unsqueeze_", "view-out=", "view-unsqueeze_-then-unsqueeze", "unsqueeze_-then-cat",
        "unsqueeze_-then-relu"])
@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_a_value_whose_rank_an_op_may_change_in_place_is_not_fused(forward, shapes):
    """The first checks tell x's rank as made (`x.view(b, -1)` is 2-D), but an op before the region may change it in
    place (`unsqueeze_`, `out=` resizes), or the rank of a value that a later op makes of it (`v.unsqueeze(0)`,
    `torch.cat([x, y], 1)`, `x.relu()`): the check there raised fxfuse's rank error where eager computes (softmax over
    dim 1 of a 3-D value). The program that holds for one rank is not fused."""
    model = GemmThen(forward).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 0, optimized.fxfuse_report
    assert_reason(optimized, "in place (`unsqueeze_`, `out=`, a hooked module): no check before the model's first op")
    inputs = tuple(torch.randn(shape) for shape in shapes)
    with torch.no_grad():
        assert_close_report(optimized(*(t.clone() for t in inputs)), model(*(t.clone() for t in inputs)))


def _after_unsqueezing_in_place(changed, value):
    """`value`, after `changed.unsqueeze_(0)`, which changes value's rank too where they are one tensor."""
    changed.unsqueeze_(0)
    return value


def _one_tensor_twice(value):
    """Forward arguments (x, y) that are one tensor, passed twice."""
    return value, value


def _a_list_of_one_tensor_and_it(value):
    """Forward arguments (xs, y): a list that holds y twice, and y."""
    return [value, value], value


# (forward, the arguments of a call of one tensor, its shape: y.unsqueeze_(0) changes x, or xs's items, too)
_ARGUMENTS_THAT_MAY_BE_ONE_TENSOR = [
    (lambda m, x, y: m.fc(_after_unsqueezing_in_place(y, x)).softmax(1), _one_tensor_twice, (3, IN)),
    (lambda m, x, y: m.fc(_after_unsqueezing_in_place(y, x).unsqueeze(0)).softmax(1), _one_tensor_twice, (IN,)),
    (lambda m, xs, y: m.fc(_after_unsqueezing_in_place(y, xs)[0]).softmax(1), _a_list_of_one_tensor_and_it, (3, IN)),
    (lambda m, xs, y: m.fc(torch.cat(_after_unsqueezing_in_place(y, xs), -1)).softmax(1), _a_list_of_one_tensor_and_it,
     (3, IN // 2)),
    (lambda m, xs, y: m.fc(torch.stack(_after_unsqueezing_in_place(y, xs))).softmax(1), _a_list_of_one_tensor_and_it,
     (IN,)),
]


@pytest.mark.parametrize("forward, arguments, shape", _ARGUMENTS_THAT_MAY_BE_ONE_TENSOR,
                         ids=["argument", "unsqueeze", "item", "cat-of-a-list", "stack-of-a-list"])
@pytest.mark.parametrize("example_inputs", [False, True], ids=["no-example-inputs", "example-inputs"])
def test_a_value_made_of_an_argument_that_may_be_one_changed_in_place_is_not_fused(forward, arguments, shape,
                                                                                   example_inputs):
    """`y.unsqueeze_(0)`, then softmax(1) of fc of what other forward arguments make (`x`, `xs[0]`, `torch.cat(xs)`):
    a call may pass y as x, or as xs's items, whose rank the op then changes too. The check before any op saw their
    rank before it, and the check where the region runs raised fxfuse's rank error where eager computes."""
    model = GemmThen(forward).eval()
    value = torch.randn(shape)
    optimized = fxfuse.optimize(model, arguments(value.clone()) if example_inputs else None)
    with torch.no_grad():
        assert_close_report(optimized(*arguments(value.clone())), model(*arguments(value.clone())))
    assert fused_op_count(optimized) == 0, optimized.fxfuse_report
    if not example_inputs:  # (example inputs of one tensor show some of these programs of another rank)
        assert_reason(optimized, "in place (`unsqueeze_`, `out=`, a hooked module): no check before the model's "
                                 "first op")


def _squeezed_in_place(value):
    """`value`, after `value.squeeze_(0)`, which drops its first dim where that is 1."""
    value.squeeze_(0)
    return value


class HookedThen(nn.Module):
    """`epilogue(m, x, y)`, where `m.pre` is an identity module with a hook: its output's rank is the hook's."""

    def __init__(self, epilogue):
        super().__init__()
        self.fc, self.pre, self.epilogue = nn.Linear(IN, OUT), nn.Identity(), epilogue
        self.pre.register_forward_hook(lambda module, inputs, output: None)

    def forward(self, x, y=None):
        return self.epilogue(self, x, y)


# (model, inputs: eager computes for some, raises IndexError for the others)
_WHOLE_VIEWS_OF_A_RANK_NOT_TOLD = [
    (GemmThen(lambda m, x, y: m.fc(_squeezed_in_place(x.view(x.size(0), -1)))[:, :].relu()),
     [(torch.randn(3, IN), None), (torch.randn(1, IN), None)]),
    (GemmThen(lambda m, x, y: (m.fc(_squeezed_in_place(x[:, :])) + y)[:, :].relu()),
     [(torch.randn(3, IN), torch.randn(3, OUT)), (torch.randn(1, IN), torch.randn(2, OUT)),
      (torch.randn(1, IN), torch.randn(OUT))]),
    (HookedThen(lambda m, x, y: m.fc(m.pre(x))[:, :].relu()), [(torch.randn(3, IN), None), (torch.randn(IN), None)]),
    (HookedThen(lambda m, x, y: (m.fc(m.pre(x)) + y)[:, :].relu()),
     [(torch.randn(3, IN), torch.randn(3, OUT)), (torch.randn(IN), torch.randn(2, OUT)),
      (torch.randn(IN), torch.randn(OUT))]),
]


@pytest.mark.parametrize("model, inputs", _WHOLE_VIEWS_OF_A_RANK_NOT_TOLD,
                         ids=["view-squeeze_", "slice-squeeze_-plus-argument", "hooked", "hooked-plus-argument"])
def test_a_whole_view_of_a_value_whose_rank_no_first_check_tells_gives_eagers_result_or_error(model, inputs):
    """`fc(v)[:, :]` needs v of 2 dims or more (require_rank_at_least), where `v.squeeze_(0)` or a hooked module may
    leave 1: no check before any op tells v's rank at a call, and the check where the region runs raised fxfuse's
    error where eager raises IndexError, or computes (`fc(v) + y` of a 2-D y has 2 dims). The whole view is left out
    of the region, and the near miss says why."""
    optimized = fxfuse.optimize(model.eval())
    assert_reason(optimized, "an input of 2 dims or more")
    for x, y in inputs:
        _eager_or_its_error(model, optimized, x.clone(), y)


def test_a_whole_view_of_a_value_whose_rank_no_first_check_tells_fuses_with_example_inputs():
    """With example inputs, the whole view of what a convolution makes fuses, and the arguments' example ranks are
    checked first, as for a program that holds for one rank (a call of others runs the model's forward)."""
    model = GemmThen(lambda m, x, y: (m.fc(m.pre(x)) + y)[:, :].relu(), pre=nn.Conv1d(3, 3, 1)).eval()
    optimized = fxfuse.optimize(model, (torch.randn(2, 3, IN), torch.randn(3, OUT)))
    assert fused_op_count(optimized) == 1 and not optimized.fxfuse_report.near_misses, optimized.fxfuse_report
    assert _calls_of(optimized, require_argument_rank) == 2, optimized.code
    for x, y in ((torch.randn(2, 3, IN), torch.randn(3, OUT)), (torch.randn(3, IN), torch.randn(OUT)),
                 (torch.randn(2, 3, IN), torch.randn(OUT)), (torch.randn(3, IN), torch.randn(2, 3, OUT))):
        _eager_or_its_error(model, optimized, x, y)


class HookedReaderAfter(nn.Module):
    """`softmax(fc(x), 1)`, then a hooked module given x, whose hook runs after the region."""

    def __init__(self):
        super().__init__()
        self.fc, self.side = nn.Linear(IN, OUT), nn.Linear(IN, OUT)
        self.side.register_forward_hook(lambda module, inputs, output: None)

    def forward(self, x):
        return self.fc(x).softmax(1) + self.side(x)


def test_an_op_that_may_change_the_rank_in_place_after_the_region_does_not_stop_it():
    """A hooked module may change x's rank in place, but it runs after the region: the first check still tells x's
    rank where the region reads it, and softmax(1) fuses."""
    model = HookedReaderAfter().eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1, optimized.fxfuse_report
    for shape in ((3, IN), (2, 3, IN)):
        _eager_or_its_error(model, optimized, torch.randn(shape))


@pytest.mark.parametrize("forward", [
    lambda m, x, y: F.group_norm(m.fc((x * m.fc.weight[0]).squeeze(0)), 5),
    lambda m, x, y: F.group_norm(m.fc((x + y).squeeze(0)), 5),
    lambda m, x, y: F.group_norm(m.fc(x.sum(0, keepdim=True).squeeze(0)), 5),
], ids=["times-a-module-tensor", "plus-an-argument", "sum"])
def test_squeeze_of_a_value_that_may_have_another_shape_than_an_argument_is_not_fused(forward):
    """`x * w` may broadcast x to more dims, `x + y` to y's, and a reduction drops sizes: the squeeze's input has
    no argument's sizes, no check before any op tells its rank, and one after it would raise where eager computes for
    another rank: group_norm is not fused."""
    model = GemmThen(forward).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 0, optimized.fxfuse_report
    assert_reason(optimized, "no check before the model's first op can tell the rank of `squeeze`")
    x, y = torch.randn(1, 4, IN), torch.randn(1, 4, IN)
    with torch.no_grad():
        assert_close_report(optimized(x, y), model(x, y))


# ---------------------------------------------------------------- an outside operand made of forward arguments

# (epilogue, extras of the model, inputs)
_OPERANDS_MADE_OF_ARGUMENTS = [
    (lambda m, x, y: torch.relu(m.gn(m.fc(x))) + x.sum(-1, keepdim=True).unsqueeze(0), (torch.randn(5, IN), None)),
    (lambda m, x, y: torch.relu(m.gn(m.fc(x))) + x.sum(-1, keepdim=True), (torch.randn(5, IN), None)),
    (lambda m, x, y: torch.relu(m.fc(x)) * y.unsqueeze(-1), (torch.randn(5, IN), torch.randn(5))),
    (lambda m, x, y: m.fc(x) + y.flatten(), (torch.randn(5, IN), torch.randn(5, 8))),
    (lambda m, x, y: m.fc(x) + (y * 2 + 1), (torch.randn(5, IN), torch.randn(OUT))),
    (lambda m, x, y: m.fc(x).sigmoid() - y.mean(0), (torch.randn(5, IN), torch.randn(3, OUT))),
]
_OPERAND_IDS = ["sum-unsqueeze", "sum-keepdim", "argument-unsqueeze", "argument-flatten", "pointwise-of-argument",
                "mean"]


@pytest.mark.parametrize("forward, inputs", _OPERANDS_MADE_OF_ARGUMENTS, ids=_OPERAND_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_an_operand_made_of_forward_arguments_fuses(forward, inputs, dtype):
    """explain() said "cannot prove that `unsqueeze` is a tensor without example inputs": a value that tensor ops make
    of forward arguments is a tensor where they are (a number where one is: number_as_tensor)."""
    model = GemmThen(forward, gn=nn.GroupNorm(4, OUT)).eval()
    _whole_chain_fused(model, inputs, dtype)


@pytest.mark.parametrize("forward, inputs", _OPERANDS_MADE_OF_ARGUMENTS, ids=_OPERAND_IDS)
def test_an_operand_made_of_forward_arguments_gives_eagers_gradients_in_train_mode(forward, inputs):
    model = GemmThen(forward, gn=nn.GroupNorm(4, OUT)).train()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1 and not optimized.fxfuse_report.near_misses, optimized.fxfuse_report
    assert_gradients_match(model, optimized, inputs)


@pytest.mark.parametrize("forward, others", [
    (_OPERANDS_MADE_OF_ARGUMENTS[0][0], [(torch.randn(2, 5, IN), None), (torch.randn(IN), None)]),
    (_OPERANDS_MADE_OF_ARGUMENTS[2][0], [(torch.randn(5, IN), torch.randn(2, 5)), (torch.randn(5, IN), 2.5),
                                         (torch.randn(5, IN), None), (torch.randn(5, IN), torch.arange(5))]),
    (_OPERANDS_MADE_OF_ARGUMENTS[4][0], [(torch.randn(5, IN), 2.5), (torch.randn(5, IN), 3),
                                         (torch.randn(5, IN), torch.randn(2, 1, OUT, dtype=torch.float64)),
                                         (torch.randn(5, IN), [1.0])]),
], ids=["sum-unsqueeze", "argument-unsqueeze", "pointwise-of-argument"])
def test_an_operand_made_of_forward_arguments_of_other_ranks_types_or_dtypes_gives_eagers_result(forward, others):
    model = GemmThen(forward, gn=nn.GroupNorm(4, OUT)).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1
    for inputs in others:
        _eager_or_its_error(model, optimized, *inputs)


@pytest.mark.parametrize("example_inputs", [False, True], ids=["no-example-inputs", "example-inputs"])
def test_a_number_that_an_identity_module_passes_on_gives_eagers_result(example_inputs):
    """nn.Identity returns what it is given, a number too (`h + self.skip(y)` of a float y): the fused op got the
    number itself as a param, and its schema raised where eager adds it (and its own error for None)."""
    model = GemmThen(lambda m, x, y: torch.relu(m.fc(x) + m.skip(y)), skip=nn.Identity()).eval()
    inputs = (torch.randn(5, IN), torch.randn(OUT))
    optimized = fxfuse.optimize(model, inputs if example_inputs else None)
    assert fused_op_count(optimized) == 1
    for y in (2.5, 3, torch.randn(OUT), torch.tensor(2.5, dtype=torch.float64), None):
        _eager_or_its_error(model, optimized, torch.randn(5, IN), y)


@pytest.mark.parametrize("forward", [
    lambda m, x, y: torch.relu(m.fc(x)) + y.squeeze(0),
    lambda m, x, y: torch.relu(m.fc(x)) + (y * 2).squeeze(0),
], ids=["of-the-argument", "of-a-pointwise-op-of-it"])
def test_an_operand_that_squeeze_makes_of_a_forward_argument_fuses(forward):
    """`y.squeeze(0)` is a tensor where y is: a near miss before ("cannot prove that `squeeze` is a tensor")."""
    model = GemmThen(forward).eval()
    optimized = _whole_chain_fused(model, (torch.randn(5, IN), torch.randn(1, OUT)))
    for y in (torch.randn(OUT), torch.randn(2, 5, OUT), torch.randn(1, 5, 1), torch.randn(3, OUT), 2.5, None):
        _eager_or_its_error(model, optimized, torch.randn(5, IN), y)


@pytest.mark.parametrize("forward, shape", [
    (lambda m, x, y: torch.relu(m.fc(x)) + (y * m.fc.bias).squeeze(0), (1, OUT)),
    (lambda m, x, y: torch.relu(m.fc(x)) + (y.t_(), y)[1].squeeze(0), (OUT, 1)),
], ids=["of-a-value", "after-an-in-place-op"])
def test_an_operand_that_squeeze_makes_of_no_argument_is_a_near_miss_that_says_why(forward, shape):
    model = GemmThen(forward).eval()
    optimized = fxfuse.optimize(model)
    assert_reason(optimized, "cannot prove that `squeeze` is a tensor without example inputs")
    assert_reason(optimized, "and a squeeze of an argument, or of pointwise ops of it and numbers, that no op before "
                             "it may change in place")
    x, y = torch.randn(5, IN), torch.randn(shape)
    with torch.no_grad():  # (y.t_() changes y: each gets its own)
        assert_close_report(optimized(x, y.clone()), model(x, y.clone()))


# ---------------------------------------------------------------- a forward argument scaled before the region reads it

_SCALED_ARGUMENTS = [
    (lambda m, x, y: torch.sub(torch.relu(m.fc(x)), y, alpha=2), lambda dtype: torch.randn(OUT, dtype=dtype)),
    (lambda m, x, y: m.fc(x).add(y, alpha=-0.5).tanh(), lambda dtype: torch.randn(5, 1, dtype=dtype)),
]


@pytest.mark.parametrize("forward, second", _SCALED_ARGUMENTS, ids=["sub", "add"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_forward_argument_scaled_by_alpha_fuses_with_a_dtype_check_first(forward, second, dtype):
    """`torch.sub(h, y, alpha=2)` is `mul($0,2.0)` of y, then the sub: where y is in the GEMM's dtype (checked before
    any op), as with example inputs. It was a near miss ("whose dtype is unknown")."""
    model = GemmThen(forward).eval()
    optimized = _whole_chain_fused(model, (torch.randn(5, IN), second(torch.float32)), dtype)
    assert _calls_of(optimized, require_argument_dtype) == 1, optimized.code


@pytest.mark.parametrize("forward, second", _SCALED_ARGUMENTS, ids=["sub", "add"])
def test_a_forward_argument_scaled_by_alpha_gives_eagers_gradients_in_train_mode(forward, second):
    model = GemmThen(forward).train()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1 and not optimized.fxfuse_report.near_misses, optimized.fxfuse_report
    assert_gradients_match(model, optimized, (torch.randn(5, IN), second(torch.float32)))


@pytest.mark.parametrize("second", [torch.arange(OUT), torch.randn(OUT, dtype=torch.float64),
                                    torch.randn(OUT, dtype=torch.float16), torch.tensor([True] * OUT), 3, 2.5, None,
                                    torch.randn(2, 5, OUT)],
                         ids=["int64", "float64", "float16", "bool", "int", "float", "None", "3-D"])
def test_a_forward_argument_scaled_by_alpha_of_another_dtype_gives_eagers_result(second):
    """An integer y scaled first would become float32 where eager keeps it; eager raises for a bool one, and rounds a
    number to the value's dtype first: the optimized model runs the model's own forward for them."""
    model = GemmThen(_SCALED_ARGUMENTS[0][0]).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1
    _eager_or_its_error(model, optimized, torch.randn(5, IN), second)


def test_two_forward_arguments_of_addcmul_get_a_dtype_check_each():
    """addcmul's `value * tensor1 * tensor2` reads two forward arguments before the region's value."""
    model = GemmThenTwoArguments(lambda h, a, b: torch.addcmul(h, a, b, value=0.5)).eval()
    optimized = _whole_chain_fused(model, (torch.randn(5, IN), torch.randn(OUT), torch.randn(5, 1)))
    assert _calls_of(optimized, require_argument_dtype) == 2, optimized.code
    x = torch.randn(5, IN)
    for a, b in ((torch.randn(OUT), torch.arange(5).view(5, 1)), (torch.arange(OUT), torch.arange(5).view(5, 1)),
                 (torch.randn(OUT, dtype=torch.float64), torch.randn(5, 1)), (2, torch.randn(5, 1))):
        _eager_or_its_error(model, optimized, x, a, b)


def test_an_operand_made_inside_the_graph_and_scaled_by_alpha_is_a_near_miss_that_says_why():
    """`y * 2` may be of any dtype (an integer y times a float is float32): only a forward argument's dtype is
    checked before any op."""
    model = GemmThen(lambda m, x, y: torch.sub(m.fc(x), y * 2, alpha=2)).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 0
    assert_reason(optimized, "computes mul of `mul`, whose dtype is unknown, before it reads the region's value")
    _eager_or_its_error(model, optimized, torch.randn(5, IN), torch.arange(OUT))


# ---------------------------------------------------------------- on the GPU: the kernels take these programs

_ON_THE_GPU = ([(forward, (torch.randn(shape),)) for forward, shape, _ in _X_MADE_BY_RANK_CHANGES] +
               [(forward, tuple(t for t in inputs if t is not None))
                for forward, inputs in _OPERANDS_MADE_OF_ARGUMENTS] +
               [(forward, (torch.randn(5, IN), second(torch.float32))) for forward, second in _SCALED_ARGUMENTS])
_ON_THE_GPU_IDS = _X_IDS + _OPERAND_IDS + ["sub-alpha", "add-alpha"]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("forward, inputs", _ON_THE_GPU, ids=_ON_THE_GPU_IDS)
def test_the_programs_these_checks_allow_run_on_the_kernels(forward, inputs, dtype, caplog):
    """The operands made of forward arguments reach the kernels as params of their own shapes (`(1, 5, 1)` after an
    unsqueeze broadcasts the output to 3-D): forward and backward run there, not the reference, and the forward
    comes within the dtype's bound of float64 (test_cuda_backend's Judge; the CPU tests above check the gradients)."""
    from test_cuda_backend import Judge

    # (groups of 8 of the 40 features: the backward kernel takes groups on its lanes' grid only, else the reference)
    model = GemmThen(forward, gn=nn.GroupNorm(5, OUT)).to("cuda", dtype).train()
    inputs = [t.to("cuda", dtype) for t in inputs]
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1 and not optimized.fxfuse_report.near_misses, optimized.fxfuse_report
    with caplog.at_level("DEBUG", logger="fxfuse"):
        out = optimized(*inputs)
        out.float().square().sum().backward()
    fallbacks = [r.getMessage() for r in caplog.records if "runs the reference" in r.getMessage()]
    assert not fallbacks, fallbacks
    Judge(model, dtype).check(out.detach(), inputs, "forward")


# ---------------------------------------------------------------- a NumPy array where a fused op takes a param

_READS_AN_ARGUMENT = {
    "h + y": lambda m, x, y: torch.relu(m.fc(x) + y),
    "y * h": lambda m, x, y: torch.relu(y * m.fc(x)),
    "torch.add(h, y)": lambda m, x, y: torch.relu(torch.add(m.fc(x), y)),
    "h.add(y)": lambda m, x, y: torch.relu(m.fc(x).add(y)),
    "h + (y * 2 + 1)": lambda m, x, y: torch.relu(m.fc(x) + (y * 2 + 1)),
}


def _result_or_error(model, *inputs):
    try:
        return model(*inputs), None
    except Exception as error:
        return None, error


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("examples", [True, False], ids=["examples", "no-examples"])
@pytest.mark.parametrize("spelling", sorted(_READS_AN_ARGUMENT))
@pytest.mark.parametrize("array", ["2-D", "1-D", "0-d"])
def test_a_numpy_array_where_the_fused_op_takes_a_param_gives_eagers_result_or_error(array, spelling, examples, grad):
    """The fused op took the array as a param, and its schema raised ("Expected a value of type 'List[Tensor]'"): eager
    computes `h + array` through NumPy where nothing requires grad (NumPy's dtype: a 0-d float64 array makes the result
    float64), raises its own RuntimeError where h requires grad, and torch.add its TypeError. An array is no tensor and
    no number (a 0-d one neither: NumPy's scalars are): the optimized model runs its model's own forward for it."""
    np = pytest.importorskip("numpy")
    model = GemmThen(_READS_AN_ARGUMENT[spelling]).eval()
    x = torch.randn(5, IN)
    optimized = fxfuse.optimize(model, (x, torch.randn(5, OUT)) if examples else None)
    assert fused_op_count(optimized) == 1, optimized.fxfuse_report
    y = {"2-D": np.random.randn(5, OUT).astype(np.float32), "1-D": np.random.randn(OUT).astype(np.float32),
         "0-d": np.array(2.0)}[array]
    with torch.set_grad_enabled(grad):
        expected, eager_error = _result_or_error(model, x, y.copy())
        actual, error = _result_or_error(optimized, x, y.copy())
    if eager_error is not None:
        assert (type(error), str(error)) == (type(eager_error), str(eager_error))
    else:
        assert error is None, error
        assert_close_report(actual, expected)
