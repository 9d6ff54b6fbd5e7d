"""Ranks 1..N-1 of a tensor-parallel engine: started here (one interpreter each, a process
group over loopback), or joined from a torchrun launch (its RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; multi-node). Each builds its own ModelRunner over its shard and
executes every step rank 0 broadcasts, until rank 0 says stop or goes away."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from datetime import timedelta

import torch

from pagedkv.errors import InvalidConfigError, TensorParallelError
from pagedkv.parallel.group import TensorParallelGroup

logger = logging.getLogger("pagedkv.parallel")

# How long a worker waits on the store for the next step before waiting again (an idle engine
# sends none; a lost rank 0 ends the wait at once, with a network error).
_IDLE_WAIT = timedelta(days=1)


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


class TensorParallelWorkers:
    """Rank 0's handle on the other ranks: sends each step, stops them: on `shutdown`, when the
    handle is collected (its engine dropped), or at interpreter exit, whichever comes first."""

    def __init__(self, group: TensorParallelGroup, channel: StepChannel, processes: list[subprocess.Popen]):
        self.group = group
        self._channel = channel
        self._processes = processes
        # (a finalizer, not atexit.register(self.shutdown): that would keep a dropped engine's ranks alive)
        self._finalizer = weakref.finalize(self, _stop_ranks, channel, processes)

    @classmethod
    def start(cls, config) -> TensorParallelWorkers:
        """Starts ranks 1..N-1 and joins them as rank 0. Under torchrun, ranks other than 0 serve
        rank 0's steps here and then exit the process (code after the engine runs on rank 0 only)."""
        size = config.tensor_parallel_size
        if under_torchrun():
            world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
            if world_size != size:
                raise InvalidConfigError(f"tensor_parallel_size={size} but torchrun started {world_size} processes")
            if rank != 0:
                serve_steps(config, rank, size, None)
                sys.exit(0)
            return cls(*join_group(config, 0, size, None), [])
        if config.is_cuda and torch.cuda.device_count() < size:
            raise InvalidConfigError(f"tensor_parallel_size={size} needs {size} GPUs; {torch.cuda.device_count()} "
                                     "are visible")
        from torch.distributed import TCPStore

        timeout = timedelta(seconds=config.distributed_timeout_seconds)
        store = TCPStore("127.0.0.1", 0, size, True, timeout, wait_for_workers=False)
        # A fresh interpreter per rank (not multiprocessing's spawn, which re-runs the user's
        # script: one without a __main__ guard would start engines recursively).
        processes = [subprocess.Popen([sys.executable, "-m", "pagedkv.parallel.workers"], stdin=subprocess.PIPE)
                     for _ in range(1, size)]
        for rank, process in enumerate(processes, start=1):
            process.stdin.write(pickle.dumps((config, rank, size, store.port, os.getpid())))
            process.stdin.close()
        logger.info("tensor parallel: started ranks 1-%d (pids %s)", size - 1, ", ".join(str(p.pid) for p in processes))
        try:
            _wait_for_ranks(store, processes, max(config.distributed_timeout_seconds, RANK_START_SECONDS))
            group, channel = join_group(config, 0, size, store)
        except BaseException:
            _stop(processes, grace_seconds=0)
            raise
        return cls(group, channel, processes)

    def send_step(self, plan) -> None:
        """Broadcasts the step to the other ranks (they execute it as rank 0 does: a
        SchedulerOutput pickles as its bytes, SchedulerOutput.to_bytes)."""
        self._broadcast(("step", plan))

    def check_alive(self) -> None:
        """Raises TensorParallelError if a rank this process started has exited."""
        exited = [(rank, p) for rank, p in enumerate(self._processes, start=1) if p.poll() is not None]
        if exited:
            raise TensorParallelError(", ".join(f"rank {rank} (pid {p.pid}) exited with status {p.returncode}"
                                                for rank, p in exited))

    def _broadcast(self, message) -> None:
        self.check_alive()
        self._channel.send(message)

    def shutdown(self) -> None:
        """Stops the other ranks and leaves the process group (idempotent); lets go of the groups
        and the store, whose sockets and threads close with them."""
        self._finalizer()
        self.group = self._channel = None


def _stop_ranks(channel: StepChannel, processes: list[subprocess.Popen]) -> None:
    exited = [process for process in processes if process.poll() is not None]
    try:
        if not exited:
            channel.send(("stop", None))
    except Exception as error:  # (a dead rank: the others are stopped below)
        logger.warning("tensor parallel: could not tell every rank to stop (%s)", error)
    _stop(processes, grace_seconds=0 if exited else 10.0)
    _leave_group()


# A fresh interpreter importing torch takes seconds, more on a loaded machine: starting the ranks
# may take this long even when distributed_timeout_seconds (how long a step may hang) is shorter.
RANK_START_SECONDS = 60.0


def _wait_for_ranks(store, processes: list[subprocess.Popen], timeout_seconds: float) -> None:
    """Waits until every started rank has reached the store, failing as soon as one exits."""
    deadline = time.monotonic() + timeout_seconds
    while store.add("ranks_ready", 0) < len(processes):
        for rank, process in enumerate(processes, start=1):
            if process.poll() is not None:
                raise TensorParallelError(f"tensor-parallel rank {rank} exited with status {process.returncode} "
                                          "while starting (its error is above)")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel ranks did not start within {timeout_seconds:g} s "
                                      f"(distributed_timeout_seconds, at least {RANK_START_SECONDS:g} s)")
        time.sleep(0.05)


class StepChannel:
    """Rank 0 to the other ranks, a message per step. A store key announces each one, so idle
    workers wait on the store (as long as the engine idles) and not in a collective; the message
    itself is a gloo broadcast (its pickled length, then its bytes), bounded by
    distributed_timeout_seconds like every collective, so a hung rank fails rank 0's step
    instead of hanging it.

    The channel keeps its last message's tensors: gloo's worker thread releases its references
    to them a moment after the broadcast returns, and were it the last holder, it would need the
    GIL to free them, which a process that is exiting (torchrun's ranks end with the script)
    never gives back: the thread exits inside C++ and the process aborts ("terminate called
    without an active exception")."""

    def __init__(self, store, control):
        import torch.distributed as dist

        self._store = dist.PrefixStore("pagedkv/steps/", store)
        self._control = control
        self._count = 0
        self._last: tuple[torch.Tensor, ...] = ()

    def send(self, message) -> None:
        import torch.distributed as dist

        self._store.set(str(self._count), b"")
        if self._count:  # (every rank has passed it: they all took part in the last broadcast)
            self._store.delete_key(str(self._count - 1))
        self._count += 1
        payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        self._last = (length, payload)
        dist.broadcast(length, src=0, group=self._control)
        dist.broadcast(payload, src=0, group=self._control)

    def receive(self):
        import torch.distributed as dist

        while True:
            try:
                self._store.wait([str(self._count)], _IDLE_WAIT)
                break
            except dist.DistStoreError:  # (a timeout: still idle)
                continue
        self._count += 1
        length = torch.zeros(1, dtype=torch.int64)
        self._last = (length,)
        dist.broadcast(length, src=0, group=self._control)
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self._last = (length, payload)
        dist.broadcast(payload, src=0, group=self._control)
        return pickle.loads(payload.numpy().tobytes())


def join_group(config, rank: int, size: int, store) -> tuple[TensorParallelGroup, StepChannel]:
    """Joins the process group (NCCL on CUDA, gloo on the CPU) and a gloo group for the steps;
    over `store`, or torchrun's environment (its rendezvous store) when it is None."""
    import torch.distributed as dist

    if dist.is_initialized():
        # An engine dropped in a reference cycle stops its ranks and leaves the group now; its
        # finalizer ran inside this collection, so what it let go of goes in a second one.
        gc.collect()
        gc.collect()
    if dist.is_initialized():
        raise InvalidConfigError("this process already belongs to a torch.distributed group (one tensor-parallel "
                                 "engine per process: shut the other down first with engine.shutdown())")
    backend = "nccl" if config.is_cuda else "gloo"
    if config.is_cuda:
        torch.cuda.set_device(_local_device(rank))
    timeout = timedelta(seconds=config.distributed_timeout_seconds)
    if store is None:
        store, _, _ = next(dist.rendezvous("env://", rank, size, timeout=timeout))
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    # The start's agreements (the KV pool's size) come after each rank builds its shard: seconds
    # more on one rank than on another is no hang, so they have a group with the start's bound.
    agreements = dist.new_group(backend="gloo", timeout=max(timeout, timedelta(seconds=RANK_START_SECONDS)))
    logger.info("tensor parallel: rank %d of %d joined (%s)", rank, size, backend)
    group = TensorParallelGroup(rank=rank, size=size, group=dist.group.WORLD, control=control, agreements=agreements)
    return group, StepChannel(store, control)


def rank_config(config, rank: int):
    """The engine config a rank runs with: its own GPU on CUDA."""
    if config.is_cuda:
        return dataclasses.replace(config, device=f"cuda:{_local_device(rank)}")
    return config


def serve_steps(config, rank: int, size: int, store) -> None:
    """A worker rank: builds its shard of the model and KV cache, then executes each step rank 0
    broadcasts until told to stop."""
    from pagedkv.runner.model_runner import ModelRunner

    group, channel = join_group(config, rank, size, store)
    runner = ModelRunner(rank_config(config, rank), group=group)
    try:
        while True:
            kind, plan = channel.receive()
            if kind == "stop":
                break
            runner.execute(plan)
    finally:
        _leave_group()


def _worker_main() -> None:
    """Entry of a rank started by TensorParallelWorkers.start: its arguments come on stdin."""
    config, rank, size, port, parent_pid = pickle.loads(sys.stdin.buffer.read())
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s tp-rank{rank} %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    from torch.distributed import TCPStore

    try:
        # Imported before saying ready (seconds of torch and transformers): after that, rank 0 meets
        # this rank in collectives bounded by distributed_timeout_seconds.
        import pagedkv.runner.model_runner  # noqa: F401

        store = TCPStore("127.0.0.1", port, size, False, timedelta(seconds=config.distributed_timeout_seconds))
        store.add("ranks_ready", 1)
        serve_steps(config, rank, size, store)
    except Exception as error:
        logger.error("tensor parallel: rank %d stopped: %s", rank, error, exc_info=True)
        os._exit(1)
    os._exit(0)


def _exit_with_parent(parent_pid: int) -> None:
    """Ends this worker when rank 0's process is gone (killed before it could say stop)."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def _stop(processes: list[subprocess.Popen], grace_seconds: float = 10.0) -> None:
    deadline = time.monotonic() + grace_seconds
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("tensor parallel: pid %d did not stop; killing it", process.pid)
            process.kill()
            process.wait(5)


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _local_device(rank: int) -> int:
    return int(os.environ.get("LOCAL_RANK", rank))


if __name__ == "__main__":
    _worker_main()
