"""The recent-traffic window's mean lengths, read from running totals, equal a scan of the window."""

import numpy as np
import pytest

from twin.policy.signals import RecentWindow


@pytest.mark.parametrize("seed", range(5))
def test_mean_lengths_from_running_totals_equal_a_scan_of_the_window(seed):
    rng = np.random.default_rng(seed)
    w = RecentWindow(horizon_s=float(rng.choice([30.0, 200.0])))
    t = 0.0
    looks = 0
    for _ in range(6000):
        t += float(rng.exponential(0.05))
        if rng.random() < 0.7:
            w.finished(t, 0.1, 1.0, int(rng.integers(1, 4000)), int(rng.integers(1, 900)))
        else:
            window = float(rng.choice([5.0, 60.0, 600.0]))
            now = t if rng.random() < 0.95 else t - float(rng.uniform(0, 10))  # a look back in time: a scan
            assert w.mean_lengths(now, window) == w._scan_means(now, window)
            looks += 1
    assert looks > 1000 and len(w._cum) == len(w.completions)  # trimmed along (horizon 30 s or 200 s)


def test_completions_added_by_hand_or_out_of_order_are_scanned():
    w = RecentWindow()
    w.finished(1.0, 0.1, 1.0, 10, 20)
    w.completions.extend([w.completions[0]])  # as the live controller copies a window
    assert w.mean_lengths(2.0, 60.0) == (10.0, 20.0)
    v = RecentWindow()
    v.finished(5.0, 0.1, 1.0, 10, 20)
    v.finished(3.0, 0.1, 1.0, 30, 40)  # out of time order
    assert v.mean_lengths(5.0, 1.5) == v._scan_means(5.0, 1.5) == (None, None)
    assert v.mean_lengths(5.0, 10.0) == (20.0, 30.0)


def test_a_copy_answers_as_its_original_and_later_appends_do_not_reach_it():
    """`copy` is what a policy deciding on another thread reads (`FleetView.snapshot`): every reading equal to the
    original's at the copy, its running totals kept (not a scan), and unchanged by what the owner adds after."""
    rng = np.random.default_rng(3)
    w = RecentWindow(horizon_s=200.0, observed_since=0.5)
    t = 0.0
    for _ in range(3000):
        t += float(rng.exponential(0.05))
        w.arrived(t, int(rng.integers(1, 4000)))
        w.finished(t, 0.1, 1.0, int(rng.integers(1, 4000)), int(rng.integers(1, 900)))
    w.mean_lengths(t, 60.0)  # a look the copy keeps its cursor of
    c = w.copy()

    def readings(x):
        return (x.mean_lengths(t, 60.0), x.mean_lengths(t, 5.0), x.rate(t, 60.0), x.completion_rate(t, 60.0),
                x.arrival_series(t, 10.0, 6), x.quantile(t, "e2e_s", 0.99, 60.0), x.total_arrivals)

    before = readings(w)
    assert readings(c) == before and len(c._cum) == len(c.completions) == len(w.completions)
    for k in range(50):
        w.arrived(t + 1 + k, 5)
        w.finished(t + 1 + k, 0.1, 1.0, 7, 7)
    assert readings(c) == before and readings(w) != before
