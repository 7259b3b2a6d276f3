"""Where a call of each optimized example spends its GPU time: every kernel's mean duration and the mean idle gap
before it, from torch.profiler's timeline of 30 calls queued back to back with the bench's four rotating input sets.

Usage: python dev/kernel_gaps.py [fp32|tf32|bf16]   (default bf16)
"""
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import fxfuse
from fxfuse.bench import INPUT_SETS
from fxfuse.modelfile import load_model_file

precision = sys.argv[1] if len(sys.argv) > 1 else "bf16"
dtype = torch.float32 if precision in ("fp32", "tf32") else torch.bfloat16
torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
calls = 30
for path in sorted((Path(__file__).parent.parent / "examples").glob("*.py")):
    model, inputs = load_model_file(path).build()
    model = fxfuse.optimize(model.to(device="cuda", dtype=dtype))
    input_sets = [[t.to(device="cuda", dtype=dtype) for t in inputs]]
    input_sets += [[torch.rand_like(t) for t in input_sets[0]] for _ in range(INPUT_SETS - 1)]
    with torch.no_grad():
        for i in range(10):
            model(*input_sets[i % INPUT_SETS])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(calls):
                model(*input_sets[i % INPUT_SETS])
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    durations, gaps = collections.defaultdict(list), collections.defaultdict(list)
    for before, kernel in zip(kernels, kernels[1:]):
        name = kernel.name.split("<")[0].split("(")[0].replace("void ", "")[-40:]
        durations[name].append(kernel.time_range.elapsed_us())
        gaps[name].append(kernel.time_range.start - before.time_range.end)
    per_call = (kernels[-1].time_range.end - kernels[0].time_range.start) / (calls - 1)
    print(f"{path.stem} ({precision}): {per_call:.1f} µs per call, start to start")
    for name in durations:
        print(f"  {name:42s} {len(durations[name]):3d}x  {sum(durations[name]) / len(durations[name]):7.1f} µs"
              f"  gap before {sum(gaps[name]) / len(gaps[name]):5.1f} µs")
