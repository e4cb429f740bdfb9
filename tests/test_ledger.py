import numpy as np
import pytest

from loop_orders.ledger import N_SLOTS, TENSORS, Ledger, slot


def test_slots_are_a_bijection():
    assert sorted(slot(t, d) for t in TENSORS for d in ("read", "write")) == list(range(N_SLOTS))


def test_from_array_round_trip_and_arithmetic():
    arr = np.arange(N_SLOTS, dtype=np.int64) * 3
    ledger = Ledger.from_array(arr)
    assert ledger.read("k") == arr[slot("k", "read")]
    assert ledger.total == int(arr.sum())
    assert (ledger + ledger) - ledger == ledger
    assert ledger.scaled(2) == ledger + ledger
    assert Ledger.from_dict(ledger.to_dict()) == ledger


def test_bytes_use_each_tensors_element_size():
    ledger = Ledger({"q": {"read": 10}, "s": {"write": 10}, "lse": {"write": 1}})
    assert ledger.bytes(4) == 40 + 40 + 4
    assert ledger.bytes(2) == 20 + 40 + 4


def test_rejects_unknown_tensor_and_bad_array():
    with pytest.raises(ValueError, match="unknown tensor"):
        Ledger({"x": {"read": 1}})
    with pytest.raises(ValueError, match="slots"):
        Ledger.from_array(np.zeros(3))
