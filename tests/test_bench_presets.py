"""benchmarks/bench_presets.py's timing of a preset's steps, on a tiny net."""
import os
import statistics
import sys
import types

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_presets  # noqa: E402


def test_breakdown_times_each_part_of_a_step_and_the_host(monkeypatch):
    """Each part's timer runs that part and only it (a time says nothing of what was timed): counted by calls
    of the augmentation (the batch), of forward_backward and of the optimizer's step within each timing."""
    import train_cifar
    counts = dict(batch=0, forward_backward=0, optimizer=0)
    real_augment, real_fb, real_make_optimizer = bench_presets.tb.augment, train_cifar.forward_backward, \
        train_cifar.make_optimizer

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    def make_optimizer(*args, **kwargs):
        opt = real_make_optimizer(*args, **kwargs)
        opt.step = counting("optimizer", opt.step)
        return opt
    monkeypatch.setattr(bench_presets.tb, "augment", counting("batch", real_augment))
    monkeypatch.setattr(train_cifar, "forward_backward", counting("forward_backward", real_fb))
    monkeypatch.setattr(train_cifar, "make_optimizer", make_optimizer)
    timed, real_time_steps = [], bench_presets.time_steps

    def time_steps(*args, **kwargs):
        before = dict(counts)
        result = real_time_steps(*args, **kwargs)
        timed.append({k: counts[k] - before[k] for k in counts})
        return result
    monkeypatch.setattr(bench_presets, "time_steps", time_steps)
    r = bench_presets.measure("fast94", torch.device("cpu"), steps=2, repeats=2, breakdown=True,
                              overrides=dict(widths=(8, 16, 16), batch_size=64, precision="fp32"))
    calls = 2 + 2 * 2  # warm-up and timed calls of each part
    assert timed[-3:] == [dict(batch=calls, forward_backward=0, optimizer=0),
                          dict(batch=0, forward_backward=calls, optimizer=0),
                          dict(batch=0, forward_backward=0, optimizer=calls)]
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


def test_time_steps_times_each_repeats_own_steps_after_the_warm_up(monkeypatch):
    """On a fake device whose queued work runs only when synchronised, and a fake clock: the warm-up (100 s a
    call, as a compile) stays out of the timing, each repeat waits for its own steps, and a step's seconds are
    its repeat's over its steps (here the n-th timed call costs n s: repeats of 1+2+3 and 4+5+6 s)."""
    clock, queued, calls = [0.0], [0.0], []

    def step(i):
        calls.append(i)
        queued[0] += 100.0 if len(calls) <= 2 else float(len(calls) - 2)

    def sync():
        clock[0] += queued[0]
        queued[0] = 0.0
    monkeypatch.setattr(bench_presets, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    mean, std = bench_presets.time_steps(step, sync, steps=3, repeats=2, warm_up=2)
    assert calls == [0, 1] + [0, 1, 2] * 2
    assert (mean, std) == pytest.approx((3.5, statistics.stdev([6 / 3, 15 / 3])))


def test_matmul_peak_is_the_rate_of_the_matmuls_it_times(monkeypatch):
    """On a fake machine that does 1 TFLOP/s (its clock advances by the FLOPs PyTorch counts since the last
    synchronisation), the measured peak must be 1 TFLOP/s whatever number of matmuls a repeat times."""
    from torch.utils.flop_counter import FlopCounterMode
    counter, clock, done = FlopCounterMode(display=False), [0.0], [0]

    def sync():
        clock[0] += (counter.get_total_flops() - done[0]) / 1e12
        done[0] = counter.get_total_flops()
    monkeypatch.setattr(bench_presets, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(bench_presets.tb, "synchronizer", lambda device: sync)
    with counter:
        mean, std = bench_presets.matmul_peak(torch.device("cpu"), "fp32", size=64, repeats=2)
    assert counter.get_total_flops() > 0 and (mean, std) == pytest.approx((1.0, 0.0))


def test_rates_are_the_runs_trained_images_and_flops_over_its_time_at_each_size(monkeypatch):
    """img/s counts the images trained on, not the candidates data selection draws, and a run's time weights each
    image size by its steps. By hand: 400 images in 50 candidates a step are 8 steps an epoch; epoch 1 at 24 px,
    epochs 2-3 at 32 px: 8 steps at 24 and 16 at 32, training 24 x 25 = 600 images."""
    monkeypatch.setattr(bench_presets, "N_TRAIN", 400)
    overrides = dict(widths=(8, 16, 16), proxy_widths=(4, 8, 8), batch_size=25, precision="fp32", epochs=3,
                     train_sizes=(24, 32))
    r = bench_presets.measure("fast96", torch.device("cpu"), steps=1, repeats=2, overrides=overrides)
    assert r["candidates_per_step"] == 50 and r["losses_finite"]
    at = {int(side): mean_std for side, mean_std in r["seconds_per_step_by_size"].items()}
    seconds, spread = 8 * at[24][0] + 16 * at[32][0], 8 * at[24][1] + 16 * at[32][1]
    assert r["est_train_time_s"] == pytest.approx(seconds)
    assert r["img_per_s"][0] == pytest.approx(600 / seconds)
    assert r["tflop_per_s"][0] == pytest.approx(r["train_flops_per_run"] / seconds / 1e12)
    # first-order error propagation: a rate's relative spread is its time's
    assert r["img_per_s"][1] / r["img_per_s"][0] == pytest.approx(spread / seconds)
    assert r["tflop_per_s"][1] / r["tflop_per_s"][0] == pytest.approx(spread / seconds)


def spy_on_timed_kinds(monkeypatch, read):
    """A bench of 200 images (8 steps an epoch in batches of 25) that records read(net) as each kind of step is
    timed; returns the nets built (the first is the bench's) and what was read."""
    monkeypatch.setattr(bench_presets, "N_TRAIN", 200)
    built, seen = [], []
    build = bench_presets.train_cifar.build_model
    monkeypatch.setattr(bench_presets.train_cifar, "build_model",
                        lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    timing = bench_presets.time_steps

    def spy(step, *a, **k):
        seen.append(read(built[0]))
        return timing(step, *a, **k)
    monkeypatch.setattr(bench_presets, "time_steps", spy)
    return built, seen


def test_each_kind_of_step_is_timed_with_the_whitening_bias_as_the_run_has_it(monkeypatch):
    """fast94 freezes the whitening bias after whiten_bias_epochs; a frozen bias's step skips the first block's
    input gradient, so it is timed apart. By hand: 200 images in batches of 25 are 8 steps an epoch; epoch 1 at 32 px
    with the bias trained, epochs 2-3 at 24 px with it frozen (timed in the order 24 then 32, so the bias must be
    put back as the run ends)."""
    built, states = spy_on_timed_kinds(monkeypatch, lambda net: net.whiten.bias.requires_grad)
    overrides = dict(widths=(8, 16, 16), batch_size=25, precision="fp32", epochs=3, lr_knots=(0, 3),
                     train_sizes=(32, 24), whiten_bias_epochs=1)
    r = bench_presets.measure("fast94", torch.device("cpu"), steps=1, repeats=2, overrides=overrides)
    assert states == [False, True]  # 24 px frozen, then 32 px trained
    at = r["seconds_per_step_by_size"]
    assert set(at) == {"24 with the whitening bias frozen", "32 with the whitening bias trained"}
    assert r["est_train_time_s"] == pytest.approx(8 * at["32 with the whitening bias trained"][0]
                                                  + 16 * at["24 with the whitening bias frozen"][0])
    trained_32 = bench_presets.count_only("fast94", dict(overrides, train_sizes=(32,), epochs=1, lr_knots=(0, 1)))
    # the last step's count (24 px, frozen) x 16, and the 32 px steps' with the bias trained x 8
    assert r["train_flops_per_run"] == 16 * r["flops_per_step"] + 8 * trained_32["flops_per_step"]
    assert not built[0].whiten.bias.requires_grad  # put back as the run ends


def test_the_share_of_peak_is_the_achieved_rate_over_the_peaks_mean(monkeypatch, capsys, tmp_path):
    """The table's % peak column against the logged rates, with a stand-in peak of 1 MFLOP/s ± 0.5 (the
    tiny net's rate is thousands of times that)."""
    import json
    monkeypatch.setattr(bench_presets, "N_TRAIN", 64)
    monkeypatch.setattr(bench_presets, "matmul_peak", lambda device, precision: (1e-6, 5e-7))
    monkeypatch.setattr(sys, "argv", ["bench_presets.py", "--presets", "fast94", "--steps", "1", "--repeats", "1",
                                      "--device", "cpu", "--log-dir", str(tmp_path), "--set=widths=(8,8,8)",
                                      "--set=batch_size=64", "--set=precision=fp32", "--set=epochs=1"])
    bench_presets.main()
    (row,) = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["fast94"]]
    (r,) = json.load(open(next(tmp_path.iterdir())))["results"]
    assert row[6] == f"{100 * r['tflop_per_s'][0] / 1e-6:.0f}%"


def test_a_cpu_profile_logs_and_prints_a_full_size_steps_ops_by_their_own_time(monkeypatch, capsys, tmp_path):
    """--profile on a CPU: the ops of steps at the run's last size (a spy sees the side the profiled steps are fed),
    slowest first, the convolutions among them, each printed as logged."""
    import json
    monkeypatch.setattr(bench_presets, "N_TRAIN", 64)
    sides, resize = [], bench_presets.tb.resize_images
    monkeypatch.setattr(bench_presets.tb, "resize_images", lambda x, side: sides.append(side) or resize(x, side))
    monkeypatch.setattr(sys, "argv", ["bench_presets.py", "--presets", "fast94", "--steps", "2", "--repeats", "1",
                                      "--device", "cpu", "--log-dir", str(tmp_path), "--profile",
                                      "--set=widths=(8,8,8)", "--set=batch_size=32", "--set=precision=fp32",
                                      "--set=epochs=2", "--set=train_sizes=(20,24)"])
    bench_presets.main()
    out = capsys.readouterr().out
    (r,) = json.load(open(next(tmp_path.iterdir())))["results"]
    ops = r["cpu_op_seconds_per_step"]
    assert "aten::convolution_backward" in ops and "aten::mkldnn_convolution" in ops
    assert list(ops.values()) == sorted(ops.values(), reverse=True) and 0 < len(ops) <= 20
    for name, seconds in ops.items():
        assert f"{name:48s} {1e3 * seconds:9.1f} ms" in out
    assert sides[-2:] == [24, 24]  # the profiled steps: at the last size


def test_count_only_splits_a_step_by_the_runs_sizes_and_the_proxys_trainings(monkeypatch):
    """The net's FLOPs per step are those at the last image size (all of a step without data selection, which
    scores nothing), and the proxy trains at steps 0, proxy_every, ... at each step's size. By hand: 250 images in
    50 candidates a step are 5 steps an epoch, 10 in 2 epochs; the proxy trains at steps 0, 4 (24 px) and 8
    (32 px); a run at one size trains it 3 times, which gives each size's proxy training."""
    monkeypatch.setattr(bench_presets, "N_TRAIN", 250)
    tiny = dict(widths=(8, 16, 16), batch_size=25, epochs=2, train_sizes=(24, 32))
    plain = bench_presets.count_only("fast94", dict(tiny, batch_size=50))
    assert plain["scoring_flops_per_step"] == 0 and plain["net_flops_per_step"] == plain["flops_per_step"] > 0
    selecting = dict(tiny, proxy_widths=(4, 8, 8), proxy_every=4)
    both = bench_presets.count_only("fast96", selecting)
    one = {side: bench_presets.count_only("fast96", dict(selecting, train_sizes=(side,)))["proxy_train_flops"] / 3
           for side in (24, 32)}
    assert both["train_steps"] == 10 and both["proxy_train_flops"] == 2 * one[24] + one[32] and one[24] < one[32]


def test_the_flops_table_gives_scoring_as_a_share_of_the_nets_step(monkeypatch, capsys, tmp_path):
    """--flops-only's scoring column: the candidates' scoring over the net's own FLOPs per step, as logged."""
    import json
    monkeypatch.setattr(sys, "argv", ["bench_presets.py", "--flops-only", "--presets", "fast96", "--log-dir",
                                      str(tmp_path), "--set=widths=(8,16,16)", "--set=proxy_widths=(4,8,8)"])
    bench_presets.main()
    (row,) = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["fast96"]]
    (r,) = json.load(open(next(tmp_path.iterdir())))["results"]
    assert 0 < r["scoring_flops_per_step"] < r["net_flops_per_step"]
    assert row[4] == f"{100 * r['scoring_flops_per_step'] / r['net_flops_per_step']:.1f}%"


@pytest.mark.parametrize("select_by", ["proxy", "loss"])
def test_a_selecting_step_is_timed_as_its_run_selects(monkeypatch, select_by):
    """By loss history a run builds no proxy: of each step's candidates it trains the batch_size with the highest
    losses recorded when last trained on (never trained: infinite), chosen before augmentation, then stores the
    losses of those it trained. The timed step must do the same work, and no proxy's (it timed one)."""
    import train_cifar
    monkeypatch.setattr(bench_presets, "N_TRAIN", 300)
    proxies, stored = [], []
    real_proxy, real_record = train_cifar.Proxy, train_cifar.record_losses

    def record(history, idx, out, y, smoothing, world):
        before = history.clone()
        real_record(history, idx, out, y, smoothing, world)
        stored.append((before, idx.clone(), history.clone()))
    monkeypatch.setattr(train_cifar, "Proxy", lambda *a: proxies.append(a) or real_proxy(*a))
    monkeypatch.setattr(train_cifar, "record_losses", record)
    overrides = dict(widths=(8, 16, 16), proxy_widths=(4, 8, 8), batch_size=25, precision="fp32", epochs=1,
                     select_by=select_by, label_smoothing=0.0)
    r = bench_presets.measure("fast96", torch.device("cpu"), steps=2, repeats=2, overrides=overrides)
    assert r["candidates_per_step"] == 50 and r["losses_finite"]
    if select_by == "proxy":
        assert proxies and not stored
        return
    assert not proxies and len(stored) == 2 + 2 * 2  # warm-up and timed steps
    n = 50
    for i, (before, idx, after) in zip([0, 1] + [0, 1] * 2, stored):  # time_steps' step numbers
        start = (i * n) % (300 - n + 1)
        candidates = list(range(start, start + n))
        ranked = sorted(candidates, key=lambda j: -before[j].item())  # highest last loss first
        cut = before[ranked[24]].item()
        assert len(set(idx.tolist())) == 25 and set(idx.tolist()) <= set(candidates)
        assert all(before[j].item() >= cut for j in idx.tolist())  # (ties at the cut: any of them)
        assert all(torch.isfinite(after[idx])) and torch.equal(after[[j for j in range(300) if j not in idx]],
                                                               before[[j for j in range(300) if j not in idx]])


@pytest.mark.parametrize("jitter", [(0.0, 0.0), (0.2, 0.1)])
def test_the_benchmark_augments_as_the_run_would(monkeypatch, jitter):
    """A benchmark of --set color_jitter=... times the jittered batches (the draws a run would make), and without
    it none."""
    seen = []
    real_augment = bench_presets.tb.augment

    def augment(x, index, aug, **kwargs):
        seen.append(("shift" in aug) and bool(aug["shift"].abs().max() <= jitter[0]))
        return real_augment(x, index, aug, **kwargs)
    monkeypatch.setattr(bench_presets.tb, "augment", augment)
    bench_presets.measure("fast94", torch.device("cpu"), steps=1, repeats=1,
                          overrides=dict(widths=(8, 16, 16), batch_size=64, precision="fp32", color_jitter=jitter))
    assert seen and all(s == any(jitter) for s in seen)


def test_the_bench_names_and_times_each_kind_of_step_by_what_trains(monkeypatch):
    """A run of 3 epochs at 32 px: epoch 1 trains everything, epoch 2 freezes the bias, epoch 3 block 1 too; each
    kind is timed with those flags and weighted by its 8 steps."""
    built, flags = spy_on_timed_kinds(monkeypatch, lambda net: (net.whiten.bias.requires_grad,
                                                                net.block_parameters(0)[0].requires_grad))
    overrides = dict(widths=(8, 16, 16), batch_size=25, precision="fp32", epochs=3, lr_knots=(0, 3),
                     train_sizes=(), whiten_bias_epochs=1, block_epochs=(2,))
    r = bench_presets.measure("fast94", torch.device("cpu"), steps=1, repeats=2, overrides=overrides)
    at = r["seconds_per_step_by_size"]
    assert set(at) == {"32 with the whitening bias trained, block 1 trained",
                       "32 with the whitening bias frozen, block 1 trained",
                       "32 with the whitening bias frozen, block 1 frozen"}
    assert sorted(flags) == [(False, False), (False, True), (True, True)]
    assert r["est_train_time_s"] == pytest.approx(8 * sum(t[0] for t in at.values()))
    assert (built[0].whiten.bias.requires_grad, built[0].block_parameters(0)[0].requires_grad) == (False, False)
    assert bench_presets.kind_name(24, (None,)) == "24"


def test_the_proxy_trains_every_proxy_every_steps(monkeypatch):
    """With data selection the proxy scores every step's candidates and trains on one step in proxy_every, as in a
    run: of the timed steps' calls (warm-up included, which the count runs over), every 3rd trains it."""
    import train_cifar
    monkeypatch.setattr(bench_presets, "N_TRAIN", 300)
    trained, select = [], train_cifar.Proxy.select

    def spy(self, x, y, keep, lr, train):
        trained.append(train)
        return select(self, x, y, keep, lr, train)
    monkeypatch.setattr(train_cifar.Proxy, "select", spy)
    overrides = dict(widths=(8, 16, 16), proxy_widths=(4, 8, 8), batch_size=25, precision="fp32", epochs=1,
                     train_sizes=(), proxy_every=3)
    r = bench_presets.measure("fast96", torch.device("cpu"), steps=5, repeats=2, overrides=overrides)
    assert len(r["seconds_per_step_by_size"]) == 1 and len(trained) == 2 + 5 * 2  # one kind: warm-up and timed
    at = [i for i, t in enumerate(trained) if t]
    assert len(at) == len(trained) // 3 and all(b - a == 3 for a, b in zip(at, at[1:]))


def test_the_breakdown_times_a_full_size_step(monkeypatch):
    """Steps at 24 then 32 px: the breakdown's parts and the host's timing are of steps at 32 px (a spy sees the side
    each batch is resized to), and the full-size step time it reports is that of the 32 px kind of step."""
    sides, resize = [], bench_presets.tb.resize_images
    monkeypatch.setattr(bench_presets.tb, "resize_images", lambda x, side: sides.append(side) or resize(x, side))
    _, resized = spy_on_timed_kinds(monkeypatch, lambda net: len(sides))  # resizes done as each timing starts
    overrides = dict(widths=(8, 16, 16), batch_size=25, precision="fp32", epochs=2, lr_knots=(0, 2),
                     train_sizes=(24, 32), whiten_bias_epochs=0)
    r = bench_presets.measure("fast94", torch.device("cpu"), steps=1, repeats=2, breakdown=True, overrides=overrides)
    at = r["seconds_per_step_by_size"]
    assert set(at) == {"24", "32"} and len(resized) == 2 + 3  # each kind, then the breakdown's parts
    assert set(sides[resized[0]:resized[1]]) == {24}  # the 24 px kind's timing
    breakdown = sides[resized[2]:]
    assert len(breakdown) >= 2 + 2 + 2 and set(breakdown) == {32}  # its batch part, then the host's steps
    assert r["step_seconds_at_full_size"] == at["32"] != at["24"]


@pytest.mark.parametrize("n_train", [199, 210, 50])
def test_every_batch_lies_within_the_data(monkeypatch, n_train):
    """A batch starts where it fits whole: with 199 or 210 images (not multiples of the 50 a step takes), over more
    steps than fit in them, every index is of an image there, and a batch is 50 of them; with 50, each is all."""
    monkeypatch.setattr(bench_presets, "N_TRAIN", n_train)
    batches, real_augment = [], bench_presets.tb.augment

    def augment(x, index, aug, **kwargs):
        batches.append(index.tolist())
        return real_augment(x, index, aug, **kwargs)
    monkeypatch.setattr(bench_presets.tb, "augment", augment)
    bench_presets.measure("fast94", torch.device("cpu"), steps=8, repeats=1,
                          overrides=dict(widths=(8, 8, 8), batch_size=50, precision="fp32", epochs=1, train_sizes=()))
    assert 50 * len(batches) > n_train  # the offsets wrap around
    for idx in batches:
        assert len(set(idx)) == 50 and all(0 <= i < n_train for i in idx)
