// The fast row kernel for fp16 programs without libdevice ops whose rows are longer than 4096 features (32 values a
// thread: fast_row_values). One translation unit per kernel: ninja builds them in parallel.
#include "fast_row.cuh"

namespace fxfuse {

template bool launch_fast_row_program<Fp16Storage, kLongRowValues>(const RowProgram&, const RowLaunch&, cudaStream_t);

}  // namespace fxfuse
