"""The per-conv benchmark finds every conv of a preset's net with the shapes and gradients a run has."""
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import torch_backend as tb
import train_cifar
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_convs  # noqa: E402

CPU = torch.device("cpu")


def test_bench_convs_sees_fast94s_convs_as_a_run_does():
    cfg = train_cifar.make_config("fast94", precision="fp32")
    layers = bench_convs.conv_layers(train_cifar.build_model(cfg, CPU), CPU)
    # the whitening conv on the data, then per block a conv before the pool and one after it (32 -> 31 -> 15 -> 7 -> 3)
    w1, w2, w3 = cfg["widths"]
    assert [(name, shape) for name, _, shape, _ in layers] == [
        ("whiten", (3, 32, 32)), ("blocks.0", (24, 31, 31)), ("blocks.4", (w1, 15, 15)), ("blocks.7", (w1, 15, 15)),
        ("blocks.11", (w2, 7, 7)), ("blocks.14", (w2, 7, 7)), ("blocks.18", (w3, 3, 3))]
    assert [need_dgrad for *_, need_dgrad in layers] == [False] + [True] * 6  # the data needs no gradient
    # fast94's first epochs train on 24 px images (progressive resizing): 24 -> 23 -> 11 -> 5 -> 2
    small = bench_convs.conv_layers(train_cifar.build_model(cfg, CPU), CPU, image_size=24)
    assert [shape[1] for _, _, shape, _ in small] == [24, 23, 11, 11, 5, 5, 2]

    _, last, shape, need_dgrad = layers[-1]
    flops, seconds = bench_convs.measure_conv(last, shape, need_dgrad, 3, torch.float32, CPU, 1)
    assert flops == 2 * 3 * (3 * 3 * w3) * (9 * w3)  # 2 x outputs (batch x positions x channels) x taps
    assert all(s is not None and s[0] > 0 for s in seconds.values())
    _, whiten, shape, need_dgrad = layers[0]  # frozen weights, data input: only the forward is timed
    seconds = bench_convs.measure_conv(whiten, shape, need_dgrad, 2, torch.float32, CPU, 1)[1]
    assert seconds["fwd"] is not None and seconds["dgrad"] is None and seconds["wgrad"] is None


def test_bench_convs_times_the_matmul_where_small_map_conv_applies():
    cfg = train_cifar.make_config("fast94", precision="fp32", widths=(8, 16, 16))
    layers = bench_convs.conv_layers(train_cifar.build_model(cfg, CPU), CPU)
    _, last, shape, need_dgrad = layers[-1]
    seconds = bench_convs.measure_conv(last, shape, need_dgrad, 2, torch.bfloat16, CPU, 1, matmul=True)[1]
    assert all(s is not None and s[0] > 0 for s in seconds.values())
    _, whiten, shape, need_dgrad = layers[0]  # a biased 2x2 conv: SmallMapConv does not apply
    assert not whiten.matmul_applies()
    assert bench_convs.measure_conv(whiten, shape, need_dgrad, 2, torch.bfloat16, CPU, 1, matmul=True)[1] == dict(
        fwd=None, dgrad=None, wgrad=None)


def test_bench_convs_totals_are_what_cpu_conv_matmul_and_the_tuning_pick(tmp_path, monkeypatch, capsys):
    """The `*` and the total "as --cpu-conv matmul picks them" follow the fixed rule on any CPU (a Zen 4's log
    once gave oneDNN's there); "as run" is what auto's tuning would pick by the same timings."""
    monkeypatch.setattr(sys, "argv", ["bench_convs.py", "--preset", "fast94", "--batch-size", "2", "--repeats", "1",
                                      "--device", "cpu", "--log-dir", str(tmp_path)])
    bench_convs.main()
    out = capsys.readouterr().out
    log = json.load(open(next(tmp_path.iterdir())))
    assert log["precision"] == "bf16"
    takes = {r["conv"]: r["matmul_mode_takes_matmul"] for r in log["results"]}
    assert takes["blocks.18"] == dict(fwd=True, dgrad=True, wgrad=True)  # 3x3: all three by matmul
    assert takes["blocks.14"] == dict(fwd=False, dgrad=False, wgrad=True)  # 7x7: the wgrad
    assert takes["blocks.4"] == dict(fwd=False, dgrad=False, wgrad=False)  # 15x15: oneDNN's
    assert sum(log["seconds_per_step_matmul_mode"].values()) != sum(log["seconds_per_step"].values())
    assert log["cpu_conv_auto"] == "tuned"
    for r in log["results"]:  # tuned: the matmul within its range (8x8 and smaller) where clearly faster
        small = r["input_shape"][1] * r["input_shape"][2] <= tb.WGRAD_MATMUL_MAX_PIXELS and r["conv"] != "whiten"
        assert r["run_takes_matmul"] == {p: small and r["matmul_seconds"][p] is not None and r["seconds"][p] is not None
                                         and r["matmul_seconds"][p][0] < tb.TUNE_MARGIN * r["seconds"][p][0]
                                         for p in ("fwd", "dgrad", "wgrad")}
    for part in ("fwd", "dgrad", "wgrad"):  # each total adds, conv by conv, the kernel its mode runs (or none)
        ran = [(r["matmul_seconds"] if r["matmul_mode_takes_matmul"][part] else r["seconds"])[part]
               for r in log["results"]]
        assert log["seconds_per_step_matmul_mode"][part] == pytest.approx(sum(t[0] for t in ran if t))
        assert log["seconds_per_step"][part] == pytest.approx(sum(r["seconds"][part][0] for r in log["results"]
                                                                  if r["seconds"][part]))
        tuned = [(r["matmul_seconds"] if r["run_takes_matmul"][part] else r["seconds"])[part] for r in log["results"]]
        assert log["seconds_per_step_as_run"][part] == pytest.approx(sum(t[0] for t in tuned if t))
    rows = {cells[0]: cells for cells in map(str.split, out.splitlines()) if cells and cells[0] in takes}
    for r in log["results"]:  # the table's TF/s (to 4 decimals): the conv's FLOPs over each part's logged seconds
        for column, part in ((4, "fwd"), (7, "dgrad"), (10, "wgrad")):
            cell, seconds = rows[r["conv"]][column], r["seconds"][part]
            assert cell == "-" if seconds is None else float(cell) == pytest.approx(r["flops"] / seconds[0] / 1e12,
                                                                                    abs=1e-4)
    assert out.count("*") >= 4  # the matmul picks marked in the table
    assert "as --cpu-conv auto (tuned, the default) would pick them" in out


@pytest.mark.parametrize("matmul", [False, True])
def test_each_timed_part_computes_what_it_is_named(monkeypatch, matmul):
    """A time says nothing of what was timed: each part's result (here kept by a stand-in for the timer) must be
    autograd's forward, input gradient and weight gradient of the conv, on the random input and output gradient
    measure_conv draws (x, then the output's gradient like it, channels-last, from the seed set here)."""
    cfg = train_cifar.make_config("fast94", precision="fp32", widths=(8, 16, 16), cpu_conv="matmul")
    _, conv, shape, need_dgrad = bench_convs.conv_layers(train_cifar.build_model(cfg, CPU), CPU)[-1]
    kept = []

    def keep(step, *args, **kwargs):
        kept.append(step(0))
        return 1.0, 0.0
    monkeypatch.setattr(bench_convs, "time_steps", keep)
    torch.manual_seed(0)
    bench_convs.measure_conv(conv, shape, need_dgrad, 2, torch.float32, CPU, 1, matmul=matmul)
    torch.manual_seed(0)
    x = torch.randn(2, *shape).to(memory_format=torch.channels_last).requires_grad_()  # a run's layout
    w = conv.weight.detach().clone().requires_grad_()
    y = F.conv2d(x, w, stride=conv.stride, padding=conv.padding)
    gy = torch.randn_like(y)
    y.backward(gy)
    fwd, dgrad, wgrad = kept
    if not matmul:  # aten.convolution_backward gives (input grad, weight grad, bias grad), None where not asked
        assert dgrad[1] is None and wgrad[0] is None
        dgrad, wgrad = dgrad[0], wgrad[1]
    for got, want in ((fwd, y), (dgrad, x.grad), (wgrad, w.grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
