"""Host memory of loading a checkpoint: the loader (parameters allocated once, in the engine's
dtype, each checkpoint tensor copied into place) against the recipe it replaced (a float32 model
filled from the checkpoint, then cast), in one run. Each load runs in a fresh process; the table
shows its peak resident memory above what the process held before loading, as a multiple of the
checkpoint's bytes (1.0x = the weights once).

    python benches/load_memory.py                  # a random 0.3B Llama saved in bfloat16
    python benches/load_memory.py --layers 32      # a bigger one
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

MEASURE = r"""
import json, sys, torch
from pagedkv.loader import load, model_spec

def rss_kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))

directory, recipe = sys.argv[1], sys.argv[2]
from safetensors.torch import load_file
before = rss_kib("VmRSS:")
if recipe == "loader":
    net = load(directory, None, None, torch.bfloat16, torch.device("cpu"), None).model
else:  # the float32 model, filled, then cast
    hf_config, model_class, traits, _ = model_spec(directory, None)
    state = load_file(directory + "/model.safetensors")
    with torch.device("meta"):
        net = model_class(hf_config, traits, hf_config.max_position_embeddings, torch.bfloat16)
    net = net.to_empty(device="cpu")
    net.compute_buffers(hf_config.max_position_embeddings, torch.bfloat16)
    net.load_hf_state_dict(state)
    del state
    net = net.to(dtype=torch.bfloat16)
print(json.dumps({"peak_kib": rss_kib("VmHWM:") - before, "dtype": str(next(net.parameters()).dtype)}))
"""


def save_random_llama(directory: str, args) -> int:
    """A random Llama in bfloat16 safetensors beside a word-level tokenizer; returns its bytes."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from support.checkpoints import save_tiny_checkpoint
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
                         num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    save_tiny_checkpoint(directory, model)
    return os.path.getsize(os.path.join(directory, "model.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        checkpoint_bytes = save_random_llama(directory, args)
        rows = []
        for recipe, label in (("float32-then-cast", "float32 model, filled, then cast (before)"),
                              ("loader", "pagedkv loader: bfloat16 parameters filled in place")):
            result = json.loads(subprocess.run([sys.executable, "-c", MEASURE, directory, recipe], check=True,
                                               capture_output=True, text=True).stdout.strip().splitlines()[-1])
            rows.append((label, result["dtype"], result["peak_kib"] * 1024))
    print(f"checkpoint: {checkpoint_bytes / 2**20:.0f} MiB of bfloat16 weights "
          f"({args.layers} layers, hidden {args.hidden})\n")
    print("| recipe | parameters | peak RSS above start MiB | x checkpoint |")
    print("| --- | --- | ---: | ---: |")
    for label, dtype, peak in rows:
        print(f"| {label} | {dtype} | {peak / 2**20:.0f} | {peak / checkpoint_bytes:.2f} |")


if __name__ == "__main__":
    main()
