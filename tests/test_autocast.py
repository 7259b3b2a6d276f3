"""Optimized and compiled models under torch.autocast. Where every param of a region is already in autocast's
dtype (or it has none), the fused op runs its GEMM and epilogue in that dtype, as eager's linear does, and returns
the dtype eager's ops would (bf16 after a GELU; fp32 after an op that CUDA's autocast runs in fp32); a param in
another dtype (an fp32 norm affine, an fp32 residual) is never rounded to fit: the region's ops then run unfused,
under autocast, as eager's; one that autocast casts itself (prelu's slopes) is cast as eager's. Gradients come back
in the weights' dtype. A region never spans the start or end of an autocast block.
"""
import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fxfuse
from epilogue_models import fused_programs
from fxfuse.testing import assert_close_report, fused_op_count

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class LinearThen(nn.Module):
    def __init__(self, tail, in_features=32, out_features=24):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.shift = nn.Parameter(torch.randn(out_features) * 100.0)
        self.norm = nn.GroupNorm(4, out_features)
        self.act = nn.PReLU(out_features, init=-0.25)
        self.tail = tail

    def forward(self, x):
        return self.tail(self, x)


# name: (forward, whether the fused op runs below autocast; otherwise eager's ops run unfused)
TAILS = {
    "gelu": (lambda m, x: F.gelu(m.fc(x)), True),                         # bf16 under autocast
    "group_norm without affine, hardtanh": (lambda m, x: F.hardtanh(F.group_norm(m.fc(x), 4)), True),
    "row min plus a number": (lambda m, x: torch.min(F.group_norm(m.fc(x), 4), 1, keepdim=True)[0] + 1.5, True),
    "addmm then relu": (lambda m, x: torch.relu(torch.addmm(m.fc.bias, x, m.fc.weight.t())), True),
    "an fp32 residual": (lambda m, x: F.silu(m.fc(x)) + m.shift, False),  # promoted to fp32, never rounded
    "group_norm's fp32 affine": (lambda m, x: F.hardtanh(m.norm(m.fc(x)), -2.0, 2.0), False),
    "prelu's fp32 slopes": (lambda m, x: F.prelu(m.fc(x), m.norm.weight * -0.25), True),  # autocast casts both
    "nn.PReLU's fp32 weight": (lambda m, x: m.act(m.fc(x)), True),
}


class FusedOpDtypes(TorchDispatchMode):
    """Records the dtypes of (x, weight) of every fused-op call below autocast, and every other op's name."""

    def __init__(self):
        super().__init__()
        self.fused, self.others = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fxfuse":
            self.fused.append((args[0].dtype, args[1].dtype))
        else:
            self.others.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _model(name, device, mode):
    torch.manual_seed(0)
    model = LinearThen(TAILS[name][0]).to(device).train(mode == "train")
    return model, torch.randn(16, 32, device=device)


def _check_under_autocast(model, candidate, x, device, fused_below=None):
    """`candidate` under autocast returns eager's dtype and values. With `fused_below` set (not for compiled code,
    which a dispatch mode would keep from running), whether its fused op ran below autocast with bf16 x and weight,
    or eager's ops ran instead."""
    with torch.autocast(device, dtype=torch.bfloat16):
        expected = model(x)
        with FusedOpDtypes() if fused_below is not None else contextlib.nullcontext() as spied:
            actual = candidate(x)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    if fused_below is not None:
        wanted = [(torch.bfloat16, torch.bfloat16)] if fused_below else []
        assert spied.fused == wanted, (spied.fused, spied.others)
        assert fused_below or "gelu" in spied.others or spied.others, spied.others
    assert_close_report(actual.float(), expected.float(), rtol=1e-2, atol=1e-2)
    return actual, expected


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", sorted(TAILS))
def test_optimized_model_under_autocast(name, mode):
    model, x = _model(name, "cpu", mode)
    optimized = fxfuse.optimize(model, (x,))
    assert fused_op_count(optimized) == 1
    actual, _ = _check_under_autocast(model, optimized, x, "cpu", fused_below=TAILS[name][1])
    if mode == "train":  # the casts are autograd's: the gradients come back in the weights' dtype
        actual.float().sum().backward()
        assert model.fc.weight.grad.dtype == torch.float32 and model.fc.weight.grad.abs().sum() > 0


def test_prelu_of_a_bf16_model_with_slopes_per_token_under_autocast_is_eagers():
    """prelu reads its slopes along dim 1, the tokens of a 3-D output: the fake run that finds the result's dtype
    under autocast kept that dim (it made it 1, and prelu raised for slopes as many as the features)."""
    model = nn.Sequential(nn.Linear(6, 8), nn.PReLU(8, init=-0.5)).to(torch.bfloat16)
    x = torch.randn(2, 8, 6, dtype=torch.bfloat16)
    optimized = fxfuse.optimize(model, (x,))
    assert fused_op_count(optimized) == 1
    _check_under_autocast(model, optimized, x, "cpu", fused_below=True)


@pytest.mark.parametrize("with_examples", [True, False], ids=["example-inputs", "no-example-inputs"])
def test_group_norm_of_one_channel_per_group_under_autocast_is_eagers(with_examples):
    """group_norm raises for groups of one value (a row of one channel per group): the fake run that finds the
    result's dtype under autocast made the rows one, and raised ValueError where eager's rows are 16."""
    model = nn.Sequential(nn.Linear(32, 24), nn.GroupNorm(24, 24, affine=False)).eval()
    x = torch.randn(16, 32)
    optimized = fxfuse.optimize(model, (x,) if with_examples else None)
    assert fused_op_count(optimized) == 1
    _check_under_autocast(model, optimized, x, "cpu", fused_below=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for candidate in (model, optimized):  # (a batch of one row is groups of one value: eager's error)
            with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
                candidate(torch.randn(1, 32))


@pytest.mark.parametrize("name", ["prelu's fp32 slopes", "nn.PReLU's fp32 weight"])
def test_prelu_of_fp32_slopes_under_autocast_is_eagers_bit_for_bit(name):
    """Autocast runs prelu in its lower dtype (its lower_precision_fp lists, CPU and CUDA), casting the fp32 slopes:
    the fused op takes them cast so, and on the CPU computes eager's bf16 result exactly."""
    model, x = _model(name, "cpu", "eval")
    optimized = fxfuse.optimize(model, (x,))
    actual, expected = _check_under_autocast(model, optimized, x, "cpu", fused_below=True)
    assert actual.dtype == torch.bfloat16 and torch.equal(actual, expected)


def test_an_fp32_residual_keeps_eagers_precision():
    """An fp32 param added under autocast is eager's exactly: not rounded to bf16 (a residual of 100s would lose
    its last 8 bits)."""
    model, x = _model("an fp32 residual", "cpu", "eval")
    optimized = fxfuse.optimize(model, (x,))
    actual, expected = _check_under_autocast(model, optimized, x, "cpu", fused_below=False)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_optimize_inside_an_autocast_block_leaves_the_eager_model_as_it_was(mode):
    """autocast caches its bf16 cast of each weight until the outermost block ends: the fake shapes run of
    optimize() cast the real weights under the caller's autocast, and the eager model then read a fake bf16
    weight from that cache for the rest of the block (a FakeTensor result, or an error)."""
    model, x = _model("gelu", "cpu", mode)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a block of its own: optimize() comes first in it
        optimized = fxfuse.optimize(model, (x,))
        after, actual = model(x), optimized(x)
    assert type(after) is torch.Tensor and type(actual) is torch.Tensor, (type(after), type(actual))
    assert torch.equal(after, expected)
    assert_close_report(actual.float(), expected.float(), rtol=1e-2, atol=1e-2)
    if mode == "train":  # and the casts it reads carry autograd's history: the weights get their gradients
        after.float().sum().backward()
        assert model.fc.weight.grad is not None and model.fc.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", sorted(TAILS))
def test_compiled_model_under_autocast(name, inner):
    model, x = _model(name, "cpu", "eval")
    backend = fxfuse.make_backend(inner=inner)
    compiled = torch.compile(model, backend=backend)
    _check_under_autocast(model, compiled, x, "cpu")
    assert [len(report.fused) for report in backend.reports] == [1]


def test_a_caller_dispatch_mode_sees_no_fake_tensors():
    """The result dtype is found on fake tensors with the caller's modes set aside: a mode around the first call
    sees the fused op and real tensors only."""
    model, x = _model("gelu", "cpu", "eval")
    optimized = fxfuse.optimize(model, (x,))
    fxfuse.library._autocast_result_dtypes.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16), FusedOpDtypes() as spied:
        optimized(x)
    assert spied.fused == [(torch.bfloat16, torch.bfloat16)]
    assert not [name for name in spied.others if name.startswith("empty")], spied.others


class AutocastOffInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 24)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            h = F.gelu(self.fc(x))
        return h * 2.0


def test_a_region_never_spans_an_autocast_blocks_end():
    """Dynamo's graph holds the block's end between the GELU and the multiply: the fused op stops at the GELU,
    inside the block, where its GEMM runs in fp32 as eager's."""
    torch.manual_seed(0)
    model, x = AutocastOffInside().eval(), torch.randn(16, 32)
    backend = fxfuse.make_backend(inner="aot_eager")
    compiled = torch.compile(model, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, actual = model(x), compiled(x)
    assert actual.dtype == expected.dtype == torch.float32
    assert_close_report(actual, expected, rtol=1e-5, atol=1e-5)
    (report,) = backend.reports
    assert [row.program for row in report.fused] == ["gelu(%0,'none')"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", sorted(TAILS))
def test_optimized_model_under_cuda_autocast(name, mode, caplog):
    """On CUDA autocast runs group_norm in fp32: eager's result is fp32 there, and so is fxfuse's; the fused op
    gets bf16 tensors only, which the kernels take (no fallback logged). In train mode the gradients (through the
    C++ autograd formula, kernels/autograd.cpp) are eager's, in the params' dtype."""
    model, x = _model(name, "cuda", mode)
    optimized = fxfuse.optimize(model, (x,))
    with caplog.at_level("DEBUG", logger="fxfuse"):
        actual, expected = _check_under_autocast(model, optimized, x, "cuda", fused_below=TAILS[name][1])
    assert not [r for r in caplog.records if "runs the reference" in r.getMessage()]
    if mode == "train":
        params = list(model.parameters())  # each tail leaves some unused (allow_unused)
        # A random cotangent: square().sum() of a group_norm's output is nearly constant, so its gradient is
        # mostly cancellation, which bf16 rounding swamps (fc.weight's was 8e-2 off eager's on an H100).
        cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1)).to(expected.device)
        fused_grads = torch.autograd.grad(actual, params, cotangent.to(actual.dtype), allow_unused=True)
        eager_grads = torch.autograd.grad(expected, params, cotangent.to(expected.dtype), allow_unused=True)
        for (what, param), fused, eager in zip(model.named_parameters(), fused_grads, eager_grads):
            assert (fused is None) == (eager is None), what
            if eager is None:
                continue
            assert fused.dtype == param.dtype
            error = ((fused.double() - eager.double()).norm() / eager.double().norm()).item()
            assert error < 2e-2, f"{what}'s gradient is {error:.2e} off eager's under autocast"


def test_optimize_leaves_a_forward_with_an_autocast_block_to_its_children():
    """An fx trace would drop the block: its GEMM would then follow the caller's autocast. optimize() leaves the
    model's own forward, whose result is eager's (fp32 from inside the block)."""
    torch.manual_seed(0)
    model, x = AutocastOffInside().eval(), torch.randn(16, 32)
    optimized = fxfuse.optimize(model, (x,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, actual = model(x), optimized(x)
    assert actual.dtype == expected.dtype == torch.float32
    assert torch.equal(actual, expected)
    (skipped,) = optimized.fxfuse_report.skipped
    assert "switches autocast" in skipped.reason, skipped.reason


class SwitchesAutocastAroundItsGemm(nn.Module):
    """Calls an autocast setter as a function (no `with` block) before its GEMM, and puts the setting back as it
    was between the GEMM and the epilogue."""

    def __init__(self, setter):
        super().__init__()
        self.fc = nn.Linear(32, 24)
        self.read, self.write, self.value = AUTOCAST_SETTERS[setter]

    def forward(self, x):
        before = self.read()
        self.write(self.value)
        h = self.fc(x)
        self.write(before)
        return torch.tanh(h) * 3.0


# name: (what reads the setting, the setter, the value it sets for the GEMM)
AUTOCAST_SETTERS = {
    "set_autocast_enabled": (lambda: torch.is_autocast_enabled("cpu"),
                             lambda value: torch.set_autocast_enabled("cpu", value), False),
    "set_autocast_dtype": (lambda: torch.get_autocast_dtype("cpu"),
                           lambda value: torch.set_autocast_dtype("cpu", value), torch.float16),
    "set_autocast_cpu_enabled": (lambda: torch.is_autocast_cpu_enabled(),  # deprecated aliases
                                 lambda value: torch.set_autocast_cpu_enabled(value), False),
}


def _under_bf16_autocast(model, compiled, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x), compiled(x)


@pytest.mark.parametrize("setter", ["set_autocast_enabled", "set_autocast_dtype"])
def test_a_region_never_spans_an_autocast_setter_call(setter):
    """Dynamo's graph holds the setter itself (torch.set_autocast_dtype, ...), not an `_enter_autocast`: the
    region stopped only at a block's start or end, so the fused op ran its GEMM under the epilogue's setting, the
    caller's bf16 (eager's GEMM ran in fp32 or fp16)."""
    torch.manual_seed(0)
    model, x = SwitchesAutocastAroundItsGemm(setter).eval(), torch.randn(16, 32)
    backend = fxfuse.make_backend(inner="aot_eager")
    expected, actual = _under_bf16_autocast(model, torch.compile(model, backend=backend), x)
    assert_close_report(actual, expected)
    reasons = [row.reason for report in backend.reports for row in report.near_misses]
    assert any("switches autocast" in reason for reason in reasons), reasons


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.set_autocast_cpu_enabled's
@pytest.mark.parametrize("setter", ["set_autocast_dtype", "set_autocast_cpu_enabled"])
def test_optimize_leaves_a_forward_that_calls_an_autocast_setter_to_its_children(setter):
    """An fx trace runs the setter at trace time and records nothing of it: the GEMM followed the caller's
    autocast (bf16 where eager's ran in fp16 or fp32). Only torch.set_autocast_enabled was watched."""
    if not hasattr(torch, setter):
        pytest.skip(f"this torch has no torch.{setter}")
    torch.manual_seed(0)
    model, x = SwitchesAutocastAroundItsGemm(setter).eval(), torch.randn(16, 32)
    optimized = fxfuse.optimize(model, (x,))
    expected, actual = _under_bf16_autocast(model, optimized, x)
    assert_close_report(actual, expected)
    (skipped,) = optimized.fxfuse_report.skipped
    assert "switches autocast" in skipped.reason, skipped.reason


class InPlaceBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.b = nn.Linear(32, 24), nn.Parameter(torch.randn(24))

    def forward(self, x):
        out = self.fc(x)
        out += self.b
        return torch.relu(out)


class InPlaceResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        out = self.fc(x)
        out += x
        return torch.relu(out)


@pytest.mark.parametrize("model_class", [InPlaceBias, InPlaceResidual], ids=["out += self.b", "out += x"])
def test_an_in_place_op_with_an_fp32_operand_keeps_the_autocast_dtype_in_optimizes_model(model_class):
    """optimize() traces without autocast, where both operands are fp32: its program said add, and under bf16
    autocast its reference (the param is not bf16) added out of place, promoting eager's bf16 `out` to fp32. The
    program now says add_ (program.py), which keeps the changed value's dtype."""
    torch.manual_seed(0)
    model, x = model_class().eval(), torch.randn(8, 32)
    optimized = fxfuse.optimize(model, (x,))
    assert fused_programs(optimized) == ["add_(%0,$0);relu(%1)"]
    expected, actual = _under_bf16_autocast(model, optimized, x)
    assert actual.dtype == expected.dtype == torch.bfloat16
    assert_close_report(actual, expected)


def test_an_in_place_op_with_an_fp32_param_keeps_the_autocast_dtype_under_the_backend():
    """`out += self.b` keeps bf16 `out` bf16 in eager; the backend fused it as an add, which under autocast ran with
    the fp32 param unfused and promoted the result to fp32. Its program says add_ now."""
    model, x = InPlaceBias().eval(), torch.randn(8, 32)
    backend = fxfuse.make_backend(inner="eager")
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        expected = model(x)
        actual = torch.compile(model, backend=backend)(x)
    assert actual.dtype == expected.dtype == torch.bfloat16
    assert_close_report(actual, expected)
    assert [row.program for report in backend.reports for row in report.fused] == ["add_(%0,$0);relu(%1)"]


class ExpInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 24)

    def forward(self, x):
        out = self.fc(x)
        out.exp_()
        return out


@pytest.fixture
def cpu_autocast_runs_exp_in_fp32():
    """CUDA's autocast policy for aten::exp (float32; its in-place exp_ has none), given to CPU's autocast for one
    test: CPU's runs every op of the vocabulary in its own dtype."""
    key = torch._C.DispatchKey.AutocastCPU

    def exp_in_fp32(t):
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return torch.exp(t.float())

    library = torch.library.Library("aten", "IMPL")
    library.impl("exp", exp_in_fp32, "AutocastCPU")
    from fxfuse import library as fxfuse_library
    cached = dict(fxfuse_library._autocast_result_dtypes)
    try:
        yield
    finally:
        library._destroy()
        fxfuse_library._autocast_result_dtypes.clear()
        fxfuse_library._autocast_result_dtypes.update(cached)


@pytest.mark.parametrize("front_door", ["optimize", "backend"])
def test_an_in_place_unary_op_keeps_its_value_dtype_where_autocast_runs_its_op_in_fp32(cpu_autocast_runs_exp_in_fp32,
                                                                                        front_door):
    """`out.exp_()` keeps bf16 `out` bf16 under CUDA's autocast, which runs the out-of-place exp (and log, rsqrt,
    pow, softplus...) in fp32 but leaves in-place ops alone. Only an in-place op with another tensor operand was an
    in-place instruction: the program said exp, whose result the fused op returned in fp32."""
    torch.manual_seed(0)
    model, x = ExpInPlace().eval(), torch.randn(8, 32)
    if front_door == "optimize":
        fused = fxfuse.optimize(model, (x,))
    else:
        torch._dynamo.reset()
        fused = torch.compile(model, backend=fxfuse.make_backend(inner="eager"))
    with torch.no_grad():
        expected, actual = _under_bf16_autocast(model, fused, x)
    assert actual.dtype == expected.dtype == torch.bfloat16
    assert_close_report(actual, expected)
