// The fast row kernel for fp32 programs.
// One translation unit per kernel: ninja builds them in parallel.
#include "fast_row.cuh"

namespace fxfuse {

template bool launch_fast_row_program<Fp32Storage, kRowValues>(const RowProgram&, const RowLaunch&, cudaStream_t);

}  // namespace fxfuse
