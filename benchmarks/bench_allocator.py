"""Training throughput on the CPU under different memory allocators (glibc, glibc with huge pages, jemalloc,
tcmalloc), each in a fresh process of benchmarks/bench_presets.py.

    python benchmarks/bench_allocator.py [--presets fast94-sgd] [--set batch_size=2048] [--threads 1]

Why: PyTorch has no caching allocator on the CPU, so every step frees and re-allocates activations of tens to
hundreds of MB. glibc returns blocks that large to the kernel at once (mmap/munmap), and the next step pays a
page fault per 4 KiB page to get them back. An allocator that keeps freed memory (jemalloc, tcmalloc) skips
that. The allocator is chosen at process start (LD_PRELOAD), so each one runs in its own process.
Appends one JSON line per allocator and preset to logs/bench_allocator.jsonl.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import core  # noqa: E402
import torch_backend as tb  # noqa: E402
import train_cifar  # noqa: E402


INSTALL = {"jemalloc": "libjemalloc2", "tcmalloc": "libtcmalloc-minimal4"}  # Debian/Ubuntu packages


def allocators():
    """name -> extra environment, for the allocators present on this machine."""
    out = {"glibc": {}, "glibc-hugetlb": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}}
    jemalloc = tb.find_allocator_library("jemalloc")
    if jemalloc:
        out["jemalloc"] = {"LD_PRELOAD": jemalloc, "MALLOC_CONF": tb.JEMALLOC_CONF}
    tcmalloc = tb.find_allocator_library("tcmalloc_minimal") or tb.find_allocator_library("tcmalloc")
    if tcmalloc:
        out["tcmalloc"] = {"LD_PRELOAD": tcmalloc}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["fast94-sgd"], choices=list(train_cifar.PRESETS),  # (logged)
                   help="presets to time (default: fast94-sgd)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to bench_presets.py")
    p.add_argument("--steps", type=int, default=5, help="training steps per timed repeat")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per allocator (mean ± std)")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for every run (default: torch's)")
    p.add_argument("--allocators", nargs="+", default=None, help="default: every one found")
    p.add_argument("--out", default=os.path.join(ROOT, "logs", "bench_allocator.jsonl"),
                   help="JSONL file the results are appended to")
    a = p.parse_args()
    if min(a.steps, a.repeats) < 1 or (a.threads is not None and a.threads < 1):
        p.error("--steps, --repeats and --threads must be at least 1")
    try:  # before any allocator is timed: a measurement must not end on a file it cannot append to
        overrides = core.parse_overrides(a.set)  # (each child rejected a bad one with its usage, exit 1)
        for preset in a.presets:
            train_cifar.make_config(preset, **overrides)
        if a.out:
            core.writable_file(a.out, "--out")
    except ValueError as e:
        p.error(str(e))
    found = allocators()
    names = a.allocators or list(found)
    missing = [n for n in names if n not in found]
    if missing:
        p.error(f"allocator(s) not found on this machine: {', '.join(missing)} (found: {', '.join(found)}); "
                f"e.g. apt-get install {' '.join(INSTALL[n] for n in missing if n in INSTALL)}")
    skipped = [n for n in INSTALL if n not in found]
    if not a.allocators and skipped:  # said, so that a table without them is not read as all there is
        print(f"note: skipping {', '.join(skipped)}, not found on this machine; to time "
              f"{'them' if len(skipped) > 1 else 'it'}: apt-get install {' '.join(INSTALL[n] for n in skipped)}")
    date = core.utc_timestamp()
    table = core.Table(["allocator", "preset", "img/s", "±", "speed-up"], width=13)
    base = {}
    for name in names:
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF", "GLIBC_TUNABLES")}
        env.update(found[name])
        if a.threads:
            env["OMP_NUM_THREADS"] = str(a.threads)
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_presets.py"), "--presets", *a.presets,
                   "--steps", str(a.steps), "--repeats", str(a.repeats), "--log-dir", tmp]
            for s in a.set:
                cmd += ["--set", s]
            run = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if run.returncode != 0:
                sys.exit(f"bench_allocator: {name}: bench_presets.py failed:\n{run.stderr.strip()[-2000:]}")
            (log,) = glob.glob(os.path.join(tmp, "bench_presets-*.json"))
            with open(log) as f:
                result = json.load(f)
        for r in result["results"]:
            rate = r["img_per_s"]
            base.setdefault(r["preset"], rate[0])
            table.row({"allocator": name, "preset": r["preset"], "img/s": round(rate[0]), "±": round(rate[1]),
                       "speed-up": round(rate[0] / base[r["preset"]], 2)})
            rec = dict(date=date, allocator=name, env=dict(found[name]),
                       hardware=result["hardware"], torch=result["torch"], commit=result["commit"],
                       threads=result.get("threads"), steps=a.steps, repeats=a.repeats, preset=r["preset"],
                       overrides=r.get("overrides", {}), precision=r["precision"], batch_size=r["batch_size"],
                       img_per_s=rate)
            if a.out:
                os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
                core.append_jsonl(a.out, rec)
    if a.out:
        print(f"appended to {a.out}")


if __name__ == "__main__":
    core.exit_with(main)
