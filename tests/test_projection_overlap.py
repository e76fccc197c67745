"""project_step_time with compute_seconds / overlap_steps: the wall time of overlapped schedules.

The schedules are built by hand (a CommunicationCost whose period sends given bytes on given steps)
on a link that moves 1000 bytes a second between 2 workers (a ring all-reduce of B bytes sends B),
so a payload of 1500 bytes is a 1.5 s transfer; and read off a real Streaming DiLoCo.
"""

from __future__ import annotations

import copy
import math
import pickle
import random

import jax.numpy as jnp
import optax
import pytest

import jaxopt_dist as jd
from jaxopt_dist._src.accounting import costs

SLOW = dict(bandwidth_gbps=8e-6, latency_us=0.0)  # 1000 bytes per second, no latency


def _schedule(seconds_per_step):
    """A CommunicationCost whose period's step ``j`` all-reduces ``seconds_per_step[j]`` seconds of bytes."""
    steps = []
    for j, seconds in enumerate(seconds_per_step):
        size = round(seconds * 1000)
        sent = (costs.Collective("all_reduce", "psum", ("data",), 2, (((size,), "uint8"),), size, 1.0, "x"),)
        steps.append(costs.StepCost(j, sent if size else ()))
    return costs.CommunicationCost(
        num_workers=2,
        axis_sizes={"data": 2},
        params_bytes=1000,
        dense_bytes=1000.0,
        steps=tuple(steps),
        period=tuple(range(len(steps))),
        sites=(),
        step_dependent=True,
        exact=True,
        data_axes=("data",),
    )


def _wall(seconds_per_step, compute, window):
    return jd.project_step_time(
        _schedule(seconds_per_step), compute_seconds=compute, overlap_steps=window, **SLOW
    )


def _reference_wall(seconds_per_step, compute, window, periods=300):
    """The recurrence of the docstring in absolute time, averaged over the last half of ``periods``."""
    end = link = 0.0
    done = {}
    ends = []
    for n in range(periods * len(seconds_per_step)):
        compute_end = end + compute
        seconds = seconds_per_step[n % len(seconds_per_step)]
        if seconds:
            link = max(link, compute_end) + seconds
            done[n + window] = link
        end = max(compute_end, done.pop(n, compute_end))
        ends.append(end)
    half = len(ends) // 2
    return (ends[-1] - ends[half - 1]) / (len(ends) - half)


# (period's transfers in seconds, compute seconds, overlap steps, hand-computed wall seconds per step)
CASES = [
    # One fragment: max(P c, T, P c + T - w c) / P.
    ([1.0, 0, 0, 0], 0.5, 1, 2.5 / 4),  # wire longer than the window: 0.5 s of 1.0 s shows
    ([0.4, 0, 0, 0], 0.5, 1, 2.0 / 4),  # wire shorter than the window: hidden
    ([1.0, 0, 0, 0], 0.5, 2, 2.0 / 4),  # a window of two steps is exactly long enough
    ([1.0, 0, 0, 0], 0.5, 0, 3.0 / 4),  # blocking: compute + T / P
    ([3.0, 0, 0, 0], 0.5, 4, 3.0 / 4),  # eager (w = P): the link is the bottleneck
    ([1.5, 0, 0, 0], 0.5, 4, 2.0 / 4),  # eager: hidden
    ([3.0, 0], 1.0, 5, 3.0 / 2),  # w beyond the period: still link-bound
    ([3.0], 1.0, 1, 3.0),  # every step sends more than a step computes: one transfer after another
    ([0.5], 1.0, 1, 1.0),  # every step, hidden by the next
    ([1.0, 0, 1.02, 0], 0.5, 28, 2.02 / 4),  # a backlog grows 0.02 s a period until the deadline binds
    # Several fragments.
    ([1.5, 0, 0.75, 0], 1.0, 1, 4.5 / 4),  # apart: each shows its own excess (0.5 and 0)
    ([1.5, 1.5, 0, 0], 1.0, 1, 5.0 / 4),  # back to back: the second queues behind the first (not 4.5 / 4)
    ([1.5, 1.5, 0, 0], 1.0, 2, 4.0 / 4),  # ... which a window of two steps hides
    ([0, 2.0, 0, 2.0, 0, 2.0], 0.5, 1, 7.5 / 6),  # three fragments, 1.5 s each exposed
]


@pytest.mark.parametrize("transfers, compute, window, expected", CASES)
def test_hand_computed_schedules(transfers, compute, window, expected):
    t = _wall(transfers, compute, window)
    assert t.seconds == pytest.approx(sum(transfers) / len(transfers))
    assert t.wall_seconds == pytest.approx(expected, rel=1e-12)
    assert t.utilization == pytest.approx(compute / expected, rel=1e-12)
    assert (t.compute_seconds, t.overlap_steps) == (compute, window)


def test_one_fragment_formula_and_the_reference_recurrence():
    rng = random.Random(0)
    for _ in range(40):
        period = rng.randint(1, 6)
        transfers = [round(rng.choice([0.0, 0.0, rng.uniform(0.1, 4.0)]), 3) for _ in range(period)]
        compute, window = rng.choice([0.25, 0.5, 1.0]), rng.randint(0, 8)
        wall = _wall(transfers, compute, window).wall_seconds
        assert wall == pytest.approx(_reference_wall(transfers, compute, window), rel=1e-9, abs=1e-12)
        assert (
            max(compute, sum(transfers) / period) - 1e-12 <= wall <= compute + sum(transfers) / period + 1e-12
        )
        if sum(1 for x in transfers if x) == 1:
            big_t = sum(transfers)
            pc = period * compute
            assert wall == pytest.approx(max(pc, big_t, pc + big_t - window * compute) / period)


@pytest.fixture(scope="module")
def streaming_cost():
    # H = 4 steps, 2 fragments (leaf "a": 1024 bytes, sent on step 0; leaf "b": 512 bytes, on step 2),
    # each applied a step later.
    tx = jd.diloco(optax.sgd(0.1), sync_every=4, num_fragments=2, sync_delay=1)
    return jd.communication_cost(tx, {"a": jnp.zeros(256), "b": jnp.zeros(128)}, num_workers=2)


KILOBYTE_A_SECOND = dict(bandwidth_gbps=8 * 1024e-9, latency_us=0.0)  # 1024 bytes: 1 s, 512: 0.5 s


@pytest.mark.parametrize(
    "compute, window, wall",
    [
        (1.0, 0, 1.0 + 1.5 / 4),  # blocking
        (1.0, 1, 1.0),  # both hidden: 1 s <= one step
        (0.5, 1, 2.5 / 4),  # "a" shows 0.5 s, "b" hidden
        (0.25, 1, 2.0 / 4),  # "a" shows 0.75 s, "b" 0.25 s
        (0.25, 4, 1.5 / 4),  # a whole period to finish: the link (1.5 s a period) is the bottleneck
    ],
)
def test_streaming_diloco(streaming_cost, compute, window, wall):
    steps = streaming_cost.period_steps()
    assert [s.sent_bytes for s in steps] == [1024.0, 0.0, 512.0, 0.0]
    t = jd.project_step_time(
        streaming_cost, compute_seconds=compute, overlap_steps=window, **KILOBYTE_A_SECOND
    )
    assert t.seconds == pytest.approx(1.5 / 4)
    assert t.wall_seconds == pytest.approx(wall, rel=1e-9)
    assert t.utilization == pytest.approx(compute / wall, rel=1e-9)


@pytest.mark.parametrize("compute", [0.0, 0.1, 1.0, 3.0])
def test_no_overlap_is_compute_plus_communication(streaming_cost, compute):
    link = dict(bandwidth_gbps=1e-5, latency_us=100.0, algorithm="gloo", call_floor_us=4000.0)
    plain = jd.project_step_time(streaming_cost, **link)
    t = jd.project_step_time(streaming_cost, compute_seconds=compute, **link)
    assert float(t) == float(plain) and t.by_kind == plain.by_kind
    assert t.wall_seconds == pytest.approx(compute + plain.seconds, rel=1e-12)
    walls = [
        jd.project_step_time(streaming_cost, compute_seconds=compute, overlap_steps=w, **link).wall_seconds
        for w in range(6)
    ]
    assert all(a >= b - 1e-12 for a, b in zip(walls, walls[1:]))  # a longer window never hurts


def test_without_compute_nothing_changes_and_pickling(streaming_cost):
    plain = jd.project_step_time(streaming_cost, **KILOBYTE_A_SECOND)
    assert plain.wall_seconds is None and plain.utilization is None and plain.compute_seconds is None
    assert "wall" not in repr(plain) and "wall" not in plain.table()
    t = jd.project_step_time(streaming_cost, compute_seconds=0.5, overlap_steps=1, **KILOBYTE_A_SECOND)
    assert "wall_seconds=0.625" in repr(t) and "utilization 80.0%" in t.table()
    for x in (plain, t):
        for y in (pickle.loads(pickle.dumps(x)), copy.deepcopy(x)):
            assert type(y) is type(x) and float(y) == float(x) and repr(y) == repr(x)
            assert (y.by_kind, y.by_axis, y.wall_seconds, y.utilization) == (
                x.by_kind,
                x.by_axis,
                x.wall_seconds,
                x.utilization,
            )


def test_nothing_sent_and_no_compute():
    assert _wall([0, 0], 0.0, 3).utilization == 1.0
    assert _wall([0, 0], 2.0, 0).wall_seconds == 2.0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(compute_seconds=-1.0), ValueError, r"`compute_seconds` must be finite and >= 0"),
        (dict(compute_seconds=math.inf), ValueError, r"`compute_seconds` must be finite"),
        (dict(compute_seconds=math.nan), ValueError, r"`compute_seconds` must be finite"),
        (dict(compute_seconds="1"), TypeError, r"`compute_seconds` must be a number"),
        (dict(compute_seconds=True), TypeError, r"`compute_seconds` must be a number"),
        (dict(compute_seconds=1.0, overlap_steps=-1), ValueError, r"`overlap_steps` must be >= 0"),
        (dict(compute_seconds=1.0, overlap_steps=1.0), TypeError, r"`overlap_steps` must be an int"),
        (dict(compute_seconds=1.0, overlap_steps=True), TypeError, r"`overlap_steps` must be an int"),
        (dict(overlap_steps=1), ValueError, r"`overlap_steps` needs `compute_seconds`"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        jd.project_step_time(_schedule([1.0, 0]), **SLOW, **kwargs)
