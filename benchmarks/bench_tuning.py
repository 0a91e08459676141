"""How steady `--cpu-conv auto`'s choice of conv kernels is on this CPU: tunes a preset's small-map conv shapes
afresh `--times` times (as a run does before its timer) and prints, for each shape and pass, how often the
matmul won and oneDNN's and the matmul's best times (median over the tunings). A choice that flips between
tunings is a near-tie or the machine's noise. `--one-after-the-other` times each kernel's calls in one go
instead of alternating them, as the tuning did before 2026-12-07, for comparison.

    python benchmarks/bench_tuning.py [--preset fast94] [--times 5] [--one-after-the-other]

Random data of each conv's shape, bf16, channels-last. Writes logs/bench_tuning-*.json."""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import core  # noqa: E402
import torch_backend as tb  # noqa: E402
import train_cifar  # noqa: E402

def preset_shapes(preset):
    """The small-map conv shapes a CPU run of the preset tunes (met while its FLOPs are counted, as in a run)."""
    cfg = train_cifar.make_config(preset, cpu_conv="tuned", precision="bf16")
    device = torch.device("cpu")
    model = train_cifar.build_model(cfg, device)
    opt = train_cifar.make_optimizer(cfg, model)
    with tb.recording_small_map_shapes() as shapes:
        train_cifar.run_flops(cfg, model, opt, device, "bf16", core.CIFAR10_TRAIN_IMAGES)
    return sorted(shapes)


def one_after_the_other(fns, repeats):
    return [tb.time_conv_pass([fn], repeats)[0] for fn in fns]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="fast94", choices=sorted(train_cifar.PRESETS),
                    help="whose small-map convs to tune")
    ap.add_argument("--times", type=int, default=5, help="tunings, each afresh")
    ap.add_argument("--one-after-the-other", action="store_true", help="time each kernel's calls in one go")
    ap.add_argument("--log-dir", default="logs", type=core.folder_option, help="where the JSON result goes")
    args = ap.parse_args(argv)
    if args.times < 1:
        ap.error("--times must be at least 1")
    shapes = preset_shapes(args.preset)
    if not shapes:
        sys.exit(f"error: {args.preset} has no small-map bf16 convs to tune")
    timer = one_after_the_other if args.one_after_the_other else tb.time_conv_pass
    hardware = tb.device_name(torch.device("cpu"))
    print(f"{args.preset}: {len(shapes)} shapes, {args.times} tunings "
          f"({'one kernel after the other' if args.one_after_the_other else 'alternating'}); {hardware}")
    tunings = []
    for i in range(args.times):
        tb.forget_tuned_kernels()
        start = time.perf_counter()
        timings = tb.tune_small_map_convs(shapes, timer=timer)
        tunings.append({tb.conv_shape_name(key): {name: list(pair) for name, pair in passes.items()}
                        for key, passes in timings.items()})
        took = [f"{shape} {p}" for shape, passes in tunings[-1].items() for p, pair in passes.items()
                if tb.matmul_wins(*pair)]
        print(f"tuning {i + 1}: {time.perf_counter() - start:.1f} s; the matmul for {', '.join(took) or 'nothing'}",
              flush=True)
    table = core.Table(["shape", "pass", "matmul won", "oneDNN ms", "matmul ms", "ratio"], width=20)
    rows = []
    for key in shapes:
        for p in tb.CONV_PASSES:
            pairs = [t[tb.conv_shape_name(key)][p] for t in tunings]
            rows.append(dict(shape=tb.conv_shape_name(key), conv_pass=p,
                             matmul_won=sum(tb.matmul_wins(*pair) for pair in pairs),
                             onednn_ms=1e3 * statistics.median(o for o, _ in pairs),
                             matmul_ms=1e3 * statistics.median(m for _, m in pairs)))
            r = rows[-1]
            table.row({"shape": r["shape"], "pass": p, "matmul won": f"{r['matmul_won']}/{args.times}",
                       "oneDNN ms": f"{r['onednn_ms']:.1f}", "matmul ms": f"{r['matmul_ms']:.1f}",
                       "ratio": f"{r['matmul_ms'] / r['onednn_ms']:.2f}"})
    if args.log_dir:
        date = core.utc_timestamp()
        path = core.stamped_log_path(args.log_dir, "bench_tuning", date)
        core.write_json_atomic(path, dict(
            preset=args.preset, hardware=hardware, torch=torch.__version__, commit=core.git_commit(), date=date,
            timing="one after the other" if args.one_after_the_other else "alternating", repeats=tb.TUNE_REPEATS,
            margin=tb.TUNE_MARGIN, tunings=tunings, summary=rows))
        print(f"log: {path}")


if __name__ == "__main__":
    core.exit_with(main)
