import numpy as np
import pytest
import torch

import torch_backend as tb


@pytest.mark.parametrize("pad, cutout, flip, jitter, dtype", [
    (0, 0, False, (0, 0), torch.float32), (2, 0, True, (0, 0), torch.float32), (4, 8, True, (0, 0), torch.float32),
    (4, 12, False, (0, 0), torch.float32), (2, 0, True, (0.14, 0.13), torch.float32),
    (4, 8, True, (0.5, 0), torch.bfloat16), (2, 6, False, (0, 0.3), torch.bfloat16)])
def test_batched_augmentation_equals_per_sample_loop(pad, cutout, flip, jitter, dtype):
    gen = torch.Generator().manual_seed(pad * 100 + cutout)
    data = torch.randn(64, 32 + 2 * pad, 32 + 2 * pad, 3, generator=gen).to(dtype)
    index = torch.randperm(64, generator=gen)[:40]
    aug = tb.draw_augmentation(40, pad, cutout, flip, gen, torch.device("cpu"), jitter=jitter)
    batched = tb.augment(data, index, aug, cutout=cutout)
    reference = tb.augment_reference(data, index, aug, cutout=cutout)
    assert batched.shape == (40, 3, 32, 32) and batched.dtype == dtype
    assert batched.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(batched, reference, rtol=0, atol=0)


def test_augmentation_pixel_by_pixel():
    """Both implementations against what each output pixel must be (augment_reference lives beside augment, so a
    mistake made in both would pass the test above): image b's pixel (y, x) is the padded image's (dy + y, dx + x),
    with x mirrored across the width when flipped, and zero inside the cutout square at (cy, cx) of the output."""
    n, size, cutout, channels = 4, 6, 2, 2  # (padded by 1: 8 x 8 images)
    data = torch.arange(n * (size + 2) ** 2 * channels, dtype=torch.float32).view(n, size + 2, size + 2, channels)
    index = torch.tensor([2, 0, 3])
    aug = dict(dy=torch.tensor([0, 2, 1]), dx=torch.tensor([2, 1, 0]), flip=torch.tensor([True, False, True]),
               cy=torch.tensor([0, 4, 3]), cx=torch.tensor([1, 0, 4]))
    expected = np.zeros((3, channels, size, size), np.float32)
    for b, i in enumerate(index.tolist()):
        dy, dx, cy, cx = (int(aug[k][b]) for k in ("dy", "dx", "cy", "cx"))
        for c in range(channels):
            for y in range(size):
                for x in range(size):
                    src_x = size - 1 - x if aug["flip"][b] else x
                    cut = cy <= y < cy + cutout and cx <= x < cx + cutout
                    expected[b, c, y, x] = 0 if cut else data[i, dy + y, dx + src_x, c]
    for out in (tb.augment(data, index, aug, size=size, cutout=cutout),
                tb.augment_reference(data, index, aug, size=size, cutout=cutout)):
        np.testing.assert_array_equal(out.numpy(), expected)


def test_colour_jitter_pixel_by_pixel():
    """With jitter each output pixel is (its cropped, flipped value + shift) * scale, computed here in float64, and
    cutout's square stays 0 (the mean colour of the normalised data) after it."""
    gen = torch.Generator().manual_seed(3)
    data = torch.randn(5, 12, 12, 3, generator=gen, dtype=torch.float64)
    index = torch.tensor([4, 1, 1])
    aug = dict(dy=torch.tensor([0, 2, 1]), dx=torch.tensor([1, 0, 2]), flip=torch.tensor([False, True, False]),
               cy=torch.tensor([0, 3, 5]), cx=torch.tensor([2, 0, 5]),
               shift=torch.tensor([0.25, -0.5, 0.0], dtype=torch.float64),
               scale=torch.tensor([1.5, 0.75, 1.0], dtype=torch.float64))
    expected = np.zeros((3, 3, 10, 10))
    for b, i in enumerate(index.tolist()):
        dy, dx, cy, cx = (int(aug[k][b]) for k in ("dy", "dx", "cy", "cx"))
        for y in range(10):
            for x in range(10):
                src_x = 9 - x if aug["flip"][b] else x
                cut = cy <= y < cy + 3 and cx <= x < cx + 3
                for c in range(3):
                    value = (float(data[i, dy + y, dx + src_x, c]) + float(aug["shift"][b])) * float(aug["scale"][b])
                    expected[b, c, y, x] = 0 if cut else value
    for out in (tb.augment(data, index, aug, size=10, cutout=3), tb.augment_reference(data, index, aug, size=10,
                                                                                      cutout=3)):
        np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-12)


def test_colour_jitter_draws_cover_their_ranges_and_leave_the_other_draws_alone():
    """Shifts fill [-brightness, brightness] and scales [1 - contrast, 1 + contrast], independently of each other;
    they are drawn after the rest, so a run without jitter draws (and trains on) exactly what it did before."""
    def draw(jitter):
        return tb.draw_augmentation(20000, 2, 4, True, torch.Generator().manual_seed(7), torch.device("cpu"),
                                    jitter=jitter)
    plain, jittered = draw((0, 0)), draw((0.2, 0.1))
    assert set(plain) == {"dy", "dx", "flip", "cy", "cx"}
    for k in plain:
        assert torch.equal(plain[k], jittered[k])
    shift, scale = jittered["shift"], jittered["scale"]
    assert -0.2 <= shift.min() < -0.199 and 0.199 < shift.max() <= 0.2 and abs(shift.mean()) < 0.005
    assert 0.9 <= scale.min() < 0.901 and 1.099 < scale.max() <= 1.1 and abs(scale.mean() - 1) < 0.003
    assert abs(np.corrcoef(shift.numpy(), scale.numpy())[0, 1]) < 0.03
    only_contrast = draw((0, 0.3))
    assert not only_contrast["shift"].any() and 0.7 <= only_contrast["scale"].min() < 0.701


def test_draws_cover_their_ranges():
    """Every crop offset 0..2*pad and cutout corner 0..size-cutout occurs, both ends included (no off-by-one)."""
    gen = torch.Generator().manual_seed(0)
    aug = tb.draw_augmentation(20000, 4, 8, True, gen, torch.device("cpu"))
    assert set(aug["dy"].tolist()) == set(range(9)) and set(aug["dx"].tolist()) == set(range(9))
    # the 8x8 square stays inside the 32x32 image, and reaches each of its edges
    assert set(aug["cy"].tolist()) == set(range(25)) and set(aug["cx"].tolist()) == set(range(25))
    # drawn independently per axis: every crop offset pair and every cutout corner occurs (20000 draws over 81 and
    # 625 cells; a miss has chance < 1e-10), not only the diagonal of one draw used twice
    assert set(zip(aug["dy"].tolist(), aug["dx"].tolist())) == {(y, x) for y in range(9) for x in range(9)}
    assert set(zip(aug["cy"].tolist(), aug["cx"].tolist())) == {(y, x) for y in range(25) for x in range(25)}
    small = tb.draw_augmentation(20000, 2, 6, False, gen, torch.device("cpu"), size=20)
    assert set(small["dy"].tolist()) == set(small["dx"].tolist()) == set(range(5))
    assert set(small["cy"].tolist()) == set(small["cx"].tolist()) == set(range(15))
    assert 0.48 < aug["flip"].float().mean() < 0.52
    none = tb.draw_augmentation(100, 0, 0, False, gen, torch.device("cpu"))
    assert not any(v.any() for v in none.values())


def test_unaugmented_crop_is_the_centre_of_the_padded_image():
    x = torch.randn(8, 32, 32, 3)
    padded = torch.nn.functional.pad(x.permute(0, 3, 1, 2), (2,) * 4, mode="reflect").permute(0, 2, 3, 1)
    aug = tb.draw_augmentation(8, 2, 0, False, torch.Generator().manual_seed(0), torch.device("cpu"))
    aug["dy"][:] = 2
    aug["dx"][:] = 2
    torch.testing.assert_close(tb.augment(padded, torch.arange(8), aug), x.permute(0, 3, 1, 2))


def test_to_device_normalises_and_pads(tiny):
    d = tb.to_device(tiny, torch.device("cpu"), torch.float32, pad=4)
    assert d["train_x"].shape == (200, 40, 40, 3) and d["test_x"].shape == (50, 3, 32, 32)
    x0 = torch.from_numpy(tiny["train_x"][0]).float()
    expected = (x0 / 255 - torch.tensor(tb.CIFAR_MEAN)) / torch.tensor(tb.CIFAR_STD)
    torch.testing.assert_close(d["train_x"][0, 4:36, 4:36], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d["train_x"][0, 3, 4:36], expected[1])  # reflect padding mirrors row 1
    # the test images: NCHW, test_x[n, c, i, j] from pixel (i, j) channel c, against float64 published constants
    mean, std = np.array([0.4914, 0.4822, 0.4465]), np.array([0.2470, 0.2435, 0.2616])
    want = np.empty((3, 32, 32))
    for c in range(3):
        want[c] = (tiny["test_x"][0][:, :, c].astype(np.float64) / 255 - mean[c]) / std[c]
    np.testing.assert_allclose(d["test_x"][0].double().numpy(), want, rtol=0, atol=1e-5)


def test_to_device_puts_every_array_on_the_device_test_images_channels_last(tiny):
    """On the meta device (a stand-in for a GPU: nothing left on the host shows): the labels too; the train
    images NHWC and contiguous in the run's dtype, the test images NCHW in channels_last memory, the nets' layout."""
    d = tb.to_device(tiny, torch.device("meta"), torch.bfloat16, pad=2)
    assert {k: v.device.type for k, v in d.items()} == dict.fromkeys(d, "meta")
    assert d["train_x"].dtype == d["test_x"].dtype == torch.bfloat16 and d["train_y"].dtype == torch.int64
    assert d["train_x"].shape == (200, 36, 36, 3) and d["train_x"].is_contiguous()
    assert d["test_x"].shape == (50, 3, 32, 32) and d["test_x"].is_contiguous(memory_format=torch.channels_last)
