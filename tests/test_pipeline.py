"""Data-echoing semantics: how often each example appears per upstream pass, whole-batch repeats, the shuffle
buffer, and exact fresh-example counting."""
import collections

import pytest
import torch

import pipeline
import torch_backend as tb
from conftest import HostReads

CFG = dict(batch_size=8, pad=2, cutout=0, flip="random")


def stream_of(n, cfg, generator):
    data = dict(train_x=torch.zeros(n, 36, 36, 3), train_y=torch.arange(n))
    return pipeline.BatchStream(data, cfg, generator, torch.device("cpu"))


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("factor", [1, 2, 4])
@pytest.mark.parametrize("mode", ["example-before-aug", "example-after-aug"])
def test_example_echo_repeats_each_example_factor_times(mode, factor):
    fresh = torch.randperm(100, generator=gen())
    items, aug_ids, first = pipeline.echo_pass(fresh, mode, factor, 8, gen(1))
    assert collections.Counter(items.tolist()) == {i: factor for i in range(100)}
    assert first.sum() == 100 and set(items[first].tolist()) == set(range(100))
    copies_share = {}
    for item, a in zip(items.tolist(), aug_ids.tolist()):
        copies_share.setdefault(item, set()).add(a)
    if mode == "example-before-aug":  # every copy is augmented on its own
        assert len(set(aug_ids.tolist())) == len(items)
    else:  # the augmented example itself is repeated
        assert all(len(a) == 1 for a in copies_share.values()) and len(set(aug_ids.tolist())) == 100


def test_non_integer_factor_mixes_floor_and_ceil_with_the_right_mean():
    r = pipeline.echo_repeats(200000, 2.3, gen())
    assert set(r.tolist()) == {2, 3} and r.float().mean() == pytest.approx(2.3, abs=0.01)
    with pytest.raises(ValueError):
        pipeline.echo_repeats(10, 0.5, gen())


@pytest.mark.parametrize("factor", [2, 3])
def test_batch_echo_repeats_whole_batches(factor):
    fresh = torch.randperm(50, generator=gen())
    items, aug_ids, first = pipeline.echo_pass(fresh, "batch", factor, 8, gen(1))
    batches = items.view(-1, 8)
    assert len(batches) == 6 * factor  # 6 whole batches of 8 from 50 examples, each repeated
    for b in range(6):
        block = batches[b * factor:(b + 1) * factor]
        assert (block == fresh[b * 8:(b + 1) * 8]).all()  # identical consecutive copies
    assert (aug_ids.view(-1, 8)[::factor] == aug_ids.view(-1, 8)[factor - 1::factor]).all()
    assert first.sum() == 48


def test_shuffle_buffer_emits_every_item_exactly_once():
    for n, size in [(1000, 1), (1000, 10), (1000, 999), (5, 10)]:
        order = pipeline.shuffle_buffer_order(n, size, gen(size))
        assert sorted(order.tolist()) == list(range(n))
    order = pipeline.shuffle_buffer_order(1000, 10, gen()).tolist()
    assert order != list(range(1000))
    # an item leaves only after it entered: the k-th output happens when item k + size enters
    assert all(item <= k + 10 for k, item in enumerate(order))


def test_without_echo_a_pass_is_a_plain_shuffled_epoch():
    stream = stream_of(40, dict(CFG, flip="alternate"), gen(3))
    g = gen(3)
    base_flip = torch.randint(0, 2, (40,), generator=g).bool()
    for epoch in range(2):
        perm = torch.randperm(40, generator=g)
        aug = tb.draw_augmentation(40, 2, 0, False, g, torch.device("cpu"))
        aug["flip"] = base_flip[perm] ^ bool(epoch % 2)
        for b in range(5):
            idx, a = stream.next_indices()
            sl = slice(b * 8, b * 8 + 8)
            assert (idx == perm[sl]).all() and all((a[k] == aug[k][sl]).all() for k in aug)
    assert stream.fresh_read == 80


@pytest.mark.parametrize("mode, factor", [("none", 1), ("example-before-aug", 2.5), ("example-after-aug", 4),
                                          ("batch", 2)])
def test_fresh_example_count_is_exact(mode, factor):
    cfg = dict(CFG, echo=mode, echo_factor=factor)
    stream = stream_of(64, cfg, gen())
    seen_in_pass, fresh, passes = set(), 0, 0
    for _ in range(60):
        idx, _ = stream.next_indices()
        if stream.passes != passes:  # a new upstream pass began with this batch
            passes, seen_in_pass = stream.passes, set()
        new = set(idx.tolist()) - seen_in_pass
        fresh += len(new)
        seen_in_pass |= new
        assert stream.fresh_read == fresh
    examples_trained = 60 * 8
    assert fresh == pytest.approx(examples_trained / factor, rel=0.15)


def test_shuffle_buffer_reads_ahead_by_at_most_its_size():
    cfg = dict(CFG, echo="example-after-aug", echo_factor=2, echo_shuffle_buffer=16)
    stream = stream_of(64, cfg, gen())
    emitted = set()
    for _ in range(10):  # within the first pass (128 items)
        idx, _ = stream.next_indices()
        emitted |= set(idx.tolist())
        assert len(emitted) <= stream.fresh_read <= len(emitted) + 16


def test_stream_state_round_trip():
    cfg = dict(CFG, echo="example-before-aug", echo_factor=2)
    a = stream_of(64, cfg, gen(5))
    for _ in range(7):
        a.next_indices()
    g_state = a.gen.get_state()
    b = stream_of(64, cfg, torch.Generator())
    b.load_state_dict(a.state_dict())
    b.gen.set_state(g_state)
    for _ in range(30):  # crosses into new passes
        (ia, aa), (ib, ab) = a.next_indices(), b.next_indices()
        assert (ia == ib).all() and all((aa[k] == ab[k]).all() for k in aa)
    assert a.fresh_read == b.fresh_read


@pytest.mark.parametrize("mode", pipeline.ECHO_MODES)
@pytest.mark.parametrize("factor", [1, 2, 2.5])
@pytest.mark.parametrize("n, batch_size", [(100, 20), (97, 10)])
def test_a_pass_draws_its_augmentations_without_reading_the_device(mode, factor, n, batch_size):
    """The count of augmentations a pass draws, known on the host (reading aug_ids.max() from a GPU made the first
    step of every pass wait, which --sync-check refuses), is the count that was read: the random streams, and so
    every run, stay as they were."""
    cfg = dict(batch_size=batch_size, pad=2, cutout=0, flip="random", echo=mode, echo_factor=factor,
               echo_shuffle_buffer=0)
    data = dict(train_x=torch.zeros(n, 36, 36, 3), train_y=torch.zeros(n, dtype=torch.long))
    stream = pipeline.BatchStream(data, cfg, torch.Generator().manual_seed(0), torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    items, aug_ids, _ = pipeline.echo_pass(torch.randperm(n, generator=gen), mode, factor, batch_size, gen)
    assert stream._augmentations(items) == int(aug_ids.max()) + 1


def test_a_new_pass_reads_nothing_on_the_host():
    """A pass's first batch counts the examples read before it on the device: int() of that count made the first
    step of every pass after the first wait for the GPU, which --sync-check refuses. fresh_read (read at an epoch's
    end, outside the steps) is as it was."""
    stream = stream_of(40, CFG, gen())
    with HostReads():
        for _ in range(12):  # five batches a pass: into the third pass
            stream.next_indices()
    assert stream.passes == 3 and stream.fresh_read == 96


@pytest.mark.parametrize("mode", ["example-after-aug", "batch", "example-before-aug"])
def test_shuffle_buffer_moves_each_items_augmentation_with_it(mode):
    """Guards against the shuffle buffer reordering items but not their aug ids (draws no longer follow items)."""
    cfg = dict(CFG, echo=mode, echo_factor=2, echo_shuffle_buffer=16)
    stream = stream_of(64, cfg, gen(2))
    draws, positions = collections.defaultdict(list), collections.defaultdict(list)
    for b in range(16):  # one whole pass: 64 examples, each twice, in batches of 8
        idx, a = stream.next_indices()
        for r, item in enumerate(idx.tolist()):
            draws[item].append((int(a["dy"][r]), int(a["dx"][r]), bool(a["flip"][r])))
            positions[item].append(b * 8 + r)
    assert stream.passes == 1 and set(draws) == set(range(64)) and all(len(d) == 2 for d in draws.values())
    assert sum(p[1] - p[0] > 1 for p in positions.values()) > 32  # the buffer did separate most copies
    if mode == "example-before-aug":  # every copy is augmented on its own (50 possible draws, so few coincide)
        assert sum(d[0] != d[1] for d in draws.values()) > 0.9 * 64
    else:  # copies of an augmented example (or of a batch) are identical wherever the buffer put them
        assert all(d[0] == d[1] for d in draws.values())


def streamed_order(n, size, generator):
    buf = pipeline.ShuffleBuffer(size, generator)
    return torch.tensor(buf.push(list(range(n))) + buf.flush())


@pytest.mark.parametrize("order_of", [pipeline.shuffle_buffer_order, streamed_order], ids=["order", "streaming"])
def test_a_buffer_larger_than_the_stream_still_shuffles(order_of):
    """Guards against residents being flushed in slot order, which leaves a stream of n <= size items unshuffled."""
    outputs = []
    for seed in range(5):
        for n, size in [(10, 10), (7, 20)]:
            out = order_of(n, size, gen(seed)).tolist()
            assert sorted(out) == list(range(n))
            outputs.append(out == list(range(n)))
    assert not any(outputs)  # a random order of 7 or 10 items is the identity with chance < 1/5000


def test_a_fractional_factor_is_met_on_average_without_rounding():
    """Guards against the fractional part of the echo factor being rounded (4/3 echoing like 1.3)."""
    n = 300000
    items, _, _ = pipeline.echo_pass(torch.arange(n), "example-after-aug", 4 / 3, 8, gen())
    counts = torch.bincount(items, minlength=n)
    assert set(counts.tolist()) == {1, 2}
    # a third of the items twice: sd of the mean sqrt(2/9 / n) < 0.001; rounding to 0.1 would be 0.033 off
    assert len(items) / n == pytest.approx(4 / 3, abs=0.004)


@pytest.mark.parametrize("order_of", [pipeline.shuffle_buffer_order, streamed_order], ids=["order", "streaming"])
def test_a_full_buffer_emits_any_resident_with_equal_chance(order_of):
    """Guards against a replaced slot drawn from too few residents (randint(0, size - 1) never evicts the last):
    fed size + 1 items, the first out is the resident the new item replaced, each of the size with chance 1/size."""
    size, trials = 8, 2000
    counts = collections.Counter(int(order_of(size + 1, size, gen(seed))[0]) for seed in range(trials))
    assert set(counts) == set(range(size))  # never the new item, which entered after the pick
    assert all(abs(c - trials / size) < 5 * (trials / size * (1 - 1 / size)) ** 0.5 for c in counts.values())


@pytest.mark.parametrize("mode, factor", [("none", 1), ("example-before-aug", 2), ("example-after-aug", 2),
                                          ("batch", 2)])
def test_flip_none_never_flips_and_random_flips_half(mode, factor):
    """Guards against flip="none" being drawn like "random" (or "random" not flipping) in any echo mode."""
    for flip in ("none", "random"):
        stream = stream_of(64, dict(CFG, flip=flip, echo=mode, echo_factor=factor), gen(4))
        flips = torch.cat([stream.next_indices()[1]["flip"] for _ in range(20)])  # over more than one pass
        if flip == "none":
            assert not flips.any()
        else:  # 160 fair coins: 0.5 +- 0.04 sd
            assert 0.3 < flips.float().mean() < 0.7


@pytest.mark.parametrize("mode, shared", [("example-after-aug", True), ("example-before-aug", False)])
def test_colour_jitter_reaches_the_batches_and_follows_each_augmentation(mode, shared):
    """The stream's batches are the per-sample reference of their draws, jitter included; echoed after
    augmentation, an example's copies in a pass share one shift and scale, echoed before it each copy has its own."""
    cfg = dict(CFG, color_jitter=(0.3, 0.2), echo=mode, echo_factor=2, echo_shuffle_buffer=0)
    data = dict(train_x=torch.randn(40, 36, 36, 3, generator=gen(4)), train_y=torch.arange(40))
    stream = pipeline.BatchStream(data, cfg, gen(5), torch.device("cpu"))
    seen = collections.defaultdict(set)
    for _ in range(10):  # the first pass: 80 echoed examples
        idx, aug = stream.next_indices()
        assert aug["shift"].abs().max() <= 0.3 and (aug["scale"] - 1).abs().max() <= 0.2
        torch.testing.assert_close(stream._augmented(idx, aug)[0], tb.augment_reference(data["train_x"], idx, aug),
                                   rtol=0, atol=0)
        for i, s, c in zip(idx.tolist(), aug["shift"].tolist(), aug["scale"].tolist()):
            seen[i].add((s, c))
    assert stream.passes == 1 and len(seen) == 40
    assert all(len(v) == (1 if shared else 2) for v in seen.values())
