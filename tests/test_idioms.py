"""Multi-node idioms: the built-in ones (fxfuse.patterns) in any spelling of their ops, and idioms that user code
declares with ``fxfuse.idiom`` without editing fxfuse. Scalars of an idiom are captured, never baked in.
"""
import inspect
import math
import re

import pytest
import torch
import torch.nn.functional as F

import fxfuse
from epilogue_models import BATCH, IN, GemmThen, assert_whole_chain_fused, fused_programs
from fxfuse import idioms
from fxfuse.testing import assert_close_report


@pytest.fixture
def scratch_idioms():
    """Idioms declared in a test are forgotten after it."""
    saved = list(idioms.IDIOMS)
    yield
    idioms.IDIOMS[:] = saved


def program_of(epilogue, x=None, **extras):
    model = GemmThen(epilogue, **extras)
    optimized = assert_whole_chain_fused(model, (torch.randn(BATCH, IN) if x is None else x,))
    (program,) = fused_programs(optimized)
    return program


def on_gemm(fn):
    return lambda m, x, y: fn(m.fc(x))


# ---------------------------------------------------------------- built-in idioms, in other spellings of their ops


BUILT_IN = {
    "silu: x*torch.sigmoid(x)": (on_gemm(lambda h: h * torch.sigmoid(h)), "silu(%0)"),
    "silu: x.sigmoid().mul(x)": (on_gemm(lambda h: h.sigmoid().mul(h)), "silu(%0)"),
    "mish: x*F.softplus(x).tanh()": (on_gemm(lambda h: h * F.softplus(h).tanh()), "mish(%0)"),
    "mish: x*tanh(softplus(x, beta=1, threshold=20))": (
        on_gemm(lambda h: h * torch.tanh(F.softplus(h, 1.0, 20.0))), "mish(%0)"),
    "hardswish: x*F.hardtanh(x+3,0,6)/6": (on_gemm(lambda h: h * F.hardtanh(h + 3, 0, 6) / 6), "hardswish(%0)"),
    "gelu-tanh spelled out": (on_gemm(lambda h: 0.5 * h * (1.0 + torch.tanh(
        0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))), "gelu(%0,'tanh')"),
    "gelu-erf spelled out": (on_gemm(lambda h: h * 0.5 * (1.0 + torch.erf(h / math.sqrt(2.0)))), "gelu(%0,'none')"),
    "gelu-erf: 0.5*x*(1+erf(x*0.7071...))": (
        on_gemm(lambda h: 0.5 * h * (1 + torch.erf(h * 0.7071067811865476))), "gelu(%0,'none')"),
    "gelu-erf: .mul and 2 ** 0.5": (
        on_gemm(lambda h: h.mul(0.5).mul(1.0 + torch.erf(h / 2 ** 0.5))), "gelu(%0,'none')"),
    "gelu-erf: the method (x / sqrt2).erf()": (
        on_gemm(lambda h: h * 0.5 * (1.0 + (h / math.sqrt(2.0)).erf())), "gelu(%0,'none')"),
    "gelu-erf: torch.special.erf": (
        on_gemm(lambda h: 0.5 * h * (1.0 + torch.special.erf(h / math.sqrt(2.0)))), "gelu(%0,'none')"),
    "leaky_relu via where, torch.gt": (on_gemm(lambda h: torch.where(torch.gt(h, 0), h, 0.2 * h)), "leaky_relu(%0,0.2)"),
    "leaky_relu via where, h.greater(0)": (
        on_gemm(lambda h: torch.where(h.greater(0), h, 0.2 * h)), "leaky_relu(%0,0.2)"),
    "leaky_relu via the method h.where(h > 0, 0.1 * h)": (
        on_gemm(lambda h: h.where(h > 0, 0.1 * h)), "leaky_relu(%0,0.1)"),
    "elu via where, h.gt(0)": (on_gemm(lambda h: torch.where(h.gt(0), h, 0.7 * (h.exp() - 1))), "elu(%0,0.7,1.0,1.0)"),
    "leaky_relu via where, slope captured": (
        on_gemm(lambda h: torch.where(h > 0, h, 0.2 * h)), "leaky_relu(%0,0.2)"),
    "elu via where, alpha captured": (
        on_gemm(lambda h: torch.where(h > 0, h, 0.7 * (torch.exp(h) - 1.0))), "elu(%0,0.7,1.0,1.0)"),
    "elu via where, other alpha": (
        on_gemm(lambda h: torch.where(h > 0, h, 1.3 * (h.exp() - 1))), "elu(%0,1.3,1.0,1.0)"),
    "rms_norm: LLaMA's x*rsqrt(x.pow(2).mean(-1,keepdim=True)+eps)": (
        on_gemm(lambda h: h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)), "rms_norm(%0,None,1e-06)"),
    "rms_norm: x / sqrt(x.pow(2).mean(-1,keepdim=True)+eps)": (
        on_gemm(lambda h: h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)), "rms_norm(%0,None,1e-06)"),
    "rms_norm: torch.square, eps first, then a scale": (
        on_gemm(lambda h: 2.0 * (h * (1e-5 + torch.square(h).mean(dim=-1, keepdim=True)).rsqrt())),
        "rms_norm(%0,None,1e-05);mul(2.0,%1)"),
}


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_built_in_idiom_in_another_spelling(name):
    epilogue, program = BUILT_IN[name]
    assert program_of(epilogue) == program


NOT_THE_IDIOM = {
    "x*sigmoid(2x) is not silu": (on_gemm(lambda h: h * torch.sigmoid(h * 2.0)), "silu"),
    "x*tanh(softplus(x, beta=2)) is not mish": (on_gemm(lambda h: h * torch.tanh(F.softplus(h, beta=2.0))), "mish"),
    "x*relu6(x+2)/6 is not hardswish": (on_gemm(lambda h: h * F.relu6(h + 2.0) / 6.0), "hardswish"),
    "x*rsqrt(x.pow(2).sum(-1,keepdim=True)+eps) is not rms_norm": (
        on_gemm(lambda h: h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + 1e-6)), "rms_norm"),
    # clamp's gradient on its bounds is 1, relu6's (and hardswish's at -3 and 3) 0: not the same function's
    "x*clamp(x+3,0,6)/6 is not hardswish": (on_gemm(lambda h: h * torch.clamp(h + 3.0, 0.0, 6.0) / 6.0),
                                            "hardswish"),
    "gelu with another constant is not gelu": (on_gemm(lambda h: 0.5 * h * (1.0 + torch.tanh(
        0.79 * (h + 0.044715 * torch.pow(h, 3.0))))), "gelu"),
}


@pytest.mark.parametrize("name", list(NOT_THE_IDIOM))
def test_near_idiom_is_not_that_op(name):
    """A near idiom is not recognised as the op; what of it is in the vocabulary still fuses, and matches."""
    epilogue, op = NOT_THE_IDIOM[name]
    model = GemmThen(epilogue)
    optimized = fxfuse.testing.assert_fuses(model, (torch.randn(BATCH, IN),), regions=1)
    assert op + "(" not in fused_programs(optimized)[0]


def test_erf_gelu_with_another_scale_is_not_gelu():
    model = GemmThen(on_gemm(lambda h: h * 0.5 * (1.0 + torch.erf(h / 1.5))))
    optimized = fxfuse.testing.assert_fuses(model, (torch.randn(BATCH, IN),), regions=1)
    (program,) = [row.program for row in optimized.fxfuse_report.fused]
    assert program == "mul(%0,0.5);div(%0,1.5);erf(%2);add(1.0,%3);mul(%1,%4)"  # the ops as written


def test_elu_spelling_with_another_threshold_is_not_elu():
    model = GemmThen(on_gemm(lambda h: torch.where(h > 1, h, 0.7 * (torch.exp(h) - 1.0))))
    fxfuse.testing.assert_not_fused(model, (torch.randn(BATCH, IN),), reason="`where` (where) is not an epilogue op")


# ---------------------------------------------------------------- user-declared idioms


def test_user_declared_idiom_fuses(scratch_idioms):
    @fxfuse.idiom("silu")
    def silu_as_division(x):
        return x / (1.0 + torch.exp(-x))

    assert program_of(on_gemm(lambda h: h / (1.0 + torch.exp(-h)))) == "silu(%0)"


def test_user_idiom_captures_its_keyword_only_scalars(scratch_idioms):
    @fxfuse.idiom("leaky_relu")
    def leaky_relu_by_maximum(x, *, negative_slope):
        return torch.where(x >= 0, x, x * negative_slope)

    assert program_of(on_gemm(lambda h: torch.where(h >= 0, h, h * 0.05))) == "leaky_relu(%0,0.05)"
    assert program_of(on_gemm(lambda h: torch.where(h >= 0, h, 0.3 * h))) == "leaky_relu(%0,0.3)"


def test_user_idiom_with_fixed_attributes(scratch_idioms):
    @fxfuse.idiom("clamp", min=0.0, max=1.0)
    def unit_clamp(x):
        return torch.minimum(torch.relu(x), torch.ones_like(x))

    assert program_of(on_gemm(lambda h: torch.minimum(torch.relu(h), torch.ones_like(h)))) == "clamp(%0,0.0,1.0)"


def test_user_idiom_of_two_tensors(scratch_idioms):
    @fxfuse.idiom("add")
    def add_by_double_negation(x, y):
        return x - (-y)

    program = program_of(lambda m, x, y: m.fc(x) - (-m.b), b=torch.nn.Parameter(torch.randn(40)))
    assert program == "add(%0,$0)"


def test_user_idioms_do_not_leak_between_tests():
    assert all(i.function.__module__ != __name__ for i in idioms.IDIOMS)


@pytest.mark.parametrize("op, fixed, message", [
    ("nosuchop", {}, "'nosuchop' is not an epilogue op"),
    ("rms_norm", {"wieght": None}, "rms_norm has no operand or attribute wieght"),
    ("rms_norm", {"weight": 1.0}, "a fixed operand can only be None (weight)"),
])
def test_an_idiom_with_a_wrong_declaration_says_what(op, fixed, message, scratch_idioms):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        @fxfuse.idiom(op, **fixed)
        def spelled(x, *, eps):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_an_idiom_whose_op_has_an_extra_argument_is_not_matched():
    """The model's mean has a dtype= that the idiom's has not: not rms_norm (which would drop the dtype); the
    mean itself is then refused for its pinned dtype, and the region stops before it."""
    model = GemmThen(on_gemm(lambda h: h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True, dtype=torch.float32) + 1e-6)))
    optimized = fxfuse.optimize(model, (torch.randn(BATCH, IN),))
    assert not any("rms_norm" in program for program in fused_programs(optimized))
    reasons = [row.reason for row in optimized.fxfuse_report.near_misses]
    assert any("pins its result's dtype" in reason for reason in reasons), reasons


@pytest.mark.parametrize("spelling", ["leaky", "elu"])
def test_keyword_arguments_of_an_op_outside_the_vocabulary_are_not_positions(spelling):
    """torch.where(h > 0, other=h, input=y) is where(h > 0, y, h): the leaky_relu / elu idioms read positions,
    so with keywords in another order they must not match (they did, and returned other values)."""
    branch = {"leaky": lambda h: 0.1 * h, "elu": lambda h: 2.0 * (h.exp() - 1.0)}[spelling]
    model = GemmThen(on_gemm(lambda h: torch.where(h > 0, other=h, input=branch(h))))
    x = torch.randn(BATCH, IN)
    optimized = fxfuse.optimize(model, (x,))
    assert not any(op in program for program in fused_programs(optimized) for op in ("leaky_relu", "elu("))
    with torch.no_grad():
        fxfuse.testing.assert_close_report(optimized(x), model(x))


def test_the_method_where_is_where_of_its_condition_self_and_other_only_by_position():
    """`a.where(c, b)` is torch.where(c, a, b); with `other=` its operands are not read by position."""
    for spelled in (lambda h: (h * 0.1).where(h > 0, h), lambda h: (h * 0.1).where(h > 0, other=h)):
        model, x = GemmThen(on_gemm(spelled)), torch.randn(BATCH, IN)
        optimized = fxfuse.optimize(model, (x,))
        assert not any("leaky_relu" in program for program in fused_programs(optimized))
        with torch.no_grad():
            assert_close_report(optimized(x), model(x))


def test_an_idiom_rooted_at_an_in_place_op_keeps_its_mutation_in_sight():
    """b *= torch.sigmoid(b) (Dynamo's operator.imul) is silu in place of b: a region that read b before it must
    not read it after (it did, through the idiom, which dropped the in-place record)."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(IN, 8)

        def forward(self, x, b):
            t = self.fc(x) + b
            b *= torch.sigmoid(b)
            return t * 2

    model, x, b = Model().eval(), torch.randn(BATCH, IN), torch.randn(8)
    with torch.no_grad():
        fxfuse.testing.assert_close_report(torch.compile(model, backend="fxfuse")(x, b.clone()), model(x, b.clone()))


@pytest.mark.parametrize("spelled, scale", [
    (lambda h: h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6), 300.0),  # pow(2) overflows past 256
    (lambda h: h * F.relu6(h + 3.0) / 6.0, 20000.0),                             # the product past 65504
], ids=["rms_norm", "hardswish"])
def test_an_idiom_that_overflows_in_fp16_is_not_its_op_there(spelled, scale):
    """Eager's fp16 spelled-out formula gives 0 or inf where rms_norm and hardswish, computing in fp32, do not:
    those idioms apply to fp32 and bf16 values only."""
    torch.manual_seed(0)
    model = GemmThen(on_gemm(spelled)).half().eval()
    with torch.no_grad():
        model.fc.weight.mul_(scale)
    x = torch.randn(BATCH, IN, dtype=torch.float16)
    optimized = fxfuse.optimize(model, (x,))
    assert not any(op in program for program in fused_programs(optimized) for op in ("rms_norm", "hardswish"))
    with torch.no_grad():
        expected, actual = model(x), optimized(x)
    assert torch.equal(actual.isinf(), expected.isinf()) and (expected.isinf() | (expected == 0)).any()
    assert_close_report(actual, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("spelled", [lambda h: h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6),
                                     lambda h: h * F.relu6(h + 3.0) / 6.0], ids=["rms_norm", "hardswish"])
def test_an_idiom_of_fp32s_range_runs_in_float64(spelled):
    """rms_norm's and hardswish's idioms, declared for fp32 and bf16, raised in a model optimized in fp32 and then
    cast to float64, where eager's formula is as exact as the op."""
    model = GemmThen(on_gemm(spelled)).eval()
    optimized = fxfuse.optimize(model, (torch.randn(BATCH, IN),))
    assert fused_programs(optimized)
    optimized.double()
    x = torch.randn(BATCH, IN, dtype=torch.float64)
    with torch.no_grad():
        assert_close_report(optimized(x), model(x))


def test_an_idiom_captures_numpy_numbers_as_pythons(scratch_idioms):
    """A NumPy float captured raw made the program text `np.float64(-0.5)`, which the op could not parse."""
    np = pytest.importorskip("numpy")

    @fxfuse.idiom("clamp")
    def clamp_by_full_like(x, *, min, max):
        return torch.minimum(torch.maximum(x, torch.full_like(x, min)), torch.full_like(x, max))

    program = program_of(on_gemm(lambda h: torch.minimum(torch.maximum(h, torch.full_like(h, np.float64(-0.5))),
                                                         torch.full_like(h, np.float64(0.5)))))
    assert program == "clamp(%0,-0.5,0.5)"


def idiom_cases():
    """(built-in idiom, the attributes it captures) for each sample of its op that agrees with its fixed ones."""
    import fxfuse.patterns  # noqa: F401  (registers the built-in idioms)
    from fxfuse.epilogue import EPILOGUE_OPS

    cases = []
    for built_in in idioms.IDIOMS:
        captured = [p.name for p in inspect.signature(built_in.function).parameters.values()
                    if p.kind is p.KEYWORD_ONLY]
        for sample in EPILOGUE_OPS[built_in.op].samples:
            agrees = all(sample.get(name, value) == value for name, value in built_in.attrs.items())
            if agrees and all(sample.get(name) is not None for name in captured):
                cases.append(pytest.param(built_in, {name: sample[name] for name in captured},
                                          id=f"{built_in.function.__name__}-{sample}"))
    return cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("built_in, captured", idiom_cases())
def test_a_built_in_idiom_is_its_op_within_rounding_in_every_dtype_it_claims(built_in, captured, dtype):
    """Eager's spelled-out formula, in the dtype, against the op's reference in that dtype (which computes in fp32
    as the fused op does), at fxfuse.testing's tolerances, over [-12, 12], random values and magnitudes up to 2e4
    (where fp16 intermediates overflow): where they differ, the idiom must not claim the dtype (`dtypes=`)."""
    from fxfuse.epilogue import EPILOGUE_OPS

    if built_in.dtypes is not None and dtype not in built_in.dtypes:
        pytest.skip(f"declared for {built_in.dtypes} only")
    torch.manual_seed(0)
    large = torch.logspace(1.0, 4.3, 64)
    x = torch.cat([torch.linspace(-12.0, 12.0, 4800), torch.randn(4032) * 3.0, large, -large]).view(-1, 64)
    x = x.to(dtype)
    attrs = {**built_in.attrs, **captured}
    expected = EPILOGUE_OPS[built_in.op].reference(x, **built_in.fixed_operands, **attrs)
    assert_close_report(built_in.function(x, **captured), expected)
