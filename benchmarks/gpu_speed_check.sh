#!/usr/bin/env bash
# One device call (one H100/H200, ~8 min): the engine's GPU correctness tests that the
# speed work touches, decode-kernel timings as graphs replay them, the whole engine-speed
# benchmark and a per-kernel decode profile.
#
#   source .device/env.sh && bash benchmarks/gpu_speed_check.sh [STEP ...]
#
# STEPs (default: all): kernels graphs equivalence decode_kernels engine_speed
# engine_speed_gemv0 (decode with cuBLAS projections only, for comparison) profile.
# Logs and JSON go under $OUT; the exit code is the number of failed steps.
set -u
OUT=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$OUT"
failed=0
step() {  # step NAME TIMEOUT_S TAIL_LINES CMD...
    local name=$1 limit=$2 lines=$3
    shift 3
    echo "== $name"
    if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then echo "   ok"; else
        echo "   FAILED (rc=$?)"; failed=$((failed + 1)); fi
    grep -v "pdserve.engine\|pdserve.kv_cache\|ContinuousBatching\|_warn_once\|UserWarning" \
        "$OUT/$name.log" | tail -"$lines" | sed 's/^/   /'
}
wanted() { [ -z "$STEPS" ] || [[ " $STEPS " == *" $1 "* ]]; }
STEPS="$*"
PYTEST="python3 -m pytest -q -m gpu -p no:cacheprovider"
wanted kernels && step kernels 150 4 $PYTEST tests/engine_core/test_triton_kernels.py \
    -k "qk_norm or silu or gemv or rope or decode or norm"
wanted graphs && step graphs 150 4 $PYTEST tests/engine_core/test_cuda_graphs.py
wanted equivalence && step equivalence 150 4 $PYTEST tests/engine_core/test_gpu_equivalence.py
wanted decode_kernels && step decode_kernels 200 44 python3 -m benchmarks.decode_kernels \
    --out "$OUT/decode_kernels.json"
wanted engine_speed && step engine_speed 330 16 python3 -m benchmarks.engine_speed \
    --out "$OUT/engine_speed.json"
wanted engine_speed_gemv0 && step engine_speed_gemv0 120 8 python3 -m benchmarks.engine_speed \
    --only limits,decode,small --triton-gemv-max-rows 0 --out "$OUT/engine_speed_gemv0.json"
wanted profile && step profile 90 56 python3 -m benchmarks.profile_decode --model qwen3-8b \
    --model qwen3-0.6b --out "$OUT/profile_decode.json"
exit "$failed"
