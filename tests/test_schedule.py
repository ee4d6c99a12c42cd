"""Access streams: golden orders, the documented algorithm, partition invariants."""

import numpy as np
import pytest

import clairvoyant
from reference_shuffle import permutation


def test_golden_orders_are_pinned():
    # Changing these changes every user's training order.
    assert clairvoyant.access_stream(10, 1, 0, 2, 10, 0)[0].tolist() == [1, 5, 4, 8, 7, 3, 0, 6, 2, 9]
    assert clairvoyant.access_stream(10, 1, 0, 2, 10, 0)[1].tolist() == [6, 4, 5, 2, 7, 8, 0, 3, 1, 9]


@pytest.mark.parametrize("n,seed,epoch", [(1, 0, 0), (17, 3, 2), (1000, 123456789, 7), (5000, 2**63 + 5, 1)])
def test_native_matches_documented_algorithm(n, seed, epoch):
    stream = clairvoyant.access_stream(n, 1, 0, epoch + 1, 1, seed)[epoch]
    assert stream.dtype == np.int64
    assert stream.tolist() == permutation(n, seed, epoch)


@pytest.mark.parametrize("n,world,batch,drop_last", [(8000, 4, 32, False), (1001, 3, 7, False), (1001, 3, 7, True), (66, 4, 8, False)])
def test_every_rank_same_batches_union_is_dataset(n, world, batch, drop_last):
    epochs = 3
    streams = [clairvoyant.access_stream(n, world, r, epochs, batch, 5, drop_last) for r in range(world)]
    for e in range(epochs):
        seen = np.concatenate([streams[r][e] for r in range(world)])
        assert len(np.unique(seen)) == len(seen), "a sample twice in one epoch"
        if drop_last:
            assert len(seen) == n // (world * batch) * world * batch
        else:
            assert sorted(seen.tolist()) == list(range(n))
        lengths = [len(streams[r][e]) for r in range(world)]
        assert max(lengths) - min(lengths) <= 1


def test_original_four_rank_example_is_even():
    lengths = [len(clairvoyant.access_stream(8000, 4, r, 1, 32, 0)[0]) for r in range(4)]
    assert lengths == [2000, 2000, 2000, 2000]


def test_explicit_order():
    orders = [[4, 3, 2, 1, 0, 5], [0, 0, 1, 1, 2, 2]]
    r0 = clairvoyant.access_stream_from_order(6, orders, 2, 0, 1)
    r1 = clairvoyant.access_stream_from_order(6, orders, 2, 1, 1)
    assert r0[0].tolist() == [4, 2, 0] and r1[0].tolist() == [3, 1, 5]
    assert r0[1].tolist() == [0, 1, 2]
    with pytest.raises(clairvoyant.ConfigError, match="sample 9"):
        clairvoyant.access_stream_from_order(6, [[9]], 1, 0, 1)


def test_unsplittable_epoch_names_the_field():
    with pytest.raises(clairvoyant.ConfigError, match="drop_last"):
        clairvoyant.access_stream(3, 4, 0, 1, 8, 0)
    with pytest.raises(clairvoyant.ConfigError, match="rank"):
        clairvoyant.access_stream(100, 4, 4, 1, 8, 0)
