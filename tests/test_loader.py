"""The loader pipeline (pipeline.LoaderStream): PNG round trip, per-sample augmentation in the workers against the
reference definition, echo counts per upstream pass, whole-batch echo, the streaming shuffle buffer and exact
fresh-example counting, with 0 and 1 DataLoader workers."""
import collections
import math
import multiprocessing

import numpy as np
import pytest
import torch

import pipeline
import torch_backend as tb
import train_cifar
from conftest import synthetic

CPU = torch.device("cpu")
ALL_MODES = ["none", "example-before-aug", "example-after-aug", "batch"]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def loader_data(n=200, pad=2, dtype=torch.float32, seed=0):
    """What train() hands the loader pipeline: the device tensors (padded) plus the raw uint8 arrays."""
    raw = synthetic(n_train=n, n_test=10, seed=seed)
    data = tb.to_device(raw, CPU, dtype, pad=pad)
    data.update(raw_train_x=raw["train_x"], raw_train_y=raw["train_y"])
    return data


def stream_of(data, workers=0, **cfg):
    cfg = dict(dict(batch_size=20, pad=2, cutout=0, flip="random", echo="none", echo_factor=1,
                    echo_shuffle_buffer=0, loader_workers=workers), **cfg)
    return pipeline.LoaderStream(data, cfg, gen(cfg.pop("seed", 0)), CPU)


def test_png_round_trip_is_exact(cifar10):
    rng = np.random.default_rng(0)
    x = cifar10["train_x"][rng.permutation(len(cifar10["train_x"]))[:400]]
    extremes = np.stack([np.zeros((32, 32, 3), np.uint8), np.full((32, 32, 3), 255, np.uint8),
                         synthetic(n_train=10)["train_x"][0]])
    for images in (x, extremes):
        encoded = pipeline.EncodedImages(images)
        assert len(encoded) == len(images) and encoded.blob.dtype == np.uint8
        decoded = np.stack([encoded.decode(i) for i in range(len(images))])
        assert decoded.dtype == np.uint8 and np.array_equal(decoded, images)


def test_encoding_is_done_once_per_data_set():
    a, b = synthetic(n_train=20)["train_x"], synthetic(n_train=20, seed=1)["train_x"]
    assert pipeline.encode_pngs(a) is pipeline.encode_pngs(a)
    assert pipeline.encode_pngs(a.copy()) is pipeline.encode_pngs(a)  # the same pixels in another array
    assert pipeline.encode_pngs(b) is not pipeline.encode_pngs(a)
    assert pipeline.encode_pngs(a[:10]) is not pipeline.encode_pngs(a)


@pytest.mark.parametrize("size, pad", [(32, 0), (32, 2), (32, 4), (32, 16), (5, 3)])
def test_reflect_index_is_reflect_padding(size, pad):
    x = np.arange(size)
    assert np.array_equal(x[pipeline.reflect_index(size, pad)], np.pad(x, pad, mode="reflect"))


@pytest.mark.parametrize("pad, cutout, flip", [(0, 0, False), (2, 0, True), (4, 8, True), (4, 12, False)])
def test_worker_augmentation_equals_the_reference(pad, cutout, flip):
    """A worker's job, decoded from PNG and augmented one sample at a time, is augment_reference of the
    normalised, padded data set with the draws the worker made."""
    data = loader_data(n=100, pad=pad)
    dataset = pipeline.LoaderDataset(pipeline.encode_pngs(data["raw_train_x"]), data["raw_train_y"], pad, cutout, flip)
    index = np.random.default_rng(pad + cutout).permutation(100)[:60]
    out = dataset[(1, 7, 1234, index)]
    ref = tb.augment_reference(data["train_x"], torch.from_numpy(index), out, cutout=cutout)
    assert torch.equal(out["x"].permute(0, 3, 1, 2), ref)  # bit for bit
    assert torch.equal(out["y"], data["train_y"][index]) and (out["upstream"] == 7).all() and (out["pass"] == 1).all()
    again = dataset[(1, 7, 1234, index)]
    assert all(torch.equal(out[k], again[k]) for k in pipeline.AUG_KEYS)  # draws depend on the job only
    other = dataset[(1, 8, 1234, index)]
    if pad or flip or cutout:
        assert not all(torch.equal(out[k], other[k]) for k in pipeline.AUG_KEYS)


def test_draws_cover_the_device_pipelines_ranges():
    aug = pipeline.draw_augmentation_np(np.random.default_rng(0), 20000, 4, 8, True)
    assert set(aug["dy"].tolist()) == set(range(9)) and set(aug["dx"].tolist()) == set(range(9))
    assert set(aug["cy"].tolist()) == set(range(25)) and set(aug["cx"].tolist()) == set(range(25))
    # each axis its own draw: every offset pair and cutout corner occurs (a miss has chance < 1e-10)
    assert set(zip(aug["dy"].tolist(), aug["dx"].tolist())) == {(y, x) for y in range(9) for x in range(9)}
    assert set(zip(aug["cy"].tolist(), aug["cx"].tolist())) == {(y, x) for y in range(25) for x in range(25)}
    assert 0.48 < aug["flip"].mean() < 0.52


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("mode, factor", [("none", 1), ("example-before-aug", 2), ("example-after-aug", 2.5),
                                          ("batch", 2)])
def test_stream_batches_are_the_reference_augmentation(mode, factor, workers):
    data = loader_data(n=100, pad=4)
    stream = stream_of(data, workers, pad=4, cutout=8, echo=mode, echo_factor=factor, batch_size=25)
    for _ in range(10):  # crosses a pass boundary (4 upstream batches per pass)
        x, y = stream.next_batch()
        assert x.shape == (25, 3, 32, 32) and x.dtype == torch.float32
        assert x.is_contiguous(memory_format=torch.channels_last)
        ref = tb.augment_reference(data["train_x"], stream.last["index"], stream.last, cutout=8)
        assert torch.equal(x, ref) and torch.equal(y, data["train_y"][stream.last["index"]])
    stream.close()


def test_bf16_slices_of_the_global_batch():
    data = loader_data(n=100, pad=2, dtype=torch.bfloat16)
    stream = stream_of(data, echo="example-before-aug", echo_factor=2, cutout=4)
    x, y = stream.next_batch(5, 15)
    ref = tb.augment_reference(data["train_x"], stream.last["index"][5:15],
                               {k: v[5:15] for k, v in stream.last.items()}, cutout=4)
    assert x.dtype == torch.bfloat16 and x.shape == (10, 3, 32, 32) and torch.equal(x, ref)
    assert torch.equal(y, data["train_y"][stream.last["index"][5:15]])


def test_the_number_of_workers_does_not_change_the_batches():
    data = loader_data(n=100)
    a, b = (stream_of(data, w, echo="example-after-aug", echo_factor=1.5, echo_shuffle_buffer=30) for w in (0, 1))
    for _ in range(12):
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    c = stream_of(data, 0, echo="example-after-aug", echo_factor=1.5, echo_shuffle_buffer=30, seed=1)
    assert not torch.equal(c.next_batch()[0], stream_of(data, 0, echo="example-after-aug", echo_factor=1.5,
                                                         echo_shuffle_buffer=30).next_batch()[0])
    b.close()


def count_per_pass(stream, batches):
    seen = collections.Counter()
    draws = collections.defaultdict(set)
    for _ in range(batches):
        stream.next_batch()
        last = stream.last
        for r in range(len(last["index"])):
            key = (int(last["pass"][r]), int(last["index"][r]))
            seen[key] += 1
            draws[key].add(tuple(int(last[k][r]) for k in pipeline.AUG_KEYS))
    return seen, draws


@pytest.mark.parametrize("factor", [1, 2, 3])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_each_example_appears_factor_times_per_upstream_pass(mode, factor):
    """250 examples, batch 20: a pass delivers 12 upstream batches (240 examples, 10 dropped) and, echoed,
    12 * factor training batches, in which every delivered example appears factor times."""
    data = loader_data(n=250)
    stream = stream_of(data, pad=4, echo=mode, echo_factor=factor)
    e = factor if mode != "none" else 1
    seen, draws = count_per_pass(stream, 2 * 12 * e)
    assert stream.passes == 2 and stream.fresh_read == 2 * 240
    for p in (1, 2):
        in_pass = {i: c for (q, i), c in seen.items() if q == p}
        assert len(in_pass) == 240 and set(in_pass.values()) == {e}
    if mode in ("example-after-aug", "batch"):  # copies are the same augmented example
        assert all(len(d) == 1 for d in draws.values())
    elif mode == "example-before-aug" and e > 1:  # every copy is augmented on its own
        assert sum(len(d) for d in draws.values()) > 0.9 * sum(seen.values())


@pytest.mark.parametrize("mode, factor, workers", [("none", 1, 0), ("none", 1, 1), ("example-before-aug", 2, 0),
                                                   ("example-after-aug", 2, 0)])
def test_alternating_flips_alternate_every_pass_as_on_the_device(mode, factor, workers):
    """flip="alternate" (fast94's): each example flipped one way in a pass and the other way in the next, every
    copy alike, the first way random per example; the batches still the reference augmentation of those draws.
    (Before 2026-12-05 the loader flipped at random here while its logs said alternate.)"""
    data = loader_data(n=100)
    stream = stream_of(data, workers, flip="alternate", echo=mode, echo_factor=factor)
    flips = collections.defaultdict(set)
    for _ in range(3 * 5 * factor):  # three upstream passes of 5 batches
        x, _ = stream.next_batch()
        last = stream.last
        assert torch.equal(x, tb.augment_reference(data["train_x"], last["index"], last))
        for i, p, f in zip(last["index"].tolist(), last["pass"].tolist(), last["flip"].tolist()):
            flips[i, p].add(f)
    assert stream.passes == 3 and all(len(f) == 1 for f in flips.values())
    first = [flips[i, 1].pop() for i in range(100)]
    assert 30 < sum(first) < 70
    assert all(flips[i, 2] == {not first[i]} and flips[i, 3] == {first[i]} for i in range(100))
    stream.close()


@pytest.mark.parametrize("workers, factor", [(0, 2), (1, 3), (0, 2.5)])
def test_batch_echo_repeats_whole_identical_batches(workers, factor):
    data = loader_data(n=100)
    stream = stream_of(data, workers, echo="batch", echo_factor=factor, cutout=6)
    groups, previous = [], None
    for _ in range(30):
        x, y = stream.next_batch()
        u = stream.last["upstream"]
        assert (u == u[0]).all()  # a training batch is one upstream batch
        if previous is not None and int(u[0]) == previous[0]:
            assert torch.equal(x, previous[1]) and torch.equal(y, previous[2])
            groups[-1] += 1
        else:
            groups.append(1)
        previous = (int(u[0]), x, y)
    assert int(stream.last["upstream"][0]) == len(groups) - 1 and stream.fresh_read == 20 * len(groups)
    full = groups[:-1]  # the last group may be cut short
    if factor == int(factor):
        assert set(full) == {factor}
    else:
        assert set(full) == {2, 3}


def test_shuffle_buffer_streams_every_item_exactly_once():
    for n, size in [(1000, 10), (1000, 999), (5, 10), (300, 64)]:
        buf = pipeline.ShuffleBuffer(size, gen(size))
        assert buf.push(list(range(n))) + buf.flush() == pipeline.shuffle_buffer_order(n, size, gen(size)).tolist()
        buf, out, pushed = pipeline.ShuffleBuffer(size, gen(1)), [], 0
        chunks = np.random.default_rng(size).integers(1, 50, 100)
        for k in chunks:  # pushed in pieces, as upstream batches arrive
            items = list(range(pushed, min(pushed + int(k), n)))
            pushed += len(items)
            emitted = buf.push(items)
            assert len(emitted) == max(0, pushed - size) - len(out) and all(i < pushed for i in emitted)
            out += emitted
        out += buf.flush()
        assert sorted(out) == list(range(n)) and (size >= n or out != list(range(n)))


@pytest.mark.parametrize("workers", [0, 1])
def test_shuffled_echo_stream_keeps_every_item_exactly_once(workers):
    """With a 50-item buffer the stream is shuffled across batches and passes, yet what came out plus what is
    still waiting (echo stage, buffer) is every delivered example of every pass exactly factor times."""
    data = loader_data(n=100)
    stream = stream_of(data, workers, echo="example-after-aug", echo_factor=2, echo_shuffle_buffer=50)
    seen, _ = count_per_pass(stream, 33)  # 660 items out, not a whole number of upstream batches
    waiting = stream.ready + stream.buffer.items
    assert len(stream.buffer.items) == 50
    for r in waiting:
        info = stream.chunks[r // 20].info
        seen[(int(info["pass"][r % 20]), int(info["index"][r % 20]))] += 1
    passes = stream.fresh_read // 100 + (stream.fresh_read % 100 > 0)
    assert sum(seen.values()) == 2 * stream.fresh_read and passes == stream.passes == 4
    assert set(seen.values()) == {2}
    for p in range(1, passes):  # complete passes: every example
        assert {i for q, i in seen if q == p} == set(range(100))
    plain = stream_of(data, workers, echo="example-after-aug", echo_factor=2)
    plain.next_batch()
    assert (plain.last["index"][0::2] == plain.last["index"][1::2]).all()  # without the buffer copies are adjacent
    stream.next_batch()
    assert (stream.last["index"][0::2] != stream.last["index"][1::2]).any()


@pytest.mark.parametrize("mode, factor, buffer", [("none", 1, 0), ("example-before-aug", 2.5, 0),
                                                  ("example-after-aug", 3, 37), ("batch", 2, 0), ("batch", 1.5, 25)])
def test_fresh_read_counts_exactly_the_delivered_examples(mode, factor, buffer):
    """Upstream batches 0, 1, ... are delivered in order; each is either emitted or still waiting (echo stage,
    shuffle buffer), so fresh_read is 20 times the number of upstream batches referred to so far."""
    data = loader_data(n=100)
    stream = stream_of(data, echo=mode, echo_factor=factor, echo_shuffle_buffer=buffer)
    assert stream.fresh_read == 0
    emitted = set()
    for k in range(1, 31):
        stream.next_batch()
        emitted |= set(stream.last["upstream"].tolist())
        waiting = {r // 20 for r in stream.ready + (stream.buffer.items if stream.buffer else [])}
        referred = emitted | waiting
        assert stream.fresh_read == 20 * len(referred) == 20 * (max(referred) + 1)
        if mode == "none":
            assert stream.fresh_read == 20 * k
        elif buffer == 0 and factor == int(factor):
            assert stream.fresh_read == 20 * math.ceil(k / factor)
    assert stream.passes == math.ceil(stream.fresh_read / 100)


def test_checkpoint_is_not_supported():
    stream = stream_of(loader_data(n=40))
    with pytest.raises(ValueError, match="--checkpoint is not supported with --pipeline loader"):
        stream.state_dict()


def test_train_with_the_loader_pipeline_counts_fresh_examples(tiny):
    """End to end: 200 images, batch 50 (4 steps an epoch), batch echo 2: an epoch reads 100 fresh examples."""
    s = train_cifar.train("fast94", data=tiny, log_dir=None, log=lambda *a: None, widths=(8, 16, 16), batch_size=50,
                          epochs=2, precision="fp32", tta=0, pipeline="loader", loader_workers=1, echo="batch",
                          echo_factor=2)
    run = s["runs"][0]
    assert [r["fresh"] for r in run["epochs"]] == [100, 200] and run["accuracy"] is not None


@pytest.mark.parametrize("mode, factor", [("none", 1), ("example-before-aug", 2)])
def test_alternating_flips_start_from_the_base_flip_in_the_first_pass(mode, factor):
    """Guards against swapped pass parity: odd passes (the first is 1) flip as base_flip, even ones the other way."""
    stream = stream_of(loader_data(n=40), flip="alternate", echo=mode, echo_factor=factor)
    passes = set()
    for _ in range(2 * 2 * factor):  # two upstream passes of 2 batches of 20
        stream.next_batch()
        last = stream.last
        for i, p, f in zip(last["index"].tolist(), last["pass"].tolist(), last["flip"].tolist()):
            assert f == (bool(stream.base_flip[i]) if p % 2 == 1 else not stream.base_flip[i])
            passes.add(p)
    assert passes == {1, 2} and 0 < stream.base_flip.sum() < 40


def test_upstream_jobs_reshuffle_every_pass():
    """Guards against one permutation being reused for every pass: each pass is a new order of all examples."""
    jobs = iter(pipeline.UpstreamJobs(30, 10, shuffle_seed=3, aug_seed=7))
    orders = []
    for p in range(1, 5):
        order = []
        for u in range(3 * (p - 1), 3 * p):  # 3 upstream batches of 10 per pass, numbered on across passes
            pass_no, upstream, seed, index = next(jobs)
            assert (pass_no, upstream, seed, len(index)) == (p, u, 7, 10)
            order += index.tolist()
        assert sorted(order) == list(range(30))
        orders.append(order)
    assert len({tuple(o) for o in orders}) == 4


@pytest.mark.parametrize("buffer", [0, 8])
def test_finished_upstream_batches_are_released(buffer):
    """Guards against a leak: upstream batches whose echoed items were all emitted must be freed."""
    factor, bs = 1.5, 4
    stream = stream_of(loader_data(n=40), batch_size=bs, echo="example-after-aug", echo_factor=factor,
                       echo_shuffle_buffer=buffer)
    # fewer than bs * ceil(factor) items wait in `ready` after a batch; in order (no buffer) they span at most
    # ceil(factor) + 1 upstream batches, and with a buffer at most one batch per waiting item
    bound = math.ceil(factor) + 1 if not buffer else buffer + bs * math.ceil(factor)
    for _ in range(60):  # about 40 upstream batches
        stream.next_batch()
        waiting = stream.ready + (stream.buffer.items if stream.buffer else [])
        assert len(stream.chunks) <= bound and set(stream.chunks) == {r // bs for r in waiting}
    assert stream.fresh_read >= 30 * bs


def test_png_cache_is_not_fooled_by_a_reused_id(monkeypatch):
    """Guards against encode_pngs returning a freed array's PNGs for a new array that got the same id()."""
    monkeypatch.setattr(pipeline, "_PNG_BY_ID", {})
    monkeypatch.setattr(pipeline, "id", lambda obj: 12345, raising=False)  # every array gets the same id
    a = synthetic(n_train=4, seed=1)["train_x"]
    assert np.array_equal(pipeline.encode_pngs(a).decode(0), a[0])
    del a  # freed: its id may now be handed to a new array
    b = synthetic(n_train=4, seed=2)["train_x"]
    encoded = pipeline.encode_pngs(b)
    assert np.array_equal(np.stack([encoded.decode(i) for i in range(4)]), b)


@pytest.mark.parametrize("mode, factor", [("none", 1), ("example-before-aug", 2), ("example-after-aug", 2),
                                          ("batch", 2)])
def test_flip_none_never_flips_and_random_flips_half(mode, factor):
    """Guards against flip="none" flipping, or "random" never flipping, in the workers or (example-before-aug)
    in the echo stage's own draws; the images are checked against the reference with those flips."""
    data = loader_data(n=40)
    for flip in ("none", "random"):
        stream = stream_of(data, flip=flip, echo=mode, echo_factor=factor)
        flips = []
        for _ in range(6):
            x, _ = stream.next_batch()
            assert torch.equal(x, tb.augment_reference(data["train_x"], stream.last["index"], stream.last, cutout=0))
            flips.append(stream.last["flip"])
        flips = torch.cat(flips)
        if flip == "none":
            assert not flips.any()
        else:  # 120 fair coins: 0.5 +- 0.05 sd
            assert 0.3 < flips.float().mean() < 0.7
        stream.close()


def test_every_upstream_batch_draws_its_own_augmentations():
    """Guards against worker seeds that repeat across upstream batches (the same crops and cutouts every few
    batches or every pass): over three passes no two upstream batches have the same draws."""
    stream = stream_of(loader_data(n=100, pad=4), pad=4, cutout=8, batch_size=25)
    draws = {}
    for _ in range(12):
        stream.next_batch()
        last = stream.last
        draws[int(last["upstream"][0])] = tuple(tuple(last[k].tolist()) for k in pipeline.AUG_KEYS)
    stream.close()
    assert sorted(draws) == list(range(12)) and len(set(draws.values())) == 12


def test_close_stops_the_workers_at_once():
    """Persistent workers: the DataLoader keeps its iterator, so dropping the stream's alone left them running
    (and holding memory) while study_data_echo timed training steps after close()."""
    stream = stream_of(loader_data(), workers=1)
    stream.next_batch()
    workers = multiprocessing.active_children()
    assert workers and all(w.is_alive() for w in workers)
    stream.close()
    for w in workers:
        w.join(timeout=10)
    assert not any(w.is_alive() for w in workers)
    with pytest.raises(RuntimeError, match="this stream is closed"):
        for _ in range(100):  # past what was prefetched before the close
            stream.next_batch()


def test_the_stream_refuses_at_start_what_it_cannot_stream():
    """At construction, before any worker starts: a batch larger than the data (the data's size is fine), an echo
    factor below 1 (1 is fine) and an echo mode it does not know, each named."""
    data = loader_data(n=40)
    assert stream_of(data, batch_size=40).bs == 40
    with pytest.raises(ValueError, match="^batch size 41 exceeds the 40 training images$"):
        stream_of(data, batch_size=41)
    assert stream_of(data, echo="batch", echo_factor=1).factor == 1
    with pytest.raises(ValueError, match="^echo factor must be >= 1, got 0.5$"):
        stream_of(data, echo="batch", echo_factor=0.5)
    with pytest.raises(ValueError, match="^unknown echo mode 'examples'; choose one of none, example-before-aug"):
        stream_of(data, echo="examples", echo_factor=2)


def test_a_shuffle_buffer_of_two_items_already_shuffles():
    """Only a buffer of 1 (which emits in order) is no buffer: one of 2 mixes the stream, from the first batch."""
    data = loader_data(n=100)
    assert stream_of(data, echo_shuffle_buffer=1).buffer is None
    plain, mixed = stream_of(data), stream_of(data, echo_shuffle_buffer=2)
    assert mixed.buffer.size == 2
    plain.next_batch()
    mixed.next_batch()
    assert plain.last["index"].tolist() != mixed.last["index"].tolist()
