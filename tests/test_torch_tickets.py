"""Tickets: the drop-in's sampler hands a batch to torch's workers before its bytes are staged,
and the worker waits for where they are (``clairvoyant.torch._tickets``)."""

import os
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import clairvoyant.torch as ct  # noqa: E402
from clairvoyant.errors import CancelledError, ExhaustedError  # noqa: E402
from clairvoyant.torch import _tickets  # noqa: E402


class _Src:
    """A job's batch iterator whose batches are staged when the test says so."""

    def __init__(self, batches):
        self.batches = list(batches)
        self.staged = threading.Semaphore(0)
        self.interrupted = threading.Event()
        self.taken = 0

    def __next__(self):
        while not self.staged.acquire(timeout=0.01):
            if self.interrupted.is_set():
                self.interrupted.clear()
                raise CancelledError("interrupted")
        item = self.batches[self.taken]
        self.taken += 1
        if isinstance(item, BaseException):
            raise item
        return item


class _Engine:
    def __init__(self, src):
        self.src = src

    def interrupt(self):
        self.src.interrupted.set()


def _batch(where, private=None):
    return (object(), where, np.zeros(len(where), dtype=np.int64), private or {})


def _later(fn, key):
    """Run ``fn`` in a thread, as a worker would: its value (under ``key``) or its error."""
    got = {}

    def run():
        try:
            got[key] = fn()
        except BaseException as e:  # noqa: BLE001 - what the worker would raise
            got["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, got


def _redeem_later(board, token):
    return _later(lambda: board.redeem(token), "value")


def _feeder(board, src, total, first=10):
    leases = {}
    return _tickets.Feeder(board, src, first, total, leases, threading.Lock(), "epoch 0"), leases


def test_tickets_are_handed_out_before_the_bytes_are_staged():
    board = _tickets.Board(8, 4)
    src = _Src([_batch([(0, 0, 5), (0, 5, 7)]), _batch([(1, 64, 3)])])
    feeder, leases = _feeder(board, src, 2)
    # Nothing is staged, yet both tickets are handed out at once.
    assert feeder.hand() == 10 and feeder.hand() == 11
    t, got = _redeem_later(board, 10)
    t.join(0.2)
    assert t.is_alive(), "the worker must wait for the post"
    src.staged.release()
    t.join(5)
    assert got["value"] == ([(0, 0, 5), (0, 5, 7)], {})
    assert 10 in leases  # the bytes stay leased until the worker says it is done
    src.staged.release()
    assert board.redeem(11) == ([(1, 64, 3)], {})
    feeder.stop()


def test_the_feeder_takes_no_batch_before_its_ticket_is_handed_out():
    board = _tickets.Board(8, 4)
    src = _Src([_batch([(0, 0, 1)])] * 3)
    for _ in range(3):
        src.staged.release()
    feeder, _ = _feeder(board, src, 3)
    threading.Event().wait(0.1)
    assert src.taken == 0  # a slot is reused later: never post past the tickets handed out
    feeder.hand()
    board.redeem(10)
    threading.Event().wait(0.05)
    assert src.taken == 1
    feeder.stop()


def test_wide_batches_and_private_bytes_are_spilled_and_the_spill_removed():
    board = _tickets.Board(8, 2)
    wide = [(0, 8 * i, 8) for i in range(5)]
    src = _Src([_batch(wide), _batch([(2, 0, 3)], {0: b"abc"})])
    feeder, _ = _feeder(board, src, 2)
    feeder.hand(), feeder.hand()
    src.staged.release(), src.staged.release()
    assert board.redeem(10) == (wide, {})
    assert board.redeem(11) == ([(2, 0, 3)], {0: b"abc"})
    assert os.listdir(board._spills) == []  # read and removed
    board.clean()
    assert not os.path.exists(board._spills)
    feeder.stop()


def test_without_room_to_spill_the_dataset_reads_the_batch_and_errors_still_arrive(tmp_path):
    board = _tickets.Board(8, 2)
    blocker = tmp_path / "full"
    blocker.write_bytes(b"")
    board._spills = str(blocker / "spill")  # cannot be created, as on a full file system
    wide = [(0, 8 * i, 8) for i in range(5)]
    src = _Src([_batch(wide), CancelledError("the job is closed")])
    feeder, _ = _feeder(board, src, 3)
    feeder.hand(), feeder.hand(), feeder.hand()
    src.staged.release(), src.staged.release()
    assert board.redeem(10) == (None, {})  # nothing lost: read as torch would
    for token in (11, 12):  # the error's kind arrives without its message file
        with pytest.raises(CancelledError):
            board.redeem(token)
    feeder.stop()


def test_a_batch_clairvoyant_could_not_read_is_read_by_the_dataset():
    board = _tickets.Board(8, 4)
    src = _Src([OSError("sample 3: no such file"), _batch([(0, 0, 1)])])
    feeder, _ = _feeder(board, src, 2)
    feeder.hand(), feeder.hand()
    src.staged.release(), src.staged.release()
    assert board.redeem(10) == (None, {})
    assert board.redeem(11) == ([(0, 0, 1)], {})
    feeder.stop()


def test_a_closed_job_fails_the_waiting_tickets_and_the_next_hand_out():
    board = _tickets.Board(8, 4)
    src = _Src([CancelledError("the job is closed"), _batch([(0, 0, 1)])])
    feeder, _ = _feeder(board, src, 2)
    feeder.hand(), feeder.hand()
    waiting = [_redeem_later(board, t) for t in (10, 11)]
    src.staged.release()
    for t, got in waiting:
        t.join(5)
        assert isinstance(got.get("error"), CancelledError) and "closed" in str(got["error"])
    with pytest.raises(CancelledError, match="closed"):
        feeder.hand()
    feeder.stop()


def test_stopping_interrupts_the_wait_and_ends_the_handed_tickets():
    board = _tickets.Board(8, 4)
    src = _Src([_batch([(0, 0, 1)])] * 4)
    feeder, _ = _feeder(board, src, 4)
    feeder.hand(), feeder.hand()
    t, got = _redeem_later(board, 10)
    feeder.engine = _Engine(src)
    feeder.stop()  # the take of batch 10 is waiting: interrupted, not waited out
    t.join(5)
    assert isinstance(got.get("error"), ExhaustedError)
    # Ticket 11 was handed out too: its worker is told, not left waiting.
    with pytest.raises(ExhaustedError):
        board.redeem(11)
    with pytest.raises(ExhaustedError, match="left unfinished"):
        feeder.hand()


class _Bytes(torch.utils.data.Dataset):
    """The dataset protocol over small files."""

    def __init__(self, root, n):
        self.files = []
        for i in range(n):
            p = os.path.join(root, f"{i}.bin")
            with open(p, "wb") as f:
                f.write(bytes([i % 251]) * (1 + i % 7))
            self.files.append(p)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with open(self.files[i], "rb") as f:
            return torch.tensor(list(f.read()), dtype=torch.int64).sum() * 1000 + i

    def __clairvoyant_files__(self):
        return self.files

    def __clairvoyant_getitem__(self, i, data):
        return torch.tensor(list(bytes(data)), dtype=torch.int64).sum() * 1000 + i


def test_batches_wider_than_a_slot_arrive_whole(tmp_path):
    ds = _Bytes(str(tmp_path), 320)
    rng = np.random.default_rng(1)
    batches = [rng.permutation(320)[:300].tolist(), list(range(5)), rng.permutation(320)[:290].tolist()]
    ref = [b.tolist() for b in torch.utils.data.DataLoader(ds, batch_sampler=batches, num_workers=2)]
    loader = ct.DataLoader(ds, batch_sampler=batches, num_workers=2)
    got = [b.tolist() for b in loader]
    stats = loader.stats()
    loader.close()
    assert got == ref
    assert stats and stats[0]["samples"] == 595  # from clairvoyant, through spilled tickets


_ORPHAN = r"""
import os, sys, time, torch
import clairvoyant, clairvoyant.torch as ct

root = sys.argv[1]
files = []
for i in range(64):
    p = os.path.join(root, f"{i}.bin")
    with open(p, "wb") as f:
        f.write(bytes(2000))
    files.append(p)

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return len(files)
    def __getitem__(self, i):
        return i
    def __clairvoyant_source__(self):
        fs = clairvoyant.EmulatedFs(os.path.join(root, "fs.state"), 5000.0, 1.0)  # 5 s per open
        return clairvoyant.FileList(files, [0] * len(files), emulated=fs)
    def __clairvoyant_getitem__(self, i, data):
        return i

loader = ct.DataLoader(Slow(), batch_size=4, num_workers=2, persistent_workers=True)
it = iter(loader)  # the workers get their first tickets and wait for the bytes
print(" ".join(str(w.pid) for w in it._workers), flush=True)
time.sleep(120)
"""


def test_workers_waiting_for_tickets_exit_when_the_training_process_is_killed(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN)
    (tmp_path / "data").mkdir()
    env = dict(os.environ, CLAIRVOYANT_QUIET="1")
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "data")], stdout=subprocess.PIPE, text=True, env=env)
    workers: list = []
    try:
        workers[:] = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2
        time.sleep(0.5)  # the workers now wait for their tickets' posts
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 20
        alive = workers
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [w for w in workers if _alive(w)]
        assert not alive, f"workers {alive} outlived the training process"
    finally:
        proc.kill()
        proc.wait()
        for w in workers:  # a failed run leaves none behind
            try:
                os.kill(w, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_spill_folders_of_killed_loading_processes_are_removed(tmp_path):
    import subprocess
    import sys

    board = _tickets.Board(8, 2)
    base = os.path.dirname(board._spills)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = os.path.join(base, f"clairvoyant-spill-{gone.pid}-{'0' * 16}")
    live = os.path.join(base, f"clairvoyant-spill-{os.getpid()}-{'1' * 16}")
    for d in (stale, live):
        os.makedirs(os.path.join(d, "inner"))
    try:
        board.post(3, [(0, 0, 1)] * 3, {})  # wider than a slot: spilled, the folder made
        assert board.redeem(3)[0] == [(0, 0, 1)] * 3
        assert not os.path.exists(stale)
        assert os.path.isdir(live)  # its process is alive
    finally:
        board.clean()
        import shutil

        shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


class _PartsSrc:
    """A job's batch iterator that stages each batch in parts when the test says so: a batch is
    a list of parts (where, private, failed), or an exception raised in its place."""

    def __init__(self, batches):
        self.batches = list(batches)
        self.staged = threading.Semaphore(0)
        self.taken = 0

    def next_parts(self):
        if self.taken >= len(self.batches):
            raise StopIteration
        parts = self.batches[self.taken]
        self.taken += 1
        return self._parts(parts)

    def _parts(self, parts):
        for part in parts:
            while not self.staged.acquire(timeout=0.01):
                pass
            if isinstance(part, BaseException):
                raise part
            where, private, failed = part
            yield object(), where, np.zeros(len(where), dtype=np.int64), private, failed


def test_a_batch_is_posted_in_parts_as_they_are_staged():
    board = _tickets.Board(8, 4)
    src = _PartsSrc([[([(0, 0, 5), (0, 5, 7)], {}, False), ([(1, 64, 3)], {}, False)]])
    feeder, leases = _feeder(board, src, 1)
    assert feeder.hand() == 10
    src.staged.release()
    # The first part reaches a worker before the batch is whole.
    assert board.redeem_from(10, 0) == ([(0, 0, 5), (0, 5, 7)], {}, False)
    assert board.redeem_from(10, 1) == ([(0, 5, 7)], {}, False)
    t, whole = _redeem_later(board, 10)
    t.join(0.2)
    assert t.is_alive(), "the whole batch is not posted yet"
    src.staged.release()
    t.join(5)
    assert whole["value"] == ([(0, 0, 5), (0, 5, 7), (1, 64, 3)], {})
    assert board.redeem_from(10, 2) == ([(1, 64, 3)], {}, True)
    assert len(leases[10]) == 2, "every part's samples stay leased until the worker is done"
    feeder.stop()


def test_a_sample_that_could_not_be_read_is_left_to_the_dataset_and_private_bytes_end_in_a_spill():
    board = _tickets.Board(8, 4)
    src = _PartsSrc([[([(0, 0, 5)], {}, True), ([(1, 8, 2)], {0: b"xy"}, False)]])
    feeder, _ = _feeder(board, src, 1)
    feeder.hand()
    src.staged.release()
    assert board.redeem_from(10, 0) == ([(0, 0, 5), (_tickets.DATASET_READS, 0, 0)], {}, False)
    src.staged.release()
    # Private bytes cannot be posted in a slot: the batch comes whole from a spill file.
    assert board.redeem_from(10, 2) == ([(1, 8, 2)], {2: b"xy"}, True)
    feeder.stop()


def test_an_epoch_that_ends_in_the_middle_of_a_batch_fails_its_ticket_and_keeps_the_parts_leased():
    board = _tickets.Board(8, 4)
    src = _PartsSrc([[([(0, 0, 5)], {}, False), CancelledError("the job is closed")]])
    feeder, leases = _feeder(board, src, 1)
    feeder.hand()
    src.staged.release()
    assert board.redeem_from(10, 0)[0] == [(0, 0, 5)]
    src.staged.release()
    with pytest.raises(CancelledError, match="closed"):
        board.redeem_from(10, 1)
    # A worker may still be computing the first part's samples: their bytes stay leased.
    assert len(leases[10]) == 1
    with pytest.raises(CancelledError, match="closed"):
        feeder.hand()
    feeder.stop()


class _Recording(torch.utils.data.Dataset):
    """A dataset of the protocol that records which samples it computed and how."""

    def __init__(self):
        self.calls = []

    def __len__(self):
        return 16

    def __getitem__(self, i):
        self.calls.append(("read", i))
        return ("read", i)

    def __clairvoyant_getitem__(self, i, data):
        self.calls.append(("staged", i))
        return ("staged", i, bytes(data))


def _worker(tmp_path, board):
    from clairvoyant.torch import _datasets

    region = tmp_path / "ring"
    region.write_bytes(b"abcdefghij")
    dataset = _Recording()
    cached = _datasets.CachedDataset(
        dataset, "protocol", torch.zeros(8, dtype=torch.int64), torch.zeros((0, 0), dtype=torch.uint8), board
    )
    return dataset, cached, _datasets.Batch([4, 7, 9], 10, [str(region)], _tickets.TICKET, {})


def _items_later(cached, req):
    return _later(lambda: cached.__getitems__(req), "items")


def _until(cond, what):
    deadline = time.monotonic() + 5
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_worker_computes_the_first_samples_of_a_batch_before_the_last_are_staged(tmp_path):
    board = _tickets.Board(8, 4)
    dataset, cached, req = _worker(tmp_path, board)
    board.post_part(10, 0, [(0, 0, 3)])
    t, got = _items_later(cached, req)
    _until(lambda: dataset.calls == [("staged", 4)], "the first sample is computed while the batch is incomplete")
    assert t.is_alive()
    board.post_part(10, 1, [(_tickets.DATASET_READS, 0, 0), (0, 5, 2)])
    board.end_parts(10, 3)
    t.join(5)
    assert got["items"] == [("staged", 4, b"abc"), ("read", 7), ("staged", 9, b"fg")]
    assert int(cached.done[10 % 8]) == 11, "the batch's bytes are given back"


def test_a_worker_whose_batch_fails_after_its_first_part_raises(tmp_path):
    board = _tickets.Board(8, 4)
    dataset, cached, req = _worker(tmp_path, board)
    board.post_part(10, 0, [(0, 0, 3)])
    t, got = _items_later(cached, req)
    _until(lambda: dataset.calls == [("staged", 4)], "the first sample is computed")
    board.post_error(10, CancelledError("the job was closed during epoch 0"))
    t.join(5)
    assert isinstance(got.get("error"), CancelledError) and "closed" in str(got["error"])
    assert int(cached.done[10 % 8]) == 11
