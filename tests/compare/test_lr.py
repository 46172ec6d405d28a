"""warmup_cosine: the learning rate of the memory axis and the long-run benchmark."""

import math

import pytest

from leantrain.compare.lr import warmup_cosine


def test_warmup_then_cosine_to_the_floor():
    factor = warmup_cosine(10, 100)
    assert factor(0) == pytest.approx(0.1)
    assert factor(9) == pytest.approx(1.0)
    assert factor(10) == pytest.approx(1.0)
    assert factor(55) == pytest.approx(0.55)  # half way down the cosine
    assert factor(100) == pytest.approx(0.1)
    assert factor(150) == pytest.approx(0.1)  # stays at the floor past the end
    half = warmup_cosine(1, 3, floor=0.0)
    assert half(2) == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)))


@pytest.mark.parametrize(
    "warmup, steps, floor",
    [(0, 10, 0.1), (5, 0, 0.1), (True, 10, 0.1), (2.0, 10, 0.1), (1, 10, 1.5)],
)
def test_bad_arguments_are_refused(warmup, steps, floor):
    with pytest.raises(ValueError, match="warmup|steps|floor"):
        warmup_cosine(warmup, steps, floor)
