import collections
import contextlib
import copy
import datetime
import io
import itertools
import json
import math
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import core
import torch_backend as tb
import train_cifar
from conftest import HostReads, ROOT, synthetic

TINY = dict(widths=(8, 16, 16, 16), batch_size=50, epochs=2, precision="fp32", target=0.5)


def cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_cifar.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture
def tiny_npz(tmp_path, tiny):
    path = tmp_path / "tiny.npz"
    np.savez(path, **tiny)
    return str(path)


@pytest.mark.parametrize("args, message", [
    (["--preset", "resnet1000"], "invalid choice"),
    (["--epochs", "0"], "epochs must be positive"),
    (["--epochs", "1e9"], "epochs must be at most 10000, got 1e+09"),  # (planned every step's size, silently)
    (["--batch-size", "-4"], "batch size must be a positive integer"),
    (["--target", "1.5"], "target must be in (0, 1]"),
    (["--target", "94"], "target must be in (0, 1], got 94.0 (a percentage? 0.94)"),
    (["--lr-knots", "0", "5", "9"], "same length"),
    (["--lr-knots", "0", "5", "2", "--lr-values", "0", "1", "0"], "lr-knots must be non-decreasing"),
    (["--label-smoothing", "1"], "label smoothing must be in [0, 1)"),  # every target uniform: nothing to learn
    (["--color-jitter", "0.1"], "color-jitter takes two numbers: brightness >= 0 and contrast in [0, 1), got (0.1,)"),
    (["--color-jitter", "0.1", "1"], "contrast in [0, 1), got (0.1, 1.0)"),  # (a factor of 0..2: images inverted)
    (["--color-jitter", "-0.1", "0.1"], "brightness >= 0"),
    (["--color-jitter", "0.1", "0.1", "--pipeline", "loader"], "color-jitter needs pipeline device"),
    (["--precision", "fp16", "--device", "cpu"], "fp16 is for CUDA"),
    (["--batch-size", "500"], "exceeds the 200 training images"),
    (["--train-sizes", "12", "32"], "train-sizes must be whole numbers of pixels in 16..32"),
    (["--tta-confidence", "1.5"], "tta-confidence must be in [0, 1]"),
    (["--tta-confidence", "0.5", "--tta", "0"], "--tta-confidence has no effect without --tta 1 or 2"),
    (["--preset", "fast94-sgd", "--trust-coefficient", "0.01"], "--trust-coefficient has no effect without --optimizer"),
    (["--preset", "fast94-sgd", "--muon-lr-scale", "0.5"], "--muon-lr-scale has no effect without --optimizer muon"),
    (["--reference-batch-size", "256"], "--reference-batch-size has no effect without --lr-scaling linear or sqrt"),
    (["--loader-workers", "4"], "--loader-workers has no effect without --pipeline loader"),
    (["--proxy-every", "2"], "--proxy-every has no effect without --select-fraction below 1 and --select-by proxy"),
    (["--compile-mode", "reduce-overhead"], "--compile-mode has no effect without --compile true"),
    (["--warmup-epochs", "12"], "warmup-epochs 12 must end before the schedule does (epoch 10)"),
    (["--cpu-conv", "winograd"], "cpu-conv must be one of auto, tuned, matmul, onednn"),
    (["--loss-scale", "-8"], "loss-scale must be batch, dynamic or a positive number"),
    (["--loss-scale", "dynamic", "--precision", "bf16"], "loss-scale dynamic is for fp16; this run is bf16"),
    (["--loss-scale", "64", "--precision", "fp32"], "loss-scale 64 is for fp16; this run is fp32"),
    (["--widths", "8", "16"], "net fastnet takes 3 channel counts"),
    (["--widths", "8", "0", "16"], "each at least 1, got (8, 0, 16)"),
    (["--preset", "resnet9", "--widths", "8", "16", "16"], "net resnet9 takes 4 channel counts"),
    (["--preset", "fast96", "--proxy-widths", "4", "-4", "4"], "three proxy-widths, each at least 1"),
    (["--epochs", "inf"], "epochs must be finite, got inf"),
    (["--lr-knots", "0", "inf", "--lr-values", "1", "0"], "lr-knots must be finite"),
    (["--warmup-epochs", "inf"], "warmup-epochs must be finite"),
    (["--lookahead-start-epoch", "0", "--lookahead-every", "0"], "lookahead needs lookahead-every >= 1"),
    (["--lookahead-start-epoch", "0", "--lookahead-decay", "2"], "lookahead-decay in [0, 1]"),
    (["--device", "gpu0"], "device 'gpu0': not a device name"),
    (["--sync-check", "true", "--device", "cpu"], "sync-check is for CUDA devices"),
    (["--holdout", "200"], "holdout 200 leaves none of the 200 training images"),
    (["--holdout", "-1"], "holdout must be >= 0 (0: evaluate on the test set), got -1"),  # (was "< 50000" here)
    (["--whiten-bias-epochs", "-1"], "whiten-bias-epochs must be >= 0"),  # (taken as "never frozen")
    (["--allreduce", "hierarchical"], "allreduce hierarchical needs several processes"),  # (a flat run, silently)
    (["--echo-factor", "3"], "echo-factor 3 needs an --echo mode"),
    (["--echo", "batch", "--echo-factor", "1e6"], "echo-factor 1e+06 makes each pass 200,000,000 echoed examples; "
                                                    "at most 50,000,000 fit in memory"),  # (was a MemoryError)
    (["--seed", str(2 ** 64 - 1), "--runs", "2"], "seeds must lie in [-2^63, 2^64)"),
    (["--holdout", "100", "--batch-size", "150"], "exceeds the 100 training images left by holdout 100"),
    (["--device", "meta"], "run on cpu or cuda devices only"),
    (["--log-dir", "/dev/null/logs"], "log-dir /dev/null/logs: cannot write there (Not a directory)"),
    (["--checkpoint", "/dev/null/run.pt"], "checkpoint's folder /dev/null: cannot write there"),
])
def test_bad_options_exit_2_with_one_line(tiny_npz, args, message):
    r = cli("--data", tiny_npz, "--log-dir", "", *args)
    assert r.returncode == 2
    assert message in r.stderr and r.stderr.strip().count("\n") <= 1  # argparse adds a usage line at most


@pytest.mark.parametrize("options, named", [
    (dict(echo="batch", echo_factor=2.0), "data echoing (--echo batch)"),
    (dict(echo="batch", echo_factor=2.0, echo_shuffle_buffer=64), "the shuffle buffer"),
    (dict(pipeline="loader"), "the loader pipeline"),
    (dict(precision="fp16", loss_scale="dynamic"), "fp16's dynamic loss scale"),
])
def test_sync_check_refuses_at_once_what_reads_the_host_by_design(monkeypatch, options, named):
    """Not a failure at the first step on the GPU (a lease's minutes lost): before the data loads, naming why."""
    monkeypatch.setattr(tb, "resolve_device", lambda device: torch.device("cuda"))
    options = dict(dict(precision="bf16"), **options)
    with pytest.raises(ValueError, match=r"^sync-check would stop the first step: .*read from the host by design") as e:
        train_cifar.train("fast94", data_path="/nonexistent", log_dir=None, sync_check=True, **options)
    assert named in str(e.value)
    for preset in ("fast94", "fast96"):  # the presets, in either GPU precision (fp16's fixed scale), read nothing
        for precision in ("bf16", "fp16"):
            assert train_cifar.host_reads_by_design(train_cifar.make_config(preset), precision) == []


def test_a_checkpoint_under_several_processes_is_refused_before_its_folder_is_made(monkeypatch, tmp_path, tiny):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    folder = tmp_path / "ckpt"
    with pytest.raises(ValueError, match="--checkpoint is for single-process runs"):
        train_cifar.train("fast94", data=tiny, checkpoint=str(folder / "run.pt"), **TINY_FAST)
    assert not folder.exists()


def test_a_device_that_cannot_run_is_refused_saying_why(monkeypatch):
    """Not an AssertionError from deep in torch.cuda after the data has loaded."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device 'cuda': this torch \(.*\) (was built without CUDA|finds no CUDA)"):
        tb.resolve_device("cuda")
    assert tb.resolve_device(None) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="there are 2 CUDA device"):
        tb.resolve_device("cuda:2")
    assert tb.resolve_device("cuda:1") == torch.device("cuda:1")
    assert tb.resolve_device("cpu") == torch.device("cpu")


def test_cuda_sync_debug_sets_the_mode_for_the_block_and_puts_it_back(monkeypatch):
    """--sync-check's switch: torch's sync debug mode "error" inside the step loop, the one before restored after,
    also when the block raises; nothing on a CPU or with mode None. (tests/test_gpu.py runs it for real.)"""
    modes = [0]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: modes.append({"default": 0, "error": 2}.get(m, m)))
    cuda = collections.namedtuple("Device", "type")("cuda")
    with tb.cuda_sync_debug(cuda, "error"):
        assert modes[-1] == 2
        with tb.cuda_sync_debug(cuda, "default"):  # a per-step evaluation inside the loop
            assert modes[-1] == 0
        assert modes[-1] == 2
    assert modes[-1] == 0
    with pytest.raises(KeyError):
        with tb.cuda_sync_debug(cuda, "error"):
            raise KeyError
    assert modes[-1] == 0
    before = len(modes)
    for device, mode in ((cuda, None), (torch.device("cpu"), "error")):
        with tb.cuda_sync_debug(device, mode):
            pass
    assert len(modes) == before


@pytest.mark.parametrize("preset, options", [
    ("fast94", dict(widths=(8, 16, 16), train_sizes=(24, 32))),  # Muon, resizing
    ("fast94", dict(widths=(8, 16, 16), color_jitter=(0.1, 0.1))),
    ("fast96", dict(widths=(8, 16, 16), proxy_widths=(4, 8, 8))),  # proxy selection, lookahead
])
def test_the_training_steps_read_nothing_on_the_host(monkeypatch, preset, options):
    """tests/test_gpu.py's check on a CPU: the steps of two epochs (so a second pass of the data starts inside them)
    under HostReads wherever --sync-check switches torch's sync debug mode to "error", and with reads allowed where
    it switches back to "default" (an evaluation inside the steps). The stand-in follows the mode it is given, so
    a loop that stopped asking for "error" (--sync-check silently off on a GPU) fails here too. (run_once: train()
    refuses sync_check on a CPU, rightly.)"""
    modes = []

    @contextlib.contextmanager
    def host_reads(device, mode):
        modes.append(mode)
        paused, HostReads.paused = HostReads.paused, mode == "default"
        try:
            with HostReads() if mode == "error" else contextlib.nullcontext():
                yield
        finally:
            HostReads.paused = paused
    monkeypatch.setattr(tb, "cuda_sync_debug", host_reads)
    cfg = train_cifar.make_config(preset, batch_size=100, epochs=2, precision="fp32", eval_every_steps=3, **options)
    dev = torch.device("cpu")
    on_device = tb.to_device(tb.validate(synthetic(400, 100), "tiny"), dev, torch.float32, pad=cfg["pad"])
    result = train_cifar.run_once(dict(cfg, sync_check=True), on_device, 0, 0, dev, "fp32", log=lambda *a: None)
    assert result["accuracy"] is not None
    per_epoch = 400 // train_cifar.candidate_batch_size(cfg)  # 4 steps (fast96: 2, of 200 candidates)
    want = [m for e in (1, 2) for m in ["error"] + ["default"] * sum(
        s % 3 == 0 for s in range((e - 1) * per_epoch + 1, e * per_epoch + 1))]
    assert modes == want, modes  # each epoch's steps checked; only the evaluations among them let through


def test_epochs_alone_stretch_the_presets_lr_knots():
    """--epochs 8 on fast94 (knots 0, 10) used to end the run at the LR of epoch 8 of 10, never annealed; the
    knots now stretch with the epochs, unless --lr-knots is given too."""
    assert train_cifar.make_config("fast94", epochs=8)["lr_knots"] == (0, 8)
    assert train_cifar.make_config("fast94-sgd", epochs=19.8)["lr_knots"] == pytest.approx((0, 4.554, 19.8))
    assert train_cifar.make_config("fast94", epochs=8, lr_knots=(0, 10))["lr_knots"] == (0, 10)
    assert train_cifar.make_config("fast94")["lr_knots"] == train_cifar.PRESETS["fast94"]["lr_knots"]


@pytest.mark.parametrize("overrides, message", [
    (dict(epochs="inf"), "epochs takes a number, got 'inf'"),
    (dict(pad=1.5), "pad takes a whole number, got 1.5"),
    (dict(loader_workers=0.5), "loader-workers takes a whole number"),
    (dict(batch_size=True), "batch-size takes a whole number"),
    (dict(nesterov="yes"), "nesterov takes True or False"),
    (dict(widths="8"), "widths takes a tuple of numbers"),
    # each element too (--set, or a --from-log config edited): TypeErrors deep in a run, or True taken as 1
    (dict(lr_values=(1, "0")), "lr-values takes a tuple of numbers, got (1, '0')"),
    (dict(lr_knots=(0, [1])), "lr-knots takes a tuple of numbers"),
    (dict(widths=(True, 16, 16)), "widths takes a tuple of numbers"),
    (dict(lr_values=(1, True)), "lr-values takes a tuple of numbers"),
    (dict(momentum=True), "momentum takes a number"),
    (dict(preset="resnet9"), "preset is not an option to set"),  # (was a TypeError: two values for preset)
])
def test_make_config_refuses_values_of_the_wrong_kind(overrides, message):
    """What --set (studies, benchmarks) could not read as a literal stays text: an error here, not a TypeError
    (or a string silently taken) deep in a run. Lists stand for tuples, ints for floats."""
    with pytest.raises(ValueError, match=re.escape(message)):
        train_cifar.make_config("fast94", **overrides)
    cfg = train_cifar.make_config("fast94", epochs=9, lr_knots=[0, 9], lr_values=[1, 0], widths=[8, 16, 16])
    assert cfg["epochs"] == 9 and list(cfg["widths"]) == [8, 16, 16]


@pytest.mark.parametrize("refused, message, accepted", [
    # each check of check_config at its edge: the value just outside is refused, the edge itself accepted
    (dict(ema_every=5, ema_decay=1.0), "ema-decay in [0, 1)", dict(ema_every=5, ema_decay=0.0)),
    (dict(ema_every=-1), "ema-every >= 0", dict(ema_every=0)),
    (dict(momentum=1.0), "momentum must be in [0, 1), got 1.0", dict(momentum=0.0)),
    (dict(momentum=-0.1), "momentum must be in [0, 1)", dict(momentum=0.999)),
    (dict(lr_values=(0.5, -1e-9)), "lr-values must be finite and >= 0", dict(lr_values=(0.5, 0.0))),
    (dict(weight_decay=-1e-9), "weight decay must be >= 0", dict(weight_decay=0.0)),
    (dict(bias_lr_scale=0.0), "bias-lr-scale > 0", dict(bias_lr_scale=1e-3)),
    (dict(label_smoothing=-0.1), "label smoothing must be in [0, 1)", dict(label_smoothing=0.0)),
    (dict(pad=17), "pad must be in 0..16", dict(pad=16)),
    (dict(pad=-1), "pad must be in 0..16", dict(pad=0)),
    (dict(cutout=33), "cutout in 0..32", dict(cutout=32)),
    (dict(eval_every=-1), "eval-every must be >= 0", dict(eval_every=0)),
    (dict(stop_after_epochs=-1), "stop-after-epochs must be >= 0", dict(stop_after_epochs=0)),
    (dict(runs=0), "runs must be at least 1", dict(runs=1)),
    (dict(flip="sometimes"), "flip must be none, random or alternate", dict(flip="none")),
    (dict(tta=3), "tta must be 0 (none), 1 (mirror) or 2", dict(tta=1)),
    (dict(tta_confidence=-0.01), "tta-confidence must be in [0, 1]", dict(tta_confidence=1.0)),
    (dict(target=0.0), "target must be in (0, 1]", dict(target=1.0)),
    (dict(lookahead_start_epoch=0, lookahead_pow=-1.0), "lookahead-pow >= 0",
     dict(lookahead_start_epoch=0, lookahead_pow=0.0)),
    (dict(lookahead_start_epoch=0, lookahead_decay=-0.1), "lookahead-decay in [0, 1]",
     dict(lookahead_start_epoch=0, lookahead_decay=1.0)),
    (dict(lookahead_sync="never"), "lookahead-sync must be epoch or end", dict(lookahead_sync="epoch")),
    (dict(bn_momentum=1.5), "bn-momentum must be in [0, 1]", dict(bn_momentum=1.0)),
    (dict(muon_lr_scale=0.0), "muon-lr-scale > 0", dict(muon_lr_scale=1e-3)),
    (dict(muon_momentum=1.0), "muon-momentum in [0, 1)", dict(muon_momentum=0.0)),
    (dict(muon_ns_steps=0), "muon-ns-steps >= 1", dict(muon_ns_steps=1)),
    (dict(muon_norm="spectral"), "muon-norm must be one of", dict(muon_norm="none")),
    (dict(optimizer="adam"), "optimizer must be sgd, lars or muon", dict(optimizer="lars")),
    (dict(lr_scaling="cube"), "lr-scaling must be one of", dict(lr_scaling="sqrt")),
    (dict(reference_batch_size=-1), "reference-batch-size > 0", dict(reference_batch_size=1)),
    (dict(warmup_epochs=-1.0), "warmup-epochs >= 0", dict(warmup_epochs=0.0)),
    # a warm-up must end before the schedule's last knot: at it, nothing of the schedule would be left
    (dict(warmup_epochs=10.0), "warmup-epochs 10 must end before the schedule does", dict(warmup_epochs=9.5)),
    (dict(bn_group_size=-1), "group sizes must be >= 0", dict(bn_group_size=0)),
    (dict(sync_bn_group_size=-1), "group sizes must be >= 0", dict(sync_bn_group_size=0)),
    (dict(allreduce="ring"), "allreduce must be flat or hierarchical", dict(allreduce="flat")),
    (dict(echo="sometimes"), "echo must be one of", dict(echo="batch")),
    (dict(echo="batch", echo_factor=0.99), "echo-factor >= 1", dict(echo="batch", echo_factor=1.0)),
    (dict(echo_shuffle_buffer=-1), "echo-shuffle-buffer >= 0", dict(echo_shuffle_buffer=0)),
    (dict(eval_every_steps=-1), "eval-every-steps must be >= 0", dict(eval_every_steps=0)),
    (dict(pipeline="gpu"), "pipeline must be device or loader", dict(pipeline="loader")),
    (dict(loader_workers=-1), "loader-workers >= 0", dict(loader_workers=0)),
    (dict(select_by="random"), "select-by must be proxy or loss", dict(select_by="loss")),
    (dict(net="vgg"), "unknown net 'vgg'", dict(net="fastnet")),
    (dict(precision="fp8"), "precision must be auto, fp32, bf16 or fp16", dict(precision="bf16")),
    (dict(eval_precision="bf16"), "eval-precision must be same (the run's) or fp32", dict(eval_precision="fp32")),
    (dict(compile_mode="fastest"), "compile-mode must be one of", dict(compile_mode="max-autotune")),
    (dict(epochs=0.0), "epochs must be positive", dict(epochs=1e-3, lr_knots=(0, 1e-3))),
    (dict(lr_knots=(), lr_values=()), "lr-knots and lr-values need the same length",
     dict(lr_knots=(0,), lr_values=(0.5,))),
])
def test_each_config_check_refuses_past_its_edge_and_accepts_the_edge(refused, message, accepted):
    with pytest.raises(ValueError, match=re.escape(message)):
        train_cifar.make_config("fast94", **refused)
    cfg = train_cifar.make_config("fast94", **accepted)
    assert all(cfg[k] == v for k, v in accepted.items())


@pytest.mark.parametrize("preset", ["fast94", "fast96", "resnet9"])
def test_help_shows_the_chosen_presets_values(preset):
    """--help gives each option's value in the preset named (fast94 when none is), as the command line takes it."""
    help_text = train_cifar.parse_args([] if preset == "fast94" else ["--preset", preset])[0].format_help()
    cfg = train_cifar.make_config(preset)

    def shown(option):
        return re.search(rf"--{option}\b[^\n]*\n?\s+{preset}: ([^\n]*)", help_text).group(1)

    assert shown("batch-size") == str(cfg["batch_size"])
    assert shown("widths") == " ".join(map(str, cfg["widths"]))
    assert shown("compile") == "false" and shown("precision") == "auto"
    assert shown("train-sizes") == (" ".join(map(str, cfg["train_sizes"])) or "(none)")


def test_every_option_says_what_it_means():
    """Each config key has a line in OPTION_HELP, shown under its flag and the preset's value; none is stale."""
    keys = set(train_cifar.COMMON) | {k for cfg in train_cifar.PRESETS.values() for k in cfg}
    assert set(train_cifar.OPTION_HELP) == keys
    help_text = train_cifar.parse_args([])[0].format_help()
    for key, meaning in train_cifar.OPTION_HELP.items():
        flag = "--" + key.replace("_", "-")
        assert re.search(rf"{flag}\b[^\n]*\n?\s+fast94: [^\n]*\n\s+{re.escape(meaning)}\n", help_text), flag
    # listed as OPTION_HELP groups them (--runs and --seed first, not --allreduce as the alphabet had it)
    shown = [m for m in re.findall(r"^  --([a-z-]+)", help_text, re.M) if m.replace("-", "_") in keys]
    assert shown == [k.replace("_", "-") for k in train_cifar.OPTION_HELP]


def test_missing_data_exits_2_and_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.npz")
    r = cli("--data", missing, "--log-dir", "")
    assert r.returncode == 2 and missing in r.stderr and "--data" in r.stderr and "Traceback" not in r.stderr


def test_diverged_run_exits_nonzero_and_keeps_its_logs(tiny_npz, tmp_path):
    logs = tmp_path / "logs"
    r = cli("--data", tiny_npz, "--log-dir", str(logs), "--preset", "resnet9", "--widths", "8", "8", "8", "8",
            "--batch-size", "50", "--epochs", "3", "--precision", "fp32", "--lr-values", "1e30", "1e30", "1e30")
    assert r.returncode == 1 and "diverged" in r.stderr, r.stderr
    path = next(logs.glob("*.json"))
    summary = json.loads(path.read_text(), parse_constant=lambda token: pytest.fail(f"{token} is not JSON"))
    assert summary["runs"][0]["diverged"] is True and summary["runs"][0]["accuracy"] is None
    assert summary["accuracy_mean"] is None and math.isnan(core.read_run_log(str(path))["accuracy_mean"])
    rows = core.read_tsv(str(next(logs.glob("*.tsv"))))
    assert rows and rows[-1]["train_loss"] in ("nan", "inf")


def test_train_api_learns_and_logs_every_required_field(cifar10, tmp_path):
    """A small net on a random 10k subset of real CIFAR-10 must learn far beyond chance in two epochs."""
    rng = np.random.default_rng(0)
    i, j = rng.permutation(50000)[:10000], rng.permutation(10000)[:2000]
    data = dict(train_x=cifar10["train_x"][i], train_y=cifar10["train_y"][i],
                test_x=cifar10["test_x"][j], test_y=cifar10["test_y"][j])
    s = train_cifar.train("fast94", data=data, log_dir=str(tmp_path), widths=(32, 64, 64), epochs=2,
                          lr_knots=(0, 0.5, 2), lr_values=(0.3, 1.5, 0.1), batch_size=500, runs=2, target=0.3,
                          train_sizes=(), log=lambda *a: None)  # one image size: FLOPs = per step x steps
    assert s["accuracy_mean"] > 0.5, s["accuracy_mean"]  # chance is 0.1; 0.66 with Muon here, 0.60 with SGD
    saved = json.loads(open(s["log_json"]).read())
    for key in ("preset", "config", "hardware", "torch", "commit", "runs", "accuracy_mean", "accuracy_std"):
        assert key in saved
    assert saved["config"]["epochs"] == 2 and saved["config"]["batch_size"] == 500
    assert [r["seed"] for r in saved["runs"]] == [0, 1]
    for run in saved["runs"]:
        for key in ("accuracy", "epoch_reached_target", "time_to_target_s", "total_time_s", "train_flops", "diverged"):
            assert key in run
        assert run["epoch_reached_target"] in (1, 2) and run["time_to_target_s"] <= run["total_time_s"]
        assert run["train_flops"] == saved["train_flops_per_step"] * saved["train_steps"] > 0
    assert saved["accuracy_mean"] == pytest.approx(np.mean([r["accuracy"] for r in saved["runs"]]))
    rows = core.read_tsv(next(str(p) for p in tmp_path.glob("*.tsv")))
    assert [(r["run"], r["epoch"]) for r in rows] == [("0", "1"), ("0", "2"), ("1", "1"), ("1", "2")]


@pytest.mark.parametrize("preset, options", [
    ("resnet9", TINY), ("resnet9-tricks", dict(TINY, batch_size=64)),
    # data selection: the proxy and its optimizer come back from the checkpoint
    ("fast96", dict(TINY, widths=(8, 16, 16), proxy_widths=(4, 8, 8))),
    # data selection by loss history: the per-example losses come back from the checkpoint
    ("fast94", dict(TINY, widths=(8, 16, 16), select_fraction=0.5, select_by="loss", train_sizes=())),
    # lookahead's slow weights (every 3 steps, so epoch 1's checkpoint holds them) come back too
    ("fast95", dict(TINY, widths=(8, 16, 16), lookahead_every=3)),
])
def test_resumed_run_equals_uninterrupted_run(tmp_path, preset, options):
    data = synthetic(400, 100)
    cfg = train_cifar.make_config(preset, **options)
    dev = torch.device("cpu")
    on_device = tb.to_device(tb.validate(data, "tiny"), dev, torch.float32, pad=cfg["pad"])
    full = train_cifar.run_once(cfg, on_device, 0, 7, dev, "fp32", log=lambda *a: None)

    class Stop(Exception):
        pass

    def crash_in_epoch_2(row):  # after epoch 1's checkpoint, before epoch 2's
        if row["epoch"] == 2:
            raise Stop
    ckpt = str(tmp_path / "run.pt")
    with pytest.raises(Stop):
        train_cifar.run_once(cfg, on_device, 0, 7, dev, "fp32", on_epoch=crash_in_epoch_2, checkpoint=ckpt)
    legacy = torch.load(ckpt, weights_only=False)  # as saved before segments were recorded
    del legacy["result"]["segments"]
    torch.save(legacy, str(tmp_path / "legacy.pt"))
    said, reported = [], []
    resumed = train_cifar.run_once(cfg, on_device, 0, 7, dev, "fp32", log=said.append, checkpoint=ckpt,
                                   on_epoch=reported.append)
    assert said and said[0].startswith(f"resumed from {ckpt} after epoch 1")
    assert reported == resumed["epochs"]  # the restored epoch 1 too, so the TSV holds the whole run
    assert [r["epoch"] for r in reported] == [r["epoch"] for r in full["epochs"]]
    assert [r["train_loss"] for r in resumed["epochs"]] == [r["train_loss"] for r in full["epochs"]]
    assert resumed["accuracy"] == full["accuracy"]
    # where each part ran: epoch 1 by the first invocation, the rest by the one that resumed
    assert [seg["first_epoch"] for seg in full["segments"]] == [1]
    assert [seg["first_epoch"] for seg in resumed["segments"]] == [1, 2]
    assert all(seg["hardware"] == tb.device_name(dev) and seg["commit"] for seg in resumed["segments"])
    from_legacy = train_cifar.run_once(cfg, on_device, 0, 7, dev, "fp32", log=lambda *a: None,
                                       checkpoint=str(tmp_path / "legacy.pt"))
    assert [(seg["first_epoch"], seg["hardware"]) for seg in from_legacy["segments"]] == [(1, None),
                                                                                         (2, tb.device_name(dev))]
    other = train_cifar.make_config(preset, **dict(options, epochs=3))
    with pytest.raises(ValueError, match=r"another configuration \(differs in epochs, lr_knots\)"):
        train_cifar.run_once(other, on_device, 0, 7, dev, "fp32", checkpoint=ckpt)


def test_a_compiled_resume_warms_up_on_the_loaded_optimizer_state(tmp_path, monkeypatch):
    """Loading a checkpoint replaces the optimizer's buffers, whose addresses a CUDA graph keeps: it must come
    before the compile warm-up, else the update's graph is recorded again inside the timed steps. (The warm-up
    and torch.compile stand in here: what counts is which buffers the warm-up sees.)"""
    data = synthetic(400, 100)
    cfg = train_cifar.make_config("resnet9", **TINY)
    dev = torch.device("cpu")
    on_device = tb.to_device(tb.validate(data, "tiny"), dev, torch.float32, pad=cfg["pad"])
    ckpt = str(tmp_path / "run.pt")
    train_cifar.run_once(dict(cfg, stop_after_epochs=1), on_device, 0, 7, dev, "fp32", checkpoint=ckpt,
                         log=lambda *a: None)
    saved = torch.load(ckpt, weights_only=False)["opt"]["state"]
    seen = []

    def warm_up(cfg, model, device, precision, world, opt=None):
        seen.append({i: (s["momentum_buffer"], s["momentum_buffer"].clone()) for i, s in
                     enumerate(opt.state[p] for g in opt.param_groups for p in g["params"])})
    monkeypatch.setattr(train_cifar, "warm_up_compile", warm_up)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    opts = []
    real = train_cifar.make_optimizer
    monkeypatch.setattr(train_cifar, "make_optimizer", lambda *a, **k: opts.append(real(*a, **k)) or opts[-1])
    train_cifar.run_once(dict(cfg, compile=True), on_device, 0, 7, dev, "fp32", checkpoint=ckpt, log=lambda *a: None)
    assert len(seen) == 1 and set(seen[0]) == set(saved)
    for i, (buf, at_warm_up) in seen[0].items():
        assert torch.equal(at_warm_up, saved[i]["momentum_buffer"])  # the checkpoint's state ...
        params = [p for g in opts[-1].param_groups for p in g["params"]]
        assert opts[-1].state[params[i]]["momentum_buffer"] is buf  # ... in the tensors the steps went on with


def test_stopped_run_follows_the_full_schedule_and_continues_to_the_uninterrupted_run(tmp_path):
    """--stop-after-epochs 1 of a 3-epoch schedule trains epoch 1 exactly as the full run does (its LR included),
    ends with a final evaluation, and a later invocation without the stop continues it from its checkpoint to
    the full run's result."""
    data = synthetic(400, 100)
    cfg = train_cifar.make_config("resnet9", **dict(TINY, epochs=3))
    dev = torch.device("cpu")
    on_device = tb.to_device(tb.validate(data, "tiny"), dev, torch.float32, pad=cfg["pad"])
    quiet = dict(log=lambda *a: None)
    full = train_cifar.run_once(cfg, on_device, 0, 7, dev, "fp32", **quiet)
    ckpt = str(tmp_path / "run.pt")
    part = train_cifar.run_once(dict(cfg, stop_after_epochs=1), on_device, 0, 7, dev, "fp32", checkpoint=ckpt, **quiet)
    assert part["stopped_after_epoch"] == 1 and part["steps_trained"] == 8  # 400 images at batch 50
    assert [(r["epoch"], r["lr"], r["train_loss"]) for r in part["epochs"]] == \
        [(r["epoch"], r["lr"], r["train_loss"]) for r in full["epochs"][:1]]
    assert part["accuracy"] == part["epochs"][0]["test_acc"] and part["total_time_s"] > 0
    # asking again for the same stop returns the saved result; an earlier stop than the checkpoint is an error
    again = train_cifar.run_once(dict(cfg, stop_after_epochs=1), on_device, 0, 7, dev, "fp32", checkpoint=ckpt, **quiet)
    assert again["accuracy"] == part["accuracy"] and len(again["epochs"]) == 1
    two = train_cifar.run_once(dict(cfg, stop_after_epochs=2), on_device, 0, 7, dev, "fp32", checkpoint=ckpt, **quiet)
    assert two["stopped_after_epoch"] == 2 and [r["epoch"] for r in two["epochs"]] == [1, 2]
    mid = checkpoint_after_epoch_2(cfg, on_device, dev, str(tmp_path / "mid.pt"))  # a run not stopped
    with pytest.raises(ValueError, match="already past epoch 1"):
        train_cifar.run_once(dict(cfg, stop_after_epochs=1), on_device, 0, 7, dev, "fp32", checkpoint=mid, **quiet)
    rest = train_cifar.run_once(cfg, on_device, 0, 7, dev, "fp32", checkpoint=ckpt, **quiet)
    assert rest["stopped_after_epoch"] is None and "steps_trained" not in rest
    assert [r["train_loss"] for r in rest["epochs"]] == [r["train_loss"] for r in full["epochs"]]
    assert rest["accuracy"] == full["accuracy"]
    assert [seg["first_epoch"] for seg in rest["segments"]] == [1, 2, 3]


def checkpoint_after_epoch_2(cfg, on_device, dev, ckpt):
    """The checkpoint of a run interrupted in epoch 3 (saved after epoch 2)."""
    class Stop(Exception):
        pass

    def crash_in_epoch_3(row):
        if row["epoch"] == 3:
            raise Stop
    with pytest.raises(Stop):
        train_cifar.run_once(cfg, on_device, 0, 7, dev, "fp32", on_epoch=crash_in_epoch_3, checkpoint=ckpt,
                             log=lambda *a: None)
    return ckpt


def test_stopped_run_logs_its_partial_flops_and_says_so(tiny_npz, tmp_path):
    r = cli("--preset", "resnet9", "--data", tiny_npz, "--widths", "8", "16", "16", "16", "--batch-size", "50",
            "--epochs", "3", "--precision", "fp32", "--stop-after-epochs", "2", "--log-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "stopped after epoch 2 of 3 by --stop-after-epochs" in r.stdout
    saved = json.load(open(next(str(p) for p in tmp_path.glob("*.json"))))
    run = saved["runs"][0]
    assert run["stopped_after_epoch"] == 2 and len(run["epochs"]) == 2
    assert run["train_flops"] == saved["train_flops_per_step"] * run["steps_trained"]
    assert run["steps_trained"] < saved["train_steps"]


@pytest.mark.parametrize("n_train, same", [(250, True), (200, False)])
def test_lookahead_sync_at_the_end_differs_from_each_epoch_only_when_an_epoch_ends_between_updates(n_train, same):
    """Lookahead updates every 5 steps and leaves the net on its average. With 5 steps an epoch (250 images at
    batch 50) an epoch ends right after an update, so copying the average back then changes nothing and both
    modes train identically; with 4 steps an epoch (200 images) the per-epoch copy drops steps and they differ."""
    data = synthetic(n_train, 50)
    base = train_cifar.make_config("fast95", widths=(8, 16, 16), batch_size=50, epochs=3, precision="fp32",
                                   lookahead_start_epoch=0)
    dev = torch.device("cpu")
    on_device = tb.to_device(tb.validate(data, "tiny"), dev, torch.float32, pad=base["pad"])
    losses = {}
    for sync in ("epoch", "end"):
        r = train_cifar.run_once(dict(base, lookahead_sync=sync), on_device, 0, 3, dev, "fp32", log=lambda *a: None)
        losses[sync] = [row["train_loss"] for row in r["epochs"]]
    assert (losses["epoch"] == losses["end"]) == same
    assert losses["epoch"][0] == losses["end"][0]  # the first epoch trains the same either way


@pytest.mark.parametrize("content", ["text", "truncated", "other object"])
def test_a_file_that_is_no_checkpoint_exits_2_with_one_line(tiny_npz, tmp_path, content):
    """A checkpoint cut short (copied half-way), a text file or another saved object: named, not a traceback."""
    ckpt = tmp_path / "run.pt"
    if content == "text":
        ckpt.write_text("not a checkpoint\n")
    elif content == "truncated":
        train_cifar.train("resnet9", data=np.load(tiny_npz), checkpoint=str(ckpt), log=lambda *a: None,
                          log_dir=None, **dict(TINY, epochs=1))
        ckpt.write_bytes(ckpt.read_bytes()[:2000])
    else:
        torch.save([1, 2, 3], ckpt)
    r = cli("--data", tiny_npz, "--log-dir", "", "--preset", "resnet9", "--checkpoint", str(ckpt), "--widths", "8", "16",
            "16", "16", "--batch-size", "50", "--epochs", "1", "--precision", "fp32")
    assert r.returncode == 2 and f"{ckpt} is not a checkpoint of train_cifar.py" in r.stderr
    assert r.stderr.strip().count("\n") == 0


def test_a_saved_dict_lacking_part_of_a_run_is_no_checkpoint(tmp_path):
    """A dict with some of a run's parts (say another tool's {"cfg", "seed", "model"}) failed later on the missing
    one, with a KeyError: each of cfg, seed, model, opt, result and epoch is required."""
    parts = dict(cfg={}, seed=0, model={}, opt={}, result={}, epoch=1)
    path = str(tmp_path / "run.pt")
    torch.save(parts, path)
    assert train_cifar.load_checkpoint(path, torch.device("cpu")) == parts
    for missing in parts:
        torch.save({k: v for k, v in parts.items() if k != missing}, path)
        with pytest.raises(ValueError, match=r"run.pt is not a checkpoint of train_cifar.py \(not a saved run\)"):
            train_cifar.load_checkpoint(path, torch.device("cpu"))


def test_progress_within_epochs_reports_every_step_and_changes_nothing(tiny):
    """A run told to show progress (on a terminal, by default) reports each epoch's steps on one line, clears it
    before the epoch's row, and trains exactly as one that does not."""
    out = io.StringIO()
    shown = train_cifar.train("resnet9", data=tiny, log=lambda *a: None, progress=core.Progress(out, every_s=0),
                              **dict(TINY, epochs=2))
    plain = train_cifar.train("resnet9", data=tiny, log=lambda *a: None, progress=False, **dict(TINY, epochs=2))
    lines = [part for part in out.getvalue().split("\r") if part.strip()]
    evaluation = {1: "evaluation", 2: "final evaluation"}  # then the test images (50: one batch)
    assert [line.split(" (")[0] for line in lines] == [
        text for e in (1, 2) for text in [f"run 0 epoch {e}: {i}/4" for i in range(1, 5)]
        + [f"run 0 epoch {e} {evaluation[e]}: 1/1"]]
    assert out.getvalue().endswith("\r") and out.getvalue().split("\r")[-2].strip() == ""  # cleared
    assert [r["train_loss"] for r in shown["runs"][0]["epochs"]] == [r["train_loss"] for r in plain["runs"][0]["epochs"]]


def test_checkpoint_mismatch_compares_precision_as_resolved():
    cfg = train_cifar.make_config("fast94")  # precision "auto"
    state = dict(cfg=cfg, seed=4, precision="fp32")
    assert train_cifar.checkpoint_mismatch(state, dict(cfg, precision="fp32"), 4, "fp32") is None
    assert "pass --precision fp32" in train_cifar.checkpoint_mismatch(state, cfg, 4, "bf16")
    assert "holds seed 4, not 5" in train_cifar.checkpoint_mismatch(state, cfg, 5, "fp32")
    assert "differs in lr_values" in train_cifar.checkpoint_mismatch(state, dict(cfg, lr_values=(1, 0)), 4, "fp32")
    assert train_cifar.checkpoint_mismatch(state, dict(cfg, compile=True), 4, "fp32") is None  # how, not what
    # an option added since the checkpoint (absent there) or removed since (absent here) does not block it
    older = dict(state, cfg=dict({k: v for k, v in cfg.items() if k != "lookahead_sync"}, removed_option=True))
    assert train_cifar.checkpoint_mismatch(older, cfg, 4, "fp32") is None
    legacy = dict(cfg=cfg, seed=4)  # saved before the resolved precision was: the option must match as given
    assert train_cifar.checkpoint_mismatch(legacy, cfg, 4, "fp32") is None
    assert "differs in precision" in train_cifar.checkpoint_mismatch(legacy, dict(cfg, precision="fp32"), 4, "fp32")


@pytest.mark.parametrize("eval_precision, evaluated_in, dtype", [("same", "bf16", torch.bfloat16),
                                                                  ("fp32", "fp32", torch.float32)])
def test_a_bf16_run_evaluates_in_its_eval_precision_with_its_test_images_in_it(monkeypatch, tmp_path, eval_precision,
                                                                               evaluated_in, dtype):
    """Every evaluation (each epoch's, each eval_every_steps one, the final with TTA) runs in eval_precision on
    test images stored in it: fp32 images, not bf16 ones cast up, so nothing of bf16's rounding is left. The
    logged accuracy is then the fp32 net's, recomputed from the checkpoint."""
    calls, predict = [], tb.predict

    def spy(model, x, precision, device, **kw):
        calls.append((precision, x.dtype))
        return predict(model, x, precision, device, **kw)
    monkeypatch.setattr(tb, "predict", spy)
    data, ckpt = synthetic(200, 100), tmp_path / "run.pt"
    summary = train_cifar.train("fast94", data=data, widths=(8, 16, 16), batch_size=50, epochs=2, precision="bf16",
                                eval_precision=eval_precision, eval_every_steps=3, train_sizes=(), log_dir=None,
                                log=lambda *a: None, device="cpu", checkpoint=str(ckpt))
    assert len(calls) == 2 + 2 and set(calls) == {(evaluated_in, dtype)}  # 4 steps an epoch: 2 mid-epoch, 2 ends
    state = train_cifar.load_checkpoint(str(ckpt), torch.device("cpu"))
    model = train_cifar.build_model(state["cfg"], torch.device("cpu"))
    model.load_state_dict(state["model"])
    test = tb.to_device(data, torch.device("cpu"), dtype, pad=2)
    logits = predict(model, test["test_x"], evaluated_in, torch.device("cpu"), tta=2, tta_confidence=0.7)
    assert summary["runs"][0]["accuracy"] == (logits.argmax(1) == test["test_y"]).sum().item() / 100


def test_checkpoint_mismatch_ignores_how_a_run_is_run_and_where_it_stops():
    """--stop-after-epochs, --compile(-mode), --cpu-conv and --sync-check change where a run stops or how a step
    runs, not what it computes: a checkpoint continues under other values of each (the next option still counts)."""
    cfg = train_cifar.make_config("fast94", precision="fp32")
    state = dict(cfg=cfg, seed=4, precision="fp32")
    for how in (dict(stop_after_epochs=3), dict(compile=True, compile_mode="max-autotune"), dict(cpu_conv="onednn"),
                dict(sync_check=True)):
        assert train_cifar.checkpoint_mismatch(state, dict(cfg, **how), 4, "fp32") is None, how
    assert "differs in tta" in train_cifar.checkpoint_mismatch(state, dict(cfg, tta=0, sync_check=True), 4, "fp32")


def test_a_checkpoint_or_log_without_a_data_fingerprint_compares_no_data():
    """Checkpoints and logs from before the fingerprint (or a run handed none) compare nothing, with no error;
    where both have one, the arrays that differ in size or checksum are named in order."""
    fp = dict(train_x=[200, 5], train_y=[200, 6], test_x=[50, 7], test_y=[50, 8])
    assert train_cifar.data_differs(None, fp) == train_cifar.data_differs(fp, None) == []
    assert train_cifar.data_differs("abc", fp) == []
    assert train_cifar.data_differs(fp, dict(fp, train_y=[200, 9], test_y=[49, 8])) == ["train_y", "test_y"]
    cfg = train_cifar.make_config("fast94", precision="fp32")
    assert train_cifar.checkpoint_mismatch(dict(cfg=cfg, seed=4, precision="fp32"), cfg, 4, "fp32", fp) is None


def test_a_checkpoint_resumes_one_run_only(tmp_path, tiny):
    """--runs 2 would resume the second run from the first's checkpoint: refused before anything is saved."""
    with pytest.raises(ValueError, match=r"^--checkpoint resumes a single run; use it with --runs 1$"):
        train_cifar.train("fast94", data=tiny, checkpoint=str(tmp_path / "run.pt"), runs=2, **TINY_FAST)
    assert not (tmp_path / "run.pt").exists()


def test_a_checkpoint_with_the_loader_pipeline_is_refused_before_the_data_reach_the_device(tmp_path, tiny,
                                                                                          monkeypatch):
    """Not after a first epoch trained (its stream cannot be saved): before anything is loaded or trained."""
    def no_device(*args, **kwargs):
        raise AssertionError("the data went to the device before the refusal")
    monkeypatch.setattr(tb, "to_device", no_device)
    with pytest.raises(ValueError, match="^--checkpoint is not supported with --pipeline loader$"):
        train_cifar.train("fast94", data=tiny, checkpoint=str(tmp_path / "run.pt"), pipeline="loader", **TINY_FAST)


def test_a_batch_of_every_training_image_is_runnable_and_one_more_is_not():
    """The edge: a batch of all the images left (after any holdout) runs; one image more is refused."""
    train_cifar.check_runnable(train_cifar.make_config("fast94", batch_size=200), 200)
    train_cifar.check_runnable(train_cifar.make_config("fast94", batch_size=100, holdout=100), 200)
    with pytest.raises(ValueError, match="^batch size 101 exceeds the 100 training images left by holdout 100$"):
        train_cifar.check_runnable(train_cifar.make_config("fast94", batch_size=101, holdout=100), 200)


def test_data_handed_to_train_are_checked_as_loaded_data_are(tiny):
    """train(data=...) (the studies' and the API's way in) validates the arrays as load_cifar10 does: float
    labels are a DataError naming them, not a failure deep in the loss."""
    with pytest.raises(tb.DataError, match="^data: train_y has dtype float64, expected integer labels$"):
        train_cifar.train("fast94", data=dict(tiny, train_y=tiny["train_y"].astype(np.float64)), **TINY_FAST)


def test_a_logs_data_fingerprint_must_be_sizes_and_checksums_as_written(tmp_path):
    """Each array's [size, checksum], two whole numbers: anything else (an edited log) is refused, not compared."""
    fp = dict(train_x=[200, 5], train_y=[200, 6], test_x=[50, 7], test_y=[50, 8])
    log = dict(preset="fast94", config=core.json_safe(train_cifar.make_config("fast94")), runs=[])
    path = tmp_path / "log.json"
    path.write_text(json.dumps(dict(log, data_fingerprint=fp)))
    assert train_cifar.config_from_log(str(path))[0] == "fast94"
    for bad in (dict(fp, test_y=[50, "8"]), dict(fp, test_y=[50, 8.5]), dict(fp, test_y=[50, 8, 1]),
                {k: v for k, v in fp.items() if k != "test_y"}, dict(fp, test_y=(50, 8), extra=[1, 2])):
        path.write_text(json.dumps(dict(log, data_fingerprint=bad)))
        with pytest.raises(ValueError, match="its data_fingerprint is not one train_cifar.py writes"):
            train_cifar.config_from_log(str(path))


def test_a_checkpoint_does_not_resume_on_other_data(tmp_path):
    """Other images of the same count, or the same images in another order, were resumed silently (or failed
    with an IndexError when there were more): the checkpoint now holds the data's fingerprint."""
    cfg = train_cifar.make_config("resnet9", **dict(TINY, stop_after_epochs=1))
    dev = torch.device("cpu")

    def on_device(data):
        return tb.to_device(tb.validate(data, "tiny"), dev, torch.float32, pad=cfg["pad"])
    data = synthetic(400, 100)
    ckpt = str(tmp_path / "run.pt")
    train_cifar.run_once(cfg, on_device(data), 0, 7, dev, "fp32", log=lambda *a: None, checkpoint=ckpt)
    order = np.random.default_rng(0).permutation(400)
    shuffled = dict(data, train_x=data["train_x"][order], train_y=data["train_y"][order])
    for other, differ in ((synthetic(400, 100, seed=1), "train_x, test_x differ"),
                          (shuffled, "train_x, train_y differ"), (synthetic(300, 100), "300 here")):
        with pytest.raises(ValueError, match=f"was trained on other data .*{differ}"):
            train_cifar.run_once(dict(cfg, stop_after_epochs=2), on_device(other), 0, 7, dev, "fp32",
                                 log=lambda *a: None, checkpoint=ckpt)
    with pytest.raises(ValueError, match=r"differs in pad"):  # the configuration is named first, not the data
        padded = dict(cfg, stop_after_epochs=2, pad=cfg["pad"] + 1)
        train_cifar.run_once(padded, tb.to_device(tb.validate(data, "tiny"), dev, torch.float32, pad=padded["pad"]),
                             0, 7, dev, "fp32", log=lambda *a: None, checkpoint=ckpt)
    resumed = train_cifar.run_once(dict(cfg, stop_after_epochs=2), on_device(data), 0, 7, dev, "fp32",
                                   log=lambda *a: None, checkpoint=ckpt)
    assert len(resumed["epochs"]) == 2
    fp = train_cifar.data_fingerprint(on_device(data))
    assert fp == train_cifar.data_fingerprint(on_device(dict(data)))  # exact: the same data, the same numbers


@pytest.mark.parametrize("preset", list(train_cifar.PRESETS))
def test_every_preset_trains_with_its_own_options(preset):
    """Each preset's combination of options (TTA, lookahead, EMA, ghost BN, whitening bias...) runs end to end,
    shrunk to 1/8 of its widths and its schedule to two epochs, and learns an easy task."""
    own = train_cifar.PRESETS[preset]
    widths = tuple(max(4, w // 8) for w in own["widths"])
    knots = tuple(k * 2 / own["epochs"] for k in own["lr_knots"])
    # The ResNet-18s' schedule warms up over ~5,800 steps at batch 128; squeezed into a few steps its full LR can
    # blow up a tiny net, so they take the linear-scaling LR for batch 64. The large-batch recipes (512-2000) are
    # built for few steps and keep theirs.
    scale = 64 / own["batch_size"] if own["batch_size"] <= 128 else 1.0
    values = tuple(v * scale for v in own["lr_values"])
    shrunk = dict(widths=widths, batch_size=64, epochs=2, lr_knots=knots, lr_values=values, precision="fp32")
    if own.get("select_fraction", 1) < 1:
        shrunk.update(proxy_widths=tuple(max(4, w // 8) for w in own["proxy_widths"]))
    cfg = train_cifar.make_config(preset, **shrunk)
    dev = torch.device("cpu")
    data = synthetic(640, 100)
    tints = np.random.default_rng(1).integers(0, 128, (10, 3))  # a learnable signal: one colour per class
    for split in ("train", "test"):
        tint = tints[data[f"{split}_y"]]
        data[f"{split}_x"] = (data[f"{split}_x"] // 2 + tint[:, None, None, :]).astype(np.uint8)
    on_device = tb.to_device(tb.validate(data, "tiny"), dev, torch.float32, pad=cfg["pad"])
    result = train_cifar.run_once(cfg, on_device, 0, 0, dev, "fp32", log=lambda *a: None)
    losses = [row["train_loss"] for row in result["epochs"]]
    assert len(losses) == 2 and all(np.isfinite(losses)) and not result["diverged"]
    # it learns: the loss falls by a tenth, or the accuracy is well above chance (0.1) after a few dozen steps
    assert losses[1] < 0.9 * losses[0] or result["accuracy"] >= 0.25, (losses, result["accuracy"])


def test_flop_counter_matches_the_convolution_formula():
    conv = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
    x = torch.randn(4, 3, 16, 16)
    assert tb.count_flops(lambda: conv(x)) == 2 * 4 * 8 * 3 * 9 * 16 * 16


def test_a_named_precision_is_kept_and_fp16_refused_on_a_cpu():
    cpu = torch.device("cpu")  # ("auto" on a CPU: by its flags, below)
    assert tb.resolve_precision("fp32", cpu) == "fp32" and tb.resolve_precision("bf16", cpu) == "bf16"
    with pytest.raises(ValueError, match="fp16 is for CUDA GPUs"):
        tb.resolve_precision("fp16", cpu)


ZEN3 = {"model name": "AMD EPYC", "cpu family": "25", "model": "1", "flags": "fpu sse2 avx avx2 fma"}
ZEN4 = dict(ZEN3, model="17", flags="fpu sse2 avx avx2 fma avx512f avx512_bf16")


AMX_ONLY = dict(ZEN3, flags="fpu sse2 avx avx2 fma amx_tile amx_bf16")  # (bf16 by AMX alone, as a VM may show it)


@pytest.mark.parametrize("info, bf16, isa", [(ZEN3, False, "avx2"), (ZEN4, True, "avx512_bf16"),
                                             (AMX_ONLY, True, "amx_bf16")])
def test_cpu_precision_and_hardware_string_follow_the_cpu_flags(monkeypatch, info, bf16, isa):
    # Two CPUs both called "AMD EPYC" run this project 4x apart (bf16 or not): logs must tell them apart.
    monkeypatch.setattr(tb, "cpu_info", lambda: info)
    monkeypatch.setattr(tb, "loaded_libraries", lambda: "7f00-7f01 r-xp 0 08:01 1 /usr/lib/libc.so.6\n")
    cpu = torch.device("cpu")
    assert tb.cpu_has_bf16() is bf16
    assert tb.resolve_precision("auto", cpu) == ("bf16" if bf16 else "fp32")
    name = tb.device_name(cpu)
    assert name.startswith("AMD EPYC (family 25 model " + info["model"] + ", " + isa + ", ")
    monkeypatch.setattr(tb, "loaded_libraries", lambda: "7f02-7f03 r-xp 0 08:01 2 /usr/lib/libjemalloc.so.2\n")
    assert tb.device_name(cpu).endswith(", jemalloc)") and tb.allocator_hint(cpu) is None


@pytest.mark.parametrize("bf16_supported, expected", [(True, "bf16"), (False, "fp16")])
def test_auto_precision_on_a_gpu_is_bf16_where_supported_else_fp16(monkeypatch, bf16_supported, expected):
    """(V100s and older have no bf16 units: fp16 there, with its loss scaling.)"""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_supported)
    assert tb.resolve_precision("auto", torch.device("cuda")) == expected


def test_allocator_hint_only_for_cpu_runs_under_glibc(monkeypatch):
    monkeypatch.setattr(tb, "loaded_libraries", lambda: "")
    assert "LD_PRELOAD=" in tb.allocator_hint(torch.device("cpu"))
    assert tb.allocator_hint(torch.device("cuda")) is None


@pytest.mark.parametrize("preload", ["/nonexistent/libjemalloc.so.2", tb.find_allocator_library("jemalloc")])
def test_logs_name_jemalloc_only_when_it_really_loaded(preload):
    # A preload of a missing library only warns (ld.so), so the logs once claimed jemalloc for glibc runs.
    if preload is None:
        pytest.skip("no libjemalloc on this machine (apt-get install libjemalloc2)")
    code = "import torch, torch_backend as tb; print(tb.preloaded_allocator())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, LD_PRELOAD=preload))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("jemalloc" if os.path.exists(preload) else "None")


def test_lookahead_pulls_weights_towards_the_average():
    net = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        net.weight.fill_(0.0)
    la = train_cifar.Lookahead(net)
    with torch.no_grad():
        net.weight.fill_(1.0)
    la.update(0.75)
    torch.testing.assert_close(net.weight, torch.full((2, 2), 0.25))


def test_weight_ema_averages_weights_and_bn_statistics_and_is_applied_only_inside_the_block():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.BatchNorm1d(2))
    history = []
    ema = train_cifar.WeightEMA(net, decay=0.9, every=2)
    history.append({k: v.clone() for k, v in net.state_dict().items()})
    for t in range(3):
        with torch.no_grad():
            net[0].weight.add_(1.0 + t)
            net[1].running_mean.add_(0.5)
        ema.update()
        history.append({k: v.clone() for k, v in net.state_dict().items()})
    r = 0.9 ** 2
    for key in ("0.weight", "1.running_mean", "1.running_var"):
        expected = history[0][key].double()
        for h in history[1:]:
            expected = r * expected + (1 - r) * h[key].double()
        torch.testing.assert_close(ema.avg[key].double(), expected)
    assert "1.num_batches_tracked" not in ema.avg  # integer counters are not averaged
    x = torch.randn(4, 2)
    net.eval()
    with ema.applied():
        averaged = net(x)
        torch.testing.assert_close(net[0].weight, ema.avg["0.weight"])
    torch.testing.assert_close(net[0].weight, history[-1]["0.weight"])  # the trained weights are back
    assert not torch.allclose(averaged, net(x))


def test_resnet9_tricks_trains_and_an_ema_without_decay_is_the_plain_run():
    data = synthetic(400, 100)
    dev = torch.device("cpu")
    base = dict(TINY, batch_size=64)
    plain = train_cifar.make_config("resnet9-tricks", **dict(base, ema_every=0))
    no_decay = train_cifar.make_config("resnet9-tricks", **dict(base, ema_every=1, ema_decay=0.0))
    on_device = tb.to_device(tb.validate(data, "tiny"), dev, torch.float32, pad=plain["pad"])
    a = train_cifar.run_once(plain, on_device, 0, 3, dev, "fp32", log=lambda *a: None)
    b = train_cifar.run_once(no_decay, on_device, 0, 3, dev, "fp32", log=lambda *a: None)
    assert [r["train_loss"] for r in a["epochs"]] == [r["train_loss"] for r in b["epochs"]]
    assert a["accuracy"] == b["accuracy"] and np.isfinite(a["epochs"][-1]["train_loss"])
    with pytest.raises(ValueError, match="whiten-bias-epochs needs net fastnet"):
        train_cifar.make_config("resnet9-tricks", whiten_bias_epochs=2)


def test_muons_sgd_groups_keep_decay_per_step_equal():
    """fast94's biases step at 64x the LR, so they take 1/64 of the weight decay (as SGD's groups do); the
    orthogonalised filters and the head take it whole."""
    cfg = train_cifar.make_config("fast94", widths=(8, 16, 16))
    model = train_cifar.build_model(cfg, torch.device("cpu"))
    groups = train_cifar.make_optimizer(cfg, model).param_groups
    assert len(groups) == 3 and sum(len(g["params"]) for g in groups) == len(
        [p for p in model.parameters() if p.requires_grad])
    for g in groups:
        decay = g["weight_decay"] * (1.0 if g.get("orthogonalize") else g["lr_scale"])
        assert decay == pytest.approx(cfg["weight_decay"], rel=1e-12), (g["lr_scale"], g["weight_decay"])
    assert sorted(g["lr_scale"] for g in groups) == [cfg["muon_lr_scale"], 1.0, cfg["bias_lr_scale"]]


def test_optimizer_groups_keep_decay_per_step_equal():
    cfg = train_cifar.make_config("fast94-sgd", widths=(8, 16, 16))
    model = train_cifar.build_model(cfg, torch.device("cpu"))
    opt = train_cifar.make_optimizer(cfg, model)
    slow, fast = opt.param_groups
    assert fast["lr_scale"] == 64 and fast["lr_scale"] * fast["weight_decay"] == pytest.approx(slow["weight_decay"])
    biases = [m.bias for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)] + [model.whiten.bias]
    assert len(fast["params"]) == len(biases) == 7 and all(any(p is b for b in biases) for p in fast["params"])
    assert all(p.ndim > 1 for p in slow["params"])
    assert not any(p is model.whiten.weight for g in opt.param_groups for p in g["params"])  # frozen


def test_a_classifiers_bias_takes_the_weights_lr_not_the_bn_biases():
    """resnet18's linear head has a bias: with --bias-lr-scale it stays in the plain group, with the weights,
    while every BN parameter that trains takes the scaled LR."""
    cfg = train_cifar.make_config("resnet18", widths=(8, 8, 16, 16), bias_lr_scale=8.0)
    model = train_cifar.build_model(cfg, torch.device("cpu"))
    slow, fast = train_cifar.make_optimizer(cfg, model).param_groups
    heads = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(heads) == 1 and heads[0].bias is not None and any(p is heads[0].bias for p in slow["params"])
    bn = [p for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in m.parameters() if p.requires_grad]
    assert len(fast["params"]) == len(bn) and all(any(p is q for q in bn) for p in fast["params"])


def test_step_evaluations_stop_at_target_on_a_holdout():
    data = synthetic(400, 100)
    s = train_cifar.train("resnet9", data=data, log_dir=None, log=lambda *a: None, **dict(
        TINY, epochs=3, holdout=100, eval_every_steps=3, stop_at_target=True, target=0.01))
    run = s["runs"][0]
    assert run["step_reached_target"] == 3 and [e["step"] for e in run["evals"]] == [3]
    assert len(run["epochs"]) == 1 and run["accuracy"] is not None  # stopped in the first epoch
    assert run["fresh_to_target"] == 3 * 50  # three batches of fresh examples
    meta = torch.device("meta")  # its FLOPs: the 3 steps it trained, not the 18 of its schedule
    cfg = train_cifar.make_config("resnet9", **dict(TINY, epochs=3, holdout=100, precision="fp32"))
    net = train_cifar.build_model(cfg, meta)
    opt = train_cifar.make_optimizer(cfg, net)
    assert run["train_flops"] == train_cifar.run_flops(cfg, net, opt, meta, "fp32", 300, 3)[2]
    assert run["train_flops"] == 3 * train_cifar.step_flops(net, opt, meta, "fp32", cfg["batch_size"])
    full = train_cifar.train("resnet9", data=data, log_dir=None, log=lambda *a: None,
                             **dict(TINY, epochs=1, holdout=100, eval_every_steps=2))
    assert [e["step"] for e in full["runs"][0]["evals"]] == [2, 4, 6]  # 300 training images, batch 50
    assert all(round(e["test_acc"] * 100) == e["test_acc"] * 100 for e in full["runs"][0]["evals"])


def test_an_accuracy_equal_to_the_target_reaches_it_between_steps_as_at_epoch_ends(monkeypatch):
    """9,400 right of 10,000 reaches 0.94: the step evaluations count it as the epoch ends do (>=)."""
    monkeypatch.setattr(train_cifar, "evaluate", lambda *a, **k: 0.5)
    s = train_cifar.train("resnet9", data=synthetic(200, 50), log_dir=None, log=lambda *a: None,
                          **dict(TINY, epochs=1, eval_every_steps=2, target=0.5))
    run = s["runs"][0]
    assert (run["step_reached_target"], run["epoch_reached_target"]) == (2, 1)


def test_compile_warm_up_leaves_the_net_as_it_was():
    """The warm-up trains nothing: weights, BN statistics and requires_grad are restored and no gradient is left
    (eager step here; the compiled step is the same call)."""
    cfg = train_cifar.make_config("fast94", widths=(8, 16, 16), whiten_bias_epochs=2, precision="fp32")
    dev = torch.device("cpu")
    torch.manual_seed(0)
    model = train_cifar.build_model(cfg, dev)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    rng_state = torch.get_rng_state()
    train_cifar.warm_up_compile(dict(cfg, batch_size=16), model, dev, "fp32", world=1)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert torch.equal(torch.get_rng_state(), rng_state)  # the run's random streams are untouched


def jumping_clock(monkeypatch):
    """time.perf_counter moved on 1000 s at each call of the jump() returned (with any arguments, so it can stand
    in for a function); jumped[0]: how far in all."""
    real_clock, jumped = time.perf_counter, [0.0]

    def jump(*args, **kwargs):
        jumped[0] += 1000.0
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + jumped[0])
    return jump, jumped


@pytest.mark.parametrize("preset, mode", [("fast94-sgd", "default"), ("fast94", "reduce-overhead")])
def test_compiled_run_matches_the_eager_run(monkeypatch, preset, mode):
    """torch.compile changes how the step runs, not what it computes: same seed, same training losses (fp32,
    up to kernel rounding), and the compilation is not counted in the run's time. The clock jumps 1000 s while
    the step compiles: the jump shows in the compile time reported and must not in the run's time. fast94's
    Muon update is compiled too, here in the mode that makes it a CUDA graph on a GPU (warmed up on the real
    weights and buffers, which must be put back)."""
    data = synthetic(256, 100)
    kw = dict(widths=(8, 16, 16), batch_size=64, epochs=2, precision="fp32", tta=0, lookahead_start_epoch=-1,
              whiten_bias_epochs=1, train_sizes=(), compile_mode=mode, log_dir=None)
    said = []
    eager = train_cifar.train(preset, data=data, log=lambda *a: None, **kw)["runs"][0]
    jump, _ = jumping_clock(monkeypatch)
    warm_up_compile = train_cifar.warm_up_compile
    monkeypatch.setattr(train_cifar, "warm_up_compile", lambda *a, **k: (warm_up_compile(*a, **k), jump()))
    compiled = train_cifar.train(preset, data=data, log=said.append, compile=True, **kw)["runs"][0]
    np.testing.assert_allclose([r["train_loss"] for r in compiled["epochs"]],
                               [r["train_loss"] for r in eager["epochs"]], rtol=1e-3)
    compile_s = float(next(m for m in said if m.startswith("compiled the training step")).split(" in ")[1].split()[0])
    assert compile_s >= 1000 and compiled["total_time_s"] < 1000


def test_compiling_the_proxy_is_not_counted_in_the_runs_time(monkeypatch):
    """Data selection's proxy compiles beside the net, outside the timer too: both warm-ups jump the clock by
    1000 s (torch.compile left out: what counts is where the clock is read)."""
    jump, jumped = jumping_clock(monkeypatch)
    monkeypatch.setattr(train_cifar, "warm_up_compile", jump)
    monkeypatch.setattr(train_cifar.Proxy, "warm_up", jump)
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f))
    run = train_cifar.train("fast96", data=synthetic(256, 100), log=lambda *a: None, compile=True, log_dir=None,
                            **dict(TINY, widths=(8, 16, 16), proxy_widths=(4, 8, 8), batch_size=32, epochs=1,
                                   tta=0))["runs"][0]
    assert jumped[0] == 2000 and run["total_time_s"] < 1000


@pytest.mark.parametrize("preset", ["resnet18", "resnet9", "resnet9-tricks", "fast94"])
def test_compiled_bf16_gradients_match_eager(preset):
    """A compiled bf16 step computes the eager step's gradients: finite, and as far from the fp32 gradients as
    the eager bf16 ones are (bf16's rounding, not a wrong kernel). torch 2.13's inductor turned amax's backward in
    resnet18's pooling into NaN on CPUs; tb.ConcatPool avoids it."""
    widths = dict(resnet18=(8, 8, 16, 16), resnet9=(8, 16, 16, 32), fast94=(8, 16, 16)).get(preset, (8, 16, 16, 32))
    cfg = train_cifar.make_config(preset, widths=widths, cpu_conv="onednn")
    dev = torch.device("cpu")
    torch.manual_seed(0)
    nets = [train_cifar.build_model(cfg, dev) for _ in range(3)]
    for net in nets[1:]:
        net.load_state_dict(nets[0].state_dict())
    x = torch.randn(64, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (64,))
    for step, precision in ((nets[0], "fp32"), (nets[1], "bf16"), (torch.compile(nets[2], dynamic=False), "bf16")):
        train_cifar.forward_loss(cfg, step, x, y, precision, dev)[1].backward()
    eager_errs, compiled_errs = [], []
    for (name, ref), eager, compiled in zip(nets[0].named_parameters(), nets[1].parameters(), nets[2].parameters()):
        if ref.grad is None:
            continue
        assert compiled.grad.isfinite().all(), f"{name}: the compiled step's gradient is not finite"
        eager_errs.append(float((eager.grad - ref.grad).norm() / ref.grad.norm()))
        compiled_errs.append(float((compiled.grad - ref.grad).norm() / ref.grad.norm()))
    # per tensor, bf16's error in these tiny nets is 10-50% either way; over all tensors it is steady
    assert np.mean(compiled_errs) <= 1.5 * np.mean(eager_errs) + 0.02, (np.mean(compiled_errs), np.mean(eager_errs))


HOST_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


@pytest.fixture
def host_reads(monkeypatch):
    """Counts, by kind, every read of a tensor's value from Python while the test runs."""
    reads = collections.Counter()
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


@pytest.mark.parametrize("preset", ["fast94", "fast94-sgd", "fast96"])
def test_the_training_steps_never_read_a_tensor_on_the_host(host_reads, preset):
    """On a GPU every read of a tensor's value from Python (.item(), bool(t), ...) waits for the queue to drain:
    the steps must make none, only the per-epoch summary and the evaluation. So the count of reads over a run
    must not grow with the steps in an epoch (4 against 16 here)."""
    kw = dict(widths=(8, 16, 16), batch_size=64, epochs=2, precision="fp32", tta=0, log_dir=None)
    if preset == "fast96":  # its proxy, small too (its candidates: 2 against 8 steps an epoch)
        kw.update(proxy_widths=(8, 8, 8))
    counts = []
    for n_train in (256, 1024):
        host_reads.clear()
        train_cifar.train(preset, data=synthetic(n_train, 100), log=lambda *a: None, **kw)
        counts.append(dict(host_reads))
    assert counts[0] == counts[1], f"reads from the host grow with the steps: {counts}"


def weights_after_steps(cfg, scaler, steps, reads=None):
    """A small net's weights after `steps` fp32 training steps from seed 0 with this loss scaler; reads (a
    host_reads counter) is cleared after the first step, which may set up state."""
    dev = torch.device("cpu")
    torch.manual_seed(0)
    model = train_cifar.build_model(cfg, dev)
    opt = train_cifar.make_optimizer(cfg, model)
    train_cifar.set_lr(opt, 0.5)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(32, 3, 32, 32, generator=g).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (32,), generator=g)
        train_cifar.train_step(cfg, model, opt, x, y, "fp32", dev, scaler)
        if step == 0 and reads is not None:
            reads.clear()
    return model.state_dict()


@pytest.mark.parametrize("preset", ["fast94", "fast94-sgd"])  # Muon for the filters, and SGD throughout
def test_a_fixed_loss_scale_trains_exactly_as_no_scale(preset):
    """fp16's fixed loss scale multiplies the loss by a power of two and divides the gradients by it: exact in
    binary floating point, so (in fp32 here) the weights after a few steps are the unscaled run's, bit for bit."""
    cfg = train_cifar.make_config(preset, widths=(8, 16, 16), precision="fp32")
    plain = weights_after_steps(cfg, torch.amp.GradScaler("cpu", enabled=False), 3)
    scaled = weights_after_steps(cfg, tb.FixedLossScale(1024.0), 3)
    differ = [k for k in plain if not torch.equal(plain[k], scaled[k])]
    assert not differ, differ
    # ... and it does scale: equal weights alone hold for a scaler that does nothing. The backward runs on 1024x
    # the loss (gradients 1024x, exactly), and the optimizer's step sees them divided back (float64 by hand).
    w = torch.nn.Parameter(torch.tensor([0.75, -1.5, 3.0], dtype=torch.float64))
    scaler, seen = tb.FixedLossScale(1024.0), []
    loss = (w ** 2).sum()  # d/dw = 2 w
    assert scaler.scale(loss).item() == 1024.0 * loss.item()
    scaler.scale(loss).backward()
    assert torch.equal(w.grad, 1024.0 * 2 * w.detach())
    recorder = type("Recorder", (), dict(param_groups=[dict(params=[w])],
                                         step=lambda self: seen.append(w.grad.clone())))
    scaler.step(recorder())
    assert len(seen) == 1 and torch.equal(seen[0], 2 * w.detach())


@pytest.mark.parametrize("loss_scale, reads_each_step", [("batch", False), ("64", False), ("dynamic", True)])
def test_fp16s_fixed_loss_scale_never_reads_a_tensor_on_the_host(host_reads, loss_scale, reads_each_step):
    """fp16's default loss scale is fixed, the batch size rounded down to a power of two (fast94's 2000: 1024),
    so its steps read nothing on the host; PyTorch's dynamic GradScaler reads its overflow flag in every step
    (its scaler is used here on an fp32 CPU step: fp16 itself is for CUDA)."""
    cfg = train_cifar.make_config("fast94", widths=(8, 16, 16), loss_scale=loss_scale)
    scaler = train_cifar.make_loss_scaler(cfg, "fp16", torch.device("cpu"))
    if not reads_each_step:
        assert scaler.factor == (1024 if loss_scale == "batch" else 64)
    counts = []
    for steps in (2, 5):
        weights_after_steps(cfg, scaler, steps, host_reads)
        counts.append(sum(host_reads.values()))
    assert (counts[1] > counts[0]) == reads_each_step, counts
    assert not train_cifar.make_loss_scaler(cfg, "bf16", torch.device("cpu")).is_enabled()


def test_from_log_reruns_a_logged_run_bit_for_bit_and_says_so(tiny_npz, tmp_path, capsys):
    """--from-log takes the log's whole recipe and seeds, not the preset's values: a tiny fastnet with its own
    schedule comes back identical epoch by epoch; an option changed on the command line shows where it diverges."""
    first = train_cifar.main(["--data", tiny_npz, "--log-dir", str(tmp_path / "a"), "--widths", "8", "16", "16",
                              "--batch-size", "50", "--epochs", "2", "--lr-values", "1.0", "0.0", "--precision",
                              "fp32", "--seed", "5", "--runs", "2", "--train-sizes", "16", "32"])
    again = train_cifar.main(["--from-log", first["log_json"], "--data", tiny_npz, "--log-dir", str(tmp_path / "b")])
    assert {k: v for k, v in again["config"].items()} == first["config"]
    report = again["reproduces"]["runs"]
    assert [r["seed"] for r in report] == [5, 6]
    assert all(r["epochs"] == 2 and r["first_difference"] is None and r["max_loss_difference"] == 0 for r in report)
    assert [r["logged_accuracy"] for r in report] == [r["accuracy"] for r in first["runs"]]
    assert json.loads(open(again["log_json"]).read())["reproduces"]["runs"] == report
    out = capsys.readouterr().out
    assert out.count("identical to the log over 2 epoch(s)") == 2

    # stopped after epoch 1: that epoch's evaluation is its final one (TTA), the log's a plain one
    short = train_cifar.main(["--from-log", first["log_json"], "--data", tiny_npz, "--log-dir", "", "--runs", "1",
                              "--stop-after-epochs", "1"])
    assert short["reproduces"]["runs"][0] == dict(seed=5, epochs=1, first_difference=None, max_loss_difference=0,
                                                  cut_short=True, accuracy=short["runs"][0]["accuracy"],
                                                  logged_accuracy=None)
    assert "it stopped early" in capsys.readouterr().out

    changed = train_cifar.main(["--from-log", first["log_json"], "--data", tiny_npz, "--log-dir", "",
                                "--runs", "1", "--lr-values", "0.5", "0.0"])
    assert changed["config"]["lr_values"] == [0.5, 0.0] and changed["config"]["widths"] == [8, 16, 16]
    assert changed["reproduces"]["runs"][0]["first_difference"] == 1
    out = capsys.readouterr().out
    assert "--lr-values 0.5 0.0 (logged 1.0 0.0)" in out and "differs from the log from epoch 1" in out
    assert "data_differs" not in again["reproduces"] and again["data_fingerprint"] == first["data_fingerprint"]

    # on other data (one test image changed) the rerun says so, rather than leaving the user to guess why
    other = dict(np.load(tiny_npz))
    other["test_x"] = other["test_x"].copy()
    other["test_x"][0] ^= 1
    np.savez(tmp_path / "other.npz", **other)
    elsewhere = train_cifar.main(["--from-log", first["log_json"], "--data", str(tmp_path / "other.npz"),
                                  "--log-dir", "", "--runs", "1"])
    assert elsewhere["reproduces"]["data_differs"] == ["test_x"]
    said = capsys.readouterr().out
    note = "note: this run's data are not the log's (test_x differ: other images, or the same in"
    assert note in said and said.index(note) < said.index("train_loss")  # said before it trains, and again after
    assert said.count(note) == 2

    # an edited fingerprint compared nothing: refused, as other malformed parts of a log are
    edited = json.loads(open(first["log_json"]).read())
    edited["data_fingerprint"] = "abc"
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    with pytest.raises(SystemExit) as e:
        train_cifar.main(["--from-log", str(tmp_path / "edited.json"), "--data", tiny_npz, "--log-dir", ""])
    assert e.value.code == 2 and "its data_fingerprint is not one train_cifar.py writes" in capsys.readouterr().err


def test_from_log_names_what_a_log_predates_and_refuses_what_is_gone(tiny_npz, tmp_path, capsys):
    s = train_cifar.main(["--data", tiny_npz, "--log-dir", str(tmp_path), "--widths", "8", "16", "16",
                          "--batch-size", "50", "--epochs", "1", "--precision", "fp32"])
    log = json.loads(open(s["log_json"]).read())
    # a log without an option neither table knows (as if written by code that lacked it): COMMON's, named as a
    # possible difference; one that came with what the run did not use (ema_decay, with EMA off): COMMON's, unnamed
    del log["config"]["eval_every"]
    del log["config"]["ema_decay"]
    del log["config"]["sync_check"]  # a check, not a change: not named (it cannot make a rerun differ)
    del log["config"]["color_jitter"]  # added switched off: it ran without (core.PREDATED_VALUES), not named either
    del log["config"]["tta_confidence"]  # the same: every image had the extra views, not the preset's unsure ones
    log["world_size"] = 2
    old = tmp_path / "old.json"
    old.write_text(json.dumps(log))
    preset, options, _, predated = train_cifar.config_from_log(str(old))
    assert preset == "fast94" and predated == ["eval_every"]
    assert options["color_jitter"] == (0.0, 0.0) and options["sync_check"] is False
    assert options["ema_decay"] == train_cifar.COMMON["ema_decay"] and "ema_decay" in core.PREDATED_UNUSED
    assert options["eval_every"] == train_cifar.COMMON["eval_every"]
    assert options["tta_confidence"] == 0.0 != train_cifar.PRESETS["fast94"]["tta_confidence"]
    capsys.readouterr()
    rerun = train_cifar.main(["--from-log", str(old), "--data", tiny_npz, "--log-dir", ""])
    out = capsys.readouterr().out
    assert "the log predates --eval-every: they take" in out and "the log ran 2 processes, this 1" in out
    assert not any(f"--{k}" in out for k in ("color-jitter", "sync-check", "tta-confidence", "ema-decay"))
    assert rerun["reproduces"]["runs"][0]["first_difference"] is None  # trained as logged, without the jitter
    assert rerun["config"]["tta_confidence"] == 0.0
    log["config"]["muon_fixed_norm"] = True  # an option since removed
    old.write_text(json.dumps(log))
    r = cli("--from-log", str(old), "--data", tiny_npz, "--log-dir", "")
    assert r.returncode == 2 and "muon_fixed_norm, which this code no longer has" in r.stderr
    assert r.stderr.strip().count("\n") == 0
    for args, message in [(["--from-log", str(tmp_path / "none.json")], "cannot read"),
                          (["--from-log", s["log_json"], "--preset", "fast95"], "leave --preset out")]:
        r = cli(*args, "--data", tiny_npz, "--log-dir", "")
        assert r.returncode == 2 and message in r.stderr and r.stderr.strip().count("\n") == 0
    # malformed logs: refused before anything trains (they ended in tracebacks, some after the rerun had trained)
    good = json.loads(open(s["log_json"]).read())
    for change, message in [(lambda g: g.update(config=[1, 2]), "not a train_cifar.py log"),
                            (lambda g: g["runs"][0].pop("seed"), "not a train_cifar.py log"),
                            (lambda g: g["runs"][0]["epochs"][0].pop("train_loss"), "not a train_cifar.py log"),
                            (lambda g: g["config"].update(seed="0"), "seed takes a whole number")]:
        bad = json.loads(json.dumps(good))
        change(bad)
        old.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            train_cifar.config_from_log(str(old))


def test_rows_reach_a_redirected_stdout_as_they_come(tiny_npz, tmp_path):
    """Python block-buffers stdout into a pipe or file: without line buffering the table would arrive in 8 KB
    lumps (a `nohup ... > run.log` run showing nothing for an hour). When the row of epoch 1 arrives here, the
    TSV (flushed every epoch) must not be many epochs ahead of it."""
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_cifar.py"), "--data", tiny_npz, "--log-dir",
                          str(tmp_path), "--widths", "8", "8", "8", "--batch-size", "50", "--epochs", "500",
                          "--precision", "fp32"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"})
    try:
        for line in p.stdout:
            if re.match(r"\s+0\s+1\s", line):  # run 0, epoch 1
                rows = len(core.read_tsv(str(next(tmp_path.glob("*.tsv")))))
                assert rows < 20, f"epoch 1's row came when the TSV had {rows} epochs"
                break
        else:
            pytest.fail("no row for epoch 1")
    finally:
        p.kill()
        p.wait()


def test_a_reader_that_leaves_early_ends_the_run_without_a_traceback(tiny_npz):
    """`python train_cifar.py | head -3`: once the reader is gone the run ends (exit 1) without the
    BrokenPipeError traceback Python would print, twice, for output nobody reads (core.exit_with)."""
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_cifar.py"), "--data", tiny_npz, "--log-dir", "",
                          "--widths", "8", "8", "8", "--batch-size", "50", "--epochs", "2", "--precision", "fp32"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # before the script has written anything
    err = p.stderr.read()
    assert p.wait() == 1 and "Traceback" not in err and "BrokenPipe" not in err, err


# --- Mechanics a recipe rests on, each against an independent statement of it (review of 2026-12-05: each of
# these could be broken without any test failing).

TINY_FAST = dict(widths=(8, 16, 16), batch_size=50, precision="fp32", train_sizes=(), tta=0, log_dir=None,
                 log=lambda *a: None, progress=False)


def recorded_steps(monkeypatch, record):
    """train_step, calling record(cfg, model, opt) before each step."""
    step = train_cifar.train_step

    def recording(cfg, step_fn, opt, *args, **kwargs):
        record(cfg, step_fn, opt)
        return step(cfg, step_fn, opt, *args, **kwargs)
    monkeypatch.setattr(train_cifar, "train_step", recording)


@pytest.mark.parametrize("preset, scale_of", [
    # fast94: Muon filters at 0.15x, BN biases and the whitening bias at 64x, the head at 1x
    ("fast94", lambda name, p: 0.15 if p.ndim == 4 else 64.0 if p.ndim == 1 and "head" not in name else 1.0),
    # fast95: SGD, BN biases at 64x; its whitening bias at the plain LR (whiten_bias_fast False, as airbench95)
    ("fast95", lambda name, p: 64.0 if p.ndim == 1 and not name.startswith(("whiten", "head")) else 1.0),
])
def test_every_parameter_trains_at_its_share_of_the_scheduled_lr(monkeypatch, tiny, preset, scale_of):
    """The LR each parameter steps with, against the schedule written out: linear from the knots' values at
    each step's fraction of an epoch, times the share its kind takes."""
    seen = []

    def record(cfg, model, opt):
        lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
        seen.append({n: (lr_of[id(p)], scale_of(n, p)) for n, p in model.named_parameters() if p.requires_grad})
    recorded_steps(monkeypatch, record)
    run = train_cifar.train(preset, data=tiny, epochs=2, lookahead_start_epoch=-1, whiten_bias_epochs=0,
                            **TINY_FAST)["runs"][0]
    knots, values = train_cifar.make_config(preset, epochs=2)["lr_knots"], train_cifar.PRESETS[preset]["lr_values"]
    per_epoch = 200 // 50
    assert len(seen) == 2 * per_epoch and run["accuracy"] is not None
    for step, lrs in enumerate(seen):
        scheduled = float(np.interp(step / per_epoch, knots, values))
        for name, (lr, scale) in lrs.items():
            assert lr == pytest.approx(scheduled * scale, rel=1e-12), (step, name)


def test_the_whitening_bias_trains_for_its_epochs_and_is_then_frozen(monkeypatch, tiny):
    biases = []
    recorded_steps(monkeypatch, lambda cfg, model, opt: biases.append(model.whiten.bias.detach().clone()))
    train_cifar.train("fast94", data=tiny, epochs=3, whiten_bias_epochs=1, **TINY_FAST)
    per_epoch = 200 // 50
    assert len(biases) == 3 * per_epoch
    assert all(not torch.equal(a, b) for a, b in zip(biases[:per_epoch], biases[1:per_epoch + 1]))  # epoch 1 moves
    assert all(torch.equal(b, biases[per_epoch]) for b in biases[per_epoch:])  # then it stays


def test_lookahead_pulls_with_airbenchs_decay_schedule(monkeypatch, tiny):
    """Every 5 steps from the first, decay 0.95^5 x (step / total)^3; at the end the average is copied in whole
    (lookahead_sync end, fast95's). 3 epochs of 4 steps: the average starts at step 5, pulls at 10, ends at 12."""
    decays = []
    update = train_cifar.Lookahead.update
    monkeypatch.setattr(train_cifar.Lookahead, "update", lambda self, d: (decays.append(d), update(self, d))[1])
    train_cifar.train("fast95", data=tiny, epochs=3, **TINY_FAST)
    assert decays == pytest.approx([0.95 ** 5 * (10 / 12) ** 3, 1.0], rel=1e-12)


def test_lookahead_starts_after_its_start_epoch(monkeypatch, tiny):
    """lookahead_start_epoch 1: the average is taken from epoch 2 on. 3 epochs of 4 steps, every 3 steps: it
    starts at step 6 (not 3, in epoch 1), pulls at 9 and 12, and is copied in whole at the end."""
    decays = []
    update = train_cifar.Lookahead.update
    monkeypatch.setattr(train_cifar.Lookahead, "update", lambda self, d: (decays.append(d), update(self, d))[1])
    train_cifar.train("fast95", data=tiny, epochs=3, lookahead_start_epoch=1, lookahead_every=3, **TINY_FAST)
    assert decays == pytest.approx([0.95 ** 3 * (9 / 12) ** 3, 0.95 ** 3, 1.0], rel=1e-12)


def test_the_final_evaluation_sees_the_weight_ema(monkeypatch, tiny):
    """The weights evaluated at the end are the EMA of the weights after every ema_every-th step, computed here
    in float64 from the weights after each step (8 steps, every 3: pulls after steps 3 and 6)."""
    after_steps, evaluated = [], []
    step = train_cifar.train_step

    def recording(cfg, step_fn, opt, *args, **kwargs):
        if not after_steps:
            after_steps.append({n: p.detach().double().clone() for n, p in step_fn.named_parameters()})
        out = step(cfg, step_fn, opt, *args, **kwargs)
        after_steps.append({n: p.detach().double().clone() for n, p in step_fn.named_parameters()})
        return out
    monkeypatch.setattr(train_cifar, "train_step", recording)
    evaluate = train_cifar.evaluate

    def seen(model, *args, **kwargs):
        evaluated.append({n: p.detach().double().clone() for n, p in model.named_parameters()})
        return evaluate(model, *args, **kwargs)
    monkeypatch.setattr(train_cifar, "evaluate", seen)
    decay, every = 0.6, 3
    train_cifar.train("fast94-sgd", data=tiny, epochs=2, ema_every=every, ema_decay=decay, eval_every=0,
                      lookahead_start_epoch=-1, **TINY_FAST)
    assert len(after_steps) == 1 + 8 and len(evaluated) == 1
    avg = dict(after_steps[0])  # from the initial weights
    for k in (3, 6):
        avg = {n: a + (1 - decay ** every) * (after_steps[k][n] - a) for n, a in avg.items()}
    for n, a in avg.items():
        torch.testing.assert_close(evaluated[0][n], a, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(after_steps[-1][n], a) for n, a in avg.items())  # (not the trained weights)


def test_the_whitening_is_fitted_to_the_images_not_their_padding():
    """The stored training images are padded for the random crops; the whitening is fitted inside the padding:
    what the padding holds changes nothing."""
    cfg = train_cifar.make_config("fast94", widths=(8, 16, 16))
    p = cfg["pad"]
    images = torch.rand(300, 32, 32, 3, generator=torch.Generator().manual_seed(0))
    weights = []
    for fill in (0.0, 5.0):
        padded = torch.nn.functional.pad(images.permute(0, 3, 1, 2), (p, p, p, p), value=fill).permute(0, 2, 3, 1)
        model = train_cifar.build_model(cfg, torch.device("cpu"), padded, torch.Generator().manual_seed(1))
        weights.append(model.whiten.weight.detach().clone())
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=0)


def test_only_the_final_evaluation_counts_in_a_runs_time(monkeypatch, tiny):
    """Per-epoch evaluations fill the table and are not the run's time; the final one (with its TTA) is. The
    clock jumps 1000 s in every evaluation: three epochs evaluated, one jump counted."""
    jump, jumped = jumping_clock(monkeypatch)
    evaluate = train_cifar.evaluate
    monkeypatch.setattr(train_cifar, "evaluate", lambda *a, **k: (jump(), evaluate(*a, **k))[1])
    run = train_cifar.train("fast94", data=tiny, epochs=3, eval_every=1, **TINY_FAST)["runs"][0]
    assert jumped[0] == 3000.0 and 1000 <= run["total_time_s"] < 2000
    assert [r["total_time"] < 1000 for r in run["epochs"]] == [True, True, False]


def test_a_holdout_is_evaluated_on_the_held_out_training_images(monkeypatch, tiny):
    labels = []
    evaluate = train_cifar.evaluate
    monkeypatch.setattr(train_cifar, "evaluate", lambda model, data, *a, **k: (
        labels.append(data["test_y"].cpu().numpy()), evaluate(model, data, *a, **k))[1])
    train_cifar.train("fast94", data=tiny, epochs=1, holdout=40, **TINY_FAST)
    held = np.random.default_rng(0).permutation(200)[:40]
    assert labels and all(np.array_equal(got, tiny["train_y"][held]) for got in labels)


def test_the_training_loss_is_label_smoothed_cross_entropy():
    """Against the formula in float64: (1 - e) x -log p(label) + e x mean over classes of -log p."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    for e in (0.0, 0.2):
        cfg = dict(train_cifar.make_config("fast94"), label_smoothing=e)
        _, loss = train_cifar.forward_loss(cfg, model, x, y, "fp32", torch.device("cpu"))
        logp = torch.log_softmax(model(x).double(), 1)
        want = ((1 - e) * -logp[torch.arange(16), y] + e * -logp.mean(1)).mean()
        assert loss.item() == pytest.approx(want.item(), rel=1e-6)


def test_the_lars_option_builds_lars(tiny):
    """--optimizer lars with the run's trust coefficient (not LARS's default), momentum and decay: a filter's first
    step against LARS's formula in float64, lr x trust x ||w|| / (||g|| + wd ||w||) x (g + wd w), times
    (1 + momentum) for Nesterov's look-ahead (the first velocity is the step itself)."""
    cfg = train_cifar.make_config("fast94-sgd", optimizer="lars", trust_coefficient=0.02, widths=(8, 16, 16))
    import parallel
    model = train_cifar.build_model(cfg, torch.device("cpu"))
    opt = train_cifar.make_optimizer(cfg, model)
    assert isinstance(opt, parallel.LARS)
    train_cifar.set_lr(opt, 0.1)
    gen = torch.Generator().manual_seed(0)
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.randn(p.shape, generator=gen)
    name, w = next((n, p) for n, p in model.named_parameters() if p.requires_grad and p.ndim == 4)
    w0, g = w.detach().double().clone(), w.grad.double()
    opt.step()
    wd, m = cfg["weight_decay"], cfg["momentum"]
    step = 0.1 * 0.02 * w0.norm() / (g.norm() + wd * w0.norm()) * (g + wd * w0)
    expected = w0 - ((1 + m) * step if cfg["nesterov"] and m > 0 else step)
    torch.testing.assert_close(w.detach().double(), expected, rtol=1e-5, atol=1e-7, msg=name)


def test_the_summary_pools_finished_runs_and_counts_those_that_reached_the_target():
    """A diverged run (or one without a result) is not pooled; time to target is averaged over the runs that
    reached it; the printed lines say the same numbers (statistics module as the reference) and each seed's."""
    import statistics
    cfg = train_cifar.make_config("fast94")

    def run(seed, acc, reached, total, ttt):
        return dict(seed=seed, accuracy=acc, epoch_reached_target=reached, total_time_s=total, time_to_target_s=ttt,
                    stopped_after_epoch=None)
    results = [run(0, 0.9412, 10, 400.0, 390.0), run(1, 0.9391, None, 410.0, None), run(2, 0.9430, 9, 420.0, 380.0),
               dict(run(3, None, None, None, None), diverged=True), run(4, None, None, None, None)]
    s = train_cifar.summarise(cfg, results, "cpu", "bf16", 1e12, 250, 2.65e14, "abc")
    assert s["runs_finished"] == 3 and s["runs_reaching_target"] == 2
    assert s["accuracy_mean"] == pytest.approx(statistics.mean([0.9412, 0.9391, 0.9430]))
    assert s["accuracy_std"] == pytest.approx(statistics.stdev([0.9412, 0.9391, 0.9430]))
    assert s["total_time_mean_s"] == pytest.approx(410.0) and s["time_to_target_mean_s"] == pytest.approx(385.0)
    said = []
    train_cifar.print_summary(s, log=said.append)
    assert "accuracy 94.11 ± 0.20% over 3 runs; 2/3 reached 94.0%" in said[0]
    assert said[1] == "per seed: 0: 94.12%, 1: 93.91%, 2: 94.30%, 3: diverged, 4: no result"
    assert said[2].startswith("time: 410.0 ± 10.0 s per run, to target 385.0 s; training FLOPs 0.265 PF per run")


def test_the_summary_of_one_run_or_a_run_cut_short_states_what_it_has():
    """One run has no spread to state ("± 0.00" read as a measured zero); a run stopped by --stop-after-epochs
    states the FLOPs it trained, not the schedule's; a small run's FLOPs are not "0.000 PF"."""
    cfg = train_cifar.make_config("fast94", stop_after_epochs=2)
    run = dict(seed=0, accuracy=0.6989, epoch_reached_target=None, total_time_s=247.2, time_to_target_s=None,
               stopped_after_epoch=2, train_flops=5.3e13)
    s = train_cifar.summarise(cfg, [run], "cpu", "bf16", 1e12, 250, 2.65e14, "abc")
    said = []
    train_cifar.print_summary(s, log=said.append)
    assert "accuracy 69.89% over 1 run; 0/1 reached 94.0%" in said[0]
    assert "stopped after epoch 2 of 10" in said[1]
    assert said[2].startswith("time: 247.2 s per run; training FLOPs 0.053 PF per run trained (the full schedule: "
                              "0.265 PF)")
    assert [core.format_flops(f) for f in (2.65e14, 3.1e15, 1.2e13, 9e12, 5.5e11, 0)] == \
        ["0.265 PF", "3.100 PF", "0.012 PF", "9.00 TF", "550 GF", "0 GF"]


def test_a_finished_or_refused_checkpoint_writes_no_log(tmp_path):
    """Running a finished run's command again reprints its result but writes no second log (compare_runs
    counted the one run twice, with a spread of zero); a checkpoint refused before training leaves no empty log."""
    data, ckpt, logs = synthetic(200, 50), str(tmp_path / "run.pt"), tmp_path / "logs"
    quiet = dict(data=data, log=lambda *a: None, checkpoint=ckpt, log_dir=str(logs), **TINY)
    first = train_cifar.train("resnet9", **quiet)
    assert sorted(p.suffix for p in logs.iterdir()) == [".json", ".tsv"]
    said = []
    again = train_cifar.train("resnet9", **dict(quiet, log=said.append))
    assert again["runs"][0]["accuracy"] == first["runs"][0]["accuracy"] and again["log_json"] is None
    assert any("holds this run's result already: nothing trained" in line for line in said)
    assert "(no new log: the run's own log has it)" in said
    assert len(list(logs.iterdir())) == 2
    with pytest.raises(ValueError, match="another configuration"):
        train_cifar.train("resnet9", **dict(quiet, epochs=3))
    assert len(list(logs.iterdir())) == 2
    assert json.load(open(first["log_json"]))["runs"][0]["accuracy"] == first["runs"][0]["accuracy"]
    assert len(core.read_tsv(first["log_json"][:-5] + ".tsv")) == 2  # the first invocation's log, intact


def test_a_replayed_cut_short_checkpoint_states_the_flops_it_trained(tmp_path):
    ckpt = str(tmp_path / "run.pt")
    quiet = dict(data=synthetic(200, 50), log=lambda *a: None, checkpoint=ckpt, log_dir=None,
                 **dict(TINY, epochs=3, stop_after_epochs=1))
    first, again = train_cifar.train("resnet9", **quiet), train_cifar.train("resnet9", **quiet)
    assert again["runs"][0]["train_flops"] == first["runs"][0]["train_flops"] < first["train_flops_per_run"] / 2


def test_an_interrupted_first_run_keeps_its_rows_and_an_earlier_interrupt_leaves_nothing(tmp_path):
    """Ctrl-C after the first epoch's row: the TSV keeps it and the JSON (no run finished) says what ran; before
    any row, no files (nothing was measured)."""
    class Stop(KeyboardInterrupt):
        pass

    def stop_after(rows):
        seen = []

        def log(line):
            seen.append(line)
            if sum(line.lstrip().startswith("0 ") for line in seen) > rows:  # the table's rows of run 0
                raise Stop
        return log
    for rows, files in ((1, [".json", ".tsv"]), (0, [])):
        logs = tmp_path / f"after{rows}"
        with pytest.raises(Stop):
            train_cifar.train("resnet9", data=synthetic(200, 50), log=stop_after(rows), log_dir=str(logs),
                              **dict(TINY, epochs=3))
        assert sorted(p.suffix for p in logs.iterdir()) == files
        if files:
            saved = json.load(open(next(logs.glob("*.json"))))
            assert saved["runs"] == [] and len(core.read_tsv(str(next(logs.glob("*.tsv"))))) == 1


def test_two_runs_started_in_the_same_second_get_logs_of_their_own(tmp_path, monkeypatch):
    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2026, 12, 5, 8, 0, 0)
    monkeypatch.setattr(train_cifar.datetime, "datetime", Frozen)
    quiet = dict(data=synthetic(200, 50), log=lambda *a: None, log_dir=str(tmp_path), **dict(TINY, epochs=1))
    a, b = train_cifar.train("resnet9", **quiet), train_cifar.train("resnet9", **dict(quiet, seed=1))
    assert a["log_json"] != b["log_json"] and len(list(tmp_path.iterdir())) == 4
    assert json.load(open(a["log_json"]))["runs"][0]["seed"] == 0
    assert len(core.read_tsv(a["log_json"][:-5] + ".tsv")) == 1


def test_a_log_says_when_its_invocation_started_and_when_it_was_last_written(tmp_path, monkeypatch):
    """`started` was stamped each time the JSON was rewritten, so every log's `started` was when it ended (a
    fast96 seed's 18:54 for a run begun at 18:20). The clock below ticks a second per reading; the JSON rewritten
    after each of two runs must keep the first reading as `started` and take a later one as `written`."""
    ticks = itertools.count()
    monkeypatch.setattr(core, "utc_timestamp", lambda: f"2026-12-07T18:20:{next(ticks):02d}+00:00")
    seen, real_write = [], core.write_json_atomic

    def write(path, obj):  # a copy of each JSON as written (a later run adds to the same lists)
        seen.append(copy.deepcopy(obj))
        real_write(path, obj)
    monkeypatch.setattr(core, "write_json_atomic", write)
    out = train_cifar.train("resnet9", data=synthetic(200, 50), log=lambda *a: None, log_dir=str(tmp_path),
                            **dict(TINY, epochs=1, runs=2))
    summaries = [s for s in seen if "runs" in s]
    assert len(summaries) >= 2 and [len(s["runs"]) for s in summaries][:2] == [1, 2]
    first = summaries[0]["started"]
    assert all(s["started"] == first for s in summaries)
    assert all(s["written"] > first for s in summaries) and summaries[-1]["written"] > summaries[0]["written"]
    saved = json.load(open(out["log_json"]))
    assert saved["started"] == first and saved["written"] == summaries[-1]["written"]


def test_an_evaluation_shows_progress_per_batch_of_test_images():
    """The final evaluation with TTA can take minutes on a CPU after the last epoch's line: a progress line
    counts its batches (and is cleared before the table's row)."""
    cfg = train_cifar.make_config("fast94", widths=(8, 16, 16), precision="fp32")
    dev = torch.device("cpu")
    data = tb.to_device(tb.validate(synthetic(100, 2100), "tiny"), dev, torch.float32, pad=cfg["pad"])
    model = train_cifar.build_model(cfg, dev, data["train_x"])
    out = io.StringIO()
    progress = core.Progress(out, every_s=0.0)
    acc = train_cifar.evaluate(model, data, "fp32", dev, 2, progress=progress, label="run 0 epoch 10 final evaluation")
    assert acc == train_cifar.evaluate(model, data, "fp32", dev, 2)
    shown = re.findall(r"run 0 epoch 10 final evaluation: (\d)/3 ", out.getvalue())
    assert shown == ["1", "2", "3"] and out.getvalue().endswith("\r")  # 2,100 images in batches of 1,000; cleared


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_an_interrupted_run_says_what_it_kept_without_a_traceback(tiny_npz, tmp_path, signum):
    """Ctrl-C printed a traceback from deep inside torch; kill (SIGTERM) stopped the process where it stood. Both
    now stop as asked: one line naming the log that holds the finished run (SIGINT: in run 1 of 2) or the
    checkpoint that resumes the run in flight (SIGTERM: a --checkpoint run), exit 130 or 143."""
    import signal
    ckpt = tmp_path / "run.pt"
    runs = ["--runs", "2"] if signum == "SIGINT" else ["--runs", "1", "--checkpoint", str(ckpt)]
    proc = subprocess.Popen([sys.executable, "-u", os.path.join(ROOT, "train_cifar.py"), "--data", tiny_npz,
                             "--log-dir", str(tmp_path), "--widths", "8", "8", "8", "--batch-size", "50", "--tta", "0",
                             "--epochs", "20", *runs, "--precision", "fp32", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # (as in a terminal)
    wait_for = ["1", "1"] if signum == "SIGINT" else ["0", "2"]  # run 1's first row; run 0's second (checkpointed)
    for line in proc.stdout:
        if line.split()[:2] == wait_for:
            break
    proc.send_signal(getattr(signal, signum))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == (130 if signum == "SIGINT" else 143), err
    assert "Traceback" not in err and err.strip() == "train_cifar.py: interrupted"
    (log,) = tmp_path.glob("*.json")
    tsv = log.with_suffix(".tsv")
    if signum == "SIGINT":
        assert (f"interrupted: run 1 in flight is lost; 1 finished run(s) are in {log}, every epoch's row in "
                f"{tsv}") in out
        assert len(json.loads(log.read_text())["runs"]) == 1
    else:  # nothing finished: no "0 finished run(s)", but where the rows are and how to go on
        assert (f"interrupted: run 0 stopped; every epoch's row in {tsv}; the same command resumes it from {ckpt}'s "
                "last epoch") in out
        assert json.loads(log.read_text())["runs"] == [] and ckpt.exists()


# --- What a second mutation audit of train_cifar.py found unpinned: each of these could be broken without any
# test failing.

def recorded_batches(monkeypatch):
    """The number of examples of every training step, as train_step received them."""
    sizes, step = [], train_cifar.train_step

    def recording(cfg, step_fn, opt, x, y, *args, **kwargs):
        sizes.append(len(y))
        return step(cfg, step_fn, opt, x, y, *args, **kwargs)
    monkeypatch.setattr(train_cifar, "train_step", recording)
    return sizes


def test_an_epoch_is_its_whole_batches_and_fractional_epochs_round_the_steps_up(monkeypatch):
    """230 images at batch 50: 4 whole batches an epoch, the pass's last 30 images dropped (BatchStream); 2.3
    epochs are ceil(2.3 x 4) = 10 steps (as airbench), the third epoch's 2 of them ending the run with its final
    evaluation. Fresh examples read: 200 a pass."""
    sizes = recorded_batches(monkeypatch)
    run = train_cifar.train("fast94", data=synthetic(230, 50), epochs=2.3, **TINY_FAST)["runs"][0]
    assert sizes == [50] * math.ceil(2.3 * (230 // 50))
    assert [(r["epoch"], r["fresh"]) for r in run["epochs"]] == [(1, 200), (2, 400), (3, 500)]
    assert run["accuracy"] is not None and run["accuracy"] == run["epochs"][-1]["test_acc"]


def evaluations_jumping_the_clock(monkeypatch, accuracies, confidences=None):
    """evaluate replaced: each call moves the clock 1000 s and returns the next of accuracies (then 0.0); the
    tta of each call is recorded in the returned list, its tta_confidence in confidences if given."""
    jump, _ = jumping_clock(monkeypatch)
    calls, accs = [], iter(accuracies)

    def evaluate(model, data, precision, device, tta, rank=0, world=1, tta_confidence=0.0, *args, **kwargs):
        jump()
        calls.append(tta)
        if confidences is not None:
            confidences.append(tta_confidence)
        return next(accs, 0.0)
    monkeypatch.setattr(train_cifar, "evaluate", evaluate)
    return calls


def test_time_to_target_is_the_timed_clock_where_it_was_reached(monkeypatch, tiny):
    """Each evaluation takes 1000 s on the clock. Reached at the final epoch, the time to target is the run's
    time, its final evaluation included; reached at a step evaluation, the time there, untimed evaluations
    excluded. The step evaluations are never part of a run's time (only the final one is)."""
    evaluations_jumping_the_clock(monkeypatch, [0.0, 0.0, 0.6])
    run = train_cifar.train("fast94", data=tiny, epochs=3, target=0.5, **TINY_FAST)["runs"][0]
    assert run["epoch_reached_target"] == 3 and 1000 <= run["total_time_s"] < 2000
    assert run["time_to_target_s"] == run["total_time_s"] == run["epochs"][-1]["total_time"]
    # 4 steps an epoch, evaluated every 2: evaluations at steps 2, 4 (then epoch 1), 6, 8 (epoch 2), 10, 12 (final)
    calls = evaluations_jumping_the_clock(monkeypatch, [0.0, 0.6])
    run = train_cifar.train("fast94", data=tiny, epochs=3, target=0.5, eval_every_steps=2, eval_every=0,
                            **TINY_FAST)["runs"][0]
    assert len(calls) == 7 and run["step_reached_target"] == 4
    assert run["time_to_target_s"] < 1000 and 1000 <= run["total_time_s"] < 2000
    assert run["time_to_target_s"] == run["evals"][1]["time"]
    # reached at step 4 and again at epoch 1's end: the epoch is noted, the time and examples stay step 4's
    evaluations_jumping_the_clock(monkeypatch, [0.0, 0.6, 0.6])
    run = train_cifar.train("fast94", data=tiny, epochs=3, target=0.5, eval_every_steps=2, eval_every=1,
                            **TINY_FAST)["runs"][0]
    assert (run["step_reached_target"], run["epoch_reached_target"]) == (4, 1)
    assert run["time_to_target_s"] == run["evals"][1]["time"] < run["epochs"][0]["total_time"]
    assert run["fresh_to_target"] == run["evals"][1]["fresh"] == 4 * 50


def test_epoch_time_is_the_epochs_training_alone(monkeypatch, tiny):
    """Each evaluation takes 1000 s: an epoch's time excludes its evaluation (the untimed ones and the final
    one), and the run's time is the epochs' times plus the final evaluation."""
    evaluations_jumping_the_clock(monkeypatch, [0.25, 0.5, 0.75])
    rows = train_cifar.train("fast94", data=tiny, epochs=3, **TINY_FAST)["runs"][0]["epochs"]
    assert all(r["epoch_time"] < 1000 for r in rows)
    assert [r["epoch_time"] for r in rows[1:-1]] == pytest.approx(
        [b["total_time"] - a["total_time"] for a, b in zip(rows, rows[1:-1])], abs=1e-9)
    assert 1000 <= rows[-1]["total_time"] - sum(r["epoch_time"] for r in rows) < 1001


def test_eval_every_evaluates_every_nth_epoch_without_tta_and_the_last_with_it(monkeypatch, tiny):
    """eval_every 2 over 5 epochs: plain evaluations after epochs 2 and 4, the final one (with TTA, as selective as
    the run asks) after 5."""
    confidences = []
    calls = evaluations_jumping_the_clock(monkeypatch, [0.25, 0.5, 0.75], confidences)
    run = train_cifar.train("fast94", data=tiny, epochs=5, eval_every=2,
                            **dict(TINY_FAST, tta=2, tta_confidence=0.7))["runs"][0]
    assert calls == [0, 0, 2] and confidences[-1] == 0.7  # the final one: TTA for the images below p = 0.7
    assert [None if math.isnan(r["test_acc"]) else r["test_acc"] for r in run["epochs"]] == \
        [None, 0.25, None, 0.5, 0.75]


def test_stop_at_target_ends_the_run_at_the_epoch_that_reached_it(monkeypatch, tiny):
    """Without step evaluations the epoch ends judge it: the run ends after the first epoch at the target,
    with that evaluation's accuracy as its result."""
    evaluations_jumping_the_clock(monkeypatch, [0.25, 0.5, 0.75])
    run = train_cifar.train("fast94", data=tiny, epochs=4, target=0.5, stop_at_target=True, **TINY_FAST)["runs"][0]
    assert [r["epoch"] for r in run["epochs"]] == [1, 2]
    assert (run["epoch_reached_target"], run["accuracy"]) == (2, 0.5)
    assert run["steps_trained"] == 2 * 200 // 50  # two epochs of four steps: its FLOPs count those


def test_run_r_is_the_run_of_seed_plus_r(tiny):
    """Run 1 of --seed 5 --runs 2 is what --seed 6 trains alone (init, data order and augmentation), and says so."""
    both = train_cifar.train("fast94", data=tiny, epochs=1, seed=5, runs=2, **TINY_FAST)["runs"]
    alone = train_cifar.train("fast94", data=tiny, epochs=1, seed=6, **TINY_FAST)["runs"][0]
    assert [r["seed"] for r in both] == [5, 6]
    assert both[1]["epochs"][0]["train_loss"] == alone["epochs"][0]["train_loss"]
    assert both[1]["accuracy"] == alone["accuracy"]
    assert both[0]["epochs"][0]["train_loss"] != alone["epochs"][0]["train_loss"]


def test_a_holdout_is_one_fixed_split_disjoint_from_the_images_trained_on(monkeypatch, tiny):
    """The held-out images and those trained on partition the training set, and the split is the same for every
    seed (the data as train() hands them to the device, compared as sets of images)."""
    handed = []
    to_device = tb.to_device
    monkeypatch.setattr(tb, "to_device", lambda data, *a, **k: (handed.append(data), to_device(data, *a, **k))[1])
    for seed in (0, 3):
        train_cifar.train("fast94", data=tiny, epochs=1, holdout=40, seed=seed, **TINY_FAST)

    def images(x):
        return {im.tobytes() for im in x}
    everything = images(tiny["train_x"])
    assert len(handed) == 2 and len(everything) == 200
    for data in handed:
        held, kept = images(data["test_x"]), images(data["train_x"])
        assert (len(held), len(kept), len(data["train_x"])) == (40, 160, 160)
        assert held | kept == everything and not held & kept
    assert images(handed[0]["test_x"]) == images(handed[1]["test_x"])


def test_an_epochs_train_loss_and_accuracy_are_over_its_training_examples(monkeypatch, tiny):
    """The table's train_loss and train_acc: the mean over the epoch's examples of each step's own loss and
    correctness (its forward pass, before the update), recomputed here from what train_step returned."""
    per_step, step = [], train_cifar.train_step

    def recording(cfg, step_fn, opt, x, y, *args, **kwargs):
        out, loss = step(cfg, step_fn, opt, x, y, *args, **kwargs)
        per_step.append((loss.item() * len(y), (out.argmax(1) == y).sum().item(), len(y)))
        return out, loss
    monkeypatch.setattr(train_cifar, "train_step", recording)
    run = train_cifar.train("fast94", data=tiny, epochs=2, **TINY_FAST)["runs"][0]
    assert len(per_step) == 8
    for row, steps in zip(run["epochs"], (per_step[:4], per_step[4:])):
        n = sum(k for _, _, k in steps)
        assert row["train_loss"] == pytest.approx(sum(s for s, _, _ in steps) / n, rel=1e-6)
        assert row["train_acc"] == pytest.approx(sum(c for _, c, _ in steps) / n, rel=1e-6)


def test_a_stopped_run_continues_without_its_final_evaluations_time(monkeypatch, tmp_path, tiny):
    """Each evaluation takes 1000 s on the clock. Stopped after epoch 1 of 2, the part's time counts its final
    evaluation; continued from its checkpoint, the whole run's counts only the run's own final evaluation."""
    evaluations_jumping_the_clock(monkeypatch, [])
    ckpt = str(tmp_path / "run.pt")
    part = train_cifar.train("fast94", data=tiny, epochs=2, eval_every=0, stop_after_epochs=1, checkpoint=ckpt,
                             **TINY_FAST)["runs"][0]
    assert part["stopped_after_epoch"] == 1 and part["total_time_s"] >= 1000
    whole = train_cifar.train("fast94", data=tiny, epochs=2, eval_every=0, checkpoint=ckpt, **TINY_FAST)["runs"][0]
    assert [r["epoch"] for r in whole["epochs"]] == [1, 2] and 1000 <= whole["total_time_s"] < 2000


def test_the_reproduction_report_states_the_rerun_minus_the_logged_accuracy():
    report = [dict(seed=3, epochs=2, first_difference=2, max_loss_difference=0.01, cut_short=False, accuracy=0.9512,
                   logged_accuracy=0.94)]
    assert train_cifar.describe_reproduction(report, "a.json") == [
        "seed 3: differs from the log from epoch 2 on (training loss by up to 0.01 over 2 epoch(s)); accuracy "
        "95.12% against 94.00% logged (+1.12 points)"]


def test_fractional_epochs_are_taken_on_the_command_line():
    """--epochs 2.5 (the presets' own are fractional too: fast94-sgd's 9.9); the preset's knots stretch to it."""
    preset, overrides, _ = train_cifar.run_options(train_cifar.parse_args(["--epochs", "2.5"])[1])
    assert overrides["epochs"] == 2.5
    assert train_cifar.make_config(preset, **overrides)["lr_knots"] == (0, 2.5)


def test_weights_made_nan_by_an_epochs_last_update_end_the_run_as_diverged(monkeypatch, tiny):
    """Its loss was computed before the update, so it is finite; the net is not (with fp16's fixed loss scale an
    overflow does this). Not a run that ends at the run's last step with 10% accuracy, every prediction class 0."""
    make = train_cifar.make_optimizer

    def breaking_at_the_last_step(cfg, model):
        opt = make(cfg, model)
        step, steps = opt.step, [0]

        def step_then_break(*a, **k):
            out = step(*a, **k)
            steps[0] += 1
            if steps[0] == 4:  # the run's last step (one epoch: 200 images at batch 50)
                with torch.no_grad():
                    next(model.parameters()).fill_(math.nan)
            return out
        opt.step = step_then_break
        return opt
    monkeypatch.setattr(train_cifar, "make_optimizer", breaking_at_the_last_step)
    with pytest.raises(train_cifar.Diverged, match="weights or BN statistics are not finite at epoch 1"):
        train_cifar.train("fast94", data=tiny, epochs=1, **dict(TINY_FAST, optimizer="sgd"))


def test_an_infinite_training_loss_ends_the_run_as_diverged(monkeypatch, tiny):
    """Not only NaN: an epoch whose training loss is infinite (an overflow) is a diverged run too."""
    step = train_cifar.train_step
    monkeypatch.setattr(train_cifar, "train_step", lambda *a, **k: (lambda out, loss: (out, loss * math.inf))(
        *step(*a, **k)))
    with pytest.raises(train_cifar.Diverged, match="training loss is inf at epoch 1"):
        train_cifar.train("fast94", data=tiny, epochs=2, **TINY_FAST)


def test_colour_jitter_changes_the_training_and_none_is_the_default(tiny):
    """Plumbing: --color-jitter reaches the batches a run trains on (its loss differs), and 0 0 trains exactly as
    before the option existed."""
    def first_loss(**options):
        summary = train_cifar.train("fast94", data=tiny, epochs=1, lr_knots=(0, 1), **TINY_FAST, **options)
        return summary["runs"][0]["epochs"][0]["train_loss"]
    plain = first_loss()
    assert first_loss(color_jitter=(0.0, 0.0)) == plain
    assert first_loss(color_jitter=(0.5, 0.3)) != plain



def test_every_tuple_option_comes_from_the_command_line_as_a_tuple():
    """argparse gives lists; the configs hold tuples (as presets and --from-log have them). Converted for every
    such option, not for a list of names each new one had to join (--proxy-widths had not)."""
    given = dict(lr_knots=("0", "2"), lr_values=("1", "0"), widths=("8", "16", "16"), train_sizes=("24", "32"),
                 proxy_widths=("4", "8", "8"), color_jitter=("0.1", "0.1"), block_epochs=("8", "9"))
    configs = [train_cifar.COMMON, *train_cifar.PRESETS.values()]
    assert set(given) == {k for c in configs for k, v in c.items() if isinstance(v, tuple)}  # (a new one: add it)
    argv = ["--select-fraction", "0.5"] + [a for k, v in given.items() for a in ("--" + k.replace("_", "-"), *v)]
    _, overrides, _ = train_cifar.run_options(train_cifar.parse_args(argv)[1])
    assert {k: type(overrides[k]) for k in given} == {k: tuple for k in given}
    assert overrides["proxy_widths"] == (4, 8, 8) and overrides["color_jitter"] == (0.1, 0.1)
    assert overrides["block_epochs"] == (8, 9)
