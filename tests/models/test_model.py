"""Our Llama-family model against HF transformers: SmolLM2 (GGUF, Llama) and tiny random
checkpoints of the other architectures (Qwen2 with qkv bias, Qwen3 with q/k norms, ...) loaded from
safetensors by our loader."""

import glob
import os

import pytest
import torch
from support.checkpoints import save_tiny_checkpoint

from pagedkv.loader import default_model_path, load
from pagedkv.models.blocks import ParallelBlock
from support.hf_parity import prefill_all_positions, hf_logits, assert_prefill_matches_hf, assert_greedy_generation_matches_hf
from support.tiny_models import randomize_biases, randomize_norms, tiny_moe_models, tiny_gemma3, tiny_phi3, tiny_gemma2, tiny_starcoder2, tiny_phi2, tiny_absolute_position_models, tiny_llama_variants, tiny_image_text_models, tiny_qwen_vl, randomize_routers_and_experts, add_multi_token_prediction_layer, tiny_deepseek, tiny_olmo, tiny_gpt_oss, tiny_windowed_models


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
    again = type(loaded.model)(loaded.hf_config, loaded.model.traits, 512, torch.float32)
    again.load_hf_state_dict(hf_model.state_dict())
    for (name, ours), theirs in zip(loaded.model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(ours, theirs), name


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


@pytest.mark.parametrize("model_type", ["olmo2", "olmo3"])
def test_tiny_olmo_with_post_norms_matches_hf(tmp_path, model_type):
    hf_model = tiny_olmo(model_type)
    directory = save_tiny_checkpoint(tmp_path, hf_model)
    loaded = assert_prefill_matches_hf(directory, model_type)
    windows = [layer.self_attn.sliding_window for layer in loaded.model.layers]
    assert windows == ([None] * 3 if model_type == "olmo2" else [16, None, 16])

    assert_greedy_generation_matches_hf(hf_model, directory, (40, 9, 70), 16, seed=8)


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
