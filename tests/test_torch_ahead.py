"""Persistent workers decode the next epoch's first batches while they would idle
(``clairvoyant.torch._ahead``): the batches stay torch's, whatever happens between epochs."""

import random
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DistributedSampler  # noqa: E402

import clairvoyant.torch as ct  # noqa: E402
from clairvoyant.errors import CancelledError  # noqa: E402
from clairvoyant.torch import _tickets  # noqa: E402


class Files(torch.utils.data.Dataset):
    """Files of bytes; an item draws from the worker's three generators and says when (the
    system-wide monotonic clock) and in which process it was made."""

    def __init__(self, root, n):
        self.paths = []
        for i in range(n):
            p = root / f"{i}.bin"
            p.write_bytes(bytes([i % 251]) * (100 + i))
            self.paths.append(str(p))

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            return self.__clairvoyant_getitem__(i, f.read())

    def __clairvoyant_files__(self):
        return self.paths

    def __clairvoyant_getitem__(self, i, data):
        draws = torch.tensor([float(torch.rand(1)), random.random(), float(np.random.rand())])
        return {"i": i, "n": len(data), "first": data[0], "draws": draws, "at": time.monotonic()}


def _noisy_collate(items):
    # A collate_fn that draws too (mixup-like): it runs in the worker after the items.
    out = torch.utils.data.default_collate(items)
    out["mix"] = torch.rand(1)
    return out


def _epochs(DL, root, epochs=(0, 1, 2), pause=0.0, collate=None, n=40, **kw):
    """Per epoch: the batches (without times) and the times of the first batch's items and of
    the epoch's iter()."""
    ds = Files(root, n)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, seed=3)
    loader = DL(
        ds,
        batch_size=4,
        sampler=sampler,
        num_workers=2,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(11),
        collate_fn=collate,
        **kw,
    )
    out = []
    for e in epochs:
        sampler.set_epoch(e)
        time.sleep(pause)  # the training loop's own end of epoch: workers idle
        began = time.monotonic()
        batches = list(loader)
        first = batches[0]["at"].tolist()
        for b in batches:
            del b["at"]
        out.append((e, [{k: v.tolist() for k, v in b.items()} for b in batches], began, first))
    if isinstance(loader, ct.DataLoader):
        loader.close()
    return out


def _both(tmp_path, **kw):
    """torch's loader and clairvoyant's on two copies of the files: the same batches."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ref = _epochs(torch.utils.data.DataLoader, tmp_path / "a", **kw)
    got = _epochs(ct.DataLoader, tmp_path / "b", **kw)
    assert [(e, b) for e, b, _, _ in got] == [(e, b) for e, b, _, _ in ref]
    return ref, got


def test_the_next_epoch_s_first_batches_are_decoded_before_it_begins(tmp_path):
    ref, got = _both(tmp_path, pause=0.5)
    # torch decodes each epoch's first batch after its iter(); clairvoyant's idle workers
    # decoded epochs 1 and 2's first batches before theirs.
    for e, _, began, first in ref:
        assert min(first) > began, e
    assert min(got[0][3]) > got[0][2]
    for e, _, began, first in got[1:]:
        assert max(first) < began, f"epoch {e}'s first batch was decoded {max(first) - began:.3f} s after its iter()"


def test_a_collate_fn_that_draws_gets_torch_s_batches(tmp_path):
    ref, got = _both(tmp_path, pause=0.3, collate=_noisy_collate)
    assert max(got[1][3]) < got[1][2]


def test_an_epoch_other_than_the_predicted_one_drops_what_was_decoded_ahead(tmp_path):
    # Epoch 1 is predicted after epoch 0 and decoded ahead; the loop goes to epoch 7 instead.
    ref, got = _both(tmp_path, epochs=(0, 7, 8), pause=0.3)
    assert min(got[1][3]) > got[1][2]  # epoch 7 was decoded after its iter()
    assert max(got[2][3]) < got[2][2]  # epoch 8, predicted after 7, before its own


def test_turned_off_nothing_is_decoded_ahead(tmp_path, monkeypatch):
    monkeypatch.setenv("CLAIRVOYANT_DECODE_AHEAD", "0")
    (tmp_path / "b").mkdir()
    got = _epochs(ct.DataLoader, tmp_path / "b", pause=0.3)
    for e, _, began, first in got:
        assert min(first) > began, e


def test_a_peek_and_a_short_last_batch_keep_torch_s_batches(tmp_path):
    # 41 samples: the last batch of each epoch is short; a peek restarts epoch 1.
    out = {}
    for name, DL in (("a", torch.utils.data.DataLoader), ("b", ct.DataLoader)):
        (tmp_path / name).mkdir()
        ds = Files(tmp_path / name, 41)
        sampler = DistributedSampler(ds, num_replicas=1, rank=0, seed=4)
        loader = DL(ds, batch_size=4, sampler=sampler, num_workers=2, persistent_workers=True, generator=torch.Generator().manual_seed(2))
        seen = []
        for e in range(3):
            sampler.set_epoch(e)
            time.sleep(0.2)
            if e == 1:
                peek = next(iter(loader))
                seen.append(("peek", peek["i"].tolist(), peek["draws"].tolist()))
            seen += [(e, b["i"].tolist(), b["draws"].tolist()) for b in loader]
        if DL is ct.DataLoader:
            loader.close()
        out[name] = seen
    assert out["b"] == out["a"]


# -- the feeder's side ----------------------------------------------------------------------


class _Src:
    """A pass's batch iterator: staged when the test says so, interruptible."""

    def __init__(self, n, auto=False):
        self.n, self.k, self.auto = n, 0, auto
        self.staged = threading.Semaphore(0)
        self.interrupted = threading.Event()

    def __next__(self):
        while not (self.auto or self.staged.acquire(timeout=0.01)):
            if self.interrupted.is_set():
                self.interrupted.clear()
                raise CancelledError("interrupted")
        if self.k >= self.n:
            raise StopIteration
        self.k += 1
        return (object(), [(0, self.k * 10, 3)], np.zeros(1, dtype=np.int64), {})


class _Engine:
    def __init__(self, *srcs):
        self.srcs = srcs

    def interrupt(self):
        for s in self.srcs:
            s.interrupted.set()


def _wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_feeder_takes_the_next_epoch_s_first_batches_and_posts_them_ahead():
    board = _tickets.Board(16, 4)
    now, nxt = _Src(2, auto=True), _Src(5, auto=True)
    plans = []

    def plan(first):
        plans.append(first)
        return _tickets.Ahead(7, 1, nxt, [[1], [2], [3]], first)

    feeder = _tickets.Feeder(board, now, 10, 2, {}, threading.Lock(), "epoch 0", _Engine(now, nxt), (), plan)
    feeder.hand(), feeder.hand()
    _wait_for(lambda: board.ahead_header()[3] == 1)
    feeder.stop()
    assert plans == [12]
    assert board.ahead_header()[:4] == (7, 12, 3, 1)
    assert [board.read_ahead(7, j)[:2] for j in range(3)] == [(12, [1]), (13, [2]), (14, [3])]
    assert feeder.ahead.intact and len(feeder.ahead.taken) == 3
    # The next epoch's feeder posts the batches taken ahead at once, then goes on with the pass.
    board.adopt(7)
    leases = {}
    second = _tickets.Feeder(board, nxt, 12, 5, leases, threading.Lock(), "epoch 1", None, feeder.ahead.taken)
    for _ in range(5):
        second.hand()
    assert [board.redeem(t)[0] for t in range(12, 17)] == [[(0, k * 10, 3)] for k in range(1, 6)]
    second.stop()
    assert board.ahead_header()[4] == 7


def test_a_take_ahead_that_cannot_finish_is_interrupted_and_its_pass_is_not_adopted(monkeypatch):
    monkeypatch.setattr(_tickets, "_AHEAD_PATIENCE", 0.2)
    board = _tickets.Board(16, 4)
    now, nxt = _Src(1, auto=True), _Src(3)  # the next pass's batches are never staged
    feeder = _tickets.Feeder(
        board, now, 0, 1, {}, threading.Lock(), "epoch 0", _Engine(now, nxt), (), lambda first: _tickets.Ahead(1, 1, nxt, [[0], [1]], first)
    )
    feeder.hand()
    _wait_for(lambda: board.ahead_header()[0] == 1)
    began = time.monotonic()
    feeder.stop()
    assert 0.15 < time.monotonic() - began < 2.0  # waited its patience, then interrupted
    assert not feeder.ahead.intact
    assert board.ahead_header()[3] == 1  # final: waiting workers give up


def test_a_pass_whose_take_ahead_was_interrupted_is_skipped_and_the_epoch_still_torch_s(tmp_path, monkeypatch):
    # As when the next epoch interrupts a take ahead that did not finish in time: the pass's
    # iterator is not intact, so the epoch is appended anew and what was decoded ahead dropped.
    take = _tickets.Feeder._take_ahead

    def interrupted(self):
        take(self)
        if self.ahead is not None:
            self.ahead.intact = False

    monkeypatch.setattr(_tickets.Feeder, "_take_ahead", interrupted)
    ref, got = _both(tmp_path, pause=0.3)
    for e, _, began, first in got:
        assert min(first) > began, e


def test_a_take_ahead_that_fails_leaves_the_epoch_and_the_next_hand_out_alone():
    board = _tickets.Board(16, 4)
    now = _Src(1, auto=True)

    def plan(first):
        raise CancelledError("the job is closed")

    feeder = _tickets.Feeder(board, now, 0, 1, {}, threading.Lock(), "epoch 0", _Engine(now), (), plan)
    feeder.hand()
    assert board.redeem(0)[0] == [(0, 10, 3)]
    feeder._thread.join(5)
    assert feeder.error is None and feeder.ahead is None
    feeder.stop()


def test_a_batch_taken_ahead_that_could_not_be_read_is_read_by_the_dataset():
    board = _tickets.Board(16, 4)
    nxt = _Src(3, auto=True)
    feeder = _tickets.Feeder(board, nxt, 0, 2, {}, threading.Lock(), "epoch 1", None, [(None, None, None)])
    feeder.hand(), feeder.hand()
    assert board.redeem(0) == (None, {})  # uncached: the dataset reads it itself
    assert board.redeem(1)[0] == [(0, 10, 3)]  # then the pass goes on
    feeder.stop()
