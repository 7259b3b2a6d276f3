"""GPU tests of the fused ops on a second GPU (`pytest -m cuda`; skipped with fewer than two GPUs).

With the current device left at cuda:0, tensors on cuda:1 must run on cuda:1: the GEMM, the row kernel and the
broadcast tail of the forward ops, the backward kernel, and a whole optimized model in training. Each launch goes
on cuda:1's current stream, and the current device is cuda:0 again afterwards. Shared-memory opt-ins and grid
sizes are per device (interpreter.cuh's row_grid), so the long-rows case runs on cuda:1 too, and calls alternate
between the two GPUs without a synchronization between them. Results are judged as tests/test_cuda_kernels.py and
tests/test_cuda_backward.py judge them (a float64 reference, NaN-poisoned outputs).
"""
import pytest
import torch

from test_cuda_backward import check_backward
from test_cuda_kernels import (DTYPES, EXAMPLES, assert_close_to_reference, bound_for,  # noqa: F401
                               check_long_rows, check_runs_on_the_current_stream, example_params, linear_inputs,
                               loaded_kernels, precision, run_and_check)
from test_cuda_training import _example_on, _fused
from fxfuse.testing import assert_gradients_match

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

FIRST, SECOND = torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.fixture(autouse=True)
def current_device_is_the_first():
    """Every test starts with cuda:0 current and must leave it so."""
    torch.cuda.set_device(FIRST)
    yield
    assert torch.cuda.current_device() == 0, "a fused op left another device current"


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"], indirect=True)
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_example_runs_on_its_inputs_gpu(name, precision):
    dtype = DTYPES[precision]
    n = 8192  # the examples' group sizes (16 and 32 features): at 1024, groups of 2 features are ill-conditioned
    x, weight, bias = linear_inputs(300, 257, n, dtype, device=SECOND)
    params = example_params(name, n, dtype, device=SECOND)
    out_shape = (1, n, 300, 1) if name == "linear_groupnorm_min_bias" else None
    out = run_and_check(EXAMPLES[name], x, weight, bias, params, bound_for(precision), out_shape=out_shape)
    assert out.device == SECOND


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
def test_long_rows_take_their_shared_memory_on_the_second_gpu(precision, caplog):
    """12000 features: 64 KB of fp32 staging and 750-wide groups in shared memory, past the 48 KB a launch gets
    without the opt-in, which is per device."""
    check_long_rows(12000, precision, caplog, device=SECOND)


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
def test_runs_on_the_second_gpus_current_stream(precision):
    check_runs_on_the_current_stream(precision, device=SECOND, n=8192, current_device=FIRST)


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
def test_calls_alternate_between_the_gpus(precision):
    program = EXAMPLES["linear_groupnorm_min_bias"]
    dtype = DTYPES[precision]
    calls = []
    for device in [SECOND, FIRST, SECOND, FIRST]:
        x, weight, bias = linear_inputs(256, 512, 8192, dtype, device=device)
        params = example_params("linear_groupnorm_min_bias", 8192, dtype, device=device)
        calls.append((torch.ops.fxfuse.gemm_epilogue(x, weight, bias, params, program), x, weight, bias, params))
    for out, x, weight, bias, params in calls:
        assert out.device == x.device
        assert_close_to_reference(out, x, weight, bias, params, program, bound_for(precision))


def test_inputs_on_two_gpus_raise_as_eager_does():
    x, weight, bias = linear_inputs(8, 16, 32, torch.float32, device=FIRST)
    weight = weight.to(SECOND)
    with pytest.raises(RuntimeError) as eager:
        torch.nn.functional.linear(x, weight, bias)
    with pytest.raises(RuntimeError) as fused:
        torch.ops.fxfuse.gemm_epilogue(x, weight, bias, [], "relu(%0)")
    assert str(eager.value).splitlines()[0] in str(fused.value)


@pytest.mark.parametrize("precision", ["fp32", "bf16"], indirect=True)
@pytest.mark.parametrize("name", ["linear_groupnorm_min_bias", "linear_hardtanh_mish_groupnorm"])
def test_backward_kernel_on_the_second_gpu(name, precision, caplog):
    dtype = DTYPES[precision]
    m, n = 300, 8192  # the examples' group sizes, on the backward kernel's grid
    gemm_out = torch.randn(m, n, device=SECOND).to(dtype)
    params = example_params(name, n, dtype, device=SECOND)
    check_backward(EXAMPLES[name], gemm_out, params, bound_for(precision), caplog)


@pytest.mark.parametrize("how", ["optimize-train", "optimize-eval"])
@pytest.mark.parametrize("name", ["linear_groupnorm_min_bias", "linear_hardtanh_mish_groupnorm"])
def test_training_on_the_second_gpu_matches_eager(name, how):
    model, inputs = _example_on(name, SECOND)
    assert_gradients_match(model, _fused(model, inputs, how), inputs, rtol=1e-4, atol=1e-4)
