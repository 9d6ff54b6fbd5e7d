"""pagedkv against llama.cpp on the CPU, same GGUF, same shapes, in one run (issue 42). Prints one table.

For each weight format (the embedded SmolLM2-135M-Instruct Q4_1 as shipped, and Q8_0 and BF16 copies
made from it by `llama-quantize --allow-requantize`, cached in --cache-dir) and each number of parallel
sequences B (--parallel), both engines prefill B random 128-token prompts and then decode 128 tokens
per sequence on --threads threads:

- llama.cpp: `llama-batched-bench -npp 128 -ntg 128 -npl B -c B*256 -t T -tb T --output-format jsonl`,
  one process per B, unchanged otherwise (its own batch sizes, flash-attention choice and warm-up); we read its
  S_PP = B*PP / T_PP (one decode of all prompts) and S_TG = B*TG / T_TG (TG decode calls of B tokens).
- pagedkv: one process per weight variant loads `LLM(model=<gguf dir>, gguf_file=...)`, warms up on one
  short request, then per B adds B requests of fixed random token ids (seeded), greedy, ignore_eos,
  max_tokens 129, and steps the engine: T_PP runs from the first step until every request has its
  first token (all prompts fit one step's token budget, so that is one prefill step, whose forward
  also samples the first token), T_TG from there to the last request's end: 128 decode steps of B
  tokens, as batched-bench's TG calls. S_PP = B*128 / T_PP, S_TG = B*128 / T_TG.
  Weight variants: Q4_1 and Q8_0 with the linears kept quantized (gguf_weights="quantized", float32
  activations) or dequantized to float32; BF16 in bfloat16 or float32, or kept bfloat16 beside float32
  activations (`quantized`: gguf_weights="quantized" keeps a file's tensors as stored). By default (sized for about 10
  minutes on 2 quiet cores): Q4_1 both, Q8_0 quantized, BF16 in the engine's default (`auto`: kept, its KV cache
  bfloat16 on CPUs with native bfloat16 math) and dequantized to the float dtype the engine picks for other
  checkpoints (bfloat16 on CPUs with native bfloat16 math, float32 elsewhere); `--variants all` runs every variant of each format (quantized-float-head: the LM head from its float32 weight). Before the repeats pagedkv
  loads each GGUF once, untimed: a file's first load converts it into pagedkv's GGUF cache
  (models/gguf_cache.py), which the timed loads then read.

The engines alternate run by run (each repeat: llama.cpp, then pagedkv's variants, the order reversed
on odd repeats), --repeats times; every cell is the min-max range over the repeats, and a ratio cell the
range of the repeats' pagedkv / llama.cpp ratios (each within one repeat). Also printed: the copy
bandwidth of this machine in the same run (torch `copy_` of 512 MiB on --threads threads, best of 5,
counting read + write bytes), each engine's batch-1 decode rate as weight bytes streamed per second
(the GGUF's tensor bytes per token; pagedkv's float32 LM head and dequantized weights read more) and
its share of the copy bandwidth; resident memory beside the GGUF's size: pagedkv's weight tensors, its
RSS after loading and its peak, llama.cpp's peak (the peaks hold each engine's KV cache for the largest
B, pagedkv's in the model's dtype, llama.cpp's in float16; pagedkv's size is printed), and what pagedkv's
load added to its process's RSS after `import torch` and `from pagedkv import LLM` ("over imports":
the weights, the KV cache, the tokenizer and the transformers modules the load imports), also as a
multiple of the file + that KV cache.

    python benches/vs_llamacpp.py [--llama-cpp-dir DIR] [--formats Q4_1 Q8_0 BF16] [--parallel 1 16 64]
                                  [--repeats 3] [--variants default|all] [--threads 2]
    python benches/vs_llamacpp.py --gguf FILE --parallel 1     # another GGUF, pagedkv's default load

llama.cpp's binaries: see docs/benchmarks.md (section "Against llama.cpp") for how to build them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT_LEN, NEW_TOKENS = 128, 128
DEFAULT_LLAMA_CPP_DIR = str(Path.home() / ".cache" / "pagedkv" / "llama.cpp" / "build" / "bin")
BUILD_HELP = """llama.cpp's {missing} not found in {directory}. Build it (CPU only) and pass --llama-cpp-dir or set
$LLAMA_CPP_DIR to its build/bin:
    git clone https://github.com/ggml-org/llama.cpp && cd llama.cpp   # or the llama-cpp-python sdist's vendor/llama.cpp
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \\
          -DCMAKE_BUILD_TYPE=Release
    cmake --build build --target llama-batched-bench llama-quantize -j"""
# pagedkv's weight variants: name -> (EngineConfig.gguf_weights, dtype, the formats it runs)
VARIANTS = {
    # (a BF16 file's linears stay bfloat16 beside float32 activations)
    "quantized": ("quantized", "float32", ("Q4_1", "Q8_0", "BF16")),
    # (the same with the LM head read from its float32 weight, as before the head kept its blocks)
    "quantized-float-head": ("quantized", "float32", ("Q4_1", "Q8_0")),
    # (what `LLM("model.gguf")` picks on this machine: a BF16 file kept, with its bfloat16 model's KV
    # cache where the CPU has native bfloat16 math)
    "auto": ("auto", "auto", ("Q4_1", "Q8_0", "BF16")),
    "float32": ("dequantized", "float32", ("Q4_1", "Q8_0", "BF16")),
    "bfloat16": ("dequantized", "bfloat16", ("BF16",)),
}
DEFAULT_VARIANTS = {"Q4_1": ["quantized", "float32"], "Q8_0": ["quantized"], "BF16": ["auto", "bfloat16"]}


def find_llama_cpp(directory: str) -> tuple[str, str]:
    tools = [os.path.join(directory, name) for name in ("llama-batched-bench", "llama-quantize")]
    for tool in tools:
        if not os.access(tool, os.X_OK):
            sys.exit(BUILD_HELP.format(missing=os.path.basename(tool), directory=directory))
    return tools[0], tools[1]


def gguf_copies(quantize: str, cache_dir: str, formats: list[str]) -> dict[str, str]:
    """Path of each format's GGUF: the embedded Q4_1 as shipped, the others requantized from it once."""
    from pagedkv.models.loader import default_model_path

    shipped = os.path.join(*default_model_path())
    paths = {}
    for fmt in formats:
        if fmt == "Q4_1":
            paths[fmt] = shipped
            continue
        target = os.path.join(cache_dir, os.path.basename(shipped).replace("Q4_1", fmt))
        if not os.path.exists(target):
            os.makedirs(cache_dir, exist_ok=True)
            run_measured([quantize, "--allow-requantize", shipped, target + ".part", fmt])
            os.replace(target + ".part", target)
        paths[fmt] = target
    return paths


def gguf_tensor_bytes(path: str) -> int:
    """Bytes of all tensors in a GGUF: what one decode token reads (the tied embedding is the LM head)."""
    from gguf import GGUFReader

    return sum(int(tensor.n_bytes) for tensor in GGUFReader(path).tensors)


def copy_bandwidth(threads: int) -> float:
    """GB/s of a torch copy_ of 512 MiB (read + write bytes), best of 5, on `threads` threads."""
    import torch
    from host_bandwidth import host_copy_bandwidth

    torch.set_num_threads(threads)
    return host_copy_bandwidth(timed_copies=5) / 1e9


def run_measured(command: list[str]) -> tuple[str, int]:
    """(stdout + stderr, peak RSS in bytes) of one child process. The peak is its VmHWM, read every 50 ms
    (a child's ru_maxrss would start at this process's own peak: Linux carries it across fork and exec)."""
    peak_kb = 0
    with tempfile.TemporaryFile() as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        while child.poll() is None:
            try:
                status = Path(f"/proc/{child.pid}/status").read_text()
                peak_kb = max(peak_kb, int(status.split("VmHWM:")[1].split()[0]))
            except (OSError, IndexError):  # (exiting)
                pass
            time.sleep(0.05)
        log.seek(0)
        text = log.read().decode(errors="replace")
    if child.returncode:
        sys.exit(f"{command[0]} failed ({child.returncode}):\n{text[-3000:]}")
    return text, peak_kb * 1024


def run_llama_cpp(batched_bench: str, gguf: str, batches: list[int], threads: int) -> dict:
    """One batched-bench process per B, its context sized to that B (a context sized for the largest B
    would make every smaller B's decode attend over the whole, mostly empty, cache)."""
    speeds, peak_rss = {}, 0
    for num_seqs in batches:
        command = [batched_bench, "-m", gguf, "-c", str(num_seqs * (PROMPT_LEN + NEW_TOKENS)), "-npp", str(PROMPT_LEN),
                   "-ntg", str(NEW_TOKENS), "-npl", str(num_seqs), "-t", str(threads), "-tb", str(threads),
                   "--output-format", "jsonl"]
        text, peak = run_measured(command)
        rows = [json.loads(line) for line in text.splitlines() if line.startswith("{") and '"speed_tg"' in line]
        if [row["pl"] for row in rows] != [num_seqs]:  # (batched-bench skips a B whose KV does not fit -c, silently)
            sys.exit(f"llama-batched-bench reported no row for B = {num_seqs}:\n{text[-3000:]}")
        speeds[num_seqs] = (rows[0]["speed_pp"], rows[0]["speed_tg"])
        peak_rss = max(peak_rss, peak)
    return {"speeds": speeds, "peak_rss": peak_rss}


def pagedkv_worker(gguf: str, variant: str, batches: list[int], threads: int) -> dict:
    """Runs in its own process: loads the GGUF and measures every B (see the docstring)."""
    import psutil
    import torch

    from pagedkv import LLM, SamplingParams

    torch.set_num_threads(threads)
    gguf_weights, dtype, _ = VARIANTS[variant]
    if variant == "quantized-float-head":
        from pagedkv.models import gguf_file_weights, gguf_quantized

        # (the head's float weight loaded, through transformers' reader, and not swapped for its blocks)
        gguf_file_weights.readable = lambda tensors, architecture: False
        gguf_quantized.keep_lm_head_quantized = lambda net, tensors, checked=True: None
    longest = max(batches, default=1)
    blocks_per_seq = -(-(PROMPT_LEN + NEW_TOKENS + 1) // 16)
    imported_rss = psutil.Process().memory_info().rss
    llm = LLM(model=os.path.dirname(gguf), gguf_file=os.path.basename(gguf), gguf_weights=gguf_weights, dtype=dtype,
              num_device_blocks=longest * blocks_per_seq + 1, swap_space_bytes=0, max_num_seqs=longest,
              max_num_batched_tokens=max(2048, longest * PROMPT_LEN), max_model_len=PROMPT_LEN + NEW_TOKENS + 16,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for t in [*engine.runner.model.parameters(), *engine.runner.model.buffers()]}
    loaded_rss = psutil.Process().memory_info().rss
    if not batches:  # (a load only: it fills pagedkv's GGUF cache)
        return {}
    rng = random.Random(0)
    vocab_size = engine.model_info.vocab_size

    def run(num_seqs: int, prompt_len: int, max_tokens: int) -> tuple[float, float]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind="final_only")
        for index in range(num_seqs):
            engine.add_request(f"{num_seqs}-{index}", [rng.randrange(vocab_size) for _ in range(prompt_len)], params)
        started = time.perf_counter()
        while not all(r.metrics.first_token_time is not None for r in engine.requests.values()):
            engine.step()
        prefilled = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return prefilled - started, time.perf_counter() - prefilled

    run(1, 16, 2)  # warm-up, as batched-bench's
    speeds = {}
    for num_seqs in batches:
        prefill_s, decode_s = run(num_seqs, PROMPT_LEN, NEW_TOKENS + 1)
        speeds[num_seqs] = (num_seqs * PROMPT_LEN / prefill_s, num_seqs * NEW_TOKENS / decode_s)
    return {"speeds": speeds, "loaded_rss": loaded_rss, "imported_rss": imported_rss, "weight_bytes": sum(tensors.values()),
            "dtype": str(engine.runner.dtype).removeprefix("torch."),
            "kv_dtype": str(engine.runner.kv_dtype).removeprefix("torch."),
            "kv_bytes": engine.runner.num_device_blocks * engine.runner.block_bytes}


def run_pagedkv(gguf: str, variant: str, batches: list[int], threads: int) -> dict:
    command = [sys.executable, __file__, "--worker", gguf, variant, "--parallel", *map(str, batches),
               "--threads", str(threads)]
    text, peak_rss = run_measured(command)
    result = json.loads(text.strip().splitlines()[-1])
    result["speeds"] = {int(b): tuple(s) for b, s in result.get("speeds", {}).items()}
    return {**result, "peak_rss": peak_rss}


def span(values: list[float], digits: int = 1) -> str:
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}-{high}"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp-dir", default=os.environ.get("LLAMA_CPP_DIR", DEFAULT_LLAMA_CPP_DIR),
                        help="folder of llama-batched-bench and llama-quantize (default: $LLAMA_CPP_DIR, else %(default)s)")
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/pagedkv/vs_llamacpp"),
                        help="where the Q8_0 and BF16 copies are made once")
    parser.add_argument("--formats", nargs="+", default=["Q4_1", "Q8_0", "BF16"], choices=["Q4_1", "Q8_0", "BF16"])
    parser.add_argument("--parallel", nargs="*", type=int, default=[1, 16, 64], help="numbers of parallel sequences")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=["default"],
                        help="pagedkv's weight variants: default (per format: %s), all, or names among %s"
                             % (DEFAULT_VARIANTS, list(VARIANTS)))
    parser.add_argument("--gguf", help="run this GGUF file (pagedkv in its default, `auto`) instead of --formats, "
                                       "e.g. benches/gguf_memory.py's random 7B Llama")
    parser.add_argument("--worker", nargs=2, metavar=("GGUF", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.parallel and not args.worker:
        parser.error("--parallel needs at least one number of sequences")
    if args.worker:
        print(json.dumps(pagedkv_worker(*args.worker, args.parallel, args.threads)))
        return

    batched_bench, quantize = find_llama_cpp(args.llama_cpp_dir)
    if args.gguf:
        args.formats = [os.path.basename(args.gguf)]
        ggufs = {args.formats[0]: args.gguf}
        VARIANTS["auto"] = (*VARIANTS["auto"][:2], tuple(args.formats))
        args.variants = ["auto"]
    else:
        ggufs = gguf_copies(quantize, args.cache_dir, args.formats)
    named = [name for name in args.variants if name not in ("default", "all")]
    if set(named) - set(VARIANTS):
        parser.error(f"unknown --variants {sorted(set(named) - set(VARIANTS))}: default, all or among {list(VARIANTS)}")
    if "default" in args.variants:  # (BF16 dequantized to the float dtype the engine picks on this CPU)
        from pagedkv.config import EngineConfig

        DEFAULT_VARIANTS["BF16"] = ["auto", str(EngineConfig().torch_dtype()).removeprefix("torch.")]
    variants = {fmt: [name for name in VARIANTS if fmt in VARIANTS[name][2] and
                      ("all" in args.variants or name in named or
                       ("default" in args.variants and name in DEFAULT_VARIANTS[fmt]))] for fmt in args.formats}
    for fmt in args.formats:  # (a GGUF's first load converts it into pagedkv's cache: the timed loads find it there)
        run_pagedkv(ggufs[fmt], "auto" if args.gguf else "float32", [], args.threads)
    bandwidth = copy_bandwidth(args.threads)
    llama: dict[str, list[dict]] = {fmt: [] for fmt in args.formats}
    ours: dict[tuple[str, str], list[dict]] = {(fmt, name): [] for fmt in args.formats for name in variants[fmt]}
    for repeat in range(args.repeats):
        for fmt in args.formats:
            runs = [("llama.cpp", None), *(("pagedkv", name) for name in variants[fmt])]
            for engine, name in runs if repeat % 2 == 0 else reversed(runs):
                print(f"repeat {repeat + 1}/{args.repeats}: {fmt} {engine} {name or ''}", file=sys.stderr, flush=True)
                if engine == "llama.cpp":
                    llama[fmt].append(run_llama_cpp(batched_bench, ggufs[fmt], args.parallel, args.threads))
                else:
                    ours[fmt, name].append(run_pagedkv(ggufs[fmt], name, args.parallel, args.threads))

    model = os.path.basename(args.gguf) if args.gguf else "SmolLM2-135M-Instruct"
    print(f"\npagedkv vs llama.cpp, {model}, {PROMPT_LEN}-token prompts, {NEW_TOKENS} new tokens, "
          f"{args.threads} threads; {cpu_name()}, {os.cpu_count()} cores; "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    version = subprocess.run([batched_bench, "--version"], capture_output=True, text=True).stderr.strip().splitlines()
    print(f"command: python {' '.join(sys.argv)}; llama.cpp {version[0] if version else '(no --version)'}")
    print(f"tokens/s, min-max over {args.repeats} repeats; ratio = pagedkv / llama.cpp per repeat\n")
    print("| weights | B | pagedkv weights | decode llama.cpp | decode pagedkv | ratio "
          "| prefill llama.cpp | prefill pagedkv | ratio |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for fmt in args.formats:
        for num_seqs in args.parallel:
            theirs = [run["speeds"][num_seqs] for run in llama[fmt]]
            for name in variants[fmt]:
                mine = [run["speeds"][num_seqs] for run in ours[fmt, name]]
                cells = []
                for phase in (1, 0):  # decode, then prefill
                    ratios = [m[phase] / t[phase] for m, t in zip(mine, theirs)]
                    cells += [span([t[phase] for t in theirs]), span([m[phase] for m in mine]), span(ratios, 2) + "x"]
                label = f"{VARIANTS[name][0]} {VARIANTS[name][1]}" + (", float32 LM head" if name.endswith("float-head") else "")
                if fmt == "BF16" and name == "quantized":
                    label = "kept bfloat16, float32 activations"
                if name == "auto":
                    run = ours[fmt, name][0]
                    label = f"auto: {run['dtype']} activations, {run['kv_dtype']} KV"
                print(f"| {fmt} | {num_seqs} | {label} | " + " | ".join(cells) + " |")

    print(f"\ncopy bandwidth: {bandwidth:.1f} GB/s (torch copy_ of 512 MiB, read + write, best of 5)")
    if 1 in args.parallel:
        for fmt in args.formats:
            weight_bytes = gguf_tensor_bytes(ggufs[fmt])
            rates = [("llama.cpp", [run["speeds"][1][1] for run in llama[fmt]])]
            rates += [(f"pagedkv {name}", [run["speeds"][1][1] for run in ours[fmt, name]]) for name in variants[fmt]]
            cells = [f"{engine} {span([r * weight_bytes / 1e9 for r in rate], 2)} GB/s "
                     f"({span([100 * r * weight_bytes / 1e9 / bandwidth for r in rate], 0)}%)" for engine, rate in rates]
            print(f"batch-1 decode, {fmt} ({weight_bytes / 1e6:.0f} MB of GGUF tensors per token): " + "; ".join(cells))
    for fmt in args.formats:
        cells = [f"llama.cpp peak {span([run['peak_rss'] / 1e6 for run in llama[fmt]], 0)}"]
        for name in variants[fmt]:
            runs = ours[fmt, name]
            added = [run["loaded_rss"] - run["imported_rss"] for run in runs]
            held = os.path.getsize(ggufs[fmt]) + runs[0]["kv_bytes"]
            cells.append(f"pagedkv {name}: weights {runs[0]['weight_bytes'] / 1e6:.0f}, after load "
                         f"{span([run['loaded_rss'] / 1e6 for run in runs], 0)} ({span([a / 1e6 for a in added], 0)} "
                         f"over imports, {span([a / held for a in added], 2)}x file + KV), peak "
                         f"{span([run['peak_rss'] / 1e6 for run in runs], 0)} (KV {runs[0]['kv_bytes'] / 1e6:.0f})")
        print(f"memory MB, {fmt} (file {os.path.getsize(ggufs[fmt]) / 1e6:.0f}): " + "; ".join(cells))


if __name__ == "__main__":
    main()
