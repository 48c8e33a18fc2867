// The per-token work of a llama-family layer around the matmuls (which go to cuBLAS) and the
// paged attention (attention.cu): embedding lookup, RMSNorm, RoPE, SwiGLU, row gathers.
//
// Every kernel takes one thread block per row (token) and strides its threads over the row's
// width, so consecutive threads touch consecutive addresses (coalesced) whatever the width.
// Math is in f32 whatever T is; results are rounded to T once, on store. The residual stream
// itself is T (as in vLLM): cuBLAS accumulates the projections into it in f32 with beta = 1.

#include "common.cuh"

__device__ __forceinline__ float block_sum(float v) {
  __shared__ float scratch[WARP];
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + WARP - 1) / WARP;
  return warp_sum(lane < warps ? scratch[lane] : 0.f);
}

// out[r] = table[ids[r]]
template <typename T>
__device__ void embed(T* __restrict__ out, const T* __restrict__ table,
                      const uint32_t* __restrict__ ids, int hidden) {
  const size_t src = (size_t)ids[blockIdx.x] * hidden, dst = (size_t)blockIdx.x * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[dst + i] = table[src + i];
}

// out[r] = x[r] / rms(x[r]) * w; the sum of squares is reduced in f32 across the block.
template <typename T>
__device__ void rms_norm(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ w,
                         float eps, int hidden) {
  const size_t row = (size_t)blockIdx.x * hidden;
  float ss = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = to_f(x[row + i]);
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss) / hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    from_f(out[row + i], to_f(x[row + i]) * inv * to_f(w[i]));
}

// Splits a fused QKV row `[q heads | k heads | v heads]` plus its bias (zeros for models
// without one: one add per element is cheaper than a second kernel variant) into q, k and v, rotating q and k to the row's position. `neox` pairs dimension i with i + d/2 (HF
// layout); otherwise pairs are (2i, 2i + 1) (llama.cpp's permuted GGUF layout). cos/sin are
// the engine's f32 tables, `[position][head_size / 2]`.
template <typename T>
__device__ void rope_split(T* __restrict__ q, T* __restrict__ k, T* __restrict__ v,
                           const T* __restrict__ qkv, const T* __restrict__ bias,
                           const uint32_t* __restrict__ pos, const float* __restrict__ cos_t,
                           const float* __restrict__ sin_t, int num_heads, int num_kv_heads,
                           int head_size, int neox) {
  const int half = head_size / 2;
  const int width = (num_heads + 2 * num_kv_heads) * head_size;
  const size_t r = blockIdx.x, src = r * width;
  const size_t p = (size_t)pos[r] * half;
  for (int idx = threadIdx.x; idx < (num_heads + num_kv_heads) * half; idx += blockDim.x) {
    const int head = idx / half, i = idx % half;
    const int a_i = neox ? i : 2 * i, b_i = neox ? i + half : 2 * i + 1;
    const int base = head * head_size;
    const float a = to_f(qkv[src + base + a_i]) + to_f(bias[base + a_i]);
    const float b = to_f(qkv[src + base + b_i]) + to_f(bias[base + b_i]);
    const float c = cos_t[p + i], s = sin_t[p + i];
    T* dst = head < num_heads ? q + r * num_heads * head_size + base
                              : k + r * num_kv_heads * head_size + (base - num_heads * head_size);
    from_f(dst[a_i], a * c - b * s);
    from_f(dst[b_i], a * s + b * c);
  }
  const int kv = num_kv_heads * head_size, v_off = (num_heads + num_kv_heads) * head_size;
  for (int i = threadIdx.x; i < kv; i += blockDim.x) {
    from_f(v[r * kv + i], to_f(qkv[src + v_off + i]) + to_f(bias[v_off + i]));
  }
}

// out[r][i] = silu(gu[r][i]) * gu[r][inter + i]: the fused gate/up projection's two halves.
template <typename T>
__device__ void silu_mul(T* __restrict__ out, const T* __restrict__ gu, int inter) {
  const size_t src = (size_t)blockIdx.x * 2 * inter, dst = (size_t)blockIdx.x * inter;
  for (int i = threadIdx.x; i < inter; i += blockDim.x) {
    const float g = to_f(gu[src + i]), u = to_f(gu[src + inter + i]);
    from_f(out[dst + i], g / (1.f + expf(-g)) * u);
  }
}

// out[r] = x[idx[r]]: the rows whose logits are wanted (one per sequence, not per token).
template <typename T>
__device__ void gather_rows(T* __restrict__ out, const T* __restrict__ x,
                            const uint32_t* __restrict__ idx, int width) {
  const size_t src = (size_t)idx[blockIdx.x] * width, dst = (size_t)blockIdx.x * width;
  for (int i = threadIdx.x; i < width; i += blockDim.x) out[dst + i] = x[src + i];
}

#define PER_TYPE(NAME, T)                                                                     \
  extern "C" __global__ void embed_##NAME(T* out, const T* table, const uint32_t* ids,        \
                                          int hidden) {                                       \
    embed<T>(out, table, ids, hidden);                                                        \
  }                                                                                           \
  extern "C" __global__ void rms_norm_##NAME(T* out, const T* x, const T* w, float eps,       \
                                             int hidden) {                                    \
    rms_norm<T>(out, x, w, eps, hidden);                                                      \
  }                                                                                           \
  extern "C" __global__ void rope_split_##NAME(                                               \
      T* q, T* k, T* v, const T* qkv, const T* bias, const uint32_t* pos, const float* cos_t, \
      const float* sin_t, int num_heads, int num_kv_heads, int head_size, int neox) {         \
    rope_split<T>(q, k, v, qkv, bias, pos, cos_t, sin_t, num_heads, num_kv_heads, head_size,  \
                  neox);                                                                      \
  }                                                                                           \
  extern "C" __global__ void silu_mul_##NAME(T* out, const T* gu, int inter) {                \
    silu_mul<T>(out, gu, inter);                                                              \
  }                                                                                           \
  extern "C" __global__ void gather_rows_##NAME(T* out, const T* x, const uint32_t* idx,      \
                                                int width) {                                  \
    gather_rows<T>(out, x, idx, width);                                                       \
  }

PER_TYPE(f32, float)
PER_TYPE(f16, __half)
PER_TYPE(bf16, __nv_bfloat16)
