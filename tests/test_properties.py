"""Property-based tests (hypothesis): random legal epilogue chains, shapes and parameters; optimized == eager.

A chain is drawn as a list of steps after a GEMM: pointwise ops in various spellings (some in-place) with
random scalars, binary ops with a scalar, a per-feature parameter, a second model input or an earlier value
of the chain, norms over the features, then optionally one row reduction followed by pointwise ops on the
reduced value. Every drawn chain is legal, so the whole model must become one fused op and match eager at
rtol=atol=1e-5 in float32.

Spelled-out idioms (``x * sigmoid(x)``...) are left to test_spellings.py and test_idioms.py: the fused op
computes them with the op they stand for, not eager's op order, which a norm further down may amplify.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fxfuse
from epilogue_models import assert_whole_chain_fused
from fxfuse.program import Program
from fxfuse.testing import assert_close_report

# FXFUSE_PROPERTY_EXAMPLES=2000 fuzzes harder, with fresh random examples (CI: 40, derandomized).
EXAMPLES = int(os.environ.get("FXFUSE_PROPERTY_EXAMPLES", "0"))
PROPERTY_SETTINGS = settings(max_examples=EXAMPLES or 40, deadline=None, derandomize=not EXAMPLES,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

scalars = st.floats(-3.0, 3.0, allow_nan=False).map(lambda v: round(v, 3))
positive = st.floats(0.1, 3.0).map(lambda v: round(v, 3))


def unary_steps():
    """(name, strategy of scalars, function(h, *scalars))."""
    return [
        ("relu", st.just(()), lambda h: torch.relu(h)),
        ("relu_", st.just(()), lambda h: h.relu_()),
        ("nn.ReLU6", st.just(()), lambda h: nn.functional.relu6(h)),
        ("hardtanh", st.tuples(st.floats(-2, 0), st.floats(0.01, 2)), lambda h, lo, hi: F.hardtanh(h, lo, hi)),
        ("clamp_min", st.tuples(scalars), lambda h, lo: h.clamp(min=lo)),
        ("clip", st.tuples(st.floats(-2, 0), st.floats(0, 2)), lambda h, lo, hi: torch.clip(h, lo, hi)),
        ("leaky_relu", st.tuples(st.floats(0.0, 0.5)), lambda h, s: F.leaky_relu(h, s)),
        ("leaky_relu_", st.tuples(st.floats(0.0, 0.5)), lambda h, s: F.leaky_relu_(h, s)),
        ("elu", st.tuples(positive), lambda h, a: F.elu(h, a)),
        ("selu", st.just(()), lambda h: torch.selu(h)),
        ("celu", st.tuples(positive), lambda h, a: F.celu(h, a)),
        ("gelu", st.tuples(st.sampled_from(["none", "tanh"])), lambda h, a: F.gelu(h, approximate=a)),
        ("silu", st.just(()), lambda h: F.silu(h)),
        ("mish", st.just(()), lambda h: F.mish(h)),
        ("sigmoid", st.just(()), lambda h: h.sigmoid()),
        ("tanh_", st.just(()), lambda h: h.tanh_()),
        ("softplus", st.tuples(positive, st.floats(0.5, 20)), lambda h, b, t: F.softplus(h, b, t)),
        ("hardswish", st.just(()), lambda h: F.hardswish(h)),
        ("hardsigmoid", st.just(()), lambda h: F.hardsigmoid(h)),
        ("abs", st.just(()), lambda h: h.abs()),
        ("neg", st.just(()), lambda h: -h),
        ("square", st.sampled_from([(2,), (2.0,), (3,)]), lambda h, e: h ** e),
        ("exp-of-tanh", st.just(()), lambda h: torch.exp(torch.tanh(h))),
        ("log-of-sigmoid", st.just(()), lambda h: torch.log(torch.sigmoid(h))),
    ]


BINARY = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
    "torch.add": lambda a, b: torch.add(a, b), "sub": lambda a, b: torch.sub(a, b),
    "mul": lambda a, b: torch.mul(a, b),
}


@st.composite
def chains(draw):
    """A legal chain: (leading dims, in features, out features, steps)."""
    leading = draw(st.sampled_from([(1,), (2,), (3,), (5,), (2, 3), (1, 4)]))
    in_features = draw(st.integers(1, 20))
    out_features = draw(st.sampled_from([1, 2, 7, 12, 33, 40]))
    steps = []
    count = draw(st.integers(1, 6))
    values = 1  # how many values the chain has computed so far (the GEMM's output is value 0)
    for _ in range(count):
        kind = draw(st.sampled_from(["unary", "unary", "binary", "norm"]))
        if kind == "unary":
            name, args, _ = draw(st.sampled_from(unary_steps()))
            steps.append(("unary", name, draw(args)))
        elif kind == "binary":
            op = draw(st.sampled_from(sorted(BINARY)))
            other = draw(st.sampled_from(["scalar", "vector", "input", "earlier"]))
            detail = draw(scalars) if other == "scalar" else draw(st.integers(0, values - 1))
            steps.append(("binary", op, other, detail, draw(st.booleans())))
        else:
            # group_norm: a 2-D output, and groups of 2 or more features (eager refuses 1-value groups)
            norm = draw(st.sampled_from(["layer_norm", "rms_norm", "softmax", "log_softmax"]
                                        + (["group_norm"] if len(leading) == 1 and out_features > 1 else [])))
            groups = draw(st.sampled_from([g for g in range(1, out_features) if out_features % g == 0] or [1]))
            steps.append(("norm", norm, groups, draw(st.sampled_from([1e-5, 1e-3])), draw(st.booleans())))
        values += 1
    if draw(st.booleans()):
        steps.append(("reduce", draw(st.sampled_from(["sum", "mean", "amax", "amin", "max.values", "min[0]",
                                                       "logsumexp"])), draw(st.booleans())))
        for _ in range(draw(st.integers(0, 2))):
            if draw(st.booleans()):
                name, args, _ = draw(st.sampled_from(unary_steps()))
                steps.append(("unary", name, draw(args)))
            else:
                steps.append(("binary", draw(st.sampled_from(sorted(BINARY))), "scalar", draw(scalars),
                              draw(st.booleans())))
    return leading, in_features, out_features, steps


class RandomChain(nn.Module):
    def __init__(self, in_features, out_features, steps):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.steps = steps
        self.unary = {name: fn for name, _, fn in unary_steps()}
        for i, step in enumerate(steps):
            if step[0] == "binary" and step[2] == "vector":
                self.register_parameter(f"vector{i}", nn.Parameter(torch.randn(out_features)))
            if step[0] == "norm" and step[4]:  # affine
                self.register_parameter(f"weight{i}", nn.Parameter(torch.randn(out_features)))
                self.register_parameter(f"bias{i}", nn.Parameter(torch.randn(out_features)))

    def forward(self, x, y):
        values = [self.fc(x)]
        for i, step in enumerate(self.steps):
            values.append(self.apply_step(i, step, values, y))
        return values[-1]

    def apply_step(self, i, step, values, y):
        """The value of step `i` of the chain; `values` holds the chain's values so far."""
        h = values[-1]
        if step[0] == "unary":
            return self.unary[step[1]](h, *step[2])
        if step[0] == "binary":
            _, op, other, detail, swap = step
            operand = {"scalar": lambda: detail, "vector": lambda: getattr(self, f"vector{i}"),
                       "input": lambda: y, "earlier": lambda: values[detail]}[other]()
            return BINARY[op](operand, h) if swap else BINARY[op](h, operand)
        if step[0] == "norm":
            _, norm, groups, eps, affine = step
            w, b = (getattr(self, f"weight{i}"), getattr(self, f"bias{i}")) if affine else (None, None)
            if norm == "layer_norm":
                return F.layer_norm(h, (h.shape[-1],), w, b, eps)
            if norm == "rms_norm":
                return F.rms_norm(h, h.shape[-1:], w, eps)
            if norm == "group_norm":
                return F.group_norm(h, groups, w, b, eps)
            return getattr(torch, norm)(h, -1)
        _, reduction, keepdim = step
        if reduction == "max.values":
            return h.max(dim=-1, keepdim=keepdim).values
        if reduction == "min[0]":
            return torch.min(h, -1, keepdim)[0]
        return getattr(torch, reduction)(h, -1, keepdim)


@PROPERTY_SETTINGS
@given(chains())
def test_random_legal_chain_fuses_and_matches_eager(chain):
    leading, in_features, out_features, steps = chain
    model = RandomChain(in_features, out_features, steps)
    x, y = torch.randn(*leading, in_features), torch.randn(*leading, out_features)
    assert_whole_chain_fused(model, (x, y))


@PROPERTY_SETTINGS
@given(chains())
def test_random_chain_fuses_without_example_inputs_too(chain):
    """Without shapes the matcher proves less; whatever it fuses must still be right."""
    leading, in_features, out_features, steps = chain
    model = RandomChain(in_features, out_features, steps)
    x, y = torch.randn(*leading, in_features), torch.randn(*leading, out_features)
    optimized = fxfuse.optimize(model)
    with torch.no_grad():
        assert_close_report(optimized(x, y), model(x, y), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- any graph: whatever is fused must be right


@st.composite
def graphs(draw):
    """A chain like `chains()`, interleaved with what ends or splits regions: intermediates returned as extra
    outputs, ops outside the vocabulary, a further GEMM, an in-place change of the second input."""
    leading, in_features, out_features, steps = draw(chains())
    mixed, reduced = [], False
    for step in steps:
        reduced = reduced or step[0] == "reduce"
        if draw(st.integers(0, 2)) == 0:
            kinds = ["leak", "mutate-y"] + ([] if reduced else ["flip", "cumsum", "gemm"])
            mixed.append(("other", draw(st.sampled_from(kinds))))
        mixed.append(step)
    if draw(st.booleans()):
        mixed.append(("other", "leak"))
    return leading, in_features, out_features, mixed


class RandomGraph(RandomChain):
    def __init__(self, in_features, out_features, steps):
        super().__init__(in_features, out_features, [s for s in steps if s[0] != "other"])
        self.all_steps = steps
        self.square = nn.Linear(out_features, out_features)

    def forward(self, x, y):
        outputs, values, index = [], [self.fc(x)], 0
        for step in self.all_steps:
            if step[0] != "other":
                values.append(self.apply_step(index, step, values, y))
                index += 1
            elif step[1] == "leak":
                outputs.append(values[-1])
            elif step[1] == "mutate-y":
                y.mul_(0.5)
            else:
                h = values[-1]
                values.append({"flip": lambda: torch.flip(h, [-1]), "cumsum": lambda: h.cumsum(-1),
                               "gemm": lambda: self.square(h)}[step[1]]())
        return (values[-1], *outputs)


@PROPERTY_SETTINGS
@given(graphs())
def test_random_graph_optimized_matches_eager(graph):
    """Whatever optimize() fuses in any graph, the model must still compute what eager computes."""
    leading, in_features, out_features, steps = graph
    model = RandomGraph(in_features, out_features, steps)
    x, y = torch.randn(*leading, in_features), torch.randn(*leading, out_features)
    with torch.no_grad():
        expected = model(x, y.clone())
        optimized = fxfuse.optimize(model, (x, y.clone()))
        actual = optimized(x, y.clone())
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_close_report(a, e, rtol=1e-5, atol=1e-5, what=f"output {i}")


# ---------------------------------------------------------------- the program text


@st.composite
def program_texts(draw):
    """Random well-formed program text: instruction i reads values %0..%i and any literal."""
    number = st.one_of(st.integers(-5, 5), st.floats(allow_nan=True, allow_infinity=True, width=32))
    literal = number.map(lambda v: repr(v) if isinstance(v, float) else str(v))
    texts = []
    for i in range(draw(st.integers(1, 5))):
        value = st.integers(0, i).map(lambda k: f"%{k}")
        texts.append(draw(st.one_of(
            st.tuples(st.sampled_from(["add", "sub", "mul", "div"]), value, st.one_of(value, literal)).map(
                lambda t: f"{t[0]}({t[1]},{t[2]})"),
            st.tuples(value, literal, literal).map(lambda t: f"clamp({t[0]},{t[1]},{t[2]})"),
            st.tuples(value, st.sampled_from(["'none'", "'tanh'"])).map(lambda t: f"gelu({t[0]},{t[1]})"),
            st.tuples(value, st.integers(-2, 1), st.sampled_from(["True", "False"])).map(
                lambda t: f"amax({t[0]},{t[1]},{t[2]})"),
            st.tuples(value, st.sampled_from(["None", "0.001"])).map(lambda t: f"rms_norm({t[0]},None,{t[1]})"),
        )))
    return ";".join(texts)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(program_texts())
def test_program_text_round_trips(text):
    program = Program.parse(text)
    assert str(program) == text
    assert str(Program.parse(str(program))) == text
