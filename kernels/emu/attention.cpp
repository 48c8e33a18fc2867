// The kernels of ../src/attention.cu compiled for the emulator, registered under their CUDA names.
#include "emu.h"
#include "../src/attention.cu"

#define PER_HEAD_REG(T, H)                                                                     \
  EMU_REG(paged_attention_##T##_##H##_g1)                                                    \
  EMU_REG(paged_attention_##T##_##H##_g2)                                                    \
  EMU_REG(paged_attention_##T##_##H##_g4)                                                    \
  EMU_REG(paged_attention_##T##_##H##_g8)
#define PER_TYPE_REG(T)                                                                        \
  PER_HEAD_REG(T, 64)                                                                        \
  PER_HEAD_REG(T, 80)                                                                        \
  PER_HEAD_REG(T, 96)                                                                        \
  PER_HEAD_REG(T, 128)                                                                       \
  EMU_REG(paged_attention_reduce_##T)                                                        \
  EMU_REG(reshape_and_cache_##T)
PER_TYPE_REG(f32)
PER_TYPE_REG(f16)
PER_TYPE_REG(bf16)
EMU_REG(copy_blocks)
