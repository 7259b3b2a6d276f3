"""What a call of each optimized example costs the host, against the GPU time it queues (bf16 unless given).

Usage: python dev/host_cost.py [fp32|tf32|bf16]
Per example: the host µs per call of the fxfuse-optimized model (200 calls queued, no sync in between), the GPU
µs per call over the same 200 calls back to back (events around the loop), and fxfuse.bench's per-call median
(events around each call) for the model and for the GEMM alone. Where the host cost nears the GPU time, the
per-call events take in the host's gaps and the bench's ratio reads high.
"""
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fxfuse
from fxfuse.bench import first_linear, time_ms
from fxfuse.modelfile import load_model_file

precision = sys.argv[1] if len(sys.argv) > 1 else "bf16"
dtype = torch.float32 if precision in ("fp32", "tf32") else torch.bfloat16
torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
calls = 200
print(f"{precision}: host µs per call / GPU µs per call back to back / bench per-call median µs, model and GEMM")
for path in sorted((Path(__file__).parent.parent / "examples").glob("*.py")):
    model, inputs = load_model_file(path).build()
    model = model.to(device="cuda", dtype=dtype)
    inputs = [t.to(device="cuda", dtype=dtype) for t in inputs]
    optimized = fxfuse.optimize(model)
    linear = first_linear(model)
    with torch.no_grad():
        for _ in range(10):
            optimized(*inputs)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host = time.perf_counter()
        start.record()
        for _ in range(calls):
            optimized(*inputs)
        end.record()
        host = (time.perf_counter() - host) / calls * 1e6
        torch.cuda.synchronize()
    gpu = start.elapsed_time(end) / calls * 1e3
    model_us = time_ms(optimized, [inputs], runs=50) * 1e3
    gemm_us = time_ms(lambda x, *_: F.linear(x, linear.weight, linear.bias), [inputs], runs=50) * 1e3
    print(f"{path.stem:34s} host {host:6.1f}  GPU {gpu:6.1f}  bench {model_us:6.1f} / GEMM {gemm_us:6.1f}"
          f"  ({model_us / gemm_us:.3f}x)")
