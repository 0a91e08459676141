"""Plot the training curves of logged runs: test accuracy (and training loss) per epoch or against time, one line
per run, with the target and each log's preset and seed in the legend.

    python plot_runs.py logs/fast94-2026*.json                      # -> runs.png
    python plot_runs.py logs/fast94-*.json --x time --out fast94.png
    python plot_runs.py logs/resnet9-*.json --reference logs/reference/myrtle-resnet9-v100.tsv
    python plot_runs.py logs/fast9*.json --x flops --out records.png   # accuracy against FLOPs, per recipe

With --x flops, one point per recipe instead of curves: the logs are pooled by what they trained (as
compare_runs.py pools them: seeds, hardware and compilation aside), each recipe drawn at its training FLOPs per
run with its mean final accuracy ± std over the finished runs, beside the published records; a table of the
points is printed.

With --reference (a published per-epoch curve, see logs/reference/), it also prints each run's test accuracy
beside the reference's, epoch by epoch. Reads the JSON summaries train_cifar.py writes (several logs of one preset, e.g. seeds run by separate
invocations, plot together). The last point of a run is its final accuracy, with TTA where the recipe uses it."""
import argparse
import json
import math
import os
import sys

import compare_runs
import core


LogError = core.LogError

# Published records as their authors report them (README: History): label, mean accuracy (%), training PF a run
PUBLISHED_RECORDS = [("Myrtle ResNet-9, bag of tricks", 94.1, 1.1), ("hlb-CIFAR10", 94.0, 0.59),
                     ("airbench94", 94.01, 0.36), ("airbench94 with Muon", 94.01, 0.29),
                     ("airbench95", 95.01, 1.4), ("airbench96 (faster)", 96.00, 3.1)]


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
    return [", ".join(f"{k}={show_value(c[k])}" for k in differ) for c in configs]


def show_value(v):
    """A config value as labels show it: floats short, lists in brackets, strings quoted."""
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(show_value(u) for u in v) + "]"
    return f"{v:g}" if isinstance(v, float) else json.dumps(v)


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


def flops_per_run(summary):
    return summary.get("train_flops_per_run") or summary.get("train_flops_per_step", 0) * summary.get("train_steps", 0)


def recipe_points(summaries):
    """One point per recipe the logs trained, in the order first seen. Logs pool as compare_runs.py pools them
    (compare_runs.recipe: seeds, hardware and compilation aside; an option an older log lacks is not compared).
    Each point: preset, tag (its settings of the options on which recipes of its preset differ), n finished
    runs, accuracy mean and std (%), PF per run, hardware. Recipes without a finished run are left out."""
    groups = []  # [recipe, [summaries]]
    for s in summaries:
        if not isinstance(s.get("config"), dict):
            raise LogError(f"a log of preset {s.get('preset')} has no config: cannot tell its recipe")
        r = compare_runs.recipe(s)
        group = next((g for g in groups if not core.differing_keys([g[0], r])), None)
        if group:
            group[1].append(s)
        else:
            groups.append([r, [s]])
    tags = [""] * len(groups)
    for preset in {r["preset"] for r, _ in groups}:
        mine = [i for i, (r, _) in enumerate(groups) if r["preset"] == preset]
        differ = core.differing_keys([groups[i][0] for i in mine], ignore=["preset"])
        for i in mine:
            tags[i] = ", ".join(f"{k}={show_value(groups[i][0][k])}" for k in differ)
    points = []
    for (r, logs), tag in zip(groups, tags):
        accs = [100 * run["accuracy"] for s in logs for run in s["runs"] if compare_runs.finished(run)]
        if not accs:
            continue
        mean, std = core.mean_std(accs)
        points.append(dict(preset=r["preset"], tag=tag, n=len(accs), mean=mean, std=std,
                           pf=flops_per_run(logs[0]) / 1e15, hardware=sorted({s.get("hardware", "?") for s in logs})))
    if not points:
        raise LogError("none of the logs has a finished run")
    return points


def plot_flops(points, out, published=PUBLISHED_RECORDS):
    """Accuracy against training FLOPs: each recipe's mean ± std (labelled with its n), the published records
    as open diamonds, and the 94/95/96% targets."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 6))
    for i, p in enumerate(points):
        tag = f" [{p['tag']}]" if p["tag"] else ""
        label = f"{p['preset']}{tag} (n={p['n']})"
        ax.errorbar(p["pf"], p["mean"], yerr=p["std"], fmt="o", ms=5, capsize=3, color=f"C{i % 10}", label=label)
    for i, (name, acc, pf) in enumerate(sorted(published, key=lambda r: r[2])):
        ax.plot(pf, acc, "D", mfc="none", color="0.35", ms=7)
        ax.annotate(name, (pf, acc), textcoords="offset points", xytext=(6, 6 if i % 2 else -11), fontsize=7,
                    color="0.35")  # above and below in turn: records at nearby FLOPs would overprint
    for target in (94, 95, 96):
        ax.axhline(target, color="k", ls="--", lw=0.8)
    ax.set_xscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(plain)
    ax.set(xlabel="training FLOPs per run (PF, counted)", ylabel="final test accuracy (%), mean ± std over runs",
           title="recipes of these logs (filled) and published records (open diamonds)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


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
    p.add_argument("--x", choices=["epoch", "time", "flops"], default="epoch",
                   help="x axis: epochs or seconds (curves), or training FLOPs (a point per recipe); default: epoch")
    p.add_argument("--out", default="runs.png", help="the PNG to write (default: runs.png)")
    p.add_argument("--reference", action="append", default=[], metavar="TSV",
                   help="a published per-epoch curve to draw and compare with (logs/reference/*.tsv); repeatable")
    a = p.parse_args(argv)
    try:
        if a.reference and a.x != "epoch":
            raise LogError("reference curves are per epoch and from other hardware: plot them with --x epoch")
        os.makedirs(core.writable_folder(os.path.dirname(a.out) or ".", "--out's folder"), exist_ok=True)
        summaries = [core.read_run_log(path) for path in a.logs]
        references = [load_reference(path) for path in a.reference]
        if a.x == "flops":
            points = recipe_points(summaries)
            plot_flops(points, a.out)
        else:
            n = plot(summaries, a.out, a.x, references)
    except (LogError, ValueError) as e:
        print(f"plot_runs.py: error: {e}", file=sys.stderr)
        return 2
    if a.x == "flops":
        for p in points:
            tag = f" [{p['tag']}]" if p["tag"] else ""
            print(f"{p['preset']}{tag}: {p['mean']:.2f} ± {p['std']:.2f}% (n={p['n']}) at {p['pf']:.3f} PF; "
                  + "; ".join(p["hardware"]))
        print(f"{len(points)} recipes -> {os.path.abspath(a.out)}")
        return 0
    if references:
        names, rows = comparison(summaries, references)
        table = core.Table(["epoch"] + names, width=max(10, *(len(c) + 1 for c in names)))
        for r in rows:
            cells = {k: "-" if k not in r else "nan" if math.isnan(r[k]) else f"{100 * r[k]:.2f}" for k in names}
            table.row(dict(cells, epoch=r["epoch"]))
    print(f"{n} runs -> {os.path.abspath(a.out)}")
    return 0


if __name__ == "__main__":
    core.exit_with(main)
