"""Everything that needs PyTorch: data on the device, batched augmentation, networks, precision, the Muon
optimizer, FLOPs."""
import argparse
import contextlib
import glob
import lzma
import math
import os
import pickle
import tarfile
import time
import zipfile
import zlib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
NUM_CLASSES = 10
TARBALL = "cifar-10-python.tar.gz"
BATCHES_DIR = "cifar-10-batches-py"


class DataError(Exception):
    """Missing, corrupt or malformed CIFAR-10 data; the message is meant for the user as is."""


# ---------------------------------------------------------------------------------------------------------------
# Loading: .npz, torchvision's batches folder, the official tarball, or a download.

def _unpickle(f, what):
    try:
        d = pickle.load(f, encoding="bytes")
        x = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        return x, np.asarray(d[b"labels"], dtype=np.int64)
    except Exception as e:  # any unpickling or shape failure means the file is not a CIFAR batch
        raise DataError(f"{what}: not a readable CIFAR-10 batch ({type(e).__name__}: {e})") from None


def _join_batches(train, test):
    return dict(train_x=np.concatenate([b[0] for b in train]), train_y=np.concatenate([b[1] for b in train]),
                test_x=test[0], test_y=test[1])


def _load_batches_dir(d):
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    missing = [n for n in names if not os.path.isfile(os.path.join(d, n))]
    if missing:
        raise DataError(f"{d}: incomplete CIFAR-10 folder, missing {', '.join(missing)}")
    batches = []
    for n in names:
        with open(os.path.join(d, n), "rb") as f:
            batches.append(_unpickle(f, os.path.join(d, n)))
    return _join_batches(batches[:5], batches[5])


def _load_tarball(path):
    try:
        with tarfile.open(path, "r:*") as tar:  # gzipped as published, or not
            members = {os.path.basename(m.name): m for m in tar.getmembers() if m.isfile()}
            names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
            missing = [n for n in names if n not in members]
            if missing:
                raise DataError(f"{path}: not a CIFAR-10 tarball, missing {', '.join(missing)}")
            batches = [_unpickle(tar.extractfile(members[n]), f"{path}:{n}") for n in names]
    except (tarfile.TarError, EOFError, OSError, zipfile.BadZipFile, zlib.error, lzma.LZMAError) as e:
        # (zlib's and lzma's errors are no OSError: damaged compressed data past the first member raised them;
        # tarfile's "could not be opened" message spans lines, one per compression tried)
        why = " ".join(f"{type(e).__name__}: {e}".split())
        raise DataError(f"{path}: truncated or corrupt tarball ({why})") from None
    return _join_batches(batches[:5], batches[5])


def _load_npz(path):
    keys = ("train_x", "train_y", "test_x", "test_y")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in keys if k not in z.files]
            if missing:
                raise DataError(f"{path}: missing arrays {', '.join(missing)} (expected {', '.join(keys)})")
            return {k: z[k] for k in keys}
    except DataError:
        raise
    except Exception as e:  # zipfile, zlib, EOF and value errors all mean a damaged file
        raise DataError(f"{path}: truncated or corrupt .npz ({type(e).__name__}: {e})") from None


def validate(data, where):
    """Shapes (N, 32, 32, 3) uint8 and integer labels 0..9, one per image, every class present."""
    for split in ("train", "test"):
        x, y = data[f"{split}_x"], data[f"{split}_y"]
        if x.ndim != 4 or x.shape[1:] != (32, 32, 3):
            raise DataError(f"{where}: {split}_x has shape {x.shape}, expected (N, 32, 32, 3) RGB images")
        if x.dtype != np.uint8:
            raise DataError(f"{where}: {split}_x has dtype {x.dtype}, expected uint8 pixels 0..255")
        if y.ndim != 1 or len(y) != len(x):
            raise DataError(f"{where}: {split}_y has shape {y.shape}, expected ({len(x)},) labels")
        if not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{where}: {split}_y has dtype {y.dtype}, expected integer labels")
        if len(y) == 0 or y.min() < 0 or y.max() >= NUM_CLASSES:
            raise DataError(f"{where}: {split}_y must hold labels 0..{NUM_CLASSES - 1}")
        if len(np.unique(y)) != NUM_CLASSES:
            raise DataError(f"{where}: {split}_y lacks some of the {NUM_CLASSES} classes")
    return {k: (v.astype(np.int64) if k.endswith("_y") else v) for k, v in data.items()}


def train_subset(data, n, where):
    """The data with a fixed random n of its training images (0: all of them; the rows are sorted by class, so
    never the first n); more than the data holds is a DataError naming `where` (else all would train while
    the study recorded n)."""
    if n > len(data["train_y"]):
        raise DataError(f"--train-subset {n} exceeds the {len(data['train_y'])} training images in {where}")
    if n < 0:  # (a slice [:-5] would keep all but 5)
        raise DataError(f"--train-subset must be >= 0 (0: all), got {n}")
    if not n:
        return data
    keep = np.random.default_rng(0).permutation(len(data["train_y"]))[:n]
    return dict(data, train_x=data["train_x"][keep], train_y=data["train_y"][keep])


def dataset_fingerprint(data):
    """Sizes and int64 checksums of a dataset as loaded (numpy, after validate): each row's values summed,
    weighted by the row's position, so the same images in another order differ too. Logs record it, and
    --from-log says when a rerun's data are not the log's. (A checkpoint holds another fingerprint, of the data
    as on the device: train_cifar.data_fingerprint.)"""
    def checksum(a):
        per_row = a.reshape(len(a), -1).sum(1, dtype=np.int64)
        return int((per_row * np.arange(1, len(a) + 1, dtype=np.int64)).sum())
    return {k: [len(data[k]), checksum(data[k])] for k in ("train_x", "train_y", "test_x", "test_y")}


def _download(root, hint):
    try:
        import torchvision  # only the download needs it
    except ImportError:
        raise DataError(f"no CIFAR-10 data at {root}, and torchvision (to download it) is not installed; "
                        f"{hint}") from None
    try:
        os.makedirs(root, exist_ok=True)
        torchvision.datasets.CIFAR10(root=root, train=True, download=True)  # checks the archive's md5
    except Exception as e:
        raise DataError(f"no CIFAR-10 data at {root}, and downloading it failed ({type(e).__name__}: {e}); "
                        f"offline, {hint}") from None
    return _load_batches_dir(os.path.join(root, BATCHES_DIR))


def load_cifar10(path, download=True):
    """Returns validated numpy arrays train_x, train_y, test_x, test_y (NHWC uint8, int64 labels).

    `path` is an .npz, the official tarball, a cifar-10-batches-py folder, or a folder holding one of these
    (where nothing is found and `download` is set, torchvision downloads into that folder)."""
    hint = f"pass --data PATH to a cifar10.npz, a {BATCHES_DIR}/ folder or {TARBALL} (or set CIFAR10_DATA)"
    if os.path.isfile(path):
        data = _load_npz(path) if path.endswith(".npz") or zipfile.is_zipfile(path) else _load_tarball(path)
    elif os.path.isfile(os.path.join(path, "data_batch_1")):
        data = _load_batches_dir(path)
    elif os.path.isdir(os.path.join(path, BATCHES_DIR)):
        try:
            data = _load_batches_dir(os.path.join(path, BATCHES_DIR))
        except DataError as e:  # an interrupted extraction: the tarball beside it, or a download extracts it again
            if os.path.isfile(os.path.join(path, TARBALL)):
                data = _load_tarball(os.path.join(path, TARBALL))
            elif download:
                try:
                    data = _download(path, hint)
                except DataError as failed:
                    raise DataError(f"{e}; {failed}") from None
            else:
                raise
    elif os.path.isfile(os.path.join(path, TARBALL)):
        data = _load_tarball(os.path.join(path, TARBALL))
    elif os.path.isfile(os.path.join(path, "cifar10.npz")):
        data = _load_npz(os.path.join(path, "cifar10.npz"))
    elif download and not path.endswith((".npz", ".gz")):
        data = _download(path, hint)
    else:
        raise DataError(f"no CIFAR-10 data at {path}; {hint}")
    return validate(data, path)


# ---------------------------------------------------------------------------------------------------------------
# On the device: normalise and pad once; augment whole batches with random numbers drawn per epoch.

def default_device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_device(name=None):
    """The device a --device option names (None: default_device()), or a ValueError saying why it cannot be
    used. Only CPUs and CUDA GPUs: the timer synchronises those, elsewhere it would time kernel launches."""
    if name is None:
        return default_device()
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"device {name!r}: not a device name; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r}: these scripts run on cpu or cuda devices only")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "was built without CUDA" if torch.version.cuda is None else "finds no CUDA GPU"
            raise ValueError(f"device {name!r}: this torch ({torch.__version__}) {why}; use cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: there are {torch.cuda.device_count()} CUDA device(s), "
                             f"numbered from 0")
    return device


def add_device_option(parser):
    """The --device option every script shares (checked as it is parsed, with device_option)."""
    parser.add_argument("--device", default=None, type=device_option,
                        help="cpu, cuda, cuda:1 ... (default: cuda if available)")


def device_option(text):
    """argparse type for --device: the error names the option and says why (resolve_device)."""
    try:
        return resolve_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@contextlib.contextmanager
def cuda_sync_debug(device, mode):
    """torch.cuda.set_sync_debug_mode(mode) while the block runs ("error": any host synchronisation raises,
    "default": allowed), on a CUDA device; mode None or another device: nothing changes."""
    if mode is None or device.type != "cuda":
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def synchronizer(device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def to_device(data, device, dtype, pad=0, test_dtype=None):
    """Normalised images in dtype (the test images in test_dtype where given); train kept NHWC and reflect-padded
    by `pad` for cropping, test as channels_last NCHW."""
    mean = torch.tensor(CIFAR_MEAN, device=device) * 255
    std = torch.tensor(CIFAR_STD, device=device) * 255

    def norm(x):
        return ((torch.from_numpy(x).to(device).float() - mean) / std)

    train = norm(data["train_x"])
    if pad:
        train = F.pad(train.permute(0, 3, 1, 2), (pad,) * 4, mode="reflect").permute(0, 2, 3, 1)
    test = norm(data["test_x"]).permute(0, 3, 1, 2)
    return dict(train_x=train.contiguous().to(dtype), train_y=torch.from_numpy(data["train_y"]).to(device),
                test_x=test.to(test_dtype or dtype), test_y=torch.from_numpy(data["test_y"]).to(device))


def draw_augmentation(n, pad, cutout, flip, generator, device, size=32, jitter=(0.0, 0.0)):
    """Random numbers for n examples at once: crop offsets in [0, 2*pad], flip bits, cutout corners, and where
    jitter = (brightness, contrast) is not zero a brightness shift in [-brightness, brightness] and a contrast
    factor in [1 - contrast, 1 + contrast] (drawn last, so runs without jitter draw what they always drew)."""
    def randint(high):
        return torch.randint(0, high, (n,), generator=generator, device=device)
    zeros = torch.zeros(n, dtype=torch.long, device=device)
    aug = dict(dy=randint(2 * pad + 1) if pad else zeros, dx=randint(2 * pad + 1) if pad else zeros,
               flip=(randint(2).bool() if flip else zeros.bool()),
               cy=randint(size - cutout + 1) if cutout else zeros, cx=randint(size - cutout + 1) if cutout else zeros)
    if any(jitter):
        brightness, contrast = jitter
        aug["shift"] = (torch.rand(n, generator=generator, device=device) * 2 - 1) * brightness
        aug["scale"] = 1 + (torch.rand(n, generator=generator, device=device) * 2 - 1) * contrast
    return aug


def augment(x_padded_nhwc, index, aug, size=32, cutout=0):
    """Crop, flip, jitter the colours of and cut out a batch in a few tensor ops, with no host synchronisation.

    x_padded_nhwc: (N, H+2p, W+2p, C) data set; index: (B,) rows to take; aug: draw_augmentation() for those
    rows. Returns a (B, C, size, size) channels_last batch."""
    # whole padded images; index_select on rows is a plain copy, far faster on CPUs than x[index]
    src = x_padded_nhwc.flatten(1).index_select(0, index).view(-1, *x_padded_nhwc.shape[1:])
    if src.shape[1] != size or src.shape[2] != size:
        windows = src.unfold(1, size, 1).unfold(2, size, 1)          # (B, 2p+1, 2p+1, C, size, size), a view
        src = windows[torch.arange(len(index), device=index.device), aug["dy"], aug["dx"]].permute(0, 2, 3, 1)
    out = torch.where(aug["flip"][:, None, None, None], src.flip(2), src)  # (B, size, size, C)
    if "shift" in aug:  # colour jitter on the normalised pixels, before cutout (its square stays the mean colour)
        out = (out + aug["shift"].to(out.dtype)[:, None, None, None]) * aug["scale"].to(out.dtype)[:, None, None, None]
    if cutout:
        ar = torch.arange(size, device=index.device)
        inside_y = (ar >= aug["cy"][:, None]) & (ar < aug["cy"][:, None] + cutout)
        inside_x = (ar >= aug["cx"][:, None]) & (ar < aug["cx"][:, None] + cutout)
        out = out.masked_fill((inside_y[:, :, None] & inside_x[:, None, :])[..., None], 0)
    return out.permute(0, 3, 1, 2)


def augment_reference(x_padded_nhwc, index, aug, size=32, cutout=0):
    """The same augmentation one example at a time: the readable definition the batched one must match."""
    out = []
    for b, i in enumerate(index.tolist()):
        dy, dx = int(aug["dy"][b]), int(aug["dx"][b])
        img = x_padded_nhwc[i, dy:dy + size, dx:dx + size].permute(2, 0, 1).clone()
        if aug["flip"][b]:
            img = img.flip(2)
        if "shift" in aug:
            img = (img + aug["shift"][b].to(img.dtype)) * aug["scale"][b].to(img.dtype)
        if cutout:
            cy, cx = int(aug["cy"][b]), int(aug["cx"][b])
            img[:, cy:cy + cutout, cx:cx + cutout] = 0
        out.append(img)
    return torch.stack(out)


def resize_images(x, size):
    """A batch (N, C, H, W) resized to size x size, bilinear with antialiasing (a proper low-pass when shrinking);
    the batch itself where it already has that size. PyTorch's antialiased kernel has no bf16 version on CPU, so
    it runs in fp32; layout and dtype are kept."""
    if x.shape[-2:] == (size, size):
        return x
    y = F.interpolate(x.float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Precision

def resolve_precision(name, device):
    """auto: bf16 where the hardware runs it natively, fp16 on older CUDA GPUs, fp32 otherwise."""
    if name != "auto":
        if name == "fp16" and device.type == "cpu":
            raise ValueError("fp16 is for CUDA GPUs; on a CPU use --precision bf16 or fp32")
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_has_bf16() else "fp32"


def cpu_info():
    """model name, family/model and flags of the first CPU in /proc/cpuinfo (empty where there is none)."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def cpu_flags(info=None):
    """The CPU's feature flags (x86 "flags", Arm "Features"); None where /proc/cpuinfo has neither."""
    info = cpu_info() if info is None else info
    flags = info.get("flags", info.get("Features"))
    return None if flags is None else set(flags.split())


def cpu_has_bf16():
    flags = cpu_flags()
    if flags is not None:
        return bool({"avx512_bf16", "amx_bf16"} & flags)
    return torch.backends.mkldnn.is_available() and hasattr(torch.backends.cpu, "get_cpu_capability") and \
        "AVX512" in torch.backends.cpu.get_cpu_capability()


DTYPES = dict(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16)


class FixedLossScale:
    """fp16's loss scaling without a read on the host every step (torch.amp.GradScaler reads its overflow flag in
    each step(), so the host waits for the GPU there): the loss is multiplied by a fixed factor and the gradients
    divided by it before the update; with a power of two both are exact. Myrtle's and airbench's fp16 scripts do
    the same implicitly, summing the loss over the batch instead of averaging it. A step that overflows is not
    skipped: its inf or NaN reaches the weights and the training loss, which the trainer checks once an epoch.
    The interface is GradScaler's (scale, step, update, state_dict, load_state_dict)."""

    def __init__(self, factor):
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"a loss scale must be a positive number, got {factor}")
        self.factor = float(factor)

    def scale(self, loss):
        return loss * self.factor

    def step(self, opt):
        grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1 / self.factor)  # one kernel for all of them on a GPU
        return opt.step()

    def update(self):
        pass  # fixed: nothing to adapt

    def state_dict(self):
        return dict(fixed_factor=self.factor)

    def load_state_dict(self, state):
        pass  # the factor comes from the run's configuration, which a checkpoint must match


def autocast(precision, device):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


# The widest matrix/vector extension a CPU has decides its speed here (bf16 runs only on the first two), so the
# hardware string of every log names it: a model name like "AMD EPYC" covers CPUs 4x apart.
CPU_ISA_LEVELS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "neon", "asimd")


def loaded_libraries():
    """The shared objects mapped into this process (Linux), or LD_PRELOAD's list where /proc is absent."""
    try:
        with open("/proc/self/maps") as f:
            return f.read()
    except OSError:
        return os.environ.get("LD_PRELOAD", "")


def preloaded_allocator():
    """jemalloc/tcmalloc when LD_PRELOADed (1.2-1.4x faster CPU training, see benchmarks/bench_allocator.py).
    Read from what the process mapped, not from LD_PRELOAD: a preload of a missing library only warns."""
    libs = loaded_libraries()
    return next((name for name in ("jemalloc", "tcmalloc") if f"lib{name}" in libs), None)


def find_allocator_library(name):
    """The path of lib<name>*.so* ("jemalloc", "tcmalloc_minimal", ...) in the usual library folders, or None."""
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        hits = sorted(glob.glob(os.path.join(d, f"lib{name}.so*")))
        if hits:
            return hits[0]
    return None


# jemalloc as measured by bench_allocator.py: keep every freed page (no decay) and serve even the largest
# blocks from its arenas.
JEMALLOC_CONF = "oversize_threshold:1,background_thread:false,dirty_decay_ms:-1,muzzy_decay_ms:-1"


def allocator_hint(device):
    """One line for CPU runs under glibc's allocator, naming the faster one this machine has; else None."""
    if device.type != "cpu" or preloaded_allocator():
        return None
    lib = find_allocator_library("jemalloc") or find_allocator_library("tcmalloc_minimal")
    lib = lib or "libjemalloc.so.2 (apt-get install libjemalloc2)"
    return (f"note: glibc's allocator page-faults on every step; with LD_PRELOAD={lib} MALLOC_CONF={JEMALLOC_CONF} "
            "training ran 1.2-1.4x faster on CPUs here (SPEED.md: CPU speed)")


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    info = cpu_info()
    flags = cpu_flags(info) or set()
    parts = []
    if "cpu family" in info:
        parts.append(f"family {info['cpu family']} model {info.get('model', '?')}")
    isa = next((f for f in CPU_ISA_LEVELS if f in flags), None)
    if isa:
        parts.append(isa)
    threads = torch.get_num_threads()
    parts.append(f"{threads} thread{'s' if threads != 1 else ''}")
    allocator = preloaded_allocator()
    if allocator:
        parts.append(allocator)
    return f"{info.get('model name', 'CPU')} ({', '.join(parts)})"


# ---------------------------------------------------------------------------------------------------------------
# Convolutions on small maps. On the CPU, oneDNN's bf16 kernels for 3x3 convs on maps of 8x8 and smaller run
# far below the machine's matmul rate (a weight gradient at 7x7 or 3x3: 0.07-0.22 TFLOP/s where a large matmul
# reaches 0.6-1.5). There the same sums as one matmul over the unfolded input (im2col) are 1.4-6x faster
# (benchmarks/bench_convs.py times both for every conv of a preset: logs/bench_convs-fast9[46]-2026-12-01T19*:
# conv time per step 3.32 -> 2.61 s for fast94, 4.10 -> 2.72 s for fast96).

WGRAD_MATMUL_MAX_PIXELS = 64   # weight gradient by matmul on maps of at most 8x8 (at 15x15 oneDNN's is faster)
FORWARD_MATMUL_MAX_PIXELS = 16  # forward and input gradient by matmul at most at 4x4 (oneDNN wins from 7x7)


def unfold_nhwc(x, k):
    """im2col of a (N, C, H, W) map for a k x k, stride-1 conv zero-padded to the same size: (N*H*W, k*k*C),
    columns ordered (kh, kw, c), so that rows are contiguous in the channels-last layout."""
    n, c, h, w = x.shape
    p = k // 2
    padded = F.pad(x.permute(0, 2, 3, 1), (0, 0, p, p, p, p))
    cols = torch.empty(n, h, w, k, k, c, dtype=x.dtype, device=x.device)
    for i in range(k):
        for j in range(k):
            cols[:, :, :, i, j, :] = padded[:, i:i + h, j:j + w, :]
    return cols.view(n * h * w, k * k * c)


def matmul_conv(x, weight):
    """conv2d(x, weight, padding=k // 2) as one matmul; the result is channels-last."""
    n, _, h, w = x.shape
    out_c, k = weight.shape[0], weight.shape[2]
    y = unfold_nhwc(x, k) @ weight.permute(0, 2, 3, 1).reshape(out_c, -1).t()
    return y.view(n, h, w, out_c).permute(0, 3, 1, 2)


def matmul_conv_input_grad(grad_out, weight):
    """The input gradient of a 'same' stride-1 conv: the conv of grad_out with the filters flipped and transposed."""
    return matmul_conv(grad_out, weight.flip(2, 3).transpose(0, 1))


def matmul_conv_weight_grad(grad_out, x, k):
    """The weight gradient of a 'same' stride-1 k x k conv, grad_out^T @ im2col(x), as (out, in, k, k)."""
    out_c, in_c = grad_out.shape[1], x.shape[1]
    g = grad_out.permute(0, 2, 3, 1).reshape(-1, out_c)
    return (g.t() @ unfold_nhwc(x, k)).view(out_c, k, k, in_c).permute(0, 3, 1, 2)


class SmallMapConv(torch.autograd.Function):
    """A bias-free k x k stride-1 'same' conv whose forward, input gradient (dgrad) and weight gradient (wgrad)
    each run as one matmul over the unfolded input where its flag says so, else by PyTorch's kernel. The
    weight gradient is grad_out^T @ im2col(x); the input gradient of a 'same' conv is the conv of grad_out with
    the filters flipped and transposed. Inputs share one dtype (autocast is applied by the caller); the input
    is unfolded again in the backward rather than kept (k*k times its size)."""

    @staticmethod
    def forward(ctx, x, weight, fwd_by_matmul, dgrad_by_matmul, wgrad_by_matmul):
        ctx.save_for_backward(x, weight)
        ctx.dgrad_by_matmul, ctx.wgrad_by_matmul = dgrad_by_matmul, wgrad_by_matmul
        k = weight.shape[2]
        return matmul_conv(x, weight) if fwd_by_matmul else F.conv2d(x, weight, padding=k // 2)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        k = weight.shape[2]
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = grad_w = None
        by_onednn = [need_x and not ctx.dgrad_by_matmul, need_w and not ctx.wgrad_by_matmul]
        if any(by_onednn):
            grad_x, grad_w = torch.ops.aten.convolution_backward(
                grad_out, x, weight, None, [1, 1], [k // 2, k // 2], [1, 1], False, [0, 0], 1,
                by_onednn + [False])[:2]
        if need_x and ctx.dgrad_by_matmul:
            grad_x = matmul_conv_input_grad(grad_out, weight)
        if need_w and ctx.wgrad_by_matmul:
            grad_w = matmul_conv_weight_grad(grad_out, x, k)
        return grad_x, grad_w, None, None, None


CPU_CONV_MODES = ("auto", "tuned", "matmul", "onednn")
CONV_PASSES = ("fwd", "dgrad", "wgrad")


def resolve_cpu_conv(mode):
    """The conv kernels a CPU run takes: "tuned" (per conv shape and pass the faster of the two, measured before
    the timer: tune_small_map_convs), "matmul" (SmallMapConv on small maps by the fixed rule above) or "onednn"
    (PyTorch's own). auto is tuned: which is faster depends on the CPU, not only on its features. The fixed
    rule was measured on an AMX Xeon whose oneDNN small-map kernels are slow (model 207: conv time per fast94
    step 3.32 -> 2.61 s); on an AVX-512-bf16 Zen 5 oneDNN's run near its matmul rate (logs/bench_convs-fast94-
    2026-12-02T*, bench_presets-2026-12-02T*), and on another AMX Xeon (model 167) oneDNN's are faster than the
    matmuls everywhere but the wgrad at 3x3 (logs/bench_convs-fast94-2026-12-06T*)."""
    if mode not in CPU_CONV_MODES:
        raise ValueError(f"cpu-conv must be one of {', '.join(CPU_CONV_MODES)}, not {mode!r}")
    return "tuned" if mode == "auto" else mode


# The tuned kernels: shape key -> (fwd, dgrad, wgrad by matmul), for this process (like cudnn.benchmark's cache).
# A shape seen while recording and not tuned yet waits in _pending; an untuned shape takes the choice for the
# same conv at the nearest batch size tuned, else the fixed rule.
_tuned_kernels = {}
_pending = None
TUNE_MARGIN = 0.9  # the matmul must take under 90% of oneDNN's time: near-ties keep PyTorch's kernel
TUNE_REPEATS = 3  # timed calls per kernel and pass (the fastest counts), after one warm-up call each


def matmul_wins(onednn_s, matmul_s):
    """The tuning's rule for one pass: take the matmul only where it is clearly faster."""
    return matmul_s < TUNE_MARGIN * onednn_s


def conv_key(x, conv):
    """(batch, in channels, height, width, out channels, kernel side): what a kernel's speed depends on."""
    n, c, h, w = x.shape
    return (n, c, h, w, conv.out_channels, conv.kernel_size[0])


@contextlib.contextmanager
def recording_small_map_shapes():
    """Within: the small-map bf16 conv shapes that a tuned tb.Conv2d meets and that are not tuned yet are added
    to the yielded set, for tune_small_map_convs."""
    global _pending
    outer, _pending = _pending, set()
    try:
        yield _pending
    finally:
        if outer is not None:
            outer |= _pending
        _pending = outer


def time_conv_pass(fns, repeats, clock=time.perf_counter):
    """Fastest of `repeats` calls of each of fns, in seconds, after one warm-up call each. The calls alternate
    (a, b, a, b, ...) so that a slow spell of a shared machine slows both kernels' samples, not one kernel's: timed
    one after the other, a Zen 4's tuning once took the matmul for a 7x7 forward that is 1.5x slower there."""
    for fn in fns:
        fn()
    best = [math.inf] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = clock()
            fn()
            best[i] = min(best[i], clock() - start)
    return best


def conv_pass_calls(key, dtype=torch.bfloat16, generator=None):
    """{pass: (oneDNN's call, the matmul's call)} on random channels-last data of this conv shape; each call is
    named after its pass and kernel ("wgrad_matmul")."""
    n, c, h, w, out_c, k = key
    gen = generator or torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
    x, weight, grad_out = randn(n, c, h, w), randn(out_c, c, k, k), randn(n, out_c, h, w)

    def conv_backward(which):  # 0: the input's gradient, 1: the weights'
        mask = [which == 0, which == 1, False]
        return lambda: torch.ops.aten.convolution_backward(grad_out, x, weight, None, [1, 1], [k // 2, k // 2],
                                                           [1, 1], False, [0, 0], 1, mask)[which]
    calls = dict(fwd=(lambda: F.conv2d(x, weight, padding=k // 2), lambda: matmul_conv(x, weight)),
                 dgrad=(conv_backward(0), lambda: matmul_conv_input_grad(grad_out, weight)),
                 wgrad=(conv_backward(1), lambda: matmul_conv_weight_grad(grad_out, x, k)))
    for name, (onednn, mm) in calls.items():
        onednn.__name__, mm.__name__ = f"{name}_onednn", f"{name}_matmul"
    return calls


def tune_small_map_convs(keys, repeats=TUNE_REPEATS, timer=time_conv_pass):
    """Times each pass of each conv shape not tuned yet both ways (on random data; in a run before the timer:
    timer((onednn_call, matmul_call), repeats) -> their times) and keeps the matmul where it wins (matmul_wins).
    Returns {key: {pass: (onednn_s, matmul_s)}} for the shapes it timed."""
    timings = {}
    with torch.no_grad():
        for key in sorted(set(keys) - set(_tuned_kernels)):
            calls = conv_pass_calls(key)
            timings[key] = {name: tuple(timer(pair, repeats)) for name, pair in calls.items()}
            _tuned_kernels[key] = tuple(matmul_wins(*pair) for pair in timings[key].values())
    return timings


def conv_shape_name(key):
    """A conv_key as logs name it: "2000x256x7x7->256 k3"."""
    return f"{'x'.join(map(str, key[:4]))}->{key[4]} k{key[5]}"


def tuned_kernels(keys=None):
    """The tuned choices (of these shapes; default all so far), for a run's log:
    {"2000x256x7x7->256 k3": "fwd onednn, dgrad onednn, wgrad matmul"}."""
    keys = sorted(_tuned_kernels if keys is None else set(keys) & set(_tuned_kernels))
    return {conv_shape_name(key): ", ".join(f"{name} {'matmul' if mm else 'onednn'}"
                                            for name, mm in zip(CONV_PASSES, _tuned_kernels[key]))
            for key in keys}


def tuned_kernel_flags():
    """The choices so far as {shape key: (fwd, dgrad, wgrad by matmul)}: what a checkpoint keeps."""
    return dict(_tuned_kernels)


def use_tuned_kernels(flags):
    """Takes these choices (a checkpoint's) over this process's, so that a resumed run computes as it started
    (kernels round differently). Returns the shapes where they differ from what was tuned here."""
    flags = {tuple(key): tuple(bool(f) for f in choice) for key, choice in flags.items()}
    differ = sorted(key for key, choice in flags.items() if _tuned_kernels.get(key, choice) != choice)
    _tuned_kernels.update(flags)
    return differ


def forget_tuned_kernels():
    _tuned_kernels.clear()


class Conv2d(nn.Conv2d):
    """nn.Conv2d that, on the CPU in bf16, may compute a 3x3-style 'same' conv on a small map by matmul
    (SmallMapConv): cpu_kernels "matmul" by the fixed rule above, "tuned" as measured faster on this CPU (for
    a batch size not tuned, as tuned at the nearest one; the fixed rule for a conv not tuned at all); everywhere
    else, or with "onednn", exactly nn.Conv2d. Same parameters and state dict as nn.Conv2d."""

    cpu_kernels = "matmul"

    def matmul_applies(self):
        """Whether SmallMapConv can compute this conv: bias-free, stride 1, odd square kernel, 'same' zero padding."""
        k = self.kernel_size[0]
        return (self.bias is None and self.groups == 1 and self.stride == (1, 1) and self.dilation == (1, 1)
                and self.kernel_size == (k, k) and k % 2 == 1 and self.padding == (k // 2, k // 2)
                and self.padding_mode == "zeros")

    def small_map_mode(self, x):
        """(fwd, dgrad, wgrad by matmul) when this call on x goes through SmallMapConv, else None."""
        if not (self.cpu_kernels != "onednn" and x.device.type == "cpu" and x.dim() == 4 and self.matmul_applies()):
            return None
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
        pixels = x.shape[2] * x.shape[3]
        if dtype != torch.bfloat16 or pixels > WGRAD_MATMUL_MAX_PIXELS:
            return None
        if self.cpu_kernels == "tuned":
            key = conv_key(x, self)
            if _pending is not None and key not in _tuned_kernels:
                _pending.add(key)
            flags = _tuned_kernels.get(key)
            if flags is None:  # the same conv tuned at the nearest batch size (an evaluation's are not timed)
                same_conv = [k for k in _tuned_kernels if k[1:] == key[1:]]
                if same_conv:
                    flags = _tuned_kernels[min(same_conv, key=lambda k: (abs(k[0] - key[0]), k[0]))]
            if flags is not None:
                return flags if any(flags) else None
        small = pixels <= FORWARD_MATMUL_MAX_PIXELS
        return (small, small, True)

    def forward(self, x):
        mode = self.small_map_mode(x)
        if mode is None:
            return super().forward(x)
        # autocast's cast, done here so that SmallMapConv sees bf16 inputs (the weight's cast is differentiable,
        # so its gradient arrives in the parameter's fp32)
        return SmallMapConv.apply(x.to(torch.bfloat16), self.weight.to(torch.bfloat16), *mode)


# ---------------------------------------------------------------------------------------------------------------
# Networks. BatchNorm runs in fp32 under autocast (PyTorch's autocast policy keeps its statistics in fp32).

def conv_bn(c_in, c_out):
    return nn.Sequential(Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class Residual(nn.Module):
    def __init__(self, *layers):
        super().__init__()
        self.body = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.body(x)


class ResidualGELU(Residual):
    """GELU(x + body(x)): the activation after the sum, as in airbench96 (it lets it train fewer epochs)."""

    def forward(self, x):
        return F.gelu(x + self.body(x))


class Scale(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def resnet9(widths=(64, 128, 256, 512), head_scale=0.125):
    """Myrtle's DAWNBench ResNet-9: prep, three pooled layers, residual blocks after the 1st and 3rd."""
    w0, w1, w2, w3 = widths
    return nn.Sequential(
        conv_bn(3, w0),
        conv_bn(w0, w1), nn.MaxPool2d(2), Residual(conv_bn(w1, w1), conv_bn(w1, w1)),
        conv_bn(w1, w2), nn.MaxPool2d(2),
        conv_bn(w2, w3), nn.MaxPool2d(2), Residual(conv_bn(w3, w3), conv_bn(w3, w3)),
        GlobalMaxPool(), nn.Flatten(), nn.Linear(w3, NUM_CLASSES, bias=False), Scale(head_scale))


class PreActBlock(nn.Module):
    """Pre-activation basic block (He et al. 2016): BN-ReLU, then two 3x3 convs; a projection shortcut (1x1 conv,
    where the shape changes) reads the same pre-activated input as the main branch."""

    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(c_in)
        self.conv1 = Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.conv2 = Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.shortcut = Conv2d(c_in, c_out, 1, stride, bias=False) if stride != 1 or c_in != c_out else None

    def forward(self, x):
        a = F.relu(self.bn1(x))
        skip = x if self.shortcut is None else self.shortcut(a)
        return skip + self.conv2(F.relu(self.bn2(self.conv1(a))))


def global_max_pool(x):
    """(N, C, H, W) -> (N, C, 1, 1): the max over each map, as one max-pool window the size of the map. Not amax:
    torch 2.13's inductor (CPU) compiles amax's backward after a BN or a residual sum in bf16 into NaN
    gradients (tests/test_train.py checks the compiled net's gradients). Not adaptive_max_pool2d, the same
    sums: its CUDA backward scatters with atomic adds, 0.31 ms of fast94's 7.1 ms of kernels a step on an H200
    in bf16 (logs/gpu-session-20261204-1630.txt), where max_pool2d's backward gathers."""
    return F.max_pool2d(x, x.shape[-2:])


class GlobalMaxPool(nn.Module):
    def forward(self, x):
        return global_max_pool(x)


class ConcatPool(nn.Module):
    """Global average and max pooling side by side: (N, C, H, W) -> (N, 2C)."""

    def forward(self, x):
        return torch.cat([x.mean((2, 3)), global_max_pool(x).flatten(1)], dim=1)


def preact_resnet18(prep_bn_relu=False, widths=(64, 128, 256, 256)):
    """The 18-layer pre-activation ResNet of the DAWNBench single-GPU baseline (bkj/basenet, 2018): a 3x3 prep
    conv, four stages of two blocks (the last stage 256 wide, not 512), concatenated average and max pooling,
    a linear head. The entry's prep conv is followed by BN-ReLU, which the first block's own BN-ReLU then
    duplicates (`prep_bn_relu=True`); Myrtle's post 1 drops it (the default here)."""
    layers, c_in = [Conv2d(3, widths[0], 3, 1, 1, bias=False)], widths[0]
    if prep_bn_relu:
        layers += [nn.BatchNorm2d(c_in), nn.ReLU(inplace=True)]
    for i, w in enumerate(widths):
        for j in range(2):
            layers.append(PreActBlock(c_in, w, 2 if (i > 0 and j == 0) else 1))
            c_in = w
    layers += [ConcatPool(), nn.Linear(2 * c_in, NUM_CLASSES)]
    return nn.Sequential(*layers)


def patch_whitening(images_nchw, patch=2, eps=5e-4):
    """Conv weights that whiten patch x patch image patches: eigenvectors of the patch covariance scaled by
    1/sqrt(eigenvalue), with their negatives so a following GELU/ReLU loses nothing. Computed from data
    (pass a random sample of training images: a slice of a class-sorted set would see one class only)."""
    x = images_nchw.float()
    c = x.shape[1]
    patches = x.unfold(2, patch, 1).unfold(3, patch, 1).transpose(1, 3).reshape(-1, c * patch * patch).double()
    patches = patches - patches.mean(0)
    cov = patches.T @ patches / len(patches)
    eigval, eigvec = torch.linalg.eigh(cov)
    w = (eigvec.T / torch.sqrt(eigval + eps)[:, None]).reshape(-1, c, patch, patch).float()
    return torch.cat([w, -w])


class ResNet9Tricks(nn.Module):
    """Myrtle's "bag of tricks" ResNet-9 (post 8 of "How to train your ResNet"): a frozen 3x3 patch-whitening
    conv, a 1x1 prep conv, max-pools moved before batch norm (pooling first is 4x cheaper), CELU activations and
    BN scales frozen at 1. Otherwise the layout of resnet9: residual blocks after the 1st and 3rd pooled layers.
    The logits are scaled by 1/16, not resnet9's 1/8: with the BN scales frozen at 1 the outputs are larger, and
    Myrtle halves the scale to compensate."""

    def __init__(self, widths=(64, 128, 256, 512), head_scale=1 / 16, celu_alpha=0.3, whiten_patch=3):
        super().__init__()
        w0, w1, w2, w3 = widths
        k = 3 * whiten_patch * whiten_patch
        self.whiten = Conv2d(3, k, whiten_patch, padding=whiten_patch // 2, bias=False)
        self.whiten.weight.requires_grad_(False)

        def block(c_in, c_out, size=3, pool=False):
            bn = nn.BatchNorm2d(c_out)
            bn.weight.requires_grad_(False)
            conv = Conv2d(c_in, c_out, size, padding=size // 2, bias=False)
            return nn.Sequential(conv, *([nn.MaxPool2d(2)] if pool else []), bn, nn.CELU(celu_alpha))
        self.body = nn.Sequential(
            block(k, w0, size=1),
            block(w0, w1, pool=True), Residual(block(w1, w1), block(w1, w1)),
            block(w1, w2, pool=True),
            block(w2, w3, pool=True), Residual(block(w3, w3), block(w3, w3)),
            GlobalMaxPool(), nn.Flatten(), nn.Linear(w3, NUM_CLASSES, bias=False), Scale(head_scale))

    def init_whitening(self, images_nchw):
        with torch.no_grad():  # eps 1e-2 as in Myrtle's post: the smallest eigenvalues are not blown up
            w = patch_whitening(images_nchw, self.whiten.kernel_size[0], eps=1e-2)
            self.whiten.weight.copy_(w[:self.whiten.out_channels])

    def forward(self, x):
        return self.body(self.whiten(x))


class FastNet(nn.Module):
    """Our record net: frozen whitening conv, three conv-pool-BN-GELU-conv-BN-GELU blocks, max-pool head.
    Convs start as identity (dirac) maps; BN scales are frozen at 1 so only BN biases adapt.
    depth=3 (fast96) adds a third conv-BN to each block: GELU(x + BN(conv(GELU(BN(conv(x)))))) over the last two
    convs, as airbench96. bn_momentum is PyTorch's (airbench94/95: 0.4; airbench96: the default 0.1)."""

    def __init__(self, widths=(64, 256, 256), whiten_width=24, whiten_patch=2, head_scale=1 / 9, bn_momentum=0.4,
                 depth=2):
        super().__init__()
        if depth not in (2, 3):
            raise ValueError(f"FastNet blocks have depth 2 or 3, not {depth}")
        self.whiten = Conv2d(3, whiten_width, whiten_patch, bias=True)
        self.whiten.weight.requires_grad_(False)

        def conv_bn_gelu(c_in, c_out, pool=False):
            conv = Conv2d(c_in, c_out, 3, padding=1, bias=False)
            nn.init.dirac_(conv.weight[:c_in])
            bn = nn.BatchNorm2d(c_out, momentum=bn_momentum, eps=1e-12)
            bn.weight.requires_grad_(False)
            return [conv, nn.MaxPool2d(2), bn, nn.GELU()] if pool else [conv, bn, nn.GELU()]
        blocks, c_in, self.block_starts = [], whiten_width, []
        for w in widths:
            self.block_starts.append(len(blocks))  # (an index into self.blocks: the state dict keeps its keys)
            blocks += conv_bn_gelu(c_in, w, pool=True)
            if depth == 2:
                blocks += conv_bn_gelu(w, w)
            else:
                blocks.append(ResidualGELU(*conv_bn_gelu(w, w), *conv_bn_gelu(w, w)[:2]))
            c_in = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c_in, NUM_CLASSES, bias=False)
        self.head_scale = head_scale

    @property
    def num_blocks(self):
        return len(self.block_starts)

    def block_parameters(self, i):
        """Block i's parameters that train as built: its conv filters and BN biases (its BN scales stay frozen)."""
        end = self.block_starts[i + 1] if i + 1 < self.num_blocks else len(self.blocks)
        modules = [m for layer in self.blocks[self.block_starts[i]:end] for m in layer.modules()]
        return ([m.weight for m in modules if isinstance(m, nn.Conv2d)]
                + [m.bias for m in modules if isinstance(m, nn.modules.batchnorm._BatchNorm)])

    def init_whitening(self, images_nchw):
        with torch.no_grad():
            filters = patch_whitening(images_nchw, self.whiten.kernel_size[0])
            self.whiten.weight.copy_(filters[:self.whiten.out_channels])
            self.whiten.bias.zero_()

    def forward(self, x):
        x = self.blocks(F.gelu(self.whiten(x)))
        return self.head(global_max_pool(x).flatten(1)) * self.head_scale


# ---------------------------------------------------------------------------------------------------------------
# Orthogonalised updates (Muon: Jordan et al. 2024, the optimizer of airbench94's 0.29 PF record)

# A quintic iteration x <- a x + b x^3 + c x^5 (on singular values) with a steep slope at 0, so small singular
# values grow fast (~480x in 5 steps). It does not converge to 1: after 5 steps those above ~1/200 of the
# Frobenius norm sit in about [0.7, 1.2], which updates tolerate, in far fewer steps than a convergent iteration.
NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g, steps=5, eps=1e-7):
    """Approximately the orthogonal polar factor U V^T of the matrix g = U S V^T (singular vectors kept, every
    singular value pushed towards 1), by matrix products only; g may be a batch of matrices (..., rows, cols).
    Works on the wide orientation, where X X^T is the smaller Gram matrix."""
    a, b, c = NEWTON_SCHULZ_COEFFICIENTS
    x = g / (torch.linalg.matrix_norm(g, keepdim=True) + eps)  # Frobenius norm 1, so every singular value <= 1
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def newton_schulz_grouped(mats, steps=5):
    """newton_schulz of each matrix, those with the same shorter side as one batch (their longer sides zero-padded
    to the group's longest), so each product of the iteration is one batched matmul per group instead of one per
    matrix: on a GPU a step's dozens of small products cost more to launch than to run. The padding is exact:
    [X 0] has X's Frobenius norm and orthogonalises to [O(X) 0]."""
    wide = [m.mT if m.shape[0] > m.shape[1] else m for m in mats]
    groups = {}
    for i, m in enumerate(wide):
        groups.setdefault(m.shape[0], []).append(i)
    out = [None] * len(mats)
    for members in groups.values():
        cols = max(wide[i].shape[1] for i in members)
        batch = torch.stack([F.pad(wide[i], (0, cols - wide[i].shape[1])) for i in members])
        for i, o in zip(members, newton_schulz(batch, steps)):
            o = o[:, :wide[i].shape[1]]
            out[i] = o.mT if mats[i].shape[0] > mats[i].shape[1] else o
    return out


# torch.compile's modes that also record CUDA graphs on a GPU (torch._inductor.list_mode_options sets
# "triton.cudagraphs" in these): not only reduce-overhead, max-autotune too
CUDA_GRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")


def closure_loss(closure):
    """What an optimizer's step(closure) returns: the loss that the closure recomputes with gradients, or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


MUON_NORMS = ("none", "initial", "sqrt_out")


def muon_update(params, grads, bufs, norms, lr, momentum, nesterov, weight_decay, orthogonalize, ns_steps,
                scales):
    """One parameter group's update, in place on params and bufs (the momentum buffers; zeros before the first
    step, which makes the first buffer the gradient itself). lr: a number, or a 0-d tensor on the device where the
    update is compiled (a new LR then needs no new graph). norms: each orthogonalised weight's target Frobenius
    norm, or None; scales: sqrt(max(1, rows / cols)) per weight."""
    orthogonalised = []  # (weight, its update, norm, scale), orthogonalised together below
    for p, g, buf, norm, scale in zip(params, grads, bufs, norms, scales):
        ortho = orthogonalize and p.ndim >= 2
        if weight_decay and not ortho:
            g = g.add(p, alpha=weight_decay)
        if momentum:
            buf.mul_(momentum).add_(g)
            g = g.add(buf, alpha=momentum) if nesterov else buf
        if ortho:
            orthogonalised.append((p, g, norm, scale))
        else:
            p.sub_(g * lr) if isinstance(lr, torch.Tensor) else p.sub_(g, alpha=lr)
    updates = newton_schulz_grouped([g.reshape(p.shape[0], -1).float() for p, g, _, _ in orthogonalised], ns_steps)
    for (p, _, norm, scale), update in zip(orthogonalised, updates):
        update = update.reshape(p.shape).to(p.dtype)
        if weight_decay:
            p.mul_(1 - lr * weight_decay)
        p.sub_(update * (lr * scale)) if isinstance(lr, torch.Tensor) else p.sub_(update, alpha=lr * scale)
        if norm is not None:
            p.mul_(norm / torch.linalg.vector_norm(p))


class Muon(torch.optim.Optimizer):
    """SGD with momentum, except that in groups with orthogonalize=True each weight's update (its Nesterov
    momentum, conv filters flattened to out x in*k*k) is replaced by newton_schulz(update): every direction of
    the update moves at the same rate, whatever the gradient's scale in it.

    Orthogonalised tensors: p <- p * (1 - lr * weight_decay) - lr * sqrt(max(1, rows / cols)) * O, where
    the factor gives tall matrices the same update size per entry as wide ones; then `norm` rescales the weight
    to a fixed Frobenius norm: "initial" the one it had at its first step, "sqrt_out" sqrt(rows) (airbench94's
    Muon record), "none" leaves it. The nets here follow every conv with batch norm, so the norm does not change
    the function, only how far a step of size lr turns the weight.
    Other tensors (BN biases, the head): exactly torch.optim.SGD (weight decay added to the gradient).

    compiled=True runs each group's update as one torch.compile'd graph (in compile_mode): eager, a small net's
    step is hundreds of tiny kernels, each costing more to launch than to run on a GPU. With compile_mode
    "reduce-overhead" (or "max-autotune": CUDA_GRAPH_COMPILE_MODES) the graph is also a CUDA graph, replayed in
    one launch; it updates the momentum buffers in place, which inductor allows only in tensors marked as having
    fixed addresses (the weights are, as parameters), so the buffers, LR tensors and norms are marked. Call
    warm_up() after a backward pass, before timing: it compiles (and records) the update on the real tensors, then
    puts the weights and state back."""

    def __init__(self, params, lr, momentum=0.9, nesterov=True, weight_decay=0.0, orthogonalize=False,
                 ns_steps=5, norm="none", compiled=False, compile_mode="default"):
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0 or ns_steps < 1 or norm not in MUON_NORMS:
            raise ValueError("Muon needs lr, weight_decay >= 0, momentum in [0, 1), ns_steps >= 1 and norm in "
                             + ", ".join(MUON_NORMS))
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                                      orthogonalize=orthogonalize, ns_steps=ns_steps, norm=norm))
        self.compiled = compiled
        self.fixed_addresses = compiled and compile_mode in CUDA_GRAPH_COMPILE_MODES
        if compiled:  # dynamo keeps 8 graphs of a function per process, and each set of filter shapes (a net's
            # widths, the proxy's) takes up to one per group and mode: a third width would pass that, and a
            # fullgraph compile past the limit fails
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self._update = (torch.compile(muon_update, fullgraph=True, dynamic=False, mode=compile_mode) if compiled
                        else muon_update)
        self._lr = {}  # compiled: each group's LR as a 0-d device tensor, refilled every step

    def _lr_tensor(self, i, device, value):
        if i not in self._lr:
            self._lr[i] = self._fixed(torch.zeros((), device=device))
        return self._lr[i].fill_(value)  # a kernel with the value as its argument: no copy, no sync

    def _fixed(self, t):
        """t, marked (when the update runs as a CUDA graph) as an input whose address stays: inductor then lets
        the graph update it in place; at a new address the graph is recorded again."""
        if self.fixed_addresses and t is not None:
            torch._dynamo.mark_static_address(t)
        return t

    def _state_of(self, group, params):
        """The momentum buffers (zeros before the first step: then the first buffer is the gradient itself, as in
        torch.optim.SGD), target norms (taken now if this is the first step) and update scales of params."""
        bufs, norms, scales = [], [], []
        for p in params:
            state = self.state[p]
            if group["momentum"] and "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            bufs.append(self._fixed(state.get("momentum_buffer")))  # (again after a load_state_dict)
            ortho = group["orthogonalize"] and p.ndim >= 2
            if ortho and group["norm"] != "none" and "norm" not in state:  # (full: made on the device, where
                # torch.tensor would copy from the host, which a GPU's first step would wait for)
                state["norm"] = (torch.linalg.vector_norm(p.detach()) if group["norm"] == "initial"
                                 else torch.full((), float(p.shape[0]), device=p.device).sqrt())
            norms.append(self._fixed(state["norm"]) if ortho and group["norm"] != "none" else None)
            scales.append(max(1.0, p.shape[0] * p.shape[0] / p.numel()) ** 0.5 if p.ndim >= 2 else 1.0)
        return bufs, norms, scales

    def _arguments(self, group, params, grads, bufs, norms, scales, lr):
        return (params, grads, bufs, norms, lr, group["momentum"], group["nesterov"], group["weight_decay"],
                group["orthogonalize"], group["ns_steps"], scales)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for i, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            # the compiled graph is fixed by the parameters that train (so warm_up can build it before any
            # gradient exists); a group where one of them has no gradient this step takes the eager path
            trainable = sum(p.requires_grad for p in group["params"])
            compiled = self.compiled and bool(params) and len(params) == trainable
            bufs, norms, scales = self._state_of(group, params)
            lr = self._lr_tensor(i, params[0].device, group["lr"]) if compiled else group["lr"]
            (self._update if compiled else muon_update)(
                *self._arguments(group, params, [p.grad for p in params], bufs, norms, scales, lr))
        return loss

    @torch.no_grad()
    def warm_up(self):
        """Compiles each group's update for the parameters that train now (under CUDA graphs, call it once after
        each of the backward passes that record the net's graph, so that the update's graph is recorded after
        each of them too), on the real tensors, whose addresses a CUDA graph keeps: LR 0, their gradients (zeros
        where none). Then the weights and momentum buffers are put back: the optimizer has not stepped. A norm it
        takes is the one the first step would take, as the weights have not moved."""
        if not self.compiled:
            return
        for i, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.requires_grad]
            if not params:
                continue
            bufs, norms, scales = self._state_of(group, params)
            kept = params + [b for b in bufs if b is not None]
            saved = [t.clone() for t in kept]
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
            lr = self._lr_tensor(i, params[0].device, 0.0)
            self._update(*self._arguments(group, params, grads, bufs, norms, scales, lr))
            for t, s in zip(kept, saved):
                t.copy_(s)

    def update_flops(self):
        """FLOPs of one step's Newton-Schulz products (counted, like the net's), for the run's FLOP total."""
        total = 0
        for group in self.param_groups:
            if group["orthogonalize"]:
                # on the meta device: shapes alone give the count (padding included), nothing is computed
                mats = [torch.ones(p.shape[0], p.numel() // p.shape[0], device="meta") for p in group["params"]
                        if p.requires_grad and p.ndim >= 2]
                total += count_flops(lambda: newton_schulz_grouped(mats, group["ns_steps"]))
        return total


# ---------------------------------------------------------------------------------------------------------------
# Evaluation and FLOPs

def shifted(x, dy, dx):
    """x with its content moved dy pixels down and dx right (negative: up, left); the uncovered border is
    reflect-padded, as the training crops pad."""
    k = max(abs(dy), abs(dx))
    if not k:
        return x
    h, w = x.shape[2:]
    return F.pad(x, (k, k, k, k), mode="reflect")[:, :, k - dy:k - dy + h, k - dx:k - dx + w]


def view_weights(shifts, centre_weight):
    """((dy, dx, mirrored), weight) of each view: the image and its mirror (centre_weight between them) and the
    mirrored pair of each (dy, dx) shift (the rest of the weight, split evenly)."""
    views = [((0, 0, False), centre_weight / 2), ((0, 0, True), centre_weight / 2)]
    per_shifted = (1 - centre_weight) / (2 * len(shifts)) if shifts else 0.0
    return views + [((dy, dx, mirrored), per_shifted) for dy, dx in shifts for mirrored in (False, True)]


def shifted_views(x, shifts, centre_weight):
    """(view, weight) pairs of x, as view_weights lists them."""
    moved = {(0, 0): x} | {shift: shifted(x, *shift) for shift in shifts}  # each shift padded once for its pair
    return [(moved[dy, dx].flip(3) if mirrored else moved[dy, dx], w)
            for (dy, dx, mirrored), w in view_weights(shifts, centre_weight)]


def tta_views(x, level):
    """(view, weight) pairs. 0: the image; 1: and its mirror; 2: the mirrored pair (weight 1/2 in all) and
    the pairs shifted one pixel down-right and up-left (reflect-padded; 1/2 in all). More shifts do not help
    fast94's nets (benchmarks/eval_tta.py --view-sets)."""
    if level == 0:
        return [(x, 1.0)]
    if level == 1:
        return [(x, 0.5), (x.flip(3), 0.5)]
    return shifted_views(x, [(1, 1), (-1, -1)], 0.5)


@torch.no_grad()
def predict(model, x, precision, device, batch_size=1000, tta=0, tta_confidence=0.0, on_batch=None):
    """Logits averaged over TTA views, in fp32. With tta_confidence > 0 the views beyond the image itself are run
    only for the images whose plain prediction is unsure (top softmax probability below tta_confidence); the
    others keep their plain logits. TTA rarely overturns a confident prediction, so this can keep its gain for a
    fraction of its forward passes (benchmarks/eval_tta.py measures both on trained nets). on_batch(k) is
    called on the host after the k-th batch (a progress line; it reads nothing from the device). The model's
    mode (train or eval) is as it was after."""
    was_training = model.training
    model.eval()
    outs = []
    for i in range(0, len(x), batch_size):
        xb = x[i:i + batch_size]
        with autocast(precision, device):
            if not tta or not tta_confidence:
                outs.append(sum(w * model(v).float() for v, w in tta_views(xb, tta)))
            else:
                outs.append(confident_tta(model, xb, tta, tta_confidence))
        if on_batch:
            on_batch(i // batch_size + 1)
    model.train(was_training)
    return torch.cat(outs)


def confident_tta(model, x, tta, tta_confidence):
    """predict's logits for one batch where only the unsure images get the extra views."""
    plain = model(x).float()
    unsure = (plain.softmax(1).amax(1) < tta_confidence).nonzero().squeeze(1)
    out = plain.clone()
    if len(unsure):
        (_, w_plain), *others = tta_views(x[unsure], tta)  # the first view is the image itself
        out[unsure] = w_plain * plain[unsure] + sum(w * model(v).float() for v, w in others)
    return out


def count_flops(fn):
    """FLOPs (multiply-adds count 2) of one call of fn, counted by PyTorch's dispatcher, not estimated."""
    from torch.utils.flop_counter import FlopCounterMode
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return counter.get_total_flops()
