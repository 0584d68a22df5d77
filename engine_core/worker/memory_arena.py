"""Sleep mode's memory: one range per kind (weights, KV cache) whose backing can be given
back and taken again while every tensor into it keeps its address.

Why: CUDA graphs hold raw addresses of the weights and the KV cache. If sleeping freed them
through PyTorch's allocator, waking would place them elsewhere and every graph would have to
be captured again (seconds for an 8B model). On CUDA an arena is a reserved virtual address
range (the driver's virtual memory API, ``cuMemAddressReserve``); sleeping unmaps and releases
its physical memory, waking creates and maps new physical memory at the same addresses, so
the graphs stay valid. On CPU (no graphs) the arena is one storage resized to nothing and
back; views follow their storage, so the parameters stay the same objects either way.

Contents do not survive ``release``: the caller copies what it must keep (sleep level 1's
weights) before, and refills after ``restore``.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import threading
import weakref
from collections.abc import Iterator

import torch

_ALIGN = 256  # bytes: every view starts aligned for any dtype and vector width


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_ALLOCATION_TYPE_PINNED = 1
_LOCATION_TYPE_DEVICE = 1
_ACCESS_READ_WRITE = 3
_GRANULARITY_MINIMUM = 0


class _Driver:
    """The few CUDA driver calls the arena needs, through ctypes (loaded once per process)."""

    _lock = threading.Lock()
    _lib: ctypes.CDLL | None = None

    @classmethod
    def lib(cls) -> ctypes.CDLL:
        with cls._lock:
            if cls._lib is None:
                cls._lib = ctypes.CDLL("libcuda.so.1")
            return cls._lib

    @classmethod
    def check(cls, status: int, what: str) -> None:
        if status != 0:
            name = ctypes.c_char_p()
            cls.lib().cuGetErrorName(status, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()} ({status})")


class _CudaRange:
    """A reserved device address range and the physical memory mapped at it (or not)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device_index = torch.device(device).index or 0
        self.lib = _Driver.lib()
        self.prop = _AllocationProp()
        self.prop.type = _ALLOCATION_TYPE_PINNED
        self.prop.location = _Location(_LOCATION_TYPE_DEVICE, self.device_index)
        granularity = ctypes.c_size_t()
        self.address = ctypes.c_uint64()
        # Every driver call in the context: before the runtime's first call the driver is not
        # even initialised (cuMemGetAllocationGranularity: CUDA_ERROR_NOT_INITIALIZED).
        with self._current():
            _Driver.check(self.lib.cuMemGetAllocationGranularity(
                ctypes.byref(granularity), ctypes.byref(self.prop), _GRANULARITY_MINIMUM),
                "cuMemGetAllocationGranularity")
            self.nbytes = -(-max(nbytes, 1) // granularity.value) * granularity.value
            _Driver.check(self.lib.cuMemAddressReserve(ctypes.byref(self.address),
                                                       ctypes.c_size_t(self.nbytes),
                                                       ctypes.c_size_t(0), ctypes.c_uint64(0),
                                                       ctypes.c_ulonglong(0)),
                          "cuMemAddressReserve")
        self.handle: ctypes.c_uint64 | None = None
        self.map()

    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        """The device's primary context current on this thread for driver calls (a runtime
        call that needs a context creates and binds it; the arena may be the process's
        first CUDA allocation)."""
        with torch.cuda.device(self.device_index):
            torch.cuda.synchronize()
            yield

    def map(self) -> None:
        with self._current():
            self._map()

    def _map(self) -> None:
        handle = ctypes.c_uint64()
        _Driver.check(self.lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.nbytes),
                                           ctypes.byref(self.prop), ctypes.c_ulonglong(0)),
                      f"cuMemCreate of {self.nbytes / 2**30:.2f} GiB")
        _Driver.check(self.lib.cuMemMap(self.address, ctypes.c_size_t(self.nbytes),
                                        ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)),
                      "cuMemMap")
        access = _AccessDesc(_Location(_LOCATION_TYPE_DEVICE, self.device_index),
                             _ACCESS_READ_WRITE)
        _Driver.check(self.lib.cuMemSetAccess(self.address, ctypes.c_size_t(self.nbytes),
                                              ctypes.byref(access), ctypes.c_size_t(1)),
                      "cuMemSetAccess")
        self.handle = handle

    def unmap(self) -> None:
        if self.handle is None:
            return
        with self._current():
            self._unmap()

    def _unmap(self) -> None:
        _Driver.check(self.lib.cuMemUnmap(self.address, ctypes.c_size_t(self.nbytes)),
                      "cuMemUnmap")
        _Driver.check(self.lib.cuMemRelease(self.handle), "cuMemRelease")
        self.handle = None

    def tensor(self) -> torch.Tensor:
        """The whole range as uint8. The tensor's storage owns the range: it is unmapped and
        its addresses freed when the last view of it is gone, never before."""
        owner = _RangeOwner(self)
        return torch.as_tensor(owner, device=torch.device("cuda", self.device_index))

    def free(self) -> None:
        """Unmap and free the addresses; errors ignored (this may run at interpreter exit,
        after the context is gone, when the process's memory goes anyway)."""
        if self.handle is not None:
            self.lib.cuMemUnmap(self.address, ctypes.c_size_t(self.nbytes))
            self.lib.cuMemRelease(self.handle)
            self.handle = None
        self.lib.cuMemAddressFree(self.address, ctypes.c_size_t(self.nbytes))


class _RangeOwner:
    """What ``torch.as_tensor`` needs to view memory it did not allocate; the storage keeps
    this object alive, and its collection frees the range."""

    def __init__(self, cuda_range: _CudaRange) -> None:
        self.__cuda_array_interface__ = {"shape": (cuda_range.nbytes,), "typestr": "|u1",
                                         "data": (cuda_range.address.value, False),
                                         "strides": None, "version": 2}
        weakref.finalize(self, cuda_range.free)


class MemoryArena:
    """``nbytes`` (rounded up) of memory on ``device`` handed out as views, whose backing
    ``release`` gives back and ``restore`` takes again at the same addresses (CUDA)."""

    def __init__(self, nbytes: int, device: torch.device | str) -> None:
        device = torch.device(device)
        self.device = device
        self._range: _CudaRange | None = None
        if device.type == "cuda":
            self._range = _CudaRange(nbytes, device)
            self.nbytes = self._range.nbytes
            self.tensor = self._range.tensor()
        else:
            self.nbytes = max(nbytes, 1)
            self.tensor = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.mapped = True
        self._next = 0

    def take(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The next free ``shape`` of ``dtype`` (contiguous, 256-byte aligned)."""
        nbytes = math.prod(shape) * dtype.itemsize
        start = self._next
        if start + nbytes > self.nbytes:
            raise ValueError(f"arena of {self.nbytes} bytes has no room for {nbytes} more")
        self._next = start + -(-nbytes // _ALIGN) * _ALIGN
        return self.tensor[start:start + nbytes].view(dtype).view(shape)

    @staticmethod
    def size_of(shapes: list[tuple[torch.Size, torch.dtype]]) -> int:
        """Bytes an arena needs to ``take`` every one of ``shapes`` in turn."""
        return sum(-(-s.numel() * d.itemsize // _ALIGN) * _ALIGN for s, d in shapes)

    def release(self) -> None:
        """Give the backing memory back; views stay valid objects but must not be touched."""
        if not self.mapped:
            return
        if self._range is not None:
            torch.cuda.synchronize(self.device)  # nothing queued may still use it
            self._range.unmap()
        else:
            self.tensor.untyped_storage().resize_(0)
        self.mapped = False

    def restore(self) -> None:
        """Fresh backing memory at the same addresses (CUDA; CPU views follow their storage).
        Its contents are undefined until the caller fills them."""
        if self.mapped:
            return
        if self._range is not None:
            self._range.map()
        else:
            self.tensor.untyped_storage().resize_(self.nbytes)
        self.mapped = True
