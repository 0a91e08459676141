"""Summarise logged runs as a series (pooled over logs, e.g. seeds trained by separate invocations or machines)
and compare two series: is a variant better, or within the noise?

    python compare_runs.py logs/fast94-20261202-*.json                          # one series
    python compare_runs.py logs/fast94-20261202-05*.json --vs logs/fast94-20261204-23*.json

For each series: the logs and finished runs pooled, their seeds, final test accuracy (mean ± sample std, and the
standard error of the mean), how many reach the target and how far the mean is from it (95% interval), training
FLOPs, the time per run on each machine it ran on (times on different hardware are not pooled; where it ran on
several, each machine's accuracy too), and the commits its logs ran at. For two: the difference of mean
accuracies (B - A) with Welch's standard error and 95% interval, and, over the seeds both series ran, the paired
difference (each seed's luck in data order and initialisation cancels, so it is the sharper test when the runs
were made as pairs). Reads the JSON summaries train_cifar.py writes.

Runs pool only when their logs share a recipe: logs whose hyper-parameters differ (epochs, widths, ...) are an
error naming the difference, unless --allow-mixed. Seeds, hardware, compilation and the like do not count."""
import argparse
import json
import math
import os
import sys

import core

# Config keys that say how or where a run ran, or what it reports, not what it trains. The precision asked for
# ("auto") is not: the one it resolved to is (recipe's resolved_precision).
NOT_RECIPE = {"runs", "seed", "compile", "compile_mode", "cpu_conv", "eval_every", "eval_every_steps",
              "loader_workers", "target", "stop_after_epochs", "loss_scale", "sync_check", "precision"}


LogError = core.LogError


def load_log(path):
    log = core.read_run_log(path)
    if not isinstance(log.get("config"), dict):
        raise LogError(f"{path} is not a train_cifar.py log (no config)")
    return log


def recipe(log):
    """What a log's runs trained: its hyper-parameters without NOT_RECIPE, with the preset, the resolved
    precision and the number of processes."""
    keys = {k: v for k, v in core.with_predated_values(log["config"]).items() if k not in NOT_RECIPE}
    keys.update(preset=log.get("preset"), resolved_precision=log.get("precision"), world_size=log.get("world_size", 1))
    return keys


def recipe_differences(logs):
    """{key: [each log's value]} for the recipe keys that differ between logs; a key a log lacks (written before
    the option existed) counts as core.PREDATED_VALUES says, or is not compared where no value describes it."""
    recipes = [recipe(log) for log in logs]
    return {k: [r[k] for r in recipes] for k in core.differing_keys(recipes)}


def finished(run):
    return run.get("accuracy") is not None and not run.get("diverged") and run.get("stopped_after_epoch") is None


def series(paths, allow_mixed=False):
    """The finished runs of these logs, pooled, with what describes them. A log given twice counts once."""
    paths, repeated = core.distinct_logs(paths)
    logs = [load_log(p) for p in paths]
    differ = recipe_differences(logs)
    if differ and not allow_mixed:
        key, values = next(iter(differ.items()))
        distinct = [(v, p) for i, (v, p) in enumerate(zip(values, paths)) if v not in values[:i]]
        shown = " but ".join(f"{json.dumps(v)} in {p}" for v, p in distinct)
        more = f" (and {len(differ) - 1} more option(s) differ)" if len(differ) > 1 else ""
        raise LogError(f"these logs trained different recipes: {key} is {shown}{more}; "
                       "pass --allow-mixed to pool them anyway")
    runs = [dict(run, target=log["config"].get("target"), flops=log.get("train_flops_per_run"),
                 hardware=log.get("hardware")) for log in logs for run in log["runs"]]
    done = [r for r in runs if finished(r)]
    if not done:
        raise LogError(f"no finished run in {', '.join(paths)}")
    return dict(paths=list(paths), logs=logs, presets=sorted({str(log.get("preset")) for log in logs}), runs=done,
                left_out=len(runs) - len(done), differences=differ, repeated=repeated)


def seed_ranges(seeds):
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'; seeds run more than once are named after them:
    [0, 1, 1, 2, 2] -> '0-2; 1-2 run twice'."""
    by_count = {}
    for s in sorted(set(seeds)):
        if seeds.count(s) > 1:
            by_count.setdefault(seeds.count(s), []).append(s)
    if by_count:
        return seed_ranges(sorted(set(seeds))) + "; " + ", ".join(
            f"{seed_ranges(group)} run {'twice' if n == 2 else f'{n} times'}" for n, group in sorted(by_count.items()))
    out, seeds = [], sorted(seeds)
    for s in seeds:
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def summary(s):
    runs = s["runs"]
    acc = [100 * r["accuracy"] for r in runs]
    mean, std = core.mean_std(acc)
    times, accuracies = {}, {}  # per machine: times on different hardware do not pool
    for r in runs:
        accuracies.setdefault(str(r["hardware"]), []).append(100 * r["accuracy"])
        if r.get("total_time_s") is not None:
            times.setdefault(str(r["hardware"]), []).append(r["total_time_s"])
    reached = [r for r in runs if r["target"] is not None and r["accuracy"] >= r["target"]]
    # FLOPs a run, one per value as printed (PF rounded to 3 decimals made every small run 0.000 PF)
    flops = list({core.format_flops(f): f for f in sorted({r["flops"] for r in runs if r["flops"]})}.values())
    commits = list(dict.fromkeys(str(log.get("commit"))[:7] for log in s["logs"]))  # in the order given
    return dict(n=len(runs), seeds=seed_ranges([r["seed"] for r in runs]), mean=mean, std=std, commits=commits,
                se=std / math.sqrt(len(runs)) if len(runs) > 1 else math.nan, reached=len(reached),
                targets=sorted({r["target"] for r in runs if r["target"] is not None}),
                flops=flops, hardware={h: times.get(h, []) for h in sorted(accuracies)},
                accuracy_by_hardware={h: accuracies[h] for h in sorted(accuracies)})


def paired_runs(a, b):
    """Accuracies (percent) of the seeds that each series ran exactly once, in both: (seeds, in a, in b)."""
    def once(runs):
        seeds = [r["seed"] for r in runs]
        return {r["seed"]: 100 * r["accuracy"] for r in runs if seeds.count(r["seed"]) == 1}
    in_a, in_b = once(a["runs"]), once(b["runs"])
    shared = sorted(set(in_a) & set(in_b))
    return shared, [in_a[s] for s in shared], [in_b[s] for s in shared]


def describe(name, s, out=print):
    m = summary(s)
    logs = "1 log" if len(s["paths"]) == 1 else f"{len(s['paths'])} logs"
    se = f" (standard error {m['se']:.2f})" if m["n"] > 1 else ""
    target = "/".join(f"{100 * t:g}%" for t in m["targets"])
    out(f"{name}: {', '.join(s['presets'])}, {logs}, n={m['n']} (seeds {m['seeds']})")
    reach = f"{m['reached']} of {m['n']} reach {target}" if target else "no target logged"
    out(f"  accuracy {core.format_mean_std(m['mean'], m['std'], m['n'], 2, unit='%')}{se}; {reach}")
    if len(m["targets"]) == 1 and m["n"] > 1:  # does the mean meet the target, or is it within the noise of it?
        half = core.student_t_quantile(0.975, m["n"] - 1) * m["se"]
        gap = m["mean"] - 100 * m["targets"][0]
        out(f"  mean - target {gap:+.2f} points (95% interval {gap - half:+.2f} to {gap + half:+.2f})")
    if m["flops"]:
        out("  training FLOPs " + " / ".join(core.format_flops(f) for f in m["flops"]) + " a run")
    several = len(m["hardware"]) > 1  # then each machine's accuracy too: do its kernels, rounding otherwise, tell?
    for h, times in m["hardware"].items():
        accuracies = m["accuracy_by_hardware"][h]
        runs = f"{len(accuracies)} run{'s' if len(accuracies) > 1 else ''}"
        if several:
            runs += ", " + core.format_mean_std(*core.mean_std(accuracies), len(accuracies), 2, unit="%")
        mean_time, std_time = core.mean_std(times)
        if len(times) > 1:
            out(f"  on {h}: {runs}, {mean_time:.1f} ± {std_time:.1f} s a run")
        else:
            out(f"  on {h}: {runs}, " + (f"{mean_time:.1f} s" if times else "no times logged"))
    shown = m["commits"] if len(m["commits"]) <= 8 else m["commits"][:4] + ["..."] + m["commits"][-2:]
    out(f"  code: {len(m['commits'])} commit(s), {', '.join(shown)}"
        + (" (a seed may round otherwise across them: see train_cifar.py --from-log)"
           if len(m["commits"]) > 1 else ""))
    if s["left_out"]:
        out(f"  ({s['left_out']} unfinished, diverged or cut-short run(s) left out)")
    if s.get("repeated"):
        out(f"  (counted once: {', '.join(s['repeated'])})")
    for key, values in s["differences"].items():
        out(f"  mixed: {key} = {', '.join(json.dumps(v) for v in values)}")


def interval(d):
    if math.isnan(d["se"]):
        return f"{d['diff']:+.2f} points (too few runs for an error estimate)"
    return (f"{d['diff']:+.2f} ± {d['se']:.2f} points (95% interval {d['ci'][0]:+.2f} to {d['ci'][1]:+.2f}"
            + (f", {d['df']:.1f} degrees of freedom)" if not math.isnan(d["df"]) else ")"))


def machine(hardware):
    """(processes, device) of a log's hardware string: train_cifar.py prefixes "N processes x " under torchrun."""
    count, sep, device = hardware.partition(" processes x ")
    return (int(count), device) if sep and count.isdigit() else (1, hardware)


def processes(n):
    return "1 process" if n == 1 else f"{n} processes"


def compare(a, b, out=print):
    acc = [[100 * r["accuracy"] for r in s["runs"]] for s in (a, b)]
    out(f"B - A, all runs (Welch): {interval(core.mean_difference(*acc))}")
    hardware_a, hardware_b = summary(a)["hardware"], summary(b)["hardware"]
    machines_a, machines_b = ({machine(h) for h in hw} for hw in (hardware_a, hardware_b))
    # Say what differs: the devices, or only how many processes shared the work (the hardware string names both)
    differs = []
    if {d for _, d in machines_a} != {d for _, d in machines_b}:
        differs.append("on different hardware")
    if {n for n, _ in machines_a} != {n for n, _ in machines_b}:
        differs.append("with different process counts")
    elsewhere = f" ({', '.join(differs)})" if differs else ""
    seeds, in_a, in_b = paired_runs(a, b)
    if seeds:  # (on other hardware a seed may not draw the same initialisation and data order)
        out(f"B - A, paired over the {len(seeds)} seed(s) both ran ({seed_ranges(seeds)}): "
            f"{interval(core.paired_difference(in_a, in_b))}{elsewhere}")
    # Times compare on one device only; on it, runs with other process counts pair up too (the ratio is then
    # the speed-up from the processes), labelled with their counts.
    compared = False
    for h_a, times_a in hardware_a.items():
        for h_b, times_b in hardware_b.items():
            (n_a, device), (n_b, device_b) = machine(h_a), machine(h_b)
            if device == device_b and times_a and times_b:
                ratio = core.mean_std(times_b)[0] / core.mean_std(times_a)[0]
                where = h_a if n_a == n_b else f"{device} ({processes(n_a)} in A, {processes(n_b)} in B)"
                out(f"time per run B / A on {where}: {ratio:.3f}")
                compared = True
    if not compared and any(hardware_a.values()) and any(hardware_b.values()):
        out("times not compared: A and B ran on different hardware")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("logs", nargs="+", help="JSON logs of series A")
    p.add_argument("--vs", nargs="+", default=[], metavar="LOG", help="JSON logs of series B, compared with A")
    p.add_argument("--allow-mixed", action="store_true", help="pool logs whose recipes differ (listed as mixed)")
    a = p.parse_args(argv)
    in_b = {os.path.realpath(x) for x in a.vs}
    both = list(dict.fromkeys(x for x in a.logs if os.path.realpath(x) in in_b))  # (as the user named them)
    if both:  # (a glob for B that also matches A's logs: B - A would count those runs on both sides)
        print(f"compare_runs.py: error: {', '.join(both)} given in both A and --vs B; give each log to one series",
              file=sys.stderr)
        return 2
    try:
        first = series(a.logs, a.allow_mixed)
        second = series(a.vs, a.allow_mixed) if a.vs else None
    except LogError as e:
        print(f"compare_runs.py: error: {e}", file=sys.stderr)
        return 2
    describe("A" if second else "series", first)
    if second:
        describe("B", second)
        logs = [first["logs"][0], second["logs"][0]]
        changed = recipe_differences(logs)
        unknown = sorted(set(recipe(logs[0])) ^ set(recipe(logs[1])))  # options one log predates
        print("B's recipe against A's: " + ("the same" if not changed else "; ".join(
            f"{key} {json.dumps(x)} -> {json.dumps(y)}" for key, (x, y) in changed.items()))
            + (f" (not in both logs, so not compared: {', '.join(unknown)})" if unknown else ""))
        compare(first, second)
    return 0


if __name__ == "__main__":
    core.exit_with(main)
