"""fast96's pieces: depth-3 fastnet blocks and data selection by a proxy net trained alongside."""
import copy
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


def test_proxy_keeps_the_highest_loss_examples_and_trains_on_them_every_nth_step():
    """Scores in train mode (batch statistics) with the run's label-smoothed loss, against a float64 copy; trains
    only on the steps asked to, and then exactly as SGD on the mean loss of the kept examples."""
    cfg = train_cifar.make_config("fast96", widths=(8, 16, 16), proxy_widths=(4, 8, 8), precision="fp32")
    torch.manual_seed(0)
    proxy = train_cifar.Proxy(cfg, None, None, CPU, "fp32")
    for p in proxy.model.blocks.parameters():  # away from the dirac start, so losses differ clearly
        p.data.add_(0.05 * torch.randn_like(p))
    x = torch.randn(40, 3, 32, 32).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (40,))
    ref_model = copy.deepcopy(proxy.model).double().train()
    with torch.no_grad():
        ref = F.cross_entropy(ref_model(x.double()), y, reduction="none", label_smoothing=0.2)
    hardest = sorted(ref.topk(15).indices.tolist())
    before = [p.detach().clone() for p in proxy.model.parameters()]
    xs, ys = proxy.select(x, y, 15, lr=0.1, train=False)
    assert all(torch.equal(a, b) for a, b in zip(before, proxy.model.parameters()))  # scored, not trained
    assert xs.shape == (15, 3, 32, 32) and xs.is_contiguous(memory_format=torch.channels_last)
    picked = sorted(int((x == xi).flatten(1).all(1).nonzero()) for xi in xs)
    assert picked == hardest and sorted(ys.tolist()) == sorted(y[hardest].tolist())
    # a training step: SGD (as the run's optimizer) on the mean label-smoothed loss of the kept 15
    twin = copy.deepcopy(proxy.model)
    twin_opt = train_cifar.make_optimizer(proxy.cfg, twin)
    train_cifar.set_lr(twin_opt, 0.1)
    proxy.select(x, y, 15, lr=0.1, train=True)
    twin.train()
    losses = F.cross_entropy(twin(x), y, reduction="none", label_smoothing=0.2)
    losses[torch.tensor(hardest)].mean().backward()
    twin_opt.step()
    for (name, p), q in zip(proxy.model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, msg=name)
    assert not proxy.model.whiten.bias.requires_grad  # frozen in the proxy, as airbench96


def test_depth3_block_adds_a_residual_over_its_last_two_convs_with_gelu_after_the_sum():
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

    def conv_bn(x, i):
        bn = bns[i]
        x = F.conv2d(x, convs[i].weight, padding=1)
        if i % 3 == 0:
            x = F.max_pool2d(x, 2)
        return F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
    x = torch.randn(2, 3, 32, 32)
    h = F.gelu(net.whiten(x))
    for b in range(3):  # airbench96: the GELU comes after the residual sum
        h = F.gelu(conv_bn(h, 3 * b))
        h = F.gelu(h + conv_bn(F.gelu(conv_bn(h, 3 * b + 1)), 3 * b + 2))
    ref = net.head(F.adaptive_max_pool2d(h, 1).flatten(1)) * net.head_scale
    torch.testing.assert_close(net(x), ref)
    depth2 = sum(p.numel() for p in tb.FastNet((8, 16, 16)).parameters())
    assert sum(p.numel() for p in net.parameters()) - depth2 == sum(9 * w * w + 2 * w for w in (8, 16, 16))


def test_proxy_learns_the_task_alongside_and_selects_what_it_finds_hard():
    data = tinted(640, 200)
    cfg = train_cifar.make_config("fast96", widths=(8, 16, 16), batch_size=32, proxy_widths=(8, 8, 8),
                                  precision="fp32")
    on_device = tb.to_device(tb.validate(data, "tiny"), CPU, torch.float32, pad=cfg["pad"])
    gen = torch.Generator().manual_seed(0)
    proxy = train_cifar.Proxy(cfg, on_device, gen, CPU, "fp32")
    stream = train_cifar.pipeline.BatchStream(on_device, dict(cfg, batch_size=64), gen, CPU)
    for step in range(80):  # 8 passes over the candidates, a proxy step every other one
        proxy.select(*stream.next_batch(), 32, lr=0.05, train=step % 2 == 0)
    proxy.check()
    assert train_cifar.evaluate(proxy.model, on_device, "fp32", CPU, tta=0) > 0.5  # chance is 0.1
    x, y = stream.next_batch()
    xs, ys = proxy.select(x, y, 32, lr=0.0, train=False)
    proxy.model.eval()
    with torch.no_grad():
        loss_all, loss_kept = F.cross_entropy(proxy.model(x), y), F.cross_entropy(proxy.model(xs), ys)
    assert loss_kept > loss_all


def test_run_flops_count_the_proxy_training_and_the_scoring():
    cfg = train_cifar.make_config("fast96", widths=(8, 16, 16), proxy_widths=(4, 8, 8), batch_size=64,
                                  epochs=3, proxy_every=4, precision="fp32")
    plain = dict(cfg, select_fraction=1.0)
    net = train_cifar.build_model(cfg, CPU)
    opt = train_cifar.make_optimizer(cfg, net)
    # 47 steps an epoch, 141 in all: the proxy trains at steps 0, 4, ..., 140, 36 of them (from step 1: 35)
    per_step, steps, total = train_cifar.run_flops(cfg, net, opt, CPU, "fp32", 6016)
    plain_step, plain_steps, plain_total = train_cifar.run_flops(plain, net, opt, CPU, "fp32", 6016)
    assert steps == 3 * 6016 // 128 == 141 and plain_steps == 3 * 6016 // 64  # an epoch: a pass over the candidates
    proxy = tb.FastNet((4, 8, 8), bn_momentum=0.1)
    proxy.whiten.bias.requires_grad_(False)
    x = torch.randn(128, 3, 32, 32)
    with torch.no_grad():
        scoring = tb.count_flops(lambda: proxy(x))
    assert per_step == plain_step + scoring
    backward = train_cifar.train_flops(proxy, CPU, "fp32", 128) - scoring  # through all 128 candidates
    assert total == per_step * steps + math.ceil(steps / 4) * backward
    assert plain_total == plain_step * plain_steps


@pytest.mark.parametrize("options, message", [
    (dict(select_fraction=0.0), "select-fraction must be in"),
    (dict(select_fraction=1.5), "select-fraction must be in"),
    (dict(proxy_every=0), "needs a proxy"),
    (dict(proxy_widths=(8, 8)), "needs a proxy"),
    (dict(net="resnet9", block_depth=2, whiten_bias_epochs=0, bn_momentum=0.2), "applies to net fastnet only"),
    (dict(net="resnet9", whiten_bias_epochs=0), "block-depth must be 2 or 3"),
    (dict(block_depth=4), "block-depth must be 2 or 3"),
])
def test_impossible_selection_options_are_errors(options, message):
    with pytest.raises(ValueError, match=message):
        train_cifar.make_config("fast96", **options)


def test_fast96_counts_the_flops_of_airbench96_faster():
    """The preset's own numbers: 45 epochs of 1024 candidates a step (48 steps an epoch), 512 trained on; our
    count of the whole run, proxy included, comes to airbench96_faster's published 3.1 PF."""
    cfg = train_cifar.make_config("fast96", precision="fp32")
    assert train_cifar.candidate_batch_size(cfg) == 1024
    meta = torch.device("meta")  # FLOPs are counted from shapes: no arithmetic needed
    net = train_cifar.build_model(cfg, meta)
    _, steps, total = train_cifar.run_flops(cfg, net, train_cifar.make_optimizer(cfg, net), meta, "fp32", 50000)
    assert steps == 48 * 45 and total == pytest.approx(3.1e15, rel=0.01)


def test_flops_counted_on_the_meta_device_equal_those_counted_on_real_tensors():
    import bench_presets
    overrides = dict(widths=(8, 16, 16), proxy_widths=(4, 8, 8), batch_size=64, epochs=2)
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
                                  proxy_every=1, lr_values=(1e30, 1e30, 1e30), precision="fp32")
    on_device = tb.to_device(tb.validate(data, "tiny"), CPU, torch.float32, pad=cfg["pad"])
    with pytest.raises(train_cifar.Diverged, match="proxy diverged"):
        train_cifar.run_once(cfg, on_device, 0, 0, CPU, "fp32", log=lambda *a: None)


def test_command_line_runs_data_selection_and_logs_the_proxy_flops(tmp_path):
    from test_train import cli
    np.savez(tmp_path / "tiny.npz", **tinted(400, 100))
    r = cli("--preset", "fast96", "--data", str(tmp_path / "tiny.npz"), "--log-dir", str(tmp_path),
            "--widths", "8", "16", "16", "--proxy-widths", "4", "8", "8", "--proxy-every", "2", "--epochs", "2",
            "--batch-size", "50", "--lr-values", "0.05", "0.25", "0.02")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(next(tmp_path.glob("fast96-*.json")).read_text())
    assert summary["config"]["proxy_widths"] == [4, 8, 8] and summary["config"]["proxy_every"] == 2
    run = summary["runs"][0]
    assert run["accuracy"] is not None and summary["train_steps"] == 2 * (400 // 100)
    without_proxy = summary["train_flops_per_step"] * summary["train_steps"]
    assert run["train_flops"] == summary["train_flops_per_run"] > without_proxy


# Data selection by loss history (select_by "loss"): no proxy, each example scored by the loss it last had.

def test_next_chosen_batch_keeps_the_highest_scored_candidates_augmented_as_the_whole_batch_would_be():
    data = tinted(300, 10)
    cfg = train_cifar.make_config("fast94", batch_size=60, select_fraction=0.5, select_by="loss", precision="fp32")
    on_device = tb.to_device(tb.validate(data, "tiny"), CPU, torch.float32, pad=cfg["pad"])
    stream_cfg = dict(cfg, batch_size=120)
    chooser = train_cifar.pipeline.BatchStream(on_device, stream_cfg, torch.Generator().manual_seed(3), CPU)
    twin = train_cifar.pipeline.BatchStream(on_device, stream_cfg, torch.Generator().manual_seed(3), CPU)
    scores = torch.rand(300, generator=torch.Generator().manual_seed(4))
    scores[::7] = math.inf  # never trained on: first in line
    for _ in range(5):  # across a pass boundary (2 batches a pass), where the alternating flips change
        idx, aug = twin.next_indices()
        whole = tb.augment(on_device["train_x"], idx, aug)
        x, y, chosen = chooser.next_chosen_batch(scores, 60)
        assert sorted(chosen.tolist()) == sorted(idx[scores[idx].argsort(descending=True)[:60]].tolist())
        rows = [int((idx == i).nonzero()) for i in chosen]
        torch.testing.assert_close(x, whole[rows], rtol=0, atol=0)
        assert torch.equal(y, on_device["train_y"][chosen])
    # a process's slice (torchrun): rows lo:hi of the same choice, so the processes' slices (uneven ones too) are
    # together the whole choice, each example once, each image that example's augmented as in the whole batch
    idx, aug = twin.next_indices()
    whole = tb.augment(on_device["train_x"], idx, aug)
    parts = []
    for lo, hi in ((0, 25), (25, 60)):
        rank = train_cifar.pipeline.BatchStream(on_device, stream_cfg, torch.Generator().manual_seed(3), CPU)
        for _ in range(5):
            rank.next_chosen_batch(scores, 60)
        x, y, chosen = rank.next_chosen_batch(scores, 60, lo, hi)
        assert len(x) == len(y) == len(chosen) == hi - lo
        rows = [int((idx == i).nonzero()) for i in chosen]
        torch.testing.assert_close(x, whole[rows], rtol=0, atol=0)
        assert torch.equal(y, on_device["train_y"][chosen])
        parts += chosen.tolist()
    assert sorted(parts) == sorted(idx[scores[idx].argsort(descending=True)[:60]].tolist())


def test_record_losses_stores_each_examples_label_smoothed_loss_under_its_index():
    torch.manual_seed(0)
    history = torch.full((50,), math.inf)
    idx = torch.tensor([3, 17, 41, 8])
    out, y = torch.randn(4, 10).to(torch.bfloat16), torch.tensor([1, 9, 0, 4])
    train_cifar.record_losses(history, idx, out, y, 0.2, world=1)
    logp = torch.log_softmax(out.double(), 1)
    ref = -(0.8 * logp.gather(1, y[:, None])[:, 0] + 0.2 * logp.mean(1))
    torch.testing.assert_close(history[idx].double(), ref, rtol=1e-6, atol=1e-6)
    others = torch.ones(50, dtype=torch.bool)
    others[idx] = False
    assert torch.isinf(history[others]).all()


def test_loss_history_trains_the_never_trained_first_and_counts_no_scoring_flops(tmp_path):
    """f = 0.5: the first epoch trains on exactly half the examples (all start untrained); in the second the
    untrained half goes first, so nearly all have been trained on (random choice: about 75%)."""
    data = tinted(640, 100)
    cfg = train_cifar.make_config("fast94", widths=(8, 16, 16), batch_size=32, epochs=2, select_fraction=0.5,
                                  select_by="loss", train_sizes=(), precision="fp32")
    on_device = tb.to_device(tb.validate(data, "tiny"), CPU, torch.float32, pad=cfg["pad"])
    seen = []
    ckpt = str(tmp_path / "run.pt")

    def after_epoch(row):
        seen.append(torch.isfinite(torch.load(ckpt, weights_only=False)["history"]).sum().item()
                    if os.path.exists(ckpt) else None)
    result = train_cifar.run_once(cfg, on_device, 0, 0, CPU, "fp32", log=lambda *a: None, checkpoint=ckpt,
                                  on_epoch=after_epoch)
    history = torch.load(ckpt, weights_only=False)["history"]
    assert seen[1] == 10 * 32  # epoch 1's checkpoint: 10 steps of 32 distinct examples
    assert torch.isfinite(history).sum() >= 0.9 * 640, torch.isfinite(history).sum()
    assert history[torch.isfinite(history)].min() > 0 and result["accuracy"] is not None
    net = train_cifar.build_model(cfg, CPU)
    per_step, steps, total = train_cifar.run_flops(cfg, net, train_cifar.make_optimizer(cfg, net), CPU, "fp32", 640)
    plain = dict(cfg, select_fraction=1.0)
    assert steps == 2 * 640 // 64 and total == steps * per_step
    assert per_step == train_cifar.run_flops(plain, net, train_cifar.make_optimizer(plain, net), CPU, "fp32", 640)[0]


def test_loss_history_needs_the_device_pipeline():
    with pytest.raises(ValueError, match="select-by loss needs pipeline device"):
        train_cifar.make_config("fast94", select_fraction=0.7, select_by="loss", pipeline="loader")
    with pytest.raises(ValueError, match="select-by must be proxy or loss"):
        train_cifar.make_config("fast94", select_fraction=0.7, select_by="random")


def test_compiled_proxy_scores_selects_and_trains_as_the_eager_one_without_recompiling():
    """--compile compiles the proxy too (one graph to score, one to train, built by warm_up outside the timer and
    leaving the proxy as it was): the same choices and the same weights as the eager proxy, and no step
    compiles anything."""
    cfg = train_cifar.make_config("fast96", widths=(8, 16, 16), proxy_widths=(4, 8, 8), precision="fp32")
    eager = train_cifar.Proxy(cfg, None, None, CPU, "fp32")
    compiled = train_cifar.Proxy(dict(cfg, compile=True), None, None, CPU, "fp32")
    assert compiled.forward is not compiled.model and eager.forward is eager.model
    with torch.no_grad():
        for p in eager.model.blocks.parameters():  # away from the dirac start, so losses differ clearly
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    compiled.model.load_state_dict(eager.model.state_dict())
    before = {k: v.clone() for k, v in compiled.model.state_dict().items()}
    compiled.warm_up(32, [32])
    assert all(torch.equal(before[k], v) for k, v in compiled.model.state_dict().items())
    assert all(p.grad is None for p in compiled.model.parameters())
    gen = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(4):
            x = torch.randn(32, 3, 32, 32, generator=gen).to(memory_format=torch.channels_last)
            y = torch.randint(0, 10, (32,), generator=gen)
            chosen = [proxy.select(x, y, 16, lr=0.1, train=step % 2 == 0)[0] for proxy in (eager, compiled)]
            sums = [c.flatten(1).sum(1).sort().values for c in chosen]  # the same images, in any order
            torch.testing.assert_close(sums[0], sums[1])
    for p, q in zip(eager.model.parameters(), compiled.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)
    assert not torch.equal(before["blocks.0.weight"], compiled.model.state_dict()["blocks.0.weight"])  # trained


def test_the_proxy_trains_at_steps_0_every_2_every_as_its_flops_count_it(monkeypatch):
    """proxy_every 3 over 2 epochs of 4 steps (400 images, 100 candidates a step): the proxy scores at every step
    and trains at steps 0, 3 and 6, the steps run_flops counts its training at."""
    trains, select = [], train_cifar.Proxy.select

    def recording(self, x, y, keep, lr, train):
        trains.append(train)
        return select(self, x, y, keep, lr, train)
    monkeypatch.setattr(train_cifar.Proxy, "select", recording)
    train_cifar.train("fast96", data=synthetic(400, 50), widths=(8, 16, 16), proxy_widths=(4, 8, 8), batch_size=50,
                      epochs=2, proxy_every=3, precision="fp32", train_sizes=(), tta=0, log_dir=None,
                      log=lambda *a: None, progress=False)
    assert trains == [True, False, False, True, False, False, True, False]
