"""Checks only a CUDA GPU can make (skipped elsewhere; benchmarks/gpu_session.sh runs their real-preset form,
`--sync-check true`, in its smoke). The CPU tests cover the same code's arithmetic."""
import pytest
import torch

import train_cifar
from conftest import synthetic

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SMALL = dict(data=synthetic(400, 100), device="cuda", log=lambda *a: None, log_dir=None, progress=False,
             batch_size=100, epochs=2, sync_check=True)


@pytest.mark.parametrize("preset, options", [
    ("fast94", dict(widths=(8, 16, 16), train_sizes=(24, 32))),  # Muon, resizing, selective TTA
    ("fast96", dict(widths=(8, 16, 16), proxy_widths=(4, 8, 8))),  # proxy selection, lookahead, residual blocks
    ("fast94", dict(widths=(8, 16, 16), precision="fp16")),  # the fixed loss scale
])
def test_training_steps_never_wait_on_the_gpu(preset, options):
    summary = train_cifar.train(preset, **SMALL, **options)
    assert summary["runs"][0]["accuracy"] is not None


def test_the_check_catches_a_step_that_reads_on_the_host(monkeypatch):
    """The check can fail: a step that reads its loss on the host (as GradScaler's overflow check does)."""
    step = train_cifar.train_step

    def reading_step(*args, **kwargs):
        out, loss = step(*args, **kwargs)
        loss.item()
        return out, loss
    monkeypatch.setattr(train_cifar, "train_step", reading_step)
    with pytest.raises(RuntimeError, match="synchroniz") as caught:
        train_cifar.train("fast94", **SMALL, widths=(8, 16, 16))
    assert any(entry.name == "reading_step" for entry in caught.traceback)  # that read, not another
