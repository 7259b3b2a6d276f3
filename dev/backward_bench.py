"""Times the epilogue's backward at full size (1024 x 8192): the CUDA kernel (torch.ops.fxfuse.epilogue_backward)
against the reference it replaces (epilogue_backward_fallback: autograd through the reference ops), per example
program and dtype.

Usage: python dev/backward_bench.py [fp32,bf16]
Prints, per program: the op's wall time per call (CUDA events, back-to-back calls, so CPU-bound calls show it),
and the CUDA time of its kernels per call (torch.profiler), with the backward row kernel's own share.
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from fxfuse import kernels
from fxfuse.program import run_program

PROGRAMS = {  # the examples' programs at full size (tests/test_cuda_kernels.py::EXAMPLES) and their param shapes
    "hardtanh": ("group_norm(%0,$0,$1,16,1e-05);hardtanh(%1,-2.0,2.0)", [(8192,)] * 2),
    "leaky_sum": ("group_norm(%0,$0,$1,512,1e-05);leaky_relu(%1,0.01);add(%2,%2)", [(8192,)] * 2),
    "min_bias": ("group_norm(%0,$0,$1,512,1e-05);min_dim(%1,1,True);add(%2,$2)", [(8192,), (8192,), (1, 8192, 1, 1)]),
    "mish": ("add(%0,$0);hardtanh(%1,-1.0,1.0);mish(%2);group_norm(%3,$1,$2,256,1e-05)", [(8192,)] * 3),
}
RUNS = 50
M, N = 1024, 8192


def time_calls(fn):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(RUNS):
        fn()
    end.record()
    torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) / RUNS * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(RUNS):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    cuda_us = sum(e.device_time_total for e in events) / RUNS
    kernel_us = sum(e.device_time_total for e in events if "row_backward_kernel" in e.key) / RUNS
    return wall_us, cuda_us, kernel_us


def main():
    assert kernels.load()
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    chosen = sys.argv[1].split(",") if len(sys.argv) > 1 else list(dtypes)
    print(f"{'program':<10} {'dtype':<5} {'kernel: wall us':>16} {'CUDA us':>8} {'row kernel us':>14} "
          f"{'reference: wall us':>19} {'CUDA us':>8}")
    for name, (program, shapes) in PROGRAMS.items():
        for dtype_name in chosen:
            dtype = dtypes[dtype_name]
            gemm_out = torch.randn(M, N, device="cuda", dtype=dtype)
            params = [torch.randn(shape, device="cuda", dtype=dtype) for shape in shapes]
            grad_output = torch.randn(run_program(gemm_out, params, program).shape, device="cuda", dtype=dtype)
            needs = [True] * (1 + len(params))
            fused = time_calls(lambda: torch.ops.fxfuse.epilogue_backward(grad_output, gemm_out, params, program, needs))
            reference = time_calls(lambda: torch.ops.fxfuse.epilogue_backward_fallback(
                grad_output, gemm_out, params, program, needs, "benchmark"))
            print(f"{name:<10} {dtype_name:<5} {fused[0]:>16.1f} {fused[1]:>8.1f} {fused[2]:>14.1f} "
                  f"{reference[0]:>19.1f} {reference[1]:>8.1f}")


if __name__ == "__main__":
    main()
