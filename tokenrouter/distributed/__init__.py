"""Tensor parallelism inside one subserver: a process group per engine, the sharded layers, and the
worker processes that run the model on ranks 1..tp_size-1 (rank 0 is the engine's own process)."""

from tokenrouter.distributed.group import TPGroup, check_tp_divisible

__all__ = ["TPGroup", "check_tp_divisible"]
