"""Our Llama-family model against HF transformers: SmolLM2 (GGUF, Llama) and tiny random
checkpoints of the other architectures (Qwen2 with qkv bias, Qwen3 with q/k norms, ...) loaded from
safetensors by our loader."""

import glob
import os

import pytest
import torch
from conftest import save_tiny_checkpoint

from pagedkv.attention import AttentionMetadata, TorchRefBackend
from pagedkv.kv_cache import KVCache
from pagedkv.loader import default_model_path, load
from pagedkv.models.blocks import ParallelBlock


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
        hidden = model(torch.tensor(token_ids), torch.arange(num_tokens), metadata, cache, TorchRefBackend())
        return model.compute_logits(hidden)


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def test_default_model_path_points_at_the_embedded_gguf(smollm2):
    assert default_model_path() == smollm2


def test_smollm2_prefill_logits_match_hf(smollm2_runner, smollm2_hf_model):
    tokens = smollm2_runner.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    tokens = tokens + tokens[:7]  # 2 blocks of 16, the second partly filled
    ours = prefill_all_positions(smollm2_runner.model, tokens, [5, 2], block_size=16, num_blocks=8)
    reference = hf_logits(smollm2_hf_model, tokens)
    assert ours.dtype == torch.float32 and ours.shape == reference.shape
    assert (ours - reference).abs().max().item() < 2e-3
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_tiny_qwen2_from_safetensors_matches_hf(tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    loaded = load(tiny_qwen2_dir, None, None, torch.float32, torch.device("cpu"), None)
    assert loaded.hf_config.model_type == "qwen2"
    assert loaded.model.layers[0].self_attn.qkv_proj.bias is not None
    assert 2 in loaded.eos_token_ids
    assert loaded.tokenizer.convert_tokens_to_ids("w7") == 7
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 256, (37,), generator=generator).tolist()
    ours = prefill_all_positions(loaded.model, tokens, [3, 0, 6], block_size=16, num_blocks=8)
    reference = hf_logits(hf_model, tokens)
    assert (ours - reference).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


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


def randomize_biases(model, low: float = -0.5, high: float = 0.5) -> None:
    """Biases drawn from [low, high) (random init leaves them at 0), so each shows in the logits."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.uniform_(low, high)


def randomize_norms(model, low: float, high: float) -> None:
    """Norm weights drawn from [low, high) (random init leaves them constant), so each norm's
    form and placement shows in the logits."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(low, high)


def test_a_bfloat16_load_holds_the_float32_weights_rounded_once(tiny_qwen2_dir):
    """The loader allocates parameters in the engine's dtype and copies the checkpoint into them:
    the same numbers as a float32 model cast afterwards, with no float32 copy on the host."""
    as_float32 = load(tiny_qwen2_dir, None, None, torch.float32, torch.device("cpu"), None).model.state_dict()
    as_bfloat16 = load(tiny_qwen2_dir, None, None, torch.bfloat16, torch.device("cpu"), None).model.state_dict()
    assert as_float32.keys() == as_bfloat16.keys()
    for name, tensor in as_bfloat16.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, as_float32[name].to(torch.bfloat16)), name


def test_tiny_qwen3_with_query_and_key_norms_matches_hf(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # head_dim 32 with hidden 64 and 4 heads: the attention is wider than the residual stream,
    # as in Qwen3-0.6B (16 x 128 over 1024)
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # norm weights far from 1, so a skipped q/k norm shows in the logits
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.2, 3.0)
            layer.self_attn.k_norm.weight.uniform_(0.2, 3.0)
    loaded = assert_prefill_matches_hf(save_tiny_checkpoint(tmp_path, model), "qwen3")
    assert loaded.model.layers[0].self_attn.q_norm is not None


TINY_MOE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, eos_token_id=2, bos_token_id=1, num_experts_per_tok=2)


def tiny_moe_models(qwen3_head_dim: int = 16):
    """(model_type, HF model): Mixtral (always renormalized), Qwen3-MoE (q/k norms, one dense
    layer, renormalized), Qwen2-MoE (shared expert, qkv bias, not renormalized) and Granite MoE
    (Granite's multipliers, softmax over the top-k logits) and OLMoE (q/k norms over whole
    projections, clipped q/k/v, not renormalized)."""
    from transformers import (GraniteMoeConfig, GraniteMoeForCausalLM, MixtralConfig, MixtralForCausalLM,
                              OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    torch.manual_seed(0)
    yield "mixtral", MixtralForCausalLM(MixtralConfig(**TINY_MOE, intermediate_size=48, num_local_experts=8))
    yield "qwen3_moe", Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **TINY_MOE, head_dim=qwen3_head_dim, intermediate_size=96, moe_intermediate_size=32, num_experts=6, mlp_only_layers=[1],
        norm_topk_prob=True))
    yield "qwen2_moe", Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **TINY_MOE, intermediate_size=96, moe_intermediate_size=32, num_experts=6, shared_expert_intermediate_size=40,
        norm_topk_prob=False))
    yield "granitemoe", GraniteMoeForCausalLM(GraniteMoeConfig(
        **TINY_MOE, intermediate_size=32, num_local_experts=6, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.0078125, logits_scaling=8.0))
    yield "olmoe", OlmoeForCausalLM(OlmoeConfig(
        **TINY_MOE, intermediate_size=32, num_experts=6, norm_topk_prob=False, clip_qkv=0.5))


@pytest.mark.parametrize("index", range(5), ids=["mixtral", "qwen3_moe", "qwen2_moe", "granitemoe", "olmoe"])
def test_tiny_mixture_of_experts_checkpoints_match_hf(tmp_path, index):
    model_type, hf_model = list(tiny_moe_models())[index]
    with torch.no_grad():  # a sharper router than random init's, so every token's top-k is decisive
        for name, parameter in hf_model.named_parameters():
            if name.endswith(("mlp.gate.weight", "router.weight")):
                parameter.normal_(std=1.0)
    loaded = assert_prefill_matches_hf(save_tiny_checkpoint(tmp_path, hf_model.eval()), model_type)
    layers = loaded.model.layers
    assert [layer.is_moe for layer in layers] == ([True, False, True] if model_type == "qwen3_moe" else [True] * 3)
    assert layers[0].mlp.has_shared_expert == (model_type == "qwen2_moe")
    # transformers keeps experts stacked in memory (what a GGUF file is dequantized into): same weights
    again = type(loaded.model)(loaded.hf_config, 512, torch.float32)
    again.load_hf_state_dict(hf_model.state_dict())
    for (name, ours), theirs in zip(loaded.model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(ours, theirs), name


def tiny_gemma3(**overrides):
    """A random Gemma 3 text model: sliding (window 16, rope base 1e4) and full layers (rope base
    1e6, linear scaling), query_pre_attn_scalar apart from head_dim, soft-capped logits."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=512, eos_token_id=2, bos_token_id=1,
        pad_token_id=0, sliding_window=16, query_pre_attn_scalar=48, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}},
        **overrides,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    randomize_norms(model, -0.5, 0.5)  # offsets away from 0, so (1 + w) matters
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(std=0.3)
    return model.eval()


def test_tiny_smollm3_with_rotary_free_layers_matches_hf(tmp_path):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    config = SmolLM3Config(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                           no_rope_layers=[1, 1, 0, 1], eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    loaded = assert_prefill_matches_hf(save_tiny_checkpoint(tmp_path, SmolLM3ForCausalLM(config).eval()), "smollm3")
    assert [layer.self_attn.use_rope for layer in loaded.model.layers] == [True, True, False, True]


def test_tiny_granite_with_its_multipliers_matches_hf(tmp_path):
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                           logits_scaling=8.0, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    assert_prefill_matches_hf(save_tiny_checkpoint(tmp_path, GraniteForCausalLM(config).eval()), "granite")


def tiny_phi3(tmp_path):
    """A random Phi-3 (fused qkv and gate/up weights) with Phi-4-mini's partial rotary factor and
    LongRoPE factors over a pretraining length of 64."""
    from transformers import Phi3Config, Phi3ForCausalLM

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 64, "short_factor": [1.0, 1.3, 2.1, 4.0],
            "long_factor": [1.0, 2.5, 6.0, 16.0]}
    config = Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        original_max_position_embeddings=64, rope_parameters=rope, eos_token_id=2, bos_token_id=1,
                        pad_token_id=0)
    torch.manual_seed(0)
    return save_tiny_checkpoint(tmp_path, Phi3ForCausalLM(config).eval())


def test_tiny_phi3_with_partial_rotary_and_longrope_matches_hf(tmp_path):
    """Within the pretraining length (where every implementation uses the short factors); past it,
    each position is rotated with the long factors."""
    from pagedkv.layers.rotary_embedding import rope_inverse_frequencies

    loaded = assert_prefill_matches_hf(tiny_phi3(tmp_path), "phi3")
    rotary, config = loaded.model.rotary, loaded.hf_config
    assert rotary.cos.shape[-1] == 8  # half of each 16-dim head rotates
    short, scaling = rope_inverse_frequencies(config)
    long, _ = rope_inverse_frequencies(config, seq_len=65)
    assert not torch.allclose(short, long)
    for position, inv_freq in ((63, short), (64, long), (200, long)):
        angles = position * inv_freq
        torch.testing.assert_close(rotary.cos[position], torch.cat([angles, angles]).cos() * scaling)


def test_tiny_gemma3_matches_hf_past_its_window(tmp_path):
    hf_model = tiny_gemma3()
    directory = save_tiny_checkpoint(tmp_path, hf_model)
    loaded = assert_prefill_matches_hf(directory, "gemma3_text")
    assert [layer.self_attn.sliding_window for layer in loaded.model.layers] == [16, None, 16]

    assert_greedy_generation_matches_hf(hf_model, directory, (40, 7, 70), 20, seed=6)


def tiny_gemma2():
    """A random Gemma 2: sliding (window 16) and full layers sharing one rope, attention logits
    soft-capped at 2 (so the cap bends them: Gemma 2's own 50 barely touches random ones)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=512, eos_token_id=2, bos_token_id=1,
        pad_token_id=0, sliding_window=16, query_pre_attn_scalar=48, attn_logit_softcapping=2.0,
        final_logit_softcapping=30.0, attn_implementation="eager",  # (SDPA would drop the soft cap)
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config)
    randomize_norms(model, -0.5, 0.5)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(std=0.3)
        for layer in model.model.layers:  # larger queries: logits of several units, where the cap bends them
            layer.self_attn.q_proj.weight.mul_(8)
    return model.eval()


def test_tiny_gemma2_with_soft_capped_attention_matches_hf(tmp_path):
    hf_model = tiny_gemma2()
    directory = save_tiny_checkpoint(tmp_path, hf_model)
    loaded = assert_prefill_matches_hf(directory, "gemma2", attn_implementation="eager")
    assert [layer.self_attn.sliding_window for layer in loaded.model.layers] == [16, None, 16]
    assert {layer.self_attn.logit_softcap for layer in loaded.model.layers} == {2.0}

    # Prompts past the window, decoded by the Rust kernels (prefill chunks of 32 tokens)
    assert_greedy_generation_matches_hf(hf_model, directory, (40, 9, 70), 16, seed=7)
    # ... and the soft cap matters: without it the logits differ
    with torch.inference_mode():
        tokens = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(3)).tolist()
        capped = prefill_all_positions(loaded.model, tokens, [3, 0, 6], block_size=16, num_blocks=8)
        for layer in loaded.model.layers:
            layer.self_attn.logit_softcap = None
        uncapped = prefill_all_positions(loaded.model, tokens, [3, 0, 6], block_size=16, num_blocks=8)
    assert (capped - uncapped).abs().max().item() > 0.1


def test_tiny_gemma1_matches_hf(tmp_path):
    """Gemma 1: Llama's layout with Gemma's norms, scaled embeddings and a GELU MLP (the legacy
    `hidden_act="gelu"` of the official configs means the tanh approximation, as transformers
    reads it)."""
    from pagedkv.layers.activation import gelu_tanh_and_mul
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                         hidden_act="gelu", eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = GemmaForCausalLM(config)
    randomize_norms(model, -0.5, 0.5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "mlp" in name:  # an MLP that dominates the residual stream, so its activation shows
                parameter.mul_(20)
    loaded = assert_prefill_matches_hf(save_tiny_checkpoint(tmp_path, model.eval()), "gemma")
    assert not any(layer.sandwich_norms or layer.self_attn.sliding_window for layer in loaded.model.layers)
    assert loaded.model.layers[0].mlp.act_and_mul is gelu_tanh_and_mul


def tiny_starcoder2(directory):
    """A random StarCoder2 (hidden 128, MLP 192, 2 query heads and 1 KV head of 64, every layer
    windowed over 16 positions) with random norms and biases, saved in `directory`. Returns the
    HF model."""
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    config = Starcoder2Config(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                              sliding_window=16, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = Starcoder2ForCausalLM(config)
    randomize_norms(model, 0.5, 1.5)
    randomize_biases(model)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(std=0.5)  # (tied: decisive logits too)
    save_tiny_checkpoint(directory, model.eval())
    return model


def test_tiny_starcoder2_matches_hf_and_releases_blocks_behind_its_window(tmp_path):
    """StarCoder2: biased LayerNorms and projections, a GELU MLP without a gate, tied embeddings,
    every layer windowed (16 positions): prefill logits, and greedy generation in a pool of 5
    blocks of 16 that the longest sequence (70 + 16 tokens) outgrows unless blocks behind its
    window are released."""
    model = tiny_starcoder2(tmp_path)
    directory = str(tmp_path)
    loaded = assert_prefill_matches_hf(directory, "starcoder2")
    assert loaded.model.layers[0].self_attn.o_proj.bias is not None
    llm = assert_greedy_generation_matches_hf(model, directory, (40, 9, 70), 16, seed=7, attention_backend="cpu",
                                              num_device_blocks=5)
    assert llm.engine.runner.sliding_window == 16 and llm.engine.max_model_len == 512


def test_tiny_glm4_matches_hf(tmp_path):
    """GLM-4: four norms per layer, rotary embedding over adjacent pairs of the first half of each
    head, biased q/k/v but not o_proj, fused gate/up: prefill logits and greedy generation as
    HF's, and rotating halves instead of pairs would show."""
    from transformers import Glm4Config, Glm4ForCausalLM

    config = Glm4Config(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                        eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = Glm4ForCausalLM(config)
    randomize_norms(model, 0.5, 1.5)
    randomize_biases(model)
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.5)
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    loaded = assert_prefill_matches_hf(directory, "glm4")
    attention = loaded.model.layers[0].self_attn
    assert attention.rope_interleaved and attention.qkv_proj.bias is not None and attention.o_proj.bias is None
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)
    tokens = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        pairs = prefill_all_positions(loaded.model, tokens, [3, 0, 6], block_size=16, num_blocks=8)
        for layer in loaded.model.layers:
            layer.self_attn.rope_interleaved = False
        halves = prefill_all_positions(loaded.model, tokens, [3, 0, 6], block_size=16, num_blocks=8)
    assert (pairs - halves).abs().max().item() > 0.1


@pytest.mark.parametrize("use_qk_norm", [False, True], ids=["command-r", "command-r-plus"])
def test_tiny_cohere_matches_hf(tmp_path, use_qk_norm):
    """Cohere: parallel attention and MLP off one mean-subtracting norm, rotary embedding over
    adjacent pairs, per-head query/key norms (Command R+), scaled logits."""
    from transformers import CohereConfig, CohereForCausalLM

    config = CohereConfig(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                          use_qk_norm=use_qk_norm, logit_scale=0.5, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = CohereForCausalLM(config)
    randomize_norms(model, 0.5, 1.5)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(std=1.0)  # (tied, and scaled by 0.5: decisive logits)
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    loaded = assert_prefill_matches_hf(directory, "cohere")
    assert (loaded.model.layers[0].self_attn.q_norm is not None) == use_qk_norm
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)


def tiny_phi2(directory):
    """A random Phi-2 (hidden 160, 2 heads of 80, rotary on 32 dims of each) with random norms and
    biases, saved in `directory`. Returns the HF model."""
    from transformers import PhiConfig, PhiForCausalLM

    config = PhiConfig(vocab_size=256, hidden_size=160, intermediate_size=192, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                       eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = PhiForCausalLM(config)
    randomize_norms(model, 0.5, 1.5)
    randomize_biases(model)
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.5)
    save_tiny_checkpoint(directory, model.eval())
    return model


def test_tiny_phi2_matches_hf(tmp_path):
    """Phi-2: parallel attention and GELU MLP off one biased LayerNorm, biases everywhere (the LM
    head's too), rotary embedding on 40% of each head (32 of 80 dims)."""
    model, directory = tiny_phi2(tmp_path), str(tmp_path)
    loaded = assert_prefill_matches_hf(directory, "phi")
    assert loaded.model.lm_head.bias is not None and loaded.model.layers[0].self_attn.o_proj.bias is not None
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)


@pytest.mark.parametrize("parallel", [True, False], ids=["pythia", "sequential"])
def test_tiny_gpt_neox_matches_hf(tmp_path, parallel):
    """GPT-NeoX: two biased LayerNorms per layer, attention and MLP in parallel (Pythia) or in
    sequence, q/k/v interleaved per head in one checkpoint tensor, rotary embedding on a quarter
    of each head (16 of 64 dims)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                           num_attention_heads=2, max_position_embeddings=512, use_parallel_residual=parallel,
                           eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(config)
    randomize_norms(model, 0.5, 1.5)
    randomize_biases(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(std=0.5)
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    loaded = assert_prefill_matches_hf(directory, "gpt_neox")
    assert isinstance(loaded.model.layers[0], ParallelBlock) == parallel
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)


@pytest.mark.parametrize("variant", ["7b", "40b", "falcon2", "sequential"])
def test_tiny_falcon_matches_hf(tmp_path, variant):
    """Falcon: Falcon-7B's multi-query attention beside the MLP off one norm; Falcon-40B's new
    decoder architecture (grouped KV heads, a norm each for attention and MLP); Falcon 2's (one
    shared norm); multi-head attention and MLP in sequence with biases."""
    from transformers import FalconConfig, FalconForCausalLM

    shape = dict(vocab_size=256, hidden_size=128, ffn_hidden_size=192, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=512, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    options = {"7b": dict(multi_query=True, parallel_attn=True),
               "40b": dict(new_decoder_architecture=True, num_kv_heads=2),
               "falcon2": dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
               "sequential": dict(multi_query=False, parallel_attn=False, bias=True, tie_word_embeddings=False)}
    torch.manual_seed(0)
    model = FalconForCausalLM(FalconConfig(**shape, **options[variant]))
    randomize_norms(model, 0.5, 1.5)
    randomize_biases(model)
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    loaded = assert_prefill_matches_hf(directory, "falcon")
    attention = loaded.model.layers[0].self_attn
    assert attention.num_kv_heads == {"7b": 1, "40b": 2, "falcon2": 2, "sequential": 4}[variant]
    assert isinstance(loaded.model.layers[0], ParallelBlock) == (variant != "sequential")
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)


def test_falcon_with_alibi_is_refused(tmp_path):
    from transformers import FalconConfig, FalconForCausalLM

    model = FalconForCausalLM(FalconConfig(vocab_size=256, hidden_size=64, ffn_hidden_size=96, num_hidden_layers=1,
                                           num_attention_heads=2, alibi=True, multi_query=False))
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    with pytest.raises(ValueError, match="ALiBi"):
        load(directory, None, None, torch.float32, torch.device("cpu"), None)


def tiny_absolute_position_models():
    """(model_type, HF model) of the learned-position families: GPT-2, OPT, and GPTBigCode with
    multi-query attention (StarCoder's) and without."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPTBigCodeConfig, GPTBigCodeForCausalLM, OPTConfig, OPTForCausalLM

    common = dict(vocab_size=256, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    yield "gpt2", GPT2LMHeadModel(GPT2Config(n_embd=128, n_layer=2, n_head=2, n_positions=512, **common))
    yield "opt", OPTForCausalLM(OPTConfig(hidden_size=128, ffn_dim=192, num_hidden_layers=2, num_attention_heads=2,
                                          word_embed_proj_dim=128, max_position_embeddings=512, **common))
    for multi_query in (True, False):
        torch.manual_seed(0)
        yield "gpt_bigcode", GPTBigCodeForCausalLM(GPTBigCodeConfig(n_embd=128, n_layer=2, n_head=2, n_positions=512,
                                                                    multi_query=multi_query, **common))


@pytest.mark.parametrize("index", range(4), ids=["gpt2", "opt", "starcoder-mqa", "gpt_bigcode-mha"])
def test_learned_position_models_match_hf(tmp_path, index):
    """GPT-2 (Conv1D weights, fused c_attn), OPT (positions offset by 2, ReLU MLP) and GPTBigCode
    (multi-query or per-head fused c_attn): learned absolute positions instead of rotary
    embedding, biased LayerNorms and projections."""
    model_type, model = list(tiny_absolute_position_models())[index]
    randomize_norms(model, 0.5, 1.5)
    randomize_biases(model)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(std=0.5)  # (tied: decisive logits too)
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    loaded = assert_prefill_matches_hf(directory, model_type)
    assert not loaded.model.layers[0].self_attn.use_rope
    if model_type == "gpt_bigcode":
        assert loaded.model.layers[0].self_attn.num_kv_heads == (1 if model.config.multi_query else 2)
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)


def tiny_llama_variants():
    """(model_type, HF model) of Llama's layout with other rope layouts and biases: Ministral
    (every layer windowed), Helium (pairs rotated, biased q/k/v, unbiased o_proj, biased MLP),
    Seed-OSS (its own attention_out_bias), ERNIE 4.5 (pairs rotated, biases everywhere), GLM
    (pairs rotated over half of each head, gate/up fused) and Arcee (an ungated squared-ReLU MLP)."""
    import transformers

    common = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=512, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    variants = {
        "ministral": ("MinistralConfig", "MinistralForCausalLM", dict(sliding_window=16, layer_types=["sliding_attention"] * 2)),
        "helium": ("HeliumConfig", "HeliumForCausalLM", dict(attention_bias=True, mlp_bias=True)),
        "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(attention_bias=True, attention_out_bias=False,
                                                                  mlp_bias=True)),
        "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(use_bias=True)),
        "glm": ("GlmConfig", "GlmForCausalLM", dict(attention_bias=True)),
        "arcee": ("ArceeConfig", "ArceeForCausalLM", dict(mlp_bias=True)),
    }
    for model_type, (config_class, model_class, extra) in variants.items():
        torch.manual_seed(0)
        config = getattr(transformers, config_class)(**common, head_dim=64, **extra)
        yield model_type, getattr(transformers, model_class)(config)


@pytest.mark.parametrize("index", range(6), ids=["ministral", "helium", "seed_oss", "ernie4_5", "glm", "arcee"])
def test_llama_variants_match_hf(tmp_path, index):
    model_type, model = list(tiny_llama_variants())[index]
    randomize_norms(model, 0.5, 1.5)
    randomize_biases(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(std=0.5)
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    loaded = assert_prefill_matches_hf(directory, model_type)
    attention = loaded.model.layers[0].self_attn
    assert attention.rope_interleaved == (model_type in ("helium", "ernie4_5", "glm"))
    assert (attention.o_proj.bias is not None) == (model_type == "ernie4_5")
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)


def test_tiny_gptj_matches_hf(tmp_path):
    """GPT-J: parallel blocks, unbiased attention, rotary embedding over adjacent pairs of the first
    16 of 64 dims of each head, biased MLP and LM head."""
    from transformers import GPTJConfig, GPTJForCausalLM

    config = GPTJConfig(vocab_size=256, n_embd=128, n_layer=2, n_head=2, rotary_dim=16, n_positions=512,
                        eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = GPTJForCausalLM(config)
    randomize_norms(model, 0.5, 1.5)
    randomize_biases(model)
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.5)
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    loaded = assert_prefill_matches_hf(directory, "gptj")
    attention = loaded.model.layers[0].self_attn
    assert attention.rope_interleaved and attention.qkv_proj.bias is None and loaded.model.lm_head.bias is not None
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)


def test_tiny_olmo1_matches_hf(tmp_path):
    """OLMo 1: Llama's blocks with LayerNorms that learn nothing, q/k/v clipped."""
    from transformers import OlmoConfig, OlmoForCausalLM

    config = OlmoConfig(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, clip_qkv=0.5,
                        eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = OlmoForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.5)
        for layer in model.model.layers:  # q/k/v well past the clip
            layer.self_attn.q_proj.weight.mul_(20)
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    loaded = assert_prefill_matches_hf(directory, "olmo")
    assert loaded.model.layers[0].self_attn.clip_qkv == 0.5
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)


def test_tiny_nemotron_matches_hf(tmp_path):
    """Nemotron: LayerNorms with (1 + w) weights and biases, a squared-ReLU MLP without gate,
    rotary embedding on half of each head."""
    from transformers import NemotronConfig, NemotronForCausalLM

    config = NemotronConfig(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                            eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = NemotronForCausalLM(config)
    randomize_norms(model, -0.5, 0.5)
    randomize_biases(model)
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.5)
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    assert_prefill_matches_hf(directory, "nemotron")
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)


@pytest.mark.parametrize("twelve_b", [False, True], ids=["stablelm-2-1.6b", "stablelm-2-12b"])
def test_tiny_stablelm_matches_hf(tmp_path, twelve_b):
    """StableLM 2: biased LayerNorms, q/k/v biases, rotary embedding on a quarter of each head;
    the 12B's parallel blocks and per-head query/key LayerNorms."""
    from transformers import StableLmConfig, StableLmForCausalLM

    config = StableLmConfig(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                            use_qkv_bias=True, use_parallel_residual=twelve_b, qk_layernorm=twelve_b,
                            eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = StableLmForCausalLM(config)
    randomize_norms(model, 0.5, 1.5)
    randomize_biases(model)  # (the LayerNorms' too)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "_layernorm.norms." in name and name.endswith("weight"):  # the 12B's per-head q/k LayerNorms
                parameter.uniform_(0.5, 1.5)
        model.lm_head.weight.normal_(std=0.5)
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    loaded = assert_prefill_matches_hf(directory, "stablelm")
    assert (loaded.model.layers[0].self_attn.q_norm is not None) == twelve_b
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)


def test_tiny_exaone4_matches_hf(tmp_path):
    """EXAONE 4: OLMo 2's post-norm blocks, per-head query/key norms, windowed layers (16
    positions) and full layers without rotary embedding, past the window."""
    from transformers import Exaone4Config, Exaone4ForCausalLM

    config = Exaone4Config(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                           sliding_window=16, sliding_window_pattern=2, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = Exaone4ForCausalLM(config)
    randomize_norms(model, 0.5, 1.5)
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.5)
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    loaded = assert_prefill_matches_hf(directory, "exaone4")
    attention = [layer.self_attn for layer in loaded.model.layers]
    assert [a.sliding_window for a in attention] == [16, None] and [a.use_rope for a in attention] == [True, False]
    assert attention[0].q_norm is not None
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)


def tiny_image_text_models():
    """(model_type, text model_type, HF model) of image-text checkpoints: Gemma 3 (4B and up) and
    Mistral 3 (Mistral Small 3.1 and up), with tiny vision towers."""
    import transformers
    from transformers import MistralConfig, PixtralVisionConfig, SiglipVisionConfig

    gemma_text = tiny_gemma3().config
    gemma_text.final_logit_softcapping = None  # (as released: HF's image-text model never caps its logits)
    mistral_text = MistralConfig(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512)
    ids = dict(eos_token_id=2, bos_token_id=1, pad_token_id=0)
    configs = {
        "gemma3": ("gemma3_text", transformers.Gemma3Config(
            text_config=gemma_text, mm_tokens_per_image=4, image_token_index=255, boi_token_index=253,
            eoi_token_index=254, vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                                                  num_hidden_layers=1, num_attention_heads=2,
                                                                  image_size=28, patch_size=14), **ids)),
        "mistral3": ("mistral", transformers.Mistral3Config(
            text_config=mistral_text, image_token_index=255,  # (tied as a whole, though its text config is not)
            vision_config=PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, image_size=28, patch_size=14, head_dim=16),
            **ids)),
    }
    for model_type, (text_type, config) in configs.items():
        torch.manual_seed(0)
        yield model_type, text_type, transformers.AutoModelForImageTextToText.from_config(config)


@pytest.mark.parametrize("index", range(2), ids=["gemma3", "mistral3"])
def test_the_language_model_of_image_text_checkpoints(tmp_path, index):
    """Gemma 3 4B and up and Mistral Small 3.1 and up are image-text checkpoints: their language
    model is served on text prompts, as HF's whole model computes them, and the vision weights
    are left out."""
    model_type, text_type, model = list(tiny_image_text_models())[index]
    low, high = (-0.5, 0.5) if model_type == "gemma3" else (0.5, 1.5)  # (Gemma's norm weights are offsets from 1)
    randomize_norms(model, low, high)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(std=1.0)  # (tied: decisive logits too)
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    from transformers import AutoConfig, AutoModelForImageTextToText

    assert AutoConfig.from_pretrained(directory).model_type == model_type
    loaded = assert_prefill_matches_hf(directory, text_type, hf_class=AutoModelForImageTextToText)
    assert not any("vision" in name for name, _ in loaded.model.named_parameters())
    assert loaded.model.tie_word_embeddings
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)


def tiny_qwen_vl(model_type: str):
    """A random Qwen2-VL, Qwen2.5-VL or Qwen3-VL with a one-block vision tower; vocabulary 300 with
    the vision tokens at 297-299, whose logits are zero: text prompts (ids 3-255) stay text, as
    they do for the real models."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    text = dict(vocab_size=300, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rope_parameters=rope, tie_word_embeddings=False)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)
    ids = dict(image_token_id=297, video_token_id=298, vision_start_token_id=299, eos_token_id=2, bos_token_id=1,
               pad_token_id=0, tie_word_embeddings=False)
    if model_type == "qwen2_vl":
        config = transformers.Qwen2VLConfig(text_config=text, vision_config={**vision, "embed_dim": 32,
                                                                             "hidden_size": 128}, **ids)
    elif model_type == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config={
            **vision, "out_hidden_size": 128, "window_size": 56, "fullatt_block_indexes": [0]}, **ids)
    else:
        text = {**text, "head_dim": 32, "rope_parameters": {**rope, "mrope_interleaved": True}}
        vision = {**vision, "out_hidden_size": 128, "patch_size": 16, "num_position_embeddings": 16,
                  "deepstack_visual_indexes": [0]}
        if model_type == "qwen3_vl":
            config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
        else:  # Qwen3-VL-30B-A3B's kind: Qwen3-MoE's language model
            text = {**text, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                    "decoder_sparse_step": 1, "norm_topk_prob": True}
            config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    randomize_norms(model, 0.5, 1.5)
    randomize_biases(model)
    randomize_routers_and_experts(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(std=0.5)
        model.get_output_embeddings().weight[256:] = 0.0
    return model.eval()


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_the_language_model_of_qwen_vl_checkpoints(tmp_path, model_type):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE served on text prompts: their multimodal
    rotary embedding (sections of the rotary dims for time, height and width) is plain rotary
    when every position is a text one; Qwen2's q/k/v biases, Qwen3's per-head q/k norms,
    Qwen3-MoE's experts."""
    from transformers import AutoModelForImageTextToText

    model = tiny_qwen_vl(model_type)
    directory = save_tiny_checkpoint(tmp_path, model)
    if model_type == "qwen3_vl_moe":  # as released, experts transposed: [E, H, 2I] and [E, I, H]
        from safetensors.torch import load_file, save_file

        path = os.path.join(directory, "model.safetensors")
        state = {name: tensor.transpose(1, 2).contiguous() if ".mlp.experts." in name else tensor
                 for name, tensor in load_file(path).items()}
        save_file(state, path, metadata={"format": "pt"})
    loaded = assert_prefill_matches_hf(directory, f"{model_type}_text", hf_class=AutoModelForImageTextToText)
    assert not any("visual" in name for name, _ in loaded.model.named_parameters())
    attention = loaded.model.layers[0].self_attn
    assert (attention.qkv_proj.bias is not None) == model_type.startswith("qwen2")
    assert (attention.q_norm is not None) == model_type.startswith("qwen3")
    assert loaded.model.layers[0].is_moe == (model_type == "qwen3_vl_moe")
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)


def randomize_routers_and_experts(model, bias_std: float = 0.2) -> None:
    """Experts and routers away from init's near-uniform routing, and the routers' choice biases
    (DeepSeek-V3's, GLM-4.5's, ERNIE 4.5's e_score_correction_bias) away from zero."""
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                tensor.normal_(std=bias_std)
            elif "experts" in name or name.endswith("gate.weight"):
                tensor.normal_(std=0.3)


def add_multi_token_prediction_layer(directory: str, last_layer: int) -> None:
    """As DeepSeek-V3 and GLM-4.5 are released: one more layer (a copy of the last) past
    num_hidden_layers in the checkpoint, for multi-token prediction."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(directory, "model.safetensors")
    state = load_file(path)
    state.update({name.replace(f"model.layers.{last_layer}.", f"model.layers.{last_layer + 1}."): tensor.clone()
                  for name, tensor in state.items() if name.startswith(f"model.layers.{last_layer}.")})
    save_file(state, path, metadata={"format": "pt"})


def tiny_deepseek(variant: str):
    """A random DeepSeek: multi-head latent attention (queries through a low-rank projection in
    "v2" and "v3", straight in "lite"), YaRN rope with mscale, one dense layer then DeepSeekMoE
    layers (8 routed experts in 4 groups, top 2, scaled weights, a shared expert): V2's softmax
    router (group-limited in "v2"), V3's biased sigmoid one with renormalized weights."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
    shape = dict(vocab_size=256, hidden_size=128, intermediate_size=192, moe_intermediate_size=48, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                 q_lora_rank=None if variant == "lite" else 48, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24,
                 n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
                 topk_group=2, max_position_embeddings=512, rope_parameters=rope, eos_token_id=2, bos_token_id=1,
                 pad_token_id=0)
    if variant == "v3":
        config, model_class = DeepseekV3Config(**shape, routed_scaling_factor=2.5, norm_topk_prob=True), DeepseekV3ForCausalLM
    else:
        config = DeepseekV2Config(**shape, routed_scaling_factor=2.0, norm_topk_prob=False,
                                  topk_method="group_limited_greedy" if variant == "v2" else "greedy")
        model_class = DeepseekV2ForCausalLM
    torch.manual_seed(0)
    model = model_class(config)
    randomize_norms(model, 0.5, 1.5)
    randomize_routers_and_experts(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(std=0.5)
    return model.eval()


@pytest.mark.parametrize("variant", ["v2", "lite", "v3"])
def test_tiny_deepseek_matches_hf(tmp_path, variant):
    """DeepSeek-V2 and V3 with latent attention computed on the cached latents (the key
    projection absorbed into the query), as HF's expanded keys and values compute it; V3's
    multi-token-prediction layer in the checkpoint is left out."""
    hf_model = tiny_deepseek(variant)
    directory = save_tiny_checkpoint(tmp_path, hf_model)
    if variant == "v3":
        add_multi_token_prediction_layer(directory, last_layer=2)
    loaded = assert_prefill_matches_hf(directory, "deepseek_v2" if variant != "v3" else "deepseek_v3")
    attention = loaded.model.layers[0].self_attn
    assert (attention.num_kv_heads, attention.head_dim) == (1, 32 + 16)  # the cache: one latent + rope key
    assert [layer.is_moe for layer in loaded.model.layers] == [False, True, True]
    assert_greedy_generation_matches_hf(hf_model, directory, (40, 9), 16, seed=7)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["glm4.5", "qk-norm"])
def test_tiny_glm4_moe_matches_hf(tmp_path, qk_norm):
    """GLM-4.5: q/k/v biases and an unbiased output, rotary embedding on half of each head,
    optional per-head q/k norms, one dense layer then DeepSeek-V3's biased sigmoid routing over
    expert groups with a shared expert; its multi-token-prediction layer is left out."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = Glm4MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=192, moe_intermediate_size=48,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           attention_bias=True, use_qk_norm=qk_norm, n_routed_experts=8, num_experts_per_tok=2,
                           n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                           routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=512,
                           eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(config)
    randomize_norms(model, 0.5, 1.5)
    randomize_biases(model)
    randomize_routers_and_experts(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(std=0.5)
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    add_multi_token_prediction_layer(directory, last_layer=2)
    loaded = assert_prefill_matches_hf(directory, "glm4_moe")
    attention = loaded.model.layers[0].self_attn
    assert attention.qkv_proj.bias is not None and attention.o_proj.bias is None
    assert (attention.q_norm is not None) == qk_norm
    assert [layer.is_moe for layer in loaded.model.layers] == [False, True, True]
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)


def test_tiny_ernie4_5_moe_matches_hf(tmp_path):
    """ERNIE 4.5 MoE: ERNIE's attention (adjacent-pair rotary), a dense first layer, then
    experts chosen on biased softmax scores and weighted by the unbiased ones renormalized, with
    shared experts; the last layer dense again (moe_layer_end_index)."""
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    config = Ernie4_5_MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=192, moe_intermediate_size=48,
                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                num_experts=8, moe_k=2, num_experts_per_tok=2, moe_num_shared_experts=1,
                                moe_layer_start_index=1, moe_layer_end_index=2, moe_layer_interval=1,
                                max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
                                pad_token_id=0)
    torch.manual_seed(0)
    model = Ernie4_5_MoeForCausalLM(config)
    randomize_norms(model, 0.5, 1.5)
    randomize_routers_and_experts(model, bias_std=0.1)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(std=0.5)
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    loaded = assert_prefill_matches_hf(directory, "ernie4_5_moe")
    assert [layer.is_moe for layer in loaded.model.layers] == [False, True, True, False]
    assert loaded.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)


def test_tiny_dots1_matches_hf(tmp_path):
    """dots.llm1: Qwen3's per-head q/k norms, one dense layer, then DeepSeek-V3's biased sigmoid
    routing over expert groups (scaled, not renormalized) with shared experts."""
    from transformers import Dots1Config, Dots1ForCausalLM

    config = Dots1Config(vocab_size=256, hidden_size=128, intermediate_size=192, moe_intermediate_size=48,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, n_group=2, topk_group=1,
                         first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=False,
                         max_position_embeddings=512, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = Dots1ForCausalLM(config)
    randomize_norms(model, 0.5, 1.5)
    randomize_routers_and_experts(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(std=0.5)
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    loaded = assert_prefill_matches_hf(directory, "dots1")
    assert loaded.model.layers[0].self_attn.q_norm.weight.shape == (32,)
    assert [layer.is_moe for layer in loaded.model.layers] == [False, True, True]
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)


def test_tiny_minimax_m2_matches_hf(tmp_path):
    """MiniMax-M2: q/k RMSNorm over whole projections, rotary embedding on half of each head
    (`rotary_dim`), and in every layer experts chosen on biased sigmoid scores, weighted by the
    unbiased ones renormalized."""
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    config = MiniMaxM2Config(vocab_size=256, hidden_size=128, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=16,
                             num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
                             eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = MiniMaxM2ForCausalLM(config)
    randomize_norms(model, 0.5, 1.5)
    randomize_routers_and_experts(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(std=0.5)
    directory = save_tiny_checkpoint(tmp_path, model.eval())
    loaded = assert_prefill_matches_hf(directory, "minimax_m2")
    assert loaded.model.layers[0].self_attn.q_norm.weight.shape == (4 * 32,)
    assert loaded.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0
    assert_greedy_generation_matches_hf(model, directory, (40, 9), 16, seed=7)


def tiny_olmo(model_type: str, head_dim: int = 32):
    """A random OLMo 2, or OLMo 3 with sliding (window 16, rope base 1e4) and full layers (rope
    base 5e5, linear scaling)."""
    from transformers import Olmo2Config, Olmo2ForCausalLM, Olmo3Config, Olmo3ForCausalLM

    shape = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512, eos_token_id=2, bos_token_id=1,
                 pad_token_id=0)
    if model_type == "olmo2":
        config, model_class = Olmo2Config(**shape), Olmo2ForCausalLM
    else:
        config = Olmo3Config(
            **shape, sliding_window=16, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0}},
        )
        model_class = Olmo3ForCausalLM
    torch.manual_seed(0)
    model = model_class(config)
    randomize_norms(model, 0.5, 1.5)  # away from 1, so each norm's placement matters
    return model.eval()


@pytest.mark.parametrize("model_type", ["olmo2", "olmo3"])
def test_tiny_olmo_with_post_norms_matches_hf(tmp_path, model_type):
    hf_model = tiny_olmo(model_type)
    directory = save_tiny_checkpoint(tmp_path, hf_model)
    loaded = assert_prefill_matches_hf(directory, model_type)
    windows = [layer.self_attn.sliding_window for layer in loaded.model.layers]
    assert windows == ([None] * 3 if model_type == "olmo2" else [16, None, 16])

    assert_greedy_generation_matches_hf(hf_model, directory, (40, 9, 70), 16, seed=8)


def tiny_gpt_oss(head_dim: int = 16):
    """A random GPT-OSS: attention sinks, biases on every projection, sliding (window 16) and
    full layers, YaRN rope, 4 experts (top 2) with biases and the clamped SwiGLU."""
    from transformers import GptOssConfig, GptOssForCausalLM

    rope = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 64, "rope_theta": 150000.0}
    config = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=512, sliding_window=16, rope_parameters=rope,
                          eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = GptOssForCausalLM(config)
    with torch.no_grad():  # random init leaves sinks, biases and the router near zero: make them count
        for name, parameter in model.named_parameters():
            if name.endswith(("sinks", "bias")) or "router" in name:
                parameter.normal_(std=1.0)
            elif "experts" in name:
                parameter.normal_(std=0.5)  # activations past the SwiGLU clamp at 7 now and then
    return model.eval()


def test_tiny_gpt_oss_with_sinks_and_biased_experts_matches_hf(tmp_path):
    hf_model = tiny_gpt_oss()
    directory = save_tiny_checkpoint(tmp_path, hf_model)
    loaded = assert_prefill_matches_hf(directory, "gpt_oss")
    attention = [layer.self_attn for layer in loaded.model.layers]
    assert [a.sliding_window for a in attention] == [16, None] and all(a.sinks is not None for a in attention)
    assert all(layer.is_moe and layer.mlp.expert_down_bias is not None for layer in loaded.model.layers)
    assert_greedy_generation_matches_hf(hf_model, directory, (40, 9, 70), 16, seed=9)


def test_gpt_oss_mxfp4_experts_load_as_transformers_widens_them(tmp_path):
    """GPT-OSS checkpoints store experts in MXFP4 (experts.*_blocks: two 4-bit floats a byte,
    *_scales: a power of two per 32): random codes, widened into the HF model's weights, then
    saved packed; our loader's model matches the HF model on them."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_model = tiny_gpt_oss()
    generator = torch.Generator().manual_seed(4)
    packed = {}
    for i, layer in enumerate(hf_model.model.layers):
        for name, rows, columns in (("gate_up_proj", 128, 64), ("down_proj", 64, 64)):
            blocks = torch.randint(0, 256, (4, rows, columns // 32, 16), generator=generator, dtype=torch.uint8)
            scales = torch.randint(122, 127, (4, rows, columns // 32), generator=generator, dtype=torch.uint8)
            with torch.no_grad():
                getattr(layer.mlp.experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            packed[f"model.layers.{i}.mlp.experts.{name}_blocks"] = blocks
            packed[f"model.layers.{i}.mlp.experts.{name}_scales"] = scales
    directory = save_tiny_checkpoint(tmp_path, hf_model)
    [weights_file] = glob.glob(f"{directory}/*.safetensors")
    state = {name: tensor for name, tensor in load_file(weights_file).items()
             if not name.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**state, **packed}, weights_file, metadata={"format": "pt"})

    loaded = load(directory, None, None, torch.float32, torch.device("cpu"), None)
    tokens = torch.randint(3, 256, (37,), generator=generator).tolist()
    ours = prefill_all_positions(loaded.model, tokens, [3, 0, 6], block_size=16, num_blocks=8)
    assert (ours - hf_logits(hf_model, tokens)).abs().max().item() < 1e-4


def test_gemma_options_the_kernels_lack_are_refused(tmp_path):
    directory = save_tiny_checkpoint(tmp_path, tiny_gemma3(use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        load(directory, None, None, torch.float32, torch.device("cpu"), None)


def test_loader_rejects_unknown_directories(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(str(tmp_path / "missing"), None, None, torch.float32, torch.device("cpu"), None)


def test_max_model_len_stays_within_the_positions(tmp_path):
    import pagedkv
    from pagedkv import LLM
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    directory = save_tiny_checkpoint(tmp_path, Qwen2ForCausalLM(config))
    assert LLM(directory, dtype="float32", num_device_blocks=64).engine.max_model_len == 512
    with pytest.raises(pagedkv.InvalidConfigError, match="max_model_len=600 exceeds the model's max_position_embeddings=512"):
        LLM(directory, dtype="float32", num_device_blocks=64, max_model_len=600)


def tiny_windowed_models():
    """(name, HF model) with sliding-window attention over 16 positions and head dim 64 (the
    Rust prefill kernel's): Mistral (every layer) and Qwen2 (`layer_types`: full, then windowed)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=512, eos_token_id=2, bos_token_id=1,
                  sliding_window=16)
    torch.manual_seed(0)
    yield "mistral", MistralForCausalLM(MistralConfig(**common))
    yield "qwen2", Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, max_window_layers=1))


@pytest.mark.parametrize("index", range(2), ids=["mistral", "qwen2"])
def test_sliding_window_models_match_hf_past_their_window(tmp_path, index):
    """Prefill logits at every position of a 37-token prompt (two windows) and greedy generation
    through the engine's CPU kernels, chunked and batched, all well past the 16-token window."""

    from pagedkv import SamplingParams

    model_type, hf_model = list(tiny_windowed_models())[index]
    with torch.no_grad():
        hf_model.lm_head.weight.normal_(std=0.5)  # decisive logits: float32 noise never flips a token
    directory = save_tiny_checkpoint(tmp_path, hf_model.eval())
    loaded = assert_prefill_matches_hf(directory, model_type)
    windows = [layer.self_attn.sliding_window for layer in loaded.model.layers]
    assert windows == ([16, 16] if model_type == "mistral" else [None, 16])

    llm = assert_greedy_generation_matches_hf(hf_model, directory, (40, 7, 90), 24, seed=5, attention_backend="cpu")
    assert llm.engine.max_model_len == 512
    # Mistral's every layer is windowed: blocks before each sequence's window are released, so a
    # pool of 5 blocks of 16 tokens (80) serves the 114-token sequence, through both backends
    # (the torch reference reads released entries of the tables masked).
    assert llm.engine.runner.sliding_window == (16 if model_type == "mistral" else 0)
    if model_type == "mistral":
        for backend in ("cpu", "torch"):
            llm = assert_greedy_generation_matches_hf(hf_model, directory, (40, 7, 90), 24, seed=5,
                                                      attention_backend=backend, num_device_blocks=5)
            assert llm.engine.max_model_len == 512
            stats = llm.engine.scheduler.stats()
            assert stats["num_free_device_blocks"] == 5
            # The 90-token prompt again: its first blocks were evicted from the 5-block pool, but
            # those its first computed token reads are cached, so it hits (windowed cache hits)
            # and still generates what HF does.
            generator = torch.Generator().manual_seed(5)  # (the helper's prompts, drawn again)
            prompt = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in (40, 7, 90)][2]
            with torch.inference_mode():
                expected = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24,
                                             min_new_tokens=24, pad_token_id=0)[0, len(prompt):].tolist()
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            again = llm.generate([prompt], params, use_tqdm=False)[0]
            assert again.outputs[0].token_ids == expected
            assert llm.engine.scheduler.stats()["prefix_cache_hits"] > stats["prefix_cache_hits"]
