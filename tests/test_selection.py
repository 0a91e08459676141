"""fast96's pieces: depth-3 fastnet blocks and data selection by a proxy net."""
import json
import math
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_backend as tb
import train_cifar
from conftest import ROOT, synthetic

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

CPU = torch.device("cpu")


def tinted(n_train, n_test, seed=0):
    """Synthetic images with a learnable signal: one colour per class."""
    data = synthetic(n_train, n_test, seed)
    tints = np.random.default_rng(seed + 1).integers(0, 128, (10, 3))
    for split in ("train", "test"):
        data[f"{split}_x"] = (data[f"{split}_x"] // 2 + tints[data[f"{split}_y"]][:, None, None, :]).astype(np.uint8)
    return data


def test_select_hardest_keeps_the_highest_loss_examples_of_a_per_example_reference():
    torch.manual_seed(0)
    proxy = tb.FastNet((8, 16, 16)).eval()
    for p in proxy.blocks.parameters():  # away from the dirac start, so losses differ clearly
        p.data.add_(0.05 * torch.randn_like(p))
    x = torch.randn(40, 3, 32, 32).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (40,))
    xs, ys = train_cifar.select_hardest(proxy, x, y, 15, "fp32", CPU)
    with torch.no_grad():  # one example at a time, in float64
        ref = [F.cross_entropy(proxy.double()(x[i:i + 1].double()), y[i:i + 1]).item() for i in range(40)]
    hardest = sorted(range(40), key=lambda i: -ref[i])[:15]
    assert xs.shape == (15, 3, 32, 32) and xs.is_contiguous(memory_format=torch.channels_last)
    picked = sorted(int((x == xi).flatten(1).all(1).nonzero()) for xi in xs)
    assert picked == sorted(hardest)
    assert sorted(ys.tolist()) == sorted(y[hardest].tolist())


def test_depth3_block_adds_a_residual_over_its_last_two_convs():
    torch.manual_seed(1)
    net = tb.FastNet((8, 16, 16), depth=3).eval()
    for p in net.parameters():
        p.data.add_(0.1 * torch.randn_like(p))
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2)
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)][1:]
    bns = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(convs) == len(bns) == 9

    def conv_bn_gelu(x, i):
        bn = bns[i]
        x = F.conv2d(x, convs[i].weight, padding=1)
        if i % 3 == 0:
            x = F.max_pool2d(x, 2)
        return F.gelu(F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps))
    x = torch.randn(2, 3, 32, 32)
    h = F.gelu(net.whiten(x))
    for b in range(3):
        h = conv_bn_gelu(h, 3 * b)
        h = h + conv_bn_gelu(conv_bn_gelu(h, 3 * b + 1), 3 * b + 2)
    ref = net.head(F.adaptive_max_pool2d(h, 1).flatten(1)) * net.head_scale
    torch.testing.assert_close(net(x), ref)
    depth2 = sum(p.numel() for p in tb.FastNet((8, 16, 16)).parameters())
    assert sum(p.numel() for p in net.parameters()) - depth2 == sum(9 * w * w + 2 * w for w in (8, 16, 16))


def test_proxy_learns_the_task_and_selection_changes_what_the_net_sees():
    data = tinted(640, 200)
    # the preset's LR is for batches of 1024 on CIFAR-10; a fifth of it suits batches of 32 here
    cfg = train_cifar.make_config("fast96", widths=(8, 16, 16), batch_size=32, epochs=2, proxy_widths=(8, 8, 8),
                                  proxy_epochs=4, lr_knots=(0, 0.5, 2), lr_values=(0.05, 0.25, 0.02), precision="fp32")
    on_device = tb.to_device(tb.validate(data, "tiny"), CPU, torch.float32, pad=cfg["pad"])
    gen = torch.Generator().manual_seed(0)
    proxy = train_cifar.train_proxy(cfg, on_device, gen, CPU, "fp32")
    assert not proxy.training and list(proxy.blocks[0].weight.shape) == [8, 24, 3, 3]
    assert train_cifar.evaluate(proxy, on_device, "fp32", CPU, tta=0) > 0.5  # chance is 0.1
    stream = train_cifar.pipeline.BatchStream(on_device, dict(cfg, batch_size=64), gen, CPU)
    x, y = stream.next_batch()
    xs, ys = train_cifar.select_hardest(proxy, x, y, 32, "fp32", CPU)
    with torch.no_grad():
        loss_all, loss_kept = F.cross_entropy(proxy(x), y), F.cross_entropy(proxy(xs), ys)
    assert loss_kept > loss_all


def test_run_flops_count_the_proxy_training_and_the_scoring():
    cfg = train_cifar.make_config("fast96", widths=(8, 16, 16), proxy_widths=(4, 8, 8), batch_size=64,
                                  epochs=3, proxy_epochs=2, precision="fp32")
    plain = dict(cfg, select_fraction=1.0)
    net = train_cifar.build_model(cfg, CPU)
    opt = train_cifar.make_optimizer(cfg, net)
    per_step, steps, total = train_cifar.run_flops(cfg, net, opt, CPU, "fp32", 6400)
    plain_step, plain_steps, plain_total = train_cifar.run_flops(plain, net, opt, CPU, "fp32", 6400)
    assert steps == 3 * 6400 // 128 and plain_steps == 3 * 6400 // 64  # an epoch is a pass over the candidates
    proxy = tb.FastNet((4, 8, 8)).eval()
    x = torch.randn(128, 3, 32, 32)
    with torch.no_grad():
        scoring = tb.count_flops(lambda: proxy(x))
    assert per_step == plain_step + scoring
    proxy_steps = 2 * 6400 // 64
    proxy_step = train_cifar.train_flops(plain, tb.FastNet((4, 8, 8)), CPU, "fp32", 64)
    assert total == per_step * steps + proxy_step * proxy_steps
    assert plain_total == plain_step * plain_steps


@pytest.mark.parametrize("options, message", [
    (dict(select_fraction=0.0), "select-fraction must be in"),
    (dict(select_fraction=1.5), "select-fraction must be in"),
    (dict(proxy_epochs=0), "needs a proxy"),
    (dict(net="resnet9", whiten_bias_epochs=0), "block-depth must be 2 or 3"),
    (dict(block_depth=4), "block-depth must be 2 or 3"),
])
def test_impossible_selection_options_are_errors(options, message):
    with pytest.raises(ValueError, match=message):
        train_cifar.make_config("fast96", **options)


def test_fast96_stays_within_its_flop_budget():
    """The preset's own numbers: an epoch is 2048 candidates a step, and the run is under airbench96's 3.1 PF."""
    cfg = train_cifar.make_config("fast96", precision="fp32")
    assert train_cifar.candidate_batch_size(cfg) == 2048
    meta = torch.device("meta")  # FLOPs are counted from shapes: no arithmetic needed
    net = train_cifar.build_model(cfg, meta)
    _, steps, total = train_cifar.run_flops(cfg, net, train_cifar.make_optimizer(cfg, net), meta, "fp32", 50000)
    assert steps == math.ceil(50000 // 2048 * cfg["epochs"]) and total <= 3.1e15


def test_flops_counted_on_the_meta_device_equal_those_counted_on_real_tensors():
    import bench_presets
    overrides = dict(widths=(8, 16, 16), proxy_widths=(4, 8, 8), batch_size=64, epochs=2, proxy_epochs=1)
    counted = bench_presets.count_only("fast96", overrides)
    cfg = train_cifar.make_config("fast96", **overrides, precision="fp32")
    net = train_cifar.build_model(cfg, CPU)
    per_step, steps, total = train_cifar.run_flops(cfg, net, train_cifar.make_optimizer(cfg, net), CPU, "fp32", 50000)
    assert counted["flops_per_step"] == per_step and counted["train_steps"] == steps
    assert counted["train_flops_per_run"] == total
    assert counted["proxy_train_flops"] > 0 and 0 < counted["scoring_flops_per_step"] < counted["net_flops_per_step"]


def test_a_diverged_proxy_stops_the_run_with_a_clear_error():
    data = tinted(256, 50)
    cfg = train_cifar.make_config("fast96", widths=(8, 16, 16), batch_size=32, epochs=2, proxy_widths=(4, 8, 8),
                                  proxy_epochs=1, lr_values=(1e30, 1e30, 1e30), precision="fp32")
    on_device = tb.to_device(tb.validate(data, "tiny"), CPU, torch.float32, pad=cfg["pad"])
    with pytest.raises(train_cifar.Diverged, match="proxy diverged"):
        train_cifar.run_once(cfg, on_device, 0, 0, CPU, "fp32", log=lambda *a: None)


def test_command_line_runs_data_selection_and_logs_the_proxy_flops(tmp_path):
    from test_train import cli
    np.savez(tmp_path / "tiny.npz", **tinted(400, 100))
    r = cli("--preset", "fast96", "--data", str(tmp_path / "tiny.npz"), "--log-dir", str(tmp_path),
            "--widths", "8", "16", "16", "--proxy-widths", "4", "8", "8", "--proxy-epochs", "0.5", "--epochs", "2",
            "--batch-size", "50", "--lr-values", "0.05", "0.25", "0.02")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(next(tmp_path.glob("fast96-*.json")).read_text())
    assert summary["config"]["proxy_widths"] == [4, 8, 8] and summary["config"]["proxy_epochs"] == 0.5
    run = summary["runs"][0]
    assert run["accuracy"] is not None and summary["train_steps"] == 2 * (400 // 100)
    without_proxy = summary["train_flops_per_step"] * summary["train_steps"]
    assert run["train_flops"] == summary["train_flops_per_run"] > without_proxy
