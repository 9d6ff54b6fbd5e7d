"""The CPU small-M linear kernel (rust/cpu_kernels/small_m_linear.rs, through
pagedkv.layers.cpu_linear) against torch in float64: odd shapes, 1 to 17 rows, float32 and
bfloat16, with and without bias, on the SIMD path this CPU picks and on the portable one."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.layers import cpu_linear
from pagedkv.layers.cpu_linear import CpuLinear, small_m_linear, use_cpu_linear
from pagedkv_core import _core
from pagedkv_core.errors import InvalidConfigError

SHAPES = [(64, 8), (577, 131), (33, 5), (1, 3), (576, 960)]  # (in_features K, out_features N)
ROWS = [1, 2, 3, 5, 8, 16, 17]


def reference(x, weight, bias):
    """The float64 product of the values the kernel reads, and the float64 sum of |terms| (the scale
    of a float32 sum's rounding error)."""
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    magnitude = F.linear(x.double().abs(), weight.double().abs(), None if bias is None else bias.double().abs())
    return exact, magnitude


def tolerance(dtype, exact, magnitude):
    # float32 math: the sum's rounding, well under 1e-5 of the sum of |terms| for K up to ~600
    # (2^-24 per add, errors of random sign). bfloat16 output: one more rounding to 8 bits of
    # mantissa, up to half a step (2^-9 of the value; 2^-8 leaves room for the float32 sum's error
    # to tip a tie).
    allowed = 1e-5 * magnitude
    if dtype == torch.bfloat16:
        allowed = allowed + 2.0**-8 * exact.abs()
    return allowed


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_float64(shape, dtype, portable):
    in_features, out_features = shape
    generator = torch.Generator().manual_seed(in_features * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        for b in (None, bias):
            out = small_m_linear(x, weight, b, portable=portable)
            assert out.dtype == dtype and out.shape == (rows, out_features)
            exact, magnitude = reference(x, weight, b)
            error = (out.double() - exact).abs()
            assert (error <= tolerance(dtype, exact, magnitude)).all(), f"rows {rows}, bias {b is not None}"


def test_both_paths_run_here():
    isa, _ = _core.cpu_attention_build()
    assert isa in ("Avx512", "Avx2Fma", "Portable")
    # (the SIMD path is the one `portable=False` reaches on an AVX2 or AVX-512 machine such as CI's)
    x, weight = torch.randn(3, 40), torch.randn(12, 40)
    assert torch.allclose(small_m_linear(x, weight), small_m_linear(x, weight, portable=True), atol=1e-5)


def test_float32_activations_with_bfloat16_weights_and_extra_leading_dims():
    weight = torch.randn(21, 75).to(torch.bfloat16)
    x = torch.randn(2, 3, 75)
    out = small_m_linear(x, weight)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 21)
    exact, magnitude = reference(x.reshape(6, 75), weight, None)
    assert ((out.reshape(6, 21).double() - exact).abs() <= 1e-5 * magnitude).all()
    # a non-contiguous x is read through a contiguous copy
    wide = torch.randn(4, 150)
    assert torch.allclose(small_m_linear(wide[:, ::2], weight.float()), F.linear(wide[:, ::2], weight.float()),
                          atol=1e-5)


def test_bad_shapes_and_dtypes_raise_clear_errors():
    weight = torch.randn(3, 4)
    with pytest.raises(ValueError, match="does not fit weight"):
        small_m_linear(torch.randn(2, 5), weight)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        small_m_linear(torch.randn(2, 4, dtype=torch.float16), weight)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        small_m_linear(torch.randn(2, 4), weight.double())
    with pytest.raises(ValueError, match="bias"):
        small_m_linear(torch.randn(2, 4), weight, torch.randn(4))
    with pytest.raises(ValueError, match="bias"):
        small_m_linear(torch.randn(2, 4), weight, torch.randn(3, dtype=torch.bfloat16))
    out, x = torch.empty(2, 3), torch.randn(2, 4)
    with pytest.raises(InvalidConfigError, match="dtype must be"):
        _core.small_m_linear_cpu(out.data_ptr(), x.data_ptr(), weight.data_ptr(), None, (2, 4, 3), 1, "float16",
                                 "float32")


def test_linear_takes_the_kernel_up_to_the_crossover_and_torch_beyond(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_linear, "small_m_linear", lambda *args: calls.append(args) or F.linear(*args))
    weight = torch.randn(8, 16)
    limit = cpu_linear.MAX_KERNEL_ROWS[torch.float32]
    cpu_linear.linear(torch.randn(limit, 16), weight)
    assert len(calls) == 1
    cpu_linear.linear(torch.randn(limit + 1, 16), weight)
    cpu_linear.linear(torch.randn(2, 16, dtype=torch.float16), weight.half())  # (torch's dtype)
    assert len(calls) == 1


def test_use_cpu_linear_swaps_plain_linear_layers_and_keeps_their_weights():
    class Custom(nn.Linear):
        pass

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), Custom(8, 8), nn.Linear(8, 4, bias=False))
    keys = list(model.state_dict())
    x = torch.randn(3, 16)
    before = model(x)
    use_cpu_linear(model)
    assert [type(m) for m in model] == [CpuLinear, Custom, CpuLinear]
    assert list(model.state_dict()) == keys
    assert torch.allclose(model(x), before, atol=1e-5)
