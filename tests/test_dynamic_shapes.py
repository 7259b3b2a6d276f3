"""Changing batch sizes and extra leading dims: optimize() builds once and takes any batch; torch.compile with
the fxfuse backend compiles no more often than it does without fxfuse (dynamic=None, True, mark_dynamic).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
import fxfuse.api
import fxfuse.rewrite
from fxfuse.modelfile import example_files, load_model_file
from fxfuse.testing import assert_close_report, fused_op_count

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

EXAMPLES = {path.stem: path for path in example_files()}
BATCHES = (3, 5, 9, 17, 2)


class CountingInner:
    """Inner compiler that counts the graphs it gets and the fused ops in them."""

    def __init__(self):
        self.compiles = 0
        self.fused_ops = []

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        self.fused_ops.append(sum(n.target is torch.ops.fxfuse.gemm_epilogue.default for n in gm.graph.nodes))
        return gm.forward


def _batches_of(inputs, batches, mark_dynamic=False):
    for batch in batches:
        resized = [torch.rand(batch, *t.shape[1:]) for t in inputs]
        if mark_dynamic:
            for t in resized:
                torch._dynamo.mark_dynamic(t, 0)
        yield resized


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_optimize_once_then_any_batch(name, monkeypatch):
    model, inputs = load_model_file(EXAMPLES[name], small=True).build()
    optimized = fxfuse.optimize(model, inputs)
    assert fused_op_count(optimized) == 1

    def no_retrace(*args, **kwargs):
        raise AssertionError("optimize() output traced or fused again for a new batch size")

    monkeypatch.setattr(torch.fx, "symbolic_trace", no_retrace)
    monkeypatch.setattr(fxfuse.rewrite, "fuse_graph", no_retrace)
    monkeypatch.setattr(fxfuse.api, "fuse_graph", no_retrace)
    with torch.no_grad():
        for batch_inputs in _batches_of(inputs, (1,) + BATCHES):
            assert_close_report(optimized(*batch_inputs), model(*batch_inputs))


class TokenMLP(nn.Module):
    """Acts on the last dim only, so any leading dims are valid in eager."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 24)
        self.ln = nn.LayerNorm(24)
        self.out = nn.Linear(24, 24)
        self.scale = nn.Parameter(torch.rand(24) + 0.5)

    def forward(self, x):
        h = nn.functional.gelu(self.ln(self.fc(x)))
        return torch.softmax(self.out(h) * self.scale, dim=-1)


LEADING_DIMS = [(5,), (2, 7), (3, 1, 4), (1, 2, 3, 2)]


def test_optimize_takes_extra_leading_dims():
    model = TokenMLP()
    optimized = fxfuse.optimize(model, (torch.randn(4, 12),))
    assert fused_op_count(optimized) == 2
    with torch.no_grad():
        for leading in LEADING_DIMS:
            x = torch.randn(*leading, 12)
            assert_close_report(optimized(x), model(x))


def test_compile_takes_extra_leading_dims():
    model = TokenMLP()
    inner = CountingInner()
    compiled = torch.compile(model, backend=fxfuse.make_backend(inner=inner), dynamic=True)
    with torch.no_grad():
        for leading in LEADING_DIMS:
            x = torch.randn(*leading, 12)
            assert_close_report(compiled(x), model(x))
    assert inner.compiles == len({len(d) for d in LEADING_DIMS})  # one graph per rank, as Dynamo does
    assert set(inner.fused_ops) == {2}


def _count_compiles(model, inputs, backend, dynamic, mark_dynamic):
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    with torch.no_grad():
        for batch_inputs in _batches_of(inputs, BATCHES, mark_dynamic):
            assert_close_report(compiled(*batch_inputs), model(*batch_inputs))


@pytest.mark.parametrize("dynamic", [None, True, "mark_dynamic"])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_compile_recompiles_as_without_fxfuse(name, dynamic):
    model, inputs = load_model_file(EXAMPLES[name], small=True).build()
    mark = dynamic == "mark_dynamic"
    dynamic = None if mark else dynamic
    baseline = CountingInner()
    _count_compiles(model, inputs, baseline, dynamic, mark)
    torch._dynamo.reset()
    inner = CountingInner()
    _count_compiles(model, inputs, fxfuse.make_backend(inner=inner), dynamic, mark)
    assert inner.compiles == baseline.compiles
    assert inner.compiles == (2 if dynamic is None and not mark else 1)  # dynamic=None: static, then dynamic
    assert set(inner.fused_ops) == {1}


def test_dynamic_module_float_is_pinned_and_checked():
    """dynamic=True makes GroupNorm's eps a graph input; the backend fuses it anyway, and a new eps still
    gives eager's result."""
    model = nn.Sequential(nn.Linear(16, 32), nn.GroupNorm(4, 32), nn.LeakyReLU(0.2))
    inner = CountingInner()
    compiled = torch.compile(model, backend=fxfuse.make_backend(inner=inner), dynamic=True)
    with torch.no_grad():
        for batch in (3, 6):
            x = torch.randn(batch, 16)
            assert_close_report(compiled(x), model(x))
        assert inner.fused_ops == [1]
        model[1].eps = 1e-2
        try:
            result = compiled(x)
        except RuntimeError as error:  # the in-graph check, if Dynamo reused the graph
            assert "was 1e-05 when this graph was compiled" in str(error)
        else:
            assert_close_report(result, model(x))


@pytest.mark.parametrize("passed", ["argument", "dict item", "positional *args"])
def test_float_passed_by_the_caller_is_not_pinned(passed):
    """dynamic=True makes a forward's float argument a graph input too; unlike a module's float it changes from
    call to call, so it stays a traced value (the op that reads it is not fused) and every value works, however
    the caller passes it."""
    def epilogue(x, slope):
        return torch.relu(nn.functional.linear(x, weight)) + F.leaky_relu(x @ weight.t(), slope)

    model = {"argument": lambda x, slope: epilogue(x, slope),
             "dict item": lambda x, cfg: epilogue(x, cfg["slope"]),
             "positional *args": lambda x, *args: epilogue(x, args[0])}[passed]
    wrap = (lambda slope: {"slope": slope}) if passed == "dict item" else (lambda slope: slope)
    weight = torch.randn(32, 16)
    compiled = torch.compile(model, backend=fxfuse.make_backend(inner="eager"), dynamic=True)
    x = torch.randn(4, 16)
    with torch.no_grad():
        for slope in (0.1, 0.2, 0.3):
            assert_close_report(compiled(x, wrap(slope)), model(x, wrap(slope)))


def test_pinned_float_check_fails_loudly_if_the_graph_is_reused_with_another_value():
    recorded = []

    def keep(gm, example_inputs):
        recorded.append((gm, list(example_inputs)))
        return gm.forward

    model = nn.Sequential(nn.Linear(16, 32), nn.GroupNorm(4, 32))
    torch.compile(model, backend=fxfuse.make_backend(inner=keep), dynamic=True)(torch.randn(3, 16))
    (gm, inputs), = recorded
    floats = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.dtype == torch.float64]
    assert floats, "Dynamo no longer passes eps as a graph input: this test has nothing to check"
    inputs[floats[0]] = torch.tensor(0.5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="when this graph was compiled"):
        gm(*inputs)


class LearnedTemperature(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.temp = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return torch.softmax(self.fc(x) * self.temp.item(), -1)


def test_the_item_of_a_tensor_attribute_is_not_pinned():
    """With capture_scalar_outputs, `self.temp.item()` of a 0-d parameter is read in the graph like a module float
    that Dynamo passes as a tensor, but its value changes with no recompile (training, fill_): it was pinned, and
    every call after a change raised. It stays a traced value (the op that reads it is not fused)."""
    model, x = LearnedTemperature(), torch.randn(4, 16)
    backend = fxfuse.make_backend(inner="eager")
    with torch._dynamo.config.patch(capture_scalar_outputs=True), torch.no_grad():
        compiled = torch.compile(model, backend=backend)
        for value in (2.0, 3.0, 0.5):
            model.temp.fill_(value)
            assert_close_report(compiled(x), model(x))
    reasons = [row.reason for report in backend.reports for row in report.near_misses]
    assert any("is not a tensor" in reason for reason in reasons), reasons  # the mul that reads the .item()


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_changed_module_float_recompiles_under_the_eager_inner_compiler(dynamic):
    """A pinned module float must be guarded, as Inductor's trace guards it: with inner "eager" nothing traced the
    check, so Dynamo reused the graph for a new slope and its in-graph check raised where eager does not."""
    model = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.1))
    compiled = torch.compile(model, backend=fxfuse.make_backend(inner="eager"), dynamic=dynamic)
    with torch.no_grad():
        for batch, slope in ((3, 0.1), (4, 0.2), (5, 0.3), (6, 0.2)):
            model[1].negative_slope = slope
            x = torch.randn(batch, 16)
            assert_close_report(compiled(x), model(x))


def test_a_number_read_from_a_dynamic_batch_dim_is_not_fused_and_explain_says_why():
    """Dynamo holds the feature count as a number, but a dynamic batch size as a SymInt graph input."""
    class ScaledByBatch(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 16)

        def forward(self, x):
            h = self.fc(x)
            return h / h.shape[0] + h * h.shape[-1] ** -0.5

    backend = fxfuse.make_backend(inner="eager")
    model = ScaledByBatch().eval()
    x = torch.randn(4, 8)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        assert_close_report(torch.compile(model, backend=backend)(x), model(x))
    reasons = [row.reason for row in backend.reports[-1].near_misses]
    assert any("is not a tensor but a number known at run time only" in r for r in reasons), backend.reports[-1]
