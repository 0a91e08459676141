"""What test-time augmentation gives and costs on trained nets: test accuracy and evaluation time without TTA,
with the mirror (2 views), with mirror and translate (6 views), and with the 6 views for unsure images only
(--tta-confidence c: images whose plain top softmax probability is below c), on the full test set.

    python train_cifar.py --seed 0 --checkpoint run0.pt ...     # a finished run's checkpoint holds its net
    python benchmarks/eval_tta.py run0.pt run1.pt [--confidences 0.5 0.7 0.9] [--repeats 3]

Each checkpoint's net is evaluated as its run evaluated it (the EMA weights where it kept one), and the accuracy
with the run's own TTA is checked against the one its run logged, before anything is timed. Times are mean ± std
over repeats, after a plain pass over the test set that also gives each image's confidence.

--view-sets also compares sets of views beyond the 6 (more one-pixel shifts, two-pixel shifts, other weights; see
VIEW_SETS), on every test image. Each distinct view's logits are computed once per net and each set's average is
formed from them, so a set's seconds are the sum of its views' forward passes. --precision fp32 evaluates nets
that their runs evaluated in bf16 in fp32 instead (test images too), to see what the lower precision costs at
test time alone: for the run's own evaluation it also counts the images right in one precision only, per net
and over all (with a sign test).
Writes logs/eval_tta-*.json."""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import core  # noqa: E402
import parallel  # noqa: E402
import torch_backend as tb  # noqa: E402
import train_cifar  # noqa: E402


def load_trained(path, device):
    """(cfg, precision its run evaluated in, net as its run evaluated it, seed, logged final accuracy,
    fingerprint of the data it ran on or None) from a finished run's checkpoint."""
    state = train_cifar.load_checkpoint(path, device)
    if state["result"]["accuracy"] is None or state["result"].get("stopped_after_epoch"):
        raise ValueError(f"{path} holds a run that has not finished (after epoch {state['epoch']})")
    cfg = state["cfg"]
    model = train_cifar.build_model(cfg, device)
    if cfg["bn_group_size"]:
        parallel.convert_bn(model, cfg["bn_group_size"])
    model.load_state_dict(state["model"])
    if state.get("ema") is not None:
        train_cifar.WeightAverage(model).load(state["ema"])
    return (cfg, train_cifar.evaluated_in(cfg, state["precision"]), model, state["seed"], state["result"]["accuracy"],
            state.get("data"))


def own_mode(cfg):
    """(tta level, tta_confidence) of the run's own final evaluation."""
    return cfg["tta"], (cfg.get("tta_confidence") or 0.0) if cfg["tta"] else 0.0


def check_own_accuracy(path, cfg, model, data, precision, device, logged, fingerprint):
    """Exits unless the run's own evaluation gives the accuracy its run logged, i.e. this is that net on that
    test set (kernels may round a few images differently, not more); before any timing, which takes minutes.
    Returns which images it gets right (for the comparison with another precision)."""
    right = train_cifar.right_per_image(model, data["test_x"], data["test_y"], precision, device, *own_mode(cfg))
    accuracy = right.sum().item() / len(right)
    if abs(accuracy - logged) <= 1e-3:
        return right
    confidence = own_mode(cfg)[1]
    name = ("plain", "mirror", "6 views")[cfg["tta"]] + (f" if p<{confidence:g}" if cfg["tta"] and confidence else "")
    if cfg.get("holdout"):
        why = f"its run evaluated {cfg['holdout']} images held out of the training set (holdout), not the test set"
    elif fingerprint:  # (main() has compared the test set with the run's)
        why = "the test set is the run's, so the net differs: another checkpoint, or another code version?"
    else:  # (checkpoints from before the data's fingerprint was saved)
        why = "other data than its run's (pass the --data it ran on), or another net or checkpoint?"
    sys.exit(f"error: {path}: {name} gives {accuracy:.4f} but its run logged {logged:.4f}: {why}")


DIAGONAL = [(1, 1), (-1, -1), (1, -1), (-1, 1)]
AXIS = [(1, 0), (-1, 0), (0, 1), (0, -1)]
# name -> (shifts, weight of the image and its mirror together); each shift adds a mirrored pair (tb.shifted_views).
# "diag": one pixel along both axes, "axis": along one; "eq": every view weighted the same.
VIEW_SETS = {
    "6v": ([(1, 1), (-1, -1)], 0.5),  # --tta 2: the reference every other set is compared with
    "6v equal": ([(1, 1), (-1, -1)], 1 / 3),
    "10v diag": (DIAGONAL, 0.5),
    "10v diag eq": (DIAGONAL, 0.2),
    "10v axis": (AXIS, 0.5),
    "10v diag 2px": ([(2 * dy, 2 * dx) for dy, dx in DIAGONAL], 0.5),
    "18v": (DIAGONAL + AXIS, 0.5),
    "18v equal": (DIAGONAL + AXIS, 1 / 9),
    "26v +2px": (DIAGONAL + AXIS + [(2 * dy, 2 * dx) for dy, dx in DIAGONAL], 0.5),
}


def view_set_accuracies(model, x, y, precision, device, sync, batch_size=1000):
    """{set name: (accuracy, seconds)} for every VIEW_SETS entry, each distinct view's logits computed once."""
    sets = {name: tb.view_weights(*spec) for name, spec in VIEW_SETS.items()}
    logits, seconds = {}, {}
    model.eval()
    with torch.no_grad():
        for view in dict.fromkeys(view for weights in sets.values() for view, _ in weights):  # each view once
            dy, dx, mirrored = view
            sync()
            t = time.perf_counter()
            out = []
            for i in range(0, len(x), batch_size):
                v = tb.shifted(x[i:i + batch_size], dy, dx)
                with tb.autocast(precision, device):
                    out.append(model(v.flip(3) if mirrored else v).float())
            logits[view] = torch.cat(out)
            sync()
            seconds[view] = time.perf_counter() - t
    model.train()
    result = {}
    for name, weights in sets.items():  # the same average predict would form over tb.shifted_views
        avg = sum(w * logits[view] for view, w in weights)
        result[name] = ((avg.argmax(1) == y).float().mean().item(), sum(seconds[view] for view, _ in weights))
    return result


def modes(confidences):
    """(name, tta level, tta_confidence) of every evaluation compared."""
    return ([("plain", 0, 0.0), ("mirror", 1, 0.0), ("6 views", 2, 0.0)]
            + [(f"6v if p<{c:g}", 2, c) for c in confidences])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoints", nargs="+", help="checkpoints of finished runs (train_cifar.py --checkpoint)")
    p.add_argument("--data", default=None, help="CIFAR-10 (default: $CIFAR10_DATA or ./data)")
    p.add_argument("--confidences", type=float, nargs="+", default=[0.5, 0.7, 0.9],
                   help="--tta-confidence values to measure (extra views only below this probability)")
    p.add_argument("--repeats", type=int, default=3, help="timed evaluations per mode (mean ± std)")
    p.add_argument("--view-sets", action="store_true", help="also compare the sets of views in VIEW_SETS")
    p.add_argument("--precision", choices=list(tb.DTYPES), default=None,
                   help="evaluate in this precision instead of the one each run evaluated in (its logged accuracy "
                        "is still checked in that one first)")
    tb.add_device_option(p)
    p.add_argument("--log-dir", default="logs", type=core.folder_option, help="where the JSON result goes")
    a = p.parse_args()
    if not all(0 < c <= 1 for c in a.confidences) or a.repeats < 1:
        p.error("confidences must be in (0, 1] and --repeats at least 1")
    missing = [c for c in a.checkpoints if not os.path.exists(c)]
    if missing:
        p.error(f"no such checkpoint: {', '.join(missing)}")
    device = a.device or tb.default_device()
    if a.precision:
        try:
            tb.resolve_precision(a.precision, device)
        except ValueError as e:  # (fp16 on a CPU)
            p.error(str(e))
    sync = tb.synchronizer(device)
    try:
        raw = tb.validate(dict(tb.load_cifar10(a.data or train_cifar.default_data_path())), "data")
    except tb.DataError as e:  # (missing or corrupt: its message says where and what to pass)
        p.error(str(e))
    datasets = {}  # by (precision, pad): the test set as each net's run fed it

    def data_for(precision, pad):
        if (precision, pad) not in datasets:
            datasets[precision, pad] = tb.to_device(raw, device, tb.DTYPES[precision], pad=pad)
        return datasets[precision, pad]
    nets = []  # every net read and checked before any is timed (minutes each on a CPU)
    for path in a.checkpoints:
        try:
            cfg, precision, model, seed, logged, fingerprint = load_trained(path, device)
        except ValueError as e:  # (its message names the file)
            p.error(str(e))
        except KeyError as e:
            p.error(f"{path}: a checkpoint without {e}, from an older train_cifar.py?")
        data = data_for(precision, cfg["pad"])
        here = train_cifar.data_fingerprint(data) if fingerprint else None  # (older checkpoints hold none)
        if here and not cfg.get("holdout") and any(here[k] != fingerprint[k] for k in ("test_x", "test_y")):
            p.error(f"{path}: this test set is not the one its run evaluated: pass the --data it ran on")
        right_own = check_own_accuracy(path, cfg, model, data, precision, device, logged, fingerprint)
        print(f"checked {path}: its net gives the {100 * logged:.2f}% its run logged", flush=True)
        nets.append((path, cfg, precision, model, seed, right_own))
    table = core.Table(["seed", "mode", "accuracy", "tta_share", "seconds", "±"], width=12)
    results = []
    info = dict(hardware=tb.device_name(device), torch=torch.__version__, commit=core.git_commit(),
                date=core.utc_timestamp(), repeats=a.repeats, precision=a.precision, results=results)
    log_path = core.stamped_log_path(a.log_dir, "eval_tta", info["date"]) if a.log_dir else None
    if log_path:
        print(f"log: {log_path} (written after every net)")
    for path, cfg, own, model, seed, right_own in nets:
        precision = a.precision or own
        if precision != own:
            print(f"{path}: its run evaluated in {own}, here in {precision}", flush=True)
        data = data_for(precision, cfg["pad"])
        plain = tb.predict(model, data["test_x"], precision, device)
        top = plain.softmax(1).amax(1)
        for name, level, confidence in modes(a.confidences):
            seconds, right = [], None  # the plain pass above was the warm-up
            for _ in range(a.repeats):
                sync()
                t = time.perf_counter()
                right = train_cifar.right_per_image(model, data["test_x"], data["test_y"], precision, device, level,
                                                    confidence)
                sync()
                seconds.append(time.perf_counter() - t)
            share = (top < confidence).float().mean().item() if confidence else float(level > 0)
            row = dict(checkpoint=os.path.basename(path), seed=seed, mode=name, tta=level, tta_confidence=confidence,
                       precision=precision, accuracy=right.sum().item() / len(right), tta_share=share,
                       seconds=core.mean_std(seconds))
            if precision != own and (level, confidence) == own_mode(cfg):  # the run's own evaluation, image by image
                here, there = int((right & ~right_own).sum()), int((right_own & ~right).sum())
                row["against_own"] = dict(precision=own, right_only_here=here, right_only_there=there)
            table.row(dict(row, seconds=row["seconds"][0], **{"±": row["seconds"][1] if a.repeats > 1 else "-"}))
            results.append(row)
        if a.view_sets:
            sets = view_set_accuracies(model, data["test_x"], data["test_y"], precision, device, sync)
            reference = next(r["accuracy"] for r in results if r["checkpoint"] == os.path.basename(path)
                             and r["mode"] == "6 views")
            if abs(sets["6v"][0] - reference) > 1e-3:  # the cached views must average as predict does
                sys.exit(f"error: {path}: the view set 6v gives {sets['6v'][0]:.4f}, "
                         f"predict {reference:.4f}")
            for name, (accuracy, seconds) in sets.items():
                shifts, centre_weight = VIEW_SETS[name]
                row = dict(checkpoint=os.path.basename(path), seed=seed, mode=name, view_set=True, precision=precision,
                           views=len(tb.view_weights(shifts, centre_weight)), shifts=shifts,
                           centre_weight=centre_weight, accuracy=accuracy, tta_share=1.0, seconds=(seconds, 0.0))
                table.row(dict(row, seconds=seconds, **{"±": "-"}))  # (timed once)
                results.append(row)
        if log_path:  # after every net, so the nets done so far survive a crash or a stop
            core.write_json_atomic(log_path, info)
    compared = [r for r in results if "against_own" in r]  # nets in another precision than their runs'
    for row in compared:
        versus = row["against_own"]
        print(f"{row['checkpoint']}, {row['mode']} (its run's evaluation): test images right only in "
              f"{row['precision']}: {versus['right_only_here']}, only in {versus['precision']}: "
              f"{versus['right_only_there']}")
    if len(compared) > 1:
        here, there = (sum(r["against_own"][k] for r in compared) for k in ("right_only_here", "right_only_there"))
        info["against_own"] = dict(nets=len(compared), right_only_here=here, right_only_there=there,
                                   sign_test_p=core.sign_test(here, there))
        print(f"over the {len(compared)} nets: test images right only in {a.precision}: {here}, only in their "
              f"runs' precision: {there} (sign test p = {info['against_own']['sign_test_p']:.2g})")
        if log_path:
            core.write_json_atomic(log_path, info)
    if a.view_sets and len(a.checkpoints) > 1:  # per net against the 6 views: mean and standard error
        print("\nview set       views  mean acc  per net against 6v (mean ± s.e., points)")
        def accuracies(name):
            return torch.tensor([r["accuracy"] for r in results if r.get("view_set") and r["mode"] == name],
                                dtype=torch.float64)
        for name in VIEW_SETS:
            acc = accuracies(name)
            d = 100 * (acc - accuracies("6v"))
            print(f"{name:14s} {len(tb.view_weights(*VIEW_SETS[name])):5d}  {100 * acc.mean():7.3f}%  "
                  f"{d.mean():+.3f} ± {d.std() / len(d) ** 0.5:.3f}")


if __name__ == "__main__":
    core.exit_with(main)
