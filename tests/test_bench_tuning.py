"""benchmarks/bench_tuning.py: the shapes a run tunes, and its count of how often each pass took the matmul."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_tuning  # noqa: E402
import torch_backend as tb  # noqa: E402


@pytest.fixture
def no_tuned_kernels():
    tb.forget_tuned_kernels()
    yield
    tb.forget_tuned_kernels()


def test_fast94_tunes_its_small_map_convs_at_every_image_size_it_trains_at():
    # the maps after the second and third poolings: 7 and 3 px at 32 px, 5 and 2 at 24, 4 and 2 at 20
    assert bench_tuning.preset_shapes("fast94") == [(2000, 256, s, s, 256, 3) for s in (2, 3, 4, 5, 7)]


def test_the_summary_counts_the_tunings_that_took_the_matmul(tmp_path, monkeypatch, capsys, no_tuned_kernels):
    key = (4, 8, 3, 3, 8, 3)
    monkeypatch.setattr(bench_tuning, "preset_shapes", lambda preset: [key])
    draws = iter([0.5, 0.95, 1.5, 0.8, 0.95, 1.5, 1.2, 0.95, 1.5])  # the matmul's seconds, oneDNN's always 1 s
    monkeypatch.setattr(tb, "time_conv_pass", lambda fns, repeats: [1.0, next(draws)])
    bench_tuning.main(["--times", "3", "--log-dir", str(tmp_path)])
    (log,) = tmp_path.iterdir()
    summary = {r["conv_pass"]: r for r in json.loads(log.read_text())["summary"]}
    assert {p: r["matmul_won"] for p, r in summary.items()} == dict(fwd=2, dgrad=0, wgrad=0)
    assert summary["fwd"]["matmul_ms"] == 800.0 and summary["fwd"]["onednn_ms"] == 1000.0  # medians
    assert "tuning 3: " in capsys.readouterr().out
    assert tb.tuned_kernel_flags() == {key: (False, False, False)}  # the last tuning's (1.2 s: oneDNN)
