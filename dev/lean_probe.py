"""Is the interpreter slow as a concept or as written? A lean interpreter over the same functors, timed on the
example programs' shapes (1024 x 8192, in place after a fresh F.linear), with and without runtime dispatch.

Usage: python dev/lean_probe.py [fp32|bf16]
The lean kernel: persistent grid of two 512-thread blocks per SM, 16 values a thread in the row kernel's chunk
layout, the row loaded straight into registers, params read from global memory by pointer, one switch per
instruction over {unary op, add/mul by scalar, by a per-feature param, by itself, group norm}, the unary op by a
second switch over the vocabulary's unary functors (kernels/epilogue_ops.cuh). "hardwired" runs the same code with
the program's instruction kinds and ops as template arguments.
"""
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from fxfuse.bench import epilogue_kernel_us
from probe_sources import UNPACK_STORAGE

KERNELS = Path(__file__).resolve().parent.parent / "kernels"

SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include "epilogue_ops.cuh"

using namespace fxfuse;
""" + UNPACK_STORAGE + r"""

enum Kind : int { UNARY, ADD_SCALAR, MUL_SCALAR, ADD_PARAM, ADD_SELF, NORM };
#define LEAN_OPCODE(name, F) LEAN_##name,
enum UnaryOp : int { FXFUSE_UNARY_OPS(LEAN_OPCODE) LEAN_COUNT };

struct LeanIns {
  int kind, op, lanes;
  Attrs attrs;            // unary attributes; scalar in a0; norm eps in a0
  const void* param;      // ADD_PARAM; NORM weight
  const void* param2;     // NORM bias
  float inv_size;
};
struct LeanProgram {
  LeanIns code[8];
  int n;
  void* data;
  int rows, tpr;
};

template <bool HALF>
struct Lean {
  static constexpr int CHUNKS = HALF ? 2 : 4, VEC = HALF ? 8 : 4;
  __device__ static void unpack(uint4 raw, float (&v)[VEC]) { unpack_storage<HALF>(raw, v); }
  __device__ static uint4 pack(const float (&v)[VEC]) {
    unsigned w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (HALF) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[k]) : "f"(v[2 * k + 1]), "f"(v[2 * k]));
      else w[k] = __float_as_uint(v[k]);
    }
    return {w[0], w[1], w[2], w[3]};
  }
};

template <bool HALF>
__device__ __forceinline__ void unary(int op, const Attrs& a, float (&v)[Lean<HALF>::CHUNKS][Lean<HALF>::VEC]) {
  switch (op) {
#define LEAN_CASE(name, F)                                                   \
  case LEAN_##name:                                                          \
    _Pragma("unroll") for (int c = 0; c < Lean<HALF>::CHUNKS; ++c)           \
    _Pragma("unroll") for (int j = 0; j < Lean<HALF>::VEC; ++j) v[c][j] = F::apply(v[c][j], a); \
    break;
    FXFUSE_UNARY_OPS(LEAN_CASE)
#undef LEAN_CASE
  }
}

template <bool HALF>
__device__ __forceinline__ void run(int kind, int op, const LeanIns& ins, int tpr,
                                    float (&v)[Lean<HALF>::CHUNKS][Lean<HALF>::VEC]) {
  using L = Lean<HALF>;
  constexpr int CHUNKS = L::CHUNKS, VEC = L::VEC;
  const int t = threadIdx.x;
  switch (kind) {
    case UNARY: unary<HALF>(op, ins.attrs, v); break;
    case ADD_SCALAR:
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[c][j] += ins.attrs.a0;
      break;
    case MUL_SCALAR:
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[c][j] *= ins.attrs.a0;
      break;
    case ADD_SELF:
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[c][j] += v[c][j];
      break;
    case ADD_PARAM:
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        float p[VEC];
        L::unpack(static_cast<const uint4*>(ins.param)[c * tpr + t], p);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[c][j] += p[j];
      }
      break;
    case NORM: {  // groups within a warp: `lanes` lanes per group, one group per chunk
      float mean[CHUNKS], rstd[CHUNKS];
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) s += v[c][j];
        mean[c] = s;
      }
      for (int offset = 1; offset < ins.lanes; offset <<= 1)
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) mean[c] += __shfl_xor_sync(0xffffffffu, mean[c], offset);
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        mean[c] *= ins.inv_size;
        float q = 0.0f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) q += (v[c][j] - mean[c]) * (v[c][j] - mean[c]);
        rstd[c] = q;
      }
      for (int offset = 1; offset < ins.lanes; offset <<= 1)
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) rstd[c] += __shfl_xor_sync(0xffffffffu, rstd[c], offset);
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        const float r = rsqrtf(rstd[c] * ins.inv_size + ins.attrs.a0);
        float w[VEC], b[VEC];
        L::unpack(static_cast<const uint4*>(ins.param)[c * tpr + t], w);
        L::unpack(static_cast<const uint4*>(ins.param2)[c * tpr + t], b);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[c][j] = GroupNorm::apply(v[c][j], mean[c], r, w[j], b[j]);
      }
      break;
    }
  }
}

// K0..K3 / O0..O3: the program's kinds and unary ops at compile time (hardwired), or -1: read at run time.
template <bool HALF, int K0, int O0, int K1, int O1, int K2, int O2, int K3, int O3>
__global__ void __launch_bounds__(512, 2) lean_kernel(const __grid_constant__ LeanProgram prog) {
  using L = Lean<HALF>;
  constexpr int CHUNKS = L::CHUNKS, VEC = L::VEC;
  const int tpr = prog.tpr;
  for (int row = blockIdx.x; row < prog.rows; row += gridDim.x) {
    uint4* p = static_cast<uint4*>(prog.data) + (long)row * CHUNKS * tpr + threadIdx.x;
    float v[CHUNKS][VEC];
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) L::unpack(p[c * tpr], v[c]);
    if constexpr (K0 >= 0) {
      run<HALF>(K0, O0, prog.code[0], tpr, v);
      if constexpr (K1 >= 0) run<HALF>(K1, O1, prog.code[1], tpr, v);
      if constexpr (K2 >= 0) run<HALF>(K2, O2, prog.code[2], tpr, v);
      if constexpr (K3 >= 0) run<HALF>(K3, O3, prog.code[3], tpr, v);
    } else {
      for (int pc = 0; pc < prog.n; ++pc) run<HALF>(prog.code[pc].kind, prog.code[pc].op, prog.code[pc], tpr, v);
    }
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) p[c * tpr] = L::pack(v[c]);
  }
}

// program 0: group_norm(16-feature groups); leaky_relu(0.01); x + x.   1: + bias; clamp(-1, 1); mish; group_norm(32).
template <bool HALF, bool HARDWIRED>
void launch_program(const LeanProgram& prog, int which, int blocks, cudaStream_t stream) {
  if (!HARDWIRED) {
    lean_kernel<HALF, -1, 0, -1, 0, -1, 0, -1, 0><<<blocks, 512, 0, stream>>>(prog);
  } else if (which == 0) {
    lean_kernel<HALF, NORM, 0, UNARY, LEAN_leaky_relu, ADD_SELF, 0, -1, 0><<<blocks, 512, 0, stream>>>(prog);
  } else {
    lean_kernel<HALF, ADD_PARAM, 0, UNARY, LEAN_clamp, UNARY, LEAN_mish, NORM, 0><<<blocks, 512, 0, stream>>>(prog);
  }
}

void lean(torch::Tensor y, int64_t which, bool hardwired, torch::Tensor bias, torch::Tensor weight, torch::Tensor beta) {
  const bool half = y.element_size() == 2;
  const int vec = 16 / y.element_size();
  LeanProgram prog{};
  prog.data = y.data_ptr();
  prog.rows = y.size(0);
  prog.tpr = static_cast<int>(y.size(1) / 16);
  auto norm = [&](int group) {
    LeanIns ins{NORM, 0, group / vec, {1e-5f, 0, 0}, weight.data_ptr(), beta.data_ptr(), 1.0f / group};
    return ins;
  };
  if (which == 0) {
    prog.code[0] = norm(16);
    prog.code[1] = LeanIns{UNARY, LEAN_leaky_relu, 0, {0.01f, 0, 0}, nullptr, nullptr, 0};
    prog.code[2] = LeanIns{ADD_SELF, 0, 0, {0, 0, 0}, nullptr, nullptr, 0};
    prog.n = 3;
  } else {
    prog.code[0] = LeanIns{ADD_PARAM, 0, 0, {0, 0, 0}, bias.data_ptr(), nullptr, 0};
    prog.code[1] = LeanIns{UNARY, LEAN_clamp, 0, {-1.0f, 1.0f, 0}, nullptr, nullptr, 0};
    prog.code[2] = LeanIns{UNARY, LEAN_mish, 0, {0, 0, 0}, nullptr, nullptr, 0};
    prog.code[3] = norm(32);
    prog.n = 4;
  }
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, y.get_device());
  auto stream = at::cuda::getCurrentCUDAStream();
  if (half) hardwired ? launch_program<true, true>(prog, which, 2 * sms, stream) : launch_program<true, false>(prog, which, 2 * sms, stream);
  else hardwired ? launch_program<false, true>(prog, which, 2 * sms, stream) : launch_program<false, false>(prog, which, 2 * sms, stream);
}
"""

module = load_inline("fxfuse_lean_probe", cuda_sources=SOURCE, functions=["lean"],
                     cpp_sources="void lean(torch::Tensor y, int64_t which, bool hardwired, torch::Tensor bias, "
                                 "torch::Tensor weight, torch::Tensor beta);",
                     extra_include_paths=[str(KERNELS)], extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr"])
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1] if len(sys.argv) > 1 else "fp32"]
x = torch.randn(1024, 8192, device="cuda", dtype=dtype)
w = torch.randn(8192, 8192, device="cuda", dtype=dtype) * 8192 ** -0.5
b = torch.randn(8192, device="cuda", dtype=dtype)
bias, gamma, beta = (torch.randn(8192, device="cuda", dtype=dtype) for _ in range(3))
linear = torch.nn.functional.linear
for which, name in enumerate(["leaky_sum", "mish"]):
    for hardwired in (False, True):
        us = epilogue_kernel_us(lambda: module.lean(linear(x, w, b), which, hardwired, bias, gamma, beta), [], 20,
                                ("lean_kernel",))
        print(f"{str(dtype)[6:]:<9} {name:<10} {'hardwired' if hardwired else 'dispatched':<11} {us:6.1f} us")
