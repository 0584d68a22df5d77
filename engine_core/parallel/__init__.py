"""Tensor parallelism: the rank group and its collectives, sharded layers, and the lockstep
channel from the engine (rank 0) to the other ranks."""
