// cublasGemmEx (all the gateway calls) over host memory for the CUDA emulator: column-major,
// f32 accumulation, f32/f16/bf16 operands, as cuBLAS defines it.
#include <stdint.h>
#include <string.h>
#include <stdio.h>
#include <stdlib.h>
#include <vector>
static float ld(const void* p, size_t i, int t) {
  if (t == 0) return ((const float*)p)[i];
  uint16_t b = ((const uint16_t*)p)[i];
  if (t == 2) { _Float16 h; memcpy(&h, &b, 2); return (float)h; }
  if (t == 14) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
  fprintf(stderr, "EMU cublas: type %d\n", t); abort();
}
static void st(void* p, size_t i, int t, float x) {
  if (t == 0) { ((float*)p)[i] = x; return; }
  uint16_t b;
  if (t == 2) { _Float16 h = (_Float16)x; memcpy(&b, &h, 2); }
  else { uint32_t u; memcpy(&u, &x, 4); u += 0x7fff + ((u >> 16) & 1); b = u >> 16; }
  ((uint16_t*)p)[i] = b;
}
static int handle_dummy;
extern "C" {
int cublasCreate_v2(void** h) { *h = &handle_dummy; return 0; }
int cublasDestroy_v2(void*) { return 0; }
int cublasSetStream_v2(void*, void*) { return 0; }
int cublasSetMathMode(void*, int) { return 0; }
int cublasSetWorkspace_v2(void*, void*, size_t) { return 0; }
int cublasGemmEx(void*, int ta, int tb, int m, int n, int k, const void* alpha, const void* A, int at,
                 int lda, const void* B, int bt, int ldb, const void* beta, void* C, int ct, int ldc,
                 int compute, int) {
  if (compute != 68) { fprintf(stderr, "EMU cublas: compute %d\n", compute); abort(); }
  float a = *(const float*)alpha, b = *(const float*)beta;
  std::vector<float> col(k);
  for (int j = 0; j < n; ++j) {
    for (int l = 0; l < k; ++l) col[l] = ld(B, tb ? (size_t)j + (size_t)l * ldb : (size_t)l + (size_t)j * ldb, bt);
    for (int i = 0; i < m; ++i) {
      float acc = 0.f;
      if (ta) { const size_t base = (size_t)i * lda; for (int l = 0; l < k; ++l) acc += ld(A, base + l, at) * col[l]; }
      else for (int l = 0; l < k; ++l) acc += ld(A, (size_t)i + (size_t)l * lda, at) * col[l];
      size_t ci = (size_t)i + (size_t)j * ldc;
      float prev = b != 0.f ? ld(C, ci, ct) : 0.f;
      st(C, ci, ct, a * acc + b * prev);
    }
  }
  return 0;
}
}
