// The fast row kernel: the row phase of the programs most epilogues are (pointwise ops, norms and row reductions
// over per-feature params), run by a lean interpreter. Same program format (program_format.cuh), same functors
// (epilogue_ops.cuh, each beside its reference in fxfuse/epilogue.py), same results as row_program_kernel.
//
//   y[row] = program(gemm_output[row]), or one value per row after a row reduction.
//
// Strategy: a persistent grid of row groups, each thread holding VALUES values of its row in registers (32 for
// 16-bit rows of more than 4096 features without libdevice ops, else 16: fast_row_values, program_format.cuh) in
// the chunk layout of interpreter.cuh (chunk c of lane t at (c * TPR + t) * VEC). The next row is copied into shared
// memory (cp.async) while one computes; params are read by pointer as 16-byte vectors; one dispatch per
// instruction: a range test sends unary ops to their switch, the rest switch on the op (binary ops then on the
// operand kind, once; norms and reductions into the statistic code, inline for groups inside a warp, and with one
// exchange of Chan-merged (mean, M2) pairs for groups across warps). The kernel may launch while the GEMM finishes,
// and waits for it on the GPU (launch_kernel, interpreter.cuh). dev/NOTES.md has the measurements of each choice
// (variants 31-49, 78, 100).
//
// Builds per storage type, chosen by the launcher: WHOLE_ROWS (features == TPR * VALUES, as for 1024, 2048, 4096
// or 8192 features) compiles the chunk masks away; WITH_LIBM_OPS false leaves out the unary and binary ops that call
// libdevice (CallsLibm), whose code slowed every other program by 4-12% (variant 42); the build with them is made
// at 16 values a thread only. On whole rows, the programs of FXFUSE_ROW_CHAINS (program_format.cuh) run
// chain_row_kernel instead: the same row loop with each instruction's op fixed at compile time (fast_op), no
// dispatch (11-25% less time than interpreted, variant 57); so do those of FXFUSE_LIBM_ROW_CHAINS (the common gelu
// programs), at 16 values only; a chain's last whole-row min (amin or min_dim) folds by atomics in shared memory,
// without barriers (fold_row_min).
//
// Limits (fits_fast_row_kernel says whether a program qualifies; the launcher in gemm_epilogue.cpp falls back to
// row_program_kernel otherwise): rows of whole 16-byte vectors, no slots, no batch_norm, groups that the lanes
// hold (GROUP_ACROSS_LANES) or, in the chains only, that lie inside a chunk (GROUP_IN_VECTOR), every param a
// contiguous per-feature vector (row_stride 0, feature_stride 1, 16-byte aligned).
#pragma once

#include <climits>

#include "interpreter.cuh"

namespace fxfuse {

// ================================================================ operands

// The fast kernel's view of a row: RowContext, whose chunks are all whole where the launcher says every row is
// (WHOLE_ROWS: features == TPR * VALUES), so that the chunk masks of the loads, stores and statistics
// compile away.
template <class S, int CHUNKS, bool WHOLE_ROWS>
struct FastRowContext : RowContext<S, CHUNKS, false> {
  __device__ int chunk_count(int c) const {
    return WHOLE_ROWS ? S::VEC : RowContext<S, CHUNKS, false>::chunk_count(c);
  }
};

// Chunk c of a per-feature param in this thread's layout, as stored; a chunk past the row's end reads the first
// vector (its values are never stored, and reductions mask them).
template <class S, bool WHOLE_ROWS>
__device__ __forceinline__ uint4 load_feature_raw(const RowProgram& prog, int param, int c, int lane) {
  const int vector = c * prog.threads_per_row + lane;
  const uint4* source = static_cast<const uint4*>(prog.params[param].ptr);
  return source[WHOLE_ROWS || vector * S::VEC < prog.features ? vector : 0];
}

// The same as floats.
template <class S, bool WHOLE_ROWS, int VEC = S::VEC>
__device__ __forceinline__ void load_feature_chunk(const RowProgram& prog, int param, int c, int lane,
                                                   float (&dst)[VEC]) {
  S::unpack(load_feature_raw<S, WHOLE_ROWS>(prog, param, c, lane), dst);
}

// ================================================================ instructions

template <class F, int CHUNKS, int VEC>
__device__ __forceinline__ void combine_scalar(Values<CHUNKS, VEC>& cur, float s, bool reversed) {
  if (reversed) {
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
}

template <class S, bool WHOLE_ROWS, class F, bool REVERSED, int CHUNKS, int VEC>
__device__ __forceinline__ void combine_feature_param(const RowProgram& prog, int param, int lane,
                                                      Values<CHUNKS, VEC>& cur) {
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    float p[VEC];
    load_feature_chunk<S, WHOLE_ROWS>(prog, param, c, lane, p);
#pragma unroll
    for (int j = 0; j < VEC; ++j) cur[c][j] = REVERSED ? F::apply(p[j], cur[c][j]) : F::apply(cur[c][j], p[j]);
  }
}

// A binary op against a scalar, a per-feature param or the value itself; `reversed` is tested once, not per
// element.
template <class S, bool WHOLE_ROWS, class F, int CHUNKS, int VEC>
__device__ __forceinline__ void fast_binary(const RowProgram& prog, const Instruction& ins, int lane,
                                            Values<CHUNKS, VEC>& cur) {
  if (ins.other == OTHER_SCALAR) {
    combine_scalar<F>(cur, ins.attrs.a0, ins.reversed);
  } else if (ins.other == OTHER_PARAM) {
    if (ins.reversed) combine_feature_param<S, WHOLE_ROWS, F, true>(prog, ins.param[0], lane, cur);
    else combine_feature_param<S, WHOLE_ROWS, F, false>(prog, ins.param[0], lane, cur);
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

// Where a row's warps meet: the general statistic code's partials, and the (mean, M2) pairs of the mean and rstd
// across warps.
template <int CHUNKS>
struct FastRowShared {
  CrossWarp<CHUNKS> cross_warp;
  float2 moments[32][CHUNKS];
};

// Chan's merge of two (mean, M2) partials of `half_count` * 2 values in all: symmetric to the bit, so both lanes
// of a butterfly step end with the same numbers.
__device__ __forceinline__ void merge_moments(float2& a, float2 b, float half_count) {
  const float delta = b.x - a.x;
  a.x = (a.x + b.x) * 0.5f;
  a.y = (a.y + b.y) + delta * delta * half_count;
}

__device__ __forceinline__ float2 shuffle_xor(float2 v, int offset) {
  return {shuffle_xor(v.x, offset), shuffle_xor(v.y, offset)};
}

// (mean, M2) of each chunk's group for groups of whole chunks across more than a warp, or of the whole row:
// two-pass over each thread's VEC values, then Chan merges across chunks, lanes and warps. One exchange between
// warps (two barriers) instead of the two of a sum and then a sum of squares.
template <int CHUNKS, int VEC>
__device__ __forceinline__ void cross_warp_moments(const Values<CHUNKS, VEC>& cur, const Instruction& ins,
                                                   float2 (&moments)[CHUNKS], FastRowShared<CHUNKS>& shared) {
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) sum += cur[c][j];
    const float mean = sum * (1.0f / VEC);
    float m2 = 0.0f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) m2 += (cur[c][j] - mean) * (cur[c][j] - mean);
    moments[c] = {mean, m2};
  }
  float count = VEC;  // values in each partial
  const bool whole_row = ins.chunks_per_group >= CHUNKS;
  if (whole_row) {
#pragma unroll
    for (int width = CHUNKS / 2; width > 0; width /= 2) {
#pragma unroll
      for (int c = 0; c < width; ++c) merge_moments(moments[c], moments[c + width], count * 0.5f);
      count *= 2.0f;
    }
  }
  const int parts = whole_row ? 1 : CHUNKS;
  for (int offset = 1; offset < 32; offset <<= 1) {
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
      if (c < parts) merge_moments(moments[c], shuffle_xor(moments[c], offset), count * 0.5f);
    count *= 2.0f;
  }
  const int warp = threadIdx.x / 32;
  const int warps_per_group = ins.lanes_per_group / 32;
  if (threadIdx.x % 32 == 0)
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
      if (c < parts) shared.moments[warp][c] = moments[c];
  __syncthreads();
  const int partial = (warp & ~(warps_per_group - 1)) | (threadIdx.x & (warps_per_group - 1));  // powers of 2
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c)
    if (c < parts) moments[c] = shared.moments[partial][c];
  for (int offset = 1; offset < warps_per_group; offset <<= 1) {
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
      if (c < parts) merge_moments(moments[c], shuffle_xor(moments[c], offset), count * 0.5f);
    count *= 2.0f;
  }
  __syncthreads();
  if (whole_row)
#pragma unroll
    for (int c = 1; c < CHUNKS; ++c) moments[c] = moments[0];
}

// A norm's statistic (s0, s1) per chunk: inline for groups inside a warp (the examples' group norms of 16 and 32
// features) and, for mean and rstd, with one exchange for groups across warps on whole rows; else the general
// statistic code.
template <Statistic ST, bool WHOLE_ROWS, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void norm_statistic(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                               float (&s0)[CHUNKS], float (&s1)[CHUNKS],
                                               FastRowShared<CHUNKS>& shared) {
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
    if (WHOLE_ROWS && (ins.chunks_per_group == 1 || ins.chunks_per_group >= CHUNKS)) {
      float2 moments[CHUNKS];
      cross_warp_moments(cur, ins, moments, shared);
      const float inv_size = 1.0f / ins.group_size;
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) s0[c] = moments[c].x, s1[c] = rsqrtf(moments[c].y * inv_size + ins.attrs.a0);
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
  compute_statistic<ST>(ctx, ins, cur, s0, s1, shared.cross_warp, nullptr);
}

// A group_norm of groups inside a chunk (GROUP_IN_VECTOR): each chunk's statistics from its own values, without an
// exchange between lanes, then its affine.
template <class S, bool WHOLE_ROWS, class F, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void fast_norm_in_vector(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur) {
  const bool weighted = ins.param[0] >= 0, biased = ins.param[1] >= 0;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    float w[VEC], b[VEC], rstd[VEC];
    center_groups_in_vector(cur[c], ins.group_size, ins.attrs.a0, rstd);  // (the params loaded after: fewer live)
    if (weighted) load_feature_chunk<S, WHOLE_ROWS>(ctx.prog, ins.param[0], c, ctx.lane, w);
    else
#pragma unroll
      for (int j = 0; j < VEC; ++j) w[j] = 1.0f;
    if (biased) load_feature_chunk<S, WHOLE_ROWS>(ctx.prog, ins.param[1], c, ctx.lane, b);
    else
#pragma unroll
      for (int j = 0; j < VEC; ++j) b[j] = 0.0f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) cur[c][j] = F::apply(cur[c][j], 0.0f, rstd[j], w[j], b[j]);
  }
}

// IN_VECTOR_GROUPS: the build takes GROUP_IN_VECTOR groups (the chains only: fits_fast_row_kernel).
template <class S, bool WHOLE_ROWS, bool IN_VECTOR_GROUPS, class F, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void fast_norm(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                          FastRowShared<CHUNKS>& shared) {
  if constexpr (IN_VECTOR_GROUPS && F::attrs == NormAttrs::GroupsEps) {  // the one norm of groups below the row
    if (ins.group_mode == GROUP_IN_VECTOR) {
      fast_norm_in_vector<S, WHOLE_ROWS, F>(ctx, ins, cur);
      return;
    }
  }
  float s0[CHUNKS], s1[CHUNKS];
  const bool weighted = ins.param[0] >= 0, biased = ins.param[1] >= 0;
  const auto affine = [&](int c, const float (&w)[VEC], const float (&b)[VEC]) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) cur[c][j] = F::apply(cur[c][j], s0[c], s1[c], w[j], b[j]);
  };
  if constexpr (VEC == 8) {
    // 16-bit rows with nn.GroupNorm's or nn.LayerNorm's affine request the weight and bias before the statistics,
    // so that the loads wait under them (16 registers at 16 values a thread; bf16 mish 15.1 -> 14.4 us, leaky_sum
    // 10.0 -> 9.5, variant 74; at 32 values, min_bias 15.5 -> 15.0, variant 99 against 98); fp32 would spill.
    // Groups across warps keep the late loads, as the held params would live through the exchange's barriers
    // (hardtanh 13.6 -> 13.2 us, variant 75).
    const bool in_warp = ins.chunks_per_group == 1 && ins.lanes_per_group <= 32;
    if (weighted && biased && in_warp) {
      uint4 w_raw[CHUNKS], b_raw[CHUNKS];
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        w_raw[c] = load_feature_raw<S, WHOLE_ROWS>(ctx.prog, ins.param[0], c, ctx.lane);
        b_raw[c] = load_feature_raw<S, WHOLE_ROWS>(ctx.prog, ins.param[1], c, ctx.lane);
      }
      norm_statistic<F::statistic, WHOLE_ROWS>(ctx, ins, cur, s0, s1, shared);
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        float w[VEC], b[VEC];
        S::unpack(w_raw[c], w);
        S::unpack(b_raw[c], b);
        affine(c, w, b);
      }
      return;
    }
  }
  norm_statistic<F::statistic, WHOLE_ROWS>(ctx, ins, cur, s0, s1, shared);
  if (weighted && biased) {  // the affine without per-element selects of the defaults
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      float w[VEC], b[VEC];
      load_feature_chunk<S, WHOLE_ROWS>(ctx.prog, ins.param[0], c, ctx.lane, w);
      load_feature_chunk<S, WHOLE_ROWS>(ctx.prog, ins.param[1], c, ctx.lane, b);
      affine(c, w, b);
    }
    return;
  }
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    float w[VEC], b[VEC];
    if (weighted) load_feature_chunk<S, WHOLE_ROWS>(ctx.prog, ins.param[0], c, ctx.lane, w);
    if (biased) load_feature_chunk<S, WHOLE_ROWS>(ctx.prog, ins.param[1], c, ctx.lane, b);
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      cur[c][j] = F::apply(cur[c][j], s0[c], s1[c], weighted ? w[j] : 1.0f, biased ? b[j] : 0.0f);
  }
}

// A row reduction's result in every element, so that later pointwise ops broadcast it for free: a chain's, whose
// op is known at compile time.
template <class F, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void fast_reduction(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                               FastRowShared<CHUNKS>& shared) {
  float s0[CHUNKS], s1[CHUNKS];
  compute_statistic<F::statistic>(ctx, ins, cur, s0, s1, shared.cross_warp, nullptr);
  fill_with_result(cur, F::result(s0[0], s1[0], ctx.prog.features, ins.attrs));
}

// The same for an interpreted program's reduction: one copy of each statistic's code for every reduction op (a copy
// per op made the bf16 fast kernels' nvcc 73% longer once var, std and vector_norm joined the seven).
template <typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void any_fast_reduction(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                                   FastRowShared<CHUNKS>& shared) {
  float s0[CHUNKS], s1[CHUNKS];
  run_statistic(ctx, ins, cur, s0, s1, shared.cross_warp, nullptr);
  fill_with_result(cur, reduction_result(ins, s0[0], s1[0], ctx.prog.features));
}

// One instruction whose op is known at compile time; IN_VECTOR_GROUPS as fast_norm's.
template <class S, bool WHOLE_ROWS, int OP, bool IN_VECTOR_GROUPS, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void fast_op(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                        FastRowShared<CHUNKS>& shared) {
  using F = typename OpOf<OP>::Functor;
  constexpr OpFamily family = OpOf<OP>::family;
  if constexpr (family == OpFamily::Unary) {
    apply_unary_op<F>(cur, ins.attrs);
  } else if constexpr (family == OpFamily::Binary) {
    fast_binary<S, WHOLE_ROWS, F>(ctx.prog, ins, ctx.lane, cur);
  } else if constexpr (family == OpFamily::Norm) {
    fast_norm<S, WHOLE_ROWS, IN_VECTOR_GROUPS, F>(ctx, ins, cur, shared);
  } else {
    fast_reduction<F>(ctx, ins, cur, shared);
  }
}

// One instruction of an interpreted program.
template <class S, bool WHOLE_ROWS, bool WITH_LIBM_OPS, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void fast_instruction(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                                 FastRowShared<CHUNKS>& shared) {
  if (is_unary(ins.op)) {  // one range test before the unary ops' own switch, not a place in the flat one
    run_unary<WITH_LIBM_OPS>(ins, cur);
    return;
  }
  switch (ins.op) {
#define FXFUSE_FAST_CASE(name, F)                                    \
  case OP_##name:                                                    \
    fast_op<S, WHOLE_ROWS, OP_##name, false>(ctx, ins, cur, shared); \
    break;
#define FXFUSE_FAST_BINARY_CASE(name, F)                                                 \
  case OP_##name:                                                                        \
    if constexpr (WITH_LIBM_OPS || !CallsLibm<F>::value)                                 \
      fast_op<S, WHOLE_ROWS, OP_##name, false>(ctx, ins, cur, shared);                   \
    break;
    FXFUSE_BINARY_OPS(FXFUSE_FAST_BINARY_CASE)
    FXFUSE_NORM_OPS(FXFUSE_FAST_CASE)
#undef FXFUSE_FAST_BINARY_CASE
#undef FXFUSE_FAST_CASE
#define FXFUSE_REDUCTION_LABEL(name, F) case OP_##name:
    FXFUSE_REDUCTION_OPS(FXFUSE_REDUCTION_LABEL)
#undef FXFUSE_REDUCTION_LABEL
      any_fast_reduction(ctx, ins, cur, shared);
      break;
    default:
      break;
  }
}

// ================================================================ a last whole-row min without barriers

// A chain whose last op is a whole-row min (amin or min_dim: min + bias's), with one value per row out and rows
// across warps, runs that op without the exchange between warps and its two barriers: each warp folds its part to
// one integer key (one redux), its first lane merges the key into the row's slot in shared memory by an atomic
// min, and the row's last warp to arrive stores the row's min. The slots, one per row the block takes, are set
// once at the start; the launcher keeps the exchange where they would not fit. min_bias's row kernel: 12.0 -> 11.2
// us fp32, 9.9 -> 9.2 bf16 (variants 89 and 91).
constexpr int kRowMinSlots = 512;

struct RowMinSlot {
  int key;
  int arrivals;
};

template <bool MIN_BY_ATOMICS>
struct RowMinSlots {
  RowMinSlot slot[kRowMinSlots];
};
template <>
struct RowMinSlots<false> {};

// An integer key in the order of the floats (a negative float's magnitude bits flipped), NaN the lowest key, as
// amin propagates NaN (MinOp). key_value inverts it; the NaN key, INT_MIN, reads back as a NaN.
constexpr int kNanKey = INT_MIN;
__device__ __forceinline__ int min_key(float v) {
  const int bits = __float_as_int(v);
  return v != v ? kNanKey : bits ^ ((bits >> 31) & INT_MAX);
}
__device__ __forceinline__ float key_value(int key) { return __int_as_float(key ^ ((key >> 31) & INT_MAX)); }

// This warp's part of its row's min into the row's slot; the row's last warp to arrive stores the row's min.
template <class S, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void fold_row_min(const Ctx& ctx, const Values<CHUNKS, VEC>& cur, RowMinSlot& slot,
                                             typename S::Raw* out) {
  float part[CHUNKS];
  chunk_extrema<MinOp>(ctx, cur, part);
  float thread_min = part[0];
#pragma unroll
  for (int c = 1; c < CHUNKS; ++c) thread_min = MinOp::apply(thread_min, part[c]);
  const int warp_key = __reduce_min_sync(0xffffffffu, min_key(thread_min));
  if (threadIdx.x % 32 != 0) return;
  atomicMin_block(&slot.key, warp_key);
  __threadfence_block();  // the key before the arrival
  if (atomicAdd_block(&slot.arrivals, 1) == ctx.prog.threads_per_row / 32 - 1) {
    __threadfence_block();
    *out = S::from_float(key_value(atomicAdd_block(&slot.key, 0)));
  }
}

// ================================================================ the kernels

// The row loop of both kernels. Block: (blockDim.x / TPR) rows of TPR threads; each block takes every gridDim.x-th
// group of rows. Staging slot c of thread t is vector c * blockDim.x + t of the dynamic shared memory (stage_row,
// unstage_chunks). run_program(ctx, cur, shared) applies the program to one row's values; MIN_BY_ATOMICS: all but
// its last op, a whole-row min, which fold_row_min then runs and stores.
template <class S, int VALUES, bool WHOLE_ROWS, bool MIN_BY_ATOMICS = false, class RunProgram>
__device__ __forceinline__ void run_rows(const RowProgram& prog, RunProgram run_program) {
  constexpr int VEC = S::VEC;
  constexpr int CHUNKS = VALUES / VEC;
  using Ctx = FastRowContext<S, CHUNKS, WHOLE_ROWS>;
  using Raw = typename S::Raw;
  __shared__ FastRowShared<CHUNKS> shared;
  __shared__ RowMinSlots<MIN_BY_ATOMICS> row_mins;
  const int tpr_shift = __popc(prog.threads_per_row - 1);  // TPR is a power of 2
  const int lane = threadIdx.x & (prog.threads_per_row - 1);
  const int rows_per_block = blockDim.x >> tpr_shift;
  const int chunk_stride = prog.threads_per_row * VEC;  // elements between a thread's chunks
  Raw* output = static_cast<Raw*>(prog.output);
  if (prog.tail_follows) allow_next_kernel_to_start();  // its blocks take SMs as this persistent grid's leave
  if constexpr (MIN_BY_ATOMICS) {
    for (int i = threadIdx.x; i < prog.row_min_slots; i += blockDim.x) row_mins.slot[i] = {INT_MAX, 0};
    __syncthreads();
  }
  wait_for_previous_kernel();  // launched early (launch_kernel): the GEMM output is not there before

  uint4* staging = row_shared;
  const auto row_of = [&](int64_t group) { return group * rows_per_block + (threadIdx.x >> tpr_shift); };
  const auto clamped = [&](int64_t row) { return row < prog.rows ? row : prog.rows - 1; };  // idle rows: never stored
  if (blockIdx.x < prog.row_groups)
    stage_row<S, CHUNKS, WHOLE_ROWS>(prog, clamped(row_of(blockIdx.x)), lane, staging);

  int iteration = 0;
  for (int64_t group = blockIdx.x; group < prog.row_groups; group += gridDim.x, ++iteration) {
    const int64_t row = row_of(group);
    const Ctx ctx{{prog, clamped(row), lane}};
    float cur[CHUNKS][VEC];
    wait_async_copies();
    unstage_chunks<S>(ctx, staging, cur);
    if (group + gridDim.x < prog.row_groups)
      stage_row<S, CHUNKS, WHOLE_ROWS>(prog, clamped(row_of(group + gridDim.x)), lane, staging);

    run_program(ctx, cur, shared);

    if (row >= prog.rows) continue;
    if constexpr (MIN_BY_ATOMICS) {
      fold_row_min<S>(ctx, cur, row_mins.slot[iteration * rows_per_block + (threadIdx.x >> tpr_shift)], output + row);
      continue;
    }
    if (prog.output_per_row) {
      if (lane == 0) output[row] = S::from_float(cur[0][0]);
      continue;
    }
    Raw* out = output + row * prog.features + lane * VEC;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
      if (ctx.chunk_count(c) > 0) store_vector<S>(out + c * chunk_stride, cur[c]);
  }
}

// Any program the fast kernel takes, interpreted: one dispatch per instruction.
template <class S, int VALUES, bool WHOLE_ROWS, bool WITH_LIBM_OPS>
__global__ void __launch_bounds__(fast_row_threads(VALUES), 1)
    fast_row_kernel(const __grid_constant__ RowProgram prog) {
  // Inlined by force: nvcc kept this loop a called function, so that `cur` lived in local memory (a 176-byte stack
  // frame in the bf16 builds, 208 with the libdevice ops).
  run_rows<S, VALUES, WHOLE_ROWS>(prog, [&](const auto& ctx, auto& cur, auto& shared) __attribute__((always_inline)) {
    for (int pc = 0; pc < prog.num_instructions; ++pc)
      fast_instruction<S, WHOLE_ROWS, WITH_LIBM_OPS>(ctx, prog.code[pc], cur, shared);
  });
}

// A chain of FXFUSE_ROW_CHAINS (program_format.cuh) on whole rows, compiled whole: instruction pc's op is OPS[pc],
// so there is no dispatch and no switch join between the ops; attributes, params and group shapes still come from
// the program.
// MIN_BY_ATOMICS: the last op, a whole-row min, runs as fold_row_min (the launcher sets row_min_slots).
template <class S, int VALUES, bool MIN_BY_ATOMICS, Opcode... OPS>
__global__ void __launch_bounds__(fast_row_threads(VALUES), 1)
    chain_row_kernel(const __grid_constant__ RowProgram prog) {
  constexpr Opcode kOps[] = {OPS...};
  constexpr int kLast = sizeof...(OPS) - 1;
  if constexpr (MIN_BY_ATOMICS) {
    static_assert(statistic_of(kOps[kLast]) == Statistic::Min, "the build that folds a last row min by atomics");
    run_rows<S, VALUES, true, true>(prog, [&](const auto& ctx, auto& cur, auto& shared) {
      int pc = 0;
      (((pc < kLast ? fast_op<S, true, OPS, true>(ctx, prog.code[pc], cur, shared) : void()), ++pc), ...);
    });
  } else {
    run_rows<S, VALUES, true>(prog, [&](const auto& ctx, auto& cur, auto& shared) {
      int pc = 0;
      (fast_op<S, true, OPS, true>(ctx, prog.code[pc++], cur, shared), ...);
    });
  }
}

// ================================================================ the launcher (declared in program_format.cuh)

using RowKernel = void (*)(RowProgram);

// The chain's build that folds its last row min by atomics, or nullptr where the last op is not a row min.
template <class S, int VALUES, Opcode... OPS>
RowKernel row_min_build() {
  constexpr Opcode kOps[] = {OPS...};
  if constexpr (statistic_of(kOps[sizeof...(OPS) - 1]) == Statistic::Min)
    return chain_row_kernel<S, VALUES, true, OPS...>;
  else
    return nullptr;
}

// A chain's entry in a lookup table: its kernel at VALUES (MIN_BY_ATOMICS: its row_min_build).
#define FXFUSE_CHAIN_ENTRY(...)                                                                                  \
  chain_entry<RowKernel, __VA_ARGS__>(MIN_BY_ATOMICS ? row_min_build<S, VALUES, __VA_ARGS__>()                   \
                                                     : chain_row_kernel<S, VALUES, false, __VA_ARGS__>),

// The kernel of the chain with libdevice ops (FXFUSE_LIBM_ROW_CHAINS) of this program's opcode sequence, at 16
// values a thread, or nullptr. A storage type's file may leave its two instances to the translation unit of its
// libm build on whole rows (`extern template`), as it does libm_row_kernel's.
template <class S, bool MIN_BY_ATOMICS>
RowKernel libm_chain_kernel(const RowProgram& prog) {
  constexpr int VALUES = kRowValues;
  static const ChainEntry<RowKernel> chains[] = {FXFUSE_LIBM_ROW_CHAINS(FXFUSE_CHAIN_ENTRY)};
  return find_chain(chains, prog.code, prog.num_instructions);
}

// The chain kernel of this program's opcode sequence (MIN_BY_ATOMICS: its row_min_build), or nullptr: one of
// FXFUSE_ROW_CHAINS, or at 16 values a thread one of FXFUSE_LIBM_ROW_CHAINS.
template <class S, int VALUES, bool MIN_BY_ATOMICS>
RowKernel chain_kernel(const RowProgram& prog) {
  static const ChainEntry<RowKernel> chains[] = {FXFUSE_ROW_CHAINS(FXFUSE_CHAIN_ENTRY)};
  const RowKernel kernel = find_chain(chains, prog.code, prog.num_instructions);
  if constexpr (VALUES == kRowValues)
    if (kernel == nullptr) return libm_chain_kernel<S, MIN_BY_ATOMICS>(prog);
  return kernel;
}
#undef FXFUSE_CHAIN_ENTRY

// The interpreted build for programs with libdevice ops, at 16 values a thread only (fast_row_values). A storage
// type's file may leave its two instances to translation units of their own (`extern template`), which ninja builds
// beside it: they were 140 of the 186 s of nvcc that the bf16 fast kernels took in one unit.
template <class S, bool WHOLE_ROWS>
RowKernel libm_row_kernel() {
  return fast_row_kernel<S, kRowValues, WHOLE_ROWS, true>;
}

template <class S, int VALUES>
bool launch_fast_row_program(const RowProgram& prog, const RowLaunch& launch, cudaStream_t stream) {
  const bool whole_rows = prog.features == prog.threads_per_row * VALUES;
  RowKernel kernel = whole_rows ? chain_kernel<S, VALUES, false>(prog) : nullptr;
  const bool chained = kernel != nullptr;
  if (!chained && uses_libm_op(prog)) {  // (laid out at 16 values a thread: fast_row_values)
    TORCH_CHECK(VALUES == kRowValues, "fxfuse: a program with libdevice ops laid out at ", VALUES, " values a thread");
    if constexpr (VALUES == kRowValues) kernel = whole_rows ? libm_row_kernel<S, true>() : libm_row_kernel<S, false>();
  } else if (!chained) {
    kernel = whole_rows ? fast_row_kernel<S, VALUES, true, false> : fast_row_kernel<S, VALUES, false, false>;
  }
  const int threads = launch.rows_per_block * prog.threads_per_row;
  RowProgram sized = prog;
  sized.row_groups = (prog.rows + launch.rows_per_block - 1) / launch.rows_per_block;
  const int64_t staging_bytes = int64_t{threads} * VALUES * sizeof(typename S::Raw);
  const RowGrid grid = row_grid(kernel, threads, staging_bytes);
  if (grid.blocks == 0) return false;
  const unsigned blocks = static_cast<unsigned>(std::min(sized.row_groups, grid.blocks));
  const int64_t slots = (sized.row_groups + blocks - 1) / blocks * launch.rows_per_block;  // rows a block takes
  const bool rows_across_warps = prog.threads_per_row > 32;
  RowKernel min_by_atomics = nullptr;
  if (chained && prog.output_per_row && rows_across_warps && slots <= kRowMinSlots)
    min_by_atomics = chain_kernel<S, VALUES, true>(prog);
  sized.row_min_slots = 0;
  // (row_grid sets the atomics build's shared-memory attribute; the grid stays the chain's)
  if (min_by_atomics != nullptr && row_grid(min_by_atomics, threads, staging_bytes).blocks > 0) {
    kernel = min_by_atomics;
    sized.row_min_slots = static_cast<int32_t>(slots);
  }
  launch_kernel(kernel, blocks, threads, staging_bytes, launch.early, stream, sized);
  return true;
}

}  // namespace fxfuse
