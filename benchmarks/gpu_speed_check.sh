#!/usr/bin/env bash
# One device call (one H100/H200, ~8 min): the engine's GPU correctness tests that the
# speed work touches, then the whole engine-speed benchmark and a per-kernel decode profile.
#
#   source .device/env.sh && bash benchmarks/gpu_speed_check.sh
#
# Logs and JSON go under $OUT; the exit code is the number of failed steps.
set -u
OUT=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$OUT"
failed=0
step() {  # step NAME TIMEOUT_S CMD...
    local name=$1 limit=$2
    shift 2
    echo "== $name"
    if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then echo "   ok"; else
        echo "   FAILED (rc=$?)"; failed=$((failed + 1)); fi
    grep -v "pdserve.engine\|pdserve.kv_cache\|ContinuousBatching" "$OUT/$name.log" | tail -${TAIL:-4} | sed 's/^/   /'
}
pytest_gpu() { python3 -m pytest -q -m gpu -p no:cacheprovider "$@"; }
step kernels 150 pytest_gpu tests/engine_core/test_triton_kernels.py -k "qk_norm or silu or rope or decode or norm"
step graphs 150 pytest_gpu tests/engine_core/test_cuda_graphs.py
step equivalence 150 pytest_gpu tests/engine_core/test_gpu_equivalence.py
TAIL=16 step engine_speed 330 python3 -m benchmarks.engine_speed --out "$OUT/engine_speed.json"
TAIL=56 step profile 90 python3 -m benchmarks.profile_decode --model qwen3-8b --model qwen3-0.6b \
    --out "$OUT/profile_decode.json"
exit "$failed"
