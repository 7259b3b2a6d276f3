// The general row kernel (with the rare paths) for fp16 programs with register slots.
// One translation unit per kernel: ninja builds them in parallel.
#include "interpreter.cuh"

namespace fxfuse {

template bool launch_row_program<Fp16Storage, kMaxSlots, true>(const RowProgram&, const RowLaunch&, cudaStream_t);

}  // namespace fxfuse
