// The fast row kernel for bf16 programs.
// One translation unit per kernel: ninja builds them in parallel.
#include "fast_row.cuh"

namespace fxfuse {

template void launch_fast_row_program<Bf16Storage>(const RowProgram&, const RowLaunch&, cudaStream_t);

}  // namespace fxfuse
