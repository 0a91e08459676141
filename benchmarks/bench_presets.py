"""For each preset: training FLOPs per run, training images/s and achieved FLOP/s on this hardware, also as a
share of the machine's practical peak (a large matmul in the same precision, measured first).

    python benchmarks/bench_presets.py [--presets fast94 resnet9] [--steps 5] [--repeats 3] [--compile]
    python benchmarks/bench_presets.py --flops-only     # FLOPs per run of every preset, counted in seconds
    python benchmarks/bench_presets.py --breakdown --compile --presets fast94   # where a step's time goes

Times full training steps (augmentation, forward, backward, update; with data selection also scoring the
candidates, and the proxy's own training steps) on random data of CIFAR-10's shape after a warm-up, so it needs
no data set; mean ± std over repeats. img/s counts the images trained on. Writes logs/bench_presets-*.json."""
import argparse
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


def kind_name(side, trains):
    """A kind of step by its image side and what trains (train_cifar.trains_in), as the logs key its time: "24
    with the whitening bias frozen, block 1 frozen"; the parts never frozen go unnamed."""
    parts = ["the whitening bias"] + [f"block {i}" for i in range(1, len(trains))]
    said = [f"{part} {'trained' if flag else 'frozen'}" for part, flag in zip(parts, trains) if flag is not None]
    return f"{side} with {', '.join(said)}" if said else f"{side}"


def time_steps(step, sync, steps, repeats, warm_up):
    """Seconds per call of step(i): mean ± std over repeats of `steps` calls, after `warm_up` calls."""
    for i in range(warm_up):
        step(i)
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        for i in range(steps):
            step(i)
        sync()
        times.append((time.perf_counter() - t) / steps)
    return core.mean_std(times)


def measure(preset, device, steps, repeats, compile=False, overrides=None, breakdown=False, profile=False):
    cfg = train_cifar.make_config(preset, **dict(overrides or {}, compile=compile))
    precision = tb.resolve_precision(cfg["precision"], device)
    bs, pad = cfg["batch_size"], cfg["pad"]
    drawn = train_cifar.candidate_batch_size(cfg)  # with data selection, the candidates a step scores
    gen = torch.Generator(device=device).manual_seed(0)
    x_all = torch.randn(N_TRAIN, 32 + 2 * pad, 32 + 2 * pad, 3, generator=gen, device=device).to(tb.DTYPES[precision])
    y_all = torch.randint(0, 10, (N_TRAIN,), generator=gen, device=device)
    model = train_cifar.build_model(cfg, device)
    opt = train_cifar.make_optimizer(cfg, model)
    if cfg["bn_group_size"]:  # ghost batch norm, as run_once sets it up
        parallel.convert_bn(model, cfg["bn_group_size"])
    step_fn = train_cifar.make_step_fn(cfg, model, world=1)  # compiled with --compile
    with tb.recording_small_map_shapes() as conv_shapes:  # (as a run does: its tuned CPU kernels, timed first)
        flops_step, run_steps, flops_run = train_cifar.run_flops(cfg, model, opt, device, precision, N_TRAIN)
    kernels = None
    if tb.resolve_cpu_conv(cfg["cpu_conv"]) == "tuned" and device.type == "cpu":
        kernels = train_cifar.tune_cpu_convs(conv_shapes)
    aug = tb.draw_augmentation(N_TRAIN, pad, cfg["cutout"], cfg["flip"] != "none", gen, device,
                               jitter=cfg["color_jitter"])
    sync = tb.synchronizer(device)
    proxy = train_cifar.Proxy(cfg, None, None, device, precision) if train_cifar.uses_proxy(cfg) else None
    # select_by loss: each candidate's loss when last trained on (inf: never yet), as a run keeps it
    history = torch.full((N_TRAIN,), math.inf, device=device) if train_cifar.uses_loss_history(cfg) else None
    if proxy is not None and compile:  # as a run does: else the proxy's training compiles inside the timed steps
        proxy.warm_up(drawn, set(cfg["train_sizes"]) | {train_cifar.IMAGE_SIZE})  # (fast96: 55 ± 76 ms a step)
    scaler = train_cifar.make_loss_scaler(cfg, precision, device)  # fp16: the run's loss scale (a step's own work)
    proxy_calls = [0]  # over warm-up and repeats, so a proxy_every-th of the timed steps train it
    losses = []  # a fast step is worth nothing if it computes NaN (as compiled resnet18 did on a CPU)

    def batch(i, n, side):
        """Images, labels and indices of batch i of n candidates; by loss history, the batch_size chosen of them
        (before augmentation, as a run chooses)."""
        start = (i * n) % (N_TRAIN - n + 1)  # (+ 1: a batch of all N_TRAIN images starts at 0)
        idx = torch.arange(start, start + n, device=device)
        keep = history[idx].topk(bs, sorted=False).indices if history is not None else slice(None)
        idx = idx[keep]
        x = tb.augment(x_all, idx, {k: v[start:start + n][keep] for k, v in aug.items()}, cutout=cfg["cutout"])
        return tb.resize_images(x, side), y_all[idx], idx

    def step(i, side):
        x, y, idx = batch(i, drawn, side)
        if proxy is not None:  # scoring, and the proxy's own training step every proxy_every steps, as in a run
            proxy_calls[0] += 1
            x, y = proxy.select(x, y, bs, 1e-3, train=proxy_calls[0] % cfg["proxy_every"] == 0)
        out, loss = train_cifar.train_step(cfg, step_fn, opt, x, y, precision, device, scaler)
        if history is not None:  # the run's bookkeeping: each trained example's loss, for its next choice
            train_cifar.record_losses(history, idx, out, y, cfg["label_smoothing"], 1)
        losses.append(loss.detach())

    # Each kind of step the run takes (image size of progressive resizing, the whitening bias and blocks trained
    # or frozen) is timed on its own and weighted by the run's steps of that kind.
    kinds = train_cifar.step_kinds(cfg, N_TRAIN)
    seconds = {}
    for side, trains in sorted(set(kinds), key=str):  # by side (then by what trains), not in the run's order
        train_cifar.set_trains(model, trains)
        seconds[side, trains] = time_steps(lambda i: step(i, side), sync, steps, repeats, warm_up=3 if compile else 2)
    train_cifar.set_trains(model, kinds[-1][1])  # as the run ends, for the breakdown
    est_time = sum(seconds[kind][0] for kind in kinds)
    est_std = sum(seconds[kind][1] for kind in kinds)  # the kinds' errors added, not in quadrature: an upper bound
    per_step = (est_time / run_steps, est_std / run_steps)
    result = dict(preset=preset, overrides=overrides or {}, compile=compile, precision=precision, batch_size=bs,
                candidates_per_step=drawn, flops_per_step=flops_step, train_flops_per_run=flops_run,
                img_per_s=(bs / per_step[0], bs * per_step[1] / per_step[0] ** 2),
                tflop_per_s=(flops_run / est_time / 1e12, flops_run * est_std / est_time ** 2 / 1e12),
                est_train_time_s=est_time, losses_finite=bool(torch.stack(losses).isfinite().all()),
                seconds_per_step_by_size={kind_name(*kind): t for kind, t in seconds.items()},
                cpu_conv_kernels=kernels)
    if breakdown:  # each part of a full-size step alone, synchronised: what the step's time is made of
        side = kinds[-1][0]
        x, y, _ = batch(0, drawn, side)
        parts = dict(batch=lambda i: batch(i, drawn, side),
                     forward_backward=lambda i: train_cifar.forward_backward(cfg, model, step_fn, x[:bs], y[:bs],
                                                                             precision, device),
                     optimizer=lambda i: opt.step())
        result["seconds_by_part"] = {name: time_steps(fn, sync, steps, repeats, warm_up=2)
                                     for name, fn in parts.items()}
        # host time to issue a full step: near the step's own time, the GPU waits on Python and kernel launches
        host = []
        for i in range(repeats * steps):
            sync()
            t = time.perf_counter()
            step(i, side)
            host.append(time.perf_counter() - t)
            sync()
        result["host_seconds_per_step"] = core.mean_std(host)
        result["step_seconds_at_full_size"] = seconds[kinds[-1]]
    if profile:  # a full-size step: the GPU's kernels, or on a CPU its ops by their own (self) time
        from torch.profiler import ProfilerActivity, profile as torch_profile
        cuda = device.type == "cuda"
        with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            for i in range(steps):
                step(i, kinds[-1][0])
            sync()
        if cuda:
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            result["kernels_per_step"] = len(kernels) / steps
            print(f"{preset}: {len(kernels) / steps:.0f} GPU kernels per step")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
        else:
            ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            result["cpu_op_seconds_per_step"] = {e.key: e.self_cpu_time_total / 1e6 / steps for e in ops[:20]}
            total = sum(e.self_cpu_time_total for e in ops) / 1e6 / steps
            print(f"{preset}: a full-size step's ops, {total:.3f} s of their own time a step")
            for name, seconds in result["cpu_op_seconds_per_step"].items():
                print(f"  {name:48s} {1e3 * seconds:9.1f} ms  {100 * seconds / total:5.1f}%")
    return result


def count_only(preset, overrides=None):
    """A preset's training FLOPs, counted on PyTorch's meta device (shapes only, no arithmetic: instant on any
    machine), with the parts data selection adds: scoring the candidates and training the proxy."""
    meta = torch.device("meta")
    cfg = train_cifar.make_config(preset, **dict(overrides or {}, precision="fp32"))
    model = train_cifar.build_model(cfg, meta)
    opt = train_cifar.make_optimizer(cfg, model)
    parts = train_cifar.run_flops_parts(cfg, model, opt, meta, "fp32", N_TRAIN)
    return dict(preset=preset, overrides=overrides or {}, batch_size=cfg["batch_size"],
                candidates_per_step=train_cifar.candidate_batch_size(cfg), flops_per_step=parts["last_step"],
                net_flops_per_step=parts["last_step_net"], scoring_flops_per_step=parts["last_step_scoring"],
                train_steps=parts["steps"], proxy_train_flops=parts["proxy_training"],
                train_flops_per_run=parts["total"])


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
    p.add_argument("--presets", nargs="+", default=list(train_cifar.PRESETS), choices=list(train_cifar.PRESETS),
                   help="presets to measure (default: all)")
    p.add_argument("--steps", type=int, default=5, help="training steps per timed repeat")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per preset (mean ± std)")
    p.add_argument("--compile", action="store_true", help="time the torch.compile'd step (compiled in the warm-up)")
    tb.add_device_option(p)
    p.add_argument("--log-dir", default="logs", type=core.folder_option, help="where the JSON result goes")
    p.add_argument("--flops-only", action="store_true",
                   help="only count each preset's FLOPs (on the meta device, instant) and time nothing")
    p.add_argument("--breakdown", action="store_true",
                   help="also time each part of a step alone (batch, forward+backward, optimizer) and the host's time "
                        "to issue a step")
    p.add_argument("--profile", action="store_true",
                   help="print torch.profiler's top GPU kernels (on a CPU: ops) of a full-size step")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override an option of every preset, e.g. --set batch_size=2048")
    a = p.parse_args()
    if a.steps < 1 or a.repeats < 1:
        p.error("--steps and --repeats must be at least 1")
    try:
        overrides = core.parse_overrides(a.set)
    except ValueError as e:
        p.error(str(e))
    device = a.device or tb.default_device()
    # (each was accepted and did nothing; --compile is kept: it does not change the count, and it lets a timing
    # command, --set compile_mode included, be checked by adding --flops-only, as tests/test_gpu_session.py does)
    idle = [f"--{k}" for k in ("breakdown", "profile") if getattr(a, k)]
    if a.flops_only and idle:
        p.error(f"--flops-only times nothing: {' and '.join(idle)} would have no effect")
    if "compile" in overrides:  # (measure() sets it from --compile: a --set compile=true was silently dropped)
        p.error("--set compile=: use --compile")
    if "compile_mode" in overrides and not a.compile:  # (train_cifar's "--compile true" is this script's --compile)
        p.error("--set compile_mode= has no effect without --compile")
    for preset in a.presets:
        try:
            # (with --flops-only nothing runs: FLOPs are counted in fp32 on the meta device)
            cfg = train_cifar.make_config(preset, **dict(overrides, compile=a.compile))  # (as measure() builds it)
            train_cifar.check_runnable(cfg, N_TRAIN, None if a.flops_only else device)
            train_cifar.check_given(cfg, overrides, as_set=True)
        except ValueError as e:
            p.error(f"{preset}: {e}")
    if a.flops_only:
        info = dict(commit=core.git_commit(), torch=torch.__version__, overrides=overrides,
                    date=core.utc_timestamp())
        table = core.Table(["preset", "PF/run", "TF/step", "steps", "scoring", "proxy PF"], width=11)
        results = [count_only(preset, overrides) for preset in a.presets]
        for r in results:
            table.row({"preset": r["preset"], "PF/run": r["train_flops_per_run"] / 1e15,
                       "TF/step": r["flops_per_step"] / 1e12, "steps": r["train_steps"],
                       "scoring": f"{100 * r['scoring_flops_per_step'] / r['net_flops_per_step']:.1f}%",
                       "proxy PF": r["proxy_train_flops"] / 1e15})
        if a.log_dir:
            path = core.stamped_log_path(a.log_dir, "flops_presets", info["date"])
            core.write_json_atomic(path, dict(info, results=results))
            print(f"log: {path}")
        return
    info = dict(hardware=tb.device_name(device), torch=torch.__version__, commit=core.git_commit(),
                date=core.utc_timestamp(),
                steps=a.steps, repeats=a.repeats, compile=a.compile, overrides=overrides,
                threads=torch.get_num_threads(), ld_preload=os.environ.get("LD_PRELOAD", ""))
    precision = tb.resolve_precision(train_cifar.make_config(a.presets[0], **overrides)["precision"], device)
    info["matmul_peak_tflop_per_s"] = peak = matmul_peak(device, precision)
    print(f"{info['hardware']}, torch {torch.__version__}; matmul peak ({precision}): {peak[0]:.3f} ± {peak[1]:.3f} "
          f"TFLOP/s")
    table = core.Table(["preset", "precision", "PF/run", "img/s", "±", "TFLOP/s", "% peak", "est_time_s"], width=11)
    results = []
    for preset in a.presets:
        r = measure(preset, device, a.steps, a.repeats, a.compile, overrides, a.breakdown, a.profile)
        results.append(r)
        table.row({"preset": preset, "precision": r["precision"], "PF/run": r["train_flops_per_run"] / 1e15,
                   "img/s": round(r["img_per_s"][0]), "±": round(r["img_per_s"][1]) if a.repeats > 1 else "-",
                   "TFLOP/s": r["tflop_per_s"][0], "% peak": f"{100 * r['tflop_per_s'][0] / peak[0]:.0f}%",
                   "est_time_s": round(r["est_train_time_s"])})
        if a.breakdown:
            parts = ", ".join(f"{name} {1e3 * m:.2f} ± {1e3 * sd:.2f}"
                              for name, (m, sd) in r["seconds_by_part"].items())
            full, host = r["step_seconds_at_full_size"], r["host_seconds_per_step"]
            print(f"  {preset} ms per step at full size: {1e3 * full[0]:.2f} ± {1e3 * full[1]:.2f} (host issues it in "
                  f"{1e3 * host[0]:.2f} ± {1e3 * host[1]:.2f}); parts alone: {parts}")
        if not r["losses_finite"]:
            print(f"warning: {preset}'s timed steps gave a NaN or infinite loss; this timing is of a broken step")
        if a.log_dir:  # rewritten after each preset so an interrupted benchmark keeps what it measured
            path = core.stamped_log_path(a.log_dir, "bench_presets", info["date"])
            core.write_json_atomic(path, dict(info, results=results))
    if a.log_dir:
        print(f"log: {path}")


if __name__ == "__main__":
    core.exit_with(main)
