import glob
import io
import json
import math
import os
import re
import statistics
import sys
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
    # a repeated knot is a step: at it, the value before the step (parallel.warmup_knots relies on that)
    f = core.piecewise_linear([0, 5, 5, 10], [0, 1, 0.5, 0])
    assert (f(4), f(5), f(5 + 1e-9), f(7.5)) == pytest.approx((0.8, 1, 0.5, 0.25))
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


@pytest.mark.parametrize("p", [0.6, 0.9, 0.975, 0.995, 0.9995])
def test_student_t_quantile_against_closed_forms(p):
    """df 1 (Cauchy) and 2 have closed-form quantiles, df 3 a closed-form CDF; many df: the normal's."""
    assert core.student_t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
    assert core.student_t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)
    t = core.student_t_quantile(p, 3)
    x = t / math.sqrt(3)
    assert 0.5 + (x / (1 + x * x) + math.atan(x)) / math.pi == pytest.approx(p, abs=1e-9)
    assert core.student_t_quantile(p, 1e5) == pytest.approx(statistics.NormalDist().inv_cdf(p), rel=1e-4)
    assert core.student_t_quantile(1 - p, 7.5) == pytest.approx(-core.student_t_quantile(p, 7.5))
    with pytest.raises(ValueError):
        core.student_t_quantile(1.0, 3)


def test_welch_interval_covers_the_true_difference_95_percent_of_the_time():
    """Small samples with unequal spreads, as seeds of two variants give: a normal (z) interval would cover
    ~85% here; Welch's t interval ~95%."""
    rng = np.random.default_rng(0)
    trials, covered = 600, 0
    for _ in range(trials):
        a, b = rng.normal(94.0, 0.05, 3), rng.normal(94.1, 0.15, 4)
        d = core.mean_difference(list(a), list(b))
        se = math.sqrt(a.var(ddof=1) / 3 + b.var(ddof=1) / 4)
        assert d["diff"] == pytest.approx(b.mean() - a.mean()) and d["se"] == pytest.approx(se)
        covered += d["ci"][0] <= 0.1 <= d["ci"][1]
    assert abs(covered / trials - 0.95) < 0.03


def test_welch_degrees_of_freedom_are_welch_satterthwaites():
    """The coverage test above barely moves when df is a little off; here df against its formula, and the
    textbook case it reduces to: equal sizes and spreads give 2(n - 1), as the pooled t test."""
    a, b = [93.9, 94.1, 94.3], [93.8, 94.0, 94.5, 94.6, 94.2]
    va, vb = np.var(a, ddof=1) / 3, np.var(b, ddof=1) / 5
    d = core.mean_difference(a, b)
    assert d["df"] == pytest.approx((va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 4))
    half = core.student_t_quantile(0.975, d["df"]) * d["se"]
    assert d["ci"] == pytest.approx((d["diff"] - half, d["diff"] + half))
    assert core.mean_difference([1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0])["df"] == pytest.approx(6)


def test_paired_difference_cancels_what_each_pair_shares():
    """A per-seed offset common to both variants (that seed's luck) leaves the paired difference and its error
    alone, while the unpaired (Welch) error grows with it; the interval is the one-sample t interval."""
    rng = np.random.default_rng(1)
    a = rng.normal(94.0, 0.02, 6)
    b = a + 0.05 + rng.normal(0, 0.02, 6)
    luck = rng.normal(0, 0.5, 6)
    plain, lucky = core.paired_difference(list(a), list(b)), core.paired_difference(list(a + luck), list(b + luck))
    for k in ("diff", "se"):
        assert lucky[k] == pytest.approx(plain[k])
    d = b - a
    assert plain["se"] == pytest.approx(d.std(ddof=1) / math.sqrt(6))
    half = core.student_t_quantile(0.975, 5) * plain["se"]
    assert plain["ci"] == pytest.approx((d.mean() - half, d.mean() + half)) and plain["df"] == 5
    assert core.mean_difference(list(a + luck), list(b + luck))["se"] > 5 * plain["se"]
    assert math.isnan(core.paired_difference([1.0], [2.0])["se"])
    assert math.isnan(core.mean_difference([1.0], [2.0, 3.0])["se"])


def test_progress_rewrites_one_line_at_most_every_interval_and_clears_it():
    now = [100.0]
    out = io.StringIO()
    p = core.Progress(out, every_s=2.0, clock=lambda: now[0])
    p.start("run 0 epoch 1", 10)
    now[0] += 1.5
    p.update(1)
    assert out.getvalue() == ""  # before the first interval: nothing
    now[0] += 1.5
    p.update(3)  # 3 s for 3 steps: 1 s each, 7 to go
    assert out.getvalue() == "\rrun 0 epoch 1: 3/10 (1.00 s each, ~0m07s to go)"
    now[0] += 1.0
    p.update(4)
    assert out.getvalue().count("\r") == 1  # throttled
    width = len("run 0 epoch 1: 3/10 (1.00 s each, ~0m07s to go)")
    p.clear()
    assert out.getvalue().endswith("\r" + " " * width + "\r")
    p.clear()
    assert out.getvalue().endswith("\r" + " " * width + "\r")  # nothing shown: nothing to clear
    assert [core.format_duration(s) for s in (7, 65, 3725)] == ["0m07s", "1m05s", "1h02m"]
    assert [core.format_duration(s) for s in (59.6, 3599, 3600)] == ["1m00s", "59m59s", "1h00m"]  # no "60m00s"


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ('{"preset": "fast94", "runs": [', "is not valid JSON (Expecting value at line 1); is the file truncated?"),
    ('{"rows": []}', "is not a train_cifar.py log (no preset and runs)"),
    ('[1, 2]', "is not a train_cifar.py log (no preset and runs)"),
])
def test_read_run_log_names_the_file_and_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "log.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(core.LogError, match=re.escape(message)) as e:
        core.read_run_log(str(path))
    assert str(path) in str(e.value)
    path.write_text('{"preset": "fast94", "runs": [], "config": {}}')
    assert core.read_run_log(str(path))["preset"] == "fast94"


def test_read_run_log_points_from_a_per_epoch_table_to_its_summary(tmp_path):
    """Each run writes NAME.tsv beside NAME.json; the tools read the JSON, so a TSV passed to them says which."""
    path = tmp_path / "fast94-x.tsv"
    path.write_text("run\tepoch\ttest_acc\n0\t1\t0.5\n")
    with pytest.raises(core.LogError, match=re.escape(f"{path} is a per-epoch table; pass the JSON summary beside "
                                                      f"it, {tmp_path / 'fast94-x.json'}")):
        core.read_run_log(str(path))


def strict_json(text):
    """Parse as RFC 8259 JSON: Python's own NaN, Infinity and -Infinity tokens are refused."""
    def refuse(token):
        raise ValueError(f"{token} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_logs_are_strict_json_and_read_back_as_train_gives_them(tmp_path):
    """NaN and infinities are written as null (jq 1.6 and JavaScript refuse Python's tokens) and read back as
    NaN where train() has NaN; a run's null accuracy and time to target stay None (nothing to report)."""
    inf, nan = float("inf"), float("nan")
    row = dict(epoch=1, lr=0.1, train_loss=inf, train_acc=nan, test_acc=nan, total_time=3.0)
    log = dict(preset="fast94", config={"lr_values": (0.0, 1.0)}, accuracy_mean=nan, accuracy_std=nan,
               time_to_target_mean_s=nan, runs=[dict(seed=0, accuracy=None, time_to_target_s=None,
                                                    epochs=[row, dict(row, epoch=2, train_loss=-inf)],
                                                    evals=[dict(step=5, test_acc=0.5, train_loss=nan)])])
    path = tmp_path / "log.json"
    core.write_json_atomic(str(path), log)
    text = path.read_text()
    saved = strict_json(text)
    assert saved["accuracy_mean"] is None and saved["runs"][0]["epochs"][1]["train_loss"] is None
    assert saved["config"]["lr_values"] == [0.0, 1.0] and saved["runs"][0]["evals"][0]["test_acc"] == 0.5
    back = core.read_run_log(str(path))
    assert all(math.isnan(back[k]) for k in ("accuracy_mean", "accuracy_std", "time_to_target_mean_s"))
    run = back["runs"][0]
    assert run["accuracy"] is None and run["time_to_target_s"] is None
    assert all(math.isnan(r[k]) for r in run["epochs"] for k in ("train_loss", "train_acc", "test_acc"))
    assert math.isnan(run["evals"][0]["train_loss"]) and run["epochs"][0]["total_time"] == 3.0
    jsonl = tmp_path / "records.jsonl"
    core.append_jsonl(str(jsonl), dict(a=nan, b=[1.5, -inf]))
    core.append_jsonl(str(jsonl), dict(a=2))
    assert [strict_json(line) for line in jsonl.read_text().splitlines()] == [dict(a=None, b=[1.5, None]), dict(a=2)]


def test_every_committed_log_is_strict_json():
    """What logs/ holds must open in any JSON reader, not only Python's."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "logs")
    paths = glob.glob(os.path.join(root, "**", "*.json"), recursive=True)
    lines = glob.glob(os.path.join(root, "**", "*.jsonl"), recursive=True)
    assert len(paths) > 50 and lines
    for path in paths:
        with open(path) as f:
            strict_json(f.read())
    for path in lines:
        with open(path) as f:
            for line in f:
                if line.strip():
                    strict_json(line)


def test_differing_keys_compares_numbers_as_numbers_and_skips_keys_not_everywhere():
    a = dict(epochs=10, widths=(64, 256, 256), lr=0.5, seed=0, new_option=1)
    b = dict(epochs=10.0, widths=[64, 256, 256], lr=0.6, seed=1)
    assert core.differing_keys([a, b]) == ["lr", "seed"]
    assert core.differing_keys([a, b], ignore=["seed"]) == ["lr"]
    assert core.differing_keys([a, dict(a, widths=(64, 256, 512))]) == ["widths"]


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
    empty = tmp_path / "empty.tsv"  # e.g. left by a run killed before its first row: gets its header
    empty.write_text("")
    log = core.TsvLog(str(empty), ["epoch", "acc"])
    log.row({"epoch": 1, "acc": 0.5})
    log.close()
    assert core.read_tsv(str(empty)) == [{"epoch": "1", "acc": "0.5"}]


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


@pytest.mark.parametrize("sigterm", [True, False])
def test_a_study_stopped_by_sigterm_exits_143(sigterm):
    """The studies catch the KeyboardInterrupt, save, and sys.exit(130) (SIGINT's code) in main: after SIGTERM
    that is 143, which exit_with makes it; a Ctrl-C keeps 130."""
    import signal

    def main():  # as study_data_echo.py's main ends an interrupted study
        try:
            with core.sigterm_as_interrupt():
                if sigterm:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)  # never reached
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            sys.exit(130)
    with pytest.raises(SystemExit) as e:
        core.exit_with(main)
    assert e.value.code == (143 if sigterm else 130)


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
    (tmp_path / "scratch.txt").write_text("notes\n")  # untracked: no code it imported
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


def test_reproduction_report_finds_the_first_differing_epoch():
    def run(seed, losses, accs, accuracy):
        return dict(seed=seed, accuracy=accuracy, epochs=[dict(epoch=e + 1, train_loss=l, test_acc=a)
                                                          for e, (l, a) in enumerate(zip(losses, accs))])
    nan = float("nan")
    logged = [run(0, [2.0, 1.5, 1.2], [nan, 0.5, 0.7], 0.7), run(1, [2.1, 1.6, 1.3], [0.3, 0.5, 0.72], 0.72)]
    same, later, short, short_off, other = core.reproduction_report([
        run(0, [2.0, 1.5, 1.2], [nan, 0.5, 0.7], 0.7),       # identical, NaN (not evaluated) included
        run(1, [2.1, 1.6, 1.25], [0.3, 0.5, 0.72], 0.72),    # its last epoch's loss differs
        run(1, [2.1, 1.6], [0.3, 0.55], 0.55),               # stopped early: epoch 2 its final evaluation (TTA),
        run(1, [2.1, 1.6], [0.31, 0.55], 0.55),              # the log's a plain one: only epoch 1's compared
        run(7, [2.0], [0.1], 0.1)], logged)                  # no logged run of seed 7
    assert same == dict(seed=0, epochs=3, first_difference=None, max_loss_difference=0.0, cut_short=False,
                        accuracy=0.7, logged_accuracy=0.7)
    assert later["first_difference"] == 3 and later["max_loss_difference"] == pytest.approx(0.05)
    assert short["epochs"] == 2 and short["first_difference"] is None and short["cut_short"]
    assert short["logged_accuracy"] is None
    assert short_off["first_difference"] == 1
    assert other["epochs"] == 0 and other["first_difference"] is None


def test_writable_folder_checks_without_creating_anything(tmp_path):
    wanted = tmp_path / "a" / "b"
    assert core.writable_folder(str(wanted), "--out") == str(wanted)
    assert os.listdir(tmp_path) == []  # the check's file left no trace, and no folder was made
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"--out .*file/logs: cannot write there \(Not a directory\)"):
        core.writable_folder(str(tmp_path / "file" / "logs"), "--out")
    os.symlink(tmp_path / "gone", tmp_path / "dangling")  # a link to nothing: makedirs would fail on it later
    with pytest.raises(ValueError, match="dangling/logs: cannot write there"):
        core.writable_folder(str(tmp_path / "dangling" / "logs"), "--out")


def test_settings_difference_names_each_differing_key_with_both_values():
    there = dict(target=0.8, budget="steps", overrides=dict(epochs=2, widths=[8, 16, 16]))
    here = dict(target=0.8, budget="fresh", overrides=dict(epochs=2, widths=[8, 8, 8], precision="fp32"))
    assert core.settings_difference(there, here) == (
        "budget steps there, fresh here; overrides.precision unset there, fp32 here; "
        "overrides.widths [8, 16, 16] there, [8, 8, 8] here")
    assert core.settings_difference(None, here) == "none recorded there"


def test_exit_with_reads_the_sigterm_flag_once():
    """A study stopped by SIGTERM exits 143; a later interrupt in the same process (Ctrl-C) is 130 again."""
    def interrupted():
        sys.exit(130)
    core._terminated = True
    codes = []
    for _ in range(2):
        with pytest.raises(SystemExit) as e:
            core.exit_with(interrupted)
        codes.append(e.value.code)
    assert codes == [143, 130]


@pytest.mark.parametrize("world, ends", [("2", "without finalisation"), ("1", "normally")])
def test_under_torchrun_exit_with_ends_without_finalisation(tmp_path, world, ends):
    """Under torchrun a finished script's exit code and flushed output stand, and Python's finalisation (where
    torch's gloo can abort a rank) is skipped: an atexit handler stands for it. A lone process exits normally."""
    import subprocess
    script = tmp_path / "job.py"
    script.write_text("import atexit, sys\nsys.path.insert(0, sys.argv[1])\nimport core\n"
                      "atexit.register(lambda: print('finalised'))\n"
                      "def main():\n    print('done', end='')\n    print('warned', file=sys.stderr, end='')\n"
                      "    return 3\ncore.exit_with(main)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, str(script), root], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, RANK="0", WORLD_SIZE=world))
    assert r.returncode == 3 and r.stderr == "warned"
    assert r.stdout == ("done" if world == "2" else "donefinalised\n"), ends


def parsed_lines(text):
    """(line number, value) of each line that parses as JSON, one line at a time: the reference for read_jsonl."""
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        try:
            out.append((n, json.loads(line)))
        except ValueError:
            pass
    return out


def test_read_jsonl_cuts_off_a_torn_last_line_and_nothing_else(tmp_path):
    """Repair cuts only a torn last line; a torn line before the last (appended onto before repair existed) is
    skipped and left, and a complete last line after it, without its newline, gets one: not cut as if torn."""
    path = tmp_path / "r.jsonl"
    for text, repaired in (('{"a": 1}\n{"a": 2, "b\n{"a": 3}', '{"a": 1}\n{"a": 2, "b\n{"a": 3}\n'),
                           ('{"a": 1}\n{"a": 3}\n{"a": 2, "b', '{"a": 1}\n{"a": 3}\n'),
                           ('{"a": 1}\n{"a": 2, "b\n', '{"a": 1}\n{"a": 2, "b\n')):
        path.write_text(text)
        warnings = []
        assert core.read_jsonl(str(path), repair=True, warn=warnings.append) == parsed_lines(text)
        assert path.read_text() == repaired and len(warnings) == 1
        assert core.read_jsonl(str(path)) == parsed_lines(repaired) == parsed_lines(text)


def test_read_jsonl_refuses_a_folder_or_binary_data_and_cuts_nothing(tmp_path):
    with pytest.raises(core.JsonlError, match="is a folder, not a file of records"):
        core.read_jsonl(str(tmp_path), repair=True)
    path = tmp_path / "r.jsonl"
    binary = b'{"a": 1}\n' + bytes(range(256)) * 40  # thousands of bytes, newlines among them, no newline last
    path.write_bytes(binary)
    warnings = []
    with pytest.raises(core.JsonlError, match="holds binary data, not JSON records"):
        core.read_jsonl(str(path), repair=True, warn=warnings.append)
    assert path.read_bytes() == binary and warnings == []


def test_distinct_logs_reads_a_link_to_a_log_as_that_log(tmp_path):
    """A link to a log (or a path spelt otherwise) names the same file: read twice, its runs would count twice.
    The reference: the files' inodes."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text("{}")
    b.write_text("{}")
    (tmp_path / "latest.json").symlink_to(a)
    given = [str(a), str(b), str(tmp_path / "latest.json"), str(tmp_path / "." / "b.json")]
    inodes = [(os.stat(p).st_dev, os.stat(p).st_ino) for p in given]
    paths, repeated = core.distinct_logs(given)
    assert paths == [given[inodes.index(i)] for i in dict.fromkeys(inodes)] == [str(a), str(b)]
    assert repeated == [f"{str(a)} (given twice)", f"{str(b)} (given twice)"]


def test_table_rounds_to_four_decimals_and_never_cuts_a_number_to_its_width():
    """A cell wider than its column widens the row rather than losing digits; floats are rounded (not cut) to 4
    decimals, and from 1000 on to 1."""
    lines = []
    table = core.Table(["acc", "time"], width=6, out=lines.append)
    table.row({"acc": 0.94126, "time": 123.45678})
    table.row({"acc": 0.5, "time": 12345.678})
    assert lines[1:] == ["0.9413 123.4568", "0.5000 12345.7"]


def test_format_flops_at_its_unit_boundaries():
    """1e13 FLOPs is 0.010 PF (the records table's unit from there on), 1e12 is 1.00 TF, just below is GF."""
    assert [core.format_flops(f) for f in (1e13, 1e12, 9.99e11, 5e8)] == ["0.010 PF", "1.00 TF", "999 GF", "0.500 GF"]
    # just below a unit, a value whose 3 digits round up to the next is printed in that one (was "1000 GF", "100.0
    # GF" and "10.00 TF": 4 digits in the unit below)
    assert [core.format_flops(f) for f in (9.996e11, 99.96e9, 9.9996e12, 0)] == ["1.00 TF", "100 GF", "0.010 PF",
                                                                                  "0 GF"]


def test_progress_pads_a_shorter_line_over_the_longer_one_before_it():
    """What the terminal shows after the carriage returns (each overwriting from column 0) is the newest line
    alone, with no characters of a longer line before it left at its end."""
    now = [0.0]
    out = io.StringIO()
    p = core.Progress(out, every_s=1.0, clock=lambda: now[0])
    p.start("epoch 1", 1000)
    now[0] += 125.0
    p.update(1)  # 125 s each, 999 to go: "~34h41m"
    now[0] += 5.0
    p.update(999)  # 0.13 s each, 1 to go: "~0m00s", a shorter line
    screen = []
    for part in out.getvalue().split("\r"):
        screen[:len(part)] = part
    assert "".join(screen).rstrip() == "epoch 1: 999/1000 (0.13 s each, ~0m00s to go)"


def test_welch_interval_of_samples_without_spread_is_the_difference_itself():
    """Both variants bit-for-bit alike across seeds (deterministic runs): no spread, and no NaN interval."""
    d = core.mean_difference([1.0, 1.0], [3.0, 3.0, 3.0])
    assert d["diff"] == 2.0 and d["se"] == 0.0 and d["ci"] == (2.0, 2.0)


def test_parse_overrides_reads_numbers_tuples_booleans_and_none_as_python_would():
    """Negative and exponent numbers, booleans and None as the literals Python reads; words, text with spaces
    and text holding '=' stay strings, only keys get '-' as '_'."""
    got = core.parse_overrides(["lr=-1e-3", "lr-decay=1e-3", "widths=(1,2)", "ema=True", "tta=None",
                                "mode=none", "label=my run", "note=a=b", "tag=fp-32"])
    want = dict(lr=-0.001, lr_decay=0.001, widths=(1, 2), ema=True, tta=None, mode="none", label="my run",
                note="a=b", tag="fp-32")
    assert got == want and [type(v) for v in got.values()] == [type(v) for v in want.values()]


def test_field_problem_checks_optional_fields_that_are_there():
    """Optional means "may be absent", not "unchecked"; JSON's true is no number and 0 is a whole number >= 0."""
    fields = dict(trial=(lambda v: core.is_whole(v, 0), "a whole number >= 0", True),
                  best=(lambda v: v is None or core.is_number(v), "null or a number", False))
    assert core.field_problem(dict(trial=0), fields) is None
    assert core.field_problem(dict(trial=0, best=None), fields) is None
    assert core.field_problem(dict(trial=0, best="x"), fields, "r.") == '"r.best" is "x", not null or a number'
    assert core.field_problem(dict(best=1.0), fields) == 'no "trial"'
    assert [core.is_number(v) for v in (True, 1, 0.5, math.nan, math.inf)] == [False, True, True, False, False]
    assert [core.is_whole(v, 1) for v in (1, 0, True, 1.0)] == [True, False, False, False]


def test_settings_are_compared_by_full_dotted_key_and_nested_tuples_as_lists():
    assert dict(core.flatten(dict(a=dict(b=dict(c=1)), d=2))) == {"a.b.c": 1, "d": 2}
    assert core.differing_keys([dict(w=((1, 2), (3, 4))), dict(w=[[1, 2], [3, 4]])]) == []


def test_utc_timestamp_is_utc_whatever_the_local_time_zone(monkeypatch):
    import datetime
    monkeypatch.setenv("TZ", "Asia/Kolkata")  # +05:30 all year
    time.tzset()
    try:
        before = time.time()
        stamp = core.utc_timestamp()
        after = time.time()
    finally:
        monkeypatch.undo()
        time.tzset()
    parsed = datetime.datetime.fromisoformat(stamp)
    assert parsed.utcoffset() == datetime.timedelta(0) and parsed.microsecond == 0 and len(stamp) == 25
    # the instant it names is now (to the second): local time labelled +00:00 would be 5.5 hours off
    assert int(before) - 1 <= parsed.timestamp() <= after + 1


def test_folder_option_leaves_no_folder_as_no_folder_and_refuses_a_file(tmp_path):
    import argparse
    assert core.folder_option("") == "" and core.folder_option(str(tmp_path)) == str(tmp_path)
    (tmp_path / "f").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="cannot write there"):
        core.folder_option(str(tmp_path / "f" / "logs"))


def test_sign_test_is_the_two_sided_binomial_tail_counted_over_every_outcome():
    """Against enumeration: of the 2^n equally likely ways n disagreements can go, the share that splits at
    least as unevenly as a against b."""
    import itertools
    for n in range(9):
        outcomes = [sum(o) for o in itertools.product((0, 1), repeat=n)]
        for a in range(n + 1):
            extreme = sum(abs(k - n / 2) >= abs(a - n / 2) for k in outcomes) / 2 ** n
            assert core.sign_test(a, n - a) == pytest.approx(extreme, abs=1e-12) == core.sign_test(n - a, a)
    assert core.sign_test(14, 8) == pytest.approx(0.2863, abs=1e-4)
