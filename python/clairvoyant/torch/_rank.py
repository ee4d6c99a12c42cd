"""Which rank of how many this process is, and which ranks share its machine.

Sources, in order of precedence: the sampler (``DistributedSampler.rank``/``num_replicas``),
an initialized ``torch.distributed`` process group, the launcher's variables (torchrun, Slurm,
Open MPI, MPICH; see ``clairvoyant._env``), else one process. Two sources that disagree are an
error naming both: a script launched on 4 ranks whose loader believes it is alone would
otherwise train every rank on the whole dataset.

The ranks sharing this machine come from the launcher's local-rank variables. A launch that
sets none (``torch.multiprocessing.spawn`` + ``init_process_group``) registers each rank's host
name in the process group's store the first time a loader starts and waits (bounded) for the
others; if they do not all arrive, each rank keeps a cache of its own (correct, only less
shared) and says so.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Optional

from .. import _env, _settings
from ..errors import ConfigError

_local_cache: dict = {}


@dataclass(frozen=True)
class Where:
    rank: int
    world_size: int
    local_ranks: list
    source: str  # where rank and world size came from


def _process_group() -> Optional[tuple]:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()


def _env_rank(env) -> Optional[tuple]:
    rank = _env._first_int(_env._RANK, env)
    world = _env._first_int(_env._WORLD, env)
    if rank is None or world is None:
        return None
    return rank, world


def resolve(sampler_rank: Optional[tuple], env=None) -> Where:
    """``sampler_rank``: (rank, num_replicas) of a DistributedSampler, or None."""
    env = os.environ if env is None else env
    found = []
    if sampler_rank is not None:
        found.append(("the DistributedSampler", sampler_rank))
    pg = _process_group()
    if pg is not None:
        found.append(("torch.distributed", pg))
    launched = _env_rank(env)
    if launched is not None:
        found.append(("the launcher's environment", launched))
    for (a, (ra, wa)), (b, (rb, wb)) in zip(found, found[1:]):
        if (ra, wa) != (rb, wb):
            raise ConfigError(
                f"{a} says rank {ra} of {wa} but {b} says rank {rb} of {wb}; "
                "make them agree (a DistributedSampler takes num_replicas= and rank=)"
            )
    if not found:
        return Where(0, 1, [0], "one process")
    source, (rank, world) = found[0]
    local = _local_ranks(rank, world, env)
    return Where(rank, world, local, source)


def _local_ranks(rank: int, world: int, env) -> list:
    if world == 1:
        return [0]
    local_rank = _env._first_int(_env._LOCAL_RANK, env)
    local_size = _env._first_int(_env._LOCAL_SIZE, env)
    if local_rank is not None and local_size is not None:
        first = rank - local_rank
        return [r for r in range(first, first + local_size) if 0 <= r < world]
    if _process_group() is None:
        return [rank]  # ranks set by hand (num_replicas=, rank=): nothing tells where the others run
    key = (rank, world)
    if key not in _local_cache:
        _local_cache[key] = _rendezvous(rank, world)
    return _local_cache[key]


def _rendezvous(rank: int, world: int) -> list:
    """The ranks on this host, from host names registered in the process group's store."""
    try:
        import datetime

        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        host = socket.gethostname().encode()
        store.set(f"clairvoyant/host/{rank}", host)
        keys = [f"clairvoyant/host/{r}" for r in range(world)]
        store.wait(keys, datetime.timedelta(seconds=_settings.get("CLAIRVOYANT_RENDEZVOUS_TIMEOUT")))
        hosts = [store.get(k) for k in keys]
        return [r for r in range(world) if hosts[r] == host]
    except Exception as exc:  # no store, or not every rank arrived
        print(
            f"clairvoyant: rank {rank}: could not learn which ranks share this machine ({exc}); "
            "this rank keeps a node cache of its own (set LOCAL_RANK and LOCAL_WORLD_SIZE to share one)",
            file=sys.stderr,
        )
        return [rank]
