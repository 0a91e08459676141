"""Freezing fastnet's blocks after their epochs (block_epochs): what freezes, what a frozen step spares, and
that the FLOP count and the compile warm-up follow it (the bench's timing of each kind: test_bench_presets)."""
import re

import pytest
import torch

import train_cifar
from test_train import TINY_FAST, recorded_steps


@pytest.mark.parametrize("overrides, message", [
    (dict(block_epochs=(8, -1)), "block-epochs must be >= 0 (0: always trained), got 8 -1"),
    (dict(net="resnet9", widths=(), whiten_bias_epochs=0, block_epochs=(8,)), "block-epochs needs net fastnet"),
    (dict(block_epochs=(1, 2, 3, 4)), "block-epochs lists 4 blocks; the net has 3"),
    (dict(widths=(8, 16), block_epochs=(1, 2, 3)), "widths: net fastnet takes 3 channel counts"),  # the real fault
])
def test_impossible_block_epochs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        train_cifar.make_config("fast94", **overrides)


def test_block_epochs_on_the_command_line_are_whole_epochs(capsys):
    """A block freezes at an epoch's start, so 8.5 would act as 8: refused, as --whiten-bias-epochs 1.5 is."""
    with pytest.raises(SystemExit):
        train_cifar.parse_args(["--block-epochs", "8.5"])
    assert "--block-epochs: invalid int value: '8.5'" in capsys.readouterr().err


@pytest.mark.parametrize("depth", [2, 3])
def test_a_blocks_parameters_are_its_filters_and_bn_biases(depth):
    """Every parameter that trains as built is in exactly one block, or is the whitening bias or the head."""
    net = train_cifar.build_model(train_cifar.make_config("fast96" if depth == 3 else "fast94", widths=(8, 16, 16)),
                                  torch.device("cpu"))
    blocks = [net.block_parameters(i) for i in range(net.num_blocks)]
    assert net.num_blocks == 3 and [len(b) for b in blocks] == [2 * depth] * 3  # a conv and a BN bias per layer
    ids = [id(p) for b in blocks for p in b]
    others = ("whiten.bias", "head.weight")
    trainable = {id(p) for n, p in net.named_parameters() if p.requires_grad and n not in others}
    assert len(set(ids)) == len(ids) and set(ids) == trainable
    assert all(p.requires_grad for b in blocks for p in b)


def test_trains_in_names_each_part_by_epoch():
    cfg = train_cifar.make_config("fast94", whiten_bias_epochs=3, block_epochs=(8, 0, 9))
    assert train_cifar.trains_in(cfg, 3) == (True, True, None, True)
    assert train_cifar.trains_in(cfg, 4) == (False, True, None, True)
    assert train_cifar.trains_in(cfg, 9) == (False, False, None, True)
    assert train_cifar.trains_in(cfg, 10) == (False, False, None, False)
    assert train_cifar.trains_in(dict(cfg, whiten_bias_epochs=0, block_epochs=()), 10) == (None,)


def conv_flops(n, side, c_in, c_out):
    """A 3x3 conv's forward (or either gradient) on n maps of side x side: 2 multiply-adds' worth per MAC."""
    return 2 * n * side ** 2 * c_in * c_out * 9


@pytest.mark.parametrize("side", [20, 24, 32])
def test_a_frozen_block_spares_its_backward_and_the_input_gradient_below_it(side):
    """fast94's net (whitening conv 2x2: maps of side - 1; each block's first conv before its pool). With the
    whitening bias frozen, freezing block 1 spares its two weight gradients, its second conv's input gradient and
    block 2's first conv's input gradient; freezing block 2 alone spares only its weight gradients (block 1 below
    still needs the input gradients through it)."""
    meta, n = torch.device("meta"), 100
    net = train_cifar.build_model(train_cifar.make_config("fast94", precision="fp32"), meta)

    def flops(trains):
        with train_cifar.trains_as(net, trains):
            return train_cifar.train_flops(net, meta, "fp32", n, side)
    m = side - 1
    p1, p2 = m // 2, m // 2 // 2
    base = flops((False, True, True, True))
    block1_wgrad = conv_flops(n, m, 24, 64) + conv_flops(n, p1, 64, 64)
    assert base - flops((False, False, True, True)) == (block1_wgrad + conv_flops(n, p1, 64, 64)
                                                        + conv_flops(n, p1, 64, 256))
    assert base - flops((False, True, False, True)) == conv_flops(n, p1, 64, 256) + conv_flops(n, p2, 256, 256)
    assert all(p.requires_grad for i in range(3) for p in net.block_parameters(i))  # put back after each count


def test_run_flops_weigh_each_epochs_frozen_blocks_and_muons_update_with_them():
    """Epochs 1-8 train everything (bar the bias after epoch 3), epoch 9 freezes block 1, epoch 10 blocks 1 and 2;
    Muon's Newton-Schulz products skip the frozen filters too."""
    meta = torch.device("meta")
    cfg = train_cifar.make_config("fast94", train_sizes=(), precision="fp32", block_epochs=(8, 9))
    net = train_cifar.build_model(cfg, meta)
    opt = train_cifar.make_optimizer(cfg, net)
    at = {}
    for trains in [(True, True, True), (False, True, True), (False, False, True), (False, False, False)]:
        with train_cifar.trains_as(net, trains):
            at[trains] = train_cifar.step_flops(net, opt, meta, "fp32", cfg["batch_size"])
    with train_cifar.trains_as(net, (False, False, True)):
        left_ns = opt.update_flops()
    assert 0 < left_ns < opt.update_flops()  # block 1's two filters no longer orthogonalised
    per_epoch = train_cifar.steps_per_epoch(cfg, 50000)
    parts = train_cifar.run_flops_parts(cfg, net, opt, meta, "fp32", 50000)
    assert parts["total"] == per_epoch * (3 * at[True, True, True] + 5 * at[False, True, True]
                                          + at[False, False, True] + at[False, False, False])
    assert parts["last_step"] == at[False, False, False] < at[False, False, True] < at[False, True, True]
    assert all(p.requires_grad for i in range(3) for p in net.block_parameters(i))  # as it was


def test_a_frozen_block_stops_after_its_epochs_while_the_rest_trains(monkeypatch, tiny):
    """block_epochs (1,): block 1's filters and BN biases move in epoch 1 and not after; its BN scales never
    train; its BN statistics still follow the batches; block 2 trains throughout."""
    seen = []

    def record(cfg, model, opt):
        block1, block2 = model.block_parameters(0), model.block_parameters(1)
        bn = model.blocks[model.block_starts[0] + 2]
        seen.append(dict(block1=[p.detach().clone() for p in block1], block2=[p.detach().clone() for p in block2],
                         scale=bn.weight.detach().clone(), mean=bn.running_mean.clone()))
    recorded_steps(monkeypatch, record)
    train_cifar.train("fast94", data=tiny, epochs=3, block_epochs=(1,), **TINY_FAST)
    per_epoch = 200 // 50

    def moved(key, a, b):
        return all(not torch.equal(x, y) for x, y in zip(seen[a][key], seen[b][key]))
    assert len(seen) == 3 * per_epoch
    assert all(moved("block1", i, i + 1) for i in range(per_epoch))  # epoch 1 (and its last step) moves it
    assert all(torch.equal(x, y) for s in seen[per_epoch:] for x, y in zip(s["block1"], seen[per_epoch]["block1"]))
    assert all(moved("block2", i, i + 1) for i in range(len(seen) - 1))
    assert all(torch.equal(s["scale"], seen[0]["scale"]) for s in seen)
    assert not torch.equal(seen[-1]["mean"], seen[per_epoch]["mean"])


def test_the_compile_warm_up_visits_each_state_the_run_takes_and_puts_it_back(monkeypatch):
    """Each state of what trains that the run's epochs take gets its graph warmed up once (here 3 of 4
    epochs differ: the bias trains in epoch 1, block 2 in epochs 1-2), and the flags are left as they were."""
    cfg = train_cifar.make_config("fast94", widths=(8, 16, 16), precision="fp32", epochs=4, whiten_bias_epochs=1,
                                  block_epochs=(0, 2), train_sizes=())
    model = train_cifar.build_model(cfg, torch.device("cpu"))
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    states = []
    monkeypatch.setattr(train_cifar, "forward_backward", lambda cfg, model, *a: states.append(
        (model.whiten.bias.requires_grad, model.block_parameters(1)[0].requires_grad)))
    train_cifar.warm_up_compile(dict(cfg, batch_size=8), model, torch.device("cpu"), "fp32", world=1)
    assert states == [(True, True), (False, True), (False, False)]
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    # a state that only the last epoch takes (block 2 frozen in epoch 3 of 2.5, rounded up) is warmed up too
    states.clear()
    train_cifar.warm_up_compile(dict(cfg, batch_size=8, epochs=2.5, whiten_bias_epochs=0), model,
                                torch.device("cpu"), "fp32", world=1)
    assert states == [(True, True), (True, False)]
