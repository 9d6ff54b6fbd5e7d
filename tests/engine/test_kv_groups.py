"""KV-cache groups for models that mix sliding-window and full-attention layers (runner/kv_groups.py):
how layers are grouped, and the engine over a tiny Gemma-3-like and GPT-OSS-like checkpoint with
groups on and off, against HF, under preemption and beside the pool's limit."""

import pytest
import torch
from support.checkpoints import save_tiny_checkpoint
from support.tiny_models import tiny_gemma3, tiny_gpt_oss

from pagedkv import LLM, SamplingParams
from pagedkv.runner.kv_groups import KVCacheGroups


def test_one_kind_of_layer_is_one_group():
    assert KVCacheGroups.for_layers([None] * 4) == KVCacheGroups.single(4)
    assert KVCacheGroups.for_layers([64] * 3).windows == (64,)
    # Without the hybrid manager, mixed layers keep every block (full attention), as before.
    assert KVCacheGroups.for_layers([64, None], hybrid=False) == KVCacheGroups.single(2)


def test_gemma3_layers_make_five_windowed_groups_per_full_one():
    windows = [1024 if (layer + 1) % 6 else None for layer in range(12)]  # every sixth layer is full
    groups = KVCacheGroups.for_layers(windows)
    assert groups.windows == (1024,) * 5 + (0,)
    assert groups.slots_per_block == 2
    assert [groups.layer_group[5], groups.layer_group[11]] == [5, 5]
    assert sorted(zip(groups.layer_group, groups.layer_slot)) == [(g, s) for g in range(6) for s in range(2)]


def test_uneven_kinds_leave_a_short_last_group():
    # Gemma 3 1B: 26 layers, 4 of them full. Groups of 4 layers: the windowed kind's last has 2.
    windows = [512 if (layer + 1) % 6 else None for layer in range(26)]
    groups = KVCacheGroups.for_layers(windows)
    assert groups.windows == (512,) * 6 + (0,)
    assert groups.slots_per_block == 4
    assert [groups.layer_group.count(group) for group in range(7)] == [4, 4, 4, 4, 4, 2, 4]


def test_gpt_oss_alternating_layers_make_two_groups():
    groups = KVCacheGroups.for_layers([128, None, 128, None])
    assert groups.windows == (128, 0)
    assert groups.layer_group == (0, 1, 0, 1) and groups.layer_slot == (0, 0, 1, 1)
    assert groups.describe() == "2 groups of 2 layers: 1 with window 128, 1 full"


HYBRID_MODELS = {"gemma3": tiny_gemma3, "gpt_oss": tiny_gpt_oss}


@pytest.mark.parametrize("name", HYBRID_MODELS)
def test_greedy_tokens_and_logprobs_match_hf_with_groups_on_and_off_and_under_preemption(tmp_path, name):
    """Pools tight enough that the prompts preempt each other (groups on need less: their windowed
    layers hold their window), then every run gives HF's greedy tokens and top logprobs (the tiny
    models' greedy tokens barely depend on the context: their logprobs do) and every block back."""
    hf_model = HYBRID_MODELS[name]()
    directory = save_tiny_checkpoint(tmp_path, hf_model)
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in (20, 25, 30, 18)]
    expected = [_hf_greedy(hf_model, prompt, 60) for prompt in prompts]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=3)
    for disable, pool in ((False, 6), (True, 10)):
        llm = LLM(directory, dtype="float32", max_num_batched_tokens=32, max_num_seqs=4,
                  disable_hybrid_kv_cache_manager=disable, kv_cache_memory_bytes=_bytes_of_blocks(hf_model, pool))
        assert (llm.engine.runner.kv_groups.num_groups > 1) != disable
        for output, (tokens, logprobs) in zip(llm.generate(prompts, params, use_tqdm=False), expected):
            assert output.outputs[0].token_ids == tokens
            ours = torch.tensor([sorted(step.values(), reverse=True) for step in output.outputs[0].logprobs])
            assert torch.allclose(ours, logprobs, atol=2e-4), (ours - logprobs).abs().max()
        stats = llm.engine.scheduler.stats()
        assert stats["num_free_device_blocks"] == stats["num_device_blocks"], "every block comes back"
        assert stats["num_preemptions_swap"] + stats["num_preemptions_recompute"] > 0, "the pool is tight"


def test_a_hybrid_pool_serves_longer_sequences_than_every_layer_keeping_every_block(tmp_path):
    """Same KV bytes: without groups the pool bounds the length (14 blocks of 16 tokens = 224);
    with them only the full layer's group grows with it, so the tiny Gemma 3 generates past 224
    tokens, as HF does."""
    hf_model = tiny_gemma3()
    directory = save_tiny_checkpoint(tmp_path, hf_model)
    options = dict(dtype="float32", max_num_batched_tokens=32, kv_cache_memory_bytes=_bytes_of_blocks(hf_model, 14))
    off = LLM(directory, disable_hybrid_kv_cache_manager=True, **options)
    assert off.engine.max_model_len == 14 * 16
    on = LLM(directory, **options)
    assert on.engine.max_model_len > 14 * 16
    # One layer a block: three times the blocks for the same bytes.
    assert on.engine.runner.kv_groups.slots_per_block == 1
    assert on.engine.runner.num_device_blocks == 3 * off.engine.runner.num_device_blocks
    prompt = torch.randint(3, 256, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    tokens, logprobs = _hf_greedy(hf_model, prompt, 60)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=3)
    output = on.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert output.token_ids == tokens
    ours = torch.tensor([sorted(step.values(), reverse=True) for step in output.logprobs])
    assert torch.allclose(ours, logprobs, atol=2e-4)


def _hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens and the top 3 logprobs of each step."""
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True)
    logprobs = torch.cat(out.logits).float().log_softmax(-1).topk(3).values
    return out.sequences[0, len(prompt):].tolist(), logprobs


def _bytes_of_blocks(hf_model, num_blocks: int, block_size: int = 16) -> int:
    """KV bytes of `num_blocks` float32 blocks holding every layer (groups off)."""
    config = hf_model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return num_blocks * config.num_hidden_layers * 2 * config.num_key_value_heads * block_size * head_dim * 4
