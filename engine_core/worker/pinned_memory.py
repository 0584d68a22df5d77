"""Large page-locked host buffers of exactly the size asked, mapped for the GPU.

Why not ``torch.empty(..., pin_memory=True)``: PyTorch's pinned allocator rounds every
allocation up to the next power of two, so 17 GiB of weights or 20 GiB of KV offload would
lock 32 GiB of host memory. Here the pages are faulted in by torch's threads (``zero_``) and
then registered with the driver (``cudaHostRegister``, portable and mapped): the GPU copies at
bus speed and kernels may address the buffer directly (its device address is its host
address under unified addressing). The registration ends when the buffer is garbage
collected.
"""

from __future__ import annotations

import math
import weakref

import torch

_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02


def _unregister(pointer: int, keep_alive: torch.Tensor) -> None:
    del keep_alive  # held until here: the pages outlive their registration
    torch.cuda.cudart().cudaHostUnregister(pointer)


class HostBuffer:
    """``nbytes`` of zeroed host memory (``tensor``, uint8), page-locked and mapped when
    ``pinned``. Views of ``tensor`` must not outlive this object: its collection ends the
    registration (an owner keeps it for as long as it hands out views)."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8)
        self.pinned = pinned and nbytes > 0
        if self.pinned:
            pointer = self.tensor.data_ptr()
            status = int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes,
                                                              _HOST_REGISTER_PORTABLE_MAPPED))
            if status != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed "
                                   f"(cudaError {status}): not enough host memory to lock?")
            weakref.finalize(self, _unregister, pointer, self.tensor)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def view(self, offset: int, shape: tuple[int, ...] | torch.Size,
             dtype: torch.dtype) -> torch.Tensor:
        """A ``dtype`` tensor of ``shape`` at byte ``offset`` (aligned to the element size)."""
        nbytes = math.prod(shape) * dtype.itemsize
        return self.tensor[offset:offset + nbytes].view(dtype).view(shape)
