// Paged attention: each query token attends to its sequence's cached keys/values, read
// through the block table (the vLLM paper's PagedAttention kernel).
//
// One kernel serves decode, chunked prefill and prefix-cached extend: every query token t
// names its sequence (seq_index[t]) and how many cached tokens it may see (context_lens[t]);
// a prefill chunk's tokens get increasing context lengths, which makes them causal. With a
// sliding window w > 0, a token sees only the last w of them (Mistral, Gemma's local layers);
// with logit_softcap c > 0, logits become c * tanh(logit / c) before the softmax (Gemma 2); with
// sinks, each query head's softmax has one more key, of logit sinks[head] and value zero (GPT-OSS).
//
// Grid: (query tokens, kv heads * head tiles, partitions), NUM_THREADS threads.
// A CTA handles one query token, GROUP query heads that share one kv head (GQA: each K/V
// row is read once for all of them), and one partition of the context. With one partition
// the CTA writes the output; with several (split-K, for long contexts) it writes a partial
// result and reduce_partitions_kernel combines them.
//
// Cache layout per layer: [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM] with a free
// block stride (the block-major cache interleaves layers), each token's row contiguous. The
// cache's element type CT is the queries' DT or a float8 format, widened as it is loaded.
#include "pagedkv_common.cuh"

namespace pagedkv {

constexpr int NUM_THREADS = 128;
constexpr int NUM_WARPS = NUM_THREADS / 32;
// K/V rows loaded before they are used, to hide latency: enough 16-byte loads in flight to
// cover the memory's latency at full bandwidth (H100: 8 rows for 2-byte caches reached 87-92%
// of the copy bandwidth at batch >= 64, 4 rows 78-91%). float8 and float32 rows keep 4: their
// widened registers would cost occupancy.
template <int CT> struct Unroll { static constexpr int value = sizeof(typename Element<CT>::type) == 2 ? 8 : 4; };

template <int DT, int CT, int HEAD_DIM, int BLOCK_SIZE, int GROUP>
__device__ __forceinline__ void attend_partition(
    typename Element<DT>::type* __restrict__ out,
    float* __restrict__ partial_out, float* __restrict__ max_logits, float* __restrict__ exp_sums,
    const typename Element<DT>::type* __restrict__ query, const typename Element<CT>::type* __restrict__ key_cache,
    const typename Element<CT>::type* __restrict__ value_cache, const int* __restrict__ block_table,
    int first_visible, int context_len, long long out_token_stride, long long cache_block_stride,
    int num_heads, int first_head, int kv_head, int partition_size, int max_partitions, float scale,
    float logit_softcap, const float* __restrict__ sinks, float* shared) {
  using cache_t = typename Element<CT>::type;
  constexpr int UNROLL = Unroll<CT>::value;
  constexpr int VEC = VecWidth<CT>::value;  // a thread's slices of a row are 16-byte cache loads
  constexpr int VECS_PER_ROW = HEAD_DIM / VEC;
  constexpr int THREADS_PER_TOKEN = VECS_PER_ROW < 32 ? VECS_PER_ROW : 32;
  constexpr int VECS_PER_THREAD = VECS_PER_ROW / THREADS_PER_TOKEN;
  constexpr int TOKEN_LANES = NUM_THREADS / THREADS_PER_TOKEN;
  static_assert(HEAD_DIM % VEC == 0 && VECS_PER_ROW % THREADS_PER_TOKEN == 0, "unsupported head dim");

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rank = tid % THREADS_PER_TOKEN;  // which 16-byte slices of a row this thread reads
  const int token_lane = tid / THREADS_PER_TOKEN;
  const int partition = blockIdx.z;
  const int start = first_visible + partition * partition_size;
  const int length = min(partition_size, context_len - start);
  const long long head_offset = (long long)kv_head * BLOCK_SIZE * HEAD_DIM;

  float* logits = shared;  // [GROUP][partition_size], later reused for the V reduction
  const int reduce_floats = max(GROUP * partition_size, NUM_WARPS * GROUP * HEAD_DIM);
  float* group_max = shared + reduce_floats;  // [GROUP]
  float* group_sum = group_max + GROUP;       // [GROUP]
  // The partition's physical block numbers, read once: a row's address then costs a shared
  // load instead of a global one that every K/V load would wait behind.
  int* blocks = reinterpret_cast<int*>(group_sum + GROUP);  // [partition_size / BLOCK_SIZE + 2]
  const int first_block = start / BLOCK_SIZE;
  const int num_blocks = (start + length - 1) / BLOCK_SIZE - first_block + 1;
  for (int b = tid; b < num_blocks; b += NUM_THREADS) blocks[b] = block_table[first_block + b];
  __syncthreads();

  // This thread's slices of the GROUP query rows, pre-scaled.
  float q[GROUP][VECS_PER_THREAD][VEC];
#pragma unroll
  for (int g = 0; g < GROUP; ++g)
#pragma unroll
    for (int j = 0; j < VECS_PER_THREAD; ++j) {
      load_elements<DT, VEC>(query + (long long)(first_head + g) * HEAD_DIM + (rank + j * THREADS_PER_TOKEN) * VEC,
                             q[g][j]);
#pragma unroll
      for (int e = 0; e < VEC; ++e) q[g][j][e] *= scale;
    }

  // Phase 1: logits[g][i] = q_g . k_(start+i). The trip count is uniform across the CTA,
  // so every lane reaches the shuffles.
  for (int base = 0; base < length; base += TOKEN_LANES * UNROLL) {
    Vec16 k_raw[UNROLL][VECS_PER_THREAD];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = base + u * TOKEN_LANES + token_lane;
      if (i < length) {
        const int token = start + i;
        const long long block = blocks[token / BLOCK_SIZE - first_block];
        const cache_t* row = key_cache + block * cache_block_stride + head_offset + (token % BLOCK_SIZE) * HEAD_DIM;
#pragma unroll
        for (int j = 0; j < VECS_PER_THREAD; ++j) k_raw[u][j] = load_raw(row + (rank + j * THREADS_PER_TOKEN) * VEC);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = base + u * TOKEN_LANES + token_lane;
      if (base + u * TOKEN_LANES >= length) break;  // uniform: no lane of this round is valid
      float k[VECS_PER_THREAD][VEC];
#pragma unroll
      for (int j = 0; j < VECS_PER_THREAD; ++j) widen<CT>(k_raw[u][j], k[j]);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        float dot = 0.f;
        if (i < length)
#pragma unroll
          for (int j = 0; j < VECS_PER_THREAD; ++j)
#pragma unroll
            for (int e = 0; e < VEC; ++e) dot += q[g][j][e] * k[j][e];
        if (THREADS_PER_TOKEN > 1) dot = warp_xor_sum(dot, THREADS_PER_TOKEN / 2, 1);
        if (logit_softcap > 0.f) dot = logit_softcap * tanhf(dot / logit_softcap);
        if (i < length && rank == 0) logits[g * partition_size + i] = dot;
      }
    }
  }
  __syncthreads();

  // Softmax numerators in place; one warp per query head. A head's sink (a key of zero value)
  // joins the max and the sum here in one pass; split-K adds it when reducing the partitions.
  const bool sink_here = sinks != nullptr && max_partitions == 1;
  for (int g = warp; g < GROUP; g += NUM_WARPS) {
    float m = sink_here ? sinks[first_head + g] : neg_infinity();
    for (int i = lane; i < length; i += 32) m = fmaxf(m, logits[g * partition_size + i]);
    m = warp_max(m);
    float sum = 0.f;
    for (int i = lane; i < length; i += 32) {
      const float p = __expf(logits[g * partition_size + i] - m);
      logits[g * partition_size + i] = p;
      sum += p;
    }
    sum = warp_xor_sum(sum, 16, 1);
    if (sink_here) sum += __expf(sinks[first_head + g] - m);
    if (lane == 0) {
      group_max[g] = m;
      group_sum[g] = sum;
    }
  }
  __syncthreads();

  // Phase 2: acc[g] = sum_i p[g][i] * v_(start+i), each thread over its tokens and slices.
  float acc[GROUP][VECS_PER_THREAD][VEC];
#pragma unroll
  for (int g = 0; g < GROUP; ++g)
#pragma unroll
    for (int j = 0; j < VECS_PER_THREAD; ++j)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[g][j][e] = 0.f;
  for (int base = 0; base < length; base += TOKEN_LANES * UNROLL) {
    Vec16 v_raw[UNROLL][VECS_PER_THREAD];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = base + u * TOKEN_LANES + token_lane;
      if (i < length) {
        const int token = start + i;
        const long long block = blocks[token / BLOCK_SIZE - first_block];
        const cache_t* row = value_cache + block * cache_block_stride + head_offset + (token % BLOCK_SIZE) * HEAD_DIM;
#pragma unroll
        for (int j = 0; j < VECS_PER_THREAD; ++j) v_raw[u][j] = load_raw(row + (rank + j * THREADS_PER_TOKEN) * VEC);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = base + u * TOKEN_LANES + token_lane;
      if (i >= length) break;  // later rounds are out of range too
      float v[VECS_PER_THREAD][VEC];
#pragma unroll
      for (int j = 0; j < VECS_PER_THREAD; ++j) widen<CT>(v_raw[u][j], v[j]);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        const float p = logits[g * partition_size + i];
#pragma unroll
        for (int j = 0; j < VECS_PER_THREAD; ++j)
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[g][j][e] += p * v[j][e];
      }
    }
  }
  // Sum over the token lanes of a warp, then across warps through shared memory.
#pragma unroll
  for (int g = 0; g < GROUP; ++g)
#pragma unroll
    for (int j = 0; j < VECS_PER_THREAD; ++j)
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        if (THREADS_PER_TOKEN < 32) acc[g][j][e] = warp_xor_sum(acc[g][j][e], 16, THREADS_PER_TOKEN);
  __syncthreads();  // every thread is done reading logits
  float* warp_sums = shared;  // [NUM_WARPS][GROUP][HEAD_DIM]
  if (lane < THREADS_PER_TOKEN)
#pragma unroll
    for (int g = 0; g < GROUP; ++g)
#pragma unroll
      for (int j = 0; j < VECS_PER_THREAD; ++j)
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          warp_sums[(warp * GROUP + g) * HEAD_DIM + (rank + j * THREADS_PER_TOKEN) * VEC + e] = acc[g][j][e];
  __syncthreads();

  const int token_index = blockIdx.x;
  for (int index = tid; index < GROUP * HEAD_DIM; index += NUM_THREADS) {
    const int g = index / HEAD_DIM, d = index % HEAD_DIM;
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) total += warp_sums[(w * GROUP + g) * HEAD_DIM + d];
    total /= group_sum[g];
    const int head = first_head + g;
    if (max_partitions == 1) {
      out[token_index * out_token_stride + (long long)head * HEAD_DIM + d] = from_float<DT>(total);
    } else {
      const long long slot = ((long long)token_index * num_heads + head) * max_partitions + partition;
      partial_out[slot * HEAD_DIM + d] = total;
      if (d == 0) {
        max_logits[slot] = group_max[g];
        exp_sums[slot] = group_sum[g];
      }
    }
  }
}

// Launch with grid (num_tokens, num_kv_heads * head_tiles, max_partitions), NUM_THREADS
// threads, and (max(GROUP * partition_size, NUM_WARPS * GROUP * HEAD_DIM) + 2 * GROUP +
// partition_size / BLOCK_SIZE + 2) * 4 bytes of dynamic shared memory. Query heads of kv head h: h * group .. (h + 1) * group - 1,
// split into head_tiles tiles of GROUP heads.
template <int DT, int CT, int HEAD_DIM, int BLOCK_SIZE, int GROUP>
__global__ void paged_attention_kernel(
    typename Element<DT>::type* __restrict__ out,  // [T, num_heads, HEAD_DIM] rows of out_token_stride
    float* __restrict__ partial_out,               // [T, num_heads, max_partitions, HEAD_DIM] (split-K)
    float* __restrict__ max_logits,                // [T, num_heads, max_partitions] (split-K)
    float* __restrict__ exp_sums,                  // [T, num_heads, max_partitions] (split-K)
    const typename Element<DT>::type* __restrict__ query,  // [T, num_heads, HEAD_DIM] rows of query_token_stride
    const typename Element<CT>::type* __restrict__ key_cache,
    const typename Element<CT>::type* __restrict__ value_cache,
    const int* __restrict__ block_tables,  // [num_seqs, block_table_stride]
    const int* __restrict__ seq_index,     // [T] row of block_tables for each query token
    const int* __restrict__ context_lens,  // [T] cached tokens visible to each query token
    long long query_token_stride, long long out_token_stride, long long cache_block_stride,
    int block_table_stride, int num_heads, int num_kv_heads, int partition_size, int max_partitions,
    float scale, int sliding_window, float logit_softcap,
    const float* __restrict__ sinks) {  // [num_heads] attention-sink logits, or null
  PAGEDKV_SHARED_FLOATS(shared);
  const int token_index = blockIdx.x;
  const int context_len = context_lens[token_index];
  const int first_visible = sliding_window > 0 ? max(0, context_len - sliding_window) : 0;
  if ((int)blockIdx.z * partition_size >= context_len - first_visible) return;  // the whole CTA leaves together
  const int group = num_heads / num_kv_heads;
  const int head_tiles = group / GROUP;
  const int kv_head = blockIdx.y / head_tiles;
  const int first_head = kv_head * group + (blockIdx.y % head_tiles) * GROUP;
  const int* block_table = block_tables + (long long)seq_index[token_index] * block_table_stride;
  attend_partition<DT, CT, HEAD_DIM, BLOCK_SIZE, GROUP>(
      out, partial_out, max_logits, exp_sums, query + token_index * query_token_stride, key_cache, value_cache,
      block_table, first_visible, context_len, out_token_stride, cache_block_stride, num_heads, first_head,
      kv_head, partition_size, max_partitions, scale, logit_softcap, sinks, shared);
}

// Combines the split-K partitions of paged_attention_kernel: each partition's normalized
// output weighted by its share exp(max_p - max) * sum_p of the softmax denominator.
// Grid (num_tokens, num_heads), NUM_THREADS threads.
template <int DT, int HEAD_DIM>
__global__ void reduce_partitions_kernel(
    typename Element<DT>::type* __restrict__ out, const float* __restrict__ partial_out,
    const float* __restrict__ max_logits, const float* __restrict__ exp_sums, const int* __restrict__ context_lens,
    long long out_token_stride, int num_heads, int partition_size, int max_partitions, int sliding_window,
    const float* __restrict__ sinks) {
  const int token_index = blockIdx.x, head = blockIdx.y;
  const int context_len = context_lens[token_index];
  const int visible = sliding_window > 0 ? min(context_len, sliding_window) : context_len;
  const int num_partitions = (visible + partition_size - 1) / partition_size;
  const long long first = ((long long)token_index * num_heads + head) * max_partitions;
  float m = sinks != nullptr ? sinks[head] : neg_infinity();
  for (int p = 0; p < num_partitions; ++p) m = fmaxf(m, max_logits[first + p]);
  float denominator = sinks != nullptr ? __expf(sinks[head] - m) : 0.f;
  for (int p = 0; p < num_partitions; ++p) denominator += exp_sums[first + p] * __expf(max_logits[first + p] - m);
  for (int d = threadIdx.x; d < HEAD_DIM; d += NUM_THREADS) {
    float total = 0.f;
    for (int p = 0; p < num_partitions; ++p)
      total += exp_sums[first + p] * __expf(max_logits[first + p] - m) * partial_out[(first + p) * HEAD_DIM + d];
    out[token_index * out_token_stride + (long long)head * HEAD_DIM + d] = from_float<DT>(total / denominator);
  }
}

}  // namespace pagedkv
