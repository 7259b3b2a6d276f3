"""torch.compile(model, backend="fxfuse"): registration by name and entry point, fusion of Dynamo's graphs by
the same pass as optimize(), the choice of inner compiler (eager, aot_eager, Inductor on CPU), and no graph
break of its own.
"""
import importlib.metadata
import logging
import operator
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import fxfuse
from fxfuse.backend import FxfuseBackend, fxfuse_backend
from fxfuse.modelfile import example_files, load_model_file
from fxfuse.library import mean_of_row_groups
from fxfuse.rewrite import mean_of_feature_groups
from fxfuse.testing import assert_close_report, assert_gradients_match

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

gemm_epilogue = torch.ops.fxfuse.gemm_epilogue.default
gemm_epilogue_train = torch.ops.fxfuse.gemm_epilogue_train.default
TRAINING_FUSED = [gemm_epilogue_train, operator.getitem]  # a training graph's fused op and its result
EXAMPLES = {path.stem: path for path in example_files()}


class GraphRecorder:
    """An inner compiler that keeps each graph it is given (after fusion) and runs it as is."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self, index=-1):
        return [n.target for n in self.graphs[index].graph.nodes if n.op == "call_function"]


def test_registered_by_name_on_import():
    from torch._dynamo.backends.registry import lookup_backend

    assert "fxfuse" in torch._dynamo.list_backends()
    assert lookup_backend("fxfuse") is fxfuse_backend


def test_entry_point_declared():
    points = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert "fxfuse" in points.names
    assert points["fxfuse"].load() is fxfuse_backend


def test_name_works_without_importing_fxfuse_first():
    # Dynamo finds the entry point, imports fxfuse (which registers itself) and must not fail on the
    # duplicate name.
    script = textwrap.dedent("""
        import sys, torch
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GroupNorm(4, 16), torch.nn.ReLU())
        x = torch.randn(3, 8)
        out = torch.compile(model, backend="fxfuse", options={"inner": "eager"})(x)
        torch.testing.assert_close(out, model(x))
        assert "fxfuse" in sys.modules
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_become_one_fused_op_in_dynamos_graph(name):
    model, inputs = load_model_file(EXAMPLES[name], small=True).build()
    recorder = GraphRecorder()
    compiled = torch.compile(model, backend=fxfuse.make_backend(inner=recorder), fullgraph=True)
    with torch.no_grad():
        assert_close_report(compiled(*inputs), model(*inputs))
    assert len(recorder.graphs) == 1
    # (a pool's weight and bias, averaged before the op)
    targets = [t for t in recorder.targets() if t not in (mean_of_row_groups, mean_of_feature_groups)]
    assert targets == [gemm_epilogue], f"left beside the fused op: {targets}"


def test_options_choose_the_inner_compiler(caplog):
    model, inputs = load_model_file(EXAMPLES["linear_groupnorm_hardtanh"], small=True).build()
    recorder = GraphRecorder()
    compiled = torch.compile(model, backend="fxfuse", options={"inner": recorder})
    assert_close_report(compiled(*inputs), model(*inputs))
    assert recorder.targets() == TRAINING_FUSED

    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="fxfuse"):
        compiled = torch.compile(model, backend="fxfuse", options={"inner": "eager"})
        assert_close_report(compiled(*inputs), model(*inputs))
    assert any("1 fused region" in r.getMessage() for r in caplog.records)


def test_inner_options_go_to_the_inner_compiler():
    with pytest.raises(RuntimeError, match="Unexpected optimization option"):
        FxfuseBackend("inductor", not_an_inductor_option=1)
    with pytest.raises(TypeError):
        FxfuseBackend(GraphRecorder(), max_autotune=True)
    with pytest.raises(ValueError):
        FxfuseBackend("fxfuse")
    seen = {}

    def inner_with_options(gm, example_inputs, **kwargs):
        seen.update(kwargs)
        return gm.forward

    from torch._dynamo.backends.registry import register_backend, _COMPILER_FNS
    if "fxfuse_test_inner" not in _COMPILER_FNS:
        register_backend(inner_with_options, name="fxfuse_test_inner")
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    torch.compile(model, backend="fxfuse",  # torch.compile takes mode or options: options carry the mode
                  options={"inner": "fxfuse_test_inner", "mode": "max-autotune", "some_flag": True})(torch.randn(2, 8))
    assert seen == {"mode": "max-autotune", "options": {"some_flag": True}}
    seen.clear()
    torch._dynamo.reset()
    torch.compile(model, backend=fxfuse.make_backend("fxfuse_test_inner", mode="reduce-overhead"))(torch.randn(2, 8))
    assert seen == {"mode": "reduce-overhead"}


@pytest.mark.parametrize("given", [{"mode": "max-autotune"}, {"options": {"max_autotune": True}}])
def test_mode_or_options_given_to_torch_compile_with_a_backend_object_say_where_they_go(given):
    """torch.compile passes its mode and options on to a backend object, whose own come from make_backend(): the
    call failed with Python's "unexpected keyword argument", naming no way to give them."""
    compiled = torch.compile(nn.Sequential(nn.Linear(8, 16), nn.ReLU()), backend=fxfuse.make_backend(), **given)
    with pytest.raises(Exception, match=r"fxfuse\.make_backend\(inner, mode, \*\*options\)"):
        compiled(torch.randn(2, 8))


def test_backends_with_the_same_settings_are_equal():
    assert fxfuse.make_backend(inner="eager") == fxfuse.make_backend(inner="eager")
    assert fxfuse.make_backend(inner="eager") != fxfuse.make_backend(inner="aot_eager")


def test_graph_break_outside_the_region_is_dynamos_own():
    class WithBreak(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 16)
            self.norm = nn.LayerNorm(16)

        def forward(self, x):
            h = torch.relu(self.fc1(x))
            torch._dynamo.graph_break()
            return self.norm(self.fc2(h))

    model = WithBreak()
    recorder = GraphRecorder()
    compiled = torch.compile(model, backend=fxfuse.make_backend(inner=recorder))
    x = torch.randn(4, 8)
    assert_close_report(compiled(x), model(x))
    assert len(recorder.graphs) == 2  # the user's break only
    assert all(recorder.targets(i) == TRAINING_FUSED for i in range(2))


def test_compiling_an_optimized_model_keeps_its_fused_op():
    model, inputs = load_model_file(EXAMPLES["linear_hardtanh_mish_groupnorm"], small=True).build()
    optimized = fxfuse.optimize(model, inputs)
    recorder = GraphRecorder()
    compiled = torch.compile(optimized, backend=fxfuse.make_backend(inner=recorder), fullgraph=True)
    assert_close_report(compiled(*inputs), model(*inputs))
    assert recorder.targets() == [gemm_epilogue]


def test_inductor_on_cpu_trains_through_the_fused_op():
    """Default inner compiler: Inductor takes the fused op as an extern kernel, forward and backward."""
    from torch._inductor.utils import run_and_get_code

    model, inputs = load_model_file(EXAMPLES["linear_groupnorm_min_bias"], small=True).build()
    backend = fxfuse.make_backend()
    compiled = torch.compile(model, backend=backend)
    x = inputs[0].clone().requires_grad_()
    _, (forward_code, backward_code) = run_and_get_code(lambda: compiled(x).sum().backward())
    assert "torch.ops.fxfuse.gemm_epilogue_train.default(" in forward_code
    assert "torch.ops.fxfuse.epilogue_backward.default(" in backward_code
    assert "gemm_epilogue_backward" not in backward_code  # the kept GEMM output: no recompute GEMM
    # Inductor reorders the backward's reductions (the weight gradient sums 64 rows of magnitude ~50): plain
    # Inductor is off eager by the same ~3e-5 here.
    assert_gradients_match(model, compiled, inputs, rtol=1e-4, atol=1e-4)
    assert [len(r.fused) for r in backend.reports] == [1]
    with torch.no_grad():
        assert_close_report(compiled(*inputs), model(*inputs))


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_training_graphs_get_the_training_op(grad):
    """Under grad mode with parameters to train, the fused op keeps its GEMM output for the backward; under
    no_grad it is the in-place inference op. Dynamo guards grad mode, so each mode gets its own graph."""
    model, inputs = load_model_file(EXAMPLES["linear_groupnorm_hardtanh"], small=True).build()
    recorder = GraphRecorder()
    backend = fxfuse.make_backend(inner=recorder)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        assert_close_report(compiled(*inputs), model(*inputs))
    with torch.set_grad_enabled(grad):
        assert_close_report(compiled(*inputs), model(*inputs))
    assert [recorder.targets(i) for i in range(len(recorder.graphs))] == \
        [[gemm_epilogue]] + ([TRAINING_FUSED] if grad else [])
    assert [[row.op for row in report.fused] for report in backend.reports] == \
        [["gemm_epilogue"]] + ([["gemm_epilogue_train"]] if grad else [])


def test_frozen_model_gets_the_inference_op_unless_its_input_requires_grad():
    model, inputs = load_model_file(EXAMPLES["linear_groupnorm_hardtanh"], small=True).build()
    model.requires_grad_(False)
    recorder = GraphRecorder()
    compiled = torch.compile(model, backend=fxfuse.make_backend(inner=recorder))
    assert_close_report(compiled(*inputs), model(*inputs))
    assert recorder.targets() == [gemm_epilogue]
    x = inputs[0].clone().requires_grad_()
    assert_gradients_match(model, compiled, [x], params=[])
    assert recorder.targets() == TRAINING_FUSED


def test_backend_by_name_defaults_to_inductor_with_dynamic_shapes(caplog):
    """Inductor also compiles the in-graph check of a pinned dynamic float (GroupNorm's eps)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.GroupNorm(4, 16), nn.Hardtanh(-2.0, 2.0))
    compiled = torch.compile(model, backend="fxfuse", dynamic=True)
    def reports():
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("fxfuse backend:")]

    with torch.no_grad(), caplog.at_level(logging.INFO, logger="fxfuse"):
        x = torch.randn(5, 8)
        assert_close_report(compiled(x), model(x))
        # Inductor may make Dynamo restart the trace once with eps specialized: that is Dynamo's own business.
        compiled_graphs = len(reports())
        x = torch.randn(9, 8)
        assert_close_report(compiled(x), model(x))
    assert len(reports()) == compiled_graphs, "a new batch size recompiled"
    assert all("1 fused region" in report for report in reports()), reports()


# ---------------------------------------------------------------- found by review: what Dynamo's graphs spell

W = torch.randn(16, 16)


def _changes_the_input_through_a_view(buf):
    h = torch.nn.functional.linear(buf[:4], W)
    buf.mul_(2)  # changes the GEMM's input after the GEMM read it
    return torch.sigmoid(h)


class InPlaceOnTheInput(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc, self.act = nn.Linear(16, 16), act

    def forward(self, x):
        h = self.fc(x)
        x = self.act(x)  # Dynamo spells nn.Dropout(inplace=True) F.dropout(x, p, training, True)
        return torch.sigmoid(h) + x


class GemmInInferenceMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        with torch.inference_mode():
            h = self.fc(x)
        return torch.sigmoid(h) * x


class ChangedThroughAWholeViewWithoutGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.shift = nn.Linear(16, 8), nn.Parameter(torch.randn(()))

    def forward(self, x):
        h = self.fc(x) * 2.0
        with torch.no_grad():
            h[:].add_(self.shift)  # a view made without grad, changed in place: later reads are of h, not of it
        return 2 ** h


def _linear_with_a_2d_bias(x, w, b):
    return torch.nn.functional.silu(torch.nn.functional.linear(x, w, b))


def test_a_region_output_changed_through_a_whole_view_without_grad_is_read_as_itself():
    """`h[:].add_(p)` under no_grad after a region's output h, then `2 ** h` with grad: the read is of the fused op's
    value (eager's h), not of the view that add_ returns, whose grad_fn autograd refuses to rebuild (it raised 'A view
    was created in no_grad mode ... modified inplace') (compile_hunt seed 110060)."""
    model, x, backend = ChangedThroughAWholeViewWithoutGrad().eval(), torch.randn(4, 16), fxfuse.make_backend("eager")
    assert_gradients_match(model, torch.compile(model, backend=backend), [x])
    assert [len(report.fused) for report in backend.reports] == [1]


def test_a_change_through_a_view_of_what_the_region_reads_is_seen():
    buf = torch.randn(8, 16)
    expected = _changes_the_input_through_a_view(buf.clone())
    actual = torch.compile(_changes_the_input_through_a_view, backend=fxfuse.make_backend(inner="eager"))(buf.clone())
    assert_close_report(actual, expected)


@pytest.mark.parametrize("act", ["dropout", "rrelu"])
def test_an_in_place_module_with_its_flag_given_by_position_is_seen(act):
    module = nn.Dropout(0.5, inplace=True) if act == "dropout" else nn.RReLU(inplace=True)
    model, x = InPlaceOnTheInput(module).train(act == "dropout"), torch.randn(4, 16)
    with torch.no_grad():
        torch.manual_seed(1)
        expected = model(x.clone())
        torch.manual_seed(1)
        actual = torch.compile(model, backend=fxfuse.make_backend(inner="eager"))(x.clone())
    assert_close_report(actual, expected)


def test_a_region_never_spans_an_inference_mode_block():
    model = GemmInInferenceMode()
    x = torch.randn(4, 16, requires_grad=True)
    torch.compile(model, backend=fxfuse.make_backend(inner="eager"))(x).sum().backward()
    assert model.fc.weight.grad is None  # the GEMM ran in inference mode, as eager's


def test_a_linear_with_a_bias_that_is_not_1_d_trains():
    x, w = torch.randn(4, 16, requires_grad=True), torch.randn(32, 16, requires_grad=True)
    b = torch.randn(1, 32, requires_grad=True)
    torch.compile(_linear_with_a_2d_bias, backend=fxfuse.make_backend(inner="eager"))(x, w, b).sum().backward()
    assert b.grad.shape == (1, 32)


def test_the_users_global_inductor_post_pass_is_kept():
    """The backend stamps Inductor's cache with fxfuse's sources through post_grad_custom_post_pass, but never in
    place of a pass the user set globally (it replaced it)."""
    import torch._inductor.config as inductor_config

    from fxfuse.backend import _inner_compiler

    saved = inductor_config.post_grad_custom_post_pass
    try:
        options = {}
        _inner_compiler("inductor", None, options)
        assert "post_grad_custom_post_pass" in options
        inductor_config.post_grad_custom_post_pass = object()
        options = {}
        _inner_compiler("inductor", None, options)
        assert "post_grad_custom_post_pass" not in options
    finally:
        inductor_config.post_grad_custom_post_pass = saved


def _in_place_dunder(fc, b, x):
    h = fc(x)
    return h.__iadd__(b)


# Dynamo records an explicit operator method as a call of that method (fx's trace as the operator's function).
DUNDER_SPELLINGS = {
    "h.__add__(b)": lambda fc, b, x: fc(x).__add__(b),
    "h.__radd__(2)": lambda fc, b, x: fc(x).__radd__(2.0),
    "h.__rsub__(2)": lambda fc, b, x: fc(x).__rsub__(2.0),
    "torch.Tensor.__mul__(h,2)": lambda fc, b, x: torch.Tensor.__mul__(fc(x), 2.0),
    "h.__rtruediv__(2)": lambda fc, b, x: fc(x).abs().__add__(1.0).__rtruediv__(2.0),
    "h.__truediv__(3)": lambda fc, b, x: fc(x).__truediv__(3.0),
    "h.__pow__(2)": lambda fc, b, x: fc(x).__pow__(2),
    "h.__neg__()": lambda fc, b, x: fc(x).__neg__(),
    "h.__abs__()": lambda fc, b, x: fc(x).__abs__(),
    "h.__iadd__(b)": _in_place_dunder,
    "x.__matmul__(W.t())+b": lambda fc, b, x: x.__matmul__(fc.weight.t()).__add__(b),
}


@pytest.mark.parametrize("name", list(DUNDER_SPELLINGS))
def test_an_explicit_operator_method_in_dynamos_graph_fuses(name):
    fc, b, x = nn.Linear(16, 32), torch.randn(32), torch.randn(4, 16)
    spelling = DUNDER_SPELLINGS[name]
    recorder = GraphRecorder()
    with torch.no_grad():
        expected = spelling(fc, b, x)
        actual = torch.compile(spelling, backend=fxfuse.make_backend(inner=recorder))(fc, b, x)
    assert_close_report(actual, expected)
    assert recorder.targets() == [gemm_epilogue], recorder.graphs[-1].code


class GemmThenSpelled(nn.Module):
    def __init__(self, epilogue):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.epilogue = epilogue

    def forward(self, x):
        return self.epilogue(self, self.fc(x))


def whole_view_in_place_then_size_scale(m, h):
    h[:, :].mul_(2)
    return h * h.size(-1) ** -0.5


def add_written_into_itself(m, h):
    torch.add(h, m.fc.bias, out=h)
    return h


@pytest.mark.parametrize("epilogue, program", [
    (whole_view_in_place_then_size_scale, "mul_(%0,2);mul(%1,0.25)"),
    (add_written_into_itself, "add_(%0,$0)"),
    (lambda m, h: h.add_(h.relu(), alpha=0.5), "relu(%0);mul(%1,0.5);add_(%0,%2)"),
    (lambda m, h: torch.sub(h, m.fc.bias, alpha=2), "mul($0,2.0);sub(%0,%1)"),
    (lambda m, h: h.addcdiv(m.fc.bias, h.exp(), value=0.5), "exp(%0);mul($0,0.5);div(%2,%1);add(%0,%3)"),
], ids=["whole-view-in-place-then-size", "out=", "alpha-of-a-value", "alpha-of-a-param", "addcdiv"])
def test_spellings_of_views_out_and_alpha_fuse_in_dynamos_graph(epilogue, program):
    """Dynamo's graphs hold the feature count as a number already; views, out= and alpha are spelled as in fx's."""
    backend = FxfuseBackend(inner="eager")
    model = GemmThenSpelled(epilogue).eval()
    x = torch.randn(4, 8)
    with torch.no_grad():  # (eager raises for out= where autograd would record it)
        assert_close_report(torch.compile(model, backend=backend)(x), model(x))
    assert [row.program for row in backend.reports[-1].fused] == [program], backend.reports[-1]
