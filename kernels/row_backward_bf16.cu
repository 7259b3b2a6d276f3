// The backward row kernel for bf16. One translation unit per storage type: ninja builds them in parallel.
#include "backward_interpreter.cuh"

namespace fxfuse {

template int64_t row_backward_blocks<Bf16Storage>(const BackwardProgram&, int);
template void launch_row_backward<Bf16Storage>(const BackwardProgram&, int64_t, int, cudaStream_t);
template void launch_finish_summed_grads<Bf16Storage>(const SummedGrads&, cudaStream_t);

}  // namespace fxfuse
