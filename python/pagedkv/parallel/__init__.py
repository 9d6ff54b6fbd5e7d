"""Tensor parallelism over torch.distributed: one model sharded over several processes (one GPU
each on CUDA), the KV cache sharded by heads, one Rust scheduler on rank 0.

- group.py: the group a process belongs to (its rank, the collectives the layers call).
- sharding.py: which models shard, and each rank's slice of the checkpoint's weights.
- step_plan.py: the step rank 0 broadcasts (the scheduler's columns, picklable).
- workers.py: starting ranks 1..N-1 (or joining torchrun's), their step loop, shutdown.
"""

from pagedkv.parallel.group import SINGLE_PROCESS, TensorParallelGroup, current_group, using_group

__all__ = ["SINGLE_PROCESS", "TensorParallelGroup", "current_group", "using_group"]
