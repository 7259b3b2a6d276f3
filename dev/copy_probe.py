"""How fast can one in-place pass over a fresh F.linear output go, by access pattern and by how much arithmetic
rides on it? (1024 x 8192 fp32 or bf16)

Usage: python dev/copy_probe.py [fp32|bf16]
Prints the CUDA time per call of torch's in-place mul_ and of small kernels that each apply relu in place with a
different layout: one block per row with the row kernel's chunk layout (16 values a thread, chunk c of thread t at
(c * TPR + t) * VEC), the same as a persistent grid of two blocks per SM, and a grid-stride loop of 16-byte vectors.
Then the one-block-per-row kernel with R dependent FMAs per value (16 independent chains a thread), at four and at
two resident blocks per SM (dynamic shared memory caps it), to see whether the arithmetic hides under the memory
traffic (time = max) or adds to it (time = sum).
"""
import sys

import torch
from torch.utils.cpp_extension import load_inline

from fxfuse.bench import epilogue_kernel_us
from probe_sources import GROUP_NORM_16, UNPACK_STORAGE

SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
""" + UNPACK_STORAGE + GROUP_NORM_16 + r"""

__device__ __forceinline__ uint4 relu4(uint4 v, bool half) {
  unsigned w[4] = {v.x, v.y, v.z, v.w};
  for (int k = 0; k < 4; ++k) {
    if (half) {
      if (w[k] & 0x8000u) w[k] &= 0xffff0000u;
      if (w[k] & 0x80000000u) w[k] &= 0x0000ffffu;
    } else if (w[k] & 0x80000000u) {
      w[k] = 0;
    }
  }
  return {w[0], w[1], w[2], w[3]};
}

// CHUNKS 16-byte vectors a thread; chunk c of thread t at (c * TPR + t) in 16-byte units of its row.
template <int CHUNKS>
__global__ void row_layout(uint4* data, int rows, int tpr, bool half, bool persistent) {
  for (int row = blockIdx.x; row < rows; row += persistent ? gridDim.x : rows) {
    uint4* p = data + (long)row * CHUNKS * tpr + threadIdx.x;
    uint4 v[CHUNKS];
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) v[c] = p[c * tpr];
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) p[c * tpr] = relu4(v[c], half);
  }
}

// fp32 values -> 16 bytes of storage (unpack_storage, from dev/probe_sources.py, goes the other way).
// bf16 by truncation (the probe times memory, not rounding).
template <bool HALF>
__device__ __forceinline__ uint4 pack(const float (&v)[HALF ? 8 : 4]) {
  unsigned w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    w[k] = HALF ? (__float_as_uint(v[2 * k]) >> 16) | (__float_as_uint(v[2 * k + 1]) & 0xffff0000u)
                : __float_as_uint(v[k]);
  return {w[0], w[1], w[2], w[3]};
}

// The row layout with `rounds` dependent FMAs on each value in fp32 (bf16 values unpacked and packed again).
template <bool HALF>
__global__ void row_work(uint4* data, int tpr, int rounds) {
  constexpr int CHUNKS = HALF ? 2 : 4, VALUES = HALF ? 8 : 4;
  uint4* p = data + (long)blockIdx.x * CHUNKS * tpr + threadIdx.x;
  float v[CHUNKS][VALUES];
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) unpack_storage<HALF>(p[c * tpr], v[c]);
  for (int r = 0; r < rounds; ++r)
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
      for (int j = 0; j < VALUES; ++j) v[c][j] = fmaf(v[c][j], 1.0001f, -0.0001f);
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) p[c * tpr] = pack<HALF>(v[c]);
}

// A group norm over groups of 16 contiguous values (group_norm_16: a statistic per chunk), with its affine where
// weight is given: the row kernel's group_norm(512 groups) with its layout and reductions, at the given occupancy,
// one row a block or a persistent grid walking rows.
template <bool HALF>
__global__ void row_norm(uint4* data, int rows, int tpr, bool persistent, const uint4* weight, const uint4* bias) {
  constexpr int CHUNKS = HALF ? 2 : 4, VALUES = HALF ? 8 : 4;
  for (int row = blockIdx.x; row < rows; row += persistent ? gridDim.x : rows) {
    uint4* p = data + (long)row * CHUNKS * tpr + threadIdx.x;
    float v[CHUNKS][VALUES];
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) unpack_storage<HALF>(p[c * tpr], v[c]);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) group_norm_16<HALF>(v[c], weight, bias, c * tpr + threadIdx.x);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) p[c * tpr] = pack<HALF>(v[c]);
  }
}

__global__ void grid_stride(uint4* data, long n, bool half) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
    data[i] = relu4(data[i], half);
}

void work(torch::Tensor y, int64_t rounds, int64_t blocks_per_sm) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const bool half = y.element_size() == 2;
  uint4* data = reinterpret_cast<uint4*>(y.data_ptr());
  const int rows = y.size(0);
  const int tpr = static_cast<int>(y.numel() / rows / 16);  // 16 values a thread
  const int shared = blocks_per_sm == 2 ? 80 * 1024 : 0;
  if (half) {
    cudaFuncSetAttribute(row_work<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
    row_work<true><<<rows, tpr, shared, stream>>>(data, tpr, rounds);
  } else {
    cudaFuncSetAttribute(row_work<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
    row_work<false><<<rows, tpr, shared, stream>>>(data, tpr, rounds);
  }
}

// layout 0: one block per row, 4 per SM; 1: one block per row, 2 per SM; 2: persistent, 2 blocks per SM.
void norm(torch::Tensor y, int64_t layout, torch::Tensor weight, torch::Tensor bias) {
  const bool affine = weight.numel() > 0;
  const uint4* w = affine ? reinterpret_cast<const uint4*>(weight.data_ptr()) : nullptr;
  const uint4* b = affine ? reinterpret_cast<const uint4*>(bias.data_ptr()) : nullptr;
  auto stream = at::cuda::getCurrentCUDAStream();
  uint4* data = reinterpret_cast<uint4*>(y.data_ptr());
  const int rows = y.size(0);
  const int tpr = static_cast<int>(y.numel() / rows / 16);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, y.get_device());
  const int shared = layout == 0 ? 0 : 80 * 1024;
  const int blocks = layout == 2 ? 2 * sms : rows;
  if (y.element_size() == 2) {
    cudaFuncSetAttribute(row_norm<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
    row_norm<true><<<blocks, tpr, shared, stream>>>(data, rows, tpr, layout == 2, w, b);
  } else {
    cudaFuncSetAttribute(row_norm<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
    row_norm<false><<<blocks, tpr, shared, stream>>>(data, rows, tpr, layout == 2, w, b);
  }
}

void probe(torch::Tensor y, int64_t kind) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const bool half = y.element_size() == 2;
  uint4* data = reinterpret_cast<uint4*>(y.data_ptr());
  const int rows = y.size(0);
  const long vectors = y.numel() * y.element_size() / 16;
  const int chunks = 16 * y.element_size() / 16;  // 16 values a thread
  const int tpr = static_cast<int>(vectors / rows / chunks);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, y.get_device());
  if (kind == 0 || kind == 1) {
    const int blocks = kind == 0 ? rows : 2 * sms;
    if (chunks == 4) row_layout<4><<<blocks, tpr, 0, stream>>>(data, rows, tpr, half, kind == 1);
    else row_layout<2><<<blocks, tpr, 0, stream>>>(data, rows, tpr, half, kind == 1);
  } else {
    const int threads = 256;
    const long blocks = kind == 2 ? (vectors + threads - 1) / threads : 16L * sms;
    grid_stride<<<blocks, threads, 0, stream>>>(data, vectors, half);
  }
}
"""

module = load_inline("fxfuse_copy_probe", cuda_sources=SOURCE, functions=["probe", "work", "norm"], extra_cuda_cflags=["-O3"],
                     cpp_sources="void probe(torch::Tensor y, int64_t kind);\n"
                                 "void work(torch::Tensor y, int64_t rounds, int64_t blocks_per_sm);\n"
                                 "void norm(torch::Tensor y, int64_t layout, torch::Tensor weight, torch::Tensor bias);")
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1] if len(sys.argv) > 1 else "fp32"]
torch.backends.cuda.matmul.allow_tf32 = True
x = torch.randn(1024, 8192, device="cuda", dtype=dtype)
w = torch.randn(8192, 8192, device="cuda", dtype=dtype) * 8192 ** -0.5
b = torch.randn(8192, device="cuda", dtype=dtype)
linear = torch.nn.functional.linear
print(f"{dtype}: mul_ {epilogue_kernel_us(lambda: linear(x, w, b).mul_(1.0001), [], 20, ('elementwise',)):.1f} us")
for kind, name in enumerate(["one block per row", "persistent, 2 blocks per SM", "grid-stride, one vector a thread",
                             "grid-stride, 16 blocks per SM"]):
    us = epilogue_kernel_us(lambda: module.probe(linear(x, w, b), kind), [], 20, ("row_layout", "grid_stride"))
    print(f"{dtype}: {name}: {us:.1f} us")
for blocks_per_sm in (4, 2):
    for rounds in (0, 8, 16, 32, 64):
        us = epilogue_kernel_us(lambda: module.work(linear(x, w, b), rounds, blocks_per_sm), [], 20, ("row_work",))
        print(f"{dtype}: {blocks_per_sm} blocks per SM, {rounds:3d} FMAs per value: {us:.1f} us")
gamma, beta, none = torch.randn_like(b), torch.randn_like(b), torch.empty(0, device="cuda", dtype=dtype)
for layout, name in enumerate(["one block per row, 4 per SM", "one block per row, 2 per SM", "persistent, 2 per SM"]):
    for affine in (False, True):
        params = (gamma, beta) if affine else (none, none)
        us = epilogue_kernel_us(lambda: module.norm(linear(x, w, b), layout, *params), [], 20, ("row_norm",))
        print(f"{dtype}: group norm (groups of 16{', affine' if affine else ''}), {name}: {us:.1f} us")
