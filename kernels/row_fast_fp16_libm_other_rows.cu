// The fast row kernel for fp16 programs with libdevice ops, on the other rows (masked chunks);
// row_fast_fp16_16_values.cu launches it. One translation unit per kernel: ninja builds them in parallel.
#include "fast_row.cuh"

namespace fxfuse {

template RowKernel libm_row_kernel<Fp16Storage, false>();

}  // namespace fxfuse
