"""saria.control.makers: a maker builds exactly what the frozen dataclass's constructor builds."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from saria.control.makers import frozen_maker
from saria.orders import (DRAM, GPU, SSD, DropOrder, ObjectKey, PromoteOrder, ReloadPlan, StoreOrder, WriteOrder)

PLAN = (7, (b"a" * 32, b"b" * 32), (DRAM, SSD), None, None, 1024, 100, 50, False)
CASES = [
    (ReloadPlan, PLAN),
    (StoreOrder, (3, (1, 2), (), 200)),
    (DropOrder, (4, (1,), (2,), 300, SSD)),
    (WriteOrder, (5, (1,), (), 100, GPU, "reuse")),
    (PromoteOrder, (6, (1, 2, 3), (), 300, GPU)),
    (PromoteOrder, (6, (1, 2, 3), (), 300, SSD)),
    (ReloadPlan, PLAN[:1] + ((),) + PLAN[2:]),  # an empty plan
]


@pytest.mark.parametrize("cls, args", CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_a_maker_builds_what_the_constructor_builds(cls, args):
    check_maker(cls, args)


def check_maker(cls, args):
    """``frozen_maker(cls)(*args)`` is ``cls(*args)`` in every way a caller can tell (also used by
    tests/test_vllm_connector_parts.py for the scheduler's metadata, slots-less dataclasses)."""
    made, built = frozen_maker(cls)(*args), cls(*args)
    assert type(made) is cls
    assert made == built and repr(made) == repr(built)
    assert [getattr(made, f.name) for f in dataclasses.fields(cls)] == list(args)
    assert pickle.loads(pickle.dumps(made)) == built
    assert dataclasses.replace(made) == built and dataclasses.asdict(made) == dataclasses.asdict(built)
    if cls.__hash__ is not None and not any(isinstance(a, dict) for a in args):
        assert hash(made) == hash(built)
    field = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, field, None)
    with pytest.raises(TypeError):  # every field, positionally
        frozen_maker(cls)(*args[:-1])


def test_a_maker_is_refused_where_it_would_skip_something():
    with pytest.raises(TypeError, match="__post_init__"):
        frozen_maker(ObjectKey)  # it checks its kind there

    @dataclasses.dataclass
    class Mutable:
        x: int

    with pytest.raises(TypeError, match="frozen"):
        frozen_maker(Mutable)

    @dataclasses.dataclass(frozen=True)
    class WithInitVar:
        x: int
        y: dataclasses.InitVar[int] = 0

    with pytest.raises(TypeError, match="init-only"):
        frozen_maker(WithInitVar)
