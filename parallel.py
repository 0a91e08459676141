"""Large-batch and multi-device training pieces, after Ying et al. 2018, "Image Classification at
Supercomputer Scale": LARS, learning-rate scaling with warm-up, ghost and distributed batch norm, a 2-D
(hierarchical) gradient all-reduce for DDP, an alpha-beta cost model of that all-reduce, and a
torchrun-aware process-group set-up that fails instead of hanging.

    python parallel.py cost-model --grad-mb 25 --group-size 8 --intra-gbps 2400 --inter-gbps 200
"""
import argparse
import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import core
import torch_backend as tb

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---------------------------------------------------------------------------------------------------------------
# LARS

class LARS(torch.optim.Optimizer):
    """SGD with momentum whose step for each weight tensor is scaled by a layer-wise trust ratio
    (You et al. 2017; used by Ying et al. 2018 for ImageNet at batch 32k and beyond).

    At very large batches one global learning rate is too large for layers whose gradients are big relative to
    their weights and too small for the rest. For an adapted tensor p with gradient g,

        local_lr = trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)   (1 if ||p|| or ||g|| is 0)
        v = momentum * v + lr * local_lr * (g + weight_decay * p);   p -= v   (nesterov: p -= momentum * v + step)

    so each adapted layer moves by about lr * trust_coefficient of its own norm per step. Tensors that are not
    adapted take local_lr = 1. Any of these keys may be overridden per parameter group:

    adapt: None adapts tensors with ndim > 1 (conv and linear weights) and leaves BN scales, BN shifts and biases,
        whose norms say little about a sensible step, on the plain lr; True/False forces it for the whole group.
    exclude_from_weight_decay: True gives non-adapted tensors no weight decay, as the MLPerf LARS reference does.
        The default, False, decays every tensor like torch.optim.SGD, which is what train_cifar.py's presets are
        tuned with, so swapping SGD for LARS changes only the per-layer rates.
    """

    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001, eps=1e-9,
                 nesterov=False, adapt=None, exclude_from_weight_decay=False):
        if lr < 0 or momentum < 0 or weight_decay < 0 or trust_coefficient <= 0 or eps < 0:
            raise ValueError("LARS needs lr, momentum, weight_decay, eps >= 0 and trust_coefficient > 0")
        if nesterov and momentum == 0:
            raise ValueError("Nesterov momentum needs momentum > 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov, adapt=adapt,
                                      exclude_from_weight_decay=exclude_from_weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = tb.closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LARS does not support sparse gradients")
                self._update(p, group)
        return loss

    def _update(self, p, group):
        adapt = p.ndim > 1 if group["adapt"] is None else group["adapt"]
        weight_decay = group["weight_decay"] if adapt or not group["exclude_from_weight_decay"] else 0.0
        grad = p.grad
        step = grad.add(p, alpha=weight_decay)
        if adapt:
            step.mul_(group["lr"] * self._trust_ratio(p, grad, weight_decay, group))
        else:
            step.mul_(group["lr"])
        momentum = group["momentum"]
        if momentum:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = step.clone()  # v starts at 0, so the first v is the step itself
            else:
                state["momentum_buffer"].mul_(momentum).add_(step)
            velocity = state["momentum_buffer"]
            step = step.add(velocity, alpha=momentum) if group["nesterov"] else velocity
        p.sub_(step)

    @staticmethod
    def _trust_ratio(p, grad, weight_decay, group):
        """A 0-d tensor, computed on the device so no step waits for the host."""
        p_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(grad)
        ratio = group["trust_coefficient"] * p_norm / (g_norm + weight_decay * p_norm + group["eps"])
        return torch.where((p_norm > 0) & (g_norm > 0), ratio, torch.ones_like(ratio))


# ---------------------------------------------------------------------------------------------------------------
# Learning-rate scaling and warm-up

SCALING_RULES = ("none", "linear", "sqrt")


def scaled_lr(base_lr, batch_size, reference_batch_size, rule="linear"):
    """The learning rate for `batch_size` given `base_lr` tuned at `reference_batch_size`.

    linear keeps the expected update per example seen (Goyal et al. 2017); sqrt keeps the variance of the update
    (Krizhevsky 2014; Hoffer et al. 2017) and is the more conservative; none keeps base_lr."""
    if rule not in SCALING_RULES:
        raise ValueError(f"unknown LR scaling rule {rule!r}; expected one of {', '.join(SCALING_RULES)}")
    if batch_size <= 0 or reference_batch_size <= 0:
        raise ValueError(f"batch sizes must be positive, got {batch_size} and {reference_batch_size}")
    ratio = batch_size / reference_batch_size
    return base_lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def warmup_knots(knots, values, warmup_epochs):
    """(knots, values) of a piecewise-linear schedule that rises linearly from 0 at knots[0] to the original
    schedule's value at knots[0] + warmup_epochs and follows the original schedule from there.

    Large scaled learning rates diverge in the first epochs, while the weights are still far from a region the
    large steps suit (Goyal et al. 2017); a schedule that already rises linearly from 0 past the end of the
    warm-up comes back unchanged in shape. Feed the result to core.piecewise_linear."""
    if warmup_epochs < 0:
        raise ValueError(f"warmup_epochs must be >= 0, got {warmup_epochs}")
    schedule = core.piecewise_linear(list(knots), list(values))  # also validates knots and values
    if warmup_epochs == 0:
        return list(knots), list(values)
    end = knots[0] + warmup_epochs
    at_end = [v for k, v in zip(knots, values) if k == end]
    # a step at the end (a repeated knot): rise to the value before it, then step as the schedule does
    later = ([(end, at_end[-1])] if len(at_end) > 1 else []) + [(k, v) for k, v in zip(knots, values) if k > end]
    top = at_end[0] if at_end else schedule(end)
    return [knots[0], end] + [k for k, _ in later], [0.0, top] + [v for _, v in later]


# ---------------------------------------------------------------------------------------------------------------
# Batch norm: ghost batches and statistics shared over groups of ranks

def _running_average_factor(bn):
    """Counts this training step and returns the weight of the new statistics in the running averages, exactly
    as nn.BatchNorm2d does (momentum, or 1/steps for a cumulative average when momentum is None)."""
    bn.num_batches_tracked.add_(1)
    return 1.0 / bn.num_batches_tracked.item() if bn.momentum is None else bn.momentum


def _swap_batchnorm(module, make):
    """Replaces every nn.BatchNorm2d in `module` (the exact class, so converted layers are left alone) with
    make(bn), which shares the original's parameters and buffers, so an optimizer built earlier still updates
    them. Works in place and returns `module`, or the new layer when `module` itself is one."""
    if type(module) is nn.BatchNorm2d:
        new = make(module)
        new.weight, new.bias = module.weight, module.bias
        new.running_mean, new.running_var = module.running_mean, module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        return new
    for name, child in module.named_children():
        setattr(module, name, _swap_batchnorm(child, make))
    return module


class GhostBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d that, in training, normalises each consecutive group of `group_size` examples with that
    group's own statistics (Hoffer et al. 2017). At large batch sizes this keeps the regularising noise of small
    batch statistics, and it reproduces the per-device statistics of a data-parallel run on a single device.

    The running statistics are updated once per step with the mean over groups of each group's mean and
    (unbiased) variance: evaluation then normalises with what the typical group was normalised with, not with
    the full batch's variance, which also contains the spread between group means that no group ever saw.
    Evaluation uses the running statistics, like BatchNorm2d."""

    def __init__(self, num_features, group_size, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.group_size = group_size

    def extra_repr(self):
        return f"{super().extra_repr()}, group_size={self.group_size}"

    def forward(self, x):
        if not self.training and self.running_mean is not None:
            return super().forward(x)
        self._check_input_dim(x)
        n, c, h, w = x.shape
        k = self.group_size
        if n % k:
            raise ValueError(f"batch of {n} is not divisible into ghost batches of {k}")
        if k * h * w == 1:
            raise ValueError("ghost batches need more than one value per channel")
        g = n // k
        # Each ghost batch's channels become channels of their own, (n, c, h, w) -> (k, g * c, h, w) laid out
        # channels-last, so that one call of PyTorch's fused batch norm normalises every group (statistics in
        # fp32 also for bf16 input). Two copies of the activations each way cost far less than doing it in
        # elementwise fp32 ops, which made ghost BN a large share of resnet9-tricks' step on a CPU.
        stacked = (x.permute(0, 2, 3, 1).reshape(g, k, h, w, c).permute(1, 2, 3, 0, 4)
                   .reshape(k, h, w, g * c).permute(0, 3, 1, 2))
        # Momentum 1 leaves each group's own mean and unbiased variance in these buffers.
        stat_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        group_mean = torch.zeros(g * c, device=x.device, dtype=stat_dtype)
        group_var = torch.ones(g * c, device=x.device, dtype=stat_dtype)
        weight = self.weight.repeat(g) if self.affine else None
        bias = self.bias.repeat(g) if self.affine else None
        y = F.batch_norm(stacked, group_mean, group_var, weight, bias, True, 1.0, self.eps)
        if self.training and self.track_running_stats:
            factor = _running_average_factor(self)
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(group_mean.view(g, c).mean(0), alpha=factor)
                self.running_var.mul_(1 - factor).add_(group_var.view(g, c).mean(0), alpha=factor)
        y = (y.permute(0, 2, 3, 1).reshape(k, h, w, g, c).permute(3, 0, 1, 2, 4)  # back to (n, c, h, w)
             .reshape(n, h, w, c).permute(0, 3, 1, 2))
        return y if x.is_contiguous(memory_format=torch.channels_last) else y.contiguous()


def convert_bn(module, group_size):
    """Swaps every nn.BatchNorm2d in `module` for a GhostBatchNorm2d of `group_size` examples per ghost batch that
    shares its parameters, buffers, momentum and eps. Works in place and returns the module."""
    return _swap_batchnorm(module, lambda bn: GhostBatchNorm2d(
        bn.num_features, group_size, bn.eps, bn.momentum, bn.affine, bn.track_running_stats))


class _GroupSyncBatchNormFunction(torch.autograd.Function):
    """Batch norm whose statistics cover the whole batch spread over `group`: one all-reduce of the per-channel
    sum, sum of squares and count in forward, one of sum(dy) and sum(dy * xhat) in backward, all in fp32.
    Sums of squares lose precision only when a channel's mean is thousands of times its spread, which
    batch-normalised activations do not reach; the variance is clamped at 0 for safety. The weight and bias
    gradients returned are this rank's share, as for any parameter: DDP sums them across ranks."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, group):
        channel_dims = (0, 2, 3)
        xf = x.float()
        local_count = xf.new_full((1,), xf.numel() // xf.shape[1])
        stats = torch.cat([xf.sum(channel_dims), (xf * xf).sum(channel_dims), local_count])
        dist.all_reduce(stats, group=group)
        sums, sums_of_squares, count = stats.split([x.shape[1], x.shape[1], 1])
        mean = sums / count
        var = (sums_of_squares / count - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            running_mean.mul_(1 - factor).add_(mean, alpha=factor)
            running_var.mul_(1 - factor).add_(var * count / (count - 1), alpha=factor)
        y = (xf - mean[:, None, None]) * invstd[:, None, None]
        if weight is not None:
            y = y * weight[:, None, None] + bias[:, None, None]
        ctx.save_for_backward(x, weight, mean, invstd, count)
        ctx.group = group
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, mean, invstd, count = ctx.saved_tensors
        channel_dims = (0, 2, 3)
        xhat = (x.float() - mean[:, None, None]) * invstd[:, None, None]
        dy = grad_y.float()
        local_sums = torch.stack([dy.sum(channel_dims), (dy * xhat).sum(channel_dims)])
        global_means = local_sums / count
        dist.all_reduce(global_means, group=ctx.group)
        mean_dy, mean_dy_xhat = global_means
        scale = invstd if weight is None else invstd * weight.float()
        grad_x = (dy - mean_dy[:, None, None] - xhat * mean_dy_xhat[:, None, None]) * scale[:, None, None]
        grad_weight = grad_bias = None
        if weight is not None:
            grad_weight = local_sums[1].to(weight.dtype) if ctx.needs_input_grad[1] else None
            grad_bias = local_sums[0].to(weight.dtype) if ctx.needs_input_grad[2] else None
        return grad_x.to(x.dtype), grad_weight, grad_bias, None, None, None, None, None


class GroupSyncBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics span the batch shards of all ranks in `process_group` (None: the
    whole world), as Ying et al. do over small groups of TPU cores: statistics of 32-64 examples keep BN working
    when each core holds only a few, and their noise still regularises, unlike statistics of the global batch.

    It exists because torch.nn.SyncBatchNorm refuses CPU tensors (and thus gloo), which tests and CPU runs need;
    on CUDA, torch.nn.SyncBatchNorm.convert_sync_batchnorm(model, group) is the fused alternative. Without an
    initialised process group, with a group of one rank, or in eval mode it is plain BatchNorm2d."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_group=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = process_group

    def forward(self, x):
        if not self.training or not dist.is_initialized() or dist.get_world_size(self.process_group) == 1:
            return super().forward(x)
        self._check_input_dim(x)
        track = self.track_running_stats
        factor = _running_average_factor(self) if track else 0.0
        return _GroupSyncBatchNormFunction.apply(
            x, self.weight, self.bias, self.running_mean if track else None, self.running_var if track else None,
            self.eps, factor, self.process_group)


def convert_sync_bn(model, process_group=None):
    """Swaps every nn.BatchNorm2d in `model` for a GroupSyncBatchNorm2d over `process_group` that shares its
    parameters, buffers, momentum and eps. Works in place and returns the model."""
    return _swap_batchnorm(model, lambda bn: GroupSyncBatchNorm2d(
        bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, process_group))


# ---------------------------------------------------------------------------------------------------------------
# Process groups and the 2-D all-reduce

def _check_grid(world_size, group_size):
    if group_size < 1 or world_size < 1 or world_size % group_size:
        raise ValueError(f"cannot split {world_size} ranks into groups of {group_size}")


def _new_groups(rank_lists):
    """Creates one process group per list of ranks and returns the one holding this rank. Every rank must create
    every group, in the same order, because dist.new_group is collective over the whole world."""
    rank, mine = dist.get_rank(), None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def bn_process_groups(world_size, group_size):
    """This rank's process group among consecutive blocks of `group_size` ranks ([0..k-1], [k..2k-1], ...),
    for GroupSyncBatchNorm2d. Every rank must call it."""
    _check_grid(world_size, group_size)
    return _new_groups([list(range(start, start + group_size)) for start in range(0, world_size, group_size)])


@dataclass
class HierarchicalState:
    """The groups of hierarchical_allreduce_hook: this rank's block of `group_size` consecutive ranks (one node,
    say) and the ranks holding the same position in every other block."""
    intra_group: dist.ProcessGroup
    inter_group: dist.ProcessGroup
    group_size: int
    world_size: int


def make_hierarchical_state(world_size, group_size):
    """Builds the groups of a world_size / group_size by group_size grid of ranks: with 4 ranks in groups of 2,
    intra groups [0, 1], [2, 3] and inter groups [0, 2], [1, 3]. Every rank must call it."""
    _check_grid(world_size, group_size)
    intra = _new_groups([list(range(start, start + group_size)) for start in range(0, world_size, group_size)])
    inter = _new_groups([list(range(position, world_size, group_size)) for position in range(group_size)])
    return HierarchicalState(intra, inter, group_size, world_size)


def hierarchical_allreduce_hook(state, bucket):
    """DDP communication hook (model.register_comm_hook(state, hierarchical_allreduce_hook)) that averages
    gradients with a 2-D all-reduce: reduce-scatter within the intra group, so each of its ranks holds the
    group's sum of one 1/group_size shard; all-reduce of that shard across the inter group, whose members hold
    the same shard; all-gather within the intra group. Only 1/group_size of the gradients crosses the slow links,
    and the slow ring has world_size/group_size ranks instead of world_size (see hierarchical_allreduce_time).

    Sums are taken in fp32 whatever the bucket's dtype, so bf16/fp16 gradients lose no precision to partial sums.
    The first two collectives are issued blocking, on the autograd thread, so every rank issues every bucket's
    collectives in the same order (callbacks of futures could reorder them); on NCCL that only makes the streams
    wait, on gloo it holds up the backward pass. DDP waits for the returned future of the last one."""
    buffer = bucket.buffer()
    n = buffer.numel()
    padded = torch.zeros(n + (-n) % state.group_size, dtype=torch.float32, device=buffer.device)
    padded[:n].copy_(buffer)
    shard = padded.new_empty(padded.numel() // state.group_size)
    _reduce_scatter(shard, padded, group=state.intra_group)
    dist.all_reduce(shard, group=state.inter_group)
    work = _all_gather(padded, shard, group=state.intra_group, async_op=True)
    return work.get_future().then(lambda _: buffer.copy_(padded[:n].div_(state.world_size)))


def init_distributed(timeout_s=300.0):
    """Joins the process group that torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)
    and returns (rank, world_size, local_rank); (0, 1, 0) when not launched that way. NCCL on CUDA, gloo on CPU.

    `timeout_s` bounds every collective (on NCCL through its watchdog, TORCH_NCCL_ASYNC_ERROR_HANDLING, on by
    default): when a rank dies or hangs, the others raise within it instead of hanging until somebody notices,
    so a launcher sees the failure and can stop the job."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, 0
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world_size, local_rank


def lost_peer(error):
    """Whether `error` is a collective that failed because another process of the job died, hung or closed its
    connections (gloo raises a plain RuntimeError naming itself; NCCL a DistBackendError)."""
    if not isinstance(error, RuntimeError) or not dist.is_initialized() or dist.get_world_size() < 2:
        return False
    return isinstance(error, getattr(dist, "DistError", ())) or any(
        s in str(error) for s in ("gloo", "NCCL", "by peer", "Timed out"))


# ---------------------------------------------------------------------------------------------------------------
# Alpha-beta cost model of the all-reduce (latency alpha per message, bandwidth beta per link direction)

def ring_allreduce_time(n_ranks, nbytes, latency_s, bandwidth_Bps):
    """Seconds for a ring all-reduce (reduce-scatter then all-gather): 2(n-1) steps, each sending nbytes/n."""
    return 2 * (n_ranks - 1) * latency_s + 2 * (n_ranks - 1) / n_ranks * nbytes / bandwidth_Bps


def hierarchical_allreduce_time(n_groups, group_size, nbytes, intra_latency, intra_bw, inter_latency, inter_bw,
                                nics_per_group=1):
    """Seconds for the 2-D all-reduce of hierarchical_allreduce_hook: reduce-scatter within each group, ring
    all-reduce of nbytes/group_size across the groups, all-gather within each group (each group phase is half a
    ring all-reduce). Groups work concurrently, and so do the group_size cross-group rings, which share their
    node's nics_per_group network links: each ring gets min(nics_per_group, group_size) / group_size * inter_bw
    (a ring cannot use more than one link per hop, so nics_per_group >= group_size gives each ring a link)."""
    within_group = ring_allreduce_time(group_size, nbytes, intra_latency, intra_bw)
    ring_bw = inter_bw * min(nics_per_group, group_size) / group_size
    across_groups = ring_allreduce_time(n_groups, nbytes / group_size, inter_latency, ring_bw)
    return within_group + across_groups


def flat_allreduce_time(n_groups, group_size, nbytes, intra_latency, intra_bw, inter_latency, inter_bw,
                        nics_per_group=1):
    """Seconds for one ring through all n_groups * group_size ranks, ordered group by group. Every step waits for
    its slowest hop, so a ring that leaves its group runs at the slower of the two links.

    Assumption: the ring crosses each group boundary once per direction, a single flow on one NIC, so that hop
    gets inter_bw whatever nics_per_group is (accepted only to share the signature). A library that stripes the
    flat ring over all of a node's NICs is modelled by nics_per_group=1 and inter_bw = the node's total."""
    n = n_groups * group_size
    intra = ring_allreduce_time(n, nbytes, intra_latency, intra_bw)
    return intra if n_groups == 1 else max(intra, ring_allreduce_time(n, nbytes, inter_latency, inter_bw))


def allreduce_crossover(nbytes, group_size, intra_latency, intra_bw, inter_latency, inter_bw, nics_per_group=1,
                        max_ranks=1 << 16):
    """The smallest number of ranks (a multiple of group_size) from which the 2-D all-reduce is faster than the
    flat ring at every larger multiple up to max_ranks, or None if the flat ring is no slower at the last one.

    With one NIC per group and the inter link as the ring's slower hop, the 2-D scheme is faster at n_groups >= 2
    exactly when
        n_groups * inter_latency + nbytes / (n_ranks * inter_bw)  >  intra_latency + nbytes / (group_size * intra_bw)
    (both sides times 2(group_size - 1)). Right: the 2-D scheme's extra intra-group phases. Left: the flat ring's
    extra inter-group latency steps, 2(n_ranks - 1) against 2(n_groups - 1), and its extra NIC traffic, a fraction
    (n_ranks - 1)/n_ranks of 2 * nbytes against (n_groups - 1)/n_groups. The left side first falls with n_groups
    and then grows, so the 2-D scheme can win at 2 groups, lose over a middle range and then win for good; this
    returns where it wins for good. Smaller gradients and a larger inter latency move that point to fewer ranks.
    With nics_per_group >= group_size (a link per cross-group ring) the 2-D scheme wins from 2 groups."""
    args = (nbytes, intra_latency, intra_bw, inter_latency, inter_bw, nics_per_group)
    crossover = None
    for n_groups in range(max_ranks // group_size, 0, -1):
        if hierarchical_allreduce_time(n_groups, group_size, *args) >= flat_allreduce_time(n_groups, group_size,
                                                                                           *args):
            break
        crossover = n_groups * group_size
    return crossover


def faster_rank_ranges(nbytes, group_size, intra_latency, intra_bw, inter_latency, inter_bw, nics_per_group=1,
                       max_ranks=1 << 16):
    """[(first, last), ...]: the runs of consecutive multiples of group_size up to max_ranks at which the 2-D
    all-reduce is faster than the flat ring. allreduce_crossover gives only where it wins for good, so a model
    in which 2-D wins at a few groups and loses beyond (zero latencies, say) needs these to say so."""
    args = (nbytes, intra_latency, intra_bw, inter_latency, inter_bw, nics_per_group)
    ranges = []
    for n_groups in range(1, max_ranks // group_size + 1):
        ranks = n_groups * group_size
        if hierarchical_allreduce_time(n_groups, group_size, *args) < flat_allreduce_time(n_groups, group_size,
                                                                                          *args):
            if ranges and ranges[-1][1] == ranks - group_size:
                ranges[-1][1] = ranks
            else:
                ranges.append([ranks, ranks])
    return [tuple(r) for r in ranges]


def format_rank_ranges(ranges):
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def crossover_summary(nbytes, group_size, *links, max_ranks):
    """Where 2-D wins for good (allreduce_crossover), and any rank counts below that where it is faster too."""
    crossover = allreduce_crossover(nbytes, group_size, *links, max_ranks=max_ranks)
    ranges = faster_rank_ranges(nbytes, group_size, *links, max_ranks=max_ranks)
    largest = max_ranks // group_size * group_size
    if crossover:
        earlier = [r for r in ranges if r[1] < crossover]
        return f"2-D wins from {crossover} ranks" + (f" (and at {format_rank_ranges(earlier)})" if earlier else "")
    if ranges:
        return f"2-D is faster at {format_rank_ranges(ranges)} ranks only, not at {largest}"
    return f"2-D is not faster at any rank count up to {largest}"


def cost_model_table(nbytes, group_size, intra_latency, intra_bw, inter_latency, inter_bw, nics_per_group=1,
                     max_ranks=1024, out=print):
    """Prints flat-ring and 2-D all-reduce times for 1, 2, 4, ... groups, then the crossover."""
    links = (intra_latency, intra_bw, inter_latency, inter_bw, nics_per_group)
    table = core.Table(["ranks", "groups", "ring_ms", "2d_ms", "speedup"], out=out)
    n_groups = 1
    while n_groups * group_size <= max_ranks:
        ring = flat_allreduce_time(n_groups, group_size, nbytes, *links)
        two_d = hierarchical_allreduce_time(n_groups, group_size, nbytes, *links)
        table.row({"ranks": n_groups * group_size, "groups": n_groups, "ring_ms": 1e3 * ring, "2d_ms": 1e3 * two_d,
                   "speedup": ring / two_d})
        n_groups *= 2
    out(crossover_summary(nbytes, group_size, *links, max_ranks=max_ranks))


def crossover_table(sizes_bytes, group_size, intra_latency, intra_bw, inter_latency, inter_bw, nics_per_group=1,
                    max_ranks=1024, out=print):
    """Prints, per gradient size, the crossover rank count and the speedup (ring / 2-D time) at 2 groups and at
    the largest multiple of group_size up to max_ranks."""
    links = (intra_latency, intra_bw, inter_latency, inter_bw, nics_per_group)
    small, large = 2 * group_size, max_ranks // group_size * group_size
    rank_counts = sorted({small, large})
    table = core.Table(["grad_MB", "2d_from"] + [f"spd@{ranks}" for ranks in rank_counts], out=out)
    for nbytes in sizes_bytes:
        speedups = {}
        for ranks in rank_counts:
            ring = flat_allreduce_time(ranks // group_size, group_size, nbytes, *links)
            speedups[f"spd@{ranks}"] = ring / hierarchical_allreduce_time(ranks // group_size, group_size, nbytes,
                                                                           *links)
        crossover = allreduce_crossover(nbytes, group_size, *links, max_ranks=max_ranks)
        if not crossover:  # "never" hid a 2-D win at fewer ranks (zero latencies: 1.64x at 2 groups)
            ranges = faster_rank_ranges(nbytes, group_size, *links, max_ranks=max_ranks)
            crossover = f"{format_rank_ranges(ranges)} only" if ranges else "never"
        table.row({"grad_MB": f"{nbytes / 1e6:g}", "2d_from": crossover, **speedups})


MAX_RANKS = 1 << 20  # cost-model's --max-ranks: beyond any machine built, and modelled in seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    cost = commands.add_parser(
        "cost-model", help="flat ring vs 2-D all-reduce time in the alpha-beta model",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Flat ring vs 2-D all-reduce in an alpha-beta model: a table over rank counts for one gradient "
                    "size, then the crossover rank count for several sizes. The defaults describe 8-GPU nodes with "
                    "NVLink (2400 Gbit/s, 2 us) and one 200 Gbit/s NIC per node (10 us).")
    cost.add_argument("--grad-mb", type=float, default=25.0, help="gradient size, MB (1e6 bytes)")
    cost.add_argument("--sweep-mb", type=float, nargs="+", default=[1.0, 10.0, 100.0, 1000.0],
                      help="gradient sizes, MB, for the crossover table")
    cost.add_argument("--group-size", type=int, default=8, help="ranks per group (node)")
    cost.add_argument("--nics-per-group", type=int, default=1,
                      help="inter-group links per group; its cross-group rings share them")
    cost.add_argument("--intra-gbps", type=float, default=2400.0, help="link within a group, Gbit/s per direction")
    cost.add_argument("--inter-gbps", type=float, default=200.0, help="one inter-group link (NIC), Gbit/s per "
                                                                      "direction")
    cost.add_argument("--intra-latency-us", type=float, default=2.0, help="per message within a group, us")
    cost.add_argument("--inter-latency-us", type=float, default=10.0, help="per message across groups, us")
    cost.add_argument("--max-ranks", type=int, default=1024, help="largest rank count to model")
    args = parser.parse_args(argv)
    if args.group_size < 2:  # groups of one make the 2-D all-reduce the flat ring (and divided 0 by 0)
        parser.error("--group-size must be at least 2: in groups of one rank the 2-D all-reduce is the flat ring")
    # NaN passes every comparison below unnoticed and made an all-NaN table with a conclusion under it
    sizes = dict(grad_mb=[args.grad_mb], sweep_mb=args.sweep_mb, intra_gbps=[args.intra_gbps],
                 inter_gbps=[args.inter_gbps])
    for name, values in sizes.items():
        if not all(math.isfinite(v) and v > 0 for v in values):
            parser.error(f"--{name.replace('_', '-')} must be positive and finite, not {' '.join(map(str, values))}")
    for name in ("intra_latency_us", "inter_latency_us"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) >= 0):
            parser.error(f"--{name.replace('_', '-')} must be finite and >= 0, not {getattr(args, name)}")
    if args.nics_per_group < 1:
        parser.error("--nics-per-group must be at least 1")
    # the crossover scans every multiple of --group-size up to it: 1e8 ranks ran for hours without a word
    if not 2 * args.group_size <= args.max_ranks <= MAX_RANKS:
        parser.error(f"--max-ranks must be at least two groups ({2 * args.group_size}) and at most {MAX_RANKS}")
    links = (args.group_size, args.intra_latency_us * 1e-6, args.intra_gbps * 1e9 / 8, args.inter_latency_us * 1e-6,
             args.inter_gbps * 1e9 / 8, args.nics_per_group)
    # values each finite can still overflow or underflow the times (--grad-mb 1e305, --inter-gbps 1e-320)
    for nbytes in [args.grad_mb * 1e6] + [mb * 1e6 for mb in args.sweep_mb]:
        for model in (flat_allreduce_time, hierarchical_allreduce_time):
            for n_groups in (1, args.max_ranks // args.group_size):
                if not 0 < model(n_groups, links[0], nbytes, *links[1:]) < math.inf:
                    parser.error("these sizes, bandwidths and latencies give times that are 0 or overflow")
    print(f"{args.grad_mb:g} MB gradient, {args.group_size} ranks and {args.nics_per_group} NIC(s) per group:")
    cost_model_table(args.grad_mb * 1e6, *links, max_ranks=args.max_ranks)
    print("\ncrossover by gradient size (2d_from: ranks from which 2-D is faster, up to --max-ranks; 'A-B only': "
          "faster there, not at --max-ranks; spd@N: ring / 2-D time at N ranks):")
    crossover_table([mb * 1e6 for mb in args.sweep_mb], *links, max_ranks=args.max_ranks)


if __name__ == "__main__":
    main()
