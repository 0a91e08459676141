import pytest
import torch

import torch_backend as tb


def test_patch_whitening_makes_patch_covariance_identity():
    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(12, 12, generator=gen)  # correlated 2x2x3 patches
    x = torch.randn(400, 3, 8, 8, generator=gen)
    x = (x.permute(0, 2, 3, 1) @ mix[:3, :3]).permute(0, 3, 1, 2) + 0.3 * x.roll(1, dims=3)
    w = tb.patch_whitening(x, patch=2, eps=0.0)
    assert w.shape == (24, 3, 2, 2)
    torch.testing.assert_close(w[12:], -w[:12])
    out = torch.nn.functional.conv2d(x.double(), w[:12].double()).permute(0, 2, 3, 1).reshape(-1, 12)
    out = out - out.mean(0)
    torch.testing.assert_close(out.T @ out / len(out), torch.eye(12, dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("make, params", [
    (lambda: tb.resnet9(), 6_573_120),            # Myrtle's ResNet-9
    # the common CIFAR pre-activation ResNet-18 (11,171,146) plus the final BN before pooling of He et al. 2016
    (lambda: tb.preact_resnet18(False), 11_171_146 + 2 * 512),
])
def test_reference_nets_have_their_published_size(make, params):
    net = make()
    assert sum(p.numel() for p in net.parameters()) == params
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_duplicated_bn_relu_variant_adds_only_shortcut_batch_norms():
    plain, dup = tb.preact_resnet18(False), tb.preact_resnet18(True)
    extra = sum(p.numel() for p in dup.parameters()) - sum(p.numel() for p in plain.parameters())
    assert extra == 2 * (64 + 128 + 256)  # a BN (weight and bias) on each of the three projection shortcuts


def test_tta_weights_and_views():
    x = torch.randn(3, 3, 32, 32)
    for level in (0, 1, 2):
        views = tb.tta_views(x, level)
        assert sum(w for _, w in views) == pytest.approx(1.0) and all(v.shape == x.shape for v, _ in views)
    shifted = tb.tta_views(x, 2)[2][0]
    torch.testing.assert_close(shifted[:, :, 1:, 1:], x[:, :, :-1, :-1])  # one pixel down-right content shift

    class Mean(torch.nn.Module):  # invariant to flips and shifts up to the reflected border
        def forward(self, v):
            return v.mean((2, 3))[:, :1].repeat(1, 10)
    model = Mean()
    torch.testing.assert_close(tb.predict(model, x, "fp32", torch.device("cpu"), tta=1),
                               tb.predict(model, x, "fp32", torch.device("cpu"), tta=0))


def test_resnet9_tricks_whitening_keeps_large_directions_and_damps_small_ones():
    """With eps, the whitened patch covariance is diag(lambda / (lambda + eps)) over the patch covariance's
    eigenvalues: ~1 where the data varies, < 1 where it barely does (float64 reference)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, 3, 10, 10, generator=gen)
    x = x + 0.8 * x.roll(1, dims=2) + 0.5 * x.roll(1, dims=1)  # correlated neighbours and channels
    net = tb.ResNet9Tricks((8, 8, 8, 8))
    net.init_whitening(x)
    w = net.whiten.weight.double()
    assert w.shape == (27, 3, 3, 3) and not net.whiten.weight.requires_grad
    patches = x.double().unfold(2, 3, 1).unfold(3, 3, 1).permute(0, 2, 3, 1, 4, 5).reshape(-1, 27)
    patches = patches - patches.mean(0)
    lam = torch.linalg.eigvalsh(patches.T @ patches / len(patches))
    out = torch.nn.functional.conv2d(x.double(), w).permute(0, 2, 3, 1).reshape(-1, 27)
    out = out - out.mean(0)
    cov = out.T @ out / len(out)
    torch.testing.assert_close(torch.sort(torch.diag(cov)).values, torch.sort(lam / (lam + 1e-2)).values,
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(cov - torch.diag(torch.diag(cov)), torch.zeros(27, 27, dtype=torch.float64),
                               atol=1e-6, rtol=0)


def test_resnet9_tricks_has_resnet9_size_frozen_bn_scales_and_pools_before_bn():
    net = tb.ResNet9Tricks()
    # the 1x1 prep conv on 27 whitened channels has as many weights as resnet9's 3x3 prep conv on RGB
    assert sum(p.numel() for p in net.parameters()) == 6_573_120 + 27 * 27
    frozen_bn_scales = 64 + 3 * 128 + 256 + 3 * 512
    assert sum(p.numel() for p in net.parameters() if p.requires_grad) == 6_573_120 - frozen_bn_scales
    pooled = [b for b in net.modules() if isinstance(b, torch.nn.Sequential) and len(b) == 4]
    assert len(pooled) == 3
    for b in pooled:
        assert [type(m) for m in b] == [torch.nn.Conv2d, torch.nn.MaxPool2d, torch.nn.BatchNorm2d, torch.nn.CELU]
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)
