#!/usr/bin/env bash
# Every GPU check that is still owed, in one device call per stage, each writing its log and
# JSON under $OUT (device time is scarce: run a stage, read its logs, fix, run again).
#
#   source .device/env.sh && bash experiments/gpu_validation.sh engine    # one H200 (~9 min): graphs, HF equivalence, async, sleep mode, KV offload
#   source .device/env.sh && bash experiments/gpu_validation.sh kernels   # one H200 (~3 min): Triton kernel tests but decode
#   source .device/env.sh && bash experiments/gpu_validation.sh decode    # one H200 (~6 min): the decode-attention kernel tests (185)
#   source .device/env.sh && bash experiments/gpu_validation.sh cluster   # two GPUs (~7 min)
#   source .device/env.sh && bash experiments/gpu_validation.sh handoff   # two GPUs (~3 min): 1P1D with P's first token vs colocated, then report item 1 with it
#   source .device/env.sh && bash experiments/gpu_validation.sh pd1       # one GPU (~5 min): 1P1D on one GPU: equal to colocated (both first-token paths), long prompts
#   source .device/env.sh && bash experiments/gpu_validation.sh offload_sleep  # one GPU (~7 min): KV offload, sleep mode
#   source .device/env.sh && bash experiments/gpu_validation.sh speed     # one H200 (~8 min): benchmark, kernel sweep, profile
#   source .device/env.sh && bash experiments/gpu_validation.sh lm_head   # one GPU (~8 min): goal 1's floor, LM-head GEMV A/B, tests
#   source .device/env.sh && bash experiments/gpu_validation.sh attn_ab   # one GPU (~2 min): a decode-attention change A/B against BASE (or BASE_DIR; ATTN_CASES)
#   source .device/env.sh && bash experiments/gpu_validation.sh mixed     # one GPU (~9 min): mixed-step graphs: tests, A/B
#   source .device/env.sh && bash experiments/gpu_validation.sh worklist  # one GPU (~9 min): mixed steps' decode work list
#   source .device/env.sh && bash experiments/gpu_validation.sh hooked    # one GPU (~6 min): hooked (prefill-worker) steps, graphs vs eager
#   source .device/env.sh && bash experiments/gpu_validation.sh serve_ab  # one GPU (~10 min): serving with/without mixed graphs
#   source .device/env.sh && bash experiments/gpu_validation.sh host      # one GPU (~5 min): decode/mixed figures, host profile
#   source .device/env.sh && bash experiments/gpu_validation.sh transfer  # two GPUs (~3 min): connector vs raw NCCL, then its one-GPU parts
#   source .device/env.sh && bash experiments/gpu_validation.sh async     # one H200 (~8 min): engine tests, decode A/B
#   source .device/env.sh && bash experiments/gpu_validation.sh report1   # one H200 (~5 min): the report's one-GPU pieces
#   source .device/env.sh && bash experiments/gpu_validation.sh report    # two GPUs (~10 min a call): the whole report (or REPORT_ONLY), resumable
#   source .device/env.sh && bash experiments/gpu_validation.sh stall     # two GPUs (~3 min): 1P1D at 2k, 16 and 20 req/s again; D's loop-watch lines
#
# A stage keeps going after a failing step so one call reports everything; its exit code is
# the number of failed steps. Logs and results go to a run folder packed into ONE file,
# $OUT/<stage>.tgz (the device tool returns at most 8 files). Steps are stopped with SIGINT
# at their limit, so an interrupted pytest still prints its summary.
set -u
OUT=${OUT:-/tmp/pdserve-gpu}
STAGE=${1:-}
RUN=$(mktemp -d /tmp/pdserve-gpu-run.XXXXXX)
mkdir -p "$OUT"
failed=0
trap 'tar czf "$OUT/$STAGE.tgz" -C "$RUN" --exclude="model-*" . 2>/dev/null' EXIT

step() {  # step NAME TIMEOUT_S CMD...
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    if timeout -s INT -k 20 "$limit" "$@" > "$RUN/$name.log" 2>&1; then
        echo "   ok"
    else
        echo "   FAILED (rc=$?)"
        failed=$((failed + 1))
    fi
    tail -4 "$RUN/$name.log" | sed 's/^/   /'
}

case "$STAGE" in
    engine)
        step cuda_graphs 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine_core/test_cuda_graphs.py
        step equivalence 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine_core/test_gpu_equivalence.py
        step async_scheduling 150 python3 -m pytest -q -p no:cacheprovider tests/engine_core/test_async_scheduling.py
        step sleep_offload 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine_core/test_sleep_mode.py \
            tests/engine_core/test_kv_offload.py tests/engine_core/test_memory_arena.py
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
            --out "$RUN/engine_speed_async.json"
        step speed_sync 200 python3 -m benchmarks.engine_speed --only decode,small \
            --no-async-scheduling --out "$RUN/engine_speed_sync.json"
        ;;
    cluster)
        step connectors 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/connectors
        step cluster 360 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
            tests/integration/test_cluster_gpu.py -k "not p-first-token"
        ;;
    handoff)
        # The first-token handoff over NCCL: greedy output equal to colocated, then the
        # report's item 1. Without REPORT_DIR it resumes from a copy of the committed item-1
        # run of this card (same prompts), less its pd_handoff run, so the handoff is measured
        # again (~3 min) beside the committed colocated and 1P1D runs; the report itself runs
        # again any run saved on another GPU model (~6 min for all four). A REPORT_DIR given
        # is used as it is.
        step handoff_test 240 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
            tests/integration/test_cluster_gpu.py -k "p-first-token"
        if [ -z "${REPORT_DIR:-}" ]; then
            case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
                *H100*) base=2026-11-25-h100x2-1c3c702-ttft-overhead ;;
                *) base=2026-11-24-h200x2-c154dff-ttft-overhead ;;
            esac
            cp -r "results/serve/$base" "$RUN/report"
            rm -f "$RUN/report/summary.json" "$RUN/report/summary.md" \
                "$RUN/report/raw/ttft_overhead__pd_handoff.json"
        fi
        step handoff_report 340 python3 -m benchmarks.disagg_report --only ttft_overhead \
            --gpus 0,1 --results-dir "${REPORT_DIR:-$RUN/report}" --disable-tqdm
        ;;
    offload_sleep)
        # KV offload and sleep mode on one GPU: their GPU tests, then their figures (Qwen3-8B
        # dummy: an 8192-token prefix recomputed / from the device / from host memory; sleep
        # levels 1 and 2: memory given back, sleep and wake-up times).
        step offload_sleep_tests 330 python3 -m pytest -q -m gpu -p no:cacheprovider \
            tests/engine_core/test_sleep_mode.py tests/engine_core/test_kv_offload.py \
            tests/engine_core/test_memory_arena.py tests/engine_core/test_triton_kernels.py \
            -k "sleep or offload or copy_blocks"
        step offload_sleep_bench 300 python3 -m benchmarks.offload_sleep --out "$RUN/offload_sleep.json"
        ;;
    pd1)
        # The disaggregated path on one GPU: P and D share it over the CPU transport (which
        # keeps NCCL's stream discipline): equal to colocated with D's and with P's first
        # token (the handoff), long prompts (8192-token prefill steps).
        step pd_one_gpu 540 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
            tests/integration/test_cluster_gpu.py -k cpu-transport
        ;;
    speed)
        step engine_speed 330 python3 -m benchmarks.engine_speed --out "$RUN/engine_speed.json"
        step decode_kernels 200 python3 -m experiments.decode_kernels --parts gemv,attention,layer \
            --rows 1,8 --no-attn-sweep --out "$RUN/decode_kernels.json"
        step profile 90 python3 -m experiments.profile_decode --model qwen3-8b --model qwen3-0.6b \
            --out "$RUN/profile_decode.json"
        ;;
    mixed)
        # Mixed prefill+decode steps from CUDA graphs: the GPU tests they touch, then the
        # decode/mixed figures with mixed graphs (full) and without (full_decode_only).
        step cuda_graphs 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine_core/test_cuda_graphs.py
        step equivalence 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine_core/test_gpu_equivalence.py
        step warm_up_async 150 python3 -m pytest -q -p no:cacheprovider tests/engine_core/test_warm_up.py \
            tests/engine_core/test_async_scheduling.py
        step prefill_kernels 120 python3 -m pytest -q -m gpu -p no:cacheprovider \
            tests/engine_core/test_triton_kernels.py -k "prefill or profile"
        step speed_full 200 python3 -m benchmarks.engine_speed --only limits,decode,mixed,small \
            --decode-cases 1x1024,64x2048 --out "$RUN/engine_speed_full.json"
        step speed_decode_only 150 python3 -m benchmarks.engine_speed --only mixed \
            --cuda-graph-mode full_decode_only --out "$RUN/engine_speed_decode_only.json"
        ;;
    worklist)
        # The decode work list of mixed steps: its kernel and graph tests, then mixed steps
        # with long decodes from graphs (full) against eager (full_decode_only).
        step worklist_kernels 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
            tests/engine_core/test_triton_kernels.py -k "work_list or padded_step or backend or graph_grid"
        step graphs_hf 260 python3 -m pytest -q -m gpu -p no:cacheprovider \
            tests/engine_core/test_cuda_graphs.py tests/engine_core/test_gpu_equivalence.py
        C=1x1024x64,16x1024x64,1x8192x1024,1x32768x1024,1x32768x64,4x32768x512
        step long_full 150 python3 -m benchmarks.engine_speed --only mixed --max-model-len 40960 \
            --mixed-cases $C --out "$RUN/engine_speed_long_full.json"
        step long_eager 150 python3 -m benchmarks.engine_speed --only mixed --max-model-len 40960 \
            --mixed-cases $C --cuda-graph-mode full_decode_only --out "$RUN/engine_speed_long_eager.json"
        ;;
    hooked)
        # Steps with connector layer hooks (a prefill worker's): graphs with the hooks around
        # the replay up to 1024 tokens, against eager (full_decode_only), prefill-only steps.
        step hooked_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
            tests/engine_core/test_cuda_graphs.py -k "hooked or replay"
        step hooked_full 150 python3 -m benchmarks.engine_speed --only mixed --hooked-connector \
            --mixed-cases 0x0x64,0x0x512,0x0x1024,0x0x2048 --out "$RUN/engine_speed_hooked_full.json"
        step hooked_eager 150 python3 -m benchmarks.engine_speed --only mixed --hooked-connector \
            --mixed-cases 0x0x64,0x0x512,0x0x1024,0x0x2048 --cuda-graph-mode full_decode_only \
            --out "$RUN/engine_speed_hooked_eager.json"
        ;;
    serve_ab)
        # Serving on one GPU with and without mixed-step graphs (the proxy-overhead runs at
        # 200 req/s of 8-token prompts, where almost every step is mixed, and colocated
        # prefix caching); each half stops at its time budget (exit 3: rerun to finish).
        step serve_full 285 python3 -m benchmarks.disagg_report --gpus 0 \
            --only proxy_overhead,prefix_cache --results-dir "$RUN/serve_full" \
            --time-budget 265 --disable-tqdm
        step serve_decode_only 285 python3 -m benchmarks.disagg_report --gpus 0 \
            --only proxy_overhead,prefix_cache --results-dir "$RUN/serve_decode_only" \
            --time-budget 265 --disable-tqdm "--engine-args=--cuda-graph-mode full_decode_only"
        ;;
    host)
        # Decode and mixed steps against the limits, then where the host's time goes in
        # eager mixed steps (8B with a decoding batch of 16, the 0.6B at batch 1).
        step engine_speed 300 python3 -m benchmarks.engine_speed --only limits,decode,mixed,small \
            --out "$RUN/engine_speed.json"
        step host_8b 120 python3 -m experiments.host_profile --model qwen3-8b --batch 16 \
            --out "$RUN/host_profile_8b.json"
        step host_06b 90 python3 -m experiments.host_profile --model qwen3-0.6b --batch 1 \
            --out "$RUN/host_profile_06b.json"
        ;;
    transfer)
        # Host-bound (0) and with a prefill's compute per layer (200 us), as in serving.
        step kv_transfer 280 python3 benchmarks/kv_transfer.py --trials 5 \
            --min-call-bytes 33554432 134217728 --switch-intervals 0.0005 --layer-us 0 200 \
            --out "$RUN/kv_transfer.json"
        # The one-GPU parts of the same path, for the same-call comparison.
        step kv_gather 120 python3 -m experiments.kv_gather --out "$RUN/kv_gather.json"
        step kv_producer_hooks 120 python3 -m experiments.kv_producer_hooks --out "$RUN/kv_producer_hooks.json"
        ;;
    lm_head)
        # The LM head on the Triton GEMV: goal 1's floor (decode_floor.py), the decode
        # figures A/B against BASE (a commit; default the one before the change) from a
        # worktree, twice in alternation in one session, then the tests the change touches.
        git worktree add -q -f /tmp/pdserve-base "${BASE:-2226626}" > "$RUN/worktree.log" 2>&1
        step floor 200 python3 -m experiments.decode_floor --out "$RUN/decode_floor.json"
        for i in 1 2; do
            step "speed_new_$i" 150 python3 -m benchmarks.engine_speed --only limits,decode,small \
                --decode-cases 1x1024,8x1024,64x2048 --out "$RUN/speed_new_$i.json"
            step "speed_base_$i" 150 env -C /tmp/pdserve-base "PYTHONPATH=/tmp/pdserve-base:$PYTHONPATH" \
                python3 -m benchmarks.engine_speed --only limits,decode,small \
                --decode-cases 1x1024,8x1024,64x2048 --out "$RUN/speed_base_$i.json"
        done
        step equivalence 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
            tests/engine_core/test_gpu_equivalence.py tests/engine_core/test_cuda_graphs.py
        step sleep 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" \
            tests/engine_core/test_sleep_mode.py tests/engine_core/test_memory_arena.py
        ;;
    attn_ab)
        # A decode-attention change A/B against BASE (default afd30a9, before the session-14
        # attempts) from a worktree, in alternation in one session: the attention cases, the
        # layer graph and the decode figures. BASE_DIR instead names a copy of the base tree
        # already here (the device's clone may not hold recent commits), e.g. made with
        # `git archive COMMIT engine_core benchmarks | tar -x -C ab-base`.
        if [ -n "${BASE_DIR:-}" ]; then
            basedir=$(cd "$BASE_DIR" && pwd)
        else
            basedir=/tmp/pdserve-base
            git worktree add -q -f "$basedir" "${BASE:-afd30a9}" > "$RUN/worktree.log" 2>&1
        fi
        base=(env -C "$basedir" "PYTHONPATH=$basedir:$PWD:$PYTHONPATH")
        kernels=(python3 -m experiments.decode_kernels --parts attention,layer --no-attn-sweep
                 --attn-cases ${ATTN_CASES:-1x1024,1x8192,64x2048,256x2048}
                 --layer-variants "engine now: RoPE and KV write in attention, SiLU fused;no attention")
        speed=(python3 -m benchmarks.engine_speed --only limits,decode,small
               --decode-cases 1x1024,8x1024,64x2048,256x2048)
        step kernels_new_1 110 "${kernels[@]}" --out "$RUN/kernels_new_1.json"
        step kernels_base_1 110 "${base[@]}" "${kernels[@]}" --out "$RUN/kernels_base_1.json"
        step speed_new_1 130 "${speed[@]}" --out "$RUN/speed_new_1.json"
        step speed_base_1 130 "${base[@]}" "${speed[@]}" --out "$RUN/speed_base_1.json"
        step kernels_new_2 50 "${kernels[@]}" --out "$RUN/kernels_new_2.json"
        step kernels_base_2 50 "${base[@]}" "${kernels[@]}" --out "$RUN/kernels_base_2.json"
        ;;
    report1)
        # Colocated prefix caching and the proxy overhead (interleaved A/B); the 1P1D runs
        # are listed as needing two GPUs. Empty Triton cache: a fresh machine's cold start.
        rm -rf "$HOME/.triton/cache"
        step report1 420 python3 -m benchmarks.disagg_report --gpus 0 \
            --only proxy_overhead,prefix_cache --results-dir "$RUN/serve" --time-budget 400 \
            --disable-tqdm
        ;;
    stall)
        # D's event loop under load (2026-11-25: held 1.2-2.3 s at 2k prompts, 16-20 req/s,
        # before 61d4966): the 1P1D goodput points there again, from a copy of the committed
        # sweep without them (the colocated points and the other rates are kept, not rerun),
        # then every loop-watch line of the workers' logs.
        cp -r results/serve/2026-11-25-h100x2-goodput "$RUN/serve"
        rm -f "$RUN"/serve/raw/goodput_2k__pd__r16.json "$RUN"/serve/raw/goodput_2k__pd__r20.json
        rm -rf "$RUN"/serve/logs/pd  # the launcher appends: only this run's lines
        step stall 300 python3 -m benchmarks.disagg_report --gpus 0,1 --only goodput_2k \
            --rates-2k 16,20 --point-seconds 15 --results-dir "$RUN/serve" --time-budget 1000 \
            --disable-tqdm
        grep -h "loop_watch" "$RUN"/serve/logs/pd/*.log > "$RUN/loop_watch.txt" || true
        echo "   loop-watch lines: $(wc -l < "$RUN/loop_watch.txt")"
        ;;
    report)
        # The whole report on GPUs 0,1 (REPORT_ONLY: a comma-separated subset of its
        # experiments); exit 3 = time budget reached: copy serve/ back into the repo's
        # results folder and run again (finished runs are skipped).
        step report 560 python3 -m benchmarks.disagg_report --gpus 0,1 \
            ${REPORT_ONLY:+--only "$REPORT_ONLY"} \
            --results-dir "${REPORT_DIR:-$RUN/serve}" --time-budget 530 --disable-tqdm
        if [ -n "${REPORT_DIR:-}" ]; then cp -r "$REPORT_DIR" "$RUN/serve"; fi  # into the tgz
        ;;
    *)
        echo "usage: $0 engine|kernels|decode|cluster|pd1|offload_sleep|speed|lm_head|attn_ab|mixed|worklist|hooked|serve_ab|host|transfer|async|report1|report|stall" >&2
        exit 2
        ;;
esac
exit "$failed"
