"""The built-in idiom library: multi-node spellings of one canonical epilogue op.

Entry point: importing ``fxfuse.patterns`` registers these idioms. Declare your own the same way, in your
own code, with ``fxfuse.idiom``; see ``fxfuse.idioms`` for the rules (positional parameters are tensors,
keyword-only parameters are captured numbers).
"""
import torch
import torch.nn.functional as F

from fxfuse.idioms import idiom


@idiom("silu")
def silu_from_sigmoid(x):
    return x * torch.sigmoid(x)


@idiom("mish")
def mish_from_softplus(x):
    return x * torch.tanh(F.softplus(x))


# In fp16, x * relu6(x + 3) overflows past 65504 where hardswish does not, and x.pow(2) past 256: these two are
# the op in the dtypes of fp32's range or more only.
@idiom("hardswish", dtypes=(torch.float32, torch.bfloat16, torch.float64))
def hardswish_from_relu6(x):
    return x * F.relu6(x + 3.0) / 6.0


@idiom("gelu", approximate="tanh")
def gelu_tanh_spelled_out(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


@idiom("gelu", approximate="none")
def gelu_erf_spelled_out(x):  # BERT's and GPT-2's own code
    return x * 0.5 * (1.0 + torch.erf(x / 1.4142135623730951))


@idiom("gelu", approximate="none")
def gelu_erf_by_its_reciprocal(x):
    return x * 0.5 * (1.0 + torch.erf(x * 0.7071067811865476))


@idiom("elu", scale=1.0, input_scale=1.0)
def elu_from_where(x, *, alpha):
    return torch.where(x > 0, x, alpha * (torch.exp(x) - 1.0))


@idiom("leaky_relu")
def leaky_relu_from_where(x, *, negative_slope):
    return torch.where(x > 0, x, negative_slope * x)


@idiom("rms_norm", dtypes=(torch.float32, torch.bfloat16, torch.float64), weight=None)
def rms_norm_by_rsqrt(x, *, eps):  # RMSNorm's formula as LLaMA and T5 write it (without their dtype casts)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@idiom("rms_norm", dtypes=(torch.float32, torch.bfloat16, torch.float64), weight=None)
def rms_norm_by_sqrt(x, *, eps):  # the same, divided by the root: a rounding apart
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
