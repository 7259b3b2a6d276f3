// The lean row kernel for fp32 programs with register slots.
// One translation unit per kernel: ninja builds them in parallel.
#include "interpreter.cuh"

namespace fxfuse {

template bool launch_row_program<Fp32Storage, kMaxSlots, false>(const RowProgram&, const RowLaunch&, cudaStream_t);

}  // namespace fxfuse
