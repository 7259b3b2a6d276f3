// The fast row kernel for fp16 programs with libdevice ops, on whole rows (as many features as the threads hold),
// and the chains with them (FXFUSE_LIBM_ROW_CHAINS); row_fast_fp16_16_values.cu launches them. One translation unit
// per kernel: ninja builds them in parallel.
#include "fast_row.cuh"

namespace fxfuse {

template RowKernel libm_row_kernel<Fp16Storage, true>();
template RowKernel libm_chain_kernel<Fp16Storage, false>(const RowProgram&);
template RowKernel libm_chain_kernel<Fp16Storage, true>(const RowProgram&);

}  // namespace fxfuse
