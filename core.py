"""Pieces that do not depend on PyTorch: schedules, timing, tables, statistics, logs."""
import ast
import contextlib
import datetime
import functools
import json
import math
import os
import signal
import subprocess
import time


def piecewise_linear(knots, values):
    """f(t) interpolating linearly between (knots[i], values[i]); constant outside the knots."""
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


def write_json_atomic(path, obj):
    """Write via a temporary file and rename, so a crash never leaves a half-written file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, allow_nan=True)
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


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM (kill's default, and what batch schedulers send) raises KeyboardInterrupt in the main thread while
    this is active, so a long job stops the way Ctrl-C stops it: finished work saved, summary written. Under
    nohup and in background jobs of a script SIGINT is ignored, so kill -TERM is the signal that reaches them."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def utc_timestamp():
    """Now in UTC, ISO 8601 to the second (2026-12-01T14:51:25+00:00): when a log was started or written."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def stamped_log_path(log_dir, name, timestamp):
    """log_dir/NAME-2026-12-01T145125.json for a utc_timestamp, the folder made if missing: where a benchmark
    writes its JSON log."""
    os.makedirs(log_dir, exist_ok=True)
    return os.path.join(log_dir, f"{name}-{timestamp[:19].replace(':', '')}.json")


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
