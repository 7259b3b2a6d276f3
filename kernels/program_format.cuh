// The compiled form of a program, shared by the host binder (gemm_epilogue.cpp) and the kernels
// (interpreter.cuh): limits, opcodes, the instruction format, the kernels' by-value arguments, and the launchers.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "epilogue_ops.cuh"

namespace fxfuse {

constexpr int kMaxInstructions = 32;
constexpr int kMaxParams = 8;
constexpr int kMaxSlots = 2;
constexpr int kMaxTailOperands = 4;
constexpr int kMaxTailDims = 4;
constexpr int kRowValues = 16;         // values per thread of the row kernels: rows up to 16384 features
constexpr int kMaxRowThreads = 1024;   // threads per row at most; __launch_bounds__(1024, 1) caps registers at 64
constexpr int kMaxRowFeatures = kRowValues * kMaxRowThreads;

// Values per thread of the fast row kernel (fast_row.cuh) for rows of `features` in storage of `vec` values per
// 16-byte vector, of a program with or without libdevice ops (uses_libm_op): kLongRowValues for 16-bit rows of more
// than 4096 features without them, at 128 registers (bf16 min_bias's row kernel and tail 15.7 -> 15.0 us, mish
// 14.5 -> 14.3, variant 98); else 16. fp32 was slower at 32 (hardtanh 18.2 -> 19.7 us, variant 97); bf16 programs
// with libdevice ops were slower at 32 (gelu, mul, max_dim over 1024 x 2048: 14.4 -> 7.9 us above the GEMM), and
// rows of 4096 or fewer gained nothing from it (variant 100).
constexpr int kLongRowValues = 32;
__host__ __device__ constexpr int fast_row_values(int vec, int64_t features, bool with_libm_ops) {
  return vec == 8 && !with_libm_ops && features > 4096 ? kLongRowValues : kRowValues;
}
__host__ __device__ constexpr int fast_row_threads(int values) { return kMaxRowFeatures / values; }

// ================================================================ instruction format

#define FXFUSE_OPCODE(name, Functor) OP_##name,
enum Opcode : uint8_t {
  OP_SAVE,  // copy the current value into slot `slot`
  OP_LOAD,  // make slot `slot` the current value
  FXFUSE_UNARY_OPS(FXFUSE_OPCODE) FXFUSE_BINARY_OPS(FXFUSE_OPCODE) FXFUSE_FEATURE_AFFINE_OPS(FXFUSE_OPCODE)
  FXFUSE_NORM_OPS(FXFUSE_OPCODE) FXFUSE_REDUCTION_OPS(FXFUSE_OPCODE)
  OP_COUNT
};
#undef FXFUSE_OPCODE

// The unary opcodes are consecutive, right after OP_LOAD.
#define FXFUSE_COUNT_OP(name, Functor) +1
constexpr int kUnaryOpCount = 0 FXFUSE_UNARY_OPS(FXFUSE_COUNT_OP);
#undef FXFUSE_COUNT_OP
__host__ __device__ inline bool is_unary(uint8_t op) { return op > OP_LOAD && op <= OP_LOAD + kUnaryOpCount; }

// The second operand of a binary op (the first is always the current value).
enum Other : uint8_t { OTHER_CURRENT, OTHER_SLOT0, OTHER_SLOT1, OTHER_PARAM, OTHER_SCALAR };

// How a norm finds its groups (chosen by the host from the group size, VEC and TPR).
enum GroupMode : uint8_t {
  GROUP_ACROSS_LANES,  // whole chunks per group: combine chunks in-thread, then lanes_per_group lanes
  GROUP_IN_VECTOR,     // sizes below VEC that divide it (1, 2; 4 in 16-bit storage): each group inside one chunk
                       // of one thread, no exchange
  GROUP_SHARED,        // any other size: the row staged in shared memory, one thread or warp per group
};

struct Instruction {
  uint8_t op;
  uint8_t other;      // binary ops: where the second operand comes from
  uint8_t reversed;   // binary ops: compute op(other, current)
  uint8_t slot;       // OP_SAVE / OP_LOAD
  int8_t param[4];    // params read: binary operand; norm weight, bias; batch_norm mean, var, weight, bias (-1: None)
  uint8_t group_mode;
  int32_t group_size;        // norms: features per group
  int32_t chunks_per_group;  // GROUP_ACROSS_LANES: chunks of one thread in one group (>= CHUNKS: all)
  int32_t lanes_per_group;   // GROUP_ACROSS_LANES: consecutive lanes sharing a group (power of 2, <= TPR)
  Attrs attrs;               // op attributes; OTHER_SCALAR's value in a0; norms' eps in a0
};

// ================================================================ row programs compiled whole

// The opcode sequences that get a kernel of their own on whole rows, TPR * VALUES features (chain_row_kernel in
// fast_row.cuh); any other program is interpreted. These are the epilogues of the bundled examples, whose row
// kernels take 11-25% less time this way on the H100 (dev/NOTES.md, variant 57), first as the examples spell
// them (nn.Hardtanh, torch.min(h, 1)[0]), then with torch.clamp and torch.amin, which compute the same values.
// Adding a chain is one line here and about 0.6 s of nvcc per arch in each fast translation unit (the bf16 fast
// kernels' unit for sm_90a: 32.8 s without the first four, 35.3 s with them).
#define FXFUSE_ROW_CHAINS(X)                     \
  X(OP_group_norm, OP_hardtanh)                  \
  X(OP_group_norm, OP_leaky_relu, OP_add)        \
  X(OP_group_norm, OP_min_dim)                   \
  X(OP_add, OP_hardtanh, OP_mish, OP_group_norm) \
  X(OP_group_norm, OP_clamp)                     \
  X(OP_group_norm, OP_amin)                      \
  X(OP_add, OP_clamp, OP_mish, OP_group_norm)

// The chains with libdevice ops (CallsLibm), whose programs are laid out at 16 values a thread only
// (fast_row_values): compiled at 16 values, beside the interpreted build with those ops (libm_chain_kernel in
// fast_row.cuh). The pool example's program (gelu, its scale, the row max), then group_norm and gelu; either
// approximation of gelu, an attribute.
#define FXFUSE_LIBM_ROW_CHAINS(X) \
  X(OP_gelu, OP_mul, OP_max_dim)  \
  X(OP_group_norm, OP_gelu)

// The tail programs compiled whole (broadcast_tail_kernel's CHAIN): one binary op of the row phase's result and a
// param (the min + bias example's `+ bias`); the launcher checks that the second operand is a param.
#define FXFUSE_TAIL_CHAINS(X) X(OP_add) X(OP_sub) X(OP_mul) X(OP_div)

// A chain's opcodes and its kernel, for the launchers' lookup tables.
template <class Kernel>
struct ChainEntry {
  Opcode ops[kMaxInstructions];
  int length;
  Kernel kernel;
};

template <class Kernel, Opcode... OPS>
ChainEntry<Kernel> chain_entry(Kernel kernel) {
  return {{OPS...}, static_cast<int>(sizeof...(OPS)), kernel};
}

// The kernel of the chain whose opcodes are the program's, or a null one (Kernel{}).
template <class Kernel, size_t N>
Kernel find_chain(const ChainEntry<Kernel> (&chains)[N], const Instruction* code, int num_instructions) {
  for (const ChainEntry<Kernel>& chain : chains) {
    bool same = chain.length == num_instructions;
    for (int pc = 0; same && pc < chain.length; ++pc) same = code[pc].op == chain.ops[pc];
    if (same) return chain.kernel;
  }
  return Kernel{};
}

// A param as the row phase reads it: element (row, feature) is at ptr[row * row_stride + feature * feature_stride].
struct RowParam {
  const void* ptr;
  int64_t row_stride;
  int64_t feature_stride;
  bool vector_loads;  // feature_stride 1, 16-byte aligned rows: one 16-byte load per chunk
  int32_t shared_index;  // set by the launcher: its copy's first 16-byte vector in shared memory, or -1
};

struct RowProgram {
  Instruction code[kMaxInstructions];
  RowParam params[kMaxParams];
  const void* input;   // the GEMM output, [rows, features] contiguous
  void* output;        // [rows, features]: the input itself or a tensor of its own; [rows] after a row reduction
  int64_t rows;
  int64_t row_groups;  // set by the launcher: rows / rows_per_block, rounded up
  int32_t features;
  int32_t num_instructions;
  int32_t threads_per_row;  // TPR, a power of 2 from 32
  int32_t group_shared_floats;  // dynamic shared memory of the GROUP_SHARED rows, before the staged params
  int32_t staging_vector;       // set by the launcher: the staging slots' first 16-byte vector in shared memory
  int32_t row_min_slots;        // set by the launcher: > 0, a chain's last whole-row min folds by atomics (fast_row)
  bool vector_io;           // features % VEC == 0: 16-byte loads and stores of the row
  bool output_per_row;      // write one value per row
  bool tail_follows;        // a broadcast tail runs next: let it launch at once (allow_next_kernel_to_start)
};

// A tail operand: element i of the output reads ptr[sum_d coord_d(i) * strides[d]]. The host checks that
// every offset and the output size fit in 31 bits: 32-bit division per dim instead of 64-bit (about 4x fewer
// instructions).
struct TailOperand {
  const void* ptr;
  uint32_t strides[kMaxTailDims];
  bool vector_loads;  // innermost stride 1, 16-byte aligned wherever a thread's VEC outputs start
};

// Division of a 31-bit numerator by a fixed divisor as a multiply and a shift: q = (n * multiplier) >> shift
// with multiplier = ceil(2^shift / divisor), shift = 31 + ceil(log2(divisor)), exact for n < 2^31. A 32-bit
// division by a runtime value is about 20 instructions (the min + bias tail: 7.8 -> 7.1 us in bf16, variant 64).
struct FastDivisor {
  uint32_t multiplier;
  uint32_t shift;
  __host__ void set(uint32_t d) {
    uint32_t log2_ceil = 0;
    while ((uint64_t{1} << log2_ceil) < d) ++log2_ceil;
    shift = 31 + log2_ceil;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << shift) + d - 1) / d);
  }
  __device__ uint32_t divide(uint32_t n) const {
    return static_cast<uint32_t>((static_cast<uint64_t>(n) * multiplier) >> shift);
  }
};

// How a tail chain's two operands (the row phase's result and one param) vary along a thread's 16-byte run, where
// the launcher can tell: one contiguous and the other broadcast (the min + bias example: the row mins along the
// run, the bias constant). Each gets a chain build with one load path per operand (tail_loads says which).
enum TailLoads : int { TAIL_LOADS_ANY, TAIL_LOADS_ROW_VECTOR, TAIL_LOADS_ROW_BROADCAST };

struct TailProgram {
  Instruction code[kMaxInstructions];
  TailOperand operands[kMaxTailOperands];  // 0: the row phase's result; then the params the tail reads
  int32_t num_operands;
  void* output;                            // contiguous, sizes below
  uint32_t sizes[kMaxTailDims];            // coalesced output dims, outermost first
  FastDivisor divisors[kMaxTailDims];      // of sizes[]
  uint32_t numel;
  int32_t ndim;
  int32_t num_instructions;
};

// The TailLoads of a one-instruction program whose operands are the row result and a param.
inline TailLoads tail_loads(const TailProgram& prog) {
  if (prog.num_instructions != 1 || prog.num_operands != 2) return TAIL_LOADS_ANY;
  const TailOperand& row = prog.operands[0];
  const TailOperand& param = prog.operands[1];
  const auto broadcast = [&](const TailOperand& operand) { return operand.strides[prog.ndim - 1] == 0; };
  if (row.vector_loads && broadcast(param)) return TAIL_LOADS_ROW_VECTOR;
  if (broadcast(row) && param.vector_loads) return TAIL_LOADS_ROW_BROADCAST;
  return TAIL_LOADS_ANY;
}

// ================================================================ the backward's program (backward_interpreter.cuh)

constexpr int kMaxBackwardThreads = 512;  // rows up to 8192 features; __launch_bounds__(512, 1): 128 registers
constexpr int kMaxBackwardRowOps = 2;     // norms and reductions whose statistics the backward keeps in registers
constexpr int kMaxGradAccumulators = 4;   // params whose gradient sums over rows (32 KB of shared memory each)

// How a param's gradient is gathered from its per-element contributions.
enum GradKind : uint8_t {
  GRAD_NONE,     // not asked for
  GRAD_SUMMED,   // one value per feature (or a single value): summed over the block's rows in shared memory,
                 // then written to out[partial row][feature], fp32; then summed (launch_finish_summed_grads)
  GRAD_PER_ROW,  // one value per row: summed over the row, out[row], fp32
  GRAD_FULL,     // one value per element: out[row][feature], fp32
};

struct ParamGrad {
  uint8_t kind;
  int8_t accumulator;  // GRAD_SUMMED: its shared-memory accumulator
  float* out;
};

// What the backward knows of each instruction beyond the forward's format.
struct BackwardStep {
  int8_t row_op;          // norms and reductions: where their statistics are kept (< kMaxBackwardRowOps)
  bool input_per_row;     // the instruction reads a per-row value (after a reduction; held in every element)
  bool output_per_row;    // ... and writes one: its param contributions count once per row, not per element
};

struct BackwardProgram {
  RowProgram row;                     // the forward's program; input: the GEMM output; output: its gradient or null
  BackwardStep steps[kMaxInstructions];
  ParamGrad grads[kMaxParams];        // per row param
  int32_t grad_output_param;          // the row param that views the result's gradient
  bool stage_grad_output;             // it is whole contiguous rows: staged in shared memory with the GEMM output
  int32_t accumulators;               // GRAD_SUMMED params
  int32_t rows_per_block;
};

// The GRAD_SUMMED gradients finished on the device: out[a][f] = the sum over p of partials[a][p][f] in fp32, stored
// in the params' type, for every accumulator in one launch.
struct SummedGrads {
  const float* partials;                  // [accumulators, partial_rows, features]
  void* out[kMaxGradAccumulators];        // per accumulator: `features` values of the storage type
  int64_t partial_rows;
  int32_t features;
  int32_t accumulators;
};

// How the row kernel is launched: rows_per_block rows of TPR threads per block.
struct RowLaunch {
  int rows_per_block;
  int64_t shared_bytes;  // GROUP_SHARED rows (the launcher adds the staging slots)
  bool early;            // the fast kernel as a programmatic dependent of the GEMM (launch_kernel, interpreter.cuh)
};

// A feature pool's weight averaging (row_group_mean.cu): out[g] = the mean of in's rows [g * size, (g + 1) * size),
// rows of `columns` contiguous elements; `vectors`: both pointers 16-byte aligned and rows of whole 16-byte vectors.
struct RowGroupMean {
  const void* in;
  void* out;
  int64_t groups;
  int64_t columns;
  int64_t size;
  bool vectors;
};

// The kernels' storage types (interpreter.cuh): every tensor of one call has the same dtype.
struct Fp32Storage;
struct Bf16Storage;
struct Fp16Storage;

// Whether an opcode is a per-feature affine of live statistics (batch_norm).
inline bool is_feature_affine(uint8_t op) {
  switch (op) {
#define FXFUSE_AFFINE_OPCODE(name, F) case OP_##name:
    FXFUSE_FEATURE_AFFINE_OPS(FXFUSE_AFFINE_OPCODE)
#undef FXFUSE_AFFINE_OPCODE
    return true;
    default:
      return false;
  }
}

// Whether a row program needs the general row kernel, which also takes the rare paths: rows that are not whole
// 16-byte vectors, batch_norm's per-feature affine, groups staged in shared memory. The lean kernel compiles
// them out, which frees registers: no spills in bf16, against 156 / 232 bytes of spill stores / loads.
inline bool needs_general_row_kernel(const RowProgram& prog) {
  if (!prog.vector_io) return true;
  for (int pc = 0; pc < prog.num_instructions; ++pc) {
    const Instruction& ins = prog.code[pc];
    if (ins.group_size > 0 && ins.group_mode == GROUP_SHARED) return true;
    if (is_feature_affine(ins.op)) return true;
  }
  return false;
}

// Whether the fast row kernel at `values` a thread runs the program as a chain (chain_kernel, fast_row.cuh): rows
// of TPR * values features and the opcodes of one of FXFUSE_ROW_CHAINS, or at kRowValues of FXFUSE_LIBM_ROW_CHAINS.
inline bool runs_as_row_chain(const RowProgram& prog, int values) {
#define FXFUSE_CHAIN_OPS(...) chain_entry<bool, __VA_ARGS__>(true),
  static const ChainEntry<bool> chains[] = {FXFUSE_ROW_CHAINS(FXFUSE_CHAIN_OPS)};
  static const ChainEntry<bool> libm_chains[] = {FXFUSE_LIBM_ROW_CHAINS(FXFUSE_CHAIN_OPS)};
#undef FXFUSE_CHAIN_OPS
  if (prog.features != int64_t{prog.threads_per_row} * values) return false;
  return find_chain(chains, prog.code, prog.num_instructions) ||
         (values == kRowValues && find_chain(libm_chains, prog.code, prog.num_instructions));
}

// Whether the fast row kernel (fast_row.cuh) at `values` a thread takes a program: rows of whole vectors, no slots,
// nothing that needs the general kernel, every param a contiguous, 16-byte aligned per-feature vector, and groups
// inside a vector (GROUP_IN_VECTOR) in its chains only: its interpreted builds spilled more with their code (bf16
// whole rows 16 -> 152 bytes of spill stores; norm_silu 3.2 -> 3.9 us above the GEMM at 1024 features, variant 103),
// so those programs take the lean row kernel.
inline bool fits_fast_row_kernel(const RowProgram& prog, int slots_used, int values) {
  if (slots_used > 0 || needs_general_row_kernel(prog)) return false;
  for (const RowParam& p : prog.params)
    if (p.ptr != nullptr && (p.row_stride != 0 || p.feature_stride != 1 || !p.vector_loads)) return false;
  for (int pc = 0; pc < prog.num_instructions; ++pc) {
    const Instruction& ins = prog.code[pc];
    if (ins.group_size > 0 && ins.group_mode == GROUP_IN_VECTOR) return runs_as_row_chain(prog, values);
  }
  return true;
}

// Whether a program uses a unary or binary op that calls libdevice (CallsLibm): the fast row kernel's build without
// them does not take it.
inline bool uses_libm_op(const RowProgram& prog) {
  for (int pc = 0; pc < prog.num_instructions; ++pc) {
    switch (prog.code[pc].op) {
#define FXFUSE_LIBM_CASE(name, F)         \
  case OP_##name:                         \
    if (CallsLibm<F>::value) return true; \
    break;
      FXFUSE_UNARY_OPS(FXFUSE_LIBM_CASE)
      FXFUSE_BINARY_OPS(FXFUSE_LIBM_CASE)
#undef FXFUSE_LIBM_CASE
      default:
        break;
    }
  }
  return false;
}

// The launchers, explicitly instantiated one storage type, slot count and kernel generality per translation
// unit (row_program_*.cu, broadcast_tail.cu), so that ninja compiles them in parallel; each launches on
// `stream` and checks the launch. The row launchers launch nothing and return false where a block cannot have the
// shared memory the program needs on this device (an sm_86 card's 99 KB: fp32 rows past 8192 features whose groups
// sit in shared memory ask 112 KB).
template <class Storage, int SLOTS, bool GENERAL>
bool launch_row_program(const RowProgram& prog, const RowLaunch& launch, cudaStream_t stream);
template <class Storage, int VALUES>
bool launch_fast_row_program(const RowProgram& prog, const RowLaunch& launch, cudaStream_t stream);
template <class Storage>
void launch_broadcast_tail(const TailProgram& prog, bool early, cudaStream_t stream);
// False, launching nothing, where its grid would leave the GPU part idle while each thread sums many rows.
template <class Storage>
bool launch_row_group_mean(const RowGroupMean& job, cudaStream_t stream);
// The backward row kernel (backward_interpreter.cuh): its persistent grid's block count for `threads` threads,
// then the launch, whose GRAD_SUMMED outputs have blocks * rows_per_block partial rows.
template <class Storage>
int64_t row_backward_blocks(const BackwardProgram& prog, int threads);
template <class Storage>
void launch_row_backward(const BackwardProgram& prog, int64_t blocks, int threads, cudaStream_t stream);
template <class Storage>
void launch_finish_summed_grads(const SummedGrads& grads, cudaStream_t stream);

}  // namespace fxfuse
