"""GPU benchmark of the fused op against eager, torch.compile and the GEMM alone.

Entry point: ``python -m fxfuse.bench [model files...] [--png PATH] [--runs N]`` (default: examples/*.py).

For each model file and each precision (fp32 IEEE, tf32, bf16) it times every entry of ``COLUMNS`` and the GEMM
alone (``F.linear`` with the model's own Linear weights at the same precision) with CUDA events: warm-up, then the
median of many calls, rotating several input sets so that inputs do not sit in L2, and taking the calls of all
of them in round-robin passes so that each ratio compares times taken at the same clocks. Each batch of calls is
queued while the GPU spins, so the times are GPU times with the host kept ahead (a call's host cost is apart:
dev/host_cost.py). It prints one table of times and ratios to the GEMM alone, writes a PNG bar chart of the
ratios, and reports the epilogue kernels' own time (from torch.profiler's CUDA kernel records of the fxfuse call)
against the memory floor: bytes the epilogue must read and write over the device-to-device copy bandwidth
measured in the same run.

Each model also gets a training-step row per precision in ``TRAINING_PRECISIONS``: forward + backward + SGD step
for every column, with the same step of the GEMM alone as its baseline (its epilogue columns stay empty), each the
median of five timed loops of steps.

A column is one ``Column`` entry in ``COLUMNS``: a name and a function (model, example inputs) -> callable.
"""
from __future__ import annotations

import argparse
import statistics
import struct
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .modelfile import example_files, load_model_file

PRECISIONS = [  # (name, dtype, allow_tf32)
    ("fp32", torch.float32, False),
    ("tf32", torch.float32, True),
    ("bf16", torch.bfloat16, False),
]
TRAINING_PRECISIONS = ["bf16"]  # training-step rows; each costs two more Inductor compiles of forward + backward
INPUT_SETS = 4          # x of 1024 x 8192 fp32 is 32 MB: four sets exceed the H100's 50 MB L2
ROW_KERNELS = ("fast_row_kernel", "chain_row_kernel", "row_program_kernel")
EPILOGUE_KERNELS = ROW_KERNELS + ("broadcast_tail_kernel",)


@dataclass(frozen=True)
class Column:
    name: str
    build: Callable[[nn.Module, list], Callable]


def _build_fxfuse(model, inputs):
    import fxfuse

    return fxfuse.optimize(model, inputs)


def _build_compile_fxfuse(model, inputs):
    import fxfuse  # noqa: F401  (registers the backend)

    return torch.compile(model, backend="fxfuse")


COLUMNS = [
    Column("eager", lambda model, inputs: model),
    Column("torch.compile", lambda model, inputs: torch.compile(model)),
    Column("fxfuse", _build_fxfuse),
    Column("compile(fxfuse)", _build_compile_fxfuse),
]


def first_linear(model: nn.Module) -> nn.Linear:
    return next(m for m in model.modules() if isinstance(m, nn.Linear))


HOST_HEADSTART_CYCLES = 50_000_000  # about 25 ms of GPU clock: time for the host to queue a batch of calls


def _call_times_ms(fn: Callable, input_sets: list[list], runs: int) -> list[float]:
    """Milliseconds of each of `runs` calls of fn(*inputs), rotating the input sets; all calls queued, one sync.
    The GPU first spins while the host queues them, so that each time is the GPU's for that call (its kernels and
    the gaps between them), not the host's: on the shared machines the host at times took 2-3x a bf16 call's GPU
    time, and the fxfuse and torch.compile cells of bf16 rows then read 1.7-2.6x the GEMM alone, not 1.06-1.13x."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    torch.cuda._sleep(HOST_HEADSTART_CYCLES)
    for i, (start, end) in enumerate(events):
        start.record()
        fn(*input_sets[i % len(input_sets)])
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def time_ms(fn: Callable, input_sets: list[list], runs: int, warmup: int = 5) -> float:
    """Median milliseconds of fn(*inputs), rotating the input sets."""
    return time_interleaved_ms({"fn": fn}, input_sets, runs, rounds=1, warmup=warmup)["fn"]


def time_interleaved_ms(fns: dict[str, Callable], input_sets: list[list], runs: int, rounds: int = 5,
                        warmup: int = 5) -> dict[str, float]:
    """Median milliseconds per call of each fn, its `runs` calls split over `rounds` round-robin passes through
    all of them, so that each is timed at the same clocks: a GEMM's time drifts by about 1% over the minutes a
    model's row takes (fp32 GEMM alone 2.702 ms in one row, 2.726 in the next, timed one after the other)."""
    times = {name: [] for name in fns}
    with torch.no_grad():
        for fn in fns.values():
            for i in range(warmup):
                fn(*input_sets[i % len(input_sets)])
        torch.cuda.synchronize()
        for r in range(rounds):
            for name, fn in fns.items():
                times[name] += _call_times_ms(fn, input_sets, runs // rounds + (r < runs % rounds))
    return {name: statistics.median(t) for name, t in times.items()}


def time_loop_ms(fn: Callable, input_sets: list[list], runs: int, warmup: int = 20, loops: int = 5) -> float:
    """Milliseconds per call of fn(*inputs): the median, over `loops` loops, of the mean over `runs` back-to-back
    calls between two events (training steps: their CPU-side autograd and optimizer work is part of a step, and
    per-call events read it unevenly; one loop alone swung by +-0.5x of the GEMM step between runs)."""
    means = []
    with torch.enable_grad():
        for i in range(warmup):
            fn(*input_sets[i % len(input_sets)])
        for _ in range(loops):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(runs):
                fn(*input_sets[i % len(input_sets)])
            end.record()
            torch.cuda.synchronize()
            means.append(start.elapsed_time(end) / runs)
    return statistics.median(means)


def training_step(forward: Callable, params: list) -> Callable:
    """One training step of `forward`: zero the gradients, backward of the output's sum, an SGD step (a tiny
    learning rate, so that repeated steps leave the weights where they were)."""
    optimizer = torch.optim.SGD([p for p in params if p is not None], lr=1e-7)

    def step(*inputs):
        optimizer.zero_grad(set_to_none=True)
        forward(*inputs).sum().backward()
        optimizer.step()

    return step


def bench_training(model_file, precision: str, dtype: torch.dtype, input_sets: list[list], runs: int) -> dict:
    """A training-step row: forward + backward + optimizer step of every column, and of the GEMM alone."""
    torch._dynamo.reset()
    model, _ = model_file.build()
    model = model.to(device="cuda", dtype=dtype).train()
    linear = first_linear(model)
    gemm_step = training_step(lambda x, *_: F.linear(x, linear.weight, linear.bias), [linear.weight, linear.bias])
    row = {"model": model_file.name, "precision": f"{precision} train", "epilogue_us": float("nan"),
           "floor_us": float("nan"), "gemm": time_loop_ms(gemm_step, input_sets, runs)}
    for column in COLUMNS:
        step = training_step(column.build(model, input_sets[0]), list(model.parameters()))
        row[column.name] = time_loop_ms(step, input_sets, runs)
    return row


def copy_bandwidth_gbs(nbytes: int = 1 << 30, runs: int = 20) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), [[]], runs)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def epilogue_kernel_us(fn: Callable, inputs: list, calls: int = 10, kernels: tuple = EPILOGUE_KERNELS) -> float:
    """Mean GPU time per call during which an epilogue kernel ran (the fused op's own launches after its GEMM), or
    a kernel whose name contains one of `kernels`: the union of their intervals, since a kernel launched early
    overlaps the one before it."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn(*inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn(*inputs)
            torch.cuda.synchronize()
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA and any(k in e.name for k in kernels))
    total, covered_until = 0.0, float("-inf")
    for start, end in intervals:
        total += max(end - max(start, covered_until), 0)
        covered_until = max(covered_until, end)
    return total / calls


def epilogue_bytes(model: nn.Module, inputs: list, out: torch.Tensor, pool: int | None = None) -> int:
    """Fewest bytes the epilogue moves: the GEMM output read once (of out_features // pool features where a pool
    folded into the GEMM), the result written once."""
    linear = first_linear(model)
    rows = inputs[0].numel() // inputs[0].shape[-1]
    element = out.element_size()
    return rows * (linear.out_features // (pool or 1)) * element + out.numel() * element


def bench_file(path, runs: int, bandwidth: float, rounds: int = 5) -> list[dict]:
    model_file = load_model_file(path)
    rows = []
    for precision, dtype, allow_tf32 in PRECISIONS:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
        torch._dynamo.reset()
        model, inputs = model_file.build()
        model = model.to(device="cuda", dtype=dtype)
        input_sets = [[t.to(device="cuda", dtype=dtype) if t.is_floating_point() else t.cuda() for t in inputs]]
        input_sets += [[torch.rand_like(t) for t in input_sets[0]] for _ in range(INPUT_SETS - 1)]
        linear = first_linear(model)
        callables = {"gemm": lambda x, *_: F.linear(x, linear.weight, linear.bias)}
        for column in COLUMNS:
            callables[column.name] = column.build(model, input_sets[0])
        row = {"model": model_file.name, "precision": precision,
               **time_interleaved_ms(callables, input_sets, runs, rounds)}
        fused = callables["fxfuse"]
        with torch.no_grad():
            out = fused(*input_sets[0])
        row["epilogue_us"] = epilogue_kernel_us(fused, input_sets[0])
        pool = fused.fxfuse_report.fused[0].pool if fused.fxfuse_report.fused else None
        row["floor_us"] = epilogue_bytes(model, input_sets[0], out, pool) / (bandwidth * 1e9) * 1e6
        rows.append(row)
        print(format_row(row), flush=True)
        if precision in TRAINING_PRECISIONS:
            rows.append(bench_training(model_file, precision, dtype, input_sets, runs))
            print(format_row(rows[-1]), flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    return rows


def header() -> str:
    cells = [f"{'model':<32}", f"{'prec':<10}", f"{'GEMM ms':>8}"]
    cells += [f"{c.name + ' ms (x GEMM)':>26}" for c in COLUMNS]
    cells += [f"{'epilogue us':>11}", f"{'floor us':>9}", f"{'% copy BW':>9}"]
    return " ".join(cells)


def format_row(row: dict) -> str:
    cells = [f"{row['model']:<32}", f"{row['precision']:<10}", f"{row['gemm']:>8.3f}"]
    cells += [f"{row[c.name]:>15.3f} ({row[c.name] / row['gemm']:6.3f}x)" for c in COLUMNS]
    share = row["floor_us"] / row["epilogue_us"] * 100 if row["epilogue_us"] else float("nan")
    cells += [f"{row['epilogue_us']:>11.1f}", f"{row['floor_us']:>9.1f}", f"{share:>8.0f}%"]
    return " ".join(cells)


# ---------------------------------------------------------------- the PNG chart

def write_png(rows: list[dict], path: Path) -> None:
    """Bar chart of each column's time over the GEMM alone, one group per (model, precision)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _write_plain_png(rows, path)
        return
    labels = [f"{r['model']}\n{r['precision']}" for r in rows]
    width = 0.8 / len(COLUMNS)
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 1.2), 5))
    for i, column in enumerate(COLUMNS):
        ax.bar([k + i * width for k in range(len(rows))], [r[column.name] / r["gemm"] for r in rows], width,
               label=column.name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([k + width * (len(COLUMNS) - 1) / 2 for k in range(len(rows))], labels, fontsize=6)
    ax.set_ylabel("time / GEMM alone")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]


def _write_plain_png(rows: list[dict], path: Path) -> None:
    """The same chart without matplotlib: bars only, a black line at 1.0, grey lines every 0.5; colours in
    COLUMNS order (blue, orange, green, ...), groups in table order."""
    ratios = [[r[c.name] / r["gemm"] for c in COLUMNS] for r in rows]
    top = max(2.0, max(max(g) for g in ratios) * 1.05)
    bar, gap, height = 10, 14, 300
    width = gap + len(rows) * (len(COLUMNS) * bar + gap)
    pixels = [[(255, 255, 255)] * width for _ in range(height)]

    def y_of(value):
        return height - 1 - min(height - 1, int(value / top * (height - 1)))

    for tick in range(1, int(top / 0.5) + 1):
        pixels[y_of(tick * 0.5)] = [(220, 220, 220)] * width
    for g, group in enumerate(ratios):
        x0 = gap + g * (len(COLUMNS) * bar + gap)
        for c, value in enumerate(group):
            for y in range(y_of(value), height):
                for x in range(x0 + c * bar, x0 + (c + 1) * bar - 1):
                    pixels[y][x] = COLORS[c % len(COLORS)]
    pixels[y_of(1.0)] = [(0, 0, 0)] * width
    raw = b"".join(b"\x00" + bytes(v for px in line for v in px) for line in pixels)

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    path.write_bytes(png)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxfuse.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="KernelBench-style model files (default: examples/*.py)")
    parser.add_argument("--png", default="bench.png", help="where to write the chart (default: bench.png)")
    parser.add_argument("--runs", type=int, default=50, help="timed calls per measurement (default: 50)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="round-robin passes the runs are split over (default: 5; 1 times each column in turn)")
    parser.add_argument("--columns", default=",".join(c.name for c in COLUMNS),
                        help="comma-separated columns to time (default: all; fxfuse is always timed)")
    parser.add_argument("--training", default=",".join(TRAINING_PRECISIONS),
                        help="comma-separated precisions that get a training-step row, or 'none' "
                             f"(default: {','.join(TRAINING_PRECISIONS)})")
    args = parser.parse_args(argv)
    TRAINING_PRECISIONS[:] = [p for p in args.training.split(",") if p != "none"]
    wanted = set(args.columns.split(",")) | {"fxfuse"}
    COLUMNS[:] = [c for c in COLUMNS if c.name in wanted]
    if not torch.cuda.is_available():
        print("fxfuse.bench: needs a CUDA GPU", file=sys.stderr)
        return 1
    files = args.files or example_files()
    bandwidth = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"device-to-device copy {bandwidth:.0f} GB/s (read + write)")
    print(header(), flush=True)
    rows = [row for path in files for row in bench_file(path, args.runs, bandwidth, args.rounds)]
    write_png(rows, Path(args.png))
    print(f"\nchart: {args.png}")
    print(header())
    for row in rows:
        print(format_row(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
