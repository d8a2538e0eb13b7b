"""Tables.ids_batch / vouch: a step's block ids checked in one batch vouch for exactly what
Tables.ids accepts one by one (same values, same bound), and for nothing it refuses."""

import torch
from hypothesis import given, settings, strategies as st

from saria.kernels import PageTable
from saria.orders import KV
from saria.dataplane.transfer.tables import Tables

PAGES, NUM_PAGES = 4, 12
cpu = torch.device("cpu")
TABLES = Tables(PageTable([torch.zeros(NUM_PAGES, 2, 8), torch.zeros(NUM_PAGES, 3, 4)]), None, PAGES, 0)

ids_value = st.one_of(
    st.integers(min_value=0, max_value=NUM_PAGES - 1),  # mostly good ids
    st.integers(min_value=0, max_value=NUM_PAGES - 1),
    st.integers(min_value=-3, max_value=NUM_PAGES + 3),
    st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False, min_value=-2.0, max_value=NUM_PAGES + 1.0),
    st.just("3"), st.none(), st.lists(st.integers(0, 3), min_size=1, max_size=2),
)


entry = st.one_of(
    st.lists(st.integers(0, NUM_PAGES - 1), min_size=PAGES, max_size=PAGES).map(tuple),  # the usual case
    st.lists(st.integers(0, NUM_PAGES - 1), min_size=PAGES, max_size=PAGES),
    st.lists(ids_value, min_size=PAGES, max_size=PAGES),
    st.lists(ids_value, min_size=PAGES - 1, max_size=PAGES + 1).map(tuple),
    st.lists(st.integers(0, NUM_PAGES - 1), min_size=PAGES, max_size=PAGES).map(
        lambda v: torch.tensor(v, dtype=torch.int32)),
    st.none(),
)


def one(blocks):
    try:
        return TABLES.ids(KV, "the object", blocks)
    except Exception as exc:
        return exc


@settings(max_examples=300, deadline=None)
@given(st.lists(entry, min_size=0, max_size=6))
def test_batch_vouches_for_exactly_what_ids_accepts(entries):
    batch = TABLES.ids_batch(KV, entries)
    assert len(batch) == len(entries)
    singles = [one(b) for b in entries]
    for got, single in zip(batch, singles):
        if got is None:
            continue
        assert not isinstance(single, Exception), f"the batch vouched for ids that ids() refuses: {single}"
        assert got.end == single.end and got.unique == single.unique is False
        assert torch.equal(got.on(cpu), single.on(cpu))
        assert got.on(cpu).dtype == torch.int64 and got.shape == single.shape
    # where every entry is a good list or tuple, the batch vouches for all of them (the fast path)
    if entries and all(isinstance(b, (list, tuple)) and all(type(x) is int for x in b) for b in entries) and \
            not any(isinstance(s, Exception) for s in singles):
        assert all(b is not None for b in batch)
    vouched = TABLES.vouch(KV, entries)  # the check alone (the hooks' fast path): the same rows
    assert (vouched.rows if vouched is not None else []) == [i for i, got in enumerate(batch) if got is not None]
    if vouched is not None:
        assert [ids.end for ids in vouched.make()] == [batch[i].end for i in vouched.rows]


def test_a_bad_list_anywhere_leaves_every_entry_to_ids():
    good = (0, 1, 2, 3)
    assert all(b is not None for b in TABLES.ids_batch(KV, [good, list(good)]))
    assert TABLES.ids_batch(KV, [good, (0, 1, 2, True)]) == [None, None]  # not all ints: ids() converts them
    for bad in ((0, 1, 2, NUM_PAGES), (0, -1, 2, 3), (0, 1, 2, "x"), (0, 1, 2, [3]), (0, 1, 2, 2 ** 64)):
        assert TABLES.ids_batch(KV, [good, bad, good]) == [None, None, None]
    short = TABLES.ids_batch(KV, [good, (0, 1, 2), torch.tensor(good)])  # only the lists of the right length
    assert short[0] is not None and short[1:] == [None, None]
    assert TABLES.vouch(KV, [good, (0, 1, 2, True)]) is None and TABLES.vouch(KV, []) is None


def test_batch_makes_its_tensor_on_first_read_from_what_was_checked():
    """No torch op on the checking (hook) thread: the batch's one tensor is made by the first
    reader, from the values as they were checked (a list changed afterwards changes nothing), and
    every row of the batch shares it; slices and stacks of such ids work as of any BlockIds."""
    import threading

    a, b = [0, 1, 2, 3], [7, 6, 5, 11]
    first, second = TABLES.ids_batch(KV, [a, b])
    assert first._h is None and second._h is None and (first.end, second.end) == (4, 12)
    a[0] = 99  # the caller's list changes after the check: the ids are what was checked
    seen = []
    reader = threading.Thread(target=lambda: seen.append(second.on(cpu)))  # a path thread reads it first
    reader.start()
    reader.join()
    assert torch.equal(seen[0], torch.tensor([7, 6, 5, 11]))
    assert torch.equal(first.on(cpu), torch.tensor([0, 1, 2, 3]))
    assert first._host.untyped_storage().data_ptr() == second._host.untyped_storage().data_ptr()  # one tensor
    assert torch.equal(first[1:].on(cpu), torch.tensor([1, 2, 3])) and first[1:].end == 4
    stacked = type(first).stack([first, second])
    assert stacked.shape == (2, PAGES) and stacked.end == 12
    assert torch.equal(TABLES.ids(KV, "x", [0, 1, 2, 3]).on(cpu), first.on(cpu))
