"""Calibrate the batch-size study's cpu workload: best holdout accuracy and step reaching 0.65 for a few LRs."""
import sys, time
sys.path.insert(0, ".")
import train_cifar, torch_backend as tb
data = tb.load_cifar10("../shared/data/cifar10.npz")
base = dict(widths=(16, 32, 32), tta=0, lookahead_start_epoch=-1, holdout=5000, target=0.65, stop_at_target=False,
            eval_every=0, optimizer="sgd", nesterov=True, momentum=0.9, runs=1)
def trial(bs, lr, epochs, bias_scale=64.0):
    t = time.perf_counter()
    per = 45000 // bs
    s = train_cifar.train("fast94", data=data, log=lambda *a: None, log_dir=None, batch_size=bs, epochs=epochs,
                          lr_knots=(0, 0.1 * epochs, epochs), lr_values=(0, lr, lr * 0.05), bias_lr_scale=bias_scale,
                          eval_every_steps=max(1, int(per * epochs) // 16), **base)
    r = s["runs"][0]
    ev = [(e["step"], round(e["test_acc"], 3)) for e in r["evals"]]
    print(f"bs {bs} lr {lr} bias_scale {bias_scale} epochs {epochs}: reached at step {r['step_reached_target']}, "
          f"final {r['accuracy']}, evals {ev}, {time.perf_counter() - t:.0f} s", flush=True)
for lr in (0.1, 0.3, 1.0):
    trial(256, lr, 3)
trial(256, 0.3, 3, bias_scale=1.0)
for lr in (0.4, 1.2, 4.0):
    trial(2048, lr, 8)
