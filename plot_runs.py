"""Plot the training curves of logged runs: test accuracy (and training loss) per epoch or against time, one line
per run, with the target and each log's preset and seed in the legend.

    python plot_runs.py logs/fast94-2026*.json                      # -> runs.png
    python plot_runs.py logs/fast94-*.json --x time --out fast94.png
    python plot_runs.py logs/resnet9-*.json --reference logs/reference/myrtle-resnet9-v100.tsv

With --reference (a published per-epoch curve, see logs/reference/), it also prints each run's test accuracy
beside the reference's, epoch by epoch. Reads the JSON summaries train_cifar.py writes (several logs of one preset, e.g. seeds run by separate
invocations, plot together). The last point of a run is its final accuracy, with TTA where the recipe uses it."""
import argparse
import json
import math
import os
import sys

import core


LogError = core.LogError


def load_reference(path):
    """A published per-epoch curve (TSV with columns epoch, test_acc as a fraction): (label, epochs, accuracies)."""
    try:
        rows = core.read_tsv(path)
    except OSError as e:
        raise LogError(f"cannot read {path}: {e.strerror}") from None
    try:
        epochs = [int(r["epoch"]) for r in rows]
        acc = [float(r["test_acc"]) for r in rows]
    except (KeyError, ValueError):
        raise LogError(f"{path} is not a reference curve (a TSV with numeric epoch and test_acc columns)") from None
    if not rows or epochs != sorted(set(epochs)) or not all(0.0 <= a <= 1.0 for a in acc):
        raise LogError(f"{path}: epochs must increase and test_acc be fractions in [0, 1]")
    return os.path.splitext(os.path.basename(path))[0], epochs, acc


def comparison(summaries, references):
    """Rows of {epoch, <run label>: test accuracy, <reference label>: accuracy} over every epoch any of them has."""
    columns = {}
    for s in summaries:
        for run, (_, xs, acc, _) in zip([r for r in s["runs"] if r.get("epochs")], curves(s, "epoch")):
            columns[f"{s['preset']}-seed{run['seed']}"] = dict(zip(xs, acc))
    for label, epochs, acc in references:
        columns[label] = dict(zip(epochs, acc))
    epochs = sorted({e for c in columns.values() for e in c})
    return list(columns), [dict({"epoch": e}, **{k: c[e] for k, c in columns.items() if e in c}) for e in epochs]


RUN_KEYS = ("seed", "runs")  # differ between invocations of one configuration


def config_differences(summaries):
    """Per summary, its settings of the config keys on which the summaries differ (seed and runs aside; keys
    an older log lacks are not compared), as "key=value" strings: what tells their curves apart."""
    configs = [s.get("config", {}) for s in summaries]
    differ = core.differing_keys(configs, ignore=RUN_KEYS)

    def show(v):
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(show(u) for u in v) + "]"
        return f"{v:g}" if isinstance(v, float) else json.dumps(v)
    return [", ".join(f"{k}={show(c[k])}" for k in differ) for c in configs]


def curves(summary, x="epoch", tag=""):
    """One (label, xs, test accuracies, training losses) per run; epochs that were not evaluated are skipped
    for accuracy (NaN) but keep their loss. tag, if any, goes into each label (config_differences)."""
    if x not in ("epoch", "time"):
        raise LogError(f"x must be epoch or time, not {x!r}")
    out = []
    for run in summary["runs"]:
        rows = run.get("epochs") or []
        if not rows:
            continue
        xs = [r["epoch"] if x == "epoch" else r["total_time"] for r in rows]
        acc = [r["test_acc"] if r["test_acc"] is not None else math.nan for r in rows]
        label = f"{summary['preset']}{f' [{tag}]' if tag else ''} seed {run['seed']}"
        if run.get("accuracy") is not None:
            label += f": {100 * run['accuracy']:.2f}%"
        out.append((label, xs, acc, [r["train_loss"] for r in rows]))
    return out


def plot(summaries, out, x="epoch", references=()):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    targets, lowest = set(), 100.0
    n = 0
    tags = config_differences(summaries)
    colours = {}  # with several configurations, one colour per configuration, a line style per run of a log
    styles = ["-", "--", ":", "-."]
    for s, tag in zip(summaries, tags):
        targets.add(s["config"]["target"])
        for i, (label, xs, acc, loss) in enumerate(curves(s, x, tag)):
            pts = [(a, b) for a, b in zip(xs, acc) if not math.isnan(b)]
            lowest = min([lowest] + [100 * b for _, b in pts])
            look = dict(marker="o", ms=3, label=label)
            if any(tags):
                look.update(color=colours.setdefault(tag, f"C{len(colours) % 10}"), ls=styles[i % len(styles)])
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], **look)
            ax2.plot(xs, loss, **look)
            n += 1
    if not n:
        raise LogError("none of the logs has a run with per-epoch rows")
    for label, epochs, acc in references:
        ax.plot(epochs, [100 * a for a in acc], color="0.4", ls=":", marker="x", ms=3, label=f"{label} (published)")
        lowest = min([lowest] + [100 * a for a in acc])
    for t in targets:
        ax.axhline(100 * t, color="k", ls="--", lw=1)
    xlabel = "epoch" if x == "epoch" else "training time (s, the run's timer)"
    ax.set(xlabel=xlabel, ylabel="test accuracy (%)", title="test accuracy (last point: final, with TTA if the recipe has it)")
    ax.set_ylim(max(0.0, math.floor(min(lowest, *(100 * t for t in targets)) - 1)), 100)
    ax2.set(xlabel=xlabel, ylabel="training loss", title="training loss (with label smoothing if the recipe has it)")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
    entries = n + len(references)
    if entries <= 10:
        for a in (ax, ax2):
            a.legend(fontsize=7)
    else:  # inside the axes, a long legend would hide the curves: one, to the right of both
        fig.set_size_inches(14, 4.8)
        ax2.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0), ncol=math.ceil(entries / 26))
    hardware = sorted({s.get("hardware", "?") for s in summaries})
    fig.suptitle("; ".join(hardware), fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("logs", nargs="+", help="JSON summaries written by train_cifar.py")
    p.add_argument("--x", choices=["epoch", "time"], default="epoch", help="x axis: epochs or seconds (default: epoch)")
    p.add_argument("--out", default="runs.png", help="the PNG to write (default: runs.png)")
    p.add_argument("--reference", action="append", default=[], metavar="TSV",
                   help="a published per-epoch curve to draw and compare with (logs/reference/*.tsv); repeatable")
    a = p.parse_args(argv)
    try:
        if a.reference and a.x != "epoch":
            raise LogError("reference curves are per epoch and from other hardware: plot them with --x epoch")
        summaries = [core.read_run_log(path) for path in a.logs]
        references = [load_reference(path) for path in a.reference]
        n = plot(summaries, a.out, a.x, references)
    except LogError as e:
        print(f"plot_runs.py: error: {e}", file=sys.stderr)
        return 2
    if references:
        names, rows = comparison(summaries, references)
        table = core.Table(["epoch"] + names, width=max(10, *(len(c) + 1 for c in names)))
        for r in rows:
            cells = {k: "-" if k not in r else "nan" if math.isnan(r[k]) else f"{100 * r[k]:.2f}" for k in names}
            table.row(dict(cells, epoch=r["epoch"]))
    print(f"{n} runs -> {os.path.abspath(a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
