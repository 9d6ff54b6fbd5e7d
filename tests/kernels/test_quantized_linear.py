"""GGUF weights kept quantized (rust/cpu_kernels/quantized/, pagedkv.layers.quantized_linear).

Three oracles:
- decoding: blocks dequantize to exactly gguf-py's `gguf.quants.dequantize` (same float32 ops).
- the kernel: equal, bit for bit, to `reference_linear` below, a numpy copy of the scheme
  (llama.cpp's reference activation quantizers; blocks of 32: an integer total per block, combined
  by fused multiply-add, the K-quants' totals over their scaled sub-blocks the same way; the same
  float32 combination in the same order; numpy's float32 ops are IEEE, as Rust's, so equality is exact).
- the math: within `error_bound` of float64 F.linear on the dequantized weight; the bound is the
  activation quantization's (half a step per element plus the scales' f16 rounding) and a
  float32 summation term.
"""

import os

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedkv.layers.quantized_linear import GGML_TYPES, QuantizedLinear, dequantize, quantized_linear, row_bytes
from pagedkv_core import _core
from pagedkv_core.errors import InvalidConfigError

QTYPE = {name: gguf.GGMLQuantizationType[name] for name in GGML_TYPES}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
F32 = np.float32


@pytest.fixture(scope="module")
def smollm2_tensors(smollm2):
    """{name: (ggml type name, uint8 blocks [rows, row_bytes])} of the embedded GGUF's quantized tensors."""
    reader = gguf.GGUFReader(os.path.join(*smollm2))
    return {t.name: (t.tensor_type.name, np.array(t.data)) for t in reader.tensors if t.tensor_type.name in GGML_TYPES}


def weight_blocks(ggml_type: str, rows: int, in_features: int, smollm2_tensors, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes]: real rows from the GGUF where it has the type and width, else blocks
    from gguf-py's quantizer, else random bytes with sane f16 scales."""
    for _, (tensor_type, data) in sorted(smollm2_tensors.items()):
        if tensor_type == ggml_type and data.shape[1] == row_bytes(ggml_type, in_features) and data.shape[0] >= rows:
            return np.ascontiguousarray(data[:rows])
    rng = np.random.default_rng(seed)
    if ggml_type in ("Q4_0", "Q4_1", "Q8_0"):
        weights = rng.standard_normal((rows, in_features), dtype=F32) * F32(0.05)
        return gguf.quants.quantize(weights, QTYPE[ggml_type])
    block_len, block_bytes = gguf.GGML_QUANT_SIZES[QTYPE[ggml_type]]
    blocks = rng.integers(0, 256, (rows * in_features // block_len, block_bytes), dtype=np.uint8)
    halves = lambda scale, size: (rng.random(size, dtype=F32) * scale).astype(np.float16).view(np.uint8).reshape(-1, 2)  # noqa: E731
    if ggml_type in ("Q4_K", "Q5_K"):
        blocks[:, 0:2], blocks[:, 2:4] = halves(0.01, len(blocks)), halves(0.005, len(blocks))
    else:
        blocks[:, 208:210] = halves(0.002, len(blocks))
    return blocks.reshape(rows, -1)


# --- the numpy reference of the scheme ------------------------------------------------------


def quantize_activations(x: np.ndarray, ggml_type: str):
    """llama.cpp's reference quantizer for the type's partner: (scales [B], quants int64 [B, L],
    Q8_1's s [B] or Q8_K's 16-sums [B, L/16])."""
    if ggml_type in K_QUANTS:  # Q8_K: d = max / -127 (f32), ties to even, capped at 127
        blocks = x.reshape(-1, 256)
        max_value = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(axis=1)]
        with np.errstate(divide="ignore"):
            inverse = np.where(max_value != 0, F32(-127) / max_value, F32(0)).astype(F32)
        quants = np.minimum(127, np.rint(inverse[:, None] * blocks)).astype(np.int64)
        with np.errstate(divide="ignore"):
            scales = np.where(max_value != 0, F32(1) / inverse, F32(0)).astype(F32)
        return scales, quants, quants.reshape(len(blocks), 16, 16).sum(axis=2)
    blocks = x.reshape(-1, 32)  # Q8_0 / Q8_1: d = amax / 127, roundf (ties away from zero)
    scale = (np.abs(blocks).max(axis=1) / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        inverse = np.where(scale != 0, F32(1) / scale, F32(0)).astype(F32)
    scaled = (blocks * inverse[:, None]).astype(np.float64)
    quants = np.trunc(scaled + np.copysign(0.5, scaled)).astype(np.int64)
    sums = (quants.sum(axis=1).astype(F32) * scale).astype(np.float16).astype(F32)
    return scale.astype(np.float16).astype(F32), quants, sums


def f16(column: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(column).view(np.float16).astype(F32).reshape(-1)


def decode_integers(blocks: np.ndarray, ggml_type: str):
    """(d [B], per-element integer multiplier [B, L] (scale * q), min part) of weight blocks [B, bytes]."""
    if ggml_type in ("Q4_0", "Q4_1"):
        nibbles = blocks[:, 4:20] if ggml_type == "Q4_1" else blocks[:, 2:18]
        q = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=1).astype(np.int64)
        return f16(blocks[:, 0:2]), q - (8 if ggml_type == "Q4_0" else 0), f16(blocks[:, 2:4])
    if ggml_type == "Q8_0":
        return f16(blocks[:, 0:2]), blocks[:, 2:34].view(np.int8).astype(np.int64), None
    if ggml_type in ("Q4_K", "Q5_K"):
        scales, mins = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        nibbles = blocks[:, 16:144] if ggml_type == "Q4_K" else blocks[:, 48:176]
        packed = nibbles.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (packed & 0xF).reshape(-1, 8, 32).astype(np.int64)
        if ggml_type == "Q5_K":  # bit j of byte l of the 32 at 16: element 32j + l's fifth bit
            q |= ((blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).astype(np.int64) << 4
        q = q * scales.astype(np.int64)[:, :, None]
        return f16(blocks[:, 0:2]), q.reshape(-1, 256), (f16(blocks[:, 2:4]), mins.astype(np.int64))
    low = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (low & 0xF).reshape(-1, 2, 4, 32)
    high = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (low | ((high & 3) << 4)).reshape(-1, 16, 16).astype(np.int64) - 32
    q = q * blocks[:, 192:208].view(np.int8).astype(np.int64)[:, :, None]
    return f16(blocks[:, 208:210]), q.reshape(-1, 256), None


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once. a * b of two float32 is exact in float64; the float64 sum
    then rounds twice (to float64, to float32), which differs from one rounding only where the
    float64 sum lands exactly on a float32 midpoint: none in these tests' fixed inputs."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(F32)


def reference_linear(x: np.ndarray, blocks: np.ndarray, ggml_type: str, bias=None) -> np.ndarray:
    """out [M, N] by the kernel's scheme: see rust/cpu_kernels/quantized/dot.rs."""
    (m, k), n = x.shape, blocks.shape[0]
    block_len, block_bytes = gguf.GGML_QUANT_SIZES[QTYPE[ggml_type]]
    per_row = k // block_len
    act_scale, act_q, act_extra = quantize_activations(x, ggml_type)
    w_d, w_q, w_min = decode_integers(blocks.reshape(-1, block_bytes), ggml_type)
    if block_len == 32:
        totals = np.einsum("mbe,nbe->mnb", act_q.reshape(m, per_row, 32), w_q.reshape(n, per_row, 32)).astype(F32)
        block_scale = w_d.reshape(1, n, per_row) * act_scale.reshape(m, 1, per_row)  # float32 products
        acc, mins = np.zeros((m, n), F32), np.zeros((m, n), F32)
        for b in range(per_row):
            acc = fma32(block_scale[:, :, b], totals[:, :, b], acc)
            if ggml_type == "Q4_1":
                mins = fma32(w_min.reshape(1, n, per_row)[:, :, b], act_extra.reshape(m, 1, per_row)[:, :, b], mins)
        total = acc + mins
        return total if bias is None else total + bias
    totals = np.einsum("mbe,nbe->mnb", act_q.reshape(m, per_row, 256), w_q.reshape(n, per_row, 256)).astype(F32)
    block_scale = w_d.reshape(1, n, per_row) * act_scale.reshape(m, 1, per_row)
    acc, mins = np.zeros((m, n), F32), np.zeros((m, n), F32)
    for b in range(per_row):
        acc = fma32(block_scale[:, :, b], totals[:, :, b], acc)
        if ggml_type in ("Q4_K", "Q5_K"):
            dmin, min_values = w_min
            integer = (act_extra.reshape(m, 1, per_row, 8, 2) * min_values.reshape(1, n, per_row, 8, 1)).sum(axis=(3, 4))
            term = dmin.reshape(1, n, per_row)[:, :, b] * act_scale.reshape(m, 1, per_row)[:, :, b]
            mins = fma32(term, integer[:, :, b].astype(F32), mins)
    total = acc - mins if ggml_type in ("Q4_K", "Q5_K") else acc
    return total if bias is None else total + bias


def error_bound(x: np.ndarray, blocks: np.ndarray, ggml_type: str) -> np.ndarray:
    """[M, N]: |quantized - float64| allowed. Per activation element, |d_a * q - x| <= d_a / 2 plus
    d_a's f16 rounding (2^-11 relative, times |q| <= 127) for Q8_0/Q8_1; Q4_1's min meets Q8_1's
    s (f16: 2^-11 relative, plus the 32 elements' rounding); plus float32 summation."""
    (m, k), n = x.shape, blocks.shape[0]
    block_len, block_bytes = gguf.GGML_QUANT_SIZES[QTYPE[ggml_type]]
    act_scale, _, act_extra = quantize_activations(x, ggml_type)
    step = np.abs(act_scale).astype(np.float64) * (0.5 + (127 * 2.0**-11 if block_len == 32 else 1e-6))
    w = gguf.quants.dequantize(blocks, QTYPE[ggml_type]).astype(np.float64).reshape(n, k)
    scaled = w
    extra = np.zeros((m, n))
    if ggml_type == "Q4_1":
        w_min = np.repeat(f16(blocks.reshape(-1, block_bytes)[:, 2:4]).reshape(n, -1), 32, axis=1)
        scaled = w - w_min
        s = np.abs(act_extra.reshape(m, -1)).astype(np.float64)
        extra = np.abs(w_min[:, ::32]) @ (16 * np.abs(act_scale.reshape(m, -1)) + 2.0**-11 * s).T
        extra = extra.T
    per_element = np.repeat(step.reshape(m, -1), block_len, axis=1)
    summation = 1e-5 * np.abs(x.astype(np.float64)) @ np.abs(w).T
    return per_element @ np.abs(scaled).T + extra + summation + 1e-6


# --- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", GGML_TYPES)
def test_blocks_decode_exactly_as_gguf_py(ggml_type, smollm2_tensors):
    blocks = weight_blocks(ggml_type, 64, 512 if ggml_type in K_QUANTS else 576, smollm2_tensors)
    want = gguf.quants.dequantize(blocks, QTYPE[ggml_type])
    got = dequantize(torch.from_numpy(blocks), ggml_type, want.shape)
    assert np.array_equal(got.numpy(), want)


def test_real_smollm2_tensors_decode_exactly(smollm2_tensors):
    types = {tensor_type for tensor_type, _ in smollm2_tensors.values()}
    assert {"Q4_1", "Q8_0"} <= types
    for name in ("blk.0.ffn_down.weight", "blk.0.attn_q.weight", "token_embd.weight"):
        tensor_type, data = smollm2_tensors[name]
        rows = np.ascontiguousarray(data[:300])
        want = gguf.quants.dequantize(rows, QTYPE[tensor_type])
        assert np.array_equal(dequantize(torch.from_numpy(rows), tensor_type, want.shape).numpy(), want), name


@pytest.mark.parametrize("ggml_type", GGML_TYPES)
@pytest.mark.parametrize("num_tokens", [1, 2, 5, 16, 17, 70])
def test_kernel_equals_the_reference_scheme_and_float64_within_the_bound(ggml_type, num_tokens, smollm2_tensors):
    in_features = 512 if ggml_type in K_QUANTS else 576
    out_features = 37  # odd: not whole groups of 8 rows, nor of the 16-row chunks
    blocks = weight_blocks(ggml_type, out_features, in_features, smollm2_tensors, seed=num_tokens)
    rng = np.random.default_rng(num_tokens)
    x = rng.standard_normal((num_tokens, in_features), dtype=F32)
    x[0, :40] = 0  # a zero block (scale 0) and a partly zero one
    bias = rng.standard_normal(out_features, dtype=F32)
    got = quantized_linear(torch.from_numpy(x), torch.from_numpy(blocks), ggml_type, out_features, torch.from_numpy(bias))
    assert np.array_equal(got.numpy(), reference_linear(x, blocks, ggml_type, bias))

    weight = torch.from_numpy(gguf.quants.dequantize(blocks, QTYPE[ggml_type])).double()
    exact = F.linear(torch.from_numpy(x).double(), weight, torch.from_numpy(bias).double()).numpy()
    error = np.abs(got.numpy().astype(np.float64) - exact)
    assert (error <= error_bound(x, blocks, ggml_type)).all(), float(error.max())


@pytest.mark.parametrize("ggml_type", ["Q4_1", "Q8_0", "Q4_K"])
def test_module_takes_kernel_and_dequantized_paths_alike(ggml_type, smollm2_tensors):
    in_features = 512 if ggml_type == "Q4_K" else 576
    blocks = weight_blocks(ggml_type, 48, in_features, smollm2_tensors)
    layer = QuantizedLinear(in_features, 48, ggml_type, bias=True)
    layer.blocks.copy_(torch.from_numpy(blocks))
    layer.bias.data.normal_()
    weight = torch.from_numpy(gguf.quants.dequantize(blocks, QTYPE[ggml_type]))
    assert torch.equal(layer.weight, weight)
    for num_tokens in (1, 3, 40):
        x = torch.randn(num_tokens, in_features)
        want = F.linear(x.double(), weight.double(), layer.bias.double())
        bound = torch.from_numpy(error_bound(x.numpy(), blocks, ggml_type))
        assert ((layer(x).double() - want).abs() <= bound).all()
    assert layer(torch.randn(2, 3, in_features)).shape == (2, 3, 48)



@pytest.mark.parametrize("ggml_type", GGML_TYPES)
def test_a_prefill_runs_the_kernel_where_it_wins_at_every_token_count(ggml_type, smollm2_tensors):
    """The blocks of 32 (and the K-quants on AVX-512 VNNI) take a prefill's rows on the kernel, so a
    token gets the same bits in any batch; the K-quants elsewhere dequantize and call F.linear."""
    in_features = 512 if ggml_type in K_QUANTS else 576
    layer = QuantizedLinear(in_features, 45, ggml_type, bias=True)
    layer.blocks.copy_(torch.from_numpy(weight_blocks(ggml_type, 45, in_features, smollm2_tensors)))
    layer.bias.data.normal_()
    x = torch.randn(130, in_features)
    batch = layer(x)
    if not _core.quantized_kernel_at_every_token_count(ggml_type):
        assert ggml_type in K_QUANTS
        assert torch.equal(batch, F.linear(x, layer.weight, layer.bias))
        return
    assert not torch.equal(batch, F.linear(x, layer.weight, layer.bias))
    for token in (0, 63, 129):
        assert torch.equal(layer(x[token : token + 1]), batch[token : token + 1])


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="multiple of Q4_K's block of 256"):
        QuantizedLinear(576, 8, "Q4_K")
    with pytest.raises(ValueError, match="ggml_type must be one of"):
        QuantizedLinear(576, 8, "Q3_K")
    blocks = torch.zeros(4, row_bytes("Q4_1", 64), dtype=torch.uint8)
    with pytest.raises(InvalidConfigError, match="weight"):
        quantized_linear(torch.zeros(1, 64), blocks[:, 1:].contiguous(), "Q4_1", 4)
    with pytest.raises(InvalidConfigError, match="in_features"):
        quantized_linear(torch.zeros(1, 60), blocks, "Q4_1", 4)
    with pytest.raises(InvalidConfigError, match="ggml_type"):
        quantized_linear(torch.zeros(1, 64), blocks, "Q3_K", 4)
    with pytest.raises(ValueError, match="float32"):
        quantized_linear(torch.zeros(1, 64, dtype=torch.float64), blocks, "Q4_1", 4)
    with pytest.raises(InvalidConfigError, match="blocks"):
        dequantize(blocks.reshape(-1)[:-1], "Q4_1", (4, 63))
