"""Plot the training curves of logged runs: test accuracy (and training loss) per epoch or against time, one line
per run, with the target and each log's preset and seed in the legend.

    python plot_runs.py logs/fast94-2026*.json                      # -> runs.png
    python plot_runs.py logs/fast94-*.json --x time --out fast94.png
    python plot_runs.py logs/resnet9-2*.json --reference logs/reference/myrtle-resnet9-v100.tsv
    python plot_runs.py logs/fast9*.json --x flops --out records.png   # accuracy against FLOPs, per recipe

With --x flops, one point per recipe instead of curves: the logs are pooled by what they trained (as
compare_runs.py pools them: seeds, hardware and compilation aside), each recipe drawn at its training FLOPs per
run (as its newest log counts them) with its mean final accuracy ± std over the finished runs, beside the
published records; a table of the points is printed.

With --reference (a published per-epoch curve, see logs/reference/), it also prints each run's test accuracy
beside the reference's, epoch by epoch. Reads the JSON summaries train_cifar.py writes (several logs of one
preset, e.g. seeds run by separate invocations, plot together). The last point of a run is its final accuracy,
with TTA where the recipe uses it. Runs of different logs that would be labelled alike (a seed rerun on other
hardware) are told apart by their log's file name."""
import argparse
import collections
import itertools
import json
import math
import os
import sys
import textwrap

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


def log_name(path, preset):
    """How labels name a log, where runs of two logs would be labelled alike: its file name, less the extension
    and the preset (already in the label)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    return stem[len(preset) + 1:] if stem.startswith(preset + "-") and len(stem) > len(preset) + 1 else stem


def tell_apart(keys, names):
    """Per run, given its key (what its label says) and its log's name: what its label must add so that no other
    run's has the same. Nothing for a key no other run shares, else its log's name, and #1, #2, ... after it
    where that repeats too (a log given twice): a table column or a legend entry must never stand for two runs."""
    counts = collections.Counter(keys)
    named = [(k, n if counts[k] > 1 else "") for k, n in zip(keys, names)]
    counts, seen, out = collections.Counter(named), collections.Counter(), []
    for k, n in named:
        seen[k, n] += 1
        out.append(n + (f"#{seen[k, n]}" if counts[k, n] > 1 else ""))
    return out


def default_names(summaries):
    return [f"log{i + 1}" for i in range(len(summaries))]


def comparison(summaries, references, names=None):
    """Rows of {epoch, <run label>: test accuracy, <reference label>: accuracy} over every epoch any of them has.
    A run's label is preset-seedN, with @ and its log's name (names: one per summary) where runs of other logs
    have that label too (tell_apart)."""
    names = names or default_names(summaries)
    keys, logs, values = [], [], []
    for s, name in zip(summaries, names):
        for run, (_, xs, acc, _) in zip([r for r in s["runs"] if r.get("epochs")], curves(s, "epoch")):
            keys.append(f"{s['preset']}-seed{run['seed']}")
            logs.append(name)
            values.append(dict(zip(xs, acc)))
    columns = {k + (f"@{extra}" if extra else ""): v for k, extra, v in zip(keys, tell_apart(keys, logs), values)}
    for label, epochs, acc in references:
        columns[label] = dict(zip(epochs, acc))
    epochs = sorted({e for c in columns.values() for e in c})
    return list(columns), [dict({"epoch": e}, **{k: c[e] for k, c in columns.items() if e in c}) for e in epochs]


RUN_KEYS = ("seed", "runs")  # differ between invocations of one configuration


def config_differences(summaries):
    """Per summary, its settings of the config keys on which the summaries of its preset differ (seed and runs
    aside; a key an older log lacks counts as core.PREDATED_VALUES says, or is not compared; the loss scale only
    between runs in fp16, the one precision it acts in), as "key=value" strings: what tells their curves apart.
    Another preset's logs are not compared: their preset tells them apart, and its every setting would crowd
    the legend."""
    configs = [core.with_predated_values(s.get("config") or {}) for s in summaries]
    for s, config in zip(summaries, configs):
        if s.get("precision") != "fp16":  # (GradScaler in logs before --loss-scale, "batch" after: no difference)
            config.pop("loss_scale", None)
    tags = [""] * len(summaries)
    for preset in {s["preset"] for s in summaries}:
        mine = [i for i, s in enumerate(summaries) if s["preset"] == preset]
        differ = core.differing_keys([configs[i] for i in mine], ignore=RUN_KEYS)
        for i in mine:
            tags[i] = ", ".join(f"{k}={show_value(configs[i][k])}" for k in differ)
    return tags


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
        acc = [r["test_acc"] for r in rows]  # (NaN where not evaluated: core.read_run_log reads null as NaN)
        label = f"{summary['preset']}{f' [{tag}]' if tag else ''} seed {run['seed']}"
        if run.get("accuracy") is not None:
            label += f": {100 * run['accuracy']:.2f}%"
        out.append((label, xs, acc, [r["train_loss"] for r in rows]))
    return out


def flops_per_run(summary):
    return summary.get("train_flops_per_run") or summary.get("train_flops_per_step", 0) * summary.get("train_steps", 0)


def distinguishing_keys(recipes):
    """Sorted keys enough to tell every two of these recipes apart in their labels, chosen greedily: while two are
    alike in the keys chosen, the key that tells the most such pairs apart. Every key on which any two differ made
    labels of ~17 keys (world_size=1 ...); the keys all of them have could miss the one two recipes differ in
    where an older log lacks another's (core.differing_keys skips keys a log lacks)."""
    chosen = set()

    def apart(a, b, keys):
        return any(k in a and k in b and a[k] != b[k] for k in keys)
    pending = [(a, b) for a, b in itertools.combinations(recipes, 2) if not apart(a, b, chosen)]
    while pending:
        candidates = sorted({k for a, b in pending for k in core.differing_keys([a, b], ignore=["preset"])})
        if not candidates:  # (recipes alike in every key both have were pooled as one: none left)
            break
        best = max(candidates, key=lambda k: sum(apart(a, b, [k]) for a, b in pending))
        chosen.add(best)
        pending = [(a, b) for a, b in pending if not apart(a, b, [best])]
    return sorted(chosen)


def recipe_points(summaries):
    """One point per recipe the logs trained, in the order first seen. Logs pool as compare_runs.py pools them
    (compare_runs.recipe: seeds, hardware and compilation aside; an option an older log lacks is not compared).
    Each point: preset, tag (its settings of the options on which two recipes of its preset differ), n finished
    runs, accuracy mean and std (%), PF per run as its newest log counts it, the other counts its older logs
    give (older_pf), hardware. Recipes without a finished run are left out."""
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
        differ = distinguishing_keys([r for r, _ in groups if r["preset"] == preset])
        for i, (r, _) in enumerate(groups):
            if r["preset"] == preset:
                tags[i] = ", ".join(f"{k}={show_value(r[k])}" for k in differ if k in r)
    points = []
    for (r, logs), tag in zip(groups, tags):
        accs = [100 * run["accuracy"] for s in logs for run in s["runs"] if compare_runs.finished(run)]
        if not accs:
            continue
        mean, std = core.mean_std(accs)
        # the newest log's count: FLOP counting was corrected since the first logs (README: What the timer covers)
        newest = max(logs, key=lambda s: s.get("started") or "")
        points.append(dict(preset=r["preset"], tag=tag, n=len(accs), mean=mean, std=std,
                           pf=flops_per_run(newest) / 1e15,
                           older_pf=sorted({flops_per_run(s) / 1e15 for s in logs} - {flops_per_run(newest) / 1e15}),
                           hardware=sorted({s.get("hardware", "?") for s in logs})))
    if not points:
        raise LogError("none of the logs has a finished run")
    return points


def legend_below(fig, handles, labels, width_in):
    """One legend for the figure, under its axes: inside them a long legend hides the points, and beside them it
    squeezes them. Long labels are wrapped, and set in as many columns as fit the figure's width; savefig's
    bbox_inches="tight" grows the image to hold it."""
    inch_per_char, marker_in = 0.055, 0.6  # at 7 pt; a line's handle and padding
    labels = [textwrap.fill(t, int((width_in - marker_in) / inch_per_char), subsequent_indent="    ") for t in labels]
    longest = max(len(line) for t in labels for line in t.split("\n"))
    ncol = max(1, min(len(labels), int(width_in // (inch_per_char * longest + marker_in))))
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, fontsize=7, frameon=False)


def point_label(p):
    """A recipe's mean ± std over its n runs; no ± for one run, whose spread is unknown, not 0."""
    tag = f" [{p['tag']}]" if p["tag"] else ""
    return f"{p['preset']}{tag}: {core.format_mean_std(p['mean'], p['std'], p['n'], 2, unit='%')} (n={p['n']})"


def plot_flops(points, out, published=PUBLISHED_RECORDS):
    """Accuracy against training FLOPs: each recipe's mean ± std (labelled with its n; no bar for one run), the
    published records as open diamonds, and the 94/95/96% targets."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 6))
    for i, p in enumerate(points):
        ax.errorbar(p["pf"], p["mean"], yerr=p["std"] if p["n"] > 1 else None, fmt="o", ms=5, capsize=3,
                    color=f"C{i % 10}", label=point_label(p))
    for i, (name, acc, pf) in enumerate(sorted(published, key=lambda r: r[2])):
        ax.plot(pf, acc, "D", mfc="none", color="0.35", ms=7)
        ax.annotate(name, (pf, acc), textcoords="offset points", xytext=(6, 6 if i % 2 else -11), fontsize=7,
                    color="0.35")  # above and below in turn: records at nearby FLOPs would overprint
    for target in (94, 95, 96):
        ax.axhline(target, color="k", ls="--", lw=0.8)
    ax.set_xscale("log")
    # ticks in PF, TF or GF as core.format_flops prints them (PF alone read "0.000" for small runs); minor ticks
    # labelled all within a decade, at 2 and 5 within two, else none: more of these longer labels run together
    def tick(v, _, minor=False):
        lead = round(v / 10 ** math.floor(math.log10(v))) if v > 0 else 0
        lo, hi = ax.get_xlim()
        shown = hi <= 10 * lo or (hi <= 100 * lo and lead in (2, 5))
        return core.format_flops(v * 1e15) if shown or not minor else ""
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(tick))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, pos: tick(v, pos, minor=True)))
    ax.set(xlabel="training FLOPs per run (counted)", ylabel="final test accuracy (%), mean ± std over runs",
           title="recipes of these logs (filled) and published records (open diamonds)")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    legend_below(fig, *ax.get_legend_handles_labels(), fig.get_figwidth())
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot(summaries, out, x="epoch", references=(), names=None):
    """The curves of the runs of these logs (names: one per log, see tell_apart) and of the references."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    targets, lowest = set(), 100.0
    tags = config_differences(summaries)
    runs = [(s, tag, name, i, run["seed"], c)
            for s, tag, name in zip(summaries, tags, names or default_names(summaries))
            for i, (run, c) in enumerate(zip([r for r in s["runs"] if r.get("epochs")], curves(s, x, tag)))]
    if not runs:
        raise LogError("none of the logs has a run with per-epoch rows")
    # runs of two logs labelled alike but for their accuracy (a seed rerun elsewhere) get their log's name too
    extras = tell_apart([(s["preset"], tag, seed) for s, tag, _, _, seed, _ in runs], [r[2] for r in runs])
    colours = {}  # with several configurations, one colour per configuration, a line style per run of a log
    styles = ["-", "--", ":", "-."]
    for k, ((s, tag, _, i, _, (label, xs, acc, loss)), extra) in enumerate(zip(runs, extras)):
        if s["config"].get("target") is not None:  # (checked by core.read_run_log where present)
            targets.add(s["config"]["target"])
        pts = [(a, b) for a, b in zip(xs, acc) if not math.isnan(b)]
        lowest = min([lowest] + [100 * b for _, b in pts])
        # past the 10 colours of the cycle, another line style: the 11th run would look like the 1st
        look = dict(marker="o", ms=3, label=label + (f" ({extra})" if extra else ""), ls=styles[k // 10 % len(styles)])
        if any(tags):
            key = (s["preset"], tag)
            look.update(color=colours.setdefault(key, f"C{len(colours) % 10}"), ls=styles[i % len(styles)])
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], **look)
        ax2.plot(xs, loss, **look)
    for label, epochs, acc in references:
        ax.plot(epochs, [100 * a for a in acc], color="0.4", ls=":", marker="x", ms=3, label=f"{label} (published)")
        lowest = min([lowest] + [100 * a for a in acc])
    for t in targets:
        ax.axhline(100 * t, color="k", ls="--", lw=1)
    xlabel = "epoch" if x == "epoch" else "training time (s, the run's timer)"
    # two-line titles: on one line each, the two panels' titles ran into each other
    ax.set(xlabel=xlabel, ylabel="test accuracy (%)")
    ax.set_title("test accuracy\n(last point: final, with TTA if the recipe has it)", fontsize=10)
    ax.set_ylim(max(0.0, math.floor(min([lowest] + [100 * t for t in targets]) - 1)), 100)
    ax2.set(xlabel=xlabel, ylabel="training loss")
    ax2.set_title("training loss\n(with label smoothing if the recipe has it)", fontsize=10)
    for a in (ax, ax2):
        a.grid(alpha=0.3)
    hardware = sorted({s.get("hardware", "?") for s in summaries})
    fig.suptitle("; ".join(hardware), fontsize=8)
    fig.tight_layout()
    legend_below(fig, *ax.get_legend_handles_labels(), fig.get_figwidth())  # ax has every run and reference
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return len(runs)


def image_path(out):
    """The file savefig writes for --out, or a LogError: matplotlib adds ".png" to a name without an extension
    (the summary named a file it had not written) and cannot write over a folder."""
    from matplotlib.backend_bases import FigureCanvasBase

    def refuse_folder(path):
        if not os.path.basename(path) or os.path.isdir(path):
            raise LogError(f"--out {path} is a folder: name the image to write, e.g. {os.path.join(path, 'runs.png')}")
    refuse_folder(out)
    if not os.path.splitext(out)[1].strip("."):
        out = out.rstrip(".") + ".png"  # the name savefig gives it
        refuse_folder(out)
    ext = os.path.splitext(out)[1][1:]
    if ext.lower() not in FigureCanvasBase.get_supported_filetypes():
        raise LogError(f"--out {out}: matplotlib cannot write .{ext} images; use .png, .pdf, .svg or .jpg")
    return out


def plural(n, word):
    return f"{n} {word}" + ("" if n == 1 else "s")


def main(argv=None):
    # the first paragraph, whole: its first line alone breaks off mid-sentence
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
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
        a.out = image_path(a.out)
        os.makedirs(core.writable_folder(os.path.dirname(a.out) or ".", "--out's folder"), exist_ok=True)
        paths, repeated = core.distinct_logs(a.logs)  # a log given twice would draw, and pool, its runs twice
        summaries = [core.read_run_log(path) for path in paths]
        for path, s in zip(paths, summaries):  # (the flops plot says so itself, naming the preset)
            if a.x != "flops" and not isinstance(s.get("config"), dict):
                raise LogError(f"{path} is not a train_cifar.py log (no config)")
        names = [log_name(path, s["preset"]) for path, s in zip(paths, summaries)]
        references = [load_reference(path) for path in a.reference]
        if a.x == "flops":
            points = recipe_points(summaries)
            plot_flops(points, a.out)
        else:
            n = plot(summaries, a.out, a.x, references, names)
    except (LogError, ValueError) as e:
        print(f"plot_runs.py: error: {e}", file=sys.stderr)
        return 2
    once = f"counted once: {', '.join(repeated)}\n" if repeated else ""
    if a.x == "flops":
        for p in points:
            shown = core.format_flops(p["pf"] * 1e15)
            older = sorted({core.format_flops(pf * 1e15) for pf in p["older_pf"]} - {shown})
            older = f" (older logs: {', '.join(older)})" if older else ""
            print(f"{point_label(p)} at {shown}{older}; " + "; ".join(p["hardware"]))
        print(once, end="")
        print(f"{plural(len(points), 'recipe')} -> {os.path.abspath(a.out)}")
        return 0
    if references:
        columns, rows = comparison(summaries, references, names)
        table = core.Table(["epoch"] + columns, width=max(10, *(len(c) + 1 for c in columns)))
        for r in rows:
            cells = {k: "-" if k not in r else "nan" if math.isnan(r[k]) else f"{100 * r[k]:.2f}" for k in columns}
            table.row(dict(cells, epoch=r["epoch"]))
    print(f"{once}{plural(n, 'run')} -> {os.path.abspath(a.out)}")
    return 0


if __name__ == "__main__":
    core.exit_with(main)
