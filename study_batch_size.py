"""Batch-size scaling study (Shallue et al. 2018, "Measuring the Effects of Data Parallelism on Neural Network
Training"): steps to a target accuracy against the batch size, every batch size with its own metaparameter search.

    python study_batch_size.py run --workload cpu --optimizer nesterov --batch-sizes 16 32 64 128 256 512 1024 2048 \\
        --trials 8 --data cifar10.npz                                   # logs/batch-size-cpu-nesterov/
    python study_batch_size.py run --workload gpu94 --optimizer momentum --data cifar10.npz
    python study_batch_size.py run --workload cpu --optimizer lars --dry-run   # print the trials, train nothing
    python study_batch_size.py plot logs/batch-size-cpu-sgd logs/batch-size-cpu-nesterov --out logs/batch-size-cpu

Per batch size, `--trials` trials draw their metaparameters from a scrambled Halton sequence (the same unit-cube
points at every batch size). Each trial trains until the held-out (default) or test accuracy, evaluated every
few steps, reaches the target, or until its step budget runs out. Steps to target at a batch size are the best
trial's. Trials run trial-major (trial 0 at every batch size, then trial 1, ...), so an early stop already
gives a rough curve. A resumed study must use the same settings (workload, optimizer, target, budget, search
space, seed, --set); more batch sizes or trials may be added. Cost: a full cpu study (8 batch sizes x 8 trials)
is estimated at 1-2 hours on an idle 2-core CPU (trials that miss the target run their whole budget). On a
machine with several cores, N processes with --shard 0/N ... N-1/N share one study (OMP_NUM_THREADS=1 each).

Output in OUT (default logs/batch-size-<workload>-<optimizer>/):
    trials.jsonl     one line per finished trial, appended and fsynced at once; run the same command again to
                     resume (finished trials are skipped, a torn last line from a crash is dropped). With
                     --shard K/N, trials-shardKofN.jsonl: one file per process, so no two write the same file.
    summary.tsv/json per batch size: best steps to target, its metaparameters, trials reaching the target;
                     the regimes and the learning-rate trend
    steps_to_target.png, best_lr.png

Regimes (analyse()): the ideal line is steps = s0 * b0 / b through the smallest batch size that reached the
target. Perfect scaling lasts while the best steps stay within PERFECT_TOL above that line. The maximal useful
batch size is the smallest b beyond which no larger batch size cuts steps by USEFUL_TOL or more per doubling,
beyond what the evaluation interval can hide; between the two lies the region of diminishing returns.
"""
import argparse
import collections
import dataclasses
import json
import math
import os
import sys
import time

import numpy as np

import core

# ---------------------------------------------------------------------------------------------------------------
# Workloads. A workload is a train_cifar preset with fixed overrides, a target, an evaluation split and a step
# budget. Only the optimizer, its metaparameters and the LR schedule vary between trials. Lookahead is off so
# that the optimizer under study is the only one; TTA is off because step evaluations run without it.
#
# Step budget: max(ceil(epochs * steps_per_epoch(b)), min_steps). In epochs at small batches (steps to target
# fall as 1/b there), but never fewer than min_steps, so large batches, which need more epochs, can still reach
# the target. The eval interval is budget // evals_per_trial steps (at least 1): every trial has about that many
# evaluations over its full budget, so steps to target are resolved to ~1/evals_per_trial of the budget.

WORKLOADS = {
    # Calibration (logs/batch-size-cpu-calibration/; 1 thread of a 2-core AMD EPYC, bf16, torch 2.13.0,
    # Nesterov 0.9, 10% warm-up then linear decay to 5%): at batch 256 over 3 epochs, lr 0.1 / 0.3 / 1.0 reached
    # 65% on the holdout at step 352 / 320 / 512 (final 72.5 / 77.9 / 74.3%), about 65 s a trial; at batch 2048
    # over 8 epochs, lr 0.4 / 1.2 / 4.0 reached it at step 100 / 140 / never (24%). With fast94-sgd's 64x LR on
    # BN biases the curves were noisy (lr 1.0: 37% -> 16% -> 36% in the first 100 steps); with the biases at the
    # plain LR, lr 0.3 reached 65% at step 224 instead of 320 and smoothly. So the study trains every parameter at
    # the LR under study (bias_lr_scale 1): the optimizer compared is then the only one.
    "cpu": dict(preset="fast94-sgd", about="fast94-sgd net at widths 16/32/32, 65% on a 5000-image holdout",
                eval="holdout", holdout=5000, target=0.65, epochs=4.0, min_steps=200, evals_per_trial=20,
                batch_sizes=(16, 32, 64, 128, 256, 512, 1024, 2048),
                overrides=dict(widths=(16, 32, 32), tta=0, lookahead_start_epoch=-1, bias_lr_scale=1.0)),
    # Uncalibrated (no GPU was available): fast94-sgd to 94% on the test set without TTA and lookahead, so the
    # budget is twice its 9.9 epochs.
    "gpu94": dict(preset="fast94-sgd", about="fast94-sgd to 94% on the test set (no TTA, no lookahead)",
                  eval="test", holdout=0, target=0.94, epochs=20.0, min_steps=500, evals_per_trial=50,
                  batch_sizes=(64, 128, 256, 512, 1024, 2048, 4096, 8192),
                  overrides=dict(tta=0, lookahead_start_epoch=-1, bias_lr_scale=1.0)),
}

# Search space: (low, high, scale) of each metaparameter, sampled from the unit cube. Each has a fixed Halton
# coordinate, so trial i of every optimizer shares its learning rate, warm-up and decay (common random numbers).
SEARCH_SPACE = {
    # Effective LR lr / (1 - momentum) (Shallue et al. sec. 4.7; = lr for plain SGD) at LR_REFERENCE_BATCH.
    "lr_eff": (0.3, 30.0, "log"),
    "one_minus_momentum": (0.02, 0.5, "log"),   # momentum 0.5 ... 0.98 (momentum optimizers)
    "warmup_frac": (0.0, 0.2, "linear"),       # linear warm-up from 0 over this fraction of the step budget,
    "decay_to": (0.01, 0.3, "log"),             # then linear decay to this fraction of the peak at the budget's end
    "trust": (0.001, 0.02, "log"),              # LARS trust coefficient (relative step of a layer ~ lr * trust)
}
# The LR window slides with the batch size: lr_eff range * (b / LR_REFERENCE_BATCH) ** LR_WINDOW_EXPONENT.
# 0.75 lies halfway between the square-root and linear rules, so over 16 ... 2048 neither rule's optimum sits near
# an edge of the two-decade window. Caveat: where the optimum is flat, the best trial's LR follows the window and
# the fitted LR slope is pulled towards 0.75; use --lr-window-exponent 0 (and a wider range) for a fixed window.
LR_REFERENCE_BATCH = 256
LR_WINDOW_EXPONENT = 0.75
EDGE_FRACTION = 0.1  # a best LR in the outer 10% (log scale) of its window is flagged: widen the search space

# Regime tolerances (see analyse()).
PERFECT_TOL = 0.25   # perfect scaling: best steps at most 25% above the ideal line steps = s0 * b0 / b
USEFUL_TOL = 0.10    # maximal useful batch: no larger batch cuts the steps by 10% or more per doubling


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """How a point of the search space becomes train_cifar options. lr is always lr_eff * (1 - momentum)."""
    dims: tuple     # searched metaparameters (keys of SEARCH_SPACE)
    options: object  # params -> train_cifar overrides (optimizer, momentum, nesterov, ...)
    about: str


def _momentum(p):
    return 1.0 - p["one_minus_momentum"]


SCHEDULE_DIMS = ("lr_eff", "warmup_frac", "decay_to")
OPTIMIZERS = {
    "sgd": Optimizer(SCHEDULE_DIMS, lambda p: dict(optimizer="sgd", momentum=0.0, nesterov=False),
                     "plain SGD (momentum 0)"),
    "momentum": Optimizer(SCHEDULE_DIMS + ("one_minus_momentum",),
                          lambda p: dict(optimizer="sgd", momentum=_momentum(p), nesterov=False),
                          "heavy-ball momentum"),
    "nesterov": Optimizer(SCHEDULE_DIMS + ("one_minus_momentum",),
                          lambda p: dict(optimizer="sgd", momentum=_momentum(p), nesterov=True),
                          "Nesterov momentum"),
    "lars": Optimizer(SCHEDULE_DIMS + ("one_minus_momentum", "trust"),
                      lambda p: dict(optimizer="lars", momentum=_momentum(p), nesterov=False,
                                     trust_coefficient=p["trust"]),
                      "LARS with heavy-ball momentum; BN parameters and biases take the plain lr"),
}

# ---------------------------------------------------------------------------------------------------------------
# Scrambled Halton sequence


def primes(n):
    """The first n primes."""
    out, k = [], 2
    while len(out) < n:
        if all(k % p for p in out if p * p <= k):
            out.append(k)
        k += 1
    return out


def scrambled_halton(n, d, seed=0):
    """The first n points of the d-dimensional Halton sequence (coordinate j: radical inverse in the j-th prime),
    every digit scrambled by a random permutation of 0..p-1 drawn per coordinate and digit position.

    Low discrepancy: trials cover the space more evenly than random ones, so a budget of a few trials still
    probes every part of the LR window. The plain sequence (seed=None) is correlated in high coordinates
    and starts at 0; the digit permutations (Braaten & Weller 1979) remove both and keep each coordinate's
    stratification (any p^k consecutive points hit every interval [i/p^k, (i+1)/p^k) once). Point i depends
    only on (i, coordinate, seed), not on n or d, so a resumed or enlarged study draws the same trials."""
    rng = np.random.default_rng(seed) if seed is not None else None
    index = np.arange(n, dtype=np.int64)
    out = np.empty((n, d))
    for j, p in enumerate(primes(d)):
        n_digits = math.ceil(53 / math.log2(p))  # double precision; fixed, so permutations do not depend on n
        perms = [rng.permutation(p) if rng is not None else np.arange(p) for _ in range(n_digits)]
        u, rest, scale = np.zeros(n), index.copy(), 1.0 / p
        for k in range(n_digits):
            u += perms[k][rest % p] * scale
            rest //= p
            scale /= p
        out[:, j] = u
    return np.minimum(out, np.nextafter(1.0, 0.0))


# ---------------------------------------------------------------------------------------------------------------
# Trials: metaparameters, schedule, budget


def lr_window(batch_size, space=SEARCH_SPACE, exponent=LR_WINDOW_EXPONENT, reference=LR_REFERENCE_BATCH):
    lo, hi, _ = space["lr_eff"]
    f = (batch_size / reference) ** exponent
    return lo * f, hi * f


def from_unit(u, low, high, scale):
    return math.exp(math.log(low) + u * (math.log(high) - math.log(low))) if scale == "log" else low + u * (high - low)


def sample_params(optimizer, trial, batch_size, seed=0, space=SEARCH_SPACE, exponent=LR_WINDOW_EXPONENT,
                  reference=LR_REFERENCE_BATCH):
    """Metaparameters of trial `trial` (0-based) at this batch size: point `trial` of the scrambled Halton
    sequence, mapped through the optimizer's dimensions of the search space."""
    u = scrambled_halton(trial + 1, len(space), seed)[trial]
    coord = {name: float(u[i]) for i, name in enumerate(space)}
    params = {}
    for name in OPTIMIZERS[optimizer].dims:
        low, high, scale = space[name]
        if name == "lr_eff":
            low, high = lr_window(batch_size, space, exponent, reference)
        params[name] = from_unit(coord[name], low, high, scale)
    options = OPTIMIZERS[optimizer].options(params)
    params.update(momentum=options["momentum"], lr=params["lr_eff"] * (1 - options["momentum"]))
    return params, options


def lr_knots(params, budget_epochs):
    """Piecewise-linear schedule in epochs: 0 -> lr over the warm-up, then linear to decay_to * lr at the end."""
    lr, w = params["lr"], params["warmup_frac"] * budget_epochs
    if w > 0:
        return [0.0, w, budget_epochs], [0.0, lr, lr * params["decay_to"]]
    return [0.0, budget_epochs], [lr, lr * params["decay_to"]]


def budget_steps(batch_size, n_train, epochs, min_steps):
    return max(math.ceil(epochs * (n_train // batch_size)), int(min_steps))


def make_trial(settings, batch_size, trial, n_train):
    """Everything one trial needs: its key, metaparameters, budget and the train_cifar options."""
    per_epoch = n_train // batch_size
    budget = budget_steps(batch_size, n_train, settings["epochs"], settings["min_steps"])
    every = max(1, budget // settings["evals_per_trial"])
    space = {k: tuple(v) for k, v in settings["search_space"].items()}
    window = dict(exponent=settings["lr_window_exponent"], reference=settings["lr_reference_batch"])
    params, options = sample_params(settings["optimizer"], trial, batch_size, settings["seed"], space, **window)
    budget_epochs = budget / per_epoch
    knots, values = lr_knots(params, budget_epochs)
    train = dict(settings["overrides"], **options, batch_size=batch_size,
                 epochs=(budget - 0.5) / per_epoch,  # the trainer runs ceil(epochs * per_epoch) = budget steps
                 lr_knots=tuple(knots), lr_values=tuple(values), target=settings["target"], stop_at_target=True,
                 eval_every=0, eval_every_steps=every, holdout=settings["holdout"], seed=settings["seed"] + trial,
                 runs=1)
    train = core.as_tuples(train)
    return dict(workload=settings["workload"], optimizer=settings["optimizer"], batch_size=batch_size, trial=trial,
                params=params, budget_steps=budget, budget_epochs=budget_epochs, eval_every_steps=every,
                lr_window=list(lr_window(batch_size, space, **window)), train=train)


def plan(settings, batch_sizes, trials, n_train, shard=None, order=()):
    """Trial-major order: trial 0 at every batch size, then trial 1, ... (a partial study is a rough curve).
    order: trials to run first, in this order (the rest follow in index order), e.g. those that did best at a
    smaller batch size, so a study cut short has spent its time where the target is likeliest.
    shard (K, N): every N-th trial from the K-th of the trial-major plan without `order`, so each of N shards spans
    all batch sizes, and shards given different orders still split the study between them (sharding the
    reordered plan ran some trials in two shards and others in none)."""
    first = [t for t in dict.fromkeys(order) if t < trials]
    ts = first + [t for t in range(trials) if t not in first]
    keys = [(t, b) for t in range(trials) for b in sorted(batch_sizes)]
    mine = set(keys[shard[0]::shard[1]] if shard else keys)
    return [make_trial(settings, b, t, n_train) for t in ts for b in sorted(batch_sizes) if (t, b) in mine]


def run_trial(spec, data, preset, device=None, log=lambda *a: None):
    """One real trial through train_cifar.train; a diverged run is a record with diverged=True."""
    import train_cifar
    rec = {k: spec[k] for k in ("workload", "optimizer", "batch_size", "trial", "params", "budget_steps",
                                "budget_epochs", "eval_every_steps", "lr_window")}
    rec.update(reached=False, diverged=False, steps_to_target=None, examples_to_target=None)
    t = time.perf_counter()
    try:
        s = train_cifar.train(preset, data=data, device=device, log=log, log_dir=None, **spec["train"])
        run = s["runs"][0]
        steps = run["step_reached_target"]
        if steps is None and run["epoch_reached_target"] is not None:  # only the final evaluation reached it
            steps = spec["budget_steps"]
        accs = [e["test_acc"] for e in run["evals"]] + ([run["accuracy"]] if run["accuracy"] is not None else [])
        rec.update(reached=steps is not None, steps_to_target=steps,
                   examples_to_target=steps * spec["batch_size"] if steps is not None else None,
                   last_eval_step=run["evals"][-1]["step"] if run["evals"] else None,
                   best_acc=max(accs) if accs else None, final_acc=run["accuracy"],
                   time_to_target_s=run["time_to_target_s"], train_time_s=run["total_time_s"],
                   evals=[[e["step"], round(e["test_acc"], 5), round(e["train_loss"], 5)] for e in run["evals"]],
                   hardware=s["hardware"], precision=s["precision"], commit=s["commit"])
    except train_cifar.Diverged as e:
        rec.update(diverged=True, error=str(e))
    rec.update(wall_s=time.perf_counter() - t,
               finished=core.utc_timestamp())
    return rec


# ---------------------------------------------------------------------------------------------------------------
# Trials file and the resumable runner


class StudyError(ValueError):
    pass


def trial_key(rec):
    return rec["workload"], rec["optimizer"], int(rec["batch_size"]), int(rec["trial"])


_STRING = (lambda v: isinstance(v, str), "a string", True)
_COUNT = (lambda v: core.is_whole(v, 1), "a whole number >= 1", True)
# Fields of a trial record that resume, the summary and the plots read: key -> (test, what it must be, required).
# A record missing one failed deep inside them (KeyError, AttributeError), long after the file was read.
TRIAL_FIELDS = {
    "workload": _STRING, "optimizer": _STRING, "batch_size": _COUNT,
    "trial": (lambda v: core.is_whole(v, 0), "a whole number >= 0", True),
    "settings": (lambda v: isinstance(v, dict), "an object", True),
    "reached": (lambda v: isinstance(v, bool), "true or false", True),
    "diverged": (lambda v: isinstance(v, bool), "true or false", True),
    "budget_steps": _COUNT, "eval_every_steps": _COUNT,
    "steps_to_target": (lambda v: v is None or core.is_whole(v, 1), "null or a whole number >= 1", False),
    "best_acc": (lambda v: v is None or core.is_number(v), "null or a number", False),
    "params": (lambda v: isinstance(v, dict), "an object", True),
    "lr_window": (lambda v: isinstance(v, list) and len(v) == 2 and all(core.is_number(x) and x > 0 for x in v),
                  "two positive numbers", True),
}
SETTINGS_FIELDS = {"workload": _STRING, "optimizer": _STRING, "eval": _STRING,
                   "target": (core.is_number, "a number", True)}
PARAMS_FIELDS = {k: (lambda v: core.is_number(v) and v >= 0, "a number >= 0", True)
                 for k in ("lr", "momentum", "warmup_frac", "decay_to")}
PARAMS_FIELDS.update(lr_eff=(lambda v: core.is_number(v) and v > 0, "a number > 0", True),
                     trust=(lambda v: v is None or core.is_number(v), "null or a number", False))


def record_problem(rec):
    """Why a parsed line is not a trial record of this study, or None."""
    problem = (core.field_problem(rec, TRIAL_FIELDS)
               or core.field_problem(rec["settings"], SETTINGS_FIELDS, "settings.")
               or core.field_problem(rec["params"], PARAMS_FIELDS, "params."))
    if not problem and rec["reached"] and rec.get("steps_to_target") is None:
        problem = 'a trial that reached the target with no "steps_to_target"'
    return problem


def read_trials(path, repair=False, warn=lambda m: print(m, file=sys.stderr)):
    """Records of trials.jsonl (core.read_jsonl: a line torn by a crash skipped, or with repair cut off). A line
    that parses but is no trial record (edited, or another file) is a StudyError naming it."""
    records = []
    for n, rec in core.read_jsonl(path, repair, warn, error=StudyError):
        problem = record_problem(rec)
        if problem:
            raise StudyError(f"{path}:{n} is not a trial record of this study ({problem}); fix or remove that line")
        records.append(rec)
    return records


def describe_params(p):
    bits = [f"lr_eff {p['lr_eff']:.3g}"] + ([f"m {p['momentum']:.3f}"] if p["momentum"] else [])
    # both fractions, not absolute values: of the trial's step budget, and of the peak LR at the budget's end
    bits += [f"warm-up {p['warmup_frac']:.2f} of the budget", f"decay to {p['decay_to']:.3g} x the peak LR"]
    return ", ".join(bits + ([f"trust {p['trust']:.3g}"] if "trust" in p else []))


def describe(rec):
    if rec.get("diverged"):
        what = "DIVERGED"
    elif rec.get("reached"):
        what = f"target at step {rec['steps_to_target']}/{rec['budget_steps']}"
    else:
        acc = rec.get("best_acc")
        what = f"not reached in {rec['budget_steps']} steps" + (f" (best acc {acc:.4f})" if acc is not None else "")
    return f"b={rec['batch_size']:<5} trial {rec['trial']}: {describe_params(rec['params'])}: {what}"


def trial_files(out):
    """The trial files of an output folder: trials.jsonl, then the shards' trials-shard<K>of<N>.jsonl."""
    if not os.path.isdir(out):
        return []
    names = [n for n in os.listdir(out) if n.startswith("trials") and n.endswith(".jsonl")]
    return [os.path.join(out, n) for n in sorted(names, key=lambda n: (n != "trials.jsonl", n))]


def read_folder(out, warn=lambda m: print(m, file=sys.stderr)):
    """Every trial of an output folder, over all its trial files; a trial found twice counts once (the first)."""
    seen, records = {}, []
    for path in trial_files(out):
        for r in read_trials(path, warn=warn):
            key = trial_key(r)
            if key in seen:
                if seen[key] != r:
                    warn(f"warning: {path}: trial {key} differs from an earlier record of it; the earlier is kept")
                continue
            seen[key] = r
            records.append(r)
    return records


def shard_path(out, shard):
    return os.path.join(out, "trials.jsonl" if shard is None else f"trials-shard{shard[0]}of{shard[1]}.jsonl")


def run_study(specs, trial_fn, path, settings, log=print, others=()):
    """Runs the specs whose key is not yet in `path` (or in `others`, the records of other shards), appending
    each record to `path` as soon as it finishes; returns the records of `path`. A KeyboardInterrupt loses only
    the trial in flight and propagates. Records made with other settings are an error: a resumed study must
    measure the same thing."""
    records = read_trials(path, repair=True)
    known = records + list(others)
    other = [r for r in known if r.get("settings") != settings]
    if other:
        raise StudyError(f"{path} holds trials with other settings "
                         f"({core.settings_difference(other[0].get('settings'), settings)}); use another --out")
    done = {trial_key(r) for r in known}
    todo = [s for s in specs if trial_key(s) not in done]
    log(f"{len(done)} finished trial(s) in {os.path.dirname(path) or '.'}, {len(todo)} of this run's to go")
    t0, walls = time.perf_counter(), collections.defaultdict(list)
    for i, spec in enumerate(todo, 1):
        rec = dict(trial_fn(spec), settings=settings)
        core.append_jsonl(path, rec)  # a crash loses at most the trial in flight
        records.append(rec)
        walls[spec["batch_size"]].append(rec.get("wall_s", 0.0))
        everything = [w for ws in walls.values() for w in ws]
        eta = sum(np.mean(walls[s["batch_size"]]) if walls[s["batch_size"]] else np.mean(everything)
                  for s in todo[i:])
        log(f"[{i}/{len(todo)}] {describe(rec)} | {rec.get('wall_s', 0.0):.0f} s | "
            f"elapsed {core.format_duration(time.perf_counter() - t0)}, ETA {core.format_duration(eta)}")
    return records


# ---------------------------------------------------------------------------------------------------------------
# Analysis (pure)


def best_per_batch(records):
    """Per batch size: the best trial (fewest steps to target; ties to the higher accuracy) and counts."""
    groups = collections.defaultdict(list)
    for r in records:
        groups[int(r["batch_size"])].append(r)
    rows = []
    for b in sorted(groups):
        recs = sorted(groups[b], key=lambda r: r["trial"])
        ok = [r for r in recs if r.get("reached")]
        row = dict(batch_size=b, trials=len(recs), reached=len(ok), diverged=sum(bool(r.get("diverged")) for r in recs),
                   budget_steps=max(r["budget_steps"] for r in recs), eval_every_steps=recs[0]["eval_every_steps"],
                   best_steps=None, best_examples=None, best_trial=None)
        if ok:
            best = min(ok, key=lambda r: (r["steps_to_target"], -(r.get("best_acc") or 0), r["trial"]))
            p = best["params"]
            lo, hi = best["lr_window"]
            pos = math.log(p["lr_eff"] / lo) / math.log(hi / lo) if hi > lo else 0.5
            row.update(best_steps=best["steps_to_target"], best_examples=best["steps_to_target"] * b,
                       best_trial=best["trial"], best_lr=p["lr"], best_lr_eff=p["lr_eff"], best_momentum=p["momentum"],
                       best_warmup_frac=p["warmup_frac"], best_decay_to=p["decay_to"], best_trust=p.get("trust"),
                       lr_window_lo=lo, lr_window_hi=hi,
                       lr_at_edge=bool(pos < EDGE_FRACTION or pos > 1 - EDGE_FRACTION))
        rows.append(row)
    return rows


def analyse(points, perfect_tol=PERFECT_TOL, useful_tol=USEFUL_TOL):
    """Regimes of a steps-to-target curve. points: (batch_size, steps or None[, resolution]); None (target never
    reached) counts as infinitely many steps. resolution (default 0) is the evaluation interval: a trial that
    reports s steps met the target somewhere in (s - resolution, s].

    ideal: steps = s0 * b0 / b through the smallest batch size b0 that reached the target.
    perfect_end: the largest b such that every batch size from b0 to b needs at most (1 + perfect_tol) x ideal.
    max_useful: the smallest b such that no larger b' cuts steps by useful_tol or more per doubling beyond what
        the evaluation interval can hide, s(b') > (s(b) - resolution(b)) * (1 - useful_tol) ** log2(b' / b) (at
        batch 1024, 100 steps measured every 10 against 90 at 2048 is no measured cut); a noisy point in the
        middle does not end the search while larger batches still pay off. At least perfect_end. beyond_range:
        max_useful is the largest batch size that reached the target and nothing larger was measured, i.e. the
        curve was not seen to flatten.
    diminishing: the batch sizes in (perfect_end, max_useful]."""
    resolution = {int(p[0]): float(p[2]) if len(p) > 2 and p[2] else 0.0 for p in points}
    pts = sorted((int(b), math.inf if s is None else float(s)) for b, s, *_ in points)
    finite = [(b, s) for b, s in pts if math.isfinite(s)]
    result = dict(perfect_tol=perfect_tol, useful_tol=useful_tol, anchor=None, perfect_end=None, max_useful=None,
                  beyond_range=None, diminishing=[], points=[])
    if not finite:
        result["points"] = [dict(batch_size=b, steps=None, regime="not reached") for b, _ in pts]
        return result
    b0, s0 = finite[0]
    ideal = lambda b: s0 * b0 / b  # noqa: E731
    later = [(b, s) for b, s in pts if b >= b0]
    perfect_end = b0
    for b, s in later[1:]:
        if s > ideal(b) * (1 + perfect_tol):
            break
        perfect_end = b
    max_useful = finite[-1][0]
    for i, (b, s) in enumerate(later):
        floor = s - resolution[b]  # the fewest steps b may truly have needed
        if math.isfinite(s) and all(s2 > floor * (1 - useful_tol) ** math.log2(b2 / b) for b2, s2 in later[i + 1:]):
            max_useful = b
            break
    max_useful = max(max_useful, perfect_end)
    result.update(anchor=[b0, s0], perfect_end=perfect_end, max_useful=max_useful,
                  beyond_range=max_useful == pts[-1][0],
                  diminishing=[b for b, _ in pts if perfect_end < b <= max_useful])
    prev = None
    for b, s in pts:
        regime = ("not reached" if not math.isfinite(s) else "before anchor" if b < b0 else
                  "perfect" if b <= perfect_end else "diminishing" if b <= max_useful else "beyond max useful")
        cut = None
        if prev is not None and math.isfinite(s) and b > prev[0]:  # steps cut per doubling since the last point
            cut = 1 - (s / prev[1]) ** (1 / math.log2(b / prev[0]))
        result["points"].append(dict(batch_size=b, steps=s if math.isfinite(s) else None,
                                     ideal_steps=ideal(b), steps_over_ideal=s / ideal(b) if math.isfinite(s) else None,
                                     cut_per_doubling=cut, regime=regime))
        if math.isfinite(s):
            prev = (b, s)
    return result


UNDECIDED = "undecided"


def lr_trend(batch_sizes, lrs):
    """Least-squares slope of log(best lr) against log(batch size), its standard error, and which scaling rule
    it is closer to: 1 (linear, Goyal et al. 2017) or 0.5 (square root, Krizhevsky 2014). UNDECIDED where the
    slope prints as 0.75, halfway (2 batch sizes put it there when both best trials are the same point of the
    window, which slides as batch^0.75), or where 0.75 lies within slope ± its standard error."""
    pts = [(b, lr) for b, lr in zip(batch_sizes, lrs) if lr is not None and lr > 0]
    if len(pts) < 2:
        return dict(n=len(pts), slope=None, stderr=None, intercept=None, closer_to=None, undecided_because=None)
    x, y = np.log([b for b, _ in pts]), np.log([lr for _, lr in pts])
    slope, intercept = np.polyfit(x, y, 1)
    stderr = None
    if len(pts) > 2:
        resid = y - (slope * x + intercept)
        stderr = float(math.sqrt(resid @ resid / (len(pts) - 2) / ((x - x.mean()) @ (x - x.mean()))))
    undecided = ("0.75 is halfway between square root (0.5) and linear (1)" if round(slope, 2) == 0.75 else
                 "0.75, halfway between square root (0.5) and linear (1), lies within one standard error"
                 if stderr is not None and abs(slope - 0.75) <= stderr else None)
    closer = UNDECIDED if undecided else "linear (1)" if slope > 0.75 else "square root (0.5)"
    return dict(n=len(pts), slope=float(slope), stderr=stderr, intercept=float(intercept), closer_to=closer,
                undecided_because=undecided)


def summarise(records):
    """Rows per batch size, regimes of the best-steps curve and the LR trends (all points, perfect region)."""
    rows = best_per_batch(records)
    regimes = analyse([(r["batch_size"], r["best_steps"], r["eval_every_steps"]) for r in rows])
    by_b = {p["batch_size"]: p for p in regimes["points"]}
    for r in rows:
        p = by_b[r["batch_size"]]
        r.update(ideal_steps=p.get("ideal_steps"), steps_over_ideal=p.get("steps_over_ideal"), regime=p["regime"])
    bs, lrs = [r["batch_size"] for r in rows], [r.get("best_lr_eff") for r in rows]
    trend = dict(all=lr_trend(bs, lrs))
    if regimes["perfect_end"] is not None:
        keep = [(b, lr) for b, lr in zip(bs, lrs) if b <= regimes["perfect_end"]]
        trend["perfect_scaling"] = lr_trend([b for b, _ in keep], [lr for _, lr in keep])
    return rows, regimes, trend


SUMMARY_COLUMNS = ["batch_size", "trials", "reached", "diverged", "budget_steps", "eval_every_steps", "best_steps",
                   "best_examples", "ideal_steps", "steps_over_ideal", "regime", "best_trial", "best_lr",
                   "best_lr_eff", "best_momentum", "best_warmup_frac", "best_decay_to", "best_trust", "lr_at_edge"]


def fmt_cell(v):
    return "" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v)


def write_summary(out, settings, records, status):
    rows, regimes, trend = summarise(records)
    tmp = os.path.join(out, f"summary.tsv.tmp{os.getpid()}")  # (per process: shards finishing together)
    with open(tmp, "w") as f:
        f.write("\t".join(SUMMARY_COLUMNS) + "\n")
        for r in rows:
            f.write("\t".join(fmt_cell(r.get(c)) for c in SUMMARY_COLUMNS) + "\n")
    os.replace(tmp, os.path.join(out, "summary.tsv"))
    core.write_json_atomic(os.path.join(out, "summary.json"), dict(
        settings=settings, status=status, trials=len(records), rows=rows, regimes=regimes, lr_trend=trend,
        written=core.utc_timestamp(),
        note="best_steps: fewest steps to target over the trials at that batch size; lr_eff = lr / (1 - momentum)"))
    return rows, regimes, trend


def report(rows, regimes, trend, log=print):
    log(f"{'batch':>6} {'reached':>8} {'best steps':>10} {'x ideal':>8} {'lr_eff':>8} {'lr':>8} {'momentum':>8}  "
        "regime")
    for r in rows:
        edge = " (LR at window edge)" if r.get("lr_at_edge") else ""
        steps = f"{r['best_steps']}" if r["best_steps"] is not None else f">{r['budget_steps']}"
        ratio = f"{r['steps_over_ideal']:.2f}" if r.get("steps_over_ideal") is not None else "-"
        lr = lambda k: f"{r[k]:.3g}" if r.get(k) is not None else "-"  # noqa: E731
        log(f"{r['batch_size']:>6} {r['reached']:>3}/{r['trials']:<4} {steps:>10} {ratio:>8} {lr('best_lr_eff'):>8} "
            f"{lr('best_lr'):>8} {lr('best_momentum'):>8}  {r['regime']}{edge}")
    if regimes["perfect_end"] is not None:
        # Larger batch sizes that never reached the target say nothing about a plateau: name them instead.
        larger = [p for p in regimes["points"] if p["batch_size"] > regimes["max_useful"]]
        missed = [p["batch_size"] for p in larger if p["steps"] is None]
        not_reached = (f"{', '.join(map(str, missed))} did not reach the target within "
                       + ("its budget" if len(missed) == 1 else "their budgets"))
        flat = f"no larger batch cuts steps by {regimes['useful_tol']:.0%} per doubling"
        why = (" (or larger: the curve did not flatten in the measured range)" if regimes["beyond_range"] else
               f" ({flat})" if not missed else f" ({not_reached}: unknown whether larger batches pay off)"
               if len(missed) == len(larger) else f" ({flat} among those that reached it; {not_reached})")
        log(f"perfect scaling (within {regimes['perfect_tol']:.0%} of ideal) up to batch {regimes['perfect_end']}; "
            f"maximal useful batch size {regimes['max_useful']}" + why)
    for name, t in trend.items():
        if t.get("slope") is not None:
            se = f" ± {t['stderr']:.2f}" if t["stderr"] is not None else ""
            verdict = (f"closer to {t['closer_to']}" if t["closer_to"] != UNDECIDED else
                       f"undecided: {t['undecided_because']}")
            log(f"best lr_eff ~ batch^{t['slope']:.2f}{se} over {t['n']} batch sizes ({name.replace('_', ' ')}): "
                + verdict)


# ---------------------------------------------------------------------------------------------------------------
# Plots


def plot(curves, out_dir):
    """curves: (label, rows, regimes, trend). Writes steps_to_target.png and best_lr.png into out_dir."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    all_b = sorted({r["batch_size"] for _, rows, _, _ in curves for r in rows})
    for i, (label, rows, reg, _) in enumerate(curves):
        c = colors[i % len(colors)]
        ok = [r for r in rows if r["best_steps"] is not None]
        ax.plot([r["batch_size"] for r in ok], [r["best_steps"] for r in ok], "o-", color=c, label=label)
        # The target was met somewhere in (steps - eval interval, steps]: show that interval.
        lower = [min(r["eval_every_steps"], r["best_steps"] - 1) for r in ok]
        ax.errorbar([r["batch_size"] for r in ok], [r["best_steps"] for r in ok], yerr=[lower, [0] * len(ok)],
                    fmt="none", ecolor=c, elinewidth=1, capsize=3,
                    label="evaluation interval (target met within)" if i == 0 else None)
        missed = [r for r in rows if r["best_steps"] is None]
        if missed:
            ax.plot([r["batch_size"] for r in missed], [r["budget_steps"] for r in missed], "^", color=c, mfc="none",
                    label=f"{label}: not reached (steps > budget)")
        if reg["anchor"] is None:
            continue
        b0, s0 = reg["anchor"]
        own_b = [b for b in all_b if b >= b0]  # from the curve's own first point: no line where it has no data
        ax.plot(own_b, [s0 * b0 / b for b in own_b], "--", color=c, lw=1, alpha=0.7,
                label="perfect scaling (ideal 1/b)" if i == 0 else None)
        steps = {r["batch_size"]: r["best_steps"] for r in ok}
        ax.plot([reg["perfect_end"]], [steps[reg["perfect_end"]]], "s", ms=13, mfc="none", mec=c, mew=2,
                label="end of perfect scaling" if i == 0 else None)
        ax.plot([reg["max_useful"]], [steps[reg["max_useful"]]], "*", ms=16, color=c, mec="k",
                label="maximal useful batch size" if i == 0 else None)
        if len(curves) == 1:  # shade the regimes, boundaries halfway (in log) between measured batch sizes
            def edge(b, side):
                k = all_b.index(b)
                nb = all_b[k + side] if 0 <= k + side < len(all_b) else b * 2.0 ** side
                return math.sqrt(b * nb)
            lo, hi = edge(all_b[0], -1), edge(all_b[-1], 1)
            p_hi, m_hi = edge(reg["perfect_end"], 1), edge(reg["max_useful"], 1)
            ax.axvspan(lo, p_hi, color="tab:green", alpha=0.08, label="perfect scaling region")
            if m_hi > p_hi:
                ax.axvspan(p_hi, m_hi, color="tab:orange", alpha=0.08, label="diminishing returns")
            if hi > m_hi:
                ax.axvspan(m_hi, hi, color="tab:red", alpha=0.08, label="beyond maximal useful batch")
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="steps to target (best trial)",
           title="steps to target vs batch size")
    steps_png = _finish_log_log_plot(fig, ax, all_b, os.path.join(out_dir, "steps_to_target.png"))

    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    anchor = None
    for i, (label, rows, _, trend) in enumerate(curves):
        c = colors[i % len(colors)]
        ok = [r for r in rows if r.get("best_lr_eff") is not None]
        if not ok:
            continue
        t = trend["all"]
        slope = f", slope {t['slope']:.2f}" if t.get("slope") is not None else ""
        ax.plot([r["batch_size"] for r in ok], [r["best_lr_eff"] for r in ok], "o-", color=c, label=label + slope)
        edges = [r for r in ok if r["lr_at_edge"]]
        if edges:
            ax.plot([r["batch_size"] for r in edges], [r["best_lr_eff"] for r in edges], "o", ms=11, mfc="none",
                    mec="r", label="at the edge of the search window" if anchor is None else None)
        if len(curves) == 1:
            ax.fill_between([r["batch_size"] for r in ok], [r["lr_window_lo"] for r in ok],
                            [r["lr_window_hi"] for r in ok], color=c, alpha=0.08, label="search window")
        if anchor is None:  # reference lines through the first curve's centroid (geometric means)
            anchor = (math.exp(np.mean(np.log([r["batch_size"] for r in ok]))),
                      math.exp(np.mean(np.log([r["best_lr_eff"] for r in ok]))))
    if anchor is not None:
        for k, style, name in ((1.0, "k--", "linear scaling (slope 1)"),
                               (0.5, "k:", "square-root scaling (slope 0.5)")):
            ax.plot(all_b, [anchor[1] * (b / anchor[0]) ** k for b in all_b], style, lw=1, label=name)
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="best effective LR  lr / (1 - momentum)",
           title="best learning rate vs batch size")
    lr_png = _finish_log_log_plot(fig, ax, all_b, os.path.join(out_dir, "best_lr.png"))
    return steps_png, lr_png


def _finish_log_log_plot(fig, ax, batch_sizes, path):
    """Batch sizes as x tick labels, grid, legend; saves the figure to path and returns path."""
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:  # (nothing reached the target: an empty legend warns)
        ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = f"{path[:-len('.png')]}.tmp{os.getpid()}.png"  # whole or not at all, also with shards ending together
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    import matplotlib.pyplot as plt  # matplotlib is imported only where a plot is drawn
    plt.close(fig)
    return path


def load_dir(d):
    """(label, records) of one output folder: the records made with the settings of its summary (or its last)."""
    records = read_folder(d)
    if not records:
        raise StudyError(f"no trials in {d}")
    settings = records[-1]["settings"]
    records = [r for r in records if r.get("settings") == settings]
    return f"{settings['workload']}/{settings['optimizer']}", settings, records


# ---------------------------------------------------------------------------------------------------------------
# Command line


# train_cifar options the study controls for every trial (not settable with --set).
STUDY_OPTIONS = {"batch_size", "epochs", "lr_knots", "lr_values", "target", "stop_at_target", "eval_every",
                 "eval_every_steps", "holdout", "seed", "runs", "optimizer", "momentum", "nesterov",
                 "trust_coefficient", "warmup_epochs", "lr_scaling"}


def study_settings(workload="cpu", optimizer="nesterov", target=None, eval=None, holdout=None, epochs=None,
                   min_steps=None, evals_per_trial=None, seed=0, lr_range=None,
                   lr_window_exponent=LR_WINDOW_EXPONENT, train_subset=0, overrides=None):
    """What must stay the same within one output folder (batch sizes and trial counts may grow); None takes the
    workload's value. JSON-ready (lists, not tuples), so a resumed study compares equal to the stored one."""
    w = WORKLOADS[workload]
    if optimizer not in OPTIMIZERS:
        raise StudyError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    taken = sorted(set(overrides or {}) & STUDY_OPTIONS)
    if taken:
        raise StudyError(f"--set {', '.join(taken)}: the study controls this per trial (see its own options)")
    space = dict(SEARCH_SPACE)
    if lr_range:
        lo, hi = map(float, lr_range)
        if not 0 < lo <= hi < math.inf:  # (its log scale: 0 or below was a "math domain error")
            raise StudyError(f"--lr-range needs 0 < LO <= HI, both finite, got {lo:g} {hi:g}")
        space["lr_eff"] = (lo, hi, "log")
    eval_split = eval or w["eval"]
    if holdout is not None and eval_split != "holdout":  # it was dropped: the target is judged on the test set
        who = f"--eval {eval}" if eval else f"the {workload} workload"  # (the user's own choice, where given)
        raise StudyError(f"--holdout {holdout} needs --eval holdout ({who} judges the target on "
                         f"the {eval_split} set, so no images are held out)")
    holdout = (holdout if holdout is not None else w["holdout"] or 5000) if eval_split == "holdout" else 0
    if eval_split == "holdout" and holdout < 1:  # (0 would judge the target on the test set after all)
        raise StudyError(f"--holdout must be at least 1 with --eval holdout, got {holdout}")
    if train_subset < 0:
        raise StudyError(f"--train-subset must be >= 0 (0: all), got {train_subset}")
    if train_subset > core.CIFAR10_TRAIN_IMAGES:  # (trained on all of them while the settings recorded N)
        raise StudyError(f"--train-subset {train_subset} exceeds CIFAR-10's {core.CIFAR10_TRAIN_IMAGES} "
                         "training images")
    overrides = dict(w["overrides"], **(overrides or {}))
    pick = lambda v, k: v if v is not None else w[k]  # noqa: E731
    epochs, min_steps = pick(epochs, "epochs"), pick(min_steps, "min_steps")
    evals_per_trial = pick(evals_per_trial, "evals_per_trial")
    if not 0 < epochs < math.inf:
        raise StudyError(f"--epochs must be positive and finite, got {epochs}")
    if min_steps < 0:
        raise StudyError(f"--min-steps must be >= 0, got {min_steps}")
    if evals_per_trial < 1:  # (0 divided by zero, below 0 evaluated every step)
        raise StudyError(f"--evals-per-trial must be at least 1, got {evals_per_trial}")
    return dict(workload=workload, preset=w["preset"], optimizer=optimizer, target=pick(target, "target"),
                eval=eval_split, holdout=holdout, epochs=epochs, min_steps=min_steps, evals_per_trial=evals_per_trial,
                seed=seed,
                search_space={k: list(v) for k, v in space.items()}, lr_window_exponent=lr_window_exponent,
                lr_reference_batch=LR_REFERENCE_BATCH, train_subset=train_subset,
                overrides={k: list(v) if isinstance(v, tuple) else v for k, v in sorted(overrides.items())})


# Named by describe_settings itself; any other option given with --set follows as key=value.
DESCRIBED_OPTIONS = {"widths"}


def describe_settings(settings):
    """What every trial trains, from the effective train_cifar config and study settings (after --set, --target,
    --holdout, ...), not the workload's description: a header restating defaults misled about what ran."""
    import train_cifar
    overrides = core.as_tuples(settings["overrides"])
    cfg = train_cifar.make_config(settings["preset"], **overrides)
    net = settings["preset"] + (" net at widths " + "/".join(map(str, cfg["widths"])) if cfg["widths"] else "")
    where = (f"on a {settings['holdout']}-image holdout" if settings["eval"] == "holdout" else "on the test set")
    preset = train_cifar.make_config(settings["preset"])
    # the workload's own changes from its preset too (gpu94: tta=0 ...)
    given = core.differing_keys([cfg, preset], ignore=DESCRIBED_OPTIONS | {"target", "holdout", "runs", "seed"})
    return ", ".join([net, f"{settings['target'] * 100:g}% {where}",
                      f"budget max({settings['epochs']:g} epoch{'s' if settings['epochs'] != 1 else ''}, "
                      f"{settings['min_steps']} steps)",
                      f"{settings['evals_per_trial']} evaluations per budget"]
                     + [f"{k}={cfg[k]}" for k in given])


def study_header(args):
    return (f"study: {args.workload} ({describe_settings(args.settings)}), {args.optimizer} "
            f"({OPTIMIZERS[args.optimizer].about}), batch sizes {' '.join(map(str, args.batch_sizes))}, "
            f"{args.trials} trials each")


def parse_args(argv):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run (or resume) a study")
    r.add_argument("--workload", default="cpu", choices=list(WORKLOADS),
                   help="; ".join(f"{k}: {w['about']}" for k, w in WORKLOADS.items()).replace("%", "%%"))
    r.add_argument("--optimizer", default="nesterov", choices=list(OPTIMIZERS),
                   help="; ".join(f"{k}: {o.about}" for k, o in OPTIMIZERS.items()))
    r.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default: the workload's")
    r.add_argument("--trials", type=int, default=8, help="trials per batch size")
    r.add_argument("--data", default=None, help="CIFAR-10 .npz, tarball or folder (default: $CIFAR10_DATA or ./data)")
    r.add_argument("--eval", choices=["holdout", "test"], default=None,
                   help="judge the target on held-out training images or the test set (default: the workload's)")
    r.add_argument("--holdout", type=int, default=None, help="held-out images for --eval holdout (default 5000)")
    r.add_argument("--target", type=float, default=None, help="accuracy to reach (default: the workload's)")
    r.add_argument("--epochs", type=float, default=None, help="step budget in epochs (default: the workload's)")
    r.add_argument("--min-steps", type=int, default=None, help="the budget is never below this many steps")
    r.add_argument("--evals-per-trial", type=int, default=None, help="evaluations over a full budget")
    r.add_argument("--lr-range", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                   help=f"effective-LR window at batch {LR_REFERENCE_BATCH} (default {SEARCH_SPACE['lr_eff'][:2]})")
    r.add_argument("--lr-window-exponent", type=float, default=LR_WINDOW_EXPONENT,
                   help="the LR window slides as batch**this (0: the same window everywhere)")
    r.add_argument("--seed", type=int, default=0, help="seeds the Halton scrambling; trial t trains with seed+t")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other train_cifar option, e.g. --set precision=fp32 --set 'widths=(8,16,16)'")
    r.add_argument("--train-subset", type=int, default=0, metavar="N",
                   help="train on a fixed random N images (smoke tests)")
    r.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    r.add_argument("--out", default=None, help="output folder (default logs/batch-size-<workload>-<optimizer>)")
    r.add_argument("--shard", default=None, metavar="K/N",
                   help="run every N-th trial of the plan, from the K-th (0-based), into trials-shardKofN.jsonl of "
                        "the same folder: N processes with K = 0..N-1 share a study; each skips what any has done")
    r.add_argument("--trial-order", type=int, nargs="+", default=[], metavar="T",
                   help="run these trials first, in this order (the others follow); the metaparameters of trial t "
                        "do not change, only when it runs")
    r.add_argument("--dry-run", action="store_true",
                   help="print the planned trials and exit (budgets for CIFAR-10 unless --data is given)")
    r.add_argument("--verbose", action="store_true", help="print every trial's training log")
    q = sub.add_parser("plot", help="summaries and plots of one or several output folders (one curve each)")
    q.add_argument("dirs", nargs="+", help="output folders of `run`")
    q.add_argument("--out", default=None, help="where the PNGs go (default: the folder, or logs/batch-size-plots)")
    args = p.parse_args(argv)
    if args.command == "run":
        w = WORKLOADS[args.workload]
        args.batch_sizes = core.distinct_values("--batch-sizes", sorted(args.batch_sizes or w["batch_sizes"]))
        if min(args.batch_sizes) < 1 or args.trials < 1:
            p.error("batch sizes and --trials must be positive")
        if any(not 0 <= t < args.trials for t in args.trial_order):
            p.error(f"--trial-order takes trial numbers from 0 to {args.trials - 1}")
        if args.shard is not None:
            k, sep, n = args.shard.partition("/")
            if not (sep and k.isdecimal() and n.isdecimal() and 0 <= int(k) < int(n)):  # ("²".isdigit())
                p.error(f"--shard expects K/N with 0 <= K < N, got {args.shard!r}")
            args.shard = (int(k), int(n))
        try:
            args.settings = study_settings(args.workload, args.optimizer, args.target, args.eval, args.holdout,
                                           args.epochs, args.min_steps, args.evals_per_trial, args.seed,
                                           args.lr_range, args.lr_window_exponent, args.train_subset,
                                           core.parse_overrides(args.set))
            import train_cifar
            train_cifar.make_config(w["preset"], **core.as_tuples(args.settings["overrides"]))
            for b in args.batch_sizes:  # a window reaching 0 or inf was a "math domain error" naming nothing
                try:
                    lo, hi = lr_window(b, args.settings["search_space"], args.lr_window_exponent)
                except OverflowError:
                    lo = hi = math.inf
                if not 0 < lo <= hi < math.inf:
                    raise StudyError(f"--lr-window-exponent {args.lr_window_exponent:g} puts the LR window at batch "
                                     f"{b} out of floating-point range")
            # at most this many (the real data may hold fewer: the run checks again with it in hand)
            holdout = args.settings["holdout"]
            n_train = (args.train_subset or core.CIFAR10_TRAIN_IMAGES) - holdout
            source = (f"--train-subset {args.train_subset}" if args.train_subset else
                      f"CIFAR-10's {core.CIFAR10_TRAIN_IMAGES}")
            if n_train < 1:  # ("-4900 training images ... are too few" said it the hard way)
                raise StudyError(holdout_leaves_none(holdout, n_train + holdout, source))
            if n_train < max(args.batch_sizes):
                held = f" less a holdout of {holdout}" if holdout else ""
                raise StudyError(f"{n_train} training images ({source}{held}) are too few for batch sizes up to "
                                 f"{max(args.batch_sizes)}")
            # every trial's options (the target, each sampled LR and budget, ghost-BN groups dividing the batch)
            # checked now, not after hours of others
            given = core.parse_overrides(args.set)
            for spec in plan(args.settings, args.batch_sizes, args.trials, n_train):
                cfg = train_cifar.make_config(w["preset"], **spec["train"])
                train_cifar.check_distributed(cfg, 1)
                train_cifar.check_given(cfg, given, as_set=True)
        except ValueError as e:
            p.error(str(e))
        args.out = args.out or os.path.join("logs", f"batch-size-{args.workload}-{args.optimizer}")
    return p, args


def holdout_leaves_none(holdout, n_images, source):
    return (f"a holdout of {holdout} leaves none of the {n_images} training images ({source}) to train on; give a "
            "smaller --holdout")


def load_data(parser, args):
    """The training data of the study (--train-subset taken), or a one-line error."""
    import torch_backend as tb
    import train_cifar
    path = args.data or train_cifar.default_data_path()
    try:
        return tb.train_subset(tb.load_cifar10(path), args.train_subset, path)
    except tb.DataError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


def cmd_run(parser, args):
    settings = args.settings
    if args.dry_run:  # budgets are in epochs of the training images: CIFAR-10's unless --data names other data
        data = load_data(parser, args) if args.data else None
    else:
        import torch_backend as tb  # only here: plotting runs without torch (planning imports train_cifar)
        import train_cifar
        try:
            device = tb.resolve_device(args.device)
            os.makedirs(core.writable_folder(args.out, "--out"), exist_ok=True)
        except ValueError as e:
            parser.exit(2, f"{parser.prog}: error: {e}\n")
        data = load_data(parser, args)
        # The data's identity joins the settings a resume compares: a folder of a subset must not resume on the
        # full data (or other data), mixing trials of both.
        settings = dict(settings, data=tb.dataset_fingerprint(data))
    n_train = ((len(data["train_y"]) if data else args.train_subset or core.CIFAR10_TRAIN_IMAGES)
               - settings["holdout"])
    if n_train <= 0:
        none_left = holdout_leaves_none(settings["holdout"], n_train + settings["holdout"], args.data or "the data")
        parser.exit(2, f"{parser.prog}: error: {none_left}\n")
    if max(args.batch_sizes) > n_train:
        parser.exit(2, f"{parser.prog}: error: batch sizes up to {max(args.batch_sizes)} need more than the "
                       f"{n_train} training images left (holdout {settings['holdout']})\n")
    if args.dry_run:
        print(study_header(args), flush=True)
        for spec in plan(settings, args.batch_sizes, args.trials, n_train, args.shard, args.trial_order):
            print(f"b={spec['batch_size']:<5} trial {spec['trial']}: {describe_params(spec['params'])}; budget "
                  f"{spec['budget_steps']} steps ({spec['budget_epochs']:.2f} epochs), eval every "
                  f"{spec['eval_every_steps']}")
        return
    w = WORKLOADS[args.workload]
    path = shard_path(args.out, args.shard)
    specs = plan(settings, args.batch_sizes, args.trials, n_train, args.shard, args.trial_order)
    try:  # trials vary the optimizer and its schedule, not the precision (fp16 on a CPU failed the first trial)
        for spec in specs[:1]:
            tb.resolve_precision(train_cifar.make_config(w["preset"], **spec["train"])["precision"], device)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    try:
        others = [r for p in trial_files(args.out) if p != path for r in read_trials(p)]
    except StudyError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    print(f"{study_header(args)}, on {tb.device_name(device)}", flush=True)
    log = print if args.verbose else (lambda *a: None)
    status = "complete"
    try:
        with core.sigterm_as_interrupt():
            run_study(specs, lambda s: run_trial(s, data, w["preset"], device, log), path, settings,
                      log=lambda m: print(m, flush=True), others=others)
    except StudyError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    except KeyboardInterrupt:
        status = "interrupted"
        print("\ninterrupted: the trial in flight is lost, finished trials are kept; run the same command to resume",
              flush=True)
    try:  # (a file of another shard may have changed while this one ran)
        records = [r for r in read_folder(args.out) if r.get("settings") == settings]
    except StudyError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if status == "complete" and args.shard:  # this shard's part is done; the folder's only once every shard's is
        done = {trial_key(r) for r in records}
        whole = plan(settings, args.batch_sizes, args.trials, n_train)
        left = sum(trial_key(spec) not in done for spec in whole)
        if left:
            status = f"partial: {left} of {len(whole)} trials left to other shards"
    if records:
        rows, regimes, trend = write_summary(args.out, settings, records, status)
        report(rows, regimes, trend)
        pngs = plot([(f"{args.workload}/{args.optimizer}", rows, regimes, trend)], args.out)
        trials = f"{path}, " if os.path.exists(path) else ""  # (nothing left to run: this run wrote no trial file)
        print(f"wrote {trials}{os.path.join(args.out, 'summary.tsv')} (all {len(records)} trials in the folder), "
              f"summary.json, {', '.join(pngs)}", flush=True)
    if status == "interrupted":
        sys.exit(130)


def distinguish(groups):
    """Curves sharing a label ("cpu/nesterov" of two targets) are told apart in place by the settings that differ
    among them (key=value), or by their folders where only the data or too many settings differ."""
    by_label = collections.defaultdict(list)
    for g in groups:
        by_label[g[1]].append(g)
    for same in by_label.values():
        if len(same) < 2:
            continue
        flats = [dict(core.flatten(g[2])) for g in same]
        keys = sorted({k for f in flats for k in f if any(f.get(k) != o.get(k) for o in flats)})
        shown = [k for k in keys if not k.startswith("data.")]
        for g, f in zip(same, flats):
            if shown and len(shown) <= 3 and len(shown) == len(keys):
                g[1] += " " + ", ".join(f"{k}={core.as_lists(f.get(k))}" for k in shown)
            else:  # the data's checksums, or a long list of keys, would not make a readable label
                g[1] += " (" + " + ".join(g[0]) + ")"


def cmd_plot(parser, args):
    """One curve per distinct settings: folders measured with the same settings (one study run into several
    folders, e.g. more batch sizes added later) join into one curve; a trial found twice counts once."""
    groups = {}  # settings (as JSON) -> [folders, label, settings, records by key]
    for d in args.dirs:
        try:
            label, settings, records = load_dir(d)
        except StudyError as e:
            parser.exit(2, f"{parser.prog}: error: {e}\n")
        g = groups.setdefault(json.dumps(settings, sort_keys=True), [[], label, settings, {}])
        g[0].append(d)
        for r in records:
            g[3].setdefault(trial_key(r), r)
    distinguish(list(groups.values()))
    curves = []
    for dirs, label, settings, by_key in groups.values():
        records = list(by_key.values())
        rows, regimes, trend = summarise(records)
        print(f"\n{' + '.join(dirs)}: {label}, target {settings['target']:g} ({settings['eval']}), "
              f"{len(records)} trials")
        report(rows, regimes, trend)
        curves.append((label, rows, regimes, trend))
    out = args.out or (args.dirs[0] if len(args.dirs) == 1 else os.path.join("logs", "batch-size-plots"))
    try:
        os.makedirs(core.writable_folder(out, "--out"), exist_ok=True)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    print("wrote " + ", ".join(plot(curves, out)))


def main(argv=None):
    parser, args = parse_args(argv)
    (cmd_run if args.command == "run" else cmd_plot)(parser, args)


if __name__ == "__main__":
    core.exit_with(main)
