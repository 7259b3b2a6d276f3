"""Canonicalization: every spelling of a GEMM or epilogue op becomes one ``Canonical`` record.

Entry point: ``canonicalize(gm) -> dict[fx.Node, Canonical]``.

Spellings differ in form (module, functional, torch.*, tensor method, operator, in-place), in argument
passing (positional, keyword, NumPy's keywords such as ``axis=``, defaults) and in name (aliases such as
``torch.clip``). This module is the only
place that knows about them: the matcher sees canonical ops named after ``fxfuse.epilogue`` entries, plus
``linear`` for the GEMM anchor. The graph itself is left as it is, except that uses of a tensor after an
in-place op on it are redirected to the in-place node (which returns that same tensor), so that data flow
is explicit in the edges.

Each spelling is bound against a Python signature, so keyword and positional arguments, and defaults, are
all resolved the same way. Module calls are first translated to their functional equivalent, with the
module's tensors as ``Attr`` operands.
"""
from __future__ import annotations

import builtins
import dataclasses
import functools
import inspect
import math
import numbers
import operator
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .epilogue import EPILOGUE_OPS, POINTWISE

LINEAR = "linear"      # the GEMM anchor: operands (x, weight, bias); attr transpose_weight
IDENTITY = "identity"  # a no-op in the region (eval-mode dropout, nn.Identity, contiguous, clone)
COVERED = "covered"    # a node that another canonical op stands for (its only operand): matched through it
# an average pool over the features of a GEMM's output, which the GEMM's weight and bias take (avg_pool1d with
# stride = kernel): attrs kernel, unsqueezed (written as `h.unsqueeze(1)`, the pool, `.squeeze(1)`: of a 2-D h only)
FEATURE_POOL = "feature_pool"


@dataclass(frozen=True)
class Attr:
    """A tensor attribute of the traced module (a parameter or buffer), by its dotted path."""
    path: str

    def __str__(self):
        return self.path


@dataclass
class Canonical:
    op: str
    operands: tuple = ()                      # fx.Node | Attr | number | None, in the op's operand order
    attrs: dict[str, Any] = field(default_factory=dict)
    inplace_of: Any = None                    # the tensor an in-place spelling mutates
    covers: tuple = ()                        # further fx nodes this canonical op stands for
    problem: str | None = None                # recognised, but not fusible: the reason
    dtypes: tuple | None = None               # an idiom's: the dtypes its spelling is the op in (None: all)


@dataclass(frozen=True)
class OperandOf:
    """In a Canonical's `steps`: the canonical op's operand at `position`."""
    position: int


PREVIOUS = "previous"  # in a Canonical's `steps`: the previous step's result


def computed_as(steps: tuple, operands: tuple, inplace_of=None, attrs=None) -> Canonical:
    """An op that eager computes as several of the vocabulary's, in its order (`input + alpha * other`, addcmul's
    `input + value * tensor1 * tensor2`, softmin's softmax of `-input`): `steps` are (op, args), each arg an operand
    (`OperandOf`), the previous step's result (`PREVIOUS`) or a number; the steps before the last are pointwise ops
    without attributes. The canonical op is the last step's, with `attrs`; its operands are the formula's, and the
    matcher emits each step (its `steps` attribute)."""
    return Canonical(steps[-1][0], tuple(operands), {**(attrs or {}), "steps": tuple(steps)}, inplace_of=inplace_of)


@dataclass(frozen=True)
class SizeExpression:
    """A number computed in the graph from sizes of one tensor, `source` (`h.size(-1) ** -0.5`,
    `math.sqrt(h.shape[-1])`, `1.0 / h.shape[1]`): an operand whose value the matcher knows where the dims read are
    the features of a region value (the GEMM's weight fixes them), and computes as eager does (`value`)."""
    source: fx.Node
    dims: tuple       # the dims read, as written (-1, 1)
    reads: tuple      # the nodes whose value is a size (`t.size(-1)`, `t.shape[-1]`)
    steps: tuple      # the arithmetic on them, in graph order; the last one is the operand
    covers: tuple     # every node of the expression: the op that reads it stands for them

    def value(self, size: int):
        """The expression's number where every dim read has `size` elements."""
        values = {read: size for read in self.reads}
        for step in self.steps:
            args = fx.node.map_arg(step.args, values.__getitem__)
            kwargs = fx.node.map_arg(step.kwargs, values.__getitem__)
            values[step] = step.target(*args, **kwargs)
        return values[self.steps[-1]] if self.steps else size

    def __str__(self):
        return (self.steps or self.reads)[-1].name


class NotFusible(Exception):
    """Raised by a spelling handler: the op is recognised but this use of it cannot be fused."""


# ---------------------------------------------------------------- the spelling table

_FUNCTIONS: dict[Any, tuple[inspect.Signature, Callable]] = {}
_METHODS: dict[str, tuple[inspect.Signature, Callable]] = {}
_INPLACE_FUNCTIONS: set = set()
_INPLACE_METHODS: set = set()


@functools.lru_cache(maxsize=None)
def signatures_of(function) -> tuple[inspect.Signature, ...]:
    """A Python function's signature, or a torch builtin's, one per overload (cached: a builtin's takes ms)."""
    try:
        return (inspect.signature(function),)
    except (TypeError, ValueError):
        return tuple(fx.operator_schemas.get_signature_for_torch_op(function) or ())


def _signature(text: str) -> inspect.Signature:
    namespace: dict[str, Any] = {}
    exec(f"def f{text}: pass", {}, namespace)
    return inspect.signature(namespace["f"])


def spelling(signature: str, functions=(), methods=(), inplace_functions=(), inplace_methods=()):
    """Declare the spellings of one canonical op: the handler gets the bound arguments and ``inplace``."""
    sig = _signature(signature)

    def register(handler):
        for fn in functions:
            _FUNCTIONS[fn] = (sig, handler)
        for fn in inplace_functions:
            _FUNCTIONS[fn] = (sig, handler)
            _INPLACE_FUNCTIONS.add(fn)
        for name in methods:
            _METHODS[name] = (sig, handler)
        for name in inplace_methods:
            _METHODS[name] = (sig, handler)
            _INPLACE_METHODS.add(name)
        return handler

    return register


def _optional(*names, module=torch):
    return tuple(f for f in (getattr(module, n, None) for n in names) if f is not None)


def _nn(*names):
    """torch._C._nn's builtins of these names (F's Python functions call them), those this torch has."""
    return _optional(*names, module=torch._C._nn)


def _unary(op: str, fns=(), inplace_fns=(), methods=(), signature="(input, inplace=False)", **attrs):
    @spelling(signature, functions=fns, inplace_functions=inplace_fns, methods=methods,
              inplace_methods=tuple(m + "_" for m in methods))
    def handler(a, inplace):
        return Canonical(op, (a["input"],), dict(attrs), inplace_of=a["input"] if inplace else None)
    return handler


_unary("relu", (F.relu, torch.relu), (F.relu_, torch.relu_), ("relu",))
_unary("silu", (F.silu, *_nn("silu")), _nn("silu_"))
_unary("mish", (F.mish, *_nn("mish")), _nn("mish_"))
_unary("sigmoid", (torch.sigmoid, F.sigmoid, torch.special.expit), _optional("sigmoid_"), ("sigmoid",))
_unary("tanh", (torch.tanh, F.tanh), _optional("tanh_"), ("tanh",))
_unary("hardswish", (F.hardswish, *_nn("hardswish")), _nn("hardswish_"))
_unary("hardsigmoid", (F.hardsigmoid, *_nn("hardsigmoid")), _nn("hardsigmoid_"))
_unary("exp", (torch.exp,), _optional("exp_"), ("exp",))
_unary("log", (torch.log,), _optional("log_"), ("log",))
_unary("rsqrt", (torch.rsqrt,), _optional("rsqrt_"), ("rsqrt",))
_unary("abs", (torch.abs, torch.absolute, operator.abs), _optional("abs_"), ("abs", "absolute"))
_unary("neg", (torch.neg, torch.negative, operator.neg), _optional("neg_", "negative_"), ("neg", "negative"))
_unary("sqrt", (torch.sqrt,), _optional("sqrt_"), ("sqrt",))
_unary("reciprocal", (torch.reciprocal,), _optional("reciprocal_"), ("reciprocal",))
_unary("erf", (torch.erf, torch.special.erf), _optional("erf_"), ("erf",))
_unary("log1p", (torch.log1p, torch.special.log1p), _optional("log1p_"), ("log1p",))
_unary("expm1", (torch.expm1, torch.special.expm1), _optional("expm1_"), ("expm1",))
_unary("sin", (torch.sin,), _optional("sin_"), ("sin",))
_unary("cos", (torch.cos,), _optional("cos_"), ("cos",))
_unary("log_sigmoid", (F.logsigmoid,), signature="(input)")  # F.logsigmoid is torch._C._nn.log_sigmoid
_unary("softsign", (F.softsign,), signature="(input)")
_unary("tanhshrink", (F.tanhshrink,), signature="(input)")
_unary("exp2", (torch.exp2, torch.special.exp2), _optional("exp2_"), ("exp2",))
_unary("log2", (torch.log2,), _optional("log2_"), ("log2",))
_unary("log10", (torch.log10,), _optional("log10_"), ("log10",))
_unary("tan", (torch.tan,), _optional("tan_"), ("tan",))
_unary("atan", (torch.atan, torch.arctan), _optional("atan_", "arctan_"), ("atan", "arctan"))
_unary("sinh", (torch.sinh,), _optional("sinh_"), ("sinh",))
_unary("cosh", (torch.cosh,), _optional("cosh_"), ("cosh",))
_unary("asinh", (torch.asinh, torch.arcsinh), _optional("asinh_", "arcsinh_"), ("asinh", "arcsinh"))
_unary("erfc", (torch.erfc, torch.special.erfc), _optional("erfc_"), ("erfc",))
_unary("sign", (torch.sign, torch.sgn), _optional("sign_", "sgn_"), ("sign", "sgn"))  # sgn: sign, of a real tensor
_unary("floor", (torch.floor,), _optional("floor_"), ("floor",))
_unary("ceil", (torch.ceil,), _optional("ceil_"), ("ceil",))
_unary("trunc", (torch.trunc, torch.fix), _optional("trunc_", "fix_"), ("trunc", "fix"))
_unary("frac", (torch.frac,), _optional("frac_"), ("frac",))


@spelling("(input, *, decimals=0)", functions=(torch.round, torch.special.round),
          inplace_functions=_optional("round_"), methods=("round",), inplace_methods=("round_",))
def _round(a, inplace):
    decimals = a["decimals"]
    if isinstance(decimals, bool) or not isinstance(decimals, int) or decimals != 0:
        raise NotFusible(f"round with decimals={decimals!r}: the fused op rounds to integers only")
    return Canonical("round", (a["input"],), {}, inplace_of=_inplace(a, inplace))


@spelling("(input, eps=None)", functions=(torch.logit, torch.special.logit), inplace_functions=_optional("logit_"),
          methods=("logit",), inplace_methods=("logit_",))
def _logit(a, inplace):
    eps = None if a["eps"] is None else _number(a["eps"], "logit's eps")
    return Canonical("logit", (a["input"],), {"eps": eps}, inplace_of=_inplace(a, inplace))


@spelling("(input)", functions=(torch.positive, operator.pos), methods=("positive", "__pos__"))
def _positive(a, inplace):
    return Canonical(IDENTITY, (a["input"],), {"same_tensor": True})  # eager returns its input


@spelling("(input, threshold, value, inplace=False)", functions=(F.threshold, torch.threshold),
          inplace_functions=(torch.threshold_,))  # F.threshold_ is torch.threshold_
def _threshold(a, inplace):
    attrs = {"threshold": _number(a["threshold"], "threshold's threshold"),
             "value": _number(a["value"], "threshold's value")}
    return Canonical("threshold", (a["input"],), attrs, inplace_of=_inplace(a, inplace))


@spelling("(input, lambd=0.5)", functions=(torch.hardshrink,), methods=("hardshrink",))  # F.hardshrink too
def _hardshrink(a, inplace):
    return Canonical("hardshrink", (a["input"],), {"lambd": _number(a["lambd"], "hardshrink's lambd")})


@spelling("(input, lambd=0.5)", functions=(F.softshrink,))  # torch._C._nn.softshrink
def _softshrink(a, inplace):
    lambd = _number(a["lambd"], "softshrink's lambd")
    if not 0.0 <= lambd <= 65504.0:  # eager raises below 0, and above the largest value of the input's dtype
        raise NotFusible(f"softshrink's lambd={lambd!r} is outside [0, 65504], where eager may raise")
    return Canonical("softshrink", (a["input"],), {"lambd": lambd})


@spelling("(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True)",
          functions=(torch.avg_pool1d,))  # F.avg_pool1d, and nn.AvgPool1d's forward
def _avg_pool1d(a, inplace):
    kernel = _pool_size(a["kernel_size"], "kernel_size")
    stride = kernel if a["stride"] in (None, (), []) else _pool_size(a["stride"], "stride")
    problem = None  # (a FEATURE_POOL record all the same: between unsqueeze and squeeze, it says why at the unsqueeze)
    if stride != kernel:  # (windows that overlap or skip features: no mean of the weight's rows in groups)
        problem = (f"avg_pool1d with stride {stride} and kernel_size {kernel}: only windows that tile the features "
                   "fold into the GEMM")
    elif _pool_size(a["padding"], "padding", least=0) != 0 or a["ceil_mode"] is not False:
        problem = "avg_pool1d with padding or ceil_mode: its edge windows average fewer features"
    return Canonical(FEATURE_POOL, (a["input"],), {"kernel": kernel, "unsqueezed": False}, problem=problem)


def _pool_size(value, name: str, least: int = 1) -> int:
    """A pool's size argument, an int or a one-item tuple or list of one, as avg_pool1d reads it."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise NotFusible(f"avg_pool1d's {name}={value!r} is no int of {least} or more")
    return value


@spelling("(input, *, memory_format=None)", methods=("contiguous",))
def _contiguous(a, inplace):
    if a["memory_format"] not in (None, torch.contiguous_format):  # channels_last: other strides, or eager raises
        raise NotFusible(f"contiguous with memory_format={a['memory_format']}")
    return Canonical(IDENTITY, (a["input"],), {})


@spelling("(input, *, memory_format=None)", functions=(torch.clone,), methods=("clone",))
def _clone(a, inplace):
    if a["memory_format"] not in (None, torch.preserve_format, torch.contiguous_format):
        raise NotFusible(f"clone with memory_format={a['memory_format']}")
    # a copy: no view of its input (match._bases); in a region an in-place op on it is refused where the original is
    # read after it, as for an alias (the program's values are one per op): conservative
    return Canonical(IDENTITY, (a["input"],), {"copy": True})


@spelling("(input)", functions=(torch.detach,), methods=("detach",))
def _detach(a, inplace):
    return Canonical("detach", (a["input"],), {})


def _inplace(a, inplace):
    return a["input"] if inplace else None


@spelling("(input, beta=1.0, threshold=20.0)", functions=(F.softplus,))
def _softplus(a, inplace):
    # beta and threshold are attributes of the program: captured, not fixed to their defaults.
    attrs = {"beta": _number(a["beta"], "softplus's beta"),
             "threshold": _number(a["threshold"], "softplus's threshold")}
    return Canonical("softplus", (a["input"],), attrs)


@spelling("(input, approximate='none')", functions=(F.gelu,), inplace_functions=_nn("gelu_"))
def _gelu(a, inplace):
    return Canonical("gelu", (a["input"],), {"approximate": a["approximate"]}, inplace_of=_inplace(a, inplace))


@spelling("(input, negative_slope=0.01, inplace=False)", functions=(F.leaky_relu, *_nn("leaky_relu")),
          inplace_functions=(F.leaky_relu_,))
def _leaky_relu(a, inplace):
    return Canonical("leaky_relu", (a["input"],), {"negative_slope": _number(a["negative_slope"], "leaky_relu's slope")},
                     inplace_of=_inplace(a, inplace))


@spelling("(input, alpha=1.0, inplace=False)", functions=(F.elu,))
def _elu(a, inplace):
    attrs = {"alpha": _number(a["alpha"], "elu's alpha"), "scale": 1.0, "input_scale": 1.0}
    return Canonical("elu", (a["input"],), attrs, inplace_of=_inplace(a, inplace))


@spelling("(input, alpha=1, scale=1, input_scale=1)",
          functions=(torch.ops.aten.elu, torch.ops.aten.elu.default, torch._C._nn.elu),
          inplace_functions=(F.elu_,))
def _aten_elu(a, inplace):
    # The general form, which elu's reference (fxfuse.epilogue) calls. F.elu_ is torch._C._nn.elu_, this form in
    # place: its third positional argument is scale, not F.elu's inplace.
    attrs = {name: _number(a[name], f"elu's {name}") for name in ("alpha", "scale", "input_scale")}
    return Canonical("elu", (a["input"],), attrs, inplace_of=_inplace(a, inplace))


def _rrelu_in_eval(a, inplace):
    """rrelu outside training is leaky_relu with the bounds' mean as its slope, as eager computes it."""
    if a["training"] is not False:
        raise NotFusible("rrelu in training mode draws a random slope for each element")
    lower, upper = _number(a["lower"], "rrelu's lower"), _number(a["upper"], "rrelu's upper")
    if not (math.isfinite(lower) and math.isfinite(upper) and lower <= upper):
        raise NotFusible(f"rrelu's bounds {lower!r}, {upper!r} are not finite with lower <= upper (eager raises)")
    return Canonical("leaky_relu", (a["input"],), {"negative_slope": (lower + upper) / 2},
                     inplace_of=_inplace(a, inplace))


@spelling("(input, lower=0.125, upper=0.3333333333333333, training=False, inplace=False)", functions=(F.rrelu,))
def _rrelu(a, inplace):
    return _rrelu_in_eval(a, inplace)


@spelling("(input, lower=0.125, upper=0.3333333333333333, training=False, generator=None)",
          functions=(torch.rrelu,), inplace_functions=(torch.rrelu_,))  # F.rrelu_ is torch.rrelu_
def _torch_rrelu(a, inplace):
    return _rrelu_in_eval(a, inplace)


@spelling("(input, inplace=False)", functions=(F.selu, torch.selu), inplace_functions=_optional("selu_"))
def _selu(a, inplace):
    attrs = {"alpha": 1.6732632423543772848170429916717, "scale": 1.0507009873554804934193349852946,
             "input_scale": 1.0}
    return Canonical("elu", (a["input"],), attrs, inplace_of=_inplace(a, inplace))


@spelling("(input, alpha=1.0, inplace=False)", functions=(F.celu, torch.celu), inplace_functions=_optional("celu_"))
def _celu(a, inplace):
    alpha = _number(a["alpha"], "celu's alpha")
    if alpha == 0:
        raise NotFusible("celu with alpha=0")
    attrs = {"alpha": alpha, "scale": 1.0, "input_scale": 1.0 / alpha}
    return Canonical("elu", (a["input"],), attrs, inplace_of=_inplace(a, inplace))


@spelling("(input, weight)", functions=(torch.prelu,), methods=("prelu",))  # F.prelu is torch.prelu
def _prelu(a, inplace):
    for name in ("input", "weight"):
        if not isinstance(a[name], Attr) and surely_not_tensor(a[name]):
            raise NotFusible(f"prelu's {name} {a[name]!r} is not a tensor (eager raises)")
    return Canonical("prelu", (a["input"], a["weight"]), {})


def _plain_scalar(operand):
    """A scalar operand as the Python number the program text writes (NumPy's float64 and int64 spell
    themselves `np.float64(...)`); anything else as it is."""
    if isinstance(operand, (fx.Node, Attr, torch.Tensor, bool)) or operand is None:
        return operand  # a bool stays one: eager refuses some ops with it (`h - True`)
    if isinstance(operand, numbers.Integral):
        return int(operand)
    if isinstance(operand, numbers.Real):
        return float(operand)
    if isinstance(operand, numbers.Complex):
        raise NotFusible(f"the complex scalar {operand!r} makes the result complex")
    return operand


_SCALAR_INTS = range(-2**63, 2**64)  # the ints eager's parser takes for a Scalar argument: int64's and uint64's


def _number(value, what):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # NumPy's reals are numbers.Real too
        raise NotFusible(f"{what} is not a Python number")
    if isinstance(value, numbers.Integral) and int(value) not in _SCALAR_INTS:
        raise NotFusible(f"{what} {value} does not fit a 64-bit int (eager raises)")
    return float(value)


def _clamp(a, inplace, low, high):
    if low is None and high is None:
        raise NotFusible("clamp without bounds")
    low = None if low is None else _number(low, "clamp's min")
    high = None if high is None else _number(high, "clamp's max")
    return Canonical("clamp", (a["input"],), {"min": low, "max": high}, inplace_of=_inplace(a, inplace))


@spelling("(input, min=None, max=None)", functions=(torch.clamp, torch.clip),
          inplace_functions=_optional("clamp_", "clip_"), methods=("clamp", "clip"),
          inplace_methods=("clamp_", "clip_"))
def _clamp_both(a, inplace):
    return _clamp(a, inplace, a["min"], a["max"])


@spelling("(input, min)", functions=(torch.clamp_min,), inplace_functions=_optional("clamp_min_"),
          methods=("clamp_min",), inplace_methods=("clamp_min_",))
def _clamp_min(a, inplace):
    return _clamp(a, inplace, a["min"], None)


@spelling("(input, max)", functions=(torch.clamp_max,), inplace_functions=_optional("clamp_max_"),
          methods=("clamp_max",), inplace_methods=("clamp_max_",))
def _clamp_max(a, inplace):
    return _clamp(a, inplace, None, a["max"])


def _hardtanh_canonical(a, inplace, low, high):
    """Hardtanh computes clamp's values, but its gradient is 0 on the bounds themselves (clamp's is 1 there)."""
    low, high = _number(low, "hardtanh's min_val"), _number(high, "hardtanh's max_val")
    if low > high:
        raise NotFusible(f"hardtanh's min_val {low} is greater than its max_val {high} (eager raises)")
    return Canonical("hardtanh", (a["input"],), {"min_val": low, "max_val": high}, inplace_of=_inplace(a, inplace))


@spelling("(input, min_val=-1.0, max_val=1.0, inplace=False)", functions=(F.hardtanh, *_nn("hardtanh")),
          inplace_functions=(F.hardtanh_,))
def _hardtanh(a, inplace):
    return _hardtanh_canonical(a, inplace, a["min_val"], a["max_val"])


@spelling("(input, inplace=False)", functions=(F.relu6, *_nn("relu6")), inplace_functions=_nn("relu6_"))
def _relu6(a, inplace):
    return _hardtanh_canonical(a, inplace, 0.0, 6.0)


@spelling("(input)", functions=(torch.square,), methods=("square",), inplace_functions=_optional("square_"),
          inplace_methods=("square_",))
def _square(a, inplace):
    return Canonical("pow", (a["input"],), {"exponent": 2.0}, inplace_of=_inplace(a, inplace))


@spelling("(input, exponent)", functions=(torch.pow, operator.pow), methods=("pow",),
          inplace_methods=("pow_",), inplace_functions=(operator.ipow,))
def _pow(a, inplace):
    if isinstance(a["exponent"], fx.Node) and not isinstance(a["input"], fx.Node):
        raise NotFusible(f"{a['input']!r} ** a tensor: pow takes a number exponent only (2 ** x is exp2's value, but "
                         "CUDA's autocast runs pow in float32 and exp2 in the value's dtype)")
    return Canonical("pow", (a["input"],), {"exponent": _number(a["exponent"], "the exponent")},
                     inplace_of=_inplace(a, inplace))


@spelling("(input, exponent)", functions=(torch.float_power,), methods=("float_power",),
          inplace_methods=("float_power_",))
def _float_power(a, inplace):
    raise NotFusible("float_power computes in float64, where the fused op keeps its value's dtype")


def _binary(op: str, fns, methods, inplace_ops, signature="(input, other, *, alpha=1)", swap=False):
    @spelling(signature, functions=fns, methods=methods, inplace_methods=tuple(m + "_" for m in methods),
              inplace_functions=inplace_ops)
    def handler(a, inplace):
        left, right = (a["other"], a["input"]) if swap else (a["input"], a["other"])
        alpha = a.get("alpha", 1)
        if isinstance(alpha, bool):
            raise NotFusible(f"{op} with a boolean alpha (eager raises for a float result)")
        scaled = a["input"] if swap else a["other"]  # `input + alpha * other`; torch.rsub's `other - alpha * input`
        if alpha != 1 and not isinstance(scaled, fx.Node):
            # eager rounds the number to the tensor's dtype, then scales it: no one number says that
            raise NotFusible(f"{op} with alpha={alpha} and the number {scaled!r}")
        if a.get("rounding_mode") is not None:
            raise NotFusible(f"div with rounding_mode={a['rounding_mode']!r}")
        if not any(isinstance(o, fx.Node) for o in (left, right)):
            raise NotFusible(f"{op} of two constants")
        inplace_of = a["input"] if inplace else None
        if alpha == 1:
            return Canonical(op, (left, right), inplace_of=inplace_of)
        scale = ("mul", (OperandOf(1), _number(alpha, f"{op}'s alpha")))  # the second operand times alpha first
        return computed_as((scale, (op, (OperandOf(0), PREVIOUS))), (left, right), inplace_of)
    return handler


_binary("add", (torch.add, operator.add), ("add",), (operator.iadd,))
_binary("sub", (torch.sub, torch.subtract, operator.sub), ("sub", "subtract"), (operator.isub,))
_binary("sub", (torch.rsub,), (), (), swap=True)
_binary("mul", (torch.mul, torch.multiply, operator.mul), ("mul", "multiply"), (operator.imul,),
        signature="(input, other)")
_binary("div", (torch.div, torch.divide, torch.true_divide, operator.truediv), ("div", "divide", "true_divide"),
        (operator.itruediv,), signature="(input, other, *, rounding_mode=None)")


def _tensors_only(a, names, op):
    """`a`'s tensors `names`: eager's op takes no number there (`torch.addcmul(h, h, 2.0)` raises TypeError)."""
    for name in names:
        if surely_not_tensor(a[name]) or not isinstance(a[name], (fx.Node, Attr)):
            raise NotFusible(f"{op}'s {name} is not a tensor (eager raises)")
    return tuple(a[name] for name in names)


def _add_scaled(name: str, combine: str):
    """torch.addcmul (`combine` mul) and torch.addcdiv (div): eager computes `input + value * tensor1 <combine>
    tensor2`, left to right (value * 1 is exact: no step). addcdiv raises where both tensors are integer, where the
    first step reads no value of the region, which the matcher takes of tensors of its dtype only."""
    @spelling("(input, tensor1, tensor2, *, value=1)", functions=(getattr(torch, name),), methods=(name,),
              inplace_methods=(name + "_",))
    def handler(a, inplace):
        operands = _tensors_only(a, ("input", "tensor1", "tensor2"), name)
        value = a["value"]  # any real number (True is 1), as eager takes it for a floating result
        value = float(value) if isinstance(value, bool) else _number(value, f"{name}'s value")
        scaled = (("mul", (OperandOf(1), value)), (combine, (PREVIOUS, OperandOf(2)))) if value != 1 else \
            ((combine, (OperandOf(1), OperandOf(2))),)
        return computed_as((*scaled, ("add", (OperandOf(0), PREVIOUS))), operands, _inplace(a, inplace))
    return handler


_add_scaled("addcmul", "mul")
_add_scaled("addcdiv", "div")


# ---------------------------------------------------------------- normalizations

@spelling("(input, num_groups, weight=None, bias=None, eps=1e-05)", functions=(F.group_norm,))
def _group_norm(a, inplace):
    if isinstance(a["num_groups"], bool) or not isinstance(a["num_groups"], int):
        raise NotFusible(f"group_norm's num_groups is {a['num_groups']!r}, not an int (eager raises)")
    return Canonical("group_norm", (a["input"], a["weight"], a["bias"]),
                     {"num_groups": a["num_groups"], "eps": float(a["eps"])})


def _last_dim_of(node: fx.Node) -> tuple[list[fx.Node], int | None] | None:
    """If `node` computes the size of some tensor's last dim as an int or a 1-long torch.Size
    (`t.shape[-1:]`, `t.shape[-1]`, `t.size(-1)`, `t.size()[-1:]`, `t.size(dim=-1)`), or of a dim counted from the
    front (`t.shape[1:]`, `t.size(1)`), the last at one rank only: the nodes of that expression, last first, and
    that rank (None: any)."""
    def shape_of(source):
        return isinstance(source, fx.Node) and (
            source.op == "call_function" and source.target is builtins.getattr and source.args[1] == "shape"
            or source.op == "call_method" and source.target == "size" and len(source.args) == 1 and not source.kwargs)

    def last_at(dim):  # (whether `dim` is the last dim at some rank, that rank or None for every rank)
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < -1:
            return False, None
        return True, (None if dim == -1 else dim + 1)

    if node.op == "call_method" and node.target == "size" and set(node.kwargs) <= {"dim"}:
        dims = (*node.args[1:], *node.kwargs.values())
        found, rank = last_at(dims[0]) if len(dims) == 1 else (False, None)
        return ([node], rank) if found else None
    if node.op == "call_function" and node.target is operator.getitem and shape_of(node.args[0]):
        key = node.args[1]
        if isinstance(key, slice):
            found, rank = last_at(key.start) if key.stop is None and key.step is None else (False, None)
        else:
            found, rank = last_at(key)
        return ([node, node.args[0]], rank) if found else None
    return None


# Functions of numbers that a size may go through before an op reads it (`h.size(-1) ** -0.5`, `1.0 / h.shape[1]`).
_SIZE_ARITHMETIC = (operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
                    operator.pow, operator.neg, operator.pos)


def _size_read(node: fx.Node) -> tuple[fx.Node, int, tuple] | None:
    """If `node` is one dim's size of a tensor as an int (`t.size(d)`, `t.size(dim=d)`, `t.shape[d]`, `t.size()[d]`):
    (the tensor, d, the nodes of that read)."""
    if node.op == "call_method" and node.target == "size" and set(node.kwargs) <= {"dim"}:
        dims = (*node.args[1:], *node.kwargs.values())
        if len(dims) == 1 and isinstance(dims[0], int) and not isinstance(dims[0], bool):
            return node.args[0], dims[0], (node,)
        return None
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    shape, dim = node.args
    whole_shape = isinstance(shape, fx.Node) and (
        shape.op == "call_function" and shape.target is builtins.getattr and shape.args[1] == "shape"
        or shape.op == "call_method" and shape.target == "size" and len(shape.args) == 1 and not shape.kwargs)
    if whole_shape and isinstance(dim, int) and not isinstance(dim, bool):
        return shape.args[0], dim, (node, shape)
    return None


_SIZE_EXPRESSION_NODES = 16  # the most nodes a size expression is looked for in


def _size_expression(node) -> SizeExpression | None:
    """`node` as a SizeExpression, if it computes a number from sizes of one tensor only (in a few nodes: a chain of
    tensor adds is no such expression, and is not walked through)."""
    sources, dims, reads, steps, covers = set(), [], [], [], []
    budget = [_SIZE_EXPRESSION_NODES]

    def visit(item) -> bool:
        if not isinstance(item, fx.Node):
            return isinstance(item, numbers.Number)
        if item in reads or item in steps:
            return True
        budget[0] -= 1
        if budget[0] < 0:
            return False
        read = _size_read(item)
        if read is not None:
            sources.add(read[0])
            dims.append(read[1])
            reads.append(item)
            covers.extend(read[2])
            return True
        arithmetic = item.op == "call_function" and (
            item.target in _SIZE_ARITHMETIC or getattr(item.target, "__module__", None) == "math")
        if arithmetic and all(visit(a) for a in (*item.args, *item.kwargs.values())):
            steps.append(item)
            covers.append(item)
            return True
        return False

    if not isinstance(node, fx.Node) or not visit(node) or len(sources) != 1:
        return None
    position = {n: i for i, n in enumerate(node.graph.nodes)} if len(steps) > 1 else {}
    return SizeExpression(sources.pop(), tuple(sorted(set(dims))), tuple(reads),
                          tuple(sorted(steps, key=position.get) if position else steps), tuple(covers))


# The ops that take a number where a size expression stands (eager's torch.maximum takes tensors only).
_TAKES_SIZE_EXPRESSIONS = ("add", "sub", "mul", "div")


def _with_size_expressions(node: fx.Node, c: Canonical) -> Canonical:
    """`c` with each operand that computes a number from a tensor's sizes as a SizeExpression, which it then stands
    for; a problem where another node reads part of the expression too (only one op can stand for it)."""
    if c.op not in _TAKES_SIZE_EXPRESSIONS:
        return c
    operands, covers = [], list(c.covers)
    for operand in c.operands:
        expression = _size_expression(operand)
        if expression is None:
            operands.append(operand)
            continue
        inside = set(expression.covers) | {node}
        shared = next(((n, user) for n in expression.covers for user in n.users if user not in inside), None)
        if shared is not None:
            return dataclasses.replace(c, problem=f"`{shared[0].name}`, a size, is also read by `{shared[1].name}`: "
                                                  "only one op can stand for it")
        operands.append(expression)
        covers.extend(expression.covers)
    return dataclasses.replace(c, operands=tuple(operands), covers=tuple(covers))


def _normalized_size(normalized_shape) -> dict:
    """`normalized_shape` given as a number: the matcher checks it against the features (`normalized_size`), as
    eager raises for any other size."""
    items = [normalized_shape] if isinstance(normalized_shape, (int, fx.Node)) else list(normalized_shape)
    return {"normalized_size": int(items[0])} if len(items) == 1 and isinstance(items[0], int) else {}


def _last_dim_only(normalized_shape, input, what) -> tuple[tuple[fx.Node, ...], dict]:
    """Check that `normalized_shape` is the features alone. Return the nodes that compute it from `input`
    (`input.shape[-1:]`), which the norm then stands for, so that they don't keep `input` alive, and the attrs of
    the rank it needs (`input.shape[1:]` is the features of a 2-D input only)."""
    int_valued = isinstance(normalized_shape, fx.Node) and (  # t.size(-1), t.shape[-1]
        normalized_shape.op == "call_method" and normalized_shape.target == "size"
        or normalized_shape.target is operator.getitem and isinstance(normalized_shape.args[1], int))
    if isinstance(normalized_shape, int) or int_valued:
        raise NotFusible(f"{what}'s normalized_shape is an int, not a sequence (eager raises)")
    items = [normalized_shape] if isinstance(normalized_shape, (int, fx.Node)) else list(normalized_shape)
    computed = [item for item in items if isinstance(item, fx.Node)]
    expressions = [_last_dim_of(item) for item in computed]
    if any(e is None for e in expressions):
        raise NotFusible(f"{what}'s normalized_shape is computed in the graph")
    if len(items) != 1:
        raise NotFusible(f"{what} over {len(items)} dims, not the features alone")
    if any(nodes[-1].args[0] is not input for nodes, _ in expressions):
        raise NotFusible(f"{what}'s normalized_shape is the size of another tensor")
    covers = [n for nodes, _ in expressions for n in nodes]
    ranks = {rank for _, rank in expressions if rank is not None}
    return (tuple(covers) if all(len(n.users) == 1 for n in covers) else (),
            {"rank_needed": tuple(ranks)} if ranks else {})


@spelling("(input, num_groups, weight=None, bias=None, eps=1e-05, cudnn_enabled=True)",
          functions=(torch.group_norm,))
def _torch_group_norm(a, inplace):
    return _group_norm(a, inplace)


@spelling("(input, normalized_shape, weight=None, bias=None, eps=1e-05, cudnn_enable=True)",
          functions=(torch.layer_norm,))
def _torch_layer_norm(a, inplace):
    return _layer_norm(a, inplace)


@spelling("(input, normalized_shape, weight=None, bias=None, eps=1e-05)", functions=(F.layer_norm,))
def _layer_norm(a, inplace):
    covers, rank = _last_dim_only(a["normalized_shape"], a["input"], "layer_norm")
    attrs = {"eps": float(a["eps"]), **_normalized_size(a["normalized_shape"]), **rank}
    return Canonical("layer_norm", (a["input"], a["weight"], a["bias"]), attrs, covers=covers)


@spelling("(input, normalized_shape, weight=None, eps=None)", functions=(F.rms_norm, *_optional("rms_norm")))
def _rms_norm(a, inplace):
    covers, rank = _last_dim_only(a["normalized_shape"], a["input"], "rms_norm")
    eps = None if a["eps"] is None else float(a["eps"])
    return Canonical("rms_norm", (a["input"], a["weight"]),
                     {"eps": eps, **_normalized_size(a["normalized_shape"]), **rank}, covers=covers)


@spelling("(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-05)",
          functions=(F.batch_norm,))
def _batch_norm(a, inplace):
    if a["training"]:
        raise NotFusible("train-mode batch_norm normalizes over the batch, not within a row")
    if a["running_mean"] is None or a["running_var"] is None:  # eager normalizes by the batch's statistics
        raise NotFusible("batch_norm without running statistics normalizes over the batch, not within a row")
    return Canonical("batch_norm", (a["input"], a["running_mean"], a["running_var"], a["weight"], a["bias"]),
                     {"eps": float(a["eps"])})


@spelling("(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)",
          functions=(torch.batch_norm,))
def _torch_batch_norm(a, inplace):
    return _batch_norm(a, inplace)


@spelling("(input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True, "
          "momentum=0.1, eps=1e-05)", functions=(F.instance_norm,))
def _instance_norm(a, inplace):
    if not a["use_input_stats"]:
        raise NotFusible("instance_norm with running statistics")
    if a["running_mean"] is not None or a["running_var"] is not None:
        raise NotFusible("instance_norm updates its running statistics in place")
    if a["weight"] is not None or a["bias"] is not None:
        raise NotFusible("affine instance_norm scales per channel, not per feature")
    # Instance norm of each row over its features is layer norm without affine. The rank is checked by
    # the matcher (`rank_needed`): F.instance_norm wants a 3-D input.
    return Canonical("layer_norm", (a["input"], None, None), {"eps": float(a["eps"]), "rank_needed": (3,)})


def _dtype_needed(dtype) -> dict:
    """`dtype=` of a softmax or a reduction: fusible where it is the value's own dtype (a no-op), which the
    matcher checks against the GEMM's (`dtype_needed`)."""
    if dtype is None:
        return {}
    if not isinstance(dtype, torch.dtype):
        raise NotFusible(f"dtype={dtype!r} is not a torch.dtype")
    return {"dtype_needed": dtype}


def _int_argument(value, what: str) -> int:
    """An int argument as eager's parser takes it (NumPy's ints too): a bool or a float raises there
    (`F.softmax(h, 1.0)`)."""
    if isinstance(value, fx.Node):
        raise NotFusible(f"{what} is computed at run time")
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise NotFusible(f"{what} is {type(value).__name__}, not int (eager raises)") from None


def _bool_argument(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise NotFusible(f"{what} is {type(value).__name__}, not bool (eager raises)")
    return value


def _softmax_attrs(a, what: str) -> dict:
    """The attributes of a softmax-like spelling (`what`, as explain() names it): its dim and dtype=."""
    if a["dim"] is None:
        raise NotFusible(f"{what} without an explicit dim")
    return {"dim": _int_argument(a["dim"], f"{what}'s dim"), **_dtype_needed(a["dtype"])}


def _softmax_like(op):
    def handler(a, inplace):
        return Canonical(op, (a["input"],), _softmax_attrs(a, op))

    # F.softmax has a `_stacklevel` before dtype; torch.softmax, torch.special.softmax and the method do not
    # (`torch.softmax(h, -1, torch.float64)` passes the dtype by position).
    spelling("(input, dim=None, _stacklevel=3, dtype=None)", functions=(getattr(F, op),))(handler)
    spelling("(input, dim, dtype=None)", functions=(getattr(torch, op), getattr(torch.special, op)),
             methods=(op,))(handler)


_softmax_like("softmax")
_softmax_like("log_softmax")


@spelling("(input, dim=None, _stacklevel=3, dtype=None)", functions=(F.softmin,))  # and nn.Softmin's forward
def _softmin(a, inplace):
    # eager computes `(-input).softmax(dim)`, with dtype= as softmax takes it
    steps = (("neg", (OperandOf(0),)), ("softmax", (PREVIOUS,)))
    return computed_as(steps, (a["input"],), attrs=_softmax_attrs(a, "softmin"))


# ---------------------------------------------------------------- row reductions

def _single_dim(dim, op):
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            raise NotFusible(f"{op} over {len(dim) or 'all'} dims, not the features alone")
        dim = dim[0]
    if dim is None or dim == ():
        raise NotFusible(f"{op} without a dim reduces the whole tensor")
    return _int_argument(dim, f"{op}'s dim")


def _reduction(op, fns, methods, signature="(input, dim=None, keepdim=False, *, dtype=None)"):
    @spelling(signature, functions=fns, methods=methods)
    def handler(a, inplace):
        attrs = {"dim": _single_dim(a["dim"], op), "keepdim": _bool_argument(a["keepdim"], f"{op}'s keepdim"),
                 **_dtype_needed(a.get("dtype"))}
        return Canonical(op, (a["input"],), attrs)
    return handler


_reduction("sum", (torch.sum,), ("sum",))
_reduction("mean", (torch.mean,), ("mean",))
_reduction("amax", (torch.amax,), ("amax",), "(input, dim=(), keepdim=False)")
_reduction("amin", (torch.amin,), ("amin",), "(input, dim=(), keepdim=False)")
_reduction("logsumexp", (torch.logsumexp, torch.special.logsumexp), ("logsumexp",), "(input, dim, keepdim=False)")


def _spread(op):
    """torch.var / torch.std over one dim. Eager's overloads (`unbiased` by position or name, or `correction=`;
    `torch.var(h, True)` over every dim) are checked by its own parser first (_check_eager_takes)."""
    @spelling("(input, dim=None, unbiased=None, keepdim=False, *, correction=None)", functions=(getattr(torch, op),),
              methods=(op,))
    def handler(a, inplace):
        if isinstance(a["dim"], bool):  # the `(input, unbiased)` overload
            raise NotFusible(f"{op} without a dim reduces the whole tensor")
        if a["unbiased"] is not None:
            correction = 1.0 if _bool_argument(a["unbiased"], f"{op}'s unbiased") else 0.0
        else:
            correction = 1.0 if a["correction"] is None else _number(a["correction"], f"{op}'s correction")
        return Canonical(op, (a["input"],), {"dim": _single_dim(a["dim"], op),
                                             "keepdim": _bool_argument(a["keepdim"], f"{op}'s keepdim"),
                                             "correction": correction})
    return handler


_spread("var")
_spread("std")


def _two_norm(order, default_order, what: str) -> None:
    """The fused ops take the 2-norm only: `ord=2`, or the spelling's default where it is the 2-norm."""
    if order is None:
        order = default_order
    if order != "fro" and (isinstance(order, (bool, str)) or order != 2):
        raise NotFusible(f"{what} of order {order!r}: the fused op takes the 2-norm only")


def _vector_norm_canonical(a, order, default_order, what):
    _two_norm(order, default_order, what)
    if a["dim"] is None:  # torch.norm's Frobenius norm, or linalg.norm's matrix norm: over every dim
        raise NotFusible(f"{what} without a dim reduces the whole tensor")
    return Canonical("vector_norm", (a["input"],), {"dim": _single_dim(a["dim"], what),
                                                    "keepdim": _bool_argument(a["keepdim"], f"{what}'s keepdim"),
                                                    **_dtype_needed(a["dtype"])})


@spelling("(input, ord=2, dim=None, keepdim=False, *, dtype=None)", functions=(torch.linalg.vector_norm,))
def _linalg_vector_norm(a, inplace):
    return _vector_norm_canonical(a, a["ord"], 2, "vector_norm")


@spelling("(input, ord=None, dim=None, keepdim=False, *, dtype=None)", functions=(torch.linalg.norm,))
def _linalg_norm(a, inplace):
    if isinstance(a["dim"], (list, tuple)) and len(a["dim"]) == 2:
        raise NotFusible("linalg.norm over two dims is a matrix norm")
    return _vector_norm_canonical(a, a["ord"], 2, "linalg.norm")


@spelling("(input, p='fro', dim=None, keepdim=False, dtype=None)", functions=(torch.norm,), methods=("norm",))
def _norm(a, inplace):
    return _vector_norm_canonical(a, a["p"], "fro", "norm")


@spelling("(input, p=2.0, dim=1, eps=1e-12)", functions=(F.normalize,))
def _normalize(a, inplace):
    _two_norm(a["p"], 2.0, "normalize")
    return Canonical("normalize", (a["input"],), {"dim": _int_argument(a["dim"], "normalize's dim"),
                                                  "eps": _number(a["eps"], "normalize's eps")})

# torch.max(x, dim) / torch.min(x, dim) return (values, indices): the reduction is the `[0]` / `.values` node.
# Not amax / amin: those split a tied row's gradient between its extremes, these give it to the indexed one.
_VALUES_OF = {"max": "max_dim", "min": "min_dim"}
_MAX_OVER_A_DIM = _signature("(input, dim=None, keepdim=False)")  # torch.max's reduction form, as _values_of binds it


def _max_min(a, elementwise_op: str):
    """torch.max / torch.min: of two tensors, `elementwise_op`; over a dim, fused through its values (_values_of).
    Bound as given (`*args`, `**kwargs`): eager takes the other tensor as `(h, other)` or `other=` only."""
    args, kwargs = a["args"], a["kwargs"]
    other = args[0] if args else kwargs.get("other", kwargs.get("dim"))
    if isinstance(other, fx.Node) and not surely_not_tensor(other):  # torch.max(h, other): elementwise
        if len(args) + len(kwargs) != 1 or "dim" in kwargs:
            raise NotFusible(f"{elementwise_op} of two tensors with keepdim or dim= (eager raises)")
        return Canonical(elementwise_op, (a["input"], other), {})
    if not args and "dim" not in kwargs:  # h.max(): one number, and no indices
        raise NotFusible("max/min without a dim reduces the whole tensor")
    raise NotFusible("max/min over a dim is fused through its `.values` or `[0]` (its indices are not)")


@spelling("(input, *args, **kwargs)", functions=(torch.max,), methods=("max",))
def _max(a, inplace):
    return _max_min(a, "maximum")


@spelling("(input, *args, **kwargs)", functions=(torch.min,), methods=("min",))
def _min(a, inplace):
    return _max_min(a, "minimum")


def _of_two_tensors(op: str, functions, methods):
    """The spellings of an op whose torch function takes two tensors (torch.maximum, torch.hypot), and its in-place
    methods where torch has them (`h.hypot_(t)`)."""
    @spelling("(input, other)", functions=functions, methods=methods,
              inplace_methods=tuple(m + "_" for m in methods if hasattr(torch.Tensor, m + "_")))
    def handler(a, inplace):
        if not isinstance(a["other"], fx.Node) or not isinstance(a["input"], fx.Node):
            raise NotFusible(f"{op} with a number (eager takes tensors only)")
        return Canonical(op, (a["input"], a["other"]), {}, inplace_of=_inplace(a, inplace))
    return handler


_of_two_tensors("maximum", (torch.maximum,), ("maximum",))
_of_two_tensors("minimum", (torch.minimum,), ("minimum",))
_of_two_tensors("fmax", (torch.fmax,), ("fmax",))
_of_two_tensors("fmin", (torch.fmin,), ("fmin",))
_of_two_tensors("logaddexp", (torch.logaddexp,), ("logaddexp",))
_of_two_tensors("logaddexp2", (torch.logaddexp2,), ("logaddexp2",))
_of_two_tensors("hypot", (torch.hypot,), ("hypot",))
_of_two_tensors("atan2", (torch.atan2, torch.arctan2), ("atan2", "arctan2"))


@spelling("(input, other)", functions=(torch.copysign,), methods=("copysign",), inplace_methods=("copysign_",))
def _copysign(a, inplace):
    if not isinstance(a["input"], fx.Node):  # its sign may be a number; its magnitude not
        raise NotFusible("copysign of a number (eager takes a tensor first)")
    if isinstance(a["other"], float) and math.isnan(a["other"]):
        raise NotFusible("copysign with a NaN sign: the program's text does not keep a NaN's sign bit")
    return Canonical("copysign", (a["input"], a["other"]), {}, inplace_of=_inplace(a, inplace))


def _values_of(node: fx.Node) -> Canonical | None:
    """`torch.min(x, 1, True)[0]` and `x.min(dim=1).values` are the row reduction min_dim."""
    if node.op != "call_function" or node.target not in (operator.getitem, builtins.getattr):
        return None
    source, key = node.args[0], node.args[1]
    if not isinstance(source, fx.Node) or key not in (0, "values"):
        return None
    name = _reduction_name(source)
    if name is None:
        return None
    sig = _MAX_OVER_A_DIM
    try:
        bound = sig.bind(*source.args, **_from_numpy_keywords(source.kwargs, sig))
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    # A problem is told at this node: it covers `source`, so matching reaches it through `source`.
    if isinstance(a["dim"], bool) or not isinstance(a["dim"], int) or not isinstance(a["keepdim"], bool):
        return Canonical(_VALUES_OF[name], (a["input"],), {}, problem=f"{name} without an int dim and a bool keepdim",
                         covers=(source,))
    # `values, _ = torch.max(h, 1)` also makes an indices node that nothing reads: the reduction stands for it.
    others = [user for user in source.users if user is not node]
    unread = [user for user in others if user.op == "call_function" and not user.users
              and user.target in (operator.getitem, builtins.getattr)]
    # `r[0] + r.values`: fx makes a node for each read of the values; the first is the reduction, the others the
    # same tensor (identities of it)
    values = [user for user in others if user not in unread and _reads_values(user)]
    if len(unread) + len(values) != len(others):
        return Canonical(_VALUES_OF[name], (a["input"],), {}, problem=_other_readers(source, others), covers=(source,))
    if values and not node.users:
        return None  # unread: the first read covers it
    first = source.next
    while first is not node and first not in values:
        first = first.next
    if first is not node:
        return Canonical(IDENTITY, (first,))
    return Canonical(_VALUES_OF[name], (a["input"],), {"dim": a["dim"], "keepdim": a["keepdim"]},
                     covers=(source, *unread))


def _reads_values(user: fx.Node) -> bool:
    return user.op == "call_function" and user.target in (operator.getitem, builtins.getattr) and \
        len(user.args) > 1 and user.args[1] in (0, "values")


def _other_readers(source: fx.Node, others: list[fx.Node]) -> str:
    """What else reads a torch.max / torch.min result than the `[0]` being fused, for explain()."""
    def reads(user, keys):
        return user.op == "call_function" and user.target in (operator.getitem, builtins.getattr) and \
            len(user.args) > 1 and user.args[1] in keys

    if any(reads(user, (1, "indices")) for user in others):
        return f"the indices of `{source.name}` are used too"
    return f"`{source.name}` itself is used too, not only its values"


def _reduction_name(node: fx.Node) -> str | None:
    if node.op == "call_function" and node.target in (torch.max, torch.min):
        return node.target.__name__
    if node.op == "call_method" and node.target in ("max", "min"):
        return node.target
    return None


# ---------------------------------------------------------------- dropout and the GEMM anchor

def _dropout_identity(a, training, name):
    """Dropout that returns its input: p = 0, or not training. Eager checks p even then, and so does this.
    (dropout1d-3d also check the rank of every input they get: they are not folded.)"""
    p = a["p"]
    if not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise NotFusible(f"{name}'s p={p!r} is not a probability (eager raises)")
    if training and p > 0:
        raise NotFusible(f"{name}(p={p}) in training mode is random")
    return Canonical(IDENTITY, (a["input"],), {} if training else {"same_tensor": True})  # (eager returns its input)


@spelling("(input, p=0.5, training=True, inplace=False)", functions=(F.dropout,))
def _dropout(a, inplace):
    return _dropout_identity(a, a["training"], "dropout")


@spelling("(input, p=0.5, training=False, inplace=False)", functions=(F.alpha_dropout, F.feature_alpha_dropout))
def _alpha_dropout(a, inplace):
    return _dropout_identity(a, a["training"], "alpha_dropout")


@spelling("(input, p, train)", functions=(torch.dropout, torch.alpha_dropout, torch.feature_dropout,
                                          torch.feature_alpha_dropout))
def _torch_dropout(a, inplace):
    return _dropout_identity(a, a["train"], "dropout")


@spelling("(input, weight, bias=None)", functions=(F.linear, torch._C._nn.linear))
def _linear(a, inplace):
    return Canonical(LINEAR, (a["input"], a["weight"], a["bias"]), {"transpose_weight": False})


_SWAPS = {torch.transpose: "(input, dim0, dim1)", torch.swapaxes: "(input, axis0, axis1)",
          torch.swapdims: "(input, dim0, dim1)", "transpose": "(input, dim0, dim1)",
          "swapaxes": "(input, axis0, axis1)", "swapdims": "(input, dim0, dim1)"}
_MATRIX_DIMS = ((0, 1), (0, -1), (-2, 1), (-2, -1))  # the two dims of a matrix, as positive or negative indices


def _transposed_weight(other):
    """If `other` is `W.t()` (or `.T`, `transpose(0, 1)`, `swapaxes`, `permute(1, 0)`, in any argument form),
    return W."""
    if not isinstance(other, fx.Node):
        return None
    t, args = other.target, other.args
    if other.op == "call_method" and t == "t" or other.op == "call_function" and t is torch.t:
        return args[0]
    if other.op == "call_function" and t is builtins.getattr and args[1] in ("T", "mT"):
        return args[0]
    if other.op not in ("call_method", "call_function"):
        return None
    try:
        if t in _SWAPS:
            bound = _signature(_SWAPS[t]).bind(*args, **other.kwargs).arguments
            dims = tuple(bound.values())[1:]
            return bound["input"] if dims in _MATRIX_DIMS or dims[::-1] in _MATRIX_DIMS else None
        if t == "permute" and other.op == "call_method" or t is torch.permute:
            bound = _signature("(input, *dims)" if not other.kwargs else "(input, dims)").bind(*args, **other.kwargs)
            dims = bound.arguments.get("dims", ())
            dims = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else tuple(dims)
            return bound.arguments["input"] if dims[::-1] in _MATRIX_DIMS else None
    except (TypeError, ValueError):  # unhashable targets; arguments that no such call takes
        return None
    return None


def _matmul(a, matrix_input):
    attrs = {"matrix_input": True} if matrix_input else {}
    weight = _transposed_weight(a["other"])
    if weight is not None:
        covers = (a["other"],) if len(a["other"].users) == 1 else ()
        return Canonical(LINEAR, (a["input"], weight, None), {"transpose_weight": False, **attrs}, covers=covers)
    return Canonical(LINEAR, (a["input"], a["other"], None), {"transpose_weight": True, **attrs})


@spelling("(input, other)", functions=(torch.matmul, torch.linalg.matmul, operator.matmul), methods=("matmul",))
def _matmul_any_rank(a, inplace):
    return _matmul(a, matrix_input=False)


@spelling("(input, other)", functions=(torch.mm,), methods=("mm",))
def _mm(a, inplace):
    return _matmul(a, matrix_input=True)  # torch.mm takes matrices only


@spelling("(input, mat1, mat2, beta=1, alpha=1)", functions=(torch.addmm,), methods=("addmm",))
def _addmm(a, inplace):
    if a["beta"] != 1 or a["alpha"] != 1:  # a GEMM all the same: reported as a GEMM that can't be fused
        return Canonical(LINEAR, (a["mat1"], a["mat2"], None), {"transpose_weight": True},
                         problem="addmm with beta or alpha other than 1")
    attrs = {"addmm_bias": a["input"], "matrix_input": True}
    weight = _transposed_weight(a["mat2"])
    if weight is None:
        return Canonical(LINEAR, (a["mat1"], a["mat2"], None), {"transpose_weight": True, **attrs})
    covers = (a["mat2"],) if len(a["mat2"].users) == 1 else ()
    return Canonical(LINEAR, (a["mat1"], weight, None), {"transpose_weight": False, **attrs}, covers=covers)


# ---------------------------------------------------------------- operator methods

# Dynamo records an explicit `h.__add__(b)` as a call of that method (an fx trace records operator.add): the
# spelling of its operator, in place for `__iadd__`, its operands swapped for `__radd__`.
for _name, _function, _inplace_function in (
        ("add", operator.add, operator.iadd), ("sub", operator.sub, operator.isub),
        ("mul", operator.mul, operator.imul), ("truediv", operator.truediv, operator.itruediv),
        ("div", operator.truediv, operator.itruediv), ("pow", operator.pow, operator.ipow)):
    _METHODS[f"__{_name}__"] = _FUNCTIONS[_function]
    _METHODS[f"__i{_name}__"] = _FUNCTIONS[_inplace_function]
    _INPLACE_METHODS.add(f"__i{_name}__")
for _name, _op in (("add", "add"), ("sub", "sub"), ("mul", "mul"), ("truediv", "div"), ("div", "div")):
    _METHODS[f"__r{_name}__"] = (_signature("(input, other)"), _binary(_op, (), (), (), swap=True))
for _name, _function in (("neg", operator.neg), ("abs", operator.abs), ("matmul", operator.matmul)):
    _METHODS[f"__{_name}__"] = _FUNCTIONS[_function]


# ---------------------------------------------------------------- ops outside the vocabulary, in idioms

# Idioms match the ops they use outside the vocabulary (torch.where, `>`) by target and position: their other
# spellings, as the one the built-in idioms write.
_PLAIN_FUNCTIONS = {torch.gt: operator.gt, torch.greater: operator.gt}
_PLAIN_METHODS = {"gt": operator.gt, "greater": operator.gt}


def plain_call(node: fx.Node) -> tuple[Any, tuple, dict] | None:
    """A call outside the vocabulary as (target, args, kwargs) in one spelling: torch.gt and `h.gt(0)` as `h > 0`,
    `a.where(c, b)` as torch.where(c, a, b); None if `node` is no such call."""
    args, kwargs = tuple(node.args), dict(node.kwargs)
    if node.op == "call_method":
        if node.target == "where" and len(args) == 3 and not kwargs:  # self is torch.where's second argument
            return torch.where, (args[1], args[0], args[2]), {}
        if node.target in _PLAIN_METHODS:
            return _PLAIN_METHODS[node.target], args, kwargs
    if node.op == "call_function":
        try:
            plain = _PLAIN_FUNCTIONS.get(node.target)
        except TypeError:  # an unhashable target
            plain = None
        if plain is not None:
            return plain, args, kwargs
    return None


# ---------------------------------------------------------------- modules, as their functional equivalent

def _module_tensor(path: str, module: nn.Module, name: str):
    return None if getattr(module, name, None) is None else Attr(f"{path}.{name}" if path else name)


_KNOWN_MODULES = (nn.Linear, nn.ReLU, nn.SiLU, nn.Mish, nn.Hardswish, nn.Hardsigmoid, nn.SELU, nn.ReLU6, nn.Sigmoid,
                  nn.Tanh, nn.Identity, nn.Hardtanh, nn.LeakyReLU, nn.RReLU, nn.ELU, nn.CELU, nn.GELU, nn.Softplus,
                  nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Dropout, nn.AlphaDropout, nn.FeatureAlphaDropout,
                  nn.GroupNorm, nn.LayerNorm, nn.BatchNorm1d, nn.InstanceNorm1d, nn.Threshold, nn.Hardshrink,
                  nn.Softshrink, nn.LogSigmoid, nn.Softsign, nn.Tanhshrink, nn.PReLU, nn.AvgPool1d,
                  *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))


# The hooks that calling a module runs, of its own (the state-dict hooks are not called with it).
CALL_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def has_call_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def hooks_of(module: nn.Module, own_only: bool = False) -> str:
    """The hooks that calling `module` runs (its own, or every module's: not with `own_only`), named; '' if
    none."""
    from torch.nn.modules import module as module_globals

    kinds = [("forward pre-hooks", module._forward_pre_hooks, module_globals._global_forward_pre_hooks),
             ("forward hooks", module._forward_hooks, module_globals._global_forward_hooks),
             ("backward pre-hooks", module._backward_pre_hooks, module_globals._global_backward_pre_hooks),
             ("backward hooks", module._backward_hooks, module_globals._global_backward_hooks)]
    return " and ".join(name for name, own, every in kinds if own or (every and not own_only))


def _known_module_type(module: nn.Module):
    """The torch.nn class that `module` computes as: its own, or a base it inherits forward from unchanged
    (MultiheadAttention's out_proj is a NonDynamicallyQuantizableLinear, a Linear in all but name)."""
    for base in type(module).__mro__:
        if base in _KNOWN_MODULES:
            return base if type(module).forward is base.forward else None
    return None


def _module_call(module: nn.Module, path: str):
    """Return (function, extra args after the input, kwargs) equivalent to calling `module`."""
    T = lambda name: _module_tensor(path, module, name)  # noqa: E731  (a module tensor as an operand)
    kind = _known_module_type(module)
    if kind is nn.Linear:
        return F.linear, (T("weight"), T("bias")), {}
    if kind in (nn.ReLU, nn.SiLU, nn.Mish, nn.Hardswish, nn.Hardsigmoid, nn.SELU):
        fn = {nn.ReLU: F.relu, nn.SiLU: F.silu, nn.Mish: F.mish, nn.Hardswish: F.hardswish,
              nn.Hardsigmoid: F.hardsigmoid, nn.SELU: F.selu}[kind]
        return fn, (), {"inplace": module.inplace}
    if kind in (nn.Sigmoid, nn.Tanh, nn.Identity):
        return {nn.Sigmoid: torch.sigmoid, nn.Tanh: torch.tanh, nn.Identity: "identity"}[kind], (), {}
    if kind in (nn.Hardtanh, nn.ReLU6):  # ReLU6 runs Hardtanh's forward, with its own min_val and max_val
        return F.hardtanh, (module.min_val, module.max_val, module.inplace), {}
    if kind is nn.LeakyReLU:
        return F.leaky_relu, (module.negative_slope, module.inplace), {}
    if kind is nn.RReLU:
        return F.rrelu, (module.lower, module.upper, module.training, module.inplace), {}
    if kind is nn.Threshold:
        return F.threshold, (module.threshold, module.value, module.inplace), {}
    if kind in (nn.Hardshrink, nn.Softshrink):
        return {nn.Hardshrink: torch.hardshrink, nn.Softshrink: F.softshrink}[kind], (module.lambd,), {}
    if kind in (nn.LogSigmoid, nn.Softsign, nn.Tanhshrink):
        return {nn.LogSigmoid: F.logsigmoid, nn.Softsign: F.softsign, nn.Tanhshrink: F.tanhshrink}[kind], (), {}
    if kind is nn.PReLU:
        return F.prelu, (T("weight"),), {}
    if kind in (nn.ELU, nn.CELU):
        return {nn.ELU: F.elu, nn.CELU: F.celu}[kind], (module.alpha, module.inplace), {}
    if kind is nn.GELU:
        return F.gelu, (), {"approximate": module.approximate}
    if kind is nn.Softplus:
        return F.softplus, (module.beta, module.threshold), {}
    if kind in (nn.Softmax, nn.LogSoftmax, nn.Softmin):
        return {nn.Softmax: F.softmax, nn.LogSoftmax: F.log_softmax, nn.Softmin: F.softmin}[kind], (module.dim,), {}
    if kind in (nn.Dropout, nn.AlphaDropout, nn.FeatureAlphaDropout):
        fn = {nn.Dropout: F.dropout, nn.AlphaDropout: F.alpha_dropout, nn.FeatureAlphaDropout: F.feature_alpha_dropout}
        return fn[kind], (module.p, module.training), {}
    if kind is nn.AvgPool1d:
        return torch.avg_pool1d, (module.kernel_size, module.stride, module.padding, module.ceil_mode,
                                  module.count_include_pad), {}
    if kind is nn.GroupNorm:
        return F.group_norm, (module.num_groups, T("weight"), T("bias"), module.eps), {}
    if kind is nn.LayerNorm:
        return F.layer_norm, (module.normalized_shape, T("weight"), T("bias"), module.eps), {}
    if kind is getattr(nn, "RMSNorm", None):
        return F.rms_norm, (module.normalized_shape, T("weight"), module.eps), {}
    if kind is nn.BatchNorm1d:
        training = module.training
        return F.batch_norm, (T("running_mean"), T("running_var"), T("weight"), T("bias"), training,
                              0.0, module.eps), {}
    if kind is nn.InstanceNorm1d:
        return "instance_norm_module", (module,), {}
    return None


def _instance_norm_module(node, module) -> Canonical:
    if module.affine or module.track_running_stats:
        return Canonical("layer_norm", (node.args[0], None, None), {},
                         problem="InstanceNorm1d with affine or running stats is per channel, not per feature")
    # On (M, N) (unbatched) or (B, M, N) it normalizes each row over its N features.
    return Canonical("layer_norm", (node.args[0], None, None), {"eps": float(module.eps), "rank_needed": (2, 3)})


# ---------------------------------------------------------------- canonicalize a node, a graph

# torch's C++ argument parser (torch.* functions and Tensor methods, not Python functions such as F.softmax) also
# takes NumPy's names for these parameters: torch.sum(h, axis=1, keepdims=True).
_NUMPY_KEYWORDS = {"axis": "dim", "keepdims": "keepdim", "x": "input", "a": "input", "x1": "input", "x2": "other"}


def _from_numpy_keywords(kwargs: dict, sig: inspect.Signature) -> dict:
    """`kwargs` with NumPy's names replaced by the signature's own."""
    def name(key):
        torch_name = _NUMPY_KEYWORDS.get(key)
        renamed = torch_name in sig.parameters and key not in sig.parameters and torch_name not in kwargs
        return torch_name if renamed else key  # `dim=1, axis=1` together stays an error, as in eager
    return {name(key): value for key, value in kwargs.items()}


def augmented_assignment(operator_name: str, target, value):
    """What optimize()'s trace records for `target += value` (any augmented assignment; `operator_name` is the
    operator module's, "iadd"): the in-place operator applied, without rebinding the names of `target` in the
    graph's code (fx writes operator.iadd as `a += b`, which rebinds an int, where eager leaves every other name of
    it alone)."""
    return getattr(operator, operator_name)(target, value)


_NOT_TENSOR_METHODS = {"size", "dim", "numel", "item", "tolist", "stride", "element_size", "nelement"}
_NOT_TENSOR_ATTRIBUTES = {"shape", "ndim", "dtype", "device", "is_cuda", "requires_grad"}


def surely_not_tensor(obj) -> bool:
    """Whether a graph value is no tensor: a number, a recorded value that is none, or what tensors' size
    methods and attributes give and arithmetic of those (`n = x.shape[0]; n *= 2`)."""
    if not isinstance(obj, fx.Node):
        return not isinstance(obj, torch.Tensor)
    for key in ("val", "example_value"):
        if key in obj.meta:
            return not isinstance(obj.meta[key], torch.Tensor)
    if obj.op == "call_method":
        return obj.target in _NOT_TENSOR_METHODS
    if obj.op == "call_function" and obj.target is builtins.getattr:
        return obj.args[1] in _NOT_TENSOR_ATTRIBUTES
    if obj.op == "call_function" and obj.target is operator.getitem:
        return surely_not_tensor(obj.args[0]) and not isinstance(obj.args[0], (list, tuple))
    if obj.op == "call_function" and getattr(obj.target, "__module__", None) in ("_operator", "operator"):
        return all(surely_not_tensor(a) for a in obj.args)
    if obj.op == "call_function" and obj.target is augmented_assignment:
        return surely_not_tensor(obj.args[1]) and surely_not_tensor(obj.args[2])
    return False


# Tensor methods that give an int of their tensor alone, and int arithmetic that keeps ints ints (not `/`, nor `**`,
# whose negative exponent makes a float); augmented assignments by their operator's name
_INT_METHODS = ("numel", "nelement", "dim", "ndimension")
_INT_ARITHMETIC = (operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg,
                   operator.pos)
_INT_AUGMENTED = ("iadd", "isub", "imul", "ifloordiv", "imod")


def surely_an_int(obj) -> bool:
    """Whether a graph value is an int at every call where eager computes it: an int (not a bool), one dim's size of a
    tensor (`t.size(d)`, `t.shape[d]`), its element count or rank (`t.numel()`, `t.dim()`, `t.ndim`), or +, -, *, //
    and % of those (`x.numel() // k`). Not a forward argument, which may be anything, nor a whole shape."""
    if not isinstance(obj, fx.Node):
        return isinstance(obj, int) and not isinstance(obj, bool)
    if _size_read(obj) is not None:
        return True
    if obj.op == "call_method":
        return obj.target in _INT_METHODS and len(obj.args) == 1 and not obj.kwargs
    if obj.op != "call_function" or obj.kwargs:
        return False
    if obj.target is builtins.getattr:
        return obj.args[1:] == ("ndim",)
    if obj.target in _INT_ARITHMETIC:
        return all(surely_an_int(a) for a in obj.args)
    if obj.target is augmented_assignment:
        return obj.args[0] in _INT_AUGMENTED and surely_an_int(obj.args[1]) and surely_an_int(obj.args[2])
    return False


def canonical_of(node: fx.Node, gm: fx.GraphModule) -> Canonical | None:
    """The canonical op this node spells, or None if it is no op of the vocabulary."""
    c = _spelled_op(node, gm)
    if c is not None and c.problem is None and node.op == "call_module":
        module = gm.get_submodule(node.target)
        hooks = hooks_of(module)
        if hooks:  # a fused op would skip them
            return dataclasses.replace(c, problem=f"`{node.target}` has {hooks}, which a fused op would not run")
        if "forward" in vars(module):  # an instance's own forward (a wrapper's patch): the class's is not what runs
            return dataclasses.replace(c, problem=f"`{node.target}` has a forward of its own")
    return c


def _spelled_op(node: fx.Node, gm: fx.GraphModule) -> Canonical | None:
    args, kwargs = tuple(node.args), dict(node.kwargs)
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        call = _module_call(module, node.target)
        if call is None:
            return None
        fn, extra, extra_kwargs = call
        if fn == "instance_norm_module":
            return _instance_norm_module(node, module)
        if fn == "identity":
            return Canonical(IDENTITY, (args[0],), {"same_tensor": True})
        args, kwargs, target, table = args[:1] + tuple(extra), {**kwargs, **extra_kwargs}, fn, _FUNCTIONS
    elif node.op == "call_function":
        values = _values_of(node)
        if values is not None:
            return values
        whole = _whole_view(node)
        if whole is not None:
            return whole
        target, table = node.target, _FUNCTIONS
        if target is augmented_assignment:  # the operator it applies, to its operands; nothing for `n *= 2`
            if surely_not_tensor(args[1]):
                return None
            target, args = getattr(operator, args[0]), args[1:]
    elif node.op == "call_method":
        target, table = node.target, _METHODS
    else:
        return None
    try:
        entry = table.get(target)
    except TypeError:  # an unhashable target is no spelling of ours
        return None
    if entry is None:
        return None
    sig, handler = entry
    inplace = target in (_INPLACE_METHODS if node.op == "call_method" else _INPLACE_FUNCTIONS)
    if node.op == "call_method" or (node.op == "call_function" and isinstance(target, types.BuiltinFunctionType)):
        kwargs = _from_numpy_keywords(kwargs, sig)
    # `out=` of a torch function: eager's signatures take it, the spelling's do not (_into_out)
    out = kwargs.pop("out", None) if node.op == "call_function" and "out" not in sig.parameters else None
    try:
        if node.op != "call_module":
            eager_kwargs = kwargs if out is None else {**kwargs, "out": out}
            _check_eager_takes(target, node.op == "call_method", args, eager_kwargs)
        bound = sig.bind(*args, **kwargs)
    except TypeError as error:
        return Canonical("?", (), {}, problem=f"unexpected arguments: {error}")
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    inplace = inplace or bool(arguments.get("inplace", False))
    first = arguments.get("input")
    try:
        c = _differentiated_from_result(handler(arguments, inplace))
        c = dataclasses.replace(c, operands=tuple(_plain_scalar(o) for o in c.operands))
        return _with_size_expressions(node, c if out is None else _into_out(node, c, out))
    except NotFusible as reason:
        return Canonical("?", (first,) if isinstance(first, fx.Node) else (), {}, problem=str(reason))
    except (TypeError, ValueError) as error:  # a scalar argument is a traced value (Dynamo's dynamic floats)
        return Canonical("?", (first,) if isinstance(first, fx.Node) else (), {},
                         problem=f"an argument is computed in the graph, not a constant ({error})")


# In place, eager differentiates these ops from their result, which takes their attribute to be 0 or more: its
# backward raises for a negative one (or NaN), as eager's words it (by canonical op: the attribute, eager's name).
_BACKWARD_FROM_RESULT = {"leaky_relu": ("negative_slope", "leakyReLu"), "elu": ("alpha", "elu")}


def _differentiated_from_result(c: Canonical) -> Canonical:
    """An in-place leaky_relu or elu (celu, rrelu outside training) with a negative slope or alpha: eager's backward
    raises for it, where a fused op's would compute gradients. It is marked `backward_refused`, with the reason, which
    the matcher gives where the graph may be differentiated (no_grad graphs of the backend fuse it)."""
    if c.inplace_of is None or c.op not in _BACKWARD_FROM_RESULT:
        return c
    name, eager_name = _BACKWARD_FROM_RESULT[c.op]
    value = c.attrs[name]
    if value >= 0.0:
        return c
    reason = (f"in-place {c.op} with {name}={value!r}: eager's backward raises for it (\"In-place {eager_name} "
              "backward calculation is triggered with a negative slope\"), a fused op's would compute gradients; not "
              "fused in a graph that may be differentiated")
    return dataclasses.replace(c, attrs={**c.attrs, "backward_refused": reason})


def _into_out(node: fx.Node, c: Canonical, out) -> Canonical:
    """`torch.add(h, b, out=h)`: a pointwise op that writes into its first operand is its in-place form: it returns that
    tensor, changed, and raises as the in-place op does where the result would not fit it; but eager raises for it
    where autograd would record it too (`writes_out`: the rewritten graph checks). Into another tensor it is not
    fusible: the fused op makes a tensor of its own."""
    if not isinstance(out, fx.Node):
        raise NotFusible(f"out={out!r} is not a tensor of the graph")
    if c.problem is not None:
        return c
    spec = EPILOGUE_OPS.get(c.op)
    if spec is None or spec.kind != POINTWISE:
        raise NotFusible(f"{c.op} writes into `{out.name}` (out=), not into a tensor of its own")
    if not c.operands or c.operands[0] is not out:
        raise NotFusible(f"{c.op} writes into `{out.name}` (out=), which is not its first operand")
    return dataclasses.replace(c, inplace_of=out, attrs={**c.attrs, "writes_out": True})


_RANK_CHANGES = {"unsqueeze": _signature("(input, dim)"), "flatten": _signature("(input, start_dim=0, end_dim=-1)"),
                 "squeeze": _signature("(input, dim=None)")}
# The offset rank_change gives a squeeze: ("squeeze", dims, more), the rank that squeezing `dims` (None: every dim) of
# its input leaves, which the input's sizes tell at each call (shape_after), and `more` dims more. Where the squeezed
# value is a forward argument reshaped first (`x.unsqueeze(1).squeeze(0)`), rewrite's offsets add those steps:
# ("squeeze", dims, more, steps), each step ("squeeze", dims) or ("unsqueeze", dim), applied to the argument's shape.
SQUEEZED = "squeeze"
UNSQUEEZED = "unsqueeze"


# Ops that reorder their input's dims and keep its rank (or raise): methods, and torch functions
_DIM_ORDERS = ("transpose", "swapaxes", "swapdims", "permute", "t")
_DIM_ORDER_FUNCTIONS = (torch.transpose, torch.swapaxes, torch.swapdims, torch.permute, torch.t)


def rank_change(node: fx.Node) -> tuple[fx.Node, int | tuple | None, int] | None:
    """(input, offset, least) where `node` reshapes its input to a rank that follows from the input's alone: the
    result has max(rank + offset, least) dims (offset None: `least` whatever the rank), where eager computes it.
    `t.unsqueeze(d)`: one more; `t.flatten(s, e)` with dims of one sign: e - s fewer, else (s >= 0, e < 0) s - e of
    any rank; 0-d flattens to 1-D. `t.squeeze(d)`, whose rank depends on the input's sizes: (SQUEEZED, dims, 0), which
    shape_after evaluates on them. `t.transpose(a, b)`, `t.permute(...)`, `t.t()`: the same rank. `t[i]` of basic
    indices (_index_change). None for any other node."""
    if (node.op == "call_method" and node.target in _DIM_ORDERS) or \
            (node.op == "call_function" and node.target in _DIM_ORDER_FUNCTIONS):
        return (node.args[0], 0, 0) if node.args and isinstance(node.args[0], fx.Node) else None
    if node.op == "call_function" and node.target is operator.getitem:
        return _index_change(node)
    if (node.op == "call_method" and node.target in _RESHAPES) or \
            (node.op == "call_function" and node.target is torch.reshape):
        return _reshape_change(node)
    if node.op == "call_method" and node.target in _RANK_CHANGES:
        name = node.target
    elif node.op == "call_function" and node.target in (torch.unsqueeze, torch.flatten, torch.squeeze):
        name = node.target.__name__
    else:
        return None
    args, signature = node.args, _RANK_CHANGES[name]
    if node.op == "call_method" and name == "squeeze" and len(args) > 2:  # (the method takes dims as varargs too)
        args = (args[0], tuple(args[1:]))
    try:
        bound = signature.bind(*args, **_from_numpy_keywords(node.kwargs, signature))
    except TypeError:
        return None
    if name == "squeeze":
        return _squeeze_change(bound.arguments)
    bound.apply_defaults()
    values = dict(bound.arguments)
    source = values.pop("input")
    if not isinstance(source, fx.Node) or \
            not all(isinstance(dim, int) and not isinstance(dim, bool) for dim in values.values()):
        return None
    if name == "unsqueeze":
        return source, 1, 1
    start, end = values["start_dim"], values["end_dim"]
    if (start >= 0) == (end >= 0):
        return (source, start - end, 1) if start <= end else None  # (eager raises for start > end)
    return (source, None, start - end) if start >= 0 else None


# Tensor methods that take a shape as varargs or as one tuple or list, and the keyword of that one; torch.reshape's
_RESHAPES = {"view": "size", "reshape": "shape"}
_RESHAPE_SIGNATURE = _signature("(input, shape)")


def _reshape_change(node: fx.Node) -> tuple | None:
    """rank_change's (input, offset, least) of `t.view(*shape)`, `t.view(shape)`, `t.reshape(...)` alike, and
    `torch.reshape(t, shape)`, of a shape given as varargs or as a tuple or list of ints or nodes: as many dims as the
    shape has, whatever t's (eager raises where a node is no int); `t.view(n)` of one node that is surely an int
    (`t.view(t.numel())`): one. Not `t.view(torch.float16)` (a view as a dtype, of t's rank), nor a shape that is one
    other node (`t.view(s)`: an int, one dim, or a torch.Size of any length)."""
    if node.op == "call_function":
        try:
            bound = _RESHAPE_SIGNATURE.bind(*node.args, **node.kwargs)
        except TypeError:
            return None
        source, shape = bound.arguments["input"], bound.arguments["shape"]
    else:
        keyword = _RESHAPES[node.target]
        source, sizes = node.args[0] if node.args else None, tuple(node.args[1:])
        if set(node.kwargs) - {keyword} or (keyword in node.kwargs and sizes):
            return None
        if keyword in node.kwargs:
            shape = node.kwargs[keyword]
        elif len(sizes) == 1 and not isinstance(sizes[0], int) and not surely_an_int(sizes[0]):
            shape = sizes[0]  # (a tuple or list; a dtype, or a node of any length, is left out below)
        else:
            shape = sizes
    if not isinstance(source, fx.Node) or not isinstance(shape, (tuple, list)) or \
            not all(isinstance(size, fx.Node) or (isinstance(size, int) and not isinstance(size, bool))
                    for size in shape):
        return None
    return source, None, len(shape)


# torch functions that join tensors (a tuple or list of them, their first argument) along a dim: the dims they add
_JOINS = {torch.cat: 0, torch.concat: 0, torch.concatenate: 0, torch.stack: 1}


def joined_tensors(node: fx.Node) -> tuple[tuple[fx.Node, ...], int] | None:
    """(tensors, more) where `node` joins `tensors`, a tuple or list of nodes, into a tensor of their rank, `more` dims
    more: torch.cat, concat and concatenate (whose tensors are of one rank, or 1-D and empty, which they skip: the
    result has the most dims of them, where eager computes), torch.stack (one more; of tensors of one shape). Not into
    a tensor of the graph (`out=`), nor a list that is a node (a forward argument, of any length). None for any
    other node."""
    if node.op != "call_function" or node.target not in _JOINS or "out" in node.kwargs:
        return None
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    if not isinstance(tensors, (tuple, list)) or not tensors or not all(isinstance(t, fx.Node) for t in tensors):
        return None
    return tuple(tensors), _JOINS[node.target]


def joined_argument(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(argument, more) where `node` joins the items of forward argument `argument` (`torch.cat(xs, 1)` of a list or
    tuple xs, of any length) as joined_tensors' joins do: a tensor of the most dims of its items, `more` dims more,
    where eager computes. Not into a tensor of the graph (`out=`). None for any other node."""
    if node.op != "call_function" or node.target not in _JOINS or "out" in node.kwargs:
        return None
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    if not isinstance(tensors, fx.Node) or tensors.op != "placeholder":
        return None
    return tensors, _JOINS[node.target]


def _index_change(node: fx.Node) -> tuple | None:
    """rank_change's (input, offset, least) of `t[index]` with basic indices only: one dim more per None, one fewer per
    int, slices and Ellipsis keep theirs. A bare int or slice of a forward argument is left out: the argument may be a
    list or tuple, whose item is no dim fewer (a tensor takes a tuple, None and Ellipsis, which a list does not)."""
    source, index = node.args if len(node.args) == 2 else (None, None)
    if not isinstance(source, fx.Node):
        return None
    items = index if isinstance(index, tuple) else (index,)
    if source.op == "placeholder" and not isinstance(index, tuple) and index is not None and index is not Ellipsis:
        return None
    offset = 0
    for item in items:
        if item is None:
            offset += 1
        elif isinstance(item, int) and not isinstance(item, bool):
            offset -= 1
        elif item is not Ellipsis and not isinstance(item, slice):  # (a tensor, a list, a bool: advanced indexing)
            return None
    return source, offset, 0


def _squeeze_change(arguments: dict) -> tuple | None:
    """rank_change's (input, offset, least) of a squeeze of these bound arguments: `dim` left out (every dim), an int,
    or a tuple or list of them (not a dim name, or dim=None, for which eager raises)."""
    source, dims = arguments["input"], arguments.get("dim")
    if "dim" in arguments and (dims is None or isinstance(dims, int)):
        dims = (dims,)  # (None among the dims: refused below)
    if not isinstance(source, fx.Node) or not (dims is None or isinstance(dims, (tuple, list)) and
                                               all(isinstance(d, int) and not isinstance(d, bool) for d in dims)):
        return None
    return source, (SQUEEZED, None if dims is None else tuple(dims), 0), 0


def shape_step(node: fx.Node) -> tuple[fx.Node, tuple] | None:
    """(input, step) where `node` squeezes its input (step ("squeeze", dims), dims None for every dim) or unsqueezes
    it (("unsqueeze", dim)), steps that shape_after replays on a shape; None for any other node."""
    change = rank_change(node)
    if change is None:
        return None
    source, offset, _ = change
    if isinstance(offset, tuple):
        return source, (SQUEEZED, offset[1])
    if node.target not in (UNSQUEEZED, torch.unsqueeze):  # (flatten, transpose, indexing: no step of shape_after's)
        return None
    signature = _RANK_CHANGES[UNSQUEEZED]
    dim = signature.bind(*node.args, **_from_numpy_keywords(node.kwargs, signature)).arguments["dim"]
    return (source, (UNSQUEEZED, dim)) if isinstance(dim, int) and not isinstance(dim, bool) else None


def shape_after(shape, steps) -> tuple | None:
    """The shape that shape_step's `steps` make of a tensor of `shape`, as eager's squeeze and unsqueeze make it;
    None where eager raises (a dim out of range, or given twice)."""
    shape = tuple(shape)
    for name, dims in steps:
        rank = len(shape)
        if name == UNSQUEEZED:
            if not -rank - 1 <= dims <= rank:
                return None
            at = dims + rank + 1 if dims < 0 else dims
            shape = shape[:at] + (1,) + shape[at:]
            continue
        if dims is None:
            shape = tuple(size for size in shape if size != 1)
            continue
        bound = max(rank, 1)  # (a 0-d tensor takes dim 0 or -1)
        wrapped = [dim + bound if dim < 0 else dim for dim in dims]
        if any(not 0 <= dim < bound for dim in wrapped) or len(set(wrapped)) != len(wrapped):
            return None
        shape = tuple(size for i, size in enumerate(shape) if not (i in wrapped and size == 1))
    return shape


def _whole_view(node: fx.Node) -> Canonical | None:
    """`t[:, :]`, `t[:]`, `t[...]`: a view of all of `t`, whose shape and elements are `t`'s (`same_tensor`); eager
    raises where `t` has fewer dims than the index's slices (`rank_at_least`)."""
    if node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
        return None
    key = node.args[1]
    items = key if isinstance(key, tuple) else (key,)
    whole = all(item is Ellipsis or (isinstance(item, slice) and item == slice(None)) for item in items)
    if not whole or sum(item is Ellipsis for item in items) > 1:
        return None
    return Canonical(IDENTITY, (node.args[0],), {"same_tensor": True,
                                                 "rank_at_least": sum(item is not Ellipsis for item in items)})


def _check_eager_takes(target, is_method: bool, args: tuple, kwargs: dict) -> None:
    """Raises TypeError where eager's own signatures of the call take none of these arguments: a spelling's
    signature serves a function and its method alike, but `h.exp(True)`, `torch.relu(h, True)` or `h.add(b, 1)` are
    errors in eager (a method's arguments are its function's after `self`). Targets without known signatures pass."""
    function = target
    if is_method:
        function = getattr(torch, target, None) or getattr(torch, target.removesuffix("_"), None)
    signatures = signatures_of(function) if callable(function) else ()
    errors = []
    for signature in signatures:
        try:
            signature.bind(*args, **kwargs)
            return
        except TypeError as error:
            errors.append(error)
    if errors:
        raise TypeError(f"eager takes no such call ({errors[0]})")


# A node's (args, kwargs) before `_redirect_inplace_uses` first changed them (`restore_readers_outside_regions`).
_ARGUMENTS_BEFORE_REDIRECT = "fxfuse_arguments_before_redirect"


def _redirect_inplace_uses(graph: fx.Graph, canon: dict[fx.Node, Canonical]) -> None:
    """After `t.relu_()`, later readers of `t` read the in-place node instead: same tensor, explicit edge; so do later
    readers of its other names, earlier in-place ops on it and whole views of it (`same_tensor`: `t[:, :]`, eval-mode
    dropout, nn.Identity), whose shape and elements are `t`'s. In graph order, so that each in-place op on a tensor
    takes its readers over from the one before it (`t.mul_(2)` then `t.relu_()`: what reads `t` after both reads the
    relu_). Each reader keeps its first arguments, for `restore_readers_outside_regions`."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    first_name: dict[fx.Node, fx.Node] = {}  # a later name of a tensor -> the node that first named it
    names: dict[fx.Node, list] = {}          # that first node -> its later names so far
    for node in graph.nodes:
        c = canon.get(node)
        if c is None:
            continue
        if c.op == IDENTITY and c.attrs.get("same_tensor") and isinstance(c.operands[0], fx.Node):
            target = c.operands[0]
        elif isinstance(c.inplace_of, fx.Node):
            target = c.inplace_of
            tensor = first_name.get(target, target)
            for name in (tensor, *names.get(tensor, ())):
                for user in list(name.users):
                    if user is not node and position[user] > position[node]:
                        user.meta.setdefault(_ARGUMENTS_BEFORE_REDIRECT, (user.args, user.kwargs))
                        user.replace_input_with(name, node)
        else:
            continue
        tensor = first_name.get(target, target)
        first_name[node] = tensor
        names.setdefault(tensor, []).append(node)


def restore_readers_outside_regions(graph: fx.Graph, before_rewrite: set, replaced: dict | None = None) -> None:
    """After the rewrite, a reader that `_redirect_inplace_uses` redirected and no region took in reads again each name
    it read in eager, where the in-place node (of `before_rewrite`'s nodes) is still in the graph and so is that name,
    or the fused op that replaced it as a region's output (`replaced`): the same elements, but the object eager has
    (`v = x[:, :]; v.mul_(2); return x` returns `x`, not the view that mul_ returns, which autograd refuses to read
    with grad on where it was made under no_grad). A name that a region took in otherwise stays read through the
    in-place node or the fused op."""
    present = set(graph.nodes)
    unfused = before_rewrite & present
    replaced = replaced or {}
    for user in graph.nodes:
        before = user.meta.pop(_ARGUMENTS_BEFORE_REDIRECT, None)
        if before is None:
            continue
        now = []  # the nodes it reads now, in the order of `before`'s (a redirect swaps nodes, not the structure)
        fx.node.map_arg((user.args, user.kwargs), now.append)
        now = iter(now)

        def eager_name(read: fx.Node) -> fx.Node:
            """What `user` reads in place of `read`: `read`, or the fused op that replaced it, where both it and the
            in-place node are still in the graph; else what it reads now."""
            current, name = next(now), replaced.get(read, read)
            return name if current in unfused and name in present else current

        user.args, user.kwargs = fx.node.map_arg(before, eager_name)


def _refuse_inplace_on_aliases(graph: fx.Graph, canon: dict[fx.Node, Canonical]) -> None:
    """An identity op (`h.contiguous()`, eval-mode dropout, nn.Identity) returns the same tensor, and detach a tensor
    of the same memory, so an in-place op on one of them changes the others too, which the program's values (one per
    op) cannot express: an in-place op whose tensor has such an alias read after it is refused. (Later reads of the
    mutated tensor itself are redirected to the in-place op: `_redirect_inplace_uses`.)"""
    position = {node: i for i, node in enumerate(graph.nodes)}
    aliases: dict[fx.Node, set] = {}
    for node, c in canon.items():
        source = c.operands[0] if c.op in (IDENTITY, "detach") and c.operands else None
        if isinstance(source, fx.Node):
            aliases.setdefault(node, set()).add(source)
            aliases.setdefault(source, set()).add(node)
    for node, c in list(canon.items()):
        target = c.inplace_of
        if not isinstance(target, fx.Node) or target not in aliases:
            continue
        component, stack = {target}, [target]
        while stack:
            for other in aliases.get(stack.pop(), ()):
                if other not in component:
                    component.add(other)
                    stack.append(other)
        for alias in component - {target}:
            later = [user for user in alias.users if user is not node and position[user] > position[node]]
            if later:
                problem = (f"in-place `{node.name}` changes `{target.name}`, which `{alias.name}` aliases and "
                           f"`{later[0].name}` reads after it")
                canon[node] = dataclasses.replace(c, problem=problem)
                break


# Tensor methods and torch functions that return a view of their first argument (of part of it, or another shape).
_VIEW_OPS = frozenset(("view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "t", "transpose",
                       "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "squeeze", "unsqueeze", "narrow",
                       "select", "expand", "expand_as", "as_strided", "diagonal", "unfold",
                       "__getitem__", "getitem", "T", "mT", "H", "mH", "real", "imag"))


def _is_view(node: fx.Node) -> bool:
    """Whether `node` may be a view of its first argument: a view op, an index (`h[:, :4]`) or a view attribute."""
    if node.op == "call_method":
        return node.target in _VIEW_OPS
    if node.op != "call_function":
        return False
    if node.target is builtins.getattr:
        return node.args[1] in _VIEW_OPS
    return getattr(node.target, "__name__", None) in _VIEW_OPS and \
        getattr(node.target, "__module__", None) in ("torch", "_operator", "operator", None)


def _refuse_inplace_on_other_views(graph: fx.Graph, canon: dict[fx.Node, Canonical]) -> None:
    """An in-place op on a view of part of a tensor, or of another shape (`h[:, :4].mul_(2)`, `h.view(-1).add_(1)`),
    changes that tensor, which a program's values (each one tensor of its own) cannot express: the view says why."""
    for node, c in list(canon.items()):
        view = c.inplace_of
        if not isinstance(view, fx.Node) or view in canon or not _is_view(view):
            continue
        source = next(iter(view.all_input_nodes), None)
        if source is not None:
            canon[view] = Canonical("?", (source,), problem=(
                f"in-place `{node.name}` changes `{view.name}`, a view of `{source.name}` of part of it or of "
                "another shape, which a fused program cannot express"))


def _pools_of_unsqueezed_values(canon: dict) -> None:
    """`h.unsqueeze(1)`, a feature pool of it, `.squeeze(1)`: one FEATURE_POOL of h (its record on the squeeze,
    covering the other two), which holds for a 2-D h only (a 3-D one makes avg_pool1d raise)."""
    for pool, c in list(canon.items()):
        if c.op != FEATURE_POOL or not isinstance(c.operands[0], fx.Node) or len(pool.users) != 1:
            continue
        squeeze_node = next(iter(pool.users))
        unsqueezed, squeezed = shape_step(c.operands[0]), shape_step(squeeze_node)
        if unsqueezed is None or unsqueezed[1] not in ((UNSQUEEZED, 1), (UNSQUEEZED, -2)) or \
                len(c.operands[0].users) != 1 or squeezed is None or squeezed[1][1] not in ((1,), (-2,)):
            continue
        del canon[pool]
        canon[squeeze_node] = Canonical(FEATURE_POOL, (unsqueezed[0],), {**c.attrs, "unsqueezed": True},
                                        covers=(c.operands[0], pool), problem=c.problem)


def canonicalize(gm: fx.GraphModule) -> dict[fx.Node, Canonical]:
    """Canonical records for every node of `gm` that spells a GEMM or an epilogue op; idioms included."""
    from .idioms import apply_idioms

    def records():
        return {n: c for n in gm.graph.nodes if (c := canonical_of(n, gm)) is not None}

    canon = records()
    if any(c.inplace_of is not None for c in canon.values()):
        _redirect_inplace_uses(gm.graph, canon)
        canon = records()  # operands now name the redirected inputs
    _refuse_inplace_on_aliases(gm.graph, canon)
    _refuse_inplace_on_other_views(gm.graph, canon)
    _pools_of_unsqueezed_values(canon)
    apply_idioms(gm, canon)
    for node, c in list(canon.items()):
        for covered in c.covers:
            canon[covered] = Canonical(COVERED, (node,))
    return canon
