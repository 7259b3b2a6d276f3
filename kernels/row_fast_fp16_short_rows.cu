// The fast row kernel for fp16 programs whose rows are 512 features or fewer (16 values a thread).
// One translation unit per kernel: ninja builds them in parallel.
#include "fast_row.cuh"

namespace fxfuse {

template bool launch_fast_row_program<Fp16Storage, kRowValues>(const RowProgram&, const RowLaunch&, cudaStream_t);

}  // namespace fxfuse
