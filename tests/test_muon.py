"""The Muon optimizer (torch_backend.Muon) against float64 references of its formulas."""
import importlib

import numpy as np
import pytest
import torch

import torch_backend as tb
import train_cifar
from conftest import synthetic


def newton_schulz_reference(g, steps=5):
    """float64: the iteration acts on each singular value alone, so apply the scalar polynomial to the
    normalised singular values and put U and V back."""
    a, b, c = tb.NEWTON_SCHULZ_COEFFICIENTS
    u, s, vt = np.linalg.svd(np.asarray(g, dtype=np.float64), full_matrices=False)
    s = s / np.linalg.norm(g)
    for _ in range(steps):
        s = a * s + b * s ** 3 + c * s ** 5
    return (u * s) @ vt


@pytest.mark.parametrize("shape", [(16, 40), (40, 16), (24, 24), (64, 576)])
def test_newton_schulz_equals_the_singular_value_polynomial(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    out = tb.newton_schulz(g)
    assert out.shape == g.shape
    np.testing.assert_allclose(out.numpy(), newton_schulz_reference(g.numpy()), atol=2e-5)


def test_grouped_newton_schulz_equals_each_matrix_on_its_own():
    """Matrices of mixed shapes (wide, tall, square; fast94's filters are 64 x 216, 64 x 576, 256 x 576 and
    3 x 256 x 2304 here scaled down) orthogonalised in padded batches: each as the singular-value reference."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(8, 27), (8, 72), (32, 72), (32, 288), (32, 288), (40, 16), (24, 24), (16, 8)]
    mats = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]
    for m, o in zip(mats, tb.newton_schulz_grouped(mats, 3)):
        assert o.shape == m.shape
        np.testing.assert_allclose(o.numpy(), tb.newton_schulz(m, 3).numpy(), atol=1e-12)
        np.testing.assert_allclose(o.numpy(), newton_schulz_reference(m.numpy(), 3), atol=1e-7)  # eps: ~1e-9


def test_newton_schulz_pushes_singular_values_towards_one():
    # singular values 0.1 ... 10, so the smallest is 1/200 of the Frobenius norm: it ends near 0.7 like the rest;
    # one at 1/5000 of the norm grows ~480x in 5 steps and stays well below
    gen = torch.Generator().manual_seed(0)
    q1, _ = torch.linalg.qr(torch.randn(32, 32, generator=gen))
    q2, _ = torch.linalg.qr(torch.randn(96, 32, generator=gen))
    s = torch.linalg.svdvals(tb.newton_schulz((q1 * torch.logspace(-1, 1, 32)) @ q2.T))
    assert s.min() > 0.6 and s.max() < 1.25, s
    s = torch.linalg.svdvals(tb.newton_schulz((q1 * torch.logspace(-2.5, 1, 32)) @ q2.T))
    assert s.min() < 0.2 and s.max() < 1.25, s


def test_newton_schulz_is_muons_published_quintic():
    """The iteration is Muon's (Jordan et al. 2024; airbench94's record), a, b, c = 3.4445, -4.7750, 2.0315 written
    out here rather than read from the code: on a diagonal matrix each entry s / ||s|| goes through
    s <- a s + b s^3 + c s^5 five times (float64)."""
    s = torch.tensor([0.05, 0.3, 1.0, 2.0], dtype=torch.float64)
    want = s / torch.linalg.vector_norm(s)
    for _ in range(5):
        want = 3.4445 * want - 4.7750 * want ** 3 + 2.0315 * want ** 5
    torch.testing.assert_close(torch.diagonal(tb.newton_schulz(torch.diag(s))), want, atol=1e-6, rtol=0)  # eps: 2e-7


@pytest.mark.parametrize("grouped", [False, True])
def test_newton_schulz_of_a_zero_update_is_zero(grouped):
    """A filter whose update is all zeros (no loss flows through it) orthogonalises to zeros, not to 0/0's NaN,
    and a Muon step on a zero gradient leaves the weight where it was."""
    zeros = torch.zeros(4, 6)
    out = tb.newton_schulz_grouped([zeros, zeros.T], 3) if grouped else [tb.newton_schulz(zeros, 3)]
    assert all(torch.equal(o, torch.zeros_like(o)) for o in out)
    w = torch.nn.Parameter(torch.randn(4, 2, 3, 3, generator=torch.Generator().manual_seed(0)))
    w0 = w.detach().clone()
    opt = tb.Muon([dict(params=[w], orthogonalize=True, norm="sqrt_out", ns_steps=3)], lr=0.1, momentum=0.6)
    w.grad = torch.zeros_like(w)
    opt.step()
    torch.testing.assert_close(w.detach(), w0 * 2 / torch.linalg.vector_norm(w0))  # only held at sqrt(4)


def muon_reference(w0, grads, lr, momentum, nesterov, weight_decay, norm, ns_steps):
    """float64 Muon on one conv weight over a sequence of gradients."""
    w, buf = w0.astype(np.float64).copy(), None
    rows, cols = w.shape[0], w.size // w.shape[0]
    target = {"initial": np.linalg.norm(w0), "sqrt_out": np.sqrt(rows), "none": None}[norm]
    for g in grads:
        buf = g.copy() if buf is None else momentum * buf + g
        u = g + momentum * buf if nesterov else buf
        o = newton_schulz_reference(u.reshape(rows, cols), ns_steps).reshape(w.shape)
        w = w * (1 - lr * weight_decay) - lr * max(1.0, rows / cols) ** 0.5 * o
        if target is not None:
            w = w * target / np.linalg.norm(w)
    return w


@pytest.mark.parametrize("nesterov,norm,ns_steps,shape", [
    (True, "initial", 5, (8, 4, 3, 3)), (False, "none", 5, (64, 4, 1, 1)),
    (True, "sqrt_out", 3, (16, 4, 3, 3)),  # airbench94's Muon record: 3 steps, filters held at sqrt(out)
])
def test_muon_step_matches_the_float64_reference(nesterov, norm, ns_steps, shape):
    gen = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(*shape, generator=gen))
    w0 = w.detach().numpy().copy()
    grads = [torch.randn(*shape, generator=gen) for _ in range(4)]
    opt = tb.Muon([dict(params=[w], orthogonalize=True, norm=norm, ns_steps=ns_steps)], lr=0.05, momentum=0.6,
                  nesterov=nesterov, weight_decay=0.1)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    expected = muon_reference(w0, [g.numpy() for g in grads], 0.05, 0.6, nesterov, 0.1, norm, ns_steps)
    np.testing.assert_allclose(w.detach().numpy(), expected, atol=2e-5)


def test_muon_groups_without_orthogonalisation_are_exactly_sgd():
    gen = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)), torch.nn.Parameter(torch.randn(7, generator=gen))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    muon = tb.Muon(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    sgd = torch.optim.SGD(twins, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    for _ in range(3):
        for p, q in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        muon.step()
        sgd.step()
    for p, q in zip(params, twins):
        assert torch.equal(p, q)


def test_muon_update_flops_match_the_matmul_count():
    """Per Newton-Schulz step and matrix: the gram (r x c by c x r), its square, and that times the matrix; a
    matrix padded into a group with a longer one counts at the padded size, as computed."""
    w = torch.nn.Parameter(torch.zeros(16, 8, 3, 3))  # 16 x 72: gram 16x16
    opt = tb.Muon([dict(params=[w], orthogonalize=True), dict(params=[torch.nn.Parameter(torch.zeros(3))])], lr=0.1)
    r, c = 16, 72
    assert opt.update_flops() == 5 * (2 * r * r * c + 2 * r * r * r + 2 * r * r * c)
    padded = torch.nn.Parameter(torch.zeros(16, 4, 3, 3))  # 16 x 36, batched with the 16 x 72 one
    opt = tb.Muon([dict(params=[w, padded], orthogonalize=True, ns_steps=3)], lr=0.1)
    assert opt.update_flops() == 2 * 3 * (2 * r * r * c + 2 * r * r * r + 2 * r * r * c)


def test_train_with_muon_orthogonalises_the_filters_and_counts_their_flops():
    cfg = train_cifar.make_config("fast94", widths=(8, 16, 16))
    assert cfg["optimizer"] == "muon"  # the record recipe
    model = train_cifar.build_model(cfg, torch.device("cpu"))
    opt = train_cifar.make_optimizer(cfg, model)
    ortho = [g for g in opt.param_groups if g["orthogonalize"]]
    filters = [m.weight for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.weight.requires_grad]
    assert len(ortho) == 1 and len(ortho[0]["params"]) == len(filters) == 6
    assert ortho[0]["momentum"] == cfg["muon_momentum"] and ortho[0]["lr_scale"] == cfg["muon_lr_scale"]
    assert (ortho[0]["norm"], ortho[0]["ns_steps"]) == (cfg["muon_norm"], cfg["muon_ns_steps"])
    assert not any(p is model.whiten.weight for g in opt.param_groups for p in g["params"])  # frozen
    common = dict(data=synthetic(400, 100), widths=(8, 16, 16), epochs=2, batch_size=100, log=lambda *a: None)
    sgd = train_cifar.train("fast94", optimizer="sgd", **common)
    muon = train_cifar.train("fast94", **common)
    assert muon["train_flops_per_step"] - sgd["train_flops_per_step"] == opt.update_flops() > 0
    assert all(np.isfinite(r["accuracy"]) for r in muon["runs"])


def test_muon_options_are_checked():
    with pytest.raises(ValueError, match="muon-momentum"):
        train_cifar.make_config("fast94", optimizer="muon", muon_momentum=1.0)
    with pytest.raises(ValueError, match="optimizer must be"):
        train_cifar.make_config("fast94", optimizer="adam")
    with pytest.raises(ValueError, match="muon-norm must be one of none, initial, sqrt_out"):
        train_cifar.make_config("fast94", muon_norm="unit")
    with pytest.raises(ValueError, match="muon-ns-steps >= 1"):
        train_cifar.make_config("fast94", muon_ns_steps=0)


@pytest.mark.parametrize("momentum", [1.0, 1.5, -0.1])
def test_muon_refuses_momentum_outside_0_to_1(momentum):
    """The optimizer itself, not only the CLI, rejects momentum >= 1 (buffers never decay) or < 0."""
    w = torch.nn.Parameter(torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"momentum in \[0, 1\)"):
        tb.Muon([w], lr=0.1, momentum=momentum)
    tb.Muon([w], lr=0.1, momentum=0.0), tb.Muon([w], lr=0.1, momentum=0.99)  # the ends it accepts


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_muon_matches_eager_muon_without_recompiling(mode):
    """compiled=True: the same updates as the eager optimizer, each group one graph per set of trainable
    parameters, all built by warm_up, which leaves the weights and momentum buffers as they were (also after
    steps, with gradients present): changing LRs and a parameter that stops training (as fastnet's whitening
    bias) need no new graph. Under reduce-overhead (CUDA graphs on a GPU; here on the CPU inductor runs it
    without) the tensors the update changes in place or reads are marked as fixed addresses, else a GPU would
    skip the CUDA graph."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(8, 4, 3, 3), (16, 8, 3, 3)], [(10, 16), (8,), (5,)]

    def make(compiled):
        g = torch.Generator().manual_seed(4)
        filters = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes[0]]
        rest = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes[1]]
        opt = tb.Muon([dict(params=filters, orthogonalize=True, norm="sqrt_out", ns_steps=3, momentum=0.6),
                       dict(params=rest, weight_decay=0.01)], lr=0.0, momentum=0.85, nesterov=True,
                      compiled=compiled, compile_mode=mode)
        return filters + rest, opt

    def state(params, opt):
        return [t.detach().clone() for t in params + [opt.state[p]["momentum_buffer"] for p in params]]

    eager_params, eager = make(False)
    params, opt = make(True)
    before = [p.detach().clone() for p in params]
    for trains in (True, False):  # both states of the last parameter, as warm_up_compile does
        params[-1].requires_grad_(trains)
        opt.warm_up()
    params[-1].requires_grad_(True)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step, lr in enumerate([0.1, 0.05, 0.02, 0.01]):
            for ps in (params, eager_params):
                ps[-1].requires_grad_(step < 2)
            for p, q in zip(params, eager_params):
                p.grad = q.grad = torch.randn(p.shape, generator=gen) if p.requires_grad else None
            for o in (opt, eager):
                for group in o.param_groups:
                    group["lr"] = lr
                o.step()
            if step == 0:  # mid-run, with gradients and non-zero buffers: nothing moves
                saved = state(params, opt)
                opt.warm_up()
                assert all(torch.equal(a, b) for a, b in zip(state(params, opt), saved))
    for p, q in zip(params, eager_params):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), atol=1e-5)
    assert not torch.equal(params[0], before[0])
    fixed = [opt.state[p]["momentum_buffer"] for p in params] + [opt.state[p]["norm"] for p in params[:2]]
    fixed += list(opt._lr.values())
    marked = [getattr(t, "_dynamo_static_input_type", None) is not None for t in fixed]
    assert marked == [mode == "reduce-overhead"] * len(fixed)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"])
def test_every_compile_mode_that_records_cuda_graphs_gets_their_fixed_addresses(mode):
    """max-autotune records CUDA graphs on a GPU as reduce-overhead does (torch's own table of the modes says which):
    its update's buffers must be marked as fixed addresses too, and the trainer's steps must mark each step's
    start and record the graphs in the warm-up, else the recording falls into the timed steps."""
    graphs = torch._inductor.list_mode_options(mode).get("triton.cudagraphs", False)
    assert (mode in tb.CUDA_GRAPH_COMPILE_MODES) == graphs
    opt = tb.Muon([torch.nn.Parameter(torch.ones(2, 2))], lr=0.1, compiled=True, compile_mode=mode)
    assert opt.fixed_addresses == graphs
    assert train_cifar.uses_cuda_graphs(dict(compile=True, compile_mode=mode)) == graphs
    # (torch._dynamo.reset(), in conftest's teardown, imports the CUDA graph trees for a compiled update that never
    # ran, registering a backend while it iterates over them: imported first, it runs)
    importlib.import_module("torch._inductor.cudagraph_trees")


def test_compiled_muon_trains_nets_of_many_widths_in_one_process():
    """Each set of filter shapes is a graph of its own, and dynamo keeps 8 per function unless told otherwise: a
    process that trains Muon nets of many widths (a sweep, the benchmark over presets) must compile them all,
    each step the eager one's."""
    for width in range(1, 11):
        g = torch.Generator().manual_seed(width)
        weight, grad = torch.randn(4 * width, 3, 3, 3, generator=g), torch.randn(4 * width, 3, 3, 3, generator=g)
        params = [torch.nn.Parameter(weight.clone()) for _ in range(2)]
        for p, compiled in zip(params, (True, False)):
            p.grad = grad.clone()
            tb.Muon([dict(params=[p], orthogonalize=True, ns_steps=1)], lr=0.1, compiled=compiled).step()
        np.testing.assert_allclose(params[0].detach().numpy(), params[1].detach().numpy(), atol=1e-5)
