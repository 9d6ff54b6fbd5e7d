"""A BF16 GGUF (the embedded model's weights stored again as BF16) loads as stored on the CPU by
default: decoder linears and the LM head bfloat16 beside float32 activations, the token embedding
table bfloat16 and shared with the tied head, so the model holds the file's bytes, not twice them
as float32, and its KV cache is bfloat16 where its bfloat16 model's would be; up to 16 tokens a
step its logits are the same file dequantized to float32's, bit for
bit (the CPU kernel widens bfloat16 weights exactly and sums as it does float32 ones)."""

import os

import gguf
import pytest
import torch
from support.gguf_copies import requantized_copy
from support.hf_parity import prefill_all_positions

from pagedkv.config import cpu_has_native_bfloat16
from pagedkv.layers.cpu_linear import BFloat16Linear, BFloat16LMHeadProduct
from pagedkv.layers.quantized_embedding import BFloat16Embedding

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def bf16_runners(smollm2, tmp_path_factory):
    """(the BF16 file's runner as loaded by default, the same file dequantized to float32)."""
    from pagedkv.config import EngineConfig
    from pagedkv.runner.model_runner import ModelRunner

    directory = tmp_path_factory.mktemp("bf16")
    requantized_copy(os.path.join(*smollm2), str(directory / "smollm2.BF16.gguf"), gguf.GGMLQuantizationType.BF16,
                     gguf.LlamaFileType.MOSTLY_BF16)
    options = dict(model=str(directory), gguf_file="smollm2.BF16.gguf", num_device_blocks=16,
                   swap_space_bytes=1 << 20, max_model_len=128)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDKV_GGUF_CACHE_MAX_BYTES", "0")  # (no 540 MB cache entry per test run)
        yield (ModelRunner(EngineConfig(**options)),
               ModelRunner(EngineConfig(dtype="float32", gguf_weights="dequantized", **options)))


def test_auto_keeps_the_files_bfloat16_beside_float32_activations(bf16_runners):
    kept, _ = bf16_runners
    model = kept.model
    model.to(torch.float32)  # (as the engine may: the kept weights stay bfloat16)
    assert kept.dtype == torch.float32
    # (its KV cache as the bfloat16 model's: bfloat16 where the CPU computes in it, else float32)
    assert kept.kv_dtype == (torch.bfloat16 if cpu_has_native_bfloat16() else torch.float32)
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(linear, BFloat16Linear)
    assert isinstance(model.embed_tokens, BFloat16Embedding)
    assert isinstance(model.lm_head_linear, BFloat16LMHeadProduct)
    assert model.lm_head_linear.weight.data_ptr() == model.embed_tokens.table.data_ptr()  # (one copy)
    tensors = {t.untyped_storage().data_ptr(): t for t in [*model.parameters(), *model.buffers()]}.values()
    held = sum(t.untyped_storage().nbytes() for t in tensors)
    in_two_bytes = sum(t.untyped_storage().nbytes() for t in tensors if t.element_size() == 2)  # (bits as int16)
    assert in_two_bytes > 0.99 * held
    file_tensors = sum(tensor.n_bytes for tensor in gguf.GGUFReader(kept.config.model + "/smollm2.BF16.gguf").tensors)
    assert held < 1.01 * file_tensors


def test_logits_are_the_dequantized_files(bf16_runners, smollm2_hf_tokenizer):
    kept, dequantized = bf16_runners
    for prompt in PROMPTS:
        tokens = smollm2_hf_tokenizer(prompt)["input_ids"]
        ours = prefill_all_positions(kept.model, tokens, list(range(8)), block_size=16, num_blocks=8)
        reference = prefill_all_positions(dequantized.model, tokens, list(range(8)), block_size=16, num_blocks=8)
        assert len(tokens) <= 16 and torch.equal(ours, reference)


def test_a_lookup_gives_the_float_tables_rows(bf16_runners):
    kept, dequantized = bf16_runners
    ids = torch.tensor([0, 17, 49151, 17])
    assert torch.equal(kept.model.embed_tokens(ids), dequantized.model.embed_tokens(ids))
    assert torch.equal(kept.model.embed_tokens.weight, dequantized.model.embed_tokens.weight)
