"""The CPU's fused layers (rust/cpu_kernels/layer_ops.rs) against the layers' own torch code, which the
GPU runs: float32 to rounding error, bfloat16 to at most one bfloat16 step where the float32
math differs in its last bits (summation order, exp's polynomial)."""

import pytest
import torch

from pagedkv.layers import cpu_fused
from pagedkv.layers.activation import silu_and_mul
from pagedkv.layers.rms_norm import RMSNorm
from pagedkv.layers.rotary_embedding import RotaryEmbedding, split_and_rotate


@pytest.fixture
def unfused():
    """Runs the torch code of the layers inside a `with unfused():` block."""

    class Switch:
        def __enter__(self):
            cpu_fused.enabled = False

        def __exit__(self, *exc):
            cpu_fused.enabled = True

    return Switch


def assert_matches(fused: torch.Tensor, reference: torch.Tensor):
    assert fused.dtype == reference.dtype and fused.shape == reference.shape
    if fused.dtype == torch.float32:
        torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-6)
        return
    # bfloat16: the same rounding steps, so a differing element differs by one step, and rarely
    # (below 1e-30, where an underflowing exp leaves both ~0, steps mean nothing).
    steps = (fused.view(torch.int16).int() - reference.view(torch.int16).int()).abs()
    steps[(fused.float().abs() < 1e-30) & (reference.float().abs() < 1e-30)] = 0
    assert steps.max() <= 1, f"{steps.max()} bfloat16 steps apart"
    assert (steps > 0).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rms_norm_with_and_without_residual(dtype, num_tokens, unfused):
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    hidden, residual = torch.randn(num_tokens, 576, dtype=dtype) * 3, torch.randn(num_tokens, 576, dtype=dtype)
    with unfused():
        expected_alone = norm(hidden.clone())
        expected, expected_sum = norm(hidden.clone(), residual.clone())
    kept = hidden.clone()
    alone = norm(hidden)
    assert torch.equal(hidden, kept), "without a residual, the input is the residual stream: left as it was"
    fused, fused_sum = norm(hidden.clone(), residual.clone())
    assert torch.equal(fused_sum, expected_sum)
    assert_matches(alone, expected_alone)
    assert_matches(fused, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 64, 700])
def test_silu_and_mul(dtype, num_tokens, unfused):
    torch.manual_seed(1)
    gate_up = torch.randn(num_tokens, 2 * 1536, dtype=dtype) * 4
    gate_up[0, :4] = torch.tensor([100.0, -100.0, 0.0, -20.0])
    with unfused():
        expected = silu_and_mul(gate_up)
    assert_matches(silu_and_mul(gate_up), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rotates_query_and_key_in_place_and_leaves_value(dtype, unfused):
    from transformers import LlamaConfig

    torch.manual_seed(2)
    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0)
    rotary = RotaryEmbedding(config, 4096, dtype)
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    positions = torch.tensor([0, 1, 5, 4095, 17, 300])
    cos_sin = rotary(positions)
    qkv = torch.randn(len(positions), (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    with unfused():
        expected = split_and_rotate(qkv.clone(), cos_sin, num_heads, num_kv_heads, head_dim)
    fused = split_and_rotate(qkv, cos_sin, num_heads, num_kv_heads, head_dim)
    for got, want in zip(fused, expected):
        assert_matches(got, want)
    assert torch.equal(fused[2], expected[2])
    assert fused[0].data_ptr() == qkv.data_ptr(), "rotated in place: query is a view of qkv"


def test_other_tensors_take_the_torch_path(unfused):
    norm = RMSNorm(64, 1e-6)
    wide = torch.randn(8, 128)
    strided = wide[:, ::2]  # not contiguous
    assert not cpu_fused.supports(strided, norm.weight)
    assert not cpu_fused.supports(torch.randn(4, 8, dtype=torch.float16))
    with unfused():
        expected = norm(strided.contiguous())
    torch.testing.assert_close(norm(strided), expected)
    with pytest.raises(ValueError, match="weight"):
        cpu_fused.rms_norm_(torch.randn(4, 32), None, norm.weight, 1e-6)
