"""Builds one kernel variant (a patch against kernels/) and times its epilogue kernels alone.

Usage: python dev/variant_bench.py dev/variants/NN_name.patch  (one variant per process: each registers the op)
       python dev/variant_bench.py current                   (kernels/ as it is)
Prints, per example program and precision (fp32 IEEE, tf32, bf16) at 1024 x 8192 -> 8192, the epilogue
kernels' CUDA time per call (torch.profiler; the row kernel and the broadcast tail apart where there is a tail, and
the union of their intervals as fxfuse.bench reports it, since each kernel's time counts its early-launch wait),
the share of the copy bandwidth it reaches, the whole op's time (GEMM and epilogue) over the GEMM alone's, each
the median of 50 calls timed with CUDA events as fxfuse.bench times them, and the result's error against the
float64 reference (||out - ref|| / ||ref||: the CUDA tests' bound is 1e-5 for fp32, 5e-4 for tf32, 1e-2 for bf16).
"""
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fxfuse.bench import ROW_KERNELS, copy_bandwidth_gbs, epilogue_kernel_us, time_ms
from fxfuse.program import run_reference

sys.path.insert(0, str(Path(__file__).parent))
from profile_epilogue import PROGRAMS  # noqa: E402
from variant_sources import load_kernels  # noqa: E402

variant = load_kernels(sys.argv[1])
bandwidth = copy_bandwidth_gbs()
for precision, dtype in (("float32", torch.float32), ("tf32", torch.float32), ("bfloat16", torch.bfloat16)):
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    x = torch.randn(1024, 8192, device="cuda", dtype=dtype)
    w = torch.randn(8192, 8192, device="cuda", dtype=dtype) * 8192 ** -0.5
    b = torch.randn(8192, device="cuda", dtype=dtype)
    gemm_ms = time_ms(lambda: torch.nn.functional.linear(x, w, b), [[]], runs=50)
    for name, (program, shapes) in PROGRAMS.items():
        params = [torch.randn(s, device="cuda", dtype=dtype) for s in shapes]
        call = lambda: torch.ops.fxfuse.gemm_epilogue(x, w, b, params, program)
        out = call()
        ref = run_reference(x.double(), w.double(), b.double(), [p.double() for p in params], program)
        error = ((out.double() - ref).norm() / ref.norm()).item()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                call()
            torch.cuda.synchronize()
        events = prof.key_averages()
        kernel_us = {part: sum(e.device_time_total for e in events if any(k in e.key for k in kinds)) / 20
                     for part, kinds in (("row", ROW_KERNELS), ("tail", ("broadcast_tail",)))}
        us = sum(kernel_us.values())
        nbytes = x.shape[0] * w.shape[0] * x.element_size() + out.numel() * out.element_size()
        floor = nbytes / (bandwidth * 1e9) * 1e6
        op_ratio = time_ms(call, [[]], runs=50) / gemm_ms
        print(f"{variant:<12} {precision:<9} {name:<10} {us:7.1f} us  floor {floor:5.1f} us  "
              f"{floor / us * 100:4.0f}% of copy bandwidth  op/GEMM {op_ratio:.3f}  error {error:.1e}"
              + (f"  (row {kernel_us['row']:.1f} + tail {kernel_us['tail']:.1f} us, together "
                 f"{epilogue_kernel_us(call, [], calls=20):.1f})" if kernel_us["tail"] else ""))
