"""How fast can a folded feature pool average the weight's rows? (rewrite.mean_of_row_groups, 8192 x 8192)

Usage: python dev/pool_mean_probe.py [fp32|bf16] [kernel]
On the H200 (975a7b0, dev/kernel_trace.py) ATen's mean over the group dim of (N/k, k, K) took 75.9 µs in bf16 and
100.6 µs in fp32 for k = 4: about half the copy bandwidth for its bytes (N x K read, N/k x K written), and the
pool example's largest kernel after the GEMM. This times that mean against other spellings of the same average,
each checked against a float64 mean first, with the bytes it moves over its time:
- `mean`: the shipped spelling;
- `avg_pool2d`: a (1, 1, N, K) pool of kernel (k, 1), whose threads read adjacent columns of the k rows;
- `sum_then_scale`: a float32 sum over the group dim, scaled and cast back;
- `hand_written` (CUDA only): a grid-stride kernel of one 16-byte vector of each of the group's rows a thread,
  summed in fp32 and scaled once (load_inline), the ceiling an op of our own could reach.
"""
import sys

import torch
import torch.nn.functional as F

from fxfuse.bench import time_interleaved_ms
from fxfuse.rewrite import mean_of_row_groups


def by_avg_pool2d(weight: torch.Tensor, size: int) -> torch.Tensor:
    groups = weight.shape[0] // size
    return F.avg_pool2d(weight[:groups * size].view(1, 1, groups * size, -1), (size, 1)).view(groups, -1)


def by_sum_then_scale(weight: torch.Tensor, size: int) -> torch.Tensor:
    groups = weight.shape[0] // size
    summed = weight[:groups * size].unflatten(0, (groups, size)).sum(1, dtype=torch.float32)
    return summed.mul_(1.0 / size).to(weight.dtype)


SPELLINGS = {"mean": mean_of_row_groups, "avg_pool2d": by_avg_pool2d, "sum_then_scale": by_sum_then_scale}

HAND_WRITTEN = r"""
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>

// (torch's extension flags turn the bf16 conversion operators off)
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

// out[g, c] = mean(in[g * size + i, c] for i < size), 16 bytes of columns a thread, fp32 sums.
template <class T>
__global__ void row_group_mean(const uint4* in, uint4* out, long groups, long vectors_per_row, int size) {
  constexpr int VALUES = 16 / sizeof(T);
  const float scale = 1.0f / size;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < groups * vectors_per_row;
       i += (long)gridDim.x * blockDim.x) {
    const long group = i / vectors_per_row, column = i % vectors_per_row;
    const uint4* first = in + group * size * vectors_per_row + column;
    float sums[VALUES] = {};
    for (int r = 0; r < size; ++r) {
      uint4 raw = __ldcs(first + r * vectors_per_row);
      const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < VALUES; ++j) sums[j] += to_float(values[j]);
    }
    uint4 packed;
    T* results = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int j = 0; j < VALUES; ++j) results[j] = from_float<T>(sums[j] * scale);
    out[i] = packed;
  }
}

torch::Tensor mean_of_groups(torch::Tensor weight, int64_t size) {
  const long groups = weight.size(0) / size;
  auto out = torch::empty({groups, weight.size(1)}, weight.options());
  const long vectors_per_row = weight.size(1) * weight.element_size() / 16;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, weight.get_device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto in = reinterpret_cast<const uint4*>(weight.data_ptr());
  auto result = reinterpret_cast<uint4*>(out.data_ptr());
  if (weight.scalar_type() == at::kBFloat16)
    row_group_mean<__nv_bfloat16><<<8 * sms, 256, 0, stream>>>(in, result, groups, vectors_per_row, size);
  else
    row_group_mean<float><<<8 * sms, 256, 0, stream>>>(in, result, groups, vectors_per_row, size);
  return out;
}
"""


def hand_written():
    """The load_inline module of HAND_WRITTEN (CUDA only)."""
    from torch.utils.cpp_extension import load_inline
    return load_inline("fxfuse_pool_mean_probe", cpp_sources="torch::Tensor mean_of_groups(torch::Tensor weight, "
                       "int64_t size);", cuda_sources=HAND_WRITTEN, functions=["mean_of_groups"],
                       extra_cuda_cflags=["-O3"])


def main():
    precision = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, columns = (8192, 8192) if device == "cuda" else (512, 256)
    weights = [[torch.randn(rows, columns, device=device, dtype=dtype)] for _ in range(3)]
    if device == "cuda":
        SPELLINGS["hand_written"] = hand_written().mean_of_groups
    exact = mean_of_row_groups(weights[0][0].double(), size)
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
