// The row kernels for fp32 programs without slots (one translation unit per launcher: ninja builds them in parallel).
#include "interpreter.cuh"

namespace fxfuse {

void launch_row_program_fp32(const RowProgram& prog, const RowLaunch& launch, cudaStream_t stream) {
  launch_row_program<4, 0>(prog, launch, stream);
}

}  // namespace fxfuse
