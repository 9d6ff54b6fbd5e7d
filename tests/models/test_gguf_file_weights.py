"""A load that keeps a GGUF's blocks reads the file's other weights straight from it
(models/gguf_file_weights.py), never through transformers' float32 model: the model it builds is
the one the checked route builds (every kept module checked against transformers' dequantized
weights as they stream past), tensor for tensor, and gives the same logits bit for bit."""

import numpy as np
import pytest
import torch
from support.hf_parity import prefill_all_positions

from pagedkv.models import gguf_file_weights, loader

PROMPT = "The capital of France is Paris, and the capital of Italy is"


def kept_runner(**model):
    from pagedkv.config import EngineConfig
    from pagedkv.runner.model_runner import ModelRunner

    return ModelRunner(EngineConfig(dtype="float32", num_device_blocks=16, swap_space_bytes=1 << 20,
                                    max_model_len=256, gguf_weights="quantized", **model))


def routes(**model):
    """(read from the file, checked against transformers' reading)."""
    monkeypatch = pytest.MonkeyPatch()
    try:
        def no_transformers_weights(*args, **kwargs):
            raise AssertionError("a kept load read transformers' float32 weights")

        monkeypatch.setattr(loader, "_dequantized_gguf", no_transformers_weights)
        monkeypatch.setattr(loader, "safetensors_layers", no_transformers_weights)
        from_file = kept_runner(**model)
        monkeypatch.undo()
        monkeypatch.setattr(gguf_file_weights, "readable", lambda tensors, architecture: False)
        checked = kept_runner(**model)
    finally:
        monkeypatch.undo()
    return from_file, checked


@pytest.fixture(scope="module")
def both_routes():
    """The embedded model (a "llama" file: q and k rows permuted) both ways."""
    return routes()


def test_the_model_read_from_the_file_is_the_checked_one(both_routes):
    from_file, checked = (runner.model for runner in both_routes)
    ours = dict(from_file.named_buffers()) | dict(from_file.named_parameters())
    theirs = dict(checked.named_buffers()) | dict(checked.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    assert type(from_file.lm_head_linear) is type(checked.lm_head_linear)
    assert type(from_file.embed_tokens) is type(checked.embed_tokens)


def test_and_gives_the_same_logits(both_routes):
    from_file, checked = both_routes
    tokens = checked.tokenizer.encode(PROMPT)
    logits = [prefill_all_positions(runner.model, tokens, [0, 1], block_size=16, num_blocks=4)
              for runner in both_routes]
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("architecture, kind, tied, v_kind", [
    ("qwen2", "Q8_0", False, None), ("llama", "Q4_0", True, None), ("qwen2", "Q4_0", True, "Q8_0")])
def test_other_files_read_as_transformers_reads_them(tmp_path, architecture, kind, tied, v_kind):
    """A Qwen2 file (q/k/v biases, its own LM head; llama.cpp leaves its q and k rows in HF's
    order), a tiny Llama one, and one whose v is of another type than q and k (as in a Q4_K_M
    file): every decoder linear kept (none sent back to float32 by a check against transformers'
    weights; q/k/v stacked where their types differ), the same model and logits both ways."""
    import gguf
    from support.gguf_copies import tiny_gguf

    from pagedkv.layers.quantized_linear import QuantizedLinear, StackedQuantizedLinear

    part_kinds = {"attn_v": gguf.GGMLQuantizationType[v_kind]} if v_kind else None
    path = tiny_gguf(str(tmp_path / f"tiny-{architecture}.gguf"), architecture, gguf.GGMLQuantizationType[kind],
                     qkv_bias=architecture == "qwen2", tied=tied, part_kinds=part_kinds)
    from_file, checked = routes(model=path)
    for runner in (from_file, checked):
        layers = runner.model.layers
        stacked = [module for module in layers.modules() if isinstance(module, StackedQuantizedLinear)]
        assert not any(isinstance(module, torch.nn.Linear) for module in layers.modules())
        assert len(stacked) == (len(layers) if v_kind else 0)
        assert {part.ggml_type for module in stacked for part in module.parts} == ({kind, v_kind} if v_kind else set())
        assert sum(isinstance(module, QuantizedLinear) for module in layers.modules()) == (4 + bool(v_kind)) * len(layers)
        assert type(runner.model.lm_head_linear).__name__ == "QuantizedLMHeadProduct"
    ours = dict(from_file.model.named_buffers()) | dict(from_file.model.named_parameters())
    theirs = dict(checked.model.named_buffers()) | dict(checked.model.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    tokens = [1, 200, 3000, 40000, 17]
    logits = [prefill_all_positions(runner.model, tokens, [0], block_size=16, num_blocks=2) for runner in (from_file, checked)]
    assert torch.equal(logits[0], logits[1])


def test_names_and_q_k_order():
    assert gguf_file_weights.hf_name("blk.11.attn_q.weight") == "model.layers.11.self_attn.q_proj.weight"
    assert gguf_file_weights.hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert gguf_file_weights.hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_file_weights.hf_name("blk.0.ffn_gate_exps.weight") is None  # (a MoE: transformers reads it)
    # llama.cpp permutes q and k rows of "llama" files only (transformers undoes it for those only)
    heads = (9, 3)
    assert gguf_file_weights.permuted_heads("blk.0.attn_q.weight", "llama", heads) == 9
    assert gguf_file_weights.permuted_heads("blk.0.attn_k.weight", "llama", heads) == 3
    assert gguf_file_weights.permuted_heads("blk.0.attn_v.weight", "llama", heads) is None
    assert gguf_file_weights.permuted_heads("blk.0.attn_q.weight", "qwen2", heads) is None
    rows = np.arange(2 * 2 * 2 * 3).reshape(8, 3)  # 2 heads of 4 rows: llama.cpp's (0 2 1 3) order per head
    assert gguf_file_weights.unpermute_rows(rows, 2)[:, 0].tolist() == [0, 6, 3, 9, 12, 18, 15, 21]


def test_a_file_with_a_tensor_not_named_here_is_left_to_transformers():
    class Tensor:
        pass

    tensors = {"token_embd.weight": Tensor(), "blk.0.attn_q.weight": Tensor(), "rope_freqs.weight": Tensor()}
    assert gguf_file_weights.readable(tensors, "llama")
    assert not gguf_file_weights.readable(tensors, "gemma2")
    assert not gguf_file_weights.readable({**tensors, "blk.0.ffn_gate_inp.weight": Tensor()}, "llama")
