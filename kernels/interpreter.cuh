// The epilogue interpreter: the two kernels that run a compiled program (format: program_format.cuh), and
// their launcher templates.
//
//   row_program_kernel  one group of threads per row of the GEMM output; reads the row once into registers
//                       (fp32), runs the row phase of the program, writes the row (or one value per row) once.
//                       The grid is persistent: each block walks rows, and the next row is copied into shared
//                       memory (cp.async) while the current one computes. Built twice: lean, and general with
//                       the rare paths (needs_general_row_kernel in program_format.cuh says which a program needs).
//                       Programs without slots over per-feature params run on fast_row.cuh's kernel instead.
//   broadcast_tail_kernel  the pointwise instructions after a broadcast that outgrows the row (the min + bias
//                       example's (1, N, M, 1) output): one pass over the output, operands read by strides.
//                       A tail of one binary op (FXFUSE_TAIL_CHAINS) gets a build with its op compiled in: the
//                       min + bias example's tail takes 7.2 us in bf16 and 11.1 in fp32 that way, against 9.0
//                       and 12.6 interpreted (dev/NOTES.md, variants 57-64). It may launch while the row
//                       kernel runs, and waits for it on the GPU (launch_kernel).
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
#include <map>
#include <mutex>
#include <tuple>

#include "program_format.cuh"

namespace fxfuse {

// ================================================================ storage <-> fp32

// One storage type per kernel (declared in program_format.cuh): its raw element, and the conversions of a 16-byte
// vector of VEC elements to and from fp32. 16-bit vectors are split into 32-bit words with shifts and masks, so the
// load or store stays one 16-byte access.
struct Fp32Storage {
  using Raw = float;
  static constexpr int VEC = 4;
  __device__ static float to_float(Raw v) { return v; }
  __device__ static Raw from_float(float v) { return v; }
  __device__ static void unpack(const uint4& raw, float (&dst)[VEC]) {
    dst[0] = __uint_as_float(raw.x);
    dst[1] = __uint_as_float(raw.y);
    dst[2] = __uint_as_float(raw.z);
    dst[3] = __uint_as_float(raw.w);
  }
  __device__ static uint4 pack(const float (&src)[VEC]) {
    return {__float_as_uint(src[0]), __float_as_uint(src[1]), __float_as_uint(src[2]), __float_as_uint(src[3])};
  }
};

// Shared by bf16 and fp16: a word holds elements 2k (low half) and 2k + 1.
template <class Half>
struct HalfWords {
  static constexpr int VEC = 8;
  __device__ static void unpack(const uint4& raw, float (&dst)[VEC]) {
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      dst[2 * k] = Half::low_to_float(words[k]);
      dst[2 * k + 1] = Half::high_to_float(words[k]);
    }
  }
  __device__ static uint4 pack(const float (&src)[VEC]) {
    return {Half::pair(src[0], src[1]), Half::pair(src[2], src[3]), Half::pair(src[4], src[5]),
            Half::pair(src[6], src[7])};
  }
};

struct Bf16Storage : HalfWords<Bf16Storage> {
  using Raw = unsigned short;
  __device__ static float to_float(Raw v) { return __uint_as_float(static_cast<unsigned>(v) << 16); }
  __device__ static Raw from_float(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
  __device__ static float low_to_float(unsigned word) { return __uint_as_float(word << 16); }
  __device__ static float high_to_float(unsigned word) { return __uint_as_float(word & 0xffff0000u); }
  __device__ static unsigned pair(float low, float high) {
    unsigned word;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(word) : "f"(high), "f"(low));
    return word;
  }
};

struct Fp16Storage : HalfWords<Fp16Storage> {
  using Raw = unsigned short;
  __device__ static float to_float(Raw v) { return __half2float(__ushort_as_half(v)); }
  __device__ static Raw from_float(float v) { return __half_as_ushort(__float2half_rn(v)); }
  __device__ static float low_to_float(unsigned word) { return to_float(static_cast<Raw>(word & 0xffffu)); }
  __device__ static float high_to_float(unsigned word) { return to_float(static_cast<Raw>(word >> 16)); }
  __device__ static unsigned pair(float low, float high) {
    unsigned word;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(word) : "f"(high), "f"(low));
    return word;
  }
};

template <class S>
__device__ __forceinline__ void load_vector(const typename S::Raw* p, float (&dst)[S::VEC]) {
  S::unpack(*reinterpret_cast<const uint4*>(p), dst);
}

template <class S>
__device__ __forceinline__ void store_vector(typename S::Raw* p, const float (&src)[S::VEC]) {
  *reinterpret_cast<uint4*>(p) = S::pack(src);
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

// Every unary op on up to 16 values, inlined: the out-of-line version (one copy per width, called per chunk) ran
// 5-12% slower on an H200 (dev/NOTES.md, variant 07).
// ALL_UNARY_OPS false: the ops that call no libdevice function only (CallsLibm; the fast row kernel's light build).
template <int VEC, bool ALL_UNARY_OPS = true>
__device__ __forceinline__ Chunk<VEC> apply_unary(Chunk<VEC> x, uint8_t op, Attrs attrs) {
  switch (op) {
#define FXFUSE_UNARY_CASE(name, F)                                                         \
  case OP_##name:                                                                          \
    if constexpr (ALL_UNARY_OPS || !CallsLibm<F>::value)                                   \
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

// A unary instruction over all of a thread's values: one dispatch of the op for up to 16 values.
template <bool ALL_UNARY_OPS = true, int CHUNKS, int VEC>
__device__ __forceinline__ void run_unary(const Instruction& ins, Values<CHUNKS, VEC>& cur) {
  constexpr int kWidth = CHUNKS * VEC <= 16 ? CHUNKS * VEC : VEC;
  float* flat = &cur[0][0];
#pragma unroll
  for (int first = 0; first < CHUNKS * VEC; first += kWidth) {
    Chunk<kWidth> chunk;
#pragma unroll
    for (int j = 0; j < kWidth; ++j) chunk.v[j] = flat[first + j];
    chunk = apply_unary<kWidth, ALL_UNARY_OPS>(chunk, ins.op, ins.attrs);
#pragma unroll
    for (int j = 0; j < kWidth; ++j) flat[first + j] = chunk.v[j];
  }
}

// Runs one slot move, unary or binary instruction; returns false for the ops it does not know (row ops).
template <int CHUNKS, int VEC, int SLOTS, class Reader>
__device__ __forceinline__ bool run_pointwise(const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                              Values<CHUNKS, VEC> (&slots)[kSlotStorage<SLOTS>], const Reader& reader) {
  switch (ins.op) {
    case OP_SAVE:
    case OP_LOAD:
      move_slot<CHUNKS, VEC, SLOTS>(ins, cur, slots);
      return true;
    FXFUSE_UNARY_OPS(FXFUSE_OPCODE_CASE)
      run_unary(ins, cur);
      return true;
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



// An op's functor and family by opcode: the chain kernels (FXFUSE_ROW_CHAINS, FXFUSE_TAIL_CHAINS) compile each
// instruction's code from its opcode.
enum class OpFamily { Unary, Binary, Norm, Reduction };
template <int OP>
struct OpOf;
#define FXFUSE_OP_OF(name, F, FAMILY)          \
  template <>                                  \
  struct OpOf<OP_##name> {                     \
    using Functor = F;                         \
    static constexpr OpFamily family = FAMILY; \
  };
#define FXFUSE_UNARY_OP_OF(name, F) FXFUSE_OP_OF(name, F, OpFamily::Unary)
#define FXFUSE_BINARY_OP_OF(name, F) FXFUSE_OP_OF(name, F, OpFamily::Binary)
#define FXFUSE_NORM_OP_OF(name, F) FXFUSE_OP_OF(name, F, OpFamily::Norm)
#define FXFUSE_REDUCTION_OP_OF(name, F) FXFUSE_OP_OF(name, F, OpFamily::Reduction)
FXFUSE_UNARY_OPS(FXFUSE_UNARY_OP_OF)
FXFUSE_BINARY_OPS(FXFUSE_BINARY_OP_OF)
FXFUSE_NORM_OPS(FXFUSE_NORM_OP_OF)
FXFUSE_REDUCTION_OPS(FXFUSE_REDUCTION_OP_OF)
#undef FXFUSE_UNARY_OP_OF
#undef FXFUSE_BINARY_OP_OF
#undef FXFUSE_NORM_OP_OF
#undef FXFUSE_REDUCTION_OP_OF
#undef FXFUSE_OP_OF

// A unary op known at compile time, over all of a thread's values.
template <class F, int CHUNKS, int VEC>
__device__ __forceinline__ void apply_unary_op(Values<CHUNKS, VEC>& cur, const Attrs& attrs) {
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
    for (int j = 0; j < VEC; ++j) cur[c][j] = F::apply(cur[c][j], attrs);
}

// ================================================================ reductions over groups of a row

// A reducer combines two partials; apply is symmetric to the bit, so that both lanes of a butterfly step end with
// the same bits (deterministic for any group size).
struct SumOp {
  using Value = float;
  __device__ static float identity() { return 0.0f; }
  __device__ static float apply(float a, float b) { return a + b; }
};
struct MaxOp {
  using Value = float;
  __device__ static float identity() { return -INFINITY; }
  __device__ static float apply(float a, float b) { return maximum(a, b); }
};
struct MinOp {
  using Value = float;
  __device__ static float identity() { return INFINITY; }
  __device__ static float apply(float a, float b) { return minimum(a, b); }
};

__device__ __forceinline__ float shuffle_xor(float v, int offset) { return __shfl_xor_sync(0xffffffffu, v, offset); }

// Where a row's threads meet: 32 warps per block at most, one partial per chunk each.
template <int CHUNKS>
struct CrossWarp {
  float partial[32][CHUNKS];
};

// Combines v[k] over lanes_per_group consecutive lanes (a power of 2): xor butterflies within a warp, then the
// same over the group's warps' partials, read from shared memory (each lane takes partial lane % warps_per_group).
// Both lanes of a butterfly step combine the same two numbers, so every lane of a group ends with the same bits.
// WHOLE_WARPS: groups of whole warps (whole rows), whose steps within a warp are unrolled (the min + bias row
// kernel: 0.3-0.5 us less, variant 61).
template <class R, bool WHOLE_WARPS = false, int K, int CHUNKS>
__device__ __forceinline__ void lanes_allreduce(typename R::Value (&v)[K], int lanes_per_group,
                                                CrossWarp<CHUNKS>& cross_warp) {
  static_assert(K <= CHUNKS, "one cross-warp column per value");
  using Value = typename R::Value;
  const auto butterfly_step = [&](int offset) {
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = R::apply(v[k], shuffle_xor(v[k], offset));
  };
  if constexpr (WHOLE_WARPS) {
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) butterfly_step(offset);
  } else {
    const int warp_span = lanes_per_group < 32 ? lanes_per_group : 32;
    for (int offset = 1; offset < warp_span; offset <<= 1) butterfly_step(offset);
  }
  if (lanes_per_group > 32) {
    const int warp = threadIdx.x / 32;
    const int warps_per_group = lanes_per_group / 32;
    if (threadIdx.x % 32 == 0)
#pragma unroll
      for (int k = 0; k < K; ++k) cross_warp.partial[warp][k] = v[k];
    __syncthreads();
    const int partial = (warp & ~(warps_per_group - 1)) | (threadIdx.x & (warps_per_group - 1));  // powers of 2
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = cross_warp.partial[partial][k];
    for (int offset = 1; offset < warps_per_group; offset <<= 1) butterfly_step(offset);
    __syncthreads();
  }
}

// part[c] holds this thread's partial of chunk c; on return it holds the total of chunk c's group.
template <class R, int CHUNKS>
__device__ __forceinline__ void group_allreduce(typename R::Value (&part)[CHUNKS], int chunks_per_group,
                                                int lanes_per_group, CrossWarp<CHUNKS>& cross_warp) {
  using Value = typename R::Value;
  if (chunks_per_group >= CHUNKS) {  // all of this thread's chunks in one group (whole-row statistics)
    Value total[1] = {part[0]};
#pragma unroll
    for (int c = 1; c < CHUNKS; ++c) total[0] = R::apply(total[0], part[c]);
    lanes_allreduce<R, true>(total, lanes_per_group, cross_warp);  // a row spans whole warps (TPR >= 32)
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) part[c] = total[0];
    return;
  }
  if (chunks_per_group > 1) {
    Value combined[CHUNKS];
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

// The row kernel's dynamic shared memory, in 16-byte vectors: the GROUP_SHARED rows (as floats), the staged
// params, then the staging slots of the next row (offsets in RowProgram and RowParam, set by the launcher).
extern __shared__ uint4 row_shared[];

template <class S, int CHUNKS, bool GENERAL>
struct RowContext {
  static constexpr int VEC = S::VEC;
  static constexpr bool general = GENERAL;  // compiled with the rare paths (launch_row_program)
  using Raw = typename S::Raw;
  const RowProgram& prog;
  int64_t row;  // clamped to the last row for the idle rows of the last block, which compute and never store
  int lane;     // thread index within the row

  __device__ int element(int c, int j) const { return (c * prog.threads_per_row + lane) * VEC + j; }
  // Valid elements of chunk c: VEC or 0 on the vector path (features % VEC == 0), anything between otherwise.
  __device__ int chunk_count(int c) const { return min(max(prog.features - element(c, 0), 0), VEC); }
  __device__ bool valid(int c, int j) const { return element(c, j) < prog.features; }

  // The param reader of the row phase: one shared-memory vector for a staged param. Otherwise, on the vector
  // path, a chunk past the row's end reads the row's first chunk instead of branching to a fill: its values are
  // never stored, and reductions mask them.
  __device__ void load(int param, int c, float (&dst)[VEC]) const {
    const RowParam& p = prog.params[param];
    if (p.shared_index >= 0) {
      S::unpack(row_shared[p.shared_index + c * prog.threads_per_row + lane], dst);
      return;
    }
    const Raw* base = static_cast<const Raw*>(p.ptr) + row * p.row_stride;
    const int first = element(c, 0);
    if (p.vector_loads) {
      load_vector<S>(base + (first < prog.features ? first : 0), dst);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        dst[j] = first + j < prog.features ? S::to_float(base[(first + j) * p.feature_stride]) : 0.0f;
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

// Folds f(chunk, value) over each chunk's valid elements with R; the mask is tested once per chunk where the
// whole chunk is valid (always, on the vector path).
template <class R, typename Ctx, int CHUNKS, int VEC, class F>
__device__ __forceinline__ void chunk_fold(const Ctx& ctx, const Values<CHUNKS, VEC>& cur, float (&part)[CHUNKS], F f) {
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int count = ctx.chunk_count(c);
    if (count == VEC) {  // a tree: log2(VEC) dependent steps instead of VEC
      float terms[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) terms[j] = f(c, cur[c][j]);
#pragma unroll
      for (int width = VEC / 2; width > 0; width /= 2)
#pragma unroll
        for (int j = 0; j < width; ++j) terms[j] = R::apply(terms[j], terms[j + width]);
      part[c] = terms[0];
    } else {
      float acc = R::identity();
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        if (j < count) acc = R::apply(acc, f(c, cur[c][j]));
      part[c] = acc;
    }
  }
}

template <typename Ctx, int CHUNKS, int VEC, class F>
__device__ __forceinline__ void chunk_sums(const Ctx& ctx, const Values<CHUNKS, VEC>& cur, float (&part)[CHUNKS], F f) {
  chunk_fold<SumOp>(ctx, cur, part, f);
}

template <class R, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void chunk_extrema(const Ctx& ctx, const Values<CHUNKS, VEC>& cur, float (&part)[CHUNKS]) {
  chunk_fold<R>(ctx, cur, part, [](int, float v) { return v; });
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

// Centers each value of a chunk on its group's mean, in place, and gives each value its group's rstd, for groups of
// SIZE consecutive values inside the chunk. Butterflies over the chunk's values in registers, in place: each pair's
// sum is stored in both, so a group's values end with the same bits.
template <int SIZE, int VEC>
__device__ __forceinline__ void center_groups_of(float (&x)[VEC], float eps, float (&rstd)[VEC]) {
  const auto group_sums = [](float (&v)[VEC]) {
#pragma unroll
    for (int width = 1; width < SIZE; width *= 2)
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        if ((j & width) == 0) v[j] = v[j | width] = v[j] + v[j | width];
  };
  constexpr float kInvSize = 1.0f / SIZE;
#pragma unroll
  for (int j = 0; j < VEC; ++j) rstd[j] = x[j];
  group_sums(rstd);
#pragma unroll
  for (int j = 0; j < VEC; ++j) x[j] -= rstd[j] * kInvSize, rstd[j] = x[j] * x[j];
  group_sums(rstd);
#pragma unroll
  for (int j = 0; j < VEC; ++j) rstd[j] = rsqrtf(rstd[j] * kInvSize + eps);
}

// The same for the group size of GROUP_IN_VECTOR mode: a power of 2 below VEC (1 or 2; 4 in 16-bit storage), one
// build each, so that the butterflies have no runtime selects.
template <int VEC>
__device__ __forceinline__ void center_groups_in_vector(float (&x)[VEC], int size, float eps, float (&rstd)[VEC]) {
  if (size == 1) center_groups_of<1>(x, eps, rstd);
  else if (VEC == 4 || size == 2) center_groups_of<2>(x, eps, rstd);
  else center_groups_of<4>(x, eps, rstd);
}

#define FXFUSE_STATISTIC_CASE(name, F) \
  case OP_##name:                      \
    return F::statistic;
__host__ __device__ constexpr Statistic statistic_of(uint8_t op) {
  switch (op) {
    FXFUSE_NORM_OPS(FXFUSE_STATISTIC_CASE)
    FXFUSE_REDUCTION_OPS(FXFUSE_STATISTIC_CASE)
    default:
      return Statistic::Sum;
  }
}
#undef FXFUSE_STATISTIC_CASE

// (s0, s1) of each chunk's group for the statistic S. MeanAndRstd in GROUP_SHARED mode normalizes cur in place
// instead and returns (0, 1). MeanAndRstd's code also gives CenteredSquares, and RootMeanSquare's RootSumSquare
// (run_statistic): the same passes, finished by the instruction's own statistic, one copy of the code in each kernel.
template <Statistic S, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void compute_statistic(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                                  float (&s0)[CHUNKS], float (&s1)[CHUNKS],
                                                  CrossWarp<CHUNKS>& cross_warp, float* shared_rows) {
  if constexpr (S == Statistic::CenteredSquares) {
    compute_statistic<Statistic::MeanAndRstd>(ctx, ins, cur, s0, s1, cross_warp, shared_rows);
    return;
  } else if constexpr (S == Statistic::RootSumSquare) {
    compute_statistic<Statistic::RootMeanSquare>(ctx, ins, cur, s0, s1, cross_warp, shared_rows);
    return;
  }
  const int cpg = ins.chunks_per_group;
  const int lpg = ins.lanes_per_group;
  if constexpr (S == Statistic::MeanAndRstd) {
    if constexpr (Ctx::general) {
      if (ins.group_mode == GROUP_SHARED) {
        normalize_groups_in_shared(ctx, ins, cur, shared_rows);
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) s0[c] = 0.0f, s1[c] = 1.0f;
        return;
      }
    }
    const float inv_size = 1.0f / ins.group_size;
    chunk_sums(ctx, cur, s0, [](int, float v) { return v; });
    group_allreduce<SumOp>(s0, cpg, lpg, cross_warp);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) s0[c] *= inv_size;
    chunk_sums(ctx, cur, s1, [&](int c, float v) { return (v - s0[c]) * (v - s0[c]); });
    group_allreduce<SumOp>(s1, cpg, lpg, cross_warp);
    if (statistic_of(ins.op) == Statistic::CenteredSquares) return;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) s1[c] = rsqrtf(s1[c] * inv_size + ins.attrs.a0);
  } else if constexpr (S == Statistic::RootMeanSquare) {
    chunk_sums(ctx, cur, s1, [](int, float v) { return v * v; });
    group_allreduce<SumOp>(s1, cpg, lpg, cross_warp);
    const float inv_size = 1.0f / ins.group_size;
    const bool root_sum = statistic_of(ins.op) == Statistic::RootSumSquare;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      s0[c] = root_sum ? sqrtf(s1[c]) : 0.0f;
      s1[c] = root_sum ? maximum(s0[c], ins.attrs.a0) : rsqrtf(s1[c] * inv_size + ins.attrs.a0);
    }
  } else if constexpr (S == Statistic::MaxAndLogSumExp) {
    chunk_extrema<MaxOp>(ctx, cur, s0);
    group_allreduce<MaxOp>(s0, cpg, lpg, cross_warp);
    if (ins.op == OP_logsumexp)  // torch.logsumexp's rule; softmax of a row with an inf is NaN, as torch's
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

// One copy of each statistic's code per kernel, whichever op asks for it.
template <typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void run_statistic(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                              float (&s0)[CHUNKS], float (&s1)[CHUNKS], CrossWarp<CHUNKS>& cross_warp,
                                              float* shared_rows) {
  switch (statistic_of(ins.op)) {
    case Statistic::MeanAndRstd:
    case Statistic::CenteredSquares:
      return compute_statistic<Statistic::MeanAndRstd>(ctx, ins, cur, s0, s1, cross_warp, shared_rows);
    case Statistic::RootMeanSquare:
    case Statistic::RootSumSquare:
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

// A norm's per-element apply. The affine case (weight and bias both given, as nn.GroupNorm and nn.LayerNorm
// have) is compiled without the None fallbacks, which the compiler would otherwise fill speculatively for every
// chunk.
template <bool AFFINE, class F, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void apply_norm_chunks(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                                  const float (&s0)[CHUNKS], const float (&s1)[CHUNKS]) {
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    float w[VEC], b[VEC];
    if constexpr (AFFINE) {
      ctx.load(ins.param[0], c, w);
      ctx.load(ins.param[1], c, b);
    } else {
      ctx.load_feature_param(ins.param[0], c, 1.0f, w);
      ctx.load_feature_param(ins.param[1], c, 0.0f, b);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) cur[c][j] = F::apply(cur[c][j], s0[c], s1[c], w[j], b[j]);
  }
}

template <class F, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void apply_norm(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                           const float (&s0)[CHUNKS], const float (&s1)[CHUNKS]) {
  if (ins.param[0] >= 0 && ins.param[1] >= 0) apply_norm_chunks<true, F>(ctx, ins, cur, s0, s1);
  else apply_norm_chunks<false, F>(ctx, ins, cur, s0, s1);
}

// A row reduction's per-row result from its statistic.
__device__ __forceinline__ float reduction_result(const Instruction& ins, float s0, float s1, int features) {
  switch (ins.op) {
#define FXFUSE_RESULT_CASE(name, F) \
  case OP_##name:                   \
    return F::result(s0, s1, features, ins.attrs);
    FXFUSE_REDUCTION_OPS(FXFUSE_RESULT_CASE)
#undef FXFUSE_RESULT_CASE
    default:
      return 0.0f;
  }
}

template <int CHUNKS, int VEC>
__device__ __forceinline__ void fill_with_result(Values<CHUNKS, VEC>& cur, float result) {
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
    for (int j = 0; j < VEC; ++j) cur[c][j] = result;
}

// A norm's per-element apply, or a row reduction's per-row result in every element (so later pointwise ops
// broadcast it for free), from the statistic (s0, s1) of each chunk's group.
template <typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void apply_row_op(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                             const float (&s0)[CHUNKS], const float (&s1)[CHUNKS]) {
  switch (ins.op) {
#define FXFUSE_NORM_APPLY_CASE(name, F)                 \
  case OP_##name:                                       \
    apply_norm<F>(ctx, ins, cur, s0, s1);               \
    return;
    FXFUSE_NORM_OPS(FXFUSE_NORM_APPLY_CASE)
#undef FXFUSE_NORM_APPLY_CASE
    default:
      fill_with_result(cur, reduction_result(ins, s0[0], s1[0], ctx.prog.features));
  }
}

// A norm or a row reduction: its statistic (one copy of each statistic's code per kernel), then its apply. Groups
// inside a chunk (group_norm's, GROUP_IN_VECTOR) are normalized in place, and the apply takes (0, 1), as in
// GROUP_SHARED mode.
template <typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void run_row_op(const Ctx& ctx, const Instruction& ins, Values<CHUNKS, VEC>& cur,
                                           CrossWarp<CHUNKS>& cross_warp, float* shared_rows) {
  float s0[CHUNKS], s1[CHUNKS];
  if (ins.group_mode == GROUP_IN_VECTOR) {
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      float rstd[VEC];
      center_groups_in_vector(cur[c], ins.group_size, ins.attrs.a0, rstd);
#pragma unroll
      for (int j = 0; j < VEC; ++j) cur[c][j] *= rstd[j];
      s0[c] = 0.0f, s1[c] = 1.0f;
    }
  } else {
    run_statistic(ctx, ins, cur, s0, s1, cross_warp, shared_rows);
  }
  apply_row_op(ctx, ins, cur, s0, s1);
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

// ---------------------------------------------------------------- staging the next row in shared memory

// A 16-byte copy from global to shared memory that completes in the background (cp.async, sm_80 and later).
__device__ __forceinline__ void copy_async_16(unsigned shared_address, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address), "l"(global));
}
__device__ __forceinline__ unsigned shared_address_of(const void* shared) {
  return static_cast<unsigned>(__cvta_generic_to_shared(shared));
}
__device__ __forceinline__ void commit_async_copies() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void wait_async_copies() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Programmatic dependent launch (sm_90; no-ops elsewhere and where the launch did not ask for it, launch_kernel):
// the next kernel on the stream may start now, and must itself wait before it touches this kernel's output ...
__device__ __forceinline__ void allow_next_kernel_to_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}
// ... and a kernel launched early waits here until the previous kernel has finished and its writes are visible.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Starts copying this thread's chunks of a row (`in`: its first element) into its own staging slots (slot c of
// thread t at c * blockDim.x + t: a warp's 16-byte accesses are contiguous). Only the thread that copies a slot
// reads it, so waiting for its own copies is all the synchronization the staging needs. WHOLE_ROWS: every chunk
// is inside the row (the fast kernel's build for rows of TPR * kRowValues), no bounds test.
template <class S, int CHUNKS, bool WHOLE_ROWS = false>
__device__ __forceinline__ void stage_chunks(const RowProgram& prog, const typename S::Raw* in, int lane,
                                             uint4* staging) {
  constexpr int VEC = S::VEC;
  const unsigned slot = shared_address_of(staging + threadIdx.x);
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int first = (c * prog.threads_per_row + lane) * VEC;
    if (WHOLE_ROWS || first < prog.features) copy_async_16(slot + c * blockDim.x * 16, in + first);
  }
}

template <class S, int CHUNKS, bool WHOLE_ROWS = false>
__device__ __forceinline__ void stage_row(const RowProgram& prog, int64_t row, int lane, uint4* staging) {
  const typename S::Raw* in = static_cast<const typename S::Raw*>(prog.input) + row * prog.features;
  stage_chunks<S, CHUNKS, WHOLE_ROWS>(prog, in, lane, staging);
  commit_async_copies();
}

// Reads this thread's staged chunks back (zeros for chunks past the row's end).
template <class S, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void unstage_chunks(const Ctx& ctx, const uint4* staging, Values<CHUNKS, VEC>& dst) {
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    if (ctx.chunk_count(c) > 0) S::unpack(staging[c * blockDim.x + threadIdx.x], dst[c]);
    else
#pragma unroll
      for (int j = 0; j < VEC; ++j) dst[c][j] = 0.0f;
  }
}

// Starts copying each param the launcher staged (its shared_index >= 0) into shared memory, once per block, in
// the storage type, padded to CHUNKS * TPR vectors so that every chunk's read stays in bounds. Contiguous params
// of whole vectors go by cp.async, the rest element by element. The caller waits and syncs the block before the
// row phase reads them, with one shared load per param chunk.
template <class S>
__device__ __forceinline__ void stage_params(const RowProgram& prog) {
  using Raw = typename S::Raw;
  constexpr int VEC = S::VEC;
  const int padded = kRowValues * prog.threads_per_row;  // CHUNKS * TPR * VEC elements
  for (int k = 0; k < kMaxParams; ++k) {
    const RowParam& p = prog.params[k];
    if (p.shared_index < 0) continue;
    uint4* copy = row_shared + p.shared_index;
    const Raw* source = static_cast<const Raw*>(p.ptr);
    if (p.vector_loads) {
      const unsigned copy_address = shared_address_of(copy);
      for (int v = threadIdx.x; v < padded / VEC; v += blockDim.x) {
        if (v * VEC < prog.features) copy_async_16(copy_address + v * 16, source + v * VEC);
        else copy[v] = uint4{0, 0, 0, 0};
      }
    } else {
      Raw* elements = reinterpret_cast<Raw*>(copy);
      for (int i = threadIdx.x; i < padded; i += blockDim.x)
        elements[i] = i < prog.features ? source[i * p.feature_stride] : Raw{};
    }
  }
  commit_async_copies();
}

// Block: (blockDim.x / TPR) rows of TPR threads, kRowValues values per thread. The grid is persistent (as many
// blocks as fit on the GPU at once); each block takes every gridDim.x-th group of rows, and on the vector path
// the next group's row is copied into shared memory while the current one computes.
template <class S, int SLOTS, bool GENERAL>
__global__ void __launch_bounds__(kMaxRowThreads, 1) row_program_kernel(const __grid_constant__ RowProgram prog) {
  constexpr int VEC = S::VEC;
  constexpr int CHUNKS = kRowValues / VEC;
  using Ctx = RowContext<S, CHUNKS, GENERAL>;
  const bool vector_io = !GENERAL || prog.vector_io;  // the lean kernel runs vector rows only
  using Raw = typename Ctx::Raw;
  __shared__ CrossWarp<CHUNKS> cross_warp;
  float* shared_rows = reinterpret_cast<float*>(row_shared);
  uint4* staging = row_shared + prog.staging_vector;

  // TPR is a power of 2: masks and shifts, not the ~20-instruction integer division the compiler re-derived
  // wherever the lane was needed (3% of the executed instructions, ncu).
  const int tpr_shift = __popc(prog.threads_per_row - 1);
  const int lane = threadIdx.x & (prog.threads_per_row - 1);
  const int rows_per_block = blockDim.x >> tpr_shift;
  const int64_t row_groups = prog.row_groups;
  const auto clamped_row = [&](int64_t group) {
    const int64_t row = group * rows_per_block + (threadIdx.x >> tpr_shift);
    return row < prog.rows ? row : prog.rows - 1;
  };

  stage_params<S>(prog);
  if (vector_io && blockIdx.x < row_groups) stage_row<S, CHUNKS>(prog, clamped_row(blockIdx.x), lane, staging);
  wait_async_copies();
  __syncthreads();  // every thread's param copies are in

  for (int64_t group = blockIdx.x; group < row_groups; group += gridDim.x) {
    const int64_t row = group * rows_per_block + (threadIdx.x >> tpr_shift);
    const Ctx ctx{prog, clamped_row(group), lane};
    float cur[CHUNKS][VEC];
    float slots[kSlotStorage<SLOTS>][CHUNKS][VEC];
    if (vector_io) {
      wait_async_copies();
      unstage_chunks<S>(ctx, staging, cur);
      if (group + gridDim.x < row_groups) stage_row<S, CHUNKS>(prog, clamped_row(group + gridDim.x), lane, staging);
    } else {
      const Raw* in = static_cast<const Raw*>(prog.input) + ctx.row * prog.features;
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) cur[c][j] = ctx.valid(c, j) ? S::to_float(in[ctx.element(c, j)]) : 0.0f;
    }

    for (int pc = 0; pc < prog.num_instructions; ++pc) {
      const Instruction& ins = prog.code[pc];
      if (run_pointwise<CHUNKS, VEC, SLOTS>(ins, cur, slots, ctx)) continue;
      switch (ins.op) {
#define FXFUSE_AFFINE_CASE(name, F)                                 \
  case OP_##name:                                                   \
    if constexpr (GENERAL) run_feature_affine<F>(ctx, ins, cur);    \
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

    if (row >= prog.rows) continue;
    if (prog.output_per_row) {
      if (lane == 0) static_cast<Raw*>(prog.output)[row] = S::from_float(cur[0][0]);
      continue;
    }
    Raw* out = static_cast<Raw*>(prog.output) + row * prog.features;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      if (vector_io) {
        if (ctx.chunk_count(c) > 0) store_vector<S>(out + ctx.element(c, 0), cur[c]);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          if (ctx.valid(c, j)) out[ctx.element(c, j)] = S::from_float(cur[c][j]);
      }
    }
  }
}

// ================================================================ the broadcast tail kernel

// The operand reader of the tail: chunk `run` of a lane is its run-th run of ELEMS outputs, 32 * ELEMS outputs
// after the previous one. An operand is read with one 16-byte load where it is contiguous along a run, with one
// load where it is broadcast along it (stride 0), else element by element.
template <class S, int ELEMS>
struct TailReader {
  using Raw = typename S::Raw;
  static constexpr int VEC = S::VEC;
  const TailProgram& prog;
  uint32_t offset[kMaxTailOperands];  // of the lane's first run
  __device__ void load(int operand, int run, float (&dst)[ELEMS]) const {
    uint32_t base = offset[0];
#pragma unroll
    for (int k = 1; k < kMaxTailOperands; ++k)
      if (operand == k) base = offset[k];  // compile-time indices keep offset[] in registers
    const TailOperand& source = prog.operands[operand];
    const uint32_t inner = source.strides[prog.ndim - 1];
    const Raw* p = static_cast<const Raw*>(source.ptr) + base + run * 32 * ELEMS * inner;
    if constexpr (ELEMS == VEC) {
      if (source.vector_loads) {
        load_vector<S>(p, dst);
        return;
      }
    }
    if (inner == 0) {
      const float value = S::to_float(p[0]);
#pragma unroll
      for (int j = 0; j < ELEMS; ++j) dst[j] = value;
      return;
    }
#pragma unroll
    for (int j = 0; j < ELEMS; ++j) dst[j] = S::to_float(p[j * inner]);
  }
  // The same where the launcher knows the operand's kind: one 16-byte load (contiguous along the run), or one
  // element for the whole run (BROADCAST: stride 0 along it). No branch, one path.
  template <bool BROADCAST>
  __device__ void load_known(int operand, int run, float (&dst)[ELEMS]) const {
    static_assert(ELEMS == VEC, "16-byte runs only");
    uint32_t base = offset[0];
#pragma unroll
    for (int k = 1; k < kMaxTailOperands; ++k)
      if (operand == k) base = offset[k];
    const Raw* p = static_cast<const Raw*>(prog.operands[operand].ptr) + base;
    if constexpr (BROADCAST) {
      const float value = S::to_float(p[0]);
#pragma unroll
      for (int j = 0; j < ELEMS; ++j) dst[j] = value;
    } else {
      load_vector<S>(p + run * 32 * ELEMS, dst);
    }
  }
  // Operand `operand`'s run as LOADS says (TailLoads), or by its runtime kind.
  template <int LOADS>
  __device__ void load_as(int operand, int run, float (&dst)[ELEMS]) const {
    if constexpr (LOADS == TAIL_LOADS_ANY) {
      load(operand, run, dst);
    } else {
      // ROW_BROADCAST: the row result (operand 0) is the broadcast one; ROW_VECTOR: the param is.
      const bool broadcast = (operand == 0) == (LOADS == TAIL_LOADS_ROW_BROADCAST);
      if (broadcast) load_known<true>(operand, run, dst);
      else load_known<false>(operand, run, dst);
    }
  }
};

// A binary op of the current value and a param (the tail chains' instruction; the launcher checks `other`), the
// operand order resolved once rather than per value.
template <Opcode OP, int LOADS, int UNITS, int ELEMS, class Reader>
__device__ __forceinline__ void run_param_op(const Instruction& ins, float (&cur)[UNITS][ELEMS], const Reader& reader) {
  using F = typename OpOf<OP>::Functor;
  static_assert(OpOf<OP>::family == OpFamily::Binary, "tail chains are binary ops with a param");
  float param[UNITS][ELEMS];
#pragma unroll
  for (int run = 0; run < UNITS; ++run) reader.template load_as<LOADS>(ins.param[0], run, param[run]);
  if (ins.reversed) {
#pragma unroll
    for (int run = 0; run < UNITS; ++run)
#pragma unroll
      for (int j = 0; j < ELEMS; ++j) cur[run][j] = F::apply(param[run][j], cur[run][j]);
  } else {
#pragma unroll
    for (int run = 0; run < UNITS; ++run)
#pragma unroll
      for (int j = 0; j < ELEMS; ++j) cur[run][j] = F::apply(cur[run][j], param[run][j]);
  }
}

// Each warp evaluates 32 * UNITS runs of ELEMS consecutive outputs, contiguous: run u of lane l starts at
// (u * 32 + l) * ELEMS from the warp's first output, so every store instruction of the warp covers 32 * ELEMS
// contiguous outputs; the launcher's grid has a warp for every such span (one pass over the output: variant 87).
// A lane computes its index once, loads its UNITS runs together and interprets the program once over all of them.
// Runs never wrap a dim: the launcher checks that the innermost size is a multiple of 32 * ELEMS * UNITS (of ELEMS
// where UNITS is 1).
// CHAIN: the program's opcodes where it is a chain of FXFUSE_TAIL_CHAINS, compiled whole; empty: interpreted.
// LOADS (TailLoads): how a chain's two operands vary along a run where the launcher knows it, so that each load
// has one path instead of three (the min + bias tail: 7.2 -> 6.7 us bf16, 11.0 -> 10.7 fp32, variant 69).
template <class S, int ELEMS, int UNITS, int LOADS = TAIL_LOADS_ANY, Opcode... CHAIN>
__global__ void __launch_bounds__(256) broadcast_tail_kernel(const __grid_constant__ TailProgram prog) {
  using Raw = typename S::Raw;
  constexpr int WARP_SPAN = 32 * ELEMS * UNITS;
  const uint32_t warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const uint32_t first = warp * WARP_SPAN + threadIdx.x % 32 * ELEMS;  // < numel + 256 * ELEMS * UNITS < 2^32
  wait_for_previous_kernel();  // launched early (launch_kernel): the row phase's results are not there before
  if (first >= prog.numel) return;
  TailReader<S, ELEMS> reader{prog, {}};
  uint32_t rest = first;
  for (int d = prog.ndim - 1; d >= 0; --d) {
    const uint32_t outer = d > 0 ? prog.divisors[d].divide(rest) : 0;  // rest < sizes[0]: no division
    const uint32_t coord = rest - outer * prog.sizes[d];
    rest = outer;
#pragma unroll
    for (int op = 0; op < kMaxTailOperands; ++op)
      if (op < prog.num_operands) reader.offset[op] += coord * prog.operands[op].strides[d];
  }
  float cur[UNITS][ELEMS];
  float slots[kMaxSlots][UNITS][ELEMS];
#pragma unroll
  for (int run = 0; run < UNITS; ++run) reader.template load_as<LOADS>(0, run, cur[run]);
  if constexpr (sizeof...(CHAIN) == 0) {
    for (int pc = 0; pc < prog.num_instructions; ++pc)
      run_pointwise<UNITS, ELEMS, kMaxSlots>(prog.code[pc], cur, slots, reader);
  } else {
    int pc = 0;
    (run_param_op<CHAIN, LOADS>(prog.code[pc++], cur, reader), ...);
  }
#pragma unroll
  for (int run = 0; run < UNITS; ++run) {
    Raw* out = static_cast<Raw*>(prog.output) + first + run * 32 * ELEMS;
    if constexpr (ELEMS == S::VEC) {
      store_vector<S>(out, cur[run]);
    } else {
      out[0] = S::from_float(cur[run][0]);
    }
  }
}

#undef FXFUSE_OPCODE_CASE

// ================================================================ launchers (declared in program_format.cuh,
// instantiated in the .cu files)

// The persistent grid of a row kernel: as many blocks as fit on the device at once (none where a block of it cannot
// have `shared_bytes` on this device), and the shared memory each block can take on top of `shared_bytes` without
// lowering that count (for staged params). Computed once per kernel, device, block size and shared memory size.
struct RowGrid {
  int64_t blocks;
  int64_t spare_shared_bytes;
};

// kernel<<<blocks, threads, shared_bytes, stream>>>(args...), checked; with `early` (sm_90 and later), as a
// programmatic dependent launch: the kernel starts while the stream's previous kernel finishes instead of after a
// launch gap, and must wait for it (wait_for_previous_kernel) before touching its output. The host decides
// (epilogue_launches_early, gemm_epilogue.cpp).
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), unsigned blocks, int threads, int64_t shared_bytes, bool early,
                   cudaStream_t stream, const Args&... args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = early;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = static_cast<size_t>(shared_bytes);
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
}

template <class Kernel>
RowGrid row_grid(Kernel kernel, int threads, int64_t shared_bytes) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, int64_t>, RowGrid> cache;  // all row kernels share one type
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), device, threads, shared_bytes);
  const auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  int sms = 0, per_block_optin = 0, per_sm = 0, reserved_per_block = 0, blocks_per_sm = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&per_block_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&reserved_per_block, cudaDevAttrReservedSharedMemoryPerBlock, device));
  cudaFuncAttributes attributes;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  const int64_t dynamic_max = per_block_optin - static_cast<int64_t>(attributes.sharedSizeBytes);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dynamic_max)));
  if (shared_bytes > dynamic_max) return cache[key] = RowGrid{0, 0};
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, threads, shared_bytes));
  blocks_per_sm = std::max(blocks_per_sm, 1);
  const int64_t per_block = per_sm / blocks_per_sm - reserved_per_block - static_cast<int64_t>(attributes.sharedSizeBytes);
  const int64_t spare = std::max<int64_t>(std::min(dynamic_max, per_block) - shared_bytes, 0);
  return cache[key] = RowGrid{int64_t{sms} * blocks_per_sm, spare};
}

// Stages every param that is the same for all rows (row_stride 0) in shared memory, in param order, while the
// grid's spare shared memory lasts; the rest are read from global memory.
template <class S, int SLOTS, bool GENERAL>
bool launch_row_program(const RowProgram& prog, const RowLaunch& launch, cudaStream_t stream) {
  const auto kernel = row_program_kernel<S, SLOTS, GENERAL>;
  const int threads = launch.rows_per_block * prog.threads_per_row;
  const int64_t row_groups = (prog.rows + launch.rows_per_block - 1) / launch.rows_per_block;
  const int64_t staging_bytes = prog.vector_io ? int64_t{threads} * kRowValues * sizeof(typename S::Raw) : 0;
  const int64_t shared_bytes = (launch.shared_bytes + 15) / 16 * 16 + staging_bytes;
  const RowGrid grid = row_grid(kernel, threads, shared_bytes);
  if (grid.blocks == 0) return false;

  RowProgram staged = prog;
  staged.row_groups = row_groups;
  const int param_vectors = kRowValues / S::VEC * prog.threads_per_row;  // CHUNKS * TPR
  const int group_vectors = static_cast<int>((launch.shared_bytes + 15) / 16);
  int64_t spare = grid.spare_shared_bytes;
  staged.staging_vector = group_vectors;
  for (RowParam& param : staged.params) {
    param.shared_index = -1;
    if (param.ptr == nullptr || param.row_stride != 0 || spare < param_vectors * 16) continue;
    param.shared_index = staged.staging_vector;
    staged.staging_vector += param_vectors;
    spare -= param_vectors * 16;
  }
  const int64_t staged_bytes = int64_t{staged.staging_vector - group_vectors} * 16;
  const unsigned blocks = static_cast<unsigned>(std::min(row_groups, grid.blocks));
  kernel<<<blocks, threads, shared_bytes + staged_bytes, stream>>>(staged);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

using TailKernel = void (*)(TailProgram);
// 16-byte runs a thread of the tail chains: 0.3-0.4 us faster than 4 (62); one run: bf16 7.2 -> 8.7 us (66).
constexpr int kTailChainRuns = 2;

// The build of kTailChainRuns runs a thread and operand loads LOADS compiled for this program's chain of
// FXFUSE_TAIL_CHAINS, or nullptr.
template <class S, int LOADS>
TailKernel find_tail_chain(const TailProgram& prog) {
#define FXFUSE_TAIL_CHAIN_ENTRY(...) \
  chain_entry<TailKernel, __VA_ARGS__>(broadcast_tail_kernel<S, S::VEC, kTailChainRuns, LOADS, __VA_ARGS__>),
  static const ChainEntry<TailKernel> chains[] = {FXFUSE_TAIL_CHAINS(FXFUSE_TAIL_CHAIN_ENTRY)};
#undef FXFUSE_TAIL_CHAIN_ENTRY
  return find_chain(chains, prog.code, prog.num_instructions);
}

// The chain build for this program and its operands' kinds (tail_loads), or nullptr.
template <class S>
TailKernel tail_chain_kernel(const TailProgram& prog) {
  for (int pc = 0; pc < prog.num_instructions; ++pc)
    if (prog.code[pc].other != OTHER_PARAM) return nullptr;
  switch (tail_loads(prog)) {
    case TAIL_LOADS_ROW_VECTOR:
      return find_tail_chain<S, TAIL_LOADS_ROW_VECTOR>(prog);
    case TAIL_LOADS_ROW_BROADCAST:
      return find_tail_chain<S, TAIL_LOADS_ROW_BROADCAST>(prog);
    default:
      return find_tail_chain<S, TAIL_LOADS_ANY>(prog);
  }
}

// A chain of FXFUSE_TAIL_CHAINS takes kTailChainRuns 16-byte runs a thread where the innermost dim allows (the
// min + bias example's tail: 16 MB of bf16 output). Other programs are interpreted with one 16-byte run a thread
// where the innermost dim is a multiple of VEC, else one element: an interpreted build of four runs took 60 of the
// 86 s that nvcc spent on this file for sm_90a + sm_80, and timed no faster (variants 54, 55). The grid covers the
// output in one pass: min_bias's tail 10.6 -> 10.4 us in fp32 and tf32 against a grid-stride loop over at most 8
// blocks an SM (variant 87).
template <class S>
void launch_broadcast_tail(const TailProgram& prog, bool early, cudaStream_t stream) {
  constexpr int vec = S::VEC;
  const uint32_t inner = prog.sizes[prog.ndim - 1];
  TailKernel kernel = inner % (32 * vec * kTailChainRuns) == 0 ? tail_chain_kernel<S>(prog) : nullptr;
  int64_t per_thread = vec * kTailChainRuns;
  if (kernel == nullptr) {
    per_thread = inner % vec == 0 ? vec : 1;
    kernel = per_thread == vec ? broadcast_tail_kernel<S, vec, 1> : broadcast_tail_kernel<S, 1, 1>;
  }
  const int64_t threads = (prog.numel + per_thread - 1) / per_thread;
  const unsigned blocks = static_cast<unsigned>((threads + 255) / 256);
  launch_kernel(kernel, blocks, 256, 0, early, stream, prog);
}

}  // namespace fxfuse
