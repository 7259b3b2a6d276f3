// The backward row kernel for fp32. One translation unit per storage type: ninja builds them in parallel.
#include "backward_interpreter.cuh"

namespace fxfuse {

template int64_t row_backward_blocks<Fp32Storage>(const BackwardProgram&, int);
template void launch_row_backward<Fp32Storage>(const BackwardProgram&, int64_t, int, cudaStream_t);
template void launch_finish_summed_grads<Fp32Storage>(const SummedGrads&, cudaStream_t);

}  // namespace fxfuse
