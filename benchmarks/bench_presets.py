"""For each preset: training FLOPs per run, training images/s and achieved FLOP/s on this hardware, also as a
share of the machine's practical peak (a large matmul in the same precision, measured first).

    python benchmarks/bench_presets.py [--presets fast94 resnet9] [--steps 5] [--repeats 3] [--compile]

Times full training steps (augmentation, forward, backward, update) on random data of CIFAR-10's shape after
a warm-up, so it needs no data set; mean ± std over repeats. Writes logs/bench_presets-*.json."""
import argparse
import datetime
import math
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


def measure(preset, device, steps, repeats, compile=False, overrides=None):
    cfg = train_cifar.make_config(preset, **dict(overrides or {}, compile=compile))
    precision = tb.resolve_precision(cfg["precision"], device)
    bs, pad = cfg["batch_size"], cfg["pad"]
    gen = torch.Generator(device=device).manual_seed(0)
    x_all = torch.randn(N_TRAIN, 32 + 2 * pad, 32 + 2 * pad, 3, generator=gen, device=device).to(tb.DTYPES[precision])
    y_all = torch.randint(0, 10, (N_TRAIN,), generator=gen, device=device)
    model = train_cifar.build_model(cfg, device)
    opt = train_cifar.make_optimizer(cfg, model)
    if cfg["bn_group_size"]:  # ghost batch norm, as run_once sets it up
        parallel.convert_bn(model, cfg["bn_group_size"])
    step_fn = train_cifar.make_step_fn(cfg, model, world=1)  # compiled with --compile
    flops_step = train_cifar.step_flops(cfg, model, opt, device, precision, bs)
    run_steps = math.ceil(train_cifar.steps_per_epoch(cfg, N_TRAIN) * cfg["epochs"])
    aug = tb.draw_augmentation(N_TRAIN, pad, cfg["cutout"], cfg["flip"] != "none", gen, device)
    sync = tb.synchronizer(device)

    def step(i):
        sl = slice((i * bs) % (N_TRAIN - bs), (i * bs) % (N_TRAIN - bs) + bs)
        idx = torch.arange(sl.start, sl.stop, device=device)
        x = tb.augment(x_all, idx, {k: v[sl] for k, v in aug.items()}, cutout=cfg["cutout"])
        train_cifar.train_step(cfg, step_fn, opt, x, y_all[idx], precision, device)

    for i in range(3 if compile else 2):  # warm-up (and compilation)
        step(i)
    rates = []
    for r in range(repeats):
        sync()
        t = time.perf_counter()
        for i in range(steps):
            step(i)
        sync()
        rates.append(steps * bs / (time.perf_counter() - t))
    img_s = core.mean_std(rates)
    return dict(preset=preset, overrides=overrides or {}, compile=compile, precision=precision, batch_size=bs,
                flops_per_step=flops_step,
                train_flops_per_run=flops_step * run_steps, img_per_s=img_s,
                tflop_per_s=(img_s[0] * flops_step / bs / 1e12, img_s[1] * flops_step / bs / 1e12),
                est_train_time_s=run_steps * bs / img_s[0])


def matmul_peak(device, precision, size=None, repeats=5):
    """The machine's practical peak: TFLOP/s of a large square matmul in the runs' precision (the best case a
    conv net's kernels can approach), mean ± std over repeats after a warm-up."""
    size = size or (8192 if device.type == "cuda" else 2048)
    dtype = tb.DTYPES[precision]
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = tb.synchronizer(device)
    a @ b
    rates = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        for _ in range(3):
            a @ b
        sync()
        rates.append(3 * 2 * size ** 3 / (time.perf_counter() - t) / 1e12)
    return core.mean_std(rates)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=list(train_cifar.PRESETS), choices=list(train_cifar.PRESETS))
    p.add_argument("--steps", type=int, default=5, help="training steps per timed repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="time the torch.compile'd step (compiled in the warm-up)")
    p.add_argument("--device", default=None)
    p.add_argument("--log-dir", default="logs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override an option of every preset, e.g. --set batch_size=2048")
    a = p.parse_args()
    try:
        overrides = core.parse_overrides(a.set)
        for preset in a.presets:
            train_cifar.make_config(preset, **overrides)
    except ValueError as e:
        p.error(str(e))
    device = torch.device(a.device) if a.device else tb.default_device()
    info = dict(hardware=tb.device_name(device), torch=torch.__version__, commit=core.git_commit(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                steps=a.steps, repeats=a.repeats, compile=a.compile, overrides=overrides,
                threads=torch.get_num_threads(), ld_preload=os.environ.get("LD_PRELOAD", ""))
    precision = tb.resolve_precision(train_cifar.make_config(a.presets[0], **overrides)["precision"], device)
    info["matmul_peak_tflop_per_s"] = peak = matmul_peak(device, precision)
    print(f"{info['hardware']}, torch {torch.__version__}; matmul peak ({precision}): {peak[0]:.3f} ± {peak[1]:.3f} "
          f"TFLOP/s")
    table = core.Table(["preset", "precision", "PF/run", "img/s", "±", "TFLOP/s", "% peak", "est_time_s"], width=11)
    results = []
    for preset in a.presets:
        r = measure(preset, device, a.steps, a.repeats, a.compile, overrides)
        results.append(r)
        table.row({"preset": preset, "precision": r["precision"], "PF/run": r["train_flops_per_run"] / 1e15,
                   "img/s": round(r["img_per_s"][0]), "±": round(r["img_per_s"][1]),
                   "TFLOP/s": r["tflop_per_s"][0], "% peak": f"{100 * r['tflop_per_s'][0] / peak[0]:.0f}%",
                   "est_time_s": round(r["est_train_time_s"])})
        if a.log_dir:  # rewritten after each preset so an interrupted benchmark keeps what it measured
            os.makedirs(a.log_dir, exist_ok=True)
            path = os.path.join(a.log_dir, f"bench_presets-{info['date'][:19].replace(':', '')}.json")
            core.write_json_atomic(path, dict(info, results=results))
    if a.log_dir:
        print(f"log: {path}")


if __name__ == "__main__":
    main()
