"""Quantized checkpoints (float8; GPTQ, AWQ and compressed-tensors integers) load as the float
checkpoint of their dequantized weights. The test quantizes a tiny random Llama itself and packs the integers as
AutoGPTQ's, AutoAWQ's and compressed-tensors' packers do (loops over the packed positions), so
the loader's unpacking is checked against an independent writer of each format."""

import json
import os

import pytest
import torch
from support.checkpoints import save_tiny_checkpoint
from support.hf_parity import assert_greedy_generation_matches_hf, assert_prefill_matches_hf

from pagedkv.models.loader import load
from pagedkv.models.quantized_checkpoints import AWQ_PACK_ORDER

GROUP_SIZE = 32


def as_int32(values: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns of 32 bits as the int32 of the same bits."""
    return ((values + 2**31) % 2**32 - 2**31).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's qweight packing: int32 row r holds rows r * k .. r * k + k - 1, lowest bits first."""
    per_int = 32 // bits
    packed = torch.zeros(values.shape[0] // per_int, values.shape[1], dtype=torch.int64)
    for position in range(per_int):
        packed |= values[position::per_int].long() << (bits * position)
    return as_int32(packed)


def pack_columns(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """Column packing (GPTQ's qzeros, and AWQ's qweight / qzeros with AWQ's `order`)."""
    per_int = 32 // bits
    order = order or range(per_int)
    packed = torch.zeros(values.shape[0], values.shape[1] // per_int, dtype=torch.int64)
    for position, column in enumerate(order):
        packed |= values[:, column::per_int].long() << (bits * position)
    return as_int32(packed)


def quantize(weight: torch.Tensor, bits: int, groups: torch.Tensor, symmetric: bool):
    """Round-to-nearest quantization of weight [out, in] by input-channel group: (integers [in, out],
    zero points [num_groups, out], fp16 scales [num_groups, out], the dequantized weight [out, in])."""
    top = 2**bits - 1
    num_groups = int(groups.max()) + 1
    scales, zeros = torch.empty(num_groups, weight.shape[0]), torch.empty(num_groups, weight.shape[0])
    for group in range(num_groups):
        block = weight[:, groups == group]
        if symmetric:
            scales[group] = block.abs().amax(dim=1) / (2 ** (bits - 1) - 1)
            zeros[group] = 2 ** (bits - 1)
        else:
            low, high = block.amin(dim=1).clamp(max=0), block.amax(dim=1).clamp(min=0)
            scales[group] = (high - low) / top
            zeros[group] = torch.round(-low / scales[group])
    scales = scales.half()
    integers = torch.clamp(torch.round(weight.t() / scales.float()[groups]) + zeros[groups], 0, top).long()
    dequantized = ((integers - zeros[groups].long()).float() * scales.float()[groups]).t()
    return integers, zeros.long(), scales, dequantized


VARIANTS = {
    # name: (quant_method, bits, act order, symmetric, checkpoint_format)
    "gptq-4bit": ("gptq", 4, False, True, "gptq"),
    "gptq-4bit-act-order": ("gptq", 4, True, True, "gptq"),
    "gptq_v2-8bit": ("gptq", 8, False, False, "gptq_v2"),
    "gptq_v2-2bit": ("gptq", 2, True, False, "gptq_v2"),
    "awq": ("awq", 4, False, False, None),
    "compressed-w4a16": ("compressed-tensors", 4, False, True, "pack-quantized"),
    "compressed-w4a16-asym-act-order": ("compressed-tensors", 4, True, False, "pack-quantized"),
    "compressed-w8a8-channel": ("compressed-tensors", 8, False, True, "int-quantized"),
}


def quantized_checkpoint(tmp_path, variant: str):
    """A tiny Llama quantized as `variant`: (HF model holding the dequantized weights, its float
    directory, the quantized directory)."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    method, bits, act_order, symmetric, checkpoint_format = VARIANTS[variant]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         eos_token_id=2, bos_token_id=1, pad_token_id=0)).eval()
    float_dir = save_tiny_checkpoint(tmp_path / "float", model)
    generator = torch.Generator().manual_seed(1)
    quantized, dequantized = {}, {}
    for name, weight in load_file(os.path.join(float_dir, "model.safetensors")).items():
        if weight.dim() != 2 or "embed" in name or "lm_head" in name:
            quantized[name] = dequantized[name] = weight
            continue
        in_features = weight.shape[1]
        groups = torch.arange(in_features) // (in_features if checkpoint_format == "int-quantized" else GROUP_SIZE)
        if act_order:  # groups follow a permutation of the input channels (GPTQ's desc_act)
            groups = groups[torch.argsort(torch.randperm(in_features, generator=generator))]
        integers, zeros, scales, dequantized[name] = quantize(weight, bits, groups, symmetric)
        layer = name[: -len(".weight")]
        if method == "gptq":
            stored_zeros = (zeros - 1) & (2**bits - 1) if checkpoint_format == "gptq" else zeros
            quantized[layer + ".qweight"] = pack_rows(integers, bits)
            quantized[layer + ".qzeros"] = pack_columns(stored_zeros, bits)
            quantized[layer + ".g_idx"] = groups.to(torch.int32)
        elif method == "awq":
            quantized[layer + ".qweight"] = pack_columns(integers, bits, AWQ_PACK_ORDER)
            quantized[layer + ".qzeros"] = pack_columns(zeros, bits, AWQ_PACK_ORDER)
        if method != "compressed-tensors":
            quantized[layer + ".scales"] = scales
            continue
        offset = 2 ** (bits - 1)  # compressed-tensors stores signed integers, packed as value + offset
        if checkpoint_format == "pack-quantized":
            quantized[layer + ".weight_packed"] = pack_columns(integers.t(), bits)
            quantized[layer + ".weight_shape"] = torch.tensor(list(weight.shape))
        else:
            quantized[name] = (integers.t() - offset).to(torch.int8)
            quantized[layer + ".input_scale"] = torch.tensor([0.02])  # W8A8's activation scale: not used
        quantized[layer + ".weight_scale"] = scales.t().contiguous()
        if not symmetric:
            quantized[layer + ".weight_zero_point"] = pack_rows(zeros.t(), bits)
        if act_order:
            quantized[layer + ".weight_g_idx"] = groups.to(torch.int32)
    model.load_state_dict(dequantized)
    dequantized_dir = save_tiny_checkpoint(tmp_path / "dequantized", model)
    quantized_dir = save_tiny_checkpoint(tmp_path / "quantized", model)
    os.remove(os.path.join(quantized_dir, "model.safetensors"))
    save_file(quantized, os.path.join(quantized_dir, "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(quantized_dir, "config.json")
    with open(config_path) as file:
        config = json.load(file)
    config["quantization_config"] = {
        "gptq": {"quant_method": "gptq", "bits": bits, "group_size": GROUP_SIZE, "desc_act": act_order,
                 "sym": symmetric, "checkpoint_format": checkpoint_format},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE, "zero_point": True, "version": "gemm"},
        "compressed-tensors": {
            "quant_method": "compressed-tensors", "format": checkpoint_format, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": bits, "type": "int", "symmetric": symmetric,
                "strategy": "channel" if checkpoint_format == "int-quantized" else "group",
                "group_size": None if checkpoint_format == "int-quantized" else GROUP_SIZE,
                "actorder": "group" if act_order else None}}}},
    }[method]
    with open(config_path, "w") as file:
        json.dump(config, file)
    return model, dequantized_dir, quantized_dir


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_int_quantized_checkpoints_load_as_their_dequantized_weights(tmp_path, variant):
    model, dequantized_dir, quantized_dir = quantized_checkpoint(tmp_path, variant)
    ours = load(quantized_dir, None, None, torch.float32, torch.device("cpu"), None).model.state_dict()
    reference = assert_prefill_matches_hf(dequantized_dir, "llama").model.state_dict()
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[name], reference[name]) for name in ours)


def test_gptq_checkpoint_generates_what_hf_generates_with_its_dequantized_weights(tmp_path):
    model, _, quantized_dir = quantized_checkpoint(tmp_path, "gptq-4bit-act-order")
    assert_greedy_generation_matches_hf(model, quantized_dir, (40, 9), 12, seed=3)


@pytest.mark.parametrize("change, message", [
    ({"bits": 3}, "3 bits are not supported"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
    ({"quant_method": "bitsandbytes"}, "is not GPTQ or AWQ"),
])
def test_unsupported_int_quantization_is_refused_by_name(tmp_path, change, message):
    _, _, quantized_dir = quantized_checkpoint(tmp_path, "gptq-4bit")
    config_path = os.path.join(quantized_dir, "config.json")
    with open(config_path) as file:
        config = json.load(file)
    config["quantization_config"].update(change)
    with open(config_path, "w") as file:
        json.dump(config, file)
    with pytest.raises(ValueError, match=message):
        load(quantized_dir, None, None, torch.float32, torch.device("cpu"), None)


def _quantized_fp8(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(float8 codes, scale tensors by suffix, the dequantized weight) of one weight: in blocks
    of 48 x 40 (edges partial: DeepSeek-V3's format with `weight_scale_inv`), per output
    channel or per tensor (compressed-tensors' `weight_scale`)."""
    if scheme == "blocks":
        rows, columns = -(-weight.shape[0] // 48), -(-weight.shape[1] // 40)
        padded = torch.zeros(rows * 48, columns * 40)
        padded[: weight.shape[0], : weight.shape[1]] = weight
        blocks = padded.view(rows, 48, columns, 40)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        crop = (slice(0, weight.shape[0]), slice(0, weight.shape[1]))
        dequantized = (codes.float() * scale[:, None, :, None]).view_as(padded)[crop]
        return codes.view_as(padded)[crop].contiguous(), {"_scale_inv": scale}, dequantized
    scale = weight.abs().amax(dim=1, keepdim=True) / 448.0 if scheme == "channels" else weight.abs().amax() / 448.0
    codes = (weight / scale).to(torch.float8_e4m3fn)
    return codes, {"_scale": scale}, codes.float() * scale


@pytest.mark.parametrize("scheme", ["blocks", "channels", "tensor"])
def test_fp8_quantized_checkpoints_load_dequantized(tmp_path, scheme):
    """A checkpoint quantized to float8 (e4m3 weights and float32 scales: per block, as
    DeepSeek-V3's; per output channel or per tensor, as compressed-tensors' FP8 releases, whose
    activation scales are not used) loads as the float checkpoint of its dequantized weights;
    embeddings and norms stay as they are."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=200, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         eos_token_id=2, bos_token_id=1, pad_token_id=0)).eval()
    float_dir = save_tiny_checkpoint(tmp_path / "float", model)
    quantized, dequantized = {}, {}
    for name, weight in load_file(os.path.join(float_dir, "model.safetensors")).items():
        if weight.dim() != 2 or "embed" in name or "lm_head" in name:
            quantized[name] = dequantized[name] = weight
            continue
        codes, scales, dequantized[name] = _quantized_fp8(weight, scheme)
        quantized[name] = codes
        quantized.update({name + suffix: scale for suffix, scale in scales.items()})
        if scheme != "blocks":
            quantized[name.replace(".weight", ".input_scale")] = torch.tensor(0.5)
    original = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    model.load_state_dict(dequantized)
    dequantized_dir = save_tiny_checkpoint(tmp_path / "dequantized", model)
    quantized_dir = save_tiny_checkpoint(tmp_path / "quantized", model)
    save_file(quantized, os.path.join(quantized_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(quantized_dir, "config.json")) as file:
        config = json.load(file)
    config["quantization_config"] = (
        {"quant_method": "fp8", "weight_block_size": [48, 40], "activation_scheme": "dynamic"} if scheme == "blocks"
        else {"quant_method": "compressed-tensors", "format": "float-quantized"})
    with open(os.path.join(quantized_dir, "config.json"), "w") as file:
        json.dump(config, file)

    ours = load(quantized_dir, None, None, torch.float32, torch.device("cpu"), None).model.state_dict()
    reference = assert_prefill_matches_hf(dequantized_dir, "llama").model.state_dict()
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[name], reference[name]) for name in ours)
    assert not torch.equal(ours["layers.0.mlp.down_proj.weight"], original)  # (float8 rounding is in them)
