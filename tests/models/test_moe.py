"""Mixture-of-experts models through the engine: the SparseMoE layer against a per-token loop, and
greedy generation on tiny random Mixtral / Qwen3-MoE checkpoints equal to HF transformers through
batching, chunked prefill and preemption; LoRA adapters of expert layers are refused clearly."""

import json

import pytest
import torch
from support.checkpoints import save_tiny_checkpoint
from safetensors.torch import save_file

from pagedkv import LLM, InvalidConfigError, LoRARequest, SamplingParams
from pagedkv.layers.fused_moe import SparseMoE

MAX_NEW_TOKENS = 12


def per_token_reference(moe: SparseMoE, hidden: torch.Tensor) -> torch.Tensor:
    """Each token's top-k experts one at a time, in float64: what the sorted, batched layer must equal."""
    logits = hidden.double() @ moe.gate.weight.double().T
    probabilities = torch.softmax(logits, dim=-1)
    out = torch.zeros_like(hidden, dtype=torch.float64)
    for token in range(hidden.shape[0]):
        weights, experts = torch.topk(probabilities[token], moe.top_k)
        if moe.renormalize:
            weights = weights / weights.sum()
        x = hidden[token].double()
        for weight, expert in zip(weights, experts.tolist()):
            gate, up = (moe.expert_gate_up[expert].double() @ x).chunk(2)
            out[token] += weight * (moe.expert_down[expert].double() @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("num_tokens,num_experts,top_k,renormalize", [
    (1, 8, 2, True),     # a decode step: most experts idle
    (5, 4, 4, False),    # every expert for every token
    (64, 16, 3, True),   # a prefill chunk
    (3, 32, 1, False),   # top-1 routing, most experts unused
])
def test_sparse_moe_equals_a_per_token_loop(num_tokens, num_experts, top_k, renormalize):
    torch.manual_seed(num_tokens)
    moe = SparseMoE(24, 20, num_experts, top_k, renormalize)
    with torch.no_grad():
        moe.gate.weight.normal_()
        moe.expert_gate_up.normal_(std=0.3)
        moe.expert_down.normal_(std=0.3)
        hidden = torch.randn(num_tokens, 24)
        ours = moe(hidden)
    assert ours.shape == hidden.shape
    torch.testing.assert_close(ours.double(), per_token_reference(moe, hidden), rtol=1e-5, atol=1e-5)


def test_sparse_moe_rejects_more_experts_per_token_than_experts():
    with pytest.raises(ValueError, match="num_experts_per_tok=5 must be between 1 and num_experts=4"):
        SparseMoE(8, 8, 4, 5, True)


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def tiny_moe(request, tmp_path_factory):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, eos_token_id=2, bos_token_id=1, num_experts_per_tok=2)
    torch.manual_seed(0)
    if request.param == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**common, intermediate_size=48, num_local_experts=8))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, head_dim=16, intermediate_size=96,
                                                   moe_intermediate_size=32, num_experts=8, norm_topk_prob=True))
    with torch.no_grad():  # decisive routers and logits, so float32 rounding never flips a choice
        for name, parameter in model.named_parameters():
            if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
                parameter.normal_(std=1.0)
        model.lm_head.weight.normal_(std=0.5)
    model.generation_config.eos_token_id = None  # random weights: run every prompt to its length
    return save_tiny_checkpoint(tmp_path_factory.mktemp(request.param), model.eval()), model.eval()


def hf_greedy(model, token_ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([token_ids]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                             min_new_tokens=MAX_NEW_TOKENS, pad_token_id=0)
    return out[0, len(token_ids) :].tolist()


def test_moe_generation_equals_hf_through_chunked_prefill_and_preemption(tiny_moe):
    directory, hf_model = tiny_moe
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in (5, 40, 71, 17, 33, 9)]
    expected = [hf_greedy(hf_model, prompt) for prompt in prompts]
    # 14 blocks of 16 tokens cannot hold all six sequences (20 blocks at their longest): some are
    # preempted; a 32-token budget splits the long prompts into chunks
    llm = LLM(directory, dtype="float32", num_device_blocks=14, block_size=16, max_num_batched_tokens=32,
              max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    stats = llm.engine.stats()
    assert stats["num_preemptions_swap"] + stats["num_preemptions_recompute"] > 0
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"]


def test_lora_adapters_of_experts_are_refused_and_attention_adapters_run(tiny_moe, tmp_path):
    directory, _ = tiny_moe
    llm = LLM(directory, dtype="float32", enable_lora=True, max_lora_rank=4, num_device_blocks=32, max_model_len=128)

    def adapter(name: str, module: str, in_features: int, out_features: int) -> LoRARequest:
        block = "self_attn" if module.startswith(("q_", "k_", "v_", "o_")) else "mlp"
        prefix = f"base_model.model.model.layers.0.{block}.{module}"
        (tmp_path / name).mkdir()
        save_file({f"{prefix}.lora_A.weight": torch.randn(4, in_features) * 0.5,
                   f"{prefix}.lora_B.weight": torch.randn(out_features, 4) * 0.5},
                  str(tmp_path / name / "adapter_model.safetensors"))
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
        return LoRARequest(name, len(name), str(tmp_path / name))

    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    prompt = [[5, 6, 7, 8, 9, 10, 11]]
    with pytest.raises(InvalidConfigError, match="layer 0 up_proj is a mixture of experts"):
        llm.generate(prompt, params, use_tqdm=False, lora_request=adapter("experts", "up_proj", 64, 48))
    assert not llm.engine.has_unfinished_requests()
    base = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    q_size = llm.engine.runner.model.layers[0].self_attn.q_size
    adapted = llm.generate(prompt, params, use_tqdm=False, lora_request=adapter("query", "q_proj", 64, q_size))
    assert adapted[0].outputs[0].token_ids != base
