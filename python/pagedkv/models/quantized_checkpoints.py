"""Weights of quantized checkpoints, dequantized to float32 at load (the model is then cast to the
engine's dtype, so it serves what a float checkpoint of the same numbers would):

- float8 (`quant_method` fp8, compressed-tensors, fbgemm_fp8): e4m3 weights times their scales;
- GPTQ (`quant_method` gptq, AutoGPTQ / GPTQModel files): 2-, 4- or 8-bit integers packed in
  int32 along the input dim (`qweight` [in / pack, out]), zero points packed along the output dim
  (`qzeros` [groups, out / pack]), fp16 `scales` [groups, out], each input channel's group in
  `g_idx` (act-order checkpoints permute it);
- AWQ (`quant_method` awq, AutoAWQ's GEMM files): 4-bit integers packed along the output dim in
  AWQ's interleaved order (`qweight` [in, out / 8], `qzeros` [groups, out / 8]), `scales`
  [groups, out];
- compressed-tensors integers (llm-compressor's W4A16 / W8A16 / W8A8 releases): `pack-quantized`
  (`weight_packed` [out, in / pack] int32 of signed values offset by 2^(bits-1), `weight_shape`,
  asymmetric zero points packed along the output dim) or `int-quantized` (int8 `weight`), with
  `weight_scale` per tensor, channel or group and act-order `weight_g_idx`; activation scales
  are not used.

A weight is `scale * (q - zero)` of its group. Embeddings, norms and layers a checkpoint left
unquantized load as they are."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("pagedkv.models.loader")

# AWQ packs output columns 0-7 of each int32 in this order, 4 bits each from the lowest.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_FLOAT8_SCALES = (".weight_scale_inv", ".weight_scale", ".input_scale", ".k_scale", ".v_scale")
_INT_PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")
_COMPRESSED_INT_PARTS = (".weight_packed", ".weight_shape", ".weight_scale", ".weight_zero_point", ".weight_g_idx",
                         ".input_scale", ".input_zero_point")


def dequantized(state: dict[str, torch.Tensor], quantization_config) -> dict[str, torch.Tensor]:
    """The checkpoint's weights with every quantized linear layer widened to float32 `*.weight`;
    a state with no quantized tensors comes back as it is. Formats other than the ones above are
    refused with the config that named them."""
    config = quantization_config if isinstance(quantization_config, dict) else (
        quantization_config.to_dict() if quantization_config is not None else {})
    if any(name.endswith(".qweight") for name in state):
        method = config.get("quant_method")
        if method == "gptq":
            return _dequantized_gptq(state, config)
        if method == "awq":
            return _dequantized_awq(state, config)
        raise ValueError(f"checkpoint has *.qweight tensors but quantization_config {config!r} is not GPTQ or AWQ "
                         "(quant_method 'gptq' or 'awq')")
    if any(name.endswith(".weight_packed") or (tensor.dtype == torch.int8 and name.endswith(".weight"))
           for name, tensor in state.items()):
        if config.get("quant_method") != "compressed-tensors":
            raise ValueError(f"checkpoint has integer *.weight_packed or int8 *.weight tensors but quantization_config "
                             f"{config!r} is not compressed-tensors")
        return _dequantized_compressed_int(state, config)
    return _dequantized_fp8(state, config)


def _dequantized_fp8(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """In blocks (`quant_method: fp8`, DeepSeek-V3's and the -FP8 releases of Qwen3 and others:
    each float8 `*.weight` times its `*.weight_scale_inv`, one scale per `weight_block_size`
    block), or per tensor or per output channel (`compressed-tensors` and `fbgemm_fp8`, e.g. the
    FP8 releases of Llama: `*.weight_scale` of one value or one per row; their activation scales,
    `*.input_scale`, and KV-cache scales are not used)."""
    blockwise = any(name.endswith(".weight_scale_inv") for name in state)
    channelwise = any(name.endswith(".weight_scale") for name in state)
    if not (blockwise or channelwise):
        return state
    method = config.get("quant_method")
    if blockwise and method != "fp8":
        raise ValueError(f"checkpoint has *.weight_scale_inv tensors but quantization_config {config!r} is not "
                         "fine-grained fp8 (quant_method 'fp8', weight_block_size)")
    if channelwise and method not in ("compressed-tensors", "fbgemm_fp8", "fp8"):
        raise ValueError(f"checkpoint has *.weight_scale tensors but quantization_config {config!r} is not float8 "
                         "(compressed-tensors, fbgemm_fp8)")
    rows, columns = config.get("weight_block_size") or (128, 128)
    out = {}
    for name, tensor in state.items():
        if name.endswith(_FLOAT8_SCALES):
            continue
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if name + "_scale_inv" in state:
                out_features, in_features = tensor.shape
                scale = state[name + "_scale_inv"].float()
                scale = scale.repeat_interleave(rows, 0)[:out_features].repeat_interleave(columns, 1)[:, :in_features]
            elif name + "_scale" in state:
                scale = state[name + "_scale"].float()
                scale = scale.reshape(-1, *([1] * (tensor.dim() - 1))) if scale.numel() > 1 else scale.reshape(())
            else:
                raise ValueError(f"{name} is float8 with no scale ({name}_scale or {name}_scale_inv)")
            tensor = tensor.float() * scale
        out[name] = tensor
    logger.debug("dequantized float8 weights (%s) to float32", "blocks of %dx%d" % (rows, columns) if blockwise
                else "per-tensor or per-channel scales")
    return out


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The `bits`-wide unsigned integers packed in int32 along `dim` (lowest bits first, so the
    value at shift `bits * i` of element j is element `j * (32 // bits) + i` of that dim), as int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:
        values = (packed[:, None, :] >> shifts[None, :, None]) & mask
        return values.reshape(-1, packed.shape[1])
    values = (packed[:, :, None] >> shifts[None, None, :]) & mask
    return values.reshape(packed.shape[0], -1)


def grouped_dequantized(integers: torch.Tensor, zeros, scales: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """float32 weight [out, in] = scales[:, g] * (integers - zeros[:, g]) with g = groups[in]: the
    integers [out, in], zero points (None = 0) and scales [out, num_groups], each input channel's group."""
    groups = groups.long()
    if zeros is not None:
        integers = integers - zeros[:, groups]
    return (integers.float() * scales.float()[:, groups]).contiguous()


def _quantized_layers(state: dict[str, torch.Tensor], suffix: str = ".qweight") -> list[str]:
    return [name[: -len(suffix)] for name in state if name.endswith(suffix)]


def _without_int_parts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in state.items() if not name.endswith(_INT_PARTS)}


def _dequantized_gptq(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    bits = config.get("bits", 4)
    if bits not in (2, 4, 8):
        raise ValueError(f"GPTQ checkpoints of {bits} bits are not supported (2, 4 or 8)")
    checkpoint_format = config.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} is not supported ('gptq' or 'gptq_v2')")
    group_size = config.get("group_size", 128)
    out = _without_int_parts(state)
    for layer in _quantized_layers(state):
        weights = unpack_int32(state[layer + ".qweight"], bits, dim=0)  # [in, out]
        in_features, out_features = weights.shape
        zeros = unpack_int32(state[layer + ".qzeros"], bits, dim=1)[:, :out_features]
        if checkpoint_format == "gptq":
            zeros = zeros + 1  # AutoGPTQ's files store zero - 1 (what every GPTQ kernel adds back)
        groups = state.get(layer + ".g_idx")
        if groups is None:
            groups = torch.arange(in_features) // (group_size if group_size > 0 else in_features)
        out[layer + ".weight"] = grouped_dequantized(weights.t(), zeros.t(), state[layer + ".scales"].t(), groups)
    logger.debug("dequantized GPTQ weights (%d bits, groups of %s) to float32", bits, group_size)
    return out


def _dequantized_awq(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    bits = config.get("bits", config.get("w_bit", 4))
    version = str(config.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise ValueError(f"AWQ checkpoints of {bits} bits, version {version!r} are not supported (4 bits, 'gemm')")
    group_size = config.get("group_size", config.get("q_group_size", 128))
    out = _without_int_parts(state)
    for layer in _quantized_layers(state):
        if layer + ".qzeros" not in state:
            raise ValueError(f"AWQ layer {layer} has no qzeros (only zero_point=true checkpoints are supported)")
        weights = _awq_unpacked(state[layer + ".qweight"])  # [in, out]
        zeros = _awq_unpacked(state[layer + ".qzeros"])  # [groups, out]
        groups = torch.arange(weights.shape[0]) // (group_size if group_size > 0 else weights.shape[0])
        out[layer + ".weight"] = grouped_dequantized(weights.t(), zeros.t(), state[layer + ".scales"].t(), groups)
    logger.debug("dequantized AWQ weights (groups of %s) to float32", group_size)
    return out


def _awq_unpacked(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's 4-bit integers packed along the columns, [rows, columns / 8] int32, as [rows, columns]
    in column order."""
    values = unpack_int32(packed, 4, dim=1)
    packed_position = torch.tensor([AWQ_PACK_ORDER.index(column) for column in range(8)])
    columns = (torch.arange(0, values.shape[1], 8)[:, None] + packed_position).flatten()
    return values[:, columns]


def _dequantized_compressed_int(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    widths = {group["weights"]["num_bits"] for group in config.get("config_groups", {}).values()
              if (group.get("weights") or {}).get("type") == "int"}
    if len(widths) != 1:
        raise ValueError(f"compressed-tensors integer weights need one num_bits in config_groups, got {sorted(widths)}")
    bits = widths.pop()
    if bits not in (2, 4, 8):
        raise ValueError(f"compressed-tensors integer weights of {bits} bits are not supported (2, 4 or 8)")
    offset = 1 << (bits - 1)  # packed values are the signed integers + offset
    out = {name: tensor for name, tensor in state.items() if not name.endswith(_COMPRESSED_INT_PARTS)}
    packed_layers = _quantized_layers(state, ".weight_packed")
    int8_layers = [name[: -len(".weight")] for name, tensor in state.items()
                   if name.endswith(".weight") and tensor.dtype == torch.int8]
    for layer in packed_layers + int8_layers:
        if layer in packed_layers:
            out_features, in_features = state[layer + ".weight_shape"].tolist()
            integers = unpack_int32(state[layer + ".weight_packed"], bits, dim=1)[:, :in_features] - offset
        else:
            integers = state[layer + ".weight"].int()
            out_features, in_features = integers.shape
        scales = state[layer + ".weight_scale"]
        scales = scales.reshape(out_features if scales.numel() > 1 else 1, -1).expand(out_features, -1)
        zeros = state.get(layer + ".weight_zero_point")
        if zeros is not None:
            if layer in packed_layers and zeros.shape[0] != out_features:  # packed along the output dim
                zeros = unpack_int32(zeros, bits, dim=0)[:out_features] - offset
            zeros = zeros.int().reshape(out_features if zeros.numel() > 1 else 1, -1).expand(out_features, -1)
        groups = state.get(layer + ".weight_g_idx")
        if groups is None:
            groups = torch.arange(in_features) // -(-in_features // scales.shape[1])
        out[layer + ".weight"] = grouped_dequantized(integers, zeros, scales, groups)
    logger.debug("dequantized compressed-tensors %d-bit integer weights to float32", bits)
    return out
