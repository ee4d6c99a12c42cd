"""``clairvoyant run --sampler-order``: the program's DataLoader tells the node agent its order.

At the first ``iter()`` of a DataLoader (in the main process) whose dataset's files lie under
the dataset root and whose sampler is a ``DistributedSampler`` (every rank's order is a function
of the seed and the epoch: the one-line drop-in's predictor, :mod:`clairvoyant._samplers`),
the node's first rank writes every node's reads for the next epochs as order files into the
agent's private directory (the node's other ranks wait for them), and every rank sends the agent
a ``Plan`` before its workers read. The agent places and prefetches by it, as with
``--order-file``; it refuses (a notice here) when a program already read the dataset. Epochs
planned: ``CLAIRVOYANT_EPOCHS``, else 3. Ranks are assumed on nodes in contiguous blocks
(rank r on node r // (world size / nodes)), as torchrun, srun and mpirun place them by default."""

from __future__ import annotations

import hashlib
import os
import sys

from . import _settings

_done = False


def _says(first_of_node: bool | None = None) -> bool:
    """Whether this process prints the node's notices: the node's first rank (``first_of_node``,
    else the launcher's local rank 0, or a process started alone), unless CLAIRVOYANT_QUIET."""
    if first_of_node is None:
        from ._run import reports_stats

        first_of_node = reports_stats(os.environ)
    return bool(first_of_node) and not _settings.get("CLAIRVOYANT_QUIET", False)


def _notice(msg: str, first_of_node: bool | None = None) -> None:
    """One line on stderr, once per node (see :func:`_says`)."""
    if _says(first_of_node):
        print(f"clairvoyant run: {msg}", file=sys.stderr, flush=True)


def _files_of(dataset):
    from ._samplers import folder_root

    fn = getattr(dataset, "__clairvoyant_files__", None)
    if callable(fn):
        return [os.fsdecode(p) for p in fn()]
    folder, indices = folder_root(dataset)
    if folder is None:
        return None
    order = range(len(folder.samples)) if indices is None else indices
    return [os.fsdecode(folder.samples[i][0]) for i in order]


def install(module) -> None:
    """Wrap ``module.DataLoader.__iter__`` (``module`` is ``torch.utils.data.dataloader``)."""
    cls = module.DataLoader
    original = cls.__iter__

    def __iter__(self):
        global _done
        if not _done:
            _done = True
            try:
                plan(self)
            except Exception as e:  # noqa: BLE001 - the program must run whatever happens here
                _notice(f"the sampler's order was not handed to the node agent: {e}")
        return original(self)

    cls.__iter__ = __iter__


def _orderable(loader, root: str):
    """``loader``'s order predictor and dataset files when the agent can place by them (every
    rank's order known, files under ``root``), else None (with a notice why, where useful)."""
    from torch.utils.data import DistributedSampler, IterableDataset

    from ._samplers import Predictor

    if isinstance(loader.dataset, IterableDataset):
        _notice(
            f"{type(loader.dataset).__name__} is an iterable-style dataset: its order cannot be known ahead; "
            "the node agent places by hashed owners"
        )
        return None
    sampler = loader.sampler
    pred = Predictor(loader)
    if not (pred.all_ranks and isinstance(sampler, DistributedSampler)):
        _notice(f"the order of {type(sampler).__name__} is not known for every rank; the node agent places without it")
        return None
    files = _files_of(loader.dataset)
    if files is None:
        _notice(f"{type(loader.dataset).__name__} names no files; the node agent places without the order")
        return None
    inside = os.path.join(os.path.abspath(root), "")
    files = [os.path.abspath(f) for f in files]
    if not all(f.startswith(inside) for f in files):
        return None
    return pred, files


def _write_orders(pattern: str, pred, files: list, nodes: int, per_node: int, first: int, epochs: int) -> set:
    """Each node's order file (``{node}`` in ``pattern``): its ranks' reads of ``epochs`` epochs
    from ``first``, one epoch per paragraph; returns the files read."""
    covered: set = set()
    for node in range(nodes):
        ranks = range(node * per_node, (node + 1) * per_node)
        path = pattern.replace("{node}", str(node))
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as f:
            for e in range(first, first + epochs):
                streams = []
                for r in ranks:
                    batches = pred.batches(e, r) or []
                    streams.append([i for b in batches for i in (b if isinstance(b, list) else [b])])
                # The node's reads interleaved rank by rank, as its ranks advance together.
                merged = [files[s[k]] for k in range(max(map(len, streams), default=0)) for s in streams if k < len(s)]
                covered.update(merged)
                # Names that are not UTF-8 travel as Python's surrogate escapes (the agent reads
                # them back the same way).
                f.write("\n".join(merged) + "\n\n")
        os.replace(tmp, path)
    return covered


def _send(socket: str, pattern: str, first_of_node: bool) -> tuple[bool, object]:
    """Hand the order files to the agent; returns whether it took them and its count of files
    (None when it did not say)."""
    from . import _native
    from .errors import ClairvoyantError

    client = _native.AgentClient(socket)
    try:
        client.plan(pattern)
        try:
            total = client.stats().get("files")
        except (ConnectionError, OSError):
            total = None  # the notice goes without the dataset's count
    except ClairvoyantError as e:
        _notice(f"the node agent did not take the sampler's order: {e}", first_of_node)
        return False, None
    finally:
        client.close()
    return True, total


def plan(loader) -> bool:
    """Send ``loader``'s future order to the node agent; whether the agent took it."""
    from ._samplers import epoch_of

    root = _settings.get("CLAIRVOYANT_ROOT")
    socket = _settings.get("CLAIRVOYANT_AGENT")
    if root is None or socket is None:
        return False  # not under `clairvoyant run`
    known = _orderable(loader, root)
    if known is None:
        return False
    pred, files = known
    sampler = loader.sampler
    nodes = _settings.get("CLAIRVOYANT_NODES", 1)
    world = int(sampler.num_replicas)
    if world % nodes:
        _notice(f"{world} ranks do not split evenly over {nodes} nodes; the node agent places without the order")
        return False
    per_node = world // nodes
    first_of_node = int(sampler.rank) % per_node == 0
    epochs = _settings.get("CLAIRVOYANT_EPOCHS", 3)
    first = epoch_of(sampler) or 0
    directory = os.path.dirname(socket)
    # Every rank derives the same name, so the agent sees one order. The name covers the
    # dataset's files: order files an earlier run left on this agent are taken only if the same.
    listed = hashlib.blake2b("\0".join(files).encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()
    facts = repr((root, len(files), listed, world, nodes, sampler.seed, sampler.shuffle, sampler.drop_last, epochs, first))
    key = hashlib.blake2b(facts.encode(), digest_size=8).hexdigest()
    pattern = os.path.join(directory, f"order-{key}-node{{node}}.txt")
    covered = _orders_once(pattern, first_of_node, lambda: _write_orders(pattern, pred, files, nodes, per_node, first, epochs))
    took, total = _send(socket, pattern, first_of_node)
    if not took:
        return False
    if _says(first_of_node):
        if covered is None:  # written before, by an earlier run on this agent
            covered = set().union(*(_order_files_of(pattern.replace("{node}", str(n))) for n in range(nodes)))
        _notice(
            f"the node agent places by the sampler's order ({epochs} epochs from epoch {first}){_coverage(root, covered, total)}",
            first_of_node,
        )
    return True


def _orders_once(pattern: str, first_of_node: bool, write, patience: float = 5.0):
    """Have the order files written once per node, and return what ``write`` returned where this
    rank ran it (else None). The files are the same for every rank: the node's first rank runs
    ``write`` and then leaves a mark, the node's other ranks wait for the mark. A rank that waits
    ``patience`` seconds (the first rank iterates another loader first, or died) writes the files
    itself. The mark stays with the files: a later run of the same job on this agent (the same
    name, see :func:`plan`) finds them written."""
    import time

    mark = pattern.replace("{node}", "written")
    if os.path.exists(mark):
        return None
    if first_of_node:
        out = write()
        with open(mark, "w"):
            pass
        return out
    from ._cluster import _pauses  # imported while this rank waits anyway

    deadline, pauses = time.monotonic() + patience, _pauses()
    while not os.path.exists(mark):
        if time.monotonic() >= deadline:
            return write()
        time.sleep(next(pauses))
    return None


def _order_files_of(path: str) -> set:
    """The files one node's order file names."""
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        return {line for line in f.read().split("\n") if line}


def _coverage(root: str, covered: set, total) -> str:
    """What the predicted order covers of the dataset, for the notice: how many of the agent's
    ``total`` files it reads, how many it leaves out (cached when first read, as without an
    order) and the root's top-level entries that hold none of its files (an ImageNet layout's
    ``val/`` beside ``train/``)."""
    inside = os.path.join(os.path.abspath(root), "")
    tops = {f[len(inside) :].split(os.sep, 1)[0] for f in covered}
    try:
        entries = sorted(e for e in os.listdir(root) if not e.startswith("."))
    except OSError:
        entries = []

    def named(e):
        return e + ("/" if os.path.isdir(os.path.join(root, e)) else "")

    def shown(names):
        # Only the five named are looked up: a flat root holds the whole dataset's files.
        return ", ".join(named(e) for e in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

    others = [e for e in entries if e not in tops]
    where = ", ".join(named(e) for e in sorted(tops)[:5])
    text = f"; the order covers {len(covered)} files, under {where}"
    if isinstance(total, int) and total > len(covered):
        text += f", of the {total} files of the dataset; files outside it: {total - len(covered)}"
        if others:
            text += f" ({shown(others)})"
        text += ", cached when first read"
    elif others:
        text += f": {shown(others)} of the root are not in it"
    return text
