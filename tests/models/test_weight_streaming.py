"""The loader streams a safetensors checkpoint into the model a decoder layer at a time
(loader.safetensors_layers, LlamaForCausalLM.load_hf_weights): the same parameters as loading the
whole checkpoint as one dict, for checkpoints whose weights are fused, split, stacked or renamed at
load and whose layers span files; never the whole checkpoint in memory; missing or misshapen
weights still fail loudly."""

import glob
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedkv.models.loader import load, model_spec
from pagedkv.models.llama import LlamaForCausalLM
from support.checkpoints import save_tiny_checkpoint

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def tiny_hf_model(model_type: str):
    """A random HF model of each kind of load-time work: fused q/k/v and gate/up (llama, qwen2 with
    qkv biases and tied embeddings), experts stacked (mixtral's w1/w3/w2, qwen2_moe's with a shared
    expert), a fused qkv split per head (gpt_neox), per-head norms stacked (stablelm), Conv1D
    weights transposed (gpt2)."""
    import transformers

    torch.manual_seed(0)
    if model_type == "llama":
        config = transformers.LlamaConfig(**SHAPE, tie_word_embeddings=False)
    elif model_type == "qwen2":
        config = transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True)
    elif model_type == "mixtral":
        config = transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2)
    elif model_type == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=48)
    elif model_type == "gpt_neox":
        config = transformers.GPTNeoXConfig(**{**SHAPE, "num_key_value_heads": 4})  # (multi-head only)
    elif model_type == "stablelm":
        config = transformers.StableLmConfig(**SHAPE, qk_layernorm=True)
    else:
        config = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=3, n_head=4, n_positions=128)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # (no zero biases or unit norms: each weight shows where it lands)
        for parameter in model.parameters():
            parameter.normal_(std=0.5)
    return model.eval()


def save_in_shards(directory, model) -> str:
    """`model` saved in files of about 20 kB (each layer's weights span several), beside a tokenizer."""
    save_tiny_checkpoint(directory, model)
    for path in glob.glob(os.path.join(directory, "*.safetensors")):
        os.remove(path)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="20KB")
    assert len(glob.glob(os.path.join(directory, "*.safetensors"))) > 3
    return str(directory)


def whole_dict_load(directory: str, dtype: torch.dtype) -> torch.nn.Module:
    """The checkpoint read whole into one dict, then loaded (what the loader did before)."""
    hf_config, model_class, traits, _ = model_spec(directory, None)
    state = {}
    for path in glob.glob(os.path.join(directory, "*.safetensors")):
        state.update(load_file(path))
    with torch.device("meta"):
        net = model_class(hf_config, traits, hf_config.max_position_embeddings, dtype)
    net = net.to(dtype=dtype).to_empty(device="cpu")
    net.load_hf_state_dict(state)
    return net


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mixtral", "qwen2_moe", "gpt_neox", "stablelm", "gpt2"])
def test_streamed_load_equals_the_whole_dict_load(tmp_path, model_type):
    directory = save_in_shards(tmp_path, tiny_hf_model(model_type))
    streamed = load(directory, None, None, torch.float32, torch.device("cpu"), None).model
    whole = whole_dict_load(directory, torch.float32)
    ours, theirs = streamed.state_dict(), whole.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_fused_parameters_hold_hf_weights_in_their_rows_rounded_once(tmp_path):
    hf_model = tiny_hf_model("llama")
    directory = save_in_shards(tmp_path, hf_model)
    net = load(directory, None, None, torch.bfloat16, torch.device("cpu"), None).model
    hf_layer, layer = hf_model.model.layers[1], net.layers[1]
    attention = hf_layer.self_attn
    qkv = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight])
    gate_up = torch.cat([hf_layer.mlp.gate_proj.weight, hf_layer.mlp.up_proj.weight])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv.to(torch.bfloat16))
    assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up.to(torch.bfloat16))
    assert torch.equal(net.lm_head.weight, hf_model.lm_head.weight.to(torch.bfloat16))


def test_loading_holds_one_decoder_layer_of_the_checkpoint_at_a_time(tmp_path, monkeypatch):
    directory = save_in_shards(tmp_path, tiny_hf_model("mixtral"))
    groups = []
    own_weights = LlamaForCausalLM.own_weights

    def recording(self, state):
        groups.append(sorted(state))
        return own_weights(self, state)

    def whole_file(*args, **kwargs):
        raise AssertionError("the loader read a whole checkpoint file")

    monkeypatch.setattr(LlamaForCausalLM, "own_weights", recording)
    monkeypatch.setattr("safetensors.torch.load_file", whole_file)
    load(directory, None, None, torch.float32, torch.device("cpu"), None)
    # the weights outside the layers first (embeddings, final norm, LM head), then each layer's alone
    assert groups[0] == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    assert [{name.split(".")[2] for name in group} for group in groups[1:]] == [{"0"}, {"1"}, {"2"}]


@pytest.mark.parametrize("damage, message", [
    ("drop", r"missing \['layers.1.self_attn.qkv_proj.weight'\]"),
    ("reshape", r"parts of layers.1.self_attn.qkv_proj.weight \(shapes \[\[64, 64\], \[64, 64\], \[32, 64\]\]\) make 160 rows, the model.s 128"),
])
def test_a_missing_or_misshapen_weight_fails_loudly(tmp_path, damage, message):
    directory = save_tiny_checkpoint(tmp_path, tiny_hf_model("llama"))
    path = os.path.join(directory, "model.safetensors")
    state = load_file(path)
    name = "model.layers.1.self_attn.k_proj.weight"
    if damage == "drop":
        del state[name]
    else:
        state[name] = torch.zeros(64, 64)
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        load(directory, None, None, torch.float32, torch.device("cpu"), None)
