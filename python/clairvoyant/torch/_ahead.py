"""Persistent workers decode the next epoch's first batches while they would idle.

With persistent workers, a worker idles from its last batch of an epoch until the next epoch's
``iter()``; then every worker decodes at once and the training loop waits for the first batch.
When the next epoch is predicted, the feeder (``_tickets``) takes that epoch's first
``prefetch_factor x num_workers`` batches as soon as the current epoch's tickets are all handed
out and posts them *ahead*. Each worker, once its own last batch is collated, decodes on a
thread the ones torch's iterator will send it (an epoch's first batches go round robin from
worker 0), and keeps the items.

Exact by construction. A worker uses items decoded ahead only when

- the loading process *adopted* them (the next epoch is served by that very pass, so the bytes
  were leased throughout and the request's post is the one decoded),
- the request's indices are those decoded, and
- the worker's random states (torch, ``random``, numpy) are those the decode started from;

then it sets its states to where the decode left them, as if it had decoded the batch now.
The thread also collates the items with the loader's ``collate_fn`` (the largest part of a
batch's cost once it is decoded: the batch tensor is written to shared memory); the wrapped
``collate_fn`` hands that result back, and the states after it, for those very items.
Otherwise the items are dropped. The decode ahead restores the states it started from, so a
dropped decode changed nothing the dataset's own code can see through those generators. (A
dataset that keeps other state, such as a private generator, sees one extra call per dropped
item; ``CLAIRVOYANT_DECODE_AHEAD=0`` turns the decode ahead off.)
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from typing import Optional

import numpy as np
import torch

from .. import _settings

__all__ = ["Collate", "after", "active", "claim", "wanted"]

# How long an idle worker waits for the next epoch's posts before it gives up (seconds).
_WAIT = 300.0


def wanted(loader) -> bool:
    """Whether this loader's workers decode ahead: persistent workers, automatic batching, in
    order (torch's first batches then go round robin), and not turned off."""
    return bool(
        loader.persistent_workers
        and loader.num_workers > 0
        and loader._auto_collation
        and getattr(loader, "in_order", True)
        and _settings.get("CLAIRVOYANT_DECODE_AHEAD", True)
    )


class Collate:
    """The loader's ``collate_fn`` (or what it gave for these very items, collated ahead),
    then the start of a scheduled decode ahead (the worker's last batch of the epoch is
    complete: nothing of it runs any more)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, batch):
        w = _STATE
        ready = w.collated if w is not None else None
        if ready is not None and ready[0] is batch:
            from ._datasets import set_rng_state

            w.collated = None
            out = ready[1]
            set_rng_state(ready[2])
        else:
            out = self.fn(batch)
        _collated(self.fn)
        return out


def _same_state(a: tuple, b: tuple) -> bool:
    if not (torch.equal(a[0], b[0]) and a[1] == b[1]):
        return False
    if a[2] is None or b[2] is None:
        return a[2] is b[2]
    return a[2][0] == b[2][0] and np.array_equal(a[2][1], b[2][1]) and tuple(a[2][2:]) == tuple(b[2][2:])


class _Early:
    """One batch decoded ahead."""

    __slots__ = ("gen", "token", "indices", "where", "private", "pre", "post", "items", "collated")

    def __init__(self, gen, token, indices, where, private, pre, post, items, collated):
        self.gen, self.token, self.indices, self.where, self.private = gen, token, indices, where, private
        self.pre, self.post, self.items = pre, post, items
        # (the collate function's result, the random states after it), or None
        self.collated = collated

    def adopted(self, req, board) -> bool:
        """These are the request's batch, and the loading process adopted them (their leases
        were held throughout; the request's post holds the same bytes). If not, every item
        decoded ahead is dropped."""
        if board.ahead_header()[4] == self.gen and list(req) == self.indices:
            return True
        _worker().results.clear()
        return False

    def use(self) -> Optional[list]:
        """(An adopted batch.) The items when the worker's random states are those the decode
        began from, so that they are what decoding the batch now would give; else None (and
        every item decoded ahead is dropped)."""
        from ._datasets import rng_state, set_rng_state

        if not _same_state(rng_state(), self.pre):
            _worker().results.clear()
            return None
        set_rng_state(self.post)
        items, self.items = self.items, None
        if self.collated is not None:  # torch collates these very items next
            _worker().collated = (items, *self.collated)
        return items


class _Worker:
    """This worker process's decode ahead."""

    def __init__(self):
        self.thread: Optional[threading.Thread] = None
        self.stop = threading.Event()
        self.wanted = -1  # the token the worker's request is for: its decode is finished
        self.pending: Optional[tuple] = None  # what to decode once the batch is collated
        self.results: dict = {}  # token -> _Early
        self.collated: Optional[tuple] = None  # (items, their collation, random states after it)

    def _wait(self, ready, deadline: float) -> bool:
        """Poll ``ready()`` (True: go on, False: give up, None: not yet) until the worker
        needs the thread to end."""
        delay = 5e-4
        while not self.stop.is_set() and time.monotonic() < deadline:
            got = ready()
            if got is not None:
                return got
            time.sleep(delay)
            delay = min(delay * 2, 5e-3)
        return False

    def run(self, dataset, first: int, wid: int, workers: int, segments, collate) -> None:
        from ._datasets import rng_state, set_rng_state

        board = dataset.board
        deadline = time.monotonic() + _WAIT

        def begun():
            """True once the posts ahead of the epoch that starts at token ``first`` begin."""
            gen, at = board.ahead_header()[:2]
            return True if gen > 0 and at == first else None

        if not self._wait(begun, deadline):
            return
        gen = board.ahead_header()[0]

        def posted(j: int):
            """True: batch j is posted; False: it never will be (another generation, or the
            posting ended); None: not yet."""
            h = board.ahead_header()
            if h[0] != gen:
                return False
            if h[2] > j:
                return True
            return False if h[3] else None

        pre = state = rng_state()
        try:
            for j in itertools.count(wid, workers):
                if not self._wait(functools.partial(posted, j), deadline):
                    return
                got = board.read_ahead(gen, j)
                if got is None:
                    return
                token, indices, where, private = got
                items = []
                for k, i in enumerate(indices):
                    if self.stop.is_set() and self.wanted != token:
                        return
                    items.append(dataset._sample(i, dataset._bytes(k, segments, where, private)))
                post = rng_state()
                collated = None
                try:
                    collated = (collate(items), rng_state())
                except Exception:  # noqa: BLE001 - collated when the batch is asked for, and fails then
                    set_rng_state(post)
                self.results[token] = _Early(gen, token, indices, where, dict(private), state, post, items, collated)
                state = post if collated is None else collated[1]
        except Exception:  # noqa: BLE001 - the request decodes the batch itself, and fails as it would
            return
        finally:
            set_rng_state(pre)


_STATE: Optional[_Worker] = None


def _worker() -> _Worker:
    global _STATE
    if _STATE is None:
        _STATE = _Worker()
    return _STATE


def active() -> bool:
    w = _STATE
    return w is not None and (w.thread is not None or bool(w.results) or w.pending is not None)


def claim(token: int) -> Optional[_Early]:
    """(At a request, before anything else runs.) End the decode ahead, letting it finish the
    batch for ``token``; that batch's items if they were decoded."""
    w = _STATE
    if w is None:
        return None
    w.pending = None
    w.collated = None
    t = w.thread
    if t is not None:
        w.wanted = token
        w.stop.set()
        t.join()
        w.thread = None
    return w.results.pop(token, None)


def after(dataset, req) -> None:
    """(After a batch of an epoch whose next epoch may be taken ahead.) Schedule the decode
    ahead when this was the worker's last batch of the epoch."""
    info = torch.utils.data.get_worker_info()
    if info is None or req.token + info.num_workers <= req.last:
        return
    w = _worker()
    w.results.clear()
    w.pending = (dataset, req.last + 1, info.id, info.num_workers, req.segments)


def _collated(collate) -> None:
    w = _STATE
    if w is None or w.pending is None:
        return
    args, w.pending = (*w.pending, collate), None
    w.stop.clear()
    w.wanted = -1
    w.thread = threading.Thread(target=w.run, args=args, name="clairvoyant-ahead", daemon=True)
    w.thread.start()
