"""Where training batches come from: the stream of (example, augmentation) pairs that feeds the trainer, with
data echoing (Choi et al. 2019, "Faster Neural Network Training with Data Echoing").

Upstream work (reading, decoding, shuffling, augmenting) produces fresh examples; when it is slower than the
training step, echoing repeats its outputs so the accelerator never idles. Echoing only reorders and repeats
indices here: what a batch holds is decided by `items` (example indices) and `aug_ids` (which augmentation
draw each item uses). Items that share an aug id are identical copies.
"""
import math
import weakref

import numpy as np
import torch
import torch.utils.data

import torch_backend as tb

ECHO_MODES = ("none", "example-before-aug", "example-after-aug", "batch")


def echo_repeats(n, factor, generator, device=None):
    """How often each of n items is repeated: floor(factor) or ceil(factor), the latter with probability
    factor - floor(factor), so a non-integer factor is met on average."""
    if factor < 1:
        raise ValueError(f"echo factor must be >= 1, got {factor}")
    base, frac = math.floor(factor), factor - math.floor(factor)
    if not frac:
        return torch.full((n,), base, dtype=torch.long, device=device)
    extra = torch.rand(n, generator=generator, device=device) < frac
    return base + extra.long()


def shuffle_buffer_order(n, size, generator):
    """The output order of a shuffle buffer of `size` items fed items 0..n-1: once full, each new item replaces
    a random resident, which is emitted; the residents are emitted in random order at the end. Every item
    comes out exactly once, no earlier than `size` positions before it went in."""
    if size <= 1 or n <= 1:
        return torch.arange(n)
    out, buffer = [], []
    picks = torch.randint(0, size, (max(n - size, 0),), generator=generator, device=generator.device).tolist()
    for i in range(n):
        if len(buffer) < size:
            buffer.append(i)
            continue
        j = picks[i - size]
        out.append(buffer[j])
        buffer[j] = i
    tail = torch.randperm(len(buffer), generator=generator, device=generator.device).tolist()
    out.extend(buffer[t] for t in tail)
    return torch.tensor(out, dtype=torch.long)


def echo_pass(fresh, mode, factor, batch_size, generator):
    """One upstream pass of `fresh` example indices, echoed. Returns (items, aug_ids, is_first), where
    is_first marks the first appearance of each fresh example in the echoed (pre-shuffle) stream.

    example-before-aug: each example is repeated and every copy gets its own augmentation;
    example-after-aug: the augmented example is repeated (copies share the augmentation);
    batch: whole batches of fresh examples are repeated (copies share everything)."""
    if mode not in ECHO_MODES:
        raise ValueError(f"unknown echo mode {mode!r}; choose one of {', '.join(ECHO_MODES)}")
    n, device = len(fresh), fresh.device
    if mode == "none" or factor == 1:
        return fresh, torch.arange(n, device=device), torch.ones(n, dtype=torch.bool, device=device)
    if mode == "batch":
        n_batches = n // batch_size  # whole batches only, so echoed batches stay whole downstream
        repeats = echo_repeats(n_batches, factor, generator, device)
        order = torch.arange(n_batches, device=device).repeat_interleave(repeats)
        positions = (order[:, None] * batch_size + torch.arange(batch_size, device=device)).flatten()
        first = torch.ones_like(order, dtype=torch.bool)
        first[1:] = order[1:] != order[:-1]
        return fresh[positions], positions, first.repeat_interleave(batch_size)
    r = echo_repeats(n, factor, generator, device)
    items = fresh.repeat_interleave(r)
    source = torch.arange(n, device=device).repeat_interleave(r)
    first = torch.ones_like(source, dtype=torch.bool)
    first[1:] = source[1:] != source[:-1]
    aug_ids = torch.arange(len(items), device=device) if mode == "example-before-aug" else source
    return items, aug_ids, first


class BatchStream:
    """The device pipeline: global batches drawn from an endless sequence of upstream passes, each a fresh
    shuffle of the training set, echoed and optionally shuffled through a buffer, and augmented as whole
    batches on the device (torch_backend.augment) from the normalised, padded training set kept there.

    Without echoing a pass is an epoch, with the same random draws in the same order as a plain shuffled
    epoch, and a pass's last incomplete batch is dropped. `fresh_read` counts the fresh examples upstream has
    delivered so far (a shuffle buffer reads `echo_shuffle_buffer` items ahead of what it emits)."""

    STATE = ("base_flip", "passes", "fresh_before_pass", "pos", "items", "aug", "first_cum")

    def __init__(self, data, cfg, generator, device):
        """data: train_x (N, H+2p, W+2p, C) on the device and train_y, as torch_backend.to_device makes them."""
        n_train = len(data["train_y"])
        self.data, self.n, self.cfg, self.gen, self.device = data, n_train, cfg, generator, device
        self.mode, self.factor = cfg.get("echo", "none"), cfg.get("echo_factor", 1.0)
        self.buffer = cfg.get("echo_shuffle_buffer", 0)
        self.base_flip = torch.randint(0, 2, (n_train,), generator=generator, device=device).bool()
        self.passes, self.fresh_before_pass, self.pos = 0, 0, 0
        self.items = self.aug = self.first_cum = None

    def state_dict(self):
        return {k: getattr(self, k) for k in self.STATE}

    def load_state_dict(self, state):
        for k in self.STATE:
            setattr(self, k, state[k])

    def _new_pass(self):
        cfg, gen = self.cfg, self.gen
        # a dropped incomplete last batch was never read; counted on the device (a 0-d tensor after the first
        # pass): reading it here would make the first step of every pass wait for the GPU (--sync-check)
        self.fresh_before_pass = self._fresh_count()
        self.passes += 1
        fresh = torch.randperm(self.n, generator=gen, device=self.device)
        items, aug_ids, first = echo_pass(fresh, self.mode, self.factor, cfg["batch_size"], gen)
        if self.buffer:
            order = shuffle_buffer_order(len(items), self.buffer, gen).to(self.device)
            items, aug_ids = items[order], aug_ids[order]
        draws = tb.draw_augmentation(self._augmentations(items), cfg["pad"], cfg["cutout"], cfg["flip"] == "random",
                                     gen, self.device, jitter=cfg.get("color_jitter", (0.0, 0.0)))
        self.aug = {k: v[aug_ids] for k, v in draws.items()}
        if cfg["flip"] == "alternate":  # each image's flip is random once, then alternates every pass
            self.aug["flip"] = self.base_flip[items] ^ bool((self.passes - 1) % 2)
        self.items, self.first_cum, self.pos = items, torch.cumsum(first.long(), 0), 0

    def _augmentations(self, items):
        """How many augmentations a pass draws (its aug_ids' max + 1), known on the host: reading the max from
        the device would make every pass's first step wait for the GPU."""
        if self.mode == "none" or self.factor == 1 or self.mode == "example-after-aug":
            return self.n
        if self.mode == "batch":
            return self.n // self.cfg["batch_size"] * self.cfg["batch_size"]
        return len(items)  # example-before-aug: one per copy

    def next_indices(self):
        """The next global batch as (example indices, augmentation parameters)."""
        bs = self.cfg["batch_size"]
        if self.items is None or self.pos + bs > len(self.items):
            self._new_pass()
        sl = slice(self.pos, self.pos + bs)
        self.pos += bs
        return self.items[sl], {k: v[sl] for k, v in self.aug.items()}

    def next_chosen_batch(self, scores, keep, lo=0, hi=None):
        """Data selection by a score per example (train_cifar's loss history): of the next global batch of
        candidates, the `keep` with the highest scores[index]; the rest are dropped before augmentation. Returns
        images, labels and indices of rows lo:hi of the chosen batch (a process's slice under torchrun)."""
        idx, aug = self.next_indices()
        chosen = scores[idx].topk(keep, sorted=False).indices[lo:hi]
        idx = idx[chosen]
        return *self._augmented(idx, {k: v[chosen] for k, v in aug.items()}), idx

    def _augmented(self, idx, aug):
        """Images and labels of these examples under these augmentation parameters."""
        return tb.augment(self.data["train_x"], idx, aug, cutout=self.cfg["cutout"]), self.data["train_y"][idx]

    def next_batch(self, lo=0, hi=None):
        """Images and labels of rows lo:hi of the next global batch (a process's slice under torchrun)."""
        idx, aug = self.next_indices()
        sl = slice(lo, hi)
        return self._augmented(idx[sl], {k: v[sl] for k, v in aug.items()})

    def _fresh_count(self):
        """fresh_read without reading the device: an int before the first pass, else a 0-d tensor."""
        if self.items is None:
            return 0
        read_up_to = min(self.pos + self.buffer, len(self.items))
        return self.fresh_before_pass + (self.first_cum[read_up_to - 1] if read_up_to else 0)

    @property
    def fresh_read(self):
        """(A read on the host: outside the training steps only.)"""
        return int(self._fresh_count())


# ---------------------------------------------------------------------------------------------------------------
# The loader pipeline: the classic one. Training images are kept PNG-encoded in memory and decoded and augmented
# one sample at a time in torch.utils.data.DataLoader worker processes; the echo stage sits in the trainer's
# process, after the workers (or, for example-before-aug, between decoding and augmentation).

_PNG_BY_ID = {}      # id(array) -> (weak reference to the array, EncodedImages)
_PNG_BY_CONTENT = {}  # digest of the pixels -> EncodedImages, the last few data sets


class EncodedImages:
    """PNG files of N images in one flat byte buffer (blob[offsets[i]:offsets[i + 1]] is image i).

    One numpy buffer instead of N bytes objects: forked DataLoader workers share it without copying pages
    (Python refcounts on N small objects would touch, and so copy, every page)."""

    def __init__(self, images_nhwc_uint8):
        import io

        from PIL import Image
        files = []
        for img in images_nhwc_uint8:
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="PNG")
            files.append(buf.getvalue())
        self.offsets = np.zeros(len(files) + 1, dtype=np.int64)
        self.offsets[1:] = np.cumsum([len(f) for f in files])
        self.blob = np.frombuffer(b"".join(files), dtype=np.uint8)
        self.shape = images_nhwc_uint8.shape[1:]

    def __len__(self):
        return len(self.offsets) - 1

    def decode(self, i):
        """Image i as an (H, W, C) uint8 array."""
        import io

        from PIL import Image
        with Image.open(io.BytesIO(self.blob[self.offsets[i]:self.offsets[i + 1]].tobytes())) as im:
            return np.asarray(im.convert("RGB"))


def encode_pngs(images_nhwc_uint8, keep=2):
    """EncodedImages for these images, cached for the life of the process, so several runs (and a warm-up
    outside a timer) encode a training set once: by array object, else by a digest of the pixels (a copy of
    the same images, as train() makes for a held-out split, is found in a fraction of a second)."""
    import hashlib
    x = images_nhwc_uint8
    hit = _PNG_BY_ID.get(id(x))
    if hit is not None and hit[0]() is x:
        return hit[1]
    digest = (x.shape, hashlib.sha1(memoryview(np.ascontiguousarray(x)).cast("B")).hexdigest())
    encoded = _PNG_BY_CONTENT.pop(digest, None) or EncodedImages(x)
    _PNG_BY_CONTENT[digest] = encoded  # most recent last
    while len(_PNG_BY_CONTENT) > keep:
        del _PNG_BY_CONTENT[next(iter(_PNG_BY_CONTENT))]
    for key in [k for k, (ref, _) in _PNG_BY_ID.items() if ref() is None]:
        del _PNG_BY_ID[key]
    _PNG_BY_ID[id(x)] = (weakref.ref(x), encoded)
    return encoded


def reflect_index(size, pad):
    """Source row (or column) of each of the size + 2*pad rows of a reflect-padded image (torch's 'reflect',
    numpy's 'reflect': the edge is not repeated)."""
    i = np.abs(np.arange(-pad, size + pad))
    return np.where(i > size - 1, 2 * (size - 1) - i, i)


def _normalisation():
    """The constants torch_backend.to_device uses, computed the same way (float32), so results match bit for bit."""
    return (torch.tensor(tb.CIFAR_MEAN) * 255).numpy(), (torch.tensor(tb.CIFAR_STD) * 255).numpy()


def draw_augmentation_np(rng, n, pad, cutout, flip, size=32):
    """torch_backend.draw_augmentation's distributions, drawn with a numpy Generator (in a worker)."""
    def randint(high):
        return rng.integers(0, high, n, dtype=np.int64)
    zeros = np.zeros(n, dtype=np.int64)
    return dict(dy=randint(2 * pad + 1) if pad else zeros, dx=randint(2 * pad + 1) if pad else zeros,
                flip=(randint(2).astype(bool) if flip else zeros.astype(bool)),
                cy=randint(size - cutout + 1) if cutout else zeros, cx=randint(size - cutout + 1) if cutout else zeros)


def augment_example(img_hwc_uint8, dy, dx, flip, cy, cx, pad, cutout, mean, std, size=32):
    """One example, the classic way: crop size x size at (dy, dx) from the image reflect-padded by `pad`,
    mirror it if `flip`, normalise, and zero a cutout x cutout square at (cy, cx) (inside the crop).
    torch_backend.augment_reference defines the same thing on the normalised padded data set."""
    src = reflect_index(img_hwc_uint8.shape[0], pad)
    rows, cols = src[dy:dy + size], src[dx:dx + size]
    if flip:
        cols = cols[::-1]
    out = (img_hwc_uint8[rows[:, None], cols[None, :]].astype(np.float32) - mean) / std
    if cutout:
        out[cy:cy + cutout, cx:cx + cutout] = 0
    return out


class LoaderDataset(torch.utils.data.Dataset):
    """What a DataLoader worker does. A job is (pass, upstream batch number, aug seed, example indices); the
    worker decodes each example and, unless `augment` is off, augments it on its own with draws from a numpy
    Generator seeded by (aug seed, upstream batch number). The draws depend only on the job, so the batches do
    not depend on the number of workers or on which worker gets which job.

    Returns a dict: x (B, H, W, C) float32 normalised, augmented (size x size) or, without `augment`, only
    reflect-padded by `pad` (H = size + 2*pad); y, index, pass, upstream (B,) int64; and the draws used."""

    def __init__(self, encoded, labels, pad, cutout, flip, augment=True, size=32, base_flip=None):
        """base_flip: for alternating flips, each example's flip in odd passes (even passes: the other way)."""
        self.encoded, self.labels = encoded, np.asarray(labels, dtype=np.int64)
        self.pad, self.cutout, self.flip, self.augment, self.size = pad, cutout, flip, augment, size
        self.base_flip = base_flip
        self.mean, self.std = _normalisation()

    def __len__(self):
        return len(self.encoded)

    def __getitem__(self, job):
        pass_no, upstream, seed, index = job
        b, s, p = len(index), self.size, self.pad
        out = {"y": torch.from_numpy(self.labels[index]), "index": torch.from_numpy(np.asarray(index, dtype=np.int64)),
               "pass": torch.full((b,), pass_no, dtype=torch.long),
               "upstream": torch.full((b,), upstream, dtype=torch.long)}
        if self.augment:
            draws = draw_augmentation_np(np.random.default_rng([seed, upstream]), b, p, self.cutout, self.flip, s)
            if self.base_flip is not None:
                draws["flip"] = alternate_flips(self.base_flip, index, pass_no)
            x = np.empty((b, s, s, 3), dtype=np.float32)
            for k, i in enumerate(index):
                x[k] = augment_example(self.encoded.decode(i), *(draws[d][k] for d in AUG_KEYS), p, self.cutout,
                                       self.mean, self.std, s)
            out.update({k: torch.from_numpy(v) for k, v in draws.items()})
        else:  # example-before-aug: decoded and normalised, padded so that every echoed copy can be cropped
            src = reflect_index(s, p)
            x = np.empty((b, s + 2 * p, s + 2 * p, 3), dtype=np.float32)
            for k, i in enumerate(index):
                x[k] = (self.encoded.decode(i)[src[:, None], src[None, :]].astype(np.float32) - self.mean) / self.std
        out["x"] = torch.from_numpy(x)
        return out


AUG_KEYS = ("dy", "dx", "flip", "cy", "cx")


def alternate_flips(base_flip, index, pass_no):
    """Alternating flips, as the device pipeline has them: example i is flipped as base_flip[i] in odd upstream
    passes (the first is 1) and the other way in even ones."""
    return np.asarray(base_flip)[np.asarray(index)] ^ (np.asarray(pass_no) % 2 == 0)


class UpstreamJobs(torch.utils.data.Sampler):
    """Endless jobs for LoaderDataset: pass after pass, a fresh shuffle of the n examples cut into batches of
    `batch` (an incomplete last batch is dropped, as in the device pipeline). One sampler iterator spans all
    passes, so the workers keep prefetching across pass boundaries."""

    def __init__(self, n, batch, shuffle_seed, aug_seed):
        self.n, self.batch, self.shuffle_seed, self.aug_seed = n, batch, shuffle_seed, aug_seed

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.shuffle_seed)
        upstream, pass_no = 0, 0
        while True:
            pass_no += 1
            perm = torch.randperm(self.n, generator=gen).numpy()
            for b in range(self.n // self.batch):
                yield pass_no, upstream, self.aug_seed, perm[b * self.batch:(b + 1) * self.batch]
                upstream += 1


def _seed_worker(worker_id):
    """Global RNGs of a worker from its torch seed (the DataLoader's generator, seeded from the run's, plus the
    worker id). The augmentation itself uses per-job seeds; this only pins down anything else random."""
    import random
    seed = torch.initial_seed() % 2 ** 32
    random.seed(seed)
    np.random.seed(seed)


class ShuffleBuffer:
    """A streaming shuffle buffer of `size` items: once full, each new item replaces a random resident, which
    is emitted. Fed items 0..n-1 in one push and flushed, it gives shuffle_buffer_order(n, size, same generator)."""

    def __init__(self, size, generator):
        self.size, self.gen, self.items = size, generator, []

    def push(self, items):
        """Takes a list of items, returns the list of items it emits."""
        fill = min(max(self.size - len(self.items), 0), len(items))
        self.items.extend(items[:fill])
        rest, out = items[fill:], []
        if rest:
            for item, j in zip(rest, torch.randint(0, self.size, (len(rest),), generator=self.gen).tolist()):
                out.append(self.items[j])
                self.items[j] = item
        return out

    def flush(self):
        """The residents in random order (the stream ended); the buffer is left empty."""
        order = torch.randperm(len(self.items), generator=self.gen).tolist()
        out, self.items = [self.items[i] for i in order], []
        return out


class _Chunk:
    """One upstream batch in the trainer's process: its tensors and how many echoed items still refer to it."""

    def __init__(self, batch, device, dtype):
        self.x = batch.pop("x").to(device=device, dtype=dtype, non_blocking=True)
        self.y = batch.pop("y").to(device, non_blocking=True)
        self.info = batch  # index, pass, upstream and, for augmented chunks, the draws (CPU tensors)
        self.left = 0


class LoaderStream:
    """The loader pipeline, the classic one most people use: the training images PNG-encoded in memory, decoded
    and augmented per sample in cfg["loader_workers"] DataLoader worker processes (0: in this process),
    reshuffled every upstream pass, with persistent workers and prefetching.

    Upstream batches have the global batch size. The echo stage follows Choi et al.: example-after-aug repeats
    each augmented example the workers produced, batch repeats whole upstream batches (so echoed batches are
    identical), and example-before-aug has the workers only decode (and reflect-pad) the images, repeats each
    and augments every copy on its own afterwards, batched on the device with torch_backend.augment and draws
    from the run's generator. A non-integer factor repeats an item floor or ceil times (echo_repeats, per
    example or per batch). echo_shuffle_buffer N streams the echoed examples through a ShuffleBuffer of N items
    (in every mode, as the device pipeline does; with batch echo it mixes the copies of a batch). The echoed
    stream runs on across passes: nothing is dropped except each shuffle's incomplete last upstream batch.

    Augmentation matches the device pipeline's definition (crop with offsets 0..2*pad from the reflect-padded
    image, horizontal flip, cutout square inside the crop); with flip="alternate" each example's flip is drawn
    once and then alternates every upstream pass (every echoed copy of it in a pass flipped alike), as there.
    Randomness comes from the run's generator: four seeds drawn from it at construction give the shuffles,
    the per-job augmentation seeds (see LoaderDataset), the DataLoader's generator (worker seeds) and a host
    generator for echo repeats, the shuffle buffer and the before-aug draws. The batches do not depend on the
    number of workers, and every process under torchrun sees the same global batches.

    `fresh_read` counts the examples delivered by the DataLoader so far (whole upstream batches, including
    those waiting in the echo stage or the shuffle buffer); `passes` is the upstream pass of the latest
    delivered batch. For tests and diagnostics, `last` holds the CPU tensors index, pass, upstream and the
    augmentation draws (dy, dx, flip, cy, cx) of every row of the last global batch."""

    def __init__(self, data, cfg, generator, device):
        """data: raw_train_x (N, 32, 32, 3) uint8 numpy, raw_train_y, and train_x (only its dtype is used)."""
        raw_x, raw_y = data["raw_train_x"], data["raw_train_y"]
        self.n, self.bs = len(raw_y), cfg["batch_size"]
        if self.bs > self.n:
            raise ValueError(f"batch size {self.bs} exceeds the {self.n} training images")
        self.cfg, self.device, self.dtype = cfg, torch.device(device), data["train_x"].dtype
        self.mode = cfg.get("echo", "none")
        if self.mode not in ECHO_MODES:
            raise ValueError(f"unknown echo mode {self.mode!r}; choose one of {', '.join(ECHO_MODES)}")
        self.factor = cfg.get("echo_factor", 1.0) if self.mode != "none" else 1.0
        if self.factor < 1:
            raise ValueError(f"echo factor must be >= 1, got {self.factor}")
        self.before_aug = self.mode == "example-before-aug" and self.factor != 1
        seeds = torch.randint(0, 2 ** 62, (4,), generator=generator, device=generator.device).tolist()
        self.gen = torch.Generator().manual_seed(seeds[0])  # echo repeats, shuffle buffer, before-aug draws
        size = cfg.get("echo_shuffle_buffer", 0)
        self.buffer = ShuffleBuffer(size, self.gen) if size > 1 else None
        flip = cfg.get("flip", "random") != "none"
        # drawn only for alternating flips, so the other runs' random streams are as they were
        self.base_flip = (torch.randint(0, 2, (self.n,), generator=self.gen).bool().numpy()
                          if cfg.get("flip") == "alternate" else None)
        dataset = LoaderDataset(encode_pngs(raw_x), raw_y, cfg["pad"], cfg["cutout"], flip, augment=not self.before_aug,
                                base_flip=self.base_flip)
        workers = cfg.get("loader_workers", 1)
        self.loader = torch.utils.data.DataLoader(
            dataset, batch_size=None, sampler=UpstreamJobs(self.n, self.bs, seeds[1], seeds[2]),
            num_workers=workers, persistent_workers=workers > 0, prefetch_factor=4 if workers else None,
            pin_memory=self.device.type == "cuda", worker_init_fn=_seed_worker if workers else None,
            generator=torch.Generator().manual_seed(seeds[3]))
        self._upstream = None  # the DataLoader iterator, started by the first next_batch
        self.chunks, self.ready = {}, []  # upstream batches still referred to; echoed items ready to emit
        self.fresh, self.passes, self.last = 0, 0, None

    def state_dict(self):
        raise ValueError("--checkpoint is not supported with --pipeline loader")

    def load_state_dict(self, state):
        raise ValueError("--checkpoint is not supported with --pipeline loader")

    @property
    def fresh_read(self):
        return self.fresh

    def close(self):
        """Stops the worker processes now (also done when the stream is garbage-collected). Dropping the
        iterator alone did not: with persistent workers the DataLoader keeps it, and the workers with it."""
        self._upstream = self.loader = None

    def _pull(self):
        """Fetches one upstream batch and appends its echoed items (refs u * bs + row) to `ready`."""
        if self._upstream is None:
            if self.loader is None:
                raise RuntimeError("this stream is closed")
            self._upstream = iter(self.loader)
        batch = next(self._upstream)
        u = int(batch["upstream"][0])
        chunk = self.chunks[u] = _Chunk(batch, self.device, self.dtype)
        self.fresh += self.bs
        self.passes = int(chunk.info["pass"][0])
        refs = u * self.bs + torch.arange(self.bs)
        if self.mode == "batch":
            refs = refs.repeat(int(echo_repeats(1, self.factor, self.gen)))
        elif self.factor != 1:
            refs = refs.repeat_interleave(echo_repeats(self.bs, self.factor, self.gen))
        chunk.left = len(refs)
        items = refs.tolist()
        self.ready.extend(self.buffer.push(items) if self.buffer else items)

    def next_batch(self, lo=0, hi=None):
        """Images (channels_last NCHW, normalised, in data["train_x"].dtype, on the device) and labels of rows
        lo:hi of the next global batch (a process's slice under torchrun)."""
        while len(self.ready) < self.bs:
            self._pull()
        refs = torch.tensor(self.ready[:self.bs])
        del self.ready[:self.bs]
        us, rows = refs // self.bs, refs % self.bs  # which upstream batch, which row of it
        info = {}
        for u in us.unique().tolist():
            sel = us == u
            for k, v in self.chunks[u].info.items():
                info.setdefault(k, torch.empty(self.bs, dtype=v.dtype))[sel] = v[rows[sel]]
        if self.before_aug:  # every copy gets its own draws (but for alternating flips: per example and pass)
            info.update(tb.draw_augmentation(self.bs, self.cfg["pad"], self.cfg["cutout"],
                                             self.cfg.get("flip", "random") != "none", self.gen, torch.device("cpu")))
            if self.base_flip is not None:
                info["flip"] = torch.from_numpy(alternate_flips(self.base_flip, info["index"], info["pass"]))
        self.last = info
        sl = slice(lo, hi)
        x, y = self._gather(us[sl], rows[sl], {k: info[k][sl] for k in AUG_KEYS} if self.before_aug else None)
        for u, count in zip(*us.unique(return_counts=True)):  # release upstream batches fully emitted
            chunk = self.chunks[int(u)]
            chunk.left -= int(count)
            if chunk.left == 0:
                del self.chunks[int(u)]
        return x, y

    def _gather(self, us, rows, aug):
        """The rows of the batch from their upstream batches; augmented here if aug (before-aug) is given."""
        def take(u, sel):
            chunk, r = self.chunks[u], rows[sel].to(self.device)
            if aug is None:
                return chunk.x[r].permute(0, 3, 1, 2), chunk.y[r]  # NHWC rows seen as channels_last NCHW
            a = {k: v[sel].to(self.device) for k, v in aug.items()}
            return tb.augment(chunk.x, r, a, cutout=self.cfg["cutout"]), chunk.y[r]
        uniq = us.unique().tolist()
        if len(uniq) == 1:
            return take(uniq[0], torch.ones(len(us), dtype=torch.bool))
        x = torch.empty((len(us), 3, 32, 32), dtype=self.dtype, device=self.device,
                        memory_format=torch.channels_last)
        y = torch.empty(len(us), dtype=torch.long, device=self.device)
        for u in uniq:
            sel = us == u
            part_x, part_y = take(u, sel)
            sel = sel.to(self.device)
            x[sel], y[sel] = part_x, part_y
        return x, y
