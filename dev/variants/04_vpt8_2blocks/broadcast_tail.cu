// The broadcast tail kernels, for every element size.
#include "interpreter.cuh"

namespace fxfuse {

void launch_broadcast_tail(const TailProgram& prog, int element_bytes, cudaStream_t stream) {
  if (element_bytes == 4) launch_broadcast_tail<4>(prog, stream);
  else launch_broadcast_tail<2>(prog, stream);
}

}  // namespace fxfuse
