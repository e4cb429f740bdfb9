"""Tensor maps for Hopper's TMA copies (`intrinsics.tma_load`): the driver's description of a
16-bit tensor in HBM and of the box one copy takes from it, encoded on the host
(cuTensorMapEncodeTiled, cuda-bindings' driver module) and read by the copies from global
memory.

    words = encode(src, rows, width)      # 16 uint64: src (heads, n, cols) in boxes of
                                          # rows x width, swizzled rows of width elements
    maps = device_maps([words, ...])      # one uint64 device array, 16 words a map
    maps = maps_for([(src, (rows, width)), ...])   # the same, kept for the latest arrays

A box is `rows` rows of one column block of `width` elements (64, 32, 16: the 128-, 64-, 32-byte
swizzles, `intrinsics.SWIZZLE_MODES`), and a copy lands it swizzled as the wgmma operands are
laid out (`hopper.k_major`, `mn_major`). Past src's rows (a tail tile) the copy writes zeros.
On the simulator the emulated copy reads src itself and a map's words are zeros.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from .arrays import DeviceView
from .runtime import SIMULATOR, data_pointer, derived, is_recording, to_device

WORDS = 16  # a CUtensorMap: 128 bytes, 64-byte aligned
# a swizzled row's elements -> the driver's swizzle (its numbering is not wgmma's descriptor's,
# `intrinsics.SWIZZLE_MODES`)
TMA_SWIZZLES = {64: "CU_TENSOR_MAP_SWIZZLE_128B", 32: "CU_TENSOR_MAP_SWIZZLE_64B",
                16: "CU_TENSOR_MAP_SWIZZLE_32B"}


class Tensor(NamedTuple):
    """What a tensor map says of an array: its address, shape (heads, n, cols) and row and
    head strides in bytes."""

    address: int
    shape: tuple
    strides: tuple

    @classmethod
    def of(cls, src) -> Tensor:
        strides = src.stride() if callable(getattr(src, "stride", None)) else None
        if strides is not None:  # torch: in elements
            item = src.element_size()
            return cls(data_pointer(src), tuple(src.shape), (strides[1] * item,
                                                             strides[0] * item))
        return cls(data_pointer(src), tuple(src.shape), (src.strides[1], src.strides[0]))


def encode(src, rows: int, width: int) -> np.ndarray:
    """The tensor map of src, a (heads, n, cols) array of 16-bit elements whose rows are
    16-byte aligned (or its `Tensor`), for boxes of `rows` rows x `width` columns (one
    column block)."""
    if SIMULATOR:
        return np.zeros(WORDS, np.uint64)
    from cuda.bindings import driver

    t = src if isinstance(src, Tensor) else Tensor.of(src)
    heads, n, cols = t.shape
    row_bytes, head_bytes = (int(x) for x in t.strides)
    if row_bytes % 16 or head_bytes % 16 or t.address % 16:
        raise ValueError(f"TMA needs 16-byte aligned rows: strides {row_bytes}, {head_bytes} "
                         f"bytes, address {t.address:#x}")
    swizzle = getattr(driver.CUtensorMapSwizzle, TMA_SWIZZLES[width])
    wide, narrow = driver.cuuint64_t, driver.cuuint32_t
    err, tensor_map = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16,  # bits, as copied
        3, t.address, [wide(x) for x in (cols, n, heads)],
        [wide(row_bytes), wide(head_bytes)], [narrow(x) for x in (width, rows, 1)],
        [narrow(1)] * 3, driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled of a {t.shape} tensor in boxes of {rows} "
                           f"x {width}: {err!r}")
    return np.array([int(w) for w in tensor_map.opaque], np.uint64)


def device_maps(maps) -> object:
    """The maps in one device array, 16 words each, map m at word 16 m."""
    return to_device(np.concatenate(list(maps)) if maps else np.zeros(WORDS, np.uint64))


_MAPS: OrderedDict = OrderedDict()  # ((Tensor, box), ...) -> their maps on the device
# the latest maps stay on the device (launches in flight may still read them; a stream keeps
# far fewer in flight than this)
_KEPT = 64


def _maps_at(key: tuple) -> object:
    """The device maps of ((Tensor, box), ...), encoded and copied once, kept for the
    latest _KEPT keys."""
    maps = _MAPS.get(key)
    if maps is None:
        maps = _MAPS[key] = device_maps([encode(t, *box) for t, box in key])
        if len(_MAPS) > _KEPT:
            _MAPS.popitem(last=False)
    else:
        _MAPS.move_to_end(key)
    return maps


def maps_for(arrays_and_boxes) -> object:
    """The device maps of (array, (rows, width)) pairs, in order (map m of the m-th pair);
    a call on the same tensors launches with the maps it had, and a taped call's replay
    (`runtime.derived`) with those of its own arrays."""
    pairs = list(arrays_and_boxes)
    if is_recording():  # launches recorded to be compiled: the maps' type is what counts
        return DeviceView(0, (WORDS * len(pairs),), (8,), np.uint64)
    if SIMULATOR:
        return device_maps([encode(a, *box) for a, box in pairs])
    key = tuple((Tensor.of(a), box) for a, box in pairs)

    def at(addresses):
        return _maps_at(tuple((t._replace(address=address), box)
                              for (t, box), address in zip(key, addresses, strict=True)))

    return derived(_maps_at(key), at, [a for a, _ in pairs])
