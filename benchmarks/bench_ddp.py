"""Training throughput of one preset with 1 process or N processes under torchrun (the same global batch).

    python benchmarks/bench_ddp.py --preset fast94-sgd                       # 1 process
    torchrun --nproc_per_node 2 benchmarks/bench_ddp.py --preset fast94-sgd  # 2 processes (gloo on CPU, NCCL on GPU)

Times full data-parallel training steps (augmentation of the rank's slice, forward, backward, gradient
all-reduce, update) on random data of CIFAR-10's shape, after a warm-up; mean ± std of images/s over repeats.
Each process trains on global_batch / N images a step, so images/s compare directly across N. torchrun sets
OMP_NUM_THREADS=1 per process unless it is set; the threads each process used are logged. Rank 0 appends its
result to logs/bench_ddp.jsonl (one line per invocation: world size, threads, hardware, torch, commit)."""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import core  # noqa: E402
import parallel  # noqa: E402
import torch_backend as tb  # noqa: E402
import train_cifar  # noqa: E402

N_TRAIN = 50000


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default=train_cifar.DEFAULT_PRESET, choices=list(train_cifar.PRESETS),
                   help="whose training step to time (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="training steps per timed repeat")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (mean ± std)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="preset overrides")
    p.add_argument("--out", default="logs/bench_ddp.jsonl", help="JSONL file rank 0 appends to ('' for none)")
    a = p.parse_args()
    if min(a.steps, a.repeats) < 1 or a.warmup < 0:
        p.error("--steps and --repeats must be at least 1, --warmup at least 0")
    # What train() would refuse, and an --out that cannot be written, fail here: before the process group
    # exists (each rank on its own, none waits for another) and before a measurement is taken and lost.
    try:
        overrides = core.parse_overrides(a.set)
        cfg = train_cifar.make_config(a.preset, **overrides)
        train_cifar.check_given(cfg, overrides, as_set=True)
        train_cifar.check_runnable(cfg, N_TRAIN, tb.default_device(),
                                   int(os.environ.get("WORLD_SIZE", 1)) if "RANK" in os.environ else 1)
        if cfg["select_fraction"] < 1:  # its steps would be timed without the selection
            raise ValueError("this times plain data-parallel steps, without data selection: time a preset with "
                             "select-fraction below 1 with bench_presets.py, or --set select_fraction=1")
        if a.out:
            core.writable_file(a.out, "--out")
    except ValueError as e:
        p.error(str(e))
    rank, world, local_rank = parallel.init_distributed()
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    precision = tb.resolve_precision(cfg["precision"], device)
    bs, pad, local_bs = cfg["batch_size"], cfg["pad"], cfg["batch_size"] // world
    gen = torch.Generator(device=device).manual_seed(0)
    x_all = torch.randn(N_TRAIN, 32 + 2 * pad, 32 + 2 * pad, 3, generator=gen, device=device).to(tb.DTYPES[precision])
    y_all = torch.randint(0, 10, (N_TRAIN,), generator=gen, device=device)
    torch.manual_seed(0)  # the same initial weights on every rank, as DDP expects
    model = train_cifar.build_model(cfg, device)
    opt = train_cifar.make_optimizer(cfg, model)
    if cfg["bn_group_size"]:  # the net as a run builds it: ghost BN, synchronised BN, the all-reduce hook
        parallel.convert_bn(model, cfg["bn_group_size"])
    if world > 1 and cfg["sync_bn_group_size"]:
        parallel.convert_sync_bn(model, parallel.bn_process_groups(world, cfg["sync_bn_group_size"]))
    step_fn = train_cifar.make_step_fn(cfg, model, world)
    aug = tb.draw_augmentation(N_TRAIN, pad, cfg["cutout"], cfg["flip"] != "none", gen, device,
                               jitter=cfg["color_jitter"])
    sync = tb.synchronizer(device)

    def step(i):
        start = (i * bs) % (N_TRAIN - bs + 1) + rank * local_bs  # (+ 1: a batch of all N_TRAIN starts at 0)
        idx = torch.arange(start, start + local_bs, device=device)
        x = tb.augment(x_all, idx, {k: v[start:start + local_bs] for k, v in aug.items()}, cutout=cfg["cutout"])
        train_cifar.train_step(cfg, step_fn, opt, x, y_all[idx], precision, device)

    for i in range(a.warmup):
        step(i)
    rates = []
    for r in range(a.repeats):
        if world > 1:
            torch.distributed.barrier()
        sync()
        t = time.perf_counter()
        for i in range(a.steps):
            step(i)
        sync()
        elapsed = torch.tensor(time.perf_counter() - t)
        if world > 1:  # a step is done when the slowest rank is done
            torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
        rates.append(a.steps * bs / elapsed.item())
    mean, std = core.mean_std(rates)
    if rank == 0:
        rec = dict(preset=a.preset, overrides=a.set, world_size=world, threads_per_process=torch.get_num_threads(),
                   batch_size=bs, precision=precision, steps=a.steps, repeats=a.repeats, img_per_s=[mean, std],
                   rates=rates, hardware=tb.device_name(device), torch=torch.__version__, commit=core.git_commit(),
                   date=core.utc_timestamp())
        rate = f"{mean:,.0f} ± {std:,.0f}" if a.repeats > 1 else f"{mean:,.0f}"  # one repeat has no spread
        print(f"{a.preset}: {world} process(es) x {torch.get_num_threads()} thread(s), global batch {bs}, "
              f"{precision}: {rate} img/s on {rec['hardware']}")
        if a.out:
            os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
            core.append_jsonl(a.out, rec)
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    core.exit_with(main)
