// A feature pool's weight averaging: the CUDA kernel of torch.ops.fxfuse.mean_of_row_groups(tensor, size).
//
//   out[g, c] = (in[g * size, c] + ... + in[g * size + size - 1, c]) * (1 / size),  g < rows / size
//
// Reference: fxfuse/library.py::mean_of_row_groups_reference (ATen's mean over the group dim; a partial group at
// the end is dropped, as avg_pool1d drops a partial window). An avg_pool1d over a GEMM's output features folds into
// the GEMM as this mean of its weight's rows (and of its bias's values), taken at every call.
//
// Strategy: a grid-stride loop over the output's 16-byte vectors (elements where rows are not whole vectors): a
// thread loads the group's `size` input vectors of its columns (streaming loads: the input is read once), sums them
// in fp32 and scales once. ATen's mean over the group dim of the pool example's weight (bf16, 8192 x 8192 by 4) took
// 73.3 µs on an H200, this kernel's first version 45.3 (dev/pool_mean_probe.py; NOTES, twenty-eighth session).
//
// Limits (the host code, mean_of_row_groups.cpp, sends anything else to the reference): contiguous fp32, bf16 or
// fp16 input of at least `size` rows; groups of more than 128 rows only where the output fills the grid.
#include "interpreter.cuh"

namespace fxfuse {

// ================================================================ the kernel

// VALUES: S::VEC where a row is whole 16-byte vectors, 1 otherwise.
template <class S, int VALUES>
__global__ void row_group_mean_kernel(const RowGroupMean job) {
  using Raw = typename S::Raw;
  const Raw* in = static_cast<const Raw*>(job.in);
  Raw* out = static_cast<Raw*>(job.out);
  const int64_t units_per_row = job.columns / VALUES;
  const int64_t units = job.groups * units_per_row;
  const float scale = 1.0f / static_cast<float>(job.size);
  for (int64_t unit = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; unit < units;
       unit += int64_t{gridDim.x} * blockDim.x) {
    const int64_t group = unit / units_per_row;
    const int64_t column = (unit - group * units_per_row) * VALUES;
    const Raw* first = in + group * job.size * job.columns + column;
    float sums[VALUES] = {};
    for (int64_t r = 0; r < job.size; ++r) {
      float values[VALUES];
      if constexpr (VALUES == 1) {
        values[0] = S::to_float(__ldcs(first + r * job.columns));
      } else {
        S::unpack(__ldcs(reinterpret_cast<const uint4*>(first + r * job.columns)), values);
      }
#pragma unroll
      for (int j = 0; j < VALUES; ++j) sums[j] += values[j];
    }
#pragma unroll
    for (int j = 0; j < VALUES; ++j) sums[j] *= scale;
    if constexpr (VALUES == 1) {
      out[group * job.columns + column] = S::from_float(sums[0]);
    } else {
      store_vector<S>(out + group * job.columns + column, sums);
    }
  }
}

// ================================================================ the launcher

constexpr int kRowGroupMeanThreads = 256;
// The most rows a thread sums in turn where the grid leaves the GPU part idle.
constexpr int64_t kRowGroupMeanMostRowsAlone = 128;

template <class S>
bool launch_row_group_mean(const RowGroupMean& job, cudaStream_t stream) {
  const auto kernel = job.vectors ? row_group_mean_kernel<S, S::VEC> : row_group_mean_kernel<S, 1>;
  const int64_t units = job.groups * (job.vectors ? job.columns / S::VEC : job.columns);
  const int64_t needed = (units + kRowGroupMeanThreads - 1) / kRowGroupMeanThreads;
  const int64_t resident = row_grid(kernel, kRowGroupMeanThreads, 0).blocks;
  // A thread per output vector, each summing its group's rows in turn: few groups of many rows (a pool over all
  // 8192 features of an 8192 x 8192 bf16 weight: 1574 us, ATen's mean 48 us, on the H200) go to ATen.
  if (needed < resident && job.size > kRowGroupMeanMostRowsAlone) return false;
  kernel<<<static_cast<unsigned>(std::min(needed, resident)), kRowGroupMeanThreads, 0, stream>>>(job);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

template bool launch_row_group_mean<Fp32Storage>(const RowGroupMean&, cudaStream_t);
template bool launch_row_group_mean<Bf16Storage>(const RowGroupMean&, cudaStream_t);
template bool launch_row_group_mean<Fp16Storage>(const RowGroupMean&, cudaStream_t);

}  // namespace fxfuse
