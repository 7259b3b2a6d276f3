// The general row kernel (with the rare paths) for bf16 programs without slots.
// One translation unit per kernel: ninja builds them in parallel.
#include "interpreter.cuh"

namespace fxfuse {

template bool launch_row_program<Bf16Storage, 0, true>(const RowProgram&, const RowLaunch&, cudaStream_t);

}  // namespace fxfuse
