"""GPU tests of torch.ops.fxfuse.mean_of_row_groups's CUDA kernel (kernels/row_group_mean.cu), the weight averaging
of a feature pool folded into the GEMM, run with `pytest -m cuda`.

Each result is compared with the op's reference (fxfuse.library.mean_of_row_groups_reference) on float64 copies, by
||out - ref|| / ||ref|| against the dtype's bound (1e-5 fp32, 1e-2 bf16 / fp16), on fresh random inputs and an
allocator poisoned with NaN; the kernel must have run (no fallback logged), except for the inputs it sends to the
reference, which must say why.
"""
import logging

import pytest
import torch

from fxfuse import kernels
from fxfuse.library import mean_of_row_groups_reference
from fxfuse.testing import assert_close_report

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
op = torch.ops.fxfuse.mean_of_row_groups


@pytest.fixture(scope="module", autouse=True)
def loaded_kernels():
    assert kernels.load(), "the CUDA kernels did not build or load"


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def run_and_check(tensor: torch.Tensor, size: int, caplog) -> torch.Tensor:
    """The op's result on `tensor`, checked against the float64 reference, with the kernel's run asserted."""
    groups = tensor.shape[0] // size
    torch.full((groups, *tensor.shape[1:]), float("nan"), device=tensor.device, dtype=tensor.dtype)  # poison
    with caplog.at_level(logging.DEBUG, logger="fxfuse"):
        out = op(tensor, size)
    fallbacks = [r.getMessage() for r in caplog.records if "runs the reference" in r.getMessage()]
    assert not fallbacks, fallbacks
    ref = mean_of_row_groups_reference(tensor.double(), size)
    assert out.shape == ref.shape and out.dtype == tensor.dtype
    error = relative_error(out, ref)
    if not error <= BOUNDS[tensor.dtype]:
        worst = (out.double() - ref).abs().argmax()
        index = torch.unravel_index(worst, ref.shape)
        pytest.fail(f"relative error {error:.3g} > {BOUNDS[tensor.dtype]}; worst at {tuple(int(i) for i in index)}: "
                    f"{out[index].item()} against {ref[index].item()}")
    return out


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (shape, size): the pool example's weight and bias at full size, rows of whole 16-byte vectors and not, a
# partial last group, more dims, groups of one, one group.
SHAPES = [((8192, 8192), 4), ((8192,), 4), ((1000, 96), 3), ((41, 7), 4), ((1023, 1000), 4), ((10, 3, 5), 2),
          ((64, 1024), 1), ((4, 8192), 4), ((3, 8), 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, size", SHAPES, ids=str)
def test_the_kernel_averages_row_groups(shape, size, dtype, caplog):
    run_and_check(torch.randn(shape, device="cuda").to(dtype), size, caplog)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_misaligned_tensor_runs_the_kernel_by_elements(dtype, caplog):
    """A tensor whose storage starts one element past a 16-byte boundary (a slice of a flat buffer)."""
    flat = torch.randn(1 + 64 * 256, device="cuda").to(dtype)
    run_and_check(flat[1:].view(64, 256), 4, caplog)


@pytest.mark.parametrize("case, make, size, reason", [
    ("float64", lambda: torch.randn(16, 8, device="cuda", dtype=torch.float64), 4, "dtype Double"),
    ("transposed", lambda: torch.randn(8, 16, device="cuda").t(), 4, "not contiguous"),
    ("no whole group", lambda: torch.randn(3, 8, device="cuda"), 4, "no whole group"),
    # (a pool over all the features: each of the kernel's few threads would sum 8192 rows in turn)
    ("one group of many rows", lambda: torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16), 8192,
     "too few columns"),
])
def test_other_inputs_run_the_reference_and_log_why(case, make, size, reason, caplog):
    tensor = make()
    with caplog.at_level(logging.DEBUG, logger="fxfuse"):
        try:
            got = op(tensor, size)
        except RuntimeError as error:
            got = error
    messages = [r.getMessage() for r in caplog.records]
    assert any("mean_of_row_groups runs the reference" in m and reason in m for m in messages), messages
    try:
        expected = mean_of_row_groups_reference(tensor, size)
    except RuntimeError as error:  # (fewer rows than `size`: eager's pool error, raised by the reference)
        assert isinstance(got, RuntimeError) and str(got) == str(error)
        return
    assert_close_report(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradients_are_the_references(dtype):
    tensor = torch.randn(41, 96, device="cuda", dtype=dtype, requires_grad=True)
    grad_output = torch.randn(10, 96, device="cuda", dtype=dtype)
    (got,) = torch.autograd.grad(op(tensor, 4), tensor, grad_output)
    (expected,) = torch.autograd.grad(mean_of_row_groups_reference(tensor, 4), tensor, grad_output)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_op_passes_opcheck_on_the_gpu(dtype, requires_grad):
    tensor = torch.randn(41, 96, device="cuda", dtype=dtype, requires_grad=requires_grad)
    torch.library.opcheck(op.default, (tensor, 4))


def test_runs_on_the_current_non_default_stream():
    """The input takes its fresh values late on a side stream: a launch on another stream would read the old ones."""
    tensor = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    op(tensor, 4)
    torch.cuda.synchronize()
    fresh = torch.randn_like(tensor)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        tensor.copy_(fresh)
        out = op(tensor, 4)
    torch.cuda.current_stream().wait_stream(stream)
    assert relative_error(out, mean_of_row_groups_reference(fresh.double(), 4)) <= BOUNDS[torch.bfloat16]


def test_cuda_graph_capture_and_replay():
    static = torch.randn(512, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(static, 4)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = op(static, 4)
    for _ in range(2):
        fresh = torch.randn_like(static)
        static.copy_(fresh)
        static_out.fill_(float("nan"))
        graph.replay()
        assert relative_error(static_out, mean_of_row_groups_reference(fresh.double(), 4)) <= BOUNDS[torch.float32]
