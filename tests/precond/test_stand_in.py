"""The recorded stand-in: replay equals direct evaluation; misuse raises clearly."""

from __future__ import annotations

import copy
import operator
import pickle
from collections import OrderedDict, namedtuple
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from leantrain.precond import stand_in as si
from leantrain.precond.stand_in import (
    StandIn,
    contains_stand_in,
    describe,
    leaves,
    replay,
)


def new_root() -> StandIn:
    return si.root(si.Origin("test call"))


def test_chain_of_attribute_item_call_replays_on_the_real_output():
    y = new_root()
    expr = y[0]["key"].attr.method(y[1])
    inner = SimpleNamespace(method=lambda v: ("called with", v))
    output = ({"key": SimpleNamespace(attr=inner)}, 42)
    assert replay(expr, output) == ("called with", 42)
    assert describe(expr) == "y[0]['key'].attr.method(y[1])"


def test_view_with_size_of_itself():
    y = new_root()
    expr = y.view(-1, y.size(-1))
    real = torch.randn(2, 3, 5)
    out = replay(expr, real)
    assert torch.equal(out, real.view(-1, 5))
    assert repr(expr) == "<stand-in: y.view(-1, y.size(-1))>"


def test_stand_ins_nested_in_containers_and_kwargs_are_replaced():
    y = new_root()
    Pair = namedtuple("Pair", "a b")
    recorded = (
        [y[0], (y[1], {"k": [y[0]]})],
        {"d": OrderedDict(x=y[1]), "s": {y[2]}, "p": Pair(y[0], 7)},
    )
    out = replay(recorded, [10, 20, 30])
    assert out == (
        [10, (20, {"k": [10]})],
        {"d": {"x": 20}, "s": {30}, "p": Pair(10, 7)},
    )
    assert type(out[1]["d"]) is OrderedDict and type(out[1]["p"]) is Pair
    assert contains_stand_in(recorded) and not contains_stand_in(out)


def test_arithmetic_and_comparisons_are_recorded():
    y = new_root()
    a, b = torch.randn(4), torch.randn(4)
    exprs = {
        "y[0] + 0.1 * y[1]": (y[0] + 0.1 * y[1], a + 0.1 * b),
        "2 - y[0]": (2 - y[0], 2 - a),
        "-abs(y[0]) ** 2 / y[1]": (-(abs(y[0]) ** 2) / y[1], -(abs(a) ** 2) / b),
        "y[0] @ y[1]": (y[0] @ y[1], a @ b),
        "y[0] > y[1]": (y[0] > y[1], a > b),
        "y[0] == y[1]": (y[0] == y[1], a == b),
    }
    for text, (expr, expected) in exprs.items():
        assert isinstance(expr, StandIn), text
        torch.testing.assert_close(replay(expr, (a, b)), expected, msg=text)


def test_torch_functions_on_stand_ins_are_recorded():
    y = new_root()
    logits, t = torch.randn(6, 4), torch.randint(0, 4, (6,))
    expr = F.cross_entropy(y.logits, t) + torch.cat([y.logits, y.logits]).sum() * 0
    assert isinstance(expr, StandIn)
    got = replay(expr, SimpleNamespace(logits=logits))
    torch.testing.assert_close(got, F.cross_entropy(logits, t))
    assert t in [v for v in leaves(expr) if isinstance(v, torch.Tensor)]


def test_each_sub_expression_is_evaluated_once_per_replay():
    calls = []

    def fn(v):
        calls.append(v)
        return v * 2

    y = new_root()
    shared = y.fn(3)
    expr = [shared, shared + 1, {"again": shared}]
    out = replay(expr, SimpleNamespace(fn=fn))
    assert out == [6, 7, {"again": 6}] and calls == [3]


def test_leaf_substitution_reaches_inside_recordings():
    y = new_root()
    t = torch.arange(3.0)
    expr = y * t
    out = replay(expr, torch.ones(3), leaf=lambda v: v * 10 if v is t else v)
    torch.testing.assert_close(out, t * 10)


NEED_REAL = [
    ("bool", lambda y: bool(y)),
    ("if", lambda y: 1 if y else 0),
    ("len", lambda y: len(y)),
    ("iter", lambda y: list(y)),
    ("unpack", lambda y: operator.itemgetter(0)(tuple(y))),
    ("float", lambda y: float(y)),
    ("int", lambda y: int(y)),
    ("index", lambda y: [1, 2][y]),
    ("in", lambda y: 1 in y),
    ("setattr", lambda y: setattr(y, "a", 1)),
    ("setitem", lambda y: y.__setitem__(0, 1)),
    ("delitem", lambda y: y.__delitem__(0)),
    ("pickle", lambda y: pickle.dumps(y)),
    ("deepcopy", lambda y: copy.deepcopy(y)),
]


@pytest.mark.parametrize("name,use", NEED_REAL, ids=[n for n, _ in NEED_REAL])
def test_using_a_stand_in_as_a_real_value_raises_a_clear_type_error(name, use):
    y = new_root()
    with pytest.raises(TypeError, match="stand-in"):
        use(y[0])


def test_dunder_probes_are_not_recorded():
    y = new_root()
    assert not hasattr(y, "__array_interface__")
    assert not hasattr(y, "__fspath__")


def test_mixing_stand_ins_of_two_model_calls_raises():
    y1, y2 = new_root(), new_root()
    with pytest.raises(ValueError, match="different model calls"):
        y1 + y2
    with pytest.raises(ValueError, match="different model calls"):
        y1.method([y2])
    with pytest.raises(ValueError, match="different model calls"):
        F.mse_loss(y1, y2)


def test_replay_error_names_the_recorded_expression():
    y = new_root()
    with pytest.raises(AttributeError) as info:
        replay(y.missing_attribute, torch.zeros(1))
    notes = getattr(info.value, "__notes__", [])
    if hasattr(info.value, "add_note"):  # Python >= 3.11
        assert any("y.missing_attribute" in n for n in notes)


# -- property: random recorded chains replay exactly like direct evaluation ------
_OPS = st.sampled_from(["item0", "item1", "attr", "neg", "add", "mul", "view", "sum0"])


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(_OPS, max_size=8), seed=st.integers(0, 2**16))
def test_random_chains_replay_like_direct_evaluation(ops, seed):
    gen = torch.Generator().manual_seed(seed)
    value = torch.randn(2, 3, 2, generator=gen)
    output = SimpleNamespace(t=value, pair=(value, value + 1))
    expr, direct = si.root(si.Origin("p")), output
    for op in ops:
        if op in ("item0", "item1"):
            if not isinstance(direct, SimpleNamespace):
                continue
            k = int(op[-1])
            expr, direct = expr.pair[k], direct.pair[k]
        elif op == "attr":
            if isinstance(direct, SimpleNamespace):
                expr, direct = expr.t, direct.t
            else:
                expr, direct = expr.flip(-1), direct.flip(-1)
        elif isinstance(direct, SimpleNamespace):
            continue
        elif op == "neg":
            expr, direct = -expr, -direct
        elif op == "add":
            expr, direct = expr + expr * 0.5, direct + direct * 0.5
        elif op == "mul":
            expr, direct = 3.0 * expr, 3.0 * direct
        elif op == "view":
            expr, direct = (
                expr.reshape(-1, expr.size(-1)),
                direct.reshape(-1, direct.size(-1)),
            )
        elif op == "sum0" and direct.ndim > 1:
            expr, direct = torch.sum(expr, dim=0), torch.sum(direct, dim=0)
    got = replay(expr, output)
    if isinstance(direct, torch.Tensor):
        torch.testing.assert_close(got, direct)
    else:
        assert got is direct
