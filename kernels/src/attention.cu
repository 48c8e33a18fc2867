// Paged attention for the gateway's KV cache, and the kernels that maintain the cache.
//
// Cache layout (the CPU engine's, `host/src/engine/paged_attention.rs`), per layer, for K and
// for V: [num_blocks][block_size][num_kv_heads][head_size]. A token's slot is
// `block * block_size + offset`, so one token's K (or V) for one KV head is `head_size`
// contiguous elements: a warp reads it with one coalesced, vectorised load per lane (two
// 16-bit elements packed into 32 bits), and the block table is the only indirection.
//
// One attention kernel serves decode and prefill. Each "row" is one query token: its sequence
// (an index into `block_tables`) and its context length (positions 0..ctx_len it may attend,
// which is causal masking for prefill rows). Decode has one row per sequence; prefill has one
// row per prompt token. Grid: (num_heads, num_rows, num_partitions); a thread block handles
// one query head of one row over one partition of PARTITION_SIZE context tokens:
//   1. the query (scaled) goes to shared memory as f32;
//   2. each warp takes whole KV blocks; within a warp, lanes split the head dimension and a
//      shuffle reduction gives each token's logit, kept in shared memory;
//   3. block-wide max and sum (warp shuffles, then one shared slot per warp) give the softmax;
//   4. thread d accumulates output dimension d over the partition's tokens (V reads are
//      coalesced across threads: consecutive d are consecutive addresses).
// With one partition the row's output is written directly ("v1"). With several (long
// contexts, "v2"/split-K), each partition writes its unnormalised f32 accumulator, max logit
// and exp-sum, and `paged_attention_reduce` rescales and combines them.
//
// Next steps for speed (correctness first here): process all query heads of a GQA group in one
// thread block so K/V is read once per group instead of relying on L2; 16-byte loads; a tiled
// flash-attention prefill that shares K/V tiles across query rows instead of re-reading the
// context once per prompt token.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#define WARP 32
#define NUM_THREADS 128
#define NUM_WARPS (NUM_THREADS / WARP)
#define PARTITION_SIZE 512

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_f(float& o, float x) { o = x; }
__device__ __forceinline__ void from_f(__half& o, float x) { o = __float2half(x); }
__device__ __forceinline__ void from_f(__nv_bfloat16& o, float x) { o = __float2bfloat16(x); }

// Two adjacent elements as f32: one 4-byte load for 16-bit types, 8 bytes for f32.
template <typename T> struct Pair;
template <> struct Pair<float> {
  __device__ static float2 load(const float* p) { return *reinterpret_cast<const float2*>(p); }
};
template <> struct Pair<__half> {
  __device__ static float2 load(const __half* p) {
    return __half22float2(*reinterpret_cast<const __half2*>(p));
  }
};
template <> struct Pair<__nv_bfloat16> {
  __device__ static float2 load(const __nv_bfloat16* p) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
  }
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = WARP / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = WARP / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
  return v;
}

// Block-wide reduction through one shared slot per warp; every thread gets the result.
template <bool MAX>
__device__ float block_reduce(float v, float* scratch) {
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  v = MAX ? warp_max(v) : warp_sum(v);
  __syncthreads();  // scratch may still be read from a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < NUM_WARPS ? scratch[lane] : (MAX ? -INFINITY : 0.f);
  return MAX ? warp_max(v) : warp_sum(v);
}

template <typename T, int HEAD>
__device__ void attention(
    T* __restrict__ out,              // [rows, heads, HEAD]            (one partition)
    float* __restrict__ part_out,     // [rows, heads, parts, HEAD]     (several partitions)
    float* __restrict__ part_max,     // [rows, heads, parts]
    float* __restrict__ part_sum,     // [rows, heads, parts]
    const T* __restrict__ q,          // [rows, heads, HEAD]
    const T* __restrict__ k_cache,    // [blocks, block_size, kv_heads, HEAD]
    const T* __restrict__ v_cache,    // same
    const uint32_t* __restrict__ block_tables,  // [seqs, max_blocks]
    const uint32_t* __restrict__ row_seq,       // [rows]
    const uint32_t* __restrict__ row_ctx,       // [rows]
    int num_kv_heads, int block_size, int max_blocks, float scale) {
  static_assert(HEAD % 2 == 0, "pairs of elements");
  const int head = blockIdx.x, row = blockIdx.y, part = blockIdx.z;
  const int num_heads = gridDim.x, parts = gridDim.z;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int ctx = row_ctx[row];
  const int begin = part * PARTITION_SIZE;
  const int end = min(ctx, begin + PARTITION_SIZE);
  const size_t out_idx = ((size_t)row * num_heads + head) * parts + part;
  if (begin >= end) {  // this partition lies past the row's context
    if (parts > 1 && threadIdx.x == 0) {
      part_max[out_idx] = -INFINITY;
      part_sum[out_idx] = 0.f;
    }
    if (parts > 1)
      for (int d = threadIdx.x; d < HEAD; d += NUM_THREADS) part_out[out_idx * HEAD + d] = 0.f;
    return;
  }
  __shared__ float q_s[HEAD];
  __shared__ float logits[PARTITION_SIZE];
  __shared__ float scratch[NUM_WARPS];
  const T* q_row = q + ((size_t)row * num_heads + head) * HEAD;
  for (int d = threadIdx.x; d < HEAD; d += NUM_THREADS) q_s[d] = to_f(q_row[d]) * scale;
  __syncthreads();

  const uint32_t* table = block_tables + (size_t)row_seq[row] * max_blocks;
  const size_t token_stride = (size_t)num_kv_heads * HEAD;
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  float local_max = -INFINITY;
  // Warps take whole blocks (one table lookup per block), lanes the head dimension in pairs.
  const int first_block = begin / block_size, last_block = (end - 1) / block_size;
  for (int b = first_block + warp; b <= last_block; b += NUM_WARPS) {
    const size_t base = (size_t)table[b] * block_size * token_stride + (size_t)kv_head * HEAD;
    const int t0 = max(begin, b * block_size), t1 = min(end, (b + 1) * block_size);
    for (int t = t0; t < t1; ++t) {
      const T* k = k_cache + base + (size_t)(t - b * block_size) * token_stride;
      float acc = 0.f;
      for (int p = lane; p < HEAD / 2; p += WARP) {
        const float2 kv = Pair<T>::load(k + 2 * p);
        acc += q_s[2 * p] * kv.x + q_s[2 * p + 1] * kv.y;
      }
      acc = warp_sum(acc);
      if (lane == 0) logits[t - begin] = acc;
      local_max = fmaxf(local_max, acc);
    }
  }
  __syncthreads();
  const float m = block_reduce<true>(local_max, scratch);
  float local_sum = 0.f;
  for (int i = threadIdx.x; i < end - begin; i += NUM_THREADS) {
    const float e = __expf(logits[i] - m);
    logits[i] = e;
    local_sum += e;
  }
  const float sum = block_reduce<false>(local_sum, scratch);  // syncs: logits complete

  for (int d = threadIdx.x; d < HEAD; d += NUM_THREADS) {
    float acc = 0.f;
    for (int t = begin; t < end; ++t) {
      const int b = t / block_size;
      const T* v = v_cache + (size_t)table[b] * block_size * token_stride +
                   (size_t)(t - b * block_size) * token_stride + (size_t)kv_head * HEAD;
      acc += logits[t - begin] * to_f(v[d]);
    }
    if (parts == 1) {
      from_f(out[((size_t)row * num_heads + head) * HEAD + d], acc / sum);
    } else {
      part_out[out_idx * HEAD + d] = acc;
    }
  }
  if (parts > 1 && threadIdx.x == 0) {
    part_max[out_idx] = m;
    part_sum[out_idx] = sum;
  }
}

// Combines the partitions of each (row, head): rescale each partition's accumulator and
// exp-sum to the global max, then divide.
template <typename T>
__device__ void reduce(T* __restrict__ out, const float* __restrict__ part_out,
                       const float* __restrict__ part_max, const float* __restrict__ part_sum,
                       int parts, int head_size) {
  const int head = blockIdx.x, row = blockIdx.y, num_heads = gridDim.x;
  const size_t base = ((size_t)row * num_heads + head) * parts;
  __shared__ float weights[1024];
  __shared__ float scratch[NUM_WARPS];
  float local_max = -INFINITY;
  for (int p = threadIdx.x; p < parts; p += NUM_THREADS) local_max = fmaxf(local_max, part_max[base + p]);
  const float m = block_reduce<true>(local_max, scratch);
  float local_sum = 0.f;
  for (int p = threadIdx.x; p < parts; p += NUM_THREADS) {
    const float w = part_sum[base + p] > 0.f ? __expf(part_max[base + p] - m) : 0.f;
    weights[p] = w;
    local_sum += w * part_sum[base + p];
  }
  const float total = block_reduce<false>(local_sum, scratch);
  for (int d = threadIdx.x; d < head_size; d += NUM_THREADS) {
    float acc = 0.f;
    for (int p = 0; p < parts; ++p) acc += weights[p] * part_out[(base + p) * head_size + d];
    from_f(out[((size_t)row * num_heads + head) * head_size + d], acc / total);
  }
}

// K and V of this step's tokens into their slots; a negative slot (padding) is skipped.
template <typename T>
__device__ void reshape_and_cache(const T* __restrict__ key, const T* __restrict__ value,
                                  T* __restrict__ k_cache, T* __restrict__ v_cache,
                                  const int64_t* __restrict__ slots, int token_elems) {
  const int64_t slot = slots[blockIdx.x];
  if (slot < 0) return;
  const size_t src = (size_t)blockIdx.x * token_elems, dst = (size_t)slot * token_elems;
  for (int i = threadIdx.x; i < token_elems; i += blockDim.x) {
    k_cache[dst + i] = key[src + i];
    v_cache[dst + i] = value[src + i];
  }
}

#define ATTENTION(NAME, T, HEAD)                                                              \
  extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_##NAME##_##HEAD(  \
      T* out, float* part_out, float* part_max, float* part_sum, const T* q,                  \
      const T* k_cache, const T* v_cache, const uint32_t* block_tables,                      \
      const uint32_t* row_seq, const uint32_t* row_ctx, int num_kv_heads, int block_size,     \
      int max_blocks, float scale) {                                                          \
    attention<T, HEAD>(out, part_out, part_max, part_sum, q, k_cache, v_cache, block_tables, \
                       row_seq, row_ctx, num_kv_heads, block_size, max_blocks, scale);       \
  }

#define PER_TYPE(NAME, T)                                                                     \
  ATTENTION(NAME, T, 64)                                                                      \
  ATTENTION(NAME, T, 80)                                                                      \
  ATTENTION(NAME, T, 96)                                                                      \
  ATTENTION(NAME, T, 128)                                                                     \
  extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_reduce_##NAME(    \
      T* out, const float* part_out, const float* part_max, const float* part_sum, int parts, \
      int head_size) {                                                                        \
    reduce<T>(out, part_out, part_max, part_sum, parts, head_size);                           \
  }                                                                                           \
  extern "C" __global__ void reshape_and_cache_##NAME(const T* key, const T* value,           \
                                                      T* k_cache, T* v_cache,                 \
                                                      const int64_t* slots, int token_elems) { \
    reshape_and_cache<T>(key, value, k_cache, v_cache, slots, token_elems);                   \
  }

PER_TYPE(f32, float)
PER_TYPE(f16, __half)
PER_TYPE(bf16, __nv_bfloat16)

// Copy-on-write: whole blocks `pairs[2i] -> pairs[2i+1]` of one layer's K and V, as 32-bit
// words (block sizes in bytes are multiples of 4 for every supported shape).
extern "C" __global__ void copy_blocks(uint32_t* k_cache, uint32_t* v_cache,
                                       const int64_t* __restrict__ pairs, int block_words) {
  const int64_t src = pairs[2 * blockIdx.x], dst = pairs[2 * blockIdx.x + 1];
  for (int i = threadIdx.x; i < block_words; i += blockDim.x) {
    k_cache[dst * block_words + i] = k_cache[src * block_words + i];
    v_cache[dst * block_words + i] = v_cache[src * block_words + i];
  }
}
