"""Host memory of loading a checkpoint, in one run: the loader (parameters allocated once, in the
engine's dtype, the safetensors files streamed into them a decoder layer at a time) against the
whole checkpoint read into a dict first (what the loader did before, and still does for a GGUF
file), and, given --baseline-python, the previous build's loader. Each load runs in a fresh
process; the table shows its peak resident memory above what the process held before loading
(with what loading imports already imported: ~200 MiB of code, whatever the checkpoint), as a multiple of the checkpoint's bytes (1.0x = the weights once; the goal is 1.3x or less).

    python benches/load_memory.py                  # a random 0.3B Llama saved in bfloat16
    python benches/load_memory.py --layers 32      # a bigger one
    python benches/load_memory.py --baseline-python /path/to/venv-of-previous-build/bin/python

(The measuring script builds the model class with its Traits: a baseline build must have
models/registry.py, 6e7ae8f or later.)
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
import glob, json, sys, time, torch
from pagedkv.models.loader import load, model_spec

def rss_kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))

directory, recipe = sys.argv[1], sys.argv[2]
started = rss_kib("VmRSS:")
from safetensors import safe_open
from transformers import AutoTokenizer
# What loading imports (transformers, the model's modules and what building one pulls in) is code, the
# same for any checkpoint size: imported before the measurement, by building the model once on meta
hf_config, model_class, traits, _ = model_spec(directory, None)
with torch.device("meta"):
    model_class(hf_config, traits, hf_config.max_position_embeddings, torch.bfloat16)
before, start = rss_kib("VmRSS:"), time.perf_counter()
if recipe == "loader":
    net = load(directory, None, None, torch.bfloat16, torch.device("cpu"), None).model
else:  # every tensor of the checkpoint in one dict, then loaded
    state = {}
    for path in sorted(glob.glob(directory + "/*.safetensors")):
        with safe_open(path, framework="pt") as checkpoint:
            state.update({name: checkpoint.get_tensor(name) for name in checkpoint.keys()})
    with torch.device("meta"):
        net = model_class(hf_config, traits, hf_config.max_position_embeddings, torch.bfloat16)
    net = net.to(dtype=torch.bfloat16).to_empty(device="cpu")
    net.compute_buffers(hf_config.max_position_embeddings, torch.bfloat16)
    net.load_hf_state_dict(state)
    del state
seconds = time.perf_counter() - start
print(json.dumps({"peak_kib": rss_kib("VmHWM:") - before, "with_imports_kib": rss_kib("VmHWM:") - started,
                  "seconds": seconds,
                  "dtype": str(next(net.parameters()).dtype)}))
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


def measure(python: str, directory: str, recipe: str) -> dict:
    run = subprocess.run([python, "-c", MEASURE, directory, recipe], check=True, capture_output=True, text=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--baseline-python", help="a Python whose pagedkv is the previous build")
    args = parser.parse_args()
    runs = ([(args.baseline_python, "loader", "previous build's loader")] if args.baseline_python else []) + [
        (sys.executable, "whole-dict", "whole checkpoint in a dict, then loaded"),
        (sys.executable, "loader", "pagedkv loader: streamed a layer at a time")]
    with tempfile.TemporaryDirectory() as directory:
        checkpoint_bytes = save_random_llama(directory, args)
        rows = [(label, measure(python, directory, recipe)) for python, recipe, label in runs]
    print(f"checkpoint: {checkpoint_bytes / 2**20:.0f} MiB of bfloat16 weights "
          f"({args.layers} layers, hidden {args.hidden})\n")
    streamed = rows[-1][1]["peak_kib"]
    print("| recipe | parameters | load s | peak RSS above start MiB | x checkpoint | vs streamed "
          "| x checkpoint, imports counted |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for label, result in rows:
        peak = result["peak_kib"] * 1024
        print(f"| {label} | {result['dtype']} | {result['seconds']:.1f} | {peak / 2**20:.0f} | "
              f"{peak / checkpoint_bytes:.2f} | {result['peak_kib'] / streamed:.2f}x | "
              f"{result['with_imports_kib'] * 1024 / checkpoint_bytes:.2f} |")


if __name__ == "__main__":
    main()
