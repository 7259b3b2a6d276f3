"""The main job: optimize the bundled examples and show what fxfuse did.

Entry points: ``python -m fxfuse demo [files...]`` (``main``) and ``run_example_file(path)`` (what
``python examples/<name>.py`` calls).

For each model file it prints the explain table, the check against eager and a timing table. With a GPU it
runs the CUDA kernels at full size; without one, the reference implementation on the CPU at a small size.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from .api import optimize
from .modelfile import example_files, load_model_file
from .testing import assert_close_report, fused_op_count

CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _time_ms(fn, inputs, device: torch.device, repeats: int) -> float:
    """Median wall time of `fn(*inputs)` in ms (CUDA events on a GPU)."""
    with torch.no_grad():
        for _ in range(3):
            fn(*inputs)
        samples = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(*inputs)
                stop.record()
                stop.synchronize()
                samples.append(start.elapsed_time(stop))
            else:
                begin = time.perf_counter()
                fn(*inputs)
                samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples)


def run_model_file(path, device: torch.device, small: bool, dtype: torch.dtype = torch.float32) -> dict:
    """Optimize one model file on `device`; print explain, the eager check and timings. Returns the numbers."""
    model_file = load_model_file(path, small=small)
    model, inputs = model_file.build()
    model = model.to(device=device, dtype=dtype)
    inputs = [t.to(device=device, dtype=dtype) if torch.is_tensor(t) else t for t in inputs]
    shape = " x ".join(str(tuple(t.shape)) for t in inputs if torch.is_tensor(t))
    print(f"\n=== {model_file.name}  ({shape}, {str(dtype).replace('torch.', '')}, {device.type}) ===")
    optimized = optimize(model, inputs)
    print(optimized.fxfuse_report)
    with torch.no_grad():
        expected, actual = model(*inputs), optimized(*inputs)
    tolerance = CHECK_TOLERANCE[dtype]
    assert_close_report(actual, expected, rtol=tolerance, atol=tolerance)
    error = ((actual.double() - expected.double()).norm() / expected.double().norm()).item()
    print(f"check against eager: OK (relative error {error:.2e}, {fused_op_count(optimized)} fused op(s))")
    repeats = 50 if device.type == "cuda" else 5
    eager_ms = _time_ms(model, inputs, device, repeats)
    fused_ms = _time_ms(optimized, inputs, device, repeats)
    return {"name": model_file.name, "eager": eager_ms, "fxfuse": fused_ms}


def run_example_file(path) -> None:
    """`python examples/<name>.py [--full] [--small]`: optimize that one example."""
    parser = argparse.ArgumentParser(description=f"Optimize {path} with fxfuse and check it against eager.")
    parser.add_argument("--small", action="store_true", help="small sizes (the default on the CPU)")
    parser.add_argument("--full", action="store_true", help="full sizes (the default on a GPU)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = args.small or (device.type == "cpu" and not args.full)
    _print_timings([run_model_file(path, device, small)], device)


def _print_timings(rows: list[dict], device: torch.device) -> None:
    print(f"\ntimings ({device.type}, median ms; the full benchmark is `python -m fxfuse.bench`):")
    print(f"{'model':<40} {'eager':>10} {'fxfuse':>10} {'speedup':>8}")
    for row in rows:
        print(f"{row['name']:<40} {row['eager']:>10.3f} {row['fxfuse']:>10.3f} {row['eager'] / row['fxfuse']:>7.2f}x")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxfuse demo",
                                     description="Optimize model files (default: the bundled examples).")
    parser.add_argument("files", nargs="*", help="KernelBench-style model files")
    parser.add_argument("--small", action="store_true", help="small sizes (the default on the CPU)")
    parser.add_argument("--full", action="store_true", help="full sizes (the default on a GPU)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    small = args.small or (device.type == "cpu" and not args.full)
    files = args.files or example_files()
    if not files:
        print("fxfuse demo: no model files given and no bundled examples found", file=sys.stderr)
        return 2
    rows = [run_model_file(path, device, small) for path in files]
    _print_timings(rows, device)
    return 0
