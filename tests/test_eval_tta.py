"""benchmarks/eval_tta.py evaluates a finished run's net as the run did, and each TTA mode as predict does."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import core
import torch_backend as tb
import train_cifar
from conftest import ROOT, synthetic

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import eval_tta  # noqa: E402

CPU = torch.device("cpu")
TINY = dict(widths=(8, 16, 16), batch_size=50, epochs=2, precision="fp32", train_sizes=(), log_dir=None,
            log=lambda *a: None, device="cpu")


@pytest.mark.parametrize("preset", ["fast94", "resnet9-tricks"])  # resnet9-tricks evaluates its EMA weights
def test_eval_tta_reproduces_the_runs_own_accuracy_and_each_mode(tmp_path, preset):
    data = synthetic(200, 100)
    npz, ckpt = tmp_path / "tiny.npz", tmp_path / "run.pt"
    np.savez(npz, **data)
    kw = dict(TINY, widths=(8, 8, 8, 8), batch_size=64) if preset == "resnet9-tricks" else TINY
    summary = train_cifar.train(preset, data=data, checkpoint=str(ckpt), **kw)
    logs = tmp_path / "logs"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "eval_tta.py"), str(ckpt), "--data", str(npz),
                        "--confidences", "0.3", "1", "--repeats", "1", "--log-dir", str(logs)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = {row["mode"]: row for row in json.load(open(next(logs.iterdir())))["results"]}
    assert list(rows) == [name for name, *_ in eval_tta.modes([0.3, 1.0])]
    cfg, precision, model, seed, logged, _ = eval_tta.load_trained(str(ckpt), CPU)
    assert seed == 0 and logged == summary["runs"][0]["accuracy"]
    on_device = tb.to_device(data, CPU, torch.float32, pad=cfg["pad"])
    own = {0: "plain", 1: "mirror", 2: "6 views"}[cfg["tta"]]
    assert rows[own]["accuracy"] == logged
    plain = tb.predict(model, on_device["test_x"], precision, CPU)
    want = (plain.argmax(1) == on_device["test_y"]).float().mean().item()
    assert rows["plain"]["accuracy"] == pytest.approx(want)
    top = plain.softmax(1).amax(1)
    assert rows["6v if p<0.3"]["tta_share"] == pytest.approx((top < 0.3).float().mean().item())
    assert rows["6v if p<1"]["accuracy"] == rows["6 views"]["accuracy"]
    assert [rows[mode]["tta_share"] for mode in ("plain", "mirror", "6 views")] == [0.0, 1.0, 1.0]  # of the images
    table = [line.split() for line in r.stdout.splitlines() if line.split()[:2] == ["0", "plain"]]
    assert table and table[0][-1] == "-"  # one timing per mode has no spread ("0.0000" read as measured)


def test_eval_tta_checks_the_runs_own_accuracy_before_timing_and_says_why_it_differs(tmp_path):
    """On other data it timed every mode first (about 50 s on CIFAR-10), then said only that the accuracies
    differ; the checkpoint's data fingerprint tells other data from another net."""
    data = synthetic(200, 100)
    npz, ckpt = tmp_path / "tiny.npz", tmp_path / "run.pt"
    np.savez(npz, **data)
    train_cifar.train("fast94", data=data, checkpoint=str(ckpt), **TINY)
    cfg, precision, model, _, logged = eval_tta.load_trained(str(ckpt), CPU)[:5]
    state = torch.load(ckpt, weights_only=False)
    assert state["data"] is not None and logged < 0.8
    x = tb.to_device(data, CPU, torch.float32, pad=cfg["pad"])["test_x"]
    labels = tb.predict(model, x, precision, CPU, tta=cfg["tta"], tta_confidence=cfg["tta_confidence"]).argmax(1)
    labels[:10] = torch.arange(10)  # every class present; at least 90% right there
    np.savez(tmp_path / "other.npz", **dict(data, test_y=labels.numpy()))
    state["result"]["accuracy"] = (logged + 0.5) % 1  # as if another net had been logged
    torch.save(state, tmp_path / "other-net.pt")
    del state["data"]  # a checkpoint from before the fingerprint was saved
    torch.save(state, tmp_path / "old.pt")
    for run, npz_used, why in [("other-net.pt", "tiny.npz", "the test set is the run's, so the net differs"),
                               ("old.pt", "tiny.npz", "other data than its run's (pass the --data it ran on), or ")]:
        r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "eval_tta.py"), str(run), "--data",
                            npz_used, "--confidences", "0.5", "--repeats", "1", "--log-dir", ""],
                           capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert r.returncode != 0 and "plain" not in r.stdout, "a mode was timed before the check"
        assert f"{run}: 6 views " in r.stderr and " but its run logged " in r.stderr and why in r.stderr
    # other data, known by the fingerprint: a usage error before anything is evaluated (it was, then exit 1)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "eval_tta.py"), str(ckpt), "--data",
                        "other.npz", "--repeats", "1", "--log-dir", ""],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 2 and "plain" not in r.stdout and "but its run logged" not in r.stderr
    assert f"eval_tta.py: error: {ckpt}: this test set is not the one its run evaluated: pass the --data" in r.stderr


def test_eval_tta_evaluates_a_net_as_its_run_did_in_its_eval_precision(tmp_path):
    """A bf16 run evaluated in fp32 (--eval-precision fp32): its net is checked and scored in fp32 on fp32 test
    images (as its own fingerprint holds them), unless --precision asks for another; a checkpoint saved under one
    eval precision does not continue under the other."""
    data = synthetic(200, 100)
    npz, ckpt = tmp_path / "tiny.npz", tmp_path / "run.pt"
    np.savez(npz, **data)
    train_cifar.train("fast94", data=data, checkpoint=str(ckpt), **dict(TINY, precision="bf16", eval_precision="fp32"))
    assert eval_tta.load_trained(str(ckpt), CPU)[1] == "fp32"
    for asked, scored in ((None, "fp32"), ("bf16", "bf16")):
        logs = tmp_path / f"logs-{asked}"
        r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "eval_tta.py"), str(ckpt), "--data",
                            str(npz), "--confidences", "0.7", "--repeats", "1", "--log-dir", str(logs)]
                           + (["--precision", asked] if asked else []), capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        rows = json.load(open(next(logs.iterdir())))["results"]
        assert {row["precision"] for row in rows} == {scored}
        assert [row["mode"] for row in rows if "against_own" in row] == ([] if asked is None else ["6v if p<0.7"])
    # in bf16, the run's own evaluation image by image against fp32's: the images each gets right and not the other
    cfg, _, model, *_ = eval_tta.load_trained(str(ckpt), CPU)
    right = {p: (tb.predict(model, tb.to_device(data, CPU, tb.DTYPES[p])["test_x"], p, CPU, tta=2, tta_confidence=0.7)
                 .argmax(1) == torch.from_numpy(data["test_y"])) for p in ("bf16", "fp32")}
    want = dict(precision="fp32", right_only_here=int((right["bf16"] & ~right["fp32"]).sum()),
                right_only_there=int((right["fp32"] & ~right["bf16"]).sum()))
    assert rows[-1]["against_own"] == want
    state = torch.load(ckpt, weights_only=False)
    why = train_cifar.checkpoint_mismatch(state, dict(state["cfg"], eval_precision="same"), 0, "bf16")
    assert "differs in eval_precision" in why


def test_eval_tta_refuses_a_net_logged_better_or_worse_than_it_evaluates():
    """The check is of the distance from the logged accuracy: a net whose run logged more than it gives here is as
    much another net as one whose run logged less. Within 0.1 points (kernels rounding a few images of 10000
    otherwise) it is the run's net; 0.2 points off (20 images) it is not."""
    cfg = train_cifar.make_config("fast94", widths=(8, 16, 16), precision="fp32")
    torch.manual_seed(0)
    model = train_cifar.build_model(cfg, CPU)
    data = tb.to_device(synthetic(20, 100), CPU, torch.float32, pad=cfg["pad"])
    labels = tb.predict(model, data["test_x"], "fp32", CPU, tta=cfg["tta"], tta_confidence=cfg["tta_confidence"])
    labels = labels.argmax(1)
    accuracy = (labels == data["test_y"]).float().mean().item()  # its own TTA, image by image
    for logged in (accuracy, accuracy - 0.0005, accuracy + 0.0005):  # no exit
        eval_tta.check_own_accuracy("run.pt", cfg, model, data, "fp32", CPU, logged, None)
    for logged in (accuracy - 0.05, accuracy + 0.05, accuracy - 0.002, accuracy + 0.002):
        with pytest.raises(SystemExit, match=re.escape(f"run.pt: 6 views if p<0.7 gives {accuracy:.4f} but its run "
                                                       f"logged {logged:.4f}")):
            eval_tta.check_own_accuracy("run.pt", cfg, model, data, "fp32", CPU, logged, None)


def test_eval_tta_refuses_an_unfinished_run(tmp_path):
    data = synthetic(200, 100)
    ckpt = tmp_path / "run.pt"
    train_cifar.train("fast94", data=data, checkpoint=str(ckpt), stop_after_epochs=1, **TINY)
    with pytest.raises(ValueError, match="has not finished"):
        eval_tta.load_trained(str(ckpt), CPU)


def test_eval_tta_view_sets_average_each_set_as_predict_would(tmp_path):
    """--view-sets forms each set's average from logits computed once per view; every set's accuracy must be the
    one from averaging the net over tb.shifted_views directly."""
    data = synthetic(200, 100)
    npz, ckpt = tmp_path / "tiny.npz", tmp_path / "run.pt"
    np.savez(npz, **data)
    train_cifar.train("fast94", data=data, checkpoint=str(ckpt), **TINY)
    logs = tmp_path / "logs"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "eval_tta.py"), str(ckpt), str(ckpt),
                        "--data", str(npz), "--confidences", "0.5", "--repeats", "1", "--view-sets",
                        "--log-dir", str(logs)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    results = json.load(open(next(logs.iterdir())))["results"]
    sets = [row for row in results if row.get("view_set")]
    assert [row["mode"] for row in sets] == 2 * list(eval_tta.VIEW_SETS)
    assert "per net against 6v" in r.stdout
    cfg, precision, model, *_ = eval_tta.load_trained(str(ckpt), CPU)
    on_device = tb.to_device(data, CPU, torch.float32, pad=cfg["pad"])
    x, y = on_device["test_x"], on_device["test_y"]
    model.eval()
    for row in sets[:len(eval_tta.VIEW_SETS)]:
        shifts, centre = eval_tta.VIEW_SETS[row["mode"]]
        with torch.no_grad():
            logits = sum(w * model(v) for v, w in tb.shifted_views(x, shifts, centre))
        assert row["views"] == 2 + 2 * len(shifts)
        assert row["accuracy"] == pytest.approx((logits.argmax(1) == y).float().mean().item())
    six = next(row for row in results if row["mode"] == "6 views")
    assert sets[0]["mode"] == "6v" and sets[0]["accuracy"] == pytest.approx(six["accuracy"])


def test_a_view_sets_seconds_are_the_sum_of_its_views_forward_passes(monkeypatch):
    """On a fake clock that moves 1 s at each synchronisation (so a view's timed pass, between two, takes 1 s), a set
    of n views costs n s, however many sets share those views."""
    import types
    clock = [0.0]

    def sync():
        clock[0] += 1.0
    monkeypatch.setattr(eval_tta, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    model = train_cifar.build_model(train_cifar.make_config("fast94", widths=(8, 8, 8), precision="fp32"), CPU)
    x = torch.randn(4, 3, 32, 32)
    sets = eval_tta.view_set_accuracies(model, x, torch.arange(4), "fp32", CPU, sync)
    assert {name: seconds for name, (_, seconds) in sets.items()} == {
        "6v": 6.0, "6v equal": 6.0, "10v diag": 10.0, "10v diag eq": 10.0, "10v axis": 10.0, "10v diag 2px": 10.0,
        "18v": 18.0, "18v equal": 18.0, "26v +2px": 26.0}


def test_eval_tta_checks_every_checkpoint_before_timing_any(tmp_path):
    """A bad checkpoint (unfinished, or another net than its run's) after good ones was found only when reached,
    after minutes of timing the others on a CPU: now every net is read and checked first, and nothing is timed."""
    data = synthetic(200, 100)
    npz, done, unfinished = tmp_path / "tiny.npz", tmp_path / "done.pt", tmp_path / "unfinished.pt"
    np.savez(npz, **data)
    train_cifar.train("fast94", data=data, checkpoint=str(done), **TINY)
    train_cifar.train("fast94", data=data, checkpoint=str(unfinished), stop_after_epochs=1, **TINY)
    state = torch.load(done, weights_only=False)
    state["result"]["accuracy"] = (state["result"]["accuracy"] + 0.5) % 1  # as if another net had been logged
    torch.save(state, tmp_path / "other-net.pt")
    logs = tmp_path / "logs"
    for bad, code, why in [(unfinished, 2, "has not finished"), (tmp_path / "other-net.pt", 1, "but its run logged")]:
        r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "eval_tta.py"), str(done), str(bad),
                            "--data", str(npz), "--confidences", "0.5", "--repeats", "1", "--log-dir", str(logs)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == code and why in r.stderr and str(bad) in r.stderr, r.stderr
        assert "plain" not in r.stdout and not (logs.exists() and any(logs.iterdir()))  # nothing timed or logged
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "eval_tta.py"), str(done), "--data",
                        str(npz), "--confidences", "0.5", "--repeats", "1", "--log-dir", str(logs)],
                       capture_output=True, text=True, timeout=600)
    results = json.load(open(next(logs.iterdir())))["results"]
    assert r.returncode == 0 and [row["mode"] for row in results] == [m[0] for m in eval_tta.modes([0.5])]


def test_eval_tta_precision_checks_the_net_in_its_own_then_evaluates_in_the_one_asked(tmp_path, monkeypatch):
    """--precision fp32 on a net trained in bf16: its logged accuracy is checked in bf16 on bf16 test images (as
    its run evaluated), and every mode then runs in fp32 on fp32 images, each row saying so."""
    data = synthetic(200, 100)
    npz, ckpt = tmp_path / "tiny.npz", tmp_path / "run.pt"
    np.savez(npz, **data)
    train_cifar.train("fast94", data=data, checkpoint=str(ckpt), **dict(TINY, precision="bf16"))
    calls = []
    predict = tb.predict

    def spy(model, x, precision, *args, **kwargs):
        calls.append((precision, x.dtype))
        return predict(model, x, precision, *args, **kwargs)
    monkeypatch.setattr(tb, "predict", spy)
    logs = tmp_path / "logs"
    monkeypatch.setattr(sys, "argv", ["eval_tta.py", str(ckpt), "--data", str(npz), "--confidences", "0.5",
                                      "--repeats", "1", "--precision", "fp32", "--log-dir", str(logs)])
    eval_tta.main()
    assert calls[0] == ("bf16", torch.bfloat16)  # the check, as the run evaluated
    assert calls[1:] and set(calls[1:]) == {("fp32", torch.float32)}
    result = json.load(open(next(logs.iterdir())))
    assert result["precision"] == "fp32" and {row["precision"] for row in result["results"]} == {"fp32"}
    cfg, _, model, *_ = eval_tta.load_trained(str(ckpt), CPU)
    on_device = tb.to_device(data, CPU, torch.float32, pad=cfg["pad"])
    plain = tb.predict(model, on_device["test_x"], "fp32", CPU)
    rows = {row["mode"]: row for row in result["results"]}
    assert rows["plain"]["accuracy"] == pytest.approx((plain.argmax(1) == on_device["test_y"]).float().mean().item())
    monkeypatch.setattr(sys, "argv", ["eval_tta.py", str(ckpt), "--data", str(npz), "--precision", "fp16",
                                      "--device", "cpu"])
    with pytest.raises(SystemExit) as e:  # as train_cifar.py refuses it
        eval_tta.main()
    assert e.value.code == 2


def test_the_view_set_table_gives_each_sets_mean_and_standard_error_over_the_nets(tmp_path, monkeypatch, capsys):
    """Over 4 nets whose view sets are stubbed with fixed accuracies (the 6 views at 50% in each; set j of
    VIEW_SETS j x (1, 2, 0, 5) points above them), each set's line gives its mean accuracy and its mean difference
    from the 6 views ± their standard error, std / sqrt(4)."""
    import math
    import statistics
    np.savez(tmp_path / "tiny.npz", **synthetic(20, 20))
    cfg = train_cifar.make_config("fast94", widths=(8, 8, 8), precision="fp32")
    paths = [tmp_path / f"net{k}.pt" for k in range(4)]
    for path in paths:
        path.write_bytes(b"")
    points = {name: [j * d for d in (1, 2, 0, 5)] for j, name in enumerate(eval_tta.VIEW_SETS)}
    assert points["6v"] == [0, 0, 0, 0]
    per_net = iter([{name: (0.5 + p[k] / 100, 1.0) for name, p in points.items()} for k in range(4)])
    monkeypatch.setattr(eval_tta, "load_trained", lambda path, device: (
        cfg, "fp32", train_cifar.build_model(cfg, CPU), int(str(path)[-4]), 0.5, None))
    monkeypatch.setattr(eval_tta, "check_own_accuracy", lambda *a: None)
    monkeypatch.setattr(train_cifar, "right_per_image", lambda *a: torch.arange(20) % 2 == 0)  # 50%: every mode
    monkeypatch.setattr(eval_tta, "view_set_accuracies", lambda *a: next(per_net))
    monkeypatch.setattr(sys, "argv", ["eval_tta.py", *map(str, paths), "--data", str(tmp_path / "tiny.npz"),
                                      "--confidences", "0.5", "--repeats", "1", "--view-sets", "--device", "cpu",
                                      "--log-dir", ""])
    eval_tta.main()
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index("view set       views  mean acc  per net against 6v (mean ± s.e., points)") + 1:]
    assert len(table) == len(eval_tta.VIEW_SETS)
    for line, (name, p) in zip(table, points.items()):
        mean_acc = 50 + statistics.mean(p)
        se = statistics.stdev(p) / math.sqrt(len(p))
        assert line.startswith(f"{name:14s} ") and line.endswith(
            f"  {mean_acc:7.3f}%  {statistics.mean(p):+.3f} ± {se:.3f}"), (line, name)


def test_another_precision_counts_the_images_each_gets_right_per_net_and_over_all(tmp_path, monkeypatch, capsys):
    """Two nets whose runs evaluated in bf16, scored in fp32 with stubbed per-image results: for the run's own
    evaluation (6 views below p = 0.7) each net's row counts the images right only in fp32 and only in bf16, and
    the log sums them over the nets with their sign test."""
    np.savez(tmp_path / "tiny.npz", **synthetic(20, 20))
    cfg = train_cifar.make_config("fast94", widths=(8, 8, 8), precision="bf16")  # tta 2 below p = 0.7
    first = torch.arange(20)
    right = [dict(bf16=first < 10, fp32=(first >= 3) & (first < 15)),  # fp32 only: 10-14; bf16 only: 0-2
             dict(bf16=first % 2 == 0, fp32=((first % 2 == 0) & (first != 0)) | (first == 1))]  # 1 and 1
    paths = [tmp_path / f"net{k}.pt" for k in range(2)]
    for path in paths:
        path.write_bytes(b"")

    def load_trained(path, device):
        model = train_cifar.build_model(cfg, CPU)
        model.k = int(str(path)[-4])
        return cfg, "bf16", model, model.k, right[model.k]["bf16"].float().mean().item(), None
    monkeypatch.setattr(eval_tta, "load_trained", load_trained)
    monkeypatch.setattr(train_cifar, "right_per_image", lambda model, x, y, precision, *a: right[model.k][precision])
    logs = tmp_path / "logs"
    monkeypatch.setattr(sys, "argv", ["eval_tta.py", *map(str, paths), "--data", str(tmp_path / "tiny.npz"),
                                      "--confidences", "0.5", "0.7", "--repeats", "1", "--precision", "fp32",
                                      "--device", "cpu", "--log-dir", str(logs)])
    eval_tta.main()
    log = json.load(open(next(logs.iterdir())))
    counted = [(row["checkpoint"], row["mode"], row["against_own"]) for row in log["results"] if "against_own" in row]
    assert counted == [("net0.pt", "6v if p<0.7", dict(precision="bf16", right_only_here=5, right_only_there=3)),
                       ("net1.pt", "6v if p<0.7", dict(precision="bf16", right_only_here=1, right_only_there=1))]
    assert log["against_own"] == dict(nets=2, right_only_here=6, right_only_there=4, sign_test_p=core.sign_test(6, 4))
    out = capsys.readouterr().out
    assert "net0.pt, 6v if p<0.7 (its run's evaluation): test images right only in fp32: 5, only in bf16: 3" in out
    assert f"over the 2 nets: test images right only in fp32: 6, only in their runs' precision: 4 (sign test p = " \
           f"{core.sign_test(6, 4):.2g})" in out
