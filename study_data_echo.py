"""Data-echoing study (Choi et al. 2019): fresh examples and wall-clock time to a target accuracy, per echo mode
and echo factor, over several seeds.

    python study_data_echo.py --workload cpu --data cifar10.npz                # small net, ~1-2 min a run on a CPU
    python study_data_echo.py --workload gpu94 --pipeline loader --seeds 5      # fast94-sgd to 94%: the GPU study
    python study_data_echo.py --seeds 1 --factors 1 2 --modes batch --train-subset 2000 --target 0.15 \\
        --set epochs=8 --set "widths=(8,16,16)" --out /tmp/echo-smoke     # a smoke test (seconds)

Every run is train_cifar.train(..., stop_at_target=True). Factor 1 is the no-echo baseline (mode "none"), run
once per seed. Each finished run is appended to OUT/results.jsonl at once, so an interrupted study loses at most
the run in flight (a line torn by a crash is cut off); run the same command again to resume (finished runs are
skipped). OUT/summary.{tsv,json}
hold mean, std and n per mode x factor and the speed-ups over the baseline; OUT/echo_study.png plots fresh
examples to target against the echo factor, with the lines "echoed data worth as much as fresh" (baseline / e)
and "echoed data worth nothing" (baseline).

The study also measures R = t_upstream / t_downstream for the chosen pipeline: t_upstream is the time per
global batch the pipeline alone delivers (iterated without training, after a warm-up), t_downstream the time of
a training step on a ready batch (measured once per output folder, kept in OUT/r.json). Echoing can only speed
wall-clock time up when R > 1, by at most min(e, R) (upstream and training overlapped, as with DataLoader
workers) or (R + 1) / (R / e + 1) (one after the other, as in the device pipeline); the summary sets the
measured wall-clock speed-up beside these bounds.

Budget: by default every run has the workload's schedule and step budget (same hyper-parameters, so an echo
run that needs more steps than the budget is reported as not reaching the target). --budget fresh gives a run
with factor e e times the steps (LR knots and every other setting in epochs stretched alike), i.e. the same
budget of fresh examples. Runs are evaluated every `eval_every_steps` steps (the workload's; without TTA,
outside the timer) and at every epoch end, so steps, fresh examples and time to target are resolved to that.
"""
import argparse
import collections
import json
import math
import os
import sys
import time

import torch

import core
import pipeline
import torch_backend as tb
import train_cifar

DEFAULT_MODES = ("example-before-aug", "example-after-aug", "batch")

# A workload is a preset, overrides and a target. `cpu` is sized for a 2-core CPU: alone on a 2-thread AMD EPYC
# (bf16) an epoch takes about 24 s, and a 4-epoch version of this schedule reached 85.4% (72.8% after epoch 3);
# gpu94 is the real thing.
WORKLOADS = {
    "cpu": dict(preset="fast94-sgd", about="fast94-sgd at widths 32/64/64, batch 512, 6 epochs, 80% without TTA",
                overrides=dict(widths=(32, 64, 64), batch_size=512, epochs=6, lr_knots=(0, 1, 6),
                               lr_values=(0.3, 1.5, 0.1), whiten_bias_epochs=1, lookahead_start_epoch=1, tta=0,
                               target=0.80, eval_every_steps=24)),
    "gpu94": dict(preset="fast94-sgd", about="fast94-sgd (9.9 epochs, TTA at the end) to 94%",
                  overrides=dict(target=0.94, eval_every_steps=12)),
}



# Named by describe_config itself (or set per run by the study); any other --set option follows as key=value.
DESCRIBED_OPTIONS = {"widths", "batch_size", "epochs", "target", "tta", "eval_every_steps", "echo", "echo_factor",
                     "pipeline", "echo_shuffle_buffer"}


def describe_config(cfg, given=(), budget="steps"):
    """What every run trains, from its effective train_cifar config (after --set and --target), not the workload's
    description: a header restating the defaults misled about what ran. given: the --set keys."""
    net = cfg["preset"] + (" at widths " + "/".join(map(str, cfg["widths"])) if cfg["widths"] else "")
    epochs = f"{cfg['epochs']:g} epoch{'s' if cfg['epochs'] != 1 else ''}"
    epochs += " (x e at echo factor e)" if budget == "fresh" else ""
    bits = [net, f"batch {cfg['batch_size']}", epochs,
            f"{cfg['target'] * 100:g}% " + ("with TTA at the end" if cfg["tta"] else "without TTA")]
    if cfg["eval_every_steps"]:
        bits.append(f"evaluated every {cfg['eval_every_steps']} steps")
    return ", ".join(bits + [f"{k}={cfg[k]}" for k in sorted(given) if k not in DESCRIBED_OPTIONS])


# ---------------------------------------------------------------------------------------------------------------
# R = t_upstream / t_downstream

def measure_r(preset, overrides, data, device, batches=10, warmup=3, log=print):
    """Seconds per global batch of the pipeline alone (no echo) and per training step on a ready batch."""
    cfg = train_cifar.make_config(preset, **dict(overrides, echo="none", echo_factor=1.0))
    sync = tb.synchronizer(device)
    precision = tb.resolve_precision(cfg["precision"], device)
    on_device = tb.to_device(data, device, tb.DTYPES[precision], pad=cfg["pad"])
    if cfg["pipeline"] == "loader":
        on_device.update(raw_train_x=data["train_x"], raw_train_y=data["train_y"])
    gen = torch.Generator(device=device).manual_seed(0)
    stream_cls = pipeline.LoaderStream if cfg["pipeline"] == "loader" else pipeline.BatchStream
    stream = stream_cls(on_device, cfg, gen, device)

    def timed(fn, n):
        sync()
        t = time.perf_counter()
        for _ in range(n):
            out = fn()
        sync()
        return (time.perf_counter() - t) / n, out

    timed(stream.next_batch, warmup)  # starts the workers and fills their prefetch queue
    t_up, (x, y) = timed(stream.next_batch, batches)
    if hasattr(stream, "close"):
        stream.close()

    model = train_cifar.build_model(cfg, device, on_device["train_x"], gen)
    opt = train_cifar.make_optimizer(cfg, model)
    for g in opt.param_groups:  # a small LR: the step costs the same, and the net stays finite
        g["lr"] = 1e-3 * g["lr_scale"]

    def step():
        train_cifar.train_step(cfg, model, opt, x, y, precision, device)
    timed(step, 2)
    t_down, _ = timed(step, batches)
    r = dict(pipeline=cfg["pipeline"], loader_workers=cfg["loader_workers"], batch_size=cfg["batch_size"],
             precision=precision, t_upstream_s=t_up, t_downstream_s=t_down, R=t_up / t_down, batches=batches,
             hardware=tb.device_name(device))
    log(f"R = t_upstream / t_downstream = {t_up * 1e3:.1f} ms / {t_down * 1e3:.1f} ms = {r['R']:.3f} "
        f"({cfg['pipeline']} pipeline, batch {cfg['batch_size']}, {precision})")
    return r


def overlapped(cfg):
    """Whether upstream work runs alongside training (DataLoader worker processes) or before each step."""
    return cfg["pipeline"] == "loader" and cfg["loader_workers"] > 0


def ideal_speedup(e, r, overlap):
    """Wall-clock speed-up of echo factor e if echoed examples were worth fresh ones, in units of a step."""
    if overlap:
        return max(r, 1.0) / max(r / e, 1.0)
    return (r + 1) / (r / e + 1)


# ---------------------------------------------------------------------------------------------------------------
# Runs and resume

def run_key(rec):
    return (rec["workload"], rec["pipeline"], rec["mode"], float(rec["factor"]), int(rec["seed"]))


class ResultsError(ValueError):
    pass


# Fields of a run record that resume and the summary read: key -> (test, what it must be, required). A record
# missing one failed deep inside them (KeyError; "abc" as fresh_to_target a ValueError in core.mean_std).
RUN_FIELDS = {**{k: (lambda v: isinstance(v, str), "a string", True) for k in ("workload", "pipeline", "mode")},
              "factor": (lambda v: core.is_number(v) and v >= 1, "a number >= 1", True),
              "seed": (core.is_whole, "a whole number", True),
              "reached": (lambda v: isinstance(v, bool), "true or false", True)}
# and what a run that reached the target measured
REACHED_FIELDS = {k: (lambda v: core.is_number(v) and v >= 0, "a number >= 0", True)
                  for k in ("fresh_to_target", "steps_to_target", "time_to_target_s")}


def read_results(path, repair=False, warn=lambda m: print(m, file=sys.stderr)):
    """Finished runs from the JSONL file (core.read_jsonl: a line torn by a crash skipped, or with repair cut
    off). A line that parses but is no run record (edited, or another file) is a ResultsError naming it."""
    records, seen = [], {}
    for n, rec in core.read_jsonl(path, repair, warn, error=ResultsError):
        problem = core.field_problem(rec, RUN_FIELDS) or (
            core.field_problem(rec, REACHED_FIELDS) if rec.get("reached") else None)
        if problem:
            raise ResultsError(f"{path}:{n} is not a run record of this study ({problem}); fix or remove that line")
        # A run found twice (two processes resuming one folder at once, or lines copied) counts once, the first:
        # else it counted twice in n, the means and the std
        key = (run_key(rec), json.dumps(rec.get("settings"), sort_keys=True))
        if key in seen:
            if seen[key] != rec:
                warn(f"warning: {path}:{n} is another record of a run already recorded (mode {rec['mode']}, "
                     f"factor {float(rec['factor']):g}, seed {rec['seed']}); the earlier is kept")
            continue
        seen[key] = rec
        records.append(rec)
    return records


def plan(modes, factors, seeds):
    """(mode, factor, seed) in the order they run: all settings of one seed before the next seed."""
    runs = []
    for seed in seeds:
        runs.append(("none", 1.0, seed))
        runs += [(m, float(f), seed) for m in modes for f in factors if f != 1]
    return runs


def stretch(preset, overrides, factor):
    """The schedule made `factor` times longer: every setting counted in epochs (of examples trained on)."""
    cfg = train_cifar.make_config(preset, **overrides)
    out = dict(overrides, epochs=cfg["epochs"] * factor, lr_knots=tuple(k * factor for k in cfg["lr_knots"]),
               warmup_epochs=cfg["warmup_epochs"] * factor, whiten_bias_epochs=cfg["whiten_bias_epochs"] * factor,
               block_epochs=tuple(e * factor for e in cfg["block_epochs"]))
    if cfg["lookahead_start_epoch"] >= 0:
        out["lookahead_start_epoch"] = cfg["lookahead_start_epoch"] * factor
    return out


def study_overrides(args, workload):
    """train_cifar options shared by every run of the study (and the R measurement)."""
    overrides = dict(workload["overrides"], **args.overrides, pipeline=args.pipeline,
                     echo_shuffle_buffer=args.echo_shuffle_buffer)
    if args.target is not None:
        overrides["target"] = args.target
    if args.loader_workers is not None:
        overrides["loader_workers"] = args.loader_workers
    return overrides


def run_overrides(args, workload, mode, factor):
    """train_cifar options of one run: the study's, its echoing, and its schedule stretched if the budget is fresh
    examples."""
    overrides = dict(study_overrides(args, workload), echo=mode, echo_factor=factor)
    if args.budget == "fresh" and factor != 1:
        overrides = stretch(workload["preset"], overrides, factor)
    return overrides


def one_run(args, workload, data, device, mode, factor, seed, log):
    overrides = run_overrides(args, workload, mode, factor)
    cfg = train_cifar.make_config(workload["preset"], **overrides)
    rec = dict(workload=args.workload, pipeline=args.pipeline, mode=mode, factor=factor, seed=seed,
               target=cfg["target"], reached=False, diverged=False)
    t = time.perf_counter()
    try:
        s = train_cifar.train(workload["preset"], data=data, device=device, log=log, log_dir=None, runs=1,
                              seed=seed, stop_at_target=True, **overrides)
        run = s["runs"][0]
        per_epoch = train_cifar.steps_per_epoch(cfg, len(data["train_y"]))
        total_steps = train_cifar.run_steps(cfg, len(data["train_y"]))
        ep = run["epoch_reached_target"]
        steps = run.get("step_reached_target")  # set when a step-interval evaluation (eval_every_steps) hit it
        if steps is None and ep is not None:  # else: at the end of epoch ep
            steps = min(ep * per_epoch, total_steps)
        rec.update(reached=ep is not None or steps is not None, fresh_to_target=run["fresh_to_target"],
                   steps_to_target=steps, epochs_to_target=steps / per_epoch if steps is not None else None,
                   examples_to_target=steps * cfg["batch_size"] if steps is not None else None,
                   time_to_target_s=run["time_to_target_s"], accuracy=run["accuracy"],
                   epochs_run=len(run["epochs"]), total_time_s=run["total_time_s"],
                   final_fresh=run["epochs"][-1]["fresh"],
                   test_acc_by_epoch=[r["test_acc"] for r in run["epochs"]],
                   evals=[[e["step"], e["fresh"], e["test_acc"]] for e in run.get("evals", [])],  # step, fresh, acc
                   hardware=s["hardware"], precision=s["precision"], commit=s["commit"])
    except train_cifar.Diverged as e:
        rec.update(diverged=True, error=str(e))
    rec.update(wall_s=time.perf_counter() - t, settings=args.settings,
               finished=core.utc_timestamp())
    return rec


# ---------------------------------------------------------------------------------------------------------------
# Summary and plot

def summarise(records, r_info, overlap):
    """Mean, std and n per (mode, factor), over reached runs; speed-ups against the factor-1 baseline."""
    groups = collections.defaultdict(list)
    for rec in records:
        groups[(rec["mode"], float(rec["factor"]))].append(rec)
    rows = []
    base = None
    for (mode, factor), recs in sorted(groups.items(), key=lambda kv: (kv[0][0] != "none", kv[0][0], kv[0][1])):
        ok = [r for r in recs if r["reached"]]
        fresh_m, fresh_s = core.mean_std([r["fresh_to_target"] for r in ok])
        time_m, time_s = core.mean_std([r["time_to_target_s"] for r in ok])
        steps_m, steps_s = core.mean_std([r["steps_to_target"] for r in ok])
        row = dict(mode=mode, factor=factor, n=len(recs), n_reached=len(ok), fresh_mean=fresh_m, fresh_std=fresh_s,
                   steps_mean=steps_m, steps_std=steps_s, time_mean_s=time_m, time_std_s=time_s)
        if mode == "none" and factor == 1:
            base = row
        rows.append(row)
    r = r_info["R"] if r_info else math.nan
    for row in rows:
        ok = base is not None and base["n_reached"] and row["n_reached"]
        row["fresh_speedup"] = base["fresh_mean"] / row["fresh_mean"] if ok else math.nan
        row["time_speedup"] = base["time_mean_s"] / row["time_mean_s"] if ok else math.nan
        row["min_e_R"] = min(row["factor"], r) if r_info else math.nan
        row["ideal_time_speedup"] = ideal_speedup(row["factor"], r, overlap) if r_info else math.nan
    return rows


SUMMARY_COLUMNS = ["mode", "factor", "n", "n_reached", "fresh_mean", "fresh_std", "steps_mean", "steps_std",
                   "time_mean_s", "time_std_s", "fresh_speedup", "time_speedup", "min_e_R", "ideal_time_speedup"]


def write_summary(out, rows, meta):
    with open(os.path.join(out, "summary.tsv.tmp"), "w") as f:
        f.write("\t".join(SUMMARY_COLUMNS) + "\n")
        for row in rows:
            cells = (f"{row[c]:.6g}" if isinstance(row[c], float) else str(row[c]) for c in SUMMARY_COLUMNS)
            f.write("\t".join(cells) + "\n")
    os.replace(os.path.join(out, "summary.tsv.tmp"), os.path.join(out, "summary.tsv"))
    core.write_json_atomic(os.path.join(out, "summary.json"), dict(meta, rows=rows))


def print_summary(rows, r_info, log=print):
    log(f"{'mode':>18} {'e':>4} {'n':>5} {'fresh to target':>21} {'time to target (s)':>19} "
        f"{'fresh x':>8} {'time x':>7} {'min(e,R)':>8} {'ideal x':>8}")
    def show(v, spec):  # "-" where nothing was measured (no run reached the target, no R), as study_batch_size.py
        return "-" if math.isnan(v) else format(v, spec)
    for row in rows:
        # one run has no spread ("± 0" would read as measured); none has no mean either ("nan ± nan")
        one = row["n_reached"] <= 1
        fresh_std, time_std = ("", "") if one else (f"± {row['fresh_std']:<6.0f}", f"± {row['time_std_s']:<6.1f}")
        log(f"{row['mode']:>18} {row['factor']:>4g} {row['n_reached']:>2}/{row['n']:<2} "
            f"{show(row['fresh_mean'], '.0f'):>12} {fresh_std:<8}"
            f"{show(row['time_mean_s'], '.1f'):>10} {time_std:<8}{show(row['fresh_speedup'], '.2f'):>8} "
            f"{show(row['time_speedup'], '.2f'):>7} {show(row['min_e_R'], '.2f'):>8} "
            f"{show(row['ideal_time_speedup'], '.2f'):>8}")
    if r_info:
        log(f"R = {r_info['R']:.3f}: " + ("the pipeline is the bottleneck, echoing can save wall-clock time"
                                          if r_info["R"] > 1 else
                                          "training is the bottleneck, echoing cannot save wall-clock time here "
                                          "(only fresh examples)"))


def plot(out, rows, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    base = next((r for r in rows if r["mode"] == "none"), None)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    factors = sorted({r["factor"] for r in rows} | {1.0})
    if base and base["n_reached"]:
        grid = [factors[0] + (factors[-1] - factors[0]) * i / 100 for i in range(101)]
        ax.plot(grid, [base["fresh_mean"] / e for e in grid], "k--", lw=1, label="echoed data worth as much as fresh")
        ax.plot(grid, [base["fresh_mean"]] * len(grid), "k:", lw=1, label="echoed data worth nothing")
    for mode in sorted({r["mode"] for r in rows} - {"none"}):
        pts = sorted([r for r in rows if r["mode"] == mode and r["n_reached"]], key=lambda r: r["factor"])
        if base and base["n_reached"]:
            pts = [base] + pts
        if pts:
            ax.errorbar([p["factor"] for p in pts], [p["fresh_mean"] for p in pts], yerr=[p["fresh_std"] for p in pts],
                        marker="o", capsize=3, label=mode)
            ax2.plot([p["factor"] for p in pts], [p["time_speedup"] for p in pts], marker="o", label=mode)
    if base and base["n_reached"] and len(rows) == 1:
        ax.errorbar([1], [base["fresh_mean"]], yerr=[base["fresh_std"]], marker="o", capsize=3, label="no echo")
    r_rows = sorted({(r["factor"], r["min_e_R"], r["ideal_time_speedup"]) for r in rows})
    if r_rows and not math.isnan(r_rows[0][1]):
        ax2.plot([f for f, _, _ in r_rows], [max(1.0, m) for _, m, _ in r_rows], "k--", lw=1, label="max(1, min(e, R))")
        ax2.plot([f for f, _, _ in r_rows], [i for _, _, i in r_rows], "k:", lw=1, label="ideal for this pipeline")
    ax.set(xlabel="echo factor e", ylabel="fresh examples to target", title=title, xticks=factors)
    ax2.set(xlabel="echo factor e", ylabel="wall-clock speed-up to target", title="wall-clock vs baseline",
            xticks=factors)
    for a in (ax, ax2):
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, "echo_study.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------------------
# Command line


# train_cifar options the study sets itself for every run (not settable with --set), each with the option of the
# study that sets it (a --set seed=3 failed every run with a TypeError, after R was measured).
STUDY_OPTIONS = {"seed": "--seed0", "runs": "--seeds", "stop_at_target": None, "echo": "--modes",
                 "echo_factor": "--factors", "pipeline": "--pipeline", "echo_shuffle_buffer": "--echo-shuffle-buffer"}


def parse_args(argv):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="cpu", choices=list(WORKLOADS),
                   help="; ".join(f"{k}: {w['about']}" for k, w in WORKLOADS.items()).replace("%", "%%"))
    p.add_argument("--pipeline", default="device", choices=["device", "loader"],
                   help="device: batched augmentation on the device; loader: per-image DataLoader workers")
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES),
                   choices=[m for m in pipeline.ECHO_MODES if m != "none"], help="echo modes to study")
    p.add_argument("--factors", nargs="+", type=float, default=[1, 2, 4], help="echo factors (1: the baseline)")
    p.add_argument("--seeds", type=int, default=3, help="number of seeds, from --seed0")
    p.add_argument("--seed0", type=int, default=0, help="the first seed")
    p.add_argument("--target", type=float, default=None, help="override the workload's target accuracy")
    p.add_argument("--budget", default="steps", choices=["steps", "fresh"],
                   help="steps: every run has the workload's step budget; fresh: e times the steps for factor e")
    p.add_argument("--echo-shuffle-buffer", type=int, default=0,
                   help="shuffle the echoed items through a buffer of this many (0: none)")
    p.add_argument("--loader-workers", type=int, default=None,
                   help="pipeline loader: worker processes (default: the workload's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other train_cifar option, e.g. --set epochs=2 --set precision=fp32")
    p.add_argument("--data", default=None, help="CIFAR-10 .npz, tarball or folder (default: $CIFAR10_DATA or ./data)")
    p.add_argument("--train-subset", type=int, default=0, metavar="N",
                   help="train on a fixed random N of the training images (smoke tests; 0: all)")
    tb.add_device_option(p)
    p.add_argument("--out", default=None, help="output folder (default logs/echo-<workload>-<pipeline>)")
    p.add_argument("--r-batches", type=int, default=10, help="timed batches for t_upstream and t_downstream")
    p.add_argument("--no-r", action="store_true", help="do not measure R (an R already in OUT/r.json is still used)")
    p.add_argument("--remeasure-r", action="store_true", help="measure R again although OUT/r.json has it")
    p.add_argument("--verbose", action="store_true", help="print every run's per-epoch table")
    args = p.parse_args(argv)
    args.modes = core.distinct_values("--modes", args.modes)
    args.factors = core.distinct_values("--factors", args.factors, show=lambda f: f"{f:g}")
    if any(f < 1 for f in args.factors) or args.seeds < 1:
        p.error("factors must be >= 1 and --seeds >= 1")
    if args.loader_workers is not None and args.pipeline != "loader":  # (ignored, yet a setting a resume compared)
        p.error("--loader-workers has no effect without --pipeline loader")
    if args.no_r and args.remeasure_r:  # (--no-r won: R was silently not measured)
        p.error("--no-r and --remeasure-r contradict each other; give one")
    if args.train_subset < 0 or args.r_batches < 1:
        p.error("--train-subset must be >= 0 (0: all) and --r-batches >= 1")
    if args.train_subset > core.CIFAR10_TRAIN_IMAGES:  # (trained on all of them while the settings recorded N)
        p.error(f"--train-subset {args.train_subset} exceeds CIFAR-10's {core.CIFAR10_TRAIN_IMAGES} "
                "training images")
    try:
        args.overrides = core.parse_overrides(args.set)
        taken = sorted(set(args.overrides) & set(STUDY_OPTIONS))
        if taken:
            instead = sorted({STUDY_OPTIONS[k] for k in taken} - {None})
            raise ValueError(f"--set {', '.join(taken)}: the study sets {'these' if len(taken) > 1 else 'this'} "
                             "itself for every run"
                             + (f" (see {', '.join(instead)})" if instead else ""))
        twice = [k for k in ("target", "loader_workers") if k in args.overrides and getattr(args, k) is not None]
        if twice:
            raise ValueError(f"--set {twice[0]}= and --{twice[0].replace('_', '-')} both given; give it once")
        workload = WORKLOADS[args.workload]
        train_cifar.make_config(workload["preset"], **dict(workload["overrides"], **args.overrides))
        for mode, factor, _ in plan(args.modes, args.factors, [0]):  # every run's options, before any run
            train_cifar.check_given(train_cifar.make_config(workload["preset"],
                                                            **run_overrides(args, workload, mode, factor)),
                                    args.overrides, as_set=True)
    except ValueError as e:
        p.error(str(e))
    args.out = args.out or os.path.join("logs", f"echo-{args.workload}-{args.pipeline}")
    # What must not change within one output folder (a resumed study must measure the same thing).
    args.settings = dict(workload=args.workload, pipeline=args.pipeline, target=args.target, budget=args.budget,
                         echo_shuffle_buffer=args.echo_shuffle_buffer, loader_workers=args.loader_workers,
                         train_subset=args.train_subset,
                         overrides={k: list(v) if isinstance(v, tuple) else v
                                    for k, v in sorted(args.overrides.items())})
    return p, args


def main(argv=None):
    """The study; an interrupt outside its runs (loading or PNG-encoding the data, writing the summary) is one
    line and 130 too, not a traceback: results.jsonl is appended to run by run, so it holds every finished run."""
    try:
        return study(argv)
    except KeyboardInterrupt:
        print(f"\n{os.path.basename(sys.argv[0]) or 'study_data_echo.py'}: interrupted; finished runs are kept, "
              "run the same command to resume", file=sys.stderr, flush=True)
        sys.exit(130)


def study(argv=None):
    parser, args = parse_args(argv)
    workload = WORKLOADS[args.workload]
    try:
        os.makedirs(core.writable_folder(args.out, "--out"), exist_ok=True)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    results_path = os.path.join(args.out, "results.jsonl")

    def load_results(repair=False):
        try:
            return read_results(results_path, repair=repair)
        except ResultsError as e:
            parser.exit(2, f"{parser.prog}: error: {e}\n")
    records = load_results(repair=True)

    def refuse_other_settings(settings, but=()):
        """Exit if a stored run's settings differ from `settings` (keys in `but` not compared)."""
        strip = lambda d: {k: v for k, v in d.items() if k not in but} if isinstance(d, dict) else d  # noqa: E731
        mismatched = [r for r in records if strip(r.get("settings")) != strip(settings)]
        if mismatched:
            why = core.settings_difference(strip(mismatched[0].get("settings")), strip(settings))
            parser.exit(2, f"{parser.prog}: error: {results_path} holds runs with other settings ({why}); "
                           "use another --out\n")
    refuse_other_settings(args.settings, but=("data",))  # before the data are loaded; with them below
    done = {run_key(r) for r in records}
    todo = [(m, f, s) for m, f, s in plan(args.modes, args.factors, range(args.seed0, args.seed0 + args.seeds))
            if (args.workload, args.pipeline, m, f, s) not in done]
    overrides = study_overrides(args, workload)
    cfg = train_cifar.make_config(workload["preset"], **overrides)
    about = describe_config(cfg, args.overrides, args.budget)
    print(f"study: workload {args.workload} ({about}), {args.pipeline} pipeline, modes "
          f"{' '.join(args.modes)}, factors {' '.join(f'{f:g}' for f in args.factors)}, {args.seeds} seed(s); "
          f"{len(done)} run(s) already in {results_path}, {len(todo)} to go", flush=True)

    device = args.device or tb.default_device()
    try:
        data = tb.load_cifar10(args.data or train_cifar.default_data_path())
    except tb.DataError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    try:
        data = tb.train_subset(data, args.train_subset, args.data or train_cifar.default_data_path())
    except tb.DataError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    # The data's identity joins the settings: a folder of a subset must not resume on the full data (or vice versa)
    fingerprint = tb.dataset_fingerprint(data)
    args.settings["data"] = fingerprint
    refuse_other_settings(args.settings)
    try:  # what train() would refuse, refused before R is measured or any run trains
        for mode, factor, _ in plan(args.modes, args.factors, [0]):
            train_cifar.check_runnable(train_cifar.make_config(workload["preset"],
                                                               **run_overrides(args, workload, mode, factor)),
                                       len(data["train_y"]), device)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if args.pipeline == "loader":  # encode once here, so no run's timer pays for it (the cache is per array)
        t = time.perf_counter()
        pipeline.encode_pngs(data["train_x"])
        print(f"PNG-encoded {len(data['train_x'])} training images in {time.perf_counter() - t:.1f} s", flush=True)

    summary_path, r_path = os.path.join(args.out, "summary.json"), os.path.join(args.out, "r.json")
    r_info = None
    if os.path.exists(r_path) and not args.remeasure_r:  # one R per study, so a resumed study keeps its own
        try:
            with open(r_path, "rb") as f:
                r_info = json.load(f)
            problem = (f"{json.dumps(r_info)[:40]} is not a JSON object" if not isinstance(r_info, dict) else
                       None if core.is_number(r_info.get("R")) and r_info["R"] >= 0 else
                       f'"R" is {json.dumps(r_info.get("R"))[:40]}, not a number >= 0')
        except ValueError as e:  # (a UnicodeDecodeError too)
            problem = f"not JSON: {e}"
        if problem:  # written atomically, so not a crash: an edit, or another file
            parser.exit(2, f"{parser.prog}: error: {r_path} is not an R measurement of this study ({problem}); "
                           "remove it or pass --remeasure-r\n")
        if r_info.get("data") != fingerprint:  # (R depends on the data's size: not another data set's R)
            print(f"{r_path} holds R of other data (or of unrecorded data); "
                  + ("not used (--no-r)" if args.no_r else "measuring it again"), flush=True)
            r_info = None
        else:
            print(f"R = {r_info['R']:.3f} (measured {r_info.get('measured', '?')}, from {r_path}; "
                  "--remeasure-r to redo)")
    if r_info is None and not args.no_r:
        try:
            with core.sigterm_as_interrupt():
                r_info = measure_r(workload["preset"], overrides, data, device, batches=args.r_batches,
                                   log=lambda m: print(m, flush=True))
        except KeyboardInterrupt:  # like an interrupt during the runs: a message and 130, not a traceback
            print(f"\ninterrupted while measuring R: nothing written to {r_path}, finished runs are kept; "
                  "run the same command to resume", flush=True)
            sys.exit(130)
        r_info.update(measured=core.utc_timestamp(), data=fingerprint)
        core.write_json_atomic(r_path, r_info)

    def finish(status):
        records_now = [r for r in load_results() if r.get("settings") == args.settings]
        rows = summarise(records_now, r_info, overlapped(cfg))
        meta = dict(workload=args.workload, about=about, pipeline=args.pipeline, settings=args.settings,
                    config={k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}, r=r_info,
                    overlapped_pipeline=overlapped(cfg), runs=len(records_now), status=status,
                    written=core.utc_timestamp(),
                    note="means over runs that reached the target; speed-ups are baseline mean / mean")
        write_summary(args.out, rows, meta)
        png = plot(args.out, rows, f"{args.workload}, {args.pipeline} pipeline, target {cfg['target']:g}")
        print_summary(rows, r_info)
        results = f"{results_path}, " if os.path.exists(results_path) else ""  # (interrupted before any run ended)
        print(f"wrote {results}{os.path.join(args.out, 'summary.tsv')}, {summary_path}, {png}", flush=True)

    log = print if args.verbose else (lambda *a: None)
    t0, walls = time.perf_counter(), []
    try:
        with core.sigterm_as_interrupt():
            for i, (mode, factor, seed) in enumerate(todo, 1):
                rec = one_run(args, workload, data, device, mode, factor, seed, log)
                core.append_jsonl(results_path, rec)
                walls.append(rec["wall_s"])
                eta = sum(walls) / len(walls) * (len(todo) - i)
                if rec["reached"]:
                    what = (f"reached at step {rec['steps_to_target']} (epoch {rec['epochs_to_target']:.2f}), "
                            f"fresh {rec['fresh_to_target']:,}, {rec['time_to_target_s']:.1f} s to target")
                else:
                    what = ("DIVERGED" if rec["diverged"] else
                            f"did not reach {rec['target']:g} (acc {rec['accuracy']:.4f})")
                elapsed = core.format_duration(time.perf_counter() - t0)
                print(f"[{i}/{len(todo)}] {mode:>18} e={factor:<4g} seed {seed}: {what} (run {rec['wall_s']:.0f} s) | "
                      f"elapsed {elapsed}, ETA {core.format_duration(eta)}", flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted: the run in flight is lost, finished runs are kept; run the same command to resume",
              flush=True)
        finish("interrupted")
        sys.exit(130)
    finish("complete")


if __name__ == "__main__":
    core.exit_with(main)
