import csv
import itertools
import json
import math
import os
import re
import statistics

import pytest

import core
import plot_runs
import train_cifar
from conftest import figure_drawn, synthetic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """A real (tiny) logged invocation of two runs: its JSON summary and TSV table."""
    d = tmp_path_factory.mktemp("logs")
    s = train_cifar.train("resnet9", data=synthetic(200, 50), device="cpu", log=lambda *a: None, log_dir=str(d),
                          widths=(8, 16, 16, 16), batch_size=50, epochs=3, eval_every=2, runs=2, precision="fp32")
    return s["log_json"], s["log_json"][:-len(".json")] + ".tsv"


def test_curves_follow_the_logged_table(logged):
    summary = core.read_run_log(logged[0])
    with open(logged[1]) as f:
        table = list(csv.DictReader(f, delimiter="\t"))
    for x, column in (("epoch", "epoch"), ("time", "total_time")):
        got = plot_runs.curves(summary, x)
        assert len(got) == 2
        for run, (label, xs, acc, loss) in enumerate(got):
            rows = [r for r in table if int(r["run"]) == run]
            assert label.startswith(f"resnet9 seed {run}: ")
            assert xs == pytest.approx([float(r[column]) for r in rows], rel=1e-6)
            assert loss == pytest.approx([float(r["train_loss"]) for r in rows], rel=1e-6)
            # epoch 1 was not evaluated (eval_every 2): NaN in both
            assert math.isnan(acc[0]) and math.isnan(float(rows[0]["test_acc"]))
            assert acc[1:] == pytest.approx([float(r["test_acc"]) for r in rows[1:]])


def test_plot_writes_a_png(logged, tmp_path):
    out = tmp_path / "runs.png"
    assert plot_runs.main([logged[0], "--x", "time", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_into_a_new_folder_or_an_unwritable_one(logged, tmp_path, capsys):
    """A new folder is made; one that cannot be is a one-line error before the logs are read, not a traceback."""
    out = tmp_path / "plots" / "runs.png"
    assert plot_runs.main([logged[0], "--out", str(out)]) == 0 and out.exists()
    (tmp_path / "file").write_text("x")
    assert plot_runs.main([logged[0], "--out", str(tmp_path / "file" / "runs.png")]) == 2
    err = capsys.readouterr().err
    assert "--out's folder" in err and "cannot write there (Not a directory)" in err and err.count("\n") == 1


@pytest.mark.parametrize("content, message", [
    ('{"preset": "fast94", "runs": [', "not valid JSON"),
    ('{"rows": []}', "not a train_cifar.py log"),
    ('{"preset": "fast94", "runs": [], "config": {"target": 0.94}}', "none of the logs has a run"),
    # runs with rows but no config (a KeyError when the target was drawn), a hardware that is no text (a TypeError)
    ('{"preset": "fast94", "runs": [{"seed": 0, "epochs": [{"epoch": 1, "test_acc": 0.5, "total_time": 1.0, '
     '"train_loss": 2.0}]}]}', "not a train_cifar.py log (no config)"),
    ('{"preset": "fast94", "runs": [], "config": {"target": 0.94}, "hardware": 5}', "hardware is 5, not text"),
])
def test_bad_logs_exit_2_with_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert plot_runs.main([str(path), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "x.png").exists()
    assert plot_runs.main([str(tmp_path / "missing.json")]) == 2


def target_lines(fig):
    """The heights of the accuracy panel's horizontal lines across the whole panel (axhline: x from 0 to 1)."""
    return [line.get_ydata()[0] for line in fig.axes[0].get_lines()
            if list(line.get_xdata()) == [0, 1] and len(set(line.get_ydata())) == 1]


def test_a_log_without_a_target_is_drawn_without_its_line(logged, tmp_path, capsys, monkeypatch):
    """A config without "target" (or a null one) was a KeyError, then a TypeError, where the target's line is drawn.
    With a target, one line at it (in %); without one, no line (not one at a target made up)."""
    log = json.loads(open(logged[0]).read())
    out = str(tmp_path / "x.png")
    target = log["config"]["target"]
    assert target is not None
    fig = figure_drawn(monkeypatch, lambda: plot_runs.main([logged[0], "--out", out]))
    assert target_lines(fig) == pytest.approx([100 * target])
    for target in ("absent", None):
        if target == "absent":
            del log["config"]["target"]
        else:
            log["config"]["target"] = None
        path = tmp_path / "no-target.json"
        path.write_text(json.dumps(log))
        fig = figure_drawn(monkeypatch, lambda: plot_runs.main([str(path), "--out", out]))
        assert os.path.exists(out) and target_lines(fig) == []


def write_reference(path, rows):
    path.write_text("epoch\ttotal_time\ttest_acc\n" + "".join(f"{e}\t{10.0 * e}\t{a}\n" for e, a in rows))
    return str(path)


def test_reference_is_compared_epoch_by_epoch(logged, tmp_path, capsys):
    ref = write_reference(tmp_path / "published.tsv", [(1, 0.5), (2, 0.625), (3, 0.75), (4, 0.8)])
    out = tmp_path / "runs.png"
    assert plot_runs.main([logged[0], "--reference", ref, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    assert header[0] == "epoch" and header[-1] == "published"
    with open(logged[1]) as f:
        table = list(csv.DictReader(f, delimiter="\t"))
    rows = [line.split() for line in lines[1:-1]]  # the last line names the PNG
    body = {int(r[0]): r[1:] for r in rows if len(r) == len(header)}
    assert sorted(body) == [1, 2, 3, 4]  # the runs' 3 epochs and the reference's 4
    assert body[4][-1] == "80.00" and body[2][-1] == "62.50"
    # epoch 2 of each run: its logged test accuracy, as a percentage (epoch 1 was not evaluated: nan)
    run_acc = [float(r["test_acc"]) for r in table if int(r["epoch"]) == 2]
    assert [float(v) for v in body[2][:-1]] == pytest.approx([100 * a for a in run_acc], abs=0.006)
    assert body[1][0] == "nan"


@pytest.mark.parametrize("content, message", [
    ("epoch\ttest_acc\n1\t0.5\n2\t55.0\n", "fractions in [0, 1]"),
    ("epoch\ttest_acc\n2\t0.5\n1\t0.6\n", "epochs must increase"),
    ("epoch\thours\n1\t0.5\n", "not a reference curve"),
])
def test_bad_reference_exits_2_with_one_line(logged, tmp_path, capsys, content, message):
    ref = tmp_path / "ref.tsv"
    ref.write_text(content)
    assert plot_runs.main([logged[0], "--reference", str(ref), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "x.png").exists()


def test_reference_needs_the_epoch_axis(logged, tmp_path, capsys):
    ref = write_reference(tmp_path / "published.tsv", [(1, 0.5)])
    assert plot_runs.main([logged[0], "--reference", ref, "--x", "time", "--out", str(tmp_path / "x.png")]) == 2
    assert "--x epoch" in capsys.readouterr().err


def test_published_reference_curves_load():
    """The committed curves parse and reach what their runs are known for (94.08% at epochs 31 and 24)."""
    for name, epoch in (("dawnbench-resnet18-bkj-v100", 31), ("myrtle-resnet9-v100", 24)):
        label, epochs, acc = plot_runs.load_reference(os.path.join(REPO, "logs", "reference", f"{name}.tsv"))
        first = next(e for e, a in zip(epochs, acc) if a >= 0.94)
        assert label == name and first == epoch and acc[epochs.index(epoch)] == pytest.approx(0.9408)


def test_logs_of_different_configurations_are_told_apart_in_the_labels(logged):
    summary = core.read_run_log(logged[0])
    other = json.loads(json.dumps(summary))
    other["config"].update(epochs=4, seed=5, runs=1)  # seed and runs alone do not make another configuration
    older = json.loads(json.dumps(summary))
    del older["config"]["epochs"]  # a log from before an option existed: not compared on it
    assert plot_runs.config_differences([summary, other]) == ["epochs=3", "epochs=4"]
    assert plot_runs.config_differences([summary, dict(summary)]) == ["", ""]
    as_float = json.loads(json.dumps(summary))
    as_float["config"]["epochs"] = 3.0  # --epochs on the command line is a float
    assert plot_runs.config_differences([summary, as_float]) == ["", ""]
    assert plot_runs.config_differences([summary, other, older]) == ["", "", ""]
    labels = [c[0] for c in plot_runs.curves(other, "epoch", "epochs=4")]
    assert labels[0].startswith("resnet9 [epochs=4] seed 0")


def test_recipe_points_pool_logs_by_recipe(logged):
    """--x flops: one point per recipe; other seeds, other hardware or a log lacking a newer option pool with it,
    another epoch count does not. Each point's mean ± std is over the pooled finished runs."""
    summary = core.read_run_log(logged[0])
    seeds = json.loads(json.dumps(summary))
    seeds["config"].update(seed=2, runs=1)
    seeds["hardware"] = "another machine"
    seeds["runs"] = [dict(summary["runs"][0], seed=2, accuracy=0.5)]
    older = json.loads(json.dumps(summary))
    del older["config"]["cutout"]
    longer = json.loads(json.dumps(summary))
    longer["config"]["epochs"] = 4
    longer["train_flops_per_run"] *= 4 / 3
    first, second = plot_runs.recipe_points([summary, seeds, older, longer])
    accs = [100 * r["accuracy"] for r in summary["runs"]] + [50.0] + [100 * r["accuracy"] for r in older["runs"]]
    assert (first["n"], first["mean"], first["std"]) == (5, *core.mean_std(accs))
    assert first["tag"] == "epochs=3" and second["tag"] == "epochs=4" and second["n"] == 2
    assert first["pf"] == summary["train_flops_per_run"] / 1e15 and second["pf"] == pytest.approx(first["pf"] * 4 / 3)
    assert first["hardware"] == sorted({summary["hardware"], "another machine"})


def test_a_recipe_is_placed_at_its_newest_logs_flops(logged, tmp_path, capsys):
    """Logs of one recipe from before and after FLOP counting was corrected: the point takes the newest log's
    count, whichever order the logs come in, and the printed table names the older count too."""
    summary = core.read_run_log(logged[0])
    older = json.loads(json.dumps(summary))
    older.update(started="2026-12-01T00:00:00+00:00", train_flops_per_run=1.03 * summary["train_flops_per_run"])
    newer = dict(json.loads(json.dumps(summary)), started="2026-12-06T00:00:00+00:00")
    for order in ([older, newer], [newer, older]):
        (point,) = plot_runs.recipe_points(order)
        assert point["pf"] == summary["train_flops_per_run"] / 1e15
        assert point["older_pf"] == [older["train_flops_per_run"] / 1e15]
    # a third log counting a hair off the older one (as logs of one commit may) is named once, under one count
    hair = dict(json.loads(json.dumps(older)), train_flops_per_run=older["train_flops_per_run"] * (1 + 1e-6))
    paths = [copy_log(log, tmp_path / f"{i}.json") for i, log in enumerate([older, newer, hair])]
    assert plot_runs.main([*paths, "--x", "flops", "--out", str(tmp_path / "r.png")]) == 0
    shown = core.format_flops(summary["train_flops_per_run"])
    assert f" at {shown} (older logs: {core.format_flops(older['train_flops_per_run'])}); " in capsys.readouterr().out


def test_flops_plot_writes_a_png_and_prints_each_recipe(logged, tmp_path, capsys):
    out = tmp_path / "records.png"
    assert plot_runs.main([logged[0], "--x", "flops", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = core.read_run_log(logged[0])
    mean, std = core.mean_std([100 * r["accuracy"] for r in summary["runs"]])
    flops = core.format_flops(summary["train_flops_per_run"])
    assert f"resnet9: {mean:.2f} ± {std:.2f}% (n=2) at {flops}; " in capsys.readouterr().out
    unfinished = json.loads(json.dumps(summary))
    for run in unfinished["runs"]:
        run.update(accuracy=None, diverged=True)
    path = tmp_path / "diverged.json"
    path.write_text(json.dumps(unfinished))
    assert plot_runs.main([str(path), "--x", "flops", "--out", str(tmp_path / "x.png")]) == 2
    assert "none of the logs has a finished run" in capsys.readouterr().err


def copy_log(summary, path, **changes):
    """The log written again under another name (a rerun of its seeds elsewhere), with changes to its summary."""
    path.write_text(json.dumps(dict(json.loads(json.dumps(summary)), **changes)))
    return str(path)


def legend_labels(fig):
    legends = fig.legends + [a.get_legend() for a in fig.axes if a.get_legend()]
    return [[t.get_text() for t in lg.get_texts()] for lg in legends]


def test_runs_of_different_logs_alike_are_told_apart(logged, tmp_path, capsys, monkeypatch):
    """The same seeds in another log (a rerun on other hardware) and in a copy of a log under its name in another
    folder: every run keeps a column of its own in the table and an entry of its own in the legend; none
    overwrites another."""
    summary = core.read_run_log(logged[0])
    rerun = copy_log(summary, tmp_path / "resnet9-20990101-000000-1.json", hardware="another machine")
    (tmp_path / "copy").mkdir()
    copied = copy_log(summary, tmp_path / "copy" / os.path.basename(logged[0]))
    ref = write_reference(tmp_path / "published.tsv", [(1, 0.5)])
    out = str(tmp_path / "runs.png")
    fig = figure_drawn(monkeypatch, lambda: plot_runs.main([logged[0], rerun, copied, "--reference", ref,
                                                            "--out", out]))
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    assert len(set(header)) == len(header) == 8  # epoch, 6 runs, the reference
    for labels in legend_labels(fig):
        assert len(labels) == len(set(labels)) == 7
    first = plot_runs.log_name(logged[0], "resnet9")
    assert header == ["epoch"] + [f"resnet9-seed{s}@{n}" for n in (f"{first}#1", "20990101-000000-1", f"{first}#2")
                                  for s in (0, 1)] + ["published"]
    assert lines[-1].startswith("6 runs -> ")
    # each run's column holds its own accuracy: the rerun's epoch 2 is the logged run's
    row = dict(zip(header, lines[2].split()))
    assert row["resnet9-seed1@20990101-000000-1"] == f"{100 * summary['runs'][1]['epochs'][1]['test_acc']:.2f}"
    assert plot_runs.tell_apart(["a", "b", "a", "a"], ["x", "y", "z", "z"]) == ["x", "", "z#1", "z#2"]


def test_flops_labels_tell_recipes_apart_by_keys_an_older_log_lacks(logged):
    """Two recipes apart only by an option an older log lacks: the option must be in their labels, though the
    older log's recipe does not show it."""
    summary = core.read_run_log(logged[0])
    other = json.loads(json.dumps(summary))
    other["config"]["cutout"] = summary["config"]["cutout"] + 4
    older = json.loads(json.dumps(summary))
    del older["config"]["cutout"]
    older["config"]["epochs"] = 4
    tags = [p["tag"] for p in plot_runs.recipe_points([summary, other, older])]
    cutout = summary["config"]["cutout"]
    assert tags == [f"cutout={cutout}, epochs=3", f"cutout={cutout + 4}, epochs=3", "epochs=4"]


def test_one_run_has_no_spread(logged, tmp_path, capsys, monkeypatch):
    """The std of one run is undefined, not 0: no ± in the table, no error bar in the plot."""
    summary = core.read_run_log(logged[0])
    single = copy_log(summary, tmp_path / "single.json", runs=summary["runs"][:1])
    fig = figure_drawn(monkeypatch, lambda: plot_runs.main([single, "--x", "flops", "--out", str(tmp_path / "x.png")]))
    out = capsys.readouterr().out
    assert f"resnet9: {100 * summary['runs'][0]['accuracy']:.2f}% (n=1) at " in out and "±" not in out
    (container,) = fig.axes[0].containers
    assert not container.lines[2]  # no error bar


def overlap(a, b):
    return a.get_window_extent().overlaps(b.get_window_extent())


@pytest.mark.parametrize("copies", [1, 6])
def test_figures_stay_readable(logged, tmp_path, monkeypatch, copies):
    """The panel titles do not run into each other, the legend covers neither panel (however many lines), and
    each panel keeps its width; another preset's settings are not listed in each label."""
    summary = core.read_run_log(logged[0])
    logs = []
    for i in range(copies):  # each in another configuration: labels as long as a sweep's
        config = dict(summary["config"], cutout=i, batch_size=50 + i, weight_decay=0.0005 * i,
                      widths=[8 + i, 16, 16, 16], label_smoothing=0.05 * i)
        logs.append(copy_log(summary, tmp_path / f"resnet9-{i}.json", config=config))
    fig = figure_drawn(monkeypatch, lambda: plot_runs.main(logs + ["--out", str(tmp_path / "runs.png")]))
    fig.canvas.draw()
    ax, ax2 = fig.axes
    assert not overlap(ax.title, ax2.title)
    legends = fig.legends + [a.get_legend() for a in fig.axes if a.get_legend()]
    assert legends and not any(overlap(lg, a) for lg in legends for a in (ax, ax2))
    assert all(a.get_position().width * fig.get_figwidth() > 4 for a in (ax, ax2))  # inches
    fig = figure_drawn(monkeypatch, lambda: plot_runs.main(logs + ["--x", "flops", "--out", str(tmp_path / "f.png")]))
    fig.canvas.draw()
    assert not any(overlap(lg, fig.axes[0]) for lg in fig.legends + [fig.axes[0].get_legend()] if lg)
    other = json.loads(json.dumps(summary))
    other.update(preset="resnet9-tricks")
    other["config"].update(epochs=10, cutout=0)
    assert plot_runs.config_differences([summary, other]) == ["", ""]


def test_help_describes_the_script_in_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        plot_runs.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert ("per epoch or against time, one line per run, with the target and each log's preset and seed in the"
            " legend. positional arguments") in help_text


def test_documented_reference_commands_plot_one_preset():
    """A --reference command in the docs compares one preset's runs with the curve it reproduces: its glob must
    not take another preset's logs too (logs/resnet9-*.json also matches resnet9-tricks's)."""
    import glob
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        docs = f.read() + plot_runs.__doc__
    commands = re.findall(r"python plot_runs\.py ([^`\n]*--reference[^`\n]*)", docs)
    assert commands
    for command in commands:
        patterns = [w for w in command.split() if w.endswith(".json")]
        presets = {core.read_run_log(p)["preset"] for w in patterns for p in glob.glob(os.path.join(REPO, w))}
        assert len(presets) == 1, (command, presets)


def test_distinguishing_keys_are_few_and_tell_every_two_recipes_apart():
    """Not every key on which any two recipes differ (labels of ~17 keys), yet enough for each pair, also where
    an older log lacks a key (differing_keys skips it, so those two differ only in another)."""
    base = dict(preset="fast94", lr=1.0, epochs=10, world_size=1, widths=(64, 256, 256))
    recipes = [dict(base), dict(base, lr=2.0, world_size=2), dict(base, epochs=8, world_size=2),
               {k: v for k, v in dict(base, epochs=8, widths=(64, 192, 256)).items() if k != "lr"}]
    keys = plot_runs.distinguishing_keys(recipes)
    assert len(keys) <= 3 and "preset" not in keys
    for a, b in itertools.combinations(recipes, 2):
        assert any(k in a and k in b and a[k] != b[k] for k in keys), (a, b)


def test_a_log_given_twice_is_drawn_and_pooled_once(logged, tmp_path, capsys):
    """Overlapping globs name a log twice: its runs were drawn twice and pooled twice into its recipe's point
    (n=4 from 2 runs). One file, however spelt, is read once, and the summary says so."""
    summary = core.read_run_log(logged[0])
    spelt_otherwise = os.path.join(os.path.dirname(logged[0]), ".", os.path.basename(logged[0]))
    out = tmp_path / "runs.png"
    assert plot_runs.main([logged[0], spelt_otherwise, "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"counted once: {logged[0]} (given twice)", f"2 runs -> {out}"]
    assert plot_runs.main([logged[0], logged[0], "--x", "flops", "--out", str(out)]) == 0
    mean, std = core.mean_std([100 * r["accuracy"] for r in summary["runs"]])
    assert f"resnet9: {mean:.2f} ± {std:.2f}% (n=2) at " in capsys.readouterr().out


def test_out_is_the_file_written(logged, tmp_path, capsys):
    """--out a folder, or a name without an extension, printed "1 runs -> NAME" where matplotlib had written
    NAME.png (or failed): a folder is refused, a bare name gets the .png matplotlib gives it, and the summary
    names the file that exists."""
    summary = core.read_run_log(logged[0])
    single = copy_log(summary, tmp_path / "single.json", runs=summary["runs"][:1])
    (tmp_path / "folder").mkdir()
    for out in (tmp_path / "folder", str(tmp_path / "folder") + os.sep):
        assert plot_runs.main([single, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "is a folder" in err and err.count("\n") == 1
    assert os.listdir(tmp_path / "folder") == []
    for given, written in (("bare", "bare.png"), ("dotted.", "dotted.png"), ("plot.svg", "plot.svg")):
        assert plot_runs.main([single, "--out", str(tmp_path / given)]) == 0
        assert capsys.readouterr().out == f"1 run -> {tmp_path / written}\n" and (tmp_path / written).is_file()
    assert not (tmp_path / "bare").exists()
    assert plot_runs.main([single, "--out", str(tmp_path / "plot.txt")]) == 2
    err = capsys.readouterr().err
    assert "cannot write .txt images" in err and err.count("\n") == 1 and not (tmp_path / "plot.txt").exists()
    assert plot_runs.main([single, "--x", "flops", "--out", str(tmp_path / "f.png")]) == 0
    assert capsys.readouterr().out.endswith(f"1 recipe -> {tmp_path / 'f.png'}\n")


def test_small_runs_show_their_flops_in_gf(logged, tmp_path, capsys, monkeypatch):
    """73.4 GF a run was printed, and its axis ticked, as "0.000 PF"."""
    summary = core.read_run_log(logged[0])
    small = copy_log(summary, tmp_path / "small.json", train_flops_per_run=73.4e9)
    fig = figure_drawn(monkeypatch, lambda: plot_runs.main([small, "--x", "flops", "--out", str(tmp_path / "f.png")]))
    out = capsys.readouterr().out
    assert "(n=2) at 73.4 GF; " in out and "PF" not in out
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert "100 GF" in ticks and "1.00 TF" in ticks and "1.000 PF" in ticks and "0.000 PF" not in ticks


@pytest.mark.parametrize("field, value, message", [
    ("accuracy", 95, "run 0's accuracy is 95, not a fraction in [0, 1]"),
    ("accuracy", math.nan, "run 0's accuracy is NaN"),
    ("seed", "zero", "run 0's seed is \"zero\", not a whole number"),
    ("total_time_s", -5, "run 0's total_time_s is -5"),
])
def test_impossible_values_in_a_log_exit_2_naming_the_file_and_field(logged, tmp_path, capsys, field, value,
                                                                      message):
    summary = core.read_run_log(logged[0])
    edited = json.loads(json.dumps(summary))
    edited["runs"][0][field] = value
    path = copy_log(edited, tmp_path / "edited.json")
    for x in ("epoch", "flops"):
        assert plot_runs.main([path, "--x", x, "--out", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert f"error: {path}: {message}" in err and err.count("\n") == 1 and not (tmp_path / "x.png").exists()
    edited["runs"][0] = dict(summary["runs"][0], epochs=[dict(summary["runs"][0]["epochs"][-1], test_acc=2.0)])
    path = copy_log(edited, tmp_path / "edited.json")
    assert plot_runs.main([path, "--out", str(tmp_path / "x.png")]) == 2
    assert "run 0's epoch 3 test_acc is 2.0, not a fraction in [0, 1]" in capsys.readouterr().err


def test_recipe_points_leave_out_runs_that_did_not_finish(logged):
    """A run cut short by --stop-after-epochs has an accuracy (its last evaluation) but is no finished run of the
    recipe: as in compare_runs.py, its point's n, mean and std are over the finished runs alone."""
    summary = core.read_run_log(logged[0])
    cut = json.loads(json.dumps(summary))
    cut["config"].update(seed=2, runs=2)
    cut["runs"] = [dict(summary["runs"][0], seed=2, accuracy=0.2, stopped_after_epoch=1),
                   dict(summary["runs"][0], seed=3, accuracy=0.3)]
    (point,) = plot_runs.recipe_points([summary, cut])
    accs = [100 * r["accuracy"] for r in summary["runs"]] + [30.0]
    assert point["n"] == 3 and point["mean"] == pytest.approx(statistics.mean(accs))
    assert point["std"] == pytest.approx(statistics.stdev(accs))


def test_each_panel_draws_its_own_series(logged, tmp_path, monkeypatch):
    """Accuracy panel: each run's evaluated test accuracies (%); loss panel: its training losses, epoch by epoch,
    as the log's rows have them."""
    summary = core.read_run_log(logged[0])
    fig = figure_drawn(monkeypatch, lambda: plot_runs.plot([summary], str(tmp_path / "runs.png")))
    acc_lines, loss_lines = ([line for line in a.get_lines() if line.get_label().startswith("resnet9 seed")]
                             for a in fig.axes[:2])  # (not the target's line)
    assert len(acc_lines) == len(loss_lines) == len(summary["runs"])
    for run, acc, loss in zip(summary["runs"], acc_lines, loss_lines):
        rows = run["epochs"]
        evaluated = [r for r in rows if not math.isnan(r["test_acc"])]
        assert list(acc.get_xdata()) == [r["epoch"] for r in evaluated]
        assert list(acc.get_ydata()) == pytest.approx([100 * r["test_acc"] for r in evaluated])
        assert list(loss.get_xdata()) == [r["epoch"] for r in rows]
        assert list(loss.get_ydata()) == pytest.approx([r["train_loss"] for r in rows])


def test_legends_tell_a_log_from_before_an_option_from_runs_that_used_it(logged):
    """The legend names --color-jitter for an older log (which ran without it) beside a jittered one: the key an
    older log lacks was skipped, so both were labelled alike."""
    summary = core.read_run_log(logged[0])
    older = json.loads(json.dumps(summary))
    del older["config"]["color_jitter"]
    jittered = json.loads(json.dumps(summary))
    jittered["config"]["color_jitter"] = [0.14, 0.13]
    assert plot_runs.config_differences([older, jittered]) == ["color_jitter=[0, 0]", "color_jitter=[0.14, 0.13]"]
    assert [p["tag"] for p in plot_runs.recipe_points([older, jittered])] == [
        "color_jitter=[0, 0]", "color_jitter=[0.14, 0.13]"]


def test_legends_name_the_loss_scale_only_between_fp16_runs(logged):
    """A log from before --loss-scale ran GradScaler in fp16 (core.PREDATED_VALUES: dynamic), and nothing in bf16
    or fp32, where the "batch" of later logs does nothing either: no difference to label there."""
    summary = core.read_run_log(logged[0])
    older = json.loads(json.dumps(summary))
    del older["config"]["loss_scale"]
    newer = json.loads(json.dumps(summary))
    newer["config"]["loss_scale"] = "batch"
    for precision in ("fp32", "bf16"):
        for s in (older, newer):
            s["precision"] = precision
        assert plot_runs.config_differences([older, newer]) == ["", ""]
    for s in (older, newer):
        s["precision"] = "fp16"
    assert plot_runs.config_differences([older, newer]) == ['loss_scale="dynamic"', 'loss_scale="batch"']


def test_a_log_without_flops_per_run_is_placed_at_its_steps_flops(logged):
    """A log from before train_flops_per_run was logged: its point's FLOPs are its FLOPs per step x its steps."""
    summary = core.read_run_log(logged[0])
    older = json.loads(json.dumps(summary))
    del older["train_flops_per_run"]
    older.update(train_flops_per_step=3e12, train_steps=7)
    (point,) = plot_runs.recipe_points([older])
    assert point["pf"] == pytest.approx(3e12 * 7 / 1e15)


def test_the_accuracy_axis_shows_the_target_above_every_run(logged, tmp_path, monkeypatch):
    """Runs all above 95% and a 94% target: the axis must reach down to the target's line (1 point below it),
    not start above it where the line would not be seen."""
    summary = json.loads(open(logged[0]).read())
    summary["config"]["target"] = 0.94
    for run in summary["runs"]:
        run["accuracy"] = 0.97
        for row in run["epochs"]:
            row["test_acc"] = 0.96
    path = copy_log(summary, tmp_path / "high.json")
    fig = figure_drawn(monkeypatch, lambda: plot_runs.main([path, "--out", str(tmp_path / "x.png")]))
    assert target_lines(fig) == pytest.approx([94.0])
    assert fig.axes[0].get_ylim() == pytest.approx((94 - 1, 100))


def test_a_runs_label_gives_its_final_accuracy_in_percent(logged):
    summary = core.read_run_log(logged[0])
    edited = json.loads(json.dumps(summary))
    edited["runs"][0]["accuracy"] = 0.4567
    label = plot_runs.curves(edited)[0][0]
    assert label == "resnet9 seed 0: 45.67%"


def test_distinguishing_keys_take_the_key_that_tells_most_recipes_apart_first():
    """z alone tells the three recipes apart; a and b (first in alphabetical order) each tell only two pairs
    apart and are needed together: the greedy choice is z alone."""
    recipes = [dict(preset="fast94", a=0, b=0, z=0), dict(preset="fast94", a=1, b=0, z=1),
               dict(preset="fast94", a=0, b=1, z=2)]
    assert plot_runs.distinguishing_keys(recipes) == ["z"]


def test_runs_of_one_configuration_share_a_colour_and_differ_in_line_style(logged, tmp_path, monkeypatch):
    """Two configurations (epochs 3 and 4), the first in two logs (a rerun of other seeds), and another preset's
    log (no settings in its labels): every run of a configuration has its colour, another configuration another
    colour; a log's runs differ in line style."""
    from matplotlib.colors import to_hex
    summary = core.read_run_log(logged[0])
    rerun = json.loads(json.dumps(summary))
    rerun["config"].update(seed=2)
    rerun["runs"] = [dict(run, seed=2 + i) for i, run in enumerate(summary["runs"])]
    longer = json.loads(json.dumps(summary))
    longer["config"]["epochs"] = 4
    tricks = dict(json.loads(json.dumps(summary)), preset="resnet9-tricks")
    logs = [copy_log(s, tmp_path / f"log-{i}.json") for i, s in enumerate([summary, rerun, longer, tricks])]
    fig = figure_drawn(monkeypatch, lambda: plot_runs.main(logs + ["--out", str(tmp_path / "runs.png")]))
    for ax in fig.axes[:2]:
        looks = {start: [(to_hex(line.get_color()), line.get_linestyle()) for line in ax.get_lines()
                         if line.get_label().startswith(start)]
                 for start in ("resnet9 [epochs=3] ", "resnet9 [epochs=4] ", "resnet9-tricks seed ")}
        assert [len(look) for look in looks.values()] == [4, 2, 2]
        colours = [{c for c, _ in look} for look in looks.values()]
        assert [len(c) for c in colours] == [1, 1, 1] and len(set.union(*colours)) == 3
        three, four, other = looks.values()
        for log_runs in (three[:2], three[2:], four, other):
            assert len({ls for _, ls in log_runs}) == 2
