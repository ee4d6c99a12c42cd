"""Multi-node jobs: how the nodes of one job meet and what they agree on.

When the launcher describes more than one node (``WORLD_SIZE`` above ``LOCAL_WORLD_SIZE``, or
Slurm/MPI equivalents), or ``peers=True`` / ``CLAIRVOYANT_PEERS`` asks for it, every rank:

1. takes the job secret (:func:`clairvoyant._cluster.job_secret`: never through an
   unauthenticated store);
2. on the node's first local rank, starts the node's peer server on the interface that reaches
   the other nodes (:func:`clairvoyant._cluster.listen_address`; ``CLAIRVOYANT_PORT`` fixes the
   port, else an ephemeral one);
3. announces, through the launcher's own machinery (:func:`clairvoyant._cluster.allgather`), a
   small record: its node, its local ranks, the server's address, the capacities this node
   caches in, and a hash of everything that decides the access streams. Streams are never
   exchanged: every node computes every node's streams from the seed;
4. checks that every rank computed the same hash (else a ConfigError naming the ranks that
   differ), groups the ranks by node, and hands the nodes, their capacities and addresses to
   the engine, which computes the cluster-wide placement.

``CLAIRVOYANT_PEERS=off`` (or ``peers=False``) keeps every node on its own.
``CLAIRVOYANT_PEERS=host:port,host:port,...`` names every node's server explicitly (node i is
the i-th entry); this node's server listens on its entry.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

from . import _native, _settings
from ._env import _LOCAL_SIZE, _WORLD, _first_int


@dataclass
class Setup:
    """What a multi-node job hands its engine, and the node's server (first local rank only)."""

    cluster: dict
    server: object | None
    node: int
    nodes: list = field(default_factory=list)


def wanted(peers, world_size: int, local_ranks, env=None) -> bool:
    """Whether this job is one node of several."""
    env = os.environ if env is None else env
    setting = _settings.get("CLAIRVOYANT_PEERS", "", env)
    if peers is False or setting.lower() in ("off", "0", "false", "no"):
        return False
    if world_size <= len(local_ranks):
        return False
    if peers is True or setting:
        return True
    # The launcher says so: more ranks in the world than on this machine.
    world, local = _first_int(_WORLD, env), _first_int(_LOCAL_SIZE, env)
    nnodes = _first_int(("SLURM_NNODES", "SLURM_JOB_NUM_NODES"), env)
    return (world is not None and local is not None and world > local) or (nnodes is not None and nnodes > 1)


def job_id(**facts) -> int:
    """A 64-bit id of everything that decides the streams (and the run): bound into the peer
    handshake, so nodes of different jobs never exchange samples."""
    text = json.dumps(facts, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _explicit_peers(env) -> list | None:
    setting = _settings.get("CLAIRVOYANT_PEERS", "", env)
    if not setting or setting.lower() in ("on", "1", "true", "yes", "off", "0", "false", "no"):
        return None
    peers = [p.strip() for p in setting.split(",") if p.strip()]
    for p in peers:
        host, _, port = p.rpartition(":")
        if not host or not port.isdigit():
            raise _native.ConfigError(f"invalid value for CLAIRVOYANT_PEERS: {p!r} is not host:port")
    return peers


def setup(
    *,
    source,
    model,
    rank: int,
    world_size: int,
    local_ranks: list,
    run_id: str,
    facts: dict,
    timeout: float = 120.0,
    env=None,
) -> Setup:
    """Meet the other nodes (see the module's description) and return the engine's cluster
    description. ``facts`` are the inputs of the access streams (seed, batch size, epochs, ...)."""
    from . import _cluster

    env = os.environ if env is None else env
    timeout = _settings.get("CLAIRVOYANT_RENDEZVOUS_TIMEOUT", timeout, env)
    first_local = rank == min(local_ranks)
    jid = job_id(run_id=run_id, world_size=world_size, fingerprint=source._native.fingerprint, **facts)
    secret = _cluster.job_secret(rank=rank, world_size=world_size, run_id=run_id or f"job-{jid:016x}", timeout=timeout)
    explicit = _explicit_peers(env)
    capacities = [int(b) for _, b in _native.node_capacities(source._native, len(local_ranks), model)]
    server = None
    if first_local:
        if explicit is not None:
            index = _first_int(("CLAIRVOYANT_NODE_RANK", "GROUP_RANK", "SLURM_NODEID"), env)
            if index is None:
                index = rank // max(1, len(local_ranks))
            if not 0 <= index < len(explicit):
                raise _native.ConfigError(
                    f"invalid value for CLAIRVOYANT_PEERS: node {index} has no entry among {len(explicit)} addresses"
                )
            bind = explicit[index]
        else:
            port = _settings.get("CLAIRVOYANT_PORT", 0, env)
            host = _cluster.listen_address()
            bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        server = _native.PeerServer(bind, secret, jid)
    me = {
        "rank": rank,
        "node": _cluster.node_id(),
        "local_ranks": list(local_ranks),
        "address": server.address if server is not None else "",
        "capacities": capacities,
        "agree": f"{jid:016x}",
    }
    try:
        blobs = _cluster.allgather(
            json.dumps(me).encode(), rank=rank, world_size=world_size, run_id=run_id or f"job-{jid:016x}", timeout=timeout
        )
    except BaseException:
        if server is not None:
            server.close()
        raise
    # Every rank entered the gather with the secret in hand: its file is no longer needed.
    _cluster.release_job_secret(rank=rank, run_id=run_id or f"job-{jid:016x}")
    try:
        return _assemble(me, [json.loads(b) for b in blobs], server, explicit, secret, jid)
    except BaseException:
        if server is not None:
            server.close()
        raise


def _assemble(me: dict, records: list, server, explicit, secret: bytes, jid: int) -> Setup:
    differ = [r["rank"] for r in records if r["agree"] != me["agree"]]
    if differ:
        raise _native.ConfigError(
            f"ranks {differ} compute different access streams than rank {me['rank']} (the seed, batch size, "
            "epochs, dataset or run id differ between ranks); every rank of a job must start it alike"
        )
    by_node: dict = {}
    for r in records:
        by_node.setdefault(r["node"], []).append(r)
    nodes = sorted(by_node.values(), key=lambda rs: min(x["rank"] for x in rs))
    ranks = [sorted(x["rank"] for x in rs) for rs in nodes]
    mine = next(i for i, rs in enumerate(ranks) if me["rank"] in rs)
    if ranks[mine] != sorted(me["local_ranks"]):
        raise _native.ConfigError(
            f"invalid value for 'local_ranks': {me['local_ranks']}, but the ranks on this node ({me['node']}) are "
            f"{ranks[mine]}; set LOCAL_WORLD_SIZE/local_ranks to match how ranks are placed"
        )
    addresses, capacities = [], []
    for i, rs in enumerate(nodes):
        first = min(rs, key=lambda x: x["rank"])
        capacities.append(first["capacities"])
        if explicit is not None:
            if len(explicit) != len(nodes):
                raise _native.ConfigError(
                    f"invalid value for CLAIRVOYANT_PEERS: {len(explicit)} addresses for {len(nodes)} nodes"
                )
            addresses.append(explicit[i])
        else:
            if not first["address"]:
                raise _native.ConfigError(f"node {first['node']} (rank {first['rank']}) announced no peer server")
            addresses.append(first["address"])
    cluster = {
        "nodes": ranks,
        "node": mine,
        "capacities": capacities,
        "peers": addresses,
        "secret": secret,
        "job": jid,
    }
    return Setup(cluster=cluster, server=server, node=mine, nodes=ranks)
