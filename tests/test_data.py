import gzip
import os
import pickle
import sys
import tarfile

import numpy as np
import pytest

import torch_backend as tb

NAMES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def write_batches(folder, data):
    """The official pickled layout: rows of 3072 bytes, channel-major (CHW)."""
    os.makedirs(folder, exist_ok=True)
    chunks = np.array_split(np.arange(len(data["train_y"])), 5)
    parts = [(data["train_x"][c], data["train_y"][c]) for c in chunks] + [(data["test_x"], data["test_y"])]
    for name, (x, y) in zip(NAMES, parts):
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump({b"data": x.transpose(0, 3, 1, 2).reshape(len(x), -1), b"labels": y.tolist()}, f)


def assert_same(a, b):
    for k in ("train_x", "train_y", "test_x", "test_y"):
        np.testing.assert_array_equal(a[k], b[k])


def test_npz_batches_folder_and_tarball_load_the_same(tmp_path, tiny):
    np.savez(tmp_path / "c.npz", **tiny)
    write_batches(tmp_path / "root" / tb.BATCHES_DIR, tiny)
    with tarfile.open(tmp_path / tb.TARBALL, "w:gz") as tar:
        tar.add(tmp_path / "root" / tb.BATCHES_DIR, arcname=tb.BATCHES_DIR)
    for path in (tmp_path / "c.npz", tmp_path / "root", tmp_path / "root" / tb.BATCHES_DIR, tmp_path / tb.TARBALL):
        assert_same(tb.load_cifar10(str(path), download=False), tiny)


def test_an_incomplete_folder_beside_its_tarball_loads_the_tarball(tmp_path, tiny, monkeypatch):
    """An interrupted extraction left a folder missing batches: the complete tarball beside it was never read."""
    write_batches(tmp_path / "src" / tb.BATCHES_DIR, tiny)
    os.makedirs(tmp_path / "root")
    with tarfile.open(tmp_path / "root" / tb.TARBALL, "w:gz") as tar:
        tar.add(tmp_path / "src" / tb.BATCHES_DIR, arcname=tb.BATCHES_DIR)
    write_batches(tmp_path / "root" / tb.BATCHES_DIR, tiny)
    os.remove(tmp_path / "root" / tb.BATCHES_DIR / "data_batch_3")
    assert_same(tb.load_cifar10(str(tmp_path / "root"), download=False), tiny)
    # no tarball: offline, the folder's own error; with download, the download's too (it would extract again)
    os.remove(tmp_path / "root" / tb.TARBALL)
    with pytest.raises(tb.DataError, match="incomplete CIFAR-10 folder, missing data_batch_3$"):
        tb.load_cifar10(str(tmp_path / "root"), download=False)
    monkeypatch.setitem(sys.modules, "torchvision", None)  # (no download here: as if it were not installed)
    with pytest.raises(tb.DataError, match="missing data_batch_3; no CIFAR-10 data at .*torchvision .* not installed"):
        tb.load_cifar10(str(tmp_path / "root"), download=True)


def test_files_are_read_by_their_contents_not_their_names(tmp_path, tiny):
    """An .npz saved under another name was read as a tarball ("not a gzip file"); so was an uncompressed tar."""
    np.savez(tmp_path / "c.npz", **tiny)
    os.rename(tmp_path / "c.npz", tmp_path / "cifar.dat")
    write_batches(tmp_path / "root" / tb.BATCHES_DIR, tiny)
    with tarfile.open(tmp_path / "plain.tar", "w") as tar:
        tar.add(tmp_path / "root" / tb.BATCHES_DIR, arcname=tb.BATCHES_DIR)
    for path in (tmp_path / "cifar.dat", tmp_path / "plain.tar"):
        assert_same(tb.load_cifar10(str(path), download=False), tiny)


def test_truncated_files_are_clear_errors(tmp_path, tiny):
    np.savez_compressed(tmp_path / "c.npz", **tiny)
    raw = (tmp_path / "c.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(tb.DataError, match="cut.npz.*corrupt"):
        tb.load_cifar10(str(tmp_path / "cut.npz"), download=False)
    write_batches(tmp_path / "b", tiny)
    with tarfile.open(tmp_path / "x.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "b", arcname=tb.BATCHES_DIR)
    raw = (tmp_path / "x.tar.gz").read_bytes()
    (tmp_path / "cut.tar.gz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(tb.DataError, match="cut.tar.gz"):
        tb.load_cifar10(str(tmp_path / "cut.tar.gz"), download=False)
    (tmp_path / "b" / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(tb.DataError, match="data_batch_3"):
        tb.load_cifar10(str(tmp_path / "b"), download=False)
    os.remove(tmp_path / "b" / "test_batch")
    with pytest.raises(tb.DataError, match="missing test_batch"):
        tb.load_cifar10(str(tmp_path / "b"), download=False)
    os.remove(tmp_path / "b" / "data_batch_5")  # every one missing is named, not the first alone
    with pytest.raises(tb.DataError, match="incomplete CIFAR-10 folder, missing data_batch_5, test_batch$"):
        tb.load_cifar10(str(tmp_path / "b"), download=False)


def test_damaged_compressed_tarballs_are_clear_one_line_errors(tmp_path, tiny):
    """Damaged deflate data past the tarball's first member raised zlib.error (no OSError): a traceback. And a
    file that is no tarball at all gave tarfile's message of five lines, one per compression it tried."""
    write_batches(tmp_path / "b", tiny)
    with tarfile.open(tmp_path / "x.tar", "w") as tar:
        tar.add(tmp_path / "b", arcname=tb.BATCHES_DIR)
    raw = (tmp_path / "x.tar").read_bytes()
    # a gzip stream whose second member's deflate data is invalid (block type 3), as flipped bits in a download
    (tmp_path / "bad.tar.gz").write_bytes(gzip.compress(raw[:len(raw) // 2]) + gzip.compress(b"")[:10] + b"\xff" * 64)
    with pytest.raises(tb.DataError, match=r"bad.tar.gz: truncated or corrupt tarball \(error: "):
        tb.load_cifar10(str(tmp_path / "bad.tar.gz"), download=False)
    (tmp_path / "text.tar.gz").write_text("not a tarball\n" * 50)
    with pytest.raises(tb.DataError, match="text.tar.gz: truncated or corrupt tarball") as e:
        tb.load_cifar10(str(tmp_path / "text.tar.gz"), download=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(train_x=d["train_x"][:, :16]), "shape"),
    (lambda d: d.update(test_x=d["test_x"].astype(np.float32)), "dtype"),
    (lambda d: d.update(train_y=d["train_y"][:-1]), "labels"),
    (lambda d: d.update(test_y=d["test_y"] + 1), "labels 0..9"),
    (lambda d: d.update(test_y=d["test_y"].astype(np.int64) - 1), "labels 0..9"),  # -1..8: ten classes, one not ours
    (lambda d: d.update(train_y=d["train_y"] * 0), "classes"),
    (lambda d: d.update(train_y=d["train_y"].astype(np.float64)), "integer"),
    (lambda d: d.update(train_y=d["train_y"][:, None]), r"train_y has shape \(200, 1\)"),  # one label a row, 2-D
    (lambda d: d.update(test_y=d["test_y"] * 0), "test_y lacks"),  # a test set of one class scores nothing
    (lambda d: d.update(train_y=np.where(d["train_y"] == 9, 0, d["train_y"])), "train_y lacks"),  # one class short
    (lambda d: d.update(train_x=np.concatenate([d["train_x"], d["train_x"][..., :1]], -1)),
     r"train_x has shape \(200, 32, 32, 4\)"),  # RGBA: not RGB
    (lambda d: d.update(test_x=d["test_x"][:0], test_y=d["test_y"][:0]), "test_y must hold labels 0..9"),  # empty
])
def test_malformed_arrays_are_rejected(tmp_path, tiny, change, message):
    change(tiny)
    np.savez(tmp_path / "bad.npz", **tiny)
    with pytest.raises(tb.DataError, match=message):
        tb.load_cifar10(str(tmp_path / "bad.npz"), download=False)


def test_labels_of_any_integer_type_are_loaded_as_int64(tmp_path, tiny):
    """Labels stored as uint8 or int32 (as other CIFAR-10 exports keep them) come out int64, the type the
    cross-entropy loss takes as class indices, with the same values."""
    for dtype in (np.uint8, np.int32):
        np.savez(tmp_path / "small.npz", **dict(tiny, train_y=tiny["train_y"].astype(dtype),
                                                test_y=tiny["test_y"].astype(dtype)))
        data = tb.load_cifar10(str(tmp_path / "small.npz"), download=False)
        for k in ("train_y", "test_y"):
            assert data[k].dtype == np.int64 and data[k].tolist() == tiny[k].tolist()


def test_missing_arrays_and_missing_path(tmp_path, tiny):
    np.savez(tmp_path / "partial.npz", train_x=tiny["train_x"], train_y=tiny["train_y"])
    with pytest.raises(tb.DataError, match="missing arrays test_x, test_y") as e:
        tb.load_cifar10(str(tmp_path / "partial.npz"), download=False)
    assert "corrupt" not in str(e.value)  # a whole file lacking arrays, not a damaged one
    with pytest.raises(tb.DataError, match=str(tmp_path / "nowhere") + ".*--data"):
        tb.load_cifar10(str(tmp_path / "nowhere"), download=False)


def fake_torchvision(monkeypatch, cifar10):
    """torchvision, as far as the download uses it: datasets.CIFAR10(root=..., train=..., download=...) is cifar10."""
    import types
    monkeypatch.setitem(sys.modules, "torchvision", types.SimpleNamespace(datasets=types.SimpleNamespace(
        CIFAR10=cifar10)))


def test_offline_download_failure_names_the_path(tmp_path, monkeypatch):
    """With no data and no network, the download path must end in one DataError that says what to do."""
    def failing_cifar(**kwargs):
        raise OSError("network unreachable")
    fake_torchvision(monkeypatch, failing_cifar)
    with pytest.raises(tb.DataError, match=r"downloading it failed.*network unreachable.*--data"):
        tb.load_cifar10(str(tmp_path / "data"), download=True)


def test_real_cifar10_matches_published_statistics(cifar10):
    assert cifar10["train_x"].shape == (50000, 32, 32, 3) and cifar10["test_x"].shape == (10000, 32, 32, 3)
    assert np.bincount(cifar10["train_y"]).tolist() == [5000] * 10
    mean = cifar10["train_x"].reshape(-1, 3).mean(0) / 255
    np.testing.assert_allclose(mean, [0.49139968, 0.48215841, 0.44653091], atol=1e-6)


def test_dataset_fingerprint_is_per_row_sums_weighted_by_position(tiny):
    """Against a plain Python loop; the same images in another order, or one pixel changed, differ; keys beyond
    the four arrays (an API caller's label names) are ignored."""
    data = tb.validate(dict(tiny), "tiny")
    fp = tb.dataset_fingerprint(dict(data, label_names=["airplane"] * 10))
    for k in ("train_x", "train_y", "test_x", "test_y"):
        rows = [int(np.asarray(r, dtype=np.int64).sum()) for r in data[k]]
        assert fp[k] == [len(rows), sum((i + 1) * s for i, s in enumerate(rows))]
    swapped = dict(data, train_x=data["train_x"][[1, 0, *range(2, len(data["train_x"]))]])
    changed = dict(data, test_x=data["test_x"].copy())
    changed["test_x"][3, 0, 0, 0] ^= 1
    assert tb.dataset_fingerprint(swapped)["train_x"] != fp["train_x"]
    assert tb.dataset_fingerprint(changed)["test_x"] != fp["test_x"]


def test_a_folder_holding_the_tarball_or_a_cifar10_npz_loads_it(tmp_path, tiny):
    """Besides a batches folder, --data may name the folder a download or a copy left: the tarball in it, or
    a cifar10.npz."""
    write_batches(tmp_path / "src" / tb.BATCHES_DIR, tiny)
    os.makedirs(tmp_path / "t")
    with tarfile.open(tmp_path / "t" / tb.TARBALL, "w:gz") as tar:
        tar.add(tmp_path / "src" / tb.BATCHES_DIR, arcname=tb.BATCHES_DIR)
    os.makedirs(tmp_path / "n")
    np.savez(tmp_path / "n" / "cifar10.npz", **tiny)
    for folder in ("t", "n"):
        assert_same(tb.load_cifar10(str(tmp_path / folder), download=False), tiny)


def test_a_tarball_lacking_a_batch_names_it(tmp_path, tiny):
    """Not a KeyError from the member lookup: the one batch missing, named."""
    write_batches(tmp_path / "b", tiny)
    os.remove(tmp_path / "b" / "test_batch")
    with tarfile.open(tmp_path / "x.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "b", arcname=tb.BATCHES_DIR)
    with pytest.raises(tb.DataError, match=r"x.tar.gz: not a CIFAR-10 tarball, missing test_batch$"):
        tb.load_cifar10(str(tmp_path / "x.tar.gz"), download=False)


UNPICKLED = []


def _unpickled(value):
    UNPICKLED.append(value)
    return value


class UnpicklesCode:
    def __reduce__(self):
        return _unpickled, (0,)


def test_an_npz_holding_pickled_objects_is_refused_unread(tmp_path, tiny):
    """np.load with allow_pickle would run whatever an object array's pickle names: the file is refused as
    corrupt before any of it is unpickled."""
    labels = np.empty(len(tiny["train_y"]), dtype=object)
    labels[:] = tiny["train_y"].tolist()
    labels[0] = UnpicklesCode()
    np.savez(tmp_path / "objects.npz", **dict(tiny, train_y=labels))
    UNPICKLED.clear()
    with pytest.raises(tb.DataError, match="objects.npz: truncated or corrupt .npz"):
        tb.load_cifar10(str(tmp_path / "objects.npz"), download=False)
    assert UNPICKLED == []


def extracting(tiny, calls):
    """A CIFAR10 download that extracts `tiny` as the batches folder into its root, noting each root."""
    def cifar(root, train, download):
        calls.append(root)
        write_batches(os.path.join(root, tb.BATCHES_DIR), tiny)
    return cifar


def test_a_download_loads_the_batches_it_extracted(tmp_path, tiny, monkeypatch):
    """Into the folder given (made if absent), then read from the batches folder torchvision extracts there."""
    calls = []
    fake_torchvision(monkeypatch, extracting(tiny, calls))
    assert_same(tb.load_cifar10(str(tmp_path / "data"), download=True), tiny)
    assert calls == [str(tmp_path / "data")]


def test_a_missing_npz_or_tarball_path_is_never_a_download_folder(tmp_path, tiny, monkeypatch):
    """A mistyped file name (x.npz, x.tar.gz) is an error naming it, not a folder of that name to download into."""
    calls = []
    fake_torchvision(monkeypatch, extracting(tiny, calls))
    for name in ("x.npz", "x.tar.gz"):
        with pytest.raises(tb.DataError, match=f"^no CIFAR-10 data at .*{name}; pass --data"):
            tb.load_cifar10(str(tmp_path / name), download=True)
    assert calls == [] and not os.path.exists(tmp_path / "x.npz")


def test_a_train_subset_is_a_fixed_random_draw_of_up_to_every_image(tiny):
    """The rows are sorted by class in some exports: the subset is the seed-0 permutation's first n, not the
    first n rows; all the images (n = their number) is allowed, one more is refused; 0 is the data itself, and
    a negative n (which a slice would take as "all but n") is refused."""
    data = tb.validate(dict(tiny), "tiny")
    keep = np.random.default_rng(0).permutation(200)[:30]
    sub = tb.train_subset(data, 30, "tiny")
    np.testing.assert_array_equal(sub["train_x"], data["train_x"][keep])
    np.testing.assert_array_equal(sub["train_y"], data["train_y"][keep])
    assert sub["test_x"] is data["test_x"] and tb.train_subset(data, 0, "tiny") is data
    assert sorted(tb.train_subset(data, 200, "tiny")["train_y"].tolist()) == sorted(data["train_y"].tolist())
    with pytest.raises(tb.DataError, match="--train-subset 201 exceeds the 200 training images in tiny"):
        tb.train_subset(data, 201, "tiny")
    with pytest.raises(tb.DataError, match=r"--train-subset must be >= 0 \(0: all\), got -5"):
        tb.train_subset(data, -5, "tiny")
