import os
import sys

import numpy as np
import pytest
import torch
import torch.utils._python_dispatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    """Each test compiles for itself: torch.compile keeps a limited number of graphs per function (a net's
    forward: 8) across the whole process, so tests compiling one function for other shapes or modes would fill
    it, and the test after would run eager or, compiled with fullgraph, fail."""
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def no_figures_left_open():
    """Figures a test keeps open to inspect are closed after it: pyplot warns past 20 open figures, and a later
    test that turns warnings into errors (to catch matplotlib's own) would fail on that one."""
    yield
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close("all")


def figure_drawn(monkeypatch, draw):
    """The last figure draw() closes, kept open to be inspected (the plotting code closes each figure it saves);
    closed after all, so that they do not pile up across tests."""
    import matplotlib.pyplot as plt
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)
    draw()
    for fig in figures:
        close(fig)
    return figures[-1]


def real_data_path():
    return os.environ.get("CIFAR10_NPZ") or os.path.join(ROOT, "..", "shared", "data", "cifar10.npz")


@pytest.fixture(scope="session")
def cifar10():
    """The real data set; skipped only where it truly is absent."""
    path = real_data_path()
    if not os.path.exists(path):
        pytest.skip(f"real CIFAR-10 not found at {path} (set CIFAR10_NPZ)")
    import torch_backend as tb
    return tb.load_cifar10(path, download=False)


def synthetic(n_train=200, n_test=50, seed=0):
    """A tiny data set in the CIFAR-10 layout with every class present."""
    rng = np.random.default_rng(seed)
    return dict(train_x=rng.integers(0, 256, (n_train, 32, 32, 3), dtype=np.uint8),
                train_y=np.arange(n_train) % 10, test_x=rng.integers(0, 256, (n_test, 32, 32, 3), dtype=np.uint8),
                test_y=np.arange(n_test) % 10)


@pytest.fixture
def tiny():
    return synthetic()


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """On a CPU, what --sync-check refuses on a GPU: a tensor's value read on the host (item, int, float, bool) or
    an op whose output size depends on the values (nonzero, boolean masks, repeat_interleave without output_size).
    `paused` lets the loop's own allowed reads (a per-step evaluation) through."""
    paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not HostReads.paused:
            name = func._schema.name.split("::")[-1]
            masked = name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1])
            unsized = name == "repeat_interleave" and func._overloadname != "self_int" and "output_size" not in kwargs
            if name in ("_local_scalar_dense", "nonzero", "masked_select", "_unique2") or masked or unsized:
                raise AssertionError(f"{func} reads the device on the host")
        return func(*args, **kwargs)
