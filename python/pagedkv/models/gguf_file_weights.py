"""A dense Llama-family GGUF's weights read straight from the file, under HF names, a decoder
layer at a time: what a load that keeps the file's blocks (models/gguf_quantized.py) needs beside
them. transformers' GGUF reader builds its whole model in float32 first (a 673 MB Q4_1 file of a
1B model peaked at 6.9 GB resident and took 31 s to load); here the tensors the kept modules
stand for are never dequantized, and every other one is dequantized by itself, as transformers
does it (gguf-py's `dequantize`, the same float32 operations), with q and k rows put back in HF's
order where transformers puts them back (a "llama" file: llama.cpp's converter permutes them for
its rotary layout).

Only the architectures transformers reads as our Llama class, and only a file whose every tensor
has a name here: anything else (a MoE's expert tensors, another architecture) is read by
transformers as before.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

# GGUF architectures (general.architecture) read here; q/k rows permuted in "llama" files only
ARCHITECTURES = ("llama", "qwen2", "qwen3")
OUTSIDE_LAYERS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
IN_LAYERS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
NOT_READ = ("rope_freqs.weight",)  # (transformers leaves it: the config's rope scaling says the same)


def hf_name(gguf_name: str) -> str | None:
    """"blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight"; None for a name not
    mapped here."""
    stem, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if stem in OUTSIDE_LAYERS:
        return f"{OUTSIDE_LAYERS[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in IN_LAYERS:
        return f"model.layers.{parts[1]}.{IN_LAYERS[parts[2]]}.{kind}"
    return None


def readable(tensors: dict, architecture: str | None) -> bool:
    """Whether every tensor of the file has an HF name here (else transformers reads it)."""
    return architecture in ARCHITECTURES and all(
        hf_name(name) is not None or name in NOT_READ for name in tensors)


def unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order back to HF's (transformers' reverse_permute_weights); rows of
    floats or of blocks alike."""
    return rows.reshape(num_heads, rows.shape[0] // num_heads // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape)


def permuted_heads(gguf_name: str, architecture: str | None, heads: tuple[int, int]) -> int | None:
    """The head count to undo llama.cpp's q/k permutation of this tensor with, or None where the
    file keeps HF's order."""
    if architecture != "llama":
        return None
    part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    return {"attn_q": heads[0], "attn_k": heads[1]}.get(part)


def weight_groups(tensors: dict, architecture: str, heads: tuple[int, int],
                  skip: set[str]) -> Iterator[dict[str, torch.Tensor]]:
    """The file's tensors but `skip`'s (GGUF names) as float32 HF-named weights: first those
    outside the decoder layers, then a group per layer, each dequantized as its group is read."""
    import gguf

    layers: dict[int, list[str]] = {}
    for name in tensors:
        if name in skip or name in NOT_READ:
            continue
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        layers.setdefault(layer, []).append(name)
    for layer in sorted(layers):
        group = {}
        for name in layers.pop(layer):
            tensor = tensors[name]
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            num_heads = permuted_heads(name, architecture, heads)
            if num_heads is not None:
                values = unpermute_rows(values, num_heads)
            group[hf_name(name)] = torch.from_numpy(np.array(values, dtype=np.float32, order="C"))
        yield group
