#!/usr/bin/env bash
# Every GPU number the README still lacks, in one prepared run that fits a short GPU lease (~9 min on an H200),
# most wanted first. Each step's logs are packed into $OUT/gpu-logs.tar.gz as soon as it ends, so a run cut
# short by its time limit still returns what finished.
#
#   DATA=/path/to/cifar10.npz OUT=/tmp/out bash benchmarks/gpu_session.sh
#
# Then: tar -xzf gpu-logs.tar.gz -C logs/   (the JSON/TSV logs; the steps' console output is in gpu-session.txt)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${DATA:?set DATA to the CIFAR-10 .npz}" "${OUT:?set OUT to the folder that comes back}"
export PYTHONUNBUFFERED=1
LOGS=$(mktemp -d)
REPORT="$OUT/gpu-session.txt"

step() {  # step NAME COMMAND...: run, keep its output, pack the logs so far
    local name=$1; shift
    echo "=== $name: $* ($(date -u +%H:%M:%S))" | tee -a "$REPORT"
    "$@" 2>&1 | tee -a "$REPORT"
    echo "=== $name: exit ${PIPESTATUS[0]}" | tee -a "$REPORT"
    tar -czf "$OUT/gpu-logs.tar.gz" -C "$LOGS" .
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$REPORT"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$REPORT"

# 1. fast94 (#3): n = 20, compiled outside the timer.
step fast94-compile-n20 python train_cifar.py --preset fast94 --data "$DATA" --device cuda --compile true \
    --runs 20 --log-dir "$LOGS"
# 2. resnet9 (#2): n = 5.
step resnet9-n5 python train_cifar.py --preset resnet9 --data "$DATA" --device cuda --runs 5 --log-dir "$LOGS"
# 2b. resnet9-tricks (#3) and fast94-sgd, the SGD recipe fast94 replaced (#3): n = 5 each.
step resnet9-tricks-n5 python train_cifar.py --preset resnet9-tricks --data "$DATA" --device cuda --runs 5 \
    --log-dir "$LOGS"
step fast94-sgd-n5 python train_cifar.py --preset fast94-sgd --data "$DATA" --device cuda --compile true \
    --runs 5 --log-dir "$LOGS"
# 2c. fast95 (#3): n = 5 (about 10 s a run).
step fast95-n5 python train_cifar.py --preset fast95 --data "$DATA" --device cuda --compile true --runs 5 \
    --log-dir "$LOGS"
# 2d. fast96 (#3): n = 3 (a run is about 3x fast95's FLOPs).
step fast96-n3 python train_cifar.py --preset fast96 --data "$DATA" --device cuda --compile true --runs 3 \
    --log-dir "$LOGS"
# 3. Throughput and achieved FLOP/s of every preset, eager and compiled (#3).
step bench-presets python benchmarks/bench_presets.py --device cuda --log-dir "$LOGS"
step bench-presets-compile python benchmarks/bench_presets.py --device cuda --compile --log-dir "$LOGS"
# 4. fast94-sgd (the recipe of the large-batch study) at larger batches with linear LR scaling and warm-up (#6):
#    the largest that still reaches 94%.
for bs in 2048 4096; do
    step "fast94-sgd-bs$bs" python train_cifar.py --preset fast94-sgd --data "$DATA" --device cuda --compile true \
        --batch-size "$bs" --lr-scaling linear --warmup-epochs 1 --runs 5 --log-dir "$LOGS"
done
# 5. resnet18 (#2): the DAWNBench baseline, as many runs as the lease leaves time for.
step resnet18 python train_cifar.py --preset resnet18 --data "$DATA" --device cuda --runs 2 --log-dir "$LOGS"
echo "done $(date -u +%H:%M:%S)" | tee -a "$REPORT"
