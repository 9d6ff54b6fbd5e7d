"""Tensor parallelism over torch.distributed: one model sharded over several processes (one GPU
each on CUDA), the KV cache sharded by heads, one Rust scheduler on rank 0.

- group.py: the group a process belongs to (its rank, the collectives the layers call).
- sharding.py: which models shard, and each rank's slice of the checkpoint's weights.
- workers.py: starting ranks 1..N-1 (or joining torchrun's), their step loop (each step is rank
  0's SchedulerOutput, pickled as its bytes), shutdown.
"""

from pagedkv.parallel.group import SINGLE_PROCESS, TensorParallelGroup, current_group, using_group

__all__ = ["SINGLE_PROCESS", "TensorParallelGroup", "current_group", "using_group"]
