"""Building a model draws no random weights, and a CPU load does not import torch._dynamo
(with Triton: ~80 MB of resident memory a CPU engine never uses)."""

import subprocess
import sys
import textwrap

import torch
from torch import nn

from pagedkv.models.skipped_init import initialisation_skipped


def test_initialisers_do_nothing_inside_and_are_restored_after():
    weight = torch.zeros(4, 4)
    with initialisation_skipped():
        assert nn.init.normal_(weight) is weight
        nn.init.kaiming_uniform_(weight)
        table = nn.Embedding(8, 4)
    assert torch.count_nonzero(weight) == 0
    assert table.weight.shape == (8, 4)
    nn.init.normal_(weight)
    assert torch.count_nonzero(weight) > 0


def test_loading_a_model_on_the_cpu_leaves_torch_dynamo_unimported(tiny_qwen2_dir):
    script = textwrap.dedent(f"""
        import sys
        from pagedkv import LLM
        llm = LLM(model={tiny_qwen2_dir!r}, num_device_blocks=8, swap_space_bytes=0, max_model_len=64)
        print(sorted(name for name in ("torch._dynamo", "triton") if name in sys.modules))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
