"""The node agent of transparent mode (``clairvoyant run``): the engine hosted in its own
process, one per job per node. It owns the node's cache and peer server; programs running under
the interposed library ask it, through a Unix socket, where a dataset file's bytes are, and read
them from the shared memory arena themselves (see docs/transparent.md).

Started by the first ``clairvoyant run`` of a job on a node (:mod:`clairvoyant._run`); exits
when the last one that attached has gone and (with several nodes) every other node's agent is
done or gone; on a normal exit it removes its folder (docs/transparent.md, "Life cycle")."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from . import _native, _settings


def list_dataset(root: str) -> list:
    """Every regular file under ``root`` (following symbolic links to files, not to
    directories), as paths relative to it, sorted: the agent's sample ids. Names may be any
    bytes (a name that is not UTF-8 is in Python's surrogate escapes, as ``os.scandir`` gives
    it; the agent's protocol carries names as bytes). What cannot be a sample is skipped with
    one notice on stderr: symbolic links that loop or lead nowhere, sockets, pipes and
    devices."""
    out = []
    skipped: dict = {}
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        try:
            entries = list(os.scandir(os.path.join(root, rel_dir) if rel_dir else root))
        except OSError as e:
            if not rel_dir:
                raise _native.ConfigError(f"cannot list the dataset directory {root}: {e.strerror}") from e
            skipped.setdefault(f"unreadable folders ({e.strerror})", []).append(rel_dir)
            continue
        for e in entries:
            rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(rel)
                    continue
                is_file = e.is_file(follow_symlinks=True)
            except OSError as err:  # ELOOP: a symbolic link loop
                skipped.setdefault(f"symbolic links that cannot be followed ({err.strerror})", []).append(rel)
                continue
            if not is_file:
                what = "broken symbolic links" if e.is_symlink() else "sockets, pipes and devices"
                skipped.setdefault(what, []).append(rel)
                continue
            out.append(rel)
    out.sort()
    for what, rels in sorted(skipped.items()):
        shown = ", ".join(repr(os.fsencode(r))[2:-1] for r in sorted(rels)[:3])
        more = f" and {len(rels) - 3} more" if len(rels) > 3 else ""
        print(f"clairvoyant agent: skipping {len(rels)} {what} under {root}: {shown}{more}", file=sys.stderr, flush=True)
    return out


def relative(path: str, root: str) -> str | None:
    """``path`` (absolute, or relative to ``root``) as a normalized path relative to ``root``;
    None when it lies outside."""
    full = os.path.normpath(path if os.path.isabs(path) else os.path.join(root, path))
    rel = os.path.relpath(full, root)
    if rel == "." or rel.startswith(".." + os.sep) or rel == "..":
        return None
    return rel


def read_order_file(path: str, root: str, index: dict) -> list:
    """Per-epoch orders of sample ids from an order file: one dataset path per line (relative to
    the root or absolute), epochs separated by a blank line or a line starting with ``#``. A
    name that is not UTF-8 is read as Python's surrogate escapes (the listing's form)."""
    import numpy as np

    epochs, current = [], []
    prefix = os.path.join(root, "")
    try:
        f = open(path, encoding="utf-8", errors="surrogateescape")
    except OSError as e:
        raise _native.ConfigError(f"cannot read the order file {path}: {e.strerror}") from e
    with f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                if current:
                    epochs.append(np.asarray(current, dtype=np.int64))
                    current = []
                continue
            name = line.strip()
            # The usual line, a path as the listing spells it (absolute under the root, or
            # relative), is looked up as it is: the listing's names are already normal. Any
            # other is normalized first (the same id either way; normalizing every line was
            # most of the agent's time from the order's arrival to its first read).
            k = index.get(name[len(prefix) :] if name.startswith(prefix) else name)
            if k is None:
                rel = relative(name, root)
                k = index.get(rel) if rel is not None else None
            if k is None:
                raise _native.ConfigError(f"{path}, line {n}: {line.strip()!r} is not a file of the dataset {root}")
            current.append(k)
    if current:
        epochs.append(np.asarray(current, dtype=np.int64))
    if not epochs:
        raise _native.ConfigError(f"the order file {path} names no files")
    return epochs


def access_counts(epochs: list, n: int) -> tuple:
    """(counts, first need) of one node's reads: how often each sample is read over the run and
    when first (``epoch << 32 | position``, 2**64-1 when never)."""
    import numpy as np

    counts = np.zeros(n, dtype=np.uint32)
    first = np.full(n, np.iinfo(np.uint64).max, dtype=np.uint64)
    for e, order in enumerate(epochs):
        np.add.at(counts, order, 1)
        pos = np.full(n, np.iinfo(np.uint64).max, dtype=np.uint64)
        # The first position of each sample in this epoch (reversed assignment keeps the first).
        pos[order[::-1]] = (np.uint64(e) << np.uint64(32)) | np.arange(len(order), dtype=np.uint64)[::-1]
        first = np.minimum(first, pos)
    return counts, first


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m clairvoyant._agent", description=__doc__)
    p.add_argument("--root", required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--dir", required=True, help="the shared directory file to create")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--node", type=int, default=0)
    p.add_argument("--order-file", default=None, help="per-epoch orders; {node} is replaced by each node's index")
    p.add_argument("--run-id", default="")
    p.add_argument("--config", default=None)
    p.add_argument("--index-dir", default=None)
    p.add_argument("--lazy", action="store_true", help="place when a program sends its order (or at its first read)")
    p.add_argument("--ready-fd", type=int, default=None, help="write '1' to this descriptor once serving")
    p.add_argument("--idle-wait", type=float, default=60.0, help="exit if nobody attaches within this many seconds")
    return p.parse_args(argv)


class _Dataset:
    """What the agent serves: the dataset's files under ``root`` (the agent's sample ids), their
    source and the system description."""

    def __init__(self, args) -> None:
        from . import config as _config
        from .sources import FileList

        self.root = os.path.abspath(args.root)
        self.rel_paths = list_dataset(self.root)
        if not self.rel_paths:
            raise _native.ConfigError(f"the dataset directory {self.root} holds no files")
        self.index = {p: i for i, p in enumerate(self.rel_paths)}
        self.source = FileList([os.path.join(self.root, p) for p in self.rel_paths], [0] * len(self.rel_paths), index_dir=args.index_dir)
        self.model = _config.resolve(args.config)


def _placement(ds: _Dataset, order_pattern, nodes: int) -> tuple[dict, str]:
    """How the engine places samples: by the order files ``order_pattern`` (None: by hashed
    owners); returns the engine's ``agent`` argument and an id of the orders."""
    if not order_pattern:
        return {"prefill": False, "hashed": ds.root}, ""
    files = [order_pattern.replace("{node}", str(i)) for i in range(nodes)]
    if nodes > 1 and len(set(files)) == 1:
        raise _native.ConfigError(
            "with several nodes the order file must name each node's reads: put {node} in its path "
            f"(got {order_pattern})"
        )
    import hashlib

    import numpy as np

    total = len(ds.rel_paths)
    counts = [access_counts(read_order_file(f, ds.root, ds.index), total) for f in files]
    # Files no node's order reads are placed as without an order (hashed owners) and
    # filled when a program first reads them.
    agent = {"prefill": True, "counts": counts, "hashed": ds.root}
    outside = int(np.count_nonzero(np.all([c == 0 for c, _ in counts], axis=0)))
    if outside:
        print(
            f"clairvoyant agent: the order reads {total - outside} of the {total} files; "
            f"files outside it: {outside}, placed by hashed owners and cached when first read",
            file=sys.stderr,
            flush=True,
        )
    order_id = hashlib.blake2b(b"".join(c.tobytes() + fn.tobytes() for c, fn in counts), digest_size=8).hexdigest()
    return agent, order_id


def _start_engine(ds: _Dataset, args, order_pattern):
    """The engine (and, with several nodes, the peer set-up) placing by the order files
    ``order_pattern`` (None: by hashed owners)."""
    nodes, node = max(1, args.nodes), args.node
    agent, order_id = _placement(ds, order_pattern, nodes)
    cluster, peers = None, None
    if nodes > 1:
        from . import _peers

        os.environ.setdefault("CLAIRVOYANT_RENDEZVOUS", "file")
        peers = _peers.setup(
            source=ds.source,
            model=ds.model,
            rank=node,
            world_size=nodes,
            local_ranks=[node],
            run_id=args.run_id,
            facts={"transparent": ds.root, "order": order_id},
        )
        cluster = peers.cluster
    # The agent consumes no stream: its schedule (one pass, batch 1, one rank per node, the
    # last odd sample dropped) only satisfies the engine's checks; placement comes from
    # `agent`.
    try:
        engine = _native.Engine(
            ds.source._native, 1, 1, 0, True, node, nodes, [node], args.run_id or f"agent-{os.getpid()}",
            ds.model, None, 0, cluster, agent,
        )  # fmt: skip
    except BaseException:
        if peers is not None and peers.server is not None:
            peers.server.close()
        raise
    if peers is not None and peers.server is not None:
        peers.server.attach(engine)
    return engine, peers


def _announce(args, ds: _Dataset, started: float) -> None:
    """Tell the launcher that the agent is ready (its pid file, the ready pipe) and say so."""
    with open(os.path.join(os.path.dirname(args.socket), "agent.pid"), "w") as f:
        f.write(f"{os.getpid()}\n")
    if args.ready_fd is not None:
        os.write(args.ready_fd, b"1")
        os.close(args.ready_fd)
    how = "known order" if args.order_file else "order from the program's sampler, else not known" if args.lazy else "order not known"
    print(
        f"clairvoyant agent: node {args.node} of {max(1, args.nodes)}, {len(ds.rel_paths)} files under {ds.root}, {how}, "
        f"ready in {time.monotonic() - started:.1f} s",
        file=sys.stderr,
        flush=True,
    )


def _wait_for_order(server, idle_wait: float):
    """Without an engine yet: the program's first event (its order, or a read without one), or
    None when the programs finished or none attached within ``idle_wait`` seconds."""
    waited = 0.0
    while True:
        event = server.wait_event(1.0)
        if event is not None or server.finished():
            return event
        waited += 1.0
        if waited > idle_wait and server.attached == 0:
            return None


def _serve(server, ds: _Dataset, args, engine, peers) -> bool:
    """Serve until the programs are done (and, with several nodes, the other nodes' agents);
    True on a clean end. Closes the server, the engine and the peer server."""
    try:
        lingered = False
        while True:
            if engine is None:
                # Placed when the program says its order, or at its first read without one.
                event = _wait_for_order(server, args.idle_wait)
                if event is not None:
                    kind, pattern = event
                    print(f"clairvoyant agent: placing by {'the order in ' + pattern if kind == 'plan' else 'hashed owners (no order came before the first read)'}", file=sys.stderr, flush=True)
                    engine, peers = _start_engine(ds, args, pattern if kind == "plan" else None)
                    server.set_engine(engine)
            if engine is not None:
                server.wait_idle(args.idle_wait)
            if peers is not None and not lingered:
                # Launchers may still attach meanwhile: the look under the lock comes after.
                _leave_together(args.node, max(1, args.nodes), args.run_id, peers.cluster["peers"])
                lingered = True
            if _left_alone(server, args, peers):
                break
        return True
    finally:
        if peers is not None:
            print(f"clairvoyant agent: peers: {engine.peer_stats()}", file=sys.stderr, flush=True)
        server.close()
        if engine is not None:
            engine.close()
        if peers is not None and peers.server is not None:
            peers.server.close()


def _left_alone(server, args, peers) -> bool:
    """Whether no launcher is attached or attaching, and if so stop taking launchers and close
    the peer server. A launcher attaches while it holds the agent folder's lock, so the agent
    looks under that lock: one that took it meanwhile is attached by then (the agent stays for
    it), and one that takes it after finds no agent and starts a new one, rather than attaching
    to an agent on its way out; the new one's peer server can bind the port this one's held."""
    import fcntl

    from ._run import _open_lock

    try:
        lock = _open_lock(os.path.join(os.path.dirname(args.socket), "agent.lock"))
    except OSError:
        return True  # the folder is gone: no launcher can find this agent
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if server.attached:
            return False
        server.close()
        if peers is not None and peers.server is not None:
            peers.server.close()
        return True
    finally:
        os.close(lock)


def main(argv=None) -> int:
    args = _parse(argv)
    started = time.monotonic()
    ds = _Dataset(args)
    engine, peers = (None, None) if args.lazy else _start_engine(ds, args, args.order_file)
    server = _native.AgentServer(engine, args.socket, ds.root, ds.rel_paths, args.dir)
    if engine is not None and not args.order_file and max(1, args.nodes) == 1:
        # Order unknown, nothing to fetch from peers: a program reads a miss itself, as it
        # would directly, and hands the bytes to the node cache without waiting for an answer.
        server.let_programs_fill()
    _announce(args, ds, started)
    if args.lazy:
        # Placing by an order needs numpy; imported now, while the programs start, not when
        # their order arrives. Serving an unknown order needs none (its start stays light).
        import numpy  # noqa: F401
    if _serve(server, ds, args, engine, peers):
        # Its log goes too: a failed agent's folder stays (for its log) until the next launcher
        # on the node reclaims it.
        from ._run import reclaim_agent_dir

        reclaim_agent_dir(os.path.dirname(args.socket))
    return 0


#: How often a leaving agent checks that the agents it waits for are still there, how long one
#: check may take, and how many checks in a row may go unanswered before that agent counts as
#: gone (a refused connection counts at once).
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0
PROBE_MISSES = 3


def _leave_together(node: int, nodes: int, run_id: str, addresses: list) -> None:
    """Keep serving the other nodes until every node's programs have finished (their reads of
    this node's cache would otherwise fall back to the file system), at most
    ``CLAIRVOYANT_AGENT_LINGER`` seconds (default 300); but not for an agent that is gone (its
    peer server refuses connections, or does not answer :data:`PROBE_MISSES` checks in a row):
    the nodes' meeting cannot complete without it, and its programs read the file system
    directly now."""
    from . import _cluster

    linger = _settings.get("CLAIRVOYANT_AGENT_LINGER")
    done, cancel, failed = threading.Event(), threading.Event(), []

    def meet():
        try:
            _cluster.allgather(b"done", rank=node, world_size=nodes, run_id=run_id, timeout=linger, cancel=cancel)
        except BaseException as e:  # noqa: BLE001 - reported by the waiting thread
            failed.append(e)
        finally:
            done.set()

    meeting = threading.Thread(target=meet, name="clairvoyant-leave", daemon=True)
    meeting.start()
    misses = {i: 0 for i in range(len(addresses)) if i != node}
    gone = None
    while gone is None and not done.wait(PROBE_INTERVAL_S):
        for i, count in misses.items():
            why = _probe(addresses[i])
            if why is None:
                misses[i] = 0
                continue
            misses[i] = count + 1
            if why == "refused" or misses[i] >= PROBE_MISSES:
                gone = (i, why)
                break
    if gone is not None:
        # It may just have finished and left: give the meeting a moment to see its file.
        if not done.wait(2 * PROBE_INTERVAL_S):
            cancel.set()
            meeting.join(timeout=10)
            i, why = gone
            print(
                f"clairvoyant agent: node {i}'s agent is gone (its peer server at {addresses[i]}: {why}); "
                "leaving without waiting for the other nodes",
                file=sys.stderr,
                flush=True,
            )
            return
    if failed:
        print(f"clairvoyant agent: leaving without the other nodes: {failed[0]}", file=sys.stderr, flush=True)


def _probe(address: str) -> str | None:
    """None when a peer server listens at ``address`` (``host:port``, ``[v6]:port``), else why
    not: "refused" (nothing listens: its process is gone) or another reason."""
    import socket

    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
            return None
    except ConnectionRefusedError:
        return "refused"
    except (OSError, ValueError) as e:
        return str(e) or type(e).__name__


if __name__ == "__main__":
    try:
        sys.exit(main())
    except _native.ClairvoyantError as e:
        print(f"clairvoyant agent: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
