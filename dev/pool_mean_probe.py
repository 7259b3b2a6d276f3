"""How fast can a folded feature pool average the weight's rows? (fxfuse::mean_of_row_groups, 8192 x 8192)

Usage: python dev/pool_mean_probe.py [fp32|bf16] [kernel]
On the H200 (975a7b0, dev/kernel_trace.py) ATen's mean over the group dim of (N/k, k, K) took 75.9 µs in bf16 and
100.6 µs in fp32 for k = 4: about half the copy bandwidth for its bytes (N x K read, N/k x K written), and the
pool example's largest kernel after the GEMM. This times that mean against other spellings of the same average,
each checked against a float64 mean first, with the bytes it moves over its time:
- `aten_mean`: the op's reference, ATen's mean over the group dim (the shipped spelling until the op);
- `avg_pool2d`: a (1, 1, N, K) pool of kernel (k, 1), whose threads read adjacent columns of the k rows;
- `sum_then_scale`: a float32 sum over the group dim, scaled and cast back;
- `op`: torch.ops.fxfuse.mean_of_row_groups, the shipped spelling since the twenty-ninth session: on CUDA its kernel
  (kernels/row_group_mean.cu, first written here as a load_inline probe: 45.3 µs in bf16, 88.8 in fp32).
"""
import sys

import torch
import torch.nn.functional as F

from fxfuse.bench import time_interleaved_ms
from fxfuse.library import mean_of_row_groups, mean_of_row_groups_reference


def by_avg_pool2d(weight: torch.Tensor, size: int) -> torch.Tensor:
    groups = weight.shape[0] // size
    return F.avg_pool2d(weight[:groups * size].view(1, 1, groups * size, -1), (size, 1)).view(groups, -1)


def by_sum_then_scale(weight: torch.Tensor, size: int) -> torch.Tensor:
    groups = weight.shape[0] // size
    summed = weight[:groups * size].unflatten(0, (groups, size)).sum(1, dtype=torch.float32)
    return summed.mul_(1.0 / size).to(weight.dtype)


SPELLINGS = {"aten_mean": mean_of_row_groups_reference, "avg_pool2d": by_avg_pool2d,
             "sum_then_scale": by_sum_then_scale, "op": mean_of_row_groups}


def main():
    precision = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, columns = (8192, 8192) if device == "cuda" else (512, 256)
    weights = [[torch.randn(rows, columns, device=device, dtype=dtype)] for _ in range(3)]
    if device == "cuda":
        from fxfuse import kernels
        assert kernels.load(), "the CUDA kernels did not build or load"
    exact = mean_of_row_groups_reference(weights[0][0].double(), size)
    for name, spelling in SPELLINGS.items():
        error = (spelling(weights[0][0], size).double() - exact).abs().max().item()
        print(f"{name:16s} max |error| against float64 {error:.3g}")
    if device != "cuda":
        return
    calls = {name: (lambda weight, spelling=spelling: spelling(weight, size)) for name, spelling in SPELLINGS.items()}
    times = time_interleaved_ms(calls, weights, runs=50)
    moved = (rows * columns + rows // size * columns) * weights[0][0].element_size()
    for name, ms in times.items():
        print(f"{name:16s} {ms * 1e3:7.1f} µs  {moved / ms / 1e6:6.0f} GB/s (read + written)")


if __name__ == "__main__":
    main()
