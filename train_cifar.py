"""Train a network on CIFAR-10 as fast as possible and time it the way the field does.

    python train_cifar.py                              # the default record net (fast94), one run
    python train_cifar.py --preset resnet9 --runs 5    # Myrtle's DAWNBench ResNet-9, five seeds
    python train_cifar.py --preset resnet9 --epochs 30 --lr-values 0 0.3 0   # any hyper-parameter

The timer covers training (data already on the device) and the final evaluation; the per-epoch evaluations
that fill the table are excluded, as is the one-time warm-up. See README.md.
"""
import argparse
import contextlib
import datetime
import itertools
import math
import numbers
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import core
import parallel
import pipeline
import torch_backend as tb

# ---------------------------------------------------------------------------------------------------------------
# Presets. Each states where it comes from and what it should reach. lr is the peak of a piecewise-linear
# schedule (knots in epochs) for SGD on the batch-mean loss; weight_decay is PyTorch's L2 coefficient.

COMMON = dict(
    precision="auto", target=0.94, runs=1, seed=0, eval_every=1, momentum=0.9, nesterov=True,
    label_smoothing=0.0, bias_lr_scale=1.0, flip="random", pad=4, cutout=0, tta=0,
    # (brightness, contrast): each training image in each pass becomes (x + b) * c on its normalised pixels, b
    # drawn in [-brightness, brightness], c in [1 - contrast, 1 + contrast] (as the 2025 A100 record's loader)
    color_jitter=(0.0, 0.0),
    tta_confidence=0.0,  # > 0: the final evaluation's extra TTA views only for images predicted below it (tb.predict)
    # "same": the test images and the net evaluated in the run's precision; "fp32": both in fp32, without bf16's
    # rounding (fast96's 6 views on a 2-core Zen 5: 171 s, against 99 s in bf16: logs/eval_tta-2026-12-05T211546,
    # -212327). The presets keep "same": images right in one precision only, fp32 against bf16, 21 against 13 on
    # five fast96 nets (sign test p = 0.23), 28 against 22 on five fast94 nets (p = 0.48): no gain shown
    # (logs/eval_tta-2026-12-07T033732, -072819, -044035).
    eval_precision="same",
    whiten_bias_epochs=0, lookahead_start_epoch=-1, lookahead_every=5, lookahead_decay=0.95, lookahead_pow=3.0,
    lookahead_sync="epoch",  # copy the lookahead average into the net at every epoch end (airbench94) or the "end"
    # fp16 only. "batch": the loss times the batch size (rounded down to a power of two, so exact), the
    # gradients divided by it before the update, fixed: no read on the host per step (tb.FixedLossScale; airbench
    # and Myrtle sum the loss over the batch: nearly the same scale). "dynamic": torch.amp.GradScaler, which
    # skips steps that overflow but reads a flag on the host every step. Or a number: that fixed factor.
    loss_scale="batch",
    compile=False, widths=(),
    # torch.compile's mode for the net with --compile: "default", or "reduce-overhead" (CUDA graphs: the step's
    # kernels replayed in one launch) or "max-autotune-no-cudagraphs" (kernel choices timed while compiling);
    # "max-autotune" is both (tb.CUDA_GRAPH_COMPILE_MODES)
    compile_mode="default",
    # CUDA only: any host synchronisation inside the training steps is an error (torch.cuda.set_sync_debug_mode), the
    # check that the loop never waits on the GPU (the per-epoch totals and evaluations are outside it)
    sync_check=False,
    ema_every=0, ema_decay=0.99,  # evaluate a moving average of the weights, updated every ema_every steps (0: off)
    # Large batches and many devices (parallel.py). reference_batch_size 0 means the preset's own batch size.
    optimizer="sgd", trust_coefficient=0.001, lr_scaling="none", reference_batch_size=0, warmup_epochs=0.0,
    # --optimizer muon: conv filters take orthogonalised updates (torch_backend.Muon) at muon_lr_scale times the
    # schedule's LR, with their own momentum; the rest stays SGD. fast94 sets its own (see there).
    # muon_norm: the Frobenius norm each filter is held at (initial: its own at the first step; sqrt_out:
    # sqrt(out channels) as airbench94's Muon record; none); muon_ns_steps: Newton-Schulz steps (the record: 3).
    muon_lr_scale=0.16, muon_momentum=0.6, muon_norm="initial", muon_ns_steps=5,
    bn_group_size=0, sync_bn_group_size=0, allreduce="flat", allreduce_group_size=0,
    # Data echoing (pipeline.py): repeat upstream outputs echo_factor times on average.
    echo="none", echo_factor=1.0, echo_shuffle_buffer=0,
    # device: the on-device batched pipeline; loader: PNG-encoded images decoded per sample in DataLoader workers.
    pipeline="device", loader_workers=1,
    stop_at_target=False,  # end the run at the first evaluation that reaches the target (for studies)
    # End each run after this many epochs of its schedule (0: all), the LR following the full schedule; with
    # --checkpoint such a run continues later under a larger value (for runs longer than a session).
    stop_after_epochs=0,
    eval_every_steps=0,    # also evaluate every this many steps (0: per epoch only); results in runs[i]["evals"]
    holdout=0,             # evaluate on this many held-out training images instead of the test set
    block_depth=2,         # fastnet: convs per block (3: the last two wrapped in a residual)
    bn_momentum=0.4,       # fastnet's batch-norm momentum, PyTorch's convention (airbench94/95: 0.4, airbench96: 0.1)
    # fastnet's whitening bias: with the BN biases at bias_lr_scale (True, as airbench94's Muon record) or with the
    # weights at the plain LR (False, as airbench94, 95 and 96)
    whiten_bias_fast=True,
    # fastnet: block i trains in its first block_epochs[i] epochs only, then is frozen (0, or a block past the
    # list: always trained). A frozen first block spares the step its own backward and the second block's input
    # gradient (18% of a fast94 step; FreezeOut, Brock et al. 2017, freezes layers early to late likewise).
    # Frozen: no gradient step; lookahead, where on, still pulls it to its average (as the whitening bias)
    block_epochs=(),
    # Data selection: each step draws batch_size / select_fraction candidates and trains on the batch_size of them
    # with the highest loss under a proxy, a small fastnet trained alongside (as airbench96): it scores every
    # step's candidates and takes a step of its own (the run's optimizer) on the chosen ones every proxy_every steps.
    # select_by "loss": no proxy; each candidate is scored by the net's own loss on it the last time it was
    # trained on (never-trained ones first), so scoring costs nothing and the dropped ones are never augmented.
    select_fraction=1.0, select_by="proxy", proxy_widths=(32, 64, 64), proxy_every=4,
    # CPU, bf16: "matmul": 3x3 convs on small maps by matmul over the unfolded input (tb.Conv2d: weight gradients
    # at 8x8 and smaller, forward and input gradients at 4x4 and smaller; measured faster on an AMX Xeon),
    # "onednn": PyTorch's own conv kernels everywhere, "tuned" (= "auto"): for each pass of each conv shape at 8x8
    # and smaller the faster of the two, timed on this CPU before the timer (tb.resolve_cpu_conv; a CPU run logs
    # the choices as cpu_conv_kernels; a resumed run keeps its checkpoint's). No effect on GPUs.
    cpu_conv="auto",
    # Progressive resizing: the side of the training images in each epoch (the last entry repeats; empty: 32
    # throughout). Crops and flips are drawn at 32 px and the batch is then resized (bilinear, antialiased), so
    # an epoch sees whole images at a lower resolution for ~(side/32)^2 of the FLOPs. Evaluation is at 32.
    train_sizes=(),
)

PRESETS = {
    # Myrtle's DAWNBench ResNet-9 ("How to train your ResNet 4"): 94% in 79 s on one V100. Their summed loss
    # with lr 0.4/512 and weight decay 5e-4*512 is exactly this mean-loss form. Here (bf16, 2-core AMX CPU):
    # 94.18% after epoch 24 (n=1; Myrtle's own run: 94.08%), 5,398 s, logs/resnet9-20261201-080911-3335.
    "resnet9": dict(
        net="resnet9", widths=(64, 128, 256, 512), epochs=24, batch_size=512,
        lr_knots=(0, 5, 24), lr_values=(0, 0.4, 0), momentum=0.9, weight_decay=5e-4, pad=4, cutout=8),
    # Myrtle's "bag of tricks" ResNet-9 (post 8): 94.1% in 10 epochs with TTA, 26 s on one V100. Net: frozen
    # 3x3 patch whitening, pooling before BN, CELU(0.3), BN scales frozen at 1 (BN biases at 64x the LR and
    # 1/64 the decay), logits x 1/16; ghost BN over 32 images; label smoothing 0.2; an EMA of the weights (0.99 a
    # step, updated every 5) is what gets evaluated, with mirror TTA. Their summed-loss LR 1.0/512 and decay
    # 5e-4*512 at batch 512 are lr 1.0 and weight decay 5e-4 here; the LR peaks at epoch 2 (epochs/5), falls to
    # a tenth by epoch 8 and stays there while the EMA settles. Crop and flip, no cutout (bag_of_tricks.ipynb,
    # its last 10-epoch cell). Here (bf16, 2-core AMX CPU): 94.08 ± 0.13% (n=5: 93.87, 94.10, 94.07, 94.18,
    # 94.19), logs/resnet9-tricks-20261201-120951-11203, -224122-8450, -232504-9128, -20261202-002542-13358 and
    # -020648-15889 (seeds 1-4 with the fused ghost BN). NVIDIA H200, eager: 94.02 ± 0.13% (n=5), 9.2 ± 0.5 s,
    # logs/resnet9-tricks-20261204-102350-2900.
    "resnet9-tricks": dict(
        net="resnet9_tricks", widths=(64, 128, 256, 512), epochs=10, batch_size=512,
        lr_knots=(0, 2, 8, 10), lr_values=(0, 1.0, 0.1, 0.1), momentum=0.9, weight_decay=5e-4,
        bias_lr_scale=64.0, pad=4, cutout=0, label_smoothing=0.2, bn_group_size=32, ema_every=5, ema_decay=0.99,
        tta=1),
    # The DAWNBench single-GPU baseline (bkj/basenet, April 2018), analysed in Myrtle's post 1: an 18-layer
    # pre-activation ResNet (stages 64/128/256/256, concatenated average and max pooling), 35 epochs at batch 128,
    # LR 0 -> 0.1 (15) -> 0.005 (30) -> 0 (35), Nesterov, weight decay 5e-4, reflect-padded crop and flip.
    # 94% in 341 s on one V100 (its published log: 94.08% after epoch 31; 4 of 5 runs reached 94%). Its prep
    # conv has a BN-ReLU that the first block's BN-ReLU duplicates.
    # Here (bf16, 2-core AMX CPU), the first 10 epochs of the schedule: 83.26% after epoch 10 (the published
    # run: 78.21%; 2.0 points apart per epoch on average), 4,003 s, logs/resnet18-20261201-104656-10019.
    "resnet18": dict(
        net="preact_resnet18_dup", widths=(64, 128, 256, 256), epochs=35, batch_size=128,
        lr_knots=(0, 15, 30, 35), lr_values=(0, 0.1, 0.005, 0), momentum=0.9, weight_decay=5e-4, pad=4),
    # The same without the duplicated BN-ReLU (Myrtle post 1: 297 s on one V100, with faster data loading too).
    "resnet18-simple": dict(
        net="preact_resnet18", widths=(64, 128, 256, 256), epochs=35, batch_size=128,
        lr_knots=(0, 15, 30, 35), lr_values=(0, 0.1, 0.005, 0), momentum=0.9, weight_decay=5e-4, pad=4),
    # Our record net for 94%: whitening + dirac-initialised conv blocks (64/256/256), frozen BN scales with 64x
    # faster BN biases, label smoothing 0.2, alternating flips, translate 2, 6-view TTA for the images predicted
    # below p = 0.7 (on five nets the full TTA's accuracy, 93.98 vs 93.98%, in 40% of the time:
    # logs/eval_tta-2026-12-02T051343); the conv filters take orthogonalised (Muon) updates at 0.15x the
    # schedule's LR with momentum 0.6 (3 Newton-Schulz steps, every filter held at norm sqrt(out channels)), the
    # rest is Nesterov SGD. 10 epochs at batch 2000, LR falling linearly from the start, no lookahead; progressive
    # resizing: epoch 1 at 20 px, epochs 2-5 at 24 px, the rest at 32: 0.265 PF. In the form of airbench94's
    # Muon record (94.01%, n=200, 0.29 PF on an A100, 8 epochs at 32 px) but for the resizing and the schedule's
    # length; decay per step and the biases' and head's LR match it in this mean-loss form.
    # bf16, AMD EPYC Zen 5 (oneDNN's convs): 94.10 ± 0.08% (n=5: 94.16, 94.11, 94.03, 94.19, 94.01; all reach 94%),
    # 449 ± 24 s, logs/fast94-20261202-051400-6620, -052224-7258, -053112-7322, -053948-7400, -054730-7462;
    # seeds 5-8 (93.96, 94.11, 94.29, 94.10, logs/fast94-20261202-100741-26284) and 9-11 (94.23, 94.07, 94.18,
    # logs/fast94-20261202-124557-1360): 94.12 ± 0.10% over n=12; seeds 12-15 on a Zen 4 (94.23, 94.26, 94.32,
    # 94.15; 874 ± 15 s, logs/fast94-20261204-230116-23640): 94.15 ± 0.10% over n=16; seeds 16-19 there 1.5 h
    # later (94.17, 93.92, 94.12, 94.12; 693 ± 6 s, logs/fast94-20261205-012711-15184): 94.14 ± 0.11% over n=20
    # (18 reach 94%). Today's code, Zen 5: 94.13 ± 0.12% (n=15, seeds 0-14; 12 reach 94%), 378 ± 12 s,
    # logs/fast94-20261205-233635-20167, -20261206-064345-22605, -090322-32690. AMX Xeon model 167, tuned convs:
    # 94.13 ± 0.14% (n=20, 16 reach 94%), 292 ± 9 s, logs/fast94-20261206-134907-6830, -142437-7678,
    # -145221-9220, -173718-17956. Zen 4, tuned: 94.11 ± 0.16% (n=10), 729 ± 17 s,
    # logs/fast94-20261207-133313-4243, -185816-24813. NVIDIA H200, compiled: 94.14 ± 0.12% (n=20, 18 reach
    # 94%), 2.79 ± 0.24 s a run, logs/fast94-20261204-163352-1899 (the lease before, only the net compiled: 94.08 ±
    # 0.15%, 2.67 ± 0.19 s, logs/fast94-20261204-101918-1831).
    # Same machine and seeds, the forms before: 8 epochs, the first 3 at 24 px (0.234 PF): 93.87 ± 0.15%
    # (logs/fast94-20261202-034005-2703, -035808-3828; 94.02 ± 0.17% on the AMX CPU, logs/fast94-20261202-010346-
    # 15337 and -012426-15601: 93.95 over the ten, at 94.0 rather than above it); 9 epochs, 20 px then 3 at 24
    # (0.246 PF): 93.98 ± 0.11% (logs/fast94-20261202-043035-5697 ...-050222-6486). Seed by seed this form is
    # +0.23 ± 0.08 and +0.12 ± 0.02 points above them (mean ± standard error). One 32 px epoch fewer and one
    # 24 px more (0.248 PF, under the 0.25 stretch): 93.98 ± 0.13% over n=10 (logs/fast94-20261202-065316-14085,
    # -115504-32494), -0.14 ± 0.05 per seed; 94.00 ± 0.14% over n=15 with seeds 10-14 (-20261204-172221-6033);
    # 94.03 ± 0.15% over n=25 with seeds 15-24 (-185935-11561): the 0.25 PF stretch, met by one standard error;
    # 20, 20, 24 x4, 28, 28, 32, 32 px (0.224 PF): 93.62% (seed 0, logs/fast94-20261202-062030-13630).
    # Blocks 1 and 2 frozen for the last 2 and 1 epochs (--block-epochs 8 9, 0.232 PF, 11% less time on the Zen 5):
    # 93.93 ± 0.07% (n=5, logs/fast94-20261206-012008-29447), -0.13 ± 0.06 per seed against today's seeds 0-4.
    # Block 1 alone frozen for the last 2 (--block-epochs 8, 0.244 PF, 6% less time): 93.99 ± 0.06% (n=5,
    # logs/fast94-20261206-015326-30869), -0.07 ± 0.06 per seed. Neither beats the 0.241 PF form: not adopted.
    # Data selection (the 2,000 of 2,857 candidates a 32/64/64 proxy finds hardest, 0.197 PF): 93.97 ± 0.13%
    # (logs/fast94-20261202-083239-23290), 383 ± 14 s, -0.13 ± 0.06 per seed; with an 11th epoch (0.224 PF) the
    # same 93.97 ± 0.15% (logs/fast94-20261202-092212-24306); scored by the net's own last loss instead (0.180 PF)
    # 93.73 and 93.62% on seeds 0 and 3 (logs/fast94-20261202-090909-23942, -090910-23943): not adopted.
    # Batch 1000 (8 epochs, 20, 24 x3, 32 px; 0.212 PF; SGD LR 0.8), seed 0, by Muon LR per step x0.5 / x0.71 /
    # x1: 93.61 / 93.86 / 93.57% (logs/fast94-20261202-111139-31732, -111315-31858, -113107-32016): no better
    # for its FLOPs than batch 2000, though a CPU runs it at nearly the same rate.
    # Blocks 64/192/256 (0.202 PF): 93.76, 93.98% on seeds 0-1 (logs/fast94-20261202-135729-5796, -5797), -0.27
    # per seed: worse than data selection at the same FLOPs.
    # 16, 16, 24 x3, 32 x5 px (0.248 PF): 93.96 ± 0.10% (n=5; logs/fast94-20261202-145015-6952, -6953, -153701-8316).
    # The 0.248 PF form with colour jitter 0.14/0.13 (the 2025 A100 record's): 93.96 ± 0.15% (n=5,
    # logs/fast94-20261205-163825-7315), and with label smoothing 0.1 too 93.98 ± 0.08% (-163828-7358), against
    # 93.98 ± 0.18% on those seeds without it: no gain, not adopted; label smoothing 0.1 alone: 94.00 ± 0.10%
    # (logs/fast94-20261205-180332-8576).
    # Older forms, AMX CPU: 5 of 8 epochs at 24 px (0.200 PF): 93.71% (seed 0, logs/fast94-20261202-011459-15461).
    # 8 epochs at 32 px (0.284 PF): 93.98 ± 0.10% with the small-map convs as matmuls
    # (logs/fast94-20261201-213319-5651), and 94.06 ± 0.08% with oneDNN's (logs/fast94-20261201-171326-25186).
    # Before that (5 Newton-Schulz steps, each filter at its initial norm; 0.285 PF), same seeds: 93.99 ± 0.13%
    # (logs/fast94-20261201-105958-10335), and in fp32 93.97 ± 0.19% (logs/fast94-20261130-*).
    "fast94": dict(
        net="fastnet", widths=(64, 256, 256), epochs=10, batch_size=2000,
        lr_knots=(0, 10), lr_values=(1.6, 0.0), momentum=0.85, weight_decay=2.5e-3,
        optimizer="muon", muon_lr_scale=0.15, muon_momentum=0.6, muon_norm="sqrt_out", muon_ns_steps=3,
        bias_lr_scale=64.0, label_smoothing=0.2, flip="alternate", pad=2, cutout=0, tta=2, tta_confidence=0.7,
        whiten_bias_epochs=3, lookahead_start_epoch=-1, train_sizes=(20, 24, 24, 24, 24, 32)),
    # The same net with SGD throughout, in the form of airbench94 (94.01%, n=1000, 0.36 PF on an A100): 9.9
    # epochs at batch 1024, lookahead, 0.345 PF. Here (bf16 CPU): 93.80% in one process and 94.03% with two
    # (n=1 each). It was fast94 until the Muon recipe matched it with 17% fewer FLOPs; the studies use it.
    # Its whitening bias trains with the BN biases (64x LR); airbench94 keeps it at the plain LR (unmeasured).
    "fast94-sgd": dict(
        net="fastnet", widths=(64, 256, 256), epochs=9.9, batch_size=1024,
        lr_knots=(0, 2.277, 9.9), lr_values=(0.30, 1.5, 0.105), momentum=0.85, weight_decay=1.33e-3,
        bias_lr_scale=64.0, label_smoothing=0.2, flip="alternate", pad=2, cutout=0, tta=2,
        whiten_bias_epochs=3, lookahead_start_epoch=3, lookahead_every=5, lookahead_decay=0.95, lookahead_pow=3.0),
    # fast94-sgd scaled up for 95%, as airbench95 scales airbench94 (95.01%, n=200, 10.4 s on an A100, 1.39 PF):
    # blocks 1.5-2x wider, 15 epochs, peak LR x 10/11.5 with the same decay per step (weight_decay x 11.5/10);
    # the schedule keeps its shape (warm-up over the first 23%); the whitening bias at the plain LR and lookahead
    # from the start, synced into the net at the end only, as airbench95. 1.33 PF a run (counted). bf16, 2-core CPUs:
    # 95.04 ± 0.05% (n=5: 94.98, 95.08, 95.06 on an AMX Xeon, 49-69 min a run; 94.98, 95.08 on a Zen 4, 60-62 min),
    # logs/fast95-20261201-134755-16770, -145223-17524, -162455-24316 and -20261203-075221-11179. fast94's Muon
    # recipe on these blocks (LR 1.4, weight decay 2.9e-3, 15 epochs, 1.13 PF) gave 94.97 ± 0.15% (n=3,
    # logs/fast94-20261202-164255-13787): under 95%, so not adopted. NVIDIA H200, compiled: 95.06 ± 0.10% (n=5),
    # 5.39 ± 0.03 s a run, logs/fast95-20261204-102102-2288.
    "fast95": dict(
        net="fastnet", widths=(128, 384, 384), epochs=15, batch_size=1024,
        lr_knots=(0, 3.45, 15), lr_values=(0.261, 1.304, 0.0913), momentum=0.85, weight_decay=1.53e-3,
        bias_lr_scale=64.0, label_smoothing=0.2, flip="alternate", pad=2, cutout=0, tta=2,
        whiten_bias_epochs=3, whiten_bias_fast=False, lookahead_start_epoch=0, lookahead_sync="end", lookahead_every=5,
        lookahead_decay=0.95, lookahead_pow=3.0, target=0.95),
    # Our net for 96%, in the form of airbench96_faster (96.03%, n=100, 27.3 s on an A100, 3.1 PF): blocks
    # 128/384/512 of three convs, GELU after each residual sum, BN momentum 0.1; translate 4 and cutout 12;
    # 45 epochs of 1024 candidates a step, of which the 512 with the highest loss under a 32/64/64 proxy (trained
    # alongside, a step every 4) are trained on. LR warms up from 0.2x over the first 10% and falls to 0; its
    # peak 9 per 1024 examples on a summed loss (kilostep scale 7851) is 0.587 here, weight decay 0.012 per 1024
    # examples is 2.67e-3 (decay per step 1.57e-3 at the peak). The whitening bias trains throughout at the plain
    # LR (the reference's freeze never triggers); lookahead from the start, its average copied into the net at
    # the end only. Here (bf16, 2-core CPUs): 95.98 ± 0.11% over seeds 0-26 (n=27, 15 reach 96%; 0.02 short):
    # 96.15 on an AMX Xeon (model 207); 95.90 ± 0.07 (n=5) on a Zen 4; 96.02 ± 0.10 (n=6) on a Zen 5; 95.98 ± 0.12
    # (n=15) on an AMX Xeon model 167; 0.8-2.6 h a run. Each seed's log: RESULTS.md's fast96 row (or all of them,
    # with the H200's: python compare_runs.py logs/fast96-*.json).
    # NVIDIA H200, compiled: 95.95 ± 0.16% (n=9, 4 reach 96%), 24.6 ± 1.4 s a run, logs/fast96-20261204-163515-2040
    # and -163937-2863 (the lease before: 95.98 ± 0.08%, n=3, 22.5 ± 0.6 s, logs/fast96-20261204-102203-2565).
    "fast96": dict(
        net="fastnet", widths=(128, 384, 512), block_depth=3, bn_momentum=0.1, epochs=45, batch_size=512,
        select_fraction=0.5, proxy_widths=(32, 64, 64), proxy_every=4,
        lr_knots=(0, 4.5, 45), lr_values=(0.1174, 0.587, 0.0), momentum=0.85, weight_decay=2.667e-3,
        bias_lr_scale=64.0, label_smoothing=0.2, flip="alternate", pad=4, cutout=12, tta=2,
        whiten_bias_epochs=0, whiten_bias_fast=False, target=0.96,
        lookahead_start_epoch=0, lookahead_sync="end", lookahead_every=5, lookahead_decay=0.95, lookahead_pow=3.0),
}
DEFAULT_PRESET = "fast94"
IMAGE_SIZE = 32
EVAL_BATCH = 1000  # test images per forward pass
NETS = ("resnet9", "resnet9_tricks", "preact_resnet18", "preact_resnet18_dup", "fastnet")


# Counts, sizes and seeds: a fraction of one is never meant (and fails deep in torch).
WHOLE_NUMBER_OPTIONS = {"runs", "seed", "batch_size", "pad", "cutout", "tta", "eval_every", "eval_every_steps",
                        "holdout", "stop_after_epochs", "reference_batch_size", "block_depth", "muon_ns_steps",
                        "proxy_every", "lookahead_every", "ema_every", "bn_group_size", "sync_bn_group_size",
                        "allreduce_group_size", "echo_shuffle_buffer", "loader_workers"}


def make_config(preset=DEFAULT_PRESET, /, **overrides):
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if "preset" in overrides:  # (from a --set: a preset is chosen by name, and every option of it with it)
        raise ValueError("preset is not an option to set: choose the preset itself (--preset, --presets, or the "
                         "study's --workload)")
    cfg = dict(COMMON, **PRESETS[preset], preset=preset)
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(sorted(unknown))}")
    for key, value in overrides.items():  # of the wrong kind: --set (studies, benchmarks) keeps non-literals as text
        default, wanted = cfg[key], None
        if isinstance(default, bool):
            wanted = None if isinstance(value, bool) else "True or False"
        elif key in WHOLE_NUMBER_OPTIONS:  # (the command line reads these as int; --set may give 1.5)
            wanted = None if isinstance(value, numbers.Integral) and not isinstance(value, bool) else "a whole number"
        elif isinstance(default, (int, float)):  # (numpy's numbers too)
            wanted = None if isinstance(value, numbers.Real) and not isinstance(value, bool) else "a number"
        elif isinstance(default, tuple):  # (each element too: a string or a bool in one failed deep in a run)
            wanted = None if isinstance(value, (tuple, list)) and all(
                isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value) else "a tuple of numbers"
        if value is not None and wanted:
            raise ValueError(f"{key.replace('_', '-')} takes {wanted}, got {value!r}")
    given = {k: v for k, v in overrides.items() if v is not None}
    if "epochs" in given and "lr_knots" not in given and math.isfinite(given["epochs"]):
        # the schedule stretches with the run: --epochs 8 on a 10-epoch preset still anneals, at 8, not 10
        given["lr_knots"] = tuple(round(k * given["epochs"] / cfg["epochs"], 9) for k in cfg["lr_knots"])
    cfg.update(given)
    if not cfg["reference_batch_size"]:
        cfg["reference_batch_size"] = PRESETS[preset]["batch_size"]
    check_config(cfg)
    return cfg


MAX_EPOCHS = 10_000  # far beyond any CIFAR-10 schedule in the literature (a few hundred epochs at most)
MAX_ECHO_ITEMS = 50_000_000  # examples in one echoed pass (~30 bytes each in its index tensors): 1000x CIFAR-10
MIN_TRAIN_SIZE = 16  # below this the nets' three or four 2x poolings leave no map to pool


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")


def positive_number(text):
    try:
        return math.isfinite(float(text)) and float(text) > 0
    except (TypeError, ValueError):
        return False


def make_loss_scaler(cfg, precision, device):
    """What scales the training loss before its backward pass: nothing (a disabled GradScaler) unless in fp16;
    there, as COMMON's loss_scale says."""
    if precision != "fp16":
        return torch.amp.GradScaler(device.type, enabled=False)
    if cfg["loss_scale"] == "dynamic":
        return torch.amp.GradScaler(device.type)
    if cfg["loss_scale"] == "batch":
        return tb.FixedLossScale(2 ** int(math.log2(cfg["batch_size"])))
    return tb.FixedLossScale(float(cfg["loss_scale"]))


def check_config(cfg):
    """Impossible options are errors here, before any data is touched."""
    def need(ok, msg):
        if not ok:
            raise ValueError(msg)
    for key, value in cfg.items():  # an infinite epoch count, knot or scale is never meant
        values = value if isinstance(value, (tuple, list)) else [value]
        need(all(math.isfinite(v) for v in values if isinstance(v, float)),
             f"{key.replace('_', '-')} must be finite, got {value}")
    need(cfg["net"] in NETS, f"unknown net {cfg['net']!r}; choose one of {', '.join(NETS)}")
    need(cfg["whiten_bias_epochs"] >= 0, f"whiten-bias-epochs must be >= 0 (0: always trained), got "
         f"{cfg['whiten_bias_epochs']:g}")
    need(not cfg["whiten_bias_epochs"] or cfg["net"] == "fastnet", "whiten-bias-epochs needs net fastnet")
    need(all(e >= 0 for e in cfg["block_epochs"]), f"block-epochs must be >= 0 (0: always trained), got "
         f"{' '.join(f'{e:g}' for e in cfg['block_epochs'])}")
    need(not cfg["block_epochs"] or cfg["net"] == "fastnet", "block-epochs needs net fastnet")
    need(cfg["block_depth"] in (2, 3) and (cfg["block_depth"] == 2 or cfg["net"] == "fastnet"),
         "block-depth must be 2 or 3 (3 needs net fastnet)")
    need(0 <= cfg["bn_momentum"] <= 1 and (cfg["bn_momentum"] == COMMON["bn_momentum"] or cfg["net"] == "fastnet"),
         "bn-momentum must be in [0, 1] and applies to net fastnet only")
    need(0 < cfg["select_fraction"] <= 1, f"select-fraction must be in (0, 1], got {cfg['select_fraction']}")
    need(cfg["select_by"] in ("proxy", "loss"), "select-by must be proxy or loss")
    blocks = 3 if cfg["net"] == "fastnet" else 4
    need(not cfg["widths"] or (len(cfg["widths"]) == blocks and all(w == int(w) >= 1 for w in cfg["widths"])),
         f"widths: net {cfg['net']} takes {blocks} channel counts, each at least 1, got {tuple(cfg['widths'])}")
    need(len(cfg["block_epochs"]) <= blocks,
         f"block-epochs lists {len(cfg['block_epochs'])} blocks; the net has {blocks}")
    need(not uses_proxy(cfg) or (cfg["proxy_every"] >= 1 and len(cfg["proxy_widths"]) == 3
                                 and all(w == int(w) >= 1 for w in cfg["proxy_widths"])),
         "select-fraction below 1 needs a proxy: proxy-every >= 1 and three proxy-widths, each at least 1")
    need(not uses_loss_history(cfg) or cfg["pipeline"] == "device",
         "select-by loss needs pipeline device")
    need(cfg["ema_every"] >= 0 and 0 <= cfg["ema_decay"] < 1, "need ema-every >= 0 and ema-decay in [0, 1)")
    need(cfg["epochs"] > 0, f"epochs must be positive, got {cfg['epochs']}")
    # (1e9 epochs planned a list of every step's image size, silently, until memory ran out)
    need(cfg["epochs"] <= MAX_EPOCHS, f"epochs must be at most {MAX_EPOCHS}, got {cfg['epochs']:g}")
    need(cfg["compile_mode"] in COMPILE_MODES, f"compile-mode must be one of {', '.join(COMPILE_MODES)}")
    need(int(cfg["batch_size"]) == cfg["batch_size"] and cfg["batch_size"] > 0,
         f"batch size must be a positive integer, got {cfg['batch_size']}")
    need(0 < cfg["target"] <= 1, f"target must be in (0, 1], got {cfg['target']}"
         + (f" (a percentage? {cfg['target'] / 100:g})" if 10 <= cfg["target"] <= 100 else ""))
    need(cfg["runs"] >= 1, f"runs must be at least 1, got {cfg['runs']}")
    need(-2 ** 63 <= cfg["seed"] and cfg["seed"] + cfg["runs"] - 1 < 2 ** 64,  # what torch's generators take
         f"seeds must lie in [-2^63, 2^64), got {cfg['seed']}" + (f" + {cfg['runs'] - 1}" if cfg["runs"] > 1 else ""))
    need(len(cfg["lr_knots"]) == len(cfg["lr_values"]) >= 1, "lr-knots and lr-values need the same length")
    need(all(b >= a for a, b in zip(cfg["lr_knots"], cfg["lr_knots"][1:])), "lr-knots must be non-decreasing")
    need(all(math.isfinite(v) and v >= 0 for v in cfg["lr_values"]), "lr-values must be finite and >= 0")
    need(0 <= cfg["momentum"] < 1, f"momentum must be in [0, 1), got {cfg['momentum']}")
    need(cfg["weight_decay"] >= 0 and cfg["bias_lr_scale"] > 0, "weight decay must be >= 0, bias-lr-scale > 0")
    need(0 <= cfg["label_smoothing"] < 1, "label smoothing must be in [0, 1)")
    need(cfg["flip"] in ("none", "random", "alternate"), "flip must be none, random or alternate")
    need(0 <= cfg["pad"] <= 16 and 0 <= cfg["cutout"] <= 32, "pad must be in 0..16 and cutout in 0..32")
    need(len(cfg["color_jitter"]) == 2 and cfg["color_jitter"][0] >= 0 and 0 <= cfg["color_jitter"][1] < 1,
         f"color-jitter takes two numbers: brightness >= 0 and contrast in [0, 1), got {tuple(cfg['color_jitter'])}")
    need(not any(cfg["color_jitter"]) or cfg["pipeline"] == "device", "color-jitter needs pipeline device")
    need(cfg["tta"] in (0, 1, 2), "tta must be 0 (none), 1 (mirror) or 2 (mirror + translate)")
    need(0 <= cfg["tta_confidence"] <= 1, "tta-confidence must be in [0, 1] (0: TTA on every image)")
    need(cfg["precision"] in ("auto", "fp32", "bf16", "fp16"), "precision must be auto, fp32, bf16 or fp16")
    need(cfg["eval_precision"] in ("same", "fp32"), "eval-precision must be same (the run's) or fp32")
    need(cfg["loss_scale"] in ("batch", "dynamic") or positive_number(cfg["loss_scale"]),
         f"loss-scale must be batch, dynamic or a positive number, got {cfg['loss_scale']!r}")
    need(cfg["eval_every"] >= 0, "eval-every must be >= 0 (0: only at the end)")
    need(cfg["lookahead_sync"] in ("epoch", "end"), "lookahead-sync must be epoch or end")
    need(cfg["lookahead_start_epoch"] < 0 or (cfg["lookahead_every"] >= 1 and 0 <= cfg["lookahead_decay"] <= 1
                                              and cfg["lookahead_pow"] >= 0),
         "lookahead needs lookahead-every >= 1, lookahead-decay in [0, 1] and lookahead-pow >= 0")
    need(cfg["stop_after_epochs"] >= 0, "stop-after-epochs must be >= 0 (0: the whole schedule)")
    need(cfg["optimizer"] in ("sgd", "lars", "muon"), "optimizer must be sgd, lars or muon")
    need(cfg["muon_lr_scale"] > 0 and 0 <= cfg["muon_momentum"] < 1, "need muon-lr-scale > 0, muon-momentum in [0, 1)")
    need(cfg["muon_norm"] in tb.MUON_NORMS and cfg["muon_ns_steps"] >= 1,
         f"muon-norm must be one of {', '.join(tb.MUON_NORMS)} and muon-ns-steps >= 1")
    need(cfg["lr_scaling"] in parallel.SCALING_RULES, f"lr-scaling must be one of {', '.join(parallel.SCALING_RULES)}")
    need(cfg["reference_batch_size"] > 0 and cfg["warmup_epochs"] >= 0,
         "need reference-batch-size > 0, warmup-epochs >= 0")
    need(not cfg["warmup_epochs"] or cfg["lr_knots"][0] + cfg["warmup_epochs"] < cfg["lr_knots"][-1],
         f"warmup-epochs {cfg['warmup_epochs']:g} must end before the schedule does (epoch {cfg['lr_knots'][-1]:g})")
    need(cfg["bn_group_size"] >= 0 and cfg["sync_bn_group_size"] >= 0 and cfg["allreduce_group_size"] >= 0,
         "group sizes must be >= 0 (0: the default)")
    need(cfg["allreduce"] in ("flat", "hierarchical"), "allreduce must be flat or hierarchical")
    need(cfg["cpu_conv"] in tb.CPU_CONV_MODES, f"cpu-conv must be one of {', '.join(tb.CPU_CONV_MODES)}")
    need(cfg["echo"] in pipeline.ECHO_MODES, f"echo must be one of {', '.join(pipeline.ECHO_MODES)}")
    need(cfg["echo_factor"] >= 1 and cfg["echo_shuffle_buffer"] >= 0, "need echo-factor >= 1, echo-shuffle-buffer >= 0")
    need(cfg["echo"] != "none" or cfg["echo_factor"] == 1,  # (else it silently echoes nothing)
         f"echo-factor {cfg['echo_factor']:g} needs an --echo mode ({', '.join(pipeline.ECHO_MODES[1:])})")
    need(cfg["eval_every_steps"] >= 0, f"eval-every-steps must be >= 0 (0: none), got {cfg['eval_every_steps']}")
    need(cfg["holdout"] >= 0, f"holdout must be >= 0 (0: evaluate on the test set), got {cfg['holdout']}")
    need(all(int(v) == v and MIN_TRAIN_SIZE <= v <= IMAGE_SIZE for v in cfg["train_sizes"]),
         f"train-sizes must be whole numbers of pixels in {MIN_TRAIN_SIZE}..{IMAGE_SIZE}")
    need(cfg["pipeline"] in ("device", "loader") and cfg["loader_workers"] >= 0,
         "pipeline must be device or loader, loader-workers >= 0")


def check_distributed(cfg, world):
    """Checks that need the world size; train() makes them on every rank before the process group exists."""
    bs = cfg["batch_size"]
    if bs % world:
        raise ValueError(f"global batch size {bs} is not divisible by the {world} processes")
    if candidate_batch_size(cfg) % world:
        raise ValueError(f"the {candidate_batch_size(cfg)} candidates a step (batch size / select-fraction) are not "
                         f"divisible by the {world} processes")
    local = bs // world
    if cfg["bn_group_size"] and local % cfg["bn_group_size"]:
        raise ValueError(f"per-process batch {local} is not divisible into BN groups of {cfg['bn_group_size']}")
    for key in ("sync_bn_group_size", "allreduce_group_size"):
        if cfg[key] and (world % cfg[key] or world == 1):
            raise ValueError(f"{key.replace('_', '-')} {cfg[key]} needs several processes and must divide "
                             f"their number ({world})")
    if cfg["allreduce"] == "hierarchical" and world == 1:  # (one process has no gradients to sum: a flat run)
        raise ValueError("allreduce hierarchical needs several processes (torchrun --nproc_per_node N)")


# ---------------------------------------------------------------------------------------------------------------
# One run

class Diverged(RuntimeError):
    pass


def build_model(cfg, device, train_x_nhwc=None, generator=None):
    w = tuple(cfg["widths"])
    if cfg["net"] == "resnet9":
        model = tb.resnet9(w or (64, 128, 256, 512))
    elif cfg["net"].startswith("preact_resnet18"):
        model = tb.preact_resnet18(cfg["net"].endswith("_dup"), w or (64, 128, 256, 256))
    elif cfg["net"] == "resnet9_tricks":
        model = tb.ResNet9Tricks(w or (64, 128, 256, 512))
    else:
        model = tb.FastNet(w or (64, 256, 256), depth=cfg["block_depth"], bn_momentum=cfg["bn_momentum"])
    if hasattr(model, "init_whitening") and train_x_nhwc is not None:
        p = cfg["pad"]
        sample = torch.randperm(len(train_x_nhwc), generator=generator, device=train_x_nhwc.device)[:5000]
        unpadded = train_x_nhwc[sample, p:train_x_nhwc.shape[1] - p, p:train_x_nhwc.shape[2] - p]
        model.init_whitening(unpadded.permute(0, 3, 1, 2))
    kernels = tb.resolve_cpu_conv(cfg["cpu_conv"])
    for m in model.modules():
        if isinstance(m, tb.Conv2d):
            m.cpu_kernels = kernels
    return model.to(device).to(memory_format=torch.channels_last)


def make_optimizer(cfg, model):
    """Two groups: BN parameters that train (their biases; scales too where they train), and fastnet's whitening
    bias if whiten_bias_fast, take bias_lr_scale times the LR and 1/bias_lr_scale times the weight decay, so their
    decay per step is the same as everything else's. A classifier's bias stays with the weights."""
    classifier = {id(p) for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()}
    fast = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim == 1 and id(p) not in classifier
            and (cfg["whiten_bias_fast"] or not n.startswith("whiten."))]
    fast_ids = {id(p) for p in fast}
    slow = [p for p in model.parameters() if p.requires_grad and id(p) not in fast_ids]
    s = cfg["bias_lr_scale"]
    groups = [dict(params=slow, lr_scale=1.0, weight_decay=cfg["weight_decay"]),
              dict(params=fast, lr_scale=s, weight_decay=cfg["weight_decay"] / s)]
    if s == 1.0:
        groups = [dict(params=slow + fast, lr_scale=1.0, weight_decay=cfg["weight_decay"])]
    nesterov = cfg["nesterov"] and cfg["momentum"] > 0
    if cfg["optimizer"] == "lars":  # BN parameters and biases (ndim 1) keep the plain LR
        return parallel.LARS(groups, lr=0.0, momentum=cfg["momentum"], nesterov=nesterov,
                             trust_coefficient=cfg["trust_coefficient"])
    if cfg["optimizer"] == "muon":  # conv filters orthogonalised, the head and the biases as with SGD
        filters = [p for p in slow if p.ndim == 4]
        rest = [p for p in slow if p.ndim != 4]
        groups = [dict(params=filters, lr_scale=cfg["muon_lr_scale"], momentum=cfg["muon_momentum"],
                       orthogonalize=True, norm=cfg["muon_norm"], ns_steps=cfg["muon_ns_steps"],
                       weight_decay=cfg["weight_decay"]),
                  dict(params=rest, lr_scale=1.0, weight_decay=cfg["weight_decay"]),
                  dict(params=fast, lr_scale=s, weight_decay=cfg["weight_decay"] / s)]
        return tb.Muon([g for g in groups if g["params"]], lr=0.0, momentum=cfg["momentum"], nesterov=nesterov,
                       compiled=cfg["compile"], compile_mode=cfg["compile_mode"])
    return torch.optim.SGD(groups, lr=0.0, momentum=cfg["momentum"], nesterov=nesterov)


def lr_schedule(cfg):
    """The preset's piecewise-linear LR, scaled for the batch size by the chosen rule and warmed up."""
    factor = parallel.scaled_lr(1.0, cfg["batch_size"], cfg["reference_batch_size"], cfg["lr_scaling"])
    knots, values = list(cfg["lr_knots"]), [v * factor for v in cfg["lr_values"]]
    if cfg["warmup_epochs"]:
        knots, values = parallel.warmup_knots(knots, values, cfg["warmup_epochs"])
    return core.piecewise_linear(knots, values)


class WeightAverage:
    """A running average of a net's floating-point state (weights and BN statistics), starting from the net."""

    def __init__(self, model):
        self.model = model
        self.avg = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}

    # foreach ops: one kernel launch for all tensors on a GPU instead of one per tensor (dozens per update)
    @torch.no_grad()
    def pull(self, weight):
        """avg <- avg + weight * (net - avg)."""
        state = self.model.state_dict()
        torch._foreach_lerp_(list(self.avg.values()), [state[k] for k in self.avg], weight)

    @torch.no_grad()
    def load(self, tensors):
        """Copies tensors (keyed like avg) into the net."""
        state = self.model.state_dict()
        torch._foreach_copy_([state[k] for k in tensors], list(tensors.values()))


class Lookahead(WeightAverage):
    """Every few steps, pull the weights towards a slow average and copy the average back into the net."""

    def update(self, decay):
        self.pull(1 - decay)
        self.load(self.avg)


class WeightEMA(WeightAverage):
    """An exponential moving average of the weights and BN statistics, updated every `every` steps with decay
    `decay` per step (decay ** every per update). Evaluation runs on it (Myrtle's bag of tricks): late in
    training it averages out the noise of the last steps, as a lower LR would, without the extra epochs."""

    def __init__(self, model, decay, every):
        super().__init__(model)
        self.decay, self.every = decay, every

    def update(self):
        self.pull(1 - self.decay ** self.every)

    @contextlib.contextmanager
    def applied(self):
        """The averaged weights in the net while the block runs (to evaluate), the trained ones after."""
        state = self.model.state_dict()
        trained = {k: state[k].clone() for k in self.avg}
        self.load(self.avg)
        try:
            yield
        finally:
            self.load(trained)


def evaluated_weights(ema):
    return ema.applied() if ema is not None else contextlib.nullcontext()


def make_step_fn(cfg, model, world):
    """What the training step calls: the model, wrapped in DDP under torchrun (with the 2-D all-reduce hook if
    chosen) and compiled with --compile."""
    step_fn = model
    if world > 1:
        step_fn = torch.nn.parallel.DistributedDataParallel(model)
        if cfg["allreduce"] == "hierarchical":
            group = cfg["allreduce_group_size"] or int(os.environ.get("LOCAL_WORLD_SIZE", world))
            step_fn.register_comm_hook(parallel.make_hierarchical_state(world, group),
                                       parallel.hierarchical_allreduce_hook)
    # dynamic=False: each image size of progressive resizing gets its own static graph, not one dynamic graph
    return torch.compile(step_fn, dynamic=False, mode=cfg["compile_mode"]) if cfg["compile"] else step_fn


def forward_loss(cfg, step_fn, x, y, precision, device):
    """Forward under autocast, the training loss in fp32."""
    with tb.autocast(precision, device):
        out = step_fn(x)
    return out, F.cross_entropy(out.float(), y, label_smoothing=cfg["label_smoothing"])


def train_step(cfg, step_fn, opt, x, y, precision, device, scaler=None):
    """One update: forward_loss, backward (loss-scaled for fp16), optimizer step."""
    if uses_cuda_graphs(cfg):
        torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs are consumed: reuse their memory
    out, loss = forward_loss(cfg, step_fn, x, y, precision, device)
    opt.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    return out, loss


def uses_cuda_graphs(cfg):
    return cfg["compile"] and cfg["compile_mode"] in tb.CUDA_GRAPH_COMPILE_MODES


def forward_backward(cfg, model, step_fn, x, y, precision, device):
    """A training step without its update (to compile or time it): on fresh gradients, since under CUDA graphs
    the last backward's .grad is overwritten by the next replay (accumulating into it failed on the H200 at
    3a9ff96, "accessing tensor output of CUDAGraphs"; pytorch/pytorch#169545 is this failure). Returns the
    net's output: a step holds it through its update, and a CUDA graph recorded with it freed is not replayed
    while it lives (cudagraph trees check which outputs are dead), so the warm-up must hold it as long."""
    if uses_cuda_graphs(cfg):
        torch.compiler.cudagraph_mark_step_begin()
    model.zero_grad(set_to_none=True)
    out, loss = forward_loss(cfg, step_fn, x, y, precision, device)
    loss.backward()
    return out


def warm_up_batches(n, sizes, precision, device):
    """Random batches of n images (labels too) at each image size, to compile on: each size is another graph.
    From a generator of their own, so the run's random streams are left alone."""
    gen = torch.Generator(device=device).manual_seed(0)
    y = torch.randint(0, 10, (n,), device=device, generator=gen)
    return [(torch.randn(n, 3, size, size, device=device, generator=gen).to(tb.DTYPES[precision])
             .to(memory_format=torch.channels_last), y) for size in sorted(set(sizes))]


@contextlib.contextmanager
def left_as_it_was(model):
    """Whatever the block trains, the net ends as it began: weights and BN statistics restored, no gradients."""
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    yield
    model.zero_grad(set_to_none=True)
    model.load_state_dict(saved)


def warm_up_compile(cfg, model, device, precision, world, opt=None):
    """Compiles the training step (forward and backward, and a compiled optimizer's update) on the run's own net
    before its timed steps, then puts the net back as it was (weights, BN statistics, no gradients; the optimizer
    has not stepped). Covers each state of what trains that the run's epochs take (trains_in: the whitening bias
    and blocks frozen after their epochs): a change of requires_grad means another graph (and, under torchrun,
    another DDP wrapper). A later run finds most of the work in torch.compile's caches."""
    batches = warm_up_batches(cfg["batch_size"] // world, set(cfg["train_sizes"]) | {IMAGE_SIZE}, precision, device)
    states = dict.fromkeys(trains_in(cfg, e) for e in range(1, math.ceil(cfg["epochs"]) + 1))
    with left_as_it_was(model):
        for trains in states:
            with trains_as(model, trains):
                step_fn = make_step_fn(cfg, model, world)  # after the change: DDP wraps the parameters that train
                for x, y in batches:
                    # CUDA graphs are recorded at a graph's second or third call, not its first
                    for _ in range(3 if uses_cuda_graphs(cfg) else 1):
                        out = forward_backward(cfg, model, step_fn, x, y, precision, device)  # held as a step does
                        if hasattr(opt, "warm_up"):  # a compiled Muon: after the backward, as in a step
                            opt.warm_up()
                        del out


def candidate_batch_size(cfg):
    """Examples drawn per step: the batch, or with data selection the candidates it is chosen from."""
    return round(cfg["batch_size"] / cfg["select_fraction"])


def uses_proxy(cfg):
    return cfg["select_fraction"] < 1 and cfg["select_by"] == "proxy"


def uses_loss_history(cfg):
    return cfg["select_fraction"] < 1 and cfg["select_by"] == "loss"


def record_losses(history, idx, out, y, label_smoothing, world):
    """Data selection by loss history: store each trained example's loss (the step's own forward pass, before
    its update) under its index. Under torchrun every process stores the whole global batch's, so all hold the
    same history and choose the same candidates."""
    losses = F.cross_entropy(out.detach().float(), y, reduction="none", label_smoothing=label_smoothing)
    if world > 1:
        gathered_idx, gathered = [torch.empty_like(idx) for _ in range(world)], [torch.empty_like(losses)
                                                                                 for _ in range(world)]
        torch.distributed.all_gather(gathered_idx, idx)
        torch.distributed.all_gather(gathered, losses)
        idx, losses = torch.cat(gathered_idx), torch.cat(gathered)
    history[idx] = losses


def steps_per_epoch(cfg, n_train):
    return n_train // candidate_batch_size(cfg)


def run_steps(cfg, n_train):
    return math.ceil(steps_per_epoch(cfg, n_train) * cfg["epochs"])


def train_size(cfg, epoch):
    """The side of the training images in this epoch (1-based; progressive resizing, train_sizes)."""
    sizes = cfg["train_sizes"]
    return int(sizes[min(epoch, len(sizes)) - 1]) if sizes else IMAGE_SIZE


def trains_in(cfg, epoch):
    """What trains in this epoch (1-based) of the parts a run may freeze (freezable_parts): fastnet's whitening
    bias in its first whiten_bias_epochs, block i in its first block_epochs[i]. Each True or False, or None where
    the part is never frozen (it trains, as built)."""
    return tuple(epoch <= limit if limit else None for limit in (cfg["whiten_bias_epochs"], *cfg["block_epochs"]))


def freezable_parts(model):
    """The parameters each of trains_in's flags applies to, in its order: the whitening bias, then each of
    fastnet's blocks (what trains in it as built: conv filters and BN biases)."""
    bias = whiten_bias(model)
    blocks = [model.block_parameters(i) for i in range(model.num_blocks)] if hasattr(model, "num_blocks") else []
    return [[bias] if bias is not None else [], *blocks]


def set_trains(model, trains):
    """Freezes or unfreezes each part as trains says (None: as it is); True where that changed requires_grad. A
    frozen part also spares the step the input gradients only it needed: a frozen whitening bias the first
    block's, a frozen first block (and bias) its own backward and the second block's input gradient."""
    changed = False
    for flag, params in zip(trains, freezable_parts(model)):
        for p in params if flag is not None else ():
            changed |= p.requires_grad != flag
            p.requires_grad_(flag)
    return changed


def whiten_bias(model):
    """The whitening conv's bias (fastnet's), or None for nets without one."""
    return getattr(getattr(model, "whiten", None), "bias", None)


@contextlib.contextmanager
def trains_as(model, trains):
    """The parts frozen or trained as trains says (set_trains) inside the block, and as they were after."""
    was = tuple(params[0].requires_grad if params else None for params in freezable_parts(model))
    set_trains(model, trains)
    try:
        yield
    finally:
        set_trains(model, was)


def step_kinds(cfg, n_train):
    """(image side, what trains: trains_in) at every step of a run: together they decide what a step computes."""
    per_epoch = steps_per_epoch(cfg, n_train)
    epochs = (s // per_epoch + 1 for s in range(run_steps(cfg, n_train)))
    return [(train_size(cfg, e), trains_in(cfg, e)) for e in epochs]


def set_lr(opt, lr):
    """The schedule's LR, scaled per parameter group (biases, Muon's filters)."""
    for g in opt.param_groups:
        g["lr"] = lr * g["lr_scale"]


def proxy_config(cfg):
    """The proxy that scores candidates for data selection: a small depth-2 fastnet on the run's own recipe (LR
    schedule, decay, label smoothing, compilation), without selection, lookahead, EMA, ghost BN or freezing of its
    own."""
    # compile_mode default: CUDA graphs for the run's net only, as the two would share their memory pool
    return dict(cfg, net="fastnet", widths=tuple(cfg["proxy_widths"]), block_depth=2, whiten_bias_epochs=0,
                block_epochs=(), select_fraction=1.0, lookahead_start_epoch=-1, ema_every=0, bn_group_size=0,
                echo="none", compile_mode="default")


class Proxy:
    """Data selection as airbench96 does it: the proxy trains alongside the run on the same candidate batches.
    Each step it scores the candidates in train mode (batch statistics, the run's label-smoothed loss) and the
    run keeps the `keep` with the highest loss; every `every`-th step the proxy takes a step of the run's optimizer
    (SGD, or Muon for its filters) on the mean of those losses, at the run's LR. Its whitening bias stays frozen
    (at 0). Under torchrun each process selects from its own slice of the candidates with a proxy trained on
    that slice."""

    def __init__(self, cfg, data, generator, device, precision):
        self.cfg, self.precision, self.device = proxy_config(cfg), precision, device
        self.model = build_model(self.cfg, device, data["train_x"] if data else None, generator)
        self.model.whiten.bias.requires_grad_(False)
        self.opt = make_optimizer(self.cfg, self.model)
        self.scaler = make_loss_scaler(self.cfg, precision, device)
        self.loss = torch.zeros((), device=device)  # the last training step's, checked once an epoch
        # with --compile: one graph for scoring (no gradients) and one for training, per image size; warm_up
        # builds them outside the timer. Eager on a GPU, this small net's step is mostly kernel launches.
        self.forward = make_step_fn(self.cfg, self.model, world=1)

    def warm_up(self, candidates, sizes):
        """Compiles scoring and training at each image size on random batches of `candidates` images, then puts
        the proxy back as it was (weights, BN statistics, no gradients; its optimizer has not stepped)."""
        with left_as_it_was(self.model):
            for x, y in warm_up_batches(candidates, sizes, self.precision, self.device):
                for train in (False, True):
                    losses = self.losses(x, y, train)
                    if train:
                        losses.mean().backward()
            if hasattr(self.opt, "warm_up"):  # a compiled Muon (--optimizer muon)
                self.opt.warm_up()

    def losses(self, x, y, train):
        """Each candidate's loss in train mode (batch statistics), with gradients if it will train on them."""
        self.model.train()
        with torch.set_grad_enabled(train), tb.autocast(self.precision, self.device):
            return F.cross_entropy(self.forward(x).float(), y, reduction="none",
                                   label_smoothing=self.cfg["label_smoothing"])

    def select(self, x, y, keep, lr, train):
        losses = self.losses(x, y, train)
        chosen = losses.detach().topk(keep, sorted=False).indices
        if train:
            set_lr(self.opt, lr)
            self.loss = losses[chosen].mean()
            self.opt.zero_grad(set_to_none=True)
            self.scaler.scale(self.loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.loss = self.loss.detach()
        return x[chosen], y[chosen]

    def check(self):
        loss = self.loss.item()
        if not math.isfinite(loss):  # a NaN proxy would select at random
            raise Diverged(f"the data-selection proxy diverged (training loss {loss}); try other --proxy-widths "
                           "or a lower --lr-values")

    def state_dict(self):
        return dict(model=self.model.state_dict(), opt=self.opt.state_dict(), scaler=self.scaler.state_dict())

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.scaler.load_state_dict(state["scaler"])


def train_flops(model, device, precision, batch_size, size=IMAGE_SIZE):
    """FLOPs of one training step (forward and backward) at this batch size and image side; the update itself
    is ignored."""
    x = torch.randn(batch_size, 3, size, size, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch_size,), device=device)

    def step():
        with tb.autocast(precision, device):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
    flops = tb.count_flops(step)
    model.zero_grad(set_to_none=True)
    return flops


def step_flops(model, opt, device, precision, batch_size, size=IMAGE_SIZE):
    """train_flops plus what the optimizer's update computes in matrix products (Muon's Newton-Schulz)."""
    return train_flops(model, device, precision, batch_size, size) + getattr(opt, "update_flops", lambda: 0)()


def run_flops(cfg, model, opt, device, precision, n_train, steps_done=None):
    """(FLOPs of the run's last step, steps, FLOPs of the whole run, or of its first steps_done steps)."""
    parts = run_flops_parts(cfg, model, opt, device, precision, n_train, steps_done)
    return parts["last_step"], parts["steps"], parts["total"]


def run_flops_parts(cfg, model, opt, device, precision, n_train, steps_done=None):
    """A run's training FLOPs (or its first steps_done steps'), in parts: the net's steps, with data selection
    the proxy's scoring of the candidates (a forward pass each step) and its training (a backward pass through
    those candidates and its update, every proxy_every-th step), their total, and the last step's (net, scoring
    and both: last_step). Each kind of step is counted once: each image size of progressive resizing, with the
    whitening bias and blocks trained or frozen as the run has them then (a frozen bias needs no input gradient of
    the first block: 4% of a fast94 step)."""
    kinds = step_kinds(cfg, n_train)
    proxy = Proxy(cfg, None, None, device, precision) if uses_proxy(cfg) else None
    per_kind, scoring, proxy_training = {}, {}, {}
    for size, trains in set(kinds):
        with trains_as(model, trains):
            per_kind[size, trains] = step_flops(model, opt, device, precision, cfg["batch_size"], size)
    for size in {side for side, _ in kinds} if proxy is not None else ():
        x = torch.randn(candidate_batch_size(cfg), 3, size, size, device=device)
        x = x.to(memory_format=torch.channels_last)
        with torch.no_grad():
            scoring[size] = tb.count_flops(lambda: proxy.model(x))
        proxy_training[size] = step_flops(proxy.model, proxy.opt, device, precision, len(x), size) - scoring[size]
    done = kinds[:len(kinds) if steps_done is None else steps_done]
    parts = dict(steps=len(kinds), last_step_net=per_kind[kinds[-1]], last_step_scoring=scoring.get(kinds[-1][0], 0),
                 net=sum(per_kind[kind] for kind in done), scoring=sum(scoring.get(side, 0) for side, _ in done),
                 proxy_training=sum(proxy_training.get(side, 0) for side, _ in done[::cfg["proxy_every"]]))
    return dict(parts, last_step=parts["last_step_net"] + parts["last_step_scoring"],
                total=parts["net"] + parts["scoring"] + parts["proxy_training"])


def load_checkpoint(path, device):
    """A run saved by --checkpoint (written whole or not at all: saved to a temporary file, then renamed), or a
    ValueError naming the file if it is something else."""
    try:
        state = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # pickle, zip and EOF errors differ by torch version: any means not a checkpoint
        raise ValueError(f"{path} is not a checkpoint of train_cifar.py ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not {"cfg", "seed", "model", "opt", "result", "epoch"} <= set(state):
        raise ValueError(f"{path} is not a checkpoint of train_cifar.py (not a saved run)")
    return state


def data_fingerprint(data):
    """Sizes and integer checksums of the run's data as on the device (each image's bits summed, weighted by its
    position; the labels likewise; in int64, which fp32 bits can wrap around: the same number for the same data
    on any machine): a checkpoint must not resume on other data, or the same in another order (its example
    indices, loss history and stream position would then point elsewhere). Not the logs' fingerprint
    (tb.dataset_fingerprint, of the data as loaded): this one also changes with the precision, pad and holdout."""
    def bits(t):  # the tensor's bits as integers, on the host, for tb.dataset_fingerprint's checksums
        return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return tb.dataset_fingerprint({k: bits(data[k]).cpu().numpy() for k in ("train_x", "train_y", "test_x", "test_y")})


def checkpoint_mismatch(state, cfg, seed, precision, fingerprint=None):
    """Why a saved run cannot continue as this one, or None. Precision is compared as resolved, so a run that
    `auto` put in fp32 continues under `--precision fp32` (checkpoints from before this was saved compare
    the option as given); the data by data_fingerprint (where both have one)."""
    if state["seed"] != seed:
        return f"holds seed {state['seed']}, not {seed}; remove it or pass another --checkpoint"
    if "precision" in state:
        if state["precision"] != precision:
            return f"trained in {state['precision']}; pass --precision {state['precision']} to continue it"
        cfg, saved = dict(cfg, precision=None), dict(state["cfg"], precision=None)
    else:
        saved = state["cfg"]
    # where to stop is not the run, and compiling or the CPU's conv kernels change how a step runs, not what it
    # computes (each segment records whether it was compiled, and its hardware)
    unrun = dict(stop_after_epochs=0, compile=False, compile_mode=None, cpu_conv=None, sync_check=False)
    cfg, saved = dict(cfg, **unrun), dict(saved, **unrun)
    # options added or removed since the checkpoint was saved are not compared: the code's own change is what
    # the run's segments record (commit per part)
    differ = sorted(k for k in set(cfg) & set(saved) if cfg[k] != saved[k])
    if differ:
        return (f"belongs to another configuration (differs in {', '.join(differ)}); "
                "remove it or pass another --checkpoint")
    # last: the data as on the device also differs with the precision, the padding and the holdout
    differ = data_differs(state.get("data"), fingerprint)
    if differ:
        return (f"was trained on other data ({', '.join(differ)} differ: {state['data']['train_x'][0]} training "
                f"images there, {fingerprint['train_x'][0]} here); pass the --data it ran on")
    return None


def run_once(cfg, data, run_index, seed, device, precision, log=print, on_epoch=None, checkpoint=None,
             rank=0, world=1, progress=None):
    """Trains one network from scratch and returns its result entry (the `runs` item of the summary).

    checkpoint: a path; the run's whole state is saved there after every epoch and, if the file exists, the
    run continues from it (its timer too), so long CPU runs can span several sessions.
    rank, world: under torchrun every process draws the same shuffles and augmentations and trains on its
    slice of each global batch; DDP averages the gradients, so the update is that of the global batch.
    progress: a core.Progress told each step (host-side: it waits for nothing), or None."""
    sync = tb.synchronizer(device)
    torch.manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    n_train, bs = len(data["train_y"]), cfg["batch_size"]
    per_epoch = steps_per_epoch(cfg, n_train)
    total_steps = run_steps(cfg, n_train)
    lr_at = lr_schedule(cfg)
    local_bs = bs // world
    lookahead, rows = None, []
    # A run resumed from a checkpoint may span sessions, machines and commits: each invocation that trained part
    # of it adds a segment saying where its epochs ran (the summary's hardware and commit are the last one's).
    segment = dict(first_epoch=1, hardware=tb.device_name(device), commit=core.git_commit(), torch=torch.__version__,
                   compiled=bool(cfg["compile"]), started=core.utc_timestamp())
    result = dict(seed=seed, accuracy=None, epoch_reached_target=None, time_to_target_s=None,
                  fresh_to_target=None, step_reached_target=None, total_time_s=None, train_flops=None,
                  diverged=False, stopped_after_epoch=None, epochs=rows, evals=[], segments=[segment])

    fingerprint = data_fingerprint(data) if checkpoint else None  # (before the clock starts)
    timer = core.Timer(sync)
    model = build_model(cfg, device, data["train_x"], gen)  # the whitening is fitted to data: timed
    opt = make_optimizer(cfg, model)
    scaler = make_loss_scaler(cfg, precision, device)
    if cfg["bn_group_size"]:
        parallel.convert_bn(model, cfg["bn_group_size"])
    if world > 1 and cfg["sync_bn_group_size"]:
        parallel.convert_sync_bn(model, parallel.bn_process_groups(world, cfg["sync_bn_group_size"]))
    # a resumed run keeps the conv kernels it was tuned with (they round differently): bit for bit as if uninterrupted
    tuned_convs, state, kept_kernels = tb.resolve_cpu_conv(cfg["cpu_conv"]) == "tuned", None, []
    if checkpoint and os.path.exists(checkpoint):
        state = load_checkpoint(checkpoint, device)
        why = checkpoint_mismatch(state, cfg, seed, precision, fingerprint)
        if why:
            raise ValueError(f"checkpoint {checkpoint} {why}")
        # before compiling: loading the optimizer replaces its buffers, and a CUDA graph recorded on the old ones
        # would be recorded again in the timed steps
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        scaler.load_state_dict(state["scaler"])
        if tuned_convs and state.get("cpu_conv_kernels"):  # (before compiling, which reads them)
            kept_kernels = tb.use_tuned_kernels(state["cpu_conv_kernels"])
    if cfg["compile"]:  # building the net and fitting the whitening stay timed; compiling does not
        timer()
        t = time.perf_counter()
        warm_up_compile(cfg, model, device, precision, world, opt)
        timer(include_in_total=False)
        log(f"compiled the training step in {time.perf_counter() - t:.1f} s (outside the timer)")
    step_fn = make_step_fn(cfg, model, world)
    ema = WeightEMA(model, cfg["ema_decay"], cfg["ema_every"]) if cfg["ema_every"] else None
    proxy = Proxy(cfg, data, gen, device, precision) if uses_proxy(cfg) else None  # timed
    if proxy is not None and cfg["compile"]:
        timer()
        proxy.warm_up(candidate_batch_size(cfg) // world, set(cfg["train_sizes"]) | {IMAGE_SIZE})
        timer(include_in_total=False)
    if proxy is not None and state is not None:
        proxy.load_state_dict(state["proxy"])
    history = None  # select_by loss: each example's loss when last trained on (inf: never yet)
    if uses_loss_history(cfg):
        history = state["history"] if state is not None else torch.full((n_train,), math.inf, device=device)
    stream_cfg = dict(cfg, batch_size=candidate_batch_size(cfg))
    stream = (pipeline.LoaderStream if cfg["pipeline"] == "loader" else pipeline.BatchStream)(data, stream_cfg, gen,
                                                                                               device)
    local_candidates = stream_cfg["batch_size"] // world
    step, start_epoch = 0, 1
    if state is not None:
        if state["lookahead"] is not None:
            lookahead = Lookahead(model)
            lookahead.avg = state["lookahead"]
        if ema is not None:
            ema.avg = state["ema"]
        gen.set_state(state["gen"])
        stream.load_state_dict(state["stream"])
        step, start_epoch = state["step"], state["epoch"] + 1
        rows.extend(state["result"]["epochs"])
        result.update({k: v for k, v in state["result"].items() if k != "epochs"})
        stop_at = cfg["stop_after_epochs"]
        if result.get("stopped_after_epoch") and (not stop_at or stop_at > state["epoch"]):
            result.update(accuracy=None, total_time_s=None, stopped_after_epoch=None)  # it goes on from here
            result.pop("steps_trained", None)
        elif result["accuracy"] is None and stop_at and stop_at <= state["epoch"]:
            raise ValueError(f"checkpoint {checkpoint} is already past epoch {stop_at} (it holds {state['epoch']}); "
                             "pass a larger --stop-after-epochs or 0")
        if "segments" not in state["result"]:  # saved before segments were recorded: that part's origin is unknown
            result["segments"] = [dict(first_epoch=1, hardware=None, commit=None, torch=None, compiled=None,
                                        started=None)]
        if result["accuracy"] is None:
            result["segments"] = result["segments"] + [dict(segment, first_epoch=state["epoch"] + 1)]
        timer(include_in_total=False)
        timer.total = state["timer_total"]
        log(f"resumed from {checkpoint} after epoch {state['epoch']} ({timer.total:.1f} s trained)")
        if kept_kernels:
            log(f"cpu-conv: {len(kept_kernels)} small-map conv shape(s) keep the kernels the run was tuned with, "
                "not this machine's choice, so that it computes as if uninterrupted (the log's cpu_conv_kernels)")
        for row in rows:  # so this invocation's table and TSV hold the whole run, not only what it trained
            if on_epoch:
                on_epoch(row)
        if result["accuracy"] is not None:  # that run had finished (or stopped where asked): its log has it
            log(f"{checkpoint} holds this run's result already: nothing trained")
            return dict(result, trained_nothing=True)
    for epoch in range(start_epoch, math.ceil(total_steps / per_epoch) + 1):
        if set_trains(model, trains_in(cfg, epoch)) and world > 1:
            step_fn = make_step_fn(cfg, model, world)  # DDP fixes the parameters it reduces when built: again
        size = train_size(cfg, epoch)
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device, dtype=torch.long)
        seen, stop, epoch_start = 0, False, timer.total
        model.train()
        if progress:
            progress.start(f"run {run_index} epoch {epoch}", min(per_epoch, total_steps - step))
        with tb.cuda_sync_debug(device, "error" if cfg["sync_check"] else None):
            for i in range(per_epoch):
                if step >= total_steps:
                    break
                lr = lr_at(step / per_epoch)
                set_lr(opt, lr)
                if history is not None:  # the global batch's choice, then this process's slice of it
                    x, y, idx = stream.next_chosen_batch(history, bs, rank * local_bs, (rank + 1) * local_bs)
                else:
                    x, y = stream.next_batch(rank * local_candidates, (rank + 1) * local_candidates)  # its slice
                x = tb.resize_images(x, size)
                if proxy is not None:
                    x, y = proxy.select(x, y, local_bs, lr, train=step % cfg["proxy_every"] == 0)
                out, loss = train_step(cfg, step_fn, opt, x, y, precision, device, scaler)
                if history is not None:
                    record_losses(history, idx, out, y, cfg["label_smoothing"], world)
                step += 1
                if progress:
                    progress.update(i + 1)
                loss_sum += loss.detach() * len(y)
                correct += (out.detach().argmax(1) == y).sum()
                seen += len(y)
                if 0 <= cfg["lookahead_start_epoch"] < epoch and step % cfg["lookahead_every"] == 0:
                    if lookahead is None:
                        lookahead = Lookahead(model)
                    else:  # average weakly early on and strongly at the end
                        decay = (cfg["lookahead_decay"] ** cfg["lookahead_every"]
                                 * (step / total_steps) ** cfg["lookahead_pow"])
                        lookahead.update(decay)
                if ema is not None and step % cfg["ema_every"] == 0:
                    ema.update()
                if cfg["eval_every_steps"] and step % cfg["eval_every_steps"] == 0:
                    with tb.cuda_sync_debug(device, "default" if cfg["sync_check"] else None):  # it reads its accuracy
                        stop = evaluate_during_epoch(cfg, model, data, precision, device, rank, world, timer, stream,
                                                     result, step, per_epoch, loss, ema)
                    if stop:
                        break
        if progress:
            progress.clear()
        if lookahead is not None and (cfg["lookahead_sync"] == "epoch" or step >= total_steps):
            lookahead.update(1.0)
        if proxy is not None:
            proxy.check()
        # and whether the net's state is finite: an update that overflowed at the epoch's last step leaves NaN
        # weights behind a finite loss, and a NaN net scores 10% (every argmax 0), not a divergence
        finite = torch.stack([t.isfinite().all() for t in model.state_dict().values() if t.is_floating_point()])
        totals = torch.stack([loss_sum, correct.float(), torch.tensor(float(seen), device=device),
                              finite.all().float()])
        if world > 1:
            torch.distributed.all_reduce(totals)
        train_loss, train_acc, finite_nets = torch.cat([totals[:2] / totals[2], totals[3:]]).tolist()  # one sync
        timer()
        epoch_time, trained = timer.total - epoch_start, timer.total
        truncated = step < total_steps and not stop and 0 < cfg["stop_after_epochs"] <= epoch
        last = step >= total_steps or stop or truncated
        if not math.isfinite(train_loss) or finite_nets < world:
            result.update(diverged=True, total_time_s=timer.total)
            rows.append(dict(run=run_index, epoch=epoch, lr=lr, train_loss=train_loss, train_acc=train_acc,
                             test_acc=float("nan"), epoch_time=epoch_time, total_time=timer.total,
                             fresh=stream.fresh_read))
            if on_epoch:
                on_epoch(rows[-1])
            # fp16's fixed loss scale skips no overflowing step: GradScaler's would
            fp16_hint = " or --loss-scale dynamic" if isinstance(scaler, tb.FixedLossScale) else ""
            what = (f"training loss is {train_loss}" if not math.isfinite(train_loss)
                    else "the net's weights or BN statistics are not finite")
            raise Diverged(f"run {run_index} (seed {seed}) diverged: {what} at epoch {epoch}; "
                           f"try a lower --lr-values or another --precision{fp16_hint}")
        test_acc = None
        if last or (cfg["eval_every"] and epoch % cfg["eval_every"] == 0):
            tta = cfg["tta"] if last else 0
            with evaluated_weights(ema):  # (on a CPU the final one, with TTA, can take minutes: a progress line)
                label = f"run {run_index} epoch {epoch} " + ("final evaluation" if last else "evaluation")
                test_acc = evaluate(model, data, evaluated_in(cfg, precision), device, tta, rank, world,
                                    cfg["tta_confidence"], progress, label)
            timer(include_in_total=last)  # only the final evaluation counts towards the time
        row = dict(run=run_index, epoch=epoch, lr=lr, train_loss=train_loss, train_acc=train_acc,
                   test_acc=test_acc if test_acc is not None else float("nan"), epoch_time=epoch_time,
                   total_time=timer.total, fresh=stream.fresh_read)
        rows.append(row)
        if on_epoch:
            on_epoch(row)
        if test_acc is not None and test_acc >= cfg["target"] and result["epoch_reached_target"] is None:
            result["epoch_reached_target"] = epoch
            if result["step_reached_target"] is None:  # else the step-level evaluation already timed it
                result.update(time_to_target_s=timer.total, fresh_to_target=row["fresh"])
            if cfg["stop_at_target"]:
                last = True
        if last:
            result.update(accuracy=test_acc, total_time_s=timer.total)
            if step < total_steps:  # stopped at the target (or cut short, below): its FLOPs are the steps it trained
                result["steps_trained"] = step
        if truncated:
            result.update(stopped_after_epoch=epoch, steps_trained=step)
        if checkpoint:
            tmp = checkpoint + ".tmp"
            torch.save(dict(cfg=cfg, seed=seed, precision=precision, data=fingerprint, model=model.state_dict(),
                            opt=opt.state_dict(), scaler=scaler.state_dict(),
                            lookahead=lookahead.avg if lookahead else None,
                            ema=ema.avg if ema is not None else None,
                            proxy=proxy.state_dict() if proxy is not None else None, history=history,
                            cpu_conv_kernels=tb.tuned_kernel_flags() if tuned_convs else None,
                            gen=gen.get_state(), stream=stream.state_dict(), step=step, epoch=epoch,
                            # a run stopped early goes on later without its final evaluation's time
                            timer_total=trained if truncated else timer.total, result=result), tmp)
            os.replace(tmp, checkpoint)
            timer(include_in_total=False)
        if last:
            break
    return result


def evaluate_during_epoch(cfg, model, data, precision, device, rank, world, timer, stream, result, step, per_epoch,
                          loss, ema=None):
    """An evaluation between steps (eval_every_steps), outside the timer. Returns True when the run should stop
    (target reached with stop_at_target). A non-finite loss ends the run as diverged at the next epoch end."""
    timer()
    with evaluated_weights(ema):
        acc = evaluate(model, data, evaluated_in(cfg, precision), device, 0, rank, world)
    timer(include_in_total=False)
    loss = loss.item()
    result["evals"].append(dict(step=step, epoch=step / per_epoch, fresh=stream.fresh_read, test_acc=acc,
                                train_loss=loss, time=timer.total))
    if not math.isfinite(loss):
        return True
    if acc >= cfg["target"] and result["step_reached_target"] is None:
        result.update(step_reached_target=step, time_to_target_s=timer.total, fresh_to_target=stream.fresh_read)
        return cfg["stop_at_target"]
    return False


def evaluated_in(cfg, precision):
    """The precision a run evaluates in (its test images are stored in it too): eval_precision, or the run's own
    (cfgs from before the option was added have none)."""
    return precision if cfg.get("eval_precision", "same") == "same" else cfg["eval_precision"]


def right_per_image(model, x, y, precision, device, tta, tta_confidence=0.0, on_batch=None):
    """Which of the images x the net gets right (bool per image), with the TTA a run evaluates with."""
    logits = tb.predict(model, x, precision, device, batch_size=EVAL_BATCH, tta=tta, tta_confidence=tta_confidence,
                        on_batch=on_batch)
    return logits.argmax(1) == y


def evaluate(model, data, precision, device, tta, rank=0, world=1, tta_confidence=0.0, progress=None, label=""):
    """Test accuracy; with several processes each scores every world-th image and the counts are summed.
    progress: a core.Progress shown per batch of test images under `label`, or None."""
    x, y = data["test_x"][rank::world], data["test_y"][rank::world]
    if progress:
        progress.start(label, math.ceil(len(y) / EVAL_BATCH))
    right = right_per_image(model, x, y, precision, device, tta, tta_confidence,
                            on_batch=progress.update if progress else None)
    if progress:
        progress.clear()
    correct = right.sum().float()
    if world > 1:
        torch.distributed.all_reduce(correct)
    return correct.item() / len(data["test_y"])


# ---------------------------------------------------------------------------------------------------------------
# Many runs, logs, summary

TABLE_COLUMNS = ["run", "epoch", "lr", "train_loss", "train_acc", "test_acc", "epoch_time", "total_time", "fresh"]


def summarise(cfg, results, hardware, precision, flops_per_step, steps, flops_per_run, commit, data=None,
              cpu_conv_kernels=None, started=None):
    """The JSON summary of a train() call; data: the dataset's fingerprint (sizes and checksums as loaded), which
    --from-log compares; cpu_conv_kernels: the kernels tuned for its small-map convs (tb.tuned_kernels); started:
    when the call began (UTC; the summary's own time, `written`, where not given)."""
    written = core.utc_timestamp()
    done = [r for r in results if r["accuracy"] is not None]
    acc_mean, acc_std = core.mean_std([r["accuracy"] for r in done])
    reached = [r for r in done if r["epoch_reached_target"] is not None]
    time_mean, time_std = core.mean_std([r["total_time_s"] for r in done])
    ttt_mean, ttt_std = core.mean_std([r["time_to_target_s"] for r in reached])
    return dict(
        preset=cfg["preset"], config={k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
        world_size=torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
        precision=precision, hardware=hardware, torch=torch.__version__, commit=commit, data_fingerprint=data,
        started=started or written, written=written,
        train_flops_per_step=flops_per_step, train_steps=steps, train_flops_per_run=flops_per_run, runs=results,
        accuracy_mean=acc_mean, accuracy_std=acc_std, runs_reaching_target=len(reached), runs_finished=len(done),
        total_time_mean_s=time_mean, total_time_std_s=time_std,
        time_to_target_mean_s=ttt_mean, time_to_target_std_s=ttt_std,
        **({"cpu_conv_kernels": cpu_conv_kernels} if cpu_conv_kernels is not None else {}))


def check_same_on_every_rank(cfg):
    """Every rank's config against rank 0's (a collective: call it on every rank): ranks given other options (a
    seed, epochs, batch size) trained on overlapping data, hung in a collective until its timeout, or failed
    deep in DDP with a traceback. A ValueError on every rank naming what differs."""
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, cfg)
    for rank, other in enumerate(everyone):
        differs = sorted(k for k in set(everyone[0]) | set(other) if everyone[0].get(k) != other.get(k))
        if differs:
            what = ", ".join(f"{k.replace('_', '-')} {everyone[0].get(k)!r} on rank 0, {other.get(k)!r} on rank "
                             f"{rank}" for k in differs)
            raise ValueError(f"the processes were given different options ({what}); start every rank with the "
                             "same command")


def check_runnable(cfg, n_train, device=None, world=1):
    """What train() refuses once it knows the data (n_train training images, before any holdout) and the device,
    as a ValueError: for the studies and benchmarks, which build runs of their own, to refuse before any work."""
    check_distributed(cfg, world)
    if device is not None:
        precision = tb.resolve_precision(cfg["precision"], device)
        if cfg["loss_scale"] != COMMON["loss_scale"] and precision != "fp16":  # (else silently no scaling)
            raise ValueError(f"loss-scale {cfg['loss_scale']} is for fp16; this run is {precision}")
    if cfg["holdout"] >= n_train:
        raise ValueError(f"holdout {cfg['holdout']} leaves none of the {n_train} training images to train on")
    left = n_train - cfg["holdout"]
    if cfg["echo"] != "none" and left * cfg["echo_factor"] > MAX_ECHO_ITEMS:  # (1e9 was killed, out of memory)
        raise ValueError(f"echo-factor {cfg['echo_factor']:g} makes each pass {left * cfg['echo_factor']:,.0f} "
                         f"echoed examples; at most {MAX_ECHO_ITEMS:,} fit in memory")
    if candidate_batch_size(cfg) > left:
        drawn = " (candidates for selection)" if cfg["select_fraction"] < 1 else ""
        held = f" left by holdout {cfg['holdout']}" if cfg["holdout"] else ""
        raise ValueError(f"batch size {candidate_batch_size(cfg)}{drawn} exceeds the {left} training images{held}")


def host_reads_by_design(cfg, precision):
    """What in a run's training steps reads values on the host, as designed (--sync-check refuses such a run)."""
    reads = []
    if cfg["echo"] != "none":
        reads.append(f"data echoing (--echo {cfg['echo']})")
    if cfg["echo_shuffle_buffer"]:
        reads.append("the shuffle buffer (--echo-shuffle-buffer)")
    if cfg["pipeline"] == "loader":
        reads.append("the loader pipeline (--pipeline loader)")
    if precision == "fp16" and cfg["loss_scale"] == "dynamic":  # GradScaler: an overflow flag every step
        reads.append("fp16's dynamic loss scale (--loss-scale dynamic)")
    return reads


def tune_cpu_convs(shapes, log=print):
    """Times both kernels of each small-map conv shape a run meets (tb.tune_small_map_convs, before the timer)
    and returns the choices for its log: {shape: kernel per pass}."""
    start = time.perf_counter()
    tb.tune_small_map_convs(shapes)
    kernels = tb.tuned_kernels(shapes)
    if shapes:
        took = [k for k, v in kernels.items() if "matmul" in v]
        log(f"cpu-conv tuned: {len(shapes)} small-map conv shapes timed both ways in "
            f"{time.perf_counter() - start:.1f} s (before the timer); the matmul wins for {len(took)} of them "
            "(the log's cpu_conv_kernels)")
    return kernels


def logged_cpu_conv(mode, device):
    """What a run's log says of --cpu-conv: on a CPU the kernels it took (auto resolved); elsewhere, where the
    option does nothing (PyTorch's kernels run), the option as given."""
    return tb.resolve_cpu_conv(mode) if device.type == "cpu" else mode


def train(preset=DEFAULT_PRESET, data=None, data_path=None, device=None, log=print, log_dir=None, checkpoint=None,
          progress=None, **overrides):
    """Runs one configuration (cfg['runs'] seeds) and returns the summary that is also written as JSON.

    data: numpy arrays as returned by torch_backend.load_cifar10 (else loaded from data_path, default
    $CIFAR10_DATA or ./data).
    log_dir: where the JSON summary and TSV table go (None: write nothing). Raises Diverged on a non-finite loss
    or net.
    checkpoint: save/resume path for a single long run (see run_once).
    progress: a core.Progress for the steps within each epoch; None: one on stderr if it is a terminal; False: none.
    Under torchrun every process calls this; only rank 0 prints and writes logs."""
    cfg = make_config(preset, **overrides)
    # Before joining the process group, on every rank: a bad combination, or a log folder that cannot be written
    # (no run may end on a log it cannot write), then fails each rank on its own; none waits for another.
    launched_world = int(os.environ.get("WORLD_SIZE", 1)) if "RANK" in os.environ else 1
    check_distributed(cfg, launched_world)
    if checkpoint and launched_world > 1:  # (before its folder is made)
        raise ValueError("--checkpoint is for single-process runs")
    if log_dir:
        core.writable_folder(log_dir, "log-dir")
    if checkpoint:
        os.makedirs(core.writable_folder(os.path.dirname(checkpoint) or ".", "checkpoint's folder"), exist_ok=True)
    rank, world, local_rank = parallel.init_distributed()
    if rank != 0:
        log, log_dir = (lambda *a: None), None
    if progress is None and rank == 0 and sys.stderr.isatty():
        progress = core.Progress(sys.stderr)
    if device is None and world > 1 and torch.cuda.is_available():
        device = f"cuda:{local_rank}"
    device = tb.resolve_device(device)
    cfg["cpu_conv"] = logged_cpu_conv(cfg["cpu_conv"], device)
    precision = tb.resolve_precision(cfg["precision"], device)
    if cfg["sync_check"] and device.type != "cuda":
        raise ValueError(f"sync-check is for CUDA devices (torch checks host synchronisation there), not {device}")
    reads = host_reads_by_design(cfg, precision) if cfg["sync_check"] else []
    if reads:
        raise ValueError(f"sync-check would stop the first step: {' and '.join(reads)} read from the host by design")
    if data is None:
        data = tb.load_cifar10(data_path or default_data_path())
    data = tb.validate(dict(data), "data")
    data_id = tb.dataset_fingerprint(data) if rank == 0 else None  # (0.1 s; only rank 0 writes logs)
    check_runnable(cfg, len(data["train_y"]), device, world)
    if world > 1:  # ranks started by hand (or on several nodes) with other options trained apart, or hung
        check_same_on_every_rank(dict({k: v for k, v in cfg.items() if k != "cpu_conv"},  # (each CPU its kernels)
                                      train_images=len(data["train_y"]), test_images=len(data["test_y"])))
    if cfg["holdout"]:  # a fixed split, the same for every run and seed
        order = np.random.default_rng(0).permutation(len(data["train_y"]))
        held, kept = order[:cfg["holdout"]], order[cfg["holdout"]:]
        data = dict(train_x=data["train_x"][kept], train_y=data["train_y"][kept],
                    test_x=data["train_x"][held], test_y=data["train_y"][held])
    if checkpoint and cfg["runs"] != 1:
        raise ValueError("--checkpoint resumes a single run; use it with --runs 1")
    if checkpoint and cfg["pipeline"] == "loader":
        raise ValueError("--checkpoint is not supported with --pipeline loader")
    on_device = tb.to_device(data, device, tb.DTYPES[precision], pad=cfg["pad"],
                             test_dtype=tb.DTYPES[evaluated_in(cfg, precision)])
    if cfg["pipeline"] == "loader":  # the loader pipeline starts from the encoded images, not the tensors
        on_device.update(raw_train_x=data["train_x"], raw_train_y=data["train_y"])
        pipeline.encode_pngs(data["train_x"])  # once, outside the timer (cached per array)
    hardware, commit = tb.device_name(device), core.git_commit()  # the code as it was when the run started
    started = core.utc_timestamp()  # the log's `started`; each rewrite of it stamps `written`
    if world > 1:
        hardware = f"{world} processes x {hardware}"

    # Warm-up outside the timer, on a throwaway net: a counted step at each image size (the run's FLOPs), then
    # a second at full size.
    warm = build_model(cfg, device, on_device["train_x"])
    with tb.recording_small_map_shapes() as conv_shapes:  # (the convs a tuned CPU run meets, timed below)
        flops_per_step, steps, flops_per_run = run_flops(cfg, warm, make_optimizer(cfg, warm), device, precision,
                                                         len(data["train_y"]))
        train_flops(warm, device, precision, cfg["batch_size"])
    del warm
    if cfg["cpu_conv"] == "tuned":
        tune_cpu_convs(conv_shapes, log)

    def summary_now():  # the JSON as it stands, after each run and at the end
        # (the kernels read at each write: a resumed run takes the choices its checkpoint holds)
        kernels = tb.tuned_kernels(conv_shapes) if cfg["cpu_conv"] == "tuned" else None
        return summarise(cfg, results, hardware, precision, flops_per_step, steps, flops_per_run, commit, data_id,
                         kernels, started)

    name = f"{cfg['preset']}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    tsv = json_path = None
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        base = name
        for k in itertools.count(2):  # two calls of train() within a second in one process: never the same log
            if not any(os.path.exists(os.path.join(log_dir, name + ext)) for ext in (".json", ".tsv")):
                break
            name = f"{base}-{k}"
        tsv = core.TsvLog(os.path.join(log_dir, name + ".tsv"), TABLE_COLUMNS)
        json_path = os.path.join(log_dir, name + ".json")
    table = core.Table(TABLE_COLUMNS, out=log)

    rows_logged, replayed = [], []

    def on_epoch(row):
        table.row(row)
        if tsv:
            tsv.row(row)
        rows_logged.append(row)

    results = []
    log(f"preset {cfg['preset']} | {hardware} | {precision} | torch {torch.__version__} | "
        f"{core.format_flops(flops_per_run)} training FLOPs per run")
    hint = tb.allocator_hint(device)
    if hint:
        log(hint)
    try:
        for r in range(cfg["runs"]):
            try:
                res = run_once(cfg, on_device, r, cfg["seed"] + r, device, precision, log=log, on_epoch=on_epoch,
                               checkpoint=checkpoint, rank=rank, world=world, progress=progress)
            except Diverged:
                results.append(dict(seed=cfg["seed"] + r, accuracy=None, epoch_reached_target=None,
                                    time_to_target_s=None, total_time_s=None, train_flops=None, diverged=True))
                raise
            res["train_flops"] = flops_per_run
            if res.get("steps_trained"):  # a run stopped early: only the steps it trained, counted on shapes alone
                meta = torch.device("meta")
                net = build_model(cfg, meta)
                res["train_flops"] = run_flops(cfg, net, make_optimizer(cfg, net), meta, "fp32",
                                               len(data["train_y"]), res["steps_trained"])[2]
            results.append(res)
            if res.pop("trained_nothing", False):  # a finished checkpoint: a second log would count it twice
                if json_path:
                    log("(no new log: the run's own log has it)")
                replayed.append(res)
                continue
            if json_path:  # rewritten after every run so a crash keeps the finished ones
                core.write_json_atomic(json_path, summary_now())
    except (KeyboardInterrupt, RuntimeError) as e:  # Ctrl-C, SIGTERM under main(), or a lost peer: say what is kept
        if isinstance(e, RuntimeError) and not parallel.lost_peer(e):
            raise
        if progress:  # (before the line below; the finally clears nothing then)
            progress.clear()
        kept = ""
        if json_path and rows_logged:
            kept = (f"; {len(results)} finished run(s) are in {json_path}, " if results else "; ") + \
                f"every epoch's row in {tsv.path}"
        if checkpoint and os.path.exists(checkpoint):
            log(f"interrupted: run {len(results)} stopped{kept}; the same command resumes it from {checkpoint}'s "
                "last epoch")
        else:
            what = "interrupted" if isinstance(e, KeyboardInterrupt) else "another process of the job failed"
            log(f"{what}: run {len(results)} in flight is lost{kept}")
        raise
    finally:
        if progress:  # (an interrupted epoch leaves its line)
            progress.clear()
        summary = summary_now()
        if tsv:
            tsv.close()
        # No log where nothing trained: a run refused before its first epoch (say a checkpoint of another
        # configuration), or one whose checkpoint had finished; an interrupted first run keeps its rows.
        if json_path and (len(results) > len(replayed) or (rows_logged and not results)):
            core.write_json_atomic(json_path, summary)
        elif tsv:
            os.remove(tsv.path)
            json_path = None
    summary["log_json"] = json_path
    return summary


def default_data_path():
    return os.environ.get("CIFAR10_DATA") or "./data"


def run_result(run):
    """One run's outcome as the summary states it."""
    if run.get("accuracy") is not None:
        return f"{100 * run['accuracy']:.2f}%"
    return "diverged" if run.get("diverged") else "no result"


def print_summary(s, log=print):
    n = s["runs_finished"]
    log(f"\n{s['preset']}: accuracy {core.format_mean_std(s['accuracy_mean'], s['accuracy_std'], n, 2, 100, '%')}"
        f" over {n} run{'s' if n != 1 else ''}; {s['runs_reaching_target']}/{n} reached "
        f"{100 * s['config']['target']:.1f}%")
    if len(s["runs"]) > 1:  # which seed gave which result, so that one can be rerun or compared alone
        log("per seed: " + ", ".join(f"{r['seed']}: {run_result(r)}" for r in s["runs"]))
    done = [r for r in s["runs"] if r.get("accuracy") is not None]
    stopped = sorted({r["stopped_after_epoch"] for r in done if r.get("stopped_after_epoch")})
    flops = f"training FLOPs {core.format_flops(s['train_flops_per_run'])} per run"
    if stopped:
        log(f"(stopped after epoch {', '.join(map(str, stopped))} of {s['config']['epochs']:g} by "
            "--stop-after-epochs: accuracy and time are those of a run cut short, not of the full schedule)")
        trained = [r["train_flops"] for r in done if r.get("train_flops") is not None]
        if trained:  # what the runs trained, not the schedule's (a checkpoint's replayed result has no count)
            flops = (f"training FLOPs {core.format_flops(sum(trained) / len(trained))} per run trained "
                     f"(the full schedule: {core.format_flops(s['train_flops_per_run'])})")
    log(f"time: {core.format_mean_std(s['total_time_mean_s'], s['total_time_std_s'], n, 1)} s per run"
        + (f", to target {s['time_to_target_mean_s']:.1f} s" if s["runs_reaching_target"] else "")
        + f"; {flops}; {s['hardware']}, {s['precision']}")
    if s.get("log_json"):
        log(f"log: {s['log_json']}")


# ---------------------------------------------------------------------------------------------------------------
# Rerunning a logged run (--from-log): its whole recipe from the log, and the result set beside the logged one.

def config_from_log(path):
    """(preset, options, log, predated): the options that rerun the runs a train_cifar.py log records, its
    seeds included. A log older than some of today's options gets what its runs ran with where that is certain
    (core.PREDATED_VALUES), else COMMON's defaults, and names in predated those that could make the rerun differ
    (not core.PREDATED_UNUSED's); one with an option today's code lacks cannot be rerun here (ValueError naming its
    commit)."""
    log = core.read_run_log(path)  # (its runs checked there: each a seed, and epoch rows)
    if not isinstance(log.get("config") or {}, dict):  # (else a traceback after the rerun trained)
        raise ValueError(f"{path}: not a train_cifar.py log (its config is no object)")
    fingerprint = log.get("data_fingerprint")  # (none in logs before 2026-12-05; an edited one compared nothing)
    if fingerprint is not None and not (
            isinstance(fingerprint, dict) and set(fingerprint) == {"train_x", "train_y", "test_x", "test_y"}
            and all(isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)
                    for v in fingerprint.values())):
        raise ValueError(f"{path}: its data_fingerprint is not one train_cifar.py writes (a size and a checksum "
                         "for each of train_x, train_y, test_x, test_y)")
    logged = dict(log.get("config") or {})
    preset = logged.pop("preset", log["preset"])
    if preset not in PRESETS or not logged:
        raise ValueError(f"{path}: cannot rerun a log of preset {preset!r} without its config")
    logged = core.with_predated_values(logged)  # (what it ran with, known: no guess to warn of)
    options = set(COMMON) | set(PRESETS[preset])
    gone = sorted(set(logged) - options)
    if gone:
        raise ValueError(f"{path} sets {', '.join(gone)}, which this code no longer has; to rerun it, check out "
                         f"its commit {str(log.get('commit'))[:12]}")
    absent = options - set(logged)
    logged.update({k: COMMON[k] for k in absent if k in COMMON})
    missing = sorted(k for k in absent if k not in COMMON)
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}: not a complete config")
    options = core.as_tuples(logged)
    make_config(preset, **options)  # a value of the wrong kind: its error now, not a traceback later
    return preset, options, log, sorted(absent - set(core.PREDATED_UNUSED))


def describe_rerun(log_path, logged, preset, options, overrides, predated):
    """What --from-log prints before it trains: the log's provenance and what this rerun changes or lacks."""
    first, last = overrides["seed"], overrides["seed"] + overrides["runs"] - 1
    seeds = f"{first}-{last}" if last > first else f"{first}"
    lines = [f"rerunning {log_path}: preset {preset}, seed(s) {seeds}; logged on {logged.get('hardware')}, "
             f"torch {logged.get('torch')}, commit {str(logged.get('commit'))[:12]} (this code: "
             f"{str(core.git_commit())[:12]})"]
    changed = core.differing_keys([options, overrides])
    if changed:
        lines.append("changed from the log: " + ", ".join(
            f"--{k.replace('_', '-')} {as_flag_value(overrides[k])} (logged {as_flag_value(options[k])})"
            for k in changed))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if logged.get("world_size", 1) != world:
        lines.append(f"the log ran {logged.get('world_size', 1)} processes, this {world}: the runs may differ")
    if predated:
        lines.append(f"the log predates {', '.join('--' + k.replace('_', '-') for k in predated)}: they take "
                     "their defaults, so the rerun may differ")
    return lines


def data_differs(logged, now):
    """The arrays (train_x, ...) whose size or checksum differ between a log's data fingerprint and this run's;
    empty where either has none."""
    if not isinstance(logged, dict) or not now:
        return []
    return [k for k in now if logged.get(k) != now[k]]


def data_note(differing):
    return (f"this run's data are not the log's ({', '.join(differing)} differ: other images, or the same in "
            "another order, e.g. from another copy of CIFAR-10): the runs are not expected to match")


def describe_reproduction(report, log_path):
    """One line per run of core.reproduction_report."""
    lines = []
    for r in report:
        if not r["epochs"]:
            lines.append(f"seed {r['seed']}: {log_path} holds no epochs of this seed to compare with")
            continue
        if r["first_difference"] is None and r["cut_short"]:
            what = (f"identical to the log over its {r['epochs']} epoch(s), bit for bit (it stopped early: its "
                    "last evaluation, the final one, has no logged counterpart)")
        elif r["first_difference"] is None:
            what = f"identical to the log over {r['epochs']} epoch(s), training loss and test accuracy bit for bit"
        else:
            what = (f"differs from the log from epoch {r['first_difference']} on (training loss by up to "
                    f"{r['max_loss_difference']:.2g} over {r['epochs']} epoch(s))")
        if r["logged_accuracy"] is not None and r["accuracy"] is not None:
            what += (f"; accuracy {100 * r['accuracy']:.2f}% against {100 * r['logged_accuracy']:.2f}% logged "
                     f"({100 * (r['accuracy'] - r['logged_accuracy']):+.2f} points)")
        lines.append(f"seed {r['seed']}: {what}")
    return lines


# ---------------------------------------------------------------------------------------------------------------
# Command line: every hyper-parameter of the chosen preset can be overridden.

def str2bool(s):
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the whole usage
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def as_flag_value(value):
    """A config value as the command line takes it, for --help."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value)) if value else "(none)"
    return str(value)


# What each option means, for --help (its value in the chosen preset is shown above it). Every config key has
# one (tests/test_train.py), so a new option cannot reach the command line unexplained.
OPTION_HELP = dict(
    # The run
    runs="runs in this invocation, seeds seed, seed+1, ... (the summary gives mean ± std over them)",
    seed="seed of the first run (the net's init, data order and augmentation all follow from it)",
    target="test accuracy a run is judged against (time_to_target, runs reaching it)",
    stop_at_target="end a run at the first evaluation that reaches the target (for studies)",
    stop_after_epochs="end each run after this many epochs of its schedule (0: all; with --checkpoint, resume later)",
    eval_every="evaluate on the test set every this many epochs, untimed (0: only at the end)",
    eval_every_steps="also evaluate every this many steps (0: never); results in the log's runs[i][\"evals\"]",
    holdout="evaluate on this many held-out training images instead of the test set (0: the test set)",
    precision="auto (bf16 where the device runs it fast, fp16 on older GPUs, else fp32), fp32, bf16 or fp16",
    loss_scale="fp16: batch (fixed, the batch size rounded to a power of 2), dynamic (GradScaler) or a number",
    compile="torch.compile the training step (compilation is outside the timer)",
    compile_mode="torch.compile mode: default, reduce-overhead (CUDA graphs), max-autotune(-no-cudagraphs)",
    sync_check="CUDA: fail on any host synchronisation inside the training steps (the loop never waits on the GPU)",
    cpu_conv="CPU bf16 conv kernels: auto/tuned (the faster per small-map conv, timed first), matmul or onednn",
    # The net
    net="resnet9, resnet9_tricks, preact_resnet18, preact_resnet18_dup or fastnet",
    widths="channels of each block (fastnet: 3, the others: 4; none: the net's own)",
    block_depth="fastnet: convs per block, 2 or 3 (3: the last two inside a residual, as airbench96)",
    bn_momentum="fastnet: BatchNorm momentum in PyTorch's convention (the weight of the new batch)",
    bn_group_size="ghost batch norm: normalise each group of this many images on its own (0: the whole batch)",
    whiten_bias_epochs="fastnet: train the whitening conv's bias for the first this many epochs only (0: always)",
    block_epochs="fastnet: train block i for its first this many epochs only, then freeze it (0: always)",
    whiten_bias_fast="fastnet: the whitening bias trains with the BN biases at bias-lr-scale (else at the plain LR)",
    # Optimisation
    epochs="epochs of training (may be fractional); the preset's lr-knots stretch with it unless --lr-knots is given",
    batch_size="images per step (over all processes together)",
    lr_knots="epochs at which the piecewise-linear LR schedule has its knots",
    lr_values="the LR at each knot (SGD on the batch-mean loss)",
    momentum="momentum of SGD (and of the non-filter parameters under muon or lars)",
    nesterov="Nesterov momentum",
    weight_decay="L2 coefficient, PyTorch's (decay per step is LR x weight decay)",
    bias_lr_scale="BN biases take this times the LR and 1/this times the weight decay",
    label_smoothing="label smoothing of the cross-entropy loss",
    optimizer="sgd, lars (layer-wise trust ratios, for large batches) or muon (orthogonalised conv updates)",
    muon_lr_scale="muon: the conv filters' LR as a multiple of the schedule's",
    muon_momentum="muon: the conv filters' momentum",
    muon_norm="muon: each filter's norm held at initial (its own), sqrt_out (sqrt(out channels)) or none",
    muon_ns_steps="muon: Newton-Schulz steps per update",
    trust_coefficient="lars: the trust coefficient (the update's size relative to the weight's norm)",
    lr_scaling="scale the LR for batch sizes other than reference-batch-size: none, linear or sqrt",
    reference_batch_size="the batch size the LR schedule was tuned at (0: the preset's own)",
    warmup_epochs="rise linearly from LR 0 over this many epochs into the schedule (0: none)",
    lookahead_start_epoch="lookahead from this epoch on: the net pulled towards a slow average (-1: off)",
    lookahead_every="lookahead: steps between pulls",
    lookahead_decay="lookahead: the average's decay per step (to the power lookahead-every per pull)",
    lookahead_pow="lookahead: the decay is scaled by (step / total steps) to this power",
    lookahead_sync="lookahead: copy the average into the net at every epoch end (epoch) or at the end only (end)",
    ema_every="evaluate a moving average of the weights, updated every this many steps (0: off)",
    ema_decay="the moving average's decay per step (to the power ema-every per update)",
    # Data
    flip="horizontal flips: random, alternate (each image flipped on alternate epochs) or none",
    pad="random translation: crops from images reflect-padded by this many pixels",
    cutout="side of a square zeroed at a random place in each training image (0: none)",
    color_jitter="brightness B, contrast C: each training image x -> (x + b) * c, |b| <= B, |c - 1| <= C (0 0: none)",
    train_sizes="progressive resizing: the training images' side in each epoch, the last repeating (not set: 32)",
    tta="test-time augmentation: 0 none, 1 with the mirror, 2 both also shifted by a pixel (6 views)",
    tta_confidence="run the extra TTA views only on images predicted below this probability (0: on every one)",
    eval_precision="evaluate the net and test images in the run's precision (same) or in fp32",
    select_fraction="data selection: train on this fraction of each step's candidates, the hardest (1: off)",
    select_by="data selection scores candidates by a proxy net's loss (proxy) or their own last loss (loss)",
    proxy_widths="data selection: the proxy fastnet's three widths",
    proxy_every="data selection: the proxy takes a training step every this many steps",
    pipeline="device (batched augmentation on the device) or loader (per-image DataLoader workers)",
    loader_workers="pipeline loader: DataLoader worker processes",
    echo="data echoing: none, example-before-aug, example-after-aug or batch",
    echo_factor="data echoing: how often each item is repeated on average (1: no echoing)",
    echo_shuffle_buffer="data echoing: stream the echoed items through a shuffle buffer of this many (0: none)",
    # Many processes (torchrun)
    sync_bn_group_size="batch-norm statistics over groups of this many processes (0: each process its own)",
    allreduce="gradient sums: flat (DDP's) or hierarchical (within groups, then across them)",
    allreduce_group_size="hierarchical: processes per group (0: the processes on a node)",
)


def parse_args(argv):
    # --help lists each option with its value in the chosen preset (the default one unless --preset names another)
    chosen = argparse.ArgumentParser(add_help=False)
    chosen.add_argument("--preset", default=DEFAULT_PRESET, help="only to pick the values --help shows")
    preset = chosen.parse_known_args(argv)[0].preset
    values = dict(COMMON, **PRESETS.get(preset, PRESETS[DEFAULT_PRESET]))  # (an unknown preset fails below)
    p = Parser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter,
               epilog=f"The value after each option is {preset}'s; `--preset NAME --help` shows another "
                      f"preset's.\nPresets: {', '.join(PRESETS)}")
    p.add_argument("--preset", default=None, choices=list(PRESETS),
                   help=f"the recipe (README: Presets), default {DEFAULT_PRESET}; the options below override it")
    p.add_argument("--from-log", default=None, metavar="LOG.json",
                   help="rerun the runs a log records (its preset, options and seeds; the options below override\n"
                        "them) and compare each with the logged run of its seed, epoch by epoch")
    p.add_argument("--data", default=None, help="CIFAR-10 .npz, tarball or folder (default: $CIFAR10_DATA or ./data)")
    p.add_argument("--log-dir", default="logs", help="where the JSON summary and TSV table go ('' for none)")
    tb.add_device_option(p)
    p.add_argument("--checkpoint", default=None,
                   help="save the run after every epoch and resume from this file if it exists (--runs 1)")
    for k in OPTION_HELP:  # in its order, related options together (the run, precision, the net, the schedule, ...)
        example = next(cfg[k] for cfg in [COMMON, *PRESETS.values()] if k in cfg)
        flag = "--" + k.replace("_", "-")
        shown = f"{preset}: {as_flag_value(values[k])}\n{OPTION_HELP[k]}".replace("%", "%%")  # argparse formats %
        if isinstance(example, bool):
            kind = dict(type=str2bool, metavar="BOOL")
        elif isinstance(example, (tuple, list)):
            kind = dict(type=int if k.endswith(("widths", "sizes", "epochs")) else float, nargs="+")
        elif k == "epochs" or isinstance(example, float):
            kind = dict(type=float)
        else:
            kind = dict(type=int if isinstance(example, int) else str)
        p.add_argument(flag, default=None, help=shown, **kind)
    return p, p.parse_args(argv)


def run_options(args):
    """(preset, overrides, rerun) of parsed command-line options: the run's preset and every option given (with
    --from-log, the log's config under them; --data among them); rerun is None, or --from-log's (log, the
    log's options, the options it predates)."""
    not_options = ("preset", "log_dir", "device", "checkpoint", "from_log")
    overrides = core.as_tuples({k: v for k, v in vars(args).items() if k not in not_options and v is not None})
    rerun = None
    if args.from_log:
        if args.preset:
            raise ValueError("--from-log takes the preset its log names; leave --preset out")
        preset, options, logged, predated = config_from_log(args.from_log)
        overrides, rerun = dict(options, **overrides), (logged, options, predated)
    else:
        preset = args.preset or DEFAULT_PRESET
    cfg = make_config(preset, **{k: v for k, v in overrides.items() if k != "data"})
    # (a preset's or a log's own values are left alone: only what this command line gives)
    check_given(cfg, [k for k in ONLY_WITH if getattr(args, k) is not None])
    return preset, overrides, rerun


def check_given(cfg, given, as_set=False):
    """Refuses options given (names) that have no effect in cfg, as ONLY_WITH says; as_set: named as a study's or
    benchmark's --set KEY= rather than as train_cifar's --key."""
    for key in given:
        takes_effect, needs = ONLY_WITH.get(key, (None, None))
        if takes_effect and not takes_effect(cfg):
            raise ValueError(f"{f'--set {key}=' if as_set else '--' + key.replace('_', '-')} has no effect "
                             f"without {needs}")


# Options that do nothing unless another option is set: given on the command line without it, an error, not a
# run that silently ignores them. (takes effect?, what it needs)
ONLY_WITH = dict(
    trust_coefficient=(lambda c: c["optimizer"] == "lars", "--optimizer lars"),
    **{k: (lambda c: c["optimizer"] == "muon", "--optimizer muon")
       for k in ("muon_lr_scale", "muon_momentum", "muon_norm", "muon_ns_steps")},
    reference_batch_size=(lambda c: c["lr_scaling"] != "none", "--lr-scaling linear or sqrt"),
    allreduce_group_size=(lambda c: c["allreduce"] == "hierarchical", "--allreduce hierarchical"),
    loader_workers=(lambda c: c["pipeline"] == "loader", "--pipeline loader"),
    select_by=(lambda c: c["select_fraction"] < 1, "--select-fraction below 1"),
    **{k: (uses_proxy, "--select-fraction below 1 and --select-by proxy") for k in ("proxy_widths", "proxy_every")},
    **{k: (lambda c: c["lookahead_start_epoch"] >= 0, "--lookahead-start-epoch 0 or later")
       for k in ("lookahead_every", "lookahead_decay", "lookahead_pow", "lookahead_sync")},
    ema_decay=(lambda c: c["ema_every"] > 0, "--ema-every above 0"),
    compile_mode=(lambda c: c["compile"], "--compile true"),
    tta_confidence=(lambda c: c["tta"] > 0 or not c["tta_confidence"], "--tta 1 or 2"),
)


def main(argv=None):
    parser, args = parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):  # each row as it comes, also into a file (nohup ... > run.log)
        sys.stdout.reconfigure(line_buffering=True)
    logged = None
    rank0 = int(os.environ.get("RANK", 0)) == 0  # torchrun sets RANK; only rank 0 reports
    try:
        preset, overrides, rerun = run_options(args)
        data_path, data = overrides.pop("data", None), None
        if rerun:
            logged, options, predated = rerun
            for line in describe_rerun(args.from_log, logged, preset, options, overrides, predated) if rank0 else []:
                print(line)
            # the data compared before the rerun trains (a fast96 rerun takes hours), not after
            data = tb.load_cifar10(data_path or default_data_path())
            other = data_differs(logged.get("data_fingerprint"), tb.dataset_fingerprint(data)) if rank0 else []
            if other:
                print(f"note: {data_note(other)}")
        with core.sigterm_as_interrupt():  # kill (SIGTERM) stops a run as Ctrl-C does: the log written, one line
            summary = train(preset, data=data, data_path=data_path, device=args.device,
                            log_dir=args.log_dir or None, checkpoint=args.checkpoint, **overrides)
        if torch.distributed.is_initialized():
            # A rank that tears its connections down while another still reads them can make gloo abort that
            # one (SIGABRT): after a run, wait until every rank is done before any closes. After an error the
            # others may be gone, so no wait there.
            torch.distributed.barrier()
    except (ValueError, tb.DataError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    except Diverged as e:
        parser.exit(1, f"{parser.prog}: {e}\n")
    except KeyboardInterrupt:
        parser.exit(130, f"{parser.prog}: interrupted\n")  # (exit_with makes it 143 where SIGTERM stopped it)
    except RuntimeError as e:  # another rank died or hung: one line, not gloo's traceback from inside backward()
        if not parallel.lost_peer(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        parser.exit(1, f"{parser.prog}: error: another process of the job failed or stopped ({first})\n")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if rank0:
        print_summary(summary)
        if logged:
            summary["reproduces"] = dict(log=args.from_log, runs=core.reproduction_report(summary["runs"],
                                                                                          logged["runs"]))
            print(f"\nagainst {args.from_log}:")
            other = data_differs(logged.get("data_fingerprint"), summary.get("data_fingerprint"))
            if other:  # (logs before 2026-12-05 have no fingerprint: nothing to compare)
                summary["reproduces"]["data_differs"] = other
                print(f"  note: {data_note(other)}")
            for line in describe_reproduction(summary["reproduces"]["runs"], args.from_log):
                print("  " + line)
            if summary.get("log_json"):  # the comparison goes into the new log too
                core.write_json_atomic(summary["log_json"], {k: v for k, v in summary.items() if k != "log_json"})
    return summary


if __name__ == "__main__":
    core.exit_with(main)
