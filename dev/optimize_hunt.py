"""Randomized differential tester for ``fxfuse.optimize()`` on the CPU: random small models, optimized vs eager.

Each seed builds one model as Python source: sometimes an op on x first (one of a rank of its own: a view or
reshape to a given shape; torch.cat, concat or stack; an item of x), a GEMM (nn.Linear, F.linear with parameters,
torch.addmm, ``x @ w.t()``, with or without bias) on an input of 1-4 dims, then a random chain of 1-6 epilogue ops from
fxfuse's vocabulary (activations, arithmetic with numbers, parameters and forward arguments, norms, row reductions
and softmax), each in a random spelling (module, F.*, torch.*, method, in-place, operator, keywords or positional
arguments). Now and then an average pool over the features (avg_pool1d in fxfuse's spellings) comes right after the
GEMM or its bias adds, where it folds into the GEMM unless its stride, padding or ceil_mode say otherwise, or later in
the chain, where it does not fold. The dtype (float32, float64, bfloat16), train or eval mode, and whether optimize()
gets example inputs are random too. Then it checks:

- optimize() itself does not raise, and leaves the model's own results as they were;
- the optimized model gives eager's output, or eager's error (and no error where eager runs);
- its gradients of the input, the forward arguments and the parameters are eager's (where eager's backward runs);
- a second call with another batch size (sometimes another rank) gives eager's result or eager's error.

A value outside the dtype's tolerance is judged against a float64 run of the same model: it counts as a failure
only where the fused value is clearly further from float64 than eager's own value, and further than eager's value
is where its inputs and parameters change by up to one ulp of the dtype. Else it is rounding noise, counted apart:
in the second case eager's own result is that unstable there (a layer_norm over 2 features of nearly equal values;
a bf16 layer_norm's or group_norm's backward on the CPU, which keeps its mean and rstd in bf16). fxfuse's own rank
error on a second call of another rank is counted apart too (a documented limit in some cases: docs/BACKEND.md,
"Dynamic shapes"); look at those by hand.

Usage (from the repository root):

    PYTHONPATH=. python dev/optimize_hunt.py --seeds 0:300          # summary of 300 models
    PYTHONPATH=. python dev/optimize_hunt.py --seeds 17 --show      # one model: its source and what went wrong
    PYTHONPATH=. python dev/optimize_hunt.py --seeds 0:300 --dump /tmp/hunt   # each failing model's source to a file
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import linecache
import logging
import os
import random
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from fxfuse.testing import DEFAULT_TOLERANCE, fused_op_count

DTYPES = (torch.float32, torch.float32, torch.float64, torch.bfloat16, torch.float16)  # float32 twice as likely
MODEL_TIMEOUT_S = 60
MAX_STEPS = 6  # the most epilogue steps a chain draws (--max-steps)
NOISE_FACTOR = 4.0  # a fused value this many times further from float64 than eager's is a failure
PERTURBATIONS = 5  # eager runs on inputs and parameters changed by up to one ulp, to tell ill-conditioning by


# ------------------------------------------------------------------------------------------------ model drawing

@dataclass
class ModelSpec:
    """One drawn model: its source lines and how to make its inputs."""
    in_features: int
    out_features: int
    leading: tuple[int, ...]
    dtype: torch.dtype
    train: bool
    with_examples: bool
    autocast: bool = False        # eager and optimized calls both under CPU autocast to bfloat16
    strided_input: bool = False   # x (and the forward arguments of features) transposed (non-contiguous) tensors
    wrapped: bool = False         # the model is the child of a module whose forward fx can't trace
    keywords: bool = False        # the forward arguments given by name
    init_lines: list[str] = field(default_factory=list)
    forward_lines: list[str] = field(default_factory=list)
    # (name, kind, positive, dtype, features): kind "full" / "feat" / "row" / "scalar" (a 0-d tensor) / "number" (a
    # float); features: the chain's width where it was drawn (a pool over the features narrows it)
    extra_args: list[tuple[str, str, bool, torch.dtype | None, int]] = field(default_factory=list)
    returns: list[str] = field(default_factory=lambda: ["h"])
    steps: list[str] = field(default_factory=list)  # one short name per drawn step, for the summary

    def source(self) -> str:
        """The model's Python source (class Model)."""
        args = "".join(f", {arg[0]}" for arg in self.extra_args)
        lines = ["class Model(nn.Module):", "    def __init__(self):", "        super().__init__()"]
        lines += [f"        {line}" for line in self.init_lines]
        lines += [f"    def forward(self, x{args}):"]
        lines += [f"        {line}" for line in self.forward_lines]
        lines += [f"        return {', '.join(self.returns)}", ""]
        return "\n".join(lines)

    def inputs(self, leading: tuple[int, ...], generator: torch.Generator) -> list:
        """The forward's arguments for these leading dims."""
        if self.strided_input:
            x = torch.randn(self.in_features, *leading, generator=generator).movedim(0, -1)
        else:
            x = torch.randn(*leading, self.in_features, generator=generator)
        values = [x.to(self.dtype)]
        for _, kind, positive, dtype, features in self.extra_args:
            if kind == "number":
                values.append(round(float(torch.rand((), generator=generator)) + 0.5, 3))
                continue
            shape = {"full": (*leading, features), "feat": (features,), "row": (*leading, 1),
                     "scalar": ()}[kind]
            value = torch.randn(shape, generator=generator)
            if positive:
                value = torch.rand(shape, generator=generator) + 0.5
            if self.strided_input and value.dim() >= 2:
                value = value.mT.contiguous().mT
            values.append(value.to(dtype or self.dtype))
        return values


@dataclass(frozen=True)
class ModuleCall:
    """A spelling that calls a submodule: added to the model only where it is picked."""
    construction: str
    stem: str = "act"


# ------------------------------------------------------------------------------------ a pool over the features
# (shared with dev/compile_hunt.py)

@dataclass
class Pool:
    """A drawn average pool over the features of the chain's value `h`."""
    init_lines: list[str]     # the construction of its module, where it is spelled as one
    forward_lines: list[str]  # the lines that pool `h`
    features: int             # the width after it (its input's, where eager raises at it)
    step: str                 # a short name, for the summary


def draw_pool(r: random.Random, features: int, module_name, fit_input=None, can_unsqueeze: bool = True) -> Pool:
    """An average pool over the `features` of `h` in a random spelling (nn.AvgPool1d, F.avg_pool1d,
    torch.avg_pool1d; on the value, or between `unsqueeze(1)` and `squeeze(1)`). Its windows tile the features
    (fxfuse folds it into a GEMM right before it), or now and then do not: another stride, padding or ceil_mode (it
    must not fold); its kernel divides the features or not (a partial window is dropped), or exceeds them.

    module_name() names its module, where it is one; fit_input(unsqueezed) may change the model's input to fit the
    pool; without can_unsqueeze the pool is never on an unsqueezed value (the draws stay the same)."""
    n = features
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    others = [k for k in range(2, n) if n % k]
    kernel = r.choice(others) if others and r.random() < 0.4 else r.choice(divisors)
    if r.random() < 0.05:
        kernel = n + 1  # (eager raises)
    options = {}  # avg_pool1d's arguments after kernel_size that differ from their defaults (or stride = kernel)
    if r.random() < 0.3:
        extra = r.choice(["stride", "stride", "padding", "ceil_mode", "count_include_pad", "same stride"])
        if extra == "stride":
            options["stride"] = r.choice([s for s in range(1, kernel + 2) if s != kernel])
        elif extra == "padding":
            options["padding"] = r.randint(1, max(1, kernel // 2))  # (more than kernel // 2: eager raises)
        elif extra in ("ceil_mode", "count_include_pad"):
            options[extra] = extra == "ceil_mode"
        else:
            options["stride"] = kernel
    try:
        features = F.avg_pool1d(torch.zeros(1, n), kernel, **options).shape[-1]
    except RuntimeError:
        pass  # (eager raises at this pool: the width after it does not matter)
    spelling = r.choice(["module", "F", "torch"])
    kernel_text = r.choice([str(kernel), str(kernel), f"({kernel},)", f"[{kernel}]"])
    order = ("stride", "padding", "ceil_mode", "count_include_pad")
    defaults = {"stride": kernel, "padding": 0, "ceil_mode": False, "count_include_pad": True}
    if r.random() < 0.5:  # positional, up to the last one given
        given = [i for i, name in enumerate(order) if name in options]
        last = given[-1] if given else -1
        arguments = [kernel_text] + [str(options.get(name, defaults[name])) for name in order[:last + 1]]
    else:
        arguments = [kernel_text if r.random() < 0.5 else f"kernel_size={kernel_text}"]
        arguments += [f"{name}={value}" for name, value in options.items()]
    init_lines = []
    if spelling == "module":
        name = module_name()
        init_lines.append(f"self.{name} = nn.AvgPool1d({', '.join(arguments)})")
        call = f"self.{name}({{}})"
    else:
        prefix = "F.avg_pool1d" if spelling == "F" else "torch.avg_pool1d"
        call = f"{prefix}({{}}, {', '.join(arguments)})"
    unsqueezed = r.random() < 0.5 and can_unsqueeze
    if fit_input is not None:
        fit_input(unsqueezed)
    if not unsqueezed:
        lines = [f"h = {call.format('h')}"]
    else:
        dim = r.choice([1, 1, -2])
        lines = r.choice([[f"h = {call.format(f'h.unsqueeze({dim})')}.squeeze({dim})"],
                          [f"h = h.unsqueeze({dim})", f"h = {call.format('h')}", f"h = h.squeeze({dim})"]])
    shown = "".join(f", {name}={value}" for name, value in options.items())
    step = f"avg_pool1d({spelling}, {kernel}{shown}{', unsqueezed' if unsqueezed else ''})"
    return Pool(init_lines, lines, features, step)



class Drawer:
    """Draws a model's steps, tracking what the chain's value is: features (last dim N), a keepdim-reduced row
    (last dim 1) or a reduced one (one dim fewer)."""

    def __init__(self, rng: random.Random, spec: ModelSpec, pool_rng: random.Random,
                 shape_rng: random.Random | None = None):
        self.rng = rng
        self.pool_rng = pool_rng  # draws the pools over the features apart, so a model without one is as it was
        self.shape_rng = shape_rng or random.Random(0)  # draws the rank-fixing prologues apart, alike
        self.spec = spec
        self.features = spec.out_features  # the chain's width: the GEMM's, or a pool's output's
        self.state = "features"
        self.counter = 0
        self.reductions = 0
        self.kept: list[str] = []  # names of kept values (keep())

    def fresh(self, stem: str) -> str:
        """A new attribute name."""
        self.counter += 1
        return f"{stem}{self.counter}"

    def number(self, low=-2.0, high=2.0) -> float:
        return round(self.rng.uniform(low, high), 3)

    def module(self, construction: str, stem="act") -> str:
        """Add a submodule; return the forward line that calls it."""
        name = self.fresh(stem)
        self.spec.init_lines.append(f"self.{name} = {construction}")
        return f"h = self.{name}(h)"

    def param(self, shape: str, positive=False) -> str:
        """Add a parameter of `shape` (a Python tuple's text); return its expression."""
        name = self.fresh("p")
        values = f"torch.rand({shape}) + 0.5" if positive else f"torch.randn({shape})"
        kind = self.rng.random()
        if kind < 0.15:
            self.spec.init_lines.append(f"self.register_buffer('{name}', {values})")
        elif kind < 0.25:
            self.spec.init_lines.append(f"self.{name} = nn.Parameter({values}, requires_grad=False)")
        else:
            self.spec.init_lines.append(f"self.{name} = nn.Parameter({values})")
        return f"self.{name}"

    def argument(self, kind: str, positive=False) -> str:
        """Add a forward argument (sometimes of another floating dtype than the model's); return its name."""
        name = f"y{len(self.spec.extra_args)}"
        dtype = self.pick(torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool) \
            if self.rng.random() < 0.2 else None
        self.spec.extra_args.append((name, kind, positive, dtype, self.features))
        return name

    def pick(self, *choices):
        """One of `choices`; a ModuleCall picked becomes a submodule and the line that calls it."""
        choice = self.rng.choice(choices)
        return self.module(choice.construction, choice.stem) if isinstance(choice, ModuleCall) else choice

    # ---------------------------------------------------------------------------------------------- the GEMM

    def prologue(self) -> None:
        """Sometimes an op on x before the GEMM (one that keeps its rank, changes it, or changes x in place)."""
        if self.rng.random() > 0.3:
            self.rank_fixing_prologue()
            return
        k = self.spec.in_features
        line = self.pick("x = x * 0.5", "x = x.relu()", "x = F.gelu(x) + 1", "x = x.unsqueeze(0)", "x = x.squeeze(0)",
                         "x = x.squeeze()", "x = x.flatten(0, 1)", f"x = x.reshape(-1, {k})",
                         "x = x.view(-1, x.size(-1))",
                         "x = x.contiguous()", "x = x.mean(0)", "x = x.sum(0, keepdim=True)", "x = x[0]",
                         "x.mul_(2)", "x = x.transpose(0, 1)", "x = x.unsqueeze(1).squeeze(0)", "x = x[None]")
        self.spec.forward_lines.append(line)
        self.spec.steps.append(f"prologue({line})")

    def rank_fixing_prologue(self) -> None:
        """Sometimes (where prologue() drew none) an op on x whose rank is its own or follows x's through a join:
        a view or reshape to a given shape, torch.cat / concat / stack, an item of x; drawn with shape_rng."""
        if self.shape_rng.random() > 0.15:
            return
        k = self.spec.in_features
        line = self.shape_rng.choice([
            f"x = x.view(x.size(0), -1, {k})", "x = x.reshape(x.shape[0], -1)", f"x = torch.reshape(x, (-1, {k}))",
            f"x = x.view(size=(-1, {k}))", f"x = x.reshape(1, -1, {k})",
            "x = torch.cat([x, x * 2], 0)", "x = torch.cat((x, x), dim=-2)", "x = torch.concat([x, x.relu()])",
            "x = torch.stack([x, x], 0)", "x = torch.stack((x, x * 0.5), dim=1)", "x = x[-1]", "x = x[0] * 2"])
        self.spec.forward_lines.append(line)
        self.spec.steps.append(f"prologue({line})")

    def gemm(self) -> None:
        k, n = self.spec.in_features, self.spec.out_features
        bias = self.rng.random() < 0.7
        kind = self.pick("linear", "linear", "F.linear", "addmm", "matmul_t", "matmul_kn")
        if kind == "linear":
            self.spec.init_lines.append(f"self.fc = nn.Linear({k}, {n}, bias={bias})")
            self.spec.forward_lines.append("h = self.fc(x)")
        elif kind == "F.linear":
            self.spec.init_lines.append(f"self.w = nn.Parameter(torch.randn({n}, {k}) / {k ** 0.5:.4f})")
            if bias:
                self.spec.init_lines.append(f"self.b = nn.Parameter(torch.randn({n}) * 0.1)")
            self.spec.forward_lines.append(self.pick(
                f"h = F.linear(x, self.w{', self.b' if bias else ''})",
                f"h = F.linear(x, weight=self.w{', bias=self.b' if bias else ''})"))
        elif kind == "addmm":
            self.spec.init_lines.append(f"self.w = nn.Parameter(torch.randn({n}, {k}) / {k ** 0.5:.4f})")
            self.spec.init_lines.append(f"self.b = nn.Parameter(torch.randn({n}) * 0.1)")
            self.spec.forward_lines.append(self.pick("h = torch.addmm(self.b, x, self.w.t())",
                                                     "h = torch.addmm(self.b, x, self.w.T)"))
        else:
            shape = f"{n}, {k}" if kind == "matmul_t" else f"{k}, {n}"
            weight = "self.w.t()" if kind == "matmul_t" else "self.w"
            self.spec.init_lines.append(f"self.w = nn.Parameter(torch.randn({shape}) / {k ** 0.5:.4f})")
            product = self.pick(f"x @ {weight}", f"torch.matmul(x, {weight})")
            if bias:
                self.spec.init_lines.append(f"self.b = nn.Parameter(torch.randn({n}) * 0.1)")
                product += " + self.b"
            self.spec.forward_lines.append(f"h = {product}")
        self.spec.steps.append(kind + ("+b" if bias else ""))
        if self.pool_rng.random() < 0.15:
            if self.pool_rng.random() < 0.25:  # another bias of the features first, which a folded pool averages too
                self.spec.forward_lines.append(f"h = h + {self.param(f'({self.features},)')}")
                self.spec.steps.append("add(param_n)")
            self.pool()

    # ------------------------------------------------------------------------------------ a pool over the features

    def pool(self) -> None:
        """An average pool over the features (draw_pool), drawn with pool_rng; x's leading dims mostly fit it."""
        pool = draw_pool(self.pool_rng, self.features, lambda: self.fresh("pool"), self.fit_pool_input)
        self.features = pool.features
        self.spec.init_lines.extend(pool.init_lines)
        self.spec.forward_lines.extend(pool.forward_lines)
        self.spec.steps.append(pool.step)

    def fit_pool_input(self, unsqueezed: bool) -> None:
        """Mostly give x leading dims that make the pool's input 2-D or 3-D (2-D where it is unsqueezed first)."""
        fitting = [(1,), (2,), (3,), (5,)] + ([] if unsqueezed else [(1, 3), (2, 3), (3, 1)])
        if self.spec.leading not in fitting and self.pool_rng.random() < 0.8:
            self.spec.leading = self.pool_rng.choice(fitting)

    # ------------------------------------------------------------------------------------------ pointwise ops

    def activation(self) -> tuple[str, str]:
        """(step name, forward line) of a unary activation in a random spelling."""
        r = self.rng
        name = self.pick("relu", "hardtanh", "relu6", "leaky_relu", "gelu", "silu", "mish", "sigmoid", "tanh", "elu",
                         "softplus", "clamp", "selu", "celu", "hardswish", "hardsigmoid", "logsigmoid", "softsign",
                         "tanhshrink", "abs", "neg", "square", "sin", "erf", "atan", "prelu")
        if name == "relu":
            return name, self.pick(ModuleCall("nn.ReLU()"), ModuleCall("nn.ReLU(inplace=True)"), "h = F.relu(h)",
                                   "h = torch.relu(h)", "h = h.relu()", "h.relu_()", "h = F.relu(h, inplace=True)",
                                   "torch.relu_(h)", "h = F.relu_(h)")
        if name == "hardtanh":
            low, high = self.number(-2, 0), self.number(0.05, 2)
            return name, self.pick(ModuleCall(f"nn.Hardtanh({low}, {high})"), f"h = F.hardtanh(h, {low}, {high})",
                                   f"h = F.hardtanh(h, min_val={low}, max_val={high})",
                                   f"h = F.hardtanh_(h, {low}, {high})", f"h = F.hardtanh(h, {low}, {high}, True)")
        if name == "relu6":
            return name, self.pick(ModuleCall("nn.ReLU6()"), "h = F.relu6(h)", "h = F.relu6(h, inplace=True)")
        if name == "leaky_relu":
            slope = self.number(0.0, 0.4) if r.random() < 0.8 else self.number(-0.3, 1.5)
            return name, self.pick(ModuleCall(f"nn.LeakyReLU({slope})"), f"h = F.leaky_relu(h, {slope})",
                                   f"h = F.leaky_relu(h, negative_slope={slope})", f"h = F.leaky_relu_(h, {slope})",
                                   f"h = F.leaky_relu(h, {slope}, inplace=True)", "h = F.leaky_relu(h)")
        if name == "gelu":
            approximate = self.pick("none", "tanh")
            return name, self.pick(ModuleCall(f"nn.GELU(approximate='{approximate}')"),
                                   f"h = F.gelu(h, approximate='{approximate}')", "h = F.gelu(h)", "h = nn.GELU()(h)")
        if name == "silu":
            return name, self.pick(ModuleCall("nn.SiLU()"), "h = F.silu(h)", "h = F.silu(h, inplace=True)",
                                   "h = h * torch.sigmoid(h)", "h = h * h.sigmoid()")
        if name == "mish":
            return name, self.pick(ModuleCall("nn.Mish()"), "h = F.mish(h)", "h = F.mish(h, inplace=True)",
                                   "h = h * torch.tanh(F.softplus(h))")
        if name in ("sigmoid", "tanh"):
            return name, self.pick(ModuleCall(f"nn.{name.capitalize()}()"), f"h = torch.{name}(h)",
                                   f"h = h.{name}()", f"h.{name}_()", f"h = torch.{name}_(h)", f"h = F.{name}(h)")
        if name == "elu":
            alpha = self.number(0.1, 2)
            return name, self.pick(ModuleCall(f"nn.ELU({alpha})"), f"h = F.elu(h, {alpha})",
                                   f"h = F.elu(h, alpha={alpha}, inplace=True)", "h = F.elu(h)",
                                   f"h = F.elu_(h, {alpha})")
        if name == "softplus":
            beta, threshold = self.number(0.2, 3), self.number(0.5, 20)
            return name, self.pick(ModuleCall(f"nn.Softplus({beta}, {threshold})"),
                                   f"h = F.softplus(h, {beta}, {threshold})", f"h = F.softplus(h, beta={beta})",
                                   "h = F.softplus(h)", f"h = F.softplus(h, threshold={threshold})")
        if name == "clamp":
            low, high = self.number(-2, 0), self.number(0, 2)
            return name, self.pick(f"h = torch.clamp(h, {low}, {high})", f"h = h.clamp(min={low})",
                                   f"h.clamp_({low}, {high})", f"h = torch.clamp_min(h, {low})",
                                   f"h = h.clamp_min_({low})", f"h = h.clip({low}, {high})",
                                   f"h = h.clamp(max={high})", f"h = torch.clamp(h, min={low}, max={high})",
                                   f"h = torch.clamp_max(h, {high})")
        if name == "selu":
            return name, self.pick(ModuleCall("nn.SELU()"), "h = F.selu(h)", "h = torch.selu(h)",
                                   "h = F.selu(h, inplace=True)")
        if name == "celu":
            alpha = self.number(0.2, 2)
            return name, self.pick(ModuleCall(f"nn.CELU({alpha})"), f"h = F.celu(h, {alpha})",
                                   f"h = torch.celu(h, alpha={alpha})")
        if name in ("hardswish", "hardsigmoid"):
            module = {"hardswish": "Hardswish", "hardsigmoid": "Hardsigmoid"}[name]
            return name, self.pick(ModuleCall(f"nn.{module}()"), f"h = F.{name}(h)",
                                   f"h = F.{name}(h, inplace=True)")
        if name == "logsigmoid":
            return name, self.pick(ModuleCall("nn.LogSigmoid()"), "h = F.logsigmoid(h)")
        if name in ("softsign", "tanhshrink"):
            module = {"softsign": "Softsign", "tanhshrink": "Tanhshrink"}[name]
            return name, self.pick(ModuleCall(f"nn.{module}()"), f"h = F.{name}(h)")
        if name == "abs":
            return name, self.pick("h = h.abs()", "h = torch.abs(h)", "h.abs_()", "h = abs(h)")
        if name == "neg":
            return name, self.pick("h = -h", "h = h.neg()", "h = torch.neg(h)", "h.neg_()")
        if name == "square":
            return name, self.pick("h = h ** 2", "h = h.pow(2)", "h = torch.square(h)", "h = h * h",
                                   "h = torch.pow(h, 2.0)")
        if name in ("sin", "erf", "atan"):
            return name, self.pick(f"h = torch.{name}(h)", f"h = h.{name}()", f"h.{name}_()")
        # prelu: one slope or one per feature (only where the chain's value still has its features)
        channels = self.features if self.state == "features" and r.random() < 0.5 else 1
        return name, self.module(f"nn.PReLU({channels}, init={self.number(0, 0.5)})")

    def with_number(self) -> tuple[str, str]:
        """(step name, line) of arithmetic with a Python number."""
        c = self.number(-2, 2) or 0.5
        p = self.number(0.5, 2)
        op = self.pick("add", "sub", "mul", "div", "rsub")
        lines = {
            "add": (f"h = h + {c}", f"h = {c} + h", f"h = torch.add(h, {c})", f"h = h.add({c})", f"h.add_({c})",
                    f"h += {c}", f"h = torch.add(h, other={c}, alpha=2)"),
            "sub": (f"h = h - {c}", f"h = torch.sub(h, {c})", f"h.sub_({c})", f"h -= {c}", f"h = h.subtract({c})"),
            "rsub": (f"h = {c} - h", f"h = torch.rsub(h, {c})"),
            "mul": (f"h = h * {c}", f"h = {c} * h", f"h = torch.mul(h, {c})", f"h.mul_({c})", f"h *= {c}",
                    f"h = h.multiply({c})"),
            "div": (f"h = h / {p}", f"h = torch.div(h, {p})", f"h.div_({p})", f"h /= {p}", f"h = h.true_divide({p})"),
        }[op]
        if self.rng.random() < 0.1:  # a number the caller passes
            y = self.argument("number")
            return f"{op}(number argument)", self.pick(f"h = h * {y}", f"h = {y} * h", f"h = h + {y}", f"h = h / {y}",
                                                       f"h.mul_({y})", f"h = torch.sub(h, {y})")
        if self.rng.random() < 0.1:  # a number read from the features, or an int
            return f"{op}(size or int)", self.pick("h = h * h.size(-1) ** -0.5", "h = h / h.shape[-1]",
                                                   "h = h * 2", "h = h / 3", "h = 1 - h", "h += 1")
        if self.rng.random() < 0.08:  # in place on a whole view
            return f"{op}(view in place)", self.pick(f"h[:, :].mul_({c})", f"h[...].add_({c})", f"h[:].sub_({c})")
        return f"{op}(number)", self.pick(*lines)

    def with_tensor(self) -> tuple[str, str]:
        """(step name, line) of arithmetic with a tensor: a parameter or a forward argument."""
        op = self.pick("add", "add", "sub", "mul", "mul", "div", "maximum", "minimum")
        positive = op == "div"
        source = self.pick("param_n", "param_1n", "param_0d", "arg_full", "arg_feat", "arg_row", "arg_scalar")
        if source.startswith("param"):
            shape = {"param_n": f"({self.features},)", "param_1n": f"(1, {self.features})",
                     "param_0d": "()"}[source]
            t = self.param(shape, positive=positive)
        else:
            t = self.argument(source[4:], positive=positive)
        lines = {
            "add": (f"h = h + {t}", f"h = {t} + h", f"h = torch.add(h, {t})", f"h.add_({t})", f"h += {t}",
                    f"h = torch.add(h, {t}, alpha=0.5)", f"h = h.add({t}, alpha=-1.5)", f"h.add_({t}, alpha=2)",
                    f"torch.add(h, {t}, out=h)", f"h = h.addcdiv({t}, {t}.abs() + 1, value=-0.5)"),
            "sub": (f"h = h - {t}", f"h = {t} - h", f"h = torch.sub(h, {t})", f"h.sub_({t})", f"h -= {t}",
                    f"h = torch.sub(h, {t}, alpha=2)"),
            "mul": (f"h = h * {t}", f"h = {t} * h", f"h = torch.mul(h, {t})", f"h.mul_({t})", f"h *= {t}",
                    f"h = h.addcmul({t}, {t}, value=0.5)", f"torch.mul(h, {t}, out=h)"),
            "div": (f"h = h / {t}", f"h = torch.div(h, {t})", f"h.div_({t})", f"h /= {t}"),
            "maximum": (f"h = torch.maximum(h, {t})", f"h = torch.max(h, {t})", f"h = h.maximum({t})"),
            "minimum": (f"h = torch.minimum(h, {t})", f"h = torch.min({t}, h)", f"h = h.minimum({t})"),
        }[op]
        return f"{op}({source})", self.pick(*lines)

    # ---------------------------------------------------------------------------------------------- norms

    def norm(self) -> tuple[str, str]:
        """(step name, line) of a norm over the features."""
        n = self.features
        eps = self.pick(1e-5, 1e-6, 0.001, 0.1)
        name = self.pick("group_norm", "layer_norm", "rms_norm")
        if name == "group_norm":
            groups = self.pick(*[g for g in range(1, n + 1) if n % g == 0])
            affine = self.rng.random() < 0.6
            if self.rng.random() < 0.5:
                return name, self.module(f"nn.GroupNorm({groups}, {n}, eps={eps}, affine={affine})", "norm")
            if affine:
                w, b = self.param(f"({n},)"), self.param(f"({n},)")
                return name, self.pick(f"h = F.group_norm(h, {groups}, {w}, {b}, {eps})",
                                       f"h = F.group_norm(h, num_groups={groups}, weight={w}, bias={b}, eps={eps})")
            return name, f"h = F.group_norm(h, {groups})"
        if name == "layer_norm":
            affine = self.rng.random() < 0.6
            if self.rng.random() < 0.5:
                bias = self.pick(True, False)
                return name, self.module(f"nn.LayerNorm({n}, eps={eps}, elementwise_affine={affine}, bias={bias})",
                                         "norm")
            w, b = (self.param(f"({n},)"), self.param(f"({n},)")) if affine else ("None", "None")
            shape = self.pick(f"({n},)", f"[{n}]", "h.shape[-1:]", "(h.size(-1),)")
            return name, self.pick(f"h = F.layer_norm(h, {shape}, {w}, {b}, {eps})",
                                   f"h = F.layer_norm(h, {shape}, weight={w}, bias={b}, eps={eps})",
                                   f"h = F.layer_norm(h, {shape})")
        if self.rng.random() < 0.4:
            affine = self.pick(True, False)
            return name, self.module(f"nn.RMSNorm({n}, eps={eps}, elementwise_affine={affine})", "norm")
        w = self.param(f"({n},)") if self.rng.random() < 0.6 else "None"
        return name, self.pick(f"h = F.rms_norm(h, ({n},), {w}, {eps})", f"h = F.rms_norm(h, h.shape[-1:], {w})",
                               f"h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + {eps})")

    # ---------------------------------------------------------------------------------------- row reductions

    def reduction(self) -> tuple[str, str]:
        """(step name, line) of a row reduction, softmax or log_softmax."""
        dim = self.pick(-1, -1, 1)
        keepdim = self.pick(True, False)
        name = self.pick("sum", "mean", "amax", "amin", "max", "min", "logsumexp", "softmax", "log_softmax",
                         "var", "std", "norm")
        if name in ("softmax", "log_softmax"):
            module = {"softmax": "Softmax", "log_softmax": "LogSoftmax"}[name]
            return f"{name}({dim})", self.pick(ModuleCall(f"nn.{module}(dim={dim})"), f"h = F.{name}(h, dim={dim})",
                                               f"h = torch.{name}(h, {dim})", f"h = h.{name}({dim})",
                                               f"h = F.{name}(h, {dim})")
        self.state = "row" if keepdim else "reduced"
        what = f"{name}({dim},{'keep' if keepdim else 'drop'})"
        if name in ("sum", "mean", "amax", "amin", "logsumexp"):
            return what, self.pick(f"h = torch.{name}(h, {dim}, keepdim={keepdim})",
                                   f"h = h.{name}(dim={dim}, keepdim={keepdim})",
                                   f"h = torch.{name}(h, dim={dim}, keepdim={keepdim})",
                                   f"h = h.{name}({dim}, {keepdim})")
        if name in ("max", "min"):
            return what, self.pick(f"h = torch.{name}(h, {dim}, keepdim={keepdim})[0]",
                                   f"h = h.{name}(dim={dim}, keepdim={keepdim}).values",
                                   f"h, _ = torch.{name}(h, {dim}, {keepdim})")
        if name in ("var", "std"):
            return what, self.pick(f"h = torch.{name}(h, {dim}, keepdim={keepdim})",
                                   f"h = h.{name}(dim={dim}, unbiased=False, keepdim={keepdim})",
                                   f"h = torch.{name}(h, dim={dim}, correction=0, keepdim={keepdim})")
        return what, self.pick(f"h = torch.linalg.vector_norm(h, dim={dim}, keepdim={keepdim})",
                               f"h = h.norm(dim={dim}, keepdim={keepdim})",
                               f"h = torch.norm(h, 2, {dim}, {keepdim})")

    # ------------------------------------------------------------------------------ residuals, no-ops, GEMMs

    def keep(self) -> tuple[str, str]:
        """(step name, line) keeping the chain's value under a name (an alias, or a copy), for a later residual."""
        name = self.fresh("k")
        self.kept.append(name)
        return f"keep {name}", self.pick(f"{name} = h", f"{name} = h.clone()")

    def residual(self) -> tuple[str, str]:
        """(step name, line) combining the value with a kept one, itself or the GEMM's input."""
        other = self.pick(*self.kept, "h", "x")
        lines = (f"h = h + {other}", f"h = {other} - h", f"h = h * {other}", f"h.add_({other})",
                 f"h = torch.maximum(h, {other})", f"h += {other}", f"h = h + {other}.detach()")
        return f"residual({other})", self.pick(*lines)

    def no_op(self) -> tuple[str, str]:
        """(step name, line) of an op that returns its input's values."""
        return "no-op", self.pick("h = h.clone()", "h = h.contiguous()", "h = F.dropout(h, 0.3, training=False)",
                                  "h = F.dropout(h, 0.0)", ModuleCall("nn.Identity()"), ModuleCall("nn.Dropout(0.0)"),
                                  "h = +h", "h = torch.positive(h)")

    def second_gemm(self) -> tuple[str, str]:
        """(step name, line) of another Linear of N to N features (a chain that a GEMM ends and starts)."""
        n = self.features
        return "linear", ModuleCall(f"nn.Linear({n}, {n}, bias={self.pick(True, False)})", "fc")

    # ---------------------------------------------------------------------------------------------- a chain

    def chain(self) -> None:
        """1 to MAX_STEPS epilogue steps after the GEMM."""
        for _ in range(self.rng.randint(1, MAX_STEPS)):
            if self.state == "features" and self.pool_rng.random() < 0.03:  # a pool in the chain: it does not fold
                self.pool()
            kinds = ["activation", "activation", "number", "tensor", "keep", "no-op"]
            if self.kept or self.rng.random() < 0.2:
                kinds += ["residual"]
            if self.state == "features":
                kinds += ["norm", "norm"] + (["second gemm"] if self.rng.random() < 0.3 else [])
            if self.reductions < 2:
                kinds += ["reduction"]
            kind = self.pick(*kinds)
            if kind == "reduction":
                self.reductions += 1
            step, line = {"activation": self.activation, "number": self.with_number, "tensor": self.with_tensor,
                          "norm": self.norm, "reduction": self.reduction, "keep": self.keep,
                          "residual": self.residual, "no-op": self.no_op, "second gemm": self.second_gemm}[kind]()
            if isinstance(line, ModuleCall):
                line = self.module(line.construction, line.stem)
            self.spec.steps.append(step)
            self.spec.forward_lines.append(line)


def draw_model(seed: int) -> ModelSpec:
    """The model of `seed`."""
    rng = random.Random(seed)
    leading = rng.choice([(), (1,), (2,), (3,), (5,), (1, 3), (2, 3), (3, 1), (2, 1, 3)])
    out_features = rng.choice([1, 2, 3, 5, 6, 8, 12, 15, 16, 24, 33, 48])
    spec = ModelSpec(in_features=rng.randint(1, 48), out_features=out_features,
                     leading=leading, dtype=rng.choice(DTYPES), train=rng.random() < 0.5,
                     with_examples=rng.random() < 0.5)
    if rng.random() < 0.2:  # a square GEMM, so that its input can be a residual
        spec.in_features = spec.out_features
    spec.autocast = spec.dtype == torch.float32 and rng.random() < 0.15
    spec.strided_input = rng.random() < 0.15
    spec.wrapped = rng.random() < 0.15
    spec.keywords = rng.random() < 0.15
    drawer = Drawer(rng, spec, random.Random(seed + 3_000_017), random.Random(seed + 5_000_011))
    drawer.prologue()
    drawer.gemm()
    drawer.chain()
    if drawer.kept and rng.random() < 0.3:  # an intermediate value returned too
        spec.returns.append(rng.choice(drawer.kept))
    return spec


def second_leading(seed: int, leading: tuple[int, ...]) -> tuple[int, ...]:
    """Leading dims of the second call: another batch size, sometimes another rank."""
    rng = random.Random(seed + 1_000_003)
    batch = rng.choice([b for b in (1, 2, 4, 7) if (leading[:1] or (None,))[0] != b])
    if rng.random() < 0.25:
        return rng.choice([(), (batch,), (batch, 2), (2, batch, 3)])
    return (batch, *leading[1:]) if leading else ()


def build(spec: ModelSpec, seed: int) -> nn.Module:
    """Instantiate the model's source (registered with linecache, so that inspect finds it)."""
    filename = f"<optimize_hunt seed {seed}>"
    source = spec.source()
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"torch": torch, "nn": nn, "F": F, "__name__": f"optimize_hunt_{seed}"}
    exec(compile(source, filename, "exec"), namespace)
    torch.manual_seed(seed)
    model = namespace["Model"]()
    if spec.wrapped:
        model = Untraceable(model)
    return model.to(spec.dtype).train(spec.train)


class Untraceable(nn.Module):
    """A parent whose forward branches on a tensor's values (fx can't trace it): optimize() fuses its child."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x, *args, **kwargs):
        if x.numel() > 0 and bool(x.reshape(-1)[0] > 1e9):
            return x
        return self.inner(x, *args, **kwargs)


# ------------------------------------------------------------------------------------------------ checking

class Failure(Exception):
    """A finding: `kind` is "bug", "noise" (rounding only) or "rank-limit" (fxfuse's own rank error)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _run(fn):
    """(result, None) or (None, exception)."""
    try:
        return fn(), None
    except Exception as error:  # noqa: BLE001 - comparing eager's errors with the optimized model's
        return None, error


def _excess(actual: torch.Tensor, expected: torch.Tensor, dtype) -> float:
    """How far `actual` is outside `expected`'s tolerance (<= 0: within it; inf for a NaN of one only)."""
    rtol, atol = DEFAULT_TOLERANCE.get(dtype, (1e-5, 1e-5))
    a, e = actual.detach().double(), expected.detach().double()
    both_nan = a.isnan() & e.isnan()
    same_inf = (a == e) & a.isinf()
    error = ((a - e).abs() - atol - rtol * e.abs()).nan_to_num(nan=float("inf"))
    error = error.masked_fill(both_nan | same_inf, -1.0)
    return float(error.max()) if error.numel() else -1.0


def _distance(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest absolute difference, relative to the reference's scale."""
    a, r = actual.detach().double(), reference.detach().double()
    finite = r.isfinite() & a.isfinite()
    if not finite.any():
        return 0.0
    scale = max(float(r[finite].abs().max()), 1e-3)
    return float((a - r)[finite].abs().max()) / scale


def _compare(what: str, fused: torch.Tensor, eager: torch.Tensor, reference, dtype, perturbed=None) -> None:
    """Raise Failure where `fused` is not eager's value; `reference()` gives the float64 value to judge noise by,
    `perturbed(k)` eager's value on the k-th change of its inputs and parameters by up to one ulp (or None)."""
    if not isinstance(fused, torch.Tensor) or fused.shape != eager.shape or fused.dtype != eager.dtype:
        raise Failure("bug", f"{what}: fused {_describe(fused)} vs eager {_describe(eager)}")
    if _excess(fused, eager, dtype) <= 0:
        return
    ref = reference()
    fused_distance, eager_distance = _distance(fused, ref), _distance(eager, ref)
    message = f"{what} differs: fused {fused_distance:.2e} vs eager {eager_distance:.2e} from float64"
    if fused_distance <= NOISE_FACTOR * eager_distance + 1e-6 or _excess(fused, ref, dtype) <= 0:
        raise Failure("noise", message)
    # how far eager's own value strays where the values it starts from move by a rounding
    distances = [_distance(value, ref) for value in map(perturbed or (lambda k: None), range(PERTURBATIONS))
                 if isinstance(value, torch.Tensor) and value.shape == ref.shape]
    if distances and fused_distance <= max(distances) + 1e-6:
        raise Failure("noise", f"{message}, eager's {max(distances):.2e} where its inputs and parameters change by "
                               "an ulp (ill-conditioned)")
    raise Failure("bug", message)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    return type(value).__name__


def _outputs(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _as_double(values: list) -> list:
    return [v.double() if isinstance(v, torch.Tensor) else v for v in values]


def _perturbed_copy(model: nn.Module, args: list, dtype: torch.dtype, seed: int):
    """(a copy of `model`, copies of `args`), each floating value of both multiplied by 1 + u, u uniform within one
    ulp of `dtype` (the dtype eager computes in): a change the size of a rounding."""
    generator = torch.Generator().manual_seed(seed)

    def changed(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point():
            return tensor.clone()
        factor = 1 + (torch.rand(tensor.shape, generator=generator, dtype=torch.float64) * 2 - 1) * \
            torch.finfo(dtype).eps
        return (tensor.double() * factor).to(tensor.dtype)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for tensor in (*copied.parameters(), *copied.buffers()):
            tensor.copy_(changed(tensor))
    return copied, [changed(a) if isinstance(a, torch.Tensor) else a for a in args]


def _gradients(model, inputs, params, context):
    """Gradients of sum(out * cotangent) over the outputs, for the tensor inputs and `params`, computed under
    `context`; (None, error) where it raises."""
    def compute():
        leaves = [t.detach().clone().requires_grad_(True) if isinstance(t, torch.Tensor) else t for t in inputs]
        with context():
            outputs = _outputs(model(*leaves))
        generator = torch.Generator().manual_seed(1234)
        loss = sum((out * torch.randn(out.shape, generator=generator, dtype=torch.float64).to(out.dtype)).sum()
                   for out in outputs)
        wanted = [t for t in leaves if isinstance(t, torch.Tensor)] + list(params)
        return torch.autograd.grad(loss, wanted, allow_unused=True)
    return _run(compute)


def _compare_outputs(what: str, fused, eager, reference, dtype, perturbed=None) -> None:
    """_compare for each output of a model; `perturbed(k)`: eager's outputs on the k-th perturbation, or None."""
    fused, eager = _outputs(fused), _outputs(eager)
    if len(fused) != len(eager):
        raise Failure("bug", f"{what}: {len(fused)} outputs, eager's {len(eager)}")
    cached = []
    cached_perturbed = {}  # k -> eager's outputs on the k-th perturbation (None where it raised)

    def reference_of(i):
        if not cached:
            cached.extend(_outputs(reference()))
        return cached[i]

    def perturbed_of(i, k):
        if k not in cached_perturbed:
            cached_perturbed[k] = _outputs(perturbed(k)) if perturbed is not None else None
        outputs = cached_perturbed[k]
        return outputs[i] if outputs is not None and i < len(outputs) else None
    for i, (f, e) in enumerate(zip(fused, eager)):
        _compare(f"{what} {i}" if len(eager) > 1 else what, f, e, lambda i=i: reference_of(i), dtype,
                 lambda k, i=i: perturbed_of(i, k))


def check(seed: int) -> tuple[ModelSpec, int, bool]:
    """Check the model of `seed`; return (spec, fused op count, whether eager raised at the first call) or raise
    Failure."""
    spec = draw_model(seed)
    model = build(spec, seed)
    generator = torch.Generator().manual_seed(seed)
    inputs = spec.inputs(spec.leading, generator)
    tolerance_dtype = torch.bfloat16 if spec.autocast else spec.dtype
    grad_mode = torch.enable_grad if spec.train else torch.no_grad

    def context():
        """The calls' autocast (or none)."""
        return torch.autocast("cpu", dtype=torch.bfloat16) if spec.autocast else contextlib.nullcontext()

    def call(module, args, grad=None):
        """module(*args) on copies of the tensors (a forward may change an argument in place)."""
        args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        with (grad or grad_mode)(), context():
            if spec.keywords:
                return module(**dict(zip(["x", *(arg[0] for arg in spec.extra_args)], args)))
            return module(*args)

    def reference_of(args):
        """The model's float64 outputs for `args`, without autocast."""
        double = copy.deepcopy(model).double()
        with torch.no_grad():
            return double(*_as_double([a.clone() if isinstance(a, torch.Tensor) else a for a in args]))

    def perturbed_eager(args, mode=None):
        """eager's outputs for `args` on the k-th change of them and the parameters by up to an ulp (None where it
        raises), as a function of k."""
        def outputs(k):
            changed_model, changed_args = _perturbed_copy(model, args, tolerance_dtype, k)
            return _run(lambda: call(changed_model, changed_args, mode))[0]
        return outputs

    eager, eager_error = _run(lambda: call(model, inputs))
    kept_inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in inputs]
    with context():
        optimized, error = _run(lambda: fxfuse.optimize(model, inputs if spec.with_examples else None))
    if error is not None:
        raise Failure("bug", f"optimize() raised {type(error).__name__}: {error}")
    if not all(torch.equal(a, b) for a, b in zip(inputs, kept_inputs) if isinstance(a, torch.Tensor)):
        raise Failure("bug", "optimize() changed its example inputs")
    count = fused_op_count(optimized)
    fused, fused_error = _run(lambda: call(optimized, inputs))
    again, _ = _run(lambda: call(model, inputs))
    if eager_error is not None:
        if fused_error is None:
            raise Failure("bug", f"eager raises {type(eager_error).__name__}: {eager_error}; the optimized model runs")
        return spec, count, True
    if fused_error is not None:
        raise Failure("rank-limit" if "fxfuse: this part of the model was optimized" in str(fused_error) else "bug",
                      f"optimized model raises {type(fused_error).__name__}: {fused_error}")
    if again is None or not all(torch.equal(a.nan_to_num(), e.nan_to_num())
                                for a, e in zip(_outputs(again), _outputs(eager))):
        raise Failure("bug", "optimize() changed the model's own results")
    _compare_outputs("output", fused, eager, lambda: reference_of(inputs), tolerance_dtype, perturbed_eager(inputs))

    params = [p for p in model.parameters() if p.requires_grad]
    eager_grads, eager_grad_error = _gradients(model, inputs, params, context)
    fused_grads, fused_grad_error = _gradients(optimized, inputs, params, context)
    if eager_grad_error is None:
        if fused_grad_error is not None:
            raise Failure("bug", f"backward raises {type(fused_grad_error).__name__}: {fused_grad_error}")
        names = [f"input {i}" for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)]
        names += [name for name, p in model.named_parameters() if p.requires_grad]

        def reference_gradients():
            double = copy.deepcopy(model).double()
            grads, _ = _gradients(double, _as_double(inputs), [p for p in double.parameters() if p.requires_grad],
                                  contextlib.nullcontext)
            return grads
        reference_grads = []
        perturbed_grads = {}  # k -> eager's gradients on the k-th perturbation (None where its backward raised)

        def perturbed_gradient(k, i):
            if k not in perturbed_grads:
                changed_model, changed_inputs = _perturbed_copy(model, inputs, tolerance_dtype, k)
                changed_params = [p for p in changed_model.parameters() if p.requires_grad]
                perturbed_grads[k] = _gradients(changed_model, changed_inputs, changed_params, context)[0]
            return None if perturbed_grads[k] is None else perturbed_grads[k][i]
        for i, (name, f, e) in enumerate(zip(names, fused_grads, eager_grads)):
            if (f is None) != (e is None):
                raise Failure("bug", f"gradient of {name}: {'missing' if f is None else 'unexpected'}")
            if f is not None:
                def reference(i=i):
                    if not reference_grads:
                        reference_grads.extend(reference_gradients())
                    return reference_grads[i]
                _compare(f"gradient of {name}", f, e, reference, tolerance_dtype,
                         lambda k, i=i: perturbed_gradient(k, i))
    elif "inplace operation" not in str(eager_grad_error) and fused_grad_error is None:
        raise Failure("bug", f"eager's backward raises {type(eager_grad_error).__name__}: {eager_grad_error}; "
                             "the optimized model's runs")

    leading = second_leading(seed, spec.leading)
    second = spec.inputs(leading, generator)
    second_mode = torch.inference_mode if seed % 3 == 0 else torch.no_grad
    eager2, eager2_error = _run(lambda: call(model, second, second_mode))
    fused2, fused2_error = _run(lambda: call(optimized, second, second_mode))
    where = f"second call with leading dims {leading}"
    if eager2_error is not None and fused2_error is None:
        raise Failure("bug", f"{where}: eager raises {type(eager2_error).__name__}: {eager2_error}; "
                             "the optimized model runs")
    if eager2_error is None and fused2_error is not None:
        kind = "rank-limit" if "fxfuse: this part of the model was optimized" in str(fused2_error) else "bug"
        raise Failure(kind, f"{where}: optimized model raises {type(fused2_error).__name__}: {fused2_error}")
    if eager2_error is None:
        _compare_outputs(where, fused2, eager2, lambda: reference_of(second), tolerance_dtype,
                         perturbed_eager(second, second_mode))

    copied, copy_error = _run(lambda: copy.deepcopy(optimized))
    if copy_error is not None:
        raise Failure("bug", f"deepcopy of the optimized model raises {type(copy_error).__name__}: {copy_error}")
    copied_out, copied_error = _run(lambda: call(copied, inputs))
    if copied_error is not None:
        raise Failure("bug", f"the optimized model's deepcopy raises {type(copied_error).__name__}: {copied_error}")
    _compare_outputs("the optimized model's deepcopy", copied_out, eager, lambda: reference_of(inputs),
                     tolerance_dtype, perturbed_eager(inputs))

    change = change_the_model(model, random.Random(seed + 2_000_003))
    eager3, eager3_error = _run(lambda: call(model, inputs))
    fused3, fused3_error = _run(lambda: call(optimized, inputs))
    where = f"after {change}"
    if eager3_error is not None and fused3_error is None:
        raise Failure("bug", f"{where}: eager raises {type(eager3_error).__name__}: {eager3_error}; "
                             "the optimized model runs")
    if eager3_error is None and fused3_error is not None:
        if not any(text in str(fused3_error) for text in FXFUSE_REFUSALS):
            raise Failure("bug", f"{where}: optimized model raises {type(fused3_error).__name__}: {fused3_error}")
    elif eager3_error is None:
        _compare_outputs(where, fused3, eager3, lambda: reference_of(inputs), tolerance_dtype,
                         perturbed_eager(inputs))
    return spec, count, False


# fxfuse's documented errors for a model changed after optimize() (docs/BACKEND.md, Limits)
FXFUSE_REFUSALS = ("run fxfuse.optimize() on the model again", "was in eval mode when it was fused",
                   "fxfuse: this part of the model was optimized")
# module settings the hunter changes after optimize(), and how
SETTINGS = {"negative_slope": lambda v: v + 0.25, "eps": lambda v: v * 10, "min_val": lambda v: v - 0.5,
            "max_val": lambda v: v + 0.5, "alpha": lambda v: v * 2, "beta": lambda v: v + 1, "threshold": lambda v: 1.0,
            "approximate": lambda v: "tanh" if v == "none" else "none", "inplace": lambda v: not v,
            "kernel_size": lambda v: (v[0] + 1,), "ceil_mode": lambda v: not v}


def change_the_model(model: nn.Module, rng: random.Random) -> str:
    """Change `model` after optimize(): a module's setting, its mode, or a parameter's values; say what."""
    choice = rng.random()
    settings = [(name, module, attribute) for name, module in model.named_modules()
                for attribute in SETTINGS
                if isinstance(getattr(module, attribute, None), (bool, int, float, str, tuple))]
    if choice < 0.4 and settings:
        name, module, attribute = rng.choice(settings)
        before = getattr(module, attribute)
        setattr(module, attribute, SETTINGS[attribute](before))
        return f"{name}.{attribute} = {getattr(module, attribute)!r} (was {before!r})"
    if choice < 0.7:
        model.train(not model.training)
        return f"model.train({model.training})"
    parameters = list(model.named_parameters())
    if not parameters:
        return "nothing"
    name, parameter = rng.choice(parameters)
    with torch.no_grad():
        parameter.mul_(-1.5)
    return f"{name} *= -1.5"


def rounds_number_arguments(spec: ModelSpec) -> bool:
    """Whether the fused op reads a number argument as a 0-d tensor of a 16-bit dtype, rounded first where eager
    computes with the number (docs/BACKEND.md, Limits: "A number passed as a forward argument, without example
    inputs")."""
    sixteen_bit = spec.autocast or spec.dtype in (torch.bfloat16, torch.float16)
    return sixteen_bit and not spec.with_examples and any(arg[1] == "number" for arg in spec.extra_args)


def describe_mode(spec: ModelSpec) -> str:
    """dtype, mode, example inputs or not, x's leading dims, autocast and strides, in a few words."""
    words = [str(spec.dtype).removeprefix("torch."), "train" if spec.train else "eval",
             "examples" if spec.with_examples else "no-examples", f"x{spec.leading}"]
    words += ["autocast"] if spec.autocast else []
    words += ["strided x"] if spec.strided_input else []
    words += ["wrapped"] if spec.wrapped else []
    words += ["keywords"] if spec.keywords else []
    return " ".join(words)


def reproducer(seed: int, spec: ModelSpec) -> str:
    """A stand-alone script that builds the model of `seed` and runs it eager and optimized."""
    leading = second_leading(seed, spec.leading)
    return f"""# optimize_hunt seed {seed}: {describe_mode(spec)}; second call's leading dims {leading}
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse


{spec.source()}

import sys; sys.path.insert(0, "dev")
from optimize_hunt import draw_model
spec = draw_model({seed})
torch.manual_seed({seed})
model = Model().to({spec.dtype}).train({spec.train})
generator = torch.Generator().manual_seed({seed})
inputs = spec.inputs({spec.leading}, generator)
optimized = fxfuse.optimize(model, {"inputs" if spec.with_examples else "None"})
print(fxfuse.explain(model, {"inputs" if spec.with_examples else "None"}))
print(model(*inputs))
print(optimized(*inputs))
"""


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout()


def parse_seeds(text: str) -> list[int]:
    """"0:300" or "5" or "3,17,40"."""
    seeds = []
    for part in text.split(","):
        if ":" in part:
            start, stop = part.split(":")
            seeds += range(int(start), int(stop))
        else:
            seeds.append(int(part))
    return seeds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0:300", help="a range start:stop, or seeds separated by commas")
    parser.add_argument("--show", action="store_true", help="print each failing model's source and traceback")
    parser.add_argument("--dump", help="a folder to write each failing model's source to")
    parser.add_argument("--noise", action="store_true", help="list rounding-noise findings too")
    parser.add_argument("--max-steps", type=int, default=MAX_STEPS, help="the most epilogue steps of a chain")
    args = parser.parse_args(argv)
    globals()["MAX_STEPS"] = args.max_steps
    signal.signal(signal.SIGALRM, _alarm)
    warnings.filterwarnings("ignore")  # eager's own warnings (std of one value...), once per model
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)  # eager's errors, met again
    torch.set_num_threads(1)
    findings = {"bug": [], "noise": [], "rank-limit": []}
    fused = models = eager_raised = 0
    started = time.time()
    for seed in parse_seeds(args.seeds):
        models += 1
        signal.alarm(MODEL_TIMEOUT_S)
        try:
            spec, count, raised = check(seed)
            fused += count > 0
            eager_raised += raised
        except Failure as failure:
            spec = draw_model(seed)
            if failure.kind == "bug" and " differs" in str(failure) and rounds_number_arguments(spec):
                failure.kind = "noise"
            findings[failure.kind].append((seed, spec, str(failure).splitlines()[0][:300]))
            if args.show and (failure.kind != "noise" or args.noise):
                print(f"--- seed {seed} ({failure.kind}): {failure}\n{spec.source()}")
                traceback.print_exc()
        except Timeout:
            findings["bug"].append((seed, draw_model(seed), f"took more than {MODEL_TIMEOUT_S} s"))
        except Exception as error:  # noqa: BLE001 - a crash of the hunter itself
            findings["bug"].append((seed, draw_model(seed), f"hunter crashed: {type(error).__name__}: {error}"))
            if args.show:
                traceback.print_exc()
        finally:
            signal.alarm(0)
        if args.dump and any(s == seed for kind in ("bug", "rank-limit") for s, _, _ in findings[kind]):
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, f"seed_{seed}.py"), "w") as file:
                file.write(reproducer(seed, draw_model(seed)))
    print(f"{models} models ({eager_raised} where eager raises), {fused} fused, {len(findings['bug'])} failures, "
          f"{len(findings['rank-limit'])} "
          f"fxfuse rank errors, {len(findings['noise'])} rounding-noise differences ({time.time() - started:.0f} s)")
    shown = ("bug", "rank-limit", "noise") if args.noise else ("bug", "rank-limit")
    for kind in shown:
        for seed, spec, message in findings[kind]:
            print(f"  [{kind}] seed {seed} ({describe_mode(spec)}; {' > '.join(spec.steps)}): {message}")
    return 1 if findings["bug"] else 0


if __name__ == "__main__":
    sys.exit(main())
