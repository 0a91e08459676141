"""The matmul convolution for small maps (tb.SmallMapConv, tb.Conv2d) against PyTorch's own conv."""
from unittest import mock

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


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("forward_by_matmul", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_small_map_conv_matches_conv2d_in_float64(k, forward_by_matmul, channels_last):
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(3, 5, 6, 4, generator=gen, dtype=torch.float64)  # a non-square map, 5 -> 7 channels
    w = torch.randn(7, 5, k, k, generator=gen, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y_ref, gx_ref, gw_ref, probe = reference(x, w)
    xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = tb.SmallMapConv.apply(xs, ws, forward_by_matmul)
    (y * probe).sum().backward()
    for got, want in ((y, y_ref), (xs.grad, gx_ref), (ws.grad, gw_ref)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_small_map_conv_passes_gradcheck():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    for forward_by_matmul in (False, True):
        assert torch.autograd.gradcheck(lambda a, b: tb.SmallMapConv.apply(a, b, forward_by_matmul), (x, w))


def layer_and_copy(c_in, c_out, matmul):
    conv = tb.Conv2d(c_in, c_out, 3, padding=1, bias=False)
    conv.matmul_small_maps = matmul
    plain = torch.nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
    plain.load_state_dict(conv.state_dict())
    return conv, plain


@pytest.mark.parametrize("size, path", [(3, (True,)), (4, (True,)), (7, (False,)), (8, (False,)), (9, None),
                                        (16, None)])
def test_conv2d_takes_the_matmul_only_on_small_maps_in_bf16(size, path):
    conv, _ = layer_and_copy(8, 8, matmul=True)
    x = torch.randn(2, 8, size, size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert conv.small_map_mode(x) == path
    assert conv.small_map_mode(x) is None  # fp32: not measured faster, so PyTorch's own kernels
    conv.matmul_small_maps = False
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
        assert convs and all(m.matmul_small_maps == (mode == "matmul") for m in convs)
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


@pytest.mark.parametrize("flags, kernels", [({"avx2", "avx512_bf16", "amx_bf16", "amx_tile"}, "matmul"),
                                            ({"avx2", "avx512f", "avx512_bf16"}, "onednn"),
                                            ({"avx2", "fma"}, "onednn"), (None, "onednn")])
def test_auto_cpu_conv_takes_the_matmuls_only_on_amx_cpus(flags, kernels):
    with mock.patch.object(tb, "cpu_flags", return_value=flags):
        assert tb.resolve_cpu_conv("auto") == kernels
        assert tb.resolve_cpu_conv("onednn") == "onednn" and tb.resolve_cpu_conv("matmul") == "matmul"
        model = train_cifar.build_model(train_cifar.make_config("fast94", widths=(16, 32, 32)), torch.device("cpu"))
    convs = [m for m in model.modules() if isinstance(m, tb.Conv2d)]
    assert convs and all(m.matmul_small_maps == (kernels == "matmul") for m in convs)


def test_a_run_logs_the_cpu_conv_kernels_it_took(tmp_path):
    """--cpu-conv auto is resolved before the run, so the logged config names the kernels, not 'auto'."""
    data = synthetic(64, 32)
    for flags, kernels in (({"amx_bf16"}, "matmul"), ({"avx512_bf16"}, "onednn")):
        with mock.patch.object(tb, "cpu_flags", return_value=flags):
            summary = train_cifar.train("fast94", data=data, device="cpu", log=lambda *a: None, log_dir=None,
                                        widths=(8, 16, 16), batch_size=32, epochs=1, train_sizes=(), precision="fp32")
        assert summary["config"]["cpu_conv"] == kernels


def test_a_gpu_run_logs_cpu_conv_as_given():
    """On a GPU the option does nothing (PyTorch's kernels run), so its log must not name the host CPU's choice:
    the H200 logs of 2026-12-04 said 'matmul'."""
    with mock.patch.object(tb, "cpu_flags", return_value={"amx_bf16"}):
        assert train_cifar.logged_cpu_conv("auto", torch.device("cpu")) == "matmul"
        for mode in tb.CPU_CONV_MODES:
            assert train_cifar.logged_cpu_conv(mode, torch.device("cuda:0")) == mode
