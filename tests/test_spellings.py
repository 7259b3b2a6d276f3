"""Every spelling of every epilogue op of issue 2 fuses into one op, with the Linear, and matches eager.

Each case is a GEMM (``self.fc``) followed by one op written in one spelling: module, functional, torch.*,
tensor method, in-place, operator, keyword or positional arguments, alias, or a spelled-out idiom. The test
checks that the whole model became a single fused op (nothing of the chain is left) whose program holds
the canonical op the spelling stands for, and that the result matches eager in float32 (1e-5).
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from epilogue_models import BATCH, IN, OUT, GemmThen, GemmThenTwoArguments, assert_whole_chain_fused, fused_programs
from fxfuse.library import FUSED_OPS
from fxfuse.testing import assert_close_report, assert_gradients_match, assert_not_fused


def vector(n=OUT):
    return nn.Parameter(torch.randn(n))


def buffer(*shape):
    return torch.randn(*shape)


def case(name, canonical, epilogue, **extras):
    """A test case: `epilogue(m, x, y)` must fuse to a program holding `canonical(`."""
    return pytest.param(canonical, epilogue, extras, id=name)


def inplace_add(m, x, y):
    h = m.fc(x)
    h += m.b
    return h


def inplace_sub(m, x, y):
    h = m.fc(x)
    h -= 0.5
    return h


def inplace_mul(m, x, y):
    h = m.fc(x)
    h *= m.b
    return h


def inplace_div(m, x, y):
    h = m.fc(x)
    h /= 3.0
    return h


def inplace_pow(m, x, y):
    h = m.fc(x)
    h **= 2
    return h


def linear_then(fn):
    return lambda m, x, y: fn(m.fc(x))


def linear_then_b(fn):
    return lambda m, x, y: fn(m.fc(x), m.b)


def linear_then_bc(fn):
    return lambda m, x, y: fn(m.fc(x), m.b, m.c)


POINTWISE = [
    # relu
    case("nn.ReLU", "relu", lambda m, x, y: m.act(m.fc(x)), act=nn.ReLU()),
    case("nn.ReLU-inplace", "relu", lambda m, x, y: m.act(m.fc(x)), act=nn.ReLU(inplace=True)),
    case("F.relu", "relu", lambda m, x, y: F.relu(m.fc(x))),
    case("F.relu-inplace-kw", "relu", lambda m, x, y: F.relu(m.fc(x), inplace=True)),
    case("F.relu_", "relu", lambda m, x, y: F.relu_(m.fc(x))),
    case("torch.relu", "relu", lambda m, x, y: torch.relu(m.fc(x))),
    case("torch.relu_", "relu", lambda m, x, y: torch.relu_(m.fc(x))),
    case("Tensor.relu", "relu", lambda m, x, y: m.fc(x).relu()),
    case("Tensor.relu_", "relu", lambda m, x, y: m.fc(x).relu_()),
    # torch._C._nn's builtins, which F's Python functions call (F.relu_, F.elu_, F.gelu and F.softplus are some)
    case("torch._C._nn.silu", "silu", linear_then(lambda h: torch._C._nn.silu(h))),
    case("torch._C._nn.silu_", "silu", linear_then(lambda h: torch._C._nn.silu_(h))),
    case("torch._C._nn.mish_", "mish", linear_then(lambda h: torch._C._nn.mish_(h))),
    case("torch._C._nn.hardswish", "hardswish", linear_then(lambda h: torch._C._nn.hardswish(h * 4))),
    case("torch._C._nn.hardsigmoid_", "hardsigmoid", linear_then(lambda h: torch._C._nn.hardsigmoid_(h * 4))),
    case("torch._C._nn.leaky_relu", "leaky_relu(%0,0.2)", linear_then(lambda h: torch._C._nn.leaky_relu(h, 0.2))),
    case("torch._C._nn.hardtanh", "hardtanh(%0,-0.5,0.5)",
         linear_then(lambda h: torch._C._nn.hardtanh(h, -0.5, 0.5))),
    case("torch._C._nn.relu6", "hardtanh(%1,0.0,6.0)", linear_then(lambda h: torch._C._nn.relu6(h * 4))),
    case("torch._C._nn.relu6_", "hardtanh_(%1,0.0,6.0)", linear_then(lambda h: torch._C._nn.relu6_(h * 4))),
    case("torch._C._nn.gelu_", "gelu_(%0,'tanh')", linear_then(lambda h: torch._C._nn.gelu_(h, approximate="tanh"))),
    # relu6 is hardtanh; hardtanh computes clamp's values with its own gradient at the bounds
    case("nn.ReLU6", "hardtanh", lambda m, x, y: m.act(m.fc(x) * 4), act=nn.ReLU6()),
    case("nn.ReLU6-inplace", "hardtanh", lambda m, x, y: m.act(m.fc(x) * 4), act=nn.ReLU6(inplace=True)),
    case("F.relu6", "hardtanh", lambda m, x, y: F.relu6(m.fc(x) * 4)),
    case("nn.Hardtanh", "hardtanh", lambda m, x, y: m.act(m.fc(x)), act=nn.Hardtanh()),
    case("nn.Hardtanh-bounds", "hardtanh", lambda m, x, y: m.act(m.fc(x)), act=nn.Hardtanh(-0.3, 0.2)),
    case("nn.Hardtanh-kw-inplace", "hardtanh", lambda m, x, y: m.act(m.fc(x)),
         act=nn.Hardtanh(min_val=-2.0, max_val=0.1, inplace=True)),
    case("F.hardtanh", "hardtanh", lambda m, x, y: F.hardtanh(m.fc(x))),
    case("F.hardtanh-positional", "hardtanh", lambda m, x, y: F.hardtanh(m.fc(x), -0.5, 0.5)),
    case("F.hardtanh-kw", "hardtanh", lambda m, x, y: F.hardtanh(m.fc(x), max_val=0.25, min_val=-0.75)),
    case("F.hardtanh_", "hardtanh", lambda m, x, y: F.hardtanh_(m.fc(x), -0.1, 0.1)),
    case("torch.clamp", "clamp", lambda m, x, y: torch.clamp(m.fc(x), -0.5, 0.5)),
    case("torch.clamp-kw", "clamp", lambda m, x, y: torch.clamp(m.fc(x), min=-0.5, max=0.5)),
    case("torch.clamp-min-only", "clamp", lambda m, x, y: torch.clamp(m.fc(x), min=0.1)),
    case("torch.clamp-max-only", "clamp", lambda m, x, y: torch.clamp(m.fc(x), max=-0.1)),
    case("torch.clip", "clamp", lambda m, x, y: torch.clip(m.fc(x), -0.2, 0.3)),
    case("Tensor.clamp", "clamp", lambda m, x, y: m.fc(x).clamp(-0.5, 0.5)),
    case("Tensor.clip-kw", "clamp", lambda m, x, y: m.fc(x).clip(max=0.5)),
    case("Tensor.clamp_", "clamp", lambda m, x, y: m.fc(x).clamp_(-0.5, 0.5)),
    case("Tensor.clip_", "clamp", lambda m, x, y: m.fc(x).clip_(min=0.0)),
    case("torch.clamp_", "clamp", lambda m, x, y: torch.clamp_(m.fc(x), -0.5, 0.5)),
    case("torch.clamp_min", "clamp", lambda m, x, y: torch.clamp_min(m.fc(x), 0.1)),
    case("Tensor.clamp_min", "clamp", lambda m, x, y: m.fc(x).clamp_min(0.1)),
    case("Tensor.clamp_max_", "clamp", lambda m, x, y: m.fc(x).clamp_max_(-0.1)),
    case("torch.clamp_max", "clamp", lambda m, x, y: torch.clamp_max(m.fc(x), 0.2)),
    # leaky_relu
    # rrelu outside training is leaky_relu with the bounds' mean as its slope
    case("nn.RReLU-eval", f"leaky_relu(%0,{(1 / 8 + 1 / 3) / 2!r})", lambda m, x, y: m.act(m.fc(x)), act=nn.RReLU()),
    case("nn.RReLU-bounds-inplace", "leaky_relu_(%1,0.25)", lambda m, x, y: m.act(m.fc(x) * 2),
         act=nn.RReLU(0.1, 0.4, inplace=True)),
    case("F.rrelu-training=False", "leaky_relu(%0,0.25)", linear_then(lambda h: F.rrelu(h, 0.1, 0.4, training=False))),
    case("F.rrelu-defaults", "leaky_relu(%0,", linear_then(lambda h: F.rrelu(h))),
    case("torch.rrelu", "leaky_relu(%0,0.25)", linear_then(lambda h: torch.rrelu(h, 0.1, 0.4))),
    case("F.rrelu_", "leaky_relu_(%1,0.25)", linear_then(lambda h: F.rrelu_(h * 2, 0.1, 0.4))),
    case("nn.LeakyReLU", "leaky_relu", lambda m, x, y: m.act(m.fc(x)), act=nn.LeakyReLU()),
    case("nn.LeakyReLU-slope", "leaky_relu", lambda m, x, y: m.act(m.fc(x)), act=nn.LeakyReLU(0.2)),
    case("nn.LeakyReLU-kw-inplace", "leaky_relu", lambda m, x, y: m.act(m.fc(x)),
         act=nn.LeakyReLU(negative_slope=0.3, inplace=True)),
    case("F.leaky_relu", "leaky_relu", lambda m, x, y: F.leaky_relu(m.fc(x))),
    case("F.leaky_relu-positional", "leaky_relu", lambda m, x, y: F.leaky_relu(m.fc(x), 0.1)),
    case("F.leaky_relu-kw", "leaky_relu", lambda m, x, y: F.leaky_relu(m.fc(x), negative_slope=0.1)),
    case("F.leaky_relu_", "leaky_relu", lambda m, x, y: F.leaky_relu_(m.fc(x), 0.05)),
    # elu family
    case("nn.ELU", "elu", lambda m, x, y: m.act(m.fc(x)), act=nn.ELU()),
    case("nn.ELU-alpha", "elu", lambda m, x, y: m.act(m.fc(x)), act=nn.ELU(alpha=0.5)),
    case("nn.ELU-inplace", "elu", lambda m, x, y: m.act(m.fc(x)), act=nn.ELU(inplace=True)),
    case("F.elu", "elu", lambda m, x, y: F.elu(m.fc(x), 0.7)),
    case("F.elu_", "elu", lambda m, x, y: F.elu_(m.fc(x))),
    case("F.elu_-scale-positional", "elu_(%0,0.5,2.0,1.0)", lambda m, x, y: F.elu_(m.fc(x), 0.5, 2.0)),
    case("torch._C._nn.elu-all-positional", "elu(%0,0.5,2.0,3.0)",
         lambda m, x, y: torch._C._nn.elu(m.fc(x), 0.5, 2.0, 3.0)),
    case("nn.SELU", "elu", lambda m, x, y: m.act(m.fc(x)), act=nn.SELU()),
    case("F.selu", "elu", lambda m, x, y: F.selu(m.fc(x))),
    case("torch.selu", "elu", lambda m, x, y: torch.selu(m.fc(x))),
    case("nn.CELU", "elu", lambda m, x, y: m.act(m.fc(x)), act=nn.CELU(0.7)),
    case("F.celu-kw", "elu", lambda m, x, y: F.celu(m.fc(x), alpha=2.0)),
    case("torch.celu", "elu", lambda m, x, y: torch.celu(m.fc(x))),
    # gelu
    case("nn.GELU", "gelu", lambda m, x, y: m.act(m.fc(x)), act=nn.GELU()),
    case("nn.GELU-tanh", "gelu", lambda m, x, y: m.act(m.fc(x)), act=nn.GELU(approximate="tanh")),
    case("F.gelu", "gelu", lambda m, x, y: F.gelu(m.fc(x))),
    case("F.gelu-tanh", "gelu", lambda m, x, y: F.gelu(m.fc(x), approximate="tanh")),
    case("gelu-tanh-spelled-out", "gelu", lambda m, x, y: (lambda h: 0.5 * h * (1.0 + torch.tanh(
        0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0)))))(m.fc(x))),
    # silu
    case("nn.SiLU", "silu", lambda m, x, y: m.act(m.fc(x)), act=nn.SiLU()),
    case("nn.SiLU-inplace", "silu", lambda m, x, y: m.act(m.fc(x)), act=nn.SiLU(inplace=True)),
    case("F.silu", "silu", lambda m, x, y: F.silu(m.fc(x))),
    case("x*sigmoid(x)", "silu", lambda m, x, y: (lambda h: h * torch.sigmoid(h))(m.fc(x))),
    case("sigmoid(x)*x", "silu", lambda m, x, y: (lambda h: torch.sigmoid(h) * h)(m.fc(x))),
    case("x*x.sigmoid()", "silu", lambda m, x, y: (lambda h: h * h.sigmoid())(m.fc(x))),
    case("torch.mul(x,F.sigmoid(x))", "silu", lambda m, x, y: (lambda h: torch.mul(h, F.sigmoid(h)))(m.fc(x))),
    case("x.mul(sigmoid(x))", "silu", lambda m, x, y: (lambda h: h.mul(torch.sigmoid(h)))(m.fc(x))),
    # mish
    case("nn.Mish", "mish", lambda m, x, y: m.act(m.fc(x)), act=nn.Mish()),
    case("F.mish", "mish", lambda m, x, y: F.mish(m.fc(x))),
    case("x*tanh(softplus(x))", "mish", lambda m, x, y: (lambda h: h * torch.tanh(F.softplus(h)))(m.fc(x))),
    case("tanh(softplus(x))*x", "mish", lambda m, x, y: (lambda h: torch.tanh(F.softplus(h)) * h)(m.fc(x))),
    case("x*softplus(x).tanh()", "mish", lambda m, x, y: (lambda h: h * F.softplus(h).tanh())(m.fc(x))),
    # sigmoid, tanh
    case("nn.Sigmoid", "sigmoid", lambda m, x, y: m.act(m.fc(x)), act=nn.Sigmoid()),
    case("torch.sigmoid", "sigmoid", lambda m, x, y: torch.sigmoid(m.fc(x))),
    case("F.sigmoid", "sigmoid", lambda m, x, y: F.sigmoid(m.fc(x))),
    case("Tensor.sigmoid", "sigmoid", lambda m, x, y: m.fc(x).sigmoid()),
    case("Tensor.sigmoid_", "sigmoid", lambda m, x, y: m.fc(x).sigmoid_()),
    case("torch.sigmoid_", "sigmoid", lambda m, x, y: torch.sigmoid_(m.fc(x))),
    case("torch.special.expit", "sigmoid", lambda m, x, y: torch.special.expit(m.fc(x))),
    case("nn.Tanh", "tanh", lambda m, x, y: m.act(m.fc(x)), act=nn.Tanh()),
    case("torch.tanh", "tanh", lambda m, x, y: torch.tanh(m.fc(x))),
    case("F.tanh", "tanh", lambda m, x, y: F.tanh(m.fc(x))),
    case("Tensor.tanh", "tanh", lambda m, x, y: m.fc(x).tanh()),
    case("Tensor.tanh_", "tanh", lambda m, x, y: m.fc(x).tanh_()),
    # softplus
    case("nn.Softplus", "softplus", lambda m, x, y: m.act(m.fc(x)), act=nn.Softplus()),
    case("nn.Softplus-beta-threshold", "softplus", lambda m, x, y: m.act(m.fc(x)),
         act=nn.Softplus(beta=2.0, threshold=0.5)),
    case("F.softplus", "softplus", lambda m, x, y: F.softplus(m.fc(x))),
    case("F.softplus-positional", "softplus", lambda m, x, y: F.softplus(m.fc(x), 0.5, 1.0)),
    case("F.softplus-kw", "softplus", lambda m, x, y: F.softplus(m.fc(x), threshold=0.2, beta=3.0)),
    # hardswish, hardsigmoid
    case("nn.Hardswish", "hardswish", lambda m, x, y: m.act(m.fc(x) * 4), act=nn.Hardswish()),
    case("F.hardswish", "hardswish", lambda m, x, y: F.hardswish(m.fc(x) * 4)),
    case("x*relu6(x+3)/6", "hardswish", lambda m, x, y: (lambda h: h * F.relu6(h + 3.0) / 6.0)(m.fc(x) * 4)),
    case("nn.Hardsigmoid", "hardsigmoid", lambda m, x, y: m.act(m.fc(x) * 4), act=nn.Hardsigmoid()),
    case("F.hardsigmoid", "hardsigmoid", lambda m, x, y: F.hardsigmoid(m.fc(x) * 4)),
    # exp, log, abs, neg, pow
    case("torch.exp", "exp", lambda m, x, y: torch.exp(m.fc(x))),
    case("Tensor.exp", "exp", lambda m, x, y: m.fc(x).exp()),
    case("Tensor.exp_", "exp", lambda m, x, y: m.fc(x).exp_()),
    case("torch.log", "log", lambda m, x, y: torch.log(m.fc(x).abs())),
    case("Tensor.log", "log", lambda m, x, y: m.fc(x).exp().log()),
    case("Tensor.log_", "log", lambda m, x, y: m.fc(x).abs().log_()),
    case("torch.maximum", "maximum(%0,$0)", lambda m, x, y: torch.maximum(m.fc(x), m.floor), floor=torch.randn(OUT)),
    case("Tensor.minimum", "minimum(%0,$0)", lambda m, x, y: m.fc(x).minimum(m.floor), floor=torch.randn(OUT)),
    case("torch.min-of-two", "minimum($0,%0)", lambda m, x, y: torch.min(m.floor, m.fc(x)), floor=torch.randn(OUT)),
    case("nn.PReLU", "prelu(%0,$0)", lambda m, x, y: m.act(m.fc(x)), act=nn.PReLU()),
    case("nn.PReLU-per-feature", "prelu(%0,$0)", lambda m, x, y: m.act(m.fc(x)), act=nn.PReLU(OUT, init=-0.5)),
    case("F.prelu", "prelu(%0,$0)", lambda m, x, y: F.prelu(m.fc(x), m.w), w=vector()),
    case("torch.prelu-kw", "prelu(%0,$0)", lambda m, x, y: torch.prelu(input=m.fc(x), weight=m.w), w=vector(1)),
    case("Tensor.prelu", "prelu(%0,$0)", lambda m, x, y: m.fc(x).prelu(m.w), w=torch.tensor(0.2)),
    case("Tensor.prelu-kw", "prelu(%0,$0)", lambda m, x, y: m.fc(x).prelu(weight=m.w), w=vector()),
    case("torch.sqrt", "sqrt(%1)", linear_then(lambda h: torch.sqrt(h.abs()))),
    case("Tensor.sqrt_", "sqrt_(%1)", linear_then(lambda h: h.abs().sqrt_())),
    case("torch.reciprocal", "reciprocal(%0)", linear_then(torch.reciprocal)),
    case("Tensor.reciprocal_", "reciprocal_(%1)", linear_then(lambda h: (h * 2).reciprocal_())),
    case("torch.erf", "erf(%0)", linear_then(torch.erf)),
    case("torch.special.erf", "erf(%0)", linear_then(torch.special.erf)),
    case("Tensor.erf", "erf(%0)", linear_then(lambda h: h.erf())),
    case("torch.log1p", "log1p(%1)", linear_then(lambda h: torch.log1p(h.abs()))),
    case("torch.special.log1p", "log1p(%1)", linear_then(lambda h: torch.special.log1p(h.abs()))),
    case("torch.expm1", "expm1(%0)", linear_then(torch.expm1)),
    case("torch.special.expm1", "expm1(%0)", linear_then(torch.special.expm1)),
    case("Tensor.expm1_", "expm1_(%1)", linear_then(lambda h: (h * 2).expm1_())),
    case("torch.sin", "sin(%0)", linear_then(torch.sin)),
    case("Tensor.cos", "cos(%0)", linear_then(lambda h: h.cos())),
    case("F.logsigmoid", "log_sigmoid(%0)", linear_then(F.logsigmoid)),
    case("nn.LogSigmoid", "log_sigmoid(%0)", lambda m, x, y: m.act(m.fc(x)), act=nn.LogSigmoid()),
    case("F.softsign", "softsign(%0)", linear_then(F.softsign)),
    case("nn.Softsign", "softsign(%0)", lambda m, x, y: m.act(m.fc(x)), act=nn.Softsign()),
    case("F.tanhshrink", "tanhshrink(%0)", linear_then(F.tanhshrink)),
    case("nn.Tanhshrink", "tanhshrink(%0)", lambda m, x, y: m.act(m.fc(x)), act=nn.Tanhshrink()),
    case("F.threshold", "threshold(%0,0.1,-2.0)", linear_then(lambda h: F.threshold(h, 0.1, -2.0))),
    case("F.threshold-inplace", "threshold_(%1,0.1,-2.0)", linear_then(lambda h: F.threshold(h * 2, 0.1, -2.0, True))),
    case("torch.threshold_", "threshold_(%1,0.0,1.0)", linear_then(lambda h: torch.threshold_(h * 2, 0.0, 1.0))),
    case("nn.Threshold", "threshold(%0,0.5,3.0)", lambda m, x, y: m.act(m.fc(x)), act=nn.Threshold(0.5, 3.0)),
    case("F.hardshrink", "hardshrink(%0,0.5)", linear_then(F.hardshrink)),
    case("Tensor.hardshrink", "hardshrink(%0,0.2)", linear_then(lambda h: h.hardshrink(lambd=0.2))),
    case("nn.Hardshrink", "hardshrink(%0,0.3)", lambda m, x, y: m.act(m.fc(x)), act=nn.Hardshrink(0.3)),
    case("F.softshrink", "softshrink(%0,0.25)", linear_then(lambda h: F.softshrink(h, 0.25))),
    case("nn.Softshrink", "softshrink(%0,0.5)", lambda m, x, y: m.act(m.fc(x)), act=nn.Softshrink()),
    # exp2, log2, log10, tan, atan, sinh, cosh, asinh, erfc, sign, the rounding ops, frac, logit; aliases and in place
    case("torch.exp2", "exp2(%0)", linear_then(torch.exp2)),
    case("torch.special.exp2", "exp2(%0)", linear_then(torch.special.exp2)),
    case("Tensor.exp2_", "exp2_(%1)", linear_then(lambda h: (h * 2).exp2_())),
    case("torch.log2", "log2(%1)", linear_then(lambda h: torch.log2(h.abs()))),
    case("Tensor.log10_", "log10_(%1)", linear_then(lambda h: h.abs().log10_())),
    case("torch.tan", "tan(%0)", linear_then(torch.tan)),
    case("Tensor.tan_", "tan_(%1)", linear_then(lambda h: (h * 2).tan_())),
    case("torch.atan", "atan(%0)", linear_then(torch.atan)),
    case("torch.arctan", "atan(%0)", linear_then(torch.arctan)),
    case("Tensor.arctan_", "atan_(%1)", linear_then(lambda h: (h * 2).arctan_())),
    case("torch.sinh", "sinh(%0)", linear_then(torch.sinh)),
    case("Tensor.cosh", "cosh(%0)", linear_then(lambda h: h.cosh())),
    case("Tensor.cosh_", "cosh_(%1)", linear_then(lambda h: (h * 2).cosh_())),
    case("torch.asinh", "asinh(%0)", linear_then(torch.asinh)),
    case("torch.arcsinh", "asinh(%0)", linear_then(torch.arcsinh)),
    case("Tensor.arcsinh_", "asinh_(%1)", linear_then(lambda h: (h * 2).arcsinh_())),
    case("torch.erfc", "erfc(%0)", linear_then(torch.erfc)),
    case("torch.special.erfc", "erfc(%0)", linear_then(torch.special.erfc)),
    case("Tensor.erfc_", "erfc_(%1)", linear_then(lambda h: (h * 2).erfc_())),
    case("torch.sign", "sign(%0)", linear_then(torch.sign)),
    case("torch.sgn", "sign(%0)", linear_then(torch.sgn)),
    case("Tensor.sgn_", "sign_(%1)", linear_then(lambda h: (h * 2).sgn_())),
    case("torch.floor", "floor(%1)", linear_then(lambda h: torch.floor(h * 4))),
    case("Tensor.ceil_", "ceil_(%1)", linear_then(lambda h: (h * 4).ceil_())),
    case("torch.trunc", "trunc(%1)", linear_then(lambda h: torch.trunc(h * 4))),
    case("torch.fix", "trunc(%1)", linear_then(lambda h: torch.fix(h * 4))),
    case("Tensor.fix_", "trunc_(%1)", linear_then(lambda h: (h * 4).fix_())),
    case("torch.round", "round(%1)", linear_then(lambda h: torch.round(h * 4))),
    case("Tensor.round-decimals=0", "round(%1)", linear_then(lambda h: (h * 4).round(decimals=0))),
    case("Tensor.round_", "round_(%1)", linear_then(lambda h: (h * 4).round_())),
    case("torch.special.round", "round(%1)", linear_then(lambda h: torch.special.round(h * 4, decimals=0))),
    case("torch.frac", "frac(%1)", linear_then(lambda h: torch.frac(h * 4))),
    case("Tensor.frac_", "frac_(%1)", linear_then(lambda h: (h * 4).frac_())),
    case("torch.logit", "logit(%1,None)", linear_then(lambda h: torch.logit(torch.sigmoid(h)))),
    case("torch.special.logit-eps", "logit(%0,1e-06)", linear_then(lambda h: torch.special.logit(h, eps=1e-6))),
    case("Tensor.logit_", "logit_(%1,0.25)", linear_then(lambda h: (h * 2).logit_(0.25))),
    # positive is its input (`+x` too): nothing of it is left
    case("torch.positive", "relu(%0)", linear_then(lambda h: torch.relu(torch.positive(h)))),
    case("+x", "relu(%0)", linear_then(lambda h: torch.relu(+h))),
    case("Tensor.positive", "relu(%0)", linear_then(lambda h: torch.relu(h.positive()))),
    # binary ops of two tensors: the NaN-ignoring fmax / fmin, logaddexp, logaddexp2, hypot, atan2
    case("torch.fmax", "fmax(%0,$0)", lambda m, x, y: torch.fmax(m.fc(x), m.floor), floor=torch.randn(OUT)),
    case("Tensor.fmin", "fmin($0,%0)", lambda m, x, y: m.floor.fmin(m.fc(x)), floor=torch.randn(OUT)),
    case("torch.logaddexp", "logaddexp(%0,$0)", lambda m, x, y: torch.logaddexp(m.fc(x), m.b), b=vector()),
    case("Tensor.logaddexp2", "logaddexp2(%0,$0)", lambda m, x, y: m.fc(x).logaddexp2(m.b), b=vector()),
    case("torch.hypot", "hypot(%0,$0)", lambda m, x, y: torch.hypot(m.fc(x), m.b), b=vector()),
    case("Tensor.hypot_", "hypot_(%1,$0)", lambda m, x, y: (m.fc(x) * 2).hypot_(m.b), b=vector()),
    case("torch.atan2", "atan2(%0,$0)", lambda m, x, y: torch.atan2(m.fc(x), m.b), b=vector()),
    case("torch.arctan2", "atan2($0,%0)", lambda m, x, y: torch.arctan2(m.b, m.fc(x)), b=vector()),
    case("Tensor.arctan2_", "atan2_(%1,$0)", lambda m, x, y: (m.fc(x) * 2).arctan2_(m.b), b=vector()),
    case("torch.copysign", "copysign(%0,$0)", lambda m, x, y: torch.copysign(m.fc(x), m.b), b=vector()),
    case("torch.copysign-number", "copysign(%0,-1.0)", linear_then(lambda h: torch.copysign(h, -1.0))),
    case("Tensor.copysign-of-a-param", "copysign($0,%0)", lambda m, x, y: m.b.copysign(m.fc(x)), b=vector()),
    case("Tensor.copysign_", "copysign_(%1,2)", linear_then(lambda h: (h * 2).copysign_(2))),
    case("torch.rsqrt", "rsqrt", lambda m, x, y: torch.rsqrt(m.fc(x).abs() + 1.0)),
    case("Tensor.rsqrt_", "rsqrt", lambda m, x, y: m.fc(x).abs().add(1.0).rsqrt_()),
    case("torch.abs", "abs", lambda m, x, y: torch.abs(m.fc(x))),
    case("torch.absolute", "abs", lambda m, x, y: torch.absolute(m.fc(x))),
    case("abs()", "abs", lambda m, x, y: abs(m.fc(x))),
    case("Tensor.abs_", "abs", lambda m, x, y: m.fc(x).abs_()),
    case("-x", "neg", lambda m, x, y: -m.fc(x)),
    case("torch.neg", "neg", lambda m, x, y: torch.neg(m.fc(x))),
    case("torch.negative", "neg", lambda m, x, y: torch.negative(m.fc(x))),
    case("Tensor.neg_", "neg", lambda m, x, y: m.fc(x).neg_()),
    case("torch.negative_", "neg", lambda m, x, y: torch.negative_(m.fc(x))),
    case("x**2", "pow", lambda m, x, y: m.fc(x) ** 2),
    case("x**0.5", "pow", lambda m, x, y: m.fc(x).abs() ** 0.5),
    case("torch.pow", "pow", lambda m, x, y: torch.pow(m.fc(x), 3)),
    case("torch.pow-kw", "pow", lambda m, x, y: torch.pow(m.fc(x), exponent=2.0)),
    case("Tensor.pow", "pow", lambda m, x, y: m.fc(x).pow(2)),
    case("Tensor.pow_", "pow", lambda m, x, y: m.fc(x).pow_(2)),
    case("x**=2", "pow", inplace_pow),
    case("torch.square", "pow(%0,2.0)", lambda m, x, y: torch.square(m.fc(x))),
    case("Tensor.square", "pow(%0,2.0)", lambda m, x, y: m.fc(x).square()),
    case("Tensor.square_", "pow_(%0,2.0)", lambda m, x, y: m.fc(x).square_()),
    # add, sub, mul, div: scalars, per-feature vectors, parameters and buffers that broadcast
    case("x+param", "add", lambda m, x, y: m.fc(x) + m.b, b=vector()),
    case("param+x", "add", lambda m, x, y: m.b + m.fc(x), b=vector()),
    case("x+buffer", "add", lambda m, x, y: m.fc(x) + m.b, b=buffer(OUT)),
    case("x+(1,N)-buffer", "add", lambda m, x, y: m.fc(x) + m.b, b=buffer(1, OUT)),
    case("x+(B,1)-buffer", "add", lambda m, x, y: m.fc(x) + m.b, b=buffer(BATCH, 1)),
    case("x+scalar", "add", lambda m, x, y: m.fc(x) + 1.5),
    case("int+x", "add", lambda m, x, y: 2 + m.fc(x)),
    case("torch.add", "add", lambda m, x, y: torch.add(m.fc(x), m.b), b=vector()),
    case("torch.add-kw", "add", lambda m, x, y: torch.add(input=m.fc(x), other=m.b), b=vector()),
    case("Tensor.add", "add", lambda m, x, y: m.fc(x).add(m.b), b=vector()),
    case("Tensor.add_", "add", lambda m, x, y: m.fc(x).add_(m.b), b=vector()),
    case("x+=param", "add", inplace_add, b=vector()),
    case("x-param", "sub", lambda m, x, y: m.fc(x) - m.b, b=vector()),
    case("param-x", "sub", lambda m, x, y: m.b - m.fc(x), b=vector()),
    case("scalar-x", "sub", lambda m, x, y: 2.0 - m.fc(x)),
    case("torch.sub", "sub", lambda m, x, y: torch.sub(m.fc(x), m.b), b=vector()),
    case("torch.subtract", "sub", lambda m, x, y: torch.subtract(m.fc(x), 0.25)),
    case("torch.rsub", "sub", lambda m, x, y: torch.rsub(m.fc(x), 1.0)),
    case("Tensor.sub_", "sub", lambda m, x, y: m.fc(x).sub_(m.b), b=vector()),
    case("x-=scalar", "sub", inplace_sub),
    case("x*param", "mul", lambda m, x, y: m.fc(x) * m.b, b=vector()),
    case("scalar*x", "mul", lambda m, x, y: 0.5 * m.fc(x)),
    case("torch.mul", "mul", lambda m, x, y: torch.mul(m.fc(x), m.b), b=vector()),
    case("torch.multiply", "mul", lambda m, x, y: torch.multiply(m.fc(x), 2.0)),
    case("Tensor.mul_", "mul", lambda m, x, y: m.fc(x).mul_(m.b), b=vector()),
    case("x*=param", "mul", inplace_mul, b=vector()),
    case("x/param", "div", lambda m, x, y: m.fc(x) / m.b, b=nn.Parameter(torch.rand(OUT) + 0.5)),
    case("scalar/x", "div", lambda m, x, y: 1.0 / (m.fc(x).abs() + 1.0)),
    case("torch.div", "div", lambda m, x, y: torch.div(m.fc(x), 3.0)),
    case("torch.divide", "div", lambda m, x, y: torch.divide(m.fc(x), 3.0)),
    case("torch.true_divide", "div", lambda m, x, y: torch.true_divide(m.fc(x), 3.0)),
    case("Tensor.div_", "div", lambda m, x, y: m.fc(x).div_(7)),
    case("x/=scalar", "div", inplace_div),
    # residual uses of an earlier value of the region
    case("x+x", "add(%", lambda m, x, y: (lambda h: h + h)(m.fc(x))),
    case("sigmoid(x)*2+x", "sigmoid", lambda m, x, y: (lambda h: torch.sigmoid(h) * 2.0 + h)(m.fc(x))),
    case("relu(x)-x", "relu", lambda m, x, y: (lambda h: F.relu(h) - h)(m.fc(x))),
    # identities inside the region
    case("eval-dropout", "relu", lambda m, x, y: F.relu(m.drop(m.fc(x))), drop=nn.Dropout(0.5).eval()),
    case("F.dropout-training=False", "relu", lambda m, x, y: F.relu(F.dropout(m.fc(x), 0.3, training=False))),
    case("nn.Identity", "relu", lambda m, x, y: F.relu(m.ident(m.fc(x))), ident=nn.Identity()),
    case("contiguous", "relu", lambda m, x, y: F.relu(m.fc(x).contiguous())),
    case("clone", "relu", lambda m, x, y: F.relu(m.fc(x).clone())),
    case("torch.clone-preserve_format", "relu",
         lambda m, x, y: F.relu(torch.clone(m.fc(x), memory_format=torch.preserve_format))),
    # KernelBench's Matmul_Scaling_ResidualAdd: a residual of the value without its gradient
    case("clone().detach()-residual", "detach",
         lambda m, x, y: (lambda h: h * 0.5 + h.clone().detach())(m.fc(x))),
    case("torch.detach-residual", "detach", lambda m, x, y: (lambda h: torch.detach(h) * h)(m.fc(x))),
    case("eval-AlphaDropout", "elu", lambda m, x, y: F.selu(m.drop(m.fc(x))), drop=nn.AlphaDropout(0.2).eval()),
    case("eval-FeatureAlphaDropout", "relu", lambda m, x, y: F.relu(m.drop(m.fc(x))),
         drop=nn.FeatureAlphaDropout(0.2).eval()),
    case("F.alpha_dropout-training=False", "relu",
         lambda m, x, y: F.relu(F.alpha_dropout(m.fc(x), 0.1, training=False))),
    case("torch.dropout-train=False", "relu", lambda m, x, y: F.relu(torch.dropout(m.fc(x), 0.5, False))),
    case("torch.feature_alpha_dropout", "relu",
         lambda m, x, y: F.relu(torch.feature_alpha_dropout(m.fc(x), 0.5, False))),
]


@pytest.mark.parametrize("canonical, epilogue, extras", POINTWISE)
def test_pointwise_spelling_fuses(canonical, epilogue, extras):
    model = GemmThen(epilogue, **extras).eval()
    optimized = assert_whole_chain_fused(model, (torch.randn(BATCH, IN),))
    (program,) = fused_programs(optimized)
    assert canonical in program, f"expected {canonical} in {program}"


NORMS = [
    case("nn.GroupNorm", "group_norm(%0,$0,$1,4,", lambda m, x, y: m.norm(m.fc(x)), norm=nn.GroupNorm(4, OUT)),
    case("nn.GroupNorm-one-group", "group_norm", lambda m, x, y: m.norm(m.fc(x)), norm=nn.GroupNorm(1, OUT)),
    case("nn.GroupNorm-group-per-channel", "group_norm", lambda m, x, y: m.norm(m.fc(x)),
         norm=nn.GroupNorm(OUT, OUT)),
    case("nn.GroupNorm-non-affine", "group_norm(%0,None,None,5,", lambda m, x, y: m.norm(m.fc(x)),
         norm=nn.GroupNorm(5, OUT, affine=False)),
    case("nn.GroupNorm-eps", "group_norm(%0,$0,$1,8,0.001)", lambda m, x, y: m.norm(m.fc(x)),
         norm=nn.GroupNorm(8, OUT, eps=1e-3)),
    case("F.group_norm", "group_norm", lambda m, x, y: F.group_norm(m.fc(x), 2, m.w, m.b, 1e-4),
         w=vector(), b=vector()),
    case("F.group_norm-kw", "group_norm", lambda m, x, y: F.group_norm(m.fc(x), num_groups=10, eps=0.1)),
    case("nn.LayerNorm", "layer_norm", lambda m, x, y: m.norm(m.fc(x)), norm=nn.LayerNorm(OUT)),
    case("nn.LayerNorm-non-affine", "layer_norm(%0,None,None,", lambda m, x, y: m.norm(m.fc(x)),
         norm=nn.LayerNorm(OUT, elementwise_affine=False)),
    case("nn.LayerNorm-no-bias", "layer_norm(%0,$0,None,", lambda m, x, y: m.norm(m.fc(x)),
         norm=nn.LayerNorm(OUT, bias=False)),
    case("nn.LayerNorm-eps", "layer_norm", lambda m, x, y: m.norm(m.fc(x)), norm=nn.LayerNorm([OUT], eps=1e-2)),
    case("F.layer_norm", "layer_norm", lambda m, x, y: F.layer_norm(m.fc(x), (OUT,), m.w, m.b), w=vector(),
         b=vector()),
    case("F.layer_norm-kw", "layer_norm", lambda m, x, y: F.layer_norm(m.fc(x), normalized_shape=[OUT], eps=1e-3)),
    case("F.layer_norm-x.shape[-1:]", "layer_norm", linear_then(lambda h: F.layer_norm(h, h.shape[-1:]))),
    case("F.layer_norm-(x.size(-1),)", "layer_norm", linear_then(lambda h: F.layer_norm(h, (h.size(-1),)))),
    case("F.layer_norm-[x.shape[-1]]", "layer_norm", linear_then(lambda h: F.layer_norm(h, [h.shape[-1]]))),
    case("F.layer_norm-x.shape[1:]", "layer_norm", linear_then(lambda h: F.layer_norm(h, h.shape[1:]))),
    case("F.layer_norm-x.size()[1:]", "layer_norm", linear_then(lambda h: F.layer_norm(h, h.size()[1:]))),
    case("F.rms_norm-(x.size(1),)", "rms_norm", linear_then(lambda h: F.rms_norm(h, (h.size(1),)))),
    case("F.layer_norm-[x.shape[1]]", "layer_norm", linear_then(lambda h: F.layer_norm(h, [h.shape[1]]))),
    case("F.layer_norm-[x.size(dim=-1)]", "layer_norm", linear_then(lambda h: F.layer_norm(h, [h.size(dim=-1)]))),
    case("F.rms_norm-x.size()[-1:]", "rms_norm", linear_then(lambda h: F.rms_norm(h, h.size()[-1:], eps=1e-6))),
    case("nn.RMSNorm", "rms_norm", lambda m, x, y: m.norm(m.fc(x)), norm=nn.RMSNorm(OUT)),
    case("nn.RMSNorm-eps", "rms_norm(%0,$0,1e-06)", lambda m, x, y: m.norm(m.fc(x)), norm=nn.RMSNorm(OUT, eps=1e-6)),
    case("nn.RMSNorm-non-affine", "rms_norm(%0,None,", lambda m, x, y: m.norm(m.fc(x)),
         norm=nn.RMSNorm(OUT, elementwise_affine=False)),
    case("F.rms_norm", "rms_norm", lambda m, x, y: F.rms_norm(m.fc(x), (OUT,), m.w, 1e-5), w=vector()),
    case("nn.InstanceNorm1d-unbatched", "layer_norm(%0,None,None,", lambda m, x, y: m.norm(m.fc(x)),
         norm=nn.InstanceNorm1d(BATCH)),  # unbatched (C=BATCH, L=OUT)
    case("eval-BatchNorm1d", "batch_norm", lambda m, x, y: m.norm(m.fc(x)), norm=nn.BatchNorm1d(OUT)),
    case("eval-BatchNorm1d-non-affine", "batch_norm", lambda m, x, y: m.norm(m.fc(x)),
         norm=nn.BatchNorm1d(OUT, affine=False)),
    case("F.batch_norm-eval", "batch_norm",
         lambda m, x, y: F.batch_norm(m.fc(x), m.mean, m.var, m.w, m.b, training=False, eps=1e-3),
         mean=buffer(OUT), var=torch.rand(OUT) + 0.5, w=vector(), b=vector()),
    # torch.*'s own forms, with their cudnn flags
    case("torch.layer_norm", "layer_norm(%0,$0,$1,1e-05)",
         lambda m, x, y: torch.layer_norm(m.fc(x), (OUT,), m.w, m.b, 1e-5, False), w=vector(), b=vector()),
    case("torch.group_norm", "group_norm(%0,$0,$1,4,0.001)",
         lambda m, x, y: torch.group_norm(m.fc(x), 4, m.w, m.b, 1e-3, False), w=vector(), b=vector()),
    case("torch.rms_norm", "rms_norm(%0,$0,1e-06)", lambda m, x, y: torch.rms_norm(m.fc(x), [OUT], m.w, 1e-6),
         w=vector()),
    case("torch.batch_norm-eval", "batch_norm",
         lambda m, x, y: torch.batch_norm(m.fc(x), m.w, m.b, m.mean, m.var, False, 0.1, 1e-5, False),
         mean=buffer(OUT), var=torch.rand(OUT) + 0.5, w=vector(), b=vector()),
]


def _randomize_batch_norm_statistics(model):
    for module in model.modules():
        if isinstance(module, nn.BatchNorm1d):
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2.0)
            if module.affine:
                module.weight.data.normal_()
                module.bias.data.normal_()


@pytest.mark.parametrize("canonical, epilogue, extras", NORMS)
def test_norm_spelling_fuses(canonical, epilogue, extras):
    model = GemmThen(epilogue, **extras).eval()
    _randomize_batch_norm_statistics(model)
    optimized = assert_whole_chain_fused(model, (torch.randn(BATCH, IN),))
    (program,) = fused_programs(optimized)
    assert canonical in program, f"expected {canonical} in {program}"


def test_copysign_with_a_nan_sign_is_not_fused_and_explain_says_why():
    """`nan` in a program's text is positive; eager copies -nan's sign bit."""
    model = GemmThen(linear_then(lambda h: torch.copysign(h, -math.nan)))
    assert_not_fused(model, (torch.randn(BATCH, IN),), reason="copysign with a NaN sign")


def test_round_to_decimals_is_not_fused_and_explain_says_why():
    model = GemmThen(linear_then(lambda h: torch.round(h, decimals=2)))
    assert_not_fused(model, (torch.randn(BATCH, IN),), reason="round with decimals=2")


@pytest.mark.parametrize("epilogue, reason", [
    (lambda h: 2 ** h, "2 ** a tensor"),
    (lambda h: torch.pow(2.0, h), "2.0 ** a tensor"),
    (lambda h: torch.float_power(h, 2), "float_power computes in float64"),
    (lambda h: h.float_power(0.5), "float_power computes in float64"),
], ids=["2**h", "torch.pow(2.0,h)", "torch.float_power", "Tensor.float_power"])
def test_pow_spellings_outside_the_vocabulary_are_not_fused_and_explain_says_why(epilogue, reason):
    assert_not_fused(GemmThen(linear_then(epilogue)), (torch.randn(BATCH, IN),), reason=reason)


def test_softmin_without_a_dim_is_not_fused_and_explain_says_why():
    """Eager picks the dim from the value's rank, with a warning that the implicit choice is deprecated."""
    model = GemmThen(lambda m, x, y: m.act(m.fc(x)), act=nn.Softmin())
    assert_not_fused(model, (torch.randn(BATCH, IN),), reason="softmin without an explicit dim")


def test_instance_norm_of_each_row_of_a_3d_output_fuses():
    model = GemmThen(lambda m, x, y: F.instance_norm(m.fc(x), eps=1e-4))
    optimized = assert_whole_chain_fused(model, (torch.randn(2, 5, IN),))
    assert "layer_norm(%0,None,None,0.0001)" in fused_programs(optimized)[0]


def test_layer_norm_over_the_shape_from_a_dim_on_is_the_features_only_at_that_rank():
    """`h.shape[2:]` is the features of a 3-D value; of a 4-D one it is two dims, which eager normalizes together."""
    model = GemmThen(linear_then(lambda h: F.layer_norm(h, h.shape[2:])))
    optimized = assert_whole_chain_fused(model, (torch.randn(2, 5, IN),))
    assert "layer_norm(%0,None,None,1e-05)" in fused_programs(optimized)[0]
    assert_not_fused(model, (torch.randn(2, 3, 5, IN),), reason="takes only 3-D values here; the rank is 4")


def max_values_unpacked(h):
    values, _ = torch.max(h, 1)
    return values


def min_values_unpacked(h):
    values, _ = h.min(-1, keepdim=True)
    return values + 1.0


REDUCTIONS = [
    case("torch.sum", "sum(%0,1,False)", linear_then(lambda h: torch.sum(h, 1))),
    case("Tensor.sum-keepdim-kw", "sum(%0,-1,True)", linear_then(lambda h: h.sum(dim=-1, keepdim=True))),
    case("torch.sum-list-dim", "sum", linear_then(lambda h: torch.sum(h, [1]))),
    case("torch.mean", "mean(%0,1,False)", linear_then(lambda h: torch.mean(h, 1))),
    case("Tensor.mean-keepdim", "mean(%0,-1,True)", linear_then(lambda h: h.mean(-1, keepdim=True))),
    case("torch.amax", "amax(%0,1,False)", linear_then(lambda h: torch.amax(h, 1))),
    case("Tensor.amax-keepdim", "amax(%0,-1,True)", linear_then(lambda h: h.amax(-1, True))),
    case("torch.max(x,1)[0]", "max_dim(%0,1,False)", linear_then(lambda h: torch.max(h, 1)[0])),
    case("x.max(dim=1).values", "max_dim", linear_then(lambda h: h.max(dim=1).values)),
    case("torch.max-keepdim.values", "max_dim(%0,1,True)", linear_then(lambda h: torch.max(h, 1, keepdim=True).values)),
    case("torch.amin", "amin(%0,1,False)", linear_then(lambda h: torch.amin(h, dim=1))),
    case("Tensor.amin-keepdim", "amin(%0,1,True)", linear_then(lambda h: h.amin(1, keepdim=True))),
    case("torch.min(x,1,True)[0]", "min_dim(%0,1,True)", linear_then(lambda h: torch.min(h, 1, True)[0])),
    case("x.min(dim=1,keepdim=True).values", "min_dim(%0,1,True)",
         linear_then(lambda h: h.min(dim=1, keepdim=True).values)),
    case("torch.min(x,dim=-1)[0]", "min_dim(%0,-1,False)", linear_then(lambda h: torch.min(h, dim=-1)[0])),
    case("torch.logsumexp", "logsumexp(%0,1,False)", linear_then(lambda h: torch.logsumexp(h, 1))),
    case("torch.special.logsumexp", "logsumexp(%0,-1,True)",
         linear_then(lambda h: torch.special.logsumexp(h, -1, keepdim=True))),
    case("torch.special.softmax", "softmax(%0,-1)", linear_then(lambda h: torch.special.softmax(h, -1))),
    case("torch.special.log_softmax", "log_softmax(%0,1)", linear_then(lambda h: torch.special.log_softmax(h, 1))),
    case("values,_=torch.max(x,1)", "max_dim(%0,1,False)", lambda m, x, y: max_values_unpacked(m.fc(x))),
    case("values,_=x.min(-1,keepdim=True)", "min_dim(%0,-1,True)", lambda m, x, y: min_values_unpacked(m.fc(x))),
    case("Tensor.logsumexp-keepdim", "logsumexp(%0,-1,True)", linear_then(lambda h: h.logsumexp(-1, keepdim=True))),
    case("F.softmax", "softmax(%0,1)", linear_then(lambda h: F.softmax(h, dim=1))),
    case("torch.softmax", "softmax(%0,-1)", linear_then(lambda h: torch.softmax(h, -1))),
    case("Tensor.softmax", "softmax", linear_then(lambda h: h.softmax(-1))),
    case("nn.Softmax", "softmax", lambda m, x, y: m.act(m.fc(x)), act=nn.Softmax(dim=1)),
    case("F.log_softmax", "log_softmax(%0,1)", linear_then(lambda h: F.log_softmax(h, 1))),
    case("torch.log_softmax", "log_softmax", linear_then(lambda h: torch.log_softmax(h, dim=-1))),
    case("Tensor.log_softmax", "log_softmax", linear_then(lambda h: h.log_softmax(-1))),
    case("nn.LogSoftmax", "log_softmax", lambda m, x, y: m.act(m.fc(x)), act=nn.LogSoftmax(dim=-1)),
    # softmin is eager's softmax of the negated value
    case("F.softmin", "neg(%0);softmax(%1,-1)", linear_then(lambda h: F.softmin(h, -1))),
    case("F.softmin-kw", "neg(%0);softmax(%1,1)", linear_then(lambda h: F.softmin(h, dim=1))),
    case("nn.Softmin", "neg(%0);softmax(%1,-1)", lambda m, x, y: m.act(m.fc(x)), act=nn.Softmin(dim=-1)),
    case("nn.Softmin-positional", "neg(%0);softmax(%1,1)", lambda m, x, y: m.act(m.fc(x)), act=nn.Softmin(1)),
    # NumPy's keywords, which torch.* and the methods take (F.* does not)
    case("torch.sum-axis-keepdims", "sum(%0,1,True)", linear_then(lambda h: torch.sum(h, axis=1, keepdims=True))),
    case("Tensor.mean-axis", "mean(%0,-1,False)", linear_then(lambda h: h.mean(axis=-1))),
    case("torch.amax-axis", "amax(%0,1,False)", linear_then(lambda h: torch.amax(h, axis=1))),
    case("x.min(axis=-1)[0]", "min_dim(%0,-1,False)", linear_then(lambda h: h.min(axis=-1)[0])),
    case("torch.max(x,axis=1).values", "max_dim(%0,1,False)", linear_then(lambda h: torch.max(h, axis=1).values)),
    case("Tensor.logsumexp-axis", "logsumexp(%0,1,False)", linear_then(lambda h: h.logsumexp(axis=1))),
    case("torch.softmax-axis", "softmax(%0,-1)", linear_then(lambda h: torch.softmax(h, axis=-1))),
    # the spread and the 2-norm of a row
    case("torch.var", "var(%0,1,False,1.0)", linear_then(lambda h: torch.var(h, 1))),
    case("torch.var-unbiased-keepdim-positional", "var(%0,-1,True,0.0)",
         linear_then(lambda h: torch.var(h, -1, False, True))),
    case("Tensor.var-correction", "var(%0,1,False,2.0)", linear_then(lambda h: h.var(dim=[1], correction=2))),
    case("Tensor.var-unbiased-kw", "var(%0,-1,True,0.0)",
         linear_then(lambda h: h.var(-1, unbiased=False, keepdim=True))),
    case("torch.std", "std(%0,1,False,1.0)", linear_then(lambda h: torch.std(h, dim=1))),
    case("Tensor.std-axis", "std(%0,-1,True,0.0)", linear_then(lambda h: h.std(axis=-1, correction=0, keepdims=True))),
    case("standardized-by-std", "std(%0,-1,True,1.0)",
         linear_then(lambda h: (h - h.mean(-1, keepdim=True)) / h.std(-1, keepdim=True))),
    case("torch.linalg.vector_norm", "vector_norm(%0,-1,False)",
         linear_then(lambda h: torch.linalg.vector_norm(h, dim=-1))),
    case("torch.linalg.vector_norm-ord-keepdim", "vector_norm(%0,1,True)",
         linear_then(lambda h: torch.linalg.vector_norm(h, 2.0, 1, True))),
    case("torch.linalg.norm-dim", "vector_norm(%0,1,False)", linear_then(lambda h: torch.linalg.norm(h, dim=1))),
    case("torch.norm", "vector_norm(%0,1,False)", linear_then(lambda h: torch.norm(h, dim=1))),
    case("Tensor.norm-p2-keepdim", "vector_norm(%0,-1,True)", linear_then(lambda h: h.norm(2, -1, True))),
    case("F.normalize", "normalize(%0,1,1e-12)", linear_then(lambda h: F.normalize(h))),
    case("F.normalize-kw", "normalize(%0,-1,0.001)", linear_then(lambda h: F.normalize(h, p=2, dim=-1, eps=1e-3))),
    case("x/norm(x)", "vector_norm", linear_then(lambda h: h / h.norm(dim=-1, keepdim=True))),
    # pointwise ops after a reduction, broadcasting the reduced value
    case("sum-keepdim+param", "add", lambda m, x, y: m.fc(x).sum(1, keepdim=True) + m.b, b=vector(1)),
    case("mean*scalar", "mul", linear_then(lambda h: h.mean(1) * 3.0)),
    case("amax-keepdim-then-relu", "relu", linear_then(lambda h: F.relu(h.amax(-1, keepdim=True)))),
    case("x-amax(x)", "sub", linear_then(lambda h: h - h.amax(-1, keepdim=True))),
    case("exp(x-logsumexp(x))", "exp", linear_then(lambda h: torch.exp(h - torch.logsumexp(h, 1, keepdim=True)))),
    case("min-keepdim+row-bias", "add", lambda m, x, y: torch.min(m.fc(x), 1, True)[0] + m.b, b=buffer(BATCH, 1)),
    case("min-keepdim*full-param", "mul", lambda m, x, y: torch.min(m.fc(x), 1, True)[0] * m.b,
         b=vector(OUT)),
    case("softmax-then-log", "log", linear_then(lambda h: torch.log(F.softmax(h, -1)))),
    case("norm-of-a-row-scaled-by-its-sum", "layer_norm",
         linear_then(lambda h: F.layer_norm(h * h.sum(-1, keepdim=True), (OUT,)))),
    case("spelled-out-softmax-then-rms_norm", "rms_norm",
         linear_then(lambda h: (lambda e: F.rms_norm(e / e.sum(-1, keepdim=True), (OUT,)))(
             torch.exp(h - h.amax(-1, keepdim=True))))),
]


@pytest.mark.parametrize("canonical, epilogue, extras", REDUCTIONS)
def test_reduction_spelling_fuses(canonical, epilogue, extras):
    model = GemmThen(epilogue, **extras).eval()
    optimized = assert_whole_chain_fused(model, (torch.randn(BATCH, IN),))
    (program,) = fused_programs(optimized)
    assert canonical in program, f"expected {canonical} in {program}"


# Numbers read from the features of a value of the chain: fixed by the GEMM's weight, so the program holds them.
FEATURE_NUMBERS = [
    case("h*h.size(-1)**-0.5", f"mul(%0,{OUT ** -0.5!r})", linear_then(lambda h: h * h.size(-1) ** -0.5)),
    case("h/math.sqrt(h.shape[-1])", f"div(%0,{math.sqrt(OUT)!r})", linear_then(lambda h: h / math.sqrt(h.shape[-1]))),
    case("h.sum(-1,keepdim)/h.shape[-1]", f"sum(%0,-1,True);div(%1,{OUT})",
         linear_then(lambda h: h.sum(-1, keepdim=True) / h.shape[-1])),
    case("h*(1.0/h.shape[1])", f"mul(%0,{1.0 / OUT!r})", linear_then(lambda h: h * (1.0 / h.shape[1]))),
    case("h.size(dim=-1)*relu(h)", f"mul({OUT},%1)", linear_then(lambda h: h.size(dim=-1) * torch.relu(h))),
    case("gelu(h)/h.size()[-1]", f"div(%1,{OUT})", linear_then(lambda h: (lambda g: g / g.size()[-1])(F.gelu(h)))),
]


def assert_fuses_to(canonical, epilogue, extras, with_examples):
    """The GEMM then `epilogue` becomes one fused op whose program holds `canonical`, with or without examples."""
    model = GemmThen(epilogue, **extras).eval()
    optimized = assert_whole_chain_fused(model, (torch.randn(BATCH, IN),),
                                         example_inputs=None if with_examples else False)
    (program,) = fused_programs(optimized)
    assert canonical in program.replace(" ", ""), f"expected {canonical} in {program}"


@pytest.mark.parametrize("with_examples", [True, False], ids=["example-inputs", "no-example-inputs"])
@pytest.mark.parametrize("canonical, epilogue, extras", FEATURE_NUMBERS)
def test_number_read_from_the_features_fuses(canonical, epilogue, extras, with_examples):
    assert_fuses_to(canonical, epilogue, extras, with_examples)


def test_number_read_from_the_features_raises_once_the_weight_has_other_features():
    """The program holds 1 / sqrt(40): a weight of another width must not compute with it."""
    model = GemmThen(linear_then(lambda h: h * h.size(-1) ** -0.5)).eval()
    optimized = assert_whole_chain_fused(model, (torch.randn(BATCH, IN),), example_inputs=False)
    model.fc.weight = nn.Parameter(torch.randn(OUT + 8, IN))
    model.fc.bias = nn.Parameter(torch.randn(OUT + 8))
    with pytest.raises(RuntimeError, match="had 40 features when it was fused"):
        optimized(torch.randn(BATCH, IN))


@pytest.mark.parametrize("norm", [lambda h: F.layer_norm(h, (OUT,)), lambda h: F.rms_norm(h, [OUT])],
                         ids=["layer_norm", "rms_norm"])
def test_a_normalized_shape_of_the_features_raises_once_the_weight_has_other_features(norm):
    """The program normalizes over the last dim, whatever its size, where eager's normalized_shape is (40,): a weight
    of another width raises, as eager does, instead of normalizing over its features (it returned a result)."""
    model = GemmThen(linear_then(norm)).eval()
    optimized = assert_whole_chain_fused(model, (torch.randn(BATCH, IN),))
    model.fc.weight = nn.Parameter(torch.randn(OUT - 8, IN))
    model.fc.bias = nn.Parameter(torch.randn(OUT - 8))
    with pytest.raises(RuntimeError, match="expected input with shape"):
        model(torch.randn(BATCH, IN))
    with pytest.raises(RuntimeError, match="had 40 features when it was fused"):
        optimized(torch.randn(BATCH, IN))


def written_into_itself(op, *args):
    """`op(h, *args, out=h)` after the GEMM, then h read again: the op's in-place form."""
    def epilogue(m, x, y):
        h = m.fc(x)
        op(h, *[m.b if a == "b" else a for a in args], out=h)
        return h
    return epilogue


OUT_INTO_ITSELF = [
    case("torch.add(h,b,out=h)", "add_(%0,$0)", written_into_itself(torch.add, "b"), b=vector()),
    case("torch.mul(h,2.0,out=h)", "mul_(%0,2.0)", written_into_itself(torch.mul, 2.0)),
    case("torch.exp(h,out=h)", "exp_(%0)", written_into_itself(torch.exp)),
    case("torch.clamp(h,-0.5,0.5,out=h)", "clamp_(%0,-0.5,0.5)", written_into_itself(torch.clamp, -0.5, 0.5)),
    case("torch.sigmoid(h,out=h)*2", "sigmoid_(%0);mul(%1,2)",
         lambda m, x, y: (lambda h: torch.sigmoid(h, out=h) * 2)(m.fc(x))),
]


@pytest.mark.parametrize("with_examples", [True, False], ids=["example-inputs", "no-example-inputs"])
@pytest.mark.parametrize("canonical, epilogue, extras", OUT_INTO_ITSELF)
def test_op_written_into_its_own_input_fuses_as_its_in_place_form(canonical, epilogue, extras, with_examples):
    assert_fuses_to(canonical, epilogue, extras, with_examples)


def test_op_written_into_its_own_input_raises_as_eager_does_where_autograd_would_record_it():
    model = GemmThen(written_into_itself(torch.add, "b"), b=vector()).eval()
    optimized = assert_whole_chain_fused(model, (torch.randn(BATCH, IN),))
    message = "functions with out=... arguments don't support automatic differentiation"
    with pytest.raises(RuntimeError, match=message):
        model(torch.randn(BATCH, IN))
    with pytest.raises(RuntimeError, match=message):
        optimized(torch.randn(BATCH, IN))
    model.requires_grad_(False)  # nothing then requires grad: eager and the fused op compute
    x = torch.randn(BATCH, IN)
    torch.testing.assert_close(optimized(x), model(x))


ALPHA_OF_A_VALUE = [
    case("h.add_(relu(h),alpha=0.5)", "relu(%0);mul(%1,0.5);add_(%0,%2)",
         linear_then(lambda h: h.add_(torch.relu(h), alpha=0.5))),
    case("torch.add(h,sigmoid(h),alpha=-2)", "sigmoid(%0);mul(%1,-2.0);add(%0,%2)",
         linear_then(lambda h: torch.add(h, torch.sigmoid(h), alpha=-2))),
    case("torch.sub(sigmoid(h),h,alpha=3)", "sigmoid(%0);mul(%0,3.0);sub(%1,%2)",
         linear_then(lambda h: torch.sub(torch.sigmoid(h), h, alpha=3))),
    case("torch.rsub(sigmoid(h),h,alpha=3)", "sigmoid(%0);mul(%1,3.0);sub(%0,%2)",
         linear_then(lambda h: torch.rsub(torch.sigmoid(h), h, alpha=3))),
    case("h.sub_(h.sum(-1,keepdim),alpha=0.25)", "sum(%0,-1,True);mul(%1,0.25);sub_(%0,%2)",
         linear_then(lambda h: h.sub_(h.sum(-1, keepdim=True), alpha=0.25))),
]


@pytest.mark.parametrize("with_examples", [True, False], ids=["example-inputs", "no-example-inputs"])
@pytest.mark.parametrize("canonical, epilogue, extras", ALPHA_OF_A_VALUE)
def test_alpha_scaling_a_value_of_the_chain_fuses_as_a_mul_first(canonical, epilogue, extras, with_examples):
    """Eager computes `input + alpha * other`: the program scales `other` first (within rounding of a multiply-add)."""
    assert_fuses_to(canonical, epilogue, extras, with_examples)


ALPHA_OF_AN_OUTSIDE_TENSOR = [
    case("torch.add(h,b,alpha=2)", "mul($0,2.0);add(%0,%1)", linear_then_b(lambda h, b: torch.add(h, b, alpha=2)),
         b=vector()),
    case("h.sub(b,alpha=0.5)", "mul($0,0.5);sub(%0,%1)", linear_then_b(lambda h, b: h.sub(b, alpha=0.5)), b=vector()),
    case("h.add_(b,alpha=3)", "mul($0,3.0);add_(%0,%1)", linear_then_b(lambda h, b: h.add_(b, alpha=3)), b=vector()),
    case("torch.sub(h,b,alpha=-1.5,out=h)", "mul($0,-1.5);sub_(%0,%1)",
         linear_then_b(lambda h, b: torch.sub(h, b, alpha=-1.5, out=h)), b=vector()),
    case("torch.rsub(b,h,alpha=3)", "mul($0,3.0);sub(%0,%1)", linear_then_b(lambda h, b: torch.rsub(b, h, alpha=3)),
         b=vector()),
    # a param of more dims than the value: the result has the param's
    case("torch.add(h,b3d,alpha=2)", "mul($0,2.0);add(%0,%1)", linear_then_b(lambda h, b: torch.add(h, b, alpha=2)),
         b=buffer(2, 1, OUT)),
    # the scaled operand is the chain's value, the other an outside tensor (as before)
    case("torch.add(b,h,alpha=2)", "mul(%0,2.0);add($0,%1)", linear_then_b(lambda h, b: torch.add(b, h, alpha=2)),
         b=vector()),
    case("torch.rsub(h,b,alpha=3)", "mul(%0,3.0);sub($0,%1)", linear_then_b(lambda h, b: torch.rsub(h, b, alpha=3)),
         b=vector()),
    # a reduced value plus a scaled param of one feature keeps one feature: a softmax of it is its pointwise steps
    case("h.amax(-1,keepdim).add(s,alpha=2).softmax(-1)", "mul($0,2.0);add(%1,%2);sub(%3,%3);exp(%4)",
         linear_then_b(lambda h, s: h.amax(-1, keepdim=True).add(s, alpha=2).softmax(-1)), b=buffer(1)),
]


@pytest.mark.parametrize("with_examples", [True, False], ids=["example-inputs", "no-example-inputs"])
@pytest.mark.parametrize("canonical, epilogue, extras", ALPHA_OF_AN_OUTSIDE_TENSOR)
def test_alpha_scaling_a_tensor_from_outside_the_region_fuses_as_a_mul_of_the_param(canonical, epilogue, extras,
                                                                                       with_examples):
    """Eager computes `input + alpha * other`: the program scales the param first, `mul($k,alpha)`."""
    assert_fuses_to(canonical, epilogue, extras, with_examples)


def test_steps_on_outside_tensors_alone_run_before_the_fused_op_which_reads_their_results():
    """The kernels bind instructions that read a value of the chain only: `mul($0,2.0)` and `mul($0,0.5);mul(%k,$1)`
    run before the fused op, by their references, and the op reads their results as its params."""
    model = GemmThen(linear_then_bc(lambda h, b, c: torch.addcmul(torch.add(h, b, alpha=2), b, c, value=0.5).relu()),
                     b=vector(), c=vector())
    x = torch.randn(BATCH, IN)
    optimized = assert_whole_chain_fused(model, (x,))
    (call,) = [n for n in optimized.graph.nodes if n.target in FUSED_OPS]
    _, _, _, params, program = call.args
    assert program == "add(%0,$0);add(%1,$1);relu(%2)", program
    assert [p.target for p in params] == [fxfuse.epilogue.mul, fxfuse.epilogue.mul], params
    assert_close_report(optimized(x), model(x))


ADDCMUL_ADDCDIV = [
    case("torch.addcmul(h,b,c,value=0.5)", "mul($0,0.5);mul(%1,$1);add(%0,%2)",
         linear_then_bc(lambda h, b, c: torch.addcmul(h, b, c, value=0.5)), b=vector(), c=vector()),
    case("torch.addcmul(b,h,c)", "mul(%0,$1);add($0,%1)",
         linear_then_bc(lambda h, b, c: torch.addcmul(b, h, c)), b=vector(), c=vector()),
    case("torch.addcmul(b,c,h,value=True)", "mul($1,%0);add($0,%1)",
         linear_then_bc(lambda h, b, c: torch.addcmul(b, c, h, value=True)), b=vector(), c=vector()),
    case("torch.addcmul(h,b,c,value=0)", "mul($0,0.0);mul(%1,$1);add(%0,%2)",
         linear_then_bc(lambda h, b, c: torch.addcmul(h, b, c, value=0)), b=vector(), c=vector()),
    case("Tensor.addcmul(h,h,value=-2)", "mul(%0,-2.0);mul(%1,%0);add(%0,%2)",
         linear_then(lambda h: h.addcmul(h, h, value=-2))),
    case("Tensor.addcmul_(b,c,value=3)", "mul($0,3.0);mul(%1,$1);add_(%0,%2)",
         linear_then_bc(lambda h, b, c: h.addcmul_(b, c, value=3)), b=vector(), c=vector()),
    case("torch.addcmul(h,b,c,out=h)", "mul($0,$1);add_(%0,%1)",
         linear_then_bc(lambda h, b, c: torch.addcmul(h, b, c, out=h)), b=vector(), c=vector()),
    case("torch.addcdiv(h,b,c,value=0.5)", "mul($0,0.5);div(%1,$1);add(%0,%2)",
         linear_then_bc(lambda h, b, c: torch.addcdiv(h, b, c, value=0.5)), b=vector(), c=vector()),
    case("torch.addcdiv(b,c,exp(h))", "exp(%0);div($1,%1);add($0,%2)",
         linear_then_bc(lambda h, b, c: torch.addcdiv(b, c, h.exp())), b=vector(), c=vector()),
    case("Tensor.addcdiv(h,exp(h),value=3)", "exp(%0);mul(%0,3.0);div(%2,%1);add(%0,%3)",
         linear_then(lambda h: h.addcdiv(h, h.exp(), value=3))),
    case("Tensor.addcdiv_(b,c,value=-1)", "mul($0,-1.0);div(%1,$1);add_(%0,%2)",
         linear_then_bc(lambda h, b, c: h.addcdiv_(b, c, value=-1)), b=vector(), c=vector()),
]


@pytest.mark.parametrize("with_examples", [True, False], ids=["example-inputs", "no-example-inputs"])
@pytest.mark.parametrize("canonical, epilogue, extras", ADDCMUL_ADDCDIV)
def test_addcmul_and_addcdiv_fuse_as_eagers_mul_div_and_add(canonical, epilogue, extras, with_examples):
    """`input + value * tensor1 * tensor2` (or `/ tensor2`), left to right as eager computes it."""
    assert_fuses_to(canonical, epilogue, extras, with_examples)


SCALED_OUTSIDE_TENSORS_IN_BF16 = [
    linear_then_bc(lambda h, b, c: torch.add(h, b, alpha=0.3)),
    linear_then_bc(lambda h, b, c: torch.rsub(b, h, alpha=-1.7)),
    linear_then_bc(lambda h, b, c: h.addcmul(b, c, value=0.7)),
    linear_then_bc(lambda h, b, c: torch.addcdiv(b, c, h.sigmoid() + 1, value=1.3)),
]


@pytest.mark.parametrize("epilogue", SCALED_OUTSIDE_TENSORS_IN_BF16, ids=["add", "rsub", "addcmul", "addcdiv"])
def test_scaled_outside_tensors_match_eager_in_bf16(epilogue):
    """Eager computes a bf16 `h + alpha * b` in float32, rounded once; the program rounds each step, within bf16's
    tolerance."""
    model = GemmThen(epilogue, b=vector(), c=vector()).eval().to(torch.bfloat16)
    x = torch.randn(BATCH, IN, dtype=torch.bfloat16)
    assert_whole_chain_fused(model, (x,))


@pytest.mark.parametrize("epilogue", [
    linear_then_bc(lambda h, b, c: torch.add(h, b, alpha=2.5).relu()),
    linear_then_bc(lambda h, b, c: torch.addcdiv(b, h, c.exp(), value=-0.5)),
], ids=["add-alpha", "addcdiv"])
def test_gradients_of_scaled_outside_tensors_are_eagers(epilogue):
    """b's gradient is alpha (or value / c) times the output's: autograd through the program's mul of the param."""
    model = GemmThen(epilogue, b=vector(), c=vector()).train()
    x = torch.randn(BATCH, IN)
    optimized = fxfuse.optimize(model, (x,))
    assert [row.op for row in optimized.fxfuse_report.fused] == ["gemm_epilogue_train"]
    assert_gradients_match(model, optimized, (x,))


@pytest.mark.parametrize("epilogue, program", [
    (lambda h, a, b: torch.sub(h, a, alpha=0.5), "mul($0,0.5);sub(%0,%1)"),
    (lambda h, a, b: torch.addcmul(h, a, b, value=2), "mul($0,2.0);mul(%1,$1);add(%0,%2)"),
    (lambda h, a, b: torch.addcdiv(h, a, b), "div($0,$1);add(%0,%1)"),
], ids=["sub-alpha", "addcmul", "addcdiv"])
def test_scaled_forward_arguments_fuse(epilogue, program):
    model = GemmThenTwoArguments(epilogue).eval()
    inputs = (torch.randn(BATCH, IN), torch.randn(BATCH, OUT), torch.rand(OUT) + 0.5)
    optimized = assert_whole_chain_fused(model, inputs)
    assert fused_programs(optimized) == [program]
