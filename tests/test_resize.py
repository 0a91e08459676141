"""Progressive resizing (train_sizes): the resampling, the per-epoch sizes a run trains on, and its FLOP count."""
import numpy as np
import pytest
import torch

import torch_backend as tb
import train_cifar
from conftest import synthetic


def halve_reference(img):
    """Antialiased bilinear 2x shrink of one (H, W) float64 array, written out: the triangle filter stretched to
    the output's pixel spacing puts weights 1, 3, 3, 1 on the four input pixels around each output pixel,
    renormalised where the image edge cuts them off (as PIL does)."""
    def shrink_axis(a):
        n = a.shape[0]
        out = np.empty((n // 2,) + a.shape[1:])
        for i in range(n // 2):
            taps = [(j, w) for j, w in zip(range(2 * i - 1, 2 * i + 3), (1, 3, 3, 1)) if 0 <= j < n]
            out[i] = sum(w * a[j] for j, w in taps) / sum(w for _, w in taps)
        return out
    return shrink_axis(shrink_axis(img).T).T


def test_resize_images_is_the_antialiased_shrink_and_keeps_dtype_and_layout():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 32, 32, generator=g).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    y = tb.resize_images(x, 16)
    assert y.shape == (3, 2, 16, 16) and y.dtype == torch.bfloat16
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert tb.resize_images(x, 32) is x  # full-size epochs pass the batch through untouched
    ref = np.stack([np.stack([halve_reference(c) for c in img]) for img in x.double().numpy()])
    # bf16 output: within its rounding (8 bits of mantissa) of the exact float64 filter
    np.testing.assert_allclose(y.double().numpy(), ref, rtol=2 ** -7, atol=2 ** -7)
    # an unfiltered (point-sampling) shrink would be far off: the reference tells them apart
    point = torch.nn.functional.interpolate(x.float(), size=(16, 16), mode="bilinear", antialias=False)
    assert np.abs(point.double().numpy() - ref).max() > 0.1


def test_each_epoch_trains_at_its_scheduled_size_and_evaluates_at_32(monkeypatch):
    seen = []
    build = train_cifar.build_model

    def recording_build(*args, **kwargs):
        model = build(*args, **kwargs)
        model.whiten.register_forward_pre_hook(lambda m, inp: seen.append((m.training, inp[0].shape[-1])))
        return model
    monkeypatch.setattr(train_cifar, "build_model", recording_build)
    cfg = train_cifar.make_config("fast94", widths=(8, 16, 16), batch_size=50, epochs=3, precision="fp32",
                                  train_sizes=(16, 24), tta=0)
    dev = torch.device("cpu")
    data = tb.to_device(tb.validate(synthetic(200, 50), "tiny"), dev, torch.float32, pad=cfg["pad"])
    result = train_cifar.run_once(cfg, data, 0, 0, dev, "fp32", log=lambda *a: None)
    assert not result["diverged"] and len(result["epochs"]) == 3
    train_sizes = [size for training, size in seen if training]
    assert train_sizes == [16] * 4 + [24] * 8  # 4 steps an epoch; the last size repeats
    assert {size for training, size in seen if not training} == {32}


def test_run_flops_sum_each_steps_own_size_and_whitening_bias():
    """fast94 trains the whitening bias in epochs 1-3 only; a frozen bias spares the step the first block's input
    gradient: the conv 24 -> 64 (3x3) on the whitened map, 2 x 2000 x (side - 1)^2 x 64 x 24 x 9 FLOPs."""
    meta = torch.device("meta")
    cfg = train_cifar.make_config("fast94", epochs=8, lr_knots=(0, 8), train_sizes=(20, 24, 32), precision="fp32")
    assert cfg["whiten_bias_epochs"] == 3
    net = train_cifar.build_model(cfg, meta)
    opt = train_cifar.make_optimizer(cfg, net)
    at = {}
    for trains in (True, False):
        net.whiten.bias.requires_grad_(trains)
        at.update({(s, trains): train_cifar.step_flops(net, opt, meta, "fp32", cfg["batch_size"], s)
                   for s in (20, 24, 32)})
    for s in (20, 24, 32):
        assert at[s, True] - at[s, False] == 2 * cfg["batch_size"] * (s - 1) ** 2 * 64 * 24 * 9
    assert at[20, True] < at[24, True] < at[32, False]
    per_epoch = train_cifar.steps_per_epoch(cfg, 50000)  # 25 steps of 2000; 8 epochs
    per_step, steps, total = train_cifar.run_flops(cfg, net, opt, meta, "fp32", 50000)
    assert (per_step, steps) == (at[32, False], 8 * per_epoch)
    assert total == per_epoch * (at[20, True] + at[24, True] + at[32, True] + 5 * at[32, False])
    assert not net.whiten.bias.requires_grad  # counted in both states, and left frozen as it was
    # a run stopped 30 steps in trained one epoch at 20 and five steps at 24
    stopped = train_cifar.run_flops(cfg, net, opt, meta, "fp32", 50000, 30)[2]
    assert stopped == per_epoch * at[20, True] + 5 * at[24, True]
    net.whiten.bias.requires_grad_(True)  # as built; whiten_bias_epochs 0 leaves it so: it trains throughout
    plain = dict(cfg, train_sizes=(), whiten_bias_epochs=0)
    assert train_cifar.run_flops(plain, net, opt, meta, "fp32", 50000)[2] == steps * at[32, True]


@pytest.mark.parametrize("sizes", [(12, 32), (24.5,), (33,)])
def test_impossible_sizes_are_refused(sizes):
    with pytest.raises(ValueError, match="train-sizes must be whole numbers of pixels in 16..32"):
        train_cifar.make_config("fast94", train_sizes=sizes)


@pytest.mark.parametrize("net", train_cifar.NETS)
def test_every_net_trains_on_the_smallest_size_allowed(net):
    widths = (8, 16, 16) if net == "fastnet" else (8, 8, 16, 16)
    cfg = train_cifar.make_config("resnet9", net=net, widths=widths, precision="fp32")
    model = train_cifar.build_model(cfg, torch.device("cpu"))
    x = torch.randn(4, 3, train_cifar.MIN_TRAIN_SIZE, train_cifar.MIN_TRAIN_SIZE)
    out = model(x.contiguous(memory_format=torch.channels_last))
    assert out.shape == (4, 10)
    out.sum().backward()
