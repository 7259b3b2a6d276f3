"""GPU tests of the CUDA implementation of torch.ops.fxfuse.gemm_epilogue and gemm_epilogue_train (kernels/), run
with `pytest -m cuda`.

Every result is compared with the reference interpreter (fxfuse.program.run_reference) run on float64 copies of
the same inputs, by ||out - ref|| / ||ref|| against the bound of the dtype: 1e-5 fp32 (IEEE GEMM), 5e-4 tf32,
1e-2 bf16 / fp16. Inputs are fresh random draws (never zeros); outputs that the kernels allocate are poisoned
with NaN beforehand, and no NaN may appear where the reference has none. Every program that `run_and_check`
runs goes through both ops: the training op's result is judged the same way, and its GEMM output must be
eager's linear, untouched by the epilogue and in memory of its own.
"""
import logging
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn

import fxfuse
from fxfuse import kernels
from fxfuse.epilogue import EPILOGUE_OPS, NORM, POINTWISE, REDUCTION
from fxfuse.program import Instruction, Param, Program, Value, run_program, run_reference

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BOUNDS = {"fp32": 1e-5, "tf32": 5e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EXAMPLES = {
    "linear_hardtanh_mish_groupnorm": "add(%0,$0);hardtanh(%1,-1.0,1.0);mish(%2);group_norm(%3,$1,$2,256,1e-05)",
    "linear_groupnorm_min_bias": "group_norm(%0,$0,$1,512,1e-05);min_dim(%1,1,True);add(%2,$2)",
    "linear_groupnorm_leakyrelu_sum": "group_norm(%0,$0,$1,512,1e-05);leaky_relu(%1,0.01);add(%2,%2)",
    "linear_groupnorm_hardtanh": "group_norm(%0,$0,$1,16,1e-05);hardtanh(%1,-2.0,2.0)",
}


@pytest.fixture(scope="module", autouse=True)
def loaded_kernels():
    assert kernels.load(), "the CUDA kernels did not build or load"


@pytest.fixture
def precision(request):
    """Sets torch's TF32 flag for the test's precision name, and restores it."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = request.param == "tf32"
    yield request.param
    torch.backends.cuda.matmul.allow_tf32 = before


def bound_for(precision):
    return BOUNDS[precision] if precision in BOUNDS else BOUNDS[DTYPES[precision]]


def linear_inputs(m, k, n, dtype, lead=None, device="cuda"):
    bound = k ** -0.5
    x = torch.randn(*(lead or (m,)), k, device=device).to(dtype)
    weight = torch.empty(n, k, device=device).uniform_(-bound, bound).to(dtype)
    bias = torch.empty(n, device=device).uniform_(-bound, bound).to(dtype)
    return x, weight, bias


def poison_allocator(*shapes, dtype, device="cuda"):
    """Leaves NaN in the allocator's free blocks of these shapes, so an output the kernels allocate and fail to
    write shows up as NaN."""
    for shape in shapes:
        torch.full(shape, float("nan"), device=device, dtype=dtype)


def reference_program(program, dtype):
    """The program for a float64 reference of a run in `dtype`: rms_norm's eps=None means the epsilon of float32,
    which eager's rms_norm computes bf16 and fp16 in (finfo(dtype).eps here hid a kernel that used bf16's)."""
    instructions = []
    for ins in Program.parse(program).instructions:
        if ins.op == "rms_norm" and ins.attrs == (None,):
            ins = Instruction(ins.op, ins.operands, (torch.finfo(torch.float32).eps,))
        instructions.append(ins)
    return str(Program(tuple(instructions)))


def assert_close_to_reference(out, x, weight, bias, params, program, bound):
    as64 = lambda t: None if t is None else t.double()
    ref = run_reference(as64(x), as64(weight), as64(bias), [as64(p) for p in params],
                        reference_program(program, x.dtype))
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert out.dtype == x.dtype
    got = out.double()
    unwritten = torch.isnan(got) & ~torch.isnan(ref)
    diff = (got - ref).nan_to_num(nan=float("inf")).abs()
    worst = torch.argmax(torch.where(unwritten, torch.inf, diff).flatten()).item()
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), ref.shape))
    where = f"worst at {index}: got {got.flatten()[worst].item()!r}, reference {ref.flatten()[worst].item()!r}"
    assert not unwritten.any(), f"{program}: {int(unwritten.sum())} NaN where the reference has none; {where}"
    error = relative_error(got, ref)
    if x.dtype != torch.float32:
        # bf16 / fp16: no worse than eager in that dtype where eager itself misses the bound (ill-conditioned ops:
        # a softplus threshold or a 2-element group flips on the GEMM output's own rounding)
        eager = run_reference(x, weight, bias, params, program).double()
        bound = max(bound, 1.5 * relative_error(eager, ref))
    assert error <= bound, f"{program}: relative error {error:.3g} > {bound:g}; {where}"


def relative_error(got, ref):
    finite = torch.isfinite(ref)
    norm = torch.linalg.vector_norm(ref[finite]).item()
    return torch.linalg.vector_norm((got - ref)[finite]).item() / max(norm, 1e-30)


def run_and_check(program, x, weight, bias, params, bound, out_shape=None):
    gemm_shape = (*x.shape[:-1], weight.shape[0])
    poison_allocator(out_shape or gemm_shape, dtype=x.dtype, device=x.device)
    out = torch.ops.fxfuse.gemm_epilogue(x, weight, bias, params, program)
    assert_close_to_reference(out, x, weight, bias, params, program, bound)
    poison_allocator(out_shape or gemm_shape, gemm_shape, dtype=x.dtype, device=x.device)
    outputs = torch.ops.fxfuse.gemm_epilogue_train(x, weight, bias, params, program)
    assert_training_outputs(outputs, x, weight, bias, params, program, bound)
    return out


def assert_training_outputs(outputs, x, weight, bias, params, program, bound):
    """gemm_epilogue_train's (out, gemm_out): the fused result, and apart from it the GEMM output (not overwritten
    by the epilogue; cuBLASLt's algorithm may differ from F.linear's, so it is judged against float64 too)."""
    out, gemm_out = outputs
    assert_close_to_reference(out, x, weight, bias, params, program, bound)
    assert not torch._C._is_alias_of(out, gemm_out), f"{program}: the training op's outputs share memory"
    assert_close_to_reference(gemm_out, x, weight, bias, [], "", bound)


def test_every_vocabulary_op_is_supported():
    missing = set(EPILOGUE_OPS) - set(kernels.supported_ops())
    assert not missing, f"ops without a CUDA functor: {sorted(missing)}"


# ---------------------------------------------------------------- each op, with each of its sample attributes

def op_programs(name, n):
    """(program, params factory) pairs exercising op `name` on the GEMM output."""
    spec = EPILOGUE_OPS[name]
    cases = []
    for attrs in spec.samples:
        attr_values = tuple(attrs[a] for a in spec.attrs)
        if spec.is_binary:
            # a GEMM output divisor is kept away from 0 (1 / x near 0 amplifies the GEMM's own rounding)
            prefix, v = ("abs(%0);add(%1,1.0);", Value(2)) if name == "div" else ("", Value(0))
            numbers = [(v, 2.5)] * (1 in spec.number_operands) + [(1.5, v)] * (0 in spec.number_operands)
            for a, b in [(v, Param(0)), (Param(0), v), *numbers, (v, v)]:
                cases.append((prefix + str(Instruction(name, (a, b), ())), "feature"))
            cases.append((str(Instruction(name, (Value(0), Param(0)), ())), "full"))
            cases.append((str(Instruction(name, (Value(0), Param(0)), ())), "row"))
        elif name == "prelu":
            cases.append(("prelu(%0,$0)", "slopes"))
            cases.append(("prelu(%0,$0)", "one"))
        elif spec.kind == POINTWISE and name == "batch_norm":
            cases.append((str(Instruction(name, (Value(0), Param(0), Param(1), Param(2), Param(3)), attr_values)),
                          "batch_norm"))
        elif spec.kind == POINTWISE:
            prefix = "abs(%0);add(%1,0.5);" if spec.positive_domain else ""  # positive, away from 0
            # in (0, 1) for |GEMM output| < 4 (7 sigma), exactly in every dtype (a sigmoid made -200 a float32 0,
            # -inf from logit where float64's was -200)
            prefix = "mul(%0,0.125);add(%1,0.5);" if spec.unit_domain else prefix
            first = Value(prefix.count(";"))
            # a gradient-free op's result used (its gradient: exactly 0), as no op of its own reads it again
            result = first.index + 1
            suffix = f";mul(%{result},%{result})" if spec.gradient_free else ""
            cases.append((prefix + str(Instruction(name, (first,), attr_values)) + suffix, "none"))
        elif spec.kind == NORM:
            operands = (Value(0),) + tuple(Param(i) for i in range(len(spec.operands) - 1))
            cases.append((str(Instruction(name, operands, attr_values)), "affine"))
        else:
            assert spec.kind == REDUCTION
            cases.append((str(Instruction(name, (Value(0),), attr_values)), "none"))
    return cases


def make_params(kind, m, n, dtype):
    def rand(*shape):
        return torch.randn(*shape, device="cuda").to(dtype)
    if kind == "feature":
        return [rand(n) + 2.0]  # away from 0 for div
    if kind == "full":
        return [rand(m, n) + 2.0]
    if kind == "row":
        return [rand(m, 1) + 2.0]
    if kind == "slopes":
        return [rand(n)]
    if kind == "one":
        return [rand(1)]
    if kind == "affine":
        return [rand(n), rand(n)]
    if kind == "batch_norm":
        return [rand(n), torch.rand(n, device="cuda").to(dtype) + 0.5, rand(n), rand(n)]
    return []


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("name", sorted(EPILOGUE_OPS))
def test_each_op(name, precision):
    dtype = DTYPES[precision]
    m, k, n = 200, 257, 1000
    for program, kind in op_programs(name, n):
        x, weight, bias = linear_inputs(m, k, n, dtype)
        params = make_params(kind, m, n, dtype)
        if EPILOGUE_OPS[name].jumps:
            assert_close_on_its_gemm_output(program, x, weight, bias, params, bound_for(precision))
        else:
            run_and_check(program, x, weight, bias, params, bound_for(precision))


def assert_close_on_its_gemm_output(program, x, weight, bias, params, bound):
    """An op whose value jumps (sign, floor, atan2's branch cut), judged on the GEMM output the kernels computed (the
    training op's second result) through the float64 reference program: where cuBLAS's rounding differs from float64's
    (or eager's, in bf16), an element may land across a jump (sign 0.0 against 1.0 in bf16: 1.2e-2 of error)."""
    out, gemm_out = torch.ops.fxfuse.gemm_epilogue_train(x, weight, bias, params, program)
    ref = run_program(gemm_out.double(), [p.double() for p in params], reference_program(program, x.dtype))
    error = relative_error(out.double(), ref)
    assert error <= bound, f"{program}: relative error {error:.3g} > {bound:g} on the kernels' own GEMM output"


# NaN, infinities, magnitudes past the activations' thresholds, and -0: GEMM output columns whose weight row is 0
# and whose bias is the value.
SPECIAL_VALUES = [float("nan"), float("inf"), float("-inf"), 200.0, -200.0, -0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(EPILOGUE_OPS))
def test_special_values_come_out_as_in_the_reference(name, dtype):
    """NaN where the reference (float64, rounded to the dtype) has NaN, the same infinities, and the finite
    elements within the dtype's bound: the clamps, extrema and approximate exponentials keep NaN and saturate as
    torch does."""
    m, k, n = 64, 257, 1024
    for program, kind in op_programs(name, n):
        x, weight, bias = linear_inputs(m, k, n, dtype)
        columns = torch.arange(len(SPECIAL_VALUES), device="cuda") * 97 + 5
        weight[columns] = 0
        bias[columns] = torch.tensor(SPECIAL_VALUES, device="cuda").to(dtype)
        params = make_params(kind, m, n, dtype)
        got = torch.ops.fxfuse.gemm_epilogue(x, weight, bias, params, program).double()
        ref = run_reference(x.double(), weight.double(), bias.double(), [p.double() for p in params],
                            reference_program(program, dtype)).to(dtype).double()
        mismatch = (torch.isnan(got) != torch.isnan(ref)) | (torch.isinf(ref) & (got != ref))
        mismatch |= torch.isinf(got) & ~torch.isinf(ref) & ~torch.isnan(ref)
        if mismatch.any():
            first = tuple(int(i) for i in mismatch.nonzero()[0])
            pytest.fail(f"{program}: {int(mismatch.sum())} elements differ in kind from the reference; first at "
                        f"{first}: got {got[first].item()!r}, reference {ref[first].item()!r}")
        # over the reference's finite elements (the kinds above hold for the rest): nan_to_num made its infinities
        # 1.8e308, whose norm let any error of floor, round or hardshrink pass
        error = relative_error(got, ref)
        bound = BOUNDS["fp32" if dtype == torch.float32 else dtype]
        if dtype != torch.float32:  # no worse than eager in bf16, whose GEMM output's rounding moves frac's steps too
            eager = run_reference(x, weight, bias, params, program).double()
            bound = max(bound, 1.5 * relative_error(eager, ref))
        assert error <= bound, f"{program}: relative error {error:.3g} > {bound:g}"


# ---------------------------------------------------------------- shapes and group counts

@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"], indirect=True)
@pytest.mark.parametrize("misaligned", ["every operand", "the bias alone"])
def test_the_gemm_takes_operands_at_any_alignment(misaligned, precision):
    """cuBLASLt's heuristic is told where x and weight start, one element past a 256-byte boundary (4 or 2
    bytes); a bias there (for which cuBLASLt takes no hint) runs at::linear instead. Both match the reference."""
    dtype = DTYPES[precision]
    m, k, n = 64, 128 if misaligned == "the bias alone" else 129, 96
    skip = 1 if misaligned == "every operand" else 0
    x = torch.randn(m * k + 1, device="cuda").to(dtype)[skip:skip + m * k].view(m, k)
    weight = (torch.randn(n * k + 1, device="cuda") * k ** -0.5).to(dtype)[skip:skip + n * k].view(n, k)
    bias = torch.randn(n + 1, device="cuda").to(dtype)[1:]
    run_and_check("relu(%0)", x, weight, bias, [], bound_for(precision))


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("n", [96, 1000, 1024, 8192])
@pytest.mark.parametrize("m", [1, 3, 1000, 1024, 4096])
def test_shapes_and_group_counts(m, n, precision):
    dtype = DTYPES[precision]
    for groups in [g for g in (1, 16, 256, 512) if n % g == 0]:
        program = f"add(%0,$0);hardtanh(%1,-1.0,1.0);mish(%2);group_norm(%3,$1,$2,{groups},1e-05)"
        x, weight, bias = linear_inputs(m, 257, n, dtype)
        params = [torch.randn(n, device="cuda").to(dtype) for _ in range(3)]
        run_and_check(program, x, weight, bias, params, bound_for(precision))


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("groups", [3, 8, 125, 500, 1000])
def test_group_sizes_off_the_lane_grid(groups, precision):
    """Group sizes that are not a power-of-2 multiple of a 16-byte chunk: 1000 and 125 features take the
    shared-memory path; 2 and 1 (500 and 1000 groups) lie inside a chunk, whose thread computes their statistics."""
    dtype = DTYPES[precision]
    n = 3000 if groups == 3 else 1000
    x, weight, bias = linear_inputs(37, 65, n, dtype)
    params = [torch.randn(n, device="cuda").to(dtype) for _ in range(2)]
    run_and_check(f"group_norm(%0,$0,$1,{groups},1e-05)", x, weight, bias, params, bound_for(precision))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"], indirect=True)
@pytest.mark.parametrize("n", [1000, 1024, 2048, 8192])
@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no affine"])
def test_groups_inside_a_vector_run_in_the_chains_and_the_lean_kernel(affine, size, n, precision):
    """Groups of 1, 2 or 4 features lie inside one 16-byte chunk (of 8 bf16 values; 4 fp32 values make a group of 4
    a whole chunk, on the lanes' grid): each value's group statistics come from its thread's own chunk, not from
    the row staged in shared memory. The fast kernel runs them in its chains only (the mish example's program on
    whole rows); the lean row kernel interprets the other programs, as the fast kernel's interpreted builds spilled
    more with their code (variant 103)."""
    dtype = DTYPES[precision]
    groups = n // size
    if affine:
        program = f"add(%0,$0);hardtanh(%1,-1.0,1.0);mish(%2);group_norm(%3,$1,$2,{groups},1e-05)"
    else:
        program = f"add(%0,$0);group_norm(%1,None,None,{groups},1e-05)"
    x, weight, bias = linear_inputs(37, 65, n, dtype)
    params = [torch.randn(n, device="cuda").to(dtype) for _ in range(3 if affine else 1)]
    whole_rows = n != 1000  # 1024, 2048 and 8192 are TPR * the fast kernel's values a thread
    inside_a_chunk = size < 16 // dtype.itemsize
    if affine and whole_rows:
        expected = "chain"
    elif inside_a_chunk:
        expected = "lean"
    else:
        expected = f"fast {'whole' if whole_rows else 'part'} light"
    assert row_kernel_kind(launched_kernel(program, x, weight, bias, params)) == expected
    run_and_check(program, x, weight, bias, params, bound_for(precision))


@pytest.mark.parametrize("precision, n, size", [
    (precision, n, size) for precision in ("fp32", "bf16", "fp16") for n, size in ((6, 2), (97, 1), (1002, 2))
] + [(precision, n, 4) for precision in ("bf16", "fp16") for n in (12, 1004)], indirect=["precision"])
def test_groups_inside_a_vector_in_rows_that_are_not_whole_vectors(n, size, precision):
    """Groups of 1, 2 or 4 features in rows of a part vector (narrower than one, too): the general row kernel's
    last chunk holds whole groups and a part past the row's end, which must neither be stored nor reach them."""
    dtype = DTYPES[precision]
    program = f"group_norm(%0,$0,$1,{n // size},1e-05)"
    x, weight, bias = linear_inputs(37, 65, n, dtype)
    params = [torch.randn(n, device="cuda").to(dtype) for _ in range(2)]
    assert row_kernel_kind(launched_kernel(program, x, weight, bias, params)) == "general"
    run_and_check(program, x, weight, bias, params, bound_for(precision))


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("n", [1000, 1024])
def test_a_nan_feature_stays_in_its_group_inside_a_vector(n, size, precision):
    """A NaN in one feature of the GEMM output (its weight row) makes its own group NaN, not the rest of its
    16-byte chunk: the in-register sums of a group (center_groups_of) must not reach the chunk's other groups."""
    dtype = DTYPES[precision]
    program = f"group_norm(%0,$0,$1,{n // size},1e-05);hardtanh(%1,-2.0,2.0)"  # a chain on whole rows, else lean
    x, weight, bias = linear_inputs(37, 65, n, dtype)
    weight[5] = float("nan")
    params = [torch.randn(n, device="cuda").to(dtype) for _ in range(2)]
    out = run_and_check(program, x, weight, bias, params, bound_for(precision))
    nan_features = torch.isnan(out).all(0).nonzero().flatten().tolist()
    assert nan_features == list(range(5 // size * size, 5 // size * size + size)), nan_features
    assert not torch.isnan(out[:, [f for f in range(n) if f not in nan_features]]).any()


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("n", [97, 1001])
def test_rows_that_are_not_whole_vectors(n, precision):
    """N not a multiple of a 16-byte vector: element-wise loads and stores, in the general row kernel."""
    dtype = DTYPES[precision]
    x, weight, bias = linear_inputs(33, 65, n, dtype)
    params = [torch.randn(n, device="cuda").to(dtype) for _ in range(3)]
    program = "add(%0,$0);gelu(%1,'none');layer_norm(%2,$1,$2,1e-05)"
    run_and_check(program, x, weight, bias, params, bound_for(precision))


ROW_KERNEL_CHOICES = [  # (program, n, param kinds, the row kernel that must run)
    # the fast kernel: "fast", then "whole" (rows of TPR * its values a thread) or "part", then "all" (every unary
    # and binary op compiled in) or "light" (none that calls libdevice)
    # "chain": a program of FXFUSE_ROW_CHAINS or FXFUSE_LIBM_ROW_CHAINS on whole rows, compiled whole ("min by
    # atomics": its last row min)
    ("add(%0,$0);hardtanh(%1,-1.0,1.0);mish(%2);group_norm(%3,$1,$2,16,1e-05)", 1024, ["feature", "affine"], "chain"),
    # a warp's row at 16 values a thread in every dtype (16-bit rows take 32 past 4096 features)
    ("add(%0,$0);hardtanh(%1,-1.0,1.0);mish(%2);group_norm(%3,$1,$2,16,1e-05)", 512, ["feature", "affine"], "chain"),
    ("group_norm(%0,$0,$1,512,1e-05);min_dim(%1,1,True)", 8192, ["affine"], "chain, min by atomics"),
    ("group_norm(%0,$0,$1,512,1e-05);amin(%1,1,True)", 8192, ["affine"], "chain, min by atomics"),
    ("group_norm(%0,$0,$1,1,1e-05);hardtanh(%1,-2.0,2.0)", 1000, ["affine"], "fast part light"),  # a chain, part rows
    ("group_norm(%0,$0,$1,16,1e-05);hardtanh(%1,-2.0,2.0);relu(%2)", 1024, ["affine"], "fast whole light"),
    ("gelu(%0,'none');layer_norm(%1,$0,$1,1e-05)", 1000, ["affine"], "fast part all"),
    ("exp(%0);group_norm(%1,$0,$1,4,1e-05)", 2048, ["affine"], "fast whole all"),  # groups of 512 across warps
    ("layer_norm(%0,$0,$1,1e-05);relu(%1)", 4096, ["affine"], "fast whole light"),  # whole rows across warps
    ("hypot(%0,$0);layer_norm(%1,$1,$2,1e-05)", 1000, ["feature", "affine"], "fast part all"),  # a libm binary op
    # libdevice ops on long rows: 16 values a thread in 16-bit too (the launcher checks the layout's values)
    ("tanh(%0);mul(%1,2.0);max_dim(%2,1,False)", 8192, [], "fast whole all"),
    ("gelu(%0,'none');layer_norm(%1,$0,$1,1e-05)", 8200, ["affine"], "fast part all"),
    # chains with libdevice ops (FXFUSE_LIBM_ROW_CHAINS): at 16 values a thread, on long 16-bit rows too
    ("gelu(%0,'none');mul(%1,2.0);max_dim(%2,1,False)", 8192, [], "chain"),  # the pool example's
    ("gelu(%0,'tanh');mul(%1,2.0);max_dim(%2,1,False)", 1024, [], "chain"),
    ("group_norm(%0,$0,$1,16,1e-05);gelu(%1,'none')", 8192, ["affine"], "chain"),
    ("group_norm(%0,$0,$1,1,1e-05);gelu(%1,'none')", 1000, ["affine"], "fast part all"),  # a chain, part rows
    ("fmax(%0,$0);layer_norm(%1,$1,$2,1e-05)", 1000, ["feature", "affine"], "fast part light"),
    ("sigmoid(%0);mul(%0,%1)", 1000, [], "lean"),                           # a slot keeps x
    ("add(%0,$0);layer_norm(%1,None,None,1e-05)", 1024, ["full"], "lean"),  # a param per element
    ("add(%0,$0);layer_norm(%1,$1,$2,1e-05)", 1001, ["feature", "affine"], "general"),  # rows not whole vectors
    ("group_norm(%0,$0,$1,200,1e-05)", 1000, ["affine"], "general"),        # groups of 5: staged in shared memory
    # groups that straddle 16-byte vectors (3, 6 and 12 features): staged in shared memory, not inside a chunk
    ("group_norm(%0,$0,$1,336,1e-05)", 1008, ["affine"], "general"),
    ("group_norm(%0,$0,$1,168,1e-05)", 1008, ["affine"], "general"),
    ("group_norm(%0,$0,$1,84,1e-05)", 1008, ["affine"], "general"),
    # groups of 2: inside a 16-byte chunk, in the chains on whole rows, else interpreted by the lean kernel
    ("group_norm(%0,$0,$1,512,1e-05);hardtanh(%1,-2.0,2.0)", 1024, ["affine"], "chain"),
    ("group_norm(%0,$0,$1,4096,1e-05);clamp(%1,-2.0,2.0)", 8192, ["affine"], "chain"),  # 32 values in 16-bit
    ("group_norm(%0,$0,$1,512,1e-05);gelu(%1,'none')", 1024, ["affine"], "chain"),  # a chain with libdevice ops
    ("group_norm(%0,$0,$1,512,1e-05);leaky_relu(%1,0.01);add(%2,%2)", 1024, ["affine"], "chain"),
    ("add(%0,$0);clamp(%1,-1.0,1.0);mish(%2);group_norm(%3,$1,$2,512,1e-05)", 1024, ["feature", "affine"], "chain"),
    ("group_norm(%0,$0,$1,4096,1e-05);min_dim(%1,1,True)", 8192, ["affine"], "chain, min by atomics"),
    ("group_norm(%0,$0,$1,2048,1e-05);amin(%1,1,True)", 8192, ["affine"], "chain, min by atomics"),  # groups of 4
    ("group_norm(%0,$0,None,512,1e-05);hardtanh(%1,-2.0,2.0)", 1024, ["slopes"], "chain"),  # a weight only
    ("group_norm(%0,None,$0,256,1e-05);hardtanh(%1,-2.0,2.0)", 1024, ["slopes"], "chain"),  # a bias only
    ("group_norm(%0,$0,$1,512,1e-05);relu(%1)", 1024, ["affine"], "lean"),  # whole rows, not a chain
    ("group_norm(%0,None,$0,500,1e-05)", 1000, ["slopes"], "lean"),
    ("group_norm(%0,$0,$1,500,1e-05)", 1000, ["affine"], "lean"),
    ("group_norm(%0,$0,$1,501,1e-05)", 1002, ["affine"], "general"),  # ... in rows that are not whole vectors
    ("group_norm(%0,$0,$1,512,1e-05);mul(%0,%1)", 1024, ["affine"], "lean"),  # ... with a slot that keeps x
    ("batch_norm(%0,$0,$1,$2,$3,1e-05);relu(%1)", 1024, ["batch_norm"], "general"),
]


def row_kernel_kind(name: str) -> str:
    """"chain" ("chain, min by atomics" for its build that folds a last row min by atomics), "fast whole light" and
    the like for the fast kernel (its template flags), else "general" or "lean"."""
    if "chain_row_kernel" in name:
        return "chain, min by atomics" if ", true," in name else "chain"
    if "fast_row_kernel" in name:
        _storage, _values, whole_rows, with_libm_ops = name.split("<")[1].split(">")[0].split(", ")
        rows = "whole" if whole_rows == "true" else "part"
        return f"fast {rows} {'all' if with_libm_ops == 'true' else 'light'}"
    return "general" if ", true>" in name else "lean"


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("case", range(len(ROW_KERNEL_CHOICES)))
def test_the_fastest_row_kernel_that_takes_the_program_runs(case, precision):
    program, n, kinds, expected = ROW_KERNEL_CHOICES[case]
    dtype = DTYPES[precision]
    x, weight, bias = linear_inputs(64, 65, n, dtype)
    params = [p for kind in kinds for p in make_params(kind, 64, n, dtype)]
    launched = launched_kernel(program, x, weight, bias, params)
    assert row_kernel_kind(launched) == expected, launched
    out = torch.ops.fxfuse.gemm_epilogue(x, weight, bias, params, program)
    assert_close_to_reference(out, x, weight, bias, params, program, bound_for(precision))


def fast_row_values(dtype, n):
    """Values a thread of the fast row kernel (fast_row_values, program_format.cuh) for a program without libdevice
    ops: 32 for 16-bit rows of more than 4096 features, else 16."""
    return 32 if dtype != torch.float32 and n > 4096 else 16


def rows_past_the_row_min_slots(threads_per_block, dtype, n):
    """More rows than the 512 slots a block has for a chain's last row min (kRowMinSlots, fast_row.cuh) can take
    with as many blocks as the GPU can hold at once: the fast kernel's registers a thread are capped at 64 for 16
    values a thread and 128 for 32 (its launch bounds), of an SM's 65536."""
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    registers = 4 * fast_row_values(dtype, n)
    blocks_an_sm = min(properties.max_threads_per_multi_processor // threads_per_block,
                       65536 // (threads_per_block * registers))
    return 512 * properties.multi_processor_count * blocks_an_sm + 1


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("rows", ["one", "a thousand", "past the slots"])
def test_a_chains_last_row_min_folds_by_atomics_while_its_slots_last(rows, precision):
    """group_norm then a whole-row min, rows across two warps: each warp's min merges into its row's slot in shared
    memory by an atomic min, a NaN anywhere in the row winning as in torch's min, and the row's last warp stores
    it. One row leaves the block's other three rows idle; past the block's 512 slots the exchange between warps
    runs instead."""
    dtype = DTYPES[precision]
    n = 64 * fast_row_values(dtype, 1024)  # 64 threads a row, 4 rows a block of 256 threads
    m = {"one": 1, "a thousand": 1000, "past the slots": rows_past_the_row_min_slots(256, dtype, n)}[rows]
    program = "group_norm(%0,$0,$1,16,1e-05);min_dim(%1,1,True)"
    x, weight, bias = linear_inputs(m, 16, n, dtype)
    nan_row = m // 2
    x[nan_row, 3] = float("nan")  # the row's GEMM output, its groups and its min are NaN
    # biases rising along the row: each warp's part starts higher than the previous one's, so the warps' mins differ
    params = [torch.rand(n, device="cuda").to(dtype) * 0.1, torch.linspace(-1.0, 3.0, n, device="cuda").to(dtype)]
    expected = "chain" if rows == "past the slots" else "chain, min by atomics"
    assert row_kernel_kind(launched_kernel(program, x, weight, bias, params)) == expected
    out = run_and_check(program, x, weight, bias, params, bound_for(precision))
    assert torch.isnan(out[nan_row]).all() and torch.isnan(out).sum() == 1, "only the NaN row's min is NaN"


def tail_loads(name: str) -> int:
    """The LOADS template argument of a broadcast tail kernel's name (TailLoads in program_format.cuh: 0 any, 1 the
    row result contiguous along a run and the param broadcast, 2 the other way round)."""
    return int(name.split("<")[1].split(">")[0].split(", ")[3])


def launched_kernel(program, x, weight, bias, params, part="row"):
    """The name of the one row kernel that the op launches (with part="broadcast_tail": its broadcast tail kernel)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.ops.fxfuse.gemm_epilogue(x, weight, bias, params, program)
        torch.cuda.synchronize()
    launched = [e.key for e in prof.key_averages() if part in e.key and "kernel" in e.key]
    assert len(launched) == 1, launched
    return launched[0]


def chain_program(names, variant):
    """A program of the ops `names`, each applied to the previous one's result, with each op's variant-th sample
    attributes (cycled) and, for binary ops, the variant-th form of the second operand; and the kinds of the
    params it reads (make_params)."""
    instructions, kinds = [], []
    for position, name in enumerate(names):
        spec = EPILOGUE_OPS[name]
        attrs = spec.samples[variant % len(spec.samples)]
        attr_values = tuple(attrs[a] for a in spec.attrs)
        current, param = Value(position), Param(sum(2 if kind == "affine" else 1 for kind in kinds))
        if spec.is_binary:
            with_number = (current, 2.5) if 1 in spec.number_operands else (param, current)
            operands = [(current, param), (param, current), with_number, (current, current)][variant % 4]
            kinds += ["feature"] if param in operands else []
        elif spec.kind == NORM:
            operands = (current,) + tuple(Param(param.index + i) for i in range(len(spec.operands) - 1))
            kinds.append("affine")
        else:
            operands = (current,)
        instructions.append(Instruction(name, operands, attr_values))
    return str(Program(tuple(instructions))), kinds


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
def test_every_chain_runs_its_own_kernel(precision):
    """Each chain of FXFUSE_ROW_CHAINS and FXFUSE_LIBM_ROW_CHAINS, with every sample of its ops' attributes and
    operand forms, on whole rows of three lengths: its compiled kernel runs, and its result is the reference's."""
    dtype = DTYPES[precision]
    for chain in kernels.row_chains():
        variants = max([len(EPILOGUE_OPS[name].samples) for name in chain] + [4])
        for variant in range(variants):
            program, kinds = chain_program(chain, variant)
            for n in (512, 1024, 8192):  # 16-bit: 16 values a thread up to 4096 features, then 32
                rows_across_warps = n > 32 * fast_row_values(dtype, n)
                by_atomics = chain[-1] in ("amin", "min_dim") and rows_across_warps
                expected = "chain, min by atomics" if by_atomics else "chain"
                x, weight, bias = linear_inputs(37, 65, n, dtype)
                params = [p for kind in kinds for p in make_params(kind, 37, n, dtype)]
                assert row_kernel_kind(launched_kernel(program, x, weight, bias, params)) == expected, program
                run_and_check(program, x, weight, bias, params, bound_for(precision))


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
def test_every_tail_chain_runs_its_own_kernel(precision):
    """Each tail of FXFUSE_TAIL_CHAINS, both ways round, after a row min whose output broadcasts to (1, N, M, 1)
    with M = 1024 (a whole number of the chain builds' 16-byte runs per lane): the build with its ops compiled in
    runs, and its result is the reference's."""
    dtype = DTYPES[precision]
    m, n = 1024, 96
    for chain in kernels.tail_chains():
        assert len(chain) == 1, chain
        for tail in (f"{chain[0]}(%1,$0)", f"{chain[0]}($0,%1)"):
            program = f"amin(%0,-1,True);{tail}"
            x, weight, bias = linear_inputs(m, 65, n, dtype)
            params = [torch.randn(1, n, 1, 1, device="cuda").to(dtype) + 3.0]  # away from 0 for div
            launched = launched_kernel(program, x, weight, bias, params, part="broadcast_tail")
            assert "Opcode" in launched, launched  # the chain build's template arguments
            assert tail_loads(launched) == 1, launched  # the mins contiguous along the output's rows, the param not
            run_and_check(program, x, weight, bias, params, bound_for(precision), out_shape=(1, n, m, 1))


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("n", [12000, 16384])
def test_long_rows_take_more_than_48_kb_of_shared_memory(n, precision, caplog):
    """1024 threads a row: fp32 staging alone is 64 KB, past the 48 KB a launch gets without asking; at 12000
    features the 750-wide groups also take the shared-memory group path (47 KB more)."""
    check_long_rows(n, precision, caplog)


def check_long_rows(n, precision, caplog, device="cuda"):
    dtype = DTYPES[precision]
    x, weight, bias = linear_inputs(300, 129, n, dtype, device=device)
    params = [torch.randn(n, device=device).to(dtype) for _ in range(3)]
    program = "add(%0,$0);hardtanh(%1,-1.0,1.0);mish(%2);group_norm(%3,$1,$2,16,1e-05)"
    with caplog.at_level(logging.DEBUG, logger="fxfuse"):
        run_and_check(program, x, weight, bias, params, bound_for(precision))
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # the kernels ran, not the fallback


# ---------------------------------------------------------------- program families

FAMILIES = [
    # (program, params(m, n) shapes, output shape or None for the GEMM's)
    ("softmax(%0,-1)", [], None),
    ("log_softmax(%0,1);mul(%1,0.5)", [], None),
    ("sigmoid(%0);mul(%0,%1)", [], None),                                    # x * sigmoid(x): one slot
    ("amax(%0,-1,True);sub(%0,%1);exp(%2)", [], None),                       # per-row value back onto the row
    ("relu(%0);tanh(%0);add(%1,%2);mul(%3,%0)", [], None),                   # two slots
    ("logsumexp(%0,-1,False);add(%1,$0)", [("m",)], "rows"),                 # per-row output + per-row param
    ("sum(%0,-1,True);mul(%1,$0)", [("m", 1)], "rows_keep"),
    ("layer_norm(%0,$0,$1,1e-05);gelu(%1,'tanh')", [("n",), ("n",)], None),
    ("rms_norm(%0,$0,None);silu(%1)", [("n",)], None),
    ("group_norm(%0,$0,$1,8,1e-05);amin(%1,1,True);add(%2,$2)", [("n",), ("n",), (1, "n", 1, 1)], "broadcast"),
    ("mean(%0,-1,True);sub($0,%1);sigmoid(%2);mul(%3,%2)", [(1, "n", 1, 1)], "broadcast"),  # tail with a slot
    ("prelu(%0,$0);prelu(%1,$1)", [("n",), (1,)], None),                     # slopes per feature, then one
    ("amin(%0,-1,True);add(%1,$0);prelu(%2,$1)", [(1, "n", 1, 1), ("n",)], "broadcast"),  # prelu's dim 1 in the tail
    # reductions of a reduced value, as fxfuse's matcher writes them (epilogue.py's over_one_feature)
    ("amax(%0,-1,True);add(%1,0.0);sub(%1,%2);gelu(%3,'none')", [], "rows_keep"),
    ("sum(%0,-1,True);add(%1,0.0);pow(%2,1.0);sub(%3,%3);exp(%4);log(%5)", [], "rows_keep"),
]


def resolve(shape, m, n):
    return tuple(m if d == "m" else n if d == "n" else d for d in shape)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"], indirect=True)
@pytest.mark.parametrize("family", range(len(FAMILIES)))
def test_program_families(family, precision):
    program, param_shapes, output = FAMILIES[family]
    dtype = DTYPES[precision]
    m, k, n = 300, 513, 1024
    x, weight, bias = linear_inputs(m, k, n, dtype)
    params = [torch.randn(resolve(s, m, n), device="cuda").to(dtype) for s in param_shapes]
    out_shape = {None: (m, n), "rows": (m,), "rows_keep": (m, 1), "broadcast": (1, n, m, 1)}[output]
    run_and_check(program, x, weight, bias, params, bound_for(precision), out_shape)


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
def test_the_broadcast_tail_writes_into_the_dead_gemm_output(precision):
    """min + bias's (1, N, M, 1) output has the GEMM output's size, and the GEMM output is dead once the row kernel
    has read it: the call allocates one buffer of that size, not two."""
    dtype = DTYPES[precision]
    m, n = 512, 2048
    x, weight, bias = linear_inputs(m, 64, n, dtype)
    params = [torch.randn(n, device="cuda").to(dtype), torch.randn(n, device="cuda").to(dtype),
              torch.randn(1, n, 1, 1, device="cuda").to(dtype)]
    program = "group_norm(%0,$0,$1,8,1e-05);amin(%1,1,True);add(%2,$2)"
    torch.ops.fxfuse.gemm_epilogue(x, weight, bias, params, program)  # cuBLAS's workspace is allocated once
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = torch.ops.fxfuse.gemm_epilogue(x, weight, bias, params, program)
    peak = torch.cuda.max_memory_allocated() - before
    gemm_output_bytes = m * n * x.element_size()
    assert out.shape == (1, n, m, 1) and out.is_contiguous()
    assert gemm_output_bytes <= peak < 1.5 * gemm_output_bytes, (peak, gemm_output_bytes)
    assert_close_to_reference(out, x, weight, bias, params, program, bound_for(precision))


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("lead, param_shape", [((3, 7), (3, 1, 512)), ((7, 3), (7, 1, 5))])
def test_broadcast_tail_over_three_dims(lead, param_shape, precision):
    """A row min of a 3-D x against a param that broadcasts it along a new last dim: the tail's output keeps three
    dims of odd sizes (nothing merges), so every output index is split by the tail's divisors. A last dim of 512
    takes the tail chain's kernel, one of 5 the interpreted one."""
    dtype = DTYPES[precision]
    x, weight, bias = linear_inputs(None, 33, 96, dtype, lead=lead)
    params = [torch.randn(param_shape, device="cuda").to(dtype)]
    out_shape = (*lead, param_shape[-1])
    program = "amin(%0,-1,True);add(%1,$0)"
    out = run_and_check(program, x, weight, bias, params, bound_for(precision), out_shape)
    assert out.shape == out_shape
    if out_shape[-1] == 512:  # each row's min broadcast along the run, the param contiguous: the build for that
        assert tail_loads(launched_kernel(program, x, weight, bias, params, part="broadcast_tail")) == 2


@pytest.mark.parametrize("program", ["", "relu(%0)", "add(%0,$0)"])
def test_training_op_never_returns_the_gemm_output_as_its_result(program):
    """An empty program's result is the GEMM output itself: the training op returns a copy beside it."""
    torch.backends.cuda.matmul.allow_tf32 = False
    x, weight, bias = linear_inputs(64, 96, 128, torch.float32)
    params = [torch.randn(128, device="cuda")] if "$0" in program else []
    run_and_check(program, x, weight, bias, params, BOUNDS["fp32"])


def test_three_dim_input_with_layer_norm_runs_on_rows():
    x, weight, bias = linear_inputs(None, 129, 256, torch.float32, lead=(4, 50))
    params = [torch.randn(256, device="cuda"), torch.randn(256, device="cuda")]
    run_and_check("layer_norm(%0,$0,$1,1e-05);relu(%1)", x, weight, bias, params, BOUNDS["fp32"])


# ---------------------------------------------------------------- the four examples at full size

def example_params(name, n, dtype, device="cuda"):
    def rand(*shape):
        return torch.randn(*shape, device=device).to(dtype)
    if name == "linear_hardtanh_mish_groupnorm":
        return [rand(n) * 0.02, rand(n), rand(n)]
    if name == "linear_groupnorm_min_bias":
        return [rand(n), rand(n), rand(1, n, 1, 1) * 0.02]
    return [rand(n), rand(n)]


@pytest.mark.parametrize("op", ["gemm_epilogue", "gemm_epilogue_train"])
@pytest.mark.parametrize("program", [*EXAMPLES, "softmax(%0,-1)", "sum(%0,-1,True)", "logsumexp(%0,-1,False)"])
def test_results_take_in_place_ops_under_autograd_as_eagers_do(program, op):
    """A result that is a view of a tensor the op made (y seen as the output's shape) refuses in-place ops under
    autograd ('a view ... created inside a custom Function'); eager's results take them."""
    params = example_params(program, 1024, torch.float32) if program in EXAMPLES else []
    x, weight, bias = linear_inputs(64, 96, 1024, torch.float32)
    for tensor in (weight, bias, *params):
        tensor.requires_grad_(True)
    result = getattr(torch.ops.fxfuse, op)(x, weight, bias, params, EXAMPLES.get(program, program))
    out = result[0] if op == "gemm_epilogue_train" else result
    assert out._base is None
    out.mul_(2)
    out.sum().backward()
    assert weight.grad is not None and weight.grad.isfinite().all()


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"], indirect=True)
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_at_full_size(name, precision):
    dtype = DTYPES[precision]
    m, k, n = 1024, 8192, 8192
    x, weight, bias = linear_inputs(m, k, n, dtype)
    out_shape = (1, n, m, 1) if name == "linear_groupnorm_min_bias" else (m, n)
    run_and_check(EXAMPLES[name], x, weight, bias, example_params(name, n, dtype), bound_for(precision), out_shape)


# ---------------------------------------------------------------- streams, graphs, fallback, build cache

# bf16: the epilogue kernels launch early on sm_90 (programmatic dependent launch), fp32 plainly.
@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
def test_runs_on_the_current_non_default_stream(precision):
    check_runs_on_the_current_stream(precision)


def check_runs_on_the_current_stream(precision, device="cuda", n=2048, current_device=None):
    """min_bias on a side stream of the inputs' device whose x takes its fresh values late, called with
    `current_device` current (default: the inputs' own)."""
    program = EXAMPLES["linear_groupnorm_min_bias"]
    x, weight, bias = linear_inputs(512, 1024, n, DTYPES[precision], device=device)
    params = example_params("linear_groupnorm_min_bias", n, DTYPES[precision], device=device)
    torch.ops.fxfuse.gemm_epilogue(x, weight, bias, params, program)  # the first call on a device loads its
    torch.cuda.synchronize(x.device)  # kernels, which synchronizes: the order below must be the streams' alone
    fresh = torch.randn_like(x)
    stream = torch.cuda.Stream(x.device)
    stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream):  # also makes x's device current
        torch.cuda._sleep(50_000_000)  # x takes its fresh values late: a launch on another stream reads the old ones
        x.copy_(fresh)
        with torch.cuda.device(current_device if current_device is not None else x.device):
            out = torch.ops.fxfuse.gemm_epilogue(x, weight, bias, params, program)
    torch.cuda.current_stream(x.device).wait_stream(stream)
    assert_close_to_reference(out, fresh, weight, bias, params, program, bound_for(precision))


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("name", ["linear_hardtanh_mish_groupnorm", "linear_groupnorm_min_bias"])
def test_cuda_graph_capture_and_replay(name, precision):
    program = EXAMPLES[name]
    x, weight, bias = linear_inputs(256, 512, 1024, DTYPES[precision])
    params = example_params(name, 1024, DTYPES[precision])
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.ops.fxfuse.gemm_epilogue(static_x, weight, bias, params, program)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = torch.ops.fxfuse.gemm_epilogue(static_x, weight, bias, params, program)
    for _ in range(2):
        fresh = torch.randn_like(x)
        static_x.copy_(fresh)
        static_out.fill_(float("nan"))
        graph.replay()
        assert_close_to_reference(static_out, fresh, weight, bias, params, program, bound_for(precision))


def non_contiguous_weight_inputs():
    x, weight, bias = linear_inputs(64, 96, 128, torch.float32)
    return x, weight.t().contiguous().t(), bias


FALLBACKS = [
    # (why, inputs factory, program, group_norm channels, reason logged)
    ("float64", lambda: linear_inputs(64, 96, 128, torch.float64), "relu(%0)", 0, "dtype"),
    ("non-contiguous weight", non_contiguous_weight_inputs, "relu(%0)", 0, "weight is not contiguous"),
    ("3-D x with group_norm", lambda: linear_inputs(None, 96, 128, torch.float32, lead=(4, 16)),
     "group_norm(%0,$0,$1,4,1e-05)", 16, "group_norm is row-local only"),  # eager's channels: dim 1
    ("softmax over dim 0", lambda: linear_inputs(64, 96, 128, torch.float32), "softmax(%0,0)", 0, "softmax over a dim"),
]


@pytest.mark.parametrize("op", ["gemm_epilogue", "gemm_epilogue_train"])
@pytest.mark.parametrize("case", range(len(FALLBACKS)), ids=[f[0] for f in FALLBACKS])
def test_fallback_runs_the_reference_and_logs_why(case, op, caplog):
    torch.backends.cuda.matmul.allow_tf32 = False
    _, make, program, channels, reason = FALLBACKS[case]
    x, weight, bias = make()
    params = [torch.randn(channels, device="cuda", dtype=x.dtype) for _ in range(2)] if channels else []
    with caplog.at_level(logging.DEBUG, logger="fxfuse"):
        result = getattr(torch.ops.fxfuse, op)(x, weight, bias, params, program)
    messages = [record.getMessage() for record in caplog.records]
    assert any(f"{op} runs the reference" in m and reason in m for m in messages), messages
    bound = 1e-12 if x.dtype == torch.float64 else BOUNDS["fp32"]
    if op == "gemm_epilogue":
        assert_close_to_reference(result, x, weight, bias, params, program, bound)
    else:
        assert_training_outputs(result, x, weight, bias, params, program, bound)


@pytest.mark.parametrize("op", ["gemm_epilogue", "gemm_epilogue_train"])
@pytest.mark.parametrize("view", ["transposed", "permuted 3-D"])
def test_a_strided_x_runs_the_kernels(view, op, caplog):
    """x.t() or a permuted 3-D view (`fc(x.permute(1, 0, 2))`) is copied to rows before the GEMM: no reference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    if view == "transposed":
        x, weight, bias = linear_inputs(64, 96, 128, torch.float32)
        x = x.t().contiguous().t()
    else:
        x, weight, bias = linear_inputs(None, 96, 128, torch.float32, lead=(4, 16))
        x = x.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    assert not x.is_contiguous()
    program = "softmax(%0,-1)"
    with caplog.at_level(logging.DEBUG, logger="fxfuse"):
        result = getattr(torch.ops.fxfuse, op)(x, weight, bias, [], program)
    assert not [r.getMessage() for r in caplog.records if "runs the reference" in r.getMessage()]
    if op == "gemm_epilogue":
        assert_close_to_reference(result, x, weight, bias, [], program, BOUNDS["fp32"])
    else:
        assert_training_outputs(result, x, weight, bias, [], program, BOUNDS["fp32"])


def test_a_cpu_scalar_param_runs_the_reference_as_eager_takes_it(caplog):
    """A 0-dim CPU tensor mixes with CUDA tensors in eager (as a constant of the model would): the op runs the
    reference for it rather than raise."""
    torch.backends.cuda.matmul.allow_tf32 = False
    x, weight, bias = linear_inputs(64, 96, 128, torch.float32)
    params, program = [torch.tensor(0.5)], "mul(%0,$0);relu(%1)"
    with caplog.at_level(logging.DEBUG, logger="fxfuse"):
        out = torch.ops.fxfuse.gemm_epilogue(x, weight, bias, params, program)
    messages = [record.getMessage() for record in caplog.records]
    assert any("runs the reference" in m and "devices differ" in m for m in messages), messages
    assert out.device == x.device
    assert_close_to_reference(out, x, weight, bias, params, program, BOUNDS["fp32"])


def test_an_in_place_instruction_runs_the_kernels_as_its_op(caplog):
    """`add_` (the model's in-place add, program.py) keeps its first operand's dtype, which the kernels' one storage
    type does: it binds as add, with no fallback."""
    torch.backends.cuda.matmul.allow_tf32 = False
    x, weight, bias = linear_inputs(64, 96, 128, torch.float32)
    params = [torch.randn(128, device="cuda")]
    with caplog.at_level(logging.DEBUG, logger="fxfuse"):
        out = torch.ops.fxfuse.gemm_epilogue(x, weight, bias, params, "add_(%0,$0);relu(%1)")
    messages = [record.getMessage() for record in caplog.records]
    assert not any("runs the reference" in m for m in messages), messages
    assert_close_to_reference(out, x, weight, bias, params, "add(%0,$0);relu(%1)", BOUNDS["fp32"])


@pytest.mark.parametrize("program", ["sub_(2.0,%0)", "add_($0,%0)"])
def test_an_in_place_instruction_that_changes_no_value_raises_the_references_error(program):
    """program.py refuses an in-place instruction whose first operand is no value of the program; the binder read
    `sub_(2.0,%0)` as `sub` and computed it."""
    x, weight, bias = linear_inputs(8, 16, 30, torch.float32)
    with pytest.raises(ValueError, match="changes no value"):
        torch.ops.fxfuse.gemm_epilogue(x, weight, bias, [torch.randn(30, device="cuda")], program)


@pytest.mark.parametrize("program, error", [("add(%0,$4294967296)", IndexError), ("relu(%4294967296)", ValueError)])
def test_an_index_past_int_raises_the_references_error(program, error):
    """The parser read a value or param index into an int: %4294967296 wrapped to %0 and the kernels computed
    relu(%0), $4294967296 read $0, where the reference raises."""
    x, weight, bias = linear_inputs(8, 16, 30, torch.float32)
    with pytest.raises(error):
        torch.ops.fxfuse.gemm_epilogue(x, weight, bias, [torch.randn(30, device="cuda")], program)


@pytest.mark.parametrize("program", ["mul(%0,0x10)", "mul(%0,nan(1))", "hardtanh(%0,-0X1p0,1.0)"])
def test_a_number_the_reference_does_not_read_raises_its_error(program):
    """strtod reads hexadecimal numbers and NaN payloads, which program.py's float() refuses: the kernels computed
    mul(%0,0x10) as a multiply by 16 where the reference raises ValueError."""
    x, weight, bias = linear_inputs(8, 16, 30, torch.float32)
    with pytest.raises(ValueError):
        run_reference(x, weight, bias, [], program)
    with pytest.raises(ValueError):
        torch.ops.fxfuse.gemm_epilogue(x, weight, bias, [], program)


def test_errors_are_eager_errors():
    x, weight, bias = linear_inputs(8, 16, 30, torch.float32)
    params = [torch.randn(30, device="cuda"), torch.randn(30, device="cuda")]
    program = "group_norm(%0,$0,$1,7,1e-05)"  # 7 does not divide 30
    with pytest.raises(RuntimeError) as eager:
        run_reference(x, weight, bias, params, program)
    with pytest.raises(RuntimeError) as fused:
        torch.ops.fxfuse.gemm_epilogue(x, weight, bias, params, program)
    assert str(eager.value).splitlines()[0] in str(fused.value)


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("lead, slopes", [((1, 7), 7), ((3, 7), 7), ((3, 7), 1), ((2, 1), 1)])
def test_prelu_of_a_3d_output_reads_its_slopes_along_dim_1(lead, slopes, precision):
    """eager's prelu takes dim 1 as the channels: one slope per row of a (1, T, N) output (a per-row param), one
    per T rows of a (B, T, N) one (the reference), or one for all."""
    dtype = DTYPES[precision]
    x, weight, bias = linear_inputs(None, 64, 256, dtype, lead=lead)
    run_and_check("prelu(%0,$0)", x, weight, bias, [torch.randn(slopes, device="cuda").to(dtype)],
                  bound_for(precision))


@pytest.mark.parametrize("program, slopes", [("prelu(%0,$0)", (29,)), ("prelu(%0,$0)", (31,)), ("prelu(%0,$0)", (8,)),
                                             ("prelu(%0,$0)", (1, 30)), ("prelu($0,%0)", (30,)), ("prelu(%0,%0)", ())])
def test_prelu_slopes_that_are_not_the_channels_raise_eagers_error(program, slopes):
    """Slopes of another count than the channels (dim 1), of 2 dims, or the value itself: eager raises."""
    x, weight, bias = linear_inputs(8, 16, 30, torch.float32)
    params = [torch.randn(slopes, device="cuda")] if "$" in program else []
    with pytest.raises(RuntimeError) as eager:
        run_reference(x, weight, bias, params, program)
    with pytest.raises(RuntimeError) as fused:
        torch.ops.fxfuse.gemm_epilogue(x, weight, bias, params, program)
    assert str(eager.value).splitlines()[0] in str(fused.value)


# Hand-written programs whose references raise TypeError (the pass never writes them): a None or a string where the
# op takes a number, a number or None for gelu's string, a float or a bool where the op takes an integer dim or
# group count, a number for an operand of torch.maximum / minimum or prelu (which take tensors).
BAD_ATTRIBUTE_PROGRAMS = ["hardtanh(%0,None,2.0)", "leaky_relu(%0,None)", "softplus(%0,None,20.0)", "pow(%0,None)",
                          "hardtanh(%0,'tanh',2.0)", "gelu(%0,1.0)", "gelu(%0,None)",
                          "sum(%0,-1.0,True)", "amin(%0,True,True)", "softmax(%0,-1.0)", "logsumexp(%0,1.0,False)",
                          "group_norm(%0,$0,$1,5.0,1e-05)", "maximum(%0,2.5)", "minimum(1.5,%0)",
                          "prelu(%0,2.5)"]


@pytest.mark.parametrize("op", ["gemm_epilogue", "gemm_epilogue_train"])
@pytest.mark.parametrize("program", BAD_ATTRIBUTE_PROGRAMS)
def test_attributes_the_reference_refuses_raise_its_error(program, op):
    x, weight, bias = linear_inputs(8, 16, 30, torch.float32)
    params = [torch.randn(30, device="cuda"), torch.randn(30, device="cuda")] if "$" in program else []
    with pytest.raises(Exception) as eager:
        run_reference(x, weight, bias, params, program)
    with pytest.raises(type(eager.value)) as fused:
        getattr(torch.ops.fxfuse, op)(x, weight, bias, params, program)
    assert str(eager.value).splitlines()[0] in str(fused.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("program", ["hardshrink(%0,0.3)", "softshrink(%0,0.3)", "threshold(%0,0.3,-1.0)"])
def test_shrink_and_threshold_numbers_are_read_in_the_tensors_dtype(program, dtype):
    """torch's CUDA kernels of these ops compare with their number rounded to the tensor's dtype (0.3 is 0.30078125
    in bf16): the kernels kept an element equal to the rounded number where eager zeroes or replaces it."""
    rounded = torch.tensor(0.3, dtype=dtype).item()
    bias = torch.tensor([rounded, -rounded, 0.0, 1.0, -1.0, 0.25, 0.5, -0.5] * 2, device="cuda", dtype=dtype)
    x = torch.randn(4, 8, device="cuda", dtype=dtype)
    weight = torch.zeros(16, 8, device="cuda", dtype=dtype)  # the GEMM output is the bias, exactly
    fused = torch.ops.fxfuse.gemm_epilogue(x, weight, bias, [], program)
    torch.testing.assert_close(fused, run_reference(x, weight, bias, [], program), rtol=0, atol=0)


def test_a_later_process_loads_the_cached_build_quickly():
    script = ("import time, fxfuse.kernels as k; start = time.perf_counter(); assert k.load(); "
              "print(time.perf_counter() - start)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=dict(os.environ),
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "building" not in result.stdout, "the second process rebuilt the kernels"
    seconds = float(result.stdout.strip().splitlines()[-1])
    assert seconds < 2.0, f"loading the cached build took {seconds:.2f} s"


def test_two_processes_building_at_once_share_one_build(tmp_path):
    """Two processes load() into an empty cache at the same time: one builds (one line before, one with its time
    after), the other waits on the file lock and loads that build; both then run the op on the GPU. The new cache
    holds this build's compiled objects and ninja files (no library, no completion mark), so the build is ninja's
    link alone: the subject is the lock (a compile from nothing, 92 s on the H200, is gpu-check's first load)."""
    script = ("import torch, fxfuse.kernels as k; assert k.load(); "
              "x = torch.randn(5, 24, device='cuda'); w = torch.randn(40, 24, device='cuda'); "
              "out = torch.ops.fxfuse.gemm_epilogue(x, w, None, [], 'relu(%0)'); "
              "torch.testing.assert_close(out, torch.relu(x @ w.t())); print('ran the op')")
    assert kernels.load()
    built = kernels.build_directory(kernels._arch_flags())
    seeded = tmp_path / built.name
    seeded.mkdir()
    for path in built.iterdir():
        if path.suffix == ".o" or path.name in ("build.ninja", ".ninja_log", ".ninja_deps"):
            shutil.copy2(path, seeded / path.name)
    env = dict(os.environ, FXFUSE_CACHE_DIR=str(tmp_path))
    processes = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for _ in range(2)]
    outputs = [process.communicate(timeout=900) for process in processes]
    for process, (out, err) in zip(processes, outputs):
        assert process.returncode == 0 and "ran the op" in out, err[-2000:]
    builders = [out for out, _ in outputs if "fxfuse: building the CUDA kernels" in out]
    assert len(builders) == 1, [out for out, _ in outputs]
    assert "fxfuse: built the CUDA kernels in" in builders[0]


def test_a_model_optimized_on_the_cpu_then_moved_to_the_gpu_runs_the_kernels():
    """Only optimize() and the backend loaded the kernels: such a model ran the reference at every call."""
    script = ("import torch, torch.nn as nn, fxfuse, fxfuse.kernels as k; torch.manual_seed(0); "
              "model = nn.Sequential(nn.Linear(24, 40), nn.GroupNorm(4, 40), nn.Hardtanh()).eval(); "
              "optimized = fxfuse.optimize(model, (torch.randn(5, 24),)); assert not k.loaded(); "
              "model.cuda(); x = torch.randn(5, 24, device='cuda'); out = optimized(x); "
              "assert k.loaded() and torch._C._dispatch_has_kernel_for_dispatch_key('fxfuse::gemm_epilogue', 'CUDA'); "
              "torch.testing.assert_close(out, model(x)); print('ran the kernels')")
    assert_a_new_process_prints(script, "ran the kernels")


def assert_a_new_process_prints(script, line):
    """Runs `script` in a Python process of its own (nothing of fxfuse loaded yet); it must print `line`."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=dict(os.environ),
                            timeout=900)
    assert result.returncode == 0 and line in result.stdout, result.stderr[-2000:]


def test_a_processs_first_fused_call_can_be_inside_cuda_graph_capture():
    """The first call loads the kernels, makes the device's cuBLASLt handle, asks cuBLASLt's heuristic and sets the
    row kernels' shared-memory attributes: none of it may break the capture or be left out of the graph."""
    script = ("import torch, torch.nn as nn, fxfuse, fxfuse.kernels as k; torch.manual_seed(0); "
              "model = nn.Sequential(nn.Linear(64, 512), nn.GroupNorm(16, 512), nn.Hardtanh()).eval(); "
              "optimized = fxfuse.optimize(model, (torch.randn(8, 64),)); assert not k.loaded(); model.cuda(); "
              "static_x = torch.randn(200, 64, device='cuda'); graph = torch.cuda.CUDAGraph(); "
              "with_graph = torch.cuda.graph(graph); with_graph.__enter__(); static_out = optimized(static_x); "
              "with_graph.__exit__(None, None, None); assert k.loaded(); "
              "fresh = torch.randn(200, 64, device='cuda'); static_x.copy_(fresh); static_out.fill_(float('nan')); "
              "graph.replay(); torch.testing.assert_close(static_out, model(fresh)); print('replayed')")
    assert_a_new_process_prints(script, "replayed")


def test_load_is_cheap_once_loaded():
    start = time.perf_counter()
    for _ in range(100):
        assert kernels.load()
    assert time.perf_counter() - start < 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rms_norm_without_eps_is_eagers_in_16_bits(dtype, caplog):
    """rms_norm's eps=None is float32's epsilon for bf16 and fp16 as for fp32 (F.rms_norm computes in float): the
    kernels took bf16's 2^-7 (fp16's 2^-10), which moved a default nn.RMSNorm's result by 1-2% at unit scale and far
    more for small activations, and the reference here took finfo(dtype).eps too (found by review)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.RMSNorm(256)).to("cuda", dtype).eval()
    # small inputs: a mean square near 5e-3 (the bias's), where 2^-7 moves the result by a third
    x = (torch.randn(32, 64, device="cuda") * 0.03).to(dtype)
    optimized = fxfuse.optimize(model, (x,))
    assert [row.program for row in optimized.fxfuse_report.fused] == ["rms_norm(%0,$0,None)"]
    with torch.no_grad(), caplog.at_level(logging.DEBUG, logger="fxfuse"):
        actual, expected = optimized(x), model(x)
    assert not [r for r in caplog.records if "runs the reference" in r.getMessage()]  # the kernels ran
    assert relative_error(actual.double(), expected.double()) < BOUNDS[dtype]


# ---------------------------------------------------------------- edge values a review found (CUDA host and kernels)

def ran_the_kernels(caplog) -> bool:
    return not [r for r in caplog.records if "runs the reference" in r.getMessage()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n", [1024, 1001], ids=["fast", "general"])
@pytest.mark.parametrize("op", ["softmax", "log_softmax", "logsumexp"])
def test_a_row_with_an_infinity_is_eagers(op, n, dtype, caplog):
    """A row holding +inf (an fp16 GEMM output past 65504): softmax and log_softmax are NaN in every element, as in
    torch; the kernels took logsumexp's rule (an infinite max read as 0) for all three and gave 0 and -inf."""
    torch.backends.cuda.matmul.allow_tf32 = False
    x, weight, bias = linear_inputs(64, 96, n, dtype)
    weight[5], bias[5] = 0, float("inf")  # y[:, 5] is +inf in every row
    program = f"{op}(%0,-1,False)" if op == "logsumexp" else f"{op}(%0,-1)"
    with caplog.at_level(logging.DEBUG, logger="fxfuse"):
        actual = torch.ops.fxfuse.gemm_epilogue(x, weight, bias, [], program)
    expected = run_reference(x, weight, bias, [], program)  # eager's ops on the GPU, in the dtype
    assert ran_the_kernels(caplog)
    torch.testing.assert_close(actual, expected, equal_nan=True)


@pytest.mark.parametrize("program", ["clamp(%0,nan,1.0)", "clamp(%0,-1.0,nan)", "clamp(%0,nan,None)"])
def test_a_clamp_bound_of_nan_is_not_no_bound(program):
    """The kernels read None as NaN, and so a NaN bound as None: torch's clamp with both bounds and one of them NaN
    is NaN everywhere (CPU and CUDA; CUDA's clamp_min(x, nan) is not)."""
    x, weight, bias = linear_inputs(64, 96, 128, torch.float32)
    actual = torch.ops.fxfuse.gemm_epilogue(x, weight, bias, [], program)
    expected = run_reference(x, weight, bias, [], program)  # eager's clamp on the GPU
    assert "None" in program or torch.isnan(expected).all()
    torch.testing.assert_close(actual, expected, equal_nan=True)


EMPTY_OUTPUT = """
import torch
from fxfuse import kernels
from fxfuse.program import run_reference
assert kernels.load()
x, weight = torch.randn(4, 16, device="cuda"), torch.randn({n}, 16, device="cuda")
bias = torch.randn({n}, device="cuda")
params = [torch.randn({shape}, device="cuda")]
expected = run_reference(x, weight, bias, params, "{program}")
for op in (torch.ops.fxfuse.gemm_epilogue, lambda *a: torch.ops.fxfuse.gemm_epilogue_train(*a)[0]):
    assert op(x, weight, bias, params, "{program}").shape == expected.shape
torch.cuda.synchronize()
print("ok")
"""


@pytest.mark.parametrize("n, shape, program", [(16, (0, 1, 1), "add(%0,$0)"),
                                               (16, (0, 1, 1), "amin(%0,-1,True);add(%1,$0)"),
                                               (1, (0,), "relu(%0);add(%1,$0)")])
def test_a_param_that_broadcasts_the_output_to_nothing(n, shape, program):
    """A param with a dim of 0 makes eager's result empty: the broadcast tail's setup divided by that 0 on the host
    (SIGFPE: the process died). A process of its own, so that a crash fails this test alone."""
    code = EMPTY_OUTPUT.format(n=n, shape=shape, program=program)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, (result.returncode, result.stderr[-2000:])


HUGE_TAIL_DIM = """
import torch
from fxfuse import kernels
from fxfuse.program import run_reference
assert kernels.load()
x, weight = torch.randn(1, 16, device="cuda", dtype=torch.half), torch.randn(8, 16, device="cuda", dtype=torch.half)
params = [torch.randn(1, device="cuda", dtype=torch.half).expand(2 ** 32)]  # no memory of its own
program = "amin(%0,-1,True);add(%1,$0)"
expected = run_reference(x[:, :], weight, None, [params[0][:8]], program)  # (1, 8): every element the same
out = torch.ops.fxfuse.gemm_epilogue(x, weight, None, params, program)  # (1, 2^32): 8 GiB
assert out.shape == (1, 2 ** 32)
assert out.amin().item() == out.amax().item() == expected[0, 0].item()
torch.cuda.synchronize()
print("ok")
"""


def test_a_broadcast_tail_dim_of_two_to_the_32_falls_back():
    """A broadcast tail whose coalesced dim is 2^32 long: its size was cast to 32 bits (0) and the host divided by it
    (SIGFPE) before the check that the output fits 31 bits. A process of its own, so that a crash fails this alone."""
    result = subprocess.run([sys.executable, "-c", HUGE_TAIL_DIM], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, (result.returncode, result.stderr[-2000:])
