#!/usr/bin/env bash
# Every GPU check that is still owed, in one device call per stage, each writing its log and
# JSON under $OUT (device time is scarce: run a stage, read its logs, fix, run again).
#
#   source .device/env.sh && bash benchmarks/gpu_validation.sh engine    # one H200 (~8 min): graphs, HF equivalence, async
#   source .device/env.sh && bash benchmarks/gpu_validation.sh kernels   # one H200 (~3 min): Triton kernel tests but decode
#   source .device/env.sh && bash benchmarks/gpu_validation.sh decode    # one H200 (~6 min): the decode-attention kernel tests (185)
#   source .device/env.sh && bash benchmarks/gpu_validation.sh cluster   # two GPUs (~6 min)
#   source .device/env.sh && bash benchmarks/gpu_validation.sh speed     # one H200 (~8 min): benchmark, kernel sweep, profile
#   source .device/env.sh && bash benchmarks/gpu_validation.sh transfer  # two GPUs (~3 min): connector vs raw NCCL, then its one-GPU parts
#   source .device/env.sh && bash benchmarks/gpu_validation.sh async     # one H200 (~8 min): engine tests, decode A/B
#
# A stage keeps going after a failing step so one call reports everything; its exit code is
# the number of failed steps.
set -u
OUT=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$OUT"
failed=0

step() {  # step NAME TIMEOUT_S CMD...
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then
        echo "   ok"
    else
        echo "   FAILED (rc=$?)"
        failed=$((failed + 1))
    fi
    tail -4 "$OUT/$name.log" | sed 's/^/   /'
}

case "${1:-}" in
    engine)
        step cuda_graphs 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine_core/test_cuda_graphs.py
        step equivalence 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine_core/test_gpu_equivalence.py
        step async_scheduling 150 python3 -m pytest -q -p no:cacheprovider tests/engine_core/test_async_scheduling.py
        ;;
    kernels)
        # The kernel test file without its decode cases (205 cases, ~150 s on an H200).
        step triton_kernels 400 python3 -m pytest -q -m gpu -p no:cacheprovider \
            tests/engine_core/test_triton_kernels.py -k "not decode and not backend"
        ;;
    decode)
        # Its decode-attention and backend cases (185, 355 s on an H200 at 719ee16): a call of their own.
        step triton_decode 560 python3 -m pytest -q -m gpu -p no:cacheprovider \
            tests/engine_core/test_triton_kernels.py -k "decode or backend"
        ;;
    async)
        # Async scheduling on the GPU: its tests and the engine tests it touches, then the
        # decode figures with it on and off in the same session.
        step cuda_graphs 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine_core/test_cuda_graphs.py
        step equivalence 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine_core/test_gpu_equivalence.py
        step async_scheduling 200 python3 -m pytest -q -p no:cacheprovider tests/engine_core/test_async_scheduling.py
        step speed_async 200 python3 -m benchmarks.engine_speed --only limits,decode,small \
            --out "$OUT/engine_speed_async.json"
        step speed_sync 200 python3 -m benchmarks.engine_speed --only decode,small \
            --no-async-scheduling --out "$OUT/engine_speed_sync.json"
        ;;
    cluster)
        step connectors 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/connectors
        step cluster 360 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/integration/test_cluster_gpu.py
        ;;
    speed)
        step engine_speed 330 python3 -m benchmarks.engine_speed --out "$OUT/engine_speed.json"
        step decode_kernels 200 python3 -m benchmarks.decode_kernels --parts gemv,attention,layer \
            --rows 1,8 --no-attn-sweep --out "$OUT/decode_kernels.json"
        step profile 90 python3 -m benchmarks.profile_decode --model qwen3-8b --model qwen3-0.6b \
            --out "$OUT/profile_decode.json"
        ;;
    transfer)
        # Host-bound (0) and with a prefill's compute per layer (200 us), as in serving.
        step kv_transfer 280 python3 benchmarks/kv_transfer.py --trials 5 \
            --min-call-bytes 33554432 134217728 --switch-intervals 0.0005 --layer-us 0 200 \
            --out "$OUT/kv_transfer.json"
        # The one-GPU parts of the same path, for the same-call comparison.
        step kv_gather 120 python3 -m benchmarks.kv_gather --out "$OUT/kv_gather.json"
        step kv_producer_hooks 120 python3 -m benchmarks.kv_producer_hooks --out "$OUT/kv_producer_hooks.json"
        ;;
    *)
        echo "usage: $0 engine|kernels|decode|cluster|speed|transfer|async" >&2
        exit 2
        ;;
esac
exit "$failed"
