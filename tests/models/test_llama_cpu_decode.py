"""The one-call CPU decode path of Llama models (models/llama_cpu_decode.py, rust/cpu_kernels/decoder.rs):
a decode step through it gives the same bits as the layer-by-layer path (tokens and logprobs equal,
not close), and models or steps it does not cover take the layers one by one."""

import pytest
import torch

from pagedkv.config import cpu_has_native_bfloat16

from pagedkv import LLM, SamplingParams
from pagedkv.models import llama_cpu_decode
from support.checkpoints import save_tiny_checkpoint
from support.tiny_models import tiny_llama, tiny_llama_variant, tiny_qwen3

# Different lengths, so sequences cross block boundaries (16 tokens) at different steps and finish apart
TOKEN_PROMPTS = [[5, 9, 30, 7] * 5, [100, 101], [3, 4, 5, 6, 7, 8, 9, 10, 11] * 2 + [12], [200], [42, 43, 44] * 4]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    import gguf
    from support.gguf_copies import tiny_gguf

    kinds = gguf.GGMLQuantizationType
    return {
        # a kept GGUF whose v is of another type than q and k (as a Q4_K_M file's): q/k/v stacked,
        # each part with its rows of the fused bias
        "gguf-mixed-qkv": tiny_gguf(str(tmp_path_factory.mktemp("gguf") / "mixed.gguf"), "qwen2", kinds.Q4_0,
                                    qkv_bias=True, part_kinds={"attn_v": kinds.Q8_0}),
        "llama": save_tiny_checkpoint(tmp_path_factory.mktemp("llama"), tiny_llama()),
        # every layer windowed (16 tokens: generation runs past it), biased q/k/v and MLP
        "ministral": save_tiny_checkpoint(tmp_path_factory.mktemp("ministral"), tiny_llama_variant("ministral")),
        "seed_oss": save_tiny_checkpoint(tmp_path_factory.mktemp("seed_oss"), tiny_llama_variant("seed_oss")),
        "qwen3": save_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), tiny_qwen3()),
    }


def engine(name, tiny_dirs, smollm2, **options):
    common = dict(num_device_blocks=64, max_model_len=256, enable_prefix_caching=False, dtype="float32")
    if name.startswith("smollm2"):
        directory, file = smollm2
        weights = "quantized" if name == "smollm2-quantized" else "dequantized"
        return LLM(directory, gguf_file=file, gguf_weights=weights, **common, **options)
    if name.startswith("gguf"):
        return LLM(tiny_dirs[name], gguf_weights="quantized", **common, **options)
    return LLM(tiny_dirs[name], device="cpu", generation_config="vllm", **common, **options)


def generate(llm, one_call: bool, monkeypatch, max_tokens=24):
    """Tokens and top-5 logprobs of greedy generation, and how many steps went through one call."""
    calls = []
    forward = llama_cpu_decode.CpuDecodePath.forward
    monkeypatch.setattr(llama_cpu_decode.CpuDecodePath, "forward",
                        lambda self, *args: calls.append(1) or forward(self, *args))
    monkeypatch.setattr(llama_cpu_decode, "enabled", one_call)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in TOKEN_PROMPTS], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [dict(lp) for lp in o.outputs[0].logprobs]) for o in outputs], len(calls)


@pytest.mark.parametrize("name", ["smollm2-quantized", "smollm2-float32", "llama", "ministral", "seed_oss",
                                  "gguf-mixed-qkv"])
def test_decode_steps_in_one_call_give_the_layer_by_layer_bits(name, tiny_dirs, smollm2, monkeypatch):
    llm = engine(name, tiny_dirs, smollm2)
    layer_by_layer, calls_off = generate(llm, False, monkeypatch)
    one_call, calls_on = generate(llm, True, monkeypatch)
    llm.shutdown()
    assert calls_off == 0 and calls_on >= 20  # (every decode step of up to 5 rows: the kernels take up to 16)
    assert one_call == layer_by_layer


@pytest.mark.parametrize("name,options", [("qwen3", {}), ("llama", {"cpu_linear_kernel": False})])
def test_models_it_does_not_cover_take_the_layers_one_by_one(name, options, tiny_dirs, smollm2, monkeypatch):
    """Qwen3's per-head q/k norms are not in the core's layer; torch's products (cpu_linear_kernel
    off) round differently from the kernels the core calls."""
    llm = engine(name, tiny_dirs, smollm2, **options)
    _, calls = generate(llm, True, monkeypatch, max_tokens=4)
    assert calls == 0 and llm.engine.runner.model.__dict__["_cpu_decode_path"] is None
    llm.shutdown()


def test_prompt_steps_and_steps_of_more_rows_than_the_kernels_take_go_layer_by_layer(tiny_dirs, smollm2, monkeypatch):
    llm = engine("llama", tiny_dirs, smollm2)
    _, calls = generate(llm, True, monkeypatch, max_tokens=1)  # (the prompts' step alone)
    assert calls == 0
    _, calls = generate(llm, True, monkeypatch, max_tokens=4)
    assert calls == 3
    llm.engine.runner.model.__dict__["_cpu_decode_path"].max_tokens = len(TOKEN_PROMPTS) - 1
    _, calls = generate(llm, True, monkeypatch, max_tokens=4)
    llm.shutdown()
    assert calls == 0


def test_bad_shapes_and_slots_are_errors_that_write_nothing():
    from pagedkv_core import _core
    from pagedkv_core.errors import InvalidConfigError

    hidden_size, heads, kv_heads, head_dim, intermediate, block_size, num_blocks = 8, 2, 1, 4, 8, 4, 2
    block_stride = 2 * kv_heads * block_size * head_dim
    tensors = {name: torch.randn(*shape) for name, shape in
               {"qkv": (16, 8), "o": (8, 8), "gate_up": (16, 8), "down": (8, 8), "norm": (8,)}.items()}
    def linear(name, k, n):
        return ("float32", tensors[name].data_ptr(), tensors[name].numel() * 4, None, k, n)
    def decoder(qkv_rows):
        layer = (tensors["norm"].data_ptr(), [linear("qkv", 8, qkv_rows)], linear("o", 8, 8), tensors["norm"].data_ptr(),
                 linear("gate_up", 8, 16), linear("down", 8, 8), 0, kv_heads * block_size * head_dim, 0)
        shape = (hidden_size, heads, kv_heads, head_dim, intermediate, block_size, num_blocks, block_stride)
        return _core.CpuDecoder(shape, 1e-5, 0.5, [layer])
    cache = torch.zeros(num_blocks * block_stride)
    hidden, residual = torch.randn(1, 8), torch.empty(1, 8)
    cos, sin = torch.ones(1, head_dim), torch.zeros(1, head_dim)
    tables, contexts = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    def run(decoder, slot, cache_dtype="float32"):
        slots = torch.tensor([slot])
        decoder.forward(hidden.data_ptr(), residual.data_ptr(), cache.data_ptr(), cache.numel(), cache_dtype,
                        (cos.data_ptr(), sin.data_ptr()), tables.data_ptr(), 2, contexts.data_ptr(), slots.data_ptr(),
                        1, 1)
    before = hidden.clone()
    with pytest.raises(InvalidConfigError, match="qkv_proj"):
        run(decoder(qkv_rows=12), slot=4)  # (a qkv weight of the wrong size)
    with pytest.raises(InvalidConfigError, match="slot 8"):
        run(decoder(qkv_rows=16), slot=8)  # (past the cache's 8 slots)
    with pytest.raises(InvalidConfigError, match="no parts"):  # (qkv's parts, stacked by rows: none)
        _core.CpuDecoder((hidden_size, heads, kv_heads, head_dim, intermediate, block_size, num_blocks, block_stride),
                         1e-5, 0.5, [(tensors["norm"].data_ptr(), [], linear("o", 8, 8), 0, linear("gate_up", 8, 16),
                                      linear("down", 8, 8), 0, 0, 0)])
    with pytest.raises(InvalidConfigError, match="cache_dtype"):
        run(decoder(qkv_rows=16), slot=4, cache_dtype="float16")
    assert torch.equal(hidden, before) and not cache.any()
    run(decoder(qkv_rows=16), slot=4)
    assert cache.any() and not torch.equal(hidden, before)


def test_bfloat16_weights_beside_float32_activations_give_the_layer_by_layer_bits(tiny_dirs, smollm2, monkeypatch):
    """A BF16 GGUF's linears kept bfloat16 (layers.cpu_linear.BFloat16Linear), here made from the
    tiny Llama's float32 ones: the one-call path reads them as the layers do."""
    from pagedkv.layers.cpu_linear import BFloat16Linear

    llm = engine("llama", tiny_dirs, smollm2)
    for layer in llm.engine.runner.model.layers:
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                             (layer.mlp, "down_proj")):
            linear = getattr(parent, name)
            kept = BFloat16Linear(linear.in_features, linear.out_features)
            kept.weight.copy_(linear.weight.detach())
            setattr(parent, name, kept)
    layer_by_layer, calls_off = generate(llm, False, monkeypatch)
    one_call, calls_on = generate(llm, True, monkeypatch)
    llm.shutdown()
    assert calls_off == 0 and calls_on >= 20
    assert one_call == layer_by_layer


def test_a_bf16_gguf_tensor_stays_bfloat16_unless_it_differs_from_the_checkpoint_weight():
    """models/gguf_quantized.py swaps a linear for its kept module before the load, then checks it
    against the float weight streaming past: equal, it stays; not, a float32 linear takes over."""
    from types import SimpleNamespace

    from torch import nn

    from pagedkv.layers.cpu_linear import BFloat16Linear
    from pagedkv.models import gguf_quantized

    weight = torch.randn(6, 4).bfloat16()
    as_gguf = SimpleNamespace(name="blk.0.ffn_down.weight", data=weight.view(torch.uint8).numpy(),
                              tensor_type=SimpleNamespace(name="BF16"))
    for streamed, stays in ((weight.float(), True), (weight.float() + 1e-3, False)):
        parent = nn.Module()
        parent.down_proj = nn.Linear(4, 6, bias=False)
        kept = gguf_quantized._kept_module(parent.down_proj, [as_gguf], "llama", (1, 1))
        assert isinstance(kept, BFloat16Linear) and torch.equal(kept.weight, weight)
        parent.down_proj = kept
        gguf_quantized._check(parent, "down_proj", kept, "layers.0.mlp.down_proj")(streamed)
        assert (parent.down_proj is kept) == stays
        assert torch.equal(parent.down_proj.weight.float(), streamed)
        x, many = torch.randn(3, 4), torch.randn(40, 4)  # (the kernel's rows; torch's GEMM's)
        torch.testing.assert_close(parent.down_proj(x), x @ streamed.T)
        if stays and cpu_has_native_bfloat16():  # (torch's bfloat16 GEMM: x and the product rounded to bfloat16)
            expected = (many.bfloat16().float() @ streamed.T).bfloat16().float()
            torch.testing.assert_close(parent.down_proj(many), expected, rtol=2**-7, atol=1e-6)
        else:
            torch.testing.assert_close(parent.down_proj(many), many @ streamed.T)
    assert kept.to(torch.float32).weight.dtype == torch.bfloat16  # (casting the model leaves the bits)


@pytest.mark.parametrize("name", ["smollm2-quantized", "llama"])
def test_a_bfloat16_cache_beside_float32_activations_gives_the_layer_by_layer_bits_too(name, tiny_dirs, smollm2,
                                                                                       monkeypatch):
    """K/V, the attention's query and its output rounded to bfloat16 in the one call as the
    layer-by-layer path's casts round them (kv_cache_dtype="bfloat16")."""
    llm = engine(name, tiny_dirs, smollm2, kv_cache_dtype="bfloat16")
    assert llm.engine.runner.kv_cache.device_cache.dtype == torch.bfloat16
    layer_by_layer, calls_off = generate(llm, False, monkeypatch)
    one_call, calls_on = generate(llm, True, monkeypatch)
    llm.shutdown()
    assert calls_off == 0 and calls_on >= 20
    assert one_call == layer_by_layer
