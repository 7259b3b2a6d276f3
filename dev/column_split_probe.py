"""Can min_bias's row phase hide under the GEMM when the GEMM runs as column chunks? (1024 x 8192 -> 8192, torch ops)

Usage: python dev/column_split_probe.py [tf32|bf16|fp32 ...] [--trace]   (--trace: also each call's kernels, names, grids and times)

split_gemm_probe.py split the GEMM by rows: each chunk re-reads the whole weight (256 MB in fp32), and the split
alone cost 1.044x in tf32. Split by features (columns of y) instead, each chunk re-reads only x (32 MB), and a
chunk of 4096 features is 128 tiles of cuBLAS's 128 x 256, one wave that leaves 4 of the H100's 132 SMs free.
A row-local epilogue whose groups do not straddle the split (min_bias: 16-feature groups, then a row min) can run
chunk i's row phase on those free SMs while chunk i+1's GEMM runs; only the last chunk's row phase, the mins'
merge and the (N, M) write are left after the GEMM. Each line is the median CUDA time of a call (fxfuse.bench's
timing) over F.linear alone's:
- whole: F.linear; then a row min plus the (N, M) broadcast add; then y.mul_ (one in-place pass);
- columns k: the k chunks' GEMMs alone, one after another, each into a buffer of its own;
- columns k overlap: the chunks' GEMMs on a high-priority side stream; each chunk's row min (or mul_) on the
  caller's stream after its GEMM's event; the min + broadcast add once all chunks are done.
"""
import sys

import torch
import torch.nn.functional as F

from fxfuse.bench import INPUT_SETS, time_interleaved_ms
from kernel_trace import kernel_events

M, K, N = 1024, 8192, 8192
ALL_PRECISIONS = {"tf32": (torch.float32, True), "bf16": (torch.bfloat16, False), "fp32": (torch.float32, False)}
CHUNK_COUNTS = (2, 4)


def column_slices(count: int) -> list[slice]:
    size = N // count
    return [slice(i * size, (i + 1) * size) for i in range(count)]


def calls(weight, bias, gemm_stream):
    chunks = {count: [(weight[cols].contiguous(), bias[cols].contiguous()) for cols in column_slices(count)]
              for count in CHUNK_COUNTS}

    def whole(x):
        return F.linear(x, weight, bias)

    def whole_min_bias(x):
        mins = F.linear(x, weight, bias).amin(1)
        return mins[None, :] + bias[:, None]

    def whole_mul(x):
        return F.linear(x, weight, bias).mul_(1.5)

    def columns(count):
        def run(x):
            return [F.linear(x, w, b) for w, b in chunks[count]]
        return run

    def overlap(count, epilogue):
        def run(x):
            caller = torch.cuda.current_stream()
            gemm_stream.wait_stream(caller)
            results = []
            for w, b in chunks[count]:
                with torch.cuda.stream(gemm_stream):
                    y = F.linear(x, w, b)
                    done = torch.cuda.Event()
                    done.record(gemm_stream)
                caller.wait_event(done)
                y.record_stream(caller)
                results.append(y.mul_(1.5) if epilogue == "mul" else y.amin(1))
            if epilogue == "mul":
                return results
            mins = torch.stack(results).amin(0)
            return mins[None, :] + bias[:, None]
        return run

    fns = {"whole": whole, "whole+min,bias": whole_min_bias, "whole+mul_": whole_mul}
    for count in CHUNK_COUNTS:
        fns[f"columns {count}"] = columns(count)
        fns[f"columns {count} overlap min,bias"] = overlap(count, "min")
        fns[f"columns {count} overlap mul_"] = overlap(count, "mul")
    return fns


def kernel_lines(fns: dict, x) -> list[str]:
    """Name, grid and time of every kernel of one call of each fn, queued behind a GPU spin."""
    lines = []
    for name, fn in fns.items():
        kernels = kernel_events(fn, x, queued=True)
        start = kernels[0]["ts"] if kernels else 0
        for e in kernels:
            args = e.get("args", {})
            lines.append(f"  {name:28s} +{e['ts'] - start:7.1f} {e['dur']:7.1f} us grid {args.get('grid')} "
                         f"stream {args.get('stream')} {e['name'][:80]}")
    return lines


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    gemm_stream = torch.cuda.Stream(priority=-1)
    for precision in [arg for arg in sys.argv[1:] if arg in ALL_PRECISIONS] or list(ALL_PRECISIONS):
        dtype, tf32 = ALL_PRECISIONS[precision]
        torch.backends.cuda.matmul.allow_tf32 = tf32
        weight = (torch.randn(N, K, device="cuda") / K ** 0.5).to(dtype)
        bias = torch.randn(N, device="cuda").to(dtype)
        input_sets = [[torch.rand(M, K, device="cuda").to(dtype)] for _ in range(INPUT_SETS)]
        fns = calls(weight, bias, gemm_stream)
        x = input_sets[0][0]
        expected = fns["whole+min,bias"](x)
        for count in CHUNK_COUNTS:
            error = (fns[f"columns {count} overlap min,bias"](x) - expected).abs().max().item()
            print(f"{precision}: columns {count} min,bias against whole, max abs difference {error:.3g}")
        times = time_interleaved_ms(fns, input_sets, runs=40 if precision == "fp32" else 150)
        base = times["whole"]
        for name, ms in times.items():
            print(f"{precision:5s} {name:30s} {ms * 1000:9.1f} us  {ms / base:6.3f}x")
        if "--trace" in sys.argv and precision != "fp32":
            print("\n".join(kernel_lines(fns, x)))


if __name__ == "__main__":
    main()
