"""Where a preset's training step spends its convolution time: for every conv of the net, at the preset's batch
size and precision, the forward, the gradient with respect to the input (dgrad) and with respect to the weights
(wgrad), each timed alone and as achieved TFLOP/s, so a reader sees which kernel keeps a step off the machine's
peak (on a 2-core AMX CPU in bf16: the wgrad kernels, 1.5-9x slower than the same conv's forward). Each part is
timed twice where it can be: PyTorch's own kernel (oneDNN on CPUs) and the same sums as one matmul over the
unfolded input (tb.SmallMapConv), which is the evidence for where tb.Conv2d takes the matmul (--cpu-conv).

    python benchmarks/bench_convs.py [--preset fast94] [--repeats 5] [--batch-size N] [--image-size 24]

Random data of each conv's shape (layouts as in a run: channels-last, the autocast dtype); mean ± std over repeats
after a warm-up. dgrad is skipped where a run needs none (the first conv's input is the data), wgrad where the
weights are frozen (the whitening conv), the matmul where SmallMapConv does not apply (strided or biased convs).
The step totals add each part's kernel as a run with --cpu-conv matmul picks it (on any CPU), oneDNN's alone,
and as the default --cpu-conv auto (tuned) would pick it by these timings. Writes logs/bench_convs-*.json
(seconds_per_step: oneDNN's; seconds_per_step_as_run and run_takes_matmul: auto's choice, which in logs before
2026-12-06 was the fixed matmul rule on AMX CPUs and oneDNN's elsewhere, as their cpu_conv_auto says;
seconds_per_step_matmul_mode and matmul_mode_takes_matmul: the fixed rule's)."""
import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import core  # noqa: E402
import torch_backend as tb  # noqa: E402
import train_cifar  # noqa: E402
from bench_presets import time_steps  # noqa: E402


def conv_layers(model, device, image_size=32):
    """(name, module, input shape without the batch, whether a run needs the input's gradient) of every Conv2d,
    in forward order, found by running two images through the net (in eval mode, so its BN statistics stay)."""
    found = []

    def hook(name):
        def record(module, inputs):
            found.append((name, module, tuple(inputs[0].shape[1:]), bool(inputs[0].requires_grad)))
        return record
    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    was_training = model.training
    try:
        model.eval()(torch.zeros(2, 3, image_size, image_size, device=device))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return found


def measure_conv(module, in_shape, need_dgrad, batch_size, dtype, device, repeats, matmul=False):
    """Times and FLOPs of one conv's forward, dgrad and wgrad at batch_size (None for a part a run skips); with
    matmul, those of tb.SmallMapConv's matmuls (None where it does not apply)."""
    sync = tb.synchronizer(device)
    x = torch.randn(batch_size, *in_shape, device=device).to(dtype).to(memory_format=torch.channels_last)
    w = module.weight.detach().to(dtype).contiguous(memory_format=torch.channels_last)
    args = dict(stride=module.stride, padding=module.padding, dilation=module.dilation, groups=module.groups)
    y = F.conv2d(x, w, **args)
    gy = torch.randn_like(y)
    flops = 2 * y.numel() * w[0].numel()  # multiply-adds of one pass; dgrad and wgrad each cost the same

    def backward(mask):
        return lambda: torch.ops.aten.convolution_backward(
            gy, x, w, None, list(module.stride), list(module.padding), list(module.dilation), False, [0, 0],
            module.groups, mask)
    parts = {"fwd": lambda: F.conv2d(x, w, **args),
             "dgrad": backward([True, False, False]) if need_dgrad else None,
             "wgrad": backward([False, True, False]) if module.weight.requires_grad else None}
    if matmul:
        ok = isinstance(module, tb.Conv2d) and module.matmul_applies()
        parts = {"fwd": (lambda: tb.matmul_conv(x, w)) if ok else None,
                 "dgrad": (lambda: tb.matmul_conv_input_grad(gy, w)) if ok and need_dgrad else None,
                 "wgrad": (lambda: tb.matmul_conv_weight_grad(gy, x, w.shape[2]))
                 if ok and module.weight.requires_grad else None}

    def seconds(fn):  # mean ± std over repeats of one call each, after one warm-up call
        return time_steps(lambda _: fn(), sync, 1, repeats, warm_up=1)
    return flops, {k: seconds(f) if f else None for k, f in parts.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default=train_cifar.DEFAULT_PRESET, choices=list(train_cifar.PRESETS),
                   help="whose convs to time (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=0, help="default: the preset's")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per kernel (mean ± std)")
    p.add_argument("--image-size", type=int, default=32, help="input side (24: fast94's progressively resized epochs)")
    tb.add_device_option(p)
    p.add_argument("--log-dir", default="logs", type=core.folder_option, help="where the JSON result goes")
    a = p.parse_args()
    if a.repeats < 1 or a.batch_size < 0 or not train_cifar.MIN_TRAIN_SIZE <= a.image_size <= train_cifar.IMAGE_SIZE:
        p.error(f"--repeats must be >= 1, --batch-size >= 0 and --image-size in "
                f"{train_cifar.MIN_TRAIN_SIZE}..{train_cifar.IMAGE_SIZE}")
    device = a.device or tb.default_device()
    cfg = train_cifar.make_config(a.preset)
    precision = tb.resolve_precision(cfg["precision"], device)
    batch_size = a.batch_size or cfg["batch_size"]
    # the kernels --cpu-conv matmul picks, not this CPU's auto choice (oneDNN's without AMX), so the `*` and the
    # second total say what the matmuls would give here
    model = train_cifar.build_model(dict(cfg, cpu_conv="matmul"), device)
    info = dict(preset=a.preset, hardware=tb.device_name(device), torch=torch.__version__, commit=core.git_commit(),
                date=core.utc_timestamp(),
                precision=precision, batch_size=batch_size, image_size=a.image_size, repeats=a.repeats,
                threads=torch.get_num_threads(),
                cpu_conv_auto=tb.resolve_cpu_conv("auto") if device.type == "cpu" else None)
    print(f"{a.preset}, batch {batch_size}, {a.image_size} px, {precision}; {info['hardware']}, "
          f"torch {torch.__version__}")
    parts = ("fwd", "dgrad", "wgrad")
    table = core.Table(["conv", "in", "out"] + [f"{p}_{c}" for p in parts for c in ("ms", "TF/s", "mm_ms")],
                       width=10)
    results = []
    totals = {k: dict.fromkeys(parts, 0.0) for k in ("onednn", "matmul_mode", "as_run")}
    for name, module, in_shape, need_dgrad in conv_layers(model, device, a.image_size):
        flops, t = measure_conv(module, in_shape, need_dgrad, batch_size, tb.DTYPES[precision], device, a.repeats)
        t_mm = measure_conv(module, in_shape, need_dgrad, batch_size, tb.DTYPES[precision], device, a.repeats,
                            matmul=True)[1]
        with tb.autocast(precision, device):  # the kernels a run picks for each part (tb.Conv2d.small_map_mode)
            mode = module.small_map_mode(torch.empty(1, *in_shape, device=device)) if isinstance(
                module, tb.Conv2d) else None
        takes_mm = {p: bool(mode and mode[i]) and t_mm[p] is not None for i, p in enumerate(parts)}
        # auto tunes: within the matmul's range, per pass the matmul where it wins (tb.matmul_wins; a run times
        # both itself before its timer, these timings stand in for that here)
        tuned_mm = {p: mode is not None and t_mm[p] is not None and t[p] is not None
                    and tb.matmul_wins(t[p][0], t_mm[p][0]) for p in parts}
        row = {"conv": name, "in": "x".join(map(str, in_shape)), "out": module.out_channels}
        for part in parts:
            mean_std, mm = t[part], t_mm[part]
            row[f"{part}_ms"] = f"{1e3 * mean_std[0]:.1f}" if mean_std else "-"
            row[f"{part}_TF/s"] = flops / mean_std[0] / 1e12 if mean_std else "-"
            row[f"{part}_mm_ms"] = (f"{1e3 * mm[0]:.1f}" + ("*" if takes_mm[part] else "")) if mm else "-"
            totals["onednn"][part] += mean_std[0] if mean_std else 0.0
            totals["matmul_mode"][part] += (mm if takes_mm[part] else mean_std or (0.0,))[0]
            totals["as_run"][part] += (mm if tuned_mm[part] else mean_std or (0.0,))[0]
        table.row(row)
        results.append(dict(conv=name, input_shape=in_shape, out_channels=module.out_channels, flops=flops,
                            seconds=t, matmul_seconds=t_mm, matmul_mode_takes_matmul=takes_mm,
                            run_takes_matmul=tuned_mm))
    print("(* the kernel a run takes with --cpu-conv matmul)")
    for which, label in (("onednn", "oneDNN's kernels alone"), ("matmul_mode", "as --cpu-conv matmul picks them"),
                         ("as_run", "as --cpu-conv auto (tuned, the default) would pick them by these timings")):
        tot = totals[which]
        total = sum(tot.values())
        print(f"conv time per step, {label}: " + ", ".join(f"{k} {1e3 * v:.0f} ms ({100 * v / total:.0f}%)"
                                                           for k, v in tot.items()) + f"; all {1e3 * total:.0f} ms")
    if a.log_dir:
        path = core.stamped_log_path(a.log_dir, f"bench_convs-{a.preset}", info["date"])
        core.write_json_atomic(path, dict(info, results=results, seconds_per_step=totals["onednn"],
                                           seconds_per_step_matmul_mode=totals["matmul_mode"],
                                           seconds_per_step_as_run=totals["as_run"]))
        print(f"log: {path}")


if __name__ == "__main__":
    core.exit_with(main)
