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
