import json
import math
import os
import statistics
import time

import numpy as np
import pytest

import core


def test_piecewise_linear_matches_numpy_interp():
    rng = np.random.default_rng(0)
    for _ in range(20):
        knots = np.sort(rng.uniform(0, 30, 5)).tolist()
        values = rng.uniform(0, 1, 5).tolist()
        f = core.piecewise_linear(knots, values)
        for t in rng.uniform(-5, 35, 50):
            assert f(t) == pytest.approx(np.interp(t, knots, values), abs=1e-12)


def test_piecewise_linear_resnet9_schedule_and_bad_knots():
    f = core.piecewise_linear([0, 5, 24], [0, 0.4, 0])
    assert (f(0), f(2.5), f(5), f(14.5), f(24), f(30)) == pytest.approx((0, 0.2, 0.4, 0.2, 0, 0))
    with pytest.raises(ValueError):
        core.piecewise_linear([0, 5, 3], [0, 1, 0])
    with pytest.raises(ValueError):
        core.piecewise_linear([0, 5], [0])


def test_timer_counts_only_included_intervals(monkeypatch):
    clock = iter([0.0, 1.0, 3.0, 6.0])
    monkeypatch.setattr(core.time, "perf_counter", lambda: next(clock))
    syncs = []
    t = core.Timer(lambda: syncs.append(1))
    assert t() == 1.0
    assert t(include_in_total=False) == 2.0
    assert t() == 3.0
    assert t.total == 4.0 and len(syncs) == 4


def test_mean_std_against_statistics():
    xs = [0.9401, 0.9388, 0.9412, 0.9399]
    m, s = core.mean_std(xs)
    assert m == pytest.approx(statistics.mean(xs)) and s == pytest.approx(statistics.stdev(xs))
    assert core.mean_std([0.5]) == (0.5, 0.0)
    assert all(math.isnan(v) for v in core.mean_std([]))


def test_json_atomic_and_tsv_append(tmp_path):
    p = tmp_path / "s.json"
    core.write_json_atomic(str(p), {"a": 1, "b": [1.5, None]})
    assert json.loads(p.read_text()) == {"a": 1, "b": [1.5, None]}
    assert os.listdir(tmp_path) == ["s.json"]  # no temporary left behind
    t = tmp_path / "t.tsv"
    log = core.TsvLog(str(t), ["epoch", "acc"])
    log.row({"epoch": 1, "acc": 0.5})
    assert core.read_tsv(str(t)) == [{"epoch": "1", "acc": "0.5"}]  # flushed before close
    log.close()
    log = core.TsvLog(str(t), ["epoch", "acc"])  # reopening appends, no second header
    log.row({"epoch": 2, "acc": 0.6})
    log.close()
    assert [r["epoch"] for r in core.read_tsv(str(t))] == ["1", "2"]


def test_table_prints_header_once():
    lines = []
    table = core.Table(["epoch", "acc"], width=6, out=lines.append)
    table.row({"epoch": 1, "acc": 0.5})
    table.row({"epoch": 2, "acc": 0.75})
    assert lines == [" epoch    acc", "     1 0.5000", "     2 0.7500"]


def test_parse_overrides_reads_literals_and_keeps_plain_strings():
    assert core.parse_overrides(["epochs=2", "widths=(16,32,32)", "precision=fp32", "lr-values=[0, 1.5, 0]"]) == \
        dict(epochs=2, widths=(16, 32, 32), precision="fp32", lr_values=[0, 1.5, 0])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        core.parse_overrides(["epochs"])


def test_sigterm_raises_keyboard_interrupt_only_inside_the_block():
    import signal
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with core.sigterm_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode; never reached
    assert signal.getsignal(signal.SIGTERM) is before


def test_git_commit_ignores_logs_and_flags_code_changes(tmp_path):
    import subprocess

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)
    git("init", "-q")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "trials.jsonl").write_text("{}\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("commit", "-q", "-m", "one")
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    core.git_commit.cache_clear()
    (tmp_path / "logs" / "trials.jsonl").write_text("{}\n{}\n")  # a study appending to its log
    assert core.git_commit(str(tmp_path)) == sha
    core.git_commit.cache_clear()
    (tmp_path / "code.py").write_text("x = 2\n")
    assert core.git_commit(str(tmp_path)) == sha + "+dirty"
    git("commit", "-q", "-am", "two")  # the checkout moves on; this process keeps reporting what it started with
    assert core.git_commit(str(tmp_path)) == sha + "+dirty"
    core.git_commit.cache_clear()
    assert core.git_commit(str(tmp_path)) not in (sha, sha + "+dirty", None)


def test_git_commit_outside_git_reports_the_commit_it_was_given(tmp_path, monkeypatch):
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    core.git_commit.cache_clear()
    assert core.git_commit(str(tmp_path)) is None
    monkeypatch.setenv("GIT_COMMIT", "abc123+dirty")
    core.git_commit.cache_clear()
    assert core.git_commit(str(tmp_path)) == "abc123+dirty"
    core.git_commit.cache_clear()


def test_stamped_log_path_names_the_file_by_the_timestamp_and_makes_the_folder(tmp_path):
    where = tmp_path / "new" / "logs"
    path = core.stamped_log_path(str(where), "bench_convs-fast94", "2026-12-01T14:51:25+00:00")
    assert path == str(where / "bench_convs-fast94-2026-12-01T145125.json") and where.is_dir()
