"""Tiny random-weight HF models of the architectures we serve (the checkpoints the model tests
load), and the helpers that make their weights non-trivial."""

import os

import torch

from support.checkpoints import save_tiny_checkpoint


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


def save_biased_tiny_llama(directory) -> str:
    """A 2-layer random Llama, 4 query / 2 KV heads, biased attention (o_proj too) and MLP (the
    tensor-parallel tests' model: random biases, so a bias added on every rank, or on none, shows)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         attention_bias=True, mlp_bias=True, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(1)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(std=0.3)
    return save_tiny_checkpoint(directory, model)


LLAMA_SHAPE = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, max_position_embeddings=512, eos_token_id=2, bos_token_id=1, pad_token_id=0)
"""The shape most tiny dense models share: 2 layers, 2 query heads and 1 KV head of 64."""


def tiny_llama():
    """A random Llama (the SmolLM2 GGUF test's architecture, from safetensors) with random norms."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPE))
    randomize_norms(model, 0.5, 1.5)
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.5)
    return model.eval()


def tiny_qwen2():
    """A 2-layer random Qwen2 (qkv bias, GQA 4:2, untied lm_head, rope_theta 5e5)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_theta=500000.0, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # random biases, so a missing bias would show in the logits
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(std=0.5)
    return model


def tiny_qwen3():
    """A random Qwen3 whose attention is wider than the residual stream (head_dim 32 with hidden 64
    and 4 heads), as in Qwen3-0.6B (16 x 128 over 1024), with q/k norm weights far from 1."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # so a skipped q/k norm shows in the logits
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.2, 3.0)
            layer.self_attn.k_norm.weight.uniform_(0.2, 3.0)
    return model


def tiny_smollm3():
    """A random SmolLM3 whose third layer has no rotary embedding (`no_rope_layers`)."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    config = SmolLM3Config(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                           no_rope_layers=[1, 1, 0, 1], eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    return SmolLM3ForCausalLM(config).eval()


def tiny_granite():
    """A random Granite with its embedding, residual, attention and logit multipliers."""
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                           logits_scaling=8.0, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    return GraniteForCausalLM(config).eval()


def tiny_gemma1():
    """A random Gemma 1: Llama's layout with Gemma's norms (offsets from 1), scaled embeddings and
    the tanh-approximated GELU MLP (the legacy `hidden_act="gelu"` of the official configs, as
    transformers reads it), the MLP dominating the residual stream so its activation shows."""
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                         hidden_act="gelu", eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = GemmaForCausalLM(config)
    randomize_norms(model, -0.5, 0.5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "mlp" in name:
                parameter.mul_(20)
    return model.eval()


def tiny_glm4():
    """A random GLM-4: four norms per layer, rotary embedding over adjacent pairs of the first half
    of each head, biased q/k/v but not o_proj, fused gate/up."""
    from transformers import Glm4Config, Glm4ForCausalLM

    torch.manual_seed(0)
    model = Glm4ForCausalLM(Glm4Config(**LLAMA_SHAPE, head_dim=64))
    randomize_norms(model, 0.5, 1.5)
    randomize_biases(model)
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.5)
    return model.eval()


def tiny_cohere(use_qk_norm: bool):
    """A random Cohere: parallel attention and MLP off one mean-subtracting norm, rotary embedding
    over adjacent pairs, per-head query/key norms (Command R+'s `use_qk_norm`), scaled logits."""
    from transformers import CohereConfig, CohereForCausalLM

    torch.manual_seed(0)
    model = CohereForCausalLM(CohereConfig(**LLAMA_SHAPE, use_qk_norm=use_qk_norm, logit_scale=0.5))
    randomize_norms(model, 0.5, 1.5)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(std=1.0)  # (tied, and scaled by 0.5: decisive logits)
    return model.eval()


def tiny_gpt_neox(parallel: bool):
    """A random GPT-NeoX: two biased LayerNorms per layer, attention and MLP in parallel (Pythia)
    or in sequence, q/k/v interleaved per head in one checkpoint tensor, rotary embedding on a
    quarter of each head (16 of 64 dims)."""
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
    return model.eval()


FALCON_VARIANTS = {"7b": dict(multi_query=True, parallel_attn=True),
                   "40b": dict(new_decoder_architecture=True, num_kv_heads=2),
                   "falcon2": dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
                   "sequential": dict(multi_query=False, parallel_attn=False, bias=True, tie_word_embeddings=False)}


def tiny_falcon(variant: str):
    """A random Falcon (a key of FALCON_VARIANTS): Falcon-7B's multi-query attention beside the MLP
    off one norm; Falcon-40B's new decoder architecture (grouped KV heads, a norm each for
    attention and MLP); Falcon 2's (one shared norm); multi-head attention and MLP in sequence
    with biases."""
    from transformers import FalconConfig, FalconForCausalLM

    shape = dict(vocab_size=256, hidden_size=128, ffn_hidden_size=192, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=512, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = FalconForCausalLM(FalconConfig(**shape, **FALCON_VARIANTS[variant]))
    randomize_norms(model, 0.5, 1.5)
    randomize_biases(model)
    return model.eval()


def tiny_gptj():
    """A random GPT-J: parallel blocks, unbiased attention, rotary embedding over adjacent pairs of
    the first 16 of 64 dims of each head, biased MLP and LM head."""
    from transformers import GPTJConfig, GPTJForCausalLM

    config = GPTJConfig(vocab_size=256, n_embd=128, n_layer=2, n_head=2, rotary_dim=16, n_positions=512,
                        eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = GPTJForCausalLM(config)
    randomize_norms(model, 0.5, 1.5)
    randomize_biases(model)
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.5)
    return model.eval()


def tiny_olmo1():
    """A random OLMo 1: Llama's blocks with LayerNorms that learn nothing, q/k/v clipped at 0.5
    (the queries well past it)."""
    from transformers import OlmoConfig, OlmoForCausalLM

    torch.manual_seed(0)
    model = OlmoForCausalLM(OlmoConfig(**LLAMA_SHAPE, clip_qkv=0.5))
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.5)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
    return model.eval()


def tiny_nemotron():
    """A random Nemotron: LayerNorms with (1 + w) weights and biases, a squared-ReLU MLP without
    gate, rotary embedding on half of each head."""
    from transformers import NemotronConfig, NemotronForCausalLM

    torch.manual_seed(0)
    model = NemotronForCausalLM(NemotronConfig(**LLAMA_SHAPE, head_dim=64))
    randomize_norms(model, -0.5, 0.5)
    randomize_biases(model)
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.5)
    return model.eval()


def tiny_stablelm(twelve_b: bool):
    """A random StableLM 2: biased LayerNorms, q/k/v biases, rotary embedding on a quarter of each
    head; the 12B's parallel blocks and per-head query/key LayerNorms."""
    from transformers import StableLmConfig, StableLmForCausalLM

    config = StableLmConfig(**LLAMA_SHAPE, use_qkv_bias=True, use_parallel_residual=twelve_b, qk_layernorm=twelve_b)
    torch.manual_seed(0)
    model = StableLmForCausalLM(config)
    randomize_norms(model, 0.5, 1.5)
    randomize_biases(model)  # (the LayerNorms' too)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "_layernorm.norms." in name and name.endswith("weight"):  # the 12B's per-head q/k LayerNorms
                parameter.uniform_(0.5, 1.5)
        model.lm_head.weight.normal_(std=0.5)
    return model.eval()


def tiny_exaone4():
    """A random EXAONE 4: OLMo 2's post-norm blocks, per-head query/key norms, a windowed layer (16
    positions) and a full one without rotary embedding."""
    from transformers import Exaone4Config, Exaone4ForCausalLM

    config = Exaone4Config(**LLAMA_SHAPE, head_dim=64, sliding_window=16, sliding_window_pattern=2)
    torch.manual_seed(0)
    model = Exaone4ForCausalLM(config)
    randomize_norms(model, 0.5, 1.5)
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.5)
    return model.eval()


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


def tiny_moe(model_type: str):
    """One of `tiny_moe_models` with a sharper router than random init's, so every token's top-k
    is decisive."""
    model = dict(tiny_moe_models())[model_type]
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "router.weight")):
                parameter.normal_(std=1.0)
    return model.eval()


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


def tiny_phi3():
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
    return Phi3ForCausalLM(config).eval()


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


def tiny_starcoder2():
    """A random StarCoder2 (hidden 128, MLP 192, 2 query heads and 1 KV head of 64, every layer
    windowed over 16 positions) with random norms and biases."""
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
    return model.eval()


def tiny_phi2():
    """A random Phi-2 (hidden 160, 2 heads of 80, rotary on 32 dims of each) with random norms and
    biases."""
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
    return model.eval()


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


def tiny_absolute_position_model(name: str):
    """One of `tiny_absolute_position_models` ("gpt2", "opt", "gpt_bigcode-mqa", "gpt_bigcode-mha")
    with random norms and biases and decisive (tied) logits."""
    names = ("gpt2", "opt", "gpt_bigcode-mqa", "gpt_bigcode-mha")
    model = [model for _, model in tiny_absolute_position_models()][names.index(name)]
    randomize_norms(model, 0.5, 1.5)
    randomize_biases(model)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(std=0.5)
    return model.eval()


def tiny_llama_variants():
    """(model_type, HF model) of Llama's layout with other rope layouts and biases: Ministral
    (every layer windowed), Helium (pairs rotated, biased q/k/v, unbiased o_proj, biased MLP),
    Seed-OSS (its own attention_out_bias), ERNIE 4.5 (pairs rotated, biases everywhere), GLM
    (pairs rotated over half of each head, gate/up fused) and Arcee (an ungated squared-ReLU MLP)."""
    import transformers

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
        config = getattr(transformers, config_class)(**LLAMA_SHAPE, head_dim=64, **extra)
        yield model_type, getattr(transformers, model_class)(config)


def tiny_llama_variant(model_type: str):
    """One of `tiny_llama_variants` with random norms and biases and decisive logits."""
    model = dict(tiny_llama_variants())[model_type]
    randomize_norms(model, 0.5, 1.5)
    randomize_biases(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(std=0.5)
    return model.eval()


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


def tiny_image_text(model_type: str):
    """One of `tiny_image_text_models` ("gemma3", "mistral3") with random norms and decisive (tied)
    logits."""
    model = {name: model for name, _, model in tiny_image_text_models()}[model_type]
    low, high = (-0.5, 0.5) if model_type == "gemma3" else (0.5, 1.5)  # (Gemma's norm weights are offsets from 1)
    randomize_norms(model, low, high)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(std=1.0)
    return model.eval()


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


def transpose_stacked_experts(directory: str) -> None:
    """As Qwen3-VL-MoE checkpoints are released: stacked experts transposed, [E, H, 2I] and [E, I, H]."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(directory, "model.safetensors")
    state = {name: tensor.transpose(1, 2).contiguous() if ".mlp.experts." in name else tensor
             for name, tensor in load_file(path).items()}
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


def tiny_glm4_moe(qk_norm: bool):
    """A random GLM-4.5: q/k/v biases and an unbiased output, rotary embedding on half of each head,
    optional per-head q/k norms, one dense layer then DeepSeek-V3's biased sigmoid routing over
    expert groups with a shared expert."""
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
    return model.eval()


def tiny_ernie4_5_moe():
    """A random ERNIE 4.5 MoE: ERNIE's attention (adjacent-pair rotary), a dense first layer, then
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
    return model.eval()


def tiny_dots1():
    """A random dots.llm1: Qwen3's per-head q/k norms, one dense layer, then DeepSeek-V3's biased
    sigmoid routing over expert groups (scaled, not renormalized) with shared experts."""
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
    return model.eval()


def tiny_minimax_m2():
    """A random MiniMax-M2: q/k RMSNorm over whole projections, rotary embedding on half of each
    head (`rotary_dim`), and in every layer experts chosen on biased sigmoid scores, weighted by
    the unbiased ones renormalized."""
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
    return model.eval()


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


def tiny_windowed(model_type: str):
    """One of `tiny_windowed_models` ("mistral", "qwen2") with decisive logits: float32 noise never
    flips a token."""
    model = dict(tiny_windowed_models())[model_type]
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.5)
    return model.eval()


def tiny_classifier(directory, model_type: str = "llama", num_labels: int = 3, **config_options) -> tuple:
    """A random 2-layer classifier saved with its tokenizer: (HF model, directory)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  num_labels=num_labels, pad_token_id=0, bos_token_id=1, eos_token_id=2, **config_options)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():
        model.score.weight.normal_(std=0.5)  # (random init leaves the scores near 0)
    return model, save_tiny_checkpoint(directory, model)


def hf_scores(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].float()
