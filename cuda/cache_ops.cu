// Cache maintenance kernels: writing a step's new K/V into their slots, and copying whole
// blocks for copy-on-write.
#include "pagedkv_common.cuh"

namespace pagedkv {

// Scatters key/value [T, num_kv_heads, head_dim] (rows of key_token_stride /
// value_token_stride, heads contiguous) into slot slot_mapping[t] = block * block_size + offset
// of the per-layer caches [num_blocks, num_kv_heads, block_size, head_dim] (block stride
// cache_block_stride), converted from DT to the cache's CT (rounded to nearest even; float8
// saturates). Slot -1 means "do not store" (padding). Grid (T), 128 threads.
template <int DT, int CT>
__global__ void reshape_and_cache_kernel(
    typename Element<CT>::type* __restrict__ key_cache, typename Element<CT>::type* __restrict__ value_cache,
    const typename Element<DT>::type* __restrict__ key, const typename Element<DT>::type* __restrict__ value,
    const long long* __restrict__ slot_mapping, long long key_token_stride, long long value_token_stride,
    long long cache_block_stride, int num_kv_heads, int block_size, int head_dim) {
  const long long slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  const long long block = slot / block_size;
  const int offset = (int)(slot % block_size);
  const typename Element<DT>::type* key_row = key + blockIdx.x * key_token_stride;
  const typename Element<DT>::type* value_row = value + blockIdx.x * value_token_stride;
  for (int index = threadIdx.x; index < num_kv_heads * head_dim; index += blockDim.x) {
    const int head = index / head_dim, d = index % head_dim;
    const long long target = block * cache_block_stride + ((long long)head * block_size + offset) * head_dim + d;
    if constexpr (CT == DT) {  // (no conversion: bits copied as they are)
      key_cache[target] = key_row[index];
      value_cache[target] = value_row[index];
    } else {
      key_cache[target] = from_float<CT>(to_float<DT>(key_row[index]));
      value_cache[target] = from_float<CT>(to_float<DT>(value_row[index]));
    }
  }
}

}  // namespace pagedkv

// Copies whole blocks of the block-major cache (every layer, K and V: block_words 16-byte
// words per block) from pairs[p][0] to pairs[p][1]. Grid (num_pairs), 256 threads.
extern "C" __global__ void copy_blocks_kernel(pagedkv::Vec16* __restrict__ cache, const long long* __restrict__ pairs,
                                              long long block_words) {
  const long long source = pairs[2 * blockIdx.x] * block_words;
  const long long target = pairs[2 * blockIdx.x + 1] * block_words;
  for (long long word = threadIdx.x; word < block_words; word += blockDim.x) cache[target + word] = cache[source + word];
}

// Swap: copies whole blocks (block_words 16-byte words each) from source[pairs[p][0]] to
// target[pairs[p][1]], two block-major caches of which one is usually pinned host memory that
// the GPU reads or writes directly (unified addressing). One launch moves any number of
// scattered blocks, where one DMA copy per block would pay a launch's overhead each. Each
// thread keeps SWAP_UNROLL loads in flight: reads over PCIe take microseconds to return.
// Grid (num_pairs), 256 threads.
constexpr int SWAP_UNROLL = 4;
extern "C" __global__ void swap_blocks_kernel(pagedkv::Vec16* __restrict__ target,
                                              const pagedkv::Vec16* __restrict__ source,
                                              const long long* __restrict__ pairs, long long block_words) {
  const long long from = pairs[2 * blockIdx.x] * block_words;
  const long long to = pairs[2 * blockIdx.x + 1] * block_words;
  for (long long base = threadIdx.x; base < block_words; base += (long long)blockDim.x * SWAP_UNROLL) {
    pagedkv::Vec16 words[SWAP_UNROLL];
#pragma unroll
    for (int u = 0; u < SWAP_UNROLL; ++u)
      if (base + u * blockDim.x < block_words) words[u] = source[from + base + u * blockDim.x];
#pragma unroll
    for (int u = 0; u < SWAP_UNROLL; ++u)
      if (base + u * blockDim.x < block_words) target[to + base + u * blockDim.x] = words[u];
  }
}
