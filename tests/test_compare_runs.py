"""compare_runs.py: series pooled over logs, checked against the statistics module and core's differences."""
import copy
import glob
import json
import math
import os
import statistics

import pytest

import compare_runs
import core
import train_cifar
from conftest import synthetic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def real_log(tmp_path_factory):
    """The JSON summary of a real (tiny) logged invocation, as a template for logs with chosen results."""
    d = tmp_path_factory.mktemp("logs")
    s = train_cifar.train("resnet9", data=synthetic(200, 50), device="cpu", log=lambda *a: None, log_dir=str(d),
                          widths=(8, 16, 16, 16), batch_size=50, epochs=1, runs=2, precision="fp32")
    with open(s["log_json"]) as f:
        return json.load(f)


def write_log(tmp_path, template, name, results, **config):
    """A copy of template whose runs have these (seed, accuracy) results and whose config has these changes."""
    log = copy.deepcopy(template)
    log["config"].update(config, target=0.94)
    log["runs"] = [dict(copy.deepcopy(template["runs"][0]), seed=seed, accuracy=acc, total_time_s=10.0 + seed)
                   for seed, acc in results]
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(log))
    return str(path)


def test_a_series_pools_its_logs(real_log, tmp_path, capsys):
    """Two logs (seeds 0-2 and 3-4, the second with another seed, run count and compilation: not the recipe)
    are one series; unfinished runs are left out and counted."""
    first = write_log(tmp_path, real_log, "a1", [(0, 0.9401), (1, 0.9388), (2, 0.9412)])
    second = write_log(tmp_path, real_log, "a2", [(3, 0.9399), (4, 0.9420), (5, None)], seed=3, runs=3,
                       compile=True)
    s = compare_runs.series([first, second])
    m = compare_runs.summary(s)
    acc = [94.01, 93.88, 94.12, 93.99, 94.20]
    assert (m["n"], m["seeds"], m["reached"], s["left_out"]) == (5, "0-4", 3, 1)
    assert m["mean"] == pytest.approx(statistics.mean(acc)) and m["std"] == pytest.approx(statistics.stdev(acc))
    assert m["se"] == pytest.approx(statistics.stdev(acc) / math.sqrt(5))
    assert list(m["hardware"].values()) == [[10.0, 11.0, 12.0, 13.0, 14.0]]  # one machine: each run's time
    assert compare_runs.main([first, second]) == 0
    out = capsys.readouterr().out
    assert "n=5 (seeds 0-4)" in out and "3 of 5 reach 94%" in out and "1 unfinished" in out
    assert f"code: 1 commit(s), {str(real_log['commit'])[:7]}\n" in out
    half = core.student_t_quantile(0.975, 4) * statistics.stdev(acc) / math.sqrt(5)
    gap = statistics.mean(acc) - 94
    assert f"mean - target {gap:+.2f} points (95% interval {gap - half:+.2f} to {gap + half:+.2f})" in out


def test_a_log_without_a_target_says_so(real_log, tmp_path, capsys):
    """Not '0 of 2 reach ' with nothing after it."""
    path = write_log(tmp_path, real_log, "a", [(0, 0.9401), (1, 0.9388)])
    log = json.loads(open(path).read())
    del log["config"]["target"]
    open(path, "w").write(json.dumps(log))
    assert compare_runs.main([path]) == 0
    out = capsys.readouterr().out
    assert "93.94 ± 0.09%" in out and "no target logged" in out and "reach" not in out


def test_a_run_at_the_target_reaches_it_and_a_run_stopped_early_is_left_out(real_log, tmp_path):
    """9,400 of 10,000 right is 94%: it counts as reaching 0.94. A run ended by --stop-after-epochs (continued
    later from its checkpoint) has an accuracy but is not a finished run of the recipe."""
    path = write_log(tmp_path, real_log, "edge", [(0, 9400 / 10000), (1, 0.9399), (2, 0.9500)])
    log = json.loads(open(path).read())
    log["runs"][2]["stopped_after_epoch"] = 3
    open(path, "w").write(json.dumps(log))
    s = compare_runs.series([path])
    m = compare_runs.summary(s)
    assert (m["n"], m["reached"], s["left_out"]) == (2, 1, 1)
    assert m["mean"] == pytest.approx(statistics.mean([94.00, 93.99]))


@pytest.mark.parametrize("seeds, text", [([5, 0, 1, 2, 7, 8], "0-2, 5, 7-8"), ([3], "3"),
                                         ([0, 1, 1, 2, 2, 3, 9, 9, 9], "0-3, 9; 1-2 run twice, 9 run 3 times")])
def test_seed_ranges(seeds, text):
    assert compare_runs.seed_ranges(seeds) == text


def test_logs_of_different_recipes_are_not_pooled_unless_asked(real_log, tmp_path, capsys):
    first = write_log(tmp_path, real_log, "a", [(0, 0.94), (1, 0.95)])
    other = write_log(tmp_path, real_log, "b", [(2, 0.93)], epochs=2)
    assert compare_runs.main([first, other]) == 2
    err = capsys.readouterr().err
    assert "epochs is 1 in" in err and "but 2 in" in err and "--allow-mixed" in err and err.count("\n") == 1
    assert compare_runs.main([first, other, "--allow-mixed"]) == 0
    assert "mixed: epochs = 1, 2" in capsys.readouterr().out


def test_two_series_compared_unpaired_and_over_shared_seeds(real_log, tmp_path, capsys):
    """Welch over all runs; paired over the seeds each series ran exactly once (seed 1 twice in B: left out)."""
    a = write_log(tmp_path, real_log, "a", [(0, 0.9401), (1, 0.9388), (2, 0.9412), (3, 0.9395)])
    b = write_log(tmp_path, real_log, "b", [(0, 0.9415), (1, 0.9391), (1, 0.9380), (2, 0.9420), (7, 0.9433)],
                  label_smoothing=0.1)
    sa, sb = compare_runs.series([a]), compare_runs.series([b])
    seeds, in_a, in_b = compare_runs.paired_runs(sa, sb)
    assert seeds == [0, 2] and in_a == pytest.approx([94.01, 94.12]) and in_b == pytest.approx([94.15, 94.20])
    assert compare_runs.main([a, "--vs", b]) == 0
    out = capsys.readouterr().out
    welch = core.mean_difference([94.01, 93.88, 94.12, 93.95], [94.15, 93.91, 93.80, 94.20, 94.33])
    paired = core.paired_difference(in_a, in_b)
    assert f"(Welch): {welch['diff']:+.2f} ± {welch['se']:.2f} points" in out
    assert f"paired over the 2 seed(s) both ran (0, 2): {paired['diff']:+.2f} ± {paired['se']:.2f}" in out
    assert "label_smoothing 0.0 -> 0.1" in out
    assert f"time per run B / A on {real_log['hardware']}: {12.2 / 11.5:.3f}" in out


def test_bad_logs_exit_2_with_one_line(tmp_path, capsys):
    """(What core.read_run_log refuses is tested there.) A log without a config, or without a finished run."""
    for content, message in (('{"preset": "fast94", "runs": [', "is not valid JSON"),
                             ('{"preset": "fast94", "runs": []}', "not a train_cifar.py log (no config)"),
                             ('{"preset": "fast94", "runs": [], "config": {"target": 0.94}}', "no finished run"),
                             # a target of another kind was a TypeError when runs were compared with it
                             ('{"preset": "fast94", "runs": [], "config": {"target": "0.94"}}',
                              'config.target is "0.94", not a fraction in (0, 1]'),
                             ('{"preset": "fast94", "runs": [], "config": [0.94]}', "its config is no object")):
        (tmp_path / "bad.json").write_text(content)
        assert compare_runs.main([str(tmp_path / "bad.json")]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    (tmp_path / "bad.json").write_bytes(b"PK\x03\x04\xc7\xff binary")  # (an .npz given by mistake: a traceback)
    assert compare_runs.main([str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'bad.json'} is not a train_cifar.py log (not UTF-8 text)" in err and err.count("\n") == 1


def test_every_committed_log_of_a_preset_reads(capsys):
    """Logs from every stage of the project (older ones lack later options) summarise, a preset at a time."""
    by_preset = {}
    for path in sorted(glob.glob(os.path.join(REPO, "logs", "*.json"))):
        with open(path) as f:
            log = json.load(f)
        if isinstance(log, dict) and "runs" in log and "config" in log and any(map(compare_runs.finished, log["runs"])):
            by_preset.setdefault(log["preset"], []).append(path)
    assert {"fast94", "fast96", "resnet9-tricks"} <= set(by_preset)
    for paths in by_preset.values():
        assert compare_runs.main(paths + ["--allow-mixed"]) == 0
    assert capsys.readouterr().out.count("accuracy ") == len(by_preset)


def test_a_series_names_the_commits_it_spans(real_log, tmp_path, capsys):
    """Logs of one recipe run at different commits pool (the code may have changed only how a run rounds, as
    92e7861 did fast94's), and the series says which commits, in the order given, each once."""
    paths = []
    for i, commit in enumerate(["aaaaaaa1", "bbbbbbb2", "aaaaaaa1", "ccccccc3"]):
        log = json.loads(open(write_log(tmp_path, real_log, f"c{i}", [(i, 0.94)])).read())
        log["commit"] = commit
        (tmp_path / f"c{i}.json").write_text(json.dumps(log))
        paths.append(str(tmp_path / f"c{i}.json"))
    assert compare_runs.summary(compare_runs.series(paths))["commits"] == ["aaaaaaa", "bbbbbbb", "ccccccc"]
    assert compare_runs.main(paths) == 0
    assert "code: 3 commit(s), aaaaaaa, bbbbbbb, ccccccc (a seed may round otherwise" in capsys.readouterr().out


@pytest.mark.parametrize("unbuffered", [True, False])
def test_a_reader_that_leaves_early_gets_no_traceback(real_log, tmp_path, unbuffered):
    """`compare_runs.py ... | head -1`: the reader gone, Python would print a BrokenPipeError traceback (from
    print, or from the flush at exit when stdout is buffered); core.exit_with ends quietly with exit code 1."""
    import subprocess
    import sys
    path = write_log(tmp_path, real_log, "a", [(0, 0.94), (1, 0.95)])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    p = subprocess.Popen([sys.executable, os.path.join(REPO, "compare_runs.py"), path], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # before the script has written anything
    err = p.stderr.read()
    assert p.wait() == 1 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_one_run_has_no_spread_and_small_runs_keep_their_flops(real_log, tmp_path, capsys):
    """One run printed "12.70 ± 0.00%"; 73.4 GF a run printed "0.000 PF" (and such runs pooled as one FLOPs)."""
    one = write_log(tmp_path, real_log, "one", [(0, 0.127)])
    log = json.loads(open(one).read())
    log["train_flops_per_run"] = 73.4e9
    open(one, "w").write(json.dumps(log))
    assert compare_runs.main([one]) == 0
    out = capsys.readouterr().out
    assert "accuracy 12.70%; 0 of 1 reach 94%" in out and "±" not in out
    assert "training FLOPs 73.4 GF a run" in out
    other = write_log(tmp_path, real_log, "other", [(1, 0.13)], epochs=2)
    log["train_flops_per_run"], log["config"]["epochs"] = 146.8e9, 2
    open(other, "w").write(json.dumps(log))
    assert compare_runs.summary(compare_runs.series([one, other], allow_mixed=True))["flops"] == [73.4e9, 146.8e9]


def test_each_machine_gets_its_own_accuracy_where_a_series_ran_on_several(real_log, tmp_path, capsys):
    """Do a machine's kernels, which round otherwise, move the accuracy? Each machine's line gives its own runs'
    mean ± std (and a lone run's accuracy); a series on one machine keeps the pooled line only."""
    fast = write_log(tmp_path, real_log, "fast", [(0, 0.9601), (1, 0.9615), (2, 0.9589)])
    slow = write_log(tmp_path, real_log, "slow", [(3, 0.9580), (4, 0.9596)])
    lone = write_log(tmp_path, real_log, "lone", [(5, 0.9622)])
    for path, hardware in ((slow, "machine B"), (lone, "machine C")):
        log = json.loads(open(path).read())
        open(path, "w").write(json.dumps(dict(log, hardware=hardware)))
    m = compare_runs.summary(compare_runs.series([fast, slow, lone]))
    wanted = {real_log["hardware"]: [96.01, 96.15, 95.89], "machine B": [95.80, 95.96], "machine C": [96.22]}
    assert m["accuracy_by_hardware"].keys() == wanted.keys()
    assert all(m["accuracy_by_hardware"][h] == pytest.approx(wanted[h]) for h in wanted)
    assert compare_runs.main([fast, slow, lone]) == 0
    out = capsys.readouterr().out
    for values in ([96.01, 96.15, 95.89], [95.80, 95.96]):
        assert f"{len(values)} runs, {statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}%, " in out
    assert "on machine C: 1 run, 96.22%, 15.0 s\n" in out
    assert compare_runs.main([fast]) == 0
    out = capsys.readouterr().out
    assert f"on {real_log['hardware']}: 3 runs, 11.0 ± 1.0 s a run\n" in out  # no second accuracy for one machine


def test_process_counts_are_told_apart_from_hardware(real_log, tmp_path, capsys):
    """1 process against 2 on one machine was labelled "on different hardware" and lost its time comparison:
    train_cifar.py writes the hardware of 2 processes as "2 processes x <device>"."""
    device = real_log["hardware"]
    a = write_log(tmp_path, real_log, "a", [(0, 0.94), (1, 0.95)])
    b = tmp_path / "b.json"
    log = json.loads(open(a).read())
    b.write_text(json.dumps(dict(log, hardware=f"2 processes x {device}", world_size=2)))
    assert compare_runs.main([a, "--vs", str(b)]) == 0
    out = capsys.readouterr().out
    assert "(with different process counts)\n" in out and "different hardware" not in out
    assert f"time per run B / A on {device} (1 process in A, 2 processes in B): 1.000" in out
    c = tmp_path / "c.json"
    c.write_text(json.dumps(dict(log, hardware="another machine")))
    assert compare_runs.main([a, "--vs", str(c)]) == 0
    out = capsys.readouterr().out
    assert "(on different hardware)\n" in out and "times not compared: A and B ran on different hardware" in out


def test_precision_asked_for_is_not_the_recipe_the_resolved_one_is(real_log, tmp_path):
    """ddp_check.sh's runs asked for auto, which an AVX2 CPU resolved to fp32; its later runs ask for fp32: one
    recipe. bf16 against fp32 is not."""
    auto = write_log(tmp_path, real_log, "auto", [(0, 0.94)], precision="auto")
    fp32 = write_log(tmp_path, real_log, "fp32", [(1, 0.94)], precision="fp32")
    assert compare_runs.summary(compare_runs.series([auto, fp32]))["n"] == 2
    bf16 = json.loads(open(fp32).read())
    bf16["precision"] = "bf16"
    (tmp_path / "bf16.json").write_text(json.dumps(bf16))
    with pytest.raises(compare_runs.LogError, match="resolved_precision"):
        compare_runs.series([auto, str(tmp_path / "bf16.json")])


def test_a_log_given_twice_counts_once(real_log, tmp_path, capsys):
    """`compare_runs.py X.json X.json` (overlapping globs) counted each run twice: "n=2 (seeds 0; 0 run twice)", a
    spread of 0.00. One file, however spelt, is read once and said so; another file with the same seeds is a
    repeat of those seeds and still counts."""
    path = write_log(tmp_path, real_log, "a", [(0, 0.9401), (1, 0.9388)])
    spelt_otherwise = str(tmp_path / "." / "a.json")
    assert compare_runs.main([path, path, spelt_otherwise]) == 0
    out = capsys.readouterr().out
    assert "1 log, n=2 (seeds 0-1)" in out and "run twice" not in out
    assert f"accuracy {statistics.mean([94.01, 93.88]):.2f} ± {statistics.stdev([94.01, 93.88]):.2f}%" in out
    assert f"(counted once: {path} (given 3 times))" in out
    again = tmp_path / "b.json"
    again.write_text(open(path).read())
    assert compare_runs.main([path, str(again), path]) == 0
    out = capsys.readouterr().out
    assert "2 logs, n=4 (seeds 0-1; 0-1 run twice)" in out and f"(counted once: {path} (given twice))" in out
    # in both series, B - A would count its runs on both sides
    assert compare_runs.main([path, str(again), "--vs", spelt_otherwise]) == 2
    assert f"{path} given in both A and --vs B" in capsys.readouterr().err


@pytest.mark.parametrize("field, value, message", [
    ("accuracy", 95, "run 1's accuracy is 95, not a fraction in [0, 1]"),
    ("accuracy", math.nan, "run 1's accuracy is NaN"),
    ("accuracy", -0.01, "run 1's accuracy is -0.01"),
    ("accuracy", "0.94", "run 1's accuracy is \"0.94\""),
    ("total_time_s", -5, "run 1's total_time_s is -5, not a finite time >= 0"),
    ("total_time_s", math.inf, "run 1's total_time_s is Infinity"),
    ("seed", "zero", "run 1's seed is \"zero\", not a whole number"),
    ("seed", 1.5, "run 1's seed is 1.5"),
    ("seed", True, "run 1's seed is true"),
    ("train_flops_per_run", -1.0, "train_flops_per_run is -1.0"),
])
def test_impossible_values_in_a_log_exit_2_naming_the_file_and_field(real_log, tmp_path, capsys, field, value,
                                                                      message):
    """An edited log printed "accuracy 9500.00%", "nan%", "-5.0 s" or "seeds zero" with exit code 0."""
    path = write_log(tmp_path, real_log, "edited", [(0, 0.94), (1, 0.95)])
    log = json.loads(open(path).read())
    (log if field == "train_flops_per_run" else log["runs"][1])[field] = value
    open(path, "w").write(json.dumps(log))
    assert compare_runs.main([path]) == 2
    err = capsys.readouterr().err
    assert f"error: {path}: {message}" in err and err.count("\n") == 1
    log["runs"][1].update(accuracy=None, total_time_s=None)  # a run without them (unfinished) is no error
    log["train_flops_per_run"] = None
    log["runs"][1]["seed"] = 1
    open(path, "w").write(json.dumps(log))
    assert compare_runs.main([path]) == 0 and "n=1 (seeds 0)" in capsys.readouterr().out


def test_accuracies_of_exactly_0_and_1_are_valid(real_log, tmp_path, capsys):
    path = write_log(tmp_path, real_log, "edges", [(0, 0.0), (1, 1.0)])
    assert compare_runs.main([path]) == 0 and "accuracy 50.00 ± 70.71%" in capsys.readouterr().out


@pytest.mark.parametrize("key, before, other", [
    ("color_jitter", [0.0, 0.0], [0.14, 0.13]),
    ("tta_confidence", 0.0, 0.7),  # fast94's logs before selective TTA pooled with its later ones, silently
    ("train_sizes", [], [20, 24, 24, 24, 24, 32]),
    ("lookahead_sync", "epoch", "end")])
def test_a_log_from_before_an_option_is_not_pooled_with_runs_that_used_it(real_log, tmp_path, key, before, other):
    """A log that predates an option ran with the value core.PREDATED_VALUES gives it: it pools with runs
    logged with that value, not with others (keys a log lacks were skipped, so those pooled as one recipe)."""
    older = copy.deepcopy(real_log)
    del older["config"][key]
    old = write_log(tmp_path, older, "old", [(0, 0.9401), (1, 0.9388)])
    same = write_log(tmp_path, real_log, "same", [(2, 0.9412)], seed=2, **{key: before})
    changed = write_log(tmp_path, real_log, "changed", [(3, 0.9399)], seed=3, **{key: other})
    assert compare_runs.summary(compare_runs.series([old, same]))["n"] == 3
    with pytest.raises(compare_runs.LogError, match=f"trained different recipes: {key} is "):
        compare_runs.series([old, changed])
    assert compare_runs.recipe_differences([core.read_run_log(old), core.read_run_log(changed)]) == {
        key: [before, other]}


def test_every_option_a_committed_log_lacks_has_its_predated_value_or_says_why_not():
    """A new option makes every log before it lack a key: it must say what those runs ran with (or why no one
    value describes them), else compare_runs would pool them with runs of every setting of it."""
    options = set(train_cifar.COMMON)
    for preset in train_cifar.PRESETS.values():
        options |= set(preset)
    assert not set(core.PREDATED_VALUES) & set(core.PREDATED_UNUSED)
    assert set(core.PREDATED_VALUES) | set(core.PREDATED_UNUSED) <= options  # (none stale)
    logs = [core.read_run_log(p) for p in sorted(glob.glob(os.path.join(REPO, "logs", "*.json")))
            if json.load(open(p)).get("config")]
    assert len(logs) > 50
    lacking = {k for log in logs for k in options - set(log["config"])}
    assert lacking <= set(core.PREDATED_VALUES) | set(core.PREDATED_UNUSED), sorted(
        lacking - set(core.PREDATED_VALUES) - set(core.PREDATED_UNUSED))


@pytest.mark.parametrize("preset", list(train_cifar.PRESETS))
def test_the_predated_values_are_valid_options(preset):
    """Each is a value today's code takes (a rerun of an old log passes them to make_config)."""
    values = core.as_tuples(core.PREDATED_VALUES)
    cfg = train_cifar.make_config(preset, **values)
    assert {k: cfg[k] for k in values} == values
