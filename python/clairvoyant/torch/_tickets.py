"""Batches handed to workers before their bytes are staged.

torch's multi-process iterator draws the next batch of indices while it hands the training loop
the current one (``_process_data`` calls ``_try_put_index`` first). If drawing waited for that
batch's bytes, every step would wait for the batch ``prefetch_factor x num_workers`` ahead of it:
in epoch 0, where the file system sets the pace, the loop would trail the staging by that many
batches.

So the sampler hands out a *ticket* at once: the batch's indices and a token. A feeder thread in
the loading process takes the job's batches in order as they are staged and posts, for each
token, where its bytes are on a :class:`Board` in shared memory; the worker holding the ticket
waits for its post. The loop then waits only for the batch it is about to use.

A post is (token + 1, status, count) in ``head[slot]`` and ``count`` descriptors (region,
offset, length) in ``where[slot]``, written before the head. A batch too large for a slot, with
samples in private memory, or that failed, is *spilled*: pickled to a file in a folder of this
user's shared memory, read and removed by the worker.

Once every ticket of an epoch is handed out, the feeder may take the predicted next epoch's
first batches *ahead* and post them for the workers to decode while they would idle (see
``_ahead``): ``ahead = [generation, first token, posted, final, adopted generation]`` and a
spill file per batch. The next epoch adopts them when it serves that pass.
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import threading
import time
import weakref
from typing import Optional

import numpy as np
import torch

from ..errors import CancelledError, ExhaustedError

__all__ = ["Ahead", "Board", "Feeder", "TICKET"]

# What ``Batch.where`` holds for a ticket (None: the dataset reads the batch itself).
TICKET = "ticket"

_READY = 1  # descriptors in the slot
_SPILLED = 2  # (descriptors, private bytes) in the spill file
_UNCACHED = 3  # clairvoyant could not read a sample: the dataset reads the batch
_FAILED = 4  # the epoch ended: the error's kind in the count, its message in the spill file
_PARTIAL = 5  # the batch's first ``count`` descriptors are in the slot, more are coming

# A descriptor's region for a sample clairvoyant could not read: the dataset reads it.
DATASET_READS = -1

# The widest batch a slot holds; wider ones spill.
_MAX_WIDTH = 4096


class Board:
    """Posts of where each ticket's bytes are, in shared memory (travels to the workers)."""

    def __init__(self, slots: int, width: int):
        self.width = max(1, min(int(width), _MAX_WIDTH))
        self.head = torch.zeros((slots, 3), dtype=torch.int64).share_memory_()
        self.where = torch.zeros((slots, self.width, 3), dtype=torch.int64).share_memory_()
        # [generation, first token, posted, final, adopted generation] of the batches taken ahead.
        self.ahead = torch.zeros(5, dtype=torch.int64).share_memory_()
        self.pid = os.getpid()  # the loading process
        self._views = None
        # The folder of spilled posts (made at the first): in this user's private folder of
        # shared memory, else in the temporary folder (its name cannot be guessed).
        try:
            from .._dirs import user_runtime_dir

            base = user_runtime_dir()
        except Exception:  # noqa: BLE001 - no usable shared memory folder
            import tempfile

            base = tempfile.gettempdir()
        self._spills = os.path.join(base, f"clairvoyant-spill-{self.pid}-{os.urandom(8).hex()}")

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_views"] = None
        return state

    def _arrays(self):
        if self._views is None:
            self._views = (self.head.numpy(), self.where.numpy(), self.ahead.numpy())
        return self._views[:2]

    def _ahead(self) -> np.ndarray:
        self._arrays()
        return self._views[2]

    # -- the loading process -----------------------------------------------------------------
    def post(self, token: int, where, private: dict) -> None:
        head, table = self._arrays()
        slot = token % head.shape[0]
        if private or len(where) > self.width:
            try:
                self._spill(token, (list(where), dict(private)))
            except OSError:  # no room in shared memory: the dataset reads the batch itself
                self.post_uncached(token)
                return
            self._publish(slot, token, _SPILLED, 0)
            return
        n = len(where)
        if n:
            table[slot, :n] = np.asarray(where, dtype=np.int64).reshape(n, 3)
        self._publish(slot, token, _READY, n)

    def post_part(self, token: int, start: int, where) -> bool:
        """Post where samples ``start`` on of ticket ``token`` are, before the rest of its batch is
        staged (its parts in order, then :meth:`post` or another final post). False when they do
        not fit the slot: the batch is then posted whole at its end."""
        head, table = self._arrays()
        slot = token % head.shape[0]
        n = len(where)
        end = start + n
        if end > self.width:
            return False
        if n:
            table[slot, start:end] = np.asarray(where, dtype=np.int64).reshape(n, 3)
        if start == 0:
            self._publish(slot, token, _PARTIAL, end)
        else:
            head[slot, 2] = end  # the descriptors first: a worker reads up to the count
        return True

    def end_parts(self, token: int, count: int) -> None:
        """Ticket ``token``'s batch is whole: its ``count`` descriptors are posted in parts."""
        self._publish(token % self.head.shape[0], token, _READY, count)

    def _publish(self, slot: int, token: int, status: int, count: int) -> None:
        head, _ = self._arrays()
        # The count before the status: a worker that saw a part reads the final count once it
        # sees a final status.
        head[slot, 2] = count
        head[slot, 1] = status
        head[slot, 0] = token + 1  # last: the post is complete

    def post_uncached(self, token: int) -> None:
        self._publish(token % self.head.shape[0], token, _UNCACHED, 0)

    def post_error(self, token: int, error: BaseException) -> None:
        """End ticket ``token`` with ``error`` (its message travels in a spill file when there
        is room for one; the error's kind always does)."""
        try:
            self._spill(token, str(error))
        except OSError:
            pass
        self._publish(token % self.head.shape[0], token, _FAILED, 2 if isinstance(error, ExhaustedError) else 1)

    def _spill(self, token, payload) -> None:
        folder = self._spills
        if not os.path.isdir(folder):
            _remove_stale(os.path.dirname(folder))
        os.makedirs(folder, mode=0o700, exist_ok=True)
        path = os.path.join(folder, str(token))
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)

    # -- batches taken ahead (the loading process) --------------------------------------------
    def begin_ahead(self, gen: int, first: int) -> None:
        a = self._ahead()
        a[2] = a[3] = 0
        a[1] = first
        a[0] = gen  # last: the header is complete

    def post_ahead(self, gen: int, j: int, token: int, indices: list, where, private: dict) -> bool:
        """Post the ``j``-th batch taken ahead (False when there is no room to spill it)."""
        try:
            self._spill(f"ahead-{gen}-{j}", (token, list(indices), [tuple(w) for w in where], dict(private)))
        except OSError:
            return False
        self._ahead()[2] = j + 1
        return True

    def end_ahead(self) -> None:
        self._ahead()[3] = 1

    def adopt(self, gen: int) -> None:
        """The epoch now served is the one whose batches were taken ahead as ``gen``."""
        self._ahead()[4] = gen

    # -- batches taken ahead (a worker) -------------------------------------------------------
    def ahead_header(self) -> tuple:
        """(generation, first token, posted, final, adopted generation)."""
        return tuple(int(x) for x in self._ahead())

    def read_ahead(self, gen: int, j: int):
        """(token, indices, where, private) of the ``j``-th batch taken ahead as ``gen``, or None."""
        path = os.path.join(self._spills, f"ahead-{gen}-{j}")
        try:
            with open(path, "rb") as f:
                payload = pickle.load(f)
            os.unlink(path)
        except (OSError, pickle.UnpicklingError, EOFError):
            return None
        return payload

    def clean(self) -> None:
        """Remove spilled posts no worker read (their workers were stopped)."""
        if os.getpid() == self.pid:
            shutil.rmtree(self._spills, ignore_errors=True)

    # -- a worker ----------------------------------------------------------------------------
    def redeem(self, token: int) -> tuple:
        """(where, private) of ticket ``token`` once posted: where None means the dataset reads
        the batch itself. Raises the error that ended the batch's epoch."""
        self._wait(token, lambda head, slot: head[slot, 1] != _PARTIAL)
        return self._final(token)

    def redeem_from(self, token: int, k: int) -> tuple:
        """(where, private, final) of ticket ``token`` from its sample ``k`` on, as soon as sample
        ``k`` is posted: ``where`` holds the descriptors of samples ``k``, ``k + 1``, ... posted so
        far (all of them when ``final``); None: the dataset reads the batch from ``k`` on.
        ``private`` is keyed by the sample's place in the batch. Raises the error that ended the
        batch's epoch."""
        # After a batch's first part the worker has just computed samples: the next part is at
        # least a sample's read away, so the wait polls less often from its start.
        self._wait(token, lambda head, slot: head[slot, 1] != _PARTIAL or head[slot, 2] > k, 2e-5 if k == 0 else 2e-4)
        head, table = self._arrays()
        slot = token % head.shape[0]
        if head[slot, 1] == _PARTIAL:
            n = int(head[slot, 2])
            return [tuple(row) for row in table[slot, k:n].tolist()], {}, False
        where, private = self._final(token)
        return (None if where is None else where[k:]), private, True

    def _wait(self, token: int, ready, delay: float = 2e-5) -> None:
        """Until ticket ``token`` is posted and ``ready(head, slot)``, polling every ``delay``
        seconds at first, then less often (up to every millisecond)."""
        head, _ = self._arrays()
        slot = token % head.shape[0]
        checked, parent = time.monotonic(), os.getppid()
        while head[slot, 0] != token + 1 or not ready(head, slot):
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
            now = time.monotonic()
            if now - checked > 1.0:
                checked = now
                # Orphaned (the parent's exit reparents its children at once, even while it is
                # an unreaped zombie), or the loading process is gone.
                gone = os.getppid() != parent
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    gone = True
                except PermissionError:  # pragma: no cover - alive, another user's pid
                    pass
                if gone:
                    raise CancelledError(f"the loading process {self.pid} exited before batch {token}'s bytes were staged")

    def _final(self, token: int) -> tuple:
        """(where, private) of ticket ``token``, whose final post is in."""
        head, table = self._arrays()
        slot = token % head.shape[0]
        status = int(head[slot, 1])
        if status == _READY:
            n = int(head[slot, 2])
            return [tuple(row) for row in table[slot, :n].tolist()], {}
        if status == _UNCACHED:
            return None, {}
        kind = int(head[slot, 2])
        path = os.path.join(self._spills, str(token))
        try:
            with open(path, "rb") as f:
                payload = pickle.load(f)
            os.unlink(path)
        except OSError:  # an error's message is left out when there was no room for it
            if status == _SPILLED:
                raise
            payload = f"batch {token} was not staged: its epoch ended"
        if status == _SPILLED:
            where, private = payload
            return where, private
        raise (ExhaustedError if kind == 2 else CancelledError)(payload)


def _remove_stale(base: str) -> None:
    """Remove the spill folders in ``base`` of loading processes that are gone (killed: a
    process that exits cleans its own)."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) != 4 or parts[:2] != ["clairvoyant", "spill"] or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
            continue  # alive (or its pid is another process's now)
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)


class Feeder:
    """Takes one epoch's batches from the job in order, as they are staged, and posts them for
    the tickets handed out so far (never more: a slot is reused ``slots`` tokens later)."""

    def __init__(
        self,
        board: Board,
        src,
        first: int,
        total: int,
        leases: dict,
        lock: threading.Lock,
        what: str,
        engine=None,
        pre: tuple = (),
        ahead=None,
    ):
        self.board, self.src, self.engine = board, src, engine  # engine: interrupted by stop()
        self.first, self.total = first, total
        # The first batches, already taken ahead by the previous epoch's feeder.
        self.pre = list(pre)
        # Called in the feeder's thread once every batch is posted: the next epoch's Ahead, or None.
        self.plan_ahead = ahead
        self.ahead: Optional[Ahead] = None  # what was taken ahead
        # Batches are posted in parts as they are staged (see _post_parts).
        self.parts = hasattr(src, "next_parts")
        self._taking_ahead = False
        self.leases = leases  # guarded by ``lock``
        self.what = what  # "epoch N", for messages
        self.handed = 0  # tickets handed out
        self.filled = 0  # tickets posted
        self.error: Optional[BaseException] = None  # ended the epoch: raised at the next hand-out
        self.stopping = False
        self.closed = False
        self._wake = threading.Condition(lock)
        self._thread = threading.Thread(target=self._run, name="clairvoyant-feed", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def hand(self) -> int:
        """Hand out the next ticket (its token); raises the error that ended the epoch."""
        with self._wake:
            if self.error is not None:
                raise self.error
            if self.closed:
                raise ExhaustedError(f"this iterator of {self.what} was left unfinished when the next epoch began; epochs are consumed in order")
            token = self.first + self.handed
            self.handed += 1
            self._wake.notify()
            return token

    def _run(self) -> None:
        end: Optional[BaseException] = None
        try:
            for k in range(self.total):
                with self._wake:
                    while self.handed <= k and not self.stopping:
                        self._wake.wait()
                    if self.stopping:
                        return
                token = self.first + k
                lease = None
                if self.parts and k >= len(self.pre):
                    # Any other error ends the epoch: the batch's samples are not all taken.
                    try:
                        self._post_parts(token)
                    except (CancelledError, ExhaustedError) as e:
                        end = self._ended(e)
                        return
                    except StopIteration:
                        return
                    self.filled = k + 1
                    continue
                try:
                    if k < len(self.pre):  # taken ahead: (None, ...) when a sample could not be read
                        lease, where, private = self.pre[k]
                        self.pre[k] = None
                    else:
                        lease, where, _labels, private = next(self.src)
                except (CancelledError, ExhaustedError) as e:
                    end = self._ended(e)
                    return
                except StopIteration:
                    return
                except Exception:
                    lease = None
                if lease is None:
                    # clairvoyant could not read a sample of this batch: the dataset reads the
                    # batch itself, as with torch's DataLoader (and fails as it would).
                    self.board.post_uncached(token)
                else:
                    with self._wake:
                        self.leases[token] = lease
                    self.board.post(token, where, private)
                del lease
                self.filled = k + 1
            if self.plan_ahead is not None:
                try:
                    self._take_ahead()
                except Exception:  # noqa: BLE001 - optional: the next epoch takes its batches itself
                    if self.ahead is not None:
                        self.ahead.intact = False
        except BaseException as e:  # noqa: BLE001 - posted to the workers, raised at the next hand-out
            end = e
            with self._wake:
                self.error = e
        finally:
            with self._wake:
                self.closed = True
                left = range(self.first + self.filled, self.first + self.handed)
            why = end or ExhaustedError(f"{self.what} was left unfinished when the next epoch began")
            for token in left:
                try:
                    self.board.post_error(token, why)
                except OSError:
                    pass

    def _ended(self, e: BaseException) -> Optional[BaseException]:
        """The job ended the epoch with ``e`` (None when the feed was being stopped): raised at
        the next hand-out and posted to the tickets left."""
        if self.stopping:
            return None
        with self._wake:
            self.error = e
        return e

    def _post_parts(self, token: int) -> None:
        """Take ticket ``token``'s batch in parts as they are staged, posting each at once, so
        that its worker decodes the first samples while the last are read (in epoch 0 the file
        system sets the pace: the batch is then ready one decode after its last sample, not one
        batch's decode). A sample clairvoyant could not read is read by the dataset."""
        parts = self.src.next_parts()  # StopIteration: the pass has no more batches
        where, private, progressive = [], {}, True
        for lease, got, _labels, priv, failed in parts:
            with self._wake:
                held = self.leases.setdefault(token, [])
                held.append(lease)
            start = len(where)
            got = list(got)
            if failed:
                got.append((DATASET_READS, 0, 0))
            where += got
            if priv:
                private.update((start + j, b) for j, b in priv.items())
                progressive = False  # private bytes travel in a spill file, with the whole batch
            if progressive:
                progressive = self.board.post_part(token, start, got)
            del lease
        if progressive:
            self.board.end_parts(token, len(where))
        else:
            self.board.post(token, where, private)

    def stop(self, patience: Optional[float] = None) -> None:
        """End the feed (the epoch is left): its waiting take is interrupted, the tickets not
        posted are posted as ended; a take ahead gets ``patience`` seconds to finish first
        (default ``_AHEAD_PATIENCE``). Returns once the thread is gone."""
        with self._wake:
            self.stopping = True
            self._wake.notify_all()
        if self._thread is threading.current_thread():
            return
        # A take ahead is let finish (its batch is the next epoch's first), for a while.
        patience = time.monotonic() + (_AHEAD_PATIENCE if patience is None else patience)
        while self._thread.is_alive():
            if self.engine is not None and not (self._taking_ahead and time.monotonic() < patience):
                self.engine.interrupt()
            self._thread.join(timeout=0.05)
        _LIVE.discard(self)

    def _take_ahead(self) -> None:
        """Take the next epoch's first batches (if it is predicted) and post them ahead."""
        ahead = self.plan_ahead(self.first + self.total)
        if ahead is None:
            return
        self.ahead = ahead
        board = self.board
        board.begin_ahead(ahead.gen, ahead.first)
        posting = True
        try:
            for j, indices in enumerate(ahead.batches):
                with self._wake:
                    if self.stopping:
                        return
                    self._taking_ahead = True
                try:
                    lease, where, _labels, private = next(ahead.src)
                except (CancelledError, ExhaustedError):
                    ahead.intact = False  # the pass's iterator was interrupted or ended
                    return
                except Exception:  # a sample it could not read: the dataset reads that batch
                    ahead.taken.append((None, None, None))
                    posting = False
                    continue
                finally:
                    self._taking_ahead = False
                ahead.taken.append((lease, where, dict(private)))
                del lease
                posting = posting and board.post_ahead(ahead.gen, j, ahead.first + j, indices, where, private)
        finally:
            board.end_ahead()


# How long the next epoch waits for a take ahead before interrupting it (seconds).
_AHEAD_PATIENCE = 2.0


class Ahead:
    """The next epoch's first batches, taken ahead of it: generation ``gen`` of pass ``pass_``,
    for tokens from ``first``. ``taken`` holds (lease, where, private) per batch taken (None
    for one clairvoyant could not read); ``intact``: ``src`` can go on serving the pass."""

    def __init__(self, gen: int, pass_: int, src, batches: list, first: int):
        self.gen, self.pass_, self.src, self.batches, self.first = gen, pass_, src, batches, first
        self.taken: list = []
        self.intact = True


# Feeders still running: stopped at exit, before the interpreter finalizes.
_LIVE: "weakref.WeakSet[Feeder]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for feeder in list(_LIVE):
        feeder.stop(patience=0)
