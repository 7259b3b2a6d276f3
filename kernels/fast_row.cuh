// The fast row kernel: the row phase of the programs most epilogues are (pointwise ops, norms and row reductions
// over per-feature params), run by a lean interpreter. Same program format (program_format.cuh), same functors
// (epilogue_ops.cuh, each beside its reference in fxfuse/epilogue.py), same results as row_program_kernel.
//
//   y[row] = program(gemm_output[row]), or one value per row after a row reduction.
//
// Strategy: a persistent grid of row groups, each thread holding kRowValues values of its row in registers in
// the chunk layout of interpreter.cuh (chunk c of lane t at (c * TPR + t) * VEC), loaded straight from global
// memory at the row's start (no staging: two resident rows per SM keep the memory busy on their own), params read
// by pointer as 16-byte vectors, and one dispatch per instruction: a range test sends unary ops to their switch,
// the rest switch on the op (binary ops then on the operand kind; norms and reductions into the statistic code,
// inline for groups inside a warp). The four examples' programs ran 1.1-1.5x longer on the general kernel
// (dev/NOTES.md, variant 31; dev/lean_probe.py is the experiment that showed the gap).
//
// Limits (fits_fast_row_kernel says whether a program qualifies; the launcher in gemm_epilogue.cu falls back to
// row_program_kernel otherwise): rows of whole 16-byte vectors, no slots, no batch_norm, groups that the lanes
// hold (GROUP_ACROSS_LANES), every param a contiguous per-feature vector (row_stride 0, feature_stride 1, 16-byte
// aligned).
#pragma once

#include "interpreter.cuh"

namespace fxfuse {

// ================================================================ operands

// Chunk c of a per-feature param in this thread's layout; a chunk past the row's end reads the first vector (its
// values are never stored, and reductions mask them).
template <class S, int VEC = S::VEC>
__device__ __forceinline__ void load_feature_chunk(const RowProgram& prog, int param, int c, int lane,
                                                   float (&dst)[VEC]) {
  const int vector = c * prog.threads_per_row + lane;
  const uint4* source = static_cast<const uint4*>(prog.params[param].ptr);
  S::unpack(source[vector * VEC < prog.features ? vector : 0], dst);
}

// ================================================================ instructions

template <class S, class F, int CHUNKS, int VEC>
__device__ __forceinline__ void fast_binary(const RowProgram& prog, const Instruction& ins, int lane,
                                            Values<CHUNKS, VEC>& cur) {
  if (ins.other == OTHER_SCALAR) {
    const float s = ins.attrs.a0;
    if (ins.reversed) {
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) cur[c][j] = F::apply(s, cur[c][j]);
    } else {
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) cur[c][j] = F::apply(cur[c][j], s);
    }
  } else if (ins.other == OTHER_PARAM) {
    const bool reversed = ins.reversed;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      float p[VEC];
      load_feature_chunk<S>(prog, ins.param[0], c, lane, p);
#pragma unroll
      for (int j = 0; j < VEC; ++j) cur[c][j] = reversed ? F::apply(p[j], cur[c][j]) : F::apply(cur[c][j], p[j]);
    }
  } else {  // OTHER_CURRENT
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
      for (int j = 0; j < VEC; ++j) cur[c][j] = F::apply(cur[c][j], cur[c][j]);
  }
}

// Each chunk's sum of f(chunk, value) over its group, for groups of whole chunks of lanes_per_group <= 32 lanes
// (chunks_per_group 1): a group lies wholly inside the row or wholly past its end, so no value needs a mask.
template <int CHUNKS, int VEC, class F>
__device__ __forceinline__ void warp_group_sums(const Values<CHUNKS, VEC>& cur, int lanes_per_group,
                                                float (&sums)[CHUNKS], F f) {
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    sums[c] = 0.0f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) sums[c] += f(c, cur[c][j]);
  }
  for (int offset = 1; offset < lanes_per_group; offset <<= 1)
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) sums[c] += shuffle_xor(sums[c], offset);
}

// A norm's statistic (s0, s1) per chunk: inline for groups inside a warp (the examples' group norms: 16 and 32
// features), else the general statistic code.
template <Statistic ST, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void norm_statistic(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                               float (&s0)[CHUNKS], float (&s1)[CHUNKS],
                                               CrossWarp<CHUNKS>& cross_warp) {
  const bool in_warp = ins.chunks_per_group == 1 && ins.lanes_per_group <= 32;
  if constexpr (ST == Statistic::MeanAndRstd) {
    if (in_warp) {
      const float inv_size = 1.0f / ins.group_size;
      warp_group_sums(cur, ins.lanes_per_group, s0, [](int, float v) { return v; });
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) s0[c] *= inv_size;
      warp_group_sums(cur, ins.lanes_per_group, s1, [&](int c, float v) { return (v - s0[c]) * (v - s0[c]); });
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) s1[c] = rsqrtf(s1[c] * inv_size + ins.attrs.a0);
      return;
    }
  } else if constexpr (ST == Statistic::RootMeanSquare) {
    if (in_warp) {
      const float inv_size = 1.0f / ins.group_size;
      warp_group_sums(cur, ins.lanes_per_group, s1, [](int, float v) { return v * v; });
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) s0[c] = 0.0f, s1[c] = rsqrtf(s1[c] * inv_size + ins.attrs.a0);
      return;
    }
  }
  compute_statistic<ST>(ctx, ins, cur, s0, s1, cross_warp, nullptr);
}

template <class S, class F, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void fast_norm(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                          CrossWarp<CHUNKS>& cross_warp) {
  float s0[CHUNKS], s1[CHUNKS];
  norm_statistic<F::statistic>(ctx, ins, cur, s0, s1, cross_warp);
  const bool weighted = ins.param[0] >= 0, biased = ins.param[1] >= 0;
  if (weighted && biased) {  // nn.GroupNorm's and nn.LayerNorm's affine: no per-element selects of the defaults
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      float w[VEC], b[VEC];
      load_feature_chunk<S>(ctx.prog, ins.param[0], c, ctx.lane, w);
      load_feature_chunk<S>(ctx.prog, ins.param[1], c, ctx.lane, b);
#pragma unroll
      for (int j = 0; j < VEC; ++j) cur[c][j] = F::apply(cur[c][j], s0[c], s1[c], w[j], b[j]);
    }
    return;
  }
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    float w[VEC], b[VEC];
    if (weighted) load_feature_chunk<S>(ctx.prog, ins.param[0], c, ctx.lane, w);
    if (biased) load_feature_chunk<S>(ctx.prog, ins.param[1], c, ctx.lane, b);
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      cur[c][j] = F::apply(cur[c][j], s0[c], s1[c], weighted ? w[j] : 1.0f, biased ? b[j] : 0.0f);
  }
}

// A row reduction's result in every element, so that later pointwise ops broadcast it for free.
template <class F, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void fast_reduction(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                               CrossWarp<CHUNKS>& cross_warp) {
  float s0[CHUNKS], s1[CHUNKS];
  compute_statistic<F::statistic>(ctx, ins, cur, s0, s1, cross_warp, nullptr);
  const float result = F::result(s0[0], s1[0], ctx.prog.features);
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
    for (int j = 0; j < VEC; ++j) cur[c][j] = result;
}

template <class S, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void fast_instruction(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                                 CrossWarp<CHUNKS>& cross_warp) {
  if (is_unary(ins.op)) {  // one range test before the unary ops' own switch, not a place in the flat one
    run_unary(ins, cur);
    return;
  }
  switch (ins.op) {
#define FXFUSE_FAST_BINARY_CASE(name, F)               \
  case OP_##name:                                      \
    fast_binary<S, F>(ctx.prog, ins, ctx.lane, cur);   \
    break;
    FXFUSE_BINARY_OPS(FXFUSE_FAST_BINARY_CASE)
#undef FXFUSE_FAST_BINARY_CASE
#define FXFUSE_FAST_NORM_CASE(name, F)          \
  case OP_##name:                               \
    fast_norm<S, F>(ctx, ins, cur, cross_warp); \
    break;
    FXFUSE_NORM_OPS(FXFUSE_FAST_NORM_CASE)
#undef FXFUSE_FAST_NORM_CASE
#define FXFUSE_FAST_REDUCTION_CASE(name, F)       \
  case OP_##name:                                 \
    fast_reduction<F>(ctx, ins, cur, cross_warp); \
    break;
    FXFUSE_REDUCTION_OPS(FXFUSE_FAST_REDUCTION_CASE)
#undef FXFUSE_FAST_REDUCTION_CASE
    default:
      break;
  }
}

// ================================================================ the kernel

// Block: (blockDim.x / TPR) rows of TPR threads; each block takes every gridDim.x-th group of rows.
template <class S>
__global__ void __launch_bounds__(kMaxRowThreads, 1) fast_row_kernel(const __grid_constant__ RowProgram prog) {
  constexpr int VEC = S::VEC;
  constexpr int CHUNKS = kRowValues / VEC;
  using Ctx = RowContext<S, CHUNKS, false>;
  using Raw = typename S::Raw;
  __shared__ CrossWarp<CHUNKS> cross_warp;
  const int tpr_shift = __popc(prog.threads_per_row - 1);  // TPR is a power of 2
  const int lane = threadIdx.x & (prog.threads_per_row - 1);
  const int rows_per_block = blockDim.x >> tpr_shift;

  for (int64_t group = blockIdx.x; group < prog.row_groups; group += gridDim.x) {
    const int64_t row = group * rows_per_block + (threadIdx.x >> tpr_shift);
    const Ctx ctx{prog, row < prog.rows ? row : prog.rows - 1, lane};  // idle rows compute and never store
    float cur[CHUNKS][VEC];
    const Raw* in = static_cast<const Raw*>(prog.input) + ctx.row * prog.features;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      if (ctx.chunk_count(c) > 0) load_vector<S>(in + ctx.element(c, 0), cur[c]);
      else
#pragma unroll
        for (int j = 0; j < VEC; ++j) cur[c][j] = 0.0f;
    }

    for (int pc = 0; pc < prog.num_instructions; ++pc) fast_instruction<S>(ctx, prog.code[pc], cur, cross_warp);

    if (row >= prog.rows) continue;
    if (prog.output_per_row) {
      if (lane == 0) static_cast<Raw*>(prog.output)[row] = S::from_float(cur[0][0]);
      continue;
    }
    Raw* out = static_cast<Raw*>(prog.output) + row * prog.features;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
      if (ctx.chunk_count(c) > 0) store_vector<S>(out + ctx.element(c, 0), cur[c]);
  }
}

// ================================================================ the launcher (declared in program_format.cuh)

template <class S>
void launch_fast_row_program(const RowProgram& prog, const RowLaunch& launch, cudaStream_t stream) {
  const auto kernel = fast_row_kernel<S>;
  const int threads = launch.rows_per_block * prog.threads_per_row;
  RowProgram sized = prog;
  sized.row_groups = (prog.rows + launch.rows_per_block - 1) / launch.rows_per_block;
  const RowGrid grid = row_grid(kernel, threads, 0);
  const unsigned blocks = static_cast<unsigned>(std::min(sized.row_groups, grid.blocks));
  kernel<<<blocks, threads, 0, stream>>>(sized);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fxfuse
