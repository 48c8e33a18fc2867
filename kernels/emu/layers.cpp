// The kernels of ../src/layers.cu compiled for the emulator, registered under their CUDA names.
#include "emu.h"
#include "../src/layers.cu"

#define PER_TYPE_REG(T)                                                                        \
  EMU_REG(embed_##T)                                                                         \
  EMU_REG(rms_norm_##T)                                                                      \
  EMU_REG(rope_split_##T)                                                                    \
  EMU_REG(silu_mul_##T)                                                                      \
  EMU_REG(gather_rows_##T)
PER_TYPE_REG(f32)
PER_TYPE_REG(f16)
PER_TYPE_REG(bf16)
