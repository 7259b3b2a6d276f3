"""Can an epilogue hide under the GEMM when the GEMM runs as row chunks? (1024 x 8192 -> 8192, torch ops only)

Usage: python dev/split_gemm_probe.py [--trace]   (--trace: also the GEMM kernels' names and grids, per chunk count)

The GEMM runs through cuBLAS either whole (F.linear) or as k row chunks (torch.addmm into rows of one output).
A chunk's epilogue can then start as soon as its rows are done, while the next chunk's GEMM runs. Each line is
the median CUDA time of a call (fxfuse.bench's timing: calls queued behind a GPU spin, rotating four input sets)
over F.linear alone's, for fp32 IEEE, tf32 and bf16:
- whole: F.linear; F.linear then y.mul_ (the design floor of one in-place pass); then a row min of y plus a
  (N, M) broadcast add (min_bias's shape of work: a read of y, a write of N x M);
- split k: the chunks' GEMMs alone, one after another on the caller's stream;
- overlap k: the chunks' GEMMs on a high-priority side stream, each chunk's mul_ (or row min) on the caller's
  stream after its GEMM's event, so the epilogue's blocks fill what the GEMM leaves; the min + broadcast add
  writes the output once all chunks are done.
"""
import sys

import torch
import torch.nn.functional as F

from fxfuse.bench import INPUT_SETS, time_interleaved_ms
from kernel_trace import kernel_events

M, K, N = 1024, 8192, 8192
PRECISIONS = [("fp32", torch.float32, False), ("tf32", torch.float32, True), ("bf16", torch.bfloat16, False)]
CHUNK_COUNTS = (2, 4)


def chunk_slices(count: int) -> list[slice]:
    size = M // count
    return [slice(i * size, (i + 1) * size) for i in range(count)]


def calls(weight, bias, gemm_stream):
    def whole(x):
        return F.linear(x, weight, bias)

    def whole_mul(x):
        return F.linear(x, weight, bias).mul_(1.5)

    def whole_min_bias(x):
        mins = F.linear(x, weight, bias).amin(1)
        return mins[None, :] + bias[:, None]

    def split(count):
        def run(x):
            y = torch.empty(M, N, device=x.device, dtype=x.dtype)
            for rows in chunk_slices(count):
                torch.addmm(bias, x[rows], weight.t(), out=y[rows])
            return y
        return run

    def overlap(count, epilogue):
        def run(x):
            caller = torch.cuda.current_stream()
            y = torch.empty(M, N, device=x.device, dtype=x.dtype)
            mins = torch.empty(M, device=x.device, dtype=x.dtype)
            gemm_stream.wait_stream(caller)
            for rows in chunk_slices(count):
                with torch.cuda.stream(gemm_stream):
                    torch.addmm(bias, x[rows], weight.t(), out=y[rows])
                    done = torch.cuda.Event()
                    done.record(gemm_stream)
                caller.wait_event(done)
                if epilogue == "mul":
                    y[rows].mul_(1.5)
                else:
                    torch.amin(y[rows], 1, out=mins[rows])
            return y if epilogue == "mul" else mins[None, :] + bias[:, None]
        return run

    fns = {"whole": whole, "whole+mul_": whole_mul, "whole+min,bias": whole_min_bias}
    for count in CHUNK_COUNTS:
        fns[f"split {count}"] = split(count)
        fns[f"overlap {count} mul_"] = overlap(count, "mul")
        fns[f"overlap {count} min,bias"] = overlap(count, "min")
    return fns


def gemm_kernels(fns: dict, x) -> list[str]:
    """Name, grid and block of every kernel of one call of each fn (from the profiler's chrome trace)."""
    lines = []
    for name in ("whole", *(f"split {count}" for count in CHUNK_COUNTS)):
        for e in kernel_events(fns[name], x):
            args = e.get("args", {})
            lines.append(f"  {name:8s} {e['dur']:8.1f} us grid {args.get('grid')} block {args.get('block')} "
                         f"regs {args.get('registers per thread')} smem {args.get('shared memory')} "
                         f"{e['name'][:110]}")
    return lines


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    gemm_stream = torch.cuda.Stream(priority=-1)
    for precision, dtype, tf32 in PRECISIONS:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        weight = (torch.randn(N, K, device="cuda") / K ** 0.5).to(dtype)
        bias = torch.randn(N, device="cuda").to(dtype)
        input_sets = [[torch.rand(M, K, device="cuda").to(dtype)] for _ in range(INPUT_SETS)]
        fns = calls(weight, bias, gemm_stream)
        reference = fns["whole"](input_sets[0][0])
        for count in CHUNK_COUNTS:
            error = (fns[f"split {count}"](input_sets[0][0]) - reference).abs().max().item()
            print(f"{precision}: split {count} against whole, max abs difference {error:.3g}")
        times = time_interleaved_ms(fns, input_sets, runs=60 if precision == "fp32" else 200)
        base = times["whole"]
        for name, ms in times.items():
            print(f"{precision:5s} {name:22s} {ms * 1000:9.1f} us  {ms / base:6.3f}x")
        if "--trace" in sys.argv:
            print("\n".join(gemm_kernels(fns, input_sets[0][0])))


if __name__ == "__main__":
    main()
