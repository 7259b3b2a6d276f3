"""Numerics of fused models against eager: odd shapes, bfloat16, NaN and inf, and the four workloads of issue 2.

float32 is checked at rtol=atol=1e-5 and bfloat16 at its usual tolerance (``fxfuse.testing``). float64 is
not fused at all (see test_negative.py); its numerics are then eager's own.
"""
import importlib.util
import pathlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from epilogue_models import GemmThen, assert_whole_chain_fused, fused_programs
import fxfuse
from fxfuse.testing import assert_close_report, assert_gradients_match

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def chains(features):
    """Representative epilogues for `features` output features (all of them divisible by the group count)."""
    groups = next(g for g in (4, 3, 2, 1) if features % g == 0)
    return {
        "bias-hardtanh-mish-groupnorm": (
            lambda m, x, y: m.gn(F.mish(F.hardtanh(m.fc(x) + m.b))),
            dict(gn=nn.GroupNorm(groups, features), b=nn.Parameter(torch.randn(features)))),
        "groupnorm-leakyrelu-x+x": (
            lambda m, x, y: (lambda h: h + h)(F.leaky_relu(m.gn(m.fc(x)), 0.01)),
            dict(gn=nn.GroupNorm(groups, features, eps=1e-5))),
        "groupnorm-hardtanh": (
            lambda m, x, y: F.hardtanh(m.gn(m.fc(x)), -2.0, 2.0), dict(gn=nn.GroupNorm(groups, features))),
        "layernorm-gelu": (lambda m, x, y: F.gelu(m.ln(m.fc(x))), dict(ln=nn.LayerNorm(features))),
        "rmsnorm-silu-scale": (lambda m, x, y: F.silu(m.rms(m.fc(x))) * 0.5, dict(rms=nn.RMSNorm(features))),
        "softmax": (lambda m, x, y: torch.softmax(m.fc(x), -1), {}),
        "logsumexp-keepdim-minus": (lambda m, x, y: (lambda h: h - h.logsumexp(-1, keepdim=True))(m.fc(x)), {}),
        "mean-no-keepdim": (lambda m, x, y: torch.tanh(m.fc(x)).mean(-1), {}),
    }


SHAPES = {
    "batch-1": ((1,), 24, 40),
    "batch-3": ((3,), 24, 40),
    "features-7": ((5,), 9, 7),
    "features-33": ((3,), 17, 33),
    "features-100": ((2,), 31, 100),
    "3-D": ((2, 3), 24, 36),
    "3-D-batch-1": ((1, 1), 8, 12),
}


# GroupNorm normalizes dim 1, which is the features only on 2-D outputs (3-D is a negative case).
ODD_SHAPE_CASES = [pytest.param(chain, shape, id=f"{chain}-{shape}") for chain in chains(12) for shape in SHAPES
                   if len(SHAPES[shape][0]) == 1 or "groupnorm" not in chain]


@pytest.mark.parametrize("chain, shape", ODD_SHAPE_CASES)
def test_odd_shapes_match_eager(chain, shape):
    leading, in_features, out_features = SHAPES[shape]
    epilogue, extras = chains(out_features)[chain]
    model = GemmThen(epilogue, in_features=in_features, out_features=out_features, **extras)
    assert_whole_chain_fused(model, (torch.randn(*leading, in_features),))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("chain", list(chains(40)))
def test_16_bit_matches_eager_within_its_tolerance(chain, dtype):
    epilogue, extras = chains(40)[chain]
    model = GemmThen(epilogue, in_features=24, out_features=40, **extras).to(dtype)
    assert_whole_chain_fused(model, (torch.randn(3, 24, dtype=dtype),))


NAN_INF_CHAINS = {
    "relu": lambda m, x, y: torch.relu(m.fc(x)),
    "clamp": lambda m, x, y: torch.clamp(m.fc(x), -1.0, 1.0),
    "hardtanh-mish": lambda m, x, y: F.mish(F.hardtanh(m.fc(x))),
    "gelu": lambda m, x, y: F.gelu(m.fc(x)),
    "sigmoid-times-x": lambda m, x, y: (lambda h: h * torch.sigmoid(h))(m.fc(x)),
    "softplus": lambda m, x, y: F.softplus(m.fc(x)),
    "exp-log": lambda m, x, y: torch.log(torch.exp(m.fc(x))),
    "group_norm": lambda m, x, y: F.group_norm(m.fc(x), 4),
    "layer_norm": lambda m, x, y: F.layer_norm(m.fc(x), (40,)),
    "softmax": lambda m, x, y: torch.softmax(m.fc(x), -1),
    "amax": lambda m, x, y: m.fc(x).amax(-1),
    "amin-keepdim-plus": lambda m, x, y: torch.min(m.fc(x), 1, True)[0] + 1.0,
    "logsumexp": lambda m, x, y: torch.logsumexp(m.fc(x), -1),
    "sum": lambda m, x, y: m.fc(x).sum(-1),
}


def special_values_input():
    x = torch.randn(6, 24)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3, 7] = float("-inf")
    x[4] = 1e30  # overflows to inf in the GEMM
    return x


@pytest.mark.parametrize("chain", list(NAN_INF_CHAINS))
def test_nan_and_inf_propagate_as_in_eager(chain):
    model = GemmThen(NAN_INF_CHAINS[chain], in_features=24, out_features=40)
    x = special_values_input()
    optimized = assert_whole_chain_fused(model, (x,))
    with torch.no_grad():
        out = optimized(x)
    assert not torch.isfinite(out[1]).all(), "the NaN row must stay non-finite"
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[5]).all(), "finite rows must stay finite"


SPECIAL_SCALARS = {
    "clamp(min=-inf)": (lambda m, x, y: torch.clamp(m.fc(x), min=float("-inf"), max=0.5), "clamp(%0,-inf,0.5)"),
    "x*inf": (lambda m, x, y: m.fc(x) * float("inf"), "mul(%0,inf)"),
    "x+nan": (lambda m, x, y: m.fc(x) + float("nan"), "add(%0,nan)"),
    "eps=1e-12": (lambda m, x, y: F.layer_norm(m.fc(x), (40,), eps=1e-12), "layer_norm(%0,None,None,1e-12)"),
    "slope=1e-30": (lambda m, x, y: F.leaky_relu(m.fc(x), 1e-30), "leaky_relu(%0,1e-30)"),
}


@pytest.mark.parametrize("name", list(SPECIAL_SCALARS))
def test_special_scalars_are_captured_exactly(name):
    epilogue, program = SPECIAL_SCALARS[name]
    optimized = assert_whole_chain_fused(GemmThen(epilogue, in_features=24, out_features=40),
                                         (torch.randn(3, 24),))
    assert fused_programs(optimized) == [program]


def test_worst_element_is_reported_on_mismatch():
    expected = torch.zeros(3, 4)
    actual = expected.clone()
    actual[2, 1] = 0.5
    with pytest.raises(AssertionError, match=r"worst at index \(2, 1\): fused 0.5 vs eager 0.0"):
        assert_close_report(actual, expected)


# ---------------------------------------------------------------- the workloads of issue 2, at a small size


def load_example(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WORKLOADS = sorted(p.name for p in EXAMPLES.glob("*.py")) if EXAMPLES.is_dir() else []


@pytest.mark.parametrize("example", WORKLOADS)
def test_workload_becomes_exactly_one_fused_op(example):
    module = load_example(EXAMPLES / example)
    for name, value in getattr(module, "SMALL", {}).items():
        setattr(module, name, value)
    model = module.Model(*module.get_init_inputs()).eval()
    optimized = assert_whole_chain_fused(model, tuple(module.get_inputs()))
    assert len(fused_programs(optimized)) == 1


def test_workload_2_broadcasts_to_the_larger_output():
    module = load_example(EXAMPLES / "linear_groupnorm_min_bias.py")
    for name, value in module.SMALL.items():
        setattr(module, name, value)
    model = module.Model(*module.get_init_inputs())
    (x,) = module.get_inputs()
    optimized = assert_whole_chain_fused(model, (x,))
    assert optimized(x).shape == (1, module.out_features, module.batch_size, 1)


# ---------------------------------------------------------------- idioms at edge values, gradients included


def gemm_giving(epilogue, values, dtype=torch.float32):
    """A model in train mode whose GEMM output is exactly `values` in every row (zero weight, `values` as bias)."""
    model = GemmThen(epilogue, in_features=4, out_features=len(values))
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.copy_(torch.tensor(values))
    return model.to(dtype).train()


INF, NAN = float("inf"), float("nan")
IDIOM_EDGES = {
    # the slope of a where-spelled leaky_relu multiplies the discarded branch too: its NaN makes every gradient NaN
    "where(h>0,h,nan*h)": (lambda m, x, y: (lambda h: torch.where(h > 0, h, NAN * h))(m.fc(x)),
                           [2.0, 1.0, -1.0, 0.5], torch.float32),
    "where(h>0,h,inf*h)": (lambda m, x, y: (lambda h: torch.where(h > 0, h, INF * h))(m.fc(x)),
                           [2.0, 1.0, -1.0, 0.5], torch.float32),
    # inf * (exp(0) - 1) is NaN where elu(0) is 0
    "where(h>0,h,inf*(exp(h)-1))": (lambda m, x, y: (lambda h: torch.where(h > 0, h, INF * (h.exp() - 1.0)))(m.fc(x)),
                                    [0.0, 1.0, -1.0, 0.5], torch.float32),
    # a threshold of 1e-12 is not leaky_relu's 0: between them eager's slope is 0.2, leaky_relu's 1
    "where(h>1e-12,h,0.2*h)": (lambda m, x, y: (lambda h: torch.where(h > 1e-12, h, 0.2 * h))(m.fc(x)),
                               [5e-13, 1e-13, -1.0, 2.0], torch.float32),
}


@pytest.mark.parametrize("name", list(IDIOM_EDGES))
def test_spelled_out_ops_match_eager_at_edge_values_gradients_included(name):
    """Where an idiom's formula and its op part at some values (a non-finite captured number, an intermediate that
    overflows), the optimized model still gives eager's results and gradients there, NaN and inf in place."""
    epilogue, values, dtype = IDIOM_EDGES[name]
    model = gemm_giving(epilogue, values, dtype)
    x = torch.randn(3, 4, dtype=dtype)
    optimized = fxfuse.optimize(model, (x,))
    assert_close_report(optimized(x), model(x))
    assert_gradients_match(model, optimized, (x,))
