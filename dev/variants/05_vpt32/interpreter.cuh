// The epilogue interpreter: the two kernels that run a compiled program (format: program_format.cuh), and
// their launcher templates.
//
//   row_program_kernel  one group of threads per row of the GEMM output; reads the row once into registers
//                       (fp32), runs the row phase of the program, writes the row (or one value per row) once.
//   broadcast_tail_kernel  the pointwise instructions after a broadcast that outgrows the row (the min + bias
//                       example's (1, N, M, 1) output): one pass over the output, operands read by strides.
//
// Register layout of a row: thread t of the row's TPR threads holds CHUNKS chunks of VEC contiguous elements
// (VEC = 16 bytes of storage); chunk c covers elements [(c * TPR + t) * VEC, + VEC), so each load and store
// instruction of a warp covers 512 contiguous bytes. Values that are read again later live in register "slots"
// (copies of the current value), which the host allocates; they are indexed with compile-time constants only.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "program_format.cuh"

namespace fxfuse {

// ================================================================ storage <-> fp32

// Kernels are compiled per element size; bf16 and fp16 share the 2-byte kernels and differ only here, in a
// block-uniform branch (halves the compile time of the 16-bit kernels).
template <int BYTES>
struct Storage;

template <>
struct Storage<4> {
  using Raw = float;
  __device__ static float to_float(Raw v, uint8_t) { return v; }
  __device__ static Raw from_float(float v, uint8_t) { return v; }
};

template <>
struct Storage<2> {
  using Raw = unsigned short;
  __device__ static float to_float(Raw v, uint8_t kind) {
    return kind == STORAGE_BF16 ? __uint_as_float(static_cast<unsigned>(v) << 16) : __half2float(__ushort_as_half(v));
  }
  __device__ static Raw from_float(float v, uint8_t kind) {
    return kind == STORAGE_BF16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v)) : __half_as_ushort(__float2half_rn(v));
  }
};

template <int BYTES, int VEC>
__device__ __forceinline__ void load_vector(const typename Storage<BYTES>::Raw* p, uint8_t kind, float (&dst)[VEC]) {
  static_assert(VEC * BYTES == 16, "one 16-byte access");
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const auto* items = reinterpret_cast<const typename Storage<BYTES>::Raw*>(&raw);
#pragma unroll
  for (int j = 0; j < VEC; ++j) dst[j] = Storage<BYTES>::to_float(items[j], kind);
}

template <int BYTES, int VEC>
__device__ __forceinline__ void store_vector(typename Storage<BYTES>::Raw* p, uint8_t kind, const float (&src)[VEC]) {
  uint4 raw;
  auto* items = reinterpret_cast<typename Storage<BYTES>::Raw*>(&raw);
#pragma unroll
  for (int j = 0; j < VEC; ++j) items[j] = Storage<BYTES>::from_float(src[j], kind);
  *reinterpret_cast<uint4*>(p) = raw;
}

// ================================================================ pointwise instructions (row and tail)

// Values of one thread: CHUNKS chunks of VEC elements. Reader::load(param, chunk, dst) fetches a param's chunk.
template <int CHUNKS, int VEC>
using Values = float[CHUNKS][VEC];

// Slot arrays keep one element when a kernel has no slots, so that the code paths that never run still compile.
template <int SLOTS>
constexpr int kSlotStorage = SLOTS > 0 ? SLOTS : 1;

template <int VEC>
struct Chunk {
  float v[VEC];
};

// Every unary op on one chunk, called once per chunk: one copy of the unary functors per chunk width instead of
// one per element of every kernel (the fully inlined interpreter took 7.5 min to compile for one arch).
template <int VEC>
__device__ __noinline__ Chunk<VEC> apply_unary(Chunk<VEC> x, uint8_t op, Attrs attrs) {
  switch (op) {
#define FXFUSE_UNARY_CASE(name, F)                                                       \
  case OP_##name:                                                                        \
    _Pragma("unroll") for (int j = 0; j < VEC; ++j) x.v[j] = F::apply(x.v[j], attrs);   \
    break;
    FXFUSE_UNARY_OPS(FXFUSE_UNARY_CASE)
#undef FXFUSE_UNARY_CASE
    default:
      break;
  }
  return x;
}

// A binary op against its second operand, wherever it lives; the op and the operand's kind are dispatched once
// per instruction, outside the loops over the values.
template <class F, int CHUNKS, int VEC>
__device__ __forceinline__ void combine(Values<CHUNKS, VEC>& cur, const Values<CHUNKS, VEC>& other, bool reversed) {
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
    for (int j = 0; j < VEC; ++j) cur[c][j] = reversed ? F::apply(other[c][j], cur[c][j]) : F::apply(cur[c][j], other[c][j]);
}

template <class F, int CHUNKS, int VEC, int SLOTS, class Reader>
__device__ __forceinline__ void run_binary(const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                           Values<CHUNKS, VEC> (&slots)[kSlotStorage<SLOTS>], const Reader& reader) {
  const bool reversed = ins.reversed;
  switch (ins.other) {
    case OTHER_SLOT0:
      if constexpr (SLOTS > 0) combine<F>(cur, slots[0], reversed);
      break;
    case OTHER_SLOT1:
      if constexpr (SLOTS > 1) combine<F>(cur, slots[1], reversed);
      break;
    case OTHER_PARAM:
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        float p[VEC];
        reader.load(ins.param[0], c, p);
#pragma unroll
        for (int j = 0; j < VEC; ++j) cur[c][j] = reversed ? F::apply(p[j], cur[c][j]) : F::apply(cur[c][j], p[j]);
      }
      break;
    case OTHER_SCALAR: {
      const float s = ins.attrs.a0;
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) cur[c][j] = reversed ? F::apply(s, cur[c][j]) : F::apply(cur[c][j], s);
      break;
    }
    default:  // OTHER_CURRENT
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) cur[c][j] = F::apply(cur[c][j], cur[c][j]);
      break;
  }
}

template <int CHUNKS, int VEC, int SLOTS>
__device__ __forceinline__ void move_slot(const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                          Values<CHUNKS, VEC> (&slots)[kSlotStorage<SLOTS>]) {
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) {
    if (ins.slot != s) continue;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        if (ins.op == OP_SAVE) slots[s][c][j] = cur[c][j];
        else cur[c][j] = slots[s][c][j];
      }
  }
}

#define FXFUSE_OPCODE_CASE(name, F) case OP_##name:

// Runs one slot move, unary or binary instruction; returns false for the ops it does not know (row ops).
template <int CHUNKS, int VEC, int SLOTS, class Reader>
__device__ __forceinline__ bool run_pointwise(const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                              Values<CHUNKS, VEC> (&slots)[kSlotStorage<SLOTS>], const Reader& reader) {
  switch (ins.op) {
    case OP_SAVE:
    case OP_LOAD:
      move_slot<CHUNKS, VEC, SLOTS>(ins, cur, slots);
      return true;
    FXFUSE_UNARY_OPS(FXFUSE_OPCODE_CASE) {
      // one call for up to 16 values: the call costs about as much as a cheap op on a chunk
      constexpr int kWidth = CHUNKS * VEC <= 16 ? CHUNKS * VEC : VEC;
      float* flat = &cur[0][0];
#pragma unroll
      for (int first = 0; first < CHUNKS * VEC; first += kWidth) {
        Chunk<kWidth> chunk;
#pragma unroll
        for (int j = 0; j < kWidth; ++j) chunk.v[j] = flat[first + j];
        chunk = apply_unary<kWidth>(chunk, ins.op, ins.attrs);
#pragma unroll
        for (int j = 0; j < kWidth; ++j) flat[first + j] = chunk.v[j];
      }
      return true;
    }
#define FXFUSE_BINARY_CASE(name, F)                             \
  case OP_##name:                                               \
    run_binary<F, CHUNKS, VEC, SLOTS>(ins, cur, slots, reader); \
    return true;
    FXFUSE_BINARY_OPS(FXFUSE_BINARY_CASE)
#undef FXFUSE_BINARY_CASE
    default:
      return false;
  }
}



// ================================================================ reductions over groups of a row

struct SumOp {
  __device__ static float identity() { return 0.0f; }
  __device__ static float apply(float a, float b) { return a + b; }
};
struct MaxOp {
  __device__ static float identity() { return -INFINITY; }
  __device__ static float apply(float a, float b) { return (a > b || isnan(a)) ? a : b; }
};
struct MinOp {
  __device__ static float identity() { return INFINITY; }
  __device__ static float apply(float a, float b) { return (a < b || isnan(a)) ? a : b; }
};

// Where a row's threads meet: 32 warps per block at most, one partial per chunk each.
template <int CHUNKS>
struct CrossWarp {
  float partial[32][CHUNKS];
};

// Combines v[k] over lanes_per_group consecutive lanes (a power of 2): xor butterflies within a warp, then a
// fixed-order sum over the group's warps through shared memory. Every lane of a group ends with the same bits
// (each butterfly step adds the same two numbers in both lanes): deterministic.
template <class R, int K, int CHUNKS>
__device__ __forceinline__ void lanes_allreduce(float (&v)[K], int lanes_per_group, CrossWarp<CHUNKS>& cross_warp) {
  static_assert(K <= CHUNKS, "one cross-warp column per value");
  const int warp_span = lanes_per_group < 32 ? lanes_per_group : 32;
  for (int offset = 1; offset < warp_span; offset <<= 1)
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = R::apply(v[k], __shfl_xor_sync(0xffffffffu, v[k], offset));
  if (lanes_per_group > 32) {
    const int warp = threadIdx.x / 32;
    const int warps_per_group = lanes_per_group / 32;
    if (threadIdx.x % 32 == 0)
#pragma unroll
      for (int k = 0; k < K; ++k) cross_warp.partial[warp][k] = v[k];
    __syncthreads();
    const int first = warp / warps_per_group * warps_per_group;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float total = cross_warp.partial[first][k];
      for (int w = 1; w < warps_per_group; ++w) total = R::apply(total, cross_warp.partial[first + w][k]);
      v[k] = total;
    }
    __syncthreads();
  }
}

// part[c] holds this thread's partial of chunk c; on return it holds the total of chunk c's group.
template <class R, int CHUNKS>
__device__ __forceinline__ void group_allreduce(float (&part)[CHUNKS], int chunks_per_group, int lanes_per_group,
                                                CrossWarp<CHUNKS>& cross_warp) {
  if (chunks_per_group >= CHUNKS) {  // all of this thread's chunks in one group (whole-row statistics)
    float total[1] = {part[0]};
#pragma unroll
    for (int c = 1; c < CHUNKS; ++c) total[0] = R::apply(total[0], part[c]);
    lanes_allreduce<R>(total, lanes_per_group, cross_warp);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) part[c] = total[0];
    return;
  }
  if (chunks_per_group > 1) {
    float combined[CHUNKS];
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      combined[c] = R::identity();
#pragma unroll
      for (int c2 = 0; c2 < CHUNKS; ++c2)
        if (c2 / chunks_per_group == c / chunks_per_group) combined[c] = R::apply(combined[c], part[c2]);
    }
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) part[c] = combined[c];
  }
  lanes_allreduce<R>(part, lanes_per_group, cross_warp);
}

// ================================================================ the row kernel

template <int BYTES, int CHUNKS>
struct RowContext {
  static constexpr int VEC = 16 / BYTES;
  using Raw = typename Storage<BYTES>::Raw;
  const RowProgram& prog;
  int64_t row;  // clamped to the last row for the idle rows of the last block, which compute and never store
  int lane;     // thread index within the row

  __device__ int element(int c, int j) const { return (c * prog.threads_per_row + lane) * VEC + j; }
  __device__ bool valid(int c, int j) const { return element(c, j) < prog.features; }
  __device__ float to_float(Raw v) const { return Storage<BYTES>::to_float(v, prog.storage); }

  // The param reader of the row phase.
  __device__ void load(int param, int c, float (&dst)[VEC]) const {
    const RowParam& p = prog.params[param];
    const Raw* base = static_cast<const Raw*>(p.ptr) + row * p.row_stride;
    const int first = element(c, 0);
    if (p.vector_loads) {
      if (first < prog.features) {
        load_vector<BYTES, VEC>(base + first, prog.storage, dst);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) dst[j] = 0.0f;
      }
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        dst[j] = first + j < prog.features ? to_float(base[(first + j) * p.feature_stride]) : 0.0f;
    }
  }

  __device__ void load_feature_param(int param, int c, float fallback, float (&dst)[VEC]) const {
    if (param < 0) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) dst[j] = fallback;
    } else {
      load(param, c, dst);
    }
  }
};

// Sums f(chunk, value) over each chunk's valid elements.
template <typename Ctx, int CHUNKS, int VEC, class F>
__device__ __forceinline__ void chunk_sums(const Ctx& ctx, const Values<CHUNKS, VEC>& cur, float (&part)[CHUNKS], F f) {
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      if (ctx.valid(c, j)) s += f(c, cur[c][j]);
    part[c] = s;
  }
}

template <class R, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void chunk_extrema(const Ctx& ctx, const Values<CHUNKS, VEC>& cur, float (&part)[CHUNKS]) {
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    float m = R::identity();
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      if (ctx.valid(c, j)) m = R::apply(m, cur[c][j]);
    part[c] = m;
  }
}

// Normalizes each group of group_size elements of the row in place, for group layouts the lanes cannot take:
// the row goes through shared memory, and a thread (groups of up to 32) or a warp sums each group in a fixed order.
template <typename Ctx, int CHUNKS, int VEC>
__device__ void normalize_groups_in_shared(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                           float* shared_rows) {
  const int n = ctx.prog.features;
  const int tpr = ctx.prog.threads_per_row;
  float* row = shared_rows + static_cast<int64_t>(threadIdx.x / tpr) * n;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      if (ctx.valid(c, j)) row[ctx.element(c, j)] = cur[c][j];
  __syncthreads();
  const int size = ins.group_size;
  const int groups = n / size;
  const float eps = ins.attrs.a0;
  if (size <= 32) {
    for (int g = ctx.lane; g < groups; g += tpr) {
      float* group = row + g * size;
      float sum = 0.0f;
      for (int i = 0; i < size; ++i) sum += group[i];
      const float mean = sum / size;
      float squares = 0.0f;
      for (int i = 0; i < size; ++i) squares += (group[i] - mean) * (group[i] - mean);
      const float rstd = rsqrtf(squares / size + eps);
      for (int i = 0; i < size; ++i) group[i] = (group[i] - mean) * rstd;
    }
  } else {
    const int lane = ctx.lane % 32;
    for (int g = ctx.lane / 32; g < groups; g += tpr / 32) {
      float* group = row + g * size;
      float sum = 0.0f;
      for (int i = lane; i < size; i += 32) sum += group[i];
      for (int offset = 1; offset < 32; offset <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      const float mean = sum / size;
      float squares = 0.0f;
      for (int i = lane; i < size; i += 32) squares += (group[i] - mean) * (group[i] - mean);
      for (int offset = 1; offset < 32; offset <<= 1) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
      const float rstd = rsqrtf(squares / size + eps);
      for (int i = lane; i < size; i += 32) group[i] = (group[i] - mean) * rstd;
    }
  }
  __syncthreads();
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      if (ctx.valid(c, j)) cur[c][j] = row[ctx.element(c, j)];
  __syncthreads();
}

// (s0, s1) of each chunk's group for the statistic S. MeanAndRstd in GROUP_SHARED mode normalizes cur in place
// instead and returns (0, 1).
template <Statistic S, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void compute_statistic(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                                  float (&s0)[CHUNKS], float (&s1)[CHUNKS],
                                                  CrossWarp<CHUNKS>& cross_warp, float* shared_rows) {
  const int cpg = ins.chunks_per_group;
  const int lpg = ins.lanes_per_group;
  if constexpr (S == Statistic::MeanAndRstd) {
    if (ins.group_mode == GROUP_SHARED) {
      normalize_groups_in_shared(ctx, ins, cur, shared_rows);
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) s0[c] = 0.0f, s1[c] = 1.0f;
      return;
    }
    const float inv_size = 1.0f / ins.group_size;
    chunk_sums(ctx, cur, s0, [](int, float v) { return v; });
    group_allreduce<SumOp>(s0, cpg, lpg, cross_warp);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) s0[c] *= inv_size;
    chunk_sums(ctx, cur, s1, [&](int c, float v) { return (v - s0[c]) * (v - s0[c]); });
    group_allreduce<SumOp>(s1, cpg, lpg, cross_warp);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) s1[c] = rsqrtf(s1[c] * inv_size + ins.attrs.a0);
  } else if constexpr (S == Statistic::RootMeanSquare) {
    chunk_sums(ctx, cur, s1, [](int, float v) { return v * v; });
    group_allreduce<SumOp>(s1, cpg, lpg, cross_warp);
    const float inv_size = 1.0f / ins.group_size;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) s1[c] = rsqrtf(s1[c] * inv_size + ins.attrs.a0);
  } else if constexpr (S == Statistic::MaxAndLogSumExp) {
    chunk_extrema<MaxOp>(ctx, cur, s0);
    group_allreduce<MaxOp>(s0, cpg, lpg, cross_warp);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) s0[c] = isinf(s0[c]) ? 0.0f : s0[c];
    chunk_sums(ctx, cur, s1, [&](int c, float v) { return expf(v - s0[c]); });
    group_allreduce<SumOp>(s1, cpg, lpg, cross_warp);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) s1[c] = logf(s1[c]);
  } else if constexpr (S == Statistic::Sum) {
    chunk_sums(ctx, cur, s0, [](int, float v) { return v; });
    group_allreduce<SumOp>(s0, cpg, lpg, cross_warp);
  } else if constexpr (S == Statistic::Max) {
    chunk_extrema<MaxOp>(ctx, cur, s0);
    group_allreduce<MaxOp>(s0, cpg, lpg, cross_warp);
  } else {
    chunk_extrema<MinOp>(ctx, cur, s0);
    group_allreduce<MinOp>(s0, cpg, lpg, cross_warp);
  }
}

#define FXFUSE_STATISTIC_CASE(name, F) \
  case OP_##name:                      \
    return F::statistic;
__device__ __forceinline__ Statistic statistic_of(uint8_t op) {
  switch (op) {
    FXFUSE_NORM_OPS(FXFUSE_STATISTIC_CASE)
    FXFUSE_REDUCTION_OPS(FXFUSE_STATISTIC_CASE)
    default:
      return Statistic::Sum;
  }
}
#undef FXFUSE_STATISTIC_CASE

// One copy of each statistic's code per kernel, whichever op asks for it.
template <typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void run_statistic(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                              float (&s0)[CHUNKS], float (&s1)[CHUNKS], CrossWarp<CHUNKS>& cross_warp,
                                              float* shared_rows) {
  switch (statistic_of(ins.op)) {
    case Statistic::MeanAndRstd:
      return compute_statistic<Statistic::MeanAndRstd>(ctx, ins, cur, s0, s1, cross_warp, shared_rows);
    case Statistic::RootMeanSquare:
      return compute_statistic<Statistic::RootMeanSquare>(ctx, ins, cur, s0, s1, cross_warp, shared_rows);
    case Statistic::MaxAndLogSumExp:
      return compute_statistic<Statistic::MaxAndLogSumExp>(ctx, ins, cur, s0, s1, cross_warp, shared_rows);
    case Statistic::Sum:
      return compute_statistic<Statistic::Sum>(ctx, ins, cur, s0, s1, cross_warp, shared_rows);
    case Statistic::Max:
      return compute_statistic<Statistic::Max>(ctx, ins, cur, s0, s1, cross_warp, shared_rows);
    case Statistic::Min:
      return compute_statistic<Statistic::Min>(ctx, ins, cur, s0, s1, cross_warp, shared_rows);
  }
}

// A norm or a row reduction: its statistic (one copy of each statistic's code per kernel), then the op's
// per-element apply, or its per-row result in every element (so later pointwise ops broadcast it for free).
template <typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void run_row_op(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                           CrossWarp<CHUNKS>& cross_warp, float* shared_rows) {
  float s0[CHUNKS], s1[CHUNKS];
  run_statistic(ctx, ins, cur, s0, s1, cross_warp, shared_rows);
  float result = 0.0f;
  switch (ins.op) {
#define FXFUSE_RESULT_CASE(name, F)                      \
  case OP_##name:                                        \
    result = F::result(s0[0], s1[0], ctx.prog.features); \
    break;
    FXFUSE_REDUCTION_OPS(FXFUSE_RESULT_CASE)
#undef FXFUSE_RESULT_CASE
#define FXFUSE_NORM_APPLY_CASE(name, F)                                                         \
  case OP_##name:                                                                               \
    _Pragma("unroll") for (int c = 0; c < CHUNKS; ++c) {                                        \
      float w[VEC], b[VEC];                                                                     \
      ctx.load_feature_param(ins.param[0], c, 1.0f, w);                                         \
      ctx.load_feature_param(ins.param[1], c, 0.0f, b);                                         \
      _Pragma("unroll") for (int j = 0; j < VEC; ++j) cur[c][j] = F::apply(cur[c][j], s0[c], s1[c], w[j], b[j]); \
    }                                                                                           \
    return;
    FXFUSE_NORM_OPS(FXFUSE_NORM_APPLY_CASE)
#undef FXFUSE_NORM_APPLY_CASE
    default:
      break;
  }
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
    for (int j = 0; j < VEC; ++j) cur[c][j] = result;
}

template <class F, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void run_feature_affine(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur) {
  const Attrs attrs = ins.attrs;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    float mean[VEC], var[VEC], w[VEC], b[VEC];
    ctx.load(ins.param[0], c, mean);
    ctx.load(ins.param[1], c, var);
    ctx.load_feature_param(ins.param[2], c, 1.0f, w);
    ctx.load_feature_param(ins.param[3], c, 0.0f, b);
#pragma unroll
    for (int j = 0; j < VEC; ++j) cur[c][j] = F::apply(cur[c][j], mean[j], var[j], w[j], b[j], attrs);
  }
}

// Values per thread: kShortRowValues while a row fits one block, 32 for longer rows (blocks up to 512, 256 with
// slots). At 8192 features on an H200, 8 values ran 1.2-2x faster than 32: a 4x smaller unrolled body (the
// instruction cache) and more warps to hide latency (dev/NOTES.md).
template <int BYTES, int CHUNKS>
constexpr bool kShortRows = CHUNKS * (16 / BYTES) == kShortRowValues;

template <int BYTES, int CHUNKS, int SLOTS>
constexpr int kMaxBlock = kShortRows<BYTES, CHUNKS> ? kShortRowMaxThreads : (SLOTS > 0 ? 256 : 512);

// Block: (blockDim.x / TPR) rows of TPR threads.
template <int BYTES, int CHUNKS, int SLOTS>
__global__ void __launch_bounds__(kMaxBlock<BYTES, CHUNKS, SLOTS>, kShortRows<BYTES, CHUNKS> ? kShortRowMinBlocks : 1)
row_program_kernel(const __grid_constant__ RowProgram prog) {
  using Ctx = RowContext<BYTES, CHUNKS>;
  using Raw = typename Ctx::Raw;
  constexpr int VEC = Ctx::VEC;
  __shared__ CrossWarp<CHUNKS> cross_warp;
  extern __shared__ float shared_rows[];

  const int tpr = prog.threads_per_row;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / tpr) + threadIdx.x / tpr;
  const Ctx ctx{prog, row < prog.rows ? row : prog.rows - 1, static_cast<int>(threadIdx.x % tpr)};

  float cur[CHUNKS][VEC];
  float slots[kSlotStorage<SLOTS>][CHUNKS][VEC];
  const Raw* in = static_cast<const Raw*>(prog.input) + ctx.row * prog.features;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int first = ctx.element(c, 0);
    if (prog.vector_io) {
      if (first < prog.features) load_vector<BYTES, VEC>(in + first, prog.storage, cur[c]);
      else
#pragma unroll
        for (int j = 0; j < VEC; ++j) cur[c][j] = 0.0f;
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) cur[c][j] = first + j < prog.features ? ctx.to_float(in[first + j]) : 0.0f;
    }
  }

  for (int pc = 0; pc < prog.num_instructions; ++pc) {
    const Instruction& ins = prog.code[pc];
    if (run_pointwise<CHUNKS, VEC, SLOTS>(ins, cur, slots, ctx)) continue;
    switch (ins.op) {
#define FXFUSE_AFFINE_CASE(name, F)       \
  case OP_##name:                         \
    run_feature_affine<F>(ctx, ins, cur); \
    break;
      FXFUSE_FEATURE_AFFINE_OPS(FXFUSE_AFFINE_CASE)
#undef FXFUSE_AFFINE_CASE
    FXFUSE_NORM_OPS(FXFUSE_OPCODE_CASE)
    FXFUSE_REDUCTION_OPS(FXFUSE_OPCODE_CASE)
      run_row_op(ctx, ins, cur, cross_warp, shared_rows);
      break;
      default:
        break;
    }
  }

  if (row >= prog.rows) return;
  if (prog.output_per_row) {
    if (ctx.lane == 0) static_cast<Raw*>(prog.output)[row] = Storage<BYTES>::from_float(cur[0][0], prog.storage);
    return;
  }
  Raw* out = static_cast<Raw*>(prog.output) + row * prog.features;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int first = ctx.element(c, 0);
    if (prog.vector_io) {
      if (first < prog.features) store_vector<BYTES, VEC>(out + first, prog.storage, cur[c]);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        if (first + j < prog.features) out[first + j] = Storage<BYTES>::from_float(cur[c][j], prog.storage);
    }
  }
}

// ================================================================ the broadcast tail kernel

// Each thread evaluates ELEMS consecutive outputs (ELEMS = VEC when the innermost dim is a multiple of it, so
// they never wrap a dim; else 1).
template <int BYTES, int ELEMS>
struct TailReader {
  using Raw = typename Storage<BYTES>::Raw;
  const TailProgram& prog;
  uint32_t offset[kMaxTailOperands];
  __device__ void load(int operand, int, float (&dst)[ELEMS]) const {
    uint32_t base = offset[0];
#pragma unroll
    for (int k = 1; k < kMaxTailOperands; ++k)
      if (operand == k) base = offset[k];  // compile-time indices keep offset[] in registers
    const Raw* p = static_cast<const Raw*>(prog.operands[operand].ptr) + base;
    const uint32_t inner = prog.operands[operand].strides[prog.ndim - 1];
#pragma unroll
    for (int j = 0; j < ELEMS; ++j) dst[j] = Storage<BYTES>::to_float(p[j * inner], prog.storage);
  }
};

template <int BYTES, int ELEMS>
__global__ void __launch_bounds__(256) broadcast_tail_kernel(const __grid_constant__ TailProgram prog) {
  using Raw = typename Storage<BYTES>::Raw;
  constexpr int VEC = 16 / BYTES;
  const uint32_t step = gridDim.x * blockDim.x * ELEMS;
  for (uint32_t first = (blockIdx.x * blockDim.x + threadIdx.x) * ELEMS; first < prog.numel; first += step) {
    TailReader<BYTES, ELEMS> reader{prog, {}};
    uint32_t rest = first;
    for (int d = prog.ndim - 1; d >= 0; --d) {
      const uint32_t coord = rest % prog.sizes[d];
      rest /= prog.sizes[d];
#pragma unroll
      for (int op = 0; op < kMaxTailOperands; ++op) reader.offset[op] += coord * prog.operands[op].strides[d];
    }
    float cur[1][ELEMS];
    float slots[kMaxSlots][1][ELEMS];
    reader.load(0, 0, cur[0]);
    for (int pc = 0; pc < prog.num_instructions; ++pc)
      run_pointwise<1, ELEMS, kMaxSlots>(prog.code[pc], cur, slots, reader);
    Raw* out = static_cast<Raw*>(prog.output) + first;
    if constexpr (ELEMS == VEC) {
      store_vector<BYTES, VEC>(out, prog.storage, cur[0]);
    } else {
      out[0] = Storage<BYTES>::from_float(cur[0][0], prog.storage);
    }
  }
}

#undef FXFUSE_OPCODE_CASE

// ================================================================ launchers (instantiated one per .cu)

template <int BYTES, int SLOTS>
void launch_row_program(const RowProgram& prog, const RowLaunch& launch, cudaStream_t stream) {
  const int64_t blocks = (prog.rows + launch.rows_per_block - 1) / launch.rows_per_block;
  const int threads = launch.rows_per_block * prog.threads_per_row;
  constexpr int short_chunks = kShortRowValues * BYTES / 16, long_chunks = 32 * BYTES / 16;
  if (launch.chunks == short_chunks) {
    row_program_kernel<BYTES, short_chunks, SLOTS>
        <<<static_cast<unsigned>(blocks), threads, launch.shared_bytes, stream>>>(prog);
  } else {
    row_program_kernel<BYTES, long_chunks, SLOTS>
        <<<static_cast<unsigned>(blocks), threads, launch.shared_bytes, stream>>>(prog);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int BYTES>
void launch_broadcast_tail(const TailProgram& prog, cudaStream_t stream) {
  constexpr int vec = 16 / BYTES;
  const bool vectorized = prog.sizes[prog.ndim - 1] % vec == 0;
  const int64_t per_thread = vectorized ? vec : 1;
  const int64_t threads = (prog.numel + per_thread - 1) / per_thread;
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((threads + 255) / 256, int64_t{sms} * 8));
  if (vectorized) broadcast_tail_kernel<BYTES, vec><<<blocks, 256, 0, stream>>>(prog);
  else broadcast_tail_kernel<BYTES, 1><<<blocks, 256, 0, stream>>>(prog);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fxfuse
