"""The embedded SmolLM2 GGUF with its Q4_1 linear weights kept as GGUF blocks
(gguf_weights="quantized", models/gguf_quantized.py) against the same file dequantized at load.

Every token goes through the integer kernel (Q4_1 and Q8_0 take it at any token count), so the
only difference from the dequantized model is the activations' 8-bit rounding (Q8_1 per 32
values, llama.cpp's scheme): logits stay within LOGIT_TOLERANCE and greedy continuations agree on
at least MIN_EQUAL_PROMPTS of the prompts (a near-tie between two tokens may flip)."""

import pytest
import torch
from support.hf_parity import prefill_all_positions

from pagedkv.layers import quantized_linear
from pagedkv.layers.quantized_embedding import QuantizedEmbedding
from pagedkv.layers.quantized_linear import QuantizedLinear, QuantizedLMHeadProduct

LOGIT_TOLERANCE = 2.5  # absolute; logits reach |35| (std ~7); measured 1.50 at most, 7 of 8 prompts equal
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite programming language is",
    "The quick brown fox",
    "In 1969, the first humans to walk on the Moon were",
]
MIN_EQUAL_PROMPTS = 6
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def quantized_runner():
    from pagedkv.config import EngineConfig
    from pagedkv.runner.model_runner import ModelRunner

    return ModelRunner(EngineConfig(dtype="float32", num_device_blocks=64, swap_space_bytes=16 << 20,
                                    max_model_len=512, gguf_weights="quantized"))


def logits(runner, tokens: list[int]) -> torch.Tensor:
    return prefill_all_positions(runner.model, tokens, list(range(8)), block_size=16, num_blocks=8)


def test_every_decoder_linear_is_kept_quantized_and_decodes_to_the_loaded_weight(quantized_runner, smollm2_runner):
    quantized, dequantized = quantized_runner.model, smollm2_runner.model
    kept = [(name, module) for name, module in quantized.named_modules() if isinstance(module, QuantizedLinear)]
    assert len(kept) == 4 * len(quantized.layers)  # qkv, o, gate_up, down
    assert {module.ggml_type for _, module in kept} == {"Q4_1"}
    for name, module in kept:
        assert torch.equal(module.weight, dequantized.get_submodule(name).weight)
    assert not any(isinstance(m, torch.nn.Linear) for m in quantized.layers.modules())


def test_the_lm_head_reads_the_tied_embedding_tables_blocks(quantized_runner, smollm2_runner):
    head = quantized_runner.model.lm_head_linear
    assert isinstance(head, QuantizedLMHeadProduct) and head.ggml_type == "Q8_0"  # (the file's token_embd)
    assert torch.equal(quantized_linear.dequantize(head.blocks, "Q8_0", (head.vocab_size, 576)),
                       smollm2_runner.model.embed_tokens.weight)
    hidden = torch.randn(3, 576)
    kernel = head(hidden, None)  # (the table is kept as blocks too: there is no float weight to pass)
    exact = hidden.double() @ smollm2_runner.model.embed_tokens.weight.double().T
    # (8-bit activations: within a few hundredths of a logit of the float64 product)
    assert (kernel.double() - exact).abs().max() < 0.05 * exact.abs().max()


def test_the_embedding_table_is_its_blocks_and_looks_up_the_float_tables_rows(quantized_runner, smollm2_runner, smollm2):
    import os

    model = quantized_runner.model
    table = model.embed_tokens
    assert isinstance(table, QuantizedEmbedding) and table.blocks.data_ptr() == model.lm_head_linear.blocks.data_ptr()
    ids = torch.tensor([[0, 1, 49151], [17, 17, 30000]])
    assert torch.equal(table(ids), smollm2_runner.model.embed_tokens.weight[ids])
    assert torch.equal(table.weight, smollm2_runner.model.embed_tokens.weight)
    # Resident weights about the file's size (its 98 MB; the rest: norms and rotary tables).
    weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert weight_bytes < 1.1 * os.path.getsize(os.path.join(*smollm2))


def test_logits_close_and_greedy_tokens_mostly_equal(quantized_runner, smollm2_runner):
    tokenizer = smollm2_runner.tokenizer
    worst, equal_prompts = 0.0, 0
    for prompt in PROMPTS:
        ours, theirs = tokenizer.encode(prompt), tokenizer.encode(prompt)
        for _ in range(NEW_TOKENS):
            quantized_logits, dequantized_logits = logits(quantized_runner, ours), logits(smollm2_runner, theirs)
            if ours == theirs:
                worst = max(worst, (quantized_logits - dequantized_logits).abs().max().item())
            ours = ours + [int(quantized_logits[-1].argmax())]
            theirs = theirs + [int(dequantized_logits[-1].argmax())]
        equal_prompts += ours == theirs
    print(f"largest logit difference {worst:.3f}; {equal_prompts} of {len(PROMPTS)} continuations equal")
    assert worst < LOGIT_TOLERANCE, f"largest logit difference {worst}"
    assert equal_prompts >= MIN_EQUAL_PROMPTS, f"{equal_prompts} of {len(PROMPTS)} greedy continuations equal"


def test_a_long_prefill_runs_the_kernel_too(quantized_runner, smollm2_runner):
    tokens = smollm2_runner.tokenizer.encode("The capital of France is Paris, and the capital of Italy is") * 6
    assert len(tokens) > max(quantized_linear.MAX_KERNEL_TOKENS, quantized_linear.MAX_HEAD_KERNEL_TOKENS)
    quantized_logits, dequantized_logits = logits(quantized_runner, tokens), logits(smollm2_runner, tokens)
    assert not torch.equal(quantized_logits, dequantized_logits)  # (dequantize + F.linear would be equal)
    assert (quantized_logits - dequantized_logits).abs().max() < LOGIT_TOLERANCE


def test_auto_keeps_the_blocks_where_it_can_and_dequantizes_quietly_elsewhere(caplog):
    from pagedkv.config import EngineConfig
    from pagedkv.runner.model_runner import ModelRunner

    def kept(runner) -> int:
        return sum(isinstance(module, QuantizedLinear) for module in runner.model.modules())

    options = dict(num_device_blocks=8, swap_space_bytes=1 << 20, max_model_len=64)
    assert kept(ModelRunner(EngineConfig(dtype="float32", gguf_weights="auto", **options))) > 0
    with caplog.at_level("WARNING", logger="pagedkv"):
        assert kept(ModelRunner(EngineConfig(dtype="bfloat16", gguf_weights="auto", **options))) == 0
        assert "needs float32" not in caplog.text
        assert kept(ModelRunner(EngineConfig(dtype="bfloat16", gguf_weights="quantized", **options))) == 0
        assert "needs float32" in caplog.text
