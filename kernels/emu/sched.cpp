// The emulator's scheduler: every thread of a block is a fiber on the calling OS thread, run
// round-robin until it finishes or waits at a block barrier (__syncthreads) or a warp barrier
// (shuffles); a barrier opens when every live thread of its block or warp waits there, and a
// state where none can open is reported as a deadlock. A switch is a few instructions
// (emu_swap), so kernels with a barrier per token still run at useful speed.
#include "emu.h"
#include <stdio.h>
#include <stdlib.h>
#include <map>
#include <string>

extern "C" void emu_swap(void** save_sp, void* new_sp);
asm(R"(
.text
.globl emu_swap
.type emu_swap,@function
emu_swap:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
)");

enum { RUN, WAIT_BLOCK, WAIT_WARP, DONE };
struct Fiber { void* sp; char* stack; dim3 tid; int state; };
static const size_t STACK = 64 << 10;
static Fiber fibers[1024];
static void* sched_sp;
static Fiber* cur;
static emu_tramp g_kernel;
static void** g_params;
static float xchg[32][32];
dim3 emu_blockIdx, emu_blockDim, emu_gridDim;

extern "C" const dim3& emu_tid() { return cur->tid; }

static void wait(int kind) {
  cur->state = kind;
  emu_swap(&cur->sp, sched_sp);
}
extern "C" void emu_syncthreads() { wait(WAIT_BLOCK); }
extern "C" float emu_shfl_xor(float v, int o) {
  int t = cur - fibers, w = t / 32, l = t % 32;
  xchg[w][l] = v;
  wait(WAIT_WARP);
  float r = xchg[w][l ^ o];
  wait(WAIT_WARP);
  return r;
}

extern "C" void emu_fiber_entry() {
  g_kernel(g_params);
  cur->state = DONE;
  emu_swap(&cur->sp, sched_sp);
  abort();
}

static void run_block(unsigned n) {
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = fibers[i];
    if (!f.stack) f.stack = (char*)aligned_alloc(64, STACK);
    uintptr_t top = ((uintptr_t)(f.stack + STACK)) & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = 0;                          // fake return address: entry sees rsp % 16 == 8
    *--sp = (void*)&emu_fiber_entry;    // popped by ret
    for (int r = 0; r < 6; ++r) *--sp = 0;
    f.sp = sp;
    f.state = RUN;
    f.tid.x = i % emu_blockDim.x;
    f.tid.y = (i / emu_blockDim.x) % emu_blockDim.y;
    f.tid.z = i / (emu_blockDim.x * emu_blockDim.y);
  }
  for (;;) {
    for (unsigned i = 0; i < n; ++i)
      if (fibers[i].state == RUN) {
        cur = &fibers[i];
        emu_swap(&sched_sp, fibers[i].sp);
      }
    unsigned done = 0, wb = 0;
    for (unsigned i = 0; i < n; ++i) {
      done += fibers[i].state == DONE;
      wb += fibers[i].state == WAIT_BLOCK;
    }
    if (done == n) return;
    bool released = false;
    if (wb && wb + done == n) {
      for (unsigned i = 0; i < n; ++i)
        if (fibers[i].state == WAIT_BLOCK) fibers[i].state = RUN;
      released = true;
    }
    for (unsigned w = 0; w * 32 < n; ++w) {
      unsigned e = std::min(n, w * 32 + 32), ww = 0, d = 0;
      for (unsigned i = w * 32; i < e; ++i) {
        ww += fibers[i].state == WAIT_WARP;
        d += fibers[i].state == DONE;
      }
      if (ww && ww + d == e - w * 32) {
        for (unsigned i = w * 32; i < e; ++i)
          if (fibers[i].state == WAIT_WARP) fibers[i].state = RUN;
        released = true;
      }
    }
    if (!released) {
      fprintf(stderr, "EMU: deadlock in block (%u,%u,%u)\n", emu_blockIdx.x, emu_blockIdx.y, emu_blockIdx.z);
      abort();
    }
  }
}

static std::map<std::string, emu_tramp>& registry() {
  static std::map<std::string, emu_tramp> r;
  return r;
}
extern "C" void emu_register(const char* name, emu_tramp t) { registry()[name] = t; }
extern "C" emu_tramp emu_lookup(const char* name) {
  auto it = registry().find(name);
  return it == registry().end() ? nullptr : it->second;
}

extern "C" void emu_launch(emu_tramp k, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                           unsigned bz, void** params) {
  if (bx * by * bz > 1024 || gx == 0 || gy == 0 || gz == 0 || gy > 65535 || gz > 65535) {
    fprintf(stderr, "EMU: bad launch grid (%u,%u,%u) block (%u,%u,%u)\n", gx, gy, gz, bx, by, bz);
    abort();
  }
  g_kernel = k;
  g_params = params;
  emu_gridDim = {gx, gy, gz};
  emu_blockDim = {bx, by, bz};
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        emu_blockIdx = {x, y, z};
        run_block(bx * by * bz);
      }
}
