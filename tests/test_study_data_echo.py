"""study_data_echo.py: the run plan, resume from the JSONL log, the summary's statistics and bounds, and one tiny
end-to-end study on synthetic data run twice (the second run resumes and trains nothing)."""
import argparse
import json
import math
import os
import statistics
import types

import numpy as np
import pytest
import torch

import core
import study_data_echo as study
from conftest import figure_drawn, synthetic


def test_plan_runs_the_baseline_once_per_seed():
    runs = study.plan(["batch", "example-after-aug"], [1, 2, 4], [0, 1])
    per_seed = [("none", 1.0), ("batch", 2.0), ("batch", 4.0), ("example-after-aug", 2.0), ("example-after-aug", 4.0)]
    assert runs == [(m, f, seed) for seed in (0, 1) for m, f in per_seed]  # every run of seed 0, then of seed 1


def test_plan_keeps_every_factor_above_1_however_close():
    """Only factor 1 is the baseline: an echo factor of 1.25 (or 1.5) is a run of its own."""
    assert study.plan(["batch"], [1, 1.25, 1.5, 2], [0]) == [("none", 1.0, 0), ("batch", 1.25, 0), ("batch", 1.5, 0),
                                                             ("batch", 2.0, 0)]


def test_results_survive_a_line_cut_short(tmp_path, capsys):
    path = str(tmp_path / "results.jsonl")
    rec = dict(workload="cpu", pipeline="device", mode="batch", factor=2.0, seed=0, reached=False)
    core.append_jsonl(path, rec)
    with open(path, "a") as f:
        f.write('{"workload": "cpu", "pipel')  # a crash in the middle of a write
    assert study.read_results(path) == [rec]
    assert "not a complete record" in capsys.readouterr().err


def test_a_run_recorded_twice_counts_once(tmp_path, capsys):
    """Two processes resuming one folder at once both ran (and appended) the runs left: each counted twice in
    the summary's n, means and std (study_batch_size.read_folder keeps the first)."""
    path = str(tmp_path / "results.jsonl")
    first = dict(rec("none", 1.0, 0, 1000, 10.0), workload="cpu", pipeline="device")
    other = dict(rec("none", 1.0, 1, 1200, 12.0), workload="cpu", pipeline="device")
    for r in (first, other, first, dict(first, fresh_to_target=900)):
        core.append_jsonl(path, r)
    assert study.read_results(path) == [first, other]
    assert "results.jsonl:4 is another record of a run already recorded" in capsys.readouterr().err
    row = study.summarise(study.read_results(path), None, False)[0]
    assert row["n"] == 2 and row["fresh_mean"] == 1100


def test_fresh_budget_stretches_everything_counted_in_epochs():
    out = study.stretch("fast94-sgd", dict(epochs=6, lr_knots=(0, 1, 6), lr_values=(0.3, 1.5, 0.1), warmup_epochs=1,
                                       whiten_bias_epochs=1, lookahead_start_epoch=1, block_epochs=(3, 0, 5)), 2)
    assert out["epochs"] == 12 and out["lr_knots"] == (0, 2, 12) and out["lr_values"] == (0.3, 1.5, 0.1)
    assert out["warmup_epochs"] == 2
    assert out["whiten_bias_epochs"] == 2 and out["lookahead_start_epoch"] == 2 and out["block_epochs"] == (6, 0, 10)
    assert study.stretch("fast94-sgd", dict(lookahead_start_epoch=-1), 3)["lookahead_start_epoch"] == -1


def echo_args(budget, **overrides):
    """The parsed options one_run and run_overrides read (a study's args, without parsing a command line)."""
    return argparse.Namespace(workload="cpu", pipeline="device", target=None, loader_workers=None, budget=budget,
                              echo_shuffle_buffer=0, settings={}, overrides=overrides)


def test_a_fresh_budget_stretches_every_echo_factor_but_1():
    """--budget fresh: factor e trains e times the workload's epochs (its LR knots and warm-up alike), factor 2
    included; the baseline (factor 1) and every run of --budget steps keep the workload's schedule."""
    w = study.WORKLOADS["cpu"]
    epochs, knots = w["overrides"]["epochs"], w["overrides"]["lr_knots"]
    for factor in (1.5, 2.0, 4.0):
        o = study.run_overrides(echo_args("fresh", warmup_epochs=1), w, "batch", factor)
        assert o["epochs"] == epochs * factor and o["lr_knots"] == tuple(k * factor for k in knots)
        assert o["warmup_epochs"] == factor  # 1 epoch of warm-up, stretched alike
    same = [study.run_overrides(echo_args("fresh", warmup_epochs=1), w, "none", 1.0),
            study.run_overrides(echo_args("steps", warmup_epochs=1), w, "batch", 2.0)]
    assert all((o["epochs"], o["lr_knots"], o["warmup_epochs"]) == (epochs, knots, 1) for o in same)


def test_only_a_loader_with_worker_processes_overlaps_upstream_with_training():
    """The overlapped bound min(e, R) needs upstream work in other processes: a loader without workers prepares
    each batch in the training process, as the device pipeline does (one after the other)."""
    assert study.overlapped(dict(pipeline="loader", loader_workers=2))
    assert not study.overlapped(dict(pipeline="loader", loader_workers=0))
    assert not study.overlapped(dict(pipeline="device", loader_workers=2))


def test_r_is_upstream_time_over_training_time_after_their_warm_ups(monkeypatch):
    """On a fake clock: the stream's first `warmup` batches (workers starting: 100 s each) and the first 2 steps
    (100 s each) stay out of the timing; then a batch costs 30 ms and a step 20 ms, so R = 30 / 20 = 1.5."""
    clock, batches, steps = [0.0], [], []

    class Stream:
        def __init__(self, data, cfg, gen, device):
            pass

        def next_batch(self):
            batches.append(("x", len(batches)))
            clock[0] += 100.0 if len(batches) <= 3 else 0.03
            return batches[-1]

    def train_step(cfg, model, opt, x, y, precision, device):
        steps.append((x, y))
        clock[0] += 100.0 if len(steps) <= 2 else 0.02
    monkeypatch.setattr(study, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(study.pipeline, "BatchStream", Stream)
    monkeypatch.setattr(study.train_cifar, "train_step", train_step)
    overrides = dict(widths=(8, 16, 16), batch_size=50, epochs=1, precision="fp32")
    r = study.measure_r("fast94-sgd", overrides, synthetic(n_train=200, n_test=50), torch.device("cpu"),
                        batches=4, warmup=3, log=lambda m: None)
    assert len(batches) == 3 + 4 and len(steps) == 2 + 4
    assert set(steps) == {batches[-1]}  # every step trains on the last timed batch, ready
    assert r["t_upstream_s"] == pytest.approx(0.03) and r["t_downstream_s"] == pytest.approx(0.02)
    assert r["R"] == pytest.approx(0.03 / 0.02)


def test_ideal_speedup_bounds():
    assert study.ideal_speedup(4, 0.5, overlap=True) == 1.0  # training-bound: nothing to gain
    assert study.ideal_speedup(2, 3.0, overlap=True) == 2.0  # min(e, R)
    assert study.ideal_speedup(4, 3.0, overlap=True) == 3.0
    assert study.ideal_speedup(2, 1.0, overlap=False) == pytest.approx(2 / 1.5)  # (R + 1) / (R / e + 1)


@pytest.mark.parametrize("overlap", [False, True])
def test_ideal_speedup_from_the_times_of_a_step(overlap):
    """From the times themselves: a step costs t_up + t_down one after the other (max of them overlapped), and an
    echo factor e divides the upstream part only. At R = 1 dividing the wrong part gives the same number: R != 1."""
    t_down = 0.02
    for t_up in (0.005, 0.03, 0.06, 0.2):
        for e in (1.5, 2.0, 4.0):
            step = (lambda up: max(up, t_down)) if overlap else (lambda up: up + t_down)
            assert study.ideal_speedup(e, t_up / t_down, overlap) == pytest.approx(step(t_up) / step(t_up / e))


def rec(mode, factor, seed, fresh, time_s, reached=True):
    return dict(mode=mode, factor=factor, seed=seed, reached=reached, fresh_to_target=fresh if reached else None,
                time_to_target_s=time_s if reached else None, steps_to_target=100 if reached else None)


def test_summary_statistics_and_speedups():
    records = [rec("none", 1.0, 0, 1000, 10.0), rec("none", 1.0, 1, 1200, 12.0),
               rec("batch", 2.0, 0, 600, 8.0), rec("batch", 2.0, 1, 500, 14.0),
               rec("batch", 2.0, 2, 0, 0, reached=False)]
    rows = {(r["mode"], r["factor"]): r for r in study.summarise(records, dict(R=3.0), overlap=True)}
    base, echo = rows[("none", 1.0)], rows[("batch", 2.0)]
    assert base["fresh_mean"] == 1100 and base["fresh_std"] == pytest.approx(math.sqrt(2e4))
    assert (echo["n"], echo["n_reached"], echo["fresh_mean"]) == (3, 2, 550)
    assert echo["fresh_speedup"] == pytest.approx(2.0) and echo["time_speedup"] == pytest.approx(1.0)
    assert echo["min_e_R"] == 2.0 and echo["ideal_time_speedup"] == 2.0
    no_r = study.summarise(records, None, overlap=True)
    assert all(math.isnan(r["min_e_R"]) for r in no_r)


def test_time_speedup_is_the_baseline_mean_time_over_the_echo_mean_time():
    """Wall-clock speed-up: baseline mean time / echo mean time (10 s against 5 s is 2x), independent of the
    fresh-examples speed-up (here 1.25x)."""
    records = [rec("none", 1.0, 0, 1000, 9.0), rec("none", 1.0, 1, 1000, 11.0),
               rec("batch", 2.0, 0, 800, 4.0), rec("batch", 2.0, 1, 800, 6.0)]
    rows = {(r["mode"], r["factor"]): r for r in study.summarise(records, None, overlap=False)}
    assert rows[("batch", 2.0)]["time_speedup"] == pytest.approx(10.0 / 5.0)
    assert rows[("batch", 2.0)]["fresh_speedup"] == pytest.approx(1000 / 800)
    assert rows[("none", 1.0)]["time_speedup"] == pytest.approx(1.0)


def test_a_target_met_in_the_last_partial_epoch_counts_the_run_steps(monkeypatch):
    """With fractional epochs (2.5 of 4 steps: 10 steps) the last epoch, numbered 3, stops at step 10: a target met
    only at its end is at step 10, not 3 * 4 = 12, more than the run trained."""
    run = dict(epoch_reached_target=3, step_reached_target=None, fresh_to_target=500, time_to_target_s=1.0,
               accuracy=0.9, total_time_s=1.0, evals=[],
               epochs=[dict(fresh=200, test_acc=0.5), dict(fresh=400, test_acc=0.7), dict(fresh=500, test_acc=0.9)])
    monkeypatch.setattr(study.train_cifar, "train", lambda *a, **k: dict(runs=[run], hardware="stub",
                                                                          precision="fp32", commit="stub"))
    args = argparse.Namespace(workload="cpu", pipeline="device", target=None, loader_workers=None, budget="steps",
                              echo_shuffle_buffer=0, settings={}, overrides=dict(batch_size=50, epochs=2.5))
    data = dict(train_y=np.zeros(200, np.int64))
    r = study.one_run(args, study.WORKLOADS["cpu"], data, "cpu", "none", 1.0, 0, lambda *a: None)
    total = math.ceil(2.5 * (200 // 50))
    assert r["reached"] and r["steps_to_target"] == total == 10
    assert r["epochs_to_target"] == pytest.approx(2.5) and r["examples_to_target"] == total * 50
    assert r["epochs_run"] == len(run["epochs"]) == 3 and r["final_fresh"] == 500  # every epoch row, the last's


def test_fresh_examples_to_target_are_those_read_when_the_target_was_met(monkeypatch):
    """Batch echo 2, target met at a step-interval evaluation (step 6 of 8): 6 steps of 50 are 300 examples, 150 of
    them fresh, though the run's last epoch row had read 200 fresh by its end."""
    run = dict(epoch_reached_target=None, step_reached_target=6, fresh_to_target=150, time_to_target_s=1.0,
               accuracy=0.9, total_time_s=2.0, evals=[dict(step=6, fresh=150, test_acc=0.9)],
               epochs=[dict(fresh=100, test_acc=0.5), dict(fresh=200, test_acc=0.95)])
    monkeypatch.setattr(study.train_cifar, "train", lambda *a, **k: dict(runs=[run], hardware="stub",
                                                                          precision="fp32", commit="stub"))
    args = argparse.Namespace(workload="cpu", pipeline="device", target=None, loader_workers=None, budget="steps",
                              echo_shuffle_buffer=0, settings={}, overrides=dict(batch_size=50, epochs=2))
    r = study.one_run(args, study.WORKLOADS["cpu"], dict(train_y=np.zeros(200, np.int64)), "cpu", "batch", 2.0, 0,
                      lambda *a: None)
    assert r["reached"] and r["steps_to_target"] == 6 and r["examples_to_target"] == 6 * 50
    assert r["fresh_to_target"] == 6 * 50 / 2 and r["epochs_to_target"] == pytest.approx(6 / (200 / 50))


def test_tiny_study_writes_everything_and_resumes(tmp_path, capsys):
    data = str(tmp_path / "tiny.npz")
    np.savez(data, **synthetic(n_train=200, n_test=50))
    out = tmp_path / "out"
    argv = ["--data", data, "--out", str(out), "--seeds", "1", "--factors", "1", "2", "--modes", "batch",
            "--target", "0.01", "--r-batches", "2", "--set", "batch_size=50", "--set", "epochs=1",
            "--set", "widths=(8,16,16)", "--set", "eval_every_steps=2", "--set", "precision=fp32"]
    study.main(argv)
    first = capsys.readouterr().out
    assert "[2/2]" in first and "ETA" in first and "R = " in first
    lines = (out / "results.jsonl").read_text().splitlines()
    assert [json.loads(l)["mode"] for l in lines] == ["none", "batch"]
    runs = [json.loads(l) for l in lines]
    assert all(r["reached"] and r["steps_to_target"] == 2 for r in runs)  # the first step-interval evaluation
    assert [r["fresh_to_target"] for r in runs] == [100, 50]  # 2 steps of 50; batch echo 2 read one batch
    summary = json.loads((out / "summary.json").read_text())
    assert summary["r"]["R"] > 0 and len(summary["rows"]) == 2
    assert (out / "summary.tsv").exists() and (out / "echo_study.png").stat().st_size > 0
    study.main(argv)  # resumes: nothing left to train, R read back
    second = capsys.readouterr().out
    assert "2 run(s) already" in second and "0 to go" in second and "[1/" not in second
    assert len((out / "results.jsonl").read_text().splitlines()) == 2
    with pytest.raises(SystemExit) as e:  # other settings in the same folder are refused
        study.main(argv[:-1] + ["precision=auto"])
    assert e.value.code == 2


@pytest.mark.parametrize("args, message", [
    (["--target", "2"], "target must be in (0, 1], got 2.0"),
    (["--factors", "2", "inf"], "echo-factor must be finite, got inf"),
    (["--set", "epochs=inf"], "epochs takes a number, got 'inf'"),
    (["--train-subset", "-10"], "--train-subset must be >= 0 (0: all)"),  # trained on all but 10 images
    (["--train-subset", "60000"], "--train-subset 60000 exceeds CIFAR-10's 50000 training images"),  # all 50000
    (["--r-batches", "0"], "--r-batches >= 1"),  # divided by zero
    # (the study's workload trains with SGD: its results would be labelled with a setting that did nothing)
    (["--set", "muon_lr_scale=2"], "--set muon_lr_scale= has no effect without --optimizer muon"),
])
def test_options_that_would_fail_a_run_are_usage_errors_before_any_run(tmp_path, capsys, args, message):
    """Every planned run's options pass train_cifar's checks before data or output are touched (a target of 2
    or an infinite factor failed with a traceback inside a run, after the baselines had trained)."""
    with pytest.raises(SystemExit) as e:
        study.main(args + ["--data", "/nonexistent.npz", "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["--set", "seed=3"], "--set seed: the study sets this itself for every run (see --seed0)"),
    (["--set", "runs=2", "--set", "stop_at_target=False"], "--set runs, stop_at_target: the study sets these itself "
                                                           "for every run (see --seeds)"),
    (["--set", "pipeline=loader"], "--set pipeline: the study sets this itself for every run (see --pipeline)"),
    (["--set", "echo=batch", "--set", "echo_factor=3"], "--set echo, echo_factor: the study sets these itself for "
                                                        "every run (see --factors, --modes)"),
    (["--set", "target=0.5", "--target", "0.6"], "--set target= and --target both given; give it once"),
    (["--set", "loader_workers=1", "--loader-workers", "2", "--pipeline", "loader"],
     "--set loader_workers= and --loader-workers both given"),
    (["--loader-workers", "2"], "--loader-workers has no effect without --pipeline loader"),  # (ran, ignoring it)
])
def test_options_the_study_sets_itself_are_usage_errors(tmp_path, capsys, args, message):
    """--set seed=3 failed every run with a TypeError (train() got seed twice) after R was measured; --set echo
    was silently replaced by --modes, --set target= by --target."""
    with pytest.raises(SystemExit) as e:
        study.main(args + ["--data", "/nonexistent.npz", "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    ([], "batch size 512 exceeds the 200 training images"),
    (["--set", "batch_size=50", "--train-subset", "40"], "batch size 50 exceeds the 40 training images"),
    (["--set", "batch_size=50", "--set", "holdout=160"],
     "batch size 50 exceeds the 40 training images left by holdout 160"),
    (["--set", "batch_size=50", "--set", "bn_group_size=16"], "batch 50 is not divisible into BN groups of 16"),
    (["--set", "batch_size=50", "--set", "precision=fp16"], "fp16 is for CUDA GPUs"),
    # trained on all 200 while settings.train_subset said 300
    (["--set", "batch_size=50", "--train-subset", "300"], "--train-subset 300 exceeds the 200 training images in"),
])
def test_runs_train_would_refuse_are_errors_before_r_is_measured(tmp_path, capsys, args, message):
    """What train() checks with the data in hand, checked before R is measured (that was measured, r.json
    written, and then the first run failed with a traceback)."""
    data = str(tmp_path / "tiny.npz")
    np.savez(data, **synthetic(n_train=200, n_test=50))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        study.main(["--data", data, "--out", str(out), "--device", "cpu", "--seeds", "1", "--factors", "1", "2",
                    "--modes", "batch", "--r-batches", "2", "--set", "widths=(8,8,8)", "--set", "epochs=1", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert os.listdir(out) == []


def test_the_header_describes_the_effective_config_not_the_workloads_defaults(tmp_path, capsys):
    """--target and --set change what runs: the header said "widths 32/64/64, batch 512, 6 epochs, 80%" for a
    2-epoch run at widths 8/16/16 to 15%."""
    with pytest.raises(SystemExit):  # the header comes before the data, which is missing
        study.main(["--target", "0.15", "--set", "epochs=2", "--set", "widths=(8,16,16)", "--set", "precision=fp32",
                    "--data", "/nonexistent.npz", "--out", str(tmp_path / "out")])
    header = capsys.readouterr().out
    assert ("(fast94-sgd at widths 8/16/16, batch 512, 2 epochs, 15% without TTA, evaluated every 24 steps, "
            "precision=fp32)") in header
    assert "32/64/64" not in header and "80%" not in header


def test_a_folder_of_other_settings_is_refused_naming_what_differs(tmp_path, capsys):
    """The refusal named no key: it dumped the stored settings (~20 keys) for the user to compare by eye."""
    out = str(tmp_path / "out")
    argv = ["--data", "/nonexistent.npz", "--out", out, "--set", "epochs=2"]
    _, stored = study.parse_args(argv + ["--target", "0.8", "--set", "precision=fp32"])
    os.makedirs(out)
    core.append_jsonl(os.path.join(out, "results.jsonl"), dict(rec("none", 1.0, 0, 100, 1.0), workload="cpu",
                                                                 pipeline="device", settings=stored.settings))
    with pytest.raises(SystemExit) as e:
        study.main(argv + ["--target", "0.15"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert "other settings (overrides.precision fp32 there, unset here; target 0.8 there, 0.15 here)" in err
    assert "workload" not in err



def tiny_echo(tmp_path, name="tiny.npz", seed=0):
    data = str(tmp_path / name)
    np.savez(data, **synthetic(n_train=200, n_test=50, seed=seed))
    return ["--data", data, "--out", str(tmp_path / "out"), "--seeds", "1", "--factors", "1", "2", "--modes",
            "batch", "--target", "0.01", "--r-batches", "2", "--set", "batch_size=50", "--set", "epochs=1",
            "--set", "widths=(8,16,16)", "--set", "eval_every_steps=2", "--set", "precision=fp32"]


def test_a_resume_on_other_data_is_refused_and_r_is_not_reused(tmp_path, capsys, monkeypatch):
    """Neither the settings nor r.json knew the data: a subset's folder resumed on other data and kept its R."""
    argv = tiny_echo(tmp_path)
    study.main(argv)
    out = tmp_path / "out"
    assert all("data" in json.loads(l)["settings"] for l in (out / "results.jsonl").read_text().splitlines())
    other = tiny_echo(tmp_path, "other.npz", seed=1)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        study.main(other)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "other settings (data.test_x" in err
    (out / "results.jsonl").unlink()  # no runs left to refuse: r.json alone must not lend its R to other data
    measured = []
    monkeypatch.setattr(study, "measure_r", lambda *a, **k: measured.append(1) or dict(R=2.0))
    study.main(other[:other.index("--seeds")] + ["--seeds", "1", "--factors", "1", "--modes", "batch"]
               + other[other.index("--target"):])
    assert measured == [1] and "holds R of other data" in capsys.readouterr().out


def test_an_interrupt_while_r_is_measured_exits_130_with_a_message(tmp_path, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(study, "measure_r", interrupted)
    with pytest.raises(SystemExit) as e:
        study.main(tiny_echo(tmp_path))
    assert e.value.code == 130 and "interrupted while measuring R" in capsys.readouterr().out
    assert not (tmp_path / "out" / "r.json").exists()


@pytest.mark.parametrize("where", ["load_cifar10", "encode_pngs"])
def test_an_interrupt_while_the_data_load_exits_130_with_one_line(tmp_path, capsys, monkeypatch, where):
    """Ctrl-C while the data were loaded (seconds for the full set) or PNG-encoded (the loader pipeline's 50000
    images: seconds more) was a traceback: only the runs and the R measurement caught it."""
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(study.tb if where == "load_cifar10" else study.pipeline, where, interrupted)
    with pytest.raises(SystemExit) as e:
        study.main(tiny_echo(tmp_path) + ["--no-r", "--pipeline", "loader"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 130 and err.endswith("interrupted; finished runs are kept, run the same command to resume")
    assert err.count("\n") == 0


def test_no_r_with_remeasure_r_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        study.main(["--no-r", "--remeasure-r", "--data", "/nonexistent.npz", "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "--no-r and --remeasure-r" in capsys.readouterr().err


def test_an_interrupt_before_any_run_ends_names_no_unwritten_results_file(tmp_path, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(study, "one_run", interrupted)
    with pytest.raises(SystemExit) as e:
        study.main(tiny_echo(tmp_path) + ["--no-r"])
    wrote = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wrote")]
    assert e.value.code == 130 and wrote and "results.jsonl" not in wrote[0]


def stub_run(args, workload, data, device, mode, factor, seed, log):
    """A finished run record without training (what main reads back and summarises)."""
    return dict(workload=args.workload, pipeline=args.pipeline, mode=mode, factor=factor, seed=seed, target=0.01,
                reached=True, diverged=False, fresh_to_target=100, steps_to_target=2, epochs_to_target=1.0,
                time_to_target_s=1.0, accuracy=0.5, wall_s=0.0, settings=args.settings, finished="stub")


def run_keys(out):
    """(mode, factor, seed) of every line of results.jsonl; every line must parse."""
    return [(r["mode"], r["factor"], r["seed"]) for r in map(json.loads, (out / "results.jsonl").read_text()
                                                             .splitlines())]


@pytest.mark.parametrize("torn", [True, False])
def test_a_resume_after_a_torn_or_unterminated_last_line_leaves_every_run_once(tmp_path, capsys, monkeypatch, torn):
    """A crash mid-write leaves a torn last line: the resume appended onto it, making one unreadable line, and every
    later resume trained that run again. A complete last line without its newline was glued to the next alike."""
    monkeypatch.setattr(study, "one_run", stub_run)
    argv = tiny_echo(tmp_path) + ["--no-r"]
    study.main(argv)
    out = tmp_path / "out"
    first, last = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text(first + "\n" + (last[:40] if torn else last))  # no newline: a crash
    more = argv[:argv.index("--factors")] + ["--factors", "1", "2", "4"] + argv[argv.index("--modes"):]
    study.main(more)
    expected = [("none", 1.0, 0), ("batch", 2.0, 0), ("batch", 4.0, 0)]
    assert sorted(run_keys(out)) == sorted(expected)
    capsys.readouterr()
    study.main(more)  # nothing left: the repaired file holds every run, each once
    assert "3 run(s) already" in capsys.readouterr().out and sorted(run_keys(out)) == sorted(expected)


def test_repeated_factors_and_modes_train_and_count_each_run_once(tmp_path, capsys, monkeypatch):
    """--factors 1 2 2 --modes batch batch trained (batch, 2, seed 0) four times and reported n=4 of one run."""
    monkeypatch.setattr(study, "one_run", stub_run)
    argv = tiny_echo(tmp_path) + ["--no-r"]
    argv[argv.index("--factors"):argv.index("--target")] = ["--factors", "1", "2", "2", "--modes", "batch", "batch"]
    study.main(argv)
    captured = capsys.readouterr()
    assert run_keys(tmp_path / "out") == [("none", 1.0, 0), ("batch", 2.0, 0)]
    assert "note: --modes batch given more than once" in captured.err and "--factors 2 given" in captured.err
    rows = json.loads((tmp_path / "out" / "summary.json").read_text())["rows"]
    assert [(r["mode"], r["n"]) for r in rows] == [("none", 1), ("batch", 1)]


@pytest.mark.parametrize("name, edit, message", [
    ("r.json", lambda text: "garbage", "r.json is not an R measurement of this study (not JSON"),
    ("r.json", lambda text: "[1, 2]", "r.json is not an R measurement of this study ([1, 2] is not a JSON object)"),
    ("r.json", lambda text: json.dumps(dict(json.loads(text), R="fast")), '"R" is "fast", not a number'),
    ("results.jsonl", lambda text: text.replace(', "seed": 0', "", 1), 'results.jsonl:1 is not a run record of '
                                                                        'this study (no "seed")'),
    ("results.jsonl", lambda text: text.replace('"fresh_to_target": 100', '"fresh_to_target": "abc"', 1),
     'results.jsonl:1 is not a run record of this study ("fresh_to_target" is "abc", not a number >= 0)'),
    ("results.jsonl", lambda text: text + "[1, 2]\n", "results.jsonl:3 is not a run record of this study ([1, 2] is"),
    # an .npz in its place: one line (not a warning per "line") and the file left uncut
    ("results.jsonl", lambda text: "PK\x03\x04\x00\x00\n" * 50 + "\x00\xff", "results.jsonl holds binary data, not JSON"),
])
def test_edited_files_are_a_one_line_error_naming_file_and_line(tmp_path, capsys, monkeypatch, name, edit, message):
    """A garbled r.json (JSONDecodeError), a record without "seed" (KeyError), "fresh_to_target": "abc" (ValueError in
    core) or a JSON list (AttributeError) failed the resume with a traceback."""
    monkeypatch.setattr(study, "one_run", stub_run)
    monkeypatch.setattr(study, "measure_r", lambda *a, **k: dict(R=0.5))
    argv = tiny_echo(tmp_path)
    study.main(argv)
    path = tmp_path / "out" / name
    path.write_text(edit(path.read_text()))
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        study.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and message in err
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before  # nothing lost or rewritten


def test_a_cell_where_no_run_reached_the_target_shows_dashes_not_nan():
    """No run of batch e=2 reached the target: its mean and spread read "nan ± nan", its speed-up "nan"."""
    records = [rec("none", 1.0, 0, 1000, 10.0), rec("none", 1.0, 1, 1200, 12.0),
               rec("batch", 2.0, 0, 0, 0, reached=False), rec("batch", 2.0, 1, 0, 0, reached=False)]
    lines = []
    study.print_summary(study.summarise(records, None, overlap=False), None, log=lines.append)
    batch = next(line for line in lines if line.split()[0] == "batch").split()
    assert batch == ["batch", "2", "0/2", "-", "-", "-", "-", "-", "-"]
    none = next(line for line in lines if line.split()[0] == "none").split()
    assert none[3:9] == ["1100", "±", "141", "11.0", "±", "1.4"] and none[-2:] == ["-", "-"]  # no R measured


def test_a_cell_with_one_run_reached_shows_no_spread():
    """One reached run (of two) has no spread: "± 0" would read as measured; its mean is that run's."""
    records = [rec("none", 1.0, 0, 1000, 10.0), rec("none", 1.0, 1, 1200, 12.0),
               rec("batch", 2.0, 0, 600, 8.0), rec("batch", 2.0, 1, 0, 0, reached=False)]
    lines = []
    study.print_summary(study.summarise(records, None, overlap=False), None, log=lines.append)
    batch = next(line for line in lines if line.split()[0] == "batch")
    assert "±" not in batch and "nan" not in batch
    assert batch.split()[:5] == ["batch", "2", "1/2", "600", "8.0"]


def test_a_resume_does_not_train_again_a_run_that_missed_the_target(tmp_path, capsys, monkeypatch):
    """A run that missed the target (or diverged) is a finished run of the study: training it again on resume would
    add a second run of its seed to the cell, and its n_reached would count it twice."""
    def missed(args, workload, data, device, mode, factor, seed, log):
        trained.append((mode, factor, seed))
        rec = stub_run(args, workload, data, device, mode, factor, seed, log)
        if mode != "none":
            rec.update(reached=False, fresh_to_target=None, steps_to_target=None, time_to_target_s=None)
        return rec
    trained = []
    monkeypatch.setattr(study, "one_run", missed)
    argv = tiny_echo(tmp_path) + ["--no-r"]
    study.main(argv)
    assert trained == [("none", 1.0, 0), ("batch", 2.0, 0)]
    capsys.readouterr()
    study.main(argv)
    assert trained == [("none", 1.0, 0), ("batch", 2.0, 0)] and "0 to go" in capsys.readouterr().out
    rows = json.loads((tmp_path / "out" / "summary.json").read_text())["rows"]
    assert [(r["mode"], r["n"], r["n_reached"]) for r in rows] == [("none", 1, 1), ("batch", 1, 0)]


def plotted_axes(tmp_path, monkeypatch, records, r):
    """The two axes study.plot draws for these records and R, read off the figure it closes."""
    summary = study.summarise(records, dict(R=r), overlap=True)
    return figure_drawn(monkeypatch, lambda: study.plot(str(tmp_path), summary, "title")).axes


def test_the_plot_draws_each_series_where_it_belongs(tmp_path, monkeypatch):
    """Fresh examples: the baseline mean over e (echoed worth fresh) and flat (worth nothing), each mode's means
    from the baseline on; wall-clock: each mode's baseline time / its time. Means by the statistics module."""
    records = [rec("none", 1.0, 0, 1000, 10.0), rec("none", 1.0, 1, 1200, 12.0), rec("batch", 2.0, 0, 600, 8.0),
               rec("batch", 2.0, 1, 700, 6.0), rec("batch", 4.0, 0, 500, 10.0)]
    ax, ax2 = plotted_axes(tmp_path, monkeypatch, records, 3.0)
    lines = {line.get_label(): line for line in ax.get_lines()}
    base, base_time = statistics.mean([1000, 1200]), statistics.mean([10.0, 12.0])
    worth = lines["echoed data worth as much as fresh"]
    assert list(worth.get_ydata()) == pytest.approx([base / e for e in worth.get_xdata()])
    assert set(lines["echoed data worth nothing"].get_ydata()) == {base}
    (batch,) = [c for c in ax.containers if c.get_label() == "batch"]
    assert list(batch.lines[0].get_xdata()) == [1, 2, 4]
    assert list(batch.lines[0].get_ydata()) == pytest.approx([base, statistics.mean([600, 700]), 500])
    speedup = {line.get_label(): line for line in ax2.get_lines()}["batch"]
    assert list(speedup.get_ydata()) == pytest.approx([1, base_time / statistics.mean([8.0, 6.0]), base_time / 10])


def test_the_fresh_examples_error_bars_span_one_std_of_fresh_examples(tmp_path, monkeypatch):
    """Each point's bar is mean ± the std of its fresh examples to target (the steps to target here all equal,
    so a bar of their std would have no length)."""
    records = [rec("none", 1.0, 0, 1000, 10.0), rec("none", 1.0, 1, 1200, 12.0), rec("batch", 2.0, 0, 600, 8.0),
               rec("batch", 2.0, 1, 700, 6.0), rec("batch", 2.0, 2, 900, 6.0)]
    ax, _ = plotted_axes(tmp_path, monkeypatch, records, 3.0)
    (batch,) = [c for c in ax.containers if c.get_label() == "batch"]
    bars = sorted((x0, y0, y1) for coll in batch.lines[2] for (x0, y0), (_, y1) in coll.get_segments())
    expected = []
    for e, fresh in ((1, [1000, 1200]), (2, [600, 700, 900])):
        m, sd = statistics.mean(fresh), statistics.stdev(fresh)
        expected.append((e, m - sd, m + sd))
    assert bars == pytest.approx(expected)


@pytest.mark.parametrize("r", [3.0, 0.5])
def test_the_wall_clock_reference_is_min_e_r_but_never_below_1(tmp_path, monkeypatch, r):
    """Echoing never slows the pipeline down: the reference is max(1, min(e, R)), flat at 1 when training is
    the bottleneck (R < 1)."""
    records = [rec("none", 1.0, 0, 1000, 10.0), rec("batch", 2.0, 0, 600, 8.0), rec("batch", 4.0, 0, 500, 6.0)]
    _, ax2 = plotted_axes(tmp_path, monkeypatch, records, r)
    (ref,) = [line for line in ax2.get_lines() if line.get_label() == "max(1, min(e, R))"]
    assert list(ref.get_xdata()) == [1, 2, 4]
    assert list(ref.get_ydata()) == pytest.approx([max(1.0, min(e, r)) for e in (1, 2, 4)])
