"""An optimized module is still the user's model: same parameters, same state_dict, and it survives deepcopy,
pickle and torch.save/torch.load. Models that can't be traced as a whole get their traceable children
optimized and still run.
"""
import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from fxfuse.testing import assert_close_report, assert_fuses, fused_op_count


class Block(nn.Module):
    """Linear -> + bias -> Hardtanh -> Mish -> GroupNorm, then an eval-mode BatchNorm'd second GEMM."""

    def __init__(self, in_features=24, out_features=40):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(torch.randn(out_features) * 0.1)
        self.act = nn.Hardtanh()
        self.norm = nn.GroupNorm(4, out_features)
        self.proj = nn.Linear(out_features, 16, bias=False)
        self.bn = nn.BatchNorm1d(16)
        self.register_buffer("scale", torch.rand(16) + 0.5)

    def forward(self, x):
        h = self.norm(F.mish(self.act(self.fc(x) + self.bias)))
        return self.bn(self.proj(h)) * self.scale


def optimized_block():
    model = Block().eval()
    model.bn.running_mean.normal_()
    model.bn.running_var.uniform_(0.5, 2.0)
    optimized = assert_fuses(model, (torch.randn(3, 24),), regions=2)
    return model, optimized


def test_state_dict_has_the_same_keys_and_the_same_tensors():
    model, optimized = optimized_block()
    original, fused = model.state_dict(keep_vars=True), optimized.state_dict(keep_vars=True)
    assert list(fused) == list(original)
    for key, tensor in original.items():
        assert fused[key] is tensor, f"{key} is a different tensor object"


def test_optimized_module_loads_a_state_dict():
    model, optimized = optimized_block()
    other = Block().eval()
    optimized.load_state_dict(other.state_dict())
    x = torch.randn(3, 24)
    with torch.no_grad():
        assert_close_report(optimized(x), other(x))


def test_optimizer_step_on_the_original_parameters_is_seen():
    model, optimized = optimized_block()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(3, 24)
    model(x).square().sum().backward()
    optimizer.step()
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))


def test_gradients_reach_the_original_parameters_through_the_fused_op():
    model, optimized = optimized_block()
    x = torch.randn(3, 24)
    model(x).square().sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    optimized(x).square().sum().backward()
    for name, p in model.named_parameters():
        assert_close_report(p.grad, expected[name], rtol=1e-4, atol=1e-5, what=f"grad of {name}")


def roundtrip_deepcopy(module):
    return copy.deepcopy(module)


def roundtrip_pickle(module):
    return pickle.loads(pickle.dumps(module))


def roundtrip_torch_save(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("roundtrip", [copy.copy, roundtrip_deepcopy, roundtrip_pickle, roundtrip_torch_save],
                         ids=["copy", "deepcopy", "pickle", "torch.save"])
def test_roundtrip_keeps_the_fused_module_working(roundtrip):
    model, optimized = optimized_block()
    restored = roundtrip(optimized)
    assert fused_op_count(restored) == 2
    assert list(restored.state_dict()) == list(model.state_dict())
    for key, tensor in model.state_dict().items():
        assert torch.equal(restored.state_dict()[key], tensor), key
    x = torch.randn(5, 24)
    with torch.no_grad():
        assert_close_report(restored(x), model(x))
    assert str(restored.fxfuse_report) == str(optimized.fxfuse_report)


def add_one(module, args, out):
    return out + 1.0


@pytest.mark.parametrize("roundtrip", [copy.copy, roundtrip_deepcopy, roundtrip_pickle, roundtrip_torch_save],
                         ids=["copy", "deepcopy", "pickle", "torch.save"])
def test_roundtrip_keeps_the_models_own_hooks(roundtrip):
    """The root's hooks run around the optimized forward, in its copies too (deepcopy and unpickling dropped them,
    as eager's copies keep them)."""
    model, _ = optimized_block()
    model.register_forward_hook(add_one)
    optimized = fxfuse.optimize(model, (torch.randn(3, 24),))
    restored = roundtrip(optimized)
    assert len(restored._forward_hooks) == 1
    x = torch.randn(5, 24)
    with torch.no_grad():
        assert_close_report(restored(x), model(x))


GRAD_INPUTS = []


def record_grad_input(module, grad_input, grad_output):
    GRAD_INPUTS.append(grad_input[0].clone())


@pytest.mark.parametrize("roundtrip", [lambda module: module, copy.copy, roundtrip_deepcopy, roundtrip_pickle,
                                       roundtrip_torch_save], ids=["none", "copy", "deepcopy", "pickle", "torch.save"])
def test_the_models_full_backward_hook_runs_around_the_optimized_model(roundtrip):
    """The root's register_full_backward_hook was copied without the module's flag that marks its backward hooks as
    full ones, and torch runs a hook of neither kind: the optimized model's backward skipped it silently."""
    model, _ = optimized_block()
    model.register_full_backward_hook(record_grad_input)
    optimized = roundtrip(fxfuse.optimize(model, (torch.randn(3, 24),)))
    assert fused_op_count(optimized) == 2
    x = torch.randn(5, 24, requires_grad=True)
    GRAD_INPUTS.clear()
    model(x).square().sum().backward()
    optimized(x).square().sum().backward()
    assert len(GRAD_INPUTS) == 2
    assert_close_report(GRAD_INPUTS[1], GRAD_INPUTS[0], what="the hook's grad_input")


@pytest.mark.parametrize("roundtrip", [roundtrip_deepcopy, roundtrip_pickle, roundtrip_torch_save],
                         ids=["deepcopy", "pickle", "torch.save"])
def test_roundtrip_keeps_the_graphs_checks(roundtrip):
    """Unpickling traces the forward's code again, which ran each require_settings call once, at load, and dropped
    it: a changed eps then went unnoticed."""
    _, optimized = optimized_block()
    restored = roundtrip(optimized)
    restored.get_submodule("norm").eps = 0.5
    with pytest.raises(RuntimeError, match="`norm`.eps was 1e-05 when it was fused"):
        restored(torch.randn(5, 24))


class OptionalScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 40)

    def forward(self, x, scale=None):
        h = torch.relu(self.fc(x))
        return h if scale is None else h * scale


@pytest.fixture
def fx_wrap_registry_kept():
    """fx's process-wide registry of wrapped functions, put back after the test (a broken one fails every trace)."""
    from torch.fx import _symbolic_trace
    saved = dict(_symbolic_trace._wrapped_fns_to_patch)
    yield
    _symbolic_trace._wrapped_fns_to_patch.clear()
    _symbolic_trace._wrapped_fns_to_patch.update(saved)


@pytest.mark.parametrize("roundtrip", [roundtrip_pickle, roundtrip_torch_save], ids=["pickle", "torch.save"])
def test_an_argument_traced_as_none_survives_repeated_unpickling(roundtrip, fx_wrap_registry_kept):
    """fx's check that `scale` is still None, traced again on unpickling, was recorded as a wrapped function under its
    dotted name (`torch.fx._symbolic_trace._assert_is_none`), which fx's registry can't look up: the next unpickling,
    and every later fx trace in the process (any fxfuse.optimize()), raised KeyError."""
    model = OptionalScale().eval()
    optimized = fxfuse.optimize(model, (torch.randn(3, 24),))
    restored = roundtrip(roundtrip(optimized))
    assert fused_op_count(restored) == 1
    x = torch.randn(3, 24)
    with torch.no_grad():
        assert_close_report(restored(x), model(x))
    with pytest.raises(AssertionError, match="scale has been specialized to have value None"):
        restored(x, torch.ones(40))
    assert fused_op_count(fxfuse.optimize(Block().eval(), (torch.randn(3, 24),))) == 2


def test_state_dict_saved_from_the_optimized_module_loads_into_a_fresh_model():
    model, optimized = optimized_block()
    buffer = io.BytesIO()
    torch.save(optimized.state_dict(), buffer)
    buffer.seek(0)
    fresh = Block().eval()
    fresh.load_state_dict(torch.load(buffer))
    x = torch.randn(3, 24)
    with torch.no_grad():
        assert_close_report(fresh(x), model(x))


# ---------------------------------------------------------------- models that can't be traced as a whole


class DataDependent(nn.Module):
    """Its forward branches on a tensor value, which symbolic tracing can't follow; its children can be."""

    def __init__(self):
        super().__init__()
        self.head = nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.LayerNorm(40))
        self.tail = nn.Sequential(nn.Linear(40, 8), nn.Tanh())
        self.other = nn.Sequential(nn.Linear(40, 8), nn.Sigmoid())

    def forward(self, x):
        h = self.head(x)
        if h.sum() > 0:
            return self.tail(h)
        return self.other(h)


@pytest.mark.parametrize("with_example_inputs", [True, False], ids=["example-inputs", "no-inputs"])
def test_untraceable_model_gets_its_children_optimized(with_example_inputs):
    model = DataDependent().eval()
    x = torch.randn(3, 24)
    optimized = fxfuse.optimize(model, (x,) if with_example_inputs else None)
    assert fused_op_count(optimized) == 3
    assert optimized.fxfuse_report.skipped, "the model itself is reported as left in eager"
    assert "TraceError" in optimized.fxfuse_report.skipped[0].reason
    for sign in (1.0, -1.0):
        with torch.no_grad():
            assert_close_report(optimized(sign * x), model(sign * x))
    assert list(optimized.state_dict()) == list(model.state_dict())
    for key, tensor in model.state_dict(keep_vars=True).items():
        assert optimized.state_dict(keep_vars=True)[key] is tensor, key


def test_a_hook_added_to_a_child_that_the_optimized_model_replaced_raises():
    """The optimized parent calls an optimized copy of `head`: a hook registered on the model's own `head` after
    optimizing never ran, silently (one registered before runs in both)."""
    model = DataDependent().eval()
    model.head.register_forward_hook(add_one)
    optimized = fxfuse.optimize(model, (torch.randn(3, 24),))
    assert optimized.head is not model.head and fused_op_count(optimized.head) == 1
    x = torch.randn(3, 24)
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))
    model.head.register_forward_hook(add_one)
    with pytest.raises(RuntimeError, match="has forward hooks now"):
        optimized(x)


def test_untraceable_model_roundtrips_through_torch_save():
    model = DataDependent().eval()
    restored = roundtrip_torch_save(fxfuse.optimize(model))
    x = torch.randn(3, 24)
    with torch.no_grad():
        assert_close_report(restored(x), model(x))
    assert fused_op_count(restored) == 3


def test_optimize_does_not_change_the_original_model():
    model = DataDependent().eval()
    before = [type(m) for m in model.modules()]
    fxfuse.optimize(model, (torch.randn(3, 24),))
    assert [type(m) for m in model.modules()] == before
    assert fused_op_count(model) == 0


class ScaledByATensorItMakes(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 40)

    def forward(self, x, scale=None):
        return torch.relu(self.fc(x)) * torch.tensor(2.0)  # a tensor fx's trace keeps as a constant


@pytest.mark.parametrize("with_example_inputs", [True, False], ids=["example-inputs", "no-inputs"])
def test_optimize_leaves_no_tensor_constants_on_the_original_model(with_example_inputs):
    """fx's tracer stows the tensors a forward makes on the traced root, the user's model: each optimize() left a
    `_tensor_constantN` attribute on it (and every extra trace another)."""
    model = ScaledByATensorItMakes().eval()
    before = dict(vars(model))
    for _ in range(2):
        optimized = fxfuse.optimize(model, (torch.randn(3, 24),) if with_example_inputs else None)
    assert vars(model).keys() == before.keys()
    assert fused_op_count(optimized) == 1
    x = torch.randn(3, 24)
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))
    assert_close_report(copy.deepcopy(optimized)(x), model(x))


# ---------------------------------------------------------------- state the graph does not read


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 40)
        self.unused = nn.Linear(2, 2)                      # never called
        self.unused_scale = nn.Parameter(torch.ones(40))   # never read
        self.register_buffer("mask", torch.rand(40), persistent=False)
        self.register_buffer("shift", torch.randn(40))
        self.plain = torch.full((40,), 2.0)                # a tensor attribute, not state

    def forward(self, x):
        return torch.relu(self.fc(x)) * self.mask + self.shift * self.plain + torch.tensor(0.5)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.alpha = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("with_example_inputs", [True, False], ids=["example-inputs", "no-inputs"])
def test_state_the_graph_does_not_read_is_kept_as_it_was(with_example_inputs):
    model = Outer().eval()
    x = torch.randn(3, 24)
    optimized = fxfuse.optimize(model, (x,) if with_example_inputs else None)
    assert fused_op_count(optimized) == 1
    original, fused = model.state_dict(keep_vars=True), optimized.state_dict(keep_vars=True)
    assert list(fused) == list(original), "nested unused state kept; the non-persistent buffer stays out"
    assert all(fused[key] is tensor for key, tensor in original.items())
    assert optimized.inner is model.inner and optimized.training is False
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))
    for restored in (copy.copy(optimized), copy.deepcopy(optimized), roundtrip_torch_save(optimized)):
        assert list(restored.state_dict()) == list(original)
        restored.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert_close_report(restored(x), model(x))


class DataDependentWithModes(nn.Module):
    """Untraceable, with children whose behaviour depends on train/eval mode."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 40)
        self.bn = nn.BatchNorm1d(40)
        self.drop = nn.Dropout(0.5)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(40, 40), nn.ReLU())])

    def forward(self, x):
        h = self.bn(self.fc(x))
        if h.sum() > 1e9:
            return h
        return self.blocks[0](self.drop(h))


def test_untraceable_model_keeps_its_single_torch_modules_and_their_modes():
    model = DataDependentWithModes().train()
    x = torch.randn(5, 24)
    optimized = fxfuse.optimize(model, (x,))
    assert optimized.fc is model.fc and optimized.bn is model.bn and optimized.drop is model.drop
    assert fused_op_count(optimized.blocks[0]) == 1
    optimized.eval()
    model.eval()
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))
