import numpy as np
import pytest
import torch
import torch.nn.functional as F

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


def dawnbench_resnet18_params(prep_bn_relu, widths=(64, 128, 256, 256)):
    """Parameter count of the DAWNBench ResNet-18 from its description (bkj/basenet, 2018)."""
    n = 3 * widths[0] * 9 + (2 * widths[0] if prep_bn_relu else 0)
    c_in = widths[0]
    for stage, w in enumerate(widths):
        for j in range(2):
            projection = (stage > 0 and j == 0) or c_in != w  # stride 2, or a change of width
            n += 2 * c_in + c_in * w * 9 + 2 * w + w * w * 9 + (c_in * w if projection else 0)
            c_in = w
    return n + 2 * c_in * 10 + 10


@pytest.mark.parametrize("make, params", [
    (lambda: tb.resnet9(), 6_573_120),            # Myrtle's ResNet-9
    (lambda: tb.preact_resnet18(True), dawnbench_resnet18_params(True)),
    (lambda: tb.preact_resnet18(False), dawnbench_resnet18_params(False)),
])
def test_reference_nets_have_their_published_size(make, params):
    net = make()
    assert sum(p.numel() for p in net.parameters()) == params
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("prep_bn_relu", [True, False])
def test_preact_resnet18_computes_the_dawnbench_net(prep_bn_relu):
    """Forward pass against a functional reference of the DAWNBench ResNet-18: prep conv (+ BN-ReLU), blocks whose
    projection shortcut reads the pre-activated input, average and max pooling concatenated, linear head."""
    torch.manual_seed(0)
    widths = (4, 6, 8, 8)
    net = tb.preact_resnet18(prep_bn_relu, widths).double()
    for m in net.modules():  # non-trivial BN affine parameters, so a misplaced BN shows
        if isinstance(m, torch.nn.BatchNorm2d):
            torch.nn.init.uniform_(m.weight, 0.5, 1.5), torch.nn.init.uniform_(m.bias, -0.5, 0.5)
    x = torch.randn(5, 3, 16, 16, dtype=torch.float64)

    def bn_relu(bn, t):
        return F.relu(F.batch_norm(t, None, None, bn.weight, bn.bias, training=True))

    mods = list(net)
    t = F.conv2d(x, mods[0].weight, padding=1)
    rest = mods[1:]
    if prep_bn_relu:
        t, rest = bn_relu(mods[1], t), mods[3:]
    blocks, linear = rest[:8], rest[-1]
    strides = [1, 1, 2, 1, 2, 1, 2, 1]
    for b, s in zip(blocks, strides):
        a = bn_relu(b.bn1, t)
        skip = t if b.shortcut is None else F.conv2d(a, b.shortcut.weight, stride=s)
        h = F.conv2d(a, b.conv1.weight, stride=s, padding=1)
        t = skip + F.conv2d(bn_relu(b.bn2, h), b.conv2.weight, padding=1)
    pooled = torch.cat([t.mean((2, 3)), t.amax((2, 3))], 1)
    want = F.linear(pooled, linear.weight, linear.bias)
    assert [b.shortcut is not None for b in blocks] == [False, False, True, False, True, False, True, False]
    torch.testing.assert_close(net.train()(x), want)


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


@pytest.mark.parametrize("level", [1, 2])
def test_tta_averages_the_mirrored_and_shifted_views_image_by_image(level):
    """Against a per-image loop in numpy on a net that no flip or shift leaves alone (a linear map): level 1
    averages the image and its left-right mirror; level 2 gives those 1/4 each and 1/8 each to the mirrored pairs
    moved one pixel down-right and up-left, the uncovered border reflected (the test-time form of the crops)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10)).double()
    x = torch.randn(5, 3, 32, 32, dtype=torch.float64)
    got = tb.predict(model, x, "fp32", torch.device("cpu"), tta=level)
    weight, bias = model[1].weight.detach().numpy(), model[1].bias.detach().numpy()

    def logits(img):
        return weight @ img.reshape(-1) + bias

    def moved(img, dy, dx):  # content dy down, dx right; out[i, j] = img[i - dy, j - dx], reflected at the border
        padded = np.pad(img, ((0, 0), (1, 1), (1, 1)), mode="reflect")
        return padded[:, 1 - dy:33 - dy, 1 - dx:33 - dx]
    for i, img in enumerate(x.numpy()):
        pair = [(img, img[:, :, ::-1])]
        if level == 2:
            pair += [(moved(img, d, d), moved(img, d, d)[:, :, ::-1]) for d in (1, -1)]
        weights = [0.5] if level == 1 else [0.25, 0.125, 0.125]
        want = sum(w * (logits(a) + logits(b)) for w, (a, b) in zip(weights, pair))
        np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("level", [1, 2])
def test_selective_tta_matches_a_per_image_choice_between_plain_and_full_tta(level):
    """tta_confidence c: an image whose plain top softmax probability is below c gets the full TTA average, the
    others their plain logits; checked image by image against predict without it, in float64."""
    torch.manual_seed(0)
    model = tb.FastNet((8, 16, 16)).double().eval()
    for m in model.modules():  # BN statistics that are not the identity, so eval mode matters
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    model.head.weight.data *= 40  # spread the confidences over (0.1, 1)
    x = torch.randn(50, 3, 32, 32, dtype=torch.float64)
    cpu = torch.device("cpu")
    plain = tb.predict(model, x, "fp32", cpu, batch_size=7)
    full = tb.predict(model, x, "fp32", cpu, batch_size=7, tta=level)
    top = plain.softmax(1).amax(1)
    c = top.median().item()
    got = tb.predict(model, x, "fp32", cpu, batch_size=7, tta=level, tta_confidence=c)
    unsure = top < c
    assert 0 < unsure.sum() < len(x)
    for i in range(len(x)):
        torch.testing.assert_close(got[i], full[i] if unsure[i] else plain[i])
    # at 1, every image short of certainty takes the full TTA
    torch.testing.assert_close(tb.predict(model, x, "fp32", cpu, tta=level, tta_confidence=1.0), full)


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
        assert [type(m) for m in b] == [tb.Conv2d, torch.nn.MaxPool2d, torch.nn.BatchNorm2d, torch.nn.CELU]
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_shifted_moves_content_and_reflects_the_border_as_a_per_pixel_loop():
    x = torch.randn(2, 3, 6, 5)

    def reflect(i, n):  # index into a reflect-padded axis, as F.pad's "reflect" (no edge repeat)
        return -i if i < 0 else 2 * (n - 1) - i if i >= n else i
    for dy, dx in [(1, 1), (-1, -1), (1, -1), (0, 1), (-2, 0), (2, 2)]:
        want = torch.empty_like(x)
        for i in range(6):
            for j in range(5):
                want[:, :, i, j] = x[:, :, reflect(i - dy, 6), reflect(j - dx, 5)]
        torch.testing.assert_close(tb.shifted(x, dy, dx), want, rtol=0, atol=0)
    assert tb.shifted(x, 0, 0) is x


def test_shifted_views_weights_and_the_6_views_of_tta_2():
    x = torch.randn(2, 3, 8, 8)
    for shifts, centre in [([(1, 1)], 0.5), ([(1, 1), (-1, 0), (0, 2)], 0.2)]:
        views = tb.shifted_views(x, shifts, centre)
        assert len(views) == 2 + 2 * len(shifts) and sum(w for _, w in views) == pytest.approx(1.0)
        assert views[0][1] + views[1][1] == pytest.approx(centre)
    want = [x, x.flip(3), tb.shifted(x, 1, 1), tb.shifted(x, 1, 1).flip(3), tb.shifted(x, -1, -1),
            tb.shifted(x, -1, -1).flip(3)]
    got = tb.tta_views(x, 2)
    assert [w for _, w in got] == [0.25, 0.25, 0.125, 0.125, 0.125, 0.125]
    for (v, _), w in zip(got, want):
        torch.testing.assert_close(v, w, rtol=0, atol=0)


@pytest.mark.parametrize("side", [2, 3, 4])  # fast94's last maps at 20-24 px and at 32 px, resnet9's
def test_global_max_pool_takes_each_maps_max_and_routes_its_gradient_there(side):
    """Against a per-map loop in float64: the output is each map's largest value, and the gradient reaches only
    that position (the first of equal ones)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, side, side, generator=gen, dtype=torch.float64)
    x[0, 0] = 1.0  # a tie: the gradient goes to the first position in row-major order, as max_pool2d's does
    x.requires_grad_(True)
    grad_out = torch.randn(5, 4, 1, 1, generator=gen, dtype=torch.float64)
    out = tb.global_max_pool(x)
    out.backward(grad_out)
    for n in range(5):
        for c in range(4):
            flat = x[n, c].detach().flatten()
            first = int(torch.argmax((flat == flat.max()).int()))
            assert out[n, c, 0, 0] == flat.max()
            expected = torch.zeros_like(flat)
            expected[first] = grad_out[n, c, 0, 0]
            assert torch.equal(x.grad[n, c].flatten(), expected)


@pytest.mark.parametrize("depth", [2, 3])
def test_fastnet_block_convs_start_as_identity_maps(depth):
    """Each block conv's first c_in filters are dirac kernels (output channel k copies input channel k); the
    filters beyond them keep PyTorch's random init (a widening conv would otherwise start with dead channels)."""
    torch.manual_seed(0)
    net = tb.FastNet((32, 48, 48), depth=depth)
    convs = [m for m in net.blocks.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 3 * depth
    for conv in convs:
        c_out, c_in = conv.weight.shape[:2]
        want = torch.zeros(min(c_out, c_in), c_in, 3, 3)
        for k in range(min(c_out, c_in)):
            want[k, k, 1, 1] = 1.0
        assert torch.equal(conv.weight.detach()[:min(c_out, c_in)], want)
        for row in conv.weight.detach()[c_in:]:
            bound = 1 / (c_in * 9) ** 0.5  # kaiming_uniform(a=sqrt(5))'s
            assert row.abs().max() <= bound and row.std() > bound / 3
    assert any(conv.weight.shape[0] > conv.weight.shape[1] for conv in convs)


@pytest.mark.parametrize("momentum, depth", [(0.4, 2), (0.1, 3)])  # fast94's nets, fast96's
def test_fastnet_bn_running_means_use_its_momentum_and_logits_are_a_ninth_of_the_head(momentum, depth):
    """One train-mode step moves each BN running mean by the momentum passed in, (1 - m) old + m batch mean,
    and the logits are 1/9 of the linear head on the per-channel max of the last maps (float64, by hand)."""
    torch.manual_seed(0)
    net = tb.FastNet((8, 16, 16), bn_momentum=momentum, depth=depth).double().train()
    bns = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    seen = {}
    for bn in bns:
        bn.running_mean.uniform_(-1, 1)
        bn.register_forward_pre_hook(lambda m, args: seen.__setitem__(m, args[0].detach().clone()))
    old = [bn.running_mean.clone() for bn in bns]
    maps = []
    net.blocks.register_forward_hook(lambda m, args, out: maps.append(out.detach()))
    logits = net(torch.randn(6, 3, 16, 16, dtype=torch.float64))
    assert len(seen) == len(bns) == 3 * depth
    for bn, before in zip(bns, old):
        torch.testing.assert_close(bn.running_mean, (1 - momentum) * before + momentum * seen[bn].mean((0, 2, 3)))
    features = maps[0].amax((2, 3))
    torch.testing.assert_close(logits, features @ net.head.weight.detach().T / 9)


@pytest.mark.parametrize("training", [True, False])
def test_predict_evaluates_in_eval_mode_and_leaves_the_mode_as_it_was(training):
    """predict evaluates in eval mode, then leaves a net that was training in train mode (and one in eval mode,
    as an API user's, in eval mode), on every path of it."""
    torch.manual_seed(0)
    model = tb.FastNet((4, 8, 8), whiten_width=6)
    x = torch.randn(4, 3, 16, 16)
    for tta, confidence in [(0, 0.0), (1, 0.0), (1, 1.0)]:  # plain, full TTA, selective TTA (confident_tta)
        model.train(training)
        modes = []
        hook = model.register_forward_pre_hook(lambda m, args: modes.append(m.training))
        tb.predict(model, x, "fp32", torch.device("cpu"), tta=tta, tta_confidence=confidence)
        hook.remove()
        assert modes and not any(modes)  # evaluated with BN running statistics
        assert all(m.training == training for m in model.modules())


@pytest.mark.parametrize("depth", [2, 3])
def test_fastnet_computes_the_airbench_net(depth):
    """Forward pass (train mode) against a float64 functional reference of airbench's net: whitening conv, GELU,
    then per block conv, max-pool 2, BN (eps 1e-12), GELU, conv, BN, GELU (depth 3: GELU(x + BN(conv(GELU(BN(conv
    (x))))))) over the last two convs), the per-channel max of the last maps and the head scaled by 1/9."""
    torch.manual_seed(0)
    net = tb.FastNet((4, 6, 6), whiten_width=8, depth=depth).double().train()
    for m in net.modules():  # non-trivial BN shifts, a whitening bias, so a misplaced GELU or pool shows
        if isinstance(m, torch.nn.BatchNorm2d):
            torch.nn.init.uniform_(m.bias, -0.5, 0.5)
    torch.nn.init.uniform_(net.whiten.bias, -0.5, 0.5)
    x = torch.randn(4, 3, 17, 17, dtype=torch.float64)

    def bn(t, m):
        return F.batch_norm(t, None, None, m.weight, m.bias, training=True, eps=1e-12)

    convs = [m for m in net.blocks.modules() if isinstance(m, torch.nn.Conv2d)]
    bns = [m for m in net.blocks.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    t = F.gelu(F.conv2d(x, net.whiten.weight, net.whiten.bias))
    for b in range(3):
        c, n = convs[depth * b:depth * b + depth], bns[depth * b:depth * b + depth]
        t = F.gelu(bn(F.max_pool2d(F.conv2d(t, c[0].weight, padding=1), 2), n[0]))
        h = F.gelu(bn(F.conv2d(t, c[1].weight, padding=1), n[1]))
        t = h if depth == 2 else F.gelu(t + bn(F.conv2d(h, c[2].weight, padding=1), n[2]))
    want = t.amax((2, 3)) @ net.head.weight.T / 9
    torch.testing.assert_close(net(x), want)


def test_fastnet_whitening_uses_airbenchs_eps_and_starts_with_zero_bias():
    """FastNet's 2x2 whitening takes airbench's eps 5e-4: the whitened patch covariance is diag(lambda / (lambda +
    5e-4)) over the patch covariance's eigenvalues (float64 reference; data scaled so that eps matters), its 12
    filters then their negatives; the bias, whatever it was, starts at 0."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(300, 3, 9, 9, generator=gen)
    x = 0.02 * (x + 0.8 * x.roll(1, dims=3) + 0.5 * x.roll(1, dims=1))  # eigenvalues ~3e-4 .. 2e-3
    net = tb.FastNet((4, 6, 6))
    net.whiten.bias.data.fill_(0.7)
    net.init_whitening(x)
    w = net.whiten.weight.double()
    assert w.shape == (24, 3, 2, 2) and torch.equal(net.whiten.bias, torch.zeros(24))
    torch.testing.assert_close(w[12:], -w[:12])
    patches = x.double().unfold(2, 2, 1).unfold(3, 2, 1).permute(0, 2, 3, 1, 4, 5).reshape(-1, 12)
    patches = patches - patches.mean(0)
    lam = torch.linalg.eigvalsh(patches.T @ patches / len(patches))
    assert lam.min() < 5e-4 < lam.max()
    out = F.conv2d(x.double(), w[:12]).permute(0, 2, 3, 1).reshape(-1, 12)
    out = out - out.mean(0)
    cov = out.T @ out / len(out)
    torch.testing.assert_close(cov, torch.diag(lam / (lam + 5e-4)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("make, scale", [(lambda: tb.resnet9((4, 4, 8, 8)), 1 / 8),
                                         (lambda: tb.ResNet9Tricks((4, 4, 8, 8)), 1 / 16)])
def test_myrtle_nets_scale_the_head_and_tricks_uses_celu_alpha_0_3(make, scale):
    """Myrtle's logits: the linear head on the per-channel max of the last maps times 1/8 (resnet9), 1/16 for the
    bag-of-tricks net, whose activations are CELU(alpha=0.3): x where x > 0, else 0.3 (exp(x / 0.3) - 1)
    (float64, written out)."""
    torch.manual_seed(0)
    net = make().double()
    seen = []
    for m in net.modules():
        if isinstance(m, (tb.GlobalMaxPool, torch.nn.CELU)):
            m.register_forward_hook(lambda m, args, out: seen.append((m, args[0].detach(), out.detach())))
    logits = net(torch.randn(3, 3, 32, 32, dtype=torch.float64))
    (_, maps, _), = [s for s in seen if isinstance(s[0], tb.GlobalMaxPool)]
    head = [m for m in net.modules() if isinstance(m, torch.nn.Linear)][0]
    torch.testing.assert_close(logits, maps.amax((2, 3)) @ head.weight.detach().T * scale)
    celus = [(x, out) for m, x, out in seen if isinstance(m, torch.nn.CELU)]
    assert len(celus) == (8 if isinstance(net, tb.ResNet9Tricks) else 0)
    for x, out in celus:
        torch.testing.assert_close(out, torch.where(x > 0, x, 0.3 * torch.expm1(x / 0.3)))
