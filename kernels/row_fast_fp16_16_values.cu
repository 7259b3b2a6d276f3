// The fast row kernel for fp16 programs of rows of 4096 features or fewer, and for every program with libdevice ops
// (16 values a thread: fast_row_values), but for its builds with those ops and its chains with them
// (FXFUSE_LIBM_ROW_CHAINS): row_fast_fp16_libm_whole_rows.cu and row_fast_fp16_libm_other_rows.cu. One translation
// unit per kernel: ninja builds them in parallel.
#include "fast_row.cuh"

namespace fxfuse {

extern template RowKernel libm_row_kernel<Fp16Storage, true>();
extern template RowKernel libm_row_kernel<Fp16Storage, false>();
extern template RowKernel libm_chain_kernel<Fp16Storage, false>(const RowProgram&);
extern template RowKernel libm_chain_kernel<Fp16Storage, true>(const RowProgram&);
template bool launch_fast_row_program<Fp16Storage, kRowValues>(const RowProgram&, const RowLaunch&, cudaStream_t);

}  // namespace fxfuse
