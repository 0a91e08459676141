"""train_cifar.py under torchrun (gloo on CPU) against the single-process run, and its large-batch options."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

import train_cifar
from conftest import ROOT, synthetic

SCRIPT = os.path.join(ROOT, "train_cifar.py")
TINY = ["--preset", "resnet9", "--widths", "8", "8", "8", "8", "--batch-size", "40", "--epochs", "2",
        "--precision", "fp32", "--device", "cpu"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(n, *args, script=SCRIPT):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
                           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), script, *args],
                          capture_output=True, text=True, timeout=900, env=env)


def why(r):
    """A failed launch's rank errors (they come first; torchrun's own traceback after them says little)."""
    return r.stderr if len(r.stderr) < 4000 else r.stderr[:3000] + "\n...\n" + r.stderr[-800:]


@pytest.fixture
def tiny_npz(tmp_path):
    path = tmp_path / "tiny.npz"
    np.savez(path, **synthetic(400, 100))
    return str(path)


def summary(folder):
    (path,) = list(folder.glob("*.json"))  # only rank 0 writes
    return json.loads(path.read_text())


def test_two_processes_with_world_batch_norm_equal_one_process(tiny_npz, tmp_path):
    """Ten steps at a small LR, where float rounding has not yet grown: the 2-process run with BN over the
    world matches to 5e-6 (measured 2e-7), while per-process BN statistics differ by 4e-5."""
    args = [*TINY, "--epochs", "1", "--lr-values", "0", "0.02", "0"]
    one = subprocess.run([sys.executable, SCRIPT, "--data", tiny_npz, "--log-dir", str(tmp_path / "one"), *args],
                         capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert one.returncode == 0, one.stderr
    two = torchrun(2, "--data", tiny_npz, "--log-dir", str(tmp_path / "two"), "--sync-bn-group-size", "2", *args)
    assert two.returncode == 0, two.stderr
    a, b = summary(tmp_path / "one"), summary(tmp_path / "two")
    assert b["world_size"] == 2 and b["config"]["batch_size"] == 40  # the global batch is what is logged
    losses_a = [e["train_loss"] for e in a["runs"][0]["epochs"]]
    losses_b = [e["train_loss"] for e in b["runs"][0]["epochs"]]
    np.testing.assert_allclose(losses_b, losses_a, rtol=5e-6)
    assert abs(a["accuracy_mean"] - b["accuracy_mean"]) <= 0.02  # sharded evaluation, summed across ranks
    assert two.stdout.count("accuracy") == 1  # only rank 0 reports


def test_indivisible_global_batch_fails_on_every_rank(tiny_npz, tmp_path):
    """Each rank, started alone as torchrun would start it, exits 2 with the message without waiting for the
    other (which never comes: a rank that waited for its peer would hang here until the timeout)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for rank in ("0", "1"):
        r = subprocess.run([sys.executable, SCRIPT, "--data", tiny_npz, "--log-dir", str(tmp_path), *TINY,
                            "--batch-size", "41"], capture_output=True, text=True, timeout=120,
                           env=dict(env, RANK=rank, LOCAL_RANK=rank))
        assert r.returncode == 2 and "global batch size 41 is not divisible by the 2 processes" in r.stderr
    # Under torchrun the launcher stops the other workers when the first fails: all exit non-zero, no log.
    r = torchrun(2, "--data", tiny_npz, "--log-dir", str(tmp_path), *TINY, "--batch-size", "41")
    assert r.returncode != 0 and "global batch size 41 is not divisible by the 2 processes" in r.stderr
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.parametrize("other, differs", [(["--seed", "5"], "seed 0 on rank 0, 5 on rank 1"),
                                           (["--epochs", "4"], "epochs 2.0 on rank 0, 4.0 on rank 1")])
def test_ranks_given_different_options_fail_on_every_rank(tiny_npz, tmp_path, other, differs):
    """Ranks started by hand with different options: another seed trained both ranks on overlapping shards and
    logged rank 0's seed (exit 0); other epochs hung rank 0 in a collective until the timeout (review 2026-12-05)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ranks = [subprocess.Popen([sys.executable, SCRIPT, "--data", tiny_npz, "--log-dir", str(tmp_path / "logs"), *TINY,
                               *(other if rank == "1" else [])], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(env, RANK=rank, LOCAL_RANK=rank)) for rank in ("0", "1")]
    try:
        errs = [p.communicate(timeout=120)[1] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    for p, err in zip(ranks, errs):
        assert p.returncode == 2 and "Traceback" not in err, err
        assert err.startswith(f"train_cifar.py: error: the processes were given different options ({differs}"), err
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").glob("*.json"))


def test_a_rank_killed_mid_run_ends_the_other_with_one_line_and_its_rows_kept(tiny_npz, tmp_path):
    """kill -9 of rank 1 while both train: rank 0 printed gloo's RuntimeError traceback from inside backward()
    (review 2026-12-05); now one line naming the lost peer, exit 1, and the TSV rows it wrote are kept."""
    import time
    import core
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    args = [sys.executable, SCRIPT, "--data", tiny_npz, *TINY, "--epochs", "2000", "--tta", "0"]
    ranks = [subprocess.Popen(args + (["--log-dir", str(tmp_path)] if rank == "0" else []), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=dict(env, RANK=rank, LOCAL_RANK=rank))
             for rank in ("0", "1")]
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (list(tmp_path.glob("*.tsv")) and
                                              len(core.read_tsv(str(next(tmp_path.glob("*.tsv"))))) >= 2):
            assert ranks[0].poll() is None, ranks[0].communicate()[1]
            time.sleep(0.2)
        ranks[1].kill()
        out, err = ranks[0].communicate(timeout=120)
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    assert ranks[0].returncode == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("train_cifar.py: error: another process of the job failed")
    (tsv,) = tmp_path.glob("*.tsv")
    assert f"run 0 in flight is lost; every epoch's row in {tsv}" in out and len(core.read_tsv(str(tsv))) >= 2


def test_lr_scaling_and_warmup_compose_with_the_preset_schedule():
    cfg = train_cifar.make_config("resnet9", batch_size=2048, lr_scaling="linear", warmup_epochs=2)
    assert cfg["reference_batch_size"] == 512
    lr = train_cifar.lr_schedule(cfg)
    assert lr(5) == pytest.approx(1.6)             # 0.4 at batch 512, times 2048 / 512
    assert lr(1) == pytest.approx(0.5 * 1.6 * 2 / 5)  # halfway up the warm-up to the schedule's value at epoch 2
    assert lr(14.5) == pytest.approx(0.8)
    sqrt = train_cifar.lr_schedule(train_cifar.make_config("resnet9", batch_size=2048, lr_scaling="sqrt"))
    assert sqrt(5) == pytest.approx(0.8)


def test_lars_option_trains(tmp_path):
    data = synthetic(400, 100)
    for split in ("train", "test"):  # make the classes learnable: each has its own tint
        tint = (data[f"{split}_y"][:, None, None, None] * 20).astype(np.int64)
        data[f"{split}_x"] = np.clip(data[f"{split}_x"] // 3 + tint, 0, 255).astype(np.uint8)
    np.savez(tmp_path / "tinted.npz", **data)
    r = subprocess.run([sys.executable, SCRIPT, "--data", str(tmp_path / "tinted.npz"), "--log-dir", str(tmp_path), *TINY,
                        "--optimizer", "lars", "--trust-coefficient", "0.02", "--lr-knots", "0", "1", "2",
                        "--lr-values", "0", "2", "0",
                        "--bn-group-size", "20"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    s = summary(tmp_path)
    losses = [e["train_loss"] for e in s["runs"][0]["epochs"]]
    assert s["config"]["optimizer"] == "lars" and losses[-1] < 0.9 * losses[0]  # measured 2.22 -> 1.77


def test_two_processes_follow_the_freezes(tiny_npz, tmp_path):
    """fast94 trains the whitening bias for whiten_bias_epochs and then freezes it, and here block 2 after
    epoch 2; DDP must be rebuilt for each smaller parameter set (a stale reducer fails at the first step after a
    freeze). The 2-process run with world BN still matches one process epoch by epoch."""
    args = ["--preset", "fast94", "--widths", "8", "16", "16", "--batch-size", "40", "--epochs", "3",
            "--precision", "fp32", "--device", "cpu", "--whiten-bias-epochs", "1", "--block-epochs", "0", "2",
            "--tta", "0", "--lr-knots", "0", "1", "3", "--lr-values", "0", "0.02", "0"]
    one = subprocess.run([sys.executable, SCRIPT, "--data", tiny_npz, "--log-dir", str(tmp_path / "one"), *args],
                         capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert one.returncode == 0, one.stderr
    two = torchrun(2, "--data", tiny_npz, "--log-dir", str(tmp_path / "two"), "--sync-bn-group-size", "2", *args)
    assert two.returncode == 0, why(two)
    losses = [[e["train_loss"] for e in summary(tmp_path / d)["runs"][0]["epochs"]] for d in ("one", "two")]
    assert len(losses[1]) == 3
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


def test_data_selection_runs_under_torchrun(tiny_npz, tmp_path):
    """Each process scores its own slice of the candidates and keeps its share of the batch: the global batch
    stays batch_size, and an epoch is a pass over the candidates."""
    small = ["--preset", "fast96", "--widths", "8", "8", "8", "--proxy-widths", "4", "4", "4", "--proxy-every", "2",
             "--batch-size", "40", "--epochs", "1", "--lr-values", "0.05", "0.25", "0.02", "--precision", "fp32",
             "--device", "cpu"]
    odd = torchrun(2, "--data", tiny_npz, "--log-dir", "", *small, "--select-fraction", "0.66")
    assert odd.returncode != 0 and "the 61 candidates a step (batch size / select-fraction) are not" in odd.stderr
    # train_cifar.py under a wrapper that records, per rank, the candidates each step drew and the examples it
    # trained on: the logged step count is the plan, and a rank keeping all its candidates ran to it unseen
    sizes = tmp_path / "sizes"
    sizes.mkdir()
    wrapper = tmp_path / "recording_train_cifar.py"
    wrapper.write_text(RECORDING_WRAPPER.format(root=ROOT, out=str(sizes)))
    two = torchrun(2, "--data", tiny_npz, "--log-dir", str(tmp_path), *small, script=str(wrapper))
    assert two.returncode == 0, why(two)
    s = summary(tmp_path)
    assert s["world_size"] == 2 and s["train_steps"] == 400 // 80 and s["runs"][0]["accuracy"] is not None
    for rank in (0, 1):  # 80 candidates a step over 2 ranks, each keeping its half of the global batch of 40
        steps = [tuple(map(int, line.split())) for line in (sizes / f"rank{rank}").read_text().splitlines()]
        assert steps == [(40, 20)] * 5, (rank, steps)


RECORDING_WRAPPER = """
import os, sys
sys.path.insert(0, {root!r})
import core, train_cifar
select = train_cifar.Proxy.select

def recording(self, x, y, keep, *args, **kwargs):
    xs, ys = select(self, x, y, keep, *args, **kwargs)
    with open(os.path.join({out!r}, "rank" + os.environ["RANK"]), "a") as f:
        f.write(f"{{len(y)}} {{len(ys)}}\\n")
    return xs, ys
train_cifar.Proxy.select = recording
core.exit_with(train_cifar.main)
"""


def test_loss_history_selection_under_torchrun_equals_one_process(tiny_npz, tmp_path):
    """Every process stores the whole global batch's losses, so all choose as one process would: with BN over
    the world the two-process run's losses match the single-process run's, epoch 2 (chosen by history) too."""
    args = ["--preset", "fast94", "--widths", "8", "8", "8", "--batch-size", "40", "--epochs", "2",
            "--select-fraction", "0.5", "--select-by", "loss", "--train-sizes", "32", "--lr-values", "0.05", "0",
            "--precision", "fp32", "--device", "cpu", "--data", tiny_npz]
    one = subprocess.run([sys.executable, SCRIPT, "--log-dir", str(tmp_path / "one"), *args],
                         capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert one.returncode == 0, why(one)
    two = torchrun(2, "--log-dir", str(tmp_path / "two"), "--sync-bn-group-size", "2", *args)
    assert two.returncode == 0, why(two)
    a, b = summary(tmp_path / "one"), summary(tmp_path / "two")
    assert a["train_steps"] == b["train_steps"] == 2 * (400 // 80)
    losses = [[e["train_loss"] for e in s["runs"][0]["epochs"]] for s in (a, b)]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


@pytest.mark.parametrize("group", ["1", "2"])
def test_hierarchical_all_reduce_trains_as_the_flat_one(tiny_npz, tmp_path, group):
    """--allreduce hierarchical sums gradients within groups, then across the groups' leaders, then shares the
    result: the same gradient as DDP's flat all-reduce, so the same training (to float rounding), whether the two
    processes form two groups of one or one group of two. (The hook alone is tested in test_parallel.py.)"""
    args = [*TINY, "--epochs", "1", "--data", tiny_npz]
    flat = torchrun(2, *args, "--log-dir", str(tmp_path / "flat"))
    assert flat.returncode == 0, why(flat)
    tiered = torchrun(2, *args, "--log-dir", str(tmp_path / "tiered"), "--allreduce", "hierarchical",
                      "--allreduce-group-size", group)
    assert tiered.returncode == 0, why(tiered)
    a, b = summary(tmp_path / "flat"), summary(tmp_path / "tiered")
    assert b["config"]["allreduce"] == "hierarchical"
    np.testing.assert_allclose([e["train_loss"] for e in b["runs"][0]["epochs"]],
                               [e["train_loss"] for e in a["runs"][0]["epochs"]], rtol=1e-5)
    assert b["runs"][0]["accuracy"] == pytest.approx(a["runs"][0]["accuracy"], abs=0.011)


def test_warmup_rises_over_its_epochs_into_a_schedule_that_does_not_start_at_0():
    """fast94's LR falls linearly from 1.6 at epoch 0 to 0 at 10; a 2-epoch warm-up rises from 0 to the
    schedule's value at epoch 2 (1.28) and follows it from there (resnet9's schedule already rises from 0, so
    a warm-up of another length leaves it unchanged)."""
    lr = train_cifar.lr_schedule(train_cifar.make_config("fast94", warmup_epochs=2))
    assert [lr(e) for e in (0, 1, 2, 3, 10)] == pytest.approx([0.0, 0.64, 1.28, 1.12, 0.0])
    stretched = train_cifar.lr_schedule(train_cifar.make_config("fast94", epochs=20, warmup_epochs=2))
    assert [stretched(e) for e in (1, 2, 4)] == pytest.approx([0.72, 1.44, 1.28])


class FakeDDP:
    """A stand-in for DistributedDataParallel (no process group needed) that records the comm hook it is given."""

    def __init__(self, module):
        self.module, self.hooks = module, []

    def register_comm_hook(self, state, hook):
        self.hooks.append((state, hook))


@pytest.mark.parametrize("allreduce, group_size, local_world, expected", [
    ("flat", 0, "2", None), ("hierarchical", 0, "2", (4, 2)), ("hierarchical", 0, None, (4, 4)),
    ("hierarchical", 1, "2", (4, 1))])
def test_step_fn_wires_the_2d_all_reduce_on_the_chosen_groups(monkeypatch, allreduce, group_size, local_world,
                                                               expected):
    """The torchrun runs above cannot tell a missing hook, or other groups, from the right ones (every grouping
    sums the same gradients): the hook and its grid (--allreduce-group-size, else the processes on a node,
    LOCAL_WORLD_SIZE, else all of them) are checked here. One process gets the plain net."""
    import parallel
    grids = []
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", FakeDDP)
    monkeypatch.setattr(parallel, "make_hierarchical_state", lambda world, group: grids.append((world, group)) or "st")
    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    cfg = train_cifar.make_config("resnet9", allreduce=allreduce, allreduce_group_size=group_size)
    model = torch.nn.Linear(2, 2)
    assert train_cifar.make_step_fn(cfg, model, 1) is model and not grids
    step_fn = train_cifar.make_step_fn(cfg, model, 4)
    assert isinstance(step_fn, FakeDDP) and step_fn.module is model
    assert grids == ([expected] if expected else [])
    assert step_fn.hooks == ([("st", parallel.hierarchical_allreduce_hook)] if expected else [])


def test_compile_warm_up_takes_the_per_process_batch_and_a_wrapper_per_frozen_state(monkeypatch):
    """Under torchrun a step trains on batch_size / world images: graphs compiled for the global batch would be
    compiled again in the timed steps. And each state of what trains gets its own DDP wrapper, built after the
    change (a wrapper built before reduces the parameters that trained then)."""
    cfg = train_cifar.make_config("fast94", widths=(8, 8, 8), batch_size=40, epochs=3, whiten_bias_epochs=1,
                                  block_epochs=(0, 2), precision="fp32")
    model = train_cifar.build_model(cfg, torch.device("cpu"))
    sizes, wrapped, batches = [], [], train_cifar.warm_up_batches
    monkeypatch.setattr(train_cifar, "warm_up_batches", lambda n, *a: sizes.append(n) or batches(n, *a))
    monkeypatch.setattr(train_cifar, "make_step_fn", lambda c, m, world: wrapped.append(
        (world, tuple(p.requires_grad for p in m.parameters()))) or m)
    monkeypatch.setattr(train_cifar, "forward_backward", lambda cfg, model, step_fn, x, y, *a: None)
    train_cifar.warm_up_compile(cfg, model, torch.device("cpu"), "fp32", 2)
    assert sizes == [20]
    states = []
    for epoch in (1, 2, 3):
        with train_cifar.trains_as(model, train_cifar.trains_in(cfg, epoch)):
            states.append((2, tuple(p.requires_grad for p in model.parameters())))
    assert wrapped == list(dict.fromkeys(states)) and len(wrapped) == 3


def test_a_net_not_finite_on_another_rank_alone_ends_the_run_as_diverged(monkeypatch):
    """Each rank's BN statistics come from its own shard (DDP broadcasts rank 0's only at the next forward), so
    one rank's net can hold inf where rank 0's is finite: the epoch totals count the finite nets, and fewer than
    the world's is a divergence on every rank. Rank 0 of two here, its peer faked into the all-reduce: its
    loss, accuracy and count as rank 0's, its net not finite."""
    import torch.distributed as dist
    import torch_backend as tb
    cfg = train_cifar.make_config("fast94", widths=(8, 8, 8), batch_size=40, epochs=1, precision="fp32", tta=0)
    cpu = torch.device("cpu")
    data = tb.to_device(tb.validate(synthetic(80, 20), "tiny"), cpu, torch.float32, pad=cfg["pad"])
    monkeypatch.setattr(train_cifar, "make_step_fn", lambda cfg, model, world: model)

    def peer(t, *args, **kwargs):
        if t.dim() == 1:  # the epoch totals: loss sum, correct, seen, whether the net is finite
            t.copy_(t * torch.tensor([2.0, 2.0, 2.0, 1.0]))
    monkeypatch.setattr(dist, "all_reduce", peer)
    with pytest.raises(train_cifar.Diverged, match="the net's weights or BN statistics are not finite at epoch 1"):
        train_cifar.run_once(cfg, data, 0, 0, cpu, "fp32", log=lambda *a: None, rank=0, world=2)
