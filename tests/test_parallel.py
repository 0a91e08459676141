"""Tests of parallel.py. The multi-rank checks run on gloo over the CPU: one spawn of four ranks does all the
distributed work and saves what each rank computed; the tests compare that with single-process references."""
import copy
import os
import random
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import core
import parallel
import train_cifar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 4
PER_RANK = 2  # examples per rank; the global batch has WORLD * PER_RANK


# ---------------------------------------------------------------------------------------------------------------
# LARS

def lars_reference(initial, grads_per_step, settings):
    """LARS in float64 numpy, written from the formula of You et al. rather than from parallel.py. A None
    gradient leaves the parameter alone. Returns the parameters after every step."""
    params = [p.copy() for p in initial]
    velocity = [np.zeros_like(p) for p in initial]
    trajectory = []
    for grads in grads_per_step:
        for i, (g, s) in enumerate(zip(grads, settings)):
            if g is None:
                continue
            p = params[i]
            wd = s["wd"] if s["adapt"] or not s["exclude_wd"] else 0.0
            local_lr = 1.0
            if s["adapt"] and np.linalg.norm(p) > 0 and np.linalg.norm(g) > 0:
                local_lr = s["eta"] * np.linalg.norm(p) / (np.linalg.norm(g) + wd * np.linalg.norm(p) + s["eps"])
            step = s["lr"] * local_lr * (g + wd * p)
            velocity[i] = s["momentum"] * velocity[i] + step
            params[i] = p - (s["momentum"] * velocity[i] + step if s["nesterov"] else velocity[i])
        trajectory.append([p.copy() for p in params])
    return trajectory


def test_lars_matches_a_float64_reference_over_several_steps():
    torch.manual_seed(0)
    conv, bn, head = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(64, 3)
    model = nn.Sequential(conv, bn, nn.ReLU(), nn.Flatten(), head).double()
    zero_grad_weight = nn.Parameter(torch.randn(2, 2, dtype=torch.float64))  # local_lr falls back to 1
    no_grad_weight = nn.Parameter(torch.randn(3, dtype=torch.float64))  # must not move at all
    zero_weight = nn.Parameter(torch.zeros(2, 3, dtype=torch.float64))  # first step: local_lr falls back to 1
    common = dict(lr=0.1, momentum=0.9, wd=5e-4, eta=0.02, eps=1e-9, nesterov=False, exclude_wd=False)
    groups = [  # (param group, per-parameter settings the reference uses)
        (dict(params=[conv.weight, conv.bias, bn.weight, no_grad_weight], exclude_from_weight_decay=True),
         [dict(common, adapt=True, exclude_wd=True)] + [dict(common, adapt=False, exclude_wd=True)] * 3),
        (dict(params=[head.weight, head.bias, zero_grad_weight, zero_weight], lr=0.05, weight_decay=1e-3,
              trust_coefficient=0.05, adapt=True, nesterov=True),
         [dict(common, lr=0.05, wd=1e-3, eta=0.05, adapt=True, nesterov=True)] * 4),
        (dict(params=[bn.bias]), [dict(common, adapt=False)]),  # default: not adapted, still decayed
    ]
    params = [p for g, _ in groups for p in g["params"]]
    settings = [s for _, ss in groups for s in ss]
    opt = parallel.LARS([g for g, _ in groups], lr=0.1, momentum=0.9, weight_decay=5e-4, trust_coefficient=0.02)
    initial = [p.detach().numpy().copy() for p in params]
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 3, 6, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (6,), generator=gen)
    grads_per_step, trajectory = [], []
    for _ in range(5):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        zero_grad_weight.grad = torch.zeros_like(zero_grad_weight)
        zero_weight.grad = torch.randn(2, 3, generator=gen, dtype=torch.float64)
        grads_per_step.append([None if p.grad is None else p.grad.numpy().copy() for p in params])
        opt.step()
        trajectory.append([p.detach().numpy().copy() for p in params])
    for got, expected in zip(trajectory, lars_reference(initial, grads_per_step, settings)):
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-15)
    assert np.array_equal(trajectory[-1][3], initial[3])
    assert not np.allclose(trajectory[-1][0], initial[0])
    moved = next(i for i, p in enumerate(params) if p is zero_weight)
    assert np.abs(trajectory[0][moved]).min() > 0  # it moved at the first step


def test_lars_rejects_bad_settings():
    w = [nn.Parameter(torch.ones(2, 2))]
    with pytest.raises(ValueError):
        parallel.LARS(w, lr=-0.1)
    with pytest.raises(ValueError):
        parallel.LARS(w, lr=0.1, momentum=0, nesterov=True)


# ---------------------------------------------------------------------------------------------------------------
# Learning-rate scaling and warm-up

def test_scaled_lr_rules():
    assert parallel.scaled_lr(0.1, 1024, 256, "linear") == pytest.approx(0.4)
    assert parallel.scaled_lr(0.1, 1024, 256, "sqrt") == pytest.approx(0.2)
    assert parallel.scaled_lr(0.1, 1024, 256, "none") == 0.1
    assert parallel.scaled_lr(0.4, 128, 512) == pytest.approx(0.1)
    for bad in [dict(rule="cubic"), dict(batch_size=0), dict(reference_batch_size=-512)]:
        with pytest.raises(ValueError):
            parallel.scaled_lr(**dict(dict(base_lr=0.1, batch_size=1024, reference_batch_size=256), **bad))


def test_warmup_knots():
    knots, values = parallel.warmup_knots([0, 10], [1.0, 0.0], 2)
    assert knots == [0, 2, 10] and values == pytest.approx([0.0, 0.8, 0.0])
    assert core.piecewise_linear(knots, values)(1) == pytest.approx(0.4)
    # A schedule that already rises from 0 more slowly keeps its shape.
    knots, values = parallel.warmup_knots([0, 5, 24], [0.0, 0.4, 0.0], 2)
    assert knots == [0, 2, 5, 24] and values == pytest.approx([0.0, 0.16, 0.4, 0.0])
    assert parallel.warmup_knots([0, 10], [1.0, 0.0], 12) == ([0, 12], [0.0, 0.0])
    # a schedule starting at epoch 3: the warm-up ends at 3 + 2 = 5, where the schedule is 1 - 2/10 = 0.8
    knots, values = parallel.warmup_knots([3, 13], [1.0, 0.0], 2)
    assert knots == [3, 5, 13] and values == pytest.approx([0.0, 0.8, 0.0])
    assert parallel.warmup_knots([0, 10], [1.0, 0.0], 0) == ([0, 10], [1.0, 0.0])
    with pytest.raises(ValueError):
        parallel.warmup_knots([0, 10], [1.0, 0.0], -1)


# ---------------------------------------------------------------------------------------------------------------
# Ghost batch norm

def bn_problem(seed=1):
    """A batch, the upstream gradient, and BN weight and bias, all fixed."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(WORLD * PER_RANK, 3, 4, 4, generator=gen) * 2 + 1
    upstream = torch.randn(x.shape, generator=gen)
    return x, upstream, 1 + 0.2 * torch.randn(3, generator=gen), 0.2 * torch.randn(3, generator=gen)


def bn_layer(weight, bias, momentum=0.1, eps=1e-5):
    bn = nn.BatchNorm2d(len(weight), momentum=momentum, eps=eps)
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    return bn


BF16_EPS = 0.1  # large enough that leaving it out moves the output by 5%


def bf16_bn_problem():
    """bf16 channels-last activations as autocast feeds BN: channel means near 10 and spreads near 1, so that sums
    and sums of squares kept in bf16 (8 bits of mantissa) would lose the variance; the upstream gradient has an
    offset too, and is exact in bf16 as the gradient that reaches BN is. Weight and bias in fp32."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(WORLD * PER_RANK, 8, 6, 6, generator=gen) * (1 + 0.3 * torch.rand(8, 1, 1, generator=gen))
         + 10 + torch.randn(8, 1, 1, generator=gen))
    upstream = (torch.randn(x.shape, generator=gen) + 3).to(torch.bfloat16).float()  # (backward gets it in bf16)
    x = x.to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    return x, upstream, 1 + 0.2 * torch.randn(8, generator=gen), 0.2 * torch.randn(8, generator=gen)


def bn_step(bn, x, upstream):
    """One training forward and backward of loss sum(bn(x) * upstream); what comes out and the gradients."""
    x = x.clone().requires_grad_()
    y = bn(x)
    (y * upstream).sum().backward()
    return dict(y=y.detach(), dx=x.grad, dw=bn.weight.grad, db=bn.bias.grad,
                running_mean=bn.running_mean.clone(), running_var=bn.running_var.clone())


@pytest.mark.parametrize("momentum", [0.1, None])
def test_ghost_bn_with_one_group_is_batch_norm(momentum):
    x, upstream, weight, bias = bn_problem()
    plain = bn_layer(weight, bias, momentum)
    ghost = parallel.convert_bn(copy.deepcopy(plain), group_size=len(x))
    assert isinstance(ghost, parallel.GhostBatchNorm2d)
    for step in range(2):
        expected, got = bn_step(plain, x + step, upstream), bn_step(ghost, x + step, upstream)
        for key in expected:
            assert_close(got[key], expected[key])
    assert ghost.num_batches_tracked.item() == plain.num_batches_tracked.item() == 2
    plain.eval(), ghost.eval()
    assert_close(ghost(x), plain(x))


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_ghost_bn_normalises_each_chunk_on_its_own(memory_format):
    x, upstream, weight, bias = bn_problem()
    ghost = parallel.GhostBatchNorm2d(3, group_size=2)
    with torch.no_grad():
        ghost.weight.copy_(weight)
        ghost.bias.copy_(bias)
    got = bn_step(ghost, x.contiguous(memory_format=memory_format), upstream)

    x_ref = x.clone().requires_grad_()
    w_ref, b_ref = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    y_ref = torch.cat([F.batch_norm(chunk, None, None, w_ref, b_ref, training=True) for chunk in x_ref.split(2)])
    (y_ref * upstream).sum().backward()
    assert_close(got["y"], y_ref.detach())
    assert_close(got["dx"], x_ref.grad)
    assert_close(got["dw"], w_ref.grad)
    assert_close(got["db"], b_ref.grad)
    # Running statistics: the mean over chunks of each chunk's mean and unbiased variance, at momentum 0.1.
    chunks = x.split(2)
    assert_close(got["running_mean"], 0.1 * torch.stack([c.mean((0, 2, 3)) for c in chunks]).mean(0))
    assert_close(got["running_var"], 0.9 + 0.1 * torch.stack([c.var((0, 2, 3)) for c in chunks]).mean(0))


def ghost_bn_reference(x, weight, bias, group_size, eps=1e-5):
    """Ghost BN in float64, one group at a time, from the formula."""
    groups = x.double().split(group_size)
    out = []
    for chunk in groups:
        mean = chunk.mean((0, 2, 3), keepdim=True)
        var = chunk.var((0, 2, 3), unbiased=False, keepdim=True)
        out.append((chunk - mean) / torch.sqrt(var + eps) * weight.double().view(1, -1, 1, 1)
                   + bias.double().view(1, -1, 1, 1))
    return torch.cat(out)


@pytest.mark.parametrize("frozen_scale", [False, True])
def test_ghost_bn_in_bf16_channels_last_matches_the_float64_formula(frozen_scale):
    """The form resnet9-tricks trains in: bf16 activations, channels-last, 32-image groups, BN scales frozen.
    Output, input gradient and bias gradient against float64 per group; the layout is kept."""
    gen = torch.Generator().manual_seed(3)
    n, c, k = 128, 16, 32
    group_offsets = torch.randn(n // k, 1, c, 1, 1, generator=gen, dtype=torch.float64)
    x64 = (torch.randn(n, c, 6, 6, generator=gen, dtype=torch.float64) * 1.5 + 0.7
           + group_offsets.expand(-1, k, -1, 1, 1).reshape(n, c, 1, 1))
    upstream = torch.randn(x64.shape, generator=gen, dtype=torch.float64)
    x = x64.to(torch.bfloat16).contiguous(memory_format=torch.channels_last).requires_grad_()
    ghost = parallel.GhostBatchNorm2d(c, group_size=k)
    with torch.no_grad():
        ghost.weight.copy_(1 + 0.3 * torch.randn(c, generator=gen))
        ghost.bias.copy_(0.2 * torch.randn(c, generator=gen))
    ghost.weight.requires_grad_(not frozen_scale)
    y = ghost(x)
    assert y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=torch.channels_last)
    (y.float() * upstream.float()).sum().backward()

    x_ref = x.detach().double().requires_grad_()
    w_ref = ghost.weight.detach().double().requires_grad_()
    b_ref = ghost.bias.detach().double().requires_grad_()
    y_ref = ghost_bn_reference(x_ref, w_ref, b_ref, k)
    (y_ref * upstream).sum().backward()
    assert_close(y.double(), y_ref.detach(), atol=0.03, rtol=0.01)  # bf16 output: 2^-8 relative
    assert_close(x.grad.double(), x_ref.grad, atol=0.03, rtol=0.02)
    assert_close(ghost.bias.grad.double(), b_ref.grad, atol=0.05, rtol=0.01)
    if frozen_scale:
        assert ghost.weight.grad is None
    else:
        assert_close(ghost.weight.grad.double(), w_ref.grad, atol=0.3, rtol=0.02)
    # Each group's statistics, not the batch's: the group means above differ by about 1.
    group_means = x_ref.detach().split(k)
    expected_mean = 0.1 * torch.stack([g.mean((0, 2, 3)) for g in group_means]).mean(0)
    assert_close(ghost.running_mean.double(), expected_mean, atol=1e-3, rtol=1e-3)


def test_ghost_bn_without_affine_parameters_in_float64():
    x, upstream, _, _ = bn_problem()
    x = x.double()
    ghost = parallel.GhostBatchNorm2d(3, group_size=4, affine=False).double()
    got = ghost(x.clone().requires_grad_())
    assert_close(got, ghost_bn_reference(x, torch.ones(3), torch.zeros(3), 4))


def test_ghost_bn_without_running_statistics_normalises_each_group_in_eval_mode_too():
    """As nn.BatchNorm2d without running statistics uses the batch's in eval mode, ghost BN uses each group's."""
    x, _, weight, bias = bn_problem()
    ghost = parallel.GhostBatchNorm2d(3, group_size=2, track_running_stats=False).eval()
    with torch.no_grad():
        ghost.weight.copy_(weight)
        ghost.bias.copy_(bias)
    assert_close(ghost(x).double(), ghost_bn_reference(x, weight, bias, 2))


def test_ghost_bn_needs_whole_groups():
    with pytest.raises(ValueError, match="divisible"):
        parallel.GhostBatchNorm2d(3, group_size=3)(torch.randn(8, 3, 2, 2))


def test_convert_bn_swaps_every_batch_norm_and_shares_its_state():
    frozen = nn.BatchNorm2d(4, momentum=0.4, eps=1e-12)
    frozen.weight.requires_grad_(False)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.Conv2d(4, 4, 1), frozen))
    model(torch.randn(4, 3, 6, 6))  # non-trivial running statistics
    model.eval()
    x = torch.randn(2, 3, 6, 6)
    before = model(x)
    old_bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    converted = parallel.convert_bn(model, group_size=2)
    new_bns = [m for m in converted.modules() if isinstance(m, nn.BatchNorm2d)]
    assert converted is model and all(type(m) is parallel.GhostBatchNorm2d for m in new_bns)
    for old, new in zip(old_bns, new_bns):
        for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            assert getattr(new, name) is getattr(old, name), name
        assert (new.momentum, new.eps, new.training) == (old.momentum, old.eps, old.training)
    assert not new_bns[1].weight.requires_grad
    assert_close(model(x), before)


def test_converted_bn_continues_a_cumulative_average():
    """momentum=None averages every batch so far, counted in num_batches_tracked: a layer converted after two
    steps (ghost groups of the whole batch) takes the third step's statistics at weight 1/3, as plain BN does."""
    x, upstream, weight, bias = bn_problem()
    plain, converted = bn_layer(weight, bias, momentum=None), bn_layer(weight, bias, momentum=None)
    for step in range(2):
        bn_step(plain, x + step, upstream), bn_step(converted, x + step, upstream)
    converted = parallel.convert_bn(converted, group_size=len(x))
    expected, got = bn_step(plain, 2 * x, upstream), bn_step(converted, 2 * x, upstream)
    assert_close(got["running_mean"], expected["running_mean"])
    assert_close(got["running_var"], expected["running_var"])
    assert converted.num_batches_tracked.item() == 3


def test_convert_sync_bn_keeps_each_layers_momentum_and_eps():
    """fastnet's BN momentum is 0.4 and eps 1e-12: a converted layer with PyTorch's defaults (0.1, 1e-5) would
    average and normalise otherwise than the single-process run."""
    model = nn.Sequential(nn.BatchNorm2d(4, momentum=0.4, eps=1e-12), nn.BatchNorm2d(4))
    old = [(m.momentum, m.eps) for m in model]
    parallel.convert_sync_bn(model)
    assert all(isinstance(m, parallel.GroupSyncBatchNorm2d) for m in model)
    assert [(m.momentum, m.eps) for m in model] == old == [(0.4, 1e-12), (0.1, 1e-5)]


def test_sync_bn_without_a_process_group_is_batch_norm():
    x, upstream, weight, bias = bn_problem()
    plain = bn_layer(weight, bias)
    synced = parallel.convert_sync_bn(copy.deepcopy(plain))
    assert type(synced) is parallel.GroupSyncBatchNorm2d and not dist.is_initialized()
    expected, got = bn_step(plain, x, upstream), bn_step(synced, x, upstream)
    for key in expected:
        assert_close(got[key], expected[key])


# ---------------------------------------------------------------------------------------------------------------
# Distributed: BN over groups of ranks and the 2-D all-reduce hook, four gloo ranks

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def regression_batch():
    gen = torch.Generator().manual_seed(2)
    return torch.randn(WORLD * PER_RANK, 5, generator=gen), torch.randn(WORLD * PER_RANK, 3, generator=gen)


def bf16_gradients(rank):
    return torch.randn(1001, generator=torch.Generator().manual_seed(10 + rank)).to(torch.bfloat16)


class FakeBucket:
    """The one method of DDP's GradBucket that the hook uses."""

    def __init__(self, buffer):
        self._buffer = buffer

    def buffer(self):
        return self._buffer


def ddp_grads(rank, hook_state, bucket_sizes):
    """Gradients of the mean squared error on this rank's shard after a DDP backward. DDP puts every gradient in
    one bucket in the first iteration and regroups them by bucket_cap_mb from the second, so run two and keep
    the second's, whose tiny buckets make the hook run several times on buffers of odd sizes."""
    model = nn.parallel.DistributedDataParallel(mlp(), bucket_cap_mb=1e-4)
    if hook_state is not None:
        def recording_hook(state, bucket):
            bucket_sizes.append(bucket.buffer().numel())
            return parallel.hierarchical_allreduce_hook(state, bucket)
        model.register_comm_hook(hook_state, recording_hook)
    x, target = regression_batch()
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for _ in range(2):
        model.zero_grad()
        if bucket_sizes is not None:
            bucket_sizes.clear()
        F.mse_loss(model(x[shard]), target[shard]).backward()
    return [p.grad.clone() for p in model.parameters()]


def evaluation_problem():
    """A net and a test set of 103 images (shards of 26, 26, 26 and 25 over four ranks) with varied predictions."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))
    return model, dict(test_x=torch.randn(103, 3, 32, 32), test_y=torch.randint(0, 10, (103,)))


def rank_main(rank, directory):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=WORLD)
    try:
        x, upstream, weight, bias = bn_problem()
        shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        results = {}
        x16, upstream16, weight16, bias16 = bf16_bn_problem()
        for name, group in [("bn_world", None), ("bn_pairs", parallel.bn_process_groups(WORLD, 2))]:
            layer = parallel.convert_sync_bn(bn_layer(weight, bias), group)
            results[name] = bn_step(layer, x[shard], upstream[shard])
            layer16 = parallel.convert_sync_bn(bn_layer(weight16, bias16, eps=BF16_EPS), group)
            results[name + "_bf16"] = bn_step(layer16, x16[shard], upstream16[shard])
            if group is None:  # evaluation: the running statistics alone, which stay as they are
                stats = (layer.running_mean.clone(), layer.running_var.clone())
                y = layer.eval()(x[shard]).detach()
                results["bn_eval"] = dict(y=y, stats=stats, count=layer.num_batches_tracked.item(),
                                          stats_after=(layer.running_mean.clone(), layer.running_var.clone()))
        state = parallel.make_hierarchical_state(WORLD, 2)
        results["bucket_sizes"] = []
        results["ddp_flat"] = ddp_grads(rank, None, None)
        results["ddp_2d"] = ddp_grads(rank, state, results["bucket_sizes"])
        results["bf16_bucket"] = parallel.hierarchical_allreduce_hook(state, FakeBucket(bf16_gradients(rank))).wait()
        model, data = evaluation_problem()
        results["accuracy"] = train_cifar.evaluate(model, data, "fp32", torch.device("cpu"), 0, rank, WORLD)
        torch.save(results, os.path.join(directory, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ranks")
    mp.spawn(rank_main, args=(str(directory),), nprocs=WORLD, join=True)
    return [torch.load(directory / f"rank{rank}.pt") for rank in range(WORLD)]


GRID_WORLD, GRID_GROUP = 6, 3  # not square: intra groups of 3, inter groups of 2 (a 2 x 2 grid hides swaps)
GRID_SIZES = (7, 8, 9)  # bucket sizes that leave 1, 2 and 0 of a shard over


def grid_bucket(rank, n):
    return torch.randn(n, generator=torch.Generator().manual_seed(100 * n + rank))


def grid_rank_main(rank, directory):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=GRID_WORLD)
    try:
        state = parallel.make_hierarchical_state(GRID_WORLD, GRID_GROUP)
        results = dict(intra=dist.get_process_group_ranks(state.intra_group),
                       inter=dist.get_process_group_ranks(state.inter_group))
        for n in GRID_SIZES:
            results[n] = parallel.hierarchical_allreduce_hook(state, FakeBucket(grid_bucket(rank, n))).wait()
        torch.save(results, os.path.join(directory, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_hierarchical_hook_on_a_grid_that_is_not_square(tmp_path):
    """Six ranks in groups of three: each rank's groups are its block of three and the ranks at its position in
    the other block, and every bucket (sizes padded by 2, 1 and 0 to whole shards) comes back as the mean of all
    six ranks' buckets, in float64 by hand."""
    mp.spawn(grid_rank_main, args=(str(tmp_path),), nprocs=GRID_WORLD, join=True)
    for rank in range(GRID_WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        block = rank // GRID_GROUP * GRID_GROUP
        assert got["intra"] == list(range(block, block + GRID_GROUP))
        assert got["inter"] == list(range(rank % GRID_GROUP, GRID_WORLD, GRID_GROUP))
        for n in GRID_SIZES:
            mean = sum(grid_bucket(r, n).double() for r in range(GRID_WORLD)) / GRID_WORLD
            assert_close(got[n].double(), mean, rtol=1e-6, atol=1e-7)


def test_sharded_evaluation_scores_every_test_image_once(rank_results):
    """Under torchrun each rank scores every world-th test image and the counts are summed: the accuracy every
    rank reports is the single process's, exactly (an overlap or a gap between shards would move it)."""
    model, data = evaluation_problem()
    alone = train_cifar.evaluate(model, data, "fp32", torch.device("cpu"), 0)
    per_image = (model(data["test_x"]).argmax(1) == data["test_y"]).sum().item() / 103
    assert alone == pytest.approx(per_image, abs=1e-12) and 0.02 < alone < 0.98
    assert all(r["accuracy"] == alone for r in rank_results)


@pytest.mark.parametrize("key, group_size", [("bn_world", WORLD), ("bn_pairs", 2)])
def test_sync_bn_equals_bn_over_the_groups_batch(rank_results, key, group_size):
    x, upstream, weight, bias = bn_problem()
    for first in range(0, WORLD, group_size):
        rows = slice(first * PER_RANK, (first + group_size) * PER_RANK)
        expected = bn_step(bn_layer(weight, bias), x[rows], upstream[rows])
        got = [rank_results[rank][key] for rank in range(first, first + group_size)]
        assert_close(torch.cat([g["y"] for g in got]), expected["y"])
        assert_close(torch.cat([g["dx"] for g in got]), expected["dx"])
        assert_close(sum(g["dw"] for g in got), expected["dw"])  # each rank's share; DDP sums them
        assert_close(sum(g["db"] for g in got), expected["db"])
        for g in got:
            assert_close(g["running_mean"], expected["running_mean"])
            assert_close(g["running_var"], expected["running_var"])


@pytest.mark.parametrize("key, group_size", [("bn_world_bf16", WORLD), ("bn_pairs_bf16", 2)])
def test_sync_bn_in_bf16_channels_last_matches_the_float64_formula(rank_results, key, group_size):
    """bf16 input keeps its dtype and layout out, and the statistics, eps and gradients are the float64 BN's over
    the group's batch within bf16 rounding of the output and the input gradient."""
    x, upstream, weight, bias = bf16_bn_problem()
    for first in range(0, WORLD, group_size):
        rows = slice(first * PER_RANK, (first + group_size) * PER_RANK)
        expected = bn_step(bn_layer(weight, bias, eps=BF16_EPS).double(), x[rows].double(), upstream[rows].double())
        got = [rank_results[rank][key] for rank in range(first, first + group_size)]
        assert all(g["y"].dtype == g["dx"].dtype == torch.bfloat16 for g in got)
        assert all(g["y"].is_contiguous(memory_format=torch.channels_last) for g in got)
        assert_close(torch.cat([g["y"] for g in got]).double(), expected["y"], atol=0.02, rtol=0.01)
        assert_close(torch.cat([g["dx"] for g in got]).double(), expected["dx"], atol=0.02, rtol=0.01)
        assert_close(sum(g["dw"] for g in got).double(), expected["dw"], atol=0.05, rtol=1e-3)
        assert_close(sum(g["db"] for g in got).double(), expected["db"], atol=1e-3, rtol=1e-4)
        for g in got:
            assert_close(g["running_mean"].double(), expected["running_mean"], atol=1e-4, rtol=1e-5)
            assert_close(g["running_var"].double(), expected["running_var"], atol=1e-4, rtol=1e-5)


def test_sync_bn_evaluates_with_its_running_statistics_alone(rank_results):
    """In eval mode a synced layer is plain BN on the running statistics: no statistics of the test batch, no
    all-reduce, and the running statistics and step count stay."""
    x, _, weight, bias = bn_problem()
    for rank, results in enumerate(rank_results):
        got = results["bn_eval"]
        mean, var = got["stats"]
        shard = x[rank * PER_RANK:(rank + 1) * PER_RANK]
        assert_close(got["y"], F.batch_norm(shard, mean, var, weight, bias, training=False, eps=1e-5))
        assert all(torch.equal(a, b) for a, b in zip(got["stats_after"], got["stats"]))
        assert got["count"] == 1


def test_hierarchical_hook_equals_flat_allreduce_and_the_global_batch(rank_results):
    model = mlp()
    x, target = regression_batch()
    F.mse_loss(model(x), target).backward()
    expected = [p.grad for p in model.parameters()]
    for results in rank_results:
        assert len(results["bucket_sizes"]) > 1 and any(n % 2 for n in results["bucket_sizes"]), results["bucket_sizes"]
        for flat, two_d, e in zip(results["ddp_flat"], results["ddp_2d"], expected):
            assert_close(two_d, flat)
            assert_close(two_d, e)


def test_hierarchical_hook_sums_low_precision_buckets_in_fp32(rank_results):
    grads = [bf16_gradients(rank) for rank in range(WORLD)]
    exact_mean = (torch.stack([g.double() for g in grads]).sum(0) / WORLD).to(torch.bfloat16)
    for results in rank_results:
        assert results["bf16_bucket"].dtype == torch.bfloat16
        assert torch.equal(results["bf16_bucket"], exact_mean)
    bf16_partial_sums = ((grads[0] + grads[1]) + (grads[2] + grads[3])) / WORLD
    assert not torch.equal(bf16_partial_sums, exact_mean)  # so the check above tells fp32 sums from bf16 ones


# ---------------------------------------------------------------------------------------------------------------
# Process-group set-up

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAILING_RANK_SCRIPT = f"""
import sys, time
import torch
import torch.distributed as dist
sys.path.insert(0, {ROOT!r})
import parallel
rank, world_size, local_rank = parallel.init_distributed(timeout_s=5)
print("joined", rank, world_size, local_rank, flush=True)
if rank == 1:
    if sys.argv[1] == "hang":
        time.sleep(120)
    raise SystemExit("rank 1 fails before the collective")
dist.all_reduce(torch.ones(1))
print("all-reduce returned", flush=True)
"""


@pytest.mark.parametrize("failure", ["exit", "hang"])
def test_a_failing_rank_makes_the_others_exit_nonzero_in_bounded_time(failure):
    """Rank 1 dies, or hangs, before a collective. Rank 0 must fail: on the closed connection, or on the
    process-group timeout (5 s here) while rank 1 is still alive, whose launcher then stops it."""
    port, start, procs = free_port(), time.monotonic(), []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", FAILING_RANK_SCRIPT, failure], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        rank0_output = procs[0].communicate(timeout=60)[0]
        elapsed = time.monotonic() - start
        if failure == "hang":
            assert procs[1].poll() is None  # rank 0 gave up on its own, not because rank 1 went away
            procs[1].kill()
        rank1_output = procs[1].communicate(timeout=60)[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode != 0 and procs[1].returncode != 0, (rank0_output, rank1_output)
    assert elapsed < 60
    assert "joined 0 2 0" in rank0_output and "joined 1 2 1" in rank1_output, (rank0_output, rank1_output)
    assert "all-reduce returned" not in rank0_output


def test_init_distributed_without_torchrun_is_a_single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert parallel.init_distributed() == (0, 1, 0)
    assert not dist.is_initialized()



def test_init_distributed_takes_torchruns_rank_world_and_local_rank(monkeypatch):
    """On the second node of two, rank 5 is local rank 1: its GPU is cuda:1, not cuda:5."""
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    joined = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.update(kw, backend=backend))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parallel.init_distributed() == (5, 8, 1)
    assert (joined["rank"], joined["world_size"], joined["backend"]) == (5, 8, "gloo")


def test_init_distributed_in_a_joined_process_group_returns_its_rank(monkeypatch):
    """Called again once the group exists (by a benchmark after train_cifar, say), it answers the group's rank and
    size: rank 0 everywhere would make every process log and take rank 0's slices."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("joined twice"))
    assert parallel.init_distributed() == (3, 4, 1)


# ---------------------------------------------------------------------------------------------------------------
# All-reduce cost model

def test_ring_allreduce_time():
    # 2*3 latencies of 10 us + 2*3/4 of 1 MB at 1 GB/s
    assert parallel.ring_allreduce_time(4, 1e6, 1e-5, 1e9) == pytest.approx(6e-5 + 1.5e-3)
    assert parallel.ring_allreduce_time(1, 1e6, 1e-5, 1e9) == 0


def test_hierarchical_and_flat_allreduce_times():
    links = (1e-6, 1e11, 1e-5, 1e10)  # intra: 1 us, 100 GB/s; inter: 10 us, 10 GB/s per NIC
    # reduce-scatter and all-gather in groups of 4: 2 * (3 us + 3/4 * 8 MB / 100 GB/s) = 126 us.
    # A NIC per rank: 4 rings over 2 groups of 2 MB, each on its own link: 2 * 10 us + 2 MB / 10 GB/s = 220 us
    assert parallel.hierarchical_allreduce_time(2, 4, 8e6, *links, nics_per_group=4) == pytest.approx(126e-6 + 220e-6)
    assert parallel.hierarchical_allreduce_time(2, 4, 8e6, *links, nics_per_group=8) == pytest.approx(126e-6 + 220e-6)
    # One NIC per group (the default): the 4 rings get 2.5 GB/s each, 2 * 10 us + 2 MB / 2.5 GB/s = 820 us
    assert parallel.hierarchical_allreduce_time(2, 4, 8e6, *links) == pytest.approx(126e-6 + 820e-6)
    # Two NICs: 5 GB/s each, 2 * 10 us + 2 MB / 5 GB/s = 420 us
    assert parallel.hierarchical_allreduce_time(2, 4, 8e6, *links, nics_per_group=2) == pytest.approx(126e-6 + 420e-6)
    # 8 ranks paced by the inter link: 14 * 10 us + 14/8 * 8 MB / 10 GB/s, one flow per NIC whatever the NIC count
    for nics in (1, 2, 4):
        assert parallel.flat_allreduce_time(2, 4, 8e6, *links, nics) == pytest.approx(140e-6 + 1.4e-3)
    # one group: a ring on the intra link, which the 2-D scheme equals
    assert parallel.flat_allreduce_time(1, 4, 8e6, *links) == pytest.approx(6e-6 + 120e-6)
    assert parallel.hierarchical_allreduce_time(1, 4, 8e6, *links) == pytest.approx(6e-6 + 120e-6)


# intra: 1 us, 10 GB/s; inter: 10 us, 10 GB/s, one NIC per group of 4. By allreduce_crossover's docstring the
# 2-D scheme wins at G groups when 10 G + 200 / G > 201 (us, for 8 MB): from G = 20, 80 ranks.
SHARED_NIC = (1e-6, 1e10, 1e-5, 1e10)


def test_shared_nic_crossover_by_hand():
    # 19 groups: flat 2*75 * 10 us + 2*75/76 * 8 MB / 10 GB/s = 3078.9 us;
    #            2-D 2*3 * 1 us + 2*3/4 * 8 MB / 10 GB/s + 2*18 * 10 us + 2*18/19 * 2 MB / 2.5 GB/s = 3081.8 us
    assert parallel.flat_allreduce_time(19, 4, 8e6, *SHARED_NIC) == pytest.approx(1500e-6 + 150 / 76 * 800e-6)
    assert parallel.hierarchical_allreduce_time(19, 4, 8e6, *SHARED_NIC) == pytest.approx(
        1206e-6 + 360e-6 + 36 / 19 * 800e-6)
    # 20 groups: flat 1580 + 1580 = 3160 us; 2-D 1206 + 380 + 1520 = 3106 us
    assert parallel.flat_allreduce_time(20, 4, 8e6, *SHARED_NIC) == pytest.approx(3160e-6)
    assert parallel.hierarchical_allreduce_time(20, 4, 8e6, *SHARED_NIC) == pytest.approx(3106e-6)
    assert parallel.allreduce_crossover(8e6, 4, *SHARED_NIC) == 80
    assert parallel.allreduce_crossover(8e6, 4, *SHARED_NIC, max_ranks=76) is None
    # 8e7 bytes on a 40 GB/s intra link: 10 G + 2000 / G > 501 holds for G <= 4 and from G = 46 on, so the 2-D
    # scheme wins at 2 groups, loses in between, and wins for good from 184 ranks.
    links = (1e-6, 4e10, 1e-5, 1e10)
    assert parallel.hierarchical_allreduce_time(2, 4, 8e7, *links) < parallel.flat_allreduce_time(2, 4, 8e7, *links)
    assert parallel.hierarchical_allreduce_time(45, 4, 8e7, *links) > parallel.flat_allreduce_time(45, 4, 8e7, *links)
    assert parallel.allreduce_crossover(8e7, 4, *links) == 184


def test_crossover_moves_to_fewer_ranks_for_smaller_gradients_and_slower_latency():
    by_size = [parallel.allreduce_crossover(nbytes, 4, *SHARED_NIC, max_ranks=1 << 14)
               for nbytes in (8e8, 8e7, 8e6, 8e5)]
    assert all(a > b for a, b in zip(by_size, by_size[1:])) and by_size[-1] == 8, by_size
    intra_latency, intra_bw, _, inter_bw = SHARED_NIC
    by_latency = [parallel.allreduce_crossover(8e6, 4, intra_latency, intra_bw, inter_latency, inter_bw)
                  for inter_latency in (2e-6, 1e-5, 5e-5, 1e-4)]
    assert all(a > b for a, b in zip(by_latency, by_latency[1:])) and by_latency[-1] == 8, by_latency


def test_crossover_condition_matches_the_times_with_one_nic():
    rng = random.Random(1)
    for _ in range(300):
        nbytes, group_size, n_groups = 10 ** rng.uniform(3, 9), rng.randint(2, 16), rng.randint(2, 256)
        intra_latency, inter_latency = sorted(10 ** rng.uniform(-7, -4) for _ in range(2))
        inter_bw, intra_bw = sorted(10 ** rng.uniform(8, 12) for _ in range(2))  # inter is the ring's slower hop
        links = (intra_latency, intra_bw, inter_latency, inter_bw)
        flat = parallel.flat_allreduce_time(n_groups, group_size, nbytes, *links)
        two_d = parallel.hierarchical_allreduce_time(n_groups, group_size, nbytes, *links)
        left = n_groups * inter_latency + nbytes / (n_groups * group_size * inter_bw)
        right = intra_latency + nbytes / (group_size * intra_bw)
        assert flat - two_d == pytest.approx(2 * (group_size - 1) * (left - right), rel=1e-6, abs=1e-15)


def test_allreduce_crossover_with_a_nic_per_rank_is_two_groups():
    assert parallel.allreduce_crossover(8e6, 4, 1e-5, 1e10, 1e-5, 1e10, nics_per_group=4) == 8
    assert parallel.allreduce_crossover(8e6, 1, 1e-5, 1e10, 1e-5, 1e10, max_ranks=64) is None  # same as the ring
    # The old model's claim: with a link per cross-group ring and two groups or more the 2-D scheme is never
    # slower, whatever the links.
    rng = random.Random(0)
    for _ in range(300):
        nbytes, group_size = 10 ** rng.uniform(3, 9), rng.randint(2, 16)
        intra = (10 ** rng.uniform(-7, -4), 10 ** rng.uniform(8, 12))  # latency s, bandwidth B/s
        inter = (10 ** rng.uniform(-7, -4), 10 ** rng.uniform(8, 12))
        links = intra + inter
        for nics in (group_size, 2 * group_size):
            for n_groups in (2, 3, 8, 64):
                flat = parallel.flat_allreduce_time(n_groups, group_size, nbytes, *links, nics)
                assert parallel.hierarchical_allreduce_time(n_groups, group_size, nbytes, *links, nics) < flat
            assert parallel.allreduce_crossover(nbytes, group_size, *links, nics, max_ranks=1024) == 2 * group_size


def test_cost_model_command_prints_two_tables():
    lines = []
    parallel.cost_model_table(25e6, 8, 5e-6, 300e9, 1e-5, 25e9, max_ranks=64, out=lines.append)
    assert lines[0].split() == ["ranks", "groups", "ring_ms", "2d_ms", "speedup"]
    assert [int(line.split()[0]) for line in lines[1:-1]] == [8, 16, 32, 64]
    assert lines[-1] == "2-D wins from 16 ranks"
    lines = []
    parallel.crossover_table([8e5, 8e6, 8e7], 4, *SHARED_NIC, max_ranks=512, out=lines.append)  # 8e7: 800
    assert lines[0].split() == ["grad_MB", "2d_from", "spd@8", "spd@512"]
    assert [line.split()[:2] for line in lines[1:]] == [["0.8", "8"], ["8", "80"], ["80", "never"]]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "parallel.py"), "cost-model", "--max-ranks", "16"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "2-D wins from 16 ranks" in out.stdout, out.stderr
    assert out.stdout.splitlines()[7].split() == ["grad_MB", "2d_from", "spd@16"], out.stdout
    assert "crossover by gradient size" in out.stdout and len(out.stdout.splitlines()) == 12, out.stdout


def test_cost_model_command_converts_gbit_per_s_and_microseconds(capsys):
    """Guards the CLI's unit conversions (Gbit/s to bytes/s, us to s, MB to bytes): times worked out by hand."""
    parallel.main(["cost-model", "--grad-mb", "1", "--group-size", "2", "--intra-gbps", "8", "--inter-gbps", "8",
                   "--intra-latency-us", "1", "--inter-latency-us", "10", "--max-ranks", "4", "--sweep-mb", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:4]]
    # 1e6 bytes at 8 Gbit/s = 1 GB/s. One group of 2: 2 * 1 us + 2 * 1/2 * 1 ms = 1.002 ms for both schemes.
    # Two groups: flat ring of 4 paced by the inter link, 6 * 10 us + 6/4 * 1 ms = 1.56 ms; 2-D: 1.002 ms in the
    # group + a ring of 2 over 0.5 MB at 0.5 GB/s (one NIC, two rings), 2 * 10 us + 1 ms = 1.02 ms.
    expected = [(2, 1, 1.002, 1.002), (4, 2, 1.56, 2.022)]
    for row, (ranks, groups, ring_ms, two_d_ms) in zip(rows, expected):
        assert (int(row[0]), int(row[1])) == (ranks, groups)
        assert float(row[2]) == pytest.approx(ring_ms, rel=1e-3) and float(row[3]) == pytest.approx(two_d_ms, rel=1e-3)


def test_cost_model_speedups_are_the_flat_time_over_the_2d_time():
    """A speed-up above 1 must mean 2-D is faster: each printed one against the two times computed here."""
    links = (8, 5e-6, 300e9, 1e-5, 25e9)
    lines = []
    parallel.cost_model_table(25e6, *links, max_ranks=64, out=lines.append)
    for line in lines[1:-1]:
        ranks, groups, ring_ms, two_d_ms, speedup = line.split()
        flat = parallel.flat_allreduce_time(int(groups), 8, 25e6, *links[1:])
        two_d = parallel.hierarchical_allreduce_time(int(groups), 8, 25e6, *links[1:])
        assert float(ring_ms) == pytest.approx(1e3 * flat, rel=1e-3, abs=1e-3)
        assert float(two_d_ms) == pytest.approx(1e3 * two_d, rel=1e-3, abs=1e-3)
        assert float(speedup) == pytest.approx(flat / two_d, rel=1e-2)
    lines = []
    parallel.crossover_table([8e5, 8e7], 4, *SHARED_NIC, max_ranks=512, out=lines.append)
    for line in lines[1:]:
        mb, _, at_8, at_512 = line.split()
        for ranks, shown in ((8, at_8), (512, at_512)):
            want = (parallel.flat_allreduce_time(ranks // 4, 4, float(mb) * 1e6, *SHARED_NIC)
                    / parallel.hierarchical_allreduce_time(ranks // 4, 4, float(mb) * 1e6, *SHARED_NIC))
            assert float(shown) == pytest.approx(want, rel=1e-2), (mb, ranks)


def test_cost_model_says_where_2d_is_faster_when_it_does_not_win_for_good():
    """Zero latencies: 2-D is 1.64x faster at 16 ranks and slower from 104; the summary said "2-D is not faster
    at 1024 ranks" and the crossover table "never", next to a speed-up of 1.64 at 16."""
    links = (8, 0.0, 2400e9 / 8, 0.0, 200e9 / 8)
    assert parallel.faster_rank_ranges(25e6, *links, max_ranks=1024) == [(16, 96)]
    lines = []
    parallel.cost_model_table(25e6, *links, max_ranks=1024, out=lines.append)
    assert lines[-1] == "2-D is faster at 16-96 ranks only, not at 1024"
    lines = []
    parallel.crossover_table([25e6], *links, max_ranks=1024, out=lines.append)
    assert lines[1].split()[:3] == ["25", "16-96", "only"]
    lines = []
    parallel.cost_model_table(8e7, 4, *SHARED_NIC, max_ranks=512, out=lines.append)  # the ring is never slower
    assert lines[-1] == "2-D is not faster at any rank count up to 512"


def test_cost_model_refuses_groups_of_one():
    """--group-size 1 ended in a ZeroDivisionError (a 2-D all-reduce over groups of one is the flat ring)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "parallel.py"), "cost-model", "--group-size", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "error: --group-size must be at least 2" in out.stderr and out.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["--grad-mb", "nan"], "--grad-mb must be positive and finite"),
    (["--grad-mb", "inf"], "--grad-mb must be positive and finite"),
    (["--sweep-mb", "1", "nan"], "--sweep-mb must be positive and finite"),
    (["--inter-gbps", "nan"], "--inter-gbps must be positive and finite"),
    (["--intra-gbps", "inf"], "--intra-gbps must be positive and finite"),
    (["--intra-latency-us", "nan"], "--intra-latency-us must be finite and >= 0"),
    (["--inter-latency-us", "inf"], "--inter-latency-us must be finite and >= 0"),
    (["--grad-mb", "1e305"], "these sizes, bandwidths and latencies give times that are 0 or overflow"),
    (["--max-ranks", "100000000"], f"--max-ranks must be at least two groups (16) and at most {1 << 20}"),
])
def test_cost_model_refuses_values_that_are_not_finite_or_too_large(capsys, args, message):
    """NaN and infinity made an all-NaN table with a conclusion under it ("2-D wins from 8 ranks"), exit code 0;
    --max-ranks 100000000 ran for hours without a word. Each is a usage error before anything is printed."""
    started = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        parallel.main(["cost-model"] + args)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and f"error: {message}" in err and time.perf_counter() - started < 5
    assert [line for line in err.splitlines() if "error" in line] == [err.splitlines()[-1]]


@pytest.mark.parametrize("knots, values, warmup", [([0, 5, 5, 10], [1.0, 1.0, 0.5, 0.0], 5),
                                                   ([0, 2, 2, 6], [0.4, 1.2, 0.3, 0.0], 2),
                                                   ([0, 3, 10], [0.2, 1.0, 0.0], 3), ([0, 3, 10], [0.2, 1.0, 0.0], 4)])
def test_warmup_follows_the_schedule_after_its_end_steps_included(knots, values, warmup):
    """Linear from 0 to the schedule's value at the end of the warm-up (before a step there), then the schedule
    itself: a step at the warm-up's end was lost, leaving twice the LR until the next knot."""
    original = core.piecewise_linear(knots, values)
    warmed = core.piecewise_linear(*parallel.warmup_knots(knots, values, warmup))
    before_end = original(warmup - 1e-9)
    for x in np.linspace(0, knots[-1], 41):
        expected = before_end * x / warmup if x < warmup else original(x)
        assert warmed(x) == pytest.approx(expected, abs=1e-6), x
