// The row kernel for fp16 programs with register slots (one translation unit per kernel: ninja builds them in parallel).
#include "interpreter.cuh"

namespace fxfuse {

template void launch_row_program<Fp16Storage, kMaxSlots>(const RowProgram&, const RowLaunch&, cudaStream_t);

}  // namespace fxfuse
