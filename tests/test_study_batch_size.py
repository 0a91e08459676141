"""The batch-size study: regime analysis, the quasi-random search, resume, and one real trial (seconds)."""
import json
import math
import os
import statistics

import numpy as np
import pytest

import core
import study_batch_size as sbs
from conftest import synthetic

QUIET = lambda *a, **k: None  # noqa: E731


# ---------------------------------------------------------------------------------------------------------------
# Regime analysis on synthetic curves with known breakpoints

def curve(batches, perfect_end, max_useful, c=2 ** 20, noise=0.0, seed=0):
    """steps = c / b up to perfect_end, then falling as b^-0.5 (29% per doubling) up to max_useful, then flat."""
    rng = np.random.default_rng(seed)
    out = []
    for b in batches:
        s = c / min(b, perfect_end) * (min(b, max_useful) / perfect_end) ** -0.5 if b > perfect_end else c / b
        out.append((b, s * (1 + noise * rng.uniform(-1, 1))))
    return out


BATCHES = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


@pytest.mark.parametrize("perfect_end, max_useful", [(256, 1024), (64, 2048), (128, 128), (1024, 1024)])
@pytest.mark.parametrize("noise", [0.0, 0.03])
def test_regimes_are_found_at_the_known_breakpoints(perfect_end, max_useful, noise):
    for seed in range(5):
        r = sbs.analyse(curve(BATCHES, perfect_end, max_useful, noise=noise, seed=seed))
        assert r["perfect_end"] == perfect_end and r["max_useful"] == max_useful
        assert r["diminishing"] == [b for b in BATCHES if perfect_end < b <= max_useful]
        assert r["beyond_range"] is False
        regimes = [p["regime"] for p in r["points"]]
        assert regimes == ["perfect" if b <= perfect_end else "diminishing" if b <= max_useful
                           else "beyond max useful" for b in BATCHES]


def test_perfect_scaling_throughout_is_reported_as_not_flattened():
    r = sbs.analyse([(b, 1e6 / b) for b in BATCHES])
    assert r["perfect_end"] == r["max_useful"] == 4096 and r["beyond_range"] and r["diminishing"] == []
    assert all(p["steps_over_ideal"] == pytest.approx(1.0) for p in r["points"])
    assert all(p["cut_per_doubling"] == pytest.approx(0.5) for p in r["points"][1:])


def test_unreached_batch_sizes_count_as_infinitely_many_steps():
    pts = [(16, None), (32, 1000), (64, 500), (128, 260), (256, 200), (512, None)]
    r = sbs.analyse(pts)
    assert r["anchor"] == [32, 1000] and r["perfect_end"] == 128 and r["max_useful"] == 256
    assert [p["regime"] for p in r["points"]] == ["not reached", "perfect", "perfect", "perfect", "diminishing",
                                                  "not reached"]
    assert sbs.analyse([(16, None), (32, None)])["perfect_end"] is None


def test_a_noisy_point_does_not_end_the_useful_region_early():
    # 512 happens to need as many steps as 256, but 1024 and 2048 still pay off: the maximal useful batch is 2048
    pts = [(64, 800), (128, 400), (256, 200), (512, 200), (1024, 120), (2048, 80), (4096, 78)]
    r = sbs.analyse(pts)
    assert r["perfect_end"] == 256 and r["max_useful"] == 2048 and r["diminishing"] == [512, 1024, 2048]


def test_a_cut_within_the_evaluation_interval_does_not_extend_the_useful_region():
    # Measured every 10 steps, 100 at 1024 may really be 91: 90 at 2048 is no measured 10% cut, 80 would be.
    flat = [(256, 400, 20), (512, 200, 10), (1024, 100, 10), (2048, 90, 10)]
    assert sbs.analyse(flat)["max_useful"] == 1024
    assert sbs.analyse([p[:2] for p in flat])["max_useful"] == 2048  # without the resolution it would count
    assert sbs.analyse(flat[:3] + [(2048, 80, 10)])["max_useful"] == 2048


@pytest.mark.parametrize("slope, closer", [(1.0, "linear (1)"), (0.5, "square root (0.5)"), (0.8, "linear (1)")])
def test_lr_trend_recovers_the_slope(slope, closer):
    rng = np.random.default_rng(0)
    bs = [16, 32, 64, 128, 256, 512, 1024]
    lrs = [0.01 * b ** slope * math.exp(rng.normal(0, 0.05)) for b in bs]
    t = sbs.lr_trend(bs, lrs)
    assert t["slope"] == pytest.approx(slope, abs=0.05) and t["closer_to"] == closer and 0 < t["stderr"] < 0.05
    assert sbs.lr_trend([16], [0.1])["slope"] is None


def test_an_lr_slope_halfway_between_the_rules_is_no_verdict():
    """Two batch sizes whose best trials sit at the same point of the window (which slides as batch^0.75) give
    slope 0.75 exactly, halfway between 0.5 and 1: it was reported as "closer to square root (0.5)"."""
    tie = sbs.lr_trend([16, 32], [1.0, 2 ** 0.75])
    assert tie["slope"] == pytest.approx(0.75) and tie["closer_to"] == "undecided"
    lines = []
    sbs.report([], dict(perfect_end=None), dict(all=tie), log=lines.append)
    assert "undecided: 0.75 is halfway between square root (0.5) and linear (1)" in lines[-1]
    assert "closer to" not in lines[-1]
    # 0.75 within slope ± standard error: undecided too; outside it, a verdict
    bs = [16, 32, 64, 128]
    noisy = sbs.lr_trend(bs, [b ** 0.8 * f for b, f in zip(bs, (1.0, 1.3, 0.8, 1.2))])
    assert noisy["slope"] - noisy["stderr"] < 0.75 < noisy["slope"] and noisy["closer_to"] == "undecided"
    lines = []
    sbs.report([], dict(perfect_end=None), dict(all=noisy), log=lines.append)
    assert "lies within one standard error" in lines[-1]
    clear = sbs.lr_trend(bs, [b ** 0.8 * f for b, f in zip(bs, (1.0, 1.01, 0.99, 1.0))])
    assert clear["slope"] - clear["stderr"] > 0.75 and clear["closer_to"] == "linear (1)"
    assert sbs.lr_trend([16, 32], [1.0, 2 ** 0.7])["closer_to"] == "square root (0.5)"


def test_lr_trend_stderr_is_the_textbook_ols_slope_standard_error():
    """The slope's standard error (the "± x" of the report) is sqrt(s^2 (X'X)^-1)[slope] with s^2 = RSS / (n - 2);
    a wrong degrees-of-freedom count or a missing square root would misstate how well the LR rule is pinned."""
    bs, lrs = [16, 32, 64, 128, 256, 512], [0.05, 0.11, 0.16, 0.4, 0.55, 1.3]
    x, y = np.log(np.array(bs, np.float64)), np.log(np.array(lrs, np.float64))
    design = np.stack([x, np.ones_like(x)], axis=1)
    coef, rss, *_ = np.linalg.lstsq(design, y, rcond=None)
    cov = rss[0] / (len(bs) - 2) * np.linalg.inv(design.T @ design)
    t = sbs.lr_trend(bs, lrs)
    assert t["slope"] == pytest.approx(coef[0], rel=1e-9)
    assert t["stderr"] == pytest.approx(math.sqrt(cov[0, 0]), rel=1e-9)
    assert sbs.lr_trend(bs[:2], lrs[:2])["stderr"] is None  # two points: no residual degree of freedom


def test_cut_per_doubling_spreads_a_gap_over_its_doublings():
    """64 -> 256 is two doublings: 1000 -> 400 steps is a cut of 1 - sqrt(0.4) per doubling, not 60% (a cut
    counted per measured point would overstate the gains wherever batch sizes were skipped or not reached)."""
    for pts in ([(64, 1000), (256, 400)], [(64, 1000), (128, None), (256, 400)]):
        points = sbs.analyse(pts)["points"]
        assert points[0]["cut_per_doubling"] is None and points[-1]["batch_size"] == 256
        assert points[-1]["cut_per_doubling"] == pytest.approx(1 - math.sqrt(400 / 1000))


def analysed(b, trial, steps, best_acc, lr_eff=1.0, window=(0.1, 10.0)):
    """A reached trial record as best_per_batch reads it (plain SGD: lr = lr_eff)."""
    params = dict(lr_eff=lr_eff, lr=lr_eff, momentum=0.0, warmup_frac=0.1, decay_to=0.1)
    return dict(batch_size=b, trial=trial, reached=True, diverged=False, budget_steps=1000, eval_every_steps=10,
                steps_to_target=steps, best_acc=best_acc, params=params, lr_window=list(window))


def test_equal_steps_to_target_tie_break_to_the_higher_accuracy():
    """Two trials at the same steps: the best is the one that went on to the higher accuracy, not the lower
    trial number (nor the lower accuracy); its metaparameters are the row's."""
    rows = sbs.best_per_batch([analysed(64, 0, 300, 0.66, lr_eff=0.5), analysed(64, 1, 300, 0.71, lr_eff=2.0)])
    assert rows[0]["best_trial"] == 1 and rows[0]["best_lr_eff"] == 2.0 and rows[0]["best_steps"] == 300
    rows = sbs.best_per_batch([analysed(64, 0, 300, 0.71, lr_eff=0.5), analysed(64, 1, 300, 0.66, lr_eff=2.0)])
    assert rows[0]["best_trial"] == 0 and rows[0]["best_lr_eff"] == 0.5


def test_a_best_lr_near_either_end_of_its_log_window_is_flagged():
    """lr_at_edge: the best lr_eff lies in the outer 10% (log scale) of the searched window at either end, a hint
    to widen the search; the window's log-centre (its linear 9%) is not an edge."""
    lo, hi = 0.1, 10.0
    at = lambda frac: lo * (hi / lo) ** frac  # noqa: E731  (frac of the way through the window in log scale)
    records = [analysed(b, 0, 100, 0.7, lr_eff=at(frac), window=(lo, hi))
               for b, frac in ((16, 0.05), (32, 0.5), (64, 0.95))]
    assert [r["lr_at_edge"] for r in sbs.best_per_batch(records)] == [True, False, True]


def momentum_record(b, trial, steps, lr_eff, momentum=0.9, window=(0.1, 10.0), diverged=False):
    """A trial record with momentum, so lr = lr_eff * (1 - momentum) differs from lr_eff."""
    params = dict(lr_eff=lr_eff, lr=lr_eff * (1 - momentum), momentum=momentum, warmup_frac=0.1, decay_to=0.1)
    return dict(batch_size=b, trial=trial, reached=steps is not None, diverged=diverged, budget_steps=1000,
                eval_every_steps=10, steps_to_target=steps, best_acc=0.7, params=params, lr_window=list(window))


def test_counts_edge_and_lr_trend_read_the_effective_lr_and_count_only_diverged_trials_as_diverged():
    """Trials that merely missed the target are not "diverged"; the window edge and the LR trend are judged on
    lr_eff (what the window bounds), not on lr = lr_eff * (1 - momentum), which sits a decade lower at m 0.9."""
    lo, hi = 0.1, 10.0
    at = lambda frac: lo * (hi / lo) ** frac  # noqa: E731
    recs = [momentum_record(64, 0, 400, at(0.5)), momentum_record(64, 1, None, at(0.9)),
            momentum_record(64, 2, None, at(0.2), diverged=True), momentum_record(128, 0, 200, at(0.7), momentum=0.5),
            momentum_record(256, 0, 120, at(0.3), momentum=0.98)]
    rows, _, trend = sbs.summarise(recs)
    assert [(r["trials"], r["reached"], r["diverged"]) for r in rows] == [(3, 1, 1), (1, 1, 0), (1, 1, 0)]
    # in lr, 256's (m 0.98: 50x below lr_eff, 0.85 of the window's log width) would be far below the edge
    assert [r["lr_at_edge"] for r in rows] == [False, False, False]
    x, y = np.log(np.array([64, 128, 256], np.float64)), np.log(np.array([at(0.5), at(0.7), at(0.3)], np.float64))
    assert trend["all"]["slope"] == pytest.approx(np.polyfit(x, y, 1)[0], rel=1e-9)


def test_the_summary_regimes_allow_for_each_batch_sizes_evaluation_interval():
    """summarise passes every row's eval interval to analyse: 100 steps at 1024 measured every 10 may be 91, so
    88 at 2048 is no measured 10% cut (88 > (100 - 10) * 0.9) and 1024 is the maximal useful batch; measured every step
    (100 may be 100) it is a cut (88 < 99 * 0.9) and 2048 is."""
    recs = [momentum_record(b, 0, s, 1.0) for b, s in ((256, 400), (512, 200), (1024, 100), (2048, 88))]
    assert sbs.summarise(recs)[1]["max_useful"] == 1024
    recs = [dict(r, eval_every_steps=1) for r in recs]
    assert sbs.summarise(recs)[1]["max_useful"] == 2048


def test_the_perfect_scaling_lr_trend_includes_the_end_of_perfect_scaling():
    """trend["perfect_scaling"] fits every batch size up to and including perfect_end (the regime's own points)."""
    steps = {64: 800, 128: 400, 256: 200, 512: 180, 1024: 170}
    lrs = {64: 0.2, 128: 0.3, 256: 0.9, 512: 1.0, 1024: 1.1}
    rows, regimes, trend = sbs.summarise([momentum_record(b, 0, s, lrs[b], window=(0.01, 100)) for b, s in
                                          steps.items()])
    assert regimes["perfect_end"] == 256
    x, y = np.log(np.array([64, 128, 256], np.float64)), np.log(np.array([0.2, 0.3, 0.9], np.float64))
    assert trend["perfect_scaling"]["n"] == 3
    assert trend["perfect_scaling"]["slope"] == pytest.approx(np.polyfit(x, y, 1)[0], rel=1e-9)


def test_the_regime_tolerances_include_their_boundaries():
    """"At most 25% above ideal" is perfect scaling, and a cut of exactly 10% per doubling still pays off: 625
    steps at 128 against the ideal 500 is perfect; 90 after 100 steps is a 10% cut, so 2048 is maximal useful."""
    assert sbs.analyse([(64, 1000), (128, 625), (256, 600)])["perfect_end"] == 128
    assert sbs.analyse([(512, 400), (1024, 100), (2048, 90)])["max_useful"] == 2048


def test_an_unreached_batch_size_between_reached_ones_ends_perfect_scaling():
    """perfect_end needs every batch size from the anchor up to it within tolerance: one that never reached the
    target (infinitely many steps) in between ends the region, however well a larger one then did."""
    r = sbs.analyse([(32, 1000), (64, 500), (128, None), (256, 125)])
    assert r["anchor"] == [32, 1000] and r["perfect_end"] == 64
    assert [p["regime"] for p in r["points"]] == ["perfect", "perfect", "not reached", "diminishing"]


def test_the_maximal_useful_batch_size_is_never_below_the_end_of_perfect_scaling():
    """A coarse eval interval at 128 (the cut to 256 hidden in it) must not put the maximal useful batch below a
    batch size that still scaled perfectly: 1000 / 500 / 250 steps at 64 / 128 / 256 is ideal throughout."""
    r = sbs.analyse([(64, 1000, 10), (128, 500, 400), (256, 250, 10)])
    assert r["perfect_end"] == 256 and r["max_useful"] >= r["perfect_end"]


# ---------------------------------------------------------------------------------------------------------------
# Quasi-random search

def test_unscrambled_halton_is_the_radical_inverse():
    x = sbs.scrambled_halton(5, 3, seed=None)
    assert x[:, 0] == pytest.approx([0, 1 / 2, 1 / 4, 3 / 4, 1 / 8])
    assert x[:, 1] == pytest.approx([0, 1 / 3, 2 / 3, 1 / 9, 4 / 9])
    assert x[:, 2] == pytest.approx([0, 1 / 5, 2 / 5, 3 / 5, 4 / 5])


def test_halton_is_deterministic_differs_across_seeds_and_keeps_its_prefix():
    a, b = sbs.scrambled_halton(32, 5, seed=3), sbs.scrambled_halton(32, 5, seed=3)
    assert np.array_equal(a, b)
    assert not np.allclose(a, sbs.scrambled_halton(32, 5, seed=4))
    assert np.array_equal(sbs.scrambled_halton(8, 5, seed=3), a[:8])  # trial i does not depend on n
    assert np.array_equal(sbs.scrambled_halton(32, 2, seed=3), a[:, :2])  # nor on the dimension
    assert ((a >= 0) & (a < 1)).all()


@pytest.mark.parametrize("seed", range(5))
def test_halton_stratifies_and_covers_every_projection(seed):
    x = sbs.scrambled_halton(125, 5, seed)
    for j, p in enumerate(sbs.primes(5)):
        for m in (1, 2, 3):
            if p ** m <= 125:  # the first p^m points: exactly one in each interval of width p^-m
                counts = np.bincount((x[:p ** m, j] * p ** m).astype(int), minlength=p ** m)
                assert (counts == 1).all()
    for n in (9, 16, 24, 48, 96, 125):  # n >= 3k points leave no bin of width 1/k empty, in any coordinate
        k = n // 3
        for j in range(5):
            assert np.bincount((x[:n, j] * k).astype(int), minlength=k).min() >= 1


def centered_l2_discrepancy(x):
    """Hickernell's centred L2 discrepancy of points in [0, 1)^d (lower is more uniform)."""
    x = np.asarray(x, float)
    n, d = x.shape
    a = np.abs(x - 0.5)
    t1 = (13 / 12) ** d
    t2 = np.prod(1 + 0.5 * a - 0.5 * a ** 2, axis=1).sum() * 2 / n
    pair = 1 + 0.5 * a[:, None, :] + 0.5 * a[None, :, :] - 0.5 * np.abs(x[:, None, :] - x[None, :, :])
    t3 = np.prod(pair, axis=2).sum() / n ** 2
    return math.sqrt(max(t1 - t2 + t3, 0.0))


def test_halton_has_lower_discrepancy_than_random_points():
    rng = np.random.default_rng(0)
    for n in (8, 32, 128):
        qmc = np.mean([centered_l2_discrepancy(sbs.scrambled_halton(n, 5, s)) for s in range(10)])
        rnd = np.mean([centered_l2_discrepancy(rng.random((n, 5))) for _ in range(10)])
        assert qmc < 0.75 * rnd
    # random points leave bins empty where Halton does not
    empty = sum(np.bincount((rng.random(24) * 8).astype(int), minlength=8).min() == 0 for _ in range(100))
    assert empty > 10


def discrepancy_by_definition(x, m=600):
    """Hickernell's centred L2 discrepancy as its definition reads, integrated on a midpoint grid of m per axis:
    over every non-empty set u of coordinates, the mean square of the local discrepancy (share of the points
    inside minus the volume) of the box from each x_u to the corner of [0, 1]^u nearest it."""
    import itertools
    x = np.asarray(x, float)
    n, d = x.shape
    g = (np.arange(m) + 0.5) / m
    total = 0.0
    for k in range(1, d + 1):
        for u in itertools.combinations(range(d), k):
            grids = np.meshgrid(*([g] * k), indexing="ij")
            inside, vol = np.ones((n,) + (m,) * k, bool), np.ones((m,) * k)
            for axis, j in enumerate(u):
                c, p = grids[axis], x[:, j].reshape((n,) + (1,) * k)
                low = c < 0.5  # the nearest corner's side: [0, c) below the middle, [c, 1] above it
                vol = vol * np.where(low, c, 1 - c)
                inside &= np.where(low, p < c, p >= c)
            total += ((inside.mean(0) - vol) ** 2).mean()
    return math.sqrt(total)


def test_discrepancy_matches_its_definition():
    """The closed form the Halton test relies on, against its definition (needs no scipy, which the test below
    skips without and requirements-dev.txt does not install)."""
    rng = np.random.default_rng(0)
    for d in (1, 2):
        for n in (1, 5, 12):
            x = rng.random((n, d))
            assert centered_l2_discrepancy(x) == pytest.approx(discrepancy_by_definition(x), rel=5e-3)


def test_discrepancy_matches_scipy():
    qmc = pytest.importorskip("scipy.stats.qmc")
    x = sbs.scrambled_halton(40, 4, seed=1)
    assert centered_l2_discrepancy(x) ** 2 == pytest.approx(qmc.discrepancy(x, method="CD"))


def test_sampled_metaparameters_lie_in_the_space_and_the_lr_window_slides():
    for name, opt in sbs.OPTIMIZERS.items():
        for trial in range(16):
            p16, o16 = sbs.sample_params(name, trial, 16)
            p2048, _ = sbs.sample_params(name, trial, 2048)
            lo, hi = sbs.lr_window(16)
            assert lo <= p16["lr_eff"] <= hi and p16["lr"] == pytest.approx(p16["lr_eff"] * (1 - p16["momentum"]))
            assert p2048["lr_eff"] / p16["lr_eff"] == pytest.approx(128 ** sbs.LR_WINDOW_EXPONENT)
            assert p2048["warmup_frac"] == p16["warmup_frac"]  # the same unit-cube point at every batch size
            for dim in opt.dims:
                low, high, _ = sbs.SEARCH_SPACE[dim]
                assert dim == "lr_eff" or low <= p16[dim] <= high
            assert o16["optimizer"] == ("lars" if name == "lars" else "sgd")
            assert (o16["momentum"] == 0) == (name == "sgd")
            assert o16["nesterov"] == (name == "nesterov")
    # common random numbers: trial 3 has the same LR, warm-up and decay under every optimizer
    lrs = {n: sbs.sample_params(n, 3, 256)[0]["lr_eff"] for n in sbs.OPTIMIZERS}
    assert len(set(lrs.values())) == 1


def test_trial_budget_schedule_and_eval_interval():
    s = sbs.study_settings("cpu", "nesterov", epochs=4, min_steps=200, evals_per_trial=30)
    n_train = 50000 - s["holdout"]
    for b in (16, 256, 2048):
        spec = sbs.make_trial(s, b, 2, n_train)
        per_epoch = n_train // b
        budget = spec["budget_steps"]
        assert budget == max(math.ceil(4 * per_epoch), 200)
        assert math.ceil(per_epoch * spec["train"]["epochs"]) == budget  # the trainer's own step count
        knots, values = spec["train"]["lr_knots"], spec["train"]["lr_values"]
        assert knots[-1] == pytest.approx(budget / per_epoch) and max(values) == pytest.approx(spec["params"]["lr"])
        assert values[-1] == pytest.approx(spec["params"]["lr"] * spec["params"]["decay_to"])
        assert spec["eval_every_steps"] == max(1, budget // 30)
        assert spec["train"]["stop_at_target"] and spec["train"]["holdout"] == 5000 and spec["train"]["seed"] == 2
    assert sbs.study_settings("gpu94", "sgd")["holdout"] == 0
    with pytest.raises(sbs.StudyError):
        sbs.study_settings("cpu", "adam")


def test_trial_t_maps_halton_point_t_through_the_space_at_every_batch_size():
    """Trial t is point t of the scrambled Halton sequence; each metaparameter reads its own fixed coordinate
    (the order of SEARCH_SPACE, not of an optimizer's dimensions, so trial t shares its warm-up and decay across
    optimizers); the LR window is the searched range at the reference batch 256, slid by (b / 256) ** 0.75."""
    u = sbs.scrambled_halton(6, len(sbs.SEARCH_SPACE), seed=0)
    logmap = lambda x, lo, hi: math.exp(math.log(lo) + x * (math.log(hi) - math.log(lo)))  # noqa: E731
    for name in sbs.OPTIMIZERS:
        for trial in range(6):
            for b in (64, 256, 1024):
                p, _ = sbs.sample_params(name, trial, b)
                scale = (b / 256.0) ** 0.75
                assert p["lr_eff"] == pytest.approx(logmap(u[trial, 0], 0.3 * scale, 30.0 * scale), rel=1e-12)
                assert p["warmup_frac"] == pytest.approx(0.2 * u[trial, 2], rel=1e-12)
                assert p["decay_to"] == pytest.approx(logmap(u[trial, 3], 0.01, 0.3), rel=1e-12)
                if name != "sgd":
                    assert p["momentum"] == pytest.approx(1 - logmap(u[trial, 1], 0.02, 0.5), rel=1e-12)
                if name == "lars":
                    assert p["trust"] == pytest.approx(logmap(u[trial, 4], 0.001, 0.02), rel=1e-12)
    assert sbs.lr_window(256) == pytest.approx((0.3, 30.0))
    assert sbs.lr_window(4096) == pytest.approx((0.3 * 8, 30.0 * 8))  # 16 ** 0.75 = 8


def test_the_warm_up_lasts_its_fraction_of_the_trials_budget():
    """warmup_frac is a fraction of the step budget: the LR peaks at warmup_frac * budget_epochs, not after
    warmup_frac epochs (a long budget would have warmed up within its first few steps)."""
    s = sbs.study_settings("cpu", "nesterov", epochs=4, min_steps=200)
    for b, trial in ((16, 1), (2048, 3)):
        spec = sbs.make_trial(s, b, trial, 45000)
        budget_epochs = spec["budget_steps"] / (45000 // b)
        w = spec["params"]["warmup_frac"]
        assert w > 0 and spec["budget_epochs"] == pytest.approx(budget_epochs)
        assert spec["train"]["lr_knots"] == pytest.approx((0.0, w * budget_epochs, budget_epochs))
        assert spec["train"]["lr_values"][:2] == pytest.approx((0.0, spec["params"]["lr"]))


def test_a_schedule_without_warm_up_starts_at_the_peak_and_still_decays():
    """warmup_frac 0: no warm-up knot, the LR starts at its peak and falls linearly to decay_to x the peak at the
    budget's end, as with a warm-up."""
    for lr, decay_to, budget in ((1.0, 0.1, 4.0), (2.5, 0.03, 7.5)):
        knots, values = sbs.lr_knots(dict(lr=lr, warmup_frac=0.0, decay_to=decay_to), budget)
        assert knots == [0.0, budget] and values == pytest.approx([lr, lr * decay_to])


def test_trial_order_moves_trials_forward_without_changing_them():
    s = sbs.study_settings("cpu", "lars")
    plain = sbs.plan(s, [2048, 4096], 4, 45000)
    ordered = sbs.plan(s, [2048, 4096], 4, 45000, order=[3, 1, 3])
    assert [(p["trial"], p["batch_size"]) for p in ordered] == [
        (3, 2048), (3, 4096), (1, 2048), (1, 4096), (0, 2048), (0, 4096), (2, 2048), (2, 4096)]
    by_key = {(p["trial"], p["batch_size"]): p for p in plain}
    assert all(p == by_key[(p["trial"], p["batch_size"])] for p in ordered)  # same metaparameters and budget
    assert [p["trial"] for p in sbs.plan(s, [2048, 4096], 4, 45000, shard=(1, 2), order=[3, 1])] == [3, 1, 0, 2]


def test_any_number_of_shards_partitions_the_plan():
    """N shards together run every planned trial exactly once (no trial twice, none missing), for any N."""
    s = sbs.study_settings("cpu", "sgd")
    for order in ((), (4, 2)):
        whole = [sbs.trial_key(p) for p in sbs.plan(s, [16, 64, 256], 5, 45000, order=order)]
        for n in range(1, 7):
            shards = [[sbs.trial_key(p) for p in sbs.plan(s, [16, 64, 256], 5, 45000, shard=(k, n), order=order)]
                      for k in range(n)]
            assert sorted(key for shard in shards for key in shard) == sorted(whole) and len(set(whole)) == 15


def test_shards_given_different_trial_orders_still_partition_the_plan():
    """--trial-order changes when a trial runs, not which shard runs it: shard 0/2 as planned and shard 1/2 with
    --trial-order 1 ran (0, 16), (0, 64) and (1, 32) twice and (0, 32), (1, 16), (1, 64) never (review 2026-12-05)."""
    s = sbs.study_settings("cpu", "sgd")
    whole = sorted(sbs.trial_key(p) for p in sbs.plan(s, [16, 32, 64], 2, 45000))
    for orders in (((), (1,)), ((1,), ()), ((1, 0), (0,))):
        shards = [sbs.trial_key(p) for k, order in enumerate(orders)
                  for p in sbs.plan(s, [16, 32, 64], 2, 45000, shard=(k, 2), order=order)]
        assert sorted(shards) == whole


@pytest.mark.parametrize("shard", ["2/2", "0/0", "0/2/3", "+0/2", "\u00b2/3", "0/\u00b3"])
def test_a_bad_shard_is_a_one_line_usage_error(tmp_path, capsys, shard):
    """'²/3' passed str.isdigit() and then failed int() with a ValueError traceback (review 2026-12-05)."""
    with pytest.raises(SystemExit) as e:
        sbs.main(["run", "--trials", "1", "--batch-sizes", "16", "--shard", shard, "--dry-run", "--out", str(tmp_path)])
    assert e.value.code == 2 and f"--shard expects K/N with 0 <= K < N, got {shard!r}" in capsys.readouterr().err


def test_shards_finishing_together_do_not_share_a_temporary_summary(tmp_path):
    """Every shard writes the folder's summary when it ends; all wrote it through one summary.tsv.tmp, so two
    finishing together replaced each other's file mid-write and one failed with FileNotFoundError (4 processes
    writing at once: 1 write in 5 failed; review 2026-12-05). Another shard's temporary file is left alone."""
    settings = sbs.study_settings("cpu", "sgd")
    recs = [dict(spec, settings=settings, reached=True, steps_to_target=100, best_acc=0.7, diverged=False)
            for spec in sbs.plan(settings, [16, 32], 1, 45000)]
    in_flight = tmp_path / "summary.tsv.tmp"
    in_flight.write_text("another shard's summary, half written")
    sbs.write_summary(str(tmp_path), settings, recs, "complete")
    assert in_flight.read_text() == "another shard's summary, half written"
    assert len(core.read_tsv(str(tmp_path / "summary.tsv"))) == 2 and not list(tmp_path.glob("summary.tsv.tmp?*"))


def test_trial_order_outside_the_trials_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit):
        sbs.main(["run", "--trials", "2", "--trial-order", "2", "--dry-run", "--out", str(tmp_path)])


def test_an_impossible_target_is_a_usage_error_before_any_trial(tmp_path, capsys):
    """Each trial's options pass train_cifar's checks when the study starts (a target of 2 failed inside the
    first trial, with a traceback, after the data had loaded)."""
    with pytest.raises(SystemExit) as e:
        sbs.main(["run", "--target", "2", "--trials", "2", "--out", str(tmp_path), "--data", "/nonexistent.npz"])
    assert e.value.code == 2 and "target must be in (0, 1], got 2.0" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Runner: resume, torn lines, interrupts


def fake_trial(spec):
    """Steps to target of a made-up workload: perfect scaling to 256, diminishing to 1024, flat beyond; steps
    grow with the distance from the optimum effective LR, which sits at the centre of the sliding window."""
    b, lr = spec["batch_size"], spec["params"]["lr_eff"]
    ideal = 2 ** 20 / min(b, 256) * (min(b, 1024) / 256) ** -0.5 if b > 256 else 2 ** 20 / b
    steps = math.ceil(ideal * math.exp(0.5 * abs(math.log(lr / math.sqrt(math.prod(spec['lr_window']))))))
    reached = steps <= spec["budget_steps"]
    rec = {k: spec[k] for k in ("workload", "optimizer", "batch_size", "trial", "params", "budget_steps",
                                "budget_epochs", "eval_every_steps", "lr_window")}
    return dict(rec, reached=reached, diverged=False, steps_to_target=steps if reached else None,
                best_acc=0.7 if reached else 0.5, wall_s=0.01)


@pytest.fixture
def study(tmp_path):
    settings = sbs.study_settings("cpu", "momentum", epochs=40, min_steps=4000)
    specs = sbs.plan(settings, [64, 128, 256, 512, 1024, 2048], 4, 45000)
    return settings, specs, str(tmp_path / "trials.jsonl")


def test_a_killed_study_resumes_without_redoing_finished_trials(study):
    settings, specs, path = study
    calls = []

    def dies_at_the_seventh(spec):
        if len(calls) == 6:
            raise KeyboardInterrupt
        calls.append(sbs.trial_key(spec))
        return fake_trial(spec)
    with pytest.raises(KeyboardInterrupt):
        sbs.run_study(specs, dies_at_the_seventh, path, settings, log=QUIET)
    assert [sbs.trial_key(r) for r in sbs.read_trials(path)] == calls == [sbs.trial_key(s) for s in specs[:6]]

    with open(path, "a") as f:  # a crash in the middle of writing the next record
        f.write(json.dumps(fake_trial(specs[6]))[:40])
    warnings = []
    assert len(sbs.read_trials(path, warn=warnings.append)) == 6 and "torn" in warnings[0]

    again = []
    records = sbs.run_study(specs, lambda s: again.append(sbs.trial_key(s)) or fake_trial(s), path, settings, log=QUIET)
    assert again == [sbs.trial_key(s) for s in specs[6:]]  # the torn trial is redone, the finished ones are not
    with open(path) as f:
        lines = f.read().splitlines()
    assert len(lines) == len(specs) == len(records)
    assert sorted(sbs.trial_key(json.loads(line)) for line in lines) == sorted(sbs.trial_key(s) for s in specs)
    assert sbs.run_study(specs, lambda s: pytest.fail("nothing is left to run"), path, settings, log=QUIET)


def test_an_unterminated_complete_last_line_is_kept_and_terminated(study):
    settings, specs, path = study
    with open(path, "w") as f:
        f.write(json.dumps(dict(fake_trial(specs[0]), settings=settings)))
    records = sbs.run_study(specs[:2], fake_trial, path, settings, log=QUIET)
    with open(path) as f:
        assert [sbs.trial_key(json.loads(line)) for line in f] == [sbs.trial_key(s) for s in specs[:2]]
    assert len(records) == 2


def test_trials_with_other_settings_are_refused(study):
    settings, specs, path = study
    sbs.run_study(specs[:1], fake_trial, path, settings, log=QUIET)
    other = sbs.study_settings("cpu", "momentum", epochs=40, min_steps=4000, target=0.7,
                               overrides=dict(precision="fp32"))
    with pytest.raises(sbs.StudyError, match="other settings") as e:
        sbs.run_study(specs, fake_trial, path, other, log=QUIET)
    # the differing keys with both values, not the whole stored dict (~20 keys) to compare by eye
    assert "(overrides.precision unset there, fp32 here; target 0.65 there, 0.7 here)" in str(e.value)
    assert "workload" not in str(e.value)


def test_other_shards_trials_with_other_settings_are_refused(study):
    """A shard's own file may be empty while another shard's holds trials of other settings: resuming there would
    mix two studies in one folder (and skip their trials as done), so it is refused before any trial runs."""
    settings, specs, path = study
    other = dict(fake_trial(specs[0]), settings=dict(settings, target=0.7))
    with pytest.raises(sbs.StudyError, match="other settings") as e:
        sbs.run_study(specs, lambda s: pytest.fail("no trial may run"), path, settings, log=QUIET, others=[other])
    assert "target 0.7 there, 0.65 here" in str(e.value)


def test_a_folder_loads_as_the_settings_of_its_last_trial_and_only_their_trials(tmp_path):
    """A folder holding trials of settings A, then of B (a study restarted elsewhere, its file copied in) is B's
    curve: B's label and settings, B's trials alone (A's would mix two studies into one curve)."""
    a, b = sbs.study_settings("cpu", "sgd"), sbs.study_settings("cpu", "momentum", target=0.7)
    specs_a, specs_b = sbs.plan(a, [16, 32], 2, 45000), sbs.plan(b, [16, 64], 1, 45000)
    for settings, specs in ((a, specs_a), (b, specs_b)):
        for spec in specs:
            core.append_jsonl(str(tmp_path / "trials.jsonl"), dict(fake_trial(spec), settings=settings))
    label, settings, records = sbs.load_dir(str(tmp_path))
    assert label == "cpu/momentum" and settings == b
    assert [sbs.trial_key(r) for r in records] == [sbs.trial_key(s) for s in specs_b]


def test_summary_regimes_and_plots_of_a_fake_study(study, tmp_path):
    settings, specs, path = study
    records = sbs.run_study(specs, fake_trial, path, settings, log=QUIET)
    rows, regimes, trend = sbs.write_summary(str(tmp_path), settings, records, "complete")
    assert [r["batch_size"] for r in rows] == [64, 128, 256, 512, 1024, 2048]
    for r in rows:
        best = min(x["steps_to_target"] for x in records if x["batch_size"] == r["batch_size"] and x["reached"])
        assert r["best_steps"] == best and r["trials"] == 4
    assert regimes["perfect_end"] == 256 and regimes["max_useful"] == 1024
    assert trend["all"]["slope"] == pytest.approx(sbs.LR_WINDOW_EXPONENT)
    with open(tmp_path / "summary.tsv") as f:
        header, *lines = f.read().splitlines()
    assert header.split("\t") == sbs.SUMMARY_COLUMNS and len(lines) == 6
    assert json.loads((tmp_path / "summary.json").read_text())["regimes"]["max_useful"] == 1024
    for png in sbs.plot([("cpu/momentum", rows, regimes, trend), ("again", rows, regimes, trend)], str(tmp_path)):
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def drawn_axes(monkeypatch, tmp_path, curves):
    """The axes of steps_to_target.png and best_lr.png as sbs.plot draws them for these curves."""
    import matplotlib.pyplot as plt
    axes = []
    monkeypatch.setattr(sbs, "_finish_log_log_plot", lambda fig, ax, bs, path: axes.append(ax) or path)
    sbs.plot(curves, str(tmp_path))
    for ax in axes:  # closed here instead (the axes stay readable): open figures pile up across tests
        plt.close(ax.figure)
    return axes


def test_the_plot_draws_the_ideal_line_and_the_evaluation_intervals_of_the_curve(tmp_path, monkeypatch):
    """The dashed ideal line is s0 * b0 / b through the anchor, and each point's error bar reaches down one eval
    interval (the target was met within (steps - interval, steps]); both are read off the drawn figure."""
    recs = [dict(momentum_record(b, 0, s, 1.0), eval_every_steps=e)
            for b, s, e in ((32, None, 50), (64, 1000, 40), (128, 520, 20), (256, 300, 10), (512, 280, 10))]
    ax = drawn_axes(monkeypatch, tmp_path, [("cpu/momentum", *sbs.summarise(recs))])[0]
    ideal, = [line for line in ax.get_lines() if line.get_label() == "perfect scaling (ideal 1/b)"]
    assert list(ideal.get_xdata()) == [64, 128, 256, 512]
    assert list(ideal.get_ydata()) == pytest.approx([1000 * 64 / b for b in (64, 128, 256, 512)])
    bars = [seg for c in ax.containers for coll in c.lines[2] for seg in coll.get_segments()]
    assert sorted((x0, y0, y1) for (x0, y0), (_, y1) in bars) == pytest.approx(
        [(64, 960, 1000), (128, 500, 520), (256, 290, 300), (512, 270, 280)])


def test_an_error_bar_shorter_than_its_evaluation_interval_stops_at_step_1(tmp_path, monkeypatch):
    """The target was met in (steps - interval, steps], and a trial takes at least 1 step: 5 steps evaluated every
    10 reach down to step 1, not to -5 (or 0), which a log axis cannot show."""
    recs = [momentum_record(b, 0, s, 1.0) for b, s in ((32, 40), (64, 5), (128, 3))]  # every 10 steps
    assert {r["eval_every_steps"] for r in recs} == {10}
    ax, _ = drawn_axes(monkeypatch, tmp_path, [("cpu/momentum", *sbs.summarise(recs))])
    bars = [seg for c in ax.containers for coll in c.lines[2] for seg in coll.get_segments()]
    assert sorted((x0, y0, y1) for (x0, y0), (_, y1) in bars) == pytest.approx(
        [(32, 30, 40), (64, 1, 5), (128, 1, 3)])


def test_the_lr_reference_lines_have_slopes_1_and_half_through_the_geometric_centre(tmp_path, monkeypatch):
    """Linear and square-root scaling are lines of slope 1 and 0.5 on the log-log axes through the centroid of
    the best (batch size, lr_eff) points, i.e. their geometric means."""
    lrs = {64: 0.2, 128: 0.5, 256: 0.6, 1024: 3.0}
    recs = [momentum_record(b, 0, 100, lr, window=(0.01, 100)) for b, lr in lrs.items()]
    _, ax = drawn_axes(monkeypatch, tmp_path, [("cpu/momentum", *sbs.summarise(recs))])
    b0, lr0 = statistics.geometric_mean(lrs.keys()), statistics.geometric_mean(lrs.values())
    lines = {line.get_label(): line for line in ax.get_lines()}
    for name, slope in (("linear scaling (slope 1)", 1.0), ("square-root scaling (slope 0.5)", 0.5)):
        x, y = np.asarray(lines[name].get_xdata(), float), np.asarray(lines[name].get_ydata(), float)
        assert list(x) == sorted(lrs)
        assert np.polyfit(np.log(x), np.log(y), 1)[0] == pytest.approx(slope)
        assert list(y) == pytest.approx([lr0 * (b / b0) ** slope for b in x])


# ---------------------------------------------------------------------------------------------------------------
# Real trials through train_cifar.train (tiny net, synthetic data: seconds)

TINY = dict(widths=(8, 16, 16), precision="fp32")


def tiny_settings(**kw):
    return sbs.study_settings("cpu", kw.pop("optimizer", "nesterov"), holdout=50, epochs=1, min_steps=8,
                              evals_per_trial=4, overrides=TINY, **kw)


def test_a_real_trial_records_steps_to_target_and_the_full_budget_otherwise():
    data = synthetic(n_train=200, n_test=10)
    easy = sbs.run_trial(sbs.make_trial(tiny_settings(target=0.01), 25, 0, 150), data, "fast94-sgd")
    assert easy["reached"] and easy["steps_to_target"] == easy["eval_every_steps"] == 2
    assert easy["examples_to_target"] == 50 and len(easy["evals"]) == 1 and not easy["diverged"]
    hard = sbs.run_trial(sbs.make_trial(tiny_settings(target=1.0), 25, 1, 150), data, "fast94-sgd")
    assert not hard["reached"] and hard["steps_to_target"] is None and hard["budget_steps"] == 8
    assert [e[0] for e in hard["evals"]] == [2, 4, 6, 8] and 0 <= hard["best_acc"] <= 1


def test_a_target_met_only_by_the_final_evaluation_counts_the_whole_budget(monkeypatch):
    """train_cifar reports no step (only the epoch) when the final evaluation, after the last step-interval one,
    met the target: the trial reached it, in its budget's steps (not "never reached")."""
    import train_cifar
    final = dict(step_reached_target=None, epoch_reached_target=2, accuracy=0.7, time_to_target_s=1.0,
                 total_time_s=1.0, evals=[dict(step=6, test_acc=0.4, train_loss=1.5)])
    monkeypatch.setattr(train_cifar, "train", lambda *a, **k: dict(runs=[final], hardware="stub", precision="fp32",
                                                                    commit="stub"))
    spec = sbs.make_trial(tiny_settings(target=0.65), 25, 0, 150)
    rec = sbs.run_trial(spec, None, "fast94-sgd")
    budget = max(math.ceil(1 * (150 // 25)), 8)  # 1 epoch of 6 steps, but at least min_steps 8
    assert rec["reached"] and rec["steps_to_target"] == spec["budget_steps"] == budget
    assert rec["examples_to_target"] == budget * 25 and rec["best_acc"] == 0.7


def test_a_diverging_trial_is_recorded_as_diverged():
    data = synthetic(n_train=200, n_test=10)
    spec = sbs.make_trial(tiny_settings(optimizer="sgd", target=1.0, lr_range=(1e29, 1e30)), 25, 0, 150)
    rec = sbs.run_trial(spec, data, "fast94-sgd")
    assert rec["diverged"] and not rec["reached"] and "diverged" in rec["error"]


def tiny_study(tmp_path):
    """(output folder, argv) of a 4-trial study on 200 synthetic images: 2 batch sizes x 2 trials."""
    npz = tmp_path / "tiny.npz"
    np.savez(npz, **synthetic(n_train=200, n_test=20))
    out = tmp_path / "study"
    return out, ["run", "--optimizer", "sgd", "--data", str(npz), "--batch-sizes", "25", "50", "--trials", "2",
                 "--eval", "test", "--epochs", "1", "--min-steps", "4", "--evals-per-trial", "2", "--target", "0.01",
                 "--set", "widths=(8,16,16)", "--set", "precision=fp32", "--out", str(out)]


def test_command_line_runs_resumes_and_plots(tmp_path, capsys):
    out, argv = tiny_study(tmp_path)
    sbs.main(argv)
    printed = capsys.readouterr().out
    assert "[4/4]" in printed
    # the header describes what runs (--set, --target, --eval, and what the workload changes from the preset)
    assert ("study: cpu (fast94-sgd net at widths 8/16/16, 1% on the test set, budget max(1 epoch, 4 steps), "
            "2 evaluations per budget, bias_lr_scale=1.0, lookahead_start_epoch=-1, precision=fp32, tta=0), "
            "sgd") in printed
    assert len(sbs.read_trials(str(out / "trials.jsonl"))) == 4
    sbs.main(argv)
    assert "4 finished trial(s)" in capsys.readouterr().out and len(sbs.read_trials(str(out / "trials.jsonl"))) == 4
    sbs.main(["plot", str(out), str(out), "--out", str(tmp_path / "plots")])
    assert (tmp_path / "plots" / "steps_to_target.png").exists() and (tmp_path / "plots" / "best_lr.png").exists()
    for name in ("summary.tsv", "summary.json", "steps_to_target.png", "best_lr.png"):
        assert (out / name).exists()


def test_options_the_study_sets_per_trial_cannot_be_overridden():
    with pytest.raises(sbs.StudyError, match="momentum"):
        sbs.study_settings("cpu", "sgd", overrides=dict(momentum=0.9))


def test_set_options_without_effect_are_usage_errors(tmp_path, capsys):
    """An option that does nothing in the study's trials (EMA decay without EMA) would be recorded in its
    settings and plot labels as if it had been studied."""
    with pytest.raises(SystemExit) as e:
        sbs.main(["run", "--set", "ema_decay=0.9", "--dry-run", "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "--set ema_decay= has no effect without --ema-every above 0" in capsys.readouterr().err


def test_sigterm_stops_a_study_like_ctrl_c(tmp_path):
    # Background jobs under nohup ignore SIGINT; kill's SIGTERM must still keep finished trials and the summary.
    import signal
    import subprocess
    import sys
    from conftest import ROOT
    npz = tmp_path / "tiny.npz"
    np.savez(npz, **synthetic(n_train=400, n_test=20))
    out = tmp_path / "study"
    proc = subprocess.Popen(
        [sys.executable, "-u", "study_batch_size.py", "run", "--optimizer", "sgd", "--data", str(npz),
         "--batch-sizes", "25", "--trials", "50", "--eval", "test", "--epochs", "2", "--evals-per-trial", "2",
         "--target", "1.0", "--set", "widths=(8,16,16)", "--set", "precision=fp32", "--out", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # wait for the first finished trial
        lines.append(line)
        if line.startswith("[1/"):
            break
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, "".join(lines) + rest  # core.exit_with: 143 after SIGTERM
    assert "interrupted" in rest
    done = sbs.read_trials(str(out / "trials.jsonl"))
    assert 1 <= len(done) < 50
    assert json.loads((out / "summary.json").read_text())["status"] == "interrupted"


def test_shards_split_the_plan_and_share_one_folder(tmp_path, capsys):
    out, argv = tiny_study(tmp_path)
    sbs.main(argv + ["--shard", "1/2"])
    shard1 = sbs.read_trials(str(out / "trials-shard1of2.jsonl"))
    assert [(r["batch_size"], r["trial"]) for r in shard1] == [(50, 0), (50, 1)]  # plan items 1 and 3
    # not "complete" while the other shard's half is still to run (it said so, with 2 of 4 trials in the folder)
    assert json.loads((out / "summary.json").read_text())["status"] == "partial: 2 of 4 trials left to other shards"
    assert sorted(p.name for p in out.glob("*.png")) == ["best_lr.png", "steps_to_target.png"]  # no temporary left
    sbs.main(argv)  # unsharded: runs only what no shard has done
    assert "2 finished trial(s)" in capsys.readouterr().out
    assert [(r["batch_size"], r["trial"]) for r in sbs.read_trials(str(out / "trials.jsonl"))] == [(25, 0), (25, 1)]
    assert len(sbs.read_folder(str(out))) == 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trials"] == 4 and [r["trials"] for r in summary["rows"]] == [2, 2]
    assert summary["status"] == "complete"
    sbs.main(argv + ["--shard", "0/2"])  # everything is done
    assert json.loads((out / "summary.json").read_text())["status"] == "complete"  # (shard 0's part: by the others)
    assert not (out / "trials-shard0of2.jsonl").exists() or not sbs.read_trials(str(out / "trials-shard0of2.jsonl"))
    with pytest.raises(SystemExit):
        sbs.main(argv + ["--shard", "2/2"])


def test_a_trial_found_in_two_files_counts_once(tmp_path):
    settings = sbs.study_settings("cpu", "sgd")
    rec = dict(fake_trial(sbs.make_trial(settings, 16, 0, 45000)), reached=True, steps_to_target=5, settings=settings)
    for name, recs in (("trials.jsonl", [rec]), ("trials-shard0of2.jsonl", [rec, dict(rec, trial=1)]),
                       ("trials-shard1of2.jsonl", [dict(rec, steps_to_target=7)])):
        core.append_jsonl(str(tmp_path / name), recs[0])
        for r in recs[1:]:
            core.append_jsonl(str(tmp_path / name), r)
    warnings = []
    records = sbs.read_folder(str(tmp_path), warn=warnings.append)
    assert [(r["trial"], r["steps_to_target"]) for r in records] == [(0, 5), (1, 5)]
    assert len(warnings) == 1 and "differs" in warnings[0]


def test_plot_joins_folders_of_one_study_into_one_curve(tmp_path, capsys):
    # One study run into two folders (more batch sizes added later) is one curve; a copied trial counts once.
    out, argv = tiny_study(tmp_path)
    sbs.main(argv)
    more = tmp_path / "more"
    more_argv = [more if a == str(out) else a for a in argv]
    more_argv[more_argv.index("25"):more_argv.index("50") + 1] = ["100"]
    sbs.main([str(a) for a in more_argv])
    core.append_jsonl(str(more / "trials.jsonl"), sbs.read_trials(str(out / "trials.jsonl"))[0])
    capsys.readouterr()
    sbs.main(["plot", str(out), str(more), "--out", str(tmp_path / "plots")])
    printed = capsys.readouterr().out
    assert f"{out} + {more}: cpu/sgd" in printed and "6 trials" in printed


@pytest.mark.parametrize("args, message", [
    (["--evals-per-trial", "0"], "--evals-per-trial must be at least 1, got 0"),  # divided by zero
    (["--evals-per-trial", "-2"], "--evals-per-trial must be at least 1, got -2"),  # evaluated every step
    (["--min-steps", "-5"], "--min-steps must be >= 0, got -5"),
    (["--lr-range", "0", "1"], "--lr-range needs 0 < LO <= HI, both finite, got 0 1"),  # "math domain error"
    (["--lr-range", "-1", "1"], "--lr-range needs 0 < LO <= HI"),
    (["--lr-range", "5", "1"], "--lr-range needs 0 < LO <= HI"),  # was searched as if 1 5
    (["--lr-window-exponent", "1e6"], "--lr-window-exponent 1e+06 puts the LR window at batch 16 out of"),
    (["--batch-sizes", "16", "2048", "--lr-window-exponent", "1e6"], "--lr-window-exponent 1e+06 puts"),  # overflow
    (["--epochs", "-1"], "--epochs must be positive and finite, got -1.0"),  # silently min-steps
    (["--train-subset", "-10"], "--train-subset must be >= 0 (0: all), got -10"),
    # planned "budget 200 steps (-0.64 epochs)"; then said "-4900 training images ... are too few"
    (["--train-subset", "100"], "a holdout of 5000 leaves none of the 100 training images (--train-subset 100) to "
                                "train on; give a smaller --holdout"),
    (["--train-subset", "100", "--holdout", "80"], "20 training images (--train-subset 100 less a holdout of 80) are "
                                                   "too few for batch sizes up to 32"),
    (["--holdout", "0"], "--holdout must be at least 1 with --eval holdout, got 0"),  # judged on the test set
    # planned and trained on all 50000 while settings.train_subset said 60000
    (["--train-subset", "60000"], "--train-subset 60000 exceeds CIFAR-10's 50000 training images"),
    (["--batch-sizes", "16", "40", "--set", "bn_group_size=16"], "batch 40 is not divisible into BN groups of 16"),
])
def test_impossible_run_options_are_usage_errors_naming_the_option(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        sbs.main(["run", "--dry-run", "--batch-sizes", "16", "32", "--trials", "2", "--out", str(tmp_path / "out"),
                  *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_dry_run_plans_budgets_for_the_data_given(tmp_path, capsys):
    """Budgets are epochs of the training images: a dry run on 200 images planned CIFAR-10's 2500 steps an epoch."""
    npz = tmp_path / "tiny.npz"
    np.savez(npz, **synthetic(n_train=200, n_test=20))
    common = ["run", "--dry-run", "--optimizer", "sgd", "--trials", "1", "--eval", "test", "--epochs", "2",
              "--min-steps", "3", "--out", str(tmp_path / "out"), "--data", str(npz)]
    sbs.main(common + ["--batch-sizes", "20", "50"])
    out = capsys.readouterr().out
    assert "b=20    trial 0:" in out and "budget 20 steps (2.00 epochs)" in out  # 2 epochs of 200 / 20
    assert "b=50    trial 0:" in out and "budget 8 steps (2.00 epochs)" in out
    with pytest.raises(SystemExit) as e:
        sbs.main(common + ["--batch-sizes", "20", "400"])
    captured = capsys.readouterr()
    assert e.value.code == 2 and "batch sizes up to 400 need more than the 200 training images" in captured.err
    assert not (tmp_path / "out").exists() and "study:" not in captured.out  # (no plan's header before the error)
    with pytest.raises(SystemExit) as e:  # ("... more than the -4800 training images left")
        sbs.main(common[:-2] + ["--eval", "holdout", "--holdout", "300", "--data", str(npz), "--batch-sizes", "20"])
    assert e.value.code == 2 and "a holdout of 300 leaves none of the 200 training images" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--batch-sizes", "16", "40", "--set", "bn_group_size=16"], "batch 40 is not divisible into BN groups of 16"),
    (["--batch-sizes", "20", "40", "--set", "precision=fp16"], "fp16 is for CUDA GPUs"),
    # trained on all 200 while settings.train_subset said 300
    (["--batch-sizes", "20", "--train-subset", "300"], "--train-subset 300 exceeds the 200 training images in"),
])
def test_trials_train_would_refuse_are_errors_before_the_first_trial(tmp_path, capsys, args, message):
    """The first trial (batch 16, or any in fp16 on a CPU) used to run or start, then a traceback."""
    npz, out = tmp_path / "tiny.npz", tmp_path / "study"
    np.savez(npz, **synthetic(n_train=200, n_test=20))
    with pytest.raises(SystemExit) as e:
        sbs.main(["run", "--optimizer", "sgd", "--data", str(npz), "--device", "cpu", "--trials", "1", "--eval", "test",
                  "--epochs", "1", "--min-steps", "2", "--evals-per-trial", "1", "--target", "0.01",
                  "--set", "widths=(8,16,16)", "--out", str(out), *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists() or not os.listdir(out)


def test_the_header_describes_the_effective_settings_not_the_workloads_defaults(tmp_path, capsys):
    """--holdout 500 --set widths=(8,16,16) was announced as "widths 16/32/32, 65% on a 5000-image holdout"."""
    sbs.main(["run", "--dry-run", "--holdout", "500", "--target", "0.5", "--set", "widths=(8,16,16)",
              "--batch-sizes", "16", "--trials", "1", "--out", str(tmp_path / "out")])
    header = capsys.readouterr().out.splitlines()[0]
    assert header == ("study: cpu (fast94-sgd net at widths 8/16/16, 50% on a 500-image holdout, budget max(4 epochs, "
                      "200 steps), 20 evaluations per budget, bias_lr_scale=1.0, lookahead_start_epoch=-1, tta=0), "
                      "nesterov (Nesterov momentum), batch sizes 16, 1 trials each")


def test_a_resume_on_other_data_is_refused_naming_the_data(tmp_path, capsys):
    """The settings held no trace of the data: a folder built on a subset resumed on other data, mixing trials."""
    out, argv = tiny_study(tmp_path)
    sbs.main(argv)
    assert all("data" in r["settings"] for r in sbs.read_trials(str(out / "trials.jsonl")))
    other = tmp_path / "other.npz"
    np.savez(other, **synthetic(n_train=200, n_test=20, seed=1))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        sbs.main([str(other) if a.endswith("tiny.npz") else a for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "other settings (data.test_x" in err and "data.train_x" in err


def test_holdout_without_holdout_evaluation_is_a_usage_error(tmp_path, capsys):
    """gpu94 judges the target on the test set: --holdout 1000 was dropped without a word."""
    with pytest.raises(SystemExit) as e:
        sbs.main(["run", "--dry-run", "--workload", "gpu94", "--holdout", "1000", "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "--holdout 1000 needs --eval holdout" in capsys.readouterr().err
    # --eval test given: the cpu workload (which holds images out) was blamed for the user's own choice
    with pytest.raises(SystemExit) as e:
        sbs.main(["run", "--dry-run", "--workload", "cpu", "--eval", "test", "--holdout", "100", "--out",
                  str(tmp_path / "o")])
    assert e.value.code == 2 and "(--eval test judges the target on the test set" in capsys.readouterr().err


def test_unreached_larger_batch_sizes_are_named_not_called_a_plateau():
    settings = sbs.study_settings("cpu", "momentum", epochs=40, min_steps=4000)
    recs = [fake_trial(s) for s in sbs.plan(settings, [64, 128, 256], 1, 45000)]
    recs = [dict(r, reached=r["batch_size"] == 64, steps_to_target=1000 if r["batch_size"] == 64 else None)
            for r in recs]
    lines = []
    sbs.report(*sbs.summarise(recs), log=lines.append)
    text = "\n".join(lines)
    assert "maximal useful batch size 64 (128, 256 did not reach the target within their budgets" in text
    assert "no larger batch cuts" not in text


def test_plots_of_nothing_reached_draw_no_empty_legend(tmp_path):
    import warnings
    settings = sbs.study_settings("cpu", "momentum", epochs=40, min_steps=4000)
    recs = [dict(fake_trial(s), reached=False, steps_to_target=None)
            for s in sbs.plan(settings, [64, 128], 1, 45000)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "No artists with labels found to put in legend"
        sbs.plot([("cpu/momentum", *sbs.summarise(recs))], str(tmp_path))


def test_plot_labels_tell_curves_of_other_settings_apart(study, tmp_path, monkeypatch):
    settings, specs, _ = study
    dirs = []
    for target in (0.65, 0.7):
        d = tmp_path / f"t{target}"
        d.mkdir()
        sbs.run_study(specs[:2], fake_trial, str(d / "trials.jsonl"), dict(settings, target=target), log=QUIET)
        dirs.append(str(d))
    seen = []
    monkeypatch.setattr(sbs, "plot", lambda curves, out: seen.extend(c[0] for c in curves) or [])
    sbs.main(["plot", *dirs, "--out", str(tmp_path / "plots")])
    assert seen == ["cpu/momentum target=0.65", "cpu/momentum target=0.7"]


def test_plot_labels_stay_distinct_when_only_some_curves_differ_in_a_shown_key():
    """Three curves of one label: a and b differ only in their data, c from a only in its target. Labelling by
    the target alone would give a and b the same label "target=0.65": each is named by its folder instead."""
    base = dict(sbs.study_settings("cpu", "sgd"), data=dict(train_x="1111"))
    groups = [[["a"], "cpu/sgd", base, {}], [["b"], "cpu/sgd", dict(base, data=dict(train_x="2222")), {}],
              [["c"], "cpu/sgd", dict(base, target=0.7), {}]]
    sbs.distinguish(groups)
    labels = [g[1] for g in groups]
    assert len(set(labels)) == 3 and all(f"({name})" in label for name, label in zip("abc", labels))


def test_a_resume_with_nothing_to_run_names_no_unwritten_file(tmp_path, capsys):
    out, argv = tiny_study(tmp_path)
    sbs.main(argv + ["--shard", "0/2"])
    sbs.main(argv + ["--shard", "1/2"])
    capsys.readouterr()
    sbs.main(argv)  # everything done by the shards: trials.jsonl is never written
    wrote = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wrote")]
    assert not (out / "trials.jsonl").exists() and wrote and "trials.jsonl" not in wrote[0]


def test_printed_metaparameters_say_what_they_are_fractions_of():
    p = dict(lr_eff=1.0, momentum=0.9, warmup_frac=0.06, decay_to=0.131)
    assert "warm-up 0.06 of the budget, decay to 0.131 x the peak LR" in sbs.describe_params(p)


def test_repeated_batch_sizes_are_studied_once_saying_so(capsys):
    _, args = sbs.parse_args(["run", "--batch-sizes", "64", "32", "64", "--trials", "1", "--dry-run"])
    assert args.batch_sizes == [32, 64]
    assert "note: --batch-sizes 64 given more than once; each is studied once" in capsys.readouterr().err


@pytest.mark.parametrize("bad, line, message", [
    (lambda r: {k: v for k, v in r.items() if k != "trial"}, 2, 'no "trial"'),  # was a KeyError
    (lambda r: [1, 2], 2, "[1, 2] is not a JSON object"),  # was an AttributeError
    (lambda r: dict(r, steps_to_target="abc"), 2, '"steps_to_target" is "abc", not null or a whole number >= 1'),
    (lambda r: dict(r, params=dict(r["params"], lr_eff=None)), 1, '"params.lr_eff" is null, not a number > 0'),
])
def test_a_line_that_is_no_trial_record_is_a_one_line_error_naming_it(tmp_path, capsys, bad, line, message):
    """A trials record without "trial" (KeyError) or a JSON list (AttributeError) of the study's own folder failed
    run and plot with a traceback."""
    out, argv = tiny_study(tmp_path)
    parser, args = sbs.parse_args(argv)
    import torch_backend as tb
    settings = dict(args.settings, data=tb.dataset_fingerprint(sbs.load_data(parser, args)))
    good = [dict(fake_trial(spec), settings=settings) for spec in sbs.plan(settings, [25, 50], 2, 200)[:2]]
    good[line - 1] = bad(good[line - 1])
    out.mkdir()
    (out / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))
    before = (out / "trials.jsonl").read_bytes()
    for command in (argv, ["plot", str(out)]):
        with pytest.raises(SystemExit) as e:
            sbs.main(command)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.splitlines()) == 1
        assert f"trials.jsonl:{line} is not a trial record of this study ({message})" in err
    assert (out / "trials.jsonl").read_bytes() == before
