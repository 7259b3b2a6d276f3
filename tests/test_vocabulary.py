"""Generic tests over the whole epilogue vocabulary (``fxfuse.epilogue.EPILOGUE_OPS``).

For every op and every attribute set in its ``samples``, a model calls the op's *reference* directly after a
Linear; it must become one fused op whose program is exactly that op, and match eager. Adding an op to the
vocabulary adds these tests: its reference is a spelling the pass must recognise.
"""
import pytest
import torch
import torch.nn as nn

from epilogue_models import BATCH, IN, OUT, assert_whole_chain_fused, fused_programs
from fxfuse.epilogue import EPILOGUE_OPS, NORM, POINTWISE, REDUCTION
from fxfuse.program import run_program


class LinearThenReference(nn.Module):
    """Linear, then `reference(h, *operands, **attrs)`; tensor operands are parameters or buffers."""

    def __init__(self, op, attrs, operands):
        super().__init__()
        self.fc = nn.Linear(IN, OUT)
        self.reference = EPILOGUE_OPS[op].reference
        self.attrs = dict(attrs)
        self.operand_names = []
        for i, operand in enumerate(operands):
            name = f"operand{i}"
            if isinstance(operand, nn.Parameter):
                self.register_parameter(name, operand)
            elif isinstance(operand, torch.Tensor):
                self.register_buffer(name, operand)
            else:
                setattr(self, name, operand)
            self.operand_names.append(name)
        self.first = 0  # the position of the region's value among the operands
        self.gradient_free = EPILOGUE_OPS[op].gradient_free

    def forward(self, x):
        h = self.fc(x)
        operands = [getattr(self, name) for name in self.operand_names]
        operands.insert(self.first, h)
        result = self.reference(*operands, **self.attrs)
        return h + result if self.gradient_free else result  # alone, such an op is not fused (match.py)


def per_feature(name):
    if name == "running_var":
        return torch.rand(OUT) + 0.5
    if name == "running_mean":
        return torch.randn(OUT)
    return nn.Parameter(torch.randn(OUT))


def cases():
    """(op, attrs, other operands, position of the region value, expected operand text) for every op."""
    for name, spec in EPILOGUE_OPS.items():
        for attrs in spec.samples:
            others = spec.operands[1:]
            label = ",".join(f"{k}={v}" for k, v in attrs.items())
            if spec.is_binary:
                kinds = ((lambda: nn.Parameter(torch.randn(OUT)), "vector"), (lambda: 2.5, "scalar"))
                for operand, kind in kinds:
                    for first in (0, 1):  # the region value's position; a number takes the other's
                        if kind == "vector" or 1 - first in spec.number_operands:
                            yield pytest.param(name, attrs, operand, first, id=f"{name}-{kind}-{'ab'[first]}-first")
            elif others:
                yield pytest.param(name, attrs, lambda others=others: [per_feature(o) for o in others], 0,
                                   id=f"{name}-{label}-with-tensors")
                if spec.kind == NORM and all(o in ("weight", "bias") for o in others):  # prelu takes no None
                    yield pytest.param(name, attrs, lambda others=others: [None for _ in others], 0,
                                       id=f"{name}-{label}-without-affine")
            else:
                yield pytest.param(name, attrs, lambda: [], 0, id=f"{name}-{label}")


@pytest.mark.parametrize("op, attrs, make_operands, first", list(cases()))
def test_every_vocabulary_op_fuses_through_its_reference(op, attrs, make_operands, first):
    operands = make_operands()
    operands = operands if isinstance(operands, list) else [operands]
    model = LinearThenReference(op, attrs, operands).eval()
    model.first = first
    optimized = assert_whole_chain_fused(model, (torch.randn(BATCH, IN),))
    (program,) = fused_programs(optimized)
    first, *rest = program.split(";")
    after = ["add(%0,%1)"] if EPILOGUE_OPS[op].gradient_free else []
    assert first.split("(")[0] == op and rest == after, f"{op} became {program}"


def test_every_op_has_a_kind_and_samples_that_match_its_attributes():
    for name, spec in EPILOGUE_OPS.items():
        assert spec.kind in (POINTWISE, NORM, REDUCTION), name
        for sample in spec.samples:
            assert set(sample) == set(spec.attrs), f"{name}: sample {sample} vs attributes {spec.attrs}"
        if spec.feature_dim_attr:
            assert spec.feature_dim_attr in spec.attrs, name


def test_issue_2_vocabulary_is_covered():
    required = {"add", "sub", "mul", "div", "neg", "clamp", "relu", "leaky_relu", "elu", "gelu", "silu", "mish",
                "sigmoid", "tanh", "softplus", "hardswish", "hardsigmoid", "exp", "log", "abs", "pow",
                "group_norm", "layer_norm", "rms_norm", "batch_norm", "softmax", "log_softmax",
                "sum", "mean", "amax", "amin", "logsumexp"}
    assert required <= set(EPILOGUE_OPS), sorted(required - set(EPILOGUE_OPS))


# ---------------------------------------------------------------- over a features dim of one value

ONE_VALUE_OPS = [name for name, spec in EPILOGUE_OPS.items() if spec.over_one_feature is not None]
SPECIAL_VALUES = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.5, -2.25, 3e38, -1e-30]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                   reason="needs a CUDA GPU")])]


def over_one_feature_program(op):
    """The program text that stands for `op` on a value of one feature (%0), from its spec's steps."""
    instructions, result = [], "%0"
    for step, args in EPILOGUE_OPS[op].over_one_feature:
        texts = ["%0" if a == "x" else result if a == "y" else repr(a) for a in args]
        instructions.append(f"{step}({','.join(texts)})")
        result = f"%{len(instructions)}"
    return ";".join(instructions)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ONE_VALUE_OPS)
def test_each_ops_steps_over_one_feature_are_its_reference(op, dtype, device):
    """Bit for bit (signs of zero included; NaN where the reference has NaN), the same gradient, and the same dtype
    under autocast (CUDA's runs sum, logsumexp, softmax and log_softmax in float32)."""
    spec = EPILOGUE_OPS[op]
    x = torch.tensor(SPECIAL_VALUES + torch.randn(7).tolist(), dtype=dtype, device=device).reshape(-1, 1)
    attrs = {"dim": -1, "keepdim": True} if spec.kind == REDUCTION else {"dim": -1}
    program = over_one_feature_program(op)
    steps = (lambda value: run_program(value, [], program)) if program else (lambda value: value)
    expected, actual = spec.reference(x, **attrs), steps(x)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = expected.isnan()
    wrong = (nan != actual.isnan()) | (~nan & ((actual != expected) | (actual.signbit() != expected.signbit())))
    assert not wrong.any(), (f"row {wrong.nonzero()[0, 0].item()}: {x[wrong][0].item()} -> steps "
                             f"{actual[wrong][0].item()}, reference {expected[wrong][0].item()}")
    leaf, cotangent = x.clone().requires_grad_(True), torch.randn(x.shape).to(x)
    (grad_reference,) = torch.autograd.grad(spec.reference(leaf, **attrs), leaf, cotangent)
    (grad_steps,) = torch.autograd.grad(steps(leaf), leaf, cotangent)
    finite = x.isfinite().flatten()
    torch.testing.assert_close(grad_steps[finite], grad_reference[finite], rtol=0, atol=0)
    for low in (torch.bfloat16, torch.float16):
        with torch.autocast(device, dtype=low):
            assert steps(x).dtype == spec.reference(x, **attrs).dtype, f"under {device} autocast to {low}"
