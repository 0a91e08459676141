#!/usr/bin/env bash
# One process against torchrun with two, five seeds each: does data-parallel training reach the same accuracy
# (within the run-to-run spread)? A small fast94-sgd (widths 16/32/32, schedule shrunk to 5 epochs) so that ten
# runs fit in about an hour of a 2-core CPU. Logs go to logs/ddp-check/ (README: "Many devices"). fp32 as there:
# those logs are fp32 because their AVX2 CPU has no bf16; auto would pick bf16 on a CPU that has it.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-${CIFAR10_DATA:-./data}}
SMALL=(--preset fast94-sgd --widths 16 32 32 --epochs 5 --lr-knots 0 1.15 5 --runs 5 --seed 0 --data "$DATA" --device cpu
       --precision fp32 --log-dir logs/ddp-check)
OMP_NUM_THREADS=1 python train_cifar.py "${SMALL[@]}"
OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 train_cifar.py "${SMALL[@]}"
