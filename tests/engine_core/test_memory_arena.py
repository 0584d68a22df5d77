"""Sleep mode's memory arenas: views keep working across release and restore; on CUDA they
keep their addresses, the memory really goes back to the device, and a CUDA graph captured
on the arena replays correctly after a restore."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_core.worker.memory_arena import MemoryArena


def test_views_follow_the_arena_through_release_and_restore() -> None:
    shapes = [(torch.Size((3, 5)), torch.float32), (torch.Size((7,)), torch.bfloat16)]
    arena = MemoryArena(MemoryArena.size_of(shapes), "cpu")
    a, b = (arena.take(shape, dtype) for shape, dtype in shapes)
    assert b.data_ptr() - a.data_ptr() == 256  # 60 bytes, then the next 256-byte boundary
    with pytest.raises(ValueError, match="no room"):
        arena.take((1,), torch.float32)
    a.fill_(2.0)
    arena.release()
    assert a.untyped_storage().nbytes() == 0 and not arena.mapped
    arena.release()  # again: nothing to do
    arena.restore()
    assert a.untyped_storage().nbytes() == arena.nbytes
    a.fill_(3.0)
    b.fill_(1.5)
    assert a.sum().item() == 45.0 and b.float().sum().item() == 10.5


@pytest.mark.gpu
def test_cuda_arena_keeps_addresses_and_graphs_across_sleep() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    nbytes = 256 << 20
    arena = MemoryArena(nbytes, "cuda")
    x = arena.take((nbytes // 8,), torch.float32)
    y = arena.take((nbytes // 8,), torch.float32)
    x.fill_(1.0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.mul(x, 2.0, out=y)  # warm-up outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        torch.mul(x, 2.0, out=y)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.all(y == 2.0)
    addresses = (x.data_ptr(), y.data_ptr())
    free_awake = torch.cuda.mem_get_info()[0]
    arena.release()
    assert torch.cuda.mem_get_info()[0] - free_awake >= nbytes
    arena.restore()
    assert torch.cuda.mem_get_info()[0] <= free_awake + (2 << 20)
    assert (x.data_ptr(), y.data_ptr()) == addresses
    x.fill_(5.0)
    graph.replay()  # the graph recorded the arena's addresses: it reads the new contents
    torch.cuda.synchronize()
    assert torch.all(y == 10.0)


@pytest.mark.gpu
def test_cuda_arena_as_the_first_cuda_use_of_a_process() -> None:
    """A sleep-mode engine's weights arena can be its process's first CUDA allocation (no
    context bound to the thread yet): a fresh interpreter makes one, releases and restores
    it, and reads back what it wrote."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    code = ("import torch\n"
            "from engine_core.worker.memory_arena import MemoryArena\n"
            "arena = MemoryArena(3 << 20, 'cuda')\n"
            "x = arena.take((1000,), torch.float32)\n"
            "arena.release(); arena.restore()\n"
            "x.fill_(7.0)\n"
            "assert x.sum().item() == 7000.0\n"
            "print('ok', arena.nbytes)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok ")
