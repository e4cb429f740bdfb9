import numpy as np
import pytest

from loop_orders.core.ledger import TENSORS, Ledger, declare_tensor, declared_tensors, n_slots, slot

declare_tensor("scratch_test", "float32")  # a schedule's own HBM tensor, as TENSORS declares


def test_slots_are_a_bijection():
    names = declared_tensors()
    assert names[:len(TENSORS)] == TENSORS  # the common tensors keep their slots first
    assert sorted(slot(t, d) for t in names for d in ("read", "write")) == list(range(n_slots()))


def test_from_array_round_trip_and_arithmetic():
    arr = np.arange(n_slots(), dtype=np.int64) * 3
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
    parts = Ledger({"o": {"write": 10}, "scratch_test": {"write": 10}})
    assert parts.bytes(2) == 20 + 40


def test_declared_tensors_are_listed_and_compared_as_zero_when_absent():
    with_part = Ledger({"q": {"read": 3}, "scratch_test": {"read": 0}})
    assert list(with_part.to_dict()) == [*TENSORS, "scratch_test"]
    assert with_part == Ledger({"q": {"read": 3}})
    assert Ledger({"q": {"read": 3}}).read("scratch_test") == 0
    assert Ledger({"q": {"read": 3}}) != Ledger({"q": {"read": 3},
                                                 "scratch_test": {"write": 1}})


def test_declaring_a_tensor_twice_must_agree():
    declare_tensor("scratch_test", "float32")  # again, the same: a no-op
    with pytest.raises(ValueError, match="already declared"):
        declare_tensor("scratch_test", "input")
    with pytest.raises(ValueError, match="element type"):
        declare_tensor("x_test", "float64")


def test_rejects_unknown_tensor_and_bad_array():
    with pytest.raises(ValueError, match="unknown tensor"):
        Ledger({"x": {"read": 1}})
    with pytest.raises(ValueError, match="slots"):
        Ledger.from_array(np.zeros(3))
