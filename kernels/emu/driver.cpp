// The subset of the CUDA driver API that cudarc calls for the gateway, over host memory:
// device pointers are host pointers, copies are memcpy, a module's functions are the
// emulated kernels registered by name, launches run them through sched.cpp. Stream work is
// synchronous. EMU_TOTAL_MB sets the device memory reported (default 4096); EMU_TRACE=1 logs
// calls.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <map>
#include <mutex>

typedef void (*emu_tramp)(void**);
extern "C" emu_tramp emu_lookup(const char* name);
extern "C" void emu_launch(emu_tramp k, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                           unsigned bz, void** params);

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
static size_t total_mem() {
  const char* t = getenv("EMU_TOTAL_MB");
  return (size_t)(t ? atol(t) : 4096) << 20;
}
static std::map<uintptr_t, size_t> allocs;
static size_t allocated;
static std::mutex mu;
static int ctx_dummy, stream_dummy, module_dummy;
static void* current_ctx;
static bool trace = getenv("EMU_TRACE") != nullptr;
#define T(name) if (trace) fprintf(stderr, "EMU %s\n", name)

static void* dalloc(size_t n) {
  std::lock_guard<std::mutex> g(mu);
  void* p = aligned_alloc(256, (n + 255) & ~(size_t)255);
  if (!p) return nullptr;
  allocs[(uintptr_t)p] = n;
  allocated += n;
  return p;
}
static void dfree(void* p) {
  std::lock_guard<std::mutex> g(mu);
  auto it = allocs.find((uintptr_t)p);
  if (it == allocs.end()) { fprintf(stderr, "EMU: free of unknown pointer %p\n", p); abort(); }
  allocated -= it->second;
  allocs.erase(it);
  free(p);
}

extern "C" {
CUresult cuInit(unsigned) { T("cuInit"); return 0; }
CUresult cuDriverGetVersion(int* v) { *v = 13000; return 0; }
CUresult cuDeviceGetCount(int* n) { *n = 1; return 0; }
CUresult cuDeviceGet(int* d, int o) { T("cuDeviceGet"); if (o != 0) return 101; *d = 0; return 0; }
CUresult cuDeviceGetName(char* s, int len, int) { snprintf(s, len, "EMU"); return 0; }
CUresult cuDeviceTotalMem_v2(size_t* b, int) { *b = total_mem(); return 0; }
CUresult cuDeviceGetAttribute(int* v, int attr, int) {
  if (trace) fprintf(stderr, "EMU cuDeviceGetAttribute %d\n", attr);
  switch (attr) {
    case 75: *v = 9; break;   // compute capability major
    case 76: *v = 0; break;
    case 1: *v = 1024; break; // max threads per block
    case 16: *v = 132; break; // multiprocessors
    default: *v = 0;
  }
  return 0;
}
CUresult cuDevicePrimaryCtxRetain(void** c, int) { T("retain"); *c = &ctx_dummy; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(int) { return 0; }
CUresult cuCtxSetCurrent(void* c) { current_ctx = c; return 0; }
CUresult cuCtxGetCurrent(void** c) { *c = current_ctx; return 0; }
CUresult cuCtxSynchronize() { return 0; }
CUresult cuCtxGetDevice(int* d) { *d = 0; return 0; }
CUresult cuStreamCreate(void** s, unsigned) { T("stream"); *s = &stream_dummy; return 0; }
CUresult cuStreamCreateWithPriority(void** s, unsigned, int) { *s = &stream_dummy; return 0; }
CUresult cuStreamDestroy_v2(void*) { return 0; }
CUresult cuStreamSynchronize(void*) { return 0; }
CUresult cuStreamQuery(void*) { return 0; }
CUresult cuMemGetInfo_v2(size_t* f, size_t* t) {
  *t = total_mem();
  *f = *t > allocated ? *t - allocated : 0;
  if (trace) fprintf(stderr, "EMU meminfo free %zu total %zu\n", *f, *t);
  return 0;
}
CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
  if (allocated + n > total_mem()) return 2;
  void* q = dalloc(n); if (!q) return 2; *p = (CUdeviceptr)q; return 0;
}
CUresult cuMemAllocAsync(CUdeviceptr* p, size_t n, void*) { return cuMemAlloc_v2(p, n); }
CUresult cuMemFree_v2(CUdeviceptr p) { dfree((void*)p); return 0; }
CUresult cuMemFreeAsync(CUdeviceptr p, void*) { dfree((void*)p); return 0; }
CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) { memset((void*)p, v, n); return 0; }
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, void*) { memset((void*)p, v, n); return 0; }
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* s, size_t n) { memcpy((void*)d, s, n); return 0; }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t n, void*) { memcpy((void*)d, s, n); return 0; }
CUresult cuMemcpyDtoH_v2(void* d, CUdeviceptr s, size_t n) { memcpy(d, (void*)s, n); return 0; }
CUresult cuMemcpyDtoHAsync_v2(void* d, CUdeviceptr s, size_t n, void*) { memcpy(d, (void*)s, n); return 0; }
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { memmove((void*)d, (void*)s, n); return 0; }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void*) { memmove((void*)d, (void*)s, n); return 0; }
CUresult cuModuleLoadData(void** m, const void*) { T("module"); *m = &module_dummy; return 0; }
CUresult cuModuleUnload(void*) { return 0; }
CUresult cuModuleGetFunction(void** f, void*, const char* name) {
  emu_tramp t = emu_lookup(name);
  if (trace) fprintf(stderr, "EMU function %s -> %p\n", name, (void*)t);
  if (!t) return 500;  // CUDA_ERROR_NOT_FOUND
  *f = (void*)t;
  return 0;
}
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned, void*, void** params, void**) {
  emu_launch((emu_tramp)f, gx, gy, gz, bx, by, bz, params);
  return 0;
}
CUresult cuFuncGetAttribute(int* v, int, void*) { *v = 0; return 0; }
CUresult cuFuncSetAttribute(void*, int, int) { return 0; }
CUresult cuGetErrorString(CUresult, const char** s) { *s = "emulated error"; return 0; }
CUresult cuGetErrorName(CUresult, const char** s) { *s = "EMU_ERROR"; return 0; }
CUresult cuEventCreate(void** e, unsigned) { static int ev; *e = &ev; return 0; }
CUresult cuEventDestroy_v2(void*) { return 0; }
CUresult cuEventRecord(void*, void*) { return 0; }
CUresult cuEventSynchronize(void*) { return 0; }
CUresult cuStreamWaitEvent(void*, void*, unsigned) { return 0; }
}
