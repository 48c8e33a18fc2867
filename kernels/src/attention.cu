// Paged attention for the gateway's KV cache, and the kernels that maintain the cache.
//
// Cache layout (the CPU engine's, `host/src/engine/paged_attention.rs`), per layer, for K and
// for V: [num_blocks][block_size][num_kv_heads][head_size]. A token's slot is
// `block * block_size + offset`, so one token's K (or V) for one KV head is `head_size`
// contiguous elements (128-256 bytes): a few lanes read it with 16-byte loads, and the block
// table is the only indirection.
//
// One attention kernel serves decode and prefill. Each "row" is one query token: its sequence
// (an index into `block_tables`) and its context length (positions 0..ctx_len it may attend,
// which is causal masking for prefill rows). Decode has one row per sequence; prefill has one
// row per prompt token. Grid: (num_kv_heads x ceil(group / GT), num_rows, num_partitions);
// a thread block serves up to GT (1, 2, 4 or 8) query heads that share one KV head
// (GQA), for one row, over one partition of PARTITION_SIZE context tokens, so each K and V
// element is read from memory once per group instead of once per query head:
//   1. each lane keeps its 8 elements of every group head's (scaled) query in registers;
//   2. a token's K vector is read by G lanes (G = 8 or 16), one 16-byte load each; partial dot
//      products for every group head are reduced with log2(G) shuffles; a warp covers 32/G
//      tokens per step, the 4 warps interleave; logits go to shared memory;
//   3. per head, block-wide max, exp and sum give the softmax;
//   4. V is read with the same token split and 16-byte loads, each element accumulated into
//      every group head; token groups are summed with shuffles, warps through shared memory.
// With one partition the row's output is written directly ("v1"). With several (long
// contexts, "v2"/split-K), each partition writes its unnormalised f32 accumulator, max logit
// and exp-sum per head, and `paged_attention_reduce` rescales and combines them. The host
// launches the two kinds of rows separately (`row_ids` lists a launch's rows), so short rows
// never pay for the partitions of the batch's longest one.
//
// Next steps for speed: a tiled flash-attention prefill that shares K/V tiles across query rows
// instead of re-reading the context once per prompt token; deciding the partition size per
// batch (fewer, longer partitions when rows x heads already fill the GPU).

#include "common.cuh"

#define NUM_THREADS 128
#define NUM_WARPS (NUM_THREADS / WARP)
#define PARTITION_SIZE 512

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

// Eight consecutive elements as f32: one 16-byte load for 16-bit types, two for f32. Head
// sizes are multiples of 8 and the cache is 256-byte aligned, so every load is aligned.
template <typename T> struct Vec8;
template <> struct Vec8<float> {
  __device__ static void load(const float* p, float* o) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
    o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
  }
};
template <> struct Vec8<__half> {
  __device__ static void load(const __half* p, float* o) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      o[2 * i] = f.x;
      o[2 * i + 1] = f.y;
    }
  }
};
template <> struct Vec8<__nv_bfloat16> {
  __device__ static void load(const __nv_bfloat16* p, float* o) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      o[2 * i] = f.x;
      o[2 * i + 1] = f.y;
    }
  }
};

// GT: query heads of one KV head this block serves (a power of two; the launcher picks the
// smallest that holds the GQA group, up to 8), sizing the register and shared arrays.
template <typename T, int HEAD, int GT>
__device__ void attention(
    T* __restrict__ out,              // [rows, heads, HEAD]            (one partition)
    float* __restrict__ part_out,     // [launch rows, heads, parts, HEAD] (several partitions)
    float* __restrict__ part_max,     // [launch rows, heads, parts]
    float* __restrict__ part_sum,     // [launch rows, heads, parts]
    const T* __restrict__ q,          // [rows, heads, HEAD]
    const T* __restrict__ k_cache,    // [blocks, block_size, kv_heads, HEAD]
    const T* __restrict__ v_cache,    // same
    const uint32_t* __restrict__ block_tables,  // [seqs, max_blocks]
    const uint32_t* __restrict__ row_ids,       // [launch rows]: the rows this launch serves
    const uint32_t* __restrict__ row_seq,       // [rows]
    const uint32_t* __restrict__ row_ctx,       // [rows]
    int num_heads, int num_kv_heads, int block_size, int max_blocks, float scale) {
  static_assert(HEAD % 8 == 0, "16-byte pieces");
  constexpr int CHUNKS = HEAD / 8;            // 16-byte pieces of one head vector
  constexpr int G = CHUNKS > 8 ? 16 : 8;      // lanes per token (a power of two >= CHUNKS)
  constexpr int TPW = WARP / G;               // tokens a warp reads at once
  const int group = num_heads / num_kv_heads;
  const int chunks = (group + GT - 1) / GT;
  const int kv_head = blockIdx.x / chunks;
  const int h0 = kv_head * group + (blockIdx.x % chunks) * GT;  // first query head
  const int g = min(GT, (kv_head + 1) * group - h0);           // query heads here
  const int row = row_ids[blockIdx.y], part = blockIdx.z, parts = gridDim.z;
  const int ctx = row_ctx[row];
  const int begin = part * PARTITION_SIZE;
  const int end = min(ctx, begin + PARTITION_SIZE);
  const size_t head_base = (size_t)row * num_heads + h0;  // (row, h0) in [rows, heads]
  const size_t part_base = (size_t)blockIdx.y * num_heads + h0;  // in this launch's partials
  if (begin >= end) {  // this partition lies past the row's context
    if (parts > 1)
      for (int i = threadIdx.x; i < g * HEAD; i += NUM_THREADS) {
        const size_t idx = (part_base + i / HEAD) * parts + part;
        part_out[idx * HEAD + i % HEAD] = 0.f;
        if (i % HEAD == 0) {
          part_max[idx] = -INFINITY;
          part_sum[idx] = 0.f;
        }
      }
    return;
  }
  __shared__ float logits[GT][PARTITION_SIZE];
  __shared__ float acc_s[NUM_WARPS][GT][HEAD];
  __shared__ float red[GT][NUM_WARPS];
  __shared__ float stat[GT][2];  // max logit, exp-sum

  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const int tg = lane / G, gl = lane % G;  // token of the warp's step, lane within the token
  const bool active = gl < CHUNKS;         // lanes past the head (80, 96) only join shuffles
  // Each lane keeps its 8 query elements of every head of the group in registers (scaled).
  float qr[GT][8];
#pragma unroll
  for (int j = 0; j < GT; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e)
      qr[j][e] = (j < g && active) ? to_f(q[(head_base + j) * HEAD + gl * 8 + e]) * scale : 0.f;

  const uint32_t* table = block_tables + (size_t)row_seq[row] * max_blocks;
  // Block sizes are powers of two (the engine validates it): shift and mask, not division.
  const int bs_shift = __ffs(block_size) - 1, bs_mask = block_size - 1;
  const size_t token_stride = (size_t)num_kv_heads * HEAD;
  const size_t head_off = (size_t)kv_head * HEAD + gl * 8;
  // Logits: a token's K is read once (one 16-byte load per lane) for every query head of the
  // group; lanes of a token reduce their partial dot products with log2(G) shuffles.
  float local_max[GT];
#pragma unroll
  for (int j = 0; j < GT; ++j) local_max[j] = -INFINITY;
  // Unrolled so each lane has several 16-byte loads in flight before the reductions.
#pragma unroll 2
  for (int base = begin + warp * TPW; base < end; base += NUM_WARPS * TPW) {
    const int t = base + tg;
    const bool valid = t < end;
    float k8[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (valid && active) {
      const size_t slot = ((size_t)table[t >> bs_shift] << bs_shift) + (t & bs_mask);
      Vec8<T>::load(k_cache + slot * token_stride + head_off, k8);
    }
#pragma unroll
    for (int j = 0; j < GT; ++j) {
      if (j >= g) break;  // uniform across the block
      float s = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) s += qr[j][e] * k8[e];
#pragma unroll
      for (int o = G / 2; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffff, s, o);
      if (valid) {
        if (gl == 0) logits[j][t - begin] = s;
        local_max[j] = fmaxf(local_max[j], s);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < GT; ++j) {  // constant indices keep local_max in registers
    if (j >= g) break;
    const float m = warp_max(local_max[j]);
    if (lane == 0) red[j][warp] = m;
  }
  __syncthreads();  // logits and per-warp maxima complete
  if (threadIdx.x < g) {
    float m = -INFINITY;
    for (int w = 0; w < NUM_WARPS; ++w) m = fmaxf(m, red[threadIdx.x][w]);
    stat[threadIdx.x][0] = m;
  }
  __syncthreads();
  const int n = end - begin;
  for (int i = threadIdx.x; i < g * n; i += NUM_THREADS) {
    const int j = i / n, t = i % n;
    logits[j][t] = __expf(logits[j][t] - stat[j][0]);
  }
  __syncthreads();
  for (int j = warp; j < g; j += NUM_WARPS) {
    float s = 0.f;
    for (int t = lane; t < n; t += WARP) s += logits[j][t];
    s = warp_sum(s);
    if (lane == 0) stat[j][1] = s;
  }

  // Values: the same token split; each V piece is read once and added into every head's
  // accumulator, then token groups (shuffles) and warps (shared memory) are summed.
  float acc[GT][8];
#pragma unroll
  for (int j = 0; j < GT; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[j][e] = 0.f;
#pragma unroll 4
  for (int base = begin + warp * TPW; base < end; base += NUM_WARPS * TPW) {
    const int t = base + tg;
    if (t < end && active) {
      const size_t slot = ((size_t)table[t >> bs_shift] << bs_shift) + (t & bs_mask);
      float v8[8];
      Vec8<T>::load(v_cache + slot * token_stride + head_off, v8);
#pragma unroll
      for (int j = 0; j < GT; ++j) {
        if (j >= g) break;
        const float w = logits[j][t - begin];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[j][e] += w * v8[e];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < GT; ++j) {
    if (j >= g) break;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float x = acc[j][e];
#pragma unroll
      for (int o = G; o < WARP; o *= 2) x += __shfl_xor_sync(0xffffffff, x, o);
      if (tg == 0 && active) acc_s[warp][j][gl * 8 + e] = x;
    }
  }
  __syncthreads();  // acc_s and the exp-sums complete
  for (int i = threadIdx.x; i < g * HEAD; i += NUM_THREADS) {
    const int j = i / HEAD, d = i % HEAD;
    float x = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) x += acc_s[w][j][d];
    if (parts == 1) {
      from_f(out[(head_base + j) * HEAD + d], x / stat[j][1]);
    } else {
      const size_t idx = (part_base + j) * parts + part;
      part_out[idx * HEAD + d] = x;
      if (d == 0) {
        part_max[idx] = stat[j][0];
        part_sum[idx] = stat[j][1];
      }
    }
  }
}

// Combines the partitions of each (row, head) of a split-K launch: rescale each partition's
// accumulator and exp-sum to the global max, then divide.
template <typename T>
__device__ void reduce(T* __restrict__ out, const float* __restrict__ part_out,
                       const float* __restrict__ part_max, const float* __restrict__ part_sum,
                       const uint32_t* __restrict__ row_ids, int parts, int head_size) {
  const int head = blockIdx.x, row = row_ids[blockIdx.y], num_heads = gridDim.x;
  const size_t base = ((size_t)blockIdx.y * num_heads + head) * parts;
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

#define ATTENTION_G(NAME, T, HEAD, GT)                                                        \
  extern "C" __global__ void __launch_bounds__(NUM_THREADS)                                   \
      paged_attention_##NAME##_##HEAD##_g##GT(                                                \
          T* out, float* part_out, float* part_max, float* part_sum, const T* q,              \
          const T* k_cache, const T* v_cache, const uint32_t* block_tables,                  \
          const uint32_t* row_ids, const uint32_t* row_seq, const uint32_t* row_ctx,          \
          int num_heads, int num_kv_heads, int block_size, int max_blocks, float scale) {     \
    attention<T, HEAD, GT>(out, part_out, part_max, part_sum, q, k_cache, v_cache,           \
                           block_tables, row_ids, row_seq, row_ctx, num_heads, num_kv_heads,  \
                           block_size, max_blocks, scale);                                    \
  }

#define ATTENTION(NAME, T, HEAD)                                                              \
  ATTENTION_G(NAME, T, HEAD, 1)                                                               \
  ATTENTION_G(NAME, T, HEAD, 2)                                                               \
  ATTENTION_G(NAME, T, HEAD, 4)                                                               \
  ATTENTION_G(NAME, T, HEAD, 8)

#define PER_TYPE(NAME, T)                                                                     \
  ATTENTION(NAME, T, 64)                                                                      \
  ATTENTION(NAME, T, 80)                                                                      \
  ATTENTION(NAME, T, 96)                                                                      \
  ATTENTION(NAME, T, 128)                                                                     \
  extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_reduce_##NAME(    \
      T* out, const float* part_out, const float* part_max, const float* part_sum,            \
      const uint32_t* row_ids, int parts, int head_size) {                                    \
    reduce<T>(out, part_out, part_max, part_sum, row_ids, parts, head_size);                  \
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
