// The epilogue's backward: the row kernel that runs a program in reverse mode, and its launchers (declared in
// program_format.cuh, instantiated one storage type per translation unit, row_backward_*.cu).
//
//   For each row y = gemm_out[row]: grad_y = (d program / d y)^T grad_out[row], and each param's gradient.
//   Reference: fxfuse/library.py::run_epilogue_backward (torch's autograd through fxfuse/program.py::run_program).
//   The unary and binary derivatives sit beside their functors (epilogue_ops.cuh::backward, ::partials or
//   ::gradients); the norms' and reductions' are below (backward_row_op), one formula per statistic.
//
// Strategy: the forward's register layout (interpreter.cuh): TPR threads per row, 16 values a thread. A thread
// reads its chunks of the GEMM output row and of grad_out once, and runs the program forward once, keeping each
// norm's and reduction's statistics in registers. It then walks the instructions backwards: for instruction i it
// recomputes i's input from the row with the kept statistics (pointwise work only: programs are a few
// instructions long) and turns the gradient of i's output into that of its input, with the group sums that a
// norm's backward needs. grad_y is written once. Param gradients: those summed over rows (per feature, or one
// value) accumulate over the block's rows in shared memory and are written once per block, as partial rows that a
// second kernel sums (finish_summed_grads_kernel) or the host does; per-row ones are summed over the row; full ones
// are written per element.
//
// Limits (the host runs the reference otherwise, epilogue_backward.cpp): every value is read once, by the next
// instruction (no slots); rows of whole 16-byte vectors, at most 8192 features; groups on the lanes' grid; at
// most kMaxBackwardRowOps norms and reductions; no batch_norm; no broadcast beyond the rows.
#pragma once

#include "interpreter.cuh"

namespace fxfuse {

// ================================================================ kept statistics and param gradients

template <int CHUNKS>
struct KeptStatistics {
  float s0[kMaxBackwardRowOps][CHUNKS];
  float s1[kMaxBackwardRowOps][CHUNKS];

  // Register arrays take compile-time indices only: the slot is selected by an unrolled compare.
  __device__ __forceinline__ void keep(int slot, const float (&a)[CHUNKS], const float (&b)[CHUNKS]) {
#pragma unroll
    for (int k = 0; k < kMaxBackwardRowOps; ++k)
      if (k == slot)
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) s0[k][c] = a[c], s1[k][c] = b[c];
  }
  __device__ __forceinline__ void read(int slot, float (&a)[CHUNKS], float (&b)[CHUNKS]) const {
#pragma unroll
    for (int k = 0; k < kMaxBackwardRowOps; ++k)
      if (k == slot)
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) a[c] = s0[k][c], b[c] = s1[k][c];
  }
};

// What a thread of the backward knows beyond the forward's context (RowContext): where its param gradient
// contributions go (ParamGrad, program_format.cuh), and the exchange of paired group sums.
template <int CHUNKS, int VEC>
struct BackwardRow {
  const BackwardProgram& prog;
  float* accumulators;  // shared memory: [accumulators][CHUNKS][VEC][blockDim.x], each thread its own column
  CrossWarp<2 * CHUNKS>& pair_exchange;
  int64_t row;          // the thread's row; an idle thread of the last block computes and contributes nothing
  bool active;

  // This thread's column of accumulator a: element (c, j) at [(c * VEC + j) * blockDim.x]. Thread-minor, so that a
  // warp's accesses fall in 32 different banks.
  __device__ float* accumulator(int a) const {
    return accumulators + a * CHUNKS * VEC * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x);
  }
};

template <int VEC>
__device__ __forceinline__ float tree_sum(float (&terms)[VEC]) {
#pragma unroll
  for (int width = VEC / 2; width > 0; width /= 2)
#pragma unroll
    for (int j = 0; j < width; ++j) terms[j] += terms[j + width];
  return terms[0];
}

// Sums a and b, this thread's partials per chunk, over each chunk's group together (a norm backward's two sums):
// the shuffles of the two interleave, and a cross-warp exchange takes one pair of barriers instead of two.
template <int CHUNKS>
__device__ __forceinline__ void group_sum_pair(float (&a)[CHUNKS], float (&b)[CHUNKS], int chunks_per_group,
                                               int lanes_per_group, CrossWarp<2 * CHUNKS>& cross_warp) {
  if (chunks_per_group >= CHUNKS) {  // all of this thread's chunks in one group
    float totals[2] = {a[0], b[0]};
#pragma unroll
    for (int c = 1; c < CHUNKS; ++c) totals[0] += a[c], totals[1] += b[c];
    lanes_allreduce<SumOp>(totals, lanes_per_group, cross_warp);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) a[c] = totals[0], b[c] = totals[1];
    return;
  }
  float both[2 * CHUNKS];
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    both[c] = 0.0f, both[CHUNKS + c] = 0.0f;
#pragma unroll
    for (int c2 = 0; c2 < CHUNKS; ++c2)
      if (c2 / chunks_per_group == c / chunks_per_group) both[c] += a[c2], both[CHUNKS + c] += b[c2];
  }
  lanes_allreduce<SumOp>(both, lanes_per_group, cross_warp);
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) a[c] = both[c], b[c] = both[CHUNKS + c];
}

template <typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void row_allreduce_sum(const Ctx& ctx, const Values<CHUNKS, VEC>& values,
                                                  float (&total)[CHUNKS], CrossWarp<CHUNKS>& cross_warp) {
  chunk_sums(ctx, values, total, [](int, float v) { return v; });
  group_allreduce<SumOp>(total, 1 << 30, ctx.prog.threads_per_row, cross_warp);
}

// Adds `contrib`, one contribution per element of this thread's chunks, to row param `param`'s gradient. Every
// thread of the block calls it for the same param (a per-row gradient sums across warps).
template <typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void gather_param_grad(const Ctx& ctx, const BackwardRow<CHUNKS, VEC>& state, int param,
                                                  const BackwardStep& step, Values<CHUNKS, VEC>& contrib,
                                                  CrossWarp<CHUNKS>& cross_warp) {
  const ParamGrad& grad = state.prog.grads[param];
  if (grad.kind == GRAD_NONE) return;
  if (step.output_per_row)  // every element holds the row's one value: count it once
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        if (c != 0 || j != 0 || ctx.lane != 0) contrib[c][j] = 0.0f;
  if (grad.kind == GRAD_PER_ROW) {
    float total[CHUNKS];
    row_allreduce_sum(ctx, contrib, total, cross_warp);
    if (state.active && ctx.lane == 0) grad.out[state.row] += total[0];
    return;
  }
  if (!state.active) return;
  if (grad.kind == GRAD_SUMMED) {
    float* sum = state.accumulator(grad.accumulator);
    const int stride = blockDim.x;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        if (ctx.chunk_count(c) > 0) sum[(c * VEC + j) * stride] += contrib[c][j];
    return;
  }
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    if (ctx.chunk_count(c) == 0) continue;
    float* out = grad.out + state.row * ctx.prog.features + ctx.element(c, 0);
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] += contrib[c][j];
  }
}

// ================================================================ one instruction backwards

// A binary op: current = F(current, other), or F(other, current) when reversed.
template <class F, typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void binary_backward(const Ctx& ctx, const BackwardRow<CHUNKS, VEC>& state,
                                                const Instruction& ins, const BackwardStep& step,
                                                const Values<CHUNKS, VEC>& x, Values<CHUNKS, VEC>& grad,
                                                CrossWarp<CHUNKS>& cross_warp) {
  float contrib[CHUNKS][VEC];
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    float other[VEC];
    if (ins.other == OTHER_PARAM) ctx.load(ins.param[0], c, other);
    else
#pragma unroll
      for (int j = 0; j < VEC; ++j) other[j] = ins.other == OTHER_SCALAR ? ins.attrs.a0 : x[c][j];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if constexpr (GivesGradients<F>::value) {
        float g_current, g_other;
        if (ins.reversed) F::gradients(other[j], x[c][j], grad[c][j], g_other, g_current);
        else F::gradients(x[c][j], other[j], grad[c][j], g_current, g_other);
        contrib[c][j] = g_other;
        grad[c][j] = ins.other == OTHER_CURRENT ? g_current + g_other : g_current;
      } else {
        float d_current, d_other;
        if (ins.reversed) F::partials(other[j], x[c][j], d_other, d_current);
        else F::partials(x[c][j], other[j], d_current, d_other);
        const float d = ins.other == OTHER_CURRENT ? d_current + d_other : d_current;
        contrib[c][j] = SelectsGradient<F>::value && d_other == 0.0f ? 0.0f : grad[c][j] * d_other;
        grad[c][j] = SelectsGradient<F>::value && d == 0.0f ? 0.0f : grad[c][j] * d;
      }
    }
  }
  if (ins.other == OTHER_PARAM) gather_param_grad(ctx, state, ins.param[0], step, contrib, cross_warp);
}

#define FXFUSE_FIRST_INDEX_CASE(name, F) \
  case OP_##name:                        \
    return FirstIndexGradient<F>::value;
__device__ __forceinline__ bool gives_gradient_to_first_index(uint8_t op) {
  switch (op) {
    FXFUSE_REDUCTION_OPS(FXFUSE_FIRST_INDEX_CASE)
    default:
      return false;
  }
}
#undef FXFUSE_FIRST_INDEX_CASE

// A norm or a reduction, from its statistic (s0, s1) per chunk (Statistic, epilogue_ops.cuh). After a reduction
// the gradient is the row's one value, in every element.
template <typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void backward_row_op(const Ctx& ctx, const BackwardRow<CHUNKS, VEC>& state,
                                                const Instruction& ins, const BackwardStep& step,
                                                const Values<CHUNKS, VEC>& x, Values<CHUNKS, VEC>& grad,
                                                const float (&s0)[CHUNKS], const float (&s1)[CHUNKS],
                                                CrossWarp<CHUNKS>& cross_warp) {
  const int cpg = ins.chunks_per_group, lpg = ins.lanes_per_group;
  const float inv_size = 1.0f / ins.group_size;
  float work[CHUNKS][VEC];
  float sum_a[CHUNKS], sum_b[CHUNKS];
  const auto group_sum = [&](float (&sum)[CHUNKS]) {
    chunk_sums(ctx, work, sum, [](int, float v) { return v; });
    group_allreduce<SumOp>(sum, cpg, lpg, cross_warp);
  };
  switch (statistic_of(ins.op)) {
    case Statistic::MeanAndRstd:
    case Statistic::RootMeanSquare: {
      // xhat = (x - mean) * rstd (mean 0 for rms_norm); h = grad * weight;
      // dx = rstd * (h - mean(h) - xhat * mean(h * xhat)) (rms_norm: no mean(h)); dweight = grad * xhat; dbias = grad
      const bool centered = statistic_of(ins.op) == Statistic::MeanAndRstd;
      const auto xhat = [&](int c, int j) { return (x[c][j] - (centered ? s0[c] : 0.0f)) * s1[c]; };
      if (ins.param[1] >= 0) {
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
          for (int j = 0; j < VEC; ++j) work[c][j] = grad[c][j];
        gather_param_grad(ctx, state, ins.param[1], step, work, cross_warp);
      }
      if (ins.param[0] >= 0) {
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
          for (int j = 0; j < VEC; ++j) work[c][j] = grad[c][j] * xhat(c, j);
        gather_param_grad(ctx, state, ins.param[0], step, work, cross_warp);
      }
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        float w[VEC], h[VEC], h_xhat[VEC];
        ctx.load_feature_param(ins.param[0], c, 1.0f, w);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          grad[c][j] *= w[j];
          h[j] = grad[c][j];
          h_xhat[j] = grad[c][j] * xhat(c, j);
        }
        const bool valid = ctx.chunk_count(c) > 0;
        sum_a[c] = valid ? tree_sum(h) : 0.0f;
        sum_b[c] = valid ? tree_sum(h_xhat) : 0.0f;
      }
      group_sum_pair(sum_a, sum_b, cpg, lpg, state.pair_exchange);
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          grad[c][j] = s1[c] * (grad[c][j] - (centered ? sum_a[c] * inv_size : 0.0f) -
                                xhat(c, j) * sum_b[c] * inv_size);
      return;
    }
    case Statistic::MaxAndLogSumExp: {
      // softmax y = exp(x - m - log_sum): dx = y * (grad - sum(grad * y));
      // log_softmax: dx = grad - exp(y) * sum(grad); logsumexp: dx = grad * exp(x - result)
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float p = expf(x[c][j] - s0[c] - s1[c]);
          work[c][j] = ins.op == OP_softmax ? grad[c][j] * p : grad[c][j];
        }
      if (ins.op == OP_softmax || ins.op == OP_log_softmax) group_sum(sum_a);
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float p = expf(x[c][j] - s0[c] - s1[c]);
          if (ins.op == OP_softmax) grad[c][j] = p * (grad[c][j] - sum_a[c]);
          else if (ins.op == OP_log_softmax) grad[c][j] -= p * sum_a[c];
          else grad[c][j] *= p;
        }
      return;
    }
    case Statistic::Max:
    case Statistic::Min: {
      if (gives_gradient_to_first_index(ins.op)) {
        // max_dim / min_dim: the whole gradient to the first element equal to the result (the first NaN where it
        // is NaN), the one torch.max / torch.min's indices name; feature indices are exact in fp32
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const bool extreme = x[c][j] == s0[c] || (isnan(s0[c]) && isnan(x[c][j]));
            work[c][j] = extreme ? static_cast<float>(ctx.element(c, j)) : INFINITY;
          }
        chunk_extrema<MinOp>(ctx, work, sum_a);
        group_allreduce<MinOp>(sum_a, cpg, lpg, cross_warp);
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
          for (int j = 0; j < VEC; ++j)
            grad[c][j] = static_cast<float>(ctx.element(c, j)) == sum_a[c] ? grad[c][j] : 0.0f;
        return;
      }
      // amax / amin: the gradient split evenly between the elements equal to the result
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) work[c][j] = x[c][j] == s0[c] ? 1.0f : 0.0f;
      group_sum(sum_a);
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) grad[c][j] = grad[c][j] / sum_a[c] * work[c][j];
      return;
    }
    case Statistic::CenteredSquares: {
      // var: dx = grad * 2 (x - mean) / (count - correction); std first takes grad / (2 std), 0 where std is 0
      // (torch's var_backward and std_backward)
      const float scale = 2.0f / (static_cast<float>(ins.group_size) - ins.attrs.a0);
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        const float result = Std::result(s0[c], s1[c], ins.group_size, ins.attrs);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          float grad_var = grad[c][j];
          if (ins.op == OP_std) grad_var = result == 0.0f ? 0.0f : grad_var / (result * 2.0f);
          grad[c][j] = scale * grad_var * (x[c][j] - s0[c]);
        }
      }
      return;
    }
    case Statistic::RootSumSquare: {
      if (ins.op == OP_vector_norm) {
        // dx = x * grad / norm, 0 where the norm is 0 (torch's norm_backward)
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
          for (int j = 0; j < VEC; ++j) grad[c][j] = s0[c] == 0.0f ? 0.0f : x[c][j] * (grad[c][j] / s0[c]);
        return;
      }
      // normalize, y = x / d with d = max(norm, eps): dx = (grad - xhat * sum(grad * xhat)) / d, xhat = x / d, and
      // grad / d alone where the norm is below eps (autograd through F.normalize's norm, clamp_min and division)
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int j = 0; j < VEC; ++j) work[c][j] = grad[c][j] * (x[c][j] / s1[c]);
      group_sum(sum_a);
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        const float through_norm = s0[c] >= ins.attrs.a0 ? sum_a[c] : 0.0f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) grad[c][j] = (grad[c][j] - x[c][j] / s1[c] * through_norm) / s1[c];
      }
      return;
    }
    case Statistic::Sum:
      if (ins.op == OP_mean)
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
          for (int j = 0; j < VEC; ++j) grad[c][j] *= inv_size;
      return;
  }
}

#define FXFUSE_BACKWARD_CASE(name, F) case OP_##name:

// Turns `grad`, the gradient of instruction ins's output, into that of its input `x`.
template <typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void backward_step(const Ctx& ctx, const BackwardRow<CHUNKS, VEC>& state, const Instruction& ins,
                                              const BackwardStep& step, const Values<CHUNKS, VEC>& x,
                                              Values<CHUNKS, VEC>& grad, const float (&s0)[CHUNKS],
                                              const float (&s1)[CHUNKS], CrossWarp<CHUNKS>& cross_warp) {
  switch (ins.op) {
#define FXFUSE_UNARY_BACKWARD(name, F)                                                                \
  case OP_##name: {                                                                                   \
    const Attrs attrs = ins.attrs;                                                                    \
    _Pragma("unroll") for (int c = 0; c < CHUNKS; ++c)                                                \
    _Pragma("unroll") for (int j = 0; j < VEC; ++j) grad[c][j] = F::backward(x[c][j], grad[c][j], attrs); \
    break;                                                                                            \
  }
    FXFUSE_UNARY_OPS(FXFUSE_UNARY_BACKWARD)
#undef FXFUSE_UNARY_BACKWARD
#define FXFUSE_BINARY_BACKWARD(name, F)                                       \
  case OP_##name:                                                             \
    binary_backward<F>(ctx, state, ins, step, x, grad, cross_warp);            \
    break;
    FXFUSE_BINARY_OPS(FXFUSE_BINARY_BACKWARD)
#undef FXFUSE_BINARY_BACKWARD
    FXFUSE_NORM_OPS(FXFUSE_BACKWARD_CASE)
    FXFUSE_REDUCTION_OPS(FXFUSE_BACKWARD_CASE)
    backward_row_op(ctx, state, ins, step, x, grad, s0, s1, cross_warp);
    break;
    default:
      break;
  }
  if (step.input_per_row && !step.output_per_row) {  // a per-row value broadcast to the row: sum its gradient
    float total[CHUNKS];
    row_allreduce_sum(ctx, grad, total, cross_warp);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
      for (int j = 0; j < VEC; ++j) grad[c][j] = total[0];
  }
}

#undef FXFUSE_BACKWARD_CASE

// ================================================================ the backward row kernel

// cur := the input of instruction `end`, run forward from the row y. With `keep`, the norms and reductions on the way
// compute their statistics and keep them; without, they apply the kept ones (pointwise work only). One call site for
// both, so one inlined copy of the ops' switch (two, as a template flag, took row_backward_bf16.cu 120 s of nvcc, one
// 57 s).
template <typename Ctx, int CHUNKS, int VEC>
__device__ __forceinline__ void run_forward_to(const Ctx& ctx, const BackwardProgram& bprog, int end, bool keep,
                                               const Values<CHUNKS, VEC>& y, Values<CHUNKS, VEC>& cur,
                                               KeptStatistics<CHUNKS>& kept, CrossWarp<CHUNKS>& cross_warp) {
  float no_slots[1][CHUNKS][VEC];
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
    for (int j = 0; j < VEC; ++j) cur[c][j] = y[c][j];
  for (int pc = 0; pc < end; ++pc) {
    const Instruction& ins = bprog.row.code[pc];
    if (run_pointwise<CHUNKS, VEC, 0>(ins, cur, no_slots, ctx)) continue;
    float s0[CHUNKS], s1[CHUNKS];
    if (keep) {
      run_statistic(ctx, ins, cur, s0, s1, cross_warp, nullptr);
      kept.keep(bprog.steps[pc].row_op, s0, s1);
    } else {
      kept.read(bprog.steps[pc].row_op, s0, s1);
    }
    apply_row_op(ctx, ins, cur, s0, s1);
  }
}

// Blocks of rows_per_block rows of TPR threads, persistent as the forward's: the next row group's GEMM output (and
// grad_out, where it is whole contiguous rows) is copied into shared memory while the current one computes. On
// return the block writes its GRAD_SUMMED accumulators as its partial rows.
//
// Dynamic shared memory: the staging slots of the GEMM output, then grad_out's (if staged), then the accumulators.
template <class S>
__global__ void __launch_bounds__(kMaxBackwardThreads, 1)
    row_backward_kernel(const __grid_constant__ BackwardProgram bprog) {
  constexpr int VEC = S::VEC;
  constexpr int CHUNKS = kRowValues / VEC;
  using Ctx = RowContext<S, CHUNKS, false>;
  using Raw = typename S::Raw;
  const RowProgram& prog = bprog.row;
  __shared__ CrossWarp<CHUNKS> cross_warp;
  __shared__ CrossWarp<2 * CHUNKS> pair_exchange;

  const int tpr_shift = __popc(prog.threads_per_row - 1);
  const int lane = threadIdx.x & (prog.threads_per_row - 1);
  const int64_t row_groups = (prog.rows + bprog.rows_per_block - 1) / bprog.rows_per_block;
  const auto clamped_row = [&](int64_t group) {
    const int64_t row = group * bprog.rows_per_block + (threadIdx.x >> tpr_shift);
    return row < prog.rows ? row : prog.rows - 1;
  };
  uint4* staged_input = row_shared;
  uint4* staged_grad = row_shared + CHUNKS * blockDim.x;
  float* accumulators = reinterpret_cast<float*>(row_shared + (bprog.stage_grad_output ? 2 : 1) * CHUNKS * blockDim.x);
  const auto stage = [&](int64_t group) {
    const int64_t row = clamped_row(group);
    stage_chunks<S, CHUNKS>(prog, static_cast<const Raw*>(prog.input) + row * prog.features, lane, staged_input);
    if (bprog.stage_grad_output) {
      const RowParam& g = prog.params[bprog.grad_output_param];
      stage_chunks<S, CHUNKS>(prog, static_cast<const Raw*>(g.ptr) + row * g.row_stride, lane, staged_grad);
    }
    commit_async_copies();
  };

  BackwardRow<CHUNKS, VEC> state{bprog, accumulators, pair_exchange, 0, false};
  for (int a = 0; a < bprog.accumulators; ++a)
#pragma unroll
    for (int k = 0; k < CHUNKS * VEC; ++k) state.accumulator(a)[k * blockDim.x] = 0.0f;
  if (blockIdx.x < row_groups) stage(blockIdx.x);

  const int last = prog.num_instructions - 1;
  for (int64_t group = blockIdx.x; group < row_groups; group += gridDim.x) {
    state.row = group * bprog.rows_per_block + (threadIdx.x >> tpr_shift);
    state.active = state.row < prog.rows;
    const Ctx ctx{prog, clamped_row(group), lane};
    float y[CHUNKS][VEC], grad[CHUNKS][VEC], cur[CHUNKS][VEC];
    wait_async_copies();
    unstage_chunks<S>(ctx, staged_input, y);
    if (bprog.stage_grad_output) unstage_chunks<S>(ctx, staged_grad, grad);
    else
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) ctx.load(bprog.grad_output_param, c, grad[c]);
    if (group + gridDim.x < row_groups) stage(group + gridDim.x);

    // Backwards from the last instruction, each instruction's input recomputed from the row; the first pass (up to
    // the last instruction's input) keeps the statistics of the norms and reductions on the way.
    KeptStatistics<CHUNKS> kept;
    for (int pc = last; pc >= 0; --pc) {
      const Instruction& ins = prog.code[pc];
      run_forward_to(ctx, bprog, pc, /*keep=*/pc == last, y, cur, kept, cross_warp);
      float s0[CHUNKS], s1[CHUNKS];
      if (bprog.steps[pc].row_op >= 0) {
        if (pc == last) run_statistic(ctx, ins, cur, s0, s1, cross_warp, nullptr);
        else kept.read(bprog.steps[pc].row_op, s0, s1);
      }
      backward_step(ctx, state, ins, bprog.steps[pc], cur, grad, s0, s1, cross_warp);
    }

    if (!state.active || prog.output == nullptr) continue;
    Raw* out = static_cast<Raw*>(prog.output) + state.row * prog.features;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
      if (ctx.chunk_count(c) > 0) store_vector<S>(out + ctx.element(c, 0), grad[c]);
  }

  // This block's partial rows of the gradients summed over rows, in 16-byte stores (scalar ones, 32 bytes apart,
  // took 12% of the stall samples).
  const int64_t partial_row = int64_t{blockIdx.x} * bprog.rows_per_block + (threadIdx.x >> tpr_shift);
  const Ctx ctx{prog, 0, lane};
  for (int k = 0; k < kMaxParams; ++k) {
    const ParamGrad& grad = bprog.grads[k];
    if (grad.kind != GRAD_SUMMED) continue;
    const float* sum = state.accumulator(grad.accumulator);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      if (ctx.chunk_count(c) == 0) continue;
      float4* out = reinterpret_cast<float4*>(grad.out + partial_row * prog.features + ctx.element(c, 0));
#pragma unroll
      for (int q = 0; q < VEC / 4; ++q) {
        const int k0 = (c * VEC + 4 * q) * blockDim.x;
        out[q] = make_float4(sum[k0], sum[k0 + blockDim.x], sum[k0 + 2 * blockDim.x], sum[k0 + 3 * blockDim.x]);
      }
    }
  }
}

// ================================================================ the summed gradients' last step

// Blocks of kFinishColumns (accumulator, feature) columns, contiguous across a warp's lanes, by kFinishSlices
// slices of the partial rows: each thread sums every kFinishSlices-th partial row of its column in fp32 (four
// running sums, so that its loads overlap), then the first slice adds the slices' sums in shared memory and
// stores the column's gradient in the params' type. With the slices a thread loads every eighth partial row (the
// examples' backward grid of 132 blocks of one row: 17 loads) and the grid of their 2 x 8192 columns has 131 K
// threads, not 16 K.
constexpr int kFinishColumns = 32;
constexpr int kFinishSlices = 8;

template <class S>
__global__ void __launch_bounds__(kFinishColumns * kFinishSlices)
    finish_summed_grads_kernel(const __grid_constant__ SummedGrads grads) {
  __shared__ float slice_sums[kFinishSlices][kFinishColumns + 1];
  const int lane = threadIdx.x % kFinishColumns, slice = threadIdx.x / kFinishColumns;
  const int64_t column = int64_t{blockIdx.x} * kFinishColumns + lane;
  const int64_t columns = int64_t{grads.accumulators} * grads.features;
  float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (column < columns) {
    const int64_t accumulator = column / grads.features, feature = column % grads.features;
    const float* partial = grads.partials + accumulator * grads.partial_rows * grads.features + feature;
    const int64_t step = int64_t{kFinishSlices} * grads.features;
    int64_t p = slice;
    for (; p + 3 * kFinishSlices < grads.partial_rows; p += 4 * kFinishSlices)
#pragma unroll
      for (int k = 0; k < 4; ++k) sums[k] += partial[p * grads.features + k * step];
    for (; p < grads.partial_rows; p += kFinishSlices) sums[0] += partial[p * grads.features];
  }
  slice_sums[slice][lane] = (sums[0] + sums[1]) + (sums[2] + sums[3]);
  __syncthreads();
  if (slice != 0 || column >= columns) return;
  float total = slice_sums[0][lane];
#pragma unroll
  for (int k = 1; k < kFinishSlices; ++k) total += slice_sums[k][lane];
  const int64_t accumulator = column / grads.features, feature = column % grads.features;
  static_cast<typename S::Raw*>(grads.out[accumulator])[feature] = S::from_float(total);
}

// ================================================================ launchers (declared in program_format.cuh)

template <class S>
int64_t backward_shared_bytes(const BackwardProgram& prog, int threads) {
  const int64_t staging = (prog.stage_grad_output ? 2 : 1) * int64_t{threads} * kRowValues * sizeof(typename S::Raw);
  return staging + int64_t{prog.accumulators} * kRowValues * threads * static_cast<int64_t>(sizeof(float));
}

template <class S>
int64_t row_backward_blocks(const BackwardProgram& prog, int threads) {
  const RowGrid grid = row_grid(row_backward_kernel<S>, threads, backward_shared_bytes<S>(prog, threads));
  const int64_t row_groups = (prog.row.rows + prog.rows_per_block - 1) / prog.rows_per_block;
  return std::min(row_groups, grid.blocks);
}

template <class S>
void launch_row_backward(const BackwardProgram& prog, int64_t blocks, int threads, cudaStream_t stream) {
  const int64_t shared_bytes = backward_shared_bytes<S>(prog, threads);
  row_backward_kernel<S><<<static_cast<unsigned>(blocks), threads, shared_bytes, stream>>>(prog);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class S>
void launch_finish_summed_grads(const SummedGrads& grads, cudaStream_t stream) {
  const int64_t columns = int64_t{grads.accumulators} * grads.features;
  const auto blocks = static_cast<unsigned>((columns + kFinishColumns - 1) / kFinishColumns);
  finish_summed_grads_kernel<S><<<blocks, kFinishColumns * kFinishSlices, 0, stream>>>(grads);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fxfuse
