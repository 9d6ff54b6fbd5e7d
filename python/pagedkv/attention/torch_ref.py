"""The reference paged attention in plain torch (CPU and GPU): gathers K/V through the block
tables. It is the oracle the CUDA kernels are tested against, and the `torch` backend.

Its functions are public: the `cpu` backend runs `paged_attention_ref` with its own decode and
prefill (falling back to `decode_batch` and `prefill_one` where its kernels have no case), and
writes and copies blocks with `write_kv` and `copy_blocks`."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pagedkv.attention.metadata import AttentionMetadata


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache_dtype(tensor: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`tensor` as the cache's elements: float8 caches saturate at their largest finite value
    (torch turns e5m2 overflow into inf), rounding to nearest even."""
    if tensor.dtype == cache_dtype:
        return tensor
    if cache_dtype in FP8_DTYPES:
        limit = torch.finfo(cache_dtype).max
        tensor = tensor.clamp(-limit, limit)
    return tensor.to(cache_dtype)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its bytes (uint8, same shape), others as they are: the scatters and
    gathers below then need no float8 kernels, which torch lacks for some ops and devices."""
    return tensor.view(torch.uint8) if tensor.dtype in FP8_DTYPES else tensor


def write_kv(key_cache, value_cache, key, value, slot_mapping) -> None:
    """Scatters key/value [T, Hkv, D] into the per-layer caches [num_blocks, Hkv, block_size, D],
    converted to the caches' element type."""
    block_size = key_cache.shape[2]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    as_bytes(key_cache)[blocks, :, offsets] = as_bytes(to_cache_dtype(key, key_cache.dtype))
    as_bytes(value_cache)[blocks, :, offsets] = as_bytes(to_cache_dtype(value, value_cache.dtype))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's cached K or V as [Hkv, context_len, D]."""
    num_blocks = -(-context_len // cache.shape[2])
    blocks = as_bytes(cache)[block_table[:num_blocks].long()].view(cache.dtype)  # [n, Hkv, bs, D]
    return blocks.permute(1, 0, 2, 3).reshape(cache.shape[1], -1, cache.shape[3])[:, :context_len]


def paged_attention_ref(
    query, key_cache, value_cache, metadata: AttentionMetadata, scale: float, decode=None, prefill=None,
    sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D], causal over each sequence's cached context (over its last
    `sliding_window` positions, where given), the scaled logits soft-capped to
    `logit_softcap * tanh(logit / logit_softcap)` where given (Gemma 2); `sinks` ([Hq] logits,
    GPT-OSS's attention sinks) join each head's softmax as keys of zero value. `decode` replaces
    the batched decode part (same arguments as `decode_batch`); `prefill`, when it returns a
    tensor, the per-sequence prefill loop (query rows of the prefill chunks, caches, their block
    tables, query_start_loc and context_lens, scale, sliding_window, logit_softcap, sinks; None:
    not supported)."""
    output = torch.empty_like(query)
    num_prefills = metadata.num_prefills
    starts = metadata.query_start_loc_host
    prefilled = None
    if num_prefills and prefill is not None:
        num_prefill_tokens = starts[num_prefills]
        prefilled = prefill(
            query[:num_prefill_tokens], key_cache, value_cache, metadata.block_tables[:num_prefills],
            metadata.query_start_loc[: num_prefills + 1], metadata.context_lens[:num_prefills], scale, sliding_window,
            logit_softcap, sinks,
        )
        if prefilled is not None:
            output[:num_prefill_tokens] = prefilled
    for b in range(num_prefills if prefilled is None else 0):
        begin, end = starts[b], starts[b + 1]
        context_len = metadata.context_lens_host[b]
        output[begin:end] = prefill_one(
            query[begin:end], key_cache, value_cache, metadata.block_tables[b], context_len, scale, sliding_window,
            logit_softcap, sinks,
        )
    if metadata.num_decode_tokens:
        first = starts[num_prefills]
        output[first:] = (decode or decode_batch)(
            query[first:],
            key_cache,
            value_cache,
            metadata.block_tables[num_prefills:],
            metadata.context_lens[num_prefills:],
            metadata.max_context_len,
            scale,
            sliding_window,
            logit_softcap,
            sinks,
        )
    return output


def prefill_one(query, key_cache, value_cache, block_table, context_len: int, scale: float,
                sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One sequence's new tokens, query [q, Hq, D] -> [q, Hq, D]: the last q of its `context_len`
    cached tokens, each over the positions up to its own (options as `paged_attention_ref`)."""
    num_queries = query.shape[0]
    keys = gather_context(key_cache, block_table, context_len).to(query.dtype)
    values = gather_context(value_cache, block_table, context_len).to(query.dtype)
    # enable_gqa: query head h reads kv head h // group, without repeating K/V per query head.
    if num_queries == context_len and sliding_window is None and logit_softcap is None and sinks is None:  # plain causal: its kernels skip the masked half
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1), keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
        return out.transpose(0, 1)
    query_positions = torch.arange(context_len - num_queries, context_len, device=query.device)[:, None]
    key_positions = torch.arange(context_len, device=query.device)[None, :]
    mask = key_positions <= query_positions
    if sliding_window is not None:
        mask &= key_positions > query_positions - sliding_window
    if logit_softcap is not None or sinks is not None:  # SDPA has neither: the logits explicitly, [Hq, T, context]
        keys = keys.repeat_interleave(query.shape[1] // keys.shape[0], dim=0)
        values = values.repeat_interleave(query.shape[1] // values.shape[0], dim=0)
        scores = torch.matmul(query.transpose(0, 1), keys.transpose(1, 2)).float() * scale
        if logit_softcap is not None:
            scores = soft_cap(scores, logit_softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:  # one more key per head, whose value is zero: dropped after the softmax
            scores = torch.cat([scores, sinks.float().view(-1, 1, 1).expand(-1, num_queries, 1)], dim=-1)
        weights = torch.softmax(scores, dim=-1)[..., :context_len]
        return torch.matmul(weights.to(values.dtype), values).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


def decode_batch(query, key_cache, value_cache, block_tables, context_lens, max_context_len: int, scale: float,
                 sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
                 sinks: Optional[torch.Tensor] = None):
    """query [B, Hq, D] -> [B, Hq, D]: one query token per sequence over its first
    context_lens[b] cached tokens, all sequences at once (no Python loop).

    The gathered K/V stay block-shaped ([B, n, Hkv, bs, D], one index_select each, no permuted
    copy): scores are batched over (sequence, block, kv head) and the softmax runs over the
    (block, offset) axes together.
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    max_blocks = -(-max_context_len // block_size)
    flat_tables = block_tables[:, :max_blocks].reshape(-1).long()
    shape = (batch, max_blocks, num_kv_heads, block_size, head_dim)
    # (float8 caches are widened to the query's dtype: torch has no float8 matmul on every device)
    keys = as_bytes(key_cache).index_select(0, flat_tables).view(key_cache.dtype).view(shape).to(query.dtype)
    values = as_bytes(value_cache).index_select(0, flat_tables).view(value_cache.dtype).view(shape).to(query.dtype)
    group = num_heads // num_kv_heads
    queries = query.view(batch, 1, num_kv_heads, group, head_dim)
    scores = torch.matmul(queries, keys.transpose(-1, -2)).float() * scale  # [B, n, Hkv, G, bs]
    if logit_softcap is not None:
        scores = soft_cap(scores, logit_softcap)
    positions = torch.arange(max_blocks * block_size, device=query.device).view(1, max_blocks, 1, 1, block_size)
    context_ends = context_lens.view(-1, 1, 1, 1, 1).to(positions.dtype)
    invalid = positions >= context_ends
    if sliding_window is not None:
        invalid |= positions < context_ends - sliding_window
    scores = scores.masked_fill(invalid, float("-inf"))
    maxima = scores.amax(dim=(1, 4), keepdim=True)
    if sinks is not None:  # a key of zero value per head, in the max and the sum
        sink = sinks.float().view(1, 1, num_kv_heads, group, 1)
        maxima = torch.maximum(maxima, sink)
    weights = torch.exp(scores - maxima)
    total = weights.sum(dim=(1, 4), keepdim=True).squeeze(1)  # [B, Hkv, G, 1]
    if sinks is not None:
        total = total + torch.exp(sink - maxima).squeeze(1)
    out = torch.matmul(weights.to(values.dtype), values).sum(1, dtype=torch.float32)  # [B, Hkv, G, D]
    return (out / total).to(query.dtype).reshape(batch, num_heads, head_dim)


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap): logits squashed smoothly into (-cap, cap) (Gemma 2)."""
    return torch.tanh(logits / cap) * cap


def copy_blocks(kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy-on-write: kv_cache [N, L, 2, Hkv, bs, D]; pairs int64 [P, 2] of (src, dst)."""
    if pairs.numel():
        as_bytes(kv_cache)[pairs[:, 1]] = as_bytes(kv_cache)[pairs[:, 0]]


class TorchRefBackend:
    """The attention backend built on the reference functions above (AttentionBackend)."""

    name = "torch"
    supports_cuda_graphs = False  # (its prefill and decode loops read the host lists)

    @classmethod
    def check_supported(cls, device: str, head_dim: Optional[int]) -> None:
        """Runs anywhere torch does."""

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Nothing to do once per step."""

    def write_kv(self, key_cache, value_cache, key, value, slot_mapping) -> None:
        write_kv(key_cache, value_cache, key, value, slot_mapping)

    def forward(self, query, key_cache, value_cache, metadata: AttentionMetadata, scale: float,
                sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of the step's new tokens, each over its sequence's cached context (its last
        `sliding_window` positions, where given), logits soft-capped at `logit_softcap` and
        attention sinks ([Hq] logits) in the softmax, where given."""
        return paged_attention_ref(query, key_cache, value_cache, metadata, scale, sliding_window=sliding_window,
                                   logit_softcap=logit_softcap, sinks=sinks)

    def copy_blocks(self, kv_cache, pairs) -> None:
        copy_blocks(kv_cache, pairs)
