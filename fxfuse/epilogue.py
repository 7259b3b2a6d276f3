"""The epilogue vocabulary: every op a fused region may contain, each with its one plain-PyTorch reference.

Entry point: ``EPILOGUE_OPS`` (canonical name -> EpilogueOp), filled by the ``@epilogue_op`` decorator below.

A reference is the spec of its op. The reference interpreter (the CPU and fake implementation of the fused
op, see ``fxfuse.program``) calls it, and the tests use it as their oracle. The CUDA functor of each op
(``kernels/epilogue_ops.cuh``) carries a comment that points back here.

Signature convention: positional parameters are tensor *operands* (a value of the region, an outside tensor
passed to the fused op, a Python number or None); keyword-only parameters are scalar *attributes* that the
program captures (eps, slopes, bounds, group counts...).
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

POINTWISE = "pointwise"  # elementwise; binary ops broadcast their operands exactly as eager does
NORM = "norm"            # shape-preserving, needs statistics over the features of a row (or row group)
REDUCTION = "reduction"  # reduces the features of each row to one value


@dataclass(frozen=True)
class EpilogueOp:
    name: str
    kind: str
    operands: tuple[str, ...]
    attrs: tuple[str, ...]
    reference: Callable[..., torch.Tensor]
    # Operands that must be outside tensors of one value per feature (norm affines, running stats, prelu's slopes).
    feature_operands: frozenset[str] = frozenset()
    # Attribute sets the generic tests try for this op.
    samples: tuple[dict[str, Any], ...] = ({},)
    # Attributes of the op that must be the features dim ("dim" of reductions and softmax).
    feature_dim_attr: str | None = None
    # Defined, and well conditioned, for positive inputs only (log, rsqrt, fractional powers): the tests feed
    # it positive values, away from 0.
    positive_domain: bool = False
    # Defined, or well conditioned, on (0, 1) (logit; tan, whose poles are at +-pi/2): the tests feed it values
    # there.
    unit_domain: bool = False
    # Its value jumps at some inputs (sign, floor, atan2's branch cut): the CUDA tests judge it on the kernels' own
    # GEMM output, whose rounding differs from float64's and may move an element across a jump.
    jumps: bool = False
    # The operands of a binary op that may be a number: either of add's, mul's...; copysign's sign only; none of
    # torch.maximum's, which takes two tensors.
    number_operands: tuple[int, ...] = (0, 1)
    # Passes its value on but no gradient (detach): a region's result must also depend on the GEMM through other ops
    # (match.py), and the generic tests use it beside its input, as `h + h.detach()`.
    gradient_free: bool = False
    # What a norm or reduction over the features computes where they are one value (a row that an earlier keepdim
    # reduction left), as pointwise steps (op, operands and attributes) on that value "x" and the previous step's
    # result "y"; () is the value itself, None leaves such an op out of the region. The generic tests hold each to
    # the reference, in value, gradient and dtype under autocast.
    over_one_feature: tuple[tuple[str, tuple], ...] | None = None
    # Autocast runs it in its lower dtype on the CPU and CUDA (their lower_precision_fp lists: prelu), casting its
    # floating operands but float64 ones to that dtype, a param included.
    autocast_lower_precision: bool = False
    # Raises for a tensor operand of another dtype than its value's, where binary ops promote (prelu: "Type promoting
    # not supported"; outside autocast, which casts prelu's operands to one dtype).
    raises_for_another_dtype: bool = False

    @property
    def is_binary(self) -> bool:
        """Two operands that broadcast against each other, either of which may be the region's value (add, maximum);
        not prelu, whose second operand is its slopes."""
        return self.kind == POINTWISE and len(self.operands) == 2 and not self.feature_operands


EPILOGUE_OPS: dict[str, EpilogueOp] = {}


def epilogue_op(kind: str, *, samples=({},), feature_operands=(), feature_dim_attr=None, positive_domain=False,
                unit_domain=False, jumps=False, number_operands=(0, 1), over_one_feature=None, gradient_free=False,
                autocast_lower_precision=False, raises_for_another_dtype=False):
    """Register a reference function as a canonical epilogue op named after the function."""

    def register(fn):
        params = inspect.signature(fn).parameters.values()
        operands = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
        attrs = tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)
        EPILOGUE_OPS[fn.__name__] = EpilogueOp(
            name=fn.__name__, kind=kind, operands=operands, attrs=attrs, reference=fn,
            feature_operands=frozenset(feature_operands), samples=tuple(samples),
            feature_dim_attr=feature_dim_attr, positive_domain=positive_domain, unit_domain=unit_domain, jumps=jumps,
            number_operands=tuple(number_operands), over_one_feature=over_one_feature, gradient_free=gradient_free,
            autocast_lower_precision=autocast_lower_precision, raises_for_another_dtype=raises_for_another_dtype)
        return fn

    return register


# ---------------------------------------------------------------- binary pointwise
# operator.* rather than torch.*: it accepts a Python number on either side, as `2.0 - x` does in eager.

@epilogue_op(POINTWISE)
def add(a, b):
    return operator.add(a, b)


@epilogue_op(POINTWISE)
def sub(a, b):
    return operator.sub(a, b)


@epilogue_op(POINTWISE)
def mul(a, b):
    return operator.mul(a, b)


@epilogue_op(POINTWISE)
def div(a, b):
    return operator.truediv(a, b)


@epilogue_op(POINTWISE, number_operands=())
def maximum(a, b):
    return torch.maximum(a, b)


@epilogue_op(POINTWISE, number_operands=())
def minimum(a, b):
    return torch.minimum(a, b)


@epilogue_op(POINTWISE, number_operands=())
def fmax(a, b):
    # The larger, NaN only where both are (maximum's NaN wins).
    return torch.fmax(a, b)


@epilogue_op(POINTWISE, number_operands=())
def fmin(a, b):
    return torch.fmin(a, b)


@epilogue_op(POINTWISE, number_operands=())
def logaddexp(a, b):
    return torch.logaddexp(a, b)


@epilogue_op(POINTWISE, number_operands=())
def logaddexp2(a, b):
    return torch.logaddexp2(a, b)


@epilogue_op(POINTWISE, number_operands=())
def hypot(a, b):
    return torch.hypot(a, b)


@epilogue_op(POINTWISE, number_operands=(), jumps=True)
def atan2(a, b):
    return torch.atan2(a, b)


@epilogue_op(POINTWISE, number_operands=(1,), jumps=True)
def copysign(a, b):
    # a's magnitude with b's sign (b's sign bit: -0.0 and a NaN's too); b gets no gradient.
    return torch.copysign(a, b)


# ---------------------------------------------------------------- unary pointwise

@epilogue_op(POINTWISE)
def neg(x):
    return torch.neg(x)


@epilogue_op(POINTWISE)
def relu(x):
    return torch.relu(x)


@epilogue_op(POINTWISE, samples=({"min": -1.0, "max": 1.0}, {"min": 0.0, "max": None},
                                  {"min": None, "max": 0.5}, {"min": -2.0, "max": 2.0}))
def clamp(x, *, min, max):
    return torch.clamp(x, min, max)


@epilogue_op(POINTWISE, samples=({"min_val": -1.0, "max_val": 1.0}, {"min_val": 0.0, "max_val": 6.0},
                                  {"min_val": -0.5, "max_val": -0.5}))
def hardtanh(x, *, min_val, max_val):
    # clamp's values; its gradient is 0 on the bounds, where clamp's is 1 (relu6 is hardtanh(x, 0, 6)).
    return F.hardtanh(x, min_val, max_val)


@epilogue_op(POINTWISE, samples=({"negative_slope": 0.01}, {"negative_slope": 0.2}))
def leaky_relu(x, *, negative_slope):
    return F.leaky_relu(x, negative_slope)


@epilogue_op(POINTWISE, samples=({"alpha": 1.0, "scale": 1.0, "input_scale": 1.0},
                                  {"alpha": 1.6732632423543772, "scale": 1.0507009873554805, "input_scale": 1.0},
                                  {"alpha": 0.5, "scale": 1.0, "input_scale": 2.0}))
def elu(x, *, alpha, scale, input_scale):
    # One op for elu, selu (alpha and scale fixed) and celu (input_scale = 1 / alpha).
    return torch.ops.aten.elu(x, alpha, scale, input_scale)


@epilogue_op(POINTWISE, samples=({"approximate": "none"}, {"approximate": "tanh"}))
def gelu(x, *, approximate):
    return F.gelu(x, approximate=approximate)


@epilogue_op(POINTWISE)
def silu(x):
    return F.silu(x)


@epilogue_op(POINTWISE)
def mish(x):
    return F.mish(x)


@epilogue_op(POINTWISE)
def sigmoid(x):
    return torch.sigmoid(x)


@epilogue_op(POINTWISE)
def tanh(x):
    return torch.tanh(x)


@epilogue_op(POINTWISE, samples=({"beta": 1.0, "threshold": 20.0}, {"beta": 2.0, "threshold": 1.0}))
def softplus(x, *, beta, threshold):
    return F.softplus(x, beta, threshold)


@epilogue_op(POINTWISE)
def hardswish(x):
    return F.hardswish(x)


@epilogue_op(POINTWISE)
def hardsigmoid(x):
    return F.hardsigmoid(x)


@epilogue_op(POINTWISE)
def exp(x):
    return torch.exp(x)


@epilogue_op(POINTWISE, positive_domain=True)
def log(x):
    return torch.log(x)


@epilogue_op(POINTWISE, positive_domain=True)
def rsqrt(x):
    return torch.rsqrt(x)


@epilogue_op(POINTWISE)
def abs(x):
    return torch.abs(x)


@epilogue_op(POINTWISE, samples=({"exponent": 2.0}, {"exponent": 3.0}, {"exponent": 0.5}), positive_domain=True)
def pow(x, *, exponent):
    return torch.pow(x, exponent)


@epilogue_op(POINTWISE, positive_domain=True)
def sqrt(x):
    return torch.sqrt(x)


@epilogue_op(POINTWISE, positive_domain=True)
def reciprocal(x):
    return torch.reciprocal(x)


@epilogue_op(POINTWISE)
def erf(x):
    return torch.erf(x)


@epilogue_op(POINTWISE, positive_domain=True)
def log1p(x):
    return torch.log1p(x)


@epilogue_op(POINTWISE)
def expm1(x):
    return torch.expm1(x)


@epilogue_op(POINTWISE, gradient_free=True)
def detach(x):
    return x.detach()


@epilogue_op(POINTWISE)
def sin(x):
    return torch.sin(x)


@epilogue_op(POINTWISE)
def cos(x):
    return torch.cos(x)


@epilogue_op(POINTWISE)
def log_sigmoid(x):
    return F.logsigmoid(x)


@epilogue_op(POINTWISE)
def softsign(x):
    return F.softsign(x)


@epilogue_op(POINTWISE)
def tanhshrink(x):
    return F.tanhshrink(x)


@epilogue_op(POINTWISE, samples=({"threshold": 0.0, "value": 0.0}, {"threshold": 0.5, "value": -1.0}), jumps=True)
def threshold(x, *, threshold, value):
    return F.threshold(x, threshold, value)


@epilogue_op(POINTWISE, samples=({"lambd": 0.5}, {"lambd": 0.0}, {"lambd": -0.5}), jumps=True)
def hardshrink(x, *, lambd):
    return F.hardshrink(x, lambd)


@epilogue_op(POINTWISE, samples=({"lambd": 0.5}, {"lambd": 0.0}))
def softshrink(x, *, lambd):
    return F.softshrink(x, lambd)


@epilogue_op(POINTWISE)
def exp2(x):
    return torch.exp2(x)


@epilogue_op(POINTWISE, positive_domain=True)
def log2(x):
    return torch.log2(x)


@epilogue_op(POINTWISE, positive_domain=True)
def log10(x):
    return torch.log10(x)


@epilogue_op(POINTWISE, unit_domain=True)
def tan(x):
    return torch.tan(x)


@epilogue_op(POINTWISE)
def atan(x):
    return torch.atan(x)


@epilogue_op(POINTWISE)
def sinh(x):
    return torch.sinh(x)


@epilogue_op(POINTWISE)
def cosh(x):
    return torch.cosh(x)


@epilogue_op(POINTWISE)
def asinh(x):
    return torch.asinh(x)


@epilogue_op(POINTWISE)
def erfc(x):
    return torch.erfc(x)


@epilogue_op(POINTWISE, jumps=True)
def sign(x):
    # -1, 0 or 1; 0 for NaN and -0 (torch.sgn of a real tensor is the same); a gradient of 0.
    return torch.sign(x)


@epilogue_op(POINTWISE, jumps=True)
def floor(x):
    return torch.floor(x)


@epilogue_op(POINTWISE, jumps=True)
def ceil(x):
    return torch.ceil(x)


@epilogue_op(POINTWISE, jumps=True)
def trunc(x):
    return torch.trunc(x)


@epilogue_op(POINTWISE, jumps=True)
def round(x):
    # To the nearest integer, halves to even (decimals=0 only).
    return torch.round(x)


@epilogue_op(POINTWISE, jumps=True)
def frac(x):
    # x - trunc(x): NaN for an infinity; the gradient is the output's.
    return torch.frac(x)


# eps 2^-7: 1 - eps is exact in float32 (1 - 1e-6 is not, which puts a clamped value's logit 1e-4 off float64's)
@epilogue_op(POINTWISE, samples=({"eps": None}, {"eps": 0.0078125}, {"eps": 0.25}), unit_domain=True)
def logit(x, *, eps):
    # log(z / (1 - z)), z = x clamped to [eps, 1 - eps] (None: not clamped, NaN outside [0, 1]).
    return torch.logit(x, eps)


@epilogue_op(POINTWISE, feature_operands=("weight",), autocast_lower_precision=True, raises_for_another_dtype=True)
def prelu(x, weight):
    # x where x > 0, else weight * x: one slope, or one per channel (dim 1, the features of a 2-D value), as eager.
    return torch.prelu(x, weight)


# ---------------------------------------------------------------- normalizations over the features of a row

@epilogue_op(NORM, feature_operands=("weight", "bias"),
             samples=({"num_groups": 1, "eps": 1e-5}, {"num_groups": 4, "eps": 1e-5}, {"num_groups": 8, "eps": 1e-3}))
def group_norm(x, weight, bias, *, num_groups, eps):
    return F.group_norm(x, num_groups, weight, bias, eps)


@epilogue_op(NORM, feature_operands=("weight", "bias"), samples=({"eps": 1e-5}, {"eps": 1e-3}))
def layer_norm(x, weight, bias, *, eps):
    # Over the last dim only; instance norm of each row is this op without weight and bias.
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


@epilogue_op(NORM, feature_operands=("weight",), samples=({"eps": 1e-6}, {"eps": None}))
def rms_norm(x, weight, *, eps):
    return F.rms_norm(x, x.shape[-1:], weight, eps)


@epilogue_op(POINTWISE, feature_operands=("running_mean", "running_var", "weight", "bias"),
             samples=({"eps": 1e-5},))
def batch_norm(x, running_mean, running_var, weight, bias, *, eps):
    # Eval mode only: a per-feature affine with live running statistics.
    return F.batch_norm(x, running_mean, running_var, weight, bias, False, 0.0, eps)


@epilogue_op(NORM, samples=({"dim": -1, "eps": 1e-12}, {"dim": -1, "eps": 0.5}), feature_dim_attr="dim")
def normalize(x, *, dim, eps):
    # Each row over its 2-norm, or over eps where the norm is smaller (F.normalize with p=2).
    return F.normalize(x, 2.0, dim, eps)


# Over one value: x - max(x) is 0, or NaN for an infinity or NaN, as x - x; its exp is softmax's 1, and the log of
# that log_softmax's 0 (exp and log: float32 under CUDA's autocast, as softmax and log_softmax).
_SOFTMAX_OF_ONE = (("sub", ("x", "x")), ("exp", ("y",)))


@epilogue_op(NORM, samples=({"dim": -1},), feature_dim_attr="dim", over_one_feature=_SOFTMAX_OF_ONE)
def softmax(x, *, dim):
    return torch.softmax(x, dim)


@epilogue_op(NORM, samples=({"dim": -1},), feature_dim_attr="dim",
             over_one_feature=_SOFTMAX_OF_ONE + (("log", ("y",)),))
def log_softmax(x, *, dim):
    return torch.log_softmax(x, dim)


# ---------------------------------------------------------------- row reductions over the features

_REDUCE_SAMPLES = ({"dim": -1, "keepdim": True}, {"dim": -1, "keepdim": False})
# One value summed from 0: -0.0 comes out as 0.0, as torch's sum gives it; x ** 1.0 for the float32 that CUDA's
# autocast gives sum and logsumexp (not mean).
_PLUS_ZERO = (("add", ("x", 0.0)),)
_PLUS_ZERO_IN_FP32 = _PLUS_ZERO + (("pow", ("y", 1.0)),)


@epilogue_op(REDUCTION, samples=_REDUCE_SAMPLES, feature_dim_attr="dim", over_one_feature=_PLUS_ZERO_IN_FP32)
def sum(x, *, dim, keepdim):
    return torch.sum(x, dim, keepdim)


@epilogue_op(REDUCTION, samples=_REDUCE_SAMPLES, feature_dim_attr="dim", over_one_feature=_PLUS_ZERO)
def mean(x, *, dim, keepdim):
    return torch.mean(x, dim, keepdim)


@epilogue_op(REDUCTION, samples=_REDUCE_SAMPLES, feature_dim_attr="dim", over_one_feature=())
def amax(x, *, dim, keepdim):
    return torch.amax(x, dim, keepdim)


@epilogue_op(REDUCTION, samples=_REDUCE_SAMPLES, feature_dim_attr="dim", over_one_feature=())
def amin(x, *, dim, keepdim):
    return torch.amin(x, dim, keepdim)


@epilogue_op(REDUCTION, samples=_REDUCE_SAMPLES, feature_dim_attr="dim", over_one_feature=())
def max_dim(x, *, dim, keepdim):
    # amax's values; the gradient goes to the one element torch.max's indices name (the first extreme or NaN).
    return torch.max(x, dim, keepdim).values


@epilogue_op(REDUCTION, samples=_REDUCE_SAMPLES, feature_dim_attr="dim", over_one_feature=())
def min_dim(x, *, dim, keepdim):
    return torch.min(x, dim, keepdim).values


@epilogue_op(REDUCTION, samples=_REDUCE_SAMPLES, feature_dim_attr="dim", over_one_feature=_PLUS_ZERO_IN_FP32)
def logsumexp(x, *, dim, keepdim):
    return torch.logsumexp(x, dim, keepdim)


# The spread of a row: its squared deviations from the row's mean, summed, over max(0, count - correction).
_SPREAD_SAMPLES = ({"dim": -1, "keepdim": True, "correction": 1}, {"dim": -1, "keepdim": False, "correction": 0},
                   {"dim": -1, "keepdim": True, "correction": 2.5})


@epilogue_op(REDUCTION, samples=_SPREAD_SAMPLES, feature_dim_attr="dim")
def var(x, *, dim, keepdim, correction):
    return torch.var(x, dim, correction=correction, keepdim=keepdim)


@epilogue_op(REDUCTION, samples=_SPREAD_SAMPLES, feature_dim_attr="dim")
def std(x, *, dim, keepdim, correction):
    return torch.std(x, dim, correction=correction, keepdim=keepdim)


@epilogue_op(REDUCTION, samples=_REDUCE_SAMPLES, feature_dim_attr="dim")
def vector_norm(x, *, dim, keepdim):
    # The 2-norm of each row (torch.linalg.vector_norm's default ord; float32 under CUDA's autocast).
    return torch.linalg.vector_norm(x, 2, dim, keepdim)
