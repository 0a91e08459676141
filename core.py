"""Pieces that do not depend on PyTorch: schedules, timing, tables, statistics, logs."""
import argparse
import ast
import contextlib
import copy
import datetime
import errno
import functools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time


def piecewise_linear(knots, values):
    """f(t) interpolating linearly between (knots[i], values[i]); constant outside the knots. A repeated knot is
    a step, where f takes the value before it."""
    if len(knots) != len(values) or not knots:
        raise ValueError("piecewise_linear needs as many values as knots (at least one)")
    if any(b < a for a, b in zip(knots, knots[1:])):
        raise ValueError(f"knots must be non-decreasing, got {knots}")

    def f(t):
        if t <= knots[0]:
            return values[0]
        for (k0, k1), (v0, v1) in zip(zip(knots, knots[1:]), zip(values, values[1:])):
            if t <= k1:
                return v1 if k1 == k0 else v0 + (v1 - v0) * (t - k0) / (k1 - k0)
        return values[-1]
    return f


class Timer:
    """Accumulates wall-clock time of the intervals it is told to count.

    `synchronize` is called before each reading so asynchronous devices (CUDA) are measured, not queued."""

    def __init__(self, synchronize=lambda: None):
        self.synchronize = synchronize
        self.total = 0.0
        self.synchronize()
        self._last = time.perf_counter()

    def __call__(self, include_in_total=True):
        self.synchronize()
        now = time.perf_counter()
        dt, self._last = now - self._last, now
        if include_in_total:
            self.total += dt
        return dt


def mean_std(xs):
    """Mean and sample standard deviation (0 for a single value); NaN for an empty list."""
    xs = [float(x) for x in xs]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def student_t_cdf(t, df):
    """P(T <= t) for Student's t with df >= 1 degrees of freedom (fractional too, as Welch's are). With
    t = sqrt(df) tan(theta) the density becomes c cos(theta)^(df - 1), bounded on [0, pi/2) for df >= 1, so
    Simpson's rule over theta with 512 points is exact to ~1e-9 for small df and gives the 95% quantiles of
    printed t tables (6 digits) up to df 1000."""
    if not df >= 1:
        raise ValueError(f"student_t_cdf needs df >= 1, got {df}")
    theta, n = math.atan(abs(t) / math.sqrt(df)), 512
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)
    weights = [1] + [4 if i % 2 else 2 for i in range(1, n)] + [1]
    area = c * theta / n / 3 * sum(w * math.cos(i * theta / n) ** (df - 1) for i, w in enumerate(weights))
    return 0.5 + math.copysign(area, t)


def student_t_quantile(p, df):
    """The t with P(T <= t) = p, by bisection on student_t_cdf."""
    if not 0 < p < 1:
        raise ValueError(f"student_t_quantile needs p in (0, 1), got {p}")
    if p < 0.5:
        return -student_t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < p:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if student_t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def mean_difference(a, b, level=0.95):
    """mean(b) - mean(a) of two independent samples with Welch's standard error, degrees of freedom and
    confidence interval: dict(diff, se, df, ci). se, df and ci are NaN where a sample has fewer than 2 values
    (no spread to judge by); where both have no spread, se is 0 and the interval is the difference itself."""
    (ma, sa), (mb, sb) = mean_std(a), mean_std(b)
    diff, nan = mb - ma, math.nan
    if len(a) < 2 or len(b) < 2:
        return dict(diff=diff, se=nan, df=nan, ci=(nan, nan))
    va, vb = sa ** 2 / len(a), sb ** 2 / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return dict(diff=diff, se=0.0, df=nan, ci=(diff, diff))
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = student_t_quantile((1 + level) / 2, df) * se
    return dict(diff=diff, se=se, df=df, ci=(diff - half, diff + half))


def paired_difference(a, b, level=0.95):
    """mean(b[i] - a[i]) over pairs (runs of one seed in two variants: the seed's own luck cancels), with its
    standard error and t confidence interval on len - 1 degrees of freedom; NaN for fewer than 2 pairs."""
    if len(a) != len(b):
        raise ValueError("paired_difference needs samples of the same length")
    d = [y - x for x, y in zip(a, b)]
    m, s = mean_std(d)
    if len(d) < 2:
        return dict(diff=m, se=math.nan, df=math.nan, ci=(math.nan, math.nan))
    se = s / math.sqrt(len(d))
    half = student_t_quantile((1 + level) / 2, len(d) - 1) * se
    return dict(diff=m, se=se, df=len(d) - 1, ci=(m - half, m + half))


def sign_test(a, b):
    """Two-sided exact sign test: were each of a + b disagreements equally likely to go either way, the
    probability of a split at least as uneven as a against b (paired per-image comparisons of two evaluations)."""
    n, k = a + b, min(a, b)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def format_cell(v, width):
    if isinstance(v, float):
        s = f"{v:.4f}" if abs(v) < 1000 else f"{v:.1f}"
    else:
        s = str(v)
    return s.rjust(width)


class Table:
    """Prints rows under a header as they arrive; the header is printed with the first row."""

    def __init__(self, columns, width=10, out=print):
        self.columns, self.width, self.out = list(columns), width, out
        self.started = False

    def row(self, values):
        if not self.started:
            self.out(" ".join(c.rjust(self.width) for c in self.columns))
            self.started = True
        self.out(" ".join(format_cell(values.get(c, ""), self.width) for c in self.columns))


CIFAR10_TRAIN_IMAGES = 50000  # for checks made before the data is loaded (the loaded count is checked again)


def distinct_values(option, given, show=str):
    """The values of a command-line list option, each once, in the order given; a note on stderr names those given
    more than once (each would be trained, and counted, once per mention)."""
    values = list(dict.fromkeys(given))
    twice = [v for v in values if given.count(v) > 1]
    if twice:
        print(f"note: {option} {' '.join(map(show, twice))} given more than once; each is studied once",
              file=sys.stderr)
    return values


def flatten(d, prefix=""):
    """(dotted key, value) of a nested dict's leaves: {"overrides": {"epochs": 2}} -> ("overrides.epochs", 2)."""
    for k, v in d.items():
        yield from flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + k, v)]


def as_lists(v):
    """Tuples (nested too) as lists, as they come back from JSON."""
    return [as_lists(u) for u in v] if isinstance(v, (list, tuple)) else v


def as_tuples(options):
    """Options with their lists (from JSON or argparse's nargs) as the tuples train_cifar's configs hold."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}


def settings_difference(there, here):
    """The settings that differ, each with both values ("target 0.8 there, 0.15 here"); nested ones (--set
    options) by dotted key. The whole dicts hold ~20 keys and hid the one that mattered."""
    if not isinstance(there, dict):
        return "none recorded there"
    a, b = dict(flatten(there)), dict(flatten(here))
    show = lambda d, k: str(d[k]) if k in d else "unset"  # noqa: E731
    return "; ".join(f"{k} {show(a, k)} there, {show(b, k)} here" for k in sorted(a.keys() | b.keys())
                     if k not in a or k not in b or a[k] != b[k])


def format_flops(flops):
    """Training FLOPs as the records table gives them (0.265 PF), in TF or GF below 0.01 PF (a subset or narrow
    net would otherwise read "0.000 PF")."""
    shown = float(f"{flops:.3g}")  # the unit of the value as printed: 9.996e11 is "1.00 TF", not "1000 GF"
    if shown >= 1e13:
        return f"{flops / 1e15:.3f} PF"
    scale, unit = (1e12, "TF") if shown >= 1e12 else (1e9, "GF")
    digits = max(0, 2 - math.floor(math.log10(shown / scale))) if shown > 0 else 0  # 3 significant digits
    return f"{flops / scale:.{digits}f} {unit}"


def format_mean_std(mean, std, n, digits, scale=1.0, unit=""):
    """"94.12 ± 0.13%" for several values, "94.12%" for one (one run has no spread to state)."""
    if n > 1:
        return f"{scale * mean:.{digits}f} ± {scale * std:.{digits}f}{unit}"
    return f"{scale * mean:.{digits}f}{unit}"


def format_duration(seconds):
    """65 -> '1m05s', 3725 -> '1h02m', 7 -> '0m07s': for elapsed times and ETAs."""
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """One line of progress, rewritten in place at most every `every_s` seconds: for work that runs long between
    the lines a job prints (an epoch on a CPU can take minutes). Meant for a terminal: in a file the rewrites
    would pile up, so callers create it only there."""

    def __init__(self, out, every_s=2.0, clock=time.perf_counter):
        self.out, self.every_s, self.clock = out, every_s, clock
        self.label, self.total, self.started, self.shown, self.width = "", 0, 0.0, 0.0, 0

    def start(self, label, total):
        self.label, self.total = label, total
        self.started = self.shown = self.clock()

    def update(self, done):
        now = self.clock()
        if now - self.shown < self.every_s or done < 1:
            return
        self.shown = now
        each = (now - self.started) / done
        text = (f"{self.label}: {done}/{self.total} ({each:.2f} s each, "
                f"~{format_duration(each * (self.total - done))} to go)")
        self.out.write("\r" + text.ljust(self.width))
        self.out.flush()
        self.width = len(text)

    def clear(self):
        """Blank the line (before the job prints one of its own)."""
        if self.width:
            self.out.write("\r" + " " * self.width + "\r")
            self.out.flush()
            self.width = 0


def json_safe(obj):
    """obj with every NaN or infinity (a diverged loss, the mean of no runs) as None. JSON has neither: Python
    writes the tokens NaN and Infinity, which strict readers (jq 1.6, JavaScript, most other languages) refuse."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def to_json(obj, indent=None):
    """Strict JSON text (RFC 8259): non-finite numbers as null (json_safe)."""
    return json.dumps(json_safe(obj), indent=indent, allow_nan=False)


def append_jsonl(path, record):
    """One write of one strict-JSON line, flushed and fsynced: a crash loses at most the record in flight."""
    with open(path, "a") as f:
        f.write(to_json(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_json_atomic(path, obj):
    """Write strict JSON (to_json) via a temporary file and rename, so a crash never leaves a half-written file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(to_json(obj, indent=2))
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class TsvLog:
    """Appends one flushed row per call, so rows written before a crash survive it."""

    def __init__(self, path, columns):
        self.path, self.columns = path, list(columns)
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        self.f = open(path, "a")
        if new:
            self.f.write("\t".join(self.columns) + "\n")
            self.f.flush()

    def row(self, values):
        self.f.write("\t".join(str(values.get(c, "")) for c in self.columns) + "\n")
        self.f.flush()

    def close(self):
        self.f.close()


class JsonlError(ValueError):
    """A file where an append-only file of JSON records was expected that is none (a folder, binary data)."""


def read_jsonl(path, repair=False, warn=lambda m: print(m, file=sys.stderr), error=JsonlError):
    """(line number, value) for each line of an append-only JSONL file (a study's records) that parses. A line
    that does not (cut short by a crash) is skipped with a warning; with repair=True a torn last line is also cut
    off the file, and a complete last line without its newline gets one, so the next append starts a line of its
    own (appended onto a torn line, a record was lost for good). A folder or binary data (a NUL byte, which JSON
    text never holds) is an `error` (the caller's kind, else JsonlError), raised before any repair: a file the
    study never wrote is not cut."""
    if not os.path.exists(path):
        return []
    if os.path.isdir(path):
        raise error(f"{path} is a folder, not a file of records")
    with open(path, "rb") as f:
        raw = f.read()
    if b"\0" in raw:  # (an .npz in its place printed a warning for each of its thousands of "lines", then cut it)
        raise error(f"{path} holds binary data, not JSON records; move it away")
    lines = raw.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    values = []
    for n, line in enumerate(lines + [tail], 1):
        if not line.strip():
            continue
        try:
            values.append((n, json.loads(line)))
        except ValueError:
            last = n > len(lines)
            warn(f"warning: {path}:{n} is not a complete record"
                 + (" (a torn last line: an interrupted write)" if last else "")
                 + ("; cut off" if last and repair else "; ignored"))
            if last and repair:
                with open(path, "r+b") as f:
                    f.truncate(len(raw) - len(tail))
            continue
        if n > len(lines) and repair:
            with open(path, "ab") as f:
                f.write(b"\n")
    return values


def is_number(v):
    """A finite real number, not a bool (JSON's true is no count)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_whole(v, least=-math.inf):
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def field_problem(record, fields, where=""):
    """Why a record (a dict read back from a file) lacks what its readers use, or None. fields: key -> (test,
    what it must be, required)."""
    if not isinstance(record, dict):
        return f"{json.dumps(record)[:40]} is not a JSON object"
    for key, (ok, what, required) in fields.items():
        if key not in record:
            if required:
                return f'no "{where}{key}"'
        elif not ok(record[key]):
            return f'"{where}{key}" is {json.dumps(record[key])[:40]}, not {what}'
    return None


class LogError(ValueError):
    """A log that cannot be read as what it should be."""


# For a log written before an option existed, the value its runs had in effect, where that is certain, so that such
# a log compares (compare_runs, plot_runs) and reruns (--from-log) as having run with it, not as alike to every
# setting of it. Each was checked against the commit that added the option: it came switched off, or as a name
# for what the code did until then (in JSON's form: lists, not tuples).
PREDATED_VALUES = {
    # added switched off (or a check that changes nothing)
    "color_jitter": [0.0, 0.0], "sync_check": False, "tta_confidence": 0.0, "train_sizes": [], "select_fraction": 1.0,
    "ema_every": 0, "echo": "none", "echo_factor": 1.0, "echo_shuffle_buffer": 0, "holdout": 0, "stop_at_target": False,
    "stop_after_epochs": 0, "eval_every_steps": 0, "warmup_epochs": 0.0, "lr_scaling": "none", "allreduce": "flat",
    "bn_group_size": 0, "sync_bn_group_size": 0, "allreduce_group_size": 0, "block_epochs": [],
    # what ran before the option named it: SGD, the device pipeline, the proxy that scored candidates, two convs a
    # block, FastNet's fixed BN momentum, the whitening bias among the fast biases, lookahead synced every epoch,
    # 5 Newton-Schulz steps, F.conv2d (oneDNN's kernels) on CPUs, GradScaler in fp16, torch.compile's default mode,
    # evaluation in the run's own precision
    "optimizer": "sgd", "pipeline": "device", "select_by": "proxy", "block_depth": 2, "bn_momentum": 0.4,
    "whiten_bias_fast": True, "lookahead_sync": "epoch", "muon_ns_steps": 5, "cpu_conv": "onednn",
    "loss_scale": "dynamic", "compile_mode": "default", "eval_precision": "same",
}
# Options some committed logs predate that came with something those runs did not use (or replaced an option such
# a log names, which --from-log refuses): no value describes them. Such a log compares as alike to every setting of
# them, and --from-log gives them today's defaults without a warning (tests/test_compare_runs.py checks that each
# option a log in logs/ lacks is in one of the two tables).
PREDATED_UNUSED = {
    "muon_lr_scale": "added with Muon: the logs before it trained with SGD",
    "muon_momentum": "added with Muon: the logs before it trained with SGD",
    "muon_norm": "unused before Muon; then set by muon_fixed_norm (since removed: such logs are refused)",
    "ema_decay": "came with ema_every, off: unused before",
    "trust_coefficient": "LARS's alone: unused before LARS",
    "reference_batch_size": "the preset's batch size, used only by lr_scaling (none before)",
    "proxy_widths": "unused before data selection",
    "loader_workers": "unused before the loader pipeline",
    "proxy_every": "unused before data selection; replaced proxy_epochs (a proxy trained first)",
}


def with_predated_values(config):
    """A log's config with PREDATED_VALUES for the options it predates (copies: a caller may change them)."""
    return dict(copy.deepcopy(PREDATED_VALUES), **config)


def read_run_log(path):
    """The JSON summary train_cifar.py writes (preset, config, runs, ...), or a LogError saying what is wrong."""
    try:
        with open(path) as f:
            log = json.load(f)
    except OSError as e:
        raise LogError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        if path.endswith(".tsv"):  # the per-epoch table written beside each summary: an easy file to pass by mistake
            raise LogError(f"{path} is a per-epoch table; pass the JSON summary beside it, "
                           f"{path[:-len('.tsv')]}.json") from None
        raise LogError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); is the file truncated?") from None
    except UnicodeDecodeError:  # (a ValueError too: its message alone named no file)
        raise LogError(f"{path} is not a train_cifar.py log (not UTF-8 text)") from None
    if not isinstance(log, dict) or not isinstance(log.get("runs"), list) or "preset" not in log:
        raise LogError(f"{path} is not a train_cifar.py log (no preset and runs)")
    nulls_as_nan(log)
    check_run_values(log, path)
    return log


# Where train() has NaN (a mean of no runs; a diverged loss; an epoch not evaluated), its log has null (json_safe)
NAN_SUMMARY_KEYS = ("accuracy_mean", "accuracy_std", "total_time_mean_s", "total_time_std_s",
                    "time_to_target_mean_s", "time_to_target_std_s")
NAN_ROW_KEYS = ("train_loss", "train_acc", "test_acc")  # of a run's epoch rows and step-level evals


def nulls_as_nan(log):
    """Read those nulls back as NaN, in place, so a log's values are train()'s (a run's null accuracy or time to
    target stays None: no final evaluation, target not reached). Parts of the wrong type are left to the checks."""
    def fill(d, keys):
        for k in keys:
            if isinstance(d, dict) and k in d and d[k] is None:
                d[k] = math.nan
    fill(log, NAN_SUMMARY_KEYS)
    for run in log["runs"]:
        for part in ("epochs", "evals"):
            rows = run.get(part) if isinstance(run, dict) else None
            for row in rows if isinstance(rows, list) else []:
                fill(row, NAN_ROW_KEYS)


def distinct_logs(paths):
    """(paths, repeated): each file once, in the order first given, and "path (given N times)" for each given more
    than once (overlapping globs name a file twice; the same real path, or a link to it, is one file): read twice,
    its runs would count twice, as if repeats of their seeds, and shrink the spread to 0."""
    first, counts = {}, {}
    for p in paths:
        key = os.path.realpath(p)
        first.setdefault(key, p)
        counts[key] = counts.get(key, 0) + 1
    repeated = [f"{first[k]} (given {'twice' if n == 2 else f'{n} times'})" for k, n in counts.items() if n > 1]
    return list(first.values()), repeated


ROW_KEYS = {"epoch", "train_loss", "test_acc", "total_time"}  # what plot_runs.py and --from-log read of a row


def check_run_values(log, path):
    """LogError naming the file and field for a value no run can have (an edited log): accuracies outside [0, 1]
    (None: no final accuracy) or NaN, negative or non-finite times and FLOPs, seeds that are not integers.
    Readers would otherwise print them as results ("accuracy 9500.00%", "-5.0 s", "seeds zero")."""
    def bad(where, value, should):
        raise LogError(f"{path}: {where} is {json.dumps(value)}, not {should}")
    flops = log.get("train_flops_per_run")
    if flops is not None and not (is_number(flops) and flops >= 0):
        bad("train_flops_per_run", flops, "a finite count >= 0")
    config = log.get("config")  # (its absence is for each reader to judge; a config of another kind is no log's)
    if config is not None and not isinstance(config, dict):
        raise LogError(f"{path} is not a train_cifar.py log (its config is no object)")
    target = (config or {}).get("target")
    if target is not None and not (is_number(target) and 0 < target <= 1):
        bad("config.target", target, "a fraction in (0, 1]")
    if log.get("hardware") is not None and not isinstance(log["hardware"], str):
        bad("hardware", log["hardware"], "text")
    for i, run in enumerate(log["runs"]):
        if not isinstance(run, dict) or "seed" not in run:
            raise LogError(f"{path} is not a train_cifar.py log: run {i} has no seed")
        if not is_whole(run["seed"]):
            bad(f"run {i}'s seed", run["seed"], "a whole number")
        acc = run.get("accuracy")
        if acc is not None and not (is_number(acc) and 0 <= acc <= 1):
            bad(f"run {i}'s accuracy", acc, "a fraction in [0, 1] or null")
        for key in ("total_time_s", "time_to_target_s"):
            t = run.get(key)
            if t is not None and not (is_number(t) and t >= 0):
                bad(f"run {i}'s {key}", t, "a finite time >= 0 or null")
        rows = run.get("epochs") or []
        if not isinstance(rows, list) or not all(isinstance(r, dict) and ROW_KEYS <= set(r) for r in rows):
            raise LogError(f"{path} is not a train_cifar.py log: run {i}'s epochs are not rows of "
                           + ", ".join(sorted(ROW_KEYS)))
        for row in rows:  # (a diverged run's training loss is NaN or infinite: logged as such)
            where = f"run {i}'s epoch {row.get('epoch')}"
            acc, t = row.get("test_acc"), row.get("total_time")
            if acc is not None and not (is_number(acc) and 0 <= acc <= 1 or isinstance(acc, float) and math.isnan(acc)):
                bad(f"{where} test_acc", acc, "a fraction in [0, 1], NaN or null (not evaluated)")
            if t is not None and not (is_number(t) and t >= 0):
                bad(f"{where} total_time", t, "a finite time >= 0")


def reproduction_report(runs, logged_runs):
    """Each run against the logged run of the same seed, epoch by epoch (as train_cifar.py --from-log prints it).
    Per run: seed; epochs, how many both trained; first_difference, the first of those whose training loss or
    test accuracy differs at all (None: identical, bit for bit); max_loss_difference over them; cut_short, whether
    it ended before the logged run did; accuracy and logged_accuracy, the final ones where both runs trained the
    same epochs (else logged_accuracy is None). A test accuracy is compared only where both runs evaluated alike:
    a run's last epoch gets the final evaluation (TTA, averaged weights), the epochs before it a plain one.
    A seed the log lacks gets epochs 0."""
    def same(a, b):
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    logged = {r["seed"]: r for r in logged_runs if r.get("epochs")}
    report = []
    for run in runs:
        rows, ref = run.get("epochs") or [], logged.get(run["seed"])
        ref_rows = {row["epoch"]: row for row in ref["epochs"]} if ref else {}
        pairs = [(row, ref_rows[row["epoch"]]) for row in rows if row["epoch"] in ref_rows]
        last, ref_last = (rows[-1]["epoch"], ref["epochs"][-1]["epoch"]) if pairs else (None, None)
        differing = [a["epoch"] for a, b in pairs if not same(a["train_loss"], b["train_loss"])
                     or ((a["epoch"] == last) == (a["epoch"] == ref_last) and not same(a["test_acc"], b["test_acc"]))]
        report.append(dict(
            seed=run["seed"], epochs=len(pairs), first_difference=differing[0] if differing else None,
            max_loss_difference=max((abs(a["train_loss"] - b["train_loss"]) for a, b in pairs), default=None),
            cut_short=bool(pairs) and last < ref_last, accuracy=run.get("accuracy"),
            logged_accuracy=ref.get("accuracy") if pairs and last == ref_last else None))
    return report


def differing_keys(dicts, ignore=()):
    """The keys, present in every dict and not ignored, whose values differ between them; numbers compare as
    numbers (10 and 10.0 are one setting) and tuples as lists (as they come back from JSON)."""
    shared = set.intersection(*(set(d) for d in dicts)) - set(ignore) if dicts else set()
    return sorted(k for k in shared if any(as_lists(d[k]) != as_lists(dicts[0][k]) for d in dicts))


def read_tsv(path):
    with open(path) as f:
        lines = [l.rstrip("\n").split("\t") for l in f if l.strip()]
    return [dict(zip(lines[0], l)) for l in lines[1:]]


def parse_overrides(items):
    """KEY=VALUE strings (as from --set) into a dict, values read as Python literals where they parse
    (epochs=2, widths=(16,32,32)) and kept as strings otherwise (precision=fp32); '-' in keys becomes '_'."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            out[key.strip().replace("-", "_")] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key.strip().replace("-", "_")] = value
    return out


_terminated = False  # whether sigterm_as_interrupt's last block ended by SIGTERM


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM (kill's default, and what batch schedulers send) raises KeyboardInterrupt in the main thread while
    this is active, so a long job stops the way Ctrl-C stops it: finished work saved, summary written. Under
    nohup and in background jobs of a script SIGINT is ignored, so kill -TERM is the signal that reaches them.
    The signal is recorded, so that exit_with turns the caller's exit code for an interrupt (130, SIGINT's)
    into SIGTERM's (143)."""
    global _terminated

    def interrupt(signum, frame):
        global _terminated
        _terminated = True
        raise KeyboardInterrupt(f"signal {signum}")
    _terminated = False
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def utc_timestamp():
    """Now in UTC, ISO 8601 to the second (2026-12-01T14:51:25+00:00): when a log was started or written."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def writable_folder(path, what):
    """path, once it is or can become a folder this process can write in (checked with a file that leaves no
    trace, creating nothing); else a ValueError naming `what` (the option). Checked before a run starts, so a
    long run never ends on a log it cannot write."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):  # (a dangling link exists, and is no folder)
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot write there ({e.strerror or e})") from None
    return path


def writable_file(path, what):
    """writable_folder for a file's folder, and path not a folder itself (an --out that appends to a file)."""
    if os.path.isdir(path):
        raise ValueError(f"{what} {path} is a folder; it takes the file to write")
    writable_folder(os.path.dirname(path) or ".", f"{what} {path}: its folder")
    return path


def folder_option(text):
    """argparse type for an output folder ('' for none): writable_folder's check when the options are read."""
    try:
        return writable_folder(text, "folder") if text else text
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def stamped_log_path(log_dir, name, timestamp):
    """log_dir/NAME-2026-12-01T145125.json for a utc_timestamp, the folder made if missing: where a benchmark
    writes its JSON log."""
    os.makedirs(log_dir, exist_ok=True)
    return os.path.join(log_dir, f"{name}-{timestamp[:19].replace(':', '')}.json")


def exit_with(main):
    """sys.exit(main()) for a command-line script (an exit code, or anything else for 0), quiet when its reader
    leaves early (`... | head`): Python would print a BrokenPipeError traceback, twice, for output nobody reads."""
    global _terminated
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit finds no pipe
        code = 1
    except SystemExit as e:  # the studies exit 130 after a KeyboardInterrupt; one that SIGTERM raised is 143
        terminated, _terminated = _terminated, False  # (read once: a later main() in this process starts clean)
        if e.code == 130 and terminated:
            code = 128 + signal.SIGTERM
        elif launched_by_torchrun() and isinstance(e.code, int):
            code = e.code
        else:
            raise
    code = code if isinstance(code, int) else 0
    if launched_by_torchrun():
        # torch 2.13's gloo can abort a rank while Python finalises after destroy_process_group ("terminate called
        # without an active exception", SIGABRT): ~1 in 35 two-process runs on a loaded 2-core CPU, failing runs
        # whose logs were written. Everything is written and flushed by now, so end without finalisation.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def launched_by_torchrun():
    """One of several processes that torchrun (or another launcher setting RANK and WORLD_SIZE) started."""
    return "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") not in ("", "1")


@functools.lru_cache(maxsize=None)
def git_commit(directory=None):
    """The commit checked out when this process first asked, with '+dirty' when tracked files outside logs/
    differ from it. Outside git (a copy of the tree sent to another machine) it is $GIT_COMMIT if set, else None.
    Asked once per process: a long study whose checkout moves on while it runs still reports the code it imported.
    Logs that a running study appends to do not make it dirty."""
    directory = directory or os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!logs"],
                               cwd=directory, capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("GIT_COMMIT") or None
