// The row kernels for bf16 / fp16 programs that keep values in slots (one translation unit per launcher: ninja builds them in parallel).
#include "interpreter.cuh"

namespace fxfuse {

void launch_row_program_16bit_slots(const RowProgram& prog, const RowLaunch& launch, cudaStream_t stream) {
  launch_row_program<2, 2>(prog, launch, stream);
}

}  // namespace fxfuse
