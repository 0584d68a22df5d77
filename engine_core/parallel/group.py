"""The tensor-parallel group: this rank's place in it and the collectives the model needs.

torch.distributed with gloo on CPU and NCCL on CUDA. A group of one rank makes every
collective a no-op, so the model code is the same at every size.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from engine_core.config import ParallelConfig
from engine_core.errors import ConfigError
from engine_core.parallel.peer_all_reduce import PeerAllReduce

# A peer that never arrives (or died) fails the collective after this long, not never.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


def free_init_method(host: str = "127.0.0.1") -> str:
    """A rendezvous address on a port free now (rank 0 binds it at once after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return f"tcp://{host}:{probe.getsockname()[1]}"


def rank_device(device: str, config: ParallelConfig) -> str:
    """The device of this rank: rank r of a CUDA group takes ``cuda:r`` (the launcher
    narrows CUDA_VISIBLE_DEVICES to the group's GPUs); CPU ranks share the CPU."""
    if not config.is_parallel or not device.startswith("cuda"):
        return device
    torch.cuda.set_device(config.rank)
    return f"cuda:{config.rank}"


class TensorParallelGroup:
    """``size`` ranks sharing one model; collectives over the default process group, the
    small all-reduces of a CUDA group through peer memory (``peer_all_reduce.py``)."""

    def __init__(self, rank: int = 0, size: int = 1,
                 peer_all_reduce: PeerAllReduce | None = None) -> None:
        self.rank = rank
        self.size = size
        self._peer_all_reduce = peer_all_reduce

    @classmethod
    def start(cls, config: ParallelConfig, device: torch.device) -> TensorParallelGroup:
        """Join the group described by ``config`` (blocks until every rank has joined)."""
        if not config.is_parallel:
            return cls()
        if config.distributed_init_method is None:
            raise ValueError("a tensor-parallel rank needs distributed_init_method")
        if dist.is_initialized():
            raise ConfigError("this process already belongs to a tensor-parallel group: a CUDA "
                              "engine with --tensor-parallel-size > 1 is one per process")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cpu":
            # Ranks share the host's cores: each one's intra-op threads take at most its
            # share, or the ranks' spinning thread pools starve each other's collectives.
            share = max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)
            torch.set_num_threads(min(torch.get_num_threads(), share))
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=config.distributed_init_method,
                                rank=config.rank, world_size=config.tensor_parallel_size,
                                timeout=COLLECTIVE_TIMEOUT, **kwargs)
        peer = (PeerAllReduce.create(device)
                if device.type == "cuda" and not config.disable_custom_all_reduce else None)
        return cls(config.rank, config.tensor_parallel_size, peer)

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    @property
    def uses_peer_memory(self) -> bool:
        """Whether small all-reduces go one-shot over peer memory (else all via NCCL)."""
        return self._peer_all_reduce is not None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if self.size == 1:
            return tensor
        if self._peer_all_reduce is not None and self._peer_all_reduce.accepts(tensor):
            return self._peer_all_reduce(tensor)
        dist.all_reduce(tensor)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along the last dimension, in rank order."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``src``'s ``tensor`` on every rank (written into ``tensor``), returned."""
        if self.size > 1:
            dist.broadcast(tensor, src)
        return tensor

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's ``value`` (ranks agree on a size, e.g. KV blocks)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def close(self) -> None:
        """Leave the process group (so a later engine in this process can form another).

        Only gloo's group is torn down here: its destroy is local. NCCL's destroy and abort
        wait on the communicator's peers and their kernels, so a rank stopping before the
        others would hang in them; an NCCL group ends with its process (a CUDA engine with
        N > 1 is one per process, which ``start`` enforces).
        """
        if self.size > 1 and dist.is_initialized() and dist.get_backend() != "nccl":
            dist.destroy_process_group()
