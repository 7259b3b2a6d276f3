// The fast row kernel for fp16 programs whose rows are longer than 512 features (32 values a thread), but for its
// builds with libdevice ops: row_fast_fp16_libm_whole_rows.cu and row_fast_fp16_libm_other_rows.cu.
// One translation unit per kernel: ninja builds them in parallel.
#include "fast_row.cuh"

namespace fxfuse {

extern template RowKernel libm_row_kernel<Fp16Storage, kLongRowValues, true>();
extern template RowKernel libm_row_kernel<Fp16Storage, kLongRowValues, false>();
template bool launch_fast_row_program<Fp16Storage, kLongRowValues>(const RowProgram&, const RowLaunch&, cudaStream_t);

}  // namespace fxfuse
