#!/usr/bin/env bash
# Every GPU number the README still lacks, in one prepared run that fits a short GPU lease, most wanted first.
# Each step's logs are packed into $OUT/gpu-logs.tar.gz as soon as it ends, so a run cut short by its time limit
# still returns what finished.
#
#   DATA=/path/to/cifar10.npz OUT=/tmp/out bash benchmarks/gpu_session.sh          # the records (#3)
#   OUT=/tmp/out bash benchmarks/gpu_session.sh smoke                                # first: a CUDA check
#   DATA=... OUT=... PRESET=fast96 RUNS=8 bash benchmarks/gpu_session.sh screen    # variants, paired seeds
#
# smoke trains every record preset for one epoch on random data of CIFAR-10's size, compiled: it finds a CUDA-only
# failure while the data set is still on its way, gives each preset's compile and epoch times (to size the runs
# below) and leaves the compiled kernels in /tmp/inductor for the real runs (the device machine keeps /tmp while it
# stays warm, but gets a fresh copy of the repo, ignored files gone, at every call: carry the data set's parts one
# per call and copy each to /tmp). Run counts: N94, N95, N96, NTRICKS (default 20, 5, 5, 5; 0 skips one; N94_GRAPHS
# runs fast94 under CUDA graphs too, N96_FP16 fast96 in fp16, REPRO reruns that many logged fast94 seeds
# with --from-log); SMOKE: the smoke's preset[:mode] list; SYNC_CHECK: the presets it runs under --sync-check;
# COMPILE_MODE: torch.compile's mode (train_cifar's --compile-mode); EXTRAS=1 adds the GPU runs of the closed
# issues' presets if time is left.
# GIT_COMMIT names the commit in the logs where the tree has no .git. Then: tar -xzf gpu-logs.tar.gz -C logs/
# DRY_RUN=FILE writes each step's command to FILE, one per line, instead of running anything (tests/test_gpu_session.py
# checks them on a CPU, so that a lease is not spent on a misspelt option); it writes nothing else and needs no OUT
# or DATA (an unset DATA is listed as $DATA).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor  # kept on the machine between calls
if [ -n "${DRY_RUN:-}" ]; then
    # shellcheck disable=SC2016  # a literal $DATA: a placeholder in the listed commands
    LOGS=/tmp/gpu-session-dry-run REPORT=/dev/null DATA=${DATA:-'$DATA'}
else
    : "${OUT:?set OUT to the folder that comes back}"
    LOGS=$(mktemp -d) REPORT="$OUT/gpu-session.txt"
fi

step() {  # step NAME SECONDS COMMAND...: run (killed after SECONDS), keep its output, pack the logs so far
    local name=$1 limit=$2; shift 2
    if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@" >> "$DRY_RUN"; echo >> "$DRY_RUN"; return; fi
    echo "=== $name: $* ($(date -u +%H:%M:%S))" | tee -a "$REPORT"
    timeout -k 20 "$limit" "$@" 2>&1 | tee -a "$REPORT"
    echo "=== $name: exit ${PIPESTATUS[0]} ($(date -u +%H:%M:%S))" | tee -a "$REPORT"
    tar -czf "$OUT/gpu-logs.tar.gz" -C "$LOGS" .
}

[ -n "${DRY_RUN:-}" ] || nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
    | tee -a "$REPORT"
[ -n "${DRY_RUN:-}" ] || python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
    | tee -a "$REPORT"

if [ "${1:-}" = smoke ]; then
    [ -n "${DRY_RUN:-}" ] || python - <<'EOF'
import numpy as np
rng = np.random.default_rng(0)
np.savez("/tmp/random-cifar.npz", train_x=rng.integers(0, 256, (50000, 32, 32, 3), dtype=np.uint8),
         train_y=np.arange(50000) % 10, test_x=rng.integers(0, 256, (10000, 32, 32, 3), dtype=np.uint8),
         test_y=np.arange(10000) % 10)
EOF
    # SMOKE: preset[:compile mode] items; fast94's second run shows what a later run's warm-up costs
    # under CUDA graphs, TORCH_LOGS=cudagraphs prints why inductor skips one ("mutated inputs" ...); silence: none
    for item in ${SMOKE:-fast94 fast95 fast96 fast94:reduce-overhead}; do
        p=${item%%:*}; mode=${item#"$p"}; mode=${mode#:}
        graphs_log=$([ "$mode" = reduce-overhead ] && echo TORCH_LOGS=cudagraphs)  # (an empty TORCH_LOGS fails)
        # shellcheck disable=SC2086  # empty, or the one assignment
        step "smoke-$item" 150 env $graphs_log python train_cifar.py --preset "$p" \
            --data /tmp/random-cifar.npz --device cuda \
            --compile true --compile-mode "${mode:-default}" --runs "$([ "$p" = fast94 ] && echo 2 || echo 1)" \
            --stop-after-epochs 1 --log-dir "$LOGS"
    done
    [ -n "${SMOKE:-}" ] || step smoke-resnet9-tricks 60 python train_cifar.py --preset resnet9-tricks \
        --data /tmp/random-cifar.npz --device cuda --runs 1 --stop-after-epochs 1 --log-dir "$LOGS"
    # The training steps never wait on the GPU: under --sync-check any host synchronisation in them is an error
    # (two epochs: every pass over the data after the first starts inside the steps)
    for p in ${SYNC_CHECK:-fast94 fast96}; do
        step "sync-check-$p" 90 python train_cifar.py --preset "$p" --data /tmp/random-cifar.npz --device cuda \
            --compile true --sync-check true --runs 1 --stop-after-epochs 2 --log-dir "$LOGS"
    done
    ! python -c "import pytest" 2>/dev/null || step tests-gpu 120 python -m pytest -q tests/test_gpu.py
    echo "done $(date -u +%H:%M:%S)" | tee -a "$REPORT"
    exit
fi

: "${DATA:?set DATA to the CIFAR-10 .npz}"
if [ "${1:-}" = screen ]; then
    # Variants of one preset on the same seeds (paired): VARIANTS holds one set of extra options per line, and
    # its default line '' is the preset itself, e.g. VARIANTS=$'\n--precision fp16' PRESET=fast96 RUNS=8.
    while IFS= read -r variant; do
        # shellcheck disable=SC2086  # a variant is several options
        step "screen ${PRESET:-fast96} ${variant:-as is}" "${LIMIT:-300}" python train_cifar.py --preset \
            "${PRESET:-fast96}" --data "$DATA" --device cuda --compile true --runs "${RUNS:-8}" --log-dir "$LOGS" \
            $variant
    done <<< "${VARIANTS-$'\n--precision fp16'}"
    echo "done $(date -u +%H:%M:%S)" | tee -a "$REPORT"
    exit
fi
MODE=(--compile-mode "${COMPILE_MODE:-default}")
preset() {  # preset NAME RUNS SECONDS ARGS...: a step of RUNS runs of a record preset; 0 runs skips it
    local name=$1 runs=$2 limit=$3; shift 3
    [ "$runs" = 0 ] || step "$name" "$limit" python train_cifar.py --preset "$name" --data "$DATA" --device cuda \
        --runs "$runs" --log-dir "$LOGS" "$@"
}
# 1. fast94 (#3): n = 20, compiled outside the timer.
preset fast94 "${N94:-20}" 300 --compile true "${MODE[@]}"
# 1b. fast94 with CUDA graphs (torch.compile's reduce-overhead), when N94_GRAPHS asks for it.
preset fast94 "${N94_GRAPHS:-0}" 300 --compile true --compile-mode reduce-overhead
# 1c. Does a GPU rerun the same bits? fast94's first REPRO seeds rerun from the H200's committed log (--from-log
# compares epoch by epoch), when REPRO asks.
[ "${REPRO:-0}" = 0 ] || step reproduce-fast94 200 python train_cifar.py \
    --from-log logs/fast94-20261204-163352-1899.json --data "$DATA" --device cuda --runs "$REPRO" --log-dir "$LOGS"
# 2. fast95 and fast96 (#3): n = 5 each.
preset fast95 "${N95:-5}" 200 --compile true "${MODE[@]}"
preset fast96 "${N96:-5}" 300 --compile true "${MODE[@]}"
# 2b. fast96 in fp16 (its loss scaled by a fixed 512), when N96_FP16 asks: airbench96 trains in fp16, whose
# 10-bit mantissa keeps 3 bits more than bf16's; fast96 in bf16 sits at 95.95% (n=9), airbench96 at 96.03%.
preset fast96 "${N96_FP16:-0}" 300 --compile true "${MODE[@]}" --precision fp16
# 3. resnet9-tricks (#3), eager as Myrtle ran it: n = 5.
preset resnet9-tricks "${NTRICKS:-5}" 120
# 4. Throughput and achieved FLOP/s of the record presets, compiled (#3).
step bench-presets 120 python benchmarks/bench_presets.py --device cuda --compile --breakdown \
    --presets fast94 fast95 fast96 resnet9-tricks --set compile_mode="${COMPILE_MODE:-default}" --log-dir "$LOGS"
# 5. Where fast94's step time goes: its top kernels and kernel launches per step.
step profile-fast94 120 python benchmarks/bench_presets.py --device cuda --compile --profile --presets fast94 \
    --steps 5 --repeats 1 --set compile_mode="${COMPILE_MODE:-default}" --log-dir "$LOGS"
if [ "${EXTRAS:-0}" = 1 ]; then  # closed issues' presets, for the history table's GPU column
    step resnet9 120 python train_cifar.py --preset resnet9 --data "$DATA" --device cuda --runs 5 --log-dir "$LOGS"
    step fast94-sgd 120 python train_cifar.py --preset fast94-sgd --data "$DATA" --device cuda --compile true \
        --runs 5 --log-dir "$LOGS"
    step resnet18 300 python train_cifar.py --preset resnet18 --data "$DATA" --device cuda --runs 2 \
        --log-dir "$LOGS"
fi
echo "done $(date -u +%H:%M:%S)" | tee -a "$REPORT"
