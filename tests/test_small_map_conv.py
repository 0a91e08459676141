"""The matmul convolution for small maps (tb.SmallMapConv, tb.Conv2d) against PyTorch's own conv."""
from unittest import mock

import itertools

import pytest
import torch
import torch.nn.functional as F

import torch_backend as tb
import train_cifar
from conftest import synthetic


def reference(x, w):
    """Output and gradients of F.conv2d with 'same' zero padding, for the loss sum(y * probe)."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = F.conv2d(x, w, padding=w.shape[2] // 2)
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    (y * probe).sum().backward()
    return y, x.grad, w.grad, probe


ALL_KERNEL_CHOICES = list(itertools.product([False, True], repeat=3))  # (fwd, dgrad, wgrad by matmul)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("by_matmul", ALL_KERNEL_CHOICES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_small_map_conv_matches_conv2d_in_float64(k, by_matmul, channels_last):
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(3, 5, 6, 4, generator=gen, dtype=torch.float64)  # a non-square map, 5 -> 7 channels
    w = torch.randn(7, 5, k, k, generator=gen, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y_ref, gx_ref, gw_ref, probe = reference(x, w)
    xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = tb.SmallMapConv.apply(xs, ws, *by_matmul)
    (y * probe).sum().backward()
    for got, want in ((y, y_ref), (xs.grad, gx_ref), (ws.grad, gw_ref)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("by_matmul", ALL_KERNEL_CHOICES)
def test_small_map_conv_passes_gradcheck(by_matmul):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: tb.SmallMapConv.apply(a, b, *by_matmul), (x, w))


@pytest.mark.parametrize("by_matmul", ALL_KERNEL_CHOICES)
def test_small_map_conv_runs_each_pass_by_the_kernel_it_is_told(by_matmul):
    """Each pass calls the matmul where its flag says so and PyTorch's kernel otherwise, and nothing else."""
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    spies = {name: mock.patch.object(tb, fn, wraps=getattr(tb, fn)) for name, fn in (
        ("fwd", "matmul_conv"), ("dgrad", "matmul_conv_input_grad"), ("wgrad", "matmul_conv_weight_grad"))}
    with spies["fwd"] as fwd, spies["dgrad"] as dgrad, spies["wgrad"] as wgrad:
        tb.SmallMapConv.apply(x, w, *by_matmul).sum().backward()
        # (the input gradient's matmul is itself a matmul_conv of the flipped filters)
        assert (fwd.call_count, dgrad.call_count, wgrad.call_count) == (
            by_matmul[0] + by_matmul[1], by_matmul[1], by_matmul[2])


def layer_and_copy(c_in, c_out, matmul):
    conv = tb.Conv2d(c_in, c_out, 3, padding=1, bias=False)
    conv.cpu_kernels = "matmul" if matmul else "onednn"
    plain = torch.nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
    plain.load_state_dict(conv.state_dict())
    return conv, plain


@pytest.mark.parametrize("size, path", [(3, (True,) * 3), (4, (True,) * 3), (7, (False, False, True)),
                                        (8, (False, False, True)), (9, None), (16, None)])
def test_conv2d_takes_the_matmul_only_on_small_maps_in_bf16(size, path):
    conv, _ = layer_and_copy(8, 8, matmul=True)
    x = torch.randn(2, 8, size, size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert conv.small_map_mode(x) == path
    assert conv.small_map_mode(x) is None  # fp32: not measured faster, so PyTorch's own kernels
    conv.cpu_kernels = "onednn"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert conv.small_map_mode(x) is None
    strided = tb.Conv2d(8, 8, 3, stride=2, padding=1, bias=False)
    reflected = tb.Conv2d(8, 8, 3, padding=1, bias=False, padding_mode="reflect")  # the matmuls pad with zeros
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert strided.small_map_mode(x) is None and reflected.small_map_mode(x) is None


@pytest.mark.parametrize("size", [3, 8])
def test_conv2d_under_bf16_autocast_agrees_with_nn_conv2d(size):
    """Same output and gradients (fp32 for the parameter) as nn.Conv2d within bf16 rounding, via SmallMapConv."""
    torch.manual_seed(0)
    conv, plain = layer_and_copy(32, 48, matmul=True)
    x = torch.randn(16, 32, size, size).contiguous(memory_format=torch.channels_last)
    results = []
    for layer in (conv, plain):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(xi)
        (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append((y.float(), xi.grad, layer.weight.grad))
    with mock.patch.object(tb.SmallMapConv, "apply", side_effect=AssertionError("matmul path not taken")):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain(x)  # nn.Conv2d never goes through it ...
        with pytest.raises(AssertionError, match="not taken"), torch.autocast("cpu", dtype=torch.bfloat16):
            conv(x)  # ... tb.Conv2d does, on this map
    assert results[0][2].dtype == torch.float32
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())


def test_cpu_conv_onednn_is_exactly_nn_conv2d():
    conv, plain = layer_and_copy(16, 16, matmul=False)
    x = torch.randn(4, 16, 4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(conv(x), plain(x))


def test_build_model_sets_the_cpu_conv_mode_and_the_flop_count_stays():
    """Both modes build the same net, count the same training FLOPs (the matmuls are the conv's sums) and train
    to the same loss within bf16 rounding."""
    losses, flops = {}, {}
    for mode in ("matmul", "onednn"):
        cfg = train_cifar.make_config("fast94", cpu_conv=mode, widths=(16, 32, 32))
        torch.manual_seed(0)
        model = train_cifar.build_model(cfg, torch.device("cpu"))
        convs = [m for m in model.modules() if isinstance(m, tb.Conv2d)]
        assert convs and all(m.cpu_kernels == mode for m in convs)
        opt = train_cifar.make_optimizer(cfg, model)
        flops[mode] = train_cifar.step_flops(model, opt, torch.device("cpu"), "bf16", 8)
        x = torch.randn(8, 3, 32, 32).contiguous(memory_format=torch.channels_last)
        y = torch.arange(8) % 10
        losses[mode] = [train_cifar.train_step(cfg, model, opt, x, y, "bf16", torch.device("cpu"))[1].item()
                        for _ in range(3)]
    assert flops["matmul"] == flops["onednn"] > 0
    assert losses["matmul"] == pytest.approx(losses["onednn"], rel=2e-2)


def test_unknown_cpu_conv_mode_is_refused():
    with pytest.raises(ValueError, match="cpu-conv must be one of"):
        train_cifar.check_config(train_cifar.make_config("fast94", cpu_conv="winograd"))


def test_auto_cpu_conv_is_tuned_and_build_model_sets_every_conv():
    assert tb.resolve_cpu_conv("auto") == "tuned"
    assert [tb.resolve_cpu_conv(m) for m in ("tuned", "matmul", "onednn")] == ["tuned", "matmul", "onednn"]
    model = train_cifar.build_model(train_cifar.make_config("fast94", widths=(16, 32, 32)), torch.device("cpu"))
    convs = [m for m in model.modules() if isinstance(m, tb.Conv2d)]
    assert convs and all(m.cpu_kernels == "tuned" for m in convs)


@pytest.fixture
def no_tuned_kernels():
    tb.forget_tuned_kernels()
    yield
    tb.forget_tuned_kernels()


def fake_timer(matmul_share):
    """A timer for tune_small_map_convs: oneDNN's call takes 1 s, the matmul's matmul_share[pass] s."""
    def timer(fns, repeats):
        names = [fn.__name__.split("_") for fn in fns]
        return [matmul_share.get(name, 1.0) if kernel == "matmul" else 1.0 for name, kernel in names]
    return timer


def test_tuning_keeps_the_matmul_only_where_it_is_clearly_faster(no_tuned_kernels):
    key = (4, 8, 3, 3, 8, 3)
    timings = tb.tune_small_map_convs([key], repeats=1, timer=fake_timer(dict(fwd=0.5, dgrad=0.95, wgrad=1.5)))
    assert timings == {key: dict(fwd=(1.0, 0.5), dgrad=(1.0, 0.95), wgrad=(1.0, 1.5))}
    assert tb.tuned_kernels() == {"4x8x3x3->8 k3": "fwd matmul, dgrad onednn, wgrad onednn"}  # (0.95: a near-tie)
    # a shape tuned once is not timed again
    assert tb.tune_small_map_convs([key], timer=lambda fns, r: pytest.fail("timed twice")) == {}


def test_a_tuned_conv_records_its_shapes_takes_the_tuned_kernels_and_else_the_fixed_rule(no_tuned_kernels):
    conv, plain = layer_and_copy(8, 8, matmul=True)
    conv.cpu_kernels = "tuned"
    small, other = torch.randn(4, 8, 3, 3), torch.randn(2, 8, 4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with tb.recording_small_map_shapes() as seen:
            assert conv.small_map_mode(small) == (True, True, True)  # not tuned yet: the fixed rule
            conv.small_map_mode(torch.randn(2, 8, 16, 16))  # too large a map to be worth timing
        assert seen == {(4, 8, 3, 3, 8, 3)}
        tb.tune_small_map_convs(seen, timer=fake_timer(dict(fwd=2.0, dgrad=2.0, wgrad=0.5)))
        assert conv.small_map_mode(small) == (False, False, True)
        assert conv.small_map_mode(other) == (True, True, True)
        # the same conv at a batch size not tuned (an evaluation's): as tuned at the nearest batch size
        tb.tune_small_map_convs([(9, 8, 3, 3, 8, 3)], timer=fake_timer(dict(fwd=0.5)))
        assert conv.small_map_mode(torch.randn(2, 8, 3, 3)) == (False, False, True)
        assert conv.small_map_mode(torch.randn(8, 8, 3, 3)) == (True, False, False)
        tb.tune_small_map_convs([(2, 8, 4, 4, 8, 3)], timer=fake_timer({}))  # oneDNN's faster in every pass
        assert conv.small_map_mode(other) is None  # so plain nn.Conv2d
        with mock.patch.object(tb.SmallMapConv, "apply", side_effect=AssertionError("matmul path taken")):
            assert torch.equal(conv(other), plain(other))
    with torch.autocast("cpu", dtype=torch.bfloat16), tb.recording_small_map_shapes() as seen:
        conv.small_map_mode(small)
    assert seen == set()  # tuned already


def test_timing_alternates_the_kernels_and_keeps_each_ones_fastest_call():
    clock, order = [0.0], []
    seconds = dict(a=[9, 3, 5, 4], b=[9, 6, 2, 7])  # each kernel's calls: the warm-up's, then each repeat's

    def kernel(name):
        def call():
            order.append(name)
            clock[0] += seconds[name][order.count(name) - 1]
        return call
    assert tb.time_conv_pass([kernel("a"), kernel("b")], repeats=3, clock=lambda: clock[0]) == [3, 2]
    assert order == ["a", "b"] * 4


def test_tuning_times_the_real_kernels_on_the_conv_shape(no_tuned_kernels):
    """Each timed call computes its pass of a conv of that shape, oneDNN's and the matmul's alike."""
    results = {}

    def timer(fns, repeats):
        results.setdefault("calls", []).extend(fn() for fn in fns)
        return [1.0] * len(fns)
    tb.tune_small_map_convs([(2, 4, 3, 3, 6, 3)], timer=timer)
    shapes = [tuple(r.shape) for r in results["calls"]]
    assert shapes == [(2, 6, 3, 3)] * 2 + [(2, 4, 3, 3)] * 2 + [(6, 4, 3, 3)] * 2
    for onednn, matmul in zip(results["calls"][::2], results["calls"][1::2]):
        torch.testing.assert_close(matmul.float(), onednn.float(), rtol=0, atol=5e-2 * onednn.float().abs().max())


def test_a_cpu_run_tunes_its_convs_before_the_timer_and_logs_the_choices(no_tuned_kernels, monkeypatch):
    data = synthetic(64, 32)
    tuned = []
    monkeypatch.setattr(tb, "time_conv_pass", lambda fns, repeats: [1.0] * len(fns))
    real_tune = tb.tune_small_map_convs
    monkeypatch.setattr(tb, "tune_small_map_convs", lambda keys, **kw: tuned.append(set(keys)) or real_tune(
        keys, timer=fake_timer(dict(wgrad=0.1))))
    lines = []
    summary = train_cifar.train("fast94", data=data, device="cpu", log=lines.append, log_dir=None,
                                widths=(8, 16, 16), batch_size=32, epochs=1, train_sizes=(), precision="bf16")
    # 32 px: blocks at 15, 7 and 3 px; the 7x7 and 3x3 convs of the last two blocks are small enough
    assert tuned == [{(32, 16, 7, 7, 16, 3), (32, 16, 3, 3, 16, 3)}]
    assert summary["config"]["cpu_conv"] == "tuned"
    assert summary["cpu_conv_kernels"] == {"32x16x3x3->16 k3": "fwd onednn, dgrad onednn, wgrad matmul",
                                           "32x16x7x7->16 k3": "fwd onednn, dgrad onednn, wgrad matmul"}
    assert any(line.startswith("cpu-conv tuned: 2 small-map conv shapes") for line in lines)


def test_a_run_logs_the_cpu_conv_kernels_it_took(tmp_path):
    """--cpu-conv auto is resolved before the run, so the logged config names the kernels, not 'auto'."""
    data = synthetic(64, 32)
    for mode, logged in (("auto", "tuned"), ("matmul", "matmul"), ("onednn", "onednn")):
        summary = train_cifar.train("fast94", data=data, device="cpu", log=lambda *a: None, log_dir=None,
                                    widths=(8, 16, 16), batch_size=32, epochs=1, train_sizes=(), precision="fp32",
                                    cpu_conv=mode)
        assert summary["config"]["cpu_conv"] == logged
        assert summary.get("cpu_conv_kernels") == ({} if logged == "tuned" else None)  # fp32: nothing to tune


def test_a_gpu_run_logs_cpu_conv_as_given():
    """On a GPU the option does nothing (PyTorch's kernels run), so its log must not name the host CPU's choice:
    the H200 logs of 2026-12-04 said 'matmul'."""
    assert train_cifar.logged_cpu_conv("auto", torch.device("cpu")) == "tuned"
    for mode in tb.CPU_CONV_MODES:
        assert train_cifar.logged_cpu_conv(mode, torch.device("cuda:0")) == mode


def test_a_resumed_tuned_run_keeps_the_kernels_it_was_tuned_with(no_tuned_kernels, monkeypatch, tmp_path):
    """A run stopped after epoch 1 and resumed where the tuning would choose otherwise ends with the weights of
    the run uninterrupted (the matmul and oneDNN's kernels round differently in bf16) and logs the kernels it
    ran."""
    data = synthetic(64, 32)
    matmul_share = {}  # the fake timings: empty, oneDNN's kernels win every pass
    real_tune = tb.tune_small_map_convs
    monkeypatch.setattr(tb, "tune_small_map_convs", lambda keys, **kw: real_tune(keys, timer=fake_timer(matmul_share)))

    def run(share, checkpoint, **options):
        """The net's final weights (from its checkpoint), the logged kernels and the console lines."""
        tb.forget_tuned_kernels()  # each invocation a fresh process
        matmul_share.clear()
        matmul_share.update(share)
        lines = []
        summary = train_cifar.train("fast94", data=data, device="cpu", log=lines.append, log_dir=None,
                                    widths=(8, 32, 32), batch_size=32, epochs=2, train_sizes=(), precision="bf16",
                                    checkpoint=str(tmp_path / checkpoint), **options)
        return torch.load(tmp_path / checkpoint, weights_only=False)["model"], summary["cpu_conv_kernels"], lines
    by_matmul = dict(fwd=0.1, dgrad=0.1, wgrad=0.1)
    full, full_kernels, _ = run(by_matmul, "full.pt")
    run(by_matmul, "run.pt", stop_after_epochs=1)
    resumed, kernels, lines = run({}, "run.pt")
    by_onednn, onednn_kernels, _ = run({}, "onednn.pt")
    assert all(torch.equal(resumed[k], full[k]) for k in full)
    assert not all(torch.equal(by_onednn[k], full[k]) for k in full)
    assert kernels == full_kernels != onednn_kernels
    assert set(full_kernels.values()) == {"fwd matmul, dgrad matmul, wgrad matmul"}
    assert any(line.startswith("cpu-conv: 2 small-map conv shape(s) keep the kernels") for line in lines)
