"""Shapes after a hooked module: what it returns is learned from one real run of the model, hooks and all.

A module with hooks is one call of the graph, and the shapes run on fake tensors sets its hooks aside; its output's
shape, dtype and device come from a run of the model on the example inputs instead, so the ops after it keep their
shapes. Where that run does not line up with the graph (a tuple or a dict returned, more calls than the graph has),
nothing after the module has shapes, as before. The tests that fuse also check the optimized model against eager.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from epilogue_models import BATCH, IN, OUT, assert_reason, fused_programs, reasons
from fxfuse.testing import assert_close_report, assert_fuses

SEQUENCE = 5
NORM_AFTER_RELU = "relu(%0);layer_norm(%1,None,None,1e-05)"
SHAPES_MISSING = ("without example inputs", "pass example inputs")


def rows(batch=BATCH, features=IN):
    return torch.randn(batch, features)


def sequences(batch=BATCH, features=IN):
    return torch.randn(batch, SEQUENCE, features)


def doubled(module, args, out):
    return out * 2.0


class NormAfterAHookedModule(nn.Module):
    """F.instance_norm takes 3-D values only: fusing it needs the rank of fc's input, the hooked module's output."""

    def __init__(self, pre_features=IN):
        super().__init__()
        self.pre = nn.Linear(IN, pre_features)
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x):
        return F.instance_norm(torch.relu(self.fc(self.pre(x))))


class AddsAHookedModulesResult(nn.Module):
    """The add's operand is computed from the hooked module's output: a tensor, which only its shapes run can say."""

    def __init__(self):
        super().__init__()
        self.fc, self.pre = nn.Linear(IN, OUT), nn.Linear(IN, OUT)

    def forward(self, x):
        scaled = self.pre(x) * 2.0  # before the GEMM: a hooked call between the region's ops may change x
        return torch.relu(self.fc(x)) + scaled


def test_a_norm_after_a_hooked_module_fuses():
    model = NormAfterAHookedModule().eval()
    model.pre.register_forward_hook(doubled)
    optimized = assert_fuses(model, (sequences(),), regions=1)
    assert fused_programs(optimized) == [NORM_AFTER_RELU]


def test_explain_no_longer_says_the_shapes_are_missing_after_a_hooked_module():
    model, x = AddsAHookedModulesResult().eval(), rows()
    model.pre.register_forward_hook(doubled)
    report = fxfuse.explain(model, (x,))
    assert not [reason for reason in reasons(report) if any(text in reason for text in SHAPES_MISSING)], report
    optimized = assert_fuses(model, (x,), regions=1)
    assert fused_programs(optimized) == ["relu(%0);add(%1,$0)"]


def add_a_dim(module, args, out):
    return out.unsqueeze(0)


def keep_the_first_features(module, args, out):
    return out[..., :IN]


@pytest.mark.parametrize("hook, pre_features, make_input", [(add_a_dim, IN, rows),
                                                           (keep_the_first_features, 2 * IN, sequences)],
                         ids=["another rank", "fewer features"])
def test_a_hook_that_changes_the_output_shape_gives_that_shape(hook, pre_features, make_input):
    """The shape recorded is the hook's, not the module's own: a 2-D output made 3-D lets instance_norm fuse, and an
    output cut to fewer features fits fc (the module's own would not: the shapes run failed as a whole)."""
    model = NormAfterAHookedModule(pre_features).eval()
    model.pre.register_forward_hook(hook)
    optimized = assert_fuses(model, (make_input(),), regions=1)
    assert fused_programs(optimized) == [NORM_AFTER_RELU]


def as_tuple(module, args, out):
    return out, out.sum()


def as_dict(module, args, out):
    return {"h": out}


class UsesAHookedModulesFirstItem(nn.Module):
    def __init__(self, key):
        super().__init__()
        self.pre, self.fc = nn.Linear(IN, IN), nn.Linear(IN, OUT)
        self.key = key

    def forward(self, x):
        return F.instance_norm(torch.relu(self.fc(self.pre(x)[self.key])))


# (the shapes run, which sets the hooks aside, indexes the module's own tensor with "h": torch warns, then raises)
@pytest.mark.filterwarnings("ignore:Using a non-tuple sequence for multidimensional indexing")
@pytest.mark.parametrize("hook, key", [(as_tuple, 0), (as_dict, "h")], ids=["tuple", "dict"])
def test_a_hook_that_returns_no_tensor_leaves_what_follows_without_shapes(hook, key):
    model = UsesAHookedModulesFirstItem(key).eval()
    model.pre.register_forward_hook(hook)
    optimized = assert_fuses(model, (sequences(),), regions=1)
    assert fused_programs(optimized) == ["relu(%0)"]
    assert_reason(optimized, "the rank is unknown (pass example inputs)")


class CallsAHookedModuleTwice(nn.Module):
    """The first call sees a 2-D value, the second a 3-D one: each node gets its own call's shape."""

    def __init__(self):
        super().__init__()
        self.pre, self.fc, self.other = nn.Linear(IN, IN), nn.Linear(IN, OUT), nn.Linear(IN, OUT)

    def forward(self, x, y):
        first = self.pre(y)
        second = self.pre(x)
        return torch.relu(self.other(first)), F.instance_norm(torch.relu(self.fc(second)))


def test_a_hooked_module_called_twice_gives_each_call_its_shape():
    model = CallsAHookedModuleTwice().eval()
    model.pre.register_forward_hook(doubled)
    optimized = assert_fuses(model, (sequences(), rows()), regions=2)
    assert sorted(fused_programs(optimized)) == sorted(["relu(%0)", NORM_AFTER_RELU])


class CallsAHookedModuleInsideAnother(nn.Module):
    """`pre` is called twice, once inside `block` (one call of the graph): its one node can't be told which."""

    def __init__(self):
        super().__init__()
        self.pre, self.fc = nn.Linear(IN, IN), nn.Linear(IN, OUT)
        self.block = nn.Sequential(self.pre)

    def forward(self, x):
        return F.instance_norm(torch.relu(self.fc(self.pre(x)))) + self.block(x).mean()


def test_a_hooked_module_called_more_often_than_the_graph_calls_it_gives_no_shape():
    model = CallsAHookedModuleInsideAnother().eval()
    model.pre.register_forward_hook(doubled)
    model.block.register_forward_hook(doubled)
    optimized = assert_fuses(model, (sequences(),), regions=1)
    assert fused_programs(optimized) == ["relu(%0)"]
    assert_reason(optimized, "the rank is unknown (pass example inputs)")


def test_hooks_run_once_on_real_tensors_and_never_on_fake_ones():
    model, seen = NormAfterAHookedModule().eval(), []
    model.pre.register_forward_hook(lambda module, args, out: seen.append(type(out)) or out * 2.0)
    fxfuse.optimize(model, (sequences(),))
    assert seen == [torch.Tensor]


class NudgesAWeight(nn.Module):
    """A hook of `pre` changes fc's weight, which fc reads next."""

    def __init__(self):
        super().__init__()
        self.pre, self.fc = nn.Linear(IN, IN), nn.Linear(IN, OUT)
        self.pre.register_forward_hook(self.nudge_weight)

    def nudge_weight(self, module, args, out):
        with torch.no_grad():
            self.fc.weight.add_(1.0)

    def forward(self, x):
        return F.instance_norm(torch.relu(self.fc(self.pre(x))))


class NudgesItsInput(NormAfterAHookedModule):
    def forward(self, x):
        h = super().forward(x)
        x.add_(1.0)
        return h


def test_the_run_leaves_the_parameters_as_they_were():
    """The run that learns a hooked module's output is stopped before it writes into a parameter: what follows the
    module then has no shapes, as before."""
    model, x = NudgesAWeight().eval(), sequences()
    weight = model.fc.weight.detach().clone()
    optimized = fxfuse.optimize(model, (x,))
    assert torch.equal(model.fc.weight, weight)
    assert fused_programs(optimized) == ["relu(%0)"]
    with torch.no_grad():
        expected = model(x)
        model.fc.weight.copy_(weight)
        assert_close_report(optimized(x), expected)


def test_the_run_leaves_the_example_inputs_as_they_were():
    model, x = NudgesItsInput().eval(), sequences()
    model.pre.register_forward_hook(doubled)
    given = x.clone()
    optimized = fxfuse.optimize(model, (x,))
    assert torch.equal(x, given)
    assert fused_programs(optimized) == ["relu(%0)"]
    with torch.no_grad():
        assert_close_report(optimized(x.clone()), model(x.clone()))


def test_a_model_without_hooked_modules_is_not_run():
    class RecordsItsInputs(NormAfterAHookedModule):  # (no hook registered: the trace alone calls its forward)
        def forward(self, x):
            seen.append(type(x))
            return super().forward(x)

    seen = []
    fxfuse.optimize(RecordsItsInputs().eval(), (sequences(),))
    assert torch.Tensor not in seen


class OpOverTheFeaturesAfterAHookedModule(nn.Module):
    """fc's program holds for one rank of its input, the hooked module's output: softmax over dim 1 and group_norm
    take the features as dim 1 of a 2-D value. Of a 3-D value eager computes over another dim."""

    def __init__(self, op):
        super().__init__()
        self.pre, self.fc = nn.Linear(IN, IN), nn.Linear(IN, OUT)
        self.op = op

    def forward(self, x):
        h = self.fc(self.pre(torch.relu(x)))
        return torch.softmax(h, dim=1) if self.op == "softmax" else F.group_norm(h, 4)


def counting_hook(calls):
    def hook(module, args, out):
        calls.append(module)
        return out * 2.0
    return hook


def assert_eager_result_and_one_hook_call(run, model, x, calls):
    """run(x) computes what model(x) does, and the counting hook ran once for it."""
    with torch.no_grad():
        expected = model(x)
        calls.clear()
        assert_close_report(run(x), expected)
    assert len(calls) == 1


OVER_THE_FEATURES = ["softmax", "group_norm"]


@pytest.mark.parametrize("op", OVER_THE_FEATURES)
def test_without_example_inputs_a_region_after_a_hooked_module_holds_for_any_rank(op):
    """Without example inputs no check before the model's first op can tell the rank of fc's input, the hooked
    module's output, and a refusal after the hook ran would run it twice: the region is not fused (explain says why),
    and a call of either rank computes what eager does, its hook run once."""
    model, calls = OpOverTheFeaturesAfterAHookedModule(op).eval(), []
    model.pre.register_forward_hook(counting_hook(calls))
    optimized = fxfuse.optimize(model)
    assert fused_programs(optimized) == []
    assert_reason(optimized, "pass example inputs")
    for x in (rows(), torch.randn(BATCH, 4, IN)):
        assert_eager_result_and_one_hook_call(optimized, model, x, calls)


@pytest.mark.parametrize("op", OVER_THE_FEATURES)
def test_with_example_inputs_a_region_after_a_hooked_module_fuses_and_another_rank_runs_the_model(op):
    """With example inputs the argument's rank, checked before any op, tells that of the hooked module's output: a call
    of another rank runs the model's own forward, its hook once."""
    model, calls = OpOverTheFeaturesAfterAHookedModule(op).eval(), []
    model.pre.register_forward_hook(counting_hook(calls))
    optimized = assert_fuses(model, (rows(),), regions=1)
    x = torch.randn(BATCH, 4, IN)
    assert_eager_result_and_one_hook_call(optimized, model, x, calls)


@pytest.mark.parametrize("op", OVER_THE_FEATURES)
def test_the_backend_computes_a_region_after_a_hooked_module_at_each_rank(op):
    """Dynamo guards ranks (and runs the hook's code in its graph): each rank gets a graph of its own."""
    torch._dynamo.reset()
    model, calls = OpOverTheFeaturesAfterAHookedModule(op).eval(), []
    model.pre.register_forward_hook(counting_hook(calls))
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "eager"})
    for x in (rows(), torch.randn(BATCH, 4, IN)):
        assert_eager_result_and_one_hook_call(compiled, model, x, calls)


class OpOverTheFeaturesOfAViewAfterAHookedModule(nn.Module):
    """fc's input is the hooked module's output reshaped to 2 dims, whatever rank the module returns: softmax over
    dim 1 and group_norm hold for it at every call."""

    def __init__(self, op):
        super().__init__()
        self.pre, self.fc = nn.Linear(IN, IN), nn.Linear(IN, OUT)
        self.op = op

    def forward(self, x):
        h = self.fc(self.pre(torch.relu(x)).reshape(-1, IN))
        return torch.softmax(h, dim=1) if self.op == "softmax" else F.group_norm(h, 4)


def rank_adding_hook(calls):
    def hook(module, args, out):
        calls.append(module)
        return out.unsqueeze(0) * 2.0
    return hook


@pytest.mark.parametrize("hook", [counting_hook, rank_adding_hook], ids=["keeps-the-rank", "adds-a-dim"])
@pytest.mark.parametrize("op", OVER_THE_FEATURES)
def test_without_example_inputs_a_region_after_a_reshape_of_a_hooked_modules_output_fuses(op, hook):
    """`fc(hooked(x).reshape(-1, IN))` is 2-D whatever the hook returns: the region fuses without example inputs
    (it was refused, as no check could tell the rank of what the hook returns), and a call of either rank computes
    what eager does, its hook run once."""
    model, calls = OpOverTheFeaturesOfAViewAfterAHookedModule(op).eval(), []
    model.pre.register_forward_hook(hook(calls))
    optimized = fxfuse.optimize(model)
    assert len(fused_programs(optimized)) == 1, optimized.fxfuse_report
    for x in (rows(), torch.randn(BATCH, 4, IN)):
        assert_eager_result_and_one_hook_call(optimized, model, x, calls)


class OpOverTheFeaturesOfACatAfterAHookedModule(nn.Module):
    """fc's input joins the hooked module's output, of any rank, to x: softmax over dim 1 holds for a 2-D one."""

    def __init__(self):
        super().__init__()
        self.pre, self.fc = nn.Linear(IN, IN), nn.Linear(2 * IN, OUT)

    def forward(self, x):
        return torch.softmax(self.fc(torch.cat([self.pre(torch.relu(x)), x], -1)), dim=1)


def test_without_example_inputs_a_region_after_a_cat_of_a_hooked_modules_output_is_not_fused():
    """torch.cat has the rank of what it joins, but the hooked module's output may be of any rank: no check before any
    op tells it, and the region is not fused; a call of either rank computes what eager does, its hook run once."""
    model, calls = OpOverTheFeaturesOfACatAfterAHookedModule().eval(), []
    model.pre.register_forward_hook(counting_hook(calls))
    optimized = fxfuse.optimize(model)
    assert "softmax" not in " ".join(fused_programs(optimized)), optimized.fxfuse_report
    assert_reason(optimized, "pass example inputs")
    for x in (rows(), torch.randn(BATCH, 4, IN)):
        assert_eager_result_and_one_hook_call(optimized, model, x, calls)
