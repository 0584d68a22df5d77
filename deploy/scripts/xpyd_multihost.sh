#!/usr/bin/env bash
# xPyD over several hosts, after vLLM's p2p_nccl disagg_example_xpyd.sh:
# the proxy on one host, prefill and decode workers (one GPU each) on others.
#
#   host A (proxy):    PROXY_IP=10.0.0.1 ./xpyd_multihost.sh proxy
#   host B (2 x P):    PROXY_IP=10.0.0.1 GPUS=0,1 ./xpyd_multihost.sh prefill MODEL
#   host C (2 x D):    PROXY_IP=10.0.0.1 GPUS=0,1 ./xpyd_multihost.sh decode MODEL
#   client:            curl http://10.0.0.1:10001/v1/completions -H 'Content-Type: application/json' \
#                        -d '{"model": "MODEL", "prompt": "San Francisco is a", "max_tokens": 32}'
#
# Environment (all optional except PROXY_IP on worker hosts):
#   PROXY_IP          address of the proxy host (workers heartbeat to PROXY_IP:PROXY_PORT)
#   PROXY_PORT        proxy registration port (default 30001)
#   PROXY_HTTP_PORT   proxy OpenAI port (default 10001)
#   HOST_IP           this host's address the others reach (default: first of `hostname -I`)
#   GPUS              GPU ids for this host's workers, one worker each (default 0)
#   HTTP_PORT_BASE    first worker HTTP port (default 20001 prefill, 20101 decode)
#   KV_PORT_BASE      first worker kv_port  (default 21001 prefill, 22001 decode)
#   KV_BUFFER_SIZE    kv_buffer_size (default 1e1 for P, 8e9 for D, vLLM's example values)
#   EXTRA_ARGS        further engine flags, e.g. "--gpu-memory-utilization 0.8 --max-model-len 4096"
#   LOG_DIR           per-worker logs (default ./pdserve-logs)
# NCCL_* and other variables in the environment are passed through unchanged
# (e.g. NCCL_SOCKET_IFNAME=eth0, NCCL_IB_DISABLE=1 for TCP-only networks).
set -euo pipefail

ROLE=${1:?usage: $0 proxy|prefill|decode [MODEL]}
MODEL=${2:-}
PROXY_PORT=${PROXY_PORT:-30001}
PROXY_HTTP_PORT=${PROXY_HTTP_PORT:-10001}
HOST_IP=${HOST_IP:-$(hostname -I | awk '{print $1}')}
GPUS=${GPUS:-0}
LOG_DIR=${LOG_DIR:-./pdserve-logs}
read -r -a PDSERVE_CMD <<<"${PDSERVE:-pdserve}"  # e.g. PDSERVE="python -m deploy.cli"
mkdir -p "$LOG_DIR"

PIDS=()
cleanup() {
  echo "stopping ${PIDS[*]:-}"
  for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 30); do
    alive=0
    for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && return
    sleep 1
  done
  for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

case "$ROLE" in
  proxy)
    "${PDSERVE_CMD[@]}" proxy --host 0.0.0.0 --port "$PROXY_HTTP_PORT" --registration-port "$PROXY_PORT" \
      >"$LOG_DIR/proxy.log" 2>&1 &
    PIDS+=($!)
    echo "proxy: http://$HOST_IP:$PROXY_HTTP_PORT (registration $HOST_IP:$PROXY_PORT), log $LOG_DIR/proxy.log"
    ;;
  prefill|decode)
    : "${PROXY_IP:?set PROXY_IP to the address of the proxy host}"
    [ -n "$MODEL" ] || { echo "usage: $0 $ROLE MODEL" >&2; exit 2; }
    if [ "$ROLE" = prefill ]; then
      KV_ROLE=kv_producer; HTTP_BASE=${HTTP_PORT_BASE:-20001}; KV_BASE=${KV_PORT_BASE:-21001}
      BUF=${KV_BUFFER_SIZE:-1e1}
    else
      KV_ROLE=kv_consumer; HTTP_BASE=${HTTP_PORT_BASE:-20101}; KV_BASE=${KV_PORT_BASE:-22001}
      BUF=${KV_BUFFER_SIZE:-8e9}
    fi
    IFS=, read -r -a GPU_LIST <<<"$GPUS"
    for i in "${!GPU_LIST[@]}"; do
      HTTP_PORT=$((HTTP_BASE + i)); KV_PORT=$((KV_BASE + i))
      KV_CONFIG=$(printf '{"kv_connector":"P2pNcclConnector","kv_role":"%s","kv_buffer_size":"%s","kv_ip":"%s","kv_port":%d,"kv_connector_extra_config":{"proxy_ip":"%s","proxy_port":%d,"http_port":%d,"send_type":"PUT_ASYNC","nccl_num_channels":"16"}}' \
        "$KV_ROLE" "$BUF" "$HOST_IP" "$KV_PORT" "$PROXY_IP" "$PROXY_PORT" "$HTTP_PORT")
      # shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags
      CUDA_VISIBLE_DEVICES=${GPU_LIST[$i]} "${PDSERVE_CMD[@]}" "$ROLE" "$MODEL" --host 0.0.0.0 \
        --port "$HTTP_PORT" --kv-transfer-config "$KV_CONFIG" ${EXTRA_ARGS:-} \
        >"$LOG_DIR/$ROLE$i.log" 2>&1 &
      PIDS+=($!)
      echo "$ROLE$i: GPU ${GPU_LIST[$i]}, http $HOST_IP:$HTTP_PORT, kv $HOST_IP:$KV_PORT, log $LOG_DIR/$ROLE$i.log"
    done
    ;;
  *) echo "unknown role $ROLE (proxy|prefill|decode)" >&2; exit 2 ;;
esac

# Stay in the foreground; report the first process that exits (Ctrl-C stops them all).
wait -n "${PIDS[@]}" || true
echo "a $ROLE process exited; see $LOG_DIR" >&2
exit 1
