"""benchmarks/gpu_session.sh spends a GPU lease (minutes, drawn by chance) on commands no CPU session runs: each
command it would run, in every mode, must be one today's scripts accept. Checked through its DRY_RUN mode, with
the device taken as the CPU (the options are what is checked, not CUDA)."""
import os
import shlex
import subprocess
import sys

import pytest
import torch

import train_cifar
from conftest import ROOT

PLANNED_VARIANT = "--epochs 52 --train-sizes " + "24 " * 15 + "32"  # a fast96 screen for the next lease


def dry_run(tmp_path, mode, **env):
    listing = tmp_path / f"commands-{mode or 'main'}"
    environment = dict(os.environ, DRY_RUN=str(listing), OUT=str(tmp_path), DATA=str(tmp_path / "c.npz"))
    environment.update(env)
    environment = {k: v for k, v in environment.items() if v is not None}  # None: unset
    r = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_session.sh"), *([mode] if mode else [])],
                       env=environment, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert os.listdir(tmp_path) == [listing.name], "a dry run writes nothing but its listing"
    return [shlex.split(line) for line in listing.read_text().splitlines()]


def without_env(words):
    """The command after `env VAR=value ...`."""
    if words[0] == "env":
        words = words[1:]
    while "=" in words[0] and not words[0].startswith("-"):
        words = words[1:]
    return words


def on_cpu(args):
    return ["cpu" if a == "cuda" and args[i - 1] == "--device" else a for i, a in enumerate(args)]


def check_train_cifar(args):
    """What train_cifar.main does with these options up to the run: parse, take a log's config, make the config."""
    _, a = train_cifar.parse_args(on_cpu(args))
    if a.from_log:  # (the session runs in the repository's root)
        a.from_log = os.path.join(ROOT, a.from_log)
    preset, overrides, _ = train_cifar.run_options(a)
    overrides.pop("data", None)
    cfg = train_cifar.make_config(preset, **overrides)
    assert all(cfg[k] == v for k, v in overrides.items()), "an option given did not reach the config"
    return cfg


@pytest.mark.parametrize("mode, env", [
    ("smoke", {}),
    ("", dict(N94_GRAPHS="20", REPRO="2", N96_FP16="5", EXTRAS="1")),
    ("screen", dict(VARIANTS="\n--precision fp16\n" + PLANNED_VARIANT, PRESET="fast96")),
])
def test_every_command_of_the_gpu_session_is_accepted(tmp_path, mode, env):
    commands = [without_env(words) for words in dry_run(tmp_path, mode, **env)]
    assert commands, "the dry run listed nothing"
    for words in commands:
        assert words[0] == "python", words
        if words[1] == "train_cifar.py":
            check_train_cifar(words[2:])
        elif words[1] == "benchmarks/bench_presets.py":  # its options and --set values, counting FLOPs only
            timing_only = ("--breakdown", "--profile")  # (refused with --flops-only)
            options = [w for w in on_cpu(words[2:]) if w not in timing_only]
            r = subprocess.run([sys.executable, *words[1:2], *options, "--flops-only", "--log-dir", ""],
                               cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr
        elif words[1:3] == ["-m", "pytest"]:
            assert all(os.path.exists(os.path.join(ROOT, w)) for w in words[3:] if w.endswith(".py"))
        else:
            pytest.fail(f"no check for {words}")


@pytest.mark.parametrize("mode", ["smoke", "", "screen"])
def test_a_dry_run_needs_no_out_or_data(tmp_path, mode):
    """It writes nothing there and reads no data, yet stopped at "set OUT ..." and then "set DATA ..."."""
    commands = dry_run(tmp_path, mode, OUT=None, DATA=None)
    assert commands and all("--data" not in words or "$DATA" in words or "/tmp/random-cifar.npz" in words
                            for words in commands)
    assert mode == "smoke" or any("$DATA" in words for words in commands)  # a placeholder where DATA goes


def test_the_planned_fast96_variant_stays_within_its_flops():
    """The screen planned for the next lease: 52 epochs, the first 15 at 24 px, its LR schedule stretched with
    them, within airbench96_faster's 3.1 PF (counted on the meta device, as bench_presets.py counts)."""
    cfg = check_train_cifar(["--preset", "fast96", *PLANNED_VARIANT.split()])
    assert cfg["lr_knots"] == (0, 5.2, 52)
    meta = torch.device("meta")
    model = train_cifar.build_model(dict(cfg, precision="fp32"), meta)
    per_run = train_cifar.run_flops(cfg, model, train_cifar.make_optimizer(cfg, model), meta, "fp32", 50000)[2]
    assert 3.0e15 < per_run <= 3.1e15


def test_a_run_count_of_0_skips_its_step(tmp_path):
    """N95=0 (and N94_GRAPHS, N96_FP16 and REPRO left at their 0) list no step for them: listed, each would spend
    the lease's minutes starting a process to train nothing. The counts given reach --runs."""
    commands = [without_env(words) for words in dry_run(tmp_path, "", N95="0", N94="3", N94_GRAPHS=None,
                                                            N96_FP16=None, REPRO=None, EXTRAS=None)]
    trains = [words for words in commands if words[1] == "train_cifar.py"]
    presets = [(words[words.index("--preset") + 1], words[words.index("--runs") + 1]) for words in trains]
    assert presets == [("fast94", "3"), ("fast96", "5"), ("resnet9-tricks", "5")], presets
    assert not any("--from-log" in words or "reduce-overhead" in words for words in trains)
