import csv
import json
import math

import pytest

import plot_runs
import train_cifar
from conftest import synthetic


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """A real (tiny) logged invocation of two runs: its JSON summary and TSV table."""
    d = tmp_path_factory.mktemp("logs")
    s = train_cifar.train("resnet9", data=synthetic(200, 50), device="cpu", log=lambda *a: None, log_dir=str(d),
                          widths=(8, 16, 16, 16), batch_size=50, epochs=3, eval_every=2, runs=2, precision="fp32")
    return s["log_json"], s["log_json"][:-len(".json")] + ".tsv"


def test_curves_follow_the_logged_table(logged):
    summary = plot_runs.load_summary(logged[0])
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


@pytest.mark.parametrize("content, message", [
    ('{"preset": "fast94", "runs": [', "not valid JSON"),
    ('{"rows": []}', "not a train_cifar.py summary"),
    ('{"preset": "fast94", "runs": [], "config": {"target": 0.94}}', "none of the logs has a run"),
])
def test_bad_logs_exit_2_with_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert plot_runs.main([str(path), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "x.png").exists()
    assert plot_runs.main([str(tmp_path / "missing.json")]) == 2
