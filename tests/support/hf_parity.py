"""Our model against HF transformers: prefill logits at every position and greedy generations."""

import torch

from pagedkv.attention import AttentionMetadata, StepContext, TorchRefBackend
from pagedkv.runner.kv_cache import KVCache
from pagedkv.models.loader import load


def prefill_all_positions(model, token_ids: list[int], block_table: list[int], block_size: int, num_blocks: int):
    """Runs one whole-prompt prefill through the paged cache and returns logits at every position."""
    attention = model.layers[0].self_attn
    cache = KVCache(
        len(model.layers), attention.num_kv_heads, attention.head_dim, block_size, num_blocks, 0, torch.float32, "cpu"
    )
    num_tokens = len(token_ids)
    slots = [block_table[p // block_size] * block_size + p % block_size for p in range(num_tokens)]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        context_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.tensor([block_table], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=num_tokens,
        max_context_len=num_tokens,
        num_decode_tokens=0,
        query_start_loc_host=[0, num_tokens],
        context_lens_host=[num_tokens],
    )
    with torch.inference_mode():
        context = StepContext.build(metadata, cache, TorchRefBackend())
        hidden = model(torch.tensor(token_ids), torch.arange(num_tokens), context)
        return model.compute_logits(hidden)


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def assert_prefill_matches_hf(directory: str, model_type: str, tolerance: float = 1e-4, hf_class=None, **hf_options):
    """Our loader's model and HF's (`hf_class`, AutoModelForCausalLM by default) on one 37-token
    prompt over a non-contiguous block table."""
    from transformers import AutoModelForCausalLM

    loaded = load(directory, None, None, torch.float32, torch.device("cpu"), None)
    assert loaded.hf_config.model_type == model_type
    hf_model = (hf_class or AutoModelForCausalLM).from_pretrained(directory, dtype=torch.float32, **hf_options).eval()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 256, (37,), generator=generator).tolist()
    ours = prefill_all_positions(loaded.model, tokens, [3, 0, 6], block_size=16, num_blocks=8)
    reference = hf_logits(hf_model, tokens)
    assert (ours - reference).abs().max().item() < tolerance
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    return loaded


def assert_greedy_generation_matches_hf(hf_model, directory: str, lengths, max_tokens: int, seed: int, **options):
    """Random prompts of these lengths, greedy through our engine (batched, prefill chunks of 32
    tokens) and through HF `generate`: the same tokens. Returns the LLM."""
    from pagedkv import LLM, SamplingParams

    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in lengths]
    with torch.inference_mode():
        expected = [hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, pad_token_id=0)[0, len(prompt):].tolist()
                    for prompt in prompts]
    llm = LLM(directory, **{"dtype": "float32", "max_num_batched_tokens": 32, "num_device_blocks": 64, **options})
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    return llm
