"""Spawning N ranks over gloo on 127.0.0.1 (torchrun's environment variables, a free port picked at run time).

    python -m pytest tests/engine/test_engine.py -q -k world
"""

from __future__ import annotations

import io
import os
import socket
import time
import traceback

import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, fn, args, queue, threads: int, env: dict, rank_env) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's from when it started
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if rank_env is not None:
        os.environ.update(rank_env(rank))
    torch.set_num_threads(threads)
    try:
        result = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def spawn(fn, world: int, *args, timeout: float = 300.0, threads: int = 1, subprocess: bool = False,
          allow_dead: bool = False, rank_env=None) -> list:
    """Run fn(rank, world, *args) on `world` processes (torchrun's environment variables on a free 127.0.0.1
    port); returns the results by rank. World size 1 runs in this process unless subprocess=True, which also makes
    every rank a fresh interpreter (the bench's timings and the peak-memory tests: a forked rank starts with the
    fork server's heap, which moves resident-memory peaks by megabytes); other ranks fork from a server that has
    imported torch. A rank that raises fails the whole call with that rank's traceback; a rank whose process dies
    without a result (a hard abort) fails it too, unless allow_dead, which puts {"died": exitcode} in its place. No
    rank is left running. rank_env(rank) -> {name: value}, a picklable function, sets more environment variables
    per rank after torchrun's (bench/probe_world2.py puts several ranks on one GPU with LOCAL_RANK 0 and a distinct
    NCCL_HOSTID each)."""
    if world == 1 and not subprocess:
        return [fn(0, 1, *args)]
    import queue as queue_module

    import torch.multiprocessing as mp

    # Forked ranks skip importing torch (about 2 s of CPU per process, four ranks on two cores: seconds per
    # spawn); the server computes nothing, so no thread pool is forked.
    ctx = mp.get_context("spawn" if subprocess else "forkserver")
    if not subprocess:
        ctx.set_forkserver_preload(["torch", "zkern.testing"])
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, queue, threads, dict(os.environ), rank_env),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, ok, payload = queue.get(timeout=0.5)
            except queue_module.Empty:
                for r, p in enumerate(procs):
                    if r not in results and p.exitcode is not None and queue.empty():
                        if not allow_dead:
                            raise RuntimeError(f"rank {r} of {world} died (exit code {p.exitcode}) without a "
                                               f"result") from None
                        results[r] = {"died": p.exitcode}
                if time.monotonic() > deadline:
                    raise TimeoutError(f"spawn: ranks {sorted(set(range(world)) - set(results))} gave no result "
                                       f"within {timeout:g}s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {world} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [results[r] for r in range(world)]
