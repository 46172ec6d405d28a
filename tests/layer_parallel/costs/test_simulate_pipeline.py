"""The pipeline cost model: hand-counted schedules, a brute-force tick simulation of
the same schedules (the oracle), the closed forms, memory and traffic, validation."""

from __future__ import annotations

import itertools
import random

import pytest

from leantrain.layer_parallel.costs.simulate import CommModel, LayerTimes, OutsideTimes
from leantrain.layer_parallel.costs.simulate_pipeline import (
    bubble_fraction,
    critical_path,
    gpipe_time,
    peak_in_flight,
    simulate_pipeline,
    stage_order,
)


def _tick_oracle(orders, fwd, bwd, msg) -> int:
    """Advance an integer clock one tick at a time; at each tick every idle rank
    starts its next action if that action's input arrived by then."""
    stages = len(orders)
    done: list[dict] = [{} for _ in range(stages)]
    busy_until = [0] * stages
    nxt = [0] * stages
    t = 0
    while any(nxt[p] < len(orders[p]) for p in range(stages)) and t < 10**5:
        for p in range(stages):
            if busy_until[p] > t or nxt[p] == len(orders[p]):
                continue
            kind, m = orders[p][nxt[p]]
            dep = p - 1 if kind == "F" else p + 1
            if 0 <= dep < stages:
                end = done[dep].get((kind, m))
                if end is None or end + msg > t:
                    continue
            busy_until[p] = t + (fwd[p] if kind == "F" else bwd[p])
            done[p][(kind, m)] = busy_until[p]
            nxt[p] += 1
        t += 1
    return max(busy_until)


def test_hand_counted_two_stages():
    # P=2, M=2, F=1, B=2, message 0.5. GPipe: rank 1 runs F0 [1.5, 2.5], F1 [2.5,
    # 3.5], B0 [3.5, 5.5], B1 [5.5, 7.5]; rank 0 B0 [6, 8], B1 [8, 10].
    orders = stage_order("gpipe", 2, 2)
    t, fin = critical_path(orders, [1.0, 1.0], [2.0, 2.0], 0.5)
    assert t == 10.0
    assert fin[1][("B", 1)] == 7.5 and fin[0][("B", 0)] == 8.0
    assert gpipe_time(2, 2, 1.0, 2.0, 0.5) == 10.0
    # 1F1B: rank 1 runs F0 B0 F1 B1: [1.5, 2.5], [2.5, 4.5], [4.5, 5.5], [5.5, 7.5];
    # rank 0 F0 F1 B0 B1 with B0 at [5, 7], B1 at [8, 10].
    orders = stage_order("1f1b", 2, 2)
    assert orders[1] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    t, fin = critical_path(orders, [1.0, 1.0], [2.0, 2.0], 0.5)
    assert t == 10.0 and fin[0][("B", 0)] == 7.0 and fin[1][("F", 1)] == 5.5


def test_hand_counted_bubble_and_memory():
    # P=4, M=8, unit forward, backward 2: (M+P-1)(F+B) = 11 * 3 = 33 for both.
    for schedule in ("gpipe", "1f1b"):
        r = simulate_pipeline(4, 4, 8, LayerTimes(1.0, 2.0), schedule=schedule)
        assert r.step == 33.0
        assert r.bubble == pytest.approx(3 / 11) == bubble_fraction(4, 8)
        assert r.serial == 4 * 8 * 3.0 and r.speedup == pytest.approx(96 / 33)
    gpipe = simulate_pipeline(
        8, 4, 8, LayerTimes(1.0, 2.0), schedule="gpipe", layer_activation_bytes=10.0
    )
    onef = simulate_pipeline(
        8, 4, 8, LayerTimes(1.0, 2.0), schedule="1f1b", layer_activation_bytes=10.0
    )
    assert gpipe.in_flight == (8, 8, 8, 8)
    assert onef.in_flight == (4, 3, 2, 1)
    assert onef.activation_bytes == (80.0, 60.0, 40.0, 20.0)  # 2 layers per rank
    r = simulate_pipeline(8, 4, 8, LayerTimes(1.0, 2.0), state_bytes=5.0)
    assert r.message_bytes == (40.0, 80.0, 80.0, 40.0)  # ends send one way only


CASES = list(
    itertools.product(("gpipe", "1f1b"), (1, 2, 3, 4), (1, 2, 3, 5, 8), (0, 1, 3))
)


@pytest.mark.parametrize("schedule,stages,mb,msg", CASES)
def test_critical_path_equals_tick_oracle(schedule, stages, mb, msg):
    if schedule == "1f1b" and mb < stages:
        pytest.raises(ValueError, stage_order, schedule, stages, mb)
        return
    rng = random.Random(stages * 100 + mb * 10 + msg)
    orders = stage_order(schedule, stages, mb)
    for p, order in enumerate(orders):  # every micro-batch once each way
        assert sorted(order) == sorted(
            [("F", m) for m in range(mb)] + [("B", m) for m in range(mb)]
        )
        # a backward never precedes its own forward on a rank
        assert all(order.index(("F", m)) < order.index(("B", m)) for m in range(mb))
        expect = mb if schedule == "gpipe" else min(mb, stages - p)
        assert peak_in_flight(order) == expect
    for _ in range(3):  # unequal stages too
        fwd = [rng.randint(1, 4) for _ in range(stages)]
        bwd = [rng.randint(1, 6) for _ in range(stages)]
        t, _ = critical_path(orders, fwd, bwd, msg)
        assert t == _tick_oracle(orders, fwd, bwd, msg)
    f, b = rng.randint(1, 4), rng.randint(1, 6)
    t, _ = critical_path(orders, [f] * stages, [b] * stages, msg)
    if schedule == "gpipe" or msg == 0:
        assert t == gpipe_time(stages, mb, f, b, msg)


def test_communication_model_feeds_the_messages():
    comm = CommModel(latency=0.5, bandwidth=10.0)
    r = simulate_pipeline(
        2, 2, 2, LayerTimes(1.0, 2.0), schedule="gpipe", comm=comm, state_bytes=5.0
    )
    assert r.step == gpipe_time(2, 2, 1.0, 2.0, 0.5 + 0.5)
    one = simulate_pipeline(2, 1, 2, LayerTimes(1.0, 2.0), comm=comm, state_bytes=5.0)
    assert one.step == 12.0 and one.bubble == 0.0  # one stage: no message, no bubble
    ser = simulate_pipeline(
        4, 2, 2, LayerTimes(1.0, 2.0), serial_times=LayerTimes(1.5, 3.0)
    )
    assert ser.serial == 4 * 4.5


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(n_layers=6, stages=4, micro_batches=4), "n_layers=6 is not divisible"),
        (dict(n_layers=8, stages=4, micro_batches=2), "'1f1b' needs micro_batches"),
        (dict(n_layers=8, stages=2, micro_batches=0), "micro_batches"),
        (dict(n_layers=8, stages=2, micro_batches=2, schedule="zb"), "schedule must"),
        (dict(n_layers=8, stages=2, micro_batches=2, state_bytes=-1.0), "state_bytes"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate_pipeline(times=LayerTimes(1.0, 1.0), **kwargs)


def test_outside_work_goes_where_the_pipeline_runs_it():
    # N = 4, P = 2, M = 2, unit layer steps (F = B = 2 per stage), GPipe. Hand
    # schedule with embedding e on stage 0's forwards, head hf / hb on stage 1's
    # forward / backward: stage 1 ends B1 at 10 + e + 2 hf + 2 hb, stage 0 at
    # 12 + e + 2 hf + 2 hb, then its AdamW over 2 layers + the embedding.
    e, hf, hb, o, q = 0.1, 0.2, 0.3, 0.05, 0.01
    out = OutsideTimes(e, hf, hb, o, q)
    r = simulate_pipeline(4, 2, 2, LayerTimes(1.0, 1.0), schedule="gpipe", outside=out)
    assert r.step == pytest.approx(12 + e + 2 * hf + 2 * hb + 2 * o + q)
    # serial: the whole batch's embedding and head (M times a micro-batch's) and
    # AdamW over all 4 layers
    assert r.serial == pytest.approx(16 + 2 * (e + hf + hb) + q + 4 * o)
    bare = simulate_pipeline(4, 2, 2, LayerTimes(1.0, 1.0), schedule="gpipe")
    assert bare.step == 12.0 and bare.serial == 16.0
