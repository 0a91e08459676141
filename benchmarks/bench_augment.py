"""Throughput of the batched on-device augmentation against a per-sample Python loop.

    python benchmarks/bench_augment.py [--data PATH] [--batch 512] [--repeats 5]

Both apply the same crop (pad 4), flip and 8x8 cutout to the same batches; prints images/s, mean ± std over
repeats, and writes the numbers to logs/bench_augment-*.json."""
import argparse
import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import core  # noqa: E402
import torch_backend as tb  # noqa: E402


def rate(fn, n_images, repeats, sync):
    fn()  # warm-up
    rates = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        rates.append(n_images / (time.perf_counter() - t))
    return core.mean_std(rates)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=os.environ.get("CIFAR10_DATA") or "./data",
                   help="CIFAR-10 .npz, tarball or folder (default: $CIFAR10_DATA or ./data)")
    p.add_argument("--batch", type=int, default=512, help="images per batch")
    p.add_argument("--batches", type=int, default=8, help="batches per timed repeat (batched version)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (mean ± std)")
    tb.add_device_option(p)
    p.add_argument("--log-dir", default="logs", type=core.folder_option, help="where the JSON result goes")
    a = p.parse_args()
    if min(a.batch, a.batches, a.repeats) < 1:
        p.error("--batch, --batches and --repeats must be at least 1")
    device = a.device or tb.default_device()
    try:
        data = tb.to_device(tb.load_cifar10(a.data), device, torch.float32, pad=4)
    except tb.DataError as e:  # (missing or corrupt: its message says where and what to pass)
        p.error(str(e))
    n = len(data["train_y"])
    if a.batch * a.batches > n:  # slices past the end are empty: img/s would count images never augmented
        p.error(f"--batch {a.batch} x --batches {a.batches} = {a.batch * a.batches} images a repeat, more than the "
                f"{n} training images in {a.data}")
    gen = torch.Generator(device=device).manual_seed(0)
    perm = torch.randperm(n, generator=gen, device=device)
    aug = tb.draw_augmentation(n, 4, 8, True, gen, device)
    sync = tb.synchronizer(device)

    def batched(batches):
        def go():
            for b in range(batches):
                sl = slice(b * a.batch, (b + 1) * a.batch)
                tb.augment(data["train_x"], perm[sl], {k: v[sl] for k, v in aug.items()}, cutout=8)
        return go

    def loop():
        sl = slice(0, a.batch)
        tb.augment_reference(data["train_x"], perm[sl], {k: v[sl] for k, v in aug.items()}, cutout=8)

    fast = rate(batched(a.batches), a.batches * a.batch, a.repeats, sync)
    slow = rate(loop, a.batch, a.repeats, sync)
    result = dict(hardware=tb.device_name(device), torch=torch.__version__, commit=core.git_commit(),
                  date=core.utc_timestamp(),
                  batch=a.batch, repeats=a.repeats, batched_img_per_s=fast, per_sample_img_per_s=slow,
                  speedup=fast[0] / slow[0])
    print(f"{result['hardware']}, torch {torch.__version__}, batch {a.batch}, crop pad 4 + flip + cutout 8")
    print(f"batched:    {fast[0]:12.0f} ± {fast[1]:.0f} images/s")
    print(f"per-sample: {slow[0]:12.0f} ± {slow[1]:.0f} images/s")
    print(f"speed-up:   {result['speedup']:12.1f}x")
    if a.log_dir:
        os.makedirs(a.log_dir, exist_ok=True)
        path = os.path.join(a.log_dir, f"bench_augment-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
        core.write_json_atomic(path, result)
        print(f"log: {path}")


if __name__ == "__main__":
    core.exit_with(main)
