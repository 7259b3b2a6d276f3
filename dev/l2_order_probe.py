"""Which part of a GEMM's output is still in L2 when the epilogue starts, and does the order of the epilogue's reads
matter? (1024 x 8192 -> 8192, torch ops only: nothing to build)

Usage: python dev/l2_order_probe.py [fp32|tf32|bf16 ...]   (default tf32 bf16)
Each line is the mean CUDA time (µs, torch.profiler's kernel records) of one read right after a fresh F.linear:
- a copy of the whole output in order (`clone`) and with its rows or columns read in reverse (`flip`);
- the row min (`amin(dim=1)`) of each eighth of the rows and of each eighth of the columns, right after the GEMM and
  again after 256 MB of other writes (the same read from DRAM: the difference is what L2 holds of it).
"""
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

M, K, N = 1024, 8192, 8192
TRIALS = 20
BLOCKS = 8


def mean_kernel_us(gemm, read, flush=None):
    """Mean CUDA time of the kernels `read` launches, each trial right after `gemm` (and `flush`, if given)."""
    with torch.no_grad():
        for _ in range(3):
            y = gemm()
            read(y)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(TRIALS):
                y = gemm()
                if flush is not None:
                    flush()
                torch.cuda.synchronize()
                with torch.profiler.record_function("read"):
                    read(y)
                torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    # Each trial is GEMM, [flush], read: the read's kernels are the ones that are neither a GEMM (cuBLAS's names)
    # nor the flush's fill (printed as a count per trial, to see that the filter kept one kernel a read).
    total, reads = 0.0, 0
    not_reads = ("gemm", "xmma", "nvjet", "cutlass", "fill", "ampere", "sm90")
    for e in kernels:
        name = e.name.lower()
        if any(part in name for part in not_reads) and "reduce" not in name and "copy" not in name:
            continue
        total += e.time_range.elapsed_us()
        reads += 1
    return total / TRIALS, reads / TRIALS


def probe(precision):
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = torch.randn(N, K, device="cuda", dtype=dtype) / K ** 0.5
    b = torch.randn(N, device="cuda", dtype=dtype)
    scratch = torch.empty(64 * 2 ** 20, device="cuda", dtype=torch.float32)  # 256 MB

    def gemm():
        return F.linear(x, w, b)

    def flush():
        scratch.fill_(1.0)

    print(f"== {precision}: {torch.cuda.get_device_name()}, output {M * N * x.element_size() / 2 ** 20:.0f} MB")
    for label, read in (("clone (rows in order)", lambda y: y.clone()),
                        ("flip(0) (rows in reverse)", lambda y: y.flip(0)),
                        ("flip(1) (columns in reverse)", lambda y: y.flip(1)),
                        ("amin(dim=1) whole", lambda y: y.amin(dim=1))):
        hot, count = mean_kernel_us(gemm, read)
        cold, _ = mean_kernel_us(gemm, read, flush)
        print(f"  {label:32s} after GEMM {hot:6.1f} µs   from DRAM {cold:6.1f} µs   ({count:.0f} kernels)")
    rows, cols = M // BLOCKS, N // BLOCKS
    for axis in ("rows", "columns"):
        line = []
        for k in range(BLOCKS):
            if axis == "rows":
                read = lambda y, k=k: y[k * rows:(k + 1) * rows].amin(dim=1)
            else:
                read = lambda y, k=k: y[:, k * cols:(k + 1) * cols].amin(dim=1)
            hot, _ = mean_kernel_us(gemm, read)
            cold, _ = mean_kernel_us(gemm, read, flush)
            line.append(f"{hot:4.1f}/{cold:4.1f}")
        print(f"  eighths of the {axis:7s} (after GEMM / from DRAM, µs): " + "  ".join(line))


if __name__ == "__main__":
    for precision in sys.argv[1:] or ["tf32", "bf16"]:
        probe(precision)
