// Compiles our CUDA kernels (attention.cu, layers.cu) as plain C++ for a CPU emulator of the
// CUDA driver (driver.cpp, sched.cpp): every GPU thread of a block is a fiber, blocks run one
// after another on one OS thread. `__shared__` becomes `static`, which is per block because
// blocks never overlap; `__syncthreads` and warp shuffles are barriers in the fiber scheduler.
// It checks indexing, launch arguments and the host code's use of the driver without a GPU;
// it says nothing about speed, and warp-synchronous code that relies on lockstep execution
// without a shuffle or barrier would not be modelled (our kernels have none).
#pragma once
#include <stdint.h>
#include <utility>
#include <stddef.h>
#include <math.h>
#include <string.h>
#include <algorithm>
using std::max;
using std::min;
struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
extern "C" const dim3& emu_tid();
extern dim3 emu_blockIdx, emu_blockDim, emu_gridDim;
extern "C" void emu_syncthreads();
extern "C" float emu_shfl_xor(float v, int o);
#define threadIdx (emu_tid())
#define blockIdx emu_blockIdx
#define blockDim emu_blockDim
#define gridDim emu_gridDim
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static
#define __launch_bounds__(x)
#define __syncthreads() emu_syncthreads()
inline float __shfl_xor_sync(unsigned, float v, int o) { return emu_shfl_xor(v, o); }
inline float __expf(float x) { return expf(x); }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
struct __half { uint16_t b; };
struct __half2 { __half x, y; };
struct __nv_bfloat16 { uint16_t b; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline float __half2float(__half h) { _Float16 f; memcpy(&f, &h.b, 2); return (float)f; }
inline __half __float2half(float x) { _Float16 f = (_Float16)x; __half h; memcpy(&h.b, &f, 2); return h; }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
inline float __bfloat162float(__nv_bfloat16 h) { uint32_t u = (uint32_t)h.b << 16; float f; memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16(float x) {
  uint32_t u; memcpy(&u, &x, 4);
  __nv_bfloat16 h;
  if ((u & 0x7fffffff) > 0x7f800000) { h.b = 0x7fc0; return h; }
  u += 0x7fff + ((u >> 16) & 1);
  h.b = (uint16_t)(u >> 16);
  return h;
}
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return {__bfloat162float(h.x), __bfloat162float(h.y)}; }

// Kernel registry: name -> trampoline unpacking cuLaunchKernel's void** params.
typedef void (*emu_tramp)(void**);
extern "C" void emu_register(const char* name, emu_tramp t);
template <typename... A, size_t... I>
void emu_call_impl(void (*f)(A...), void** p, std::index_sequence<I...>) { f(*(A*)p[I]...); }
template <typename... A>
void emu_call(void (*f)(A...), void** p) { emu_call_impl(f, p, std::index_sequence_for<A...>{}); }
#define EMU_REG(name) \
  static int reg_##name = (emu_register(#name, [](void** p) { emu_call(name, p); }), 0);
