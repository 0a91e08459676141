"""benchmarks/bench_presets.py's timing of a preset's steps, on a tiny net."""
import os
import sys

import torch

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_presets  # noqa: E402


def test_breakdown_times_each_part_of_a_step_and_the_host():
    r = bench_presets.measure("fast94", torch.device("cpu"), steps=2, repeats=2, breakdown=True,
                              overrides=dict(widths=(8, 16, 16), batch_size=64, precision="fp32"))
    assert r["losses_finite"] and r["train_flops_per_run"] > 0
    parts = r["seconds_by_part"]
    assert set(parts) == {"batch", "forward_backward", "optimizer"} and all(m > 0 for m, _ in parts.values())
    # timings only, no comparison of them: on a shared machine they drift (the script prints, people judge)
    assert r["step_seconds_at_full_size"][0] > 0 and r["host_seconds_per_step"][0] > 0


def test_the_benchmarks_flops_are_the_runs(monkeypatch):
    """What the benchmark divides by its time is what a run counts: its FLOPs per run against count_only's (on
    the meta device) and a real run's logged count, with progressive resizing and data selection (a proxy)."""
    import train_cifar
    from conftest import synthetic
    monkeypatch.setattr(bench_presets, "N_TRAIN", 200)  # the run below trains on 200 images
    for preset, extra in (("fast94", dict(train_sizes=(24, 32))), ("fast96", dict(proxy_widths=(4, 8, 8)))):
        overrides = dict(widths=(8, 16, 16), batch_size=50, precision="fp32", epochs=2, **extra)
        timed = bench_presets.measure(preset, torch.device("cpu"), steps=1, repeats=1, overrides=overrides)
        counted = bench_presets.count_only(preset, overrides)
        run = train_cifar.train(preset, data=synthetic(200, 50), log=lambda *a: None, progress=False, tta=0,
                                **overrides)
        assert timed["train_flops_per_run"] == counted["train_flops_per_run"] == run["train_flops_per_run"] > 0
