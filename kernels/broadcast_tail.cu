// The broadcast tail kernels, for every storage type.
#include "interpreter.cuh"

namespace fxfuse {

template void launch_broadcast_tail<Fp32Storage>(const TailProgram&, bool, cudaStream_t);
template void launch_broadcast_tail<Bf16Storage>(const TailProgram&, bool, cudaStream_t);
template void launch_broadcast_tail<Fp16Storage>(const TailProgram&, bool, cudaStream_t);

}  // namespace fxfuse
