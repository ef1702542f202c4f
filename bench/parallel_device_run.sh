#!/usr/bin/env bash
# One device call on a multi-GPU host for issue 10 (repo root; carry .whl .jit .dg_src; kind nvidia-h200-x4,
# or -x2 with SPLITS=2x2,2x1,1x2):
#  1. the NCCL tests: TP/EP over 2 and 4 GPUs against one process, eager (test_parallel_engine.py -m gpu)
#     and with decode CUDA graphs on every rank (test_parallel_graphs_gpu.py, also with all_reduce=symm_mem);
#     then python -m bench.allreduce over every GPU (NCCL vs the symmetric-memory one-shot, eager and in graphs);
#  2. python -m bench.parallel over SPLITS (default 4x4,4x1,1x4) with MODEL (default gpt-oss-120b), decode
#     graphs on every rank; with EAGER_PROFILE=1 first the first split's batch-1 decode without graphs,
#     profiled (where an eager step's time goes), with torch's default CPU threads and with one per rank;
#  3. python -m bench.kv_transfer (the GPU-direct hand-off's GB/s, GPU 0 -> the last GPU);
#  4. python -m bench.disaggregated: prefill engine on GPUs 0-1, decode engine on 2-3 (TP2/EP2 each;
#     on 2 GPUs: one engine per GPU), TTFT and hand-off against one engine doing both.
#   LIMIT_S (default 560) bounds the whole script; extra args go to bench.parallel (e.g. --all-reduce symm_mem).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LIMIT_S=${LIMIT_S:-560}
start=$(date +%s)
source scripts/device_env.sh
nvidia-smi topo -m > "$LOGS/topo.txt" 2>&1
timeout 240 python3 -m pytest -q -ra -s -p no:cacheprovider -o faulthandler_timeout=150 -m gpu ${TESTS:-\
    tests/engine/test_parallel_engine.py tests/engine/test_parallel_graphs_gpu.py} > "$OUT/tests.log" 2>&1
echo "tests exit $? after $(( $(date +%s) - start )) s: $(tail -1 "$OUT/tests.log")"
# NCCL_DEBUG=INFO: the transport NCCL picked between the GPUs ("via P2P/..." or "via SHM": no peer access)
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT timeout 120 python3 -m bench.allreduce --world "$(nvidia-smi -L | wc -l)" \
    --out "$OUT/allreduce.json" > "$OUT/allreduce.log" 2>&1
echo "allreduce exit $?"; grep -E "^ +[0-9]|unavailable" "$OUT/allreduce.log"; grep -m2 -E " via " "$OUT/allreduce.log"
if [ "${EAGER_PROFILE:-0}" = 1 ]; then  # then the same with one CPU thread per rank (contention between ranks?)
    for threads in default 1; do
        ( [ "$threads" = 1 ] && export OMP_NUM_THREADS=1
          timeout 120 python3 -m bench.parallel --device cuda --model "${MODEL:-gpt-oss-120b}" \
            --splits "$(echo "${SPLITS:-4x4}" | cut -d, -f1)" --graphs off --parts b1,profile --b1-out 32 \
            --out "$OUT/parallel_eager_threads_$threads.json" > "$OUT/parallel_eager_threads_$threads.log" 2>&1
          echo "eager profile (threads $threads) exit $?" )
        grep -A1 "^\[" "$OUT/parallel_eager_threads_$threads.log" | head -4
    done
fi
left=$(( LIMIT_S - ($(date +%s) - start) - 240 ))  # kv_transfer and disaggregated run after it
# SIGABRT: faulthandler prints where rank 0 stood when the time ran out
timeout -s ABRT "$left" python3 -X faulthandler -m bench.parallel --device cuda --model "${MODEL:-gpt-oss-120b}" --splits "${SPLITS:-4x4,4x1,1x4}" \
    --out "$OUT/parallel.json" "$@" > "$OUT/parallel.log" 2>&1
echo "bench.parallel exit $? after $(( $(date +%s) - start )) s"
[ "${SKIP_KV:-0}" = 1 ] || timeout 45 python3 -m bench.kv_transfer --json "$OUT/kv_transfer.json" --decode-device "cuda:$(( $(nvidia-smi -L | wc -l) - 1 ))" \
    > "$OUT/kv_transfer.log" 2>&1
echo "kv_transfer exit $?"
gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -ge 2 ]; then
    if [ "$gpus" -ge 4 ]; then split="--tp 2 --ep 2 --decode-device cuda:2"; else split="--tp 1 --ep 1 --decode-device cuda:1"; fi
    timeout 170 python3 -m bench.disaggregated --device cuda --model "${MODEL:-gpt-oss-120b}" $split \
        --prefill-device cuda:0 --kv-cache-mb 16384 --out "$OUT/disaggregated.json" > "$OUT/disaggregated.log" 2>&1
    echo "disaggregated exit $?"; grep -E "^\[" "$OUT/disaggregated.log" | tail -4
fi
pack_logs
grep -vE "Warn|warn" "$OUT/parallel.log" | tail -12
tail -5 "$OUT/kv_transfer.log"
