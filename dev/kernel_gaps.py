"""Where a call of each optimized example spends its GPU time: every kernel's mean duration and the mean idle gap
before it, from torch.profiler's timeline of 30 calls queued behind a GPU spin (as fxfuse.bench queues them, so
that the gaps are the GPU's, not the host's) with the bench's four rotating input sets; the same for the GEMM
alone (F.linear with the model's weights), the baseline of the call's.

Usage: python dev/kernel_gaps.py [fp32|tf32|bf16] [example name part] [variant]   (default bf16, every example,
kernels/ as it is; a variant is a patch of dev/variants, built as dev/variant_bench.py builds it)
"""
import collections
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import fxfuse
from fxfuse.bench import HOST_HEADSTART_CYCLES, INPUT_SETS, first_linear
from fxfuse.modelfile import load_model_file

sys.path.insert(0, str(Path(__file__).parent))
from variant_sources import load_kernels  # noqa: E402

precision = sys.argv[1] if len(sys.argv) > 1 else "bf16"
name_part = sys.argv[2] if len(sys.argv) > 2 else ""
variant = load_kernels(sys.argv[3] if len(sys.argv) > 3 else "current")
dtype = torch.float32 if precision in ("fp32", "tf32") else torch.bfloat16
torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
CALLS = 30


def timeline(fn, input_sets):
    """Per kernel name: (durations, gaps before) in µs; and a call's GPU time: its kernels and the gaps before them."""
    with torch.no_grad():
        for i in range(10):
            fn(*input_sets[i % INPUT_SETS])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.cuda._sleep(HOST_HEADSTART_CYCLES)
            for i in range(CALLS):
                fn(*input_sets[i % INPUT_SETS])
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and "sleep" not in e.name), key=lambda e: e.time_range.start)
    durations, gaps = collections.defaultdict(list), collections.defaultdict(list)
    for before, kernel in zip(kernels, kernels[1:]):
        name = kernel.name.split("<")[0].split("(")[0].replace("void ", "")[-40:]
        durations[name].append(kernel.time_range.elapsed_us())
        gaps[name].append(kernel.time_range.start - before.time_range.end)
    per_call = sum((sum(durations[name]) + sum(gaps[name])) / len(durations[name]) for name in durations)
    return durations, gaps, per_call


for path in sorted(p for p in (Path(__file__).parent.parent / "examples").glob("*.py") if name_part in p.stem):
    model, inputs = load_model_file(path).build()
    model = model.to(device="cuda", dtype=dtype)
    linear = first_linear(model)
    optimized = fxfuse.optimize(model)
    input_sets = [[t.to(device="cuda", dtype=dtype) for t in inputs]]
    input_sets += [[torch.rand_like(t) for t in input_sets[0]] for _ in range(INPUT_SETS - 1)]
    for label, fn in (("GEMM alone", lambda x: F.linear(x, linear.weight, linear.bias)), ("fxfuse", optimized)):
        durations, gaps, per_call = timeline(fn, input_sets)
        print(f"{path.stem} ({precision}, {variant}) {label}: {per_call:.1f} µs per call (kernels and gaps)")
        for name in durations:
            print(f"  {name:42s} {len(durations[name]):3d}x  {sum(durations[name]) / len(durations[name]):7.1f} µs"
                  f"  gap before {sum(gaps[name]) / len(gaps[name]):5.1f} µs")
