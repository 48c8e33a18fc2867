// The kernels of ../src/attention.cu compiled for the emulator, registered under their CUDA names.
#include "emu.h"
#include "../src/attention.cu"

#define PER_TYPE_REG(T)                                                                        \
  EMU_REG(paged_attention_##T##_64)                                                          \
  EMU_REG(paged_attention_##T##_80)                                                          \
  EMU_REG(paged_attention_##T##_96)                                                          \
  EMU_REG(paged_attention_##T##_128)                                                         \
  EMU_REG(paged_attention_reduce_##T)                                                        \
  EMU_REG(reshape_and_cache_##T)
PER_TYPE_REG(f32)
PER_TYPE_REG(f16)
PER_TYPE_REG(bf16)
EMU_REG(copy_blocks)
