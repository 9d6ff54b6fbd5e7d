"""The two-matrix MLP of GPT-style blocks: c_proj(act(c_fc(x))), no gate (StarCoder2, Phi-2,
GPT-NeoX, GPT-J, GPT-2, OPT; Arcee's and Nemotron's squared-ReLU one, whose checkpoints name the
matrices up_proj and down_proj)."""

from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import nn

# hidden_act / activation_function -> the function (gelu_new and gelu_pytorch_tanh are GELU's tanh
# approximation, as transformers computes them)
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
}


class UngatedMLP(nn.Module):
    """c_proj(act(c_fc(x))); LoRA adapters may target c_fc and c_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, layer_index: int, bias: bool = True):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"MLP activation {activation!r} is not supported ({sorted(ACTIVATIONS)})")
        self.layer_index = layer_index
        self.activation = ACTIVATIONS[activation]
        self.c_fc = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.c_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, hidden, lora=None):
        up = self.c_fc(hidden)
        if lora is not None:
            lora.add(self.layer_index, "c_fc", hidden, up)
        activated = self.activation(up)
        out = self.c_proj(activated)
        if lora is not None:
            lora.add(self.layer_index, "c_proj", activated, out)
        return out
