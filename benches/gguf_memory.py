"""Resident memory and load time of a quantized GGUF bigger than the embedded model, in one run
(issue 42's "RSS of a Q4 model <= 1.2x the GGUF file + KV"): pagedkv's default load (the
linears, LM head and embedding table kept as the file's blocks, the other weights read straight
from the file: models/gguf_file_weights.py) against the route through transformers' GGUF reader
(its whole model dequantized to float32 first, each kept block then checked against it: what
every GGUF load did before; run where the machine's free memory holds it) and against llama.cpp
(`llama-batched-bench`, one sequence) on the same file.

The file: a Llama of random weights of the shape --shape names (1b: Llama 3.2 1B's layers, 7b:
Llama 2 7B's), quantized to --type with gguf-py, the embedded model's tokenizer (49,152 tokens),
written once into --cache-dir. Each load runs in a fresh process, with a KV cache for 512 tokens
(pagedkv's float32, llama.cpp's float16: each column says its own), and generates 16 tokens.
Columns: load seconds; RSS after `import torch` + `import pagedkv` ("imports"); after the load;
what the load added; the process's peak (VmHWM); RSS after the load, and what the load added, as
multiples of the file + the KV cache. Runs alternate; cells are min-max over --repeats.

    python benches/gguf_memory.py [--shape 1b|7b] [--type Q4_1] [--repeats 2] [--llama-cpp-dir DIR]
    python benches/gguf_memory.py --shape 7b --gguf FILE    # another file of that shape
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

from vs_llamacpp import DEFAULT_LLAMA_CPP_DIR, run_measured

# hidden, intermediate, layers, attention heads, KV heads
SHAPES = {"1b": (2048, 8192, 16, 32, 8), "7b": (4096, 11008, 32, 32, 32)}
CONTEXT, NEW_TOKENS = 512, 16

MEASURE = r"""
import json, os, sys, time
def status(key):
    return int(open("/proc/self/status").read().split(key)[1].split()[0]) * 1024
import torch
torch.set_num_threads(int(sys.argv[3]))
from pagedkv import LLM, SamplingParams
if sys.argv[2] == "transformers":
    from pagedkv.models import gguf_file_weights
    gguf_file_weights.readable = lambda tensors, architecture: False
imported = status("VmRSS:")
started = time.perf_counter()
llm = LLM(model=sys.argv[1], num_device_blocks=%d // 16 + 1, swap_space_bytes=0, max_num_seqs=1,
          max_model_len=%d, enable_prefix_caching=False)
load_s = time.perf_counter() - started
loaded = status("VmRSS:")
runner = llm.llm_engine.runner
tokens = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=%d, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
print(json.dumps({"load_s": load_s, "imported": imported, "loaded": loaded, "peak": status("VmHWM:"),
                  "kv": runner.num_device_blocks * runner.block_bytes, "tokens": list(tokens)}))
""" % (CONTEXT, CONTEXT, NEW_TOKENS)


def write_gguf(path: str, shape: str, kind: str) -> None:
    """A random-weight Llama of `shape`, its tensors quantized to `kind`, the embedded model's
    metadata (tokenizer included) with the shape's sizes."""
    import gguf
    import numpy as np
    from tqdm import tqdm

    from pagedkv.models.loader import default_model_path

    hidden, intermediate, layers, heads, kv_heads = SHAPES[shape]
    ggml_type = gguf.GGMLQuantizationType[kind]
    reader = gguf.GGUFReader(os.path.join(*default_model_path()))
    sizes = {"llama.embedding_length": hidden, "llama.feed_forward_length": intermediate, "llama.block_count": layers,
             "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv_heads,
             "llama.rope.dimension_count": hidden // heads}
    writer = gguf.GGUFWriter(path + ".part", "llama")
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        writer.add_key_value(field.name, sizes.get(field.name, field.contents()), value_type,
                             sub_type=field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None)
    rng = np.random.default_rng(0)
    vocab, kv_rows = len(reader.fields["tokenizer.ggml.tokens"].data), kv_heads * (hidden // heads)

    def add(name: str, rows: int, columns: int) -> None:
        values = rng.standard_normal((rows, columns), dtype=np.float32) * 0.02
        writer.add_tensor(name, gguf.quants.quantize(values, ggml_type), raw_dtype=ggml_type)

    add("token_embd.weight", vocab, hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in tqdm(range(layers), desc=f"writing {os.path.basename(path)}"):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for part, rows in (("attn_q", hidden), ("attn_k", kv_rows), ("attn_v", kv_rows), ("attn_output", hidden),
                           ("ffn_gate", intermediate), ("ffn_up", intermediate)):
            add(f"blk.{i}.{part}.weight", rows, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, intermediate)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(path + ".part", path)


def run_pagedkv(path: str, route: str, threads: int) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, path, route, str(threads)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"pagedkv ({route}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_llama_cpp(directory: str, path: str, threads: int, kv_bytes: int) -> dict:
    import time

    command = [os.path.join(directory, "llama-batched-bench"), "-m", path, "-c", str(CONTEXT), "-npp", "4",
               "-ntg", str(NEW_TOKENS), "-npl", "1", "-t", str(threads), "-tb", str(threads)]
    started = time.perf_counter()
    _, peak = run_measured(command)
    return {"peak": peak, "kv": kv_bytes, "wall_s": time.perf_counter() - started}


def span(values: list[float], digits: int = 0) -> str:
    low, high = min(values), max(values)
    return f"{low:.{digits}f}" if f"{low:.{digits}f}" == f"{high:.{digits}f}" else f"{low:.{digits}f}-{high:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--type", default="Q4_1", choices=["Q4_0", "Q4_1", "Q8_0"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/pagedkv/gguf_memory"))
    parser.add_argument("--llama-cpp-dir", default=os.environ.get("LLAMA_CPP_DIR", DEFAULT_LLAMA_CPP_DIR))
    parser.add_argument("--gguf", help="measure this GGUF file instead of writing one (e.g. one requantized "
                                       "from it by llama-quantize to Q4_K_M)")
    parser.add_argument("--no-transformers-route", action="store_true",
                        help="skip the route through transformers (run only where free memory holds ~10x the file)")
    args = parser.parse_args()
    import psutil

    os.makedirs(args.cache_dir, exist_ok=True)
    path = args.gguf or os.path.join(args.cache_dir, f"llama-{args.shape}-random.{args.type}.gguf")
    if not os.path.exists(path):
        write_gguf(path, args.shape, args.type)
    file_bytes = os.path.getsize(path)
    hidden, _, layers, heads, kv_heads = SHAPES[args.shape]  # (--gguf: say its --shape, for llama.cpp's KV size)
    llama_kv = 2 * layers * CONTEXT * kv_heads * (hidden // heads) * 2  # (float16 K and V)
    routes = ["default"]
    if not args.no_transformers_route and psutil.virtual_memory().available > 12 * file_bytes:
        routes.append("transformers")
    has_llama = os.access(os.path.join(args.llama_cpp_dir, "llama-batched-bench"), os.X_OK)
    results: dict[str, list[dict]] = {name: [] for name in [*routes, *(["llama.cpp"] if has_llama else [])]}
    for repeat in range(args.repeats):
        order = list(results) if repeat % 2 == 0 else list(reversed(results))
        for name in order:
            if name == "llama.cpp":
                results[name].append(run_llama_cpp(args.llama_cpp_dir, path, args.threads, llama_kv))
            else:
                results[name].append(run_pagedkv(path, name, args.threads))
            print(f"repeat {repeat + 1}: {name} done", file=sys.stderr)
    if "transformers" in results:
        assert results["transformers"][0]["tokens"] == results["default"][0]["tokens"], "the two routes' tokens differ"

    mb = 1e6
    print(f"\n{os.path.basename(path)}: {file_bytes / mb:.0f} MB; {platform.processor() or platform.machine()}, "
          f"{args.threads} threads, {datetime.date.today()}; {args.repeats} repeats, min-max\n")
    print("| load | load s | KV MB | RSS after imports MB | after load MB | load added MB | peak MB "
          "| after load / (file + KV) | added / (file + KV) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    labels = {"default": "pagedkv (kept, read from the file)", "transformers": "pagedkv through transformers' reader",
              "llama.cpp": "llama.cpp (peak of the whole run)"}
    for name, runs in results.items():
        kv = runs[0]["kv"]
        if name == "llama.cpp":
            print(f"| {labels[name]} | | {kv / mb:.0f} | | | | {span([r['peak'] / mb for r in runs])} "
                  f"| {span([r['peak'] / (file_bytes + kv) for r in runs], 2)}x (peak) | |")
            continue
        print(f"| {labels[name]} | {span([r['load_s'] for r in runs], 1)} | {kv / mb:.0f} "
              f"| {span([r['imported'] / mb for r in runs])} | {span([r['loaded'] / mb for r in runs])} "
              f"| {span([(r['loaded'] - r['imported']) / mb for r in runs])} | {span([r['peak'] / mb for r in runs])} "
              f"| {span([r['loaded'] / (file_bytes + kv) for r in runs], 2)}x "
              f"| {span([(r['loaded'] - r['imported']) / (file_bytes + kv) for r in runs], 2)}x |")


if __name__ == "__main__":
    main()
