"""Arrays in, arrays out: what each framework's arrays look like to the kernels and back.

A call's inputs decide its *kind*, and the outputs come back as the same kind:

    NumPy (host)          copied to the device; outputs copied back as NumPy arrays
    torch, CPU tensors    the same through NumPy (no copy on the host side); torch out
    torch, CUDA tensors   no copy: the kernels read the tensors' memory; outputs are torch
                          tensors allocated on the same device; torch's current stream
    CuPy arrays           no copy; CuPy outputs; CuPy's current stream
    Numba device arrays   no copy; Numba outputs
    any other object with __cuda_array_interface__: no copy; Numba device arrays out (we
                          cannot allocate its type); the stream it names, if any

The kernels see a `DeviceView` (pointer, shape, strides, dtype) of a GPU array, or a Numba
(simulator) device array; `runtime.launch` passes either to a compiled kernel without
converting it to a Numba array, so a call costs microseconds of host time.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import runtime
from .runtime import c_strides

_c_strides = functools.lru_cache(maxsize=256)(c_strides)  # a call's views: the same shapes


class DeviceView:
    """A C-contiguous (or strided) GPU array as the kernels see it: data pointer, shape,
    strides in bytes, NumPy dtype; `owner` keeps the array it views alive."""

    __slots__ = ("ptr", "shape", "strides", "dtype", "owner")

    def __init__(self, ptr: int, shape: tuple, strides: tuple, dtype, owner=None):
        self.ptr, self.shape, self.strides = ptr, tuple(shape), tuple(strides)
        self.dtype, self.owner = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype), owner

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes from the first element to the end of the last (strided views too)."""
        if 0 in self.shape:
            return 0
        return sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True)) \
            + self.dtype.itemsize

    def reshape(self, *shape) -> DeviceView:
        """A view of another shape (a C-contiguous view only)."""
        if len(shape) == 1 and isinstance(shape[0], tuple):
            shape = shape[0]
        size = math.prod(self.shape)
        if -1 in shape:
            shape = tuple(size // math.prod(x for x in shape if x != -1) if x == -1 else x
                          for x in shape)
        if math.prod(shape) != size:
            raise ValueError(f"cannot view {self.shape} as {shape}")
        return DeviceView(self.ptr, shape, c_strides(shape, self.dtype.itemsize), self.dtype,
                          self.owner)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "strides": self.strides, "typestr": self.dtype.str,
                "data": (self.ptr, False), "version": 3}


class Kind:
    """How one framework's arrays go in and come out. Subclasses per framework."""

    name = "array"
    host = False  # inputs live on the host and are copied to the device

    def signature(self, x) -> tuple:
        """What about x selects the compiled kernels and checks (shape, dtype, layout)."""
        return (type(x), tuple(x.shape), str(x.dtype), tuple(getattr(x, "strides", ())))

    def view(self, x):
        """The array as the kernels get it."""
        return x

    def operand(self, x):
        """The device array whose memory the kernels read for input x: x itself for a
        device array, a device copy of a host array. `as_kernel` views it; a call's taped
        launches (`runtime.Tape`) read its address."""
        return self.view(x)

    def as_kernel(self, a, shape):
        """The kernels' view of `a` (an `operand` or an `alloc`ed array) as `shape`."""
        return a.reshape(shape)

    def view_as(self, x, shape):
        """The array as the kernels get it, as `shape` (x is C-contiguous: checked)."""
        return self.as_kernel(self.operand(x), shape)

    def alloc(self, x, shape, dtype):
        """A new device array of `shape` like x, of the caller's kind where it can be
        (`finish` hands it to the caller)."""
        return runtime.device_empty(shape, dtype)

    def empty(self, x, shape, dtype, kernel_shape=None):
        """(array the caller gets, array the kernels write) of `shape`, like x; the kernels'
        one viewed as `kernel_shape` when given."""
        out = self.alloc(x, shape, dtype)
        return out, self.as_kernel(out, shape if kernel_shape is None else kernel_shape)

    def zeros(self, x, shape, dtype):
        """`empty`, filled with zeros (what no kernel writes: keys no query sees)."""
        out = runtime.device_zeros(shape, dtype)
        return out, out

    def finish(self, out):
        """The caller's array once the kernels have written it."""
        return out

    def stream(self, x) -> int:
        """The CUDA stream handle the call's kernels go on (0: the default stream)."""
        return 0


class NumpyKind(Kind):
    name, host = "numpy", True

    def signature(self, x) -> tuple:
        return (type(x), x.shape, x.dtype.str)

    def view(self, x):
        return runtime.to_device(np.ascontiguousarray(x))

    def finish(self, out):
        return runtime.to_host(out)


class TorchHostKind(NumpyKind):
    """CPU tensors: through NumPy, no copy on the host side; torch tensors out."""

    name = "torch-cpu"

    def signature(self, x) -> tuple:
        return (type(x), tuple(x.shape), x.dtype, "cpu")

    def view(self, x):
        return super().view(_torch_host_bits(x.detach()))

    def finish(self, out):
        import torch

        host = torch.from_numpy(runtime.to_host(out))
        return host.view(torch.bfloat16) if host.dtype == torch.uint16 else host


class TorchCudaKind(Kind):
    name = "torch"

    def signature(self, x) -> tuple:
        # the device as its index, the shape as torch's Size (a tuple): host time per call
        return (type(x), x.shape, x.dtype, x.get_device(), x.is_contiguous())

    def view(self, x):
        item = x.element_size()
        return DeviceView(x.data_ptr(), tuple(x.shape), tuple(s * item for s in x.stride()),
                          torch_to_numpy_dtype(x.dtype), x)

    def operand(self, x):
        return x  # its address: x.data_ptr() (`runtime.data_pointer`)

    def as_kernel(self, a, shape):
        dtype = torch_to_numpy_dtype(a.dtype)  # one view, no reshape: host time per call
        return DeviceView(a.data_ptr(), shape, _c_strides(shape, dtype.itemsize), dtype, a)

    def alloc(self, x, shape, dtype):
        return x.new_empty(shape, dtype=numpy_to_torch_dtype(dtype))  # on x's device

    def zeros(self, x, shape, dtype):
        import torch

        out = torch.zeros(shape, dtype=numpy_to_torch_dtype(dtype), device=x.device)
        return out, self.as_kernel(out, shape)

    def stream(self, x) -> int:
        return _current_stream()(x.get_device())


@functools.cache
def _current_stream():
    """device index -> its current stream's raw handle, as Triton's launcher asks for it: the
    public torch.cuda.current_stream() builds a Stream object first (microseconds a call),
    and so would an import and a lookup in `stream` on every call."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream


class _ViewedKind(Kind):
    """A framework whose arrays the kernels read as they are, through a DeviceView."""

    def operand(self, x):
        return x

    def as_kernel(self, a, shape):
        return self.view(a).reshape(shape)


class CupyKind(_ViewedKind):
    name = "cupy"

    def view(self, x):
        return DeviceView(x.data.ptr, x.shape, x.strides, x.dtype, x)

    def alloc(self, x, shape, dtype):
        import cupy

        with x.device:
            return cupy.empty(shape, dtype=dtype)

    def zeros(self, x, shape, dtype):
        import cupy

        with x.device:
            out = cupy.zeros(shape, dtype=dtype)
        return out, self.view(out)

    def stream(self, x) -> int:
        import cupy

        return cupy.cuda.get_current_stream().ptr


class NumbaKind(Kind):
    name = "numba"


class InterfaceKind(_ViewedKind):
    """Any object with __cuda_array_interface__: viewed without a copy; Numba out."""

    name = "cuda-array-interface"

    def signature(self, x) -> tuple:
        iface = x.__cuda_array_interface__
        return (type(x), tuple(iface["shape"]), iface["typestr"],
                tuple(iface.get("strides") or ()))

    def view(self, x):
        iface = x.__cuda_array_interface__
        dtype = np.dtype(iface["typestr"])
        strides = iface.get("strides") or c_strides(iface["shape"], dtype.itemsize)
        return DeviceView(iface["data"][0], iface["shape"], strides, dtype, x)

    def stream(self, x) -> int:
        return int(x.__cuda_array_interface__.get("stream") or 0)


KINDS = {"numpy": NumpyKind(), "torch-cpu": TorchHostKind(), "torch": TorchCudaKind(),
         "cupy": CupyKind(), "numba": NumbaKind(), "cuda-array-interface": InterfaceKind()}


def kind_of(x) -> Kind:
    """The Kind of x (TypeError for something that is not an array)."""
    if isinstance(x, np.ndarray):
        return KINDS["numpy"]
    module = type(x).__module__
    if module.startswith("torch"):
        return KINDS["torch"] if x.is_cuda else KINDS["torch-cpu"]
    if module.startswith("cupy"):
        return KINDS["cupy"]
    if hasattr(x, "copy_to_host"):
        return KINDS["numba"]
    if hasattr(x, "__cuda_array_interface__"):
        return KINDS["cuda-array-interface"]
    raise TypeError(f"expected an array (NumPy, torch, CuPy, Numba device array or any "
                    f"__cuda_array_interface__ object), got {type(x).__name__}")


def signature(x) -> tuple:
    """`kind_of(x).signature(x)` (a call's key: `api.call_key`), its kind's reader found once
    per array type: host time per call."""
    read = _SIGNATURE_OF.get(type(x))
    if read is None:
        read = _SIGNATURE_OF[type(x)] = _signature_reader(x)
    return read(x)


_SIGNATURE_OF: dict = {}  # array type -> how to read a signature off it


def _signature_reader(x):
    if type(x).__module__.startswith("torch"):  # CUDA or not: each tensor says
        cuda, host = KINDS["torch"].signature, KINDS["torch-cpu"].signature
        return lambda t: cuda(t) if t.is_cuda else host(t)
    if isinstance(x, np.ndarray) or type(x).__module__.startswith("cupy"):
        return kind_of(x).signature  # one kind for the type
    return lambda a: kind_of(a).signature(a)


def resident(a):
    """A Numba device array a call keeps (its scratch) as a DeviceView on a GPU, whose
    address is an attribute (`runtime.data_pointer`); itself under the simulator."""
    if runtime.SIMULATOR:
        return a
    return DeviceView(runtime.data_pointer(a), a.shape, a.strides, a.dtype, a)


def sequence_rows(x, start: int, n: int):
    """Rows start .. start + n - 1 of a packed (total, heads, width) device array (as `Kind.view`
    gives it) as the kernels' (heads, n, width), without a copy: a strided view, a row's next
    row heads x width elements on (one sequence of a varlen batch)."""
    if runtime.SIMULATOR:
        return x[start:start + n].transpose((1, 0, 2))
    total, heads, width = x.shape
    s0, s1, s2 = x.strides
    return DeviceView(runtime.data_pointer(x) + start * s0, (heads, n, width), (s1, s0, s2),
                      x.dtype, x)


def sequence_columns(x, start: int, n: int):
    """Columns start .. start + n - 1 of a (heads, total) device array (a varlen lse), as a
    (heads, n) view without a copy."""
    if runtime.SIMULATOR:
        return x[:, start:start + n]
    s0, s1 = x.strides
    return DeviceView(runtime.data_pointer(x) + start * s1, (x.shape[0], n), (s0, s1),
                      x.dtype, x)


def shape_of(x) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None and hasattr(x, "__cuda_array_interface__"):
        shape = x.__cuda_array_interface__["shape"]
    return tuple(int(s) for s in shape)


def dtype_name(x) -> str:
    """'float32', 'float16', 'bfloat16', ... for any supported framework's dtype."""
    dtype = getattr(x, "dtype", None)
    if dtype is None and hasattr(x, "__cuda_array_interface__"):
        dtype = x.__cuda_array_interface__["typestr"]
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype).replace("torch.", "")


def is_c_contiguous(x) -> bool:
    kind = kind_of(x)
    if kind.host:
        return True  # copied to the device contiguously
    if kind.name == "torch":
        return x.is_contiguous()
    if hasattr(x, "is_c_contiguous"):
        return bool(x.is_c_contiguous())
    if kind.name == "cupy":
        return bool(x.flags.c_contiguous)
    iface = x.__cuda_array_interface__
    if iface.get("strides") is None:
        return True
    return c_strides(iface["shape"], np.dtype(iface["typestr"]).itemsize) == tuple(
        iface["strides"])


def bfloat16_bits(x) -> np.ndarray:
    """float32 values -> the nearest bfloat16 (ties to even) as uint16 bits: how host code
    (benchmarks, the PTX check) makes bfloat16 inputs without torch."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def host_values(x) -> np.ndarray:
    """A host array as the numbers it holds: uint16 arrays carry bfloat16 (widened to float32)."""
    x = np.asarray(x)
    if x.dtype == np.uint16:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x


BFLOAT16_FRAMEWORKS = ("torch",)  # the kinds whose arrays can hold bfloat16 (NumPy cannot)


@functools.cache
def _torch_dtypes() -> dict:
    """torch dtype -> the NumPy dtype the kernels see (bfloat16: its bits as uint16)."""
    import torch

    return {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16),
            torch.bfloat16: np.dtype(np.uint16)}


def _torch_host_bits(x):
    """A CPU tensor as a NumPy array without a copy (bfloat16 as its uint16 bits)."""
    import torch

    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16)
    return x.numpy()


def torch_to_numpy_dtype(dtype):
    """The NumPy dtype a kernel sees for a torch tensor: the inputs' types, and the integers
    of the counters the kinds allocate (`_numpy_to_torch`)."""
    return _torch_to_numpy()[dtype]


@functools.cache
def _torch_to_numpy() -> dict:
    return {v: k for k, v in _numpy_to_torch().items()}


@functools.cache
def _numpy_to_torch() -> dict:
    """NumPy dtype -> torch dtype of what the kernels allocate: the inputs' types and the
    counters' and workspaces' integers."""
    import torch

    return {**{v: k for k, v in _torch_dtypes().items()},
            np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


def numpy_to_torch_dtype(dtype):
    return _numpy_to_torch()[np.dtype(dtype)]
