"""The benchmark scripts refuse impossible counts with a one-line usage error, before timing or logging anything
(a zero once divided by zero, or appended a NaN line to a committed JSONL log)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script, args, log_option", [
    ("bench_presets.py", ["--steps", "0"], "--log-dir"),
    ("bench_presets.py", ["--repeats", "0"], "--log-dir"),
    ("bench_augment.py", ["--batch", "0"], "--log-dir"),
    ("bench_augment.py", ["--repeats", "0"], "--log-dir"),
    ("bench_allocator.py", ["--threads", "0"], "--out"),
    ("bench_ddp.py", ["--repeats", "0"], "--out"),
    ("bench_convs.py", ["--repeats", "0"], "--log-dir"),
    ("eval_tta.py", ["missing.pt", "--repeats", "0"], "--log-dir"),
])
def test_impossible_counts_exit_2_before_anything_is_written(tmp_path, script, args, log_option):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args, log_option, str(out)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and f"{script}: error: " in r.stderr
    assert "at least 1" in r.stderr or "must be >= 1" in r.stderr
    assert not out.exists() and os.listdir(tmp_path) == []


@pytest.mark.parametrize("script, args, message", [
    ("bench_presets.py", ["--log-dir", "/dev/null/logs"], "argument --log-dir: folder /dev/null/logs: cannot write"),
    ("eval_tta.py", ["missing.pt", "--log-dir", "/dev/null/logs"], "folder /dev/null/logs: cannot write"),
    ("bench_convs.py", ["--device", "gpu0"], "argument --device: device 'gpu0': not a device name"),
])
def test_an_unwritable_log_folder_or_unusable_device_exits_2_before_anything_runs(tmp_path, script, args, message):
    """Refused when the options are read: not a traceback after minutes of timing whose numbers would be lost."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert os.listdir(tmp_path) == []
