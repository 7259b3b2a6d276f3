"""GPU tests of the CUDA backward of the epilogue, torch.ops.fxfuse.epilogue_backward (kernels/epilogue_backward.cpp,
kernels/backward_interpreter.cuh), run with `pytest -m cuda`.

Every gradient it returns (the GEMM output's and each param's) is compared with the reference backward
(fxfuse.library.run_epilogue_backward: torch's autograd through the reference interpreter) run on float64 copies,
by ||grad - ref|| / ||ref|| against the dtype's bound (1e-5 fp32, 1e-2 bf16 / fp16), or 1.5x the reference's own
error in that dtype where that is larger: a derivative that jumps (clamp's at a bound, leaky_relu's at 0) may take
the other side in any computation in that dtype. For the same reason, on GEMM outputs of a million elements or more,
the worst 1% of a gradient's rows (of its elements, for a param's 1-D gradient) are left out of the norm: a forward
value a rounding away from a jump takes either side, a norm's backward spreads that over the row's group, and a
param's gradient sums it into its feature. Inputs are fresh random draws; the gradient buffer is
poisoned with NaN beforehand. Each case also asserts which implementation ran: the kernel (no fallback logged), or,
for a program outside the kernel's limits, the reference, with the reason logged.
"""
import logging

import pytest
import torch

from fxfuse.epilogue import EPILOGUE_OPS
from fxfuse.library import run_epilogue_backward
from test_cuda_kernels import (BOUNDS, DTYPES, EXAMPLES, FAMILIES, bound_for, make_params, op_programs,
                               poison_allocator, precision, reference_program, resolve)  # noqa: F401

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("loaded_kernels")]

FALLBACK = "epilogue_backward runs the reference"


@pytest.fixture(scope="module")
def loaded_kernels():
    from fxfuse import kernels

    assert kernels.load(), "the CUDA kernels did not build or load"


def result_shape(program, gemm_out, params):
    from fxfuse.program import run_program

    fake = torch._subclasses.fake_tensor.FakeTensorMode()
    with fake:
        out = run_program(fake.from_tensor(gemm_out), [fake.from_tensor(p) for p in params], program)
    return tuple(out.shape)


def assert_gradient_close(what, got, ref, low_precision_ref, bound, large):
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    got = got.double()
    unwritten = torch.isnan(got) & ~torch.isnan(ref)
    diff = (got - ref).nan_to_num(nan=float("inf")).abs()
    worst = torch.argmax(torch.where(unwritten, torch.inf, diff).flatten()).item()
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), ref.shape)) if ref.dim() else ()
    where = f"worst at {index}: got {got.flatten()[worst].item()!r}, reference {ref.flatten()[worst].item()!r}"
    assert not unwritten.any(), f"{what}: {int(unwritten.sum())} NaN where the reference has none; {where}"
    bound = max(bound, 1.5 * relative_error(low_precision_ref.double(), ref))
    rows = ref.reshape(-1, ref.shape[-1]) if ref.dim() > 1 else ref.reshape(-1, 1)
    left_out = rows.shape[0] // 100 if large else 0
    error = relative_error(got.reshape(rows.shape), rows, left_out)
    assert error <= bound, f"{what}: relative error {error:.3g} > {bound:g} ({left_out} rows left out); {where}"


def relative_error(got, ref, left_out_rows=0):
    """||got - ref|| / ||ref|| over the finite elements of ref, without the `left_out_rows` worst rows."""
    finite = torch.isfinite(ref)
    row_squares = torch.where(finite, got - ref, 0.0).square().sum(-1)
    if left_out_rows:
        row_squares = row_squares.sort().values[:-left_out_rows]
    return row_squares.sum().sqrt().item() / max(torch.linalg.vector_norm(ref[finite]).item(), 1e-30)


def check_backward(program, gemm_out, params, bound, caplog, fallback=None, needs=None, grad_output=None):
    """Runs epilogue_backward on fresh gradients and judges every result; `fallback`: the reason the kernel
    must log for declining the program (None: the kernel must run)."""
    needs = needs or [True] * (1 + len(params))
    if grad_output is None:
        grad_output = torch.randn(result_shape(program, gemm_out, params), device=gemm_out.device).to(gemm_out.dtype)
    poison_allocator(gemm_out.shape, dtype=gemm_out.dtype, device=gemm_out.device)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="fxfuse"):
        grads = torch.ops.fxfuse.epilogue_backward(grad_output, gemm_out, params, program, needs)
    declined = [r.getMessage() for r in caplog.records if FALLBACK in r.getMessage()]
    if fallback is None:
        assert not declined, f"{program}: {declined}"
    else:
        assert declined and fallback in declined[0], f"{program}: expected a fallback for {fallback!r}: {declined}"
    as64 = lambda t: t.double()
    reference = run_epilogue_backward(as64(grad_output), as64(gemm_out), [as64(p) for p in params],
                                      reference_program(program, gemm_out.dtype), needs)
    low_precision = torch.ops.fxfuse.epilogue_backward_fallback(grad_output, gemm_out, params, program, needs,
                                                                "the test's reference in the same dtype")
    names = [name for name, need in zip(["gemm_out"] + [f"${i}" for i in range(len(params))], needs) if need]
    assert len(grads) == len(names)
    tensors = [gemm_out, *params]
    for k, (name, got, ref) in enumerate(zip(names, grads, reference)):
        owner = tensors[0] if name == "gemm_out" else tensors[1 + int(name[1:])]
        assert got.dtype == owner.dtype and got.is_contiguous(), f"{program}: {name}'s gradient"
        assert_gradient_close(f"{program}: d/d{name}", got, ref, low_precision[k], bound,
                              large=gemm_out.numel() >= 1_000_000)


def gemm_output(m, n, dtype):
    return torch.randn(m, n, device="cuda").to(dtype)


# ---------------------------------------------------------------- each op, with each of its sample attributes

DECLINED_OPS = {"batch_norm": "batch_norm has no backward kernel"}


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("name", sorted(EPILOGUE_OPS))
def test_each_op_backward(name, precision, caplog):
    dtype = DTYPES[precision]
    m, n = 200, 1024  # every sample group count on the lanes' grid
    for program, kind in op_programs(name, n):
        params = make_params(kind, m, n, dtype)
        # batch_norm's running statistics are buffers: autograd has no formula for them
        needs = [True] + [not (name == "batch_norm" and i < 2) for i in range(len(params))]
        check_backward(program, gemm_output(m, n, dtype), params, bound_for(precision), caplog,
                       fallback=DECLINED_OPS.get(name), needs=needs)


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("program", ["hardtanh(%0,-2.0,2.0)", "clamp(%0,-2.0,2.0)", "max_dim(%0,-1,True)",
                                     "min_dim(%0,1,False)", "amax(%0,-1,True)", "amin(%0,1,False)"])
def test_backward_on_bounds_and_ties(program, precision, caplog):
    """Small integers as the GEMM output: values exactly on the bounds, where hardtanh's gradient (0) and clamp's
    (1) part, and rows whose extreme is tied between many features, where max_dim and min_dim give the row's
    gradient to the first of them (to the first NaN, in the rows with NaNs) and amax and amin split it."""
    dtype = DTYPES[precision]
    gemm_out = torch.randint(-3, 4, (300, 1024), device="cuda").to(dtype)
    gemm_out[7, 100] = gemm_out[7, 900] = gemm_out[8, 5] = float("nan")
    check_backward(program, gemm_out, [], bound_for(precision), caplog)


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("program", ["maximum(%0,$0)", "minimum($0,%0)"])
def test_maximum_backward_gives_the_loser_0_for_an_infinite_or_nan_gradient(program, precision, caplog):
    """torch's maximum / minimum backward is a select (masked_fill_ of the loser to 0); the kernel multiplied the
    gradient by a partial of 0, which made an infinite or NaN gradient NaN at the loser."""
    dtype = DTYPES[precision]
    gemm_out, params = gemm_output(300, 1024, dtype), make_params("feature", 300, 1024, dtype)
    grad_output = torch.randn(300, 1024, device="cuda").to(dtype)
    grad_output[::7] = float("inf")
    grad_output[3::11] = float("nan")
    check_backward(program, gemm_out, params, bound_for(precision), caplog, grad_output=grad_output)


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("kind", ["slopes", "one"])
def test_prelu_backward_gives_the_slopes_0_where_x_is_positive_for_an_infinite_gradient(kind, precision, caplog):
    """torch's prelu backward is a select: where x > 0 a slope's gradient is exactly 0, not grad * 0 (NaN for an
    infinite or NaN grad); where x <= 0 it is x * grad, and x's gradient slope * grad."""
    dtype = DTYPES[precision]
    gemm_out, params = gemm_output(300, 1024, dtype), make_params(kind, 300, 1024, dtype)
    grad_output = torch.randn(300, 1024, device="cuda").to(dtype)
    gemm_out[::7] = gemm_out[::7].abs() + 0.5
    grad_output[::7] = float("inf")
    grad_output[::14] = float("nan")
    check_backward("prelu(%0,$0)", gemm_out, params, bound_for(precision), caplog, grad_output=grad_output)


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("lead, slopes, fallback", [((1, 200), 200, None), ((2, 100), 1, None),
                                                    ((2, 100), 100, "not (row, feature)")])
def test_prelu_backward_of_a_3d_output_sums_each_slope_over_its_channel(lead, slopes, fallback, precision, caplog):
    """Slopes along dim 1: per row of a (1, T, N) output; per T rows of a (B, T, N) one is the reference's."""
    dtype = DTYPES[precision]
    gemm_out = torch.randn(*lead, 512, device="cuda").to(dtype)
    params = [torch.randn(slopes, device="cuda").to(dtype)]
    check_backward("prelu(%0,$0)", gemm_out, params, bound_for(precision), caplog, fallback=fallback)


# ---------------------------------------------------------------- shapes and group counts

@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("n", [96, 1000, 1024, 8192])
@pytest.mark.parametrize("m", [1, 3, 1000, 4096])
def test_backward_shapes_and_group_counts(m, n, precision, caplog):
    dtype = DTYPES[precision]
    vector = 128 // torch.finfo(dtype).bits  # elements per 16 bytes
    for groups in [g for g in (1, 16, 256, 512) if n % g == 0]:
        program = f"add(%0,$0);hardtanh(%1,-1.0,1.0);mish(%2);group_norm(%3,$1,$2,{groups},1e-05)"
        params = [torch.randn(n, device="cuda").to(dtype) for _ in range(3)]
        off_grid = (n // groups) % vector != 0  # groups smaller than a 16-byte vector, or straddling them
        check_backward(program, gemm_output(m, n, dtype), params, bound_for(precision), caplog,
                       fallback="a group size off the lanes' grid" if off_grid else None)


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_backward_of_the_examples_at_full_size(name, precision, caplog):
    program = EXAMPLES[name]
    dtype = DTYPES[precision]
    m, n = 1024, 8192
    shapes = {"linear_groupnorm_min_bias": [(n,), (n,), (1, n, 1, 1)]}.get(name, [(n,)] * (3 if "mish" in name else 2))
    params = [torch.randn(shape, device="cuda").to(dtype) for shape in shapes]
    check_backward(program, gemm_output(m, n, dtype), params, bound_for(precision), caplog)


# ---------------------------------------------------------------- program families and limits

FAMILY_FALLBACKS = {  # program -> the reason the backward kernel declines it
    "sigmoid(%0);mul(%0,%1)": "read again later",
    "relu(%0);tanh(%0);add(%1,%2);mul(%3,%0)": "read again later",
    "amax(%0,-1,True);sub(%0,%1);exp(%2)": "read again later",
    "mean(%0,-1,True);sub($0,%1);sigmoid(%2);mul(%3,%2)": "more than adds and subtracts",
    "amin(%0,-1,True);add(%1,$0);prelu(%2,$1)": "more than adds and subtracts",
    "amax(%0,-1,True);add(%1,0.0);sub(%1,%2);gelu(%3,'none')": "read again later",
}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"], indirect=True)
@pytest.mark.parametrize("family", range(len(FAMILIES)))
def test_backward_program_families(family, precision, caplog):
    program, param_shapes, _ = FAMILIES[family]
    dtype = DTYPES[precision]
    m, n = 300, 1024
    params = [torch.randn(resolve(s, m, n), device="cuda").to(dtype) for s in param_shapes]
    check_backward(program, gemm_output(m, n, dtype), params, bound_for(precision), caplog,
                   fallback=FAMILY_FALLBACKS.get(program))


MORE_PROGRAMS = [  # (program, param shapes): per-row values meeting full ones, params used twice, scalars
    ("amax(%0,-1,True);mul(%1,$0)", [("n",)]),                   # a per-row value times a per-feature param
    ("logsumexp(%0,-1,True);add(%1,$0)", [("m", "n")]),           # ... plus a full param
    ("mul(%0,$0);tanh(%1);mul(%2,$0)", [("n",)]),                  # one param, two uses
    ("add(%0,$0);softplus(%1,1.0,20.0)", [(1,)]),                  # a one-element param
    ("layer_norm(%0,None,None,1e-05);mul(%1,$0)", [("m", 1)]),     # no affine; a per-row param
    ("sum(%0,-1,True);div(%1,$0);relu(%2)", [("m", 1)]),           # per-row value and param
    ("amin(%0,-1,True);sub($0,%1);add(%2,1.5)", [(1, "n", 1, 1)]),  # broadcast tails of adds and subtracts:
    ("relu(%0);amax(%1,1,True);sub(%2,$0);sub($1,%3)", [(1, "n", 1, 1), ("n", 1, 1)]),  # their signs
]


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("case", range(len(MORE_PROGRAMS)))
def test_backward_where_values_and_params_broadcast(case, precision, caplog):
    program, param_shapes = MORE_PROGRAMS[case]
    dtype = DTYPES[precision]
    m, n = 257, 512
    params = [torch.randn(resolve(s, m, n), device="cuda").to(dtype) + 2.0 for s in param_shapes]
    check_backward(program, gemm_output(m, n, dtype), params, bound_for(precision), caplog)


@pytest.mark.parametrize("needs", [[True, False, False, False], [False, True, True, False], [False, False, False, True],
                                   [True, True, True, True]])
def test_backward_returns_only_the_gradients_asked_for(needs, caplog):
    program = EXAMPLES["linear_hardtanh_mish_groupnorm"]
    params = [torch.randn(1024, device="cuda") for _ in range(3)]
    check_backward(program, gemm_output(100, 1024, torch.float32), params, BOUNDS["fp32"], caplog, needs=needs)


def test_backward_reads_an_expanded_gradient(caplog):
    """A later sum's backward hands over an expanded gradient (stride 0 along the features)."""
    program = "group_norm(%0,$0,$1,16,1e-05);leaky_relu(%1,0.01)"
    params = [torch.randn(1024, device="cuda") for _ in range(2)]
    grad_output = torch.randn(100, 1, device="cuda").expand(100, 1024)
    check_backward(program, gemm_output(100, 1024, torch.float32), params, BOUNDS["fp32"], caplog,
                   grad_output=grad_output)


@pytest.mark.parametrize("n, groups, reason", [(97, 1, "whole 16-byte vectors"), (16384, 1, "longer than the backward"),
                                               (1000, 500, "off the lanes' grid"), (1024, 1024, "off the lanes' grid")])
def test_backward_declines_what_its_kernel_cannot_take(n, groups, reason, caplog):
    """Rows the backward's registers or vectors do not take, and groups inside a 16-byte vector (of 2 or 1
    features, GROUP_IN_VECTOR: the backward keeps one statistic pair a chunk)."""
    program = f"group_norm(%0,$0,$1,{groups},1e-05);relu(%1)"
    params = [torch.randn(n, device="cuda") for _ in range(2)]
    check_backward(program, gemm_output(40, n, torch.float32), params, BOUNDS["fp32"], caplog, fallback=reason)


@pytest.mark.parametrize("program", [EXAMPLES["linear_groupnorm_hardtanh"], "amin(%0,-1,False);mul(%1,$2)"])
def test_backward_opcheck_on_the_gpu(program):
    params = [torch.randn(256, device="cuda") for _ in range(2)] + [torch.randn(32, device="cuda")]
    gemm_out = gemm_output(32, 256, torch.float32)
    grad_output = torch.randn(result_shape(program, gemm_out, params), device="cuda")
    needs = [True, True, True, "$2" in program]
    torch.library.opcheck(torch.ops.fxfuse.epilogue_backward.default, (grad_output, gemm_out, params, program, needs))


def test_a_misaligned_gemm_out_is_declined(caplog):
    """A contiguous view one element into its storage: the kernel's 16-byte row copies would fault ('misaligned
    address', which poisons the process's CUDA context); the reference takes it (found by review)."""
    program = EXAMPLES["linear_groupnorm_hardtanh"]
    params = [torch.randn(256, device="cuda") for _ in range(2)]
    gemm_out = torch.randn(32 * 256 + 1, device="cuda")[1:].view(32, 256)
    check_backward(program, gemm_out, params, BOUNDS["fp32"], caplog, fallback="16-byte aligned")


def test_backward_runs_on_the_current_non_default_stream():
    program = EXAMPLES["linear_groupnorm_hardtanh"]
    params = [torch.randn(1024, device="cuda") for _ in range(2)]
    gemm_out = gemm_output(512, 1024, torch.float32)
    grad_output = torch.randn(512, 1024, device="cuda")
    expected = torch.ops.fxfuse.epilogue_backward(grad_output, gemm_out, params, program, [True] * 3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = torch.ops.fxfuse.epilogue_backward(grad_output, gemm_out, params, program, [True] * 3)
    torch.cuda.current_stream().wait_stream(stream)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


def test_a_tail_params_gradient_is_not_grad_output_itself(caplog):
    """A tail param of the output's shape and dtype: its gradient, grad_output summed to its size and cast, was
    grad_output's own memory, which the op's Tensor[] may not return (found by review); a later in-place change of
    one changed the other."""
    program = "amin(%0,-1,True);add(%1,$0)"  # [M, 1] + [2, M, N]
    gemm_out, param = gemm_output(64, 128, torch.float32), torch.randn(2, 64, 128, device="cuda")
    grad_output = torch.randn(2, 64, 128, device="cuda")
    with caplog.at_level(logging.DEBUG, logger="fxfuse"):
        grads = torch.ops.fxfuse.epilogue_backward(grad_output, gemm_out, [param], program, [True, True])
    assert not [r for r in caplog.records if FALLBACK in r.getMessage()]
    torch.testing.assert_close(grads[1], grad_output)
    assert not grads[1]._is_view() and grads[1].untyped_storage().data_ptr() != grad_output.untyped_storage().data_ptr()
