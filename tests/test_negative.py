"""Chains that must not fuse, or must fuse only their legal part, and the precise reason explain() gives.

Every test also checks that the optimized model still computes what eager computes.
"""
import copy
import logging
import pickle
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from epilogue_models import (BATCH, IN, OUT, GemmThen, GemmThenTwoArguments, assert_reason, assert_whole_chain_fused,
                             fused_programs, leftover_compute, reasons)
from fxfuse.testing import assert_close_report, assert_fuses, assert_gradients_match, assert_not_fused, fused_op_count


def rows(batch=BATCH, features=IN, dtype=torch.float32):
    return torch.randn(batch, features, dtype=dtype)


# ---------------------------------------------------------------- values that leave the region


class SharedIntermediate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.out_proj = nn.Linear(OUT, OUT)
        self.b = nn.Parameter(torch.randn(OUT))

    def forward(self, x):
        h = self.fc(x)
        shifted = h + self.b
        shifted = shifted + 1.0
        return torch.relu(shifted) + self.out_proj(shifted)


def test_intermediate_used_outside_the_region_ends_the_region_before_it():
    optimized = assert_fuses(SharedIntermediate(), (rows(),), regions=2)
    assert_reason(optimized, "intermediate `add_1` is also used by `out_proj`")
    first, second = optimized.fxfuse_report.fused
    assert first.replaced == ["fc", "add", "add_1"], first
    assert "relu" not in first.program


def test_intermediate_used_by_the_graph_output_is_not_fused_past():
    model = GemmThen(lambda m, x, y: (lambda h: (torch.relu(h), h))(m.fc(x) * 2.0))
    optimized = assert_fuses(model, (rows(),), regions=1)
    assert fused_programs(optimized) == ["mul(%0,2.0)"]
    assert_reason(optimized, "intermediate `mul` is also used by `output`")


def test_two_branches_returned_separately_would_be_two_outputs():
    model = GemmThen(lambda m, x, y: (lambda h: (torch.relu(h), torch.sigmoid(h)))(m.fc(x)))
    assert_not_fused(model, (rows(),), reason="intermediate `relu` is also used by `output`")


def test_branches_that_meet_again_fuse():
    model = GemmThen(lambda m, x, y: (lambda h: torch.relu(h) + torch.sigmoid(h) * h.amax(-1, keepdim=True))(m.fc(x)))
    optimized = assert_whole_chain_fused(model, (rows(),))
    assert fused_programs(optimized) == ["relu(%0);sigmoid(%0);amax(%0,-1,True);mul(%2,%3);add(%1,%4)"]


def test_idiom_whose_interior_is_used_elsewhere_is_not_that_op():
    """In `x * sigmoid(x)` with sigmoid(x) also returned, there is no silu: the sigmoid must stay visible."""
    model = GemmThen(lambda m, x, y: (lambda h, s: (h * s, s))(*(lambda h: (h, torch.sigmoid(h)))(m.fc(x))))
    # Nor is any region legal: each prefix of fc -> sigmoid -> mul has two values used outside it.
    assert_not_fused(model, (rows(),), reason="intermediate `sigmoid` is also used by `output`")


# ---------------------------------------------------------------- cycles


class SecondOperandFromTheRegion(nn.Module):
    """relu(fc(x)) + fc2(relu(fc(x))): the add's second operand depends on the region's own output."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.fc2 = nn.Linear(OUT, OUT)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return h + self.fc2(h)


def test_operand_depending_on_the_region_through_another_path_is_a_cycle():
    optimized = assert_fuses(SecondOperandFromTheRegion(), (rows(),), regions=2)
    assert_reason(optimized, "depends on the region's own output through")
    first, second = optimized.fxfuse_report.fused
    assert first.program == "relu(%0)"
    assert second.program == "add($0,%0)", "fc2's region takes the first region's output as an operand"


class GateFromTheRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.gate = nn.Linear(OUT, OUT)

    def forward(self, x):
        h = self.fc(x)
        return h * torch.sigmoid(self.gate(h))


def test_gate_computed_from_the_gemm_output_fuses_into_the_gate_gemm_only():
    optimized = assert_fuses(GateFromTheRegion(), (rows(),), regions=1)
    assert fused_programs(optimized) == ["sigmoid(%0);mul($0,%1)"]
    assert_reason(optimized, "operand `sigmoid` depends on the region's own output through `gate`")
    assert leftover_compute(optimized) == ["fc (call_module fc)"]


# ---------------------------------------------------------------- norms and reductions that are not row-local


def test_group_count_that_does_not_divide_the_features():
    model = GemmThen(lambda m, x, y: F.group_norm(m.fc(x), 3))
    report = fxfuse.explain(model)
    assert_reason(report, f"group_norm: {OUT} channels not divisible by 3 groups")
    assert fused_op_count(fxfuse.optimize(model)) == 0


def test_group_count_reason_with_1000_channels():
    model = GemmThen(lambda m, x, y: F.group_norm(m.fc(x), 3), out_features=1000)
    assert_reason(fxfuse.explain(model, (rows(),)), "group_norm: 1000 channels not divisible by 3 groups")


def test_group_norm_before_the_divisible_part_still_fuses_what_precedes_it():
    model = GemmThen(lambda m, x, y: F.group_norm(torch.relu(m.fc(x)), 3))
    optimized = fxfuse.optimize(model)
    assert fused_programs(optimized) == ["relu(%0)"]
    assert_reason(optimized, "not divisible by 3 groups")


def test_train_mode_batch_norm_is_not_fused_and_explain_says_why():
    model = GemmThen(lambda m, x, y: m.norm(m.fc(x)), norm=nn.BatchNorm1d(OUT)).train()
    optimized = assert_not_fused(model, (rows(),), reason="train-mode batch_norm normalizes over the batch")
    assert optimized.norm.num_batches_tracked.item() == 2, "one eager run, one optimized run, none while optimizing"


def test_optimize_with_example_inputs_leaves_the_model_state_alone():
    model = GemmThen(lambda m, x, y: torch.relu(m.norm(m.fc(x))), norm=nn.BatchNorm1d(OUT)).train()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    fxfuse.optimize(model, (rows(),))
    fxfuse.explain(model, (rows(),))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} changed while optimizing"


NOT_ROW_LOCAL = {
    "sum-over-batch": (lambda m, x, y: m.fc(x).sum(0), "sum over dim 0 of a 2-D value, not the features (dim 1)"),
    "mean-over-rows-of-3-D": (lambda m, x, y: m.fc(x).mean(dim=1), "mean over dim 1 of a 3-D value"),
    "softmax-over-batch": (lambda m, x, y: F.softmax(m.fc(x), dim=0), "softmax over dim 0"),
    "log_softmax-over-dim-1-of-3-D": (lambda m, x, y: torch.log_softmax(m.fc(x), 1), "log_softmax over dim 1"),
    "amax-over-all": (lambda m, x, y: m.fc(x).amax(), "amax over all dims"),
    "sum-of-everything": (lambda m, x, y: m.fc(x).sum(), "sum without a dim reduces the whole tensor"),
    "max-over-batch": (lambda m, x, y: torch.max(m.fc(x), 0)[0], "max_dim over dim 0"),
    "logsumexp-two-dims": (lambda m, x, y: torch.logsumexp(m.fc(x), (0, 1)), "logsumexp over 2 dims"),
    "layer_norm-two-dims": (lambda m, x, y: F.layer_norm(m.fc(x), (5, OUT)), "layer_norm over 2 dims"),
    "group_norm-on-3-D": (lambda m, x, y: F.group_norm(m.fc(x), 5), "group_norm on a 3-D output"),
    "softmax-with-dtype": (lambda m, x, y: F.softmax(m.fc(x), -1, dtype=torch.float64), "softmax with dtype"),
    "sum-with-dtype": (lambda m, x, y: m.fc(x).sum(-1, dtype=torch.float64), "sum with dtype"),
    # dtype= of the value's own dtype is a no-op as traced, but pins the result under autocast (MoE routers' fp32
    # softmax): refused, by keyword and by position where torch.* takes it
    "softmax-own-dtype": (lambda m, x, y: F.softmax(m.fc(x), -1, dtype=torch.float32), "pins its result's dtype"),
    "torch.softmax-own-dtype-positional": (lambda m, x, y: torch.softmax(m.fc(x), -1, torch.float32),
                                           "softmax with dtype=float32 pins"),
    "log_softmax-own-dtype": (lambda m, x, y: m.fc(x).log_softmax(-1, torch.float32), "log_softmax with dtype"),
    "sum-own-dtype": (lambda m, x, y: m.fc(x).sum(-1, dtype=torch.float32), "sum with dtype=float32 pins"),
    # softmin is softmax of the negated value: its dtype= is softmax's
    "softmin-with-dtype": (lambda m, x, y: F.softmin(m.fc(x), -1, dtype=torch.float64),
                           "softmax with dtype=float64 makes its float32 value float64"),
    "softmin-own-dtype": (lambda m, x, y: F.softmin(m.fc(x), 1, dtype=torch.float32), "pins its result's dtype"),
    "softmin-over-batch": (lambda m, x, y: F.softmin(m.fc(x), dim=0), "softmax over dim 0"),
}
THREE_D = {"mean-over-rows-of-3-D", "log_softmax-over-dim-1-of-3-D", "layer_norm-two-dims", "group_norm-on-3-D"}


@pytest.mark.parametrize("name", list(NOT_ROW_LOCAL))
def test_norm_or_reduction_that_is_not_over_the_features(name):
    epilogue, reason = NOT_ROW_LOCAL[name]
    x = torch.randn(2, 5, IN) if name in THREE_D else rows()
    assert_not_fused(GemmThen(epilogue), (x,), reason=reason)


@pytest.mark.parametrize("epilogue", [lambda m, x, y: m.fc(x).sum(0), lambda m, x, y: F.softmax(m.fc(x), 0),
                                      lambda m, x, y: torch.amax(m.fc(x), -2)], ids=["sum", "softmax", "amax"])
def test_reduction_over_a_leading_dim_without_example_inputs(epilogue):
    """Without shapes the rank is unknown, but dim 0 (or -2) is never the last dim of a GEMM output."""
    optimized = fxfuse.optimize(GemmThen(epilogue))
    assert fused_op_count(optimized) == 0
    assert_reason(optimized, "which is never the features of a GEMM output")


def test_norm_of_a_reduced_value_fuses_only_the_reduction():
    model = GemmThen(lambda m, x, y: F.layer_norm(m.fc(x).sum(-1, keepdim=True), (1,)))
    optimized = assert_fuses(model, (rows(),), regions=1)
    assert fused_programs(optimized) == ["sum(%0,-1,True)"]
    assert_reason(optimized, "layer_norm of `sum_1` works on an already reduced value")


def test_a_reduction_of_a_reduced_value_without_keepdim_is_not_fused():
    """The steps that stand for it keep the dim, which eager's result drops."""
    model = GemmThen(lambda m, x, y: m.fc(x).amax(-1, keepdim=True).sum(-1))
    optimized = assert_fuses(model, (rows(),), regions=1)
    assert fused_programs(optimized) == ["amax(%0,-1,True)"]
    assert_reason(optimized, "sum with keepdim=False of `amax` works on an already reduced value")


@pytest.mark.parametrize("example_inputs", [True, False], ids=["shapes", "no-shapes"])
@pytest.mark.parametrize("epilogue, program", [
    (lambda m, x, y: (m.fc(x).amax(-1, keepdim=True) + m.shift).sum(-1, keepdim=True),  # (B, 1) + (N,): full rows
     "amax(%0,-1,True);add(%1,$0)"),
    (lambda m, x, y: (m.fc(x).amax(-1, keepdim=True) * y).softmax(-1),  # y's shape unknown without example inputs
     "amax(%0,-1,True);mul(%1,$0)"),
], ids=["plus-a-row-param", "times-a-graph-input"])
def test_a_reduced_value_broadcast_back_to_full_rows_is_not_one_feature(epilogue, program, example_inputs):
    model = GemmThen(epilogue, shift=nn.Parameter(torch.randn(OUT)))
    inputs = (rows(), torch.randn(BATCH, OUT))
    optimized = fxfuse.optimize(model, inputs if example_inputs else None)
    assert fused_programs(optimized) == [program]
    assert_reason(optimized, "works on an already reduced value")
    torch.testing.assert_close(optimized(*inputs), model(*inputs))


@pytest.mark.parametrize("epilogue", [
    lambda m, x, y: (m.fc(x).sum(-1, keepdim=True) + y).softmax(-1),
    lambda m, x, y: (lambda r: r - r.mean(-1, keepdim=True))(m.fc(x).amax(-1, keepdim=True) * y),
], ids=["softmax", "minus-its-mean"])
def test_a_reduced_value_beside_a_forward_argument_of_one_feature_in_the_example_inputs_is_not_one_feature(epilogue):
    """The example y of one column proved the value one feature wide for that y only: a later y of more columns
    widens it, and the pointwise steps that stand for softmax or mean over one value gave other values than eager's
    (a silent wrong result)."""
    model = GemmThen(epilogue).eval()
    optimized = fxfuse.optimize(model, (rows(), torch.randn(BATCH, 1)))
    assert_reason(optimized, "works on an already reduced value")
    x, wider = rows(), torch.randn(BATCH, 5)
    assert_close_report(optimized(x, wider), model(x, wider))


@pytest.mark.parametrize("epilogue", [lambda m, x, y: torch.relu(m.fc(x)).detach(),
                                      lambda m, x, y: m.fc(x).detach() * 2 + m.shift],
                         ids=["detached-result", "detached-then-a-param"])
def test_a_result_that_depends_on_the_gemm_only_through_detach_is_not_fused_with_it(epilogue):
    """Eager gives the GEMM's weight no gradient there (None, not zeros), and a result of no param needs none."""
    model = GemmThen(epilogue, shift=nn.Parameter(torch.randn(OUT)))
    optimized = fxfuse.optimize(model.train(), (rows(),))
    assert_reason(optimized, "depends on the GEMM only through detach, so eager gives the GEMM no gradient")
    assert all("detach" not in program for program in fused_programs(optimized))
    x = rows()
    assert optimized(x).requires_grad == model(x).requires_grad
    if model(x).requires_grad:
        assert_gradients_match(model, optimized, (x,))


@pytest.mark.parametrize("example_inputs", [True, False], ids=["shapes", "no-shapes"])
@pytest.mark.parametrize("epilogue", [lambda m, x, y: torch.maximum(m.fc(x), y),
                                      lambda m, x, y: torch.minimum(y, m.fc(x)), lambda m, x, y: F.prelu(m.fc(x), y),
                                      lambda m, x, y: torch.hypot(m.fc(x), y),
                                      lambda m, x, y: torch.copysign(y, m.fc(x))],
                         ids=["maximum", "minimum-first", "prelu", "hypot", "copysign-magnitude"])
def test_a_number_where_the_op_takes_a_tensor_only_raises_eagers_error(epilogue, example_inputs):
    """A forward argument passed as a number becomes a 0-d tensor for the fused op (number_as_tensor); torch.maximum's
    operands and prelu's slopes take no number, and eager raises there."""
    model = GemmThen(epilogue)
    optimized = fxfuse.optimize(model, (rows(), torch.rand(OUT)) if example_inputs else None)
    assert fused_op_count(optimized) == 1
    with pytest.raises(TypeError) as eager:
        model(rows(), 0.5)
    with pytest.raises(TypeError, match=re.escape(str(eager.value))):
        optimized(rows(), 0.5)


@pytest.mark.parametrize("example_inputs", [True, False], ids=["shapes", "no-shapes"])
def test_a_number_for_copysigns_sign_computes_as_eager(example_inputs):
    """copysign takes a number for its sign (its second operand), not for its magnitude (above)."""
    model = GemmThen(lambda m, x, y: torch.copysign(m.fc(x), y))
    optimized = fxfuse.optimize(model, (rows(), torch.rand(OUT)) if example_inputs else None)
    assert fused_op_count(optimized) == 1
    x = rows()
    torch.testing.assert_close(optimized(x, -0.5), model(x, -0.5), rtol=0, atol=0)


def test_min_whose_indices_are_used_too():
    model = GemmThen(lambda m, x, y: (lambda r: r[0] + r[1])(torch.min(m.fc(x), 1)))
    assert_not_fused(model, (rows(),), reason="the indices of `min_1` are used too")


@pytest.mark.parametrize("reads", [lambda r: r[0] + r.values, lambda r: r[0] * r[0] - r[0]],
                         ids=["[0] and .values", "[0] three times"])
def test_max_whose_values_are_read_twice_fuses(reads):
    """fx makes a node for each read of the values, all one tensor: they were refused as 'read twice'."""
    model = GemmThen(lambda m, x, y: reads(torch.max(m.fc(x), 1)))
    optimized = assert_fuses(model, (rows(),), regions=1)
    assert fused_programs(optimized)[0].startswith("max_dim(%0,1,False);")
    assert_fuses(model, (rows(),), regions=1, example_inputs=False)


class MaxWithIndicesReadLate(nn.Module):
    """`r[1]` as a statement of its own, after what reads the values: fx records it there, and nothing reads it."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x):
        r = torch.max(self.fc(x), 1)
        y = r[0].cumsum(0)
        r[1]
        return y


def test_max_whose_unread_indices_come_after_the_values_readers_fuses():
    """The fused op went after the unread `[1]`, behind the cumsum that reads it: fx's lint failed, left unfused."""
    optimized = assert_fuses(MaxWithIndicesReadLate(), (rows(),), regions=1)
    assert fused_programs(optimized) == ["max_dim(%0,1,False)"]
    assert not optimized.fxfuse_report.skipped


def test_max_whose_values_alias_an_in_place_change_is_not_fused_past():
    """`r[0]` read again after `r[0].add_(1)` is the changed tensor."""
    model = GemmThen(lambda m, x, y: (lambda r: (r[0].add_(1), r[0] * 2)[1])(torch.max(m.fc(x), 1)))
    optimized = assert_fuses(model, (rows(),), regions=0)
    assert_reason(optimized, "which `getitem_1` aliases")


@pytest.mark.parametrize("operand, promotes", [
    (torch.tensor(2, dtype=torch.int64), False),          # a 0-d tensor of another kind promotes nothing
    (torch.tensor(2.0, dtype=torch.float64), False),
    (torch.ones(OUT, dtype=torch.bool), False),
    (torch.ones(OUT, dtype=torch.float64), True),         # a float64 vector makes the result float64
], ids=["int64 0-d", "float64 0-d", "bool vector", "float64 vector"])
def test_an_operand_of_another_dtype_says_whether_eager_promotes(operand, promotes):
    """explain() said every such operand would promote the result."""
    model = GemmThen(lambda m, x, y: m.fc(x) * m.s, s=operand)
    optimized = assert_not_fused(model, (rows(),))
    effect = "eager would promote the result" if promotes else "the fused op takes params in the GEMM's dtype only"
    assert_reason(optimized, f"while the GEMM is float32 ({effect})")


@pytest.mark.parametrize("with_examples", [True, False], ids=["example-inputs", "no-example-inputs"])
@pytest.mark.parametrize("slopes_dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("model", [
    lambda dtype: GemmThen(lambda m, x, y: F.prelu(m.fc(x), m.w), w=nn.Parameter(torch.rand(OUT, dtype=dtype))),
    lambda dtype: GemmThen(lambda m, x, y: m.act(m.fc(x)), act=nn.PReLU(OUT).to(dtype)),
], ids=["F.prelu", "nn.PReLU"])
def test_prelus_slopes_of_another_dtype_say_eager_raises(model, slopes_dtype, with_examples):
    """eager's prelu raises for slopes of another dtype ('Type promoting not supported'): explain() says so (it said
    eager would promote the result, then that the fused op takes params in the GEMM's dtype only), and the optimized
    model raises eager's error."""
    model = model(slopes_dtype).eval()
    optimized = fxfuse.optimize(model, (rows(),) if with_examples else None)
    assert fused_op_count(optimized) == 0
    assert_reason(optimized, f"is {str(slopes_dtype).removeprefix('torch.')} while the GEMM is float32 (eager's prelu "
                             "raises for a tensor of another dtype)")
    x = rows()
    with pytest.raises(RuntimeError, match=re.escape(str(_raised_by(model, x)))):
        optimized(x)


def test_an_in_place_operand_of_another_dtype_does_not_say_eager_promotes():
    """`h += self.s` with a float64 vector keeps `h` float32 in eager: explain() said eager would promote it."""
    model = GemmThen(lambda m, x, y: torch.relu(m.fc(x).add_(m.s)), s=torch.ones(OUT, dtype=torch.float64))
    optimized = assert_not_fused(model, (rows(),))
    assert_reason(optimized, "while the GEMM is float32 (the fused op takes params in the GEMM's dtype only)")
    with torch.no_grad():
        assert optimized(rows()).dtype == model(rows()).dtype == torch.float32


# ---------------------------------------------------------------- dtypes


def test_float64_is_not_supported():
    model = GemmThen(lambda m, x, y: torch.relu(m.fc(x))).double()
    assert_not_fused(model, (rows(dtype=torch.float64),), reason="float64 is not supported")


def test_operand_of_another_dtype_would_promote_the_result():
    model = GemmThen(lambda m, x, y: torch.relu(m.fc(x)) + y)
    optimized = assert_fuses(model, (rows(), torch.randn(BATCH, OUT, dtype=torch.float64)), regions=1)
    assert fused_programs(optimized) == ["relu(%0)"]
    assert_reason(optimized, "operand `y` is float64 while the GEMM is float32")


def test_input_of_another_dtype_than_the_weight():
    model = GemmThen(lambda m, x, y: torch.relu(F.linear(x, m.w)), w=torch.randn(OUT, IN, dtype=torch.float64))
    assert_not_fused(model, (rows(dtype=torch.float64),), reason="float64 is not supported")


# ---------------------------------------------------------------- randomness and mutation


def test_train_mode_dropout_is_not_fused():
    model = GemmThen(lambda m, x, y: torch.relu(m.drop(m.fc(x))), drop=nn.Dropout(0.5)).train()
    report = fxfuse.explain(model, (rows(),))
    assert_reason(report, "dropout(p=0.5) in training mode is random")
    assert not report.fused


def test_train_mode_dropout_with_p_1_is_not_fused_and_matches():
    """p=1 zeroes everything, so eager and optimized can be compared exactly."""
    model = GemmThen(lambda m, x, y: torch.relu(F.dropout(m.fc(x), p=1.0, training=True)))
    assert_not_fused(model, (rows(),), reason="in training mode is random")


def test_in_place_op_on_a_tensor_outside_the_region_is_not_fused():
    model = GemmThen(lambda m, x, y: y.add_(m.fc(x)))
    x, y = rows(), torch.randn(BATCH, OUT)
    expected_y = y.clone()
    with torch.no_grad():
        expected = model(x, expected_y)
    optimized = fxfuse.optimize(model, (x, y.clone()))
    assert fused_op_count(optimized) == 0
    assert_reason(optimized, "in-place `add_` mutates `y`, which is outside the region")
    with torch.no_grad():
        actual = optimized(x, y)
    assert_close_report(actual, expected)
    assert_close_report(y, expected_y, what="the mutated input")


def mutate_operand_between_region_ops(m, x, y):
    scaled = m.fc(x) * y
    y.mul_(2.0)
    return scaled + y


def fill_operand_between_region_ops(m, x, y):
    scaled = m.fc(x) * y
    y.fill_(3.0)  # an in-place op outside the vocabulary
    return torch.relu(scaled)


@pytest.mark.parametrize("epilogue", [mutate_operand_between_region_ops, fill_operand_between_region_ops])
def test_in_place_change_of_an_operand_between_region_ops_is_not_fused(epilogue):
    """Fusing would move the read of `y` after its change: eager read it unchanged."""
    model = GemmThen(epilogue)
    x, y = rows(), torch.randn(BATCH, OUT)
    with torch.no_grad():
        expected = model(x, y.clone())
        optimized = fxfuse.optimize(model, (x, y.clone()))
        actual = optimized(x, y.clone())
    assert fused_op_count(optimized) == 0
    assert_reason(optimized, "changes `y` between the region's ops, which read it")
    assert_close_report(actual, expected)


def scale_a_clone_of_an_operand_between_region_ops(m, x, y):
    h = m.fc(x)
    copied = y.clone()
    copied.mul_(2.0)  # changes the copy, not y
    return torch.relu(h + y) + copied


def test_in_place_change_of_a_clone_between_region_ops_is_fused():
    """`y.clone()` is a tensor of its own: an in-place op on it changes nothing the region reads. It was taken for a
    view of y ("changes `y` between the region's ops"), and the chain was not fused."""
    model = GemmThen(scale_a_clone_of_an_operand_between_region_ops)
    x, y = rows(), torch.randn(BATCH, OUT)
    optimized = fxfuse.optimize(model, (x, y))
    assert fused_op_count(optimized) == 1, optimized.fxfuse_report
    assert not any("changes" in reason for reason in reasons(optimized)), reasons(optimized)
    with torch.no_grad():
        assert_close_report(optimized(x, y), model(x, y))


def test_in_place_op_on_the_region_value_is_fused():
    model = GemmThen(lambda m, x, y: m.fc(x).mul_(2.0).relu_())
    assert_whole_chain_fused(model, (rows(),))


# ---------------------------------------------------------------- spellings that are close to an op but are not it


NEAR_SPELLINGS = {
    # eager rounds 1e6 to fp16 (inf) before scaling it by alpha: `add(%0,1.0)` was fused
    "add-alpha-with-number": (lambda m, x, y: torch.add(m.fc(x), 1e6, alpha=1e-6), "add with alpha=1e-06"),
    "sub-alpha-with-number": (lambda m, x, y: torch.sub(m.fc(x), 3, alpha=0.1), "sub with alpha=0.1"),
    "div-floor": (lambda m, x, y: torch.div(m.fc(x), 2.0, rounding_mode="floor"), "div with rounding_mode='floor'"),
    "clamp-by-tensor": (lambda m, x, y: torch.clamp(m.fc(x), min=y), "clamp's min is not a Python number"),
    "pow-by-tensor": (lambda m, x, y: torch.pow(m.fc(x), y), "the exponent is not a Python number"),
    "addmm-beta": (lambda m, x, y: torch.addmm(y, x, m.w, beta=0.5), "addmm with beta or alpha other than 1"),
    "var-of-everything": (lambda m, x, y: torch.var(m.fc(x), True), "var without a dim reduces the whole tensor"),
    "std-of-everything": (lambda m, x, y: m.fc(x).std(), "std without a dim reduces the whole tensor"),
    "vector_norm-ord-3": (lambda m, x, y: torch.linalg.vector_norm(m.fc(x), 3, -1),
                          "vector_norm of order 3: the fused op takes the 2-norm only"),
    "norm-inf": (lambda m, x, y: m.fc(x).norm(float("inf"), 1),
                 "norm of order inf: the fused op takes the 2-norm only"),
    "norm-frobenius": (lambda m, x, y: torch.norm(m.fc(x)), "norm without a dim reduces the whole tensor"),
    "linalg.norm-matrix": (lambda m, x, y: torch.linalg.norm(m.fc(x), dim=(0, 1)),
                           "linalg.norm over two dims is a matrix norm"),
    "normalize-p1": (lambda m, x, y: F.normalize(m.fc(x), p=1.0),
                     "normalize of order 1.0: the fused op takes the 2-norm"),
}


@pytest.mark.parametrize("name", list(NEAR_SPELLINGS))
def test_near_spelling_is_not_fused_with_reason(name):
    epilogue, reason = NEAR_SPELLINGS[name]
    model = GemmThen(epilogue, w=nn.Parameter(torch.randn(IN, OUT)))
    optimized = assert_fuses(model, (rows(), torch.randn(BATCH, OUT)), regions=0)
    assert_reason(optimized, reason)


def test_mish_spelling_with_another_softplus_beta_is_not_mish():
    model = GemmThen(lambda m, x, y: (lambda h: h * torch.tanh(F.softplus(h, beta=2.0)))(m.fc(x)))
    optimized = assert_whole_chain_fused(model, (rows(),))
    (program,) = fused_programs(optimized)
    assert "mish" not in program and "softplus(%0,2.0,20.0)" in program


def test_silu_spelling_over_two_different_tensors_is_not_silu():
    model = GemmThen(lambda m, x, y: m.fc(x) * torch.sigmoid(y))
    optimized = assert_fuses(model, (rows(), torch.randn(BATCH, OUT)), regions=1)
    assert fused_programs(optimized) == ["mul(%0,$0)"]
    assert len(leftover_compute(optimized)) == 1  # the sigmoid of the input


def test_gemm_without_any_epilogue_is_left_alone():
    model = nn.Sequential(nn.Linear(IN, OUT))
    assert_not_fused(model, (rows(),), reason="no epilogue op follows the GEMM")


@pytest.mark.parametrize("no_op", [nn.Dropout(0.1), nn.Identity()], ids=["eval-Dropout", "Identity"])
def test_gemm_followed_by_no_ops_alone_is_left_alone_and_says_so(no_op):
    """explain() said 'the region would have more than one output' for a GEMM followed by an eval-mode dropout."""
    model = nn.Sequential(nn.Linear(IN, OUT), no_op).eval()
    assert_not_fused(model, (rows(),), reason="no epilogue op follows the GEMM, only no-ops")


def test_instance_norm_module_needs_known_rank():
    model = GemmThen(lambda m, x, y: m.norm(m.fc(x)), norm=nn.InstanceNorm1d(BATCH))
    optimized = fxfuse.optimize(model)  # no example inputs: the rank of the output is unknown
    assert fused_op_count(optimized) == 0
    assert_reason(optimized, "the rank is unknown (pass example inputs)")


def test_shape_of_a_region_value_read_twice_keeps_that_value_alive():
    """`n = h.shape[-1:]` used by the norm and elsewhere can't be folded into the norm: `h` is used outside."""
    model = GemmThen(lambda m, x, y: (lambda h, n: F.layer_norm(h, n) * n[0])(*(lambda h: (h, h.shape[-1:]))(m.fc(x))))
    assert_not_fused(model, (rows(),), reason="intermediate `fc` is also used by `getattr_1`")


class ScaleWithDefault(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x, *, scale=2.0):
        return torch.relu(self.fc(x)) * scale


class ScaleAnnotated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor, scale: float):
        return torch.relu(self.fc(x)) * scale


@pytest.mark.parametrize("model, inputs", [(ScaleWithDefault(), (rows(),)), (ScaleAnnotated(), (rows(), 0.5))],
                         ids=["default", "annotation"])
def test_number_argument_of_forward_is_no_tensor_operand_without_example_inputs(model, inputs):
    """Without shapes a forward argument is taken for a tensor, unless its default or annotation says not."""
    optimized = fxfuse.optimize(model)
    assert fused_programs(optimized) == ["relu(%0)"]
    assert_reason(optimized, "operand `scale` is not a tensor")
    with torch.no_grad():
        assert_close_report(optimized(*inputs), model(*inputs))


# ---------------------------------------------------------------- aliases, and changes that eager sees


def relu_through_contiguous(m, x, y):
    h = m.fc(x)
    h.contiguous().relu_()
    return h + 1.0


def relu_through_identity(m, x, y):
    h = m.fc(x)
    m.ident(h).relu_()
    return h * 2.0


def add_through_eval_dropout(m, x, y):
    h = m.fc(x)
    m.drop(h).add_(1.0)
    return h + 1.0


def alias_read_after_relu(m, x, y):
    h = m.fc(x)
    g = m.ident(h)
    h.relu_()
    return g + 1.0


def test_in_place_op_on_an_alias_made_by_contiguous_is_not_fused():
    """contiguous() returns the same tensor where it is contiguous, else a copy: an in-place op on it changes the other
    or not, which the program's values (one per op) cannot say."""
    model = GemmThen(relu_through_contiguous).eval()
    optimized = assert_not_fused(model, (rows(),))
    assert_reason(optimized, "aliases")


def double_through_detach_then_tanh(m, x, y):
    h = m.fc(x) + 1.0
    h.detach().mul_(2.0)
    return torch.tanh(h)


def double_then_read_detached_and_source(m, x, y):
    h = m.fc(x) + 1.0
    v = torch.detach(h)
    h.mul_(2.0)
    return torch.tanh(v) + h


@pytest.mark.parametrize("epilogue", [double_through_detach_then_tanh, double_then_read_detached_and_source])
def test_in_place_op_on_a_tensor_that_detach_aliases_is_not_fused_past(epilogue):
    """detach() returns a tensor that shares its input's memory: an in-place op on either changes the other, which the
    program's values (one per op) cannot say."""
    model = GemmThen(epilogue).eval()
    optimized = assert_fuses(model, (rows(),))
    assert fused_programs(optimized) == ["add(%0,1.0)"]
    if epilogue is double_then_read_detached_and_source:  # (in the other, the region stops at `add`'s other reader)
        assert_reason(optimized, "which `detach` aliases")


def slice_mul_then_read_both(m, x, y):
    h = m.fc(x)
    v = h[:, :]
    v.mul_(2)
    return v + h


def ellipsis_add_then_relu(m, x, y):
    h = m.fc(x)
    h[...].add_(1)
    return h.relu()


@pytest.mark.parametrize("with_examples", [True, False], ids=["example-inputs", "no-example-inputs"])
@pytest.mark.parametrize("epilogue", [relu_through_identity, add_through_eval_dropout, alias_read_after_relu,
                                      slice_mul_then_read_both, ellipsis_add_then_relu])
def test_in_place_op_on_a_whole_view_fuses(epilogue, with_examples):
    """nn.Identity, eval-mode dropout and `h[:, :]` are `h` itself (its shape and elements): an in-place op on one
    changes the other, whose later readers read the in-place op's value."""
    model = GemmThen(epilogue, ident=nn.Identity(), drop=nn.Dropout(0.3)).eval()
    assert_whole_chain_fused(model, (rows(),), example_inputs=None if with_examples else False)


@pytest.mark.parametrize("with_examples", [True, False], ids=["example-inputs", "no-example-inputs"])
def test_in_place_op_on_a_whole_view_of_more_dims_than_the_input_has_raises_as_eager(with_examples):
    """`h[:, :]` of a 1-D GEMM output raises in eager: the fused op checks x's rank first, also where the example
    inputs were 2-D (a later call's 1-D input ran the fused op, where eager raises), and a 1-D x runs the model's own
    forward, which raises eager's error."""
    model = GemmThen(slice_mul_then_read_both).eval()
    optimized = assert_fuses(model, (rows(),), example_inputs=None if with_examples else False)
    for candidate in (model, optimized):
        with pytest.raises(IndexError, match="too many indices"):
            candidate(torch.randn(IN))


def sum_then_scale_a_whole_view(m, x, y):
    h = m.fc(x).sum(-1)
    h[:, :].mul_(2)
    return h


@pytest.mark.parametrize("with_examples", [True, False], ids=["example-inputs", "no-example-inputs"])
def test_a_whole_view_after_a_reduction_without_keepdim_needs_a_dim_more_of_x(with_examples):
    """`h.sum(-1)[:, :]` has one dim fewer than x: a 2-D x makes eager raise, where the fused op checked for 2 dims
    and ran."""
    model = GemmThen(sum_then_scale_a_whole_view).eval()
    example = torch.randn(2, BATCH, IN)
    optimized = assert_whole_chain_fused(model, (example,), example_inputs=None if with_examples else False)
    for x in (rows(), torch.randn(IN)):
        for candidate in (model, optimized):
            with pytest.raises(IndexError, match="too many indices"):
                candidate(x)
    with torch.no_grad():
        x = torch.randn(3, 2, BATCH, IN)
        assert_close_report(optimized(x), model(x))


def sum_then_addcmul_of_an_argument_then_a_whole_view(m, x, y):
    return m.fc(x).sum(-1).addcmul(y, y, value=0.5)[:, :].relu()


def test_a_whole_view_after_a_reduction_and_steps_of_an_argument_alone_needs_a_dim_more_of_x():
    """addcmul's `value * y * y` is computed of the forward argument alone, then added to `h.sum(-1)`, which has one
    dim fewer than x: its whole view needs x of 3 dims (or a y of 2), where those steps counted as x's rank and a
    2-D x of a 0-d y ran the fused op, where eager raises."""
    model = GemmThen(sum_then_addcmul_of_an_argument_then_a_whole_view).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 1, optimized.fxfuse_report
    with torch.no_grad():
        for x, y in ((rows(), torch.randn(())), (rows(), torch.randn(BATCH)),
                     (torch.randn(2, BATCH, IN), torch.randn(())), (rows(), torch.randn(2, BATCH))):
            try:
                expected = model(x, y)
            except Exception as error:
                with pytest.raises(type(error), match=re.escape(str(error))):
                    optimized(x, y)
                continue
            assert_close_report(optimized(x, y), expected)


def scale_gemm_input_through_a_whole_view(m, x, y):
    h = torch.relu(m.fc(x))
    v = x[:, :]
    v.mul_(2)
    return x, h


def scale_other_input_through_a_whole_view(m, x, y):
    h = torch.relu(m.fc(x))
    v = y[:, :]
    v.mul_(2)
    return y, h + y


@pytest.mark.parametrize("with_examples", [True, False], ids=["example-inputs", "no-example-inputs"])
@pytest.mark.parametrize("epilogue", [scale_gemm_input_through_a_whole_view, scale_other_input_through_a_whole_view])
def test_in_place_op_on_a_whole_view_outside_the_region_leaves_its_readers_as_eager(epilogue, with_examples):
    """The readers of a tensor changed in place through a whole view read the in-place op while matching; those the
    region does not take in read the tensor itself again, as in eager: the model returns its argument, changed."""
    model = GemmThen(epilogue).eval()
    optimized = fxfuse.optimize(model, (rows(), torch.randn(BATCH, OUT)) if with_examples else None)
    assert fused_programs(optimized) == ["relu(%0)"]
    x, y = rows(), torch.randn(BATCH, OUT)
    eager_x, eager_y = x.clone(), y.clone()
    with torch.no_grad():
        expected = model(eager_x, eager_y)
        actual = optimized(x, y)
    changed = x if epilogue is scale_gemm_input_through_a_whole_view else y
    assert actual[0] is changed
    assert_close_report(actual[1], expected[1])
    torch.testing.assert_close((x, y), (eager_x, eager_y), rtol=0, atol=0)


@pytest.mark.parametrize("epilogue", [lambda m, x, y: (lambda h: (h[:, :4].mul_(2), h)[1])(m.fc(x)),
                                      lambda m, x, y: (lambda h: (h.view(-1).add_(1), h)[1])(m.fc(x)),
                                      lambda m, x, y: (lambda h: (h.t().relu_(), h)[1])(m.fc(x))],
                         ids=["part", "other-shape", "transposed"])
def test_in_place_op_on_a_view_of_part_or_another_shape_is_not_fused(epilogue):
    assert_not_fused(GemmThen(epilogue).eval(), (rows(),),
                     reason="a view of `fc` of part of it or of another shape, which a fused program cannot express")


def test_in_place_op_after_an_identity_op_fuses_where_nothing_else_reads_the_alias():
    model = GemmThen(lambda m, x, y: m.drop(m.fc(x)).relu_() + 1.0, drop=nn.Dropout(0.3)).eval()
    assert_whole_chain_fused(model, (rows(),))


def zero_operand_through_a_view(m, x, y):
    scaled = m.fc(x) * y
    y[:, :].zero_()
    return torch.relu(scaled)


def zero_operand_by_out(m, x, y):
    scaled = m.fc(x) * y
    torch.mul(y, 0.0, out=y)
    return torch.relu(scaled)


def scale_operand_through_a_reshape(m, x, y):
    scaled = m.fc(x) * y
    y.view(-1).mul_(2.0)
    return torch.relu(scaled)


def assign_into_operand(m, x, y):
    scaled = m.fc(x) * y
    y[0] = 100.0
    return torch.relu(scaled)


def zero_gemm_input_after_the_gemm(m, x, y):
    h = m.fc(x)
    x[:].zero_()
    return torch.relu(h) + y


@pytest.mark.parametrize("epilogue", [zero_operand_through_a_view, zero_operand_by_out,
                                      scale_operand_through_a_reshape, zero_gemm_input_after_the_gemm])
def test_change_of_a_read_tensor_through_a_view_out_or_assignment_is_not_fused(epilogue):
    """The fused op would read `y` (or the GEMM's `x`) after the change, where eager read it before."""
    model = GemmThen(epilogue)
    x, y = rows(), torch.randn(BATCH, OUT)
    with torch.no_grad():
        expected = model(x.clone(), y.clone())
        optimized = fxfuse.optimize(model, (x.clone(), y.clone()))
        actual = optimized(x.clone(), y.clone())
    assert fused_op_count(optimized) == 0
    assert_reason(optimized, "between the region's ops, which read it")
    assert_close_report(actual, expected)


def test_item_assignment_into_a_read_tensor_is_not_fused_by_the_backend():
    """fx's tracer can't trace `y[0] = v`; Dynamo keeps it as operator.setitem in the graph fxfuse gets."""
    torch._dynamo.reset()
    model = GemmThen(assign_into_operand)
    x, y = rows(), torch.randn(BATCH, OUT)
    compiled = torch.compile(model, backend=fxfuse.make_backend(inner="eager"))
    with torch.no_grad():
        assert_close_report(compiled(x, y.clone()), model(x, y.clone()))
    torch._dynamo.reset()


def test_fresh_tensor_changed_between_region_ops_does_not_stop_the_region():
    model = GemmThen(lambda m, x, y: (lambda scaled, z: torch.relu(scaled) + z.add_(1.0))(m.fc(x) * y, y * 2.0))
    assert_fuses(model, (rows(), torch.randn(BATCH, OUT)), regions=1)


@torch.library.custom_op("fxfuse_tests::bump", mutates_args=("t",))
def bump(t: torch.Tensor) -> None:
    t.add_(1.0)


@bump.register_fake
def _(t):
    return None


@torch.fx.wrap
def bump_in_python(t):
    t.add_(1.0)


def changes_x_by_custom_op(m, x, y):
    h = m.fc(x)
    torch.ops.fxfuse_tests.bump(x)
    return torch.relu(h)


def changes_x_in_python(m, x, y):
    h = m.fc(x)
    bump_in_python(x)  # a call_function node: fx does not trace into it
    return torch.relu(h)


@pytest.mark.parametrize("forward", [changes_x_by_custom_op, changes_x_in_python],
                         ids=["custom op whose schema writes x", "wrapped Python function"])
def test_a_call_that_may_change_x_between_the_regions_ops_stops_it(forward):
    """The GEMM moves to where the chain's last op was: a custom op whose schema says it writes its argument, or a
    Python function fxfuse cannot see into, must not run before it (it did: only in-place names counted)."""
    model, x = GemmThen(forward).eval(), rows()
    optimized = fxfuse.optimize(model, (x.clone(), None))
    with torch.no_grad():
        assert_close_report(optimized(x.clone(), None), model(x.clone(), None))
    assert fused_op_count(optimized) == 0
    assert_reason(optimized, "between the region's ops, which read it")


def changes_y_between(m, x, y):
    h = m.fc(x)
    y.mul_(2.0)
    return torch.relu(h)


def test_a_change_to_another_input_between_the_regions_ops_stops_it():
    """`model(t, t)`: y is x at run time, though the graph cannot tell (it fused, and read x doubled)."""
    model, base = GemmThen(changes_y_between, in_features=OUT).eval(), rows(features=OUT)
    optimized = fxfuse.optimize(model, (rows(features=OUT), rows(features=OUT)))
    assert fused_op_count(optimized) == 0
    assert_reason(optimized, "changes `y` between the region's ops, which read `x`: they may share memory")
    expected_input, actual_input = base.clone(), base.clone()
    with torch.no_grad():
        assert_close_report(optimized(actual_input, actual_input), model(expected_input, expected_input))


@pytest.mark.parametrize("augmented", ["floordiv", "mod"])
def test_the_backend_sees_every_augmented_assignment_as_in_place(augmented):
    """Dynamo records `x //= 0.5` as operator.ifloordiv(x, 0.5); it ran before the fused op that reads x."""
    def forward(m, x, y):
        h = m.fc(x)
        if augmented == "floordiv":
            x //= 0.5
        else:
            x %= 0.3
        return h + x

    torch._dynamo.reset()
    model, x = GemmThen(forward, in_features=OUT).eval(), rows(features=OUT)
    compiled = torch.compile(model, backend=fxfuse.make_backend(inner="eager"))
    with torch.no_grad():
        assert_close_report(compiled(x.clone(), None), model(x.clone(), None))
    torch._dynamo.reset()


def test_the_backend_takes_no_two_inputs_for_other_memory():
    """Dynamo recompiles for an input passed twice (`model(t, t)`), not for a view of it (`model(t, t.view(...))`),
    which reuses the graph of two tensors: inputs of other example storages may share memory all the same (the
    graph fused, and read y doubled)."""
    torch._dynamo.reset()
    model = GemmThen(changes_y_between, in_features=OUT).eval()
    backend = fxfuse.make_backend(inner="eager")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        x, y = rows(features=OUT), rows(features=OUT)
        assert_close_report(compiled(x.clone(), y.clone()), model(x.clone(), y.clone()))
        for share in (lambda t: t, lambda t: t.view(BATCH, OUT)):
            base = rows(features=OUT)
            expected_input, actual_input = base.clone(), base.clone()
            assert_close_report(compiled(actual_input, share(actual_input)), model(expected_input, share(expected_input)))
    assert all(not report.fused for report in backend.reports)
    torch._dynamo.reset()


class CountsItsCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(IN, OUT), nn.LayerNorm(OUT)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        y = F.gelu(self.ln(self.fc(x)))
        self.calls += 1
        return y


@pytest.mark.parametrize("model", [lambda: CountsItsCalls().eval(),
                                   lambda: nn.Sequential(nn.Linear(IN, OUT), nn.GELU(), nn.BatchNorm1d(OUT)).train()],
                         ids=["an int64 counter under no_grad", "train-mode batch norm after the region"])
def test_a_buffer_changed_after_the_region_that_cannot_be_what_it_keeps_does_not_stop_it(model):
    """Dynamo lifts parameters and buffers to graph inputs: every later add_ on a buffer was taken for a change of
    what the region keeps (in an inference graph too, and between int64 and float tensors)."""
    torch._dynamo.reset()
    backend = fxfuse.make_backend(inner="eager")
    model = model()
    compiled = torch.compile(model, backend=backend)
    with torch.set_grad_enabled(model.training):
        compiled(rows())
    assert sum(len(report.fused) for report in backend.reports) == 1
    torch._dynamo.reset()


# ---------------------------------------------------------------- scalars and dtypes as eager has them


def test_softmax_to_another_dtype_by_position_is_not_fused():
    """torch.softmax(input, dim, dtype): the third positional argument is the dtype (F.softmax's is _stacklevel)."""
    model = GemmThen(lambda m, x, y: torch.softmax(m.fc(x) * 2.0, -1, torch.float64))
    optimized = assert_fuses(model, (rows(),), regions=1)
    assert fused_programs(optimized) == ["mul(%0,2.0)"]
    assert_reason(optimized, "softmax with dtype=float64")
    assert optimized(rows()).dtype == torch.float64


def test_bf16_softmax_to_float32_is_not_fused():
    model = GemmThen(lambda m, x, y: m.fc(x).softmax(-1, torch.float32)).to(torch.bfloat16)
    optimized = assert_not_fused(model, (rows(dtype=torch.bfloat16),), reason="makes its bfloat16 value float32")
    assert optimized(rows(dtype=torch.bfloat16)).dtype == torch.float32


def test_numpy_scalar_operand_fuses_as_a_number():
    np = pytest.importorskip("numpy")
    model = GemmThen(lambda m, x, y: torch.relu(m.fc(x) / np.sqrt(OUT)))
    optimized = assert_whole_chain_fused(model, (rows(),))
    assert fused_programs(optimized) == [f"div(%0,{float(np.sqrt(OUT))!r});relu(%1)"]


@pytest.mark.parametrize("spelling, program", [
    ("h * np.float32(2)", "mul(%0,2.0)"),
    ("torch.sum(h, np.int64(1))", "sum(%0,1,False)"),
    ("F.group_norm(h, np.int64(4))", "group_norm(%0,None,None,4,1e-05)"),
    ("h + np.bool_(True)", "add(%0,True)"),
])
def test_numpy_scalars_that_are_no_python_numbers_fuse_as_numbers(spelling, program):
    """fx's trace raised NotImplementedError ('argument of type: numpy.float32') for NumPy scalars that are no
    subclass of a Python number, and optimize() left the whole model unfused."""
    np = pytest.importorskip("numpy")
    epilogue = eval(f"lambda h: {spelling}", {"np": np, "torch": torch, "F": F})
    model = GemmThen(lambda m, x, y: epilogue(m.fc(x)))
    optimized = assert_whole_chain_fused(model, (rows(),))
    assert fused_programs(optimized) == [program]


def test_complex_scalar_is_not_fused():
    model = GemmThen(lambda m, x, y: torch.relu(m.fc(x)) * 1j)
    optimized = assert_fuses(model, (rows(),), regions=1)
    assert fused_programs(optimized) == ["relu(%0)"]
    assert_reason(optimized, "complex scalar")


class ScaleUnannotated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x, scale):
        return torch.relu(self.fc(x)) * scale


@pytest.mark.parametrize("scale", [0.5, 3, torch.randn(OUT)], ids=["float", "int", "tensor"])
def test_unannotated_argument_taken_for_a_tensor_also_takes_a_number(scale):
    """Without example inputs `scale` becomes a tensor param of the fused op; a number passed there is
    converted on the way in (as eager's mul casts it)."""
    model = ScaleUnannotated()
    optimized = fxfuse.optimize(model)
    assert fused_programs(optimized) == ["relu(%0);mul(%1,$0)"]
    x = rows()
    with torch.no_grad():
        assert_close_report(optimized(x, scale), model(x, scale))


# ---------------------------------------------------------------- errors where eager raises


EAGER_ERRORS = {
    "sub-of-a-bool": (lambda m, x, y: torch.relu(m.fc(x)) - True, RuntimeError),
    "layer_norm-of-the-input's-size": (lambda m, x, y: F.layer_norm(m.fc(x), x.shape[-1:]), RuntimeError),
    "sum-with-dim-and-axis": (lambda m, x, y: m.fc(x).sum(dim=-1, axis=-1), TypeError),
    "sum-with-a-positional-dtype": (lambda m, x, y: m.fc(x).sum(1, False, torch.float32), TypeError),
    "layer_norm-of-another-size": (lambda m, x, y: torch.relu(F.layer_norm(m.fc(x), (IN,))), RuntimeError),
    "rms_norm-of-another-size": (lambda m, x, y: torch.relu(F.rms_norm(m.fc(x), [OUT + 1])), RuntimeError),
    "hardtanh-min-above-max": (lambda m, x, y: F.hardtanh(m.fc(x), 2.0, 1.0), ValueError),
    "dropout-p-above-1": (lambda m, x, y: torch.relu(F.dropout(m.fc(x), 1.5, training=False)), ValueError),
    "mm-of-3-D": (lambda m, x, y: torch.relu(torch.mm(x, m.fc.weight.t())), RuntimeError),
    "addmm-of-3-D": (lambda m, x, y: torch.relu(torch.addmm(m.fc.bias, x, m.fc.weight.t())), RuntimeError),
    "layer_norm-of-an-int": (lambda m, x, y: F.layer_norm(m.fc(x), OUT), TypeError),
    "layer_norm-of-size(-1)": (lambda m, x, y: (lambda h: F.layer_norm(h, h.size(-1)))(m.fc(x)), TypeError),
    "group_norm-of-a-float-count": (lambda m, x, y: F.group_norm(m.fc(x), 2.0), TypeError),
    "add-with-a-boolean-alpha": (lambda m, x, y: torch.add(m.fc(x), 2, alpha=True), RuntimeError),
    # addcmul and addcdiv take tensors only, and a keyword value; addcdiv divides no two integer tensors
    "addcdiv-of-two-integer-tensors": (lambda m, x, y: torch.addcdiv(m.fc(x), torch.arange(1, OUT + 1),
                                                                     torch.arange(1, OUT + 1)), RuntimeError),
    "addcmul-of-a-number": (lambda m, x, y: (lambda h: torch.addcmul(h, h, 2.0))(m.fc(x)), TypeError),
    "addcdiv-of-a-size": (lambda m, x, y: (lambda h: torch.addcdiv(h, h, h.size(-1)))(m.fc(x)), TypeError),
    "addcmul-with-a-positional-value": (lambda m, x, y: (lambda h: h.addcmul(h, h, 2))(m.fc(x)), TypeError),
    "addcdiv-with-a-complex-value": (lambda m, x, y: (lambda h: h.addcdiv(h, h.exp(), value=1j))(m.fc(x)),
                                     RuntimeError),
    "in-place-addcmul-of-a-bigger-tensor": (lambda m, x, y: (lambda h: h.addcmul_(torch.ones(3, 1, OUT), h))(m.fc(x)),
                                            RuntimeError),
    "contiguous-as-channels_last": (lambda m, x, y: torch.relu(m.fc(x).contiguous(memory_format=torch.channels_last)),
                                    RuntimeError),
    "clone-as-channels_last": (lambda m, x, y: torch.relu(m.fc(x).clone(memory_format=torch.channels_last)),
                               RuntimeError),
    # an in-place op keeps its value's shape: eager raises where the result would be bigger
    "in-place-mul-by-a-bigger-tensor": (lambda m, x, y: m.fc(x).mul_(torch.ones(3, 1, OUT)), RuntimeError),
    "in-place-mul-of-a-reduced-value": (lambda m, x, y: (lambda h: h.sum(-1, keepdim=True).mul_(h))(m.fc(x)),
                                        RuntimeError),
    # ... and not a dim bigger: shapes are lost to the very op that raises, so ranks are all the matcher has
    "in-place-add-of-a-3-D-param": (lambda m, x, y: m.fc(x).add_(torch.ones(1, 1, OUT)), RuntimeError),
    "in-place-mul-by-a-value-of-a-3-D-param": (lambda m, x, y: (lambda h: h.mul_(h + torch.ones(1, 1, OUT)))(m.fc(x)),
                                               RuntimeError),
    "in-place-add-of-keepdim-into-a-dropped-dim": (
        lambda m, x, y: (lambda h: h.sum(-1).add_(h.mean(-1, keepdim=True)))(m.fc(x)), RuntimeError),
    "in-place-mul-of-a-dropped-dim-by-a-2-D-param": (lambda m, x, y: m.fc(x).sum(-1).mul_(torch.ones(1, 1)),
                                                     RuntimeError),
    "addmm-with-a-3-D-input": (lambda m, x, y: torch.relu(torch.addmm(torch.ones(1, BATCH, OUT), x, m.fc.weight.t())),
                               RuntimeError),
    # eager's parser takes no float or bool for an int, nor an int for a bool
    "softmax-over-a-float-dim": (lambda m, x, y: F.softmax(m.fc(x), 1.0), TypeError),
    "log_softmax-over-a-bool-dim": (lambda m, x, y: m.fc(x).log_softmax(True), TypeError),
    "sum-with-an-int-keepdim": (lambda m, x, y: m.fc(x).sum(1, 1), TypeError),
    "max-with-an-int-keepdim": (lambda m, x, y: m.fc(x).max(1, 1)[0], TypeError),
    # a scalar argument is a 64-bit int or a double: a Python int past [-2**63, 2**64) overflows the parser
    "clamp-at-minus-2**64": (lambda m, x, y: torch.clamp(m.fc(x), -2**64), OverflowError),
    "leaky_relu-of-slope-2**64": (lambda m, x, y: F.leaky_relu(m.fc(x), 2**64), OverflowError),
    "pow-of-2**64": (lambda m, x, y: m.fc(x) ** 2**64, OverflowError),
    "softplus-of-threshold-2**64": (lambda m, x, y: F.softplus(m.fc(x), 1, 2**64), OverflowError),
    "rrelu-between-minus-and-plus-2**64": (lambda m, x, y: F.rrelu(m.fc(x), -2**64, 2**64), OverflowError),
}


@pytest.mark.parametrize("name", list(EAGER_ERRORS))
@pytest.mark.parametrize("shapes", [True, False], ids=["example-inputs", "no-example-inputs"])
def test_optimized_model_raises_where_eager_raises(name, shapes):
    epilogue, error = EAGER_ERRORS[name]
    model = GemmThen(epilogue).eval()
    x = torch.randn(2, BATCH, IN) if name.endswith("3-D") else rows()
    with pytest.raises(error):
        model(x)
    optimized = fxfuse.optimize(model, (x,) if shapes else None)
    with pytest.raises(error):
        optimized(x)


def test_lazy_module_is_left_to_initialize_on_its_first_call():
    model = nn.Sequential(nn.LazyLinear(OUT), nn.ReLU())
    report = fxfuse.explain(model, (rows(),))
    assert report.fused == []
    assert model(rows()).shape == (BATCH, OUT) and model[0].weight.device.type == "cpu"


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, OUT), nn.BatchNorm1d(OUT), nn.ReLU())

    def forward(self, x):
        h = self.body(x)
        return h * 2.0 if h.sum() > 0 else h  # data-dependent control flow: fx can't trace it


def test_finding_the_inputs_of_an_untraceable_models_children_leaves_its_state_alone():
    model = Untraceable().train()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    fxfuse.explain(model, (rows(),))
    fxfuse.optimize(model, (rows(),))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} changed while optimizing"


class UntraceableWithDropout(Untraceable):
    def __init__(self):
        super().__init__()
        self.body.append(nn.Dropout(0.5))


def test_finding_the_inputs_of_an_untraceable_models_children_leaves_the_random_stream_alone():
    model, x = UntraceableWithDropout().train(), rows()
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    fxfuse.optimize(model, (x,))
    assert torch.equal(torch.rand(4), expected), "optimize() moved the caller's random stream on"


class BlockWithOptionalShift(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x, shift=None):
        h = torch.relu(self.fc(x))
        return h if shift is None else h + shift


class UntraceableCallingABlockTwice(nn.Module):
    """One child called twice with inputs of different kinds: `block(x)` then `block(x, shift)`, or a tensor then a
    number for `shift`."""
    def __init__(self, second_shift):
        super().__init__()
        self.block = BlockWithOptionalShift()
        self.second_shift = second_shift

    def forward(self, x):
        if x.sum() > -1e30:  # data-dependent control flow: fx can't trace it, its children are optimized
            first = self.block(x) if self.second_shift is None else self.block(x, torch.ones(OUT))
            return first, self.block(x, 2.0 if self.second_shift is None else self.second_shift)
        return x


@pytest.mark.parametrize("second_shift", [None, 2.0], ids=["None then a number", "a tensor then a number"])
def test_a_child_called_twice_with_inputs_of_different_kinds_takes_both(second_shift):
    """The child was optimized for its first call's inputs only: the second call raised (fx's 'shift has been
    specialized to have value None', or the fused op given a number for a Tensor[] param), where eager does not."""
    model, x = UntraceableCallingABlockTwice(second_shift), rows()
    optimized = fxfuse.optimize(model, (x,))
    with torch.no_grad():
        for actual, expected in zip(optimized(x), model(x)):
            assert_close_report(actual, expected)


def test_one_tensor_as_example_inputs_is_one_input():
    model = GemmThen(lambda m, x, y: F.instance_norm(m.fc(x)))  # fuses only where the rank (3) is known
    x = torch.randn(2, BATCH, IN)
    assert fused_programs(fxfuse.optimize(model, x)) == fused_programs(fxfuse.optimize(model, (x,)))
    assert len(fxfuse.explain(model, x).fused) == 1


@pytest.mark.parametrize("change", ["slope", "dropout-p"])
def test_module_setting_changed_after_optimizing_raises(change):
    """A fused op's program holds its modules' settings as they were: a later change raises instead of computing
    with the old ones (as a later .train() does)."""
    if change == "slope":
        model = nn.Sequential(nn.Linear(IN, OUT), nn.LeakyReLU(0.2)).eval()
    else:  # p = 0 folds as an identity even in train mode
        model = nn.Sequential(nn.Linear(IN, OUT), nn.Dropout(0.0), nn.ReLU()).train()
    optimized = fxfuse.optimize(model)
    x = rows()
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))
    setattr(model[1], "negative_slope" if change == "slope" else "p", 0.5)
    with pytest.raises(RuntimeError, match="when it was fused and is now 0.5"):
        optimized(x)


def test_mm_optimized_for_matrices_raises_for_another_rank_as_eager():
    model = GemmThen(EAGER_ERRORS["mm-of-3-D"][0]).eval()
    optimized = fxfuse.optimize(model, (rows(),))
    assert fused_op_count(optimized) == 1
    with pytest.raises(RuntimeError, match="must be a matrix"):
        optimized(torch.randn(2, BATCH, IN))


def scale_identity_of_the_input(m, x, y):
    h = m.fc(x)
    m.ident(x).mul_(2.0)
    return torch.relu(h)


def scale_eval_dropout_of_the_input(m, x, y):
    h = m.fc(x)
    m.drop(x).mul_(2.0)
    return torch.relu(h)


def scale_the_input_by_foreach(m, x, y):
    h = m.fc(x)
    torch._foreach_mul_([x], 2.0)
    return torch.relu(h)


@pytest.mark.parametrize("epilogue", [scale_identity_of_the_input, scale_eval_dropout_of_the_input,
                                      scale_the_input_by_foreach])
def test_change_of_the_gemm_input_through_a_module_or_a_list_is_not_fused(epilogue):
    model = GemmThen(epilogue, ident=nn.Identity(), drop=nn.Dropout(0.1)).eval()
    x = rows()
    with torch.no_grad():
        expected = model(x.clone(), None)
        optimized = fxfuse.optimize(model, (x.clone(), None))
        actual = optimized(x.clone(), None)
    assert fused_op_count(optimized) == 0
    assert_close_report(actual, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("number", [2.5, 3, 100000.0, "np.float32", "np.int64", "np.bool_", 2 + 1j],
                         ids=["float", "int", "large", "np.float32", "np.int64", "np.bool_", "complex"])
def test_any_number_for_an_unannotated_argument_computes_as_eager(number, dtype):
    """number_as_tensor makes a 0-d CPU tensor of it: read at full precision (100000 is no fp16 inf) and
    promoting as a number does (a complex number makes the result complex, as eager). NumPy's bool_, which is no
    numbers.Number, reached the fused op's tensor params as it was."""
    np = pytest.importorskip("numpy")
    if isinstance(number, complex) and dtype == torch.float16:
        pytest.skip("eager has no complex-half division on the CPU")
    number = {"np.float32": np.float32(2.5), "np.int64": np.int64(3), "np.bool_": np.bool_(True)}.get(number, number)
    model = GemmThen(lambda m, x, y: torch.relu(m.fc(x)) / y).to(dtype)
    optimized = fxfuse.optimize(model)
    x = rows(dtype=dtype)
    with torch.no_grad():
        assert_close_report(optimized(x, number), model(x, number), atol=0.0)  # h / 1e5 is small, not 0


@pytest.mark.parametrize("example", [False, True], ids=["no_example", "example"])
def test_a_number_argument_keeps_the_dtype_of_a_value_of_no_dims(example):
    """`fc(x).amax(-1) / s` of a 1-D x is 0-d: the fused op's 0-d float64 tensor for a number s promoted it to float64,
    where eager's number keeps float32 (with example inputs too, at a later call of a 1-D x). A first check of x's rank
    keeps the division in the region: a 1-D x runs the model's own forward."""
    model = GemmThen(lambda m, x, y: torch.relu(m.fc(x)).amax(-1) / y).eval()
    optimized = fxfuse.optimize(model, (rows(), torch.tensor(2.0))) if example else fxfuse.optimize(model)
    assert fused_programs(optimized) == ["relu(%0);amax(%1,-1,False);div(%2,$0)"]
    with torch.no_grad():
        for x in (torch.randn(IN), rows()):
            for y in (2.0, torch.tensor(2.0), torch.tensor(2.0, dtype=torch.float64)):
                got, want = optimized(x, y), model(x, y)
                assert got.dtype == want.dtype, (tuple(x.shape), y)
                assert_close_report(got, want)


def test_a_number_argument_keeps_the_dtype_of_a_value_of_no_dims_after_prelu():
    """prelu's slopes do not broadcast its value: `prelu(fc(x).amax(-1)) * s` of a 1-D x is 0-d, where the slopes'
    one dim counted as the value's, so no first check of x's rank was made, and the fused op's 0-d float64 tensor for
    a number s promoted the result to float64 (optimize_hunt seed 726104)."""
    model = GemmThen(lambda m, x, y: m.act(torch.relu(m.fc(x)).amax(-1)) * y, act=nn.PReLU()).eval()
    optimized = fxfuse.optimize(model)
    assert fused_programs(optimized) == ["relu(%0);amax(%1,-1,False);prelu(%2,$0);mul(%3,$1)"]
    with torch.no_grad():
        for x in (torch.randn(IN), rows()):
            for y in (2.0, torch.tensor(2.0)):
                got, want = optimized(x, y), model(x, y)
                assert got.dtype == want.dtype, (tuple(x.shape), y, got.dtype, want.dtype)
                assert_close_report(got, want)


def test_a_number_argument_beside_a_value_of_no_dims_of_a_computed_input_is_left_out():
    """The rank check runs first, on a forward argument: of a GEMM input the graph computes, the division that may
    promote stays out of the region, and explain() says why."""
    model = GemmThen(lambda m, x, y: torch.relu(m.fc(x.relu())).amax(-1) / y).eval()
    optimized = fxfuse.optimize(model)
    assert fused_programs(optimized) == ["relu(%0);amax(%1,-1,False)"]
    assert_reason(optimized, "which may be a number at a call, with a value that may have no dims")
    with torch.no_grad():
        x = torch.randn(IN)
        got, want = optimized(x, 2.0), model(x, 2.0)
        assert got.dtype == want.dtype == torch.float32
        assert_close_report(got, want)


@pytest.mark.parametrize("number", [1e40, 1e-50, 0.1])
def test_a_float_argument_keeps_its_precision_in_a_float64_model(number):
    """number_as_tensor made a float32 tensor of it: 1e40 became inf and 1e-50 zero once the model ran in float64
    (optimized without example inputs, then .double())."""
    model = GemmThen(lambda m, x, y: torch.tanh(m.fc(x)) * y).eval()
    optimized = fxfuse.optimize(model)
    model.double()
    x = rows(dtype=torch.float64)
    with torch.no_grad():
        assert_close_report(optimized(x, number), model(x, number), rtol=1e-12, atol=0.0)


def test_module_settings_that_compute_nothing_may_change():
    model = nn.Sequential(nn.Linear(IN, OUT), nn.LeakyReLU(float("nan")), nn.ReLU()).eval()
    optimized = fxfuse.optimize(model)
    model[2].inplace = True
    x = rows()
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))  # a NaN slope is the same setting; inplace computes nothing


class ResidualAroundActivation(nn.Module):
    def __init__(self, inplace):
        super().__init__()
        self.fc, self.act = nn.Linear(IN, OUT), nn.Hardsigmoid(inplace=inplace)

    def forward(self, x):
        h = self.fc(x)
        kept = h
        return kept - self.act(h)


@pytest.mark.parametrize("inplace", [False, True])
def test_inplace_of_a_module_whose_input_is_read_again_may_not_change(inplace):
    """`kept - act(h)` of the same h: whether act writes h decides whether `kept` is h or act(h) (0 or not). The
    program held what it was when fused, and a flipped `inplace` went unnoticed: eager's zeros, fused not (or the
    other way)."""
    model = ResidualAroundActivation(inplace).eval()
    optimized = fxfuse.optimize(model)
    x = rows()
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))
        model.act.inplace = not inplace
        with pytest.raises(RuntimeError, match="inplace was"):
            optimized(x)


def test_numpy_module_setting_changed_after_optimizing_raises():
    np = pytest.importorskip("numpy")
    model = nn.Sequential(nn.Linear(IN, OUT), nn.LeakyReLU(np.float32(0.1))).eval()
    optimized = fxfuse.optimize(model)
    model[1].negative_slope = np.float32(0.5)
    with pytest.raises(RuntimeError, match="negative_slope was 0.1"):
        optimized(rows())


def scale_then_relu_in_place(m, x, y):
    h = torch.tanh(m.fc(x))
    h.mul_(2.0)
    h.relu_()
    return h - 0.5


def three_in_place_ops(m, x, y):
    h = m.fc(x)
    h.mul_(3.0)
    h.relu_()
    h += 1.0
    return h * 2.0


@pytest.mark.parametrize("epilogue", [scale_then_relu_in_place, three_in_place_ops])
def test_in_place_ops_one_after_another_on_one_tensor_fuse_in_order(epilogue):
    """Each in-place op takes the tensor's later readers over from the one before it: what reads it after both
    reads the last one's result."""
    optimized = assert_whole_chain_fused(GemmThen(epilogue), (rows(),))
    assert "relu" in fused_programs(optimized)[0]


class FrozenFeatures(nn.Module):
    """Features computed without gradients, then a head: nothing of it fuses (a Linear alone)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Linear(IN, OUT)
        self.head = nn.Linear(OUT, OUT)

    def forward(self, x):
        with torch.no_grad():
            h = self.features(x)
        return self.head(F.dropout(h, 0.5, training=self.training))


def test_model_with_nothing_to_fuse_keeps_its_own_forward():
    """A trace would fix what Python decided while tracing (the no_grad block, `training=self.training`): where
    nothing fuses, optimize() returns the model's own forward."""
    model = FrozenFeatures().eval()
    optimized = fxfuse.optimize(model, (rows(),))
    assert fused_op_count(optimized) == 0 and type(optimized) is FrozenFeatures
    x = rows()
    optimized(x).sum().backward()
    assert model.features.weight.grad is None and model.head.weight.grad is not None
    model.train(), optimized.train()
    torch.manual_seed(0)
    a = optimized(x)
    torch.manual_seed(0)
    assert_close_report(a, model(x))  # dropout is on in train mode, as in eager


# ---------------------------------------------------------------- what an fx trace would fix or drop

class DropoutByMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x):
        return F.dropout(F.gelu(self.fc(x)), 0.5, training=self.training)


def test_a_graph_that_fixed_self_training_refuses_the_other_mode():
    """`F.dropout(..., training=self.training)` is traced with the mode of that moment: after a switch the
    optimized model raises instead of dropping (or not) as the old mode did."""
    model, x = DropoutByMode().eval(), rows()
    optimized = fxfuse.optimize(model, (x,))
    assert_close_report(optimized(x), model(x))
    optimized.train()
    with pytest.raises(RuntimeError, match="was in eval mode when the model was optimized"):
        optimized(x)
    optimized.eval()
    assert_close_report(optimized(x), model.eval()(x))


class DropoutOfAFixedMode(nn.Module):
    """F.dropout with a constant `training`: off (a no-op), or on in both modes (Monte Carlo dropout)."""

    def __init__(self, training: bool):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.dropout_training = training

    def forward(self, x):
        return F.dropout(F.gelu(self.fc(x)), 0.5, training=self.dropout_training)


@pytest.mark.parametrize("dropout_training", [False, True], ids=["dropout-off", "monte-carlo-dropout"])
def test_a_graph_whose_dropout_mode_is_a_constant_runs_in_either_mode(dropout_training):
    """`training=False` (or `True`) that is no module's `self.training` is the same in both modes: the optimized model
    raised "was in train mode when the model was optimized" after `.eval()`, where eager runs."""
    model, x = DropoutOfAFixedMode(dropout_training).train(dropout_training), rows()  # (the constant is the mode)
    optimized = fxfuse.optimize(model, (x,))
    assert fused_op_count(optimized) == 1
    for mode in (not dropout_training, dropout_training):
        model.train(mode), optimized.train(mode)
        torch.manual_seed(0)
        expected = model(x)
        torch.manual_seed(0)
        assert_close_report(optimized(x), expected)


class OptionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x, mask=None):
        h = F.gelu(self.fc(x))
        if mask is not None:
            h = h * mask
        return h


def test_an_argument_left_out_of_the_example_inputs_is_traced_as_its_none_default():
    """The trace would otherwise take `mask is not None` for a tensor and fuse it as a param; fx checks at every
    call that it is still None."""
    model, x = OptionalMask(), rows()
    optimized = fxfuse.optimize(model, (x,))
    assert fused_programs(optimized) == ["gelu(%0,'none')"]
    assert_close_report(optimized(x), model(x))
    with pytest.raises(AssertionError, match="mask has been specialized to have value None"):
        optimized(x, torch.ones(OUT))



def test_an_argument_that_defaults_to_none_given_a_tensor_computes_eagers_result_for_none():
    """Given a tensor, `mask` was traced as one and took the `is not None` branch; a later call with None raised
    fxfuse's error where eager runs the other branch. For None the optimized model runs the model's own forward (its
    class's code on the optimized model's children, tensors and attributes), in copies too; a tensor still runs the
    fused op. (The guard runs before any op: nothing ran twice.)"""
    model, x, mask = OptionalMask().eval(), rows(), torch.rand(OUT)
    optimized = fxfuse.optimize(model, (x, torch.ones(OUT)))
    assert fused_programs(optimized) == ["gelu(%0,'none');mul(%1,$0)"]
    with torch.no_grad():
        for each in (optimized, copy.deepcopy(optimized), pickle.loads(pickle.dumps(optimized))):
            assert_close_report(each(x, mask), model(x, mask))
            assert_close_report(each(x), model(x))
            assert_close_report(each(x, mask=None), model(x))


class ScaledOptionalMask(nn.Module):
    """For None its code runs the same ops on other values (`h * self.scale`, not `h * mask`), and calls a method."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.scale = 3.0

    def forward(self, x, mask=None):
        h = F.gelu(self.fc(x))
        if mask is not None:
            return h * mask
        return self.rescaled(h)

    def rescaled(self, h):
        return h * self.scale


def test_an_argument_whose_none_runs_the_same_ops_on_other_values_is_guarded():
    """The traces with a tensor and with None were compared by their ops alone (two muls): a call with None ran
    `h * None` (TypeError), and without example inputs the graph was fused for a tensor. Compared with what each op
    reads, None runs the model's own forward; without example inputs the model is left to its children."""
    model, x, mask = ScaledOptionalMask().eval(), rows(), torch.rand(OUT)
    optimized = fxfuse.optimize(model, (x, torch.ones(OUT)))
    assert fused_programs(optimized) == ["gelu(%0,'none');mul(%1,$0)"]
    with torch.no_grad():
        for each in (optimized, copy.deepcopy(optimized), pickle.loads(pickle.dumps(optimized))):
            assert_close_report(each(x, mask), model(x, mask))
            assert_close_report(each(x), model(x))
        unguessed = fxfuse.optimize(model)
        assert any("runs other code for `mask`" in row.reason for row in unguessed.fxfuse_report.skipped)
        assert_close_report(unguessed(x), model(x))


def test_a_call_that_runs_the_models_forward_runs_the_roots_hooks_once():
    model, x = OptionalMask().eval(), rows()
    optimized = fxfuse.optimize(model, (x, torch.ones(OUT)))
    calls = []
    optimized.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    optimized.register_forward_hook(lambda module, args, output: calls.append("post"))
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))
    assert calls == ["pre", "post"]


@pytest.mark.parametrize("hook", ["forward hook", "forward pre-hook"])
def test_a_module_with_hooks_is_not_fused(hook):
    model, x = nn.Sequential(nn.Linear(IN, OUT), nn.ReLU()), rows()
    if hook == "forward hook":
        model[0].register_forward_hook(lambda module, args, out: out - 100.0)
    else:
        model[1].register_forward_pre_hook(lambda module, args: (args[0] + 100.0,))
    optimized = fxfuse.optimize(model, (x,))
    assert_close_report(optimized(x), model(x))
    assert any("which a fused op would not run" in reason for reason in reasons(optimized))


def test_the_root_modules_hooks_run_around_the_optimized_forward():
    model, x = nn.Sequential(nn.Linear(IN, OUT), nn.ReLU()), rows()
    model.register_forward_hook(lambda module, args, out: out + 5.0)
    optimized = fxfuse.optimize(model, (x,))
    assert fused_op_count(optimized) == 1
    assert_close_report(optimized(x), model(x))


def test_shapes_on_fake_tensors_leave_no_fake_attribute_behind():
    """The old weight_norm's pre-hook sets `weight` as a plain attribute on every call: on the fake run too."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nn.Sequential(nn.utils.weight_norm(nn.Linear(IN, OUT)), nn.ReLU())
    x = rows()
    fxfuse.explain(model, (x,))
    optimized = fxfuse.optimize(model, (x,))
    assert type(model[0].weight) is torch.Tensor
    assert_close_report(optimized(x), model(x))


class InferenceModeInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x):
        h = self.fc(x)
        with torch.inference_mode():
            m = h.amax(-1, keepdim=True)
        return torch.relu(h) * 2.0 + m.clone()


def test_an_inference_mode_block_is_a_mode_switch_too():
    model, x = InferenceModeInside(), rows()
    optimized = fxfuse.optimize(model, (x,))
    (skipped,) = optimized.fxfuse_report.skipped
    assert "switches inference mode" in skipped.reason, skipped.reason


def test_batch_norm_without_running_statistics_is_not_fused_and_says_why():
    model = nn.Sequential(nn.Linear(IN, OUT), nn.BatchNorm1d(OUT, track_running_stats=False), nn.ReLU()).eval()
    assert_not_fused(model, (rows(),), reason="batch_norm without running statistics normalizes over the batch")


class MutatesAnEarlierRegionsValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(IN, OUT), nn.Linear(IN, OUT)

    def forward(self, x):
        a = self.fc1(x) * 3      # the first region
        b = self.fc2(x) + a      # the second reads a ...
        a.mul_(2)                # ... which changes here ...
        return torch.tanh(b), a  # ... before the second region's last op


def test_an_in_place_op_on_an_earlier_regions_value_between_a_later_regions_ops():
    """The second region must not run where its tanh was, after the mul_ (it did: the in-place record still named
    the first region's replaced node)."""
    model, x = MutatesAnEarlierRegionsValue().eval(), rows()
    optimized = fxfuse.optimize(model, (x,))
    with torch.no_grad():
        for actual, expected in zip(optimized(x), model(x)):
            assert_close_report(actual, expected)


class UnusedEpilogue(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.aux_bias = nn.Parameter(torch.randn(OUT))

    def forward(self, x):
        h = self.fc(x)
        aux = h + self.aux_bias  # noqa: F841  (computed, never used)
        return torch.relu(h)


def test_an_unused_epilogue_op_leaves_its_params_without_a_gradient():
    """Eager gives aux_bias no gradient (None: an optimizer with weight decay leaves it alone); a region that took
    the unused add in gave it zeros."""
    model = UnusedEpilogue()
    optimized = fxfuse.optimize(model, (rows(),))
    assert fused_programs(optimized) == ["relu(%0)"]
    optimized(rows()).sum().backward()
    assert model.aux_bias.grad is None and model.fc.weight.grad is not None


@pytest.mark.parametrize("unused", [
    lambda m, h: h + torch.ones(OUT + 1),            # another width: eager raises
    lambda m, h: F.layer_norm(h, (OUT + 1,)),
    lambda m, h: h.softmax(5),                       # no dim 5
    lambda m, h: F.gelu(h, approximate="bad"),       # a pointwise op of numbers alone, but a bad text attribute
], ids=["add", "layer_norm", "softmax", "gelu"])
@pytest.mark.parametrize("with_example_inputs", [True, False])
def test_an_unused_op_that_eager_raises_for_still_raises(unused, with_example_inputs):
    """An unused epilogue op is dropped only where it ran on the example inputs: one that raises was dropped, and
    the optimized model returned a result."""
    def forward(m, x, y):
        h = m.fc(x)
        unused(m, h)
        return torch.relu(h)

    model = GemmThen(forward).eval()
    optimized = fxfuse.optimize(model, (rows(), None) if with_example_inputs else None)
    for candidate in (model, optimized):
        with pytest.raises((RuntimeError, IndexError)):
            candidate(rows(), None)


# ---------------------------------------------------------------- spellings whose settings or effects matter (review)

def test_relu6_module_computes_with_its_own_bounds():
    """nn.ReLU6 runs Hardtanh's forward with its min_val and max_val (it was fused as a fixed relu6)."""
    act = nn.ReLU6()
    act.max_val = 8.0
    model = GemmThen(lambda m, x, y: m.act(m.fc(x) * 10), act=act).eval()
    optimized = assert_whole_chain_fused(model, (rows(),))
    assert fused_programs(optimized) == ["mul(%0,10);hardtanh(%1,0.0,8.0)"]


def test_instance_norm_with_running_statistics_is_not_fused():
    """F.instance_norm updates running_mean / running_var in place; the fused layer_norm would not."""
    model = GemmThen(lambda m, x, y: F.instance_norm(m.fc(x), m.mean, m.var), mean=torch.zeros(4),
                     var=torch.ones(4)).eval()
    assert_not_fused(model, (torch.randn(2, 4, IN),), reason="updates its running statistics in place")


@pytest.mark.parametrize("kind", ["full backward hook", "backward pre-hook"])
def test_a_module_with_backward_hooks_is_not_folded(kind):
    calls = []
    act = nn.ReLU()
    register = act.register_full_backward_hook if kind == "full backward hook" else act.register_full_backward_pre_hook
    register(lambda *args: calls.append(1))
    model, x = GemmThen(lambda m, x, y: m.act(m.fc(x)), act=act).train(), rows()
    optimized = fxfuse.optimize(model, (x,))
    assert fused_op_count(optimized) == 0
    optimized(x).sum().backward()
    assert calls == [1]


class AddsARowInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.register_buffer("row", torch.randn(1, OUT))

    def forward(self, x):
        return self.fc(x).relu().add_(self.row)


@pytest.mark.parametrize("example_inputs", ["none", "given"])
def test_an_in_place_op_on_an_unbatched_linears_output_raises_as_eager_does(example_inputs):
    """nn.Linear takes a 1-D input: h.add_(row) with a (1, N) row can't grow h from (N,) to (1, N), and eager
    raises; the fused op, computing out of place, returned a (1, N) result. (With the 1-D example input the shapes
    run raises too, so the rank is unknown either way.)"""
    model, x = AddsARowInPlace().eval(), torch.randn(IN)
    optimized = fxfuse.optimize(model, None if example_inputs == "none" else (x,))
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        model(x)
    with torch.no_grad(), pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        optimized(x)
    batch = rows()
    with torch.no_grad():
        assert_close_report(optimized(batch), model(batch))


class InPlaceScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x, scale):
        return self.fc(x).mul_(scale)


def test_an_in_place_op_keeps_the_mutated_values_dtype():
    """h.mul_(scale) with a float64 scale stays float32, where an out-of-place mul would promote; without example
    inputs the scale's dtype is unknown, so it is not fused."""
    model, x = InPlaceScale().eval(), rows()
    scale = torch.full((OUT,), 0.1, dtype=torch.float64)
    with torch.no_grad():
        for example_inputs in ((x, scale), None):
            result = fxfuse.optimize(model, example_inputs)(x, scale)
            assert result.dtype == torch.float32
            assert_close_report(result, model(x, scale))


class MutatesAnOperandAfterTheRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.shift = nn.Parameter(torch.randn(OUT))

    def forward(self, x):
        r = self.shift * 2
        out = torch.relu(self.fc(x)) + r  # eager's add keeps nothing of r for its backward
        r.mul_(0.5)
        return out


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_an_operand_changed_in_place_after_the_region_does_not_break_the_backward(mode):
    """The fused op keeps its epilogue operands for its backward: one changed in place later made its backward
    raise ("modified by an inplace operation") where eager's does not."""
    model, x = getattr(MutatesAnOperandAfterTheRegion(), mode)(), rows().requires_grad_()
    optimized = fxfuse.optimize(model, (x,))
    optimized(x).sum().backward()
    assert_reason(optimized, "after the region, whose fused op keeps it for its backward")


# ---------------------------------------------------------------- what a trace would freeze (review)

class MaskedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.act = nn.Sequential(nn.Linear(OUT, OUT), nn.ReLU())

    def forward(self, x, mask=None):
        h = self.act(torch.relu(self.fc(x)))
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        return h


def test_an_argument_that_defaults_to_none_and_picks_the_code_is_not_traced_without_example_inputs():
    """Traced as a tensor, `mask` took the masked_fill branch: the default call raised where eager runs. The
    model is left to its children, which run either way."""
    model, x = MaskedBlock().eval(), rows()
    optimized = fxfuse.optimize(model)
    assert any("runs other code for `mask`" in row.reason for row in optimized.fxfuse_report.skipped)
    assert fused_op_count(optimized) == 1  # act's linear and relu
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))
        mask = torch.rand(BATCH, OUT) > 0.5
        assert_close_report(optimized(x, mask), model(x, mask))


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.capacity = 4

    def forward(self, x):
        return F.gelu(self.fc(x))

    def route_score(self, x):
        return self.fc(x).mean(-1)


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.expert = Expert()

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: the parent is not traced, its child is optimized alone
            x = x * 2
        k = self.expert.capacity
        return self.expert(x)[:k] + self.expert.route_score(x)[:k, None]


def test_a_fused_child_of_an_untraced_parent_keeps_its_attributes_and_methods():
    """The parent's own code read the child's plain attribute and called its method on the GraphModule that
    replaced the child: AttributeError, where eager runs."""
    model, x = Router().eval(), rows()
    optimized = fxfuse.optimize(model, (x,))
    assert fused_op_count(optimized.expert) == 1
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))
        assert_close_report(copy.deepcopy(optimized)(x), model(x))


class ScalesItsBufferInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.register_buffer("scale", torch.ones(OUT))

    def forward(self, x):
        self.scale.mul_(0.5)
        return torch.relu(self.fc(x)) * self.scale


class ChangesItselfInForward(ScalesItsBufferInForward):
    def forward(self, x):
        self.last_input = x
        return super().forward(x)


def test_a_forward_that_changes_its_model_is_not_traced_and_the_model_stays_as_it_was():
    """An fx trace would run the attribute's assignment once, at trace time, and record nothing of it: the model
    is left to its children, and optimize() leaves its buffer and attributes as they were."""
    model, x = ChangesItselfInForward().eval(), rows()
    expected = copy.deepcopy(model)
    optimized = fxfuse.optimize(model, (x,))
    assert torch.equal(model.scale, torch.ones(OUT)) and not hasattr(model, "last_input")
    assert any("sets `last_input`" in row.reason for row in optimized.fxfuse_report.skipped)
    with torch.no_grad():
        for _ in range(2):
            assert_close_report(optimized(x), expected(x))



class CountsItsCallsInABuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls = self.calls + 1  # a new tensor for the buffer, not an in-place change of it
        return torch.relu(self.fc(x))


def test_a_forward_that_assigns_its_buffer_is_not_traced_and_the_buffer_stays_a_tensor():
    """The trace's assignment left an fx Proxy as the user's buffer, where eager then computed on with it."""
    model, x = CountsItsCallsInABuffer().eval(), rows()
    optimized = fxfuse.optimize(model, (x,))
    assert type(model.calls) is torch.Tensor and torch.equal(model.calls, torch.zeros(()))
    assert any("sets buffer `calls`" in row.reason for row in optimized.fxfuse_report.skipped)
    with torch.no_grad():
        assert_close_report(optimized(x), torch.relu(model.fc(x)))
    assert torch.equal(optimized.calls, torch.ones(()))

class ClampsItsInputThenBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.act = nn.Sequential(nn.Linear(OUT, OUT), nn.ReLU())

    def forward(self, x):
        x.clamp_(0.0, 0.5)
        if x.sum() > 0:  # data-dependent: no trace of the whole, its children are tried with the inputs they see
            return self.act(self.fc(x))
        return x


def test_the_run_that_finds_childrens_inputs_leaves_the_example_inputs_as_they_were():
    """That run called the forward on the user's example inputs, whose clamp_ changed them; it now stops before
    any write into an example input or a parameter, and the children are optimized without their inputs."""
    model, x = ClampsItsInputThenBranches().eval(), torch.rand(BATCH, IN)
    given = x.clone()
    optimized = fxfuse.optimize(model, (x,))
    assert torch.equal(x, given)
    assert fused_op_count(optimized) == 1  # act's linear and relu
    with torch.no_grad():
        assert_close_report(optimized(x.clone()), model(x.clone()))


def test_a_buffer_changed_in_place_by_the_forward_is_a_step_of_the_graph():
    """The trace reads buffers as graph values: the buffer's mul_ runs at each call, as in eager, and not once
    while tracing; optimize() leaves the buffer as it was."""
    model, x = ScalesItsBufferInForward().eval(), rows()
    expected = copy.deepcopy(model)
    optimized = fxfuse.optimize(model, (x,))
    assert torch.equal(model.scale, torch.ones(OUT))
    assert fused_op_count(optimized) == 1
    with torch.no_grad():
        for _ in range(3):
            assert_close_report(optimized(x), expected(x))
    assert torch.equal(model.scale, expected.scale)


class ScaledByABufferExpression(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.register_buffer("log_scale", torch.zeros(OUT))

    def forward(self, x):
        return torch.relu(self.fc(x)) * self.log_scale.exp()


@pytest.mark.parametrize("change", ["load_state_dict", "bfloat16"])
def test_an_expression_of_a_buffer_follows_the_buffer(change):
    """fx's trace ran `self.log_scale.exp()` once and kept the result as a constant: a checkpoint loaded later, or
    the model cast to bf16, did not reach the fused op's operand (a stale scale; an fp32 result)."""
    model, x = ScaledByABufferExpression().eval(), rows()
    optimized = fxfuse.optimize(model, (x,))
    assert fused_op_count(optimized) == 1
    if change == "load_state_dict":
        model.load_state_dict({**model.state_dict(), "log_scale": torch.linspace(-1.0, 1.0, OUT)})
    else:
        model.bfloat16()
        optimized.bfloat16()
        x = x.bfloat16()
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))


class DropoutByTorchBuiltin(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(IN, OUT), nn.Linear(OUT, OUT)

    def forward(self, x):
        return torch.tanh(self.out(torch.dropout(torch.relu(self.fc(x)), 0.5, self.training)))


def test_a_graph_that_fixed_torch_dropouts_train_argument_raises_in_the_other_mode():
    model = DropoutByTorchBuiltin().train()
    optimized = fxfuse.optimize(model, (rows(),))
    optimized.eval()
    with pytest.raises(RuntimeError, match="was in train mode when the model was optimized"):
        optimized(rows())


class ScalesInTraining(nn.Module):
    """A Python branch on self.training (stochastic depth, an auxiliary term): the trace keeps the branch it took."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x):
        h = self.fc(x)
        if self.training:
            h = h * 0.5
        return torch.relu(h)


def skip_unless_training(x, training):
    return x + 1.0 if training else x


class ChildScalesInTraining(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.fc = ScalesInTraining(), nn.Linear(OUT, OUT)

    def forward(self, x):
        return torch.tanh(skip_unless_training(self.fc(self.block(x)), self.fc.training))


@pytest.mark.parametrize("model_class", [ScalesInTraining, ChildScalesInTraining])
@pytest.mark.parametrize("traced_in", ["eval", "train"])
def test_a_forward_that_reads_self_training_in_python_raises_in_the_other_mode(model_class, traced_in):
    """`if self.training:` (or self.training passed to a helper that branches on it) is decided once, at trace time:
    after optimized.train() (or .eval()) the optimized model ran the other mode's code silently."""
    model = getattr(model_class(), traced_in)()
    optimized = fxfuse.optimize(model, (rows(),))
    assert fused_op_count(optimized) >= 1
    x = rows()
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))
    optimized.train(traced_in == "eval")
    with pytest.raises(RuntimeError, match=f"was in {traced_in} mode when the model was optimized"):
        optimized(x)


def test_a_forward_that_does_not_read_self_training_still_changes_mode():
    model = GemmThen(lambda m, x, y: torch.relu(m.fc(x))).eval()
    optimized = fxfuse.optimize(model, (rows(),))
    assert optimized.traced_training is None
    optimized.train()
    x = rows()
    assert_close_report(optimized(x), model(x))


def test_optimizing_an_optimized_model_keeps_its_mode_guard():
    model = DropoutByTorchBuiltin().train()
    twice = fxfuse.optimize(fxfuse.optimize(model, (rows(),)), (rows(),))
    assert twice.traced_training is not None
    twice.eval()
    with pytest.raises(RuntimeError, match="was in train mode when the model was optimized"):
        twice(rows())


def test_rrelu_in_training_mode_is_not_fused():
    model = nn.Sequential(nn.Linear(IN, OUT), nn.RReLU()).train()
    optimized = fxfuse.optimize(model, (rows(),))
    assert not optimized.fxfuse_report.fused
    assert_reason(optimized, "rrelu in training mode draws a random slope")


def test_an_rrelu_module_fused_in_eval_mode_raises_in_train_mode():
    """Its fused slope is eval mode's: in train mode eager draws random slopes (the optimized model ran eval's)."""
    model = nn.Sequential(nn.Linear(IN, OUT), nn.RReLU(), nn.ReLU()).eval()
    optimized = assert_whole_chain_fused(model, (rows(),))
    model.train()
    with pytest.raises(RuntimeError, match="was in eval mode when it was fused"):
        optimized(rows())


def test_rrelu_with_bounds_eager_refuses_is_not_fused_and_raises_as_eager():
    model = GemmThen(lambda m, x, y: F.rrelu(m.fc(x), 0.5, 0.1))
    optimized = fxfuse.optimize(model)
    assert not optimized.fxfuse_report.fused
    assert_reason(optimized, "not finite with lower <= upper (eager raises)")
    with pytest.raises(RuntimeError, match="Lower bound should be less than or equal to the upper bound"):
        optimized(rows())


def test_softshrink_with_a_lambd_eager_refuses_is_not_fused_and_raises_as_eager():
    model = GemmThen(lambda m, x, y: F.softshrink(m.fc(x), -0.5))
    optimized = fxfuse.optimize(model)
    assert not optimized.fxfuse_report.fused
    assert_reason(optimized, "softshrink's lambd=-0.5 is outside [0, 65504]")
    with pytest.raises(RuntimeError, match="lambda must be in range"):
        optimized(rows())


def test_an_optimized_child_keeps_its_guards_inside_an_optimized_parent():
    """The parent's trace ran the child's mode and settings checks once, at trace time, and kept none of them."""
    block = nn.Sequential(nn.Linear(IN, OUT), nn.Dropout(0.5), nn.ReLU()).eval()
    net = nn.Sequential(fxfuse.optimize(block, (rows(),)), nn.Linear(OUT, OUT), nn.Tanh()).eval()
    optimized = fxfuse.optimize(net, (rows(),))
    optimized.train()
    with pytest.raises(RuntimeError, match="was in eval mode when it was fused"):
        optimized(rows())


def test_a_roots_hook_that_reads_a_plain_attribute_of_the_model_runs():
    """The optimized model had none of the model's plain attributes: the hook raised AttributeError."""
    model = nn.Sequential(nn.Linear(IN, OUT), nn.ReLU()).eval()
    model.scale = 2.0
    model.register_forward_pre_hook(lambda module, args: (args[0] * module.scale,))
    optimized = assert_whole_chain_fused(model, (rows(),))
    assert optimized.scale == 2.0


def test_a_deep_copy_keeps_the_plain_attributes_the_roots_hooks_read():
    """GraphModule's deepcopy keeps only what the graph reads: the copy's hook raised AttributeError for `scale`."""
    model, x = nn.Sequential(nn.Linear(IN, OUT), nn.ReLU()).eval(), rows()
    model.scale = 2.0
    model.register_forward_hook(lambda module, args, output: output * module.scale)
    copied = copy.deepcopy(fxfuse.optimize(model, (x,)))
    assert fused_op_count(copied) == 1
    with torch.no_grad():
        assert_close_report(copied(x), model(x))


def test_the_roots_state_dict_hooks_run_around_the_optimized_model():
    model = nn.Sequential(nn.Linear(IN, OUT), nn.ReLU()).eval()
    legacy = {"fc.weight": model[0].weight.detach().clone(), "fc.bias": model[0].bias.detach().clone()}

    def rename_legacy_keys(state_dict, prefix, *args):
        for old, new in (("fc.weight", "0.weight"), ("fc.bias", "0.bias")):
            if prefix + old in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)

    model._register_load_state_dict_pre_hook(rename_legacy_keys)
    optimized = fxfuse.optimize(model, (rows(),))
    optimized.load_state_dict(legacy)


@pytest.mark.parametrize("example_inputs", ["x", "x and None"])
def test_an_argument_traced_as_none_keeps_its_name_and_a_none_example_input_is_none(example_inputs):
    """With example inputs (x,), optimize(model)(x, mask=None) raised (fx named the input mask_1); with (x, None)
    the mask was traced as a tensor and optimize(model)(x) raised."""
    model, x = OptionalMask().eval(), rows()
    optimized = fxfuse.optimize(model, (x,) if example_inputs == "x" else (x, None))
    assert fused_op_count(optimized) == 1
    with torch.no_grad():
        for call in (lambda m: m(x), lambda m: m(x, None), lambda m: m(x, mask=None)):
            assert_close_report(call(optimized), call(model))


def test_a_hook_added_to_a_folded_module_after_optimizing_raises():
    model = nn.Sequential(nn.Linear(IN, OUT), nn.ReLU()).eval()
    optimized = fxfuse.optimize(model, (rows(),))
    model[1].register_forward_hook(lambda module, args, out: out * 0)
    with pytest.raises(RuntimeError, match="has forward hooks now, which its fused op would skip"):
        optimized(rows())


class LinearWithShift(nn.Linear):  # a LoRA-style adapter: a Linear whose forward adds something
    def forward(self, x):
        return super().forward(x) + 1.0


def replace_activation(optimized):
    optimized.add_module("1", nn.Tanh())


def replace_linear(optimized):
    shifted = LinearWithShift(IN, OUT)
    shifted.load_state_dict(optimized.get_submodule("0").state_dict())
    optimized.add_module("0", shifted)


def give_activation_a_forward(optimized):
    optimized.get_submodule("1").forward = torch.tanh


@pytest.mark.parametrize("change", [replace_activation, replace_linear, give_activation_a_forward])
def test_a_folded_module_replaced_after_optimizing_raises(change):
    """A module folded into a fused op must still be of its class, with the class's forward (a swapped ReLU or a
    Linear subclass ran as the program said, silently)."""
    model = nn.Sequential(nn.Linear(IN, OUT), nn.ReLU()).eval()
    optimized = fxfuse.optimize(model, (rows(),))
    change(optimized)
    with pytest.raises(RuntimeError, match="when it was fused and is now a"):
        optimized(rows())


def set_norm_eps(model):
    model[1].eps = 1.0


def give_linear_a_bias(model):
    model[0].bias = nn.Parameter(torch.ones(OUT))


def give_norm_a_weight(model):
    model[1].weight = nn.Parameter(torch.full((OUT,), -1.0))


@pytest.mark.parametrize("change", [set_norm_eps, give_linear_a_bias, give_norm_a_weight])
def test_a_setting_or_tensor_that_was_none_when_fused_is_guarded(change):
    """RMSNorm's eps of None (the dtype's epsilon), a Linear without a bias, a norm without affine: the program
    leaves them out, so setting one later must raise like any other changed setting."""
    norm = nn.RMSNorm(OUT, elementwise_affine=False) if change is not give_norm_a_weight else \
        nn.LayerNorm(OUT, elementwise_affine=False)
    model = nn.Sequential(nn.Linear(IN, OUT, bias=False), norm).eval()
    optimized = fxfuse.optimize(model, (rows(),))
    assert fused_op_count(optimized) == 1
    change(model)
    with pytest.raises(RuntimeError, match="was None when it was fused"):
        optimized(rows())


def drop_norm_weight(model):
    model[1].weight = None


def drop_norm_bias(model):
    model[1].bias = None


def drop_running_statistics(model):
    model[1].running_mean, model[1].running_var = None, None


@pytest.mark.parametrize("norm, change", [
    (nn.LayerNorm(OUT), drop_norm_weight),
    (nn.GroupNorm(4, OUT), drop_norm_bias),
    (nn.BatchNorm1d(OUT), drop_running_statistics),
], ids=["layer_norm-weight", "group_norm-bias", "batch_norm-statistics"])
def test_a_tensor_that_a_fused_op_reads_set_to_none_later_is_guarded(norm, change):
    """A folded module's weight, bias or statistics set to None after optimizing reached the fused op, whose schema
    raised ("Expected a value of type 'List[Tensor]' for argument 'params'") where eager computes without it."""
    model = nn.Sequential(nn.Linear(IN, OUT), norm).eval()
    optimized = fxfuse.optimize(model, (rows(),))
    assert fused_op_count(optimized) == 1
    change(model)
    with pytest.raises(RuntimeError, match="was a tensor when it was fused and is now None"):
        optimized(rows())



class RootBias(nn.Module):
    """A parameter of the root's own, read by a fused op (a graph get_attr of the root, folded into no module)."""

    def __init__(self, spelling):
        super().__init__()
        self.fc, self.spelling = nn.Linear(IN, OUT), spelling
        self.bias = nn.Parameter(torch.randn(OUT))

    def forward(self, x):
        h = self.fc(x)
        if self.spelling == "+":
            h = h + self.bias
        elif self.spelling == "reflected":
            h = self.bias + h
        elif self.spelling == "torch.add":
            h = torch.add(h, other=self.bias)
        else:
            h = h.mul(self.bias)
        return torch.relu(h)


class ScaledBy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x, scale=None):
        return torch.relu(self.fc(x)) * scale


def raised(function, *args):
    try:
        function(*args)
    except Exception as error:
        return type(error), str(error)
    raise AssertionError("no error raised")


@pytest.mark.parametrize("spelling", ["+", "reflected", "torch.add", ".mul"])
def test_a_root_tensor_that_a_fused_op_reads_set_to_none_later_raises_eagers_error(spelling):
    """`o.bias = None` for the root's own parameter, which the fused op reads as a param: the op schema's error
    ("Expected a value of type 'List[Tensor]' for argument 'params'") where eager raises TypeError from `h + None`."""
    model, x = RootBias(spelling).eval(), rows()
    optimized = fxfuse.optimize(model, (x,))
    assert fused_op_count(optimized) == 1
    optimized.bias = model.bias = None
    assert raised(optimized, x) == raised(model, x)


def test_a_forward_argument_read_by_a_fused_op_given_none_raises_eagers_error():
    """An argument that defaults to None but picks no code, given a tensor in the example inputs and None later:
    eager's `h * None` raises TypeError, which the fused op's schema error stood for."""
    model, x = ScaledBy().eval(), rows()
    optimized = fxfuse.optimize(model, (x, torch.ones(OUT)))
    assert fused_op_count(optimized) == 1
    assert raised(optimized, x) == raised(model, x)


class LinearReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x):
        return torch.relu(self.fc(x))


class BlockThenScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.other = LinearReLU(), LinearReLU()

    def forward(self, x):
        return self.block(x) * 2.0 + self.other(x)


class KeepsItsNormInEval(nn.Module):
    """mmdetection's `norm_eval`: the class's train() keeps its BatchNorm in eval mode."""

    def __init__(self):
        super().__init__()
        self.bn, self.block = nn.BatchNorm1d(IN), LinearReLU()

    def forward(self, x):
        return self.block(self.bn(x))

    def train(self, mode=True):
        super().train(mode)
        self.bn.eval()
        return self


def test_a_model_whose_class_overrides_train_keeps_its_train():
    """The optimized model, a GraphModule, ran nn.Module.train: after optimized.train() its BatchNorm normalized over
    the batch and updated the model's running statistics, where the class's train() keeps it in eval. Such a model is
    left to its children, which are optimized."""
    model = KeepsItsNormInEval()
    model.bn.running_mean.normal_()
    reference = copy.deepcopy(model).train()
    optimized = fxfuse.optimize(model.eval(), (rows(),))
    assert fused_op_count(optimized) == 1
    assert_reason(optimized, "its class overrides train()")
    optimized.train()
    assert not model.bn.training
    x = rows()
    assert_close_report(optimized(x), reference(x))
    assert torch.equal(model.bn.running_mean, reference.bn.running_mean)


def test_a_module_with_hooks_is_called_not_traced_through():
    """fx traces through a module of the user's: its hooks ran once, on proxies, and never again. It stays a call,
    whose hooks run at each call and never on the shapes run's fake tensors (once on the real run that learns what
    it returns); the rest still fuses."""
    model, seen = BlockThenScale().eval(), []
    model.block.register_forward_hook(lambda module, args, out: seen.append(type(out)) or out + 100.0)
    optimized = fxfuse.optimize(model, (rows(),))
    assert seen == [torch.Tensor] and fused_op_count(optimized) == 1  # `other`'s linear, relu and add
    x = rows()
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))
    assert seen == [torch.Tensor, torch.Tensor, torch.Tensor]


def test_a_hook_added_after_optimizing_to_a_module_traced_through_raises():
    model = BlockThenScale().eval()
    optimized = fxfuse.optimize(model, (rows(),))
    assert fused_op_count(optimized) == 2
    model.block.register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(RuntimeError, match="`block` has forward pre-hooks now; the optimized model runs its ops"):
        optimized(rows())


def add_into(t, b):
    t += b  # changes the caller's tensor: no rebinding it sees


class AddsInPlaceInAHelper(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.b = nn.Parameter(torch.full((OUT,), 10.0))

    def forward(self, x):
        h = self.fc(x)
        add_into(h, self.b)
        out = torch.relu(h)
        add_into(x, 1.0)  # after the region: between its ops, x would be read changed
        return out


def test_an_augmented_assignment_is_traced_as_the_in_place_op_it_is():
    """fx's Proxy has no `__iadd__`: `t += b` traced as `t = t + b`, lost on the caller's h (the fused op gave
    relu(h) without b) and on the caller's x."""
    model = AddsInPlaceInAHelper().eval()
    optimized = fxfuse.optimize(model, (rows(),))
    assert fused_programs(optimized) == ["add_(%0,$0);relu(%1)"]
    expected_input = rows()
    actual_input = expected_input.clone()
    with torch.no_grad():
        assert_close_report(optimized(actual_input), model(expected_input))
    assert torch.equal(actual_input, expected_input)  # both went up by one


def add_into_a_transpose(m, x, y):
    h = m.fc(x)
    t = h.T
    t += 1.0  # changes h through its view
    return torch.relu(m.fc2(h))


def subtract_from_the_values_of_a_max(m, x, y):
    h = m.fc(x).max(-1).values
    h -= y  # raises in eager where y would broadcast h to more dims
    return torch.relu(m.fc2(x)) + h.unsqueeze(-1)


def test_an_augmented_assignment_to_an_attribute_of_a_traced_tensor_is_in_place():
    """`t = h.T; t += 1` (an attribute's proxy, fx's Attribute, had no `__iadd__` of fxfuse's) was traced as
    `t = t + 1`: h was left unchanged, and fc2 read it so (a silent wrong result)."""
    model = GemmThen(add_into_a_transpose, fc2=nn.Linear(OUT, OUT)).eval()
    optimized = fxfuse.optimize(model, (rows(),))
    assert fused_op_count(optimized) == 1
    x = rows()
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))


def test_an_augmented_assignment_to_an_attribute_of_a_traced_tensor_raises_as_eager():
    """`h = t.max(-1).values; h -= y` with a y of more dims raises in eager (an in-place op keeps h's shape): it ran
    as `h - y`."""
    model = GemmThen(subtract_from_the_values_of_a_max, fc2=nn.Linear(IN, OUT)).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 2
    x, y = rows(), torch.randn(BATCH, 1)
    for candidate in (model, optimized):
        with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
            candidate(x, y)


class KeepsItsActivations(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.acts = []

    def forward(self, x):
        h = torch.relu(self.fc(x))
        self.acts.append(h)
        return h * 2.0


def test_a_forward_that_appends_to_its_models_list_is_not_traced():
    """The trace appended a proxy to the user's list once, and the optimized model never appended again."""
    model = KeepsItsActivations().eval()
    optimized = fxfuse.optimize(model, (rows(),))
    assert model.acts == []
    assert any("changes `acts` in place" in row.reason for row in optimized.fxfuse_report.skipped)
    optimized(rows())
    assert len(model.acts) == 1 and isinstance(model.acts[0], torch.Tensor)


@pytest.mark.parametrize("forward, traced_rank, other_shape", [
    (lambda m, x, y: F.instance_norm(m.fc(x)), 3, (2, 3, 5, IN)),      # normalizes over the spatial dims
    (lambda m, x, y: F.group_norm(m.fc(x), 4), 2, (2, 8, IN)),         # channels are dim 1
    (lambda m, x, y: torch.softmax(m.fc(x), dim=1), 2, (2, 3, IN)),    # dim 1 is the features of a 2-D value only
    (lambda m, x, y: torch.relu(m.fc(x)).amax(1, keepdim=True), 2, (2, 3, 5, IN)),
], ids=["instance_norm", "group_norm", "softmax over dim 1", "amax over dim 1"])
def test_a_program_that_holds_for_one_rank_computes_eagers_result_for_another(forward, traced_rank, other_shape):
    """The fx trace proves the rank from the example inputs and guarded nothing: a 4-D input to an instance_norm
    traced on 3-D ones gave layer_norm's result over the last dim (eager normalizes over the last two); then it
    raised fxfuse's error where eager computes. The rank of a forward argument is checked before any op, and for
    another the optimized model runs the model's own forward."""
    model = GemmThen(forward).eval()
    example = torch.randn(*([2] * (traced_rank - 1)), IN)
    optimized = fxfuse.optimize(model, (example,))
    assert fused_op_count(optimized) == 1
    other = torch.randn(other_shape)
    with torch.no_grad():
        assert_close_report(optimized(example), model(example))
        assert_close_report(optimized(other), model(other))


@pytest.mark.parametrize("forward, x, error", [
    (lambda m, x, y: torch.relu(m.fc(x)).amax(1, keepdim=True), torch.randn(IN), IndexError),
    (lambda m, x, y: torch.min(m.fc(x), dim=1)[0], torch.randn(IN), IndexError),
    (lambda m, x, y: F.group_norm(m.fc(x), 4), torch.randn(IN), RuntimeError),
    (lambda m, x, y: F.group_norm(m.fc(x), 4), torch.randn(2, 3, IN), RuntimeError),
    (lambda m, x, y: m.norm(m.fc(x)), torch.randn(2, 0, IN), RuntimeError),
], ids=["amax-of-1-D", "min-of-1-D", "group_norm-of-1-D", "group_norm-of-3-channels", "GroupNorm-of-0-channels"])
@pytest.mark.parametrize("example_inputs", [True, False], ids=["example-inputs", "no-example-inputs"])
def test_an_input_of_another_rank_raises_eagers_own_error(forward, x, error, example_inputs):
    """It raised fxfuse's RuntimeError ("optimized for a 2-D input"), where eager raises IndexError, or its own
    message."""
    model = GemmThen(forward, norm=nn.GroupNorm(4, OUT)).eval()
    optimized = fxfuse.optimize(model, (rows(),) if example_inputs else None)
    assert fused_op_count(optimized) == 1
    with pytest.raises(error) as eagers:
        model(x)
    with pytest.raises(error, match=re.escape(str(eagers.value))):
        optimized(x)


class TwoBlocks(nn.Module):
    """The second region's x is made inside the graph, by the first."""

    def __init__(self, epilogue):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(IN, OUT), nn.Linear(OUT, OUT)
        self.epilogue = epilogue

    def forward(self, x):
        return self.epilogue(self.fc2(torch.relu(self.fc1(x))))


@pytest.mark.parametrize("epilogue", [lambda h: F.group_norm(h, 4), lambda h: h.amax(1)], ids=["group_norm", "amax"])
def test_a_value_of_another_rank_made_inside_the_graph_computes_eagers_result(epilogue):
    """The rank of the second region's x follows from the input's: with example inputs, an input of another rank runs
    the model's own forward (it raised fxfuse's error where eager computes, or raises its own)."""
    model = TwoBlocks(epilogue).eval()
    optimized = fxfuse.optimize(model, (rows(),))
    assert fused_op_count(optimized) == 2
    with torch.no_grad():
        for x in (rows(), torch.randn(2, 8, IN), torch.randn(2, 4, 5, IN)):
            assert_close_report(optimized(x), model(x))
        with pytest.raises(type(_raised_by(model, torch.randn(IN)))) as raised:
            optimized(torch.randn(IN))
        assert str(raised.value) == str(_raised_by(model, torch.randn(IN)))


@pytest.mark.parametrize("model, second", [
    (GemmThen(lambda m, x, y: F.group_norm(m.fc(x + 1), 4)), None),
    (GemmThen(lambda m, x, y: m.fc(torch.relu(x) * m.scale).softmax(1), scale=torch.rand(IN)), None),
    (GemmThen(lambda m, x, y: m.fc(x * x.sum(-1, keepdim=True)).amax(1)), None),
    (GemmThen(lambda m, x, y: F.group_norm(m.fc(x + y), 4)), torch.randn(IN)),
    (GemmThen(lambda m, x, y: F.group_norm(m.fc(x + y), 4)), torch.randn(2, 1, IN)),
    (GemmThen(lambda m, x, y: m.fc(x.flatten(1)).amax(1)), None),
    (TwoBlocks(lambda h: F.group_norm(h, 4)), None),
], ids=["add", "pointwise-with-a-buffer", "keepdim-reduction", "two-arguments", "two-arguments-3d", "flatten",
        "two-blocks"])
def test_without_example_inputs_a_value_made_inside_the_graph_of_another_rank_gives_eagers_result(model, second):
    """Without example inputs, the rank of a fused op's x that pointwise ops, module tensors of fewer dims or GEMMs
    make of forward arguments is the most of theirs: another rank runs the model's own forward (it raised fxfuse's
    error, where eager computes or raises its own); `x.flatten(1)` is 2-D for any input that it takes."""
    model = model.eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == (2 if isinstance(model, TwoBlocks) else 1)
    with torch.no_grad():
        for x in (rows(), torch.randn(2, 8, IN), torch.randn(2, 4, 5, IN), torch.randn(IN)):
            inputs = (x,) if second is None else (x, second)
            try:
                expected = model(*inputs)
            except Exception as error:
                with pytest.raises(type(error), match=re.escape(str(error))):
                    optimized(*inputs)
                continue
            assert_close_report(optimized(*inputs), expected)


@pytest.mark.parametrize("pool, width", [
    (lambda m, h: F.avg_pool1d(torch.relu(h), 2), OUT // 2),
    (lambda m, h: m.pool(torch.relu(h)), OUT // 2),
    (lambda m, h: F.avg_pool1d(torch.relu(h).unsqueeze(1), 2).squeeze(1), OUT // 2),
    (lambda m, h: F.avg_pool1d(torch.relu(h), 2, stride=1), OUT - 1),
    (lambda m, h: F.avg_pool1d(torch.relu(h), 2, padding=1), OUT // 2 + 1),
    (lambda m, h: F.avg_pool1d(torch.relu(h).unsqueeze(1), 3, ceil_mode=True).squeeze(1), -(-OUT // 3)),
], ids=["F.avg_pool1d", "nn.AvgPool1d", "unsqueezed", "stride", "padding", "unsqueezed-ceil_mode"])
def test_without_example_inputs_a_pool_between_two_regions_keeps_its_inputs_rank(pool, width):
    """An average pool over the features that does not fold into the GEMM before it (it pools the relu's value, or
    its windows do not tile the features) makes a value of its input's rank, as the ops that keep their rank do: the
    second region's x follows from the input's, and an input of another rank runs the model's own forward (a 3-D one
    raised fxfuse's error where eager computes)."""
    model = GemmThen(lambda m, x, y: F.group_norm(m.fc2(pool(m, m.fc(x))), 4),
                     fc2=nn.Linear(width, OUT), pool=nn.AvgPool1d(2)).eval()
    optimized = fxfuse.optimize(model)
    assert fused_op_count(optimized) == 2
    with torch.no_grad():
        for x in (rows(), torch.randn(2, 8, IN), torch.randn(2, 4, 5, IN), torch.randn(IN)):
            try:
                expected = model(x)
            except Exception as error:
                with pytest.raises(type(error), match=re.escape(str(error))):
                    optimized(x)
                continue
            assert_close_report(optimized(x), expected)


def _raised_by(function, *args) -> Exception:
    try:
        function(*args)
    except Exception as error:
        return error
    raise AssertionError("it did not raise")


def test_a_value_whose_rank_does_not_follow_from_the_inputs_is_not_fused():
    """(x * w).squeeze() of a (1, 3, IN) example is 2-D, of a (2, 4, IN) input 3-D: a module tensor w may broadcast x
    to more dims, so the rank does not follow from x's sizes, and no example value of y gives the arguments' ranks to
    check before any op. A check before the fused op raised where eager computes: group_norm is not fused. (A
    squeeze of a forward argument, or of pointwise ops, squeezes and unsqueezes of it, is checked before any op, on
    its sizes: test_first_checks.py.)"""
    model = GemmThen(lambda m, x, y: F.group_norm(m.fc((x * m.fc.weight[0]).squeeze()), 4)).eval()
    optimized = fxfuse.optimize(model, (torch.randn(1, 3, IN),))
    assert fused_op_count(optimized) == 0
    assert_reason(optimized, "no check before the model's first op can tell the rank of `squeeze`")
    with torch.no_grad():
        x = torch.randn(2, 4, IN)
        assert_close_report(optimized(x), model(x))


def test_a_compiled_optimized_model_runs_the_models_forward_where_refused():
    """torch.compile of an optimized model traces the refusal and the model's own forward too."""
    model, x, mask = OptionalMask().eval(), rows(), torch.rand(OUT)
    compiled = torch.compile(fxfuse.optimize(model, (x, torch.ones(OUT))), backend="eager")
    with torch.no_grad():
        for args in ((x, mask), (x,), (torch.randn(2, 5, IN),)):
            assert_close_report(compiled(*args), model(*args))


class ChangesItsBufferFirst(nn.Module):
    """A forward that changes its buffer in place before the fused chain: a step of the graph."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return F.group_norm(self.fc(x), 4)


def test_a_call_that_runs_the_models_forward_runs_nothing_of_the_graph_first():
    model, x = ChangesItsBufferFirst().eval(), torch.randn(2, 8, IN)
    optimized = fxfuse.optimize(model, (rows(),))
    assert fused_op_count(optimized) == 1
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))
    assert model.calls.item() == 2


def test_a_weight_given_to_forward_of_another_rank_computes_eagers_result():
    """`x @ w` with w a forward argument: a 3-D w makes eager's matmul batched; the fused op takes one matrix, and
    raised fxfuse's error. The optimized model runs the model's own forward for it."""
    model = GemmThen(lambda m, x, y: torch.relu(x @ y)).eval()
    optimized = fxfuse.optimize(model, (rows(), torch.randn(IN, OUT)))
    assert fused_op_count(optimized) == 1
    x, w = torch.randn(2, BATCH, IN), torch.randn(2, IN, OUT)
    with torch.no_grad():
        assert_close_report(optimized(x, w), model(x, w))


class RebindsOtherNames(nn.Module):
    """`g @= w` and `n *= 2` make new objects in eager (a tensor has no `__imatmul__`; an int is immutable): the
    other names of g and n keep their values."""

    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(IN, OUT), nn.Linear(IN, OUT)
        self.w = nn.Parameter(torch.randn(OUT, OUT))

    def forward(self, x):
        h = self.fc(x)
        g, n = h, x.shape[0]
        rows = n
        g @= self.w
        n *= 2
        return (h + g + F.gelu(self.fc2(x))).reshape(rows, -1)[:, :n]


def test_an_augmented_assignment_leaves_other_names_alone():
    """fx writes operator.imatmul as `g @= w`, which then also changed what h named in the graph (2.995 apart)."""
    model, x = RebindsOtherNames().eval(), rows()
    optimized = fxfuse.optimize(model, (x,))
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))


class UnusedAdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(IN, OUT), nn.LayerNorm(OUT)
        self.b = nn.Parameter(torch.randn(OUT))

    def forward(self, x):
        h = self.fc(x)
        aux = h + self.b  # noqa: F841  (never used)
        return F.gelu(self.ln(h))


def test_an_unused_op_without_example_inputs_stays_out_of_the_region():
    """Not dropped without shapes (it may raise in eager), it was taken into the region, where b got zeros for a
    gradient (an AdamW step then changed it); eager gives None."""
    model = UnusedAdd().train()
    optimized = fxfuse.optimize(model)
    assert_reason(optimized, "the value of `add` is never used")
    optimized(rows()).sum().backward()
    assert model.b.grad is None


def test_an_op_over_a_dim_of_a_value_a_param_made_bigger_is_not_guarded_on_x():
    """softmax(dim=2) of fc(x) + a 3-D param: the value is 3-D for a 2-D x; the rank check took it for x's and
    raised on the example input itself."""
    model = GemmThen(lambda m, x, y: F.softmax(m.fc(x) + m.p, dim=2), p=nn.Parameter(torch.randn(2, BATCH, OUT)))
    x = rows()
    optimized = fxfuse.optimize(model.eval(), (x,))
    assert_reason(optimized, "depends on its value's rank, which a param of more dims")
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))


def test_an_op_over_a_dim_of_a_value_a_forward_argument_may_make_bigger_is_not_fused_without_example_inputs():
    """amax(1, keepdim=True) after amax(-1, keepdim=True) of max(fc(x), y), without example inputs: taken for an op
    over the features (one value, so dropped) of a value of x's rank, guarded by x's rank alone, where a 3-D y makes
    it 3-D and dim 1 a batch dim: the result kept that dim's size (3, 3, 1) where eager's is (3, 1, 1)."""
    model = GemmThen(lambda m, x, y: torch.maximum(m.fc(x), y).amax(-1, True).amax(1, True)).eval()
    x, y = rows(), torch.randn(3, BATCH, OUT)
    optimized = fxfuse.optimize(model)
    assert_reason(optimized, "depends on its value's rank, which an outside tensor of a rank not known")
    with torch.no_grad():
        assert_close_report(optimized(x, y), model(x, y))


class SpelledOutHardswish(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(4))
            self.fc.bias.zero_()

    def forward(self, x):
        h = self.fc(x)
        return h * F.relu6(h + 3.0) / 6.0


def test_an_fp32_only_idiom_computes_eagers_result_where_the_epilogue_computes_in_fp16():
    """Matched on fp32 example inputs, hardswish then ran under fp16 autocast (or after .half()), where eager's
    spelled-out formula overflows to inf and the fused op gave 20000; then it raised fxfuse's error where eager
    computes. The dtype is checked before any op, and in fp16 the optimized model runs the model's own forward."""
    model, x = SpelledOutHardswish().eval(), torch.tensor([[20000.0, 1.0, -1.0, 2.0]])
    optimized = fxfuse.optimize(model, (x,))
    assert fused_programs(optimized) == ["hardswish(%0)"]
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))
        with torch.autocast("cpu", dtype=torch.float16):
            assert torch.isinf(model(x)[0, 0])
            assert_close_report(optimized(x), model(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert_close_report(optimized(x), model(x))
        optimized.half()  # (its Linear is the model's)
        assert_close_report(optimized(x.half()), model(x.half()))


def test_a_dtype_checked_program_runs_on_meta_tensors():
    """require_dtype asked autocast about the meta device, which it does not know (eager runs there)."""
    model = SpelledOutHardswish().eval()
    optimized = fxfuse.optimize(model, (torch.randn(2, 4),)).to("meta")
    assert optimized(torch.empty(2, 4, device="meta")).shape == (2, 4)


def test_the_dtype_check_names_the_idioms_only(caplog):
    model = GemmThen(lambda m, x, y: (lambda h: h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))(m.fc(x) + 1))
    optimized = fxfuse.optimize(model.eval(), (rows(),))
    with torch.autocast("cpu", dtype=torch.float16), caplog.at_level(logging.DEBUG, logger="fxfuse"):
        optimized(rows())
    assert "its spelled-out rms_norm is that op; in float16 it is not" in caplog.text


def test_an_unused_op_of_numbers_only_is_dropped_without_example_inputs():
    """`h * 3`, never used, cannot raise and has no params: it goes, and the region fuses (a refusal of every unused
    op without shapes left this chain unfused)."""
    model = GemmThen(lambda m, x, y: (lambda h: (h * 3.0, torch.relu(h))[1])(m.fc(x))).eval()
    assert fused_programs(fxfuse.optimize(model)) == ["relu(%0)"]


class ChangesAnInputAfter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x, b, c):
        y = torch.relu(self.fc(x) + b)  # the fused op keeps b for its backward
        c.mul_(2.0)                     # another input, which may be b
        return y


def test_an_eval_model_keeps_what_its_backward_needs():
    """An eval-mode optimized model may still be differentiated (saliency): changing an input that may be what the
    fused op kept after it made backward raise where eager's did not."""
    model = ChangesAnInputAfter().eval()
    optimized = fxfuse.optimize(model, (rows(), torch.randn(OUT), torch.randn(OUT)))
    assert fused_op_count(optimized) == 0
    shared = torch.randn(OUT)
    x = rows().requires_grad_()
    optimized(x, shared, shared).sum().backward()


def test_a_model_left_unfused_is_a_copy_whose_registrations_leave_the_model_alone():
    model = nn.Sequential(nn.Linear(IN, OUT)).eval()
    optimized = fxfuse.optimize(model, (rows(),))
    assert fused_op_count(optimized) == 0
    optimized.register_forward_hook(lambda *args: None)
    optimized.register_buffer("extra", torch.zeros(1))
    assert not model._forward_hooks and "extra" not in model._buffers


class DropoutChildInTrainMode(nn.Module):
    """Monte Carlo dropout: the model in eval mode, its dropout child in train mode."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(IN, OUT), nn.Linear(OUT, OUT)
        self.drop = nn.Module()

    def forward(self, x):
        return torch.tanh(self.out(F.dropout(torch.relu(self.fc(x)), 0.5, training=self.drop.training)))


def test_a_graph_that_fixed_a_childs_mode_raises_when_that_child_changes_mode():
    model = DropoutChildInTrainMode().eval()
    model.drop.train()
    optimized = fxfuse.optimize(model, (rows(),))
    model.drop.eval()
    with pytest.raises(RuntimeError, match="`drop` was in train mode when the model was optimized"):
        optimized(rows())


class CallsItsChildWithAKeyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = OptionalMask()

    def forward(self, x):
        mask = torch.full((OUT,), 0.5)
        return self.block(x, mask=mask) if x.sum() > -1e9 else x  # data-dependent: fx can't trace the root


def test_a_child_called_with_a_keyword_argument_is_optimized_for_it():
    """The children's example inputs left keywords out: the child traced its mask as None, and the optimized model
    raised for block(x, mask=...)."""
    model, x = CallsItsChildWithAKeyword().eval(), rows()
    optimized = fxfuse.optimize(model, (x,))
    assert len(optimized.fxfuse_report.fused) == 1
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))


@pytest.mark.parametrize("spelling, program", [("torch.max(h, other=h.relu())", "relu(%0);maximum(%0,%1)"),
                                                ("h.min(other=h.relu())", "relu(%0);minimum(%0,%1)")])
def test_elementwise_max_with_the_other_tensor_by_keyword_fuses(spelling, program):
    epilogue = eval(f"lambda h: {spelling}", {"torch": torch})
    model = GemmThen(lambda m, x, y: epilogue(m.fc(x)))
    optimized = assert_whole_chain_fused(model, (rows(),))
    assert fused_programs(optimized) == [program]


def test_elementwise_max_of_two_tensors_is_maximum():
    model = GemmThen(lambda m, x, y: torch.max(m.fc(x), m.floor), floor=torch.randn(OUT))
    optimized = assert_whole_chain_fused(model, (rows(),))
    assert fused_programs(optimized) == ["maximum(%0,$0)"]


@pytest.mark.parametrize("spelling", ["torch.maximum(h, 0.5)", "torch.max(h, h, keepdim=True)",
                                      "torch.max(h, h, keepdim=False)", "torch.min(h, h, False)",
                                      "h.max(h, keepdim=False)", "torch.max(h, dim=h)", "h.min(dim=h)"])
def test_elementwise_max_that_eager_refuses_is_not_fused_and_raises_as_eager(spelling):
    epilogue = eval(f"lambda h: {spelling}", {"torch": torch})
    model = GemmThen(lambda m, x, y: epilogue(m.fc(x)))
    optimized = fxfuse.optimize(model)
    assert not optimized.fxfuse_report.fused
    with pytest.raises((TypeError, RuntimeError)):
        model(rows())
    with pytest.raises((TypeError, RuntimeError)):
        optimized(rows())


# ---------------------------------------------------------------- prelu's slopes: one, or one per channel (dim 1)

def test_prelu_of_a_3d_output_reads_its_slopes_along_dim_1_as_eager():
    """eager's prelu takes dim 1 as the channels: on a (batch, tokens, features) output, one slope per token."""
    model = GemmThen(lambda m, x, y: m.act(m.fc(x)), act=nn.PReLU(5, init=-0.5))
    optimized = assert_whole_chain_fused(model, (torch.randn(2, 5, IN),))
    assert fused_programs(optimized) == ["prelu(%0,$0)"]


@pytest.mark.parametrize("slopes, example, called", [
    (OUT, (BATCH, IN), (2, BATCH, IN)),  # one per feature, then a 3-D call: its dim 1 is not the features
    (OUT, (2, BATCH, IN), (2, BATCH, IN)),
    (BATCH, (2, BATCH, IN), (BATCH, IN)),  # one per token, then a 2-D call
    (OUT + 1, (BATCH, IN), (BATCH, IN)),
], ids=["per-feature-then-3d", "per-feature-on-3d", "per-token-then-2d", "another-count"])
def test_prelu_whose_slopes_are_not_its_channels_raises_as_eager(slopes, example, called):
    model = GemmThen(lambda m, x, y: m.act(m.fc(x)), act=nn.PReLU(slopes))
    optimized = fxfuse.optimize(model, (torch.randn(*example),))
    for candidate in (model, optimized):
        with pytest.raises(RuntimeError, match="Mismatch of parameter numbers and input channel size"):
            candidate(torch.randn(*called))


@pytest.mark.parametrize("slopes, error", [
    (torch.randn(1, OUT), "Expected `weight` to be a scalar or 1D tensor"),
    (torch.randn(OUT, dtype=torch.float64), "Type promoting not supported"),
], ids=["2d-slopes", "float64-slopes"])
def test_prelu_whose_slopes_eager_refuses_raises_as_eager(slopes, error):
    model = GemmThen(lambda m, x, y: F.prelu(m.fc(x), m.w), w=nn.Parameter(slopes))
    optimized = fxfuse.optimize(model, (rows(),))
    for candidate in (model, optimized):
        with pytest.raises(RuntimeError, match=error):
            candidate(rows())


def test_prelu_of_a_number_is_not_fused_and_raises_as_eager():
    model = GemmThen(lambda m, x, y: F.prelu(m.fc(x), 0.25))
    optimized = fxfuse.optimize(model, (rows(),))
    assert not optimized.fxfuse_report.fused
    for candidate in (model, optimized):
        with pytest.raises(TypeError, match="must be Tensor"):
            candidate(rows())


def test_an_unused_prelu_stays_to_raise_where_eager_does():
    """Its slopes are read along dim 1: a later call of another rank makes eager raise for it, so it is not dropped."""
    def epilogue(m, x, y):
        h = m.fc(x)
        m.act(h)
        return h.relu()
    model = GemmThen(epilogue, act=nn.PReLU(OUT))
    optimized = fxfuse.optimize(model, (rows(),))
    assert_reason(optimized, "the value of `act` is never used")
    for candidate in (model, optimized):
        with pytest.raises(RuntimeError, match="Mismatch of parameter numbers"):
            candidate(torch.randn(2, BATCH, IN))


# ---------------------------------------------------------------- in-place changes the graph does not name (review)

class DoublesInPlace(nn.Module):
    def forward(self, t):
        return t.mul_(2.0)


class ChangesInputAfterItsGemm(nn.Module):
    """The GEMM reads x, then a child changes x in place, then the chain's last op runs: eager's chain saw the old
    x only through the GEMM, but a region that ends after the child must not move the GEMM past it."""

    def __init__(self, child: nn.Module):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.child = child

    def forward(self, x):
        h = self.fc(x)
        changed = self.child(x)
        return torch.relu(h) + changed.sum()


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, t):
        t.mul_(2.0)
        return self.fc(t).relu()


def hooked_doubler() -> nn.Module:
    child = DoublesInPlace()
    child.register_forward_hook(lambda module, args, out: None)  # a logging hook: fx keeps the child as one call
    return child


def optimized_inner() -> nn.Module:
    return fxfuse.optimize(Inner().eval(), (rows(),))


@pytest.mark.parametrize("make_child", [hooked_doubler, optimized_inner], ids=["hooked", "optimized"])
def test_a_child_kept_as_one_call_may_change_its_inputs(make_child):
    """A hooked child and an optimized model inside are code of the user's: they changed x in place between the
    GEMM and the chain's end, and the fused op, placed at the chain's end, read the changed x."""
    model = ChangesInputAfterItsGemm(make_child()).eval()
    x = rows()
    optimized = fxfuse.optimize(model, (x.clone(),))
    assert_reason(optimized, "`child` changes `x` between the region's ops, which read it")
    with torch.no_grad():
        assert_close_report(optimized(x.clone()), model(x.clone()))


class ReadsRunningMean(nn.Module):
    def __init__(self, functional: bool):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.bn = nn.BatchNorm1d(OUT, momentum=0.5)
        self.functional = functional

    def forward(self, x, z):
        h = self.fc(x) - self.bn.running_mean
        if self.functional:
            s = F.batch_norm(z, self.bn.running_mean, self.bn.running_var, training=True, momentum=0.5)
        else:
            s = self.bn(z)  # train mode: updates running_mean in place
        return torch.relu(h), s


@pytest.mark.parametrize("functional", [False, True], ids=["module", "functional"])
def test_a_batch_norm_that_updates_a_buffer_the_region_reads_ends_it(functional):
    """Train-mode batch norm updates its running statistics in place, which aten's schema does not say."""
    model = ReadsRunningMean(functional).train()
    x, z = rows(), torch.randn(16, OUT) + 3.0
    reference = copy.deepcopy(model)
    optimized = fxfuse.optimize(model, (x, z))
    assert_reason(optimized, "changes `bn" if functional else "`bn` changes `bn.running_mean`")
    with torch.no_grad():
        assert_close_report(optimized(x, z)[0], reference(x, z)[0])


def test_a_batch_norm_updating_a_buffer_is_seen_under_the_backend():
    model = ReadsRunningMean(functional=False).train()
    x, z = rows(), torch.randn(16, OUT) + 3.0
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxfuse.make_backend(inner="eager"))
    with torch.no_grad():
        assert_close_report(compiled(x, z)[0], reference(x, z)[0])


# ---------------------------------------------------------------- calls eager takes no such arguments for (review)

@pytest.mark.parametrize("call", [
    lambda h, b: h.exp(True),
    lambda h, b: h.relu(True),
    lambda h, b: h.sigmoid(inplace=True),
    lambda h, b: torch.relu(h, True),
    lambda h, b: h.add(b, 1),
    lambda h, b: torch.sub(h, b, 1),
    lambda h, b: h.div(b, None),
    lambda h, b: h.contiguous(torch.contiguous_format),
], ids=["exp(True)", "relu(True)", "sigmoid(inplace)", "torch.relu(h, True)", "add(b, 1)", "torch.sub(h, b, 1)",
        "div(b, None)", "contiguous(format)"])
@pytest.mark.parametrize("with_example_inputs", [True, False])
def test_a_call_eager_raises_for_raises_after_optimize(call, with_example_inputs):
    """A spelling's signature served a function and its methods alike: `h.exp(True)` was taken for an in-place exp
    and fused, and alpha or rounding_mode given by position were taken."""
    model = GemmThen(lambda m, x, y: call(m.fc(x), m.b) * 2.0, b=torch.randn(OUT)).eval()
    optimized = fxfuse.optimize(model, (rows(),) if with_example_inputs else None)
    assert fused_op_count(optimized) == 0
    for candidate in (model, optimized):
        with pytest.raises(TypeError):
            candidate(rows())


# ---------------------------------------------------------------- unused ops and later shapes (review)

@pytest.mark.parametrize("unused, traced, called", [
    (lambda m, h, y: h + m.row_bias, rows(4), rows(5)),        # a buffer shaped for the example's batch
    (lambda m, h, y: h * y, rows(4), rows(4)),                  # a forward argument, of another batch later
    (lambda m, h, y: h.sum(2), torch.randn(2, 4, IN), rows(4)),  # a dim of the example's rank
], ids=["batch buffer", "forward argument", "dim 2"])
def test_an_unused_op_that_ran_on_the_examples_still_raises_for_other_shapes(unused, traced, called):
    """An unused op that ran on the example inputs was dropped, though another shape makes eager raise for it."""
    def forward(m, x, y):
        h = m.fc(x)
        unused(m, h, y)
        return torch.relu(h)

    model = GemmThen(forward, row_bias=torch.randn(4, 1)).eval()
    y_traced = torch.randn(traced.shape[0], OUT) if traced.dim() == 2 else None
    optimized = fxfuse.optimize(model, (traced, y_traced))
    y_called = torch.randn(called.shape[0] + 1, OUT)
    for candidate in (model, optimized):
        with pytest.raises((RuntimeError, IndexError)):
            candidate(called, y_called)


def test_an_unused_op_of_module_vectors_is_still_dropped():
    def forward(m, x, y):
        h = m.fc(x)
        _ = h * m.scale + 1.0
        return torch.relu(h)

    model = GemmThen(forward, scale=torch.randn(1, OUT)).eval()
    assert_whole_chain_fused(model, (rows(),))


# ---------------------------------------------------------------- nested optimized models (review)

class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.inner = fxfuse.optimize(nn.Sequential(nn.Linear(OUT, OUT), nn.ReLU()).eval(), (rows(features=OUT),))

    def forward(self, x):
        return self.inner(torch.relu(self.fc(x)) * 2.0)


def test_an_optimized_model_inside_another_need_not_have_run_first():
    """Its hook lookup, filled at its first call, was taken for an attribute the outer forward sets."""
    model, x = Outer().eval(), rows()
    optimized = fxfuse.optimize(model, (x,))
    assert len(optimized.fxfuse_report.fused) == 1, optimized.fxfuse_report
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))


# ---------------------------------------------------------------- a norm's own state, and over-refusals (review)

class BasicBlock(nn.Module):
    """torchvision's BasicBlock order with Linear and BatchNorm1d: the downsample reads x after the main path's
    norms ran."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn1 = nn.Linear(IN, OUT), nn.BatchNorm1d(OUT)
        self.fc2, self.bn2 = nn.Linear(OUT, OUT), nn.BatchNorm1d(OUT)
        self.down = nn.Sequential(nn.Linear(IN, OUT), nn.BatchNorm1d(OUT))

    def forward(self, x):
        out = self.bn2(self.fc2(F.relu(self.bn1(self.fc1(x)))))
        return F.relu(out + self.down(x))


class GatedByANorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(IN, IN), nn.BatchNorm1d(IN)

    def forward(self, x):
        return torch.sigmoid(self.fc(x)) * self.bn(x)


def test_a_norms_running_statistics_are_no_view_of_the_input():
    """Every BatchNorm module call was taken to change its statistics, which an input might view: an eval-mode
    block lost a region."""
    model = BasicBlock().eval()
    for bn in (model.bn1, model.bn2, model.down[1]):
        bn.running_mean.uniform_(-1, 1)
    assert_fuses(model, (rows(),), regions=3)


@pytest.mark.parametrize("entry", ["optimize", "backend"])
def test_a_region_reading_a_train_mode_norms_output_fuses(entry):
    """What the region reads of the norm is its output, made after the norm's changes: the walk back from it to
    the statistics the norm changes found them 'read'."""
    torch._dynamo.reset()
    model = GatedByANorm().train()
    reference, x = copy.deepcopy(model), rows(features=IN)
    if entry == "optimize":
        optimized = fxfuse.optimize(model, (x,))
        fused = len(optimized.fxfuse_report.fused)
    else:
        backend = fxfuse.make_backend(inner="eager")
        optimized = torch.compile(model, backend=backend)
        optimized(x.clone())
        fused = sum(len(report.fused) for report in backend.reports)
        reference(x.clone())  # the same step of the statistics
    assert fused == 1
    assert_close_report(optimized(x), reference(x))
    torch._dynamo.reset()


class NormsItsBuffers(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.fc, self.spelling = nn.Linear(IN, OUT), spelling
        self.register_buffer("mean", torch.zeros(OUT))
        self.register_buffer("var", torch.ones(OUT))

    def forward(self, x, y):
        h = self.fc(x) + self.mean  # reads mean before the update
        args = (y, None, None, self.mean, self.var, True, 0.5, 1e-5)
        normed = {"native": lambda: torch.native_batch_norm(*args)[0],
                  "aten": lambda: torch.ops.aten.batch_norm(*args, False)}[self.spelling]()
        return torch.relu(h) * normed


@pytest.mark.parametrize("spelling", ["native", "aten"])
def test_other_batch_norm_spellings_update_their_statistics(spelling):
    model = NormsItsBuffers(spelling).train()
    x, y = rows(), torch.randn(BATCH, OUT) * 3 + 2
    reference = copy.deepcopy(model)
    optimized = fxfuse.optimize(model, (x, y))
    assert_reason(optimized, "changes `mean")
    with torch.no_grad():
        assert_close_report(optimized(x, y), reference(x, y))


def test_a_module_with_a_forward_of_its_own_is_user_code():
    child = nn.Tanh()
    child.forward = lambda t: t.mul_(2.0)  # an instance forward: fx keeps the call whole
    model = ChangesInputAfterItsGemm(child).eval()
    x = rows()
    optimized = fxfuse.optimize(model, (x.clone(),))
    with torch.no_grad():
        assert_close_report(optimized(x.clone()), model(x.clone()))


@pytest.mark.parametrize("unused", [lambda m, h: h.mean(-1), lambda m, h: h.softmax(-1), lambda m, h: m.b + h],
                         ids=["mean(-1)", "softmax(-1)", "vector first"])
def test_an_unused_op_over_the_features_is_dropped(unused):
    """Eager raises for these at no later shape: they go, and the region fuses."""
    def forward(m, x, y):
        h = m.fc(x)
        unused(m, h)
        return torch.relu(h)

    assert_whole_chain_fused(GemmThen(forward, b=torch.randn(OUT)).eval(), (rows(),))


class HookChangesAnotherModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.other = nn.Linear(IN, OUT), nn.Linear(IN, OUT)
        self.other.register_forward_hook(self.nudge_bias)

    def nudge_bias(self, module, args, out):
        with torch.no_grad():
            self.fc.bias.add_(1.0)

    def forward(self, x):
        h = self.fc(x)
        z = self.other(x * 2)  # its hook changes fc.bias, which the region reads
        return torch.relu(h), z


def test_a_hook_may_change_any_modules_tensors_while_a_region_runs():
    model, x = HookChangesAnotherModule().eval(), rows()
    reference = copy.deepcopy(model)
    optimized = fxfuse.optimize(model, (x,))
    assert_reason(optimized, "`other` may change `fc.bias` between the region's ops")
    with torch.no_grad():
        assert_close_report(optimized(x)[0], reference(x)[0])


def test_a_hooked_module_after_the_regions_leaves_them_fused():
    """A hook could change any module's tensors, but one after every region changes none of what they read."""
    model = nn.Sequential(nn.Linear(IN, OUT), nn.ReLU(), nn.Linear(OUT, OUT)).train()
    model[2].register_forward_hook(lambda module, args, out: None)
    assert fxfuse.optimize(model, (rows(),)).fxfuse_report.fused


def test_an_unused_batch_norm_stays_for_other_ranks():
    """Batch norm's channels are dim 1, and eager raises for a 1-D or 4-D input: it ran on a 2-D example."""
    def forward(m, x, y):
        h = m.fc(x)
        m.bn(h)
        return h * 2

    model = GemmThen(forward, bn=nn.BatchNorm1d(OUT)).eval()
    optimized = fxfuse.optimize(model, (rows(),))
    for candidate in (model, optimized):
        with pytest.raises(ValueError, match="expected 2D or 3D input"):
            candidate(torch.randn(2, 2, 3, IN))


def test_an_unused_op_of_a_forward_argument_weights_output_stays():
    """`h = F.linear(x, w)` is as wide as w, a forward argument: `h + self.b` raises for another w."""
    class LinearOfAnArgument(nn.Module):
        def __init__(self):
            super().__init__()
            self.b = nn.Parameter(torch.randn(OUT))

        def forward(self, x, w):
            h = F.linear(x, w)
            _ = h + self.b
            return h.relu()

    model = LinearOfAnArgument().eval()
    optimized = fxfuse.optimize(model, (rows(), torch.randn(OUT, IN)))
    for candidate in (model, optimized):
        with pytest.raises(RuntimeError, match="must match"):
            candidate(rows(), torch.randn(OUT - 1, IN))


class InPlaceResidual(nn.Module):
    """torchvision BasicBlock's tail with a Linear: `out += x`, then an in-place ReLU."""

    def __init__(self):
        super().__init__()
        self.fc, self.relu = nn.Linear(IN, IN), nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.fc(x)
        out += x
        return self.relu(out)


def test_in_place_residual_blocks_all_fuse():
    """`out += x` changes out alone: the walk back from it took x too, so the next block's in-place ReLU was taken
    for a change of what the previous region keeps (found by review: 1 of 3 blocks fused)."""
    model = nn.Sequential(InPlaceResidual(), InPlaceResidual(), InPlaceResidual()).eval()
    assert_fuses(model, (rows(features=IN),), regions=3)


@pytest.mark.parametrize("patched", ["fc", "act"])
def test_a_folded_module_with_a_forward_of_its_own_is_not_fused(patched):
    """A wrapper's patch (`module.forward = ...`): the class's forward is not what runs, and the optimized model
    raised at every call (require_settings)."""
    model = GemmThen(lambda m, x, y: m.act(m.fc(x)), act=nn.GELU()).eval()
    module = getattr(model, patched)
    original = type(module).forward
    module.forward = lambda t: original(module, t) * 1.0
    optimized = fxfuse.optimize(model, (rows(),))
    assert_reason(optimized, f"`{patched}` has a forward of its own")
    x = rows()
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))


class GatedByAHookedChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.gate = nn.Linear(IN, OUT), nn.Linear(IN, OUT)
        self.gate.register_forward_hook(lambda module, args, out: None)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return h + self.gate(x)  # the hooked call runs between relu and the add


def test_a_region_cut_by_a_change_fuses_the_part_before_it():
    """The whole region spans a call that may change x: its prefix before the call is legal and fuses (the whole
    anchor was given up, found by review)."""
    model, x = GatedByAHookedChild().eval(), rows()
    optimized = fxfuse.optimize(model, (x,))
    assert fused_programs(optimized) == ["relu(%0)"]
    assert_reason(optimized, "`gate` changes `x` between the region's ops, which read it")
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))


# ---------------------------------------------------------------- review h1: error parity for later calls

@pytest.mark.parametrize("norm", [
    lambda h: F.layer_norm(h, (OUT,)),
    lambda h: F.rms_norm(h, (OUT,)),
    lambda h: F.layer_norm(h, (OUT,), torch.ones(OUT)),
], ids=["layer_norm", "rms_norm", "layer_norm-affine"])
def test_a_normalized_shape_after_a_forward_argument_weight_is_not_fused(norm):
    """The program normalizes over the last dim, whatever its size: with a weight of another row count at a later
    call, eager raises for normalized_shape and the fused op normalized the wider rows silently."""
    model = GemmThen(lambda m, x, y: norm(F.linear(x, y))).eval()
    w = torch.randn(OUT, IN)
    optimized = fxfuse.optimize(model, (rows(), w))
    assert fused_op_count(optimized) == 0
    assert_reason(optimized, f"normalized_shape is ({OUT},) but the GEMM's weight `y` is no module tensor")
    x, wider = rows(), torch.randn(OUT + 1, IN)
    for candidate in (model, optimized):
        with pytest.raises(RuntimeError, match="normalized_shape"):
            candidate(x, wider)
    assert_close_report(optimized(x, w), model(x, w))


@pytest.mark.parametrize("with_examples", [True, False], ids=["example-inputs", "no-example-inputs"])
@pytest.mark.parametrize("norm", [
    lambda m, h: F.layer_norm(h, (1,)),
    lambda m, h: F.rms_norm(h, [1]),
    lambda m, h: m.rms(h),
], ids=["layer_norm", "rms_norm", "RMSNorm"])
def test_a_normalized_shape_of_one_feature_after_a_broadcast_to_more_raises_as_eager(norm, with_examples):
    """A GEMM of one feature plus a tensor of more (`fc(x) + x`) has rows of the tensor's size: eager raises for a
    normalized_shape of (1,), where the fused op normalized the wider rows."""
    model = GemmThen(lambda m, x, y: norm(m, m.fc(x) + x), out_features=1,
                     rms=nn.RMSNorm(1, elementwise_affine=False)).eval()
    x = rows()
    optimized = fxfuse.optimize(model, (x,) if with_examples else None)
    assert fused_programs(optimized) == ["add(%0,$0)"]
    assert_reason(optimized, "may have more features after a broadcast")
    for candidate in (model, optimized):
        with pytest.raises(RuntimeError, match="normalized_shape"):
            candidate(x)


@pytest.mark.parametrize("norm", [lambda h: F.layer_norm(h, (1,)), lambda h: F.rms_norm(h, [1])],
                         ids=["layer_norm", "rms_norm"])
def test_a_normalized_shape_of_one_feature_after_a_forward_argument_of_one_in_the_example_inputs_raises_as_eager(norm):
    """A forward argument of one column in the example inputs may have more at a later call (`fc(x) + y` of a
    Linear(k, 1)): eager then raises for the normalized_shape (1,), where the fused op normalized the wider rows."""
    model = GemmThen(lambda m, x, y: norm(m.fc(x) + y), out_features=1).eval()
    optimized = fxfuse.optimize(model, (rows(), torch.randn(BATCH, 1)))
    assert_reason(optimized, "may have more features after a broadcast")
    x, wider = rows(), torch.randn(BATCH, 5)
    for candidate in (model, optimized):
        with pytest.raises(RuntimeError, match="normalized_shape"):
            candidate(x, wider)


def test_a_normalized_shape_of_one_feature_after_a_broadcast_of_one_fuses():
    model = GemmThen(lambda m, x, y: F.layer_norm(m.fc(x) + m.b, (1,)), out_features=1, b=torch.randn(BATCH, 1)).eval()
    assert_whole_chain_fused(model, (rows(),))


@pytest.mark.parametrize("later_y, error", [
    (torch.randn(3, BATCH, OUT), RuntimeError),              # would broadcast the mutated value bigger
    (torch.randn(BATCH, OUT, dtype=torch.float64), None),     # eager keeps float32
], ids=["3-D", "float64"])
def test_an_in_place_op_of_a_forward_argument_keeps_eagers_shape_and_dtype_at_later_calls(later_y, error):
    """The example inputs proved that `h.add_(y)` keeps h's shape and dtype for the example y only: a later y of
    more dims gave a bigger result where eager raises, a float64 one a float64 result where eager's stays float32."""
    model = GemmThen(lambda m, x, y: torch.relu(m.fc(x).add_(y))).eval()
    optimized = fxfuse.optimize(model, (rows(), torch.randn(BATCH, OUT)))
    assert_reason(optimized, "in-place `add_` reads `y`, whose shape and dtype may differ at a later call")
    x = rows()
    if error is not None:
        for candidate in (model, optimized):
            with pytest.raises(error, match="doesn't match the broadcast shape"):
                candidate(x, later_y)
    else:
        expected = model(x, later_y)
        assert optimized(x, later_y).dtype == expected.dtype == torch.float32
        assert_close_report(optimized(x, later_y), expected)


def scale_in_place_by_a_row_buffer(m, x, y):
    h = m.fc(x)
    h.mul_(m.row_scale)
    return torch.relu(h)


def add_in_place_a_buffer_of_the_example_shape(m, x, y):
    h = m.fc(x)
    h += m.row_scale
    return torch.tanh(h)


@pytest.mark.parametrize("epilogue", [scale_in_place_by_a_row_buffer, add_in_place_a_buffer_of_the_example_shape])
@pytest.mark.parametrize("buffer_shape", [(BATCH, 1), (BATCH, OUT), (1, BATCH, OUT)], ids=["rows", "full", "3-D"])
def test_an_in_place_op_of_a_module_tensor_that_fits_the_example_batch_only_is_not_fused(epilogue, buffer_shape):
    """A (batch, 1) buffer fits `h.mul_(buffer)` at the example inputs' batch size only: at another, eager raises
    ("doesn't match the broadcast shape") and the fused op broadcast the mutated value to the buffer's rows."""
    model = GemmThen(epilogue, row_scale=torch.randn(buffer_shape)).eval()
    example = rows() if len(buffer_shape) == 2 else torch.randn(1, BATCH, IN)
    optimized = fxfuse.optimize(model, (example,))
    assert_reason(optimized, "fits the mutated value at the example inputs' sizes only")
    for later in (rows(batch=1), torch.randn(1, 1, IN)):
        for candidate in (model, optimized):
            with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
                candidate(later)
    with torch.no_grad():
        assert_close_report(optimized(example), model(example))


def test_an_in_place_op_of_a_module_tensor_of_one_row_fuses_with_example_inputs():
    """A (1, features) buffer fits the mutated value at every batch size, and of x's rank or more (a 1-D x's value is
    1-D: eager raises where the buffer would make it 2-D)."""
    model = GemmThen(scale_in_place_by_a_row_buffer, row_scale=torch.randn(1, OUT)).eval()
    optimized = assert_whole_chain_fused(model, (rows(),))
    with torch.no_grad():
        for x in (rows(batch=5), torch.randn(2, BATCH, IN)):
            assert_close_report(optimized(x), model(x))
    for candidate in (model, optimized):
        with pytest.raises(RuntimeError, match="doesn't match the broadcast shape|optimized for an input of 2 dims"):
            candidate(torch.randn(IN))


def bound_by_a_row_buffer_then_add_another_in_place(m, x, y):
    h = torch.minimum(m.fc(x), m.row_bound)
    h.add_(m.row_shift)
    return h


@pytest.mark.parametrize("with_examples", [True, False], ids=["example-inputs", "no-example-inputs"])
def test_an_in_place_op_of_a_row_buffer_into_a_value_a_row_buffer_made_2_d_takes_a_1_d_input(with_examples):
    """A (1, features) buffer added in place into a value that an earlier (1, features) buffer made 2-D fits it for
    every input, a 1-D one too (eager gives a (1, features) result): with example inputs, the fused op required x
    to have 2 dims and raised fxfuse's error."""
    model = GemmThen(bound_by_a_row_buffer_then_add_another_in_place, row_bound=torch.randn(1, OUT),
                     row_shift=torch.randn(1, OUT)).eval()
    optimized = assert_whole_chain_fused(model, (rows(),), example_inputs=None if with_examples else False)
    with torch.no_grad():
        for x in (torch.randn(IN), rows(batch=5), torch.randn(2, BATCH, IN)):
            assert_close_report(optimized(x), model(x))


def _first_line_of_error(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 (the error itself is what is compared)
        return type(error), str(error).splitlines()[0]
    raise AssertionError("no error raised")


@pytest.mark.parametrize("gemm", ["mm-of-3-D", "addmm-of-3-D"])
@pytest.mark.parametrize("bad", [torch.randn(IN), torch.randn(2, BATCH, IN), None], ids=["1-D", "3-D", "None"])
@pytest.mark.parametrize("shapes", [True, False], ids=["example-inputs", "no-example-inputs"])
def test_mm_and_addmm_of_no_matrix_raise_eagers_own_error(gemm, bad, shapes):
    """The check before a fused mm/addmm raised a message of its own ("self must be a matrix (mm and addmm take
    2-D inputs; got 3-D)", where addmm says "mat1 must be a matrix, got 3-D tensor"), and an AttributeError for
    None where eager raises a TypeError."""
    model = GemmThen(EAGER_ERRORS[gemm][0]).eval()
    optimized = fxfuse.optimize(model, (rows(),) if shapes else None)
    assert fused_op_count(optimized) == 1
    assert _first_line_of_error(lambda: optimized(bad)) == _first_line_of_error(lambda: model(bad))


class AddmmOfAnArgument(nn.Module):
    """`relu(addmm(y, x, W.t()))`, whose input y is a forward argument."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x, y):
        return torch.relu(torch.addmm(y, x, self.fc.weight.t()))


@pytest.mark.parametrize("bad", [None, 2.5, torch.randn(OUT, dtype=torch.float64), torch.randn(BATCH, OUT).half()],
                         ids=["None", "a-number", "float64", "float16"])
@pytest.mark.parametrize("example", [torch.randn(OUT), torch.randn(BATCH, OUT), None],
                         ids=["a-bias-in-the-example-inputs", "rows-in-the-example-inputs", "no-example-inputs"])
def test_addmm_of_a_forward_argument_eager_refuses_raises_eagers_error(bad, example):
    """addmm takes a tensor of its matrices' dtype as its input, and promotes none: the fused op ran where eager
    raises, without a bias for None (taken for the GEMM's own bias), or adding a float64 or float16 one (and its
    schema raised its own error for a number)."""
    model = AddmmOfAnArgument().eval()
    optimized = fxfuse.optimize(model, None if example is None else (rows(), example))
    assert fused_op_count(optimized) == 1
    x, y = rows(), torch.randn(OUT) if example is None else example
    assert _first_line_of_error(lambda: optimized(x, bad)) == _first_line_of_error(lambda: model(x, bad))
    assert_close_report(optimized(x, y), model(x, y))


@pytest.mark.parametrize("reduce", [lambda h: h.max(), lambda h: torch.min(h)], ids=["h.max()", "torch.min(h)"])
def test_max_or_min_without_a_dim_says_it_reduces_the_whole_tensor(reduce):
    """explain() said "max/min over a dim is fused through its `.values` or `[0]`" for `h.max()`, which has no dim
    and no indices."""
    model = GemmThen(lambda m, x, y: reduce(m.fc(x))).eval()
    assert_not_fused(model, (rows(),), reason="max/min without a dim reduces the whole tensor")


def test_a_gemm_whose_epilogue_op_another_region_took_says_so():
    """`relu(fc(x) + fc2(x))`: fc's region takes the add, reading fc2's output as a param; explain() said "no epilogue
    op follows the GEMM" for fc2, which an add does follow."""
    model = GemmThen(lambda m, x, y: torch.relu(m.fc(x) + m.fc2(x)), fc2=nn.Linear(IN, OUT)).eval()
    optimized = fxfuse.optimize(model, (rows(),))
    assert fused_op_count(optimized) == 1
    assert_reason(optimized, "the epilogue op that follows it was fused into another GEMM's region, whose "
                             "`gemm_epilogue_default` reads it")
    assert "no epilogue op follows the GEMM" not in str(optimized.fxfuse_report)


@pytest.mark.parametrize("number", [2.0, 3, True], ids=["float", "int", "bool"])
def test_a_number_where_the_example_input_was_a_tensor_computes_as_eager(number):
    """A forward argument whose example input was a tensor was passed to the fused op as is: a number there made
    the op's schema raise ("Expected a value of type 'List[Tensor]' for argument 'params'"), where eager computes."""
    model = GemmThen(lambda m, x, y: torch.relu(m.fc(x) * y + y)).eval()
    optimized = fxfuse.optimize(model, (rows(), torch.randn(BATCH, OUT)))
    assert fused_op_count(optimized) == 1
    x = rows()
    expected = model(x, number)
    result = optimized(x, number)
    assert result.dtype == expected.dtype
    assert_close_report(result, expected)


class GemmSpelledAs(nn.Module):
    """The GEMM as the model spells it, then a group norm and a relu."""
    def __init__(self, spelling):
        super().__init__()
        self.fc, self.norm, self.spelling = nn.Linear(IN, OUT), nn.GroupNorm(4, OUT), spelling

    def forward(self, x):
        weight = self.fc.weight.t()
        h = {"module": lambda: self.fc(x), "torch.matmul": lambda: torch.matmul(x, weight),
             "@": lambda: x @ weight, "torch.mm": lambda: torch.mm(x, weight),
             "Tensor.matmul": lambda: x.matmul(weight)}[self.spelling]()
        return torch.relu(self.norm(h))


@pytest.mark.parametrize("example_inputs", [True, False], ids=["example inputs", "none"])
@pytest.mark.parametrize("bad", [None, [[1.0] * IN] * BATCH, 3.0], ids=["None", "a list", "a float"])
@pytest.mark.parametrize("spelling", ["module", "torch.matmul", "@", "torch.mm", "Tensor.matmul"])
def test_an_input_that_is_no_tensor_raises_eagers_own_error(spelling, bad, example_inputs):
    """The guards before the fused op read x.dim(): AttributeError ('NoneType' object has no attribute 'dim') where
    eager's GEMM raises its own TypeError (or, for a method, its AttributeError)."""
    model = GemmSpelledAs(spelling).eval()
    optimized = fxfuse.optimize(model, (rows(),) if example_inputs else None)
    assert fused_op_count(optimized) == 1
    with pytest.raises(Exception) as eager:
        model(bad)
    with pytest.raises(type(eager.value)) as fused:
        optimized(bad)
    assert str(fused.value).splitlines()[0] == str(eager.value).splitlines()[0]


# ---------------------------------------------------------------- numbers read from sizes

def test_number_read_from_the_batch_dim_is_not_fused_and_explain_says_why():
    """`h.shape[0]` is the caller's batch size, which another call may change: no number in a program can say it."""
    model = GemmThen(lambda m, x, y: (lambda h: h / h.shape[0])(m.fc(x)))
    assert_not_fused(model, (rows(),), reason="`getitem` reads dim 0 of `fc`, a batch dim of a 2-D value")
    optimized = assert_fuses(model, (rows(),), regions=0, example_inputs=False)
    assert_reason(optimized, "`getitem` reads dim 0 of `fc`, the features of a 1-D value only, else a batch dim")


def test_number_read_from_a_dim_that_is_the_features_at_another_rank_is_not_fused():
    model = GemmThen(lambda m, x, y: (lambda h: h * (1.0 / h.shape[1]))(m.fc(x)))
    assert_not_fused(model, (torch.randn(2, BATCH, IN),), reason="reads dim 1 of `fc`, a batch dim of a 3-D value")


def test_number_read_from_dim_1_fuses_for_2d_inputs_only():
    """Without example inputs `h.shape[1]` is taken as the features of a 2-D input; a 3-D one, where it is a batch
    dim, runs the model's own forward (the first checks: rewrite.py's FIRST_CHECKS)."""
    model = GemmThen(lambda m, x, y: (lambda h: h * (1.0 / h.shape[1]))(m.fc(x)))
    optimized = assert_fuses(model, (rows(),), example_inputs=False)
    x = torch.randn(2, BATCH, IN)
    torch.testing.assert_close(optimized(x), model(x))


def test_number_read_from_a_reduced_value_is_not_fused_past_the_reduction():
    model = GemmThen(lambda m, x, y: (lambda s: s / s.shape[-1])(m.fc(x).sum(-1, keepdim=True)))
    optimized = assert_fuses(model, (rows(),))
    assert fused_programs(optimized) == ["sum(%0,-1,True)"]
    assert_reason(optimized, "`getitem` reads a size of `sum_1`, whose last dim need not be the GEMM's features")


def test_size_read_by_two_ops_is_not_fused():
    def epilogue(m, x, y):
        h = m.fc(x)
        features = h.shape[-1]
        return h * features + features
    assert_not_fused(GemmThen(epilogue), (rows(),),
                     reason="`getitem`, a size, is also read by `add`: only one op can stand for it")


def test_number_read_from_the_features_of_a_weight_given_as_an_argument_is_not_fused():
    def epilogue(m, x, y):
        h = F.linear(x, y)
        return h * h.size(-1) ** -0.5
    assert_not_fused(GemmThen(epilogue), (rows(), torch.randn(OUT, IN)),
                     reason="`pow_1` reads the feature count, which the weight `y`, no module tensor, may change")


# ---------------------------------------------------------------- out=

def test_op_written_into_another_tensor_is_not_fused():
    def epilogue(m, x, y):
        torch.add(m.fc(x), 1.0, out=m.buf)
        return m.buf * 2
    assert_not_fused(GemmThen(epilogue, buf=torch.zeros(BATCH, OUT)), (rows(),),
                     reason="add writes into `buf` (out=), which is not its first operand")


def test_op_written_into_its_second_operand_is_not_fused():
    """`torch.sub(b, h, out=h)` is b - h: no in-place instruction of h says that."""
    def epilogue(m, x, y):
        h = m.fc(x)
        torch.sub(m.b, h, out=h)
        return h
    assert_not_fused(GemmThen(epilogue, b=nn.Parameter(torch.randn(OUT))), (rows(),),
                     reason="sub writes into `fc` (out=), which is not its first operand")


def test_reduction_written_with_out_is_not_fused():
    def epilogue(m, x, y):
        torch.sum(m.fc(x), 1, out=m.buf)
        return m.buf
    assert_not_fused(GemmThen(epilogue, buf=torch.zeros(BATCH)), (rows(),),
                     reason="sum writes into `buf` (out=), not into a tensor of its own")


# ---------------------------------------------------------------- alpha, addcmul and addcdiv

def test_addcdiv_of_two_arguments_of_unknown_dtypes_checks_them_first():
    """Without example inputs the two may be integer tensors, which eager's addcdiv raises for: their dtypes are
    checked before any op (it was not fused), and for integer ones the optimized model runs the model's own forward."""
    model = GemmThenTwoArguments(torch.addcdiv).eval()
    ints = (rows(), torch.arange(1, OUT + 1), torch.arange(1, OUT + 1))
    optimized = assert_whole_chain_fused(model, (rows(), torch.randn(OUT), torch.rand(OUT) + 0.5), example_inputs=False)
    for module in (model, optimized):
        with pytest.raises(RuntimeError, match="Integer division with addcdiv"):
            module(*ints)
    assert_whole_chain_fused(model, (rows(), torch.randn(OUT), torch.rand(OUT) + 0.5))  # with examples: floats


@pytest.mark.parametrize("epilogue", [torch.addcmul, lambda h, a, b: h.addcdiv(a, b, value=2)],
                         ids=["addcmul", "Tensor.addcdiv"])
@pytest.mark.parametrize("number_at", [1, 2], ids=["tensor1", "tensor2"])
def test_addcmul_and_addcdiv_of_an_argument_that_is_a_number_at_a_call_raise_as_eager(epilogue, number_at):
    """Their programs' mul and div take numbers, eager's addcmul and addcdiv do not: a number passed for a forward
    argument that was a tensor raises eager's TypeError."""
    model = GemmThenTwoArguments(epilogue).eval()
    optimized = assert_whole_chain_fused(model, (rows(), torch.randn(OUT), torch.rand(OUT) + 0.5))
    inputs = [rows(), torch.randn(OUT), torch.rand(OUT) + 0.5]
    inputs[number_at] = 2.0
    for module in (model, optimized):
        with pytest.raises(TypeError, match="must be Tensor, not float"):
            module(*inputs)


def test_alpha_scaling_an_argument_that_is_a_number_at_a_call_computes_as_eager():
    model = GemmThenTwoArguments(lambda h, a, b: torch.sub(h, a, alpha=0.5)).eval()
    optimized = assert_whole_chain_fused(model, (rows(), torch.randn(OUT), None))
    inputs = (rows(), 3.0, None)
    with torch.no_grad():
        assert_close_report(optimized(*inputs), model(*inputs))


def test_alpha_scaling_an_argument_of_unknown_dtype_checks_it_first():
    """Eager adds an integer `a` times alpha to a bf16 value in bf16; scaled first, it would be float32: a's dtype is
    checked before any op (it was not fused), and for an integer `a` the optimized model runs the model's forward."""
    model = GemmThenTwoArguments(lambda h, a, b: torch.add(h, a, alpha=0.5)).eval().to(torch.bfloat16)
    optimized = assert_whole_chain_fused(model, (rows(dtype=torch.bfloat16), torch.randn(OUT, dtype=torch.bfloat16),
                                                 None), example_inputs=False)
    inputs = (rows(dtype=torch.bfloat16), torch.arange(OUT), None)
    with torch.no_grad():
        assert_close_report(optimized(*inputs), model(*inputs))


def test_alpha_scaling_a_number_is_not_fused():
    """Eager rounds 0.1 to the value's dtype, then scales it: no number in the program says that in every dtype."""
    assert_not_fused(GemmThen(lambda m, x, y: m.fc(x).add_(0.1, alpha=2)), (rows(),),
                     reason="add with alpha=2 and the number 0.1")
    assert_not_fused(GemmThen(lambda m, x, y: (lambda h: h.add(h.size(-1), alpha=2))(m.fc(x))), (rows(),),
                     reason="`add` computes mul of the numbers 40, 2.0 first")


def test_in_place_op_on_a_new_tensor_made_from_the_value_is_no_view_of_it():
    def epilogue(m, x, y):
        h = m.fc(x)
        copy = torch.zeros_like(h)
        copy.add_(1)
        return h + copy
    optimized = assert_not_fused(GemmThen(epilogue).eval(), (rows(),))
    assert not [r for r in reasons(optimized) if "a view of" in r], reasons(optimized)


@pytest.mark.parametrize("with_examples", [True, False], ids=["example-inputs", "no-example-inputs"])
def test_unused_op_of_a_number_read_from_the_features_is_kept_with_its_size(with_examples):
    """The unused op stands for the size it reads: dropping it alone left the size standing for a node not there."""
    def epilogue(m, x, y):
        h = m.fc(x)
        unused = h * h.size(-1) ** -0.5  # noqa: F841
        return h.relu()
    optimized = assert_fuses(GemmThen(epilogue).eval(), (rows(),), regions=0,
                             example_inputs=None if with_examples else False)
    assert not [r for r in reasons(optimized) if "fxfuse error" in r], reasons(optimized)
    assert_reason(optimized, "the value of `mul` is never used")
    assert not [r for r in reasons(optimized) if "would be dropped" in r], reasons(optimized)  # (it is kept)
