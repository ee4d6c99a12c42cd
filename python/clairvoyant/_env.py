"""Launcher environment: rank, world size, the ranks sharing this machine, and a run id that
all local ranks of one run agree on. Every launcher variable clairvoyant reads is listed here.

| variable                                  | launcher        | meaning                         |
|-------------------------------------------|-----------------|---------------------------------|
| RANK, WORLD_SIZE                          | torchrun        | global rank / number of ranks   |
| LOCAL_RANK, LOCAL_WORLD_SIZE              | torchrun        | rank on this machine / count    |
| TORCHELASTIC_RUN_ID                       | torchrun        | run id                          |
| SLURM_PROCID, SLURM_NTASKS                | Slurm (srun)    | global rank / number of ranks   |
| SLURM_LOCALID, SLURM_NTASKS_PER_NODE      | Slurm           | rank on node / ranks per node   |
| SLURM_STEP_TASKS_PER_NODE, SLURM_NODEID   | Slurm (srun)    | ranks of each node; this node   |
| SLURM_JOB_ID, SLURM_STEP_ID               | Slurm           | run id                          |
| OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE| Open MPI        | global rank / number of ranks   |
| OMPI_COMM_WORLD_LOCAL_RANK, ..._LOCAL_SIZE| Open MPI        | rank on node / ranks on node    |
| PMI_RANK, PMI_SIZE                        | MPICH / Hydra   | global rank / number of ranks   |
| MPI_LOCALRANKID, MPI_LOCALNRANKS          | MPICH / Hydra   | rank on node / ranks on node    |
| CLAIRVOYANT_RUN_ID                        | any             | overrides the run id            |
| TORCHELASTIC_RESTART_COUNT                | torchrun        | restart; part of rendezvous keys|
| PMIX_NAMESPACE                            | PMIx (MPI/Slurm)| rendezvous run name, no run id  |
| MASTER_ADDR, MASTER_PORT                  | torchrun        | the store (rendezvous)          |
| TORCHELASTIC_USE_AGENT_STORE              | torchrun        | the agent hosts the store       |
| SLURM_JOB_NODELIST                        | Slurm           | first node: route to the others |

Variables of the cluster rendezvous (``clairvoyant._cluster``, docs/cluster.md), read there:
CLAIRVOYANT_RENDEZVOUS (store|mpi|file), CLAIRVOYANT_SHARED_DIR, CLAIRVOYANT_STORE_MASTER,
CLAIRVOYANT_SECRET, CLAIRVOYANT_LISTEN, CLAIRVOYANT_PEERS (first entry: a route hint),
CLAIRVOYANT_NODE_ID, CLAIRVOYANT_SHM_DIR (the per-user directory of a single-host secret).

The run id only tells concurrent runs apart; it is not needed for the local ranks of one run to
find their node cache (that is named after the dataset, the schedule, the local ranks and the
storage classes, and unrelated runs with equal names are told apart by the cache's rank table).
So no id is made up from process ids: ranks started by per-rank wrapper scripts have different
parents. ``TORCHELASTIC_RUN_ID=none`` (torchrun without ``--standalone``) is no id.

Local ranks are assumed to be numbered contiguously on each machine (the default of torchrun,
Slurm's block distribution and mpirun --map-by core); pass ``local_ranks=`` to a Job otherwise.
"""

from __future__ import annotations

import os
import re
from collections import namedtuple

from . import _settings
from .errors import ConfigError

_RANK = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_WORLD = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_LOCAL_RANK = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
_LOCAL_SIZE = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def _slurm_tasks_here(env) -> str | None:
    """This node's task count from the step's per-node counts (``SLURM_STEP_TASKS_PER_NODE``,
    else the job's ``SLURM_TASKS_PER_NODE``: ``"2(x3),1"`` is 2, 2, 2, 1) at ``SLURM_NODEID``.
    srun sets SLURM_NTASKS_PER_NODE only when --ntasks-per-node is given; ``srun -N 2 -n 4``
    sets these."""
    counts = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = env.get("SLURM_NODEID")
    if not counts or node is None or node == "":
        return None
    expanded = []
    for part in counts.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ConfigError(f"environment variable SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE={counts!r} is not a task count list")
        expanded += [m.group(1)] * int(m.group(2) or 1)
    try:
        return expanded[int(node)]
    except (ValueError, IndexError) as exc:
        raise ConfigError(f"environment variable SLURM_NODEID={node!r} names no node of the task counts {counts!r}") from exc


def _first(names: tuple[str, ...], env) -> tuple:
    """(name, value) of the first of ``names`` set in ``env``, else (None, None)."""
    for name in names:
        value = env.get(name)
        if (value is None or value == "") and name == "SLURM_NTASKS_PER_NODE":
            value = _slurm_tasks_here(env)
        if value is None or value == "":
            continue
        try:
            # SLURM_NTASKS_PER_NODE may look like "4(x2)".
            return name, int(value.split("(")[0])
        except ValueError as exc:
            raise ConfigError(f"environment variable {name}={value!r} is not an integer") from exc
    return None, None


def _first_int(names: tuple[str, ...], env) -> int | None:
    return _first(names, env)[1]


class Placement(namedtuple("Placement", "rank world_size local_ranks run_id")):
    """Where this process runs: rank, world size, the ranks on its node, the run's id."""

    __slots__ = ()


def _config_error(message: str) -> Exception:
    from . import _native

    return _native.ConfigError(message)


def detect(rank: int | None = None, world_size: int | None = None, local_ranks=None, env=None) -> Placement:
    """Rank, world size, local ranks and run id from arguments, else the launcher's variables."""
    env = os.environ if env is None else env
    world_name = "world_size"
    if rank is None:
        rank = _first_int(_RANK, env) or 0
    if world_size is None:
        world_name, world_size = _first(_WORLD, env)
        if world_size is None:
            world_name, world_size = "world_size", 1
    if world_size < 1:
        raise _config_error(f"invalid value for '{world_name}': {world_size}; the world has at least one rank")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside world size {world_size}")
    if local_ranks is None:
        local_rank_name, local_rank = _first(_LOCAL_RANK, env)
        local_size_name, local_size = _first(_LOCAL_SIZE, env)
        if local_size is not None and not 1 <= local_size <= world_size:
            raise _config_error(
                f"invalid value for '{local_size_name}': {local_size} ranks on this machine, "
                f"but the world ({world_name}) has {world_size}"
            )
        if local_rank is not None and local_size is not None and not 0 <= local_rank < local_size:
            raise _config_error(
                f"invalid value for '{local_rank_name}': {local_rank} is outside the {local_size} ranks on this machine ({local_size_name})"
            )
        if local_rank is None or local_size is None:
            local_ranks = [rank]
        else:
            first = rank - local_rank
            local_ranks = [r for r in range(first, first + local_size) if 0 <= r < world_size]
    try:
        local_ranks = sorted(int(r) for r in local_ranks)
    except (TypeError, ValueError) as exc:
        raise _config_error(f"invalid value for 'local_ranks': {local_ranks!r} is not a list of integers") from exc
    bad = [r for r in local_ranks if not 0 <= r < world_size]
    if bad:
        raise _config_error(
            f"invalid value for 'local_ranks': {local_ranks} holds rank {bad[0]}, outside world size {world_size}"
        )
    if len(set(local_ranks)) != len(local_ranks):
        raise _config_error(f"invalid value for 'local_ranks': {local_ranks} names a rank twice")
    if rank not in local_ranks:
        raise _config_error(f"invalid value for 'local_ranks': {local_ranks} must include this rank {rank}")
    return Placement(rank, world_size, local_ranks, run_id(env))


def run_id(env=None) -> str:
    """The run the local ranks of one job share: ``CLAIRVOYANT_RUN_ID``, else torchrun's run id,
    else the Slurm job step; "" when none is set (callers then derive one)."""
    env = os.environ if env is None else env
    run = _settings.raw("CLAIRVOYANT_RUN_ID", env) or env.get("TORCHELASTIC_RUN_ID") or ""
    if run.strip().lower() == "none":
        run = ""
    if not run and env.get("SLURM_JOB_ID"):
        run = f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}"
    return run
