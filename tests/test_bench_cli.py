"""The benchmark scripts refuse impossible counts with a one-line usage error, before timing or logging anything
(a zero once divided by zero, or appended a NaN line to a committed JSONL log)."""
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from conftest import synthetic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_allocator  # noqa: E402
import bench_ddp  # noqa: E402
import bench_presets  # noqa: E402


@pytest.mark.parametrize("script, args, log_option", [
    ("bench_presets.py", ["--steps", "0"], "--log-dir"),
    ("bench_presets.py", ["--repeats", "0"], "--log-dir"),
    ("bench_augment.py", ["--batch", "0"], "--log-dir"),
    ("bench_augment.py", ["--repeats", "0"], "--log-dir"),
    ("bench_allocator.py", ["--threads", "0"], "--out"),
    ("bench_ddp.py", ["--repeats", "0"], "--out"),
    ("bench_convs.py", ["--repeats", "0"], "--log-dir"),
    ("bench_tuning.py", ["--times", "0"], "--log-dir"),
    ("eval_tta.py", ["missing.pt", "--repeats", "0"], "--log-dir"),
])
def test_impossible_counts_exit_2_before_anything_is_written(tmp_path, script, args, log_option):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args, log_option, str(out)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and f"{script}: error: " in r.stderr
    assert "at least 1" in r.stderr or "must be >= 1" in r.stderr
    assert not out.exists() and os.listdir(tmp_path) == []


@pytest.mark.parametrize("args, message", [
    (["--presets", "nope"], "argument --presets: invalid choice: 'nope'"),
    (["--set", "batch_size=0"], "batch size must be a positive integer, got 0"),
    (["--set", "nope=1"], "nope"),
])
def test_bench_allocator_refuses_bad_presets_and_sets_itself(tmp_path, args, message):
    """They went to every bench_presets.py child unchecked: each failed with its own usage text and exit 1 after
    the allocators were found (review 2026-12-05)."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_allocator.py"), *args, "--out",
                        str(tmp_path / "out.jsonl")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and "bench_allocator.py: error: " in r.stderr and message in r.stderr, r.stderr
    assert "bench_presets.py" not in r.stderr and not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("script, args, message", [
    ("bench_presets.py", ["--log-dir", "/dev/null/logs"], "argument --log-dir: folder /dev/null/logs: cannot write"),
    ("eval_tta.py", ["missing.pt", "--log-dir", "/dev/null/logs"], "folder /dev/null/logs: cannot write"),
    ("bench_convs.py", ["--device", "gpu0"], "argument --device: device 'gpu0': not a device name"),
])
def test_an_unwritable_log_folder_or_unusable_device_exits_2_before_anything_runs(tmp_path, script, args, message):
    """Refused when the options are read: not a traceback after minutes of timing whose numbers would be lost."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert os.listdir(tmp_path) == []


def bench(script, *args, cwd, timeout=300):
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


@pytest.mark.parametrize("script", ["eval_tta.py", "bench_augment.py"])
@pytest.mark.parametrize("data, message", [("missing.npz", "no CIFAR-10 data at missing.npz"),
                                           ("corrupt.npz", "corrupt.npz: truncated or corrupt .npz")])
def test_missing_or_corrupt_data_is_a_one_line_error(tmp_path, script, data, message):
    """tb.DataError's message says what to pass; it ended in a traceback instead."""
    (tmp_path / "corrupt.npz").write_text("not an npz")
    (tmp_path / "run.pt").write_text("")  # eval_tta loads the data before its checkpoints
    args = ["run.pt"] if script == "eval_tta.py" else []
    r = bench(script, *args, "--data", data, "--log-dir", "out", cwd=tmp_path)
    assert r.returncode == 2 and f"{script}: error: {message}" in r.stderr and "Traceback" not in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["corrupt.npz", "run.pt"]


TINY_STEP = ["--steps", "1", "--repeats", "1", "--set", "widths=(8,8,8)", "--set", "batch_size=20",
             "--set", "precision=fp32"]


@pytest.mark.parametrize("script, args", [
    ("bench_ddp.py", ["--warmup", "0"]),
    ("bench_allocator.py", ["--allocators", "glibc"]),
])
@pytest.mark.parametrize("out, message", [
    ("blocker/x.jsonl", "--out blocker/x.jsonl: its folder blocker: cannot write"),
    (".", "--out . is a folder"),
])
def test_an_unwritable_out_file_exits_2_before_anything_is_timed(tmp_path, script, args, out, message):
    """Found when the options are read, not at the append after the timing, whose measurement was then lost."""
    (tmp_path / "blocker").write_text("a file where --out wants a folder")
    r = bench(script, *TINY_STEP, *args, "--out", out, cwd=tmp_path)
    assert r.returncode == 2 and f"{script}: error: {message}" in r.stderr and "Traceback" not in r.stderr
    assert "img/s" not in r.stdout and os.listdir(tmp_path) == ["blocker"]


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="bench_ddp.py runs on the GPU where there is one")


@pytest.mark.parametrize("script, args, message", [
    ("bench_presets.py", ["--presets", "resnet9-tricks", "--device", "cpu", "--steps", "1", "--repeats", "1",
                          "--set", "batch_size=100", "--set", "widths=(8,8,8,8)"],
     "resnet9-tricks: per-process batch 100 is not divisible into BN groups of 32"),
    ("bench_presets.py", ["--presets", "fast94", "--device", "cpu", *TINY_STEP, "--set", "precision=fp16"],
     "fast94: fp16 is for CUDA GPUs"),
    ("bench_presets.py", ["--flops-only", "--presets", "fast94", "--set", "batch_size=60000"],
     "fast94: batch size 60000 exceeds the 50000 training images"),
    ("bench_presets.py", ["--flops-only", "--presets", "fast96", "--set", "batch_size=30000"],
     "fast96: batch size 60000 (candidates for selection) exceeds the 50000 training images"),
    ("bench_ddp.py", [*TINY_STEP, "--warmup", "0", "--set", "batch_size=50001"],
     "batch size 50001 exceeds the 50000 training images"),
    ("bench_ddp.py", [*TINY_STEP, "--warmup", "0", "--set", "bn_group_size=16"],
     "per-process batch 20 is not divisible into BN groups of 16"),
    pytest.param("bench_ddp.py", [*TINY_STEP, "--warmup", "0", "--set", "precision=fp16"], "fp16 is for CUDA GPUs",
                 marks=CPU_ONLY),
    ("bench_ddp.py", [*TINY_STEP, "--warmup", "0", "--set", "select_fraction=0.5"],
     "this times plain data-parallel steps, without data selection"),
    # options without effect in what is timed (the compile mode of an eager step timed as if compiled)
    ("bench_presets.py", ["--flops-only", "--presets", "fast94", "--set", "compile_mode=reduce-overhead"],
     "--set compile_mode= has no effect without --compile"),
    ("bench_presets.py", ["--flops-only", "--presets", "fast94", "--set", "compile=True"],
     "--set compile=: use --compile"),  # (silently replaced by --compile's absence)
    ("bench_ddp.py", [*TINY_STEP, "--warmup", "0", "--set", "trust_coefficient=0.01"],
     "--set trust_coefficient= has no effect without --optimizer lars"),
    ("bench_presets.py", ["--flops-only", "--presets", "fast94", "--set", "preset=resnet9"],
     "fast94: preset is not an option to set"),
    ("bench_presets.py", ["--flops-only", "--presets", "fast94", "--breakdown", "--compile"],
     "--flops-only times nothing: --breakdown would have no effect"),
    ("bench_presets.py", ["--flops-only", "--presets", "fast94", "--profile"],
     "--flops-only times nothing: --profile would have no effect"),  # (on a GPU it was otherwise accepted)
])
def test_options_train_would_refuse_exit_2_before_anything_is_timed(tmp_path, script, args, message):
    """The checks train() makes before a run (the batch fits the training images, ghost-BN groups divide it, the
    device runs the precision); each ended in a traceback from inside the timing."""
    log_option = ["--out", ""] if script == "bench_ddp.py" else ["--log-dir", ""]
    r = bench(script, *args, *log_option, cwd=tmp_path)
    assert r.returncode == 2 and f"{script}: error: {message}" in r.stderr and "Traceback" not in r.stderr
    assert os.listdir(tmp_path) == []


def test_a_batch_of_every_training_image_is_timed(monkeypatch, capsys):
    """A batch as large as the data set is what train() allows; its batches' start offsets divided by zero."""
    tiny = dict(widths=(8, 8, 8), batch_size=64, precision="fp32", epochs=1)
    monkeypatch.setattr(bench_presets, "N_TRAIN", 64)
    r = bench_presets.measure("fast94", torch.device("cpu"), steps=2, repeats=1, overrides=tiny)
    assert r["losses_finite"] and r["img_per_s"][0] > 0
    monkeypatch.setattr(bench_ddp, "N_TRAIN", 64)
    monkeypatch.setattr(sys, "argv", ["bench_ddp.py", "--steps", "2", "--repeats", "1", "--warmup", "0", "--out", "",
                                      *(f"--set={k}={v}".replace(" ", "") for k, v in tiny.items())])
    bench_ddp.main()
    out = capsys.readouterr().out
    assert " img/s on " in out and "±" not in out  # one repeat has no spread: it printed "5,798 ± 0 img/s"
    monkeypatch.setattr(sys, "argv", ["bench_presets.py", "--presets", "fast94", "--steps", "2", "--repeats", "1",
                                      "--device", "cpu", "--log-dir", "",
                                      *(f"--set={k}={v}".replace(" ", "") for k, v in tiny.items())])
    bench_presets.main()
    (row,) = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["fast94"]]
    assert row[4] == "-"  # (the ± column after img/s: it printed 0)


def test_ddp_check_runs_the_documented_fp32(tmp_path):
    """README's 5-seed check was fp32 (on an AVX2 CPU, where auto picks fp32); without --precision the script
    ran bf16 on a CPU with bf16. Here python and torchrun are stand-ins that record their arguments."""
    import stat
    import subprocess
    for name in ("python", "torchrun"):
        stub = tmp_path / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> "{tmp_path}/calls"\n')
        stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", DATA="cifar10.npz")
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "ddp_check.sh")
    r = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert r.returncode == 0 and [c.split()[0] for c in calls] == ["python", "torchrun"], r.stderr
    assert all(" --precision fp32 " in f"{c} " and " --runs 5 " in c for c in calls), calls


def test_augment_refuses_more_images_a_repeat_than_the_data_holds(tmp_path):
    """Slices past the end of a small data set are empty, yet were counted: 200 images gave 523k img/s."""
    np.savez(tmp_path / "tiny.npz", **synthetic(n_train=200, n_test=10))
    r = bench("bench_augment.py", "--data", "tiny.npz", "--batch", "100", "--batches", "40", "--repeats", "1",
              "--log-dir", "out", cwd=tmp_path)
    assert r.returncode == 2 and "--batch 100 x --batches 40 = 4000 images a repeat, more than the 200 training " \
                                 "images in tiny.npz" in r.stderr
    assert os.listdir(tmp_path) == ["tiny.npz"]


def test_bench_ddp_times_the_net_a_run_builds(monkeypatch, capsys):
    """Ghost BN (resnet9-tricks') was left out, so such a preset was timed as another net."""
    import parallel
    groups, convert = [], parallel.convert_bn
    monkeypatch.setattr(parallel, "convert_bn", lambda model, g: (groups.append(g), convert(model, g))[1])
    monkeypatch.setattr(bench_ddp, "N_TRAIN", 64)
    monkeypatch.setattr(sys, "argv", ["bench_ddp.py", "--steps", "1", "--repeats", "1", "--warmup", "0", "--out", "",
                                      "--set=widths=(8,8,8)", "--set=batch_size=20", "--set=precision=fp32",
                                      "--set=bn_group_size=10"])
    bench_ddp.main()
    assert groups == [10] and "img/s" in capsys.readouterr().out


@pytest.mark.parametrize("chosen", [[], ["--allocators", "glibc"]])
def test_bench_allocator_says_which_allocators_it_skips(tmp_path, monkeypatch, capsys, chosen):
    """Without --allocators, one not installed was left out of the table silently (tcmalloc, here)."""
    import torch_backend as tb
    monkeypatch.setattr(tb, "find_allocator_library", lambda name: "/lib/libjemalloc.so.2" if name == "jemalloc"
                        else None)
    timed = []  # the allocators' runs: the first fails, which ends the benchmark before anything is timed
    monkeypatch.setattr(bench_allocator, "subprocess", types.SimpleNamespace(run=lambda cmd, env, **kw: (
        timed.append(env.get("LD_PRELOAD")), types.SimpleNamespace(returncode=1, stderr="stopped"))[1]))
    monkeypatch.setattr(sys, "argv", ["bench_allocator.py", *chosen, "--out", str(tmp_path / "a.jsonl")])
    with pytest.raises(SystemExit, match="glibc: bench_presets.py failed"):
        bench_allocator.main()
    note = "note: skipping tcmalloc, not found on this machine; to time it: apt-get install libtcmalloc-minimal4"
    assert (note in capsys.readouterr().out) == (not chosen) and timed == [None]


def ddp_bench_rank(monkeypatch, tmp_path, rank, world, *sets):
    """bench_ddp.main as rank `rank` of `world` would run it, with the process group faked: each step's labels,
    the net's conversions and the world it was wrapped for are recorded; every other rank's timing is taken as
    100 s, so the slowest rank's time is 100 s."""
    import parallel
    import torch.distributed as dist
    import train_cifar
    monkeypatch.undo()  # the last rank's fakes
    seen = dict(labels=[], sync_bn=[], wrapped=[])
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setattr(bench_ddp, "N_TRAIN", 64)
    monkeypatch.setattr(parallel, "init_distributed", lambda: (rank, world, rank))
    monkeypatch.setattr(parallel, "bn_process_groups", lambda w, g: ("group", w, g))
    monkeypatch.setattr(parallel, "convert_sync_bn", lambda model, group: seen["sync_bn"].append(group) or model)
    monkeypatch.setattr(train_cifar, "make_step_fn", lambda cfg, model, w: seen["wrapped"].append(w) or model)
    step = train_cifar.train_step
    monkeypatch.setattr(train_cifar, "train_step", lambda cfg, fn, opt, x, y, *a: (seen["labels"].append(y.clone()),
                                                                                  step(cfg, fn, opt, x, y, *a))[1])
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)
    ops = {dist.ReduceOp.MAX: lambda t: t.clamp_(min=100.0), dist.ReduceOp.SUM: lambda t: t.add_(100.0 * (world - 1))}
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=dist.ReduceOp.SUM, **k: ops[op](t))
    out = tmp_path / f"rank{rank}-of-{world}.jsonl"
    monkeypatch.setattr(sys, "argv", ["bench_ddp.py", "--steps", "3", "--repeats", "1", "--warmup", "1", "--out",
                                      str(out), "--set=widths=(8,8,8)", "--set=batch_size=20",
                                      "--set=precision=fp32", *sets])
    bench_ddp.main()
    return seen, out


def test_bench_ddp_ranks_train_on_their_slices_and_rank_0_logs_the_slowest_ranks_rate(tmp_path, monkeypatch, capsys):
    """Two ranks' slices of each step's batch are one process's batch (a rank on another's slice, or on all of
    it, times other work); the rate is the global batch over the slowest rank's time (max, not a sum of the
    ranks' times), logged by rank 0 alone; the net is wrapped for the world and synchronises BN as asked."""
    import json
    alone, _ = ddp_bench_rank(monkeypatch, tmp_path, 0, 1)
    capsys.readouterr()
    ranks = [ddp_bench_rank(monkeypatch, tmp_path, rank, 2, "--set=sync_bn_group_size=2") for rank in (0, 1)]
    assert capsys.readouterr().out.count("img/s") == 1  # rank 0's line
    assert not ranks[1][1].exists()
    (rec,) = [json.loads(line) for line in ranks[0][1].read_text().splitlines()]
    assert rec["world_size"] == 2 and rec["rates"] == [pytest.approx(3 * 20 / 100.0)]
    assert len(alone["labels"]) == 4 and all(len(y) == 20 for y in alone["labels"])
    for step, y in enumerate(alone["labels"]):
        assert torch.equal(torch.cat([seen["labels"][step] for seen, _ in ranks]), y)
    assert all(seen["wrapped"] == [2] and seen["sync_bn"] == [("group", 2, 2)] for seen, _ in ranks)
    assert alone["wrapped"] == [1] and alone["sync_bn"] == []


def test_augment_times_a_data_set_exactly_as_large_as_a_repeat_and_counts_its_images(tmp_path, monkeypatch, capsys):
    """--batch x --batches may use every training image (the refusal is for more); each rate is over the images
    its call augments: every batch of the batched version, one batch of the loop."""
    import json
    import bench_augment
    np.savez(tmp_path / "tiny.npz", **synthetic(n_train=60, n_test=10))
    counted, rate = [], bench_augment.rate
    monkeypatch.setattr(bench_augment, "rate", lambda fn, n, *a: counted.append(n) or rate(fn, n, *a))
    monkeypatch.setattr(sys, "argv", ["bench_augment.py", "--data", str(tmp_path / "tiny.npz"), "--batch", "20",
                                      "--batches", "3", "--repeats", "1", "--device", "cpu", "--log-dir",
                                      str(tmp_path / "out")])
    bench_augment.main()
    assert counted == [60, 20] and "speed-up" in capsys.readouterr().out
    (log,) = (tmp_path / "out").iterdir()
    assert json.loads(log.read_text())["batch"] == 20
