"""A randomized differential tester of fxfuse's torch.compile backend on the CPU.

Each seed builds one small random model: a Linear (``nn.Linear``, ``F.linear`` with parameters, or ``x @ W.t()``)
followed by a chain of 1-5 epilogue ops of fxfuse's vocabulary (activations with random scalars, arithmetic with
numbers, parameters, buffers and a second forward argument that broadcasts, norms, eval/train BatchNorm, row
reductions and softmax, now and then a second Linear, an op over other dims than the features, a cast or a mask, or
an average pool over the features: optimize_hunt's ``draw_pool``, right after the GEMM or its bias adds, where fxfuse
folds it, or later in the chain, where it does not) in random spellings (module, ``F.*``, ``torch.*``, method,
in-place method, operator, view, ``out=``, keywords or positional). Each model also gets random scenario features: a
graph break in the middle, ``torch.no_grad()`` around part of the chain, a Python float passed as a forward argument,
``dynamic=True/None`` with several batch sizes (0 and 1 too) and sequence lengths, an ``autograd.Function`` in the
chain, an intermediate returned beside the output, the inner compiler (eager, aot_eager, rarely Inductor), train /
eval / inference mode or grad mode changing between calls, float32 / bfloat16, ``torch.autocast("cpu",
torch.bfloat16)``, frozen parameters, a transposed input, and between calls a module float changed, an optimizer-like
step, a parameter frozen or train() <-> eval().

The model is compiled with ``fxfuse.make_backend(inner=...)`` and compared with eager: the outputs of each call and,
with grad on, the gradients of the inputs and parameters, then the buffers and the arguments (which the forward
may change in place). A mismatch or a raise is then triaged automatically:

- ``dynamo``: the same check fails without fxfuse (``torch.compile(backend=inner)``): not fxfuse's bug;
- ``precision``: a low-precision mismatch where fxfuse's result is about as close to a float64 eager run as eager's,
  a low-precision gradient through an op whose gradient jumps (a clamp bound), a gradient that cancels to about
  0, off by rounding noise of the call's largest gradient, or an ill-conditioned result: eager's own moves as far
  where its arguments and parameters change by an ulp (optimize_hunt's test: a gradient that is 0 but for rounding,
  through a norm over groups of one feature);
- ``known``: a documented difference (docs/BACKEND.md: eager's backward raises for an in-place op on a value it
  saved; a fused region saved no such value; or the forward changes a buffer that a fused op keeps for its backward
  in place after a graph break, and the compiled backward raises, as for a caller's change);
- ``fxfuse``: everything else: a bug to look at (``--show SEED`` prints the model's source and settings).

Bugs of PyTorch 2.13 itself that the hunter met: under aot_eager, ``torch.add(h, s, alpha=c)`` with a Python float
``s`` that Dynamo traces returns ``h + s`` (the models no longer spell it so); under aot_eager, a forward that reads a
buffer and then changes it in place gets gradients computed with the changed buffer.

Run it from the repository root:

    PYTHONPATH=. python dev/compile_hunt.py --seeds 0:150
    PYTHONPATH=. python dev/compile_hunt.py --show 17          # the source and settings of seed 17
    PYTHONPATH=. python dev/compile_hunt.py --seeds 17 -v      # one seed, with its source and traceback
    PYTHONPATH=. python dev/compile_hunt.py --seeds 0:20 --inner inductor   # every model through Inductor
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import random
import re
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from fxfuse.testing import DEFAULT_TOLERANCE, assert_close_report
from optimize_hunt import PERTURBATIONS, _perturbed_copy, draw_pool  # (dev/, the script's directory, is on sys.path)

# Tolerances per dtype for a compiled result against eager's (float32: a little above fxfuse's default, as
# Inductor's and the reference's roundings differ from eager's by a few ulps through a chain of ops).
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: DEFAULT_TOLERANCE[torch.bfloat16]}


class Twice(torch.autograd.Function):
    """An autograd.Function a forward applies in its chain: twice its input, twice the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class Sine(torch.autograd.Function):
    """An autograd.Function that saves its input for the backward: sin, with cos in the backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sin(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.cos(x)


# ------------------------------------------------------------------------------------------------ model generator

@dataclass
class Case:
    """One generated model and how to run it."""
    seed: int
    source: str                     # the model's class, `Model`
    in_features: int
    out_features: int
    middle: tuple                   # () for a 2-D input (B, K); (T,) for a 3-D one (B, T, K)
    second_input: tuple | None      # the shape of `y` ("B" for the batch size), or None
    float_argument: bool            # forward takes a Python float `s`
    dtype: torch.dtype
    mode: str                       # "train" (grad on), "eval" (no_grad), "eval-grad" (grad on), "inference"
                                    # (inference_mode), "mixed" (calls alternate between no_grad and grad)
    inner: str
    dynamic: bool | None
    batch_sizes: list
    autocast: bool
    mutate: str | None              # a module float to change between calls: "module_name.attribute"
    frozen: tuple = ()              # names of parameters that do not require grad
    input_grad: bool = True         # whether the tensor arguments require grad (with grad on)
    transposed_input: bool = False  # x is a transposed (non-contiguous) tensor
    between: tuple = ()             # changes made to both models before the second call (see `change_between`)
    middle_sizes: tuple = ()        # a 3-D input's T at each call after the first (dynamic shapes), else T
    features: list = field(default_factory=list)  # the scenario features, for the summary

    def describe(self) -> str:
        """The settings in one line."""
        return (f"seed {self.seed}: dtype={str(self.dtype)[6:]} mode={self.mode} inner={self.inner} "
                f"dynamic={self.dynamic} batches={self.batch_sizes} autocast={self.autocast} "
                f"x=(B,{','.join(map(str, self.middle)) + ',' if self.middle else ''}{self.in_features}) "
                f"y={self.second_input} s={self.float_argument} mutate={self.mutate} frozen={self.frozen} "
                f"input_grad={self.input_grad} transposed={self.transposed_input} between={self.between} "
                f"T_later={self.middle_sizes} features={self.features}")


class Generator:
    """Writes the source of a random Linear + epilogue model, one op at a time, tracking the shape of `h`.

    `state` is "full" (features last), "keep" (a keepdim reduction left one feature) or "reduced" (the
    features were reduced away).
    """

    def __init__(self, rng: random.Random, n: int, rank: int, second_input, float_argument: bool,
                 pool_rng: random.Random):
        self.rng = rng
        self.pool_rng = pool_rng  # draws the pools over the features apart, so a model without one is as it was
        self.n = n
        self.rank = rank
        self.second_input = second_input
        self.float_argument = float_argument
        self.init_lines: list[str] = []
        self.forward_lines: list[str] = []
        self.indent = 2
        self.state = "full"
        self.saved_full: list[str] = []   # names of earlier full-shape values, for residual uses
        self.names = 0
        self.module_floats: list[str] = []  # "module.attribute" floats of generated modules
        self.final_lines: list[str] = []  # statements before the return (a buffer's in-place update)
        self.ops = 0
        self.pools: list[str] = []  # the pools drawn, for the summary

    # -- helpers
    def new_name(self, prefix: str) -> str:
        self.names += 1
        return f"{prefix}{self.names}"

    def emit(self, line: str) -> None:
        self.forward_lines.append("    " * self.indent + line)

    def number(self, low=-2.0, high=2.0, positive=False) -> str:
        value = self.rng.uniform(0.1 if positive else low, high)
        return repr(round(value, 3)) if self.rng.random() < 0.8 else repr(float(self.rng.choice([1, 2, 0.5])))

    def param(self, shape: tuple, positive=False) -> str:
        name = self.new_name("p")
        values = f"torch.rand({shape}) + 0.5" if positive else f"torch.randn({shape})"
        self.init_lines.append(f"self.{name} = nn.Parameter({values})")
        return f"self.{name}"

    def module(self, text: str, floats=()) -> str:
        name = self.new_name("m")
        self.init_lines.append(f"self.{name} = {text}")
        self.module_floats += [f"{name}.{attribute}" for attribute in floats]
        return f"self.{name}"

    def last_dim(self) -> str:
        return self.rng.choice(["-1", str(self.rank - 1)]) if self.state == "full" else "-1"

    def assign(self, expression: str) -> None:
        self.emit(f"h = {expression}")

    def spell(self, choices) -> None:
        """Emit one of `choices`: an expression of h, "M:<module construction>" (applied to h) or "I:<statement>"
        (an in-place statement)."""
        choice = self.rng.choice(choices)
        if choice.startswith("M:"):
            text, _, floats = choice[2:].partition("|")
            self.assign(f"{self.module(text, floats.split(',') if floats else ())}(h)")
        elif choice.startswith("I:"):
            self.emit(choice[2:])
        else:
            self.assign(choice)
        self.ops += 1

    # -- ops
    def unary(self) -> None:
        r, num = self.rng, self.number
        low, high = sorted([round(r.uniform(-2, 0.5), 2), round(r.uniform(-0.5, 2), 2)])
        high = max(high, round(low + 0.05, 2))  # nn.Hardtanh wants max_val > min_val
        slope, alpha, beta = round(r.uniform(0.01, 0.5), 3), round(r.uniform(0.2, 2), 2), round(r.uniform(0.5, 3), 2)
        approximate = r.choice(["none", "tanh"])
        table = {
            "relu": ["torch.relu(h)", "F.relu(h)", "h.relu()", "M:nn.ReLU()", "I:h.relu_()",
                     "F.relu(h, inplace=True)", "M:nn.ReLU(inplace=True)", "torch.clamp(h, min=0)"],
            "hardtanh": [f"F.hardtanh(h, {low}, {high})", f"F.hardtanh(h, min_val={low}, max_val={high})",
                         f"M:nn.Hardtanh({low}, {high})|min_val,max_val", "F.relu6(h)", "M:nn.ReLU6()",
                         f"F.hardtanh_(h, {low}, {high})"],
            "clamp": [f"torch.clamp(h, {low}, {high})", f"h.clamp(min={low})", f"h.clamp_max({high})",
                      f"I:h.clamp_({low}, {high})", f"torch.clip(h, {low}, {high})"],
            "leaky_relu": [f"F.leaky_relu(h, {slope})", f"F.leaky_relu(h, negative_slope={slope})",
                           f"M:nn.LeakyReLU({slope})|negative_slope", f"M:nn.LeakyReLU({slope}, inplace=True)",
                           f"F.leaky_relu_(h, {slope})"],
            "gelu": [f"F.gelu(h, approximate='{approximate}')", "F.gelu(h)", f"M:nn.GELU('{approximate}')"],
            "elu": [f"F.elu(h, {alpha})", f"M:nn.ELU(alpha={alpha})|alpha", "F.selu(h)", f"F.celu(h, {alpha})",
                    "M:nn.SELU()", f"M:nn.CELU({alpha})|alpha", f"M:nn.ELU({alpha}, inplace=True)|alpha"],
            "softplus": [f"F.softplus(h, beta={beta})", f"F.softplus(h, {beta}, {round(r.uniform(1, 20), 1)})",
                         f"M:nn.Softplus(beta={beta})|beta,threshold", "F.softplus(h)"],
            "silu": ["F.silu(h)", "M:nn.SiLU()", "h * torch.sigmoid(h)"],
            "mish": ["F.mish(h)", "M:nn.Mish()", "h * torch.tanh(F.softplus(h))"],
            "sigmoid": ["torch.sigmoid(h)", "h.sigmoid()", "M:nn.Sigmoid()", "I:h.sigmoid_()"],
            "tanh": ["torch.tanh(h)", "h.tanh()", "M:nn.Tanh()", "F.tanh(h)"],
            "hardswish": ["F.hardswish(h)", "M:nn.Hardswish()", "F.hardsigmoid(h)", "M:nn.Hardsigmoid()"],
            "misc": ["F.logsigmoid(h)", "F.softsign(h)", "F.tanhshrink(h)", "torch.erf(h)", "torch.sin(h)",
                     "h.cos()", "torch.atan(h)", "torch.asinh(h)", "h.abs()", "torch.erfc(h)", "-h", "h.neg()",
                     "torch.exp(h)", "h.expm1()", "torch.exp2(h)", "torch.sinh(h)", "torch.cosh(h)",
                     f"F.threshold(h, {low}, {high})", f"F.hardshrink(h, {abs(low)})", f"F.softshrink(h, {abs(low)})",
                     "h.square()", "h ** 2", "torch.pow(h, 3)"],
            "positive": ["torch.log(h.abs() + 0.5)", "torch.sqrt(h.abs() + 0.1)", "(h * h + 1).rsqrt()",
                         "torch.reciprocal(h.abs() + 1)", "torch.log1p(h.abs())", "torch.log2(h.exp())",
                         "torch.log10(h.abs() + 1)", "(h.abs() + 0.5) ** 0.5", "torch.logit(torch.sigmoid(h))",
                         f"torch.logit(torch.sigmoid(h), eps={r.choice([0.01, 0.25])})", "torch.tan(torch.tanh(h))"],
            "jumps": ["torch.sign(h)", "torch.floor(h * 4)", "h.ceil()", "torch.round(h * 2)", "h.trunc()",
                      "torch.frac(h * 3)"],
            "identity": ["h.clone()", "h.contiguous()", "M:nn.Identity()", "M:nn.Dropout(0.0)", "+h"],
        }
        weights = {"relu": 3, "hardtanh": 3, "clamp": 2, "leaky_relu": 3, "gelu": 2, "elu": 2, "softplus": 2,
                   "silu": 2, "mish": 2, "sigmoid": 2, "tanh": 2, "hardswish": 1, "misc": 6, "positive": 3,
                   "jumps": 0.5, "identity": 1}
        kind = r.choices(list(weights), weights=list(weights.values()))[0]
        self.spell(table[kind])

    def arithmetic(self) -> None:
        """A binary op with a number, a parameter, the second input or the float argument."""
        r, c = self.rng, self.number()
        operands = ["number"]
        if self.state == "other":
            self.spell([f"h * {c}", f"h + {c}", f"I:h.mul_({c})"])
            return
        if self.state == "full":
            operands += ["feature_param", "feature_param", "scalar_param"]
            if self.second_input is not None:
                operands += ["second_input", "second_input"]
        else:
            operands += ["scalar_param"]
        if self.float_argument:
            operands += ["float_argument"]
        operand = r.choice(operands)
        if operand == "number":
            choices = [f"h * {c}", f"{c} * h", f"h + {c}", f"{c} - h", f"h / {self.number(positive=True)}",
                       f"torch.mul(h, {c})", f"I:h.mul_({c})", f"h.div({self.number(positive=True)})",
                       f"torch.sub(h, {c}, alpha=2)", f"I:h.add_({c})", f"h.add({c})", f"torch.rsub(h, {c})",
                       f"I:h[..., :].mul_({c})", f"I:h += {c}", f"I:h *= {c}", f"I:torch.add(h, {c}, out=h)"]
        else:
            if operand == "feature_param":
                other = self.param((self.n,))
                positive = self.param((self.n,), positive=True)
            elif operand == "scalar_param":
                other = self.param(())
                positive = self.param((), positive=True)
            elif operand == "second_input":
                other, positive = "y", "(y.abs() + 0.5)"
            else:
                other, positive = "s", "(abs(s) + 0.5)"
            choices = [f"h + {other}", f"{other} * h", f"h.mul({other})", f"h - {other}", f"h / {positive}",
                       f"{other} + h", f"I:h.add_({other})", f"I:h.mul_({other})", f"torch.sub(h, {other})",
                       f"I:h -= {other}", f"I:torch.mul(h, {other}, out=h)"]
            if operand != "float_argument":  # (aot_eager drops alpha with a traced float: see the module docstring)
                choices += [f"torch.add(h, {other}, alpha={c})", f"I:h[:].add_({other}, alpha=0.5)",
                            f"torch.maximum(h, {other})", f"torch.minimum({other}, h)",
                            f"h.addcmul({other}, {other}, value=0.5)"]
        self.spell(choices)

    def norm(self) -> None:
        r, n = self.rng, self.n
        eps = r.choice([1e-5, 1e-3, 1e-6, 0.1])
        kind = r.choice(["group_norm", "layer_norm", "rms_norm", "softmax", "normalize"])
        if kind == "group_norm" and self.rank == 3:
            kind = "layer_norm"  # group_norm's channels are dim 1, not the features of a 3-D input
        if kind == "group_norm":
            groups = r.choice([g for g in range(1, n + 1) if n % g == 0 and g <= 8])
            affine = r.random() < 0.7
            if r.random() < 0.5:
                self.spell([f"M:nn.GroupNorm({groups}, {n}, eps={eps}, affine={affine})|eps"])
            else:
                weight, bias = (self.param((n,)), self.param((n,))) if affine else ("None", "None")
                self.spell([f"F.group_norm(h, {groups}, {weight}, {bias}, {eps})",
                            f"F.group_norm(h, num_groups={groups}, weight={weight}, bias={bias}, eps={eps})"])
        elif kind == "layer_norm":
            if r.random() < 0.5:
                self.spell([f"M:nn.LayerNorm({n}, eps={eps}, elementwise_affine={r.random() < 0.7})|eps",
                            f"M:nn.LayerNorm(({n},), bias={r.random() < 0.5})"])
            else:
                weight, bias = self.param((n,)), self.param((n,))
                self.spell([f"F.layer_norm(h, ({n},), {weight}, {bias}, {eps})", f"F.layer_norm(h, [{n}])",
                            f"F.layer_norm(h, h.shape[-1:], weight={weight}, eps={eps})"])
        elif kind == "rms_norm":
            weight = self.param((n,))
            self.spell([f"M:nn.RMSNorm({n}, eps={eps})|eps", f"M:nn.RMSNorm([{n}])",
                        f"F.rms_norm(h, ({n},), {weight}, eps={eps})",
                        f"h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + {eps}) * {weight}",
                        f"h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + {eps})"])
        elif kind == "softmax":
            d = self.last_dim()
            self.spell([f"F.softmax(h, dim={d})", f"h.softmax({d})", f"torch.softmax(h, {d})", f"M:nn.Softmax(dim={d})",
                        f"F.log_softmax(h, {d})", f"h.log_softmax(dim={d})", f"M:nn.LogSoftmax({d})",
                        f"torch.log_softmax(h, -1, dtype=torch.float32)"])
        else:
            self.spell(["F.normalize(h, dim=-1)", f"F.normalize(h, p=2.0, dim=-1, eps={eps})"]
                       + (["F.instance_norm(h)", f"F.instance_norm(h, eps={eps})"] if self.rank == 3 else []))

    def reduction(self) -> None:
        r = self.rng
        d, keep = self.last_dim(), r.random() < 0.6
        k = f", keepdim={keep}"
        before = "full" if self.state == "full" else None
        if before and keep and r.random() < 0.5:  # keep the full value for a broadcast back
            name = self.new_name("h")
            self.emit(f"{name} = h")
            self.saved_full.append(name)
        self.spell([f"h.sum({d}{k})", f"torch.sum(h, dim={d}{k})", f"h.sum({d}, {keep})", f"h.mean(dim={d}{k})",
                    f"torch.mean(h, {d}{k})", f"h.amax({d}{k})", f"torch.amin(h, dim={d}{k})",
                    f"h.max(dim={d}{k}).values", f"torch.max(h, {d}, {keep})[0]", f"torch.min(h, {d}{k})[0]",
                    f"h.min({d}{k}).values", f"torch.logsumexp(h, {d}{k})", f"h.logsumexp(dim={d}{k})",
                    f"h.var({d}{k}, unbiased=False)", f"torch.std(h, dim={d}, correction=0{k})",
                    f"torch.linalg.vector_norm(h, dim={d}{k})", f"h.norm(dim={d}{k})"])
        if self.state == "full":
            self.state = "keep" if keep else "reduced"
        elif self.state == "keep" and not keep:
            self.state = "reduced"
        if self.state == "keep" and self.saved_full and r.random() < 0.6:  # broadcast back to the full shape
            full = self.saved_full[-1]
            self.spell([f"{full} - h", f"h * {full}", f"{full} / (h.abs() + 1)", f"torch.exp({full} - h)",
                        f"torch.maximum({full}, h)"])
            self.state = "full"

    def residual(self) -> None:
        """Use an earlier full value again (`h + h1`), or keep the current one for later."""
        if self.saved_full and self.state == "full" and self.rng.random() < 0.5:
            self.spell([f"h + {self.saved_full[-1]}", f"{self.saved_full[-1]} * h", "h + h", "h * h.detach()"])
        elif self.state == "full":
            name = self.new_name("h")
            self.emit(f"{name} = h")
            self.saved_full.append(name)

    def batch_norm(self) -> None:
        """BatchNorm1d over the features of a 2-D value: a per-feature affine in eval mode, batch statistics in
        training."""
        r, n = self.rng, self.n
        eps, momentum, affine = r.choice([1e-5, 1e-3, 0.1]), r.choice([0.1, 0.5, None]), r.random() < 0.7
        name = self.module(f"nn.BatchNorm1d({n}, eps={eps}, momentum={momentum}, affine={affine})",
                           ("eps",) if momentum is None else ("eps", "momentum"))
        self.init_lines += [f"{name}.running_mean.uniform_(-0.5, 0.5)", f"{name}.running_var.uniform_(0.5, 2.0)"]
        weight = f"{name}.weight" if affine else "None"
        bias = f"{name}.bias" if affine else "None"
        self.spell([f"{name}(h)", f"F.batch_norm(h, {name}.running_mean, {name}.running_var, {weight}, {bias}, "
                                  f"self.training, {momentum or 0.1}, {eps})",
                    f"F.batch_norm(h, {name}.running_mean, {name}.running_var, eps={eps})"])

    def buffer(self) -> None:
        """A buffer in the chain (`h * self.b`), which the forward may change in place afterwards."""
        name = self.new_name("b")
        shape = self.rng.choice([(self.n,), ()]) if self.state == "full" else ()
        self.init_lines.append(f"self.register_buffer('{name}', torch.rand({shape}) + 0.5)")
        self.spell([f"h * self.{name}", f"self.{name} + h", f"torch.maximum(h, self.{name})", f"I:h.mul_(self.{name})"])
        if self.rng.random() < 0.5:
            update = self.rng.choice([f"self.{name}.mul_(1.25)", f"self.{name}.add_(0.5)", f"self.{name}.fill_(0.75)"])
            (self.final_lines if self.rng.random() < 0.5 else self.forward_lines).append("    " * self.indent + update)

    def mutate_input(self) -> None:
        """The forward changes its second argument in place (after the chain read it, or before)."""
        self.emit(self.rng.choice(["y.mul_(0.5)", "y.add_(1.0)", "y.clamp_(min=0)"]))

    def not_row_local(self) -> None:
        """An op over other dims than the features (the batch, two dims, all): never a fused row op."""
        r = self.rng
        choices = ["h.softmax(0)", "h.sum(0)", "h.mean(dim=0, keepdim=True)", "F.normalize(h, dim=0)",
                   "torch.logsumexp(h, 0, keepdim=True)", "h - h.amax(0)", "h.sum()", "h / (h.abs().sum() + 1)",
                   "h - h.mean()", "h.t().softmax(-1).t()", "h.transpose(0, -1).log_softmax(-1).transpose(0, -1)",
                   "h.sum(dim=(-1,))", "h.mean(dim=[-1], keepdim=True)", "h.cumsum(-1)", "h.flip(-1)",
                   "h - h.median(-1, keepdim=True).values", "h.sort(-1).values", "h[..., ::2]", "h.roll(1, -1)"]
        if self.rank == 3:
            choices += ["h.mean(-2)", f"F.layer_norm(h, h.shape[-2:])", "h.softmax(1)", "h.sum(dim=(1, 2))",
                        "h.amax(dim=(-2, -1), keepdim=True)", "h.flatten(0, 1)",
                        "F.group_norm(h, 1)", "M:nn.GroupNorm(1, 1, affine=False)"]
        self.spell(choices)
        self.state, self.saved_full = "other", []

    def cast(self) -> None:
        """A dtype change in the chain, or a mask or where with a comparison."""
        self.spell(["h.float()", "h.to(torch.bfloat16)", "h.double()", "h.to(torch.float32).to(torch.bfloat16)",
                    "h * (h > 0)", "torch.where(h > 0, h, 0.1 * h)", "h.masked_fill(h < 0, 0.0)",
                    "h * torch.tensor(2)", "h / 3", "2 ** h", "torch.pow(2.0, h)", "h.sum(-1, dtype=torch.float64)",
                    "F.softmax(h, -1, dtype=torch.float64)", "h + torch.ones((), dtype=torch.float64)",
                    "h * torch.arange(h.shape[-1])"])
        self.state = {"h.sum(-1, dtype=torch.float64)": "reduced"}.get(self.forward_lines[-1].split(" = ", 1)[-1],
                                                                         self.state)

    def pool(self) -> None:
        """An average pool over the features (optimize_hunt's draw_pool), drawn with pool_rng: never on an unsqueezed
        3-D value (a 4-D one, where eager raises). The later ops take its width."""
        pool = draw_pool(self.pool_rng, self.n, lambda: self.new_name("m"), can_unsqueeze=self.rank == 2)
        self.init_lines += pool.init_lines
        for line in pool.forward_lines:
            self.emit(line)
        self.ops += 1
        self.pools.append(pool.step)
        if pool.features != self.n:
            self.n, self.saved_full = pool.features, []
            self.second_input = None  # its shape fits the GEMM's features

    def gemm(self) -> None:
        """A second Linear on the chain's value: its own region starts there."""
        n = self.rng.choice(range(3, 33))
        self.spell([f"M:nn.Linear({self.n}, {n})", f"M:nn.Linear({self.n}, {n}, bias=False)"])
        self.n, self.saved_full = n, []
        self.second_input = None  # its shape fits the first GEMM's features

    def step(self) -> None:
        r = self.rng
        if self.state == "full" and self.pool_rng.random() < 0.03:  # a pool in the chain: it does not fold
            self.pool()
        if self.state == "full":
            kinds = {"unary": 5, "arithmetic": 4, "norm": 2, "reduction": 2, "residual": 1, "gemm": 0.5, "buffer": 0.5}
            if self.rank == 2:
                kinds["batch_norm"] = 0.7
            kinds.update(not_row_local=0.4, cast=0.4)
        elif self.state == "other":  # after an op over other dims: pointwise ops only
            kinds = {"unary": 5, "arithmetic": 2}
        else:
            kinds = {"unary": 5, "arithmetic": 4, "reduction": 1, "buffer": 0.3, "cast": 0.2}
        if self.second_input is not None:
            kinds["mutate_input"] = 0.3
        kind = r.choices(list(kinds), weights=list(kinds.values()))[0]
        getattr(self, kind)()


def generate(seed: int) -> Case:
    """The model and settings of `seed`."""
    r = random.Random(seed)
    rank = r.choice([2, 2, 3])
    k, n = r.choice(range(3, 49)), r.choice([r.choice(range(3, 49)), r.choice([8, 12, 16, 24, 32, 48])])
    middle = (r.choice([1, 3, 5]),) if rank == 3 else ()
    second_input = None
    if r.random() < 0.4:
        second_input = r.choice([(n,), (1, n), ("B", n), (2, 1, n), (3, "B", n), (1,)] if rank == 2 else
                                [(n,), ("T", n), ("B", 1, n), ("B", "T", n), (1, 1, n), (2, "B", 1, n)])
    float_argument = r.random() < 0.2
    gen = Generator(r, n, rank, second_input, float_argument, random.Random(seed + 3_000_017))

    features = []
    chain_length = r.randint(1, 5)
    graph_break_at = r.randrange(chain_length + 1) if r.random() < 0.15 else None
    no_grad_span = sorted(r.sample(range(chain_length + 1), 2)) if r.random() < 0.1 else None
    function_at = r.randrange(chain_length + 1) if r.random() < 0.1 else None
    returns_intermediate = r.random() < 0.08

    # The GEMM.
    bias = r.random() < 0.7
    linear_kind = r.choices(["module", "functional", "matmul"], weights=[5, 3, 1])[0]
    if linear_kind == "module":
        gen.init_lines.append(f"self.linear = nn.Linear({k}, {n}, bias={bias})")
        gen.emit("h = self.linear(x)")
    else:
        gen.init_lines.append(f"self.weight = nn.Parameter(torch.randn({n}, {k}) / {k} ** 0.5)")
        gen.init_lines.append(f"self.bias = nn.Parameter(torch.randn({n}) * 0.1)" if bias else "self.bias = None")
        if linear_kind == "functional":
            gen.emit(r.choice(["h = F.linear(x, self.weight, self.bias)",
                               "h = F.linear(x, weight=self.weight, bias=self.bias)"]))
        else:
            gen.emit("h = x @ self.weight.t()" + (" + self.bias" if bias else ""))
    features.append(linear_kind)
    if gen.pool_rng.random() < 0.15:
        if gen.pool_rng.random() < 0.25:  # another bias of the features first, which a folded pool averages too
            gen.emit(f"h = h + {gen.param((n,))}")
        gen.pool()

    for position in range(chain_length + 1):
        if no_grad_span and position == no_grad_span[1]:
            gen.indent -= 1
        if graph_break_at == position:
            gen.emit(r.choice(["torch._dynamo.graph_break()", "print(end='')"]))
            features.append("graph_break")
        if no_grad_span and position == no_grad_span[0]:
            gen.emit("with torch.no_grad():")
            gen.indent += 1
            features.append("no_grad")
        if function_at == position:
            gen.assign(r.choice(["Twice.apply(h)", "Sine.apply(h)"]))
            features.append("autograd.Function")
        if position < chain_length:
            gen.step()
    if no_grad_span and no_grad_span[1] > chain_length:
        gen.indent -= 1
    if gen.forward_lines[-1].strip().startswith("with "):
        gen.emit("pass")
    gen.forward_lines += [line.replace("    " * 3, "    " * 2, 1) if line.startswith("    " * 3) else line
                          for line in gen.final_lines]
    if gen.forward_lines[-1].strip().startswith("with "):
        gen.emit("pass")
    features += gen.pools
    if returns_intermediate and gen.saved_full:
        gen.emit(f"return h, {gen.saved_full[0]}")
        features.append("returns_intermediate")
    else:
        gen.emit("return h")

    arguments = ["self", "x"] + (["y"] if second_input else []) + (["s"] if float_argument else [])
    source = "\n".join(["class Model(nn.Module):", "    def __init__(self):", "        super().__init__()"]
                       + [f"        {line}" for line in gen.init_lines]
                       + [f"    def forward({', '.join(arguments)}):"] + gen.forward_lines)

    dtype = torch.bfloat16 if r.random() < 0.2 else torch.float32
    autocast = dtype == torch.float32 and r.random() < 0.15
    mode = r.choices(["train", "eval", "eval-grad", "inference", "mixed"], weights=[5, 4, 1, 0.5, 1])[0]
    inner = r.choices(["eager", "aot_eager", "inductor"], weights=[10, 10, 1])[0]
    dynamic = r.choices([False, True, None], weights=[3, 2, 2])[0]
    batch_sizes = [r.choice(range(1, 9))]
    if dynamic is not False:
        batch_sizes += r.sample([b for b in range(0, 12) if b != batch_sizes[0]], r.choice([1, 2]))
    if mode == "mixed" and len(batch_sizes) == 1:
        batch_sizes.append(batch_sizes[0])
    mutate = None
    if gen.module_floats and r.random() < 0.2:
        mutate = r.choice(gen.module_floats)
        features.append("mutate")
        if len(batch_sizes) == 1:
            batch_sizes.append(batch_sizes[0])
    parameters = [line.split(" = ")[0][5:] for line in gen.init_lines if "nn.Parameter" in line]
    parameters += ["linear.weight", "linear.bias"] if linear_kind == "module" else []
    frozen = tuple(r.sample(parameters, r.randint(1, len(parameters)))) if r.random() < 0.15 else ()
    input_grad = r.random() < 0.8
    transposed_input = r.random() < 0.1
    between = tuple(sorted(set(r.choices(["update_params", "freeze", "toggle_mode"], k=r.randint(1, 2))))) \
        if r.random() < 0.2 else ()
    if between and len(batch_sizes) == 1:
        batch_sizes.append(batch_sizes[0])
    middle_sizes = tuple(r.choice([1, 2, 3, 5, 7]) for _ in batch_sizes[1:]) if middle and dynamic is not False \
        and r.random() < 0.5 else ()
    return Case(seed, source, k, n, middle, second_input, float_argument, dtype, mode, inner, dynamic, batch_sizes,
                autocast, mutate, frozen, input_grad, transposed_input, between, middle_sizes, features)


# ------------------------------------------------------------------------------------------------ running a case

NAMESPACE = {"torch": torch, "nn": nn, "F": F, "Twice": Twice, "Sine": Sine}


def build(case: Case) -> nn.Module:
    """The model of `case`, with the weights of its seed, in its dtype and mode."""
    namespace = dict(NAMESPACE)
    exec(case.source, namespace)
    torch.manual_seed(case.seed)
    model = namespace["Model"]().to(case.dtype)
    for name, parameter in model.named_parameters():
        if name in case.frozen:
            parameter.requires_grad_(False)
    return model.train() if case.mode == "train" else model.eval()


def inputs_of(case: Case, batch: int, call: int, dtype=None) -> list:
    """The forward arguments of call number `call` at batch size `batch`."""
    dtype = dtype or case.dtype
    middle = case.middle
    if case.middle_sizes and call > 0:
        middle = (case.middle_sizes[call - 1],)
    generator = torch.Generator().manual_seed(case.seed * 1000 + call)
    if case.transposed_input:  # the same values' shape, in a transposed layout
        x = torch.randn(case.in_features, *middle, batch, generator=generator).to(dtype).transpose(0, -1)
    else:
        x = torch.randn(batch, *middle, case.in_features, generator=generator).to(dtype)
    arguments = [x]
    if case.second_input:
        shape = tuple({"B": batch, "T": (middle or (None,))[0]}.get(d, d) for d in case.second_input)
        arguments.append(torch.randn(shape, generator=generator).to(dtype))
    if case.float_argument:
        arguments.append(round(0.3 + 0.4 * call, 2))
    return arguments


def change_between(model: nn.Module, change: str) -> None:
    """A change a training loop makes between calls: an optimizer step on every parameter ("update_params"), a
    parameter frozen ("freeze"), train() <-> eval() ("toggle_mode")."""
    if change == "update_params":
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(1.25).add_(0.125)
    elif change == "freeze":
        trainable = [p for p in model.parameters() if p.requires_grad]
        if trainable:
            trainable[0].requires_grad_(False)
    elif change == "toggle_mode":
        model.train(not model.training)


def mutate_float(model: nn.Module, path: str) -> None:
    """Change a module float (a slope, an eps) after the first call, as a user might."""
    module_name, attribute = path.split(".")
    module = getattr(model, module_name)
    setattr(module, attribute, getattr(module, attribute) * 1.5 + 0.01)


class Gradient:
    """A gradient among a call's results (as opposed to an output), for compare's triage."""

    def __init__(self, tensor):
        self.tensor = tensor


# Ops whose gradient jumps (clamp's bounds, relu's 0, max's ties): a low-precision rounding difference before them
# moves an element across the jump, and its gradient changes by the whole of its incoming gradient.
GRADIENT_JUMPS = ("clamp", "clip", "hardtanh", "relu", "threshold", "max", "min", "amax", "amin", "hardshrink",
                  "softshrink", "hardswish", "hardsigmoid", "abs", "leaky", "ReLU", "Hardtanh", "LeakyReLU",
                  "Hard", "maximum", "minimum")


def results_of(model, case: Case, arguments, with_grad: bool) -> list:
    """The outputs of one call and, with grad, the gradients of the floating inputs and of every parameter."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if case.autocast else contextlib.nullcontext()
    # The state after the call: arguments the forward may change in place, and buffers.
    state_after = lambda: ([a.detach().clone() for a in arguments if isinstance(a, torch.Tensor)]  # noqa: E731
                           + [b.clone() for b in model.buffers()])
    with autocast:
        if not with_grad:
            arguments = [a.clone() if isinstance(a, torch.Tensor) else a for a in arguments]
            grad_off = torch.inference_mode() if case.mode == "inference" else torch.no_grad()
            with grad_off:
                out = model(*arguments)
            return [o.clone() for o in (out if isinstance(out, tuple) else [out])] + state_after()
        arguments = [a.detach().clone().requires_grad_(case.input_grad) if isinstance(a, torch.Tensor) else a
                     for a in arguments]
        params = [p for p in model.parameters() if p.requires_grad]
        with torch.enable_grad():
            out = model(*arguments)
            outputs = list(out) if isinstance(out, tuple) else [out]
            generator = torch.Generator().manual_seed(case.seed)
            loss = sum((o * torch.randn(o.shape, generator=generator).to(o.dtype)).sum()
                       for o in outputs if o.requires_grad)
        wanted = [a for a in arguments if isinstance(a, torch.Tensor) and a.requires_grad] + params
        differentiable = torch.is_tensor(loss) and loss.requires_grad and wanted
        grads = torch.autograd.grad(loss, wanted, allow_unused=True) if differentiable else [None] * len(wanted)
        return ([o.detach() for o in outputs] + [Gradient(g if g is not None else torch.zeros(())) for g in grads]
                + state_after())


def run_case(case: Case, use_fxfuse: bool = True) -> tuple[int, str | None]:
    """Compile the model of `case` (with fxfuse, or with its inner compiler alone) and compare each call with eager.

    Returns (fused regions, None) or (fused regions, a one-line failure).
    """
    torch._dynamo.reset()
    eager = build(case)
    candidate = copy.deepcopy(eager)
    backend = fxfuse.make_backend(inner=case.inner) if use_fxfuse else case.inner
    compiled = torch.compile(candidate, backend=backend, dynamic=case.dynamic)
    grad_of_call = lambda call: (case.mode in ("train", "eval-grad")  # noqa: E731
                                 or (case.mode == "mixed" and call % 2 == 1))
    fused = 0
    try:
        for call, batch in enumerate(case.batch_sizes):
            if case.mutate and call == 1:
                mutate_float(eager, case.mutate)
                mutate_float(candidate, case.mutate)
            for change in case.between if call == 1 else ():
                change_between(eager, change)
                change_between(candidate, change)
            arguments = inputs_of(case, batch, call)
            with_grad = grad_of_call(call)
            try:
                expected = results_of(eager, case, arguments, with_grad)
            except Exception as error:  # eager raises: the compiled model must raise too
                try:
                    results_of(compiled, case, arguments, with_grad)
                except Exception:
                    return fused, None
                if "modified by an inplace operation" in str(error):  # docs/BACKEND.md, Limits
                    return fused, f"known: eager's backward raises 'modified by an inplace operation', compiled runs"
                return fused, f"call {call}: eager raises {type(error).__name__}: {str(error)[:80]}, compiled runs"
            actual = results_of(compiled, case, arguments, with_grad)
            fused = sum(len(report.fused) for report in backend.reports) if use_fxfuse else 0
            mismatch = compare(case, actual, expected, call, arguments, with_grad, eager)
            if mismatch:
                return fused, mismatch
    except Exception as error:
        fused = sum(len(report.fused) for report in backend.reports) if use_fxfuse else 0
        message = str(error).strip().splitlines()
        if use_fxfuse and "modified by an inplace operation" in str(error) and \
                _changes_a_buffer_after_a_graph_break(case.source):  # docs/BACKEND.md, Limits
            return fused, ("known: a buffer that a fused op keeps for its backward is changed in place by a later "
                           "graph (after a graph break), and the backward raises 'modified by an inplace operation'")
        return fused, f"raises {type(error).__name__}: {(message[0] if message else '')[:150]}"
    return fused, None


def _changes_a_buffer_after_a_graph_break(source: str) -> bool:
    """Whether the forward changes a buffer in place (`self.b2.add_(0.5)`) after a graph break: the change is then
    another graph's, which a region of the graph before cannot see, as a caller's change between the forward and
    the backward (docs/BACKEND.md, "What the fused op keeps for its backward")."""
    lines = source.splitlines()
    breaks = _graph_break_lines(lines)
    return bool(breaks) and any(re.search(r"self\.b\d+\.(mul_|add_|fill_)\(", line) for line in lines[breaks[0]:])


def _graph_break_lines(lines: list[str]) -> list[int]:
    """The indices of the source lines where Dynamo breaks the graph: an explicit break, or a call of a BatchNorm of
    momentum=None (in training it reads `float(self.num_batches_tracked)`, which Dynamo does not trace)."""
    no_momentum = {match.group(1) for line in lines
                   if (match := re.search(r"self\.(\w+) = nn\.BatchNorm\w*\(.*momentum=None", line))}
    return [i for i, line in enumerate(lines) if "graph_break()" in line or "print(end='')" in line
            or any(f"self.{name}(" in line for name in no_momentum)]


def compare(case: Case, actual: list, expected: list, call: int, arguments, with_grad: bool,
            eager: nn.Module) -> str | None:
    """None when `actual` matches eager's `expected`; else what differs, tagged "precision" when the compiled
    result is about as close to a float64 run of the `eager` model (as the call found it) as eager's."""
    low_precision = case.dtype == torch.bfloat16 or case.autocast
    rtol, atol = TOLERANCE[torch.bfloat16 if low_precision else torch.float32]
    if len(actual) != len(expected):
        return f"call {call}: {len(actual)} results vs eager's {len(expected)}"
    # The largest gradient of the call: a gradient that cancels to about 0 (a per-feature bias before a train-mode
    # batch_norm) keeps rounding noise of that size.
    gradient_scale = max([r.tensor.detach().abs().nan_to_num(0, 0, 0).max().item() for r in expected
                          if isinstance(r, Gradient) and r.tensor.numel()] or [0.0])
    for index, (a, e) in enumerate(zip(actual, expected)):
        gradient = isinstance(e, Gradient)
        a, e = (a.tensor, e.tensor) if gradient else (a, e)
        try:
            assert_close_report(a, e, rtol=rtol, atol=atol, what=f"call {call} result {index}")
        except AssertionError as error:
            message = str(error).splitlines()[0]
            if a.shape != e.shape or a.dtype != e.dtype or not torch.equal(a.isnan(), e.isnan()):
                return message  # never rounding
            if low_precision and closer_to_float64(case, eager, a, e, index, arguments, with_grad):
                return f"precision: {message}"
            if gradient and (a.double() - e.double()).abs().nan_to_num(0).max().item() <= rtol * gradient_scale:
                return f"precision (a gradient that cancels, noise of the call's largest gradient): {message}"
            if low_precision and gradient and any(op in case.source for op in GRADIENT_JUMPS):
                return f"precision (a gradient with a jump): {message}"
            if moves_as_far(case, eager, a, e, index, arguments, with_grad):
                return f"precision (ill-conditioned: eager's moves as far for a change of an ulp): {message}"
            return message
    return None


def moves_as_far(case: Case, eager: nn.Module, actual, expected, index: int, arguments, with_grad: bool) -> bool:
    """Whether eager's result number `index` moves at least as far from `expected` as `actual` is, where the arguments
    and parameters of the `eager` model (as the call found it) change by up to one ulp of the dtype it computes in:
    `actual` is then rounding noise of an ill-conditioned result (optimize_hunt's test)."""
    dtype = torch.bfloat16 if case.autocast else case.dtype
    distance_of = lambda t: (t.double() - expected.double()).abs().nan_to_num(0).max().item()  # noqa: E731
    for k in range(PERTURBATIONS):
        try:
            model, changed = _perturbed_copy(eager, arguments, dtype, case.seed * PERTURBATIONS + k)
            moved = results_of(model, case, changed, with_grad)[index]
        except Exception:
            return False
        moved = moved.tensor if isinstance(moved, Gradient) else moved
        if moved.shape == expected.shape and distance_of(moved) >= distance_of(actual):
            return True
    return False


def closer_to_float64(case: Case, eager: nn.Module, actual, expected, index: int, arguments, with_grad: bool) -> bool:
    """Whether `actual` (result number `index`) is within twice eager's error of the float64 model's result: a float64
    copy of `eager` as the call found it (the changes between calls made: a parameter frozen or updated, a module
    float changed, train() <-> eval()), not one built afresh."""
    try:
        reference_case = copy.copy(case)
        reference_case.autocast = False
        model = copy.deepcopy(eager).to(torch.float64)
        arguments = [a.to(torch.float64) if isinstance(a, torch.Tensor) else a for a in arguments]
        reference = results_of(model, reference_case, arguments, with_grad)[index]
        reference = reference.tensor if isinstance(reference, Gradient) else reference
    except Exception:
        return False
    error_of = lambda t: (t.double() - reference).abs().nan_to_num(0).max().item()  # noqa: E731
    return error_of(actual) <= 2 * error_of(expected) + 1e-2 * reference.abs().nan_to_num(0).max().item()


# ------------------------------------------------------------------------------------------------ main

def parse_seeds(text: str) -> list[int]:
    """'0:150' -> 0..149; '3,7,9' -> those; '17' -> [17]."""
    seeds = []
    for part in text.split(","):
        if ":" in part:
            start, stop = part.split(":")
            seeds += list(range(int(start), int(stop)))
        else:
            seeds.append(int(part))
    return seeds



def _record(kept: list, seed: int, failure: str) -> None:
    """Keep a difference that is not fxfuse's bug (precision, or documented), and print it."""
    kept.append((seed, failure))
    print(f"seed {seed:4d}: {failure}", flush=True)

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0:150", help="a range start:stop, or seeds separated by commas")
    parser.add_argument("--show", type=int, help="print the source and settings of one seed, and exit")
    parser.add_argument("--inner", choices=["eager", "aot_eager", "inductor"],
                        help="the inner compiler of every model (default: each seed's own, Inductor rarely)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each failing model's source")
    args = parser.parse_args()
    if args.show is not None:
        case = generate(args.show)
        print(case.describe())
        print(case.source)
        return 0
    warnings.filterwarnings("ignore")
    torch._dynamo.config.cache_size_limit = 64
    start = time.time()
    fused_models, failures, dynamo_failures, precision, models = 0, [], [], [], 0
    for seed in parse_seeds(args.seeds):
        case = generate(seed)
        if args.inner:
            case.inner = args.inner
        models += 1
        try:
            fused, failure = run_case(case)
        except Exception as error:  # a failure of the hunter itself
            fused, failure = 0, f"hunter: {type(error).__name__}: {error}"
            if args.verbose:
                traceback.print_exc()
        fused_models += fused > 0
        if failure is None:
            print(f"seed {seed:4d}: ok, {fused} fused", flush=True)
            continue
        if failure.startswith("known"):
            _record(precision, seed, failure)
            continue
        try:
            _, without = run_case(case, use_fxfuse=False)
        except Exception as error:
            without = f"hunter: {type(error).__name__}: {error}"
        if without is not None:
            dynamo_failures.append((seed, f"{failure} (without fxfuse: {without})"))
            print(f"seed {seed:4d}: DYNAMO {failure} (without fxfuse: {without})", flush=True)
            continue
        if failure.startswith("precision"):
            _record(precision, seed, failure)
            continue
        failures.append((seed, f"{failure} [{case.describe()}]"))
        print(f"seed {seed:4d}: FAIL {failure}", flush=True)
        if args.verbose:
            print(case.describe())
            print(case.source)
    torch._dynamo.reset()
    print(f"\n{models} models in {time.time() - start:.0f}s, {fused_models} fused, {len(failures)} fxfuse failures, "
          f"{len(dynamo_failures)} also without fxfuse, {len(precision)} low-precision or documented differences")
    for title, rows in (("fxfuse failures", failures), ("failing without fxfuse too", dynamo_failures),
                        ("low precision (fxfuse as close to float64 as eager) or documented", precision)):
        if rows:
            print(f"{title}:")
            for seed, text in rows:
                print(f"  seed {seed}: {text}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
