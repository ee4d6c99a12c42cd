//! Access streams: from a seed, every rank's sequence of sample indices for every epoch.
//! Pure and portable: the generator (PCG-XSL-RR 128/64), its seeding and the shuffle are spelled
//! out here so that the same inputs give the same order on any machine and any version.

use rand_core::Rng;
use rand_pcg::Lcg128Xsl64;

use crate::error::{Error, Result};

/// The stream (increment) constant of the PCG generator; the PCG reference default.
const PCG_STREAM: u128 = 0x5851_f42d_4c95_7f2d_1405_7b7e_f767_814f;

/// SplitMix64 finaliser: spreads (seed, epoch) over the generator's 128-bit state (and serves
/// deterministic choices elsewhere that need no generator state).
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The generator for one epoch (or any other numbered stream of a seed): state =
/// splitmix64(seed) << 64 | splitmix64(seed ^ splitmix64(epoch + 1)).
pub fn epoch_rng(seed: u64, epoch: u64) -> Lcg128Xsl64 {
    let hi = splitmix64(seed);
    let lo = splitmix64(seed ^ splitmix64(epoch.wrapping_add(1)));
    Lcg128Xsl64::new(((hi as u128) << 64) | lo as u128, PCG_STREAM)
}

/// Uniform integer in `0..n` (n >= 1), Lemire's multiply-and-reject method on 64-bit draws:
/// unbiased, and it consumes a documented number of draws, which keeps orders portable.
fn bounded(rng: &mut Lcg128Xsl64, n: u64) -> u64 {
    let mut m = (rng.next_u64() as u128) * (n as u128);
    if (m as u64) < n {
        let threshold = n.wrapping_neg() % n;
        while (m as u64) < threshold {
            m = (rng.next_u64() as u128) * (n as u128);
        }
    }
    (m >> 64) as u64
}

/// The global order of one epoch: a Fisher-Yates shuffle of `0..num_samples`
/// (for i from n-1 down to 1: swap(i, bounded(i+1))).
///
/// The draws do not depend on the data, so each swap's random partner is drawn a few steps
/// ahead and its cache line prefetched: the same draws, in the same order, with the memory
/// latency of the random accesses overlapped.
pub fn epoch_permutation(num_samples: u32, seed: u64, epoch: u64) -> Vec<u32> {
    const AHEAD: usize = 16;
    let mut order = crate::mem::huge_iota(num_samples);
    let mut rng = epoch_rng(seed, epoch);
    let steps = order.len().saturating_sub(1);
    let n = order.len();
    // Step s swaps position i = n-1-s with its partner, drawn from 0..=i.
    let mut partner = [0usize; AHEAD];
    for (s, slot) in partner.iter_mut().enumerate().take(steps) {
        *slot = bounded(&mut rng, (n - s) as u64) as usize;
        crate::mem::prefetch(&order, *slot);
    }
    for s in 0..steps {
        let j = partner[s % AHEAD];
        if s + AHEAD < steps {
            let ahead = bounded(&mut rng, (n - s - AHEAD) as u64) as usize;
            partner[s % AHEAD] = ahead;
            crate::mem::prefetch(&order, ahead);
        }
        order.swap(n - 1 - s, j);
    }
    order
}

/// How the ranks share each epoch's global order, and the resulting batch layout.
///
/// Global batch h (N * b consecutive entries of the global order) gives rank r the entries
/// `[h*N*b + r*b, h*N*b + (r+1)*b)`. For the remainder R = M mod (N*b) of an epoch of M entries:
/// - `drop_last`: the remainder is not used this epoch.
/// - R >= N: one more batch per rank; the remainder is split in contiguous runs, the first
///   R mod N ranks getting one sample more (sizes differ by at most one).
/// - 0 < R < N (and b >= 2, at least one full global batch): the last full global batch and the
///   remainder (N*b + R entries) become two batches per rank: first N*(b-1) + R entries split as
///   above (b or b-1 each), then one entry per rank.
///
/// So every rank has the same number of batches (unequal counts hang collective training), and
/// without drop_last every entry of the epoch goes to exactly one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Entries in the epoch's global order (M).
    pub epoch_len: u64,
    /// Number of ranks (N).
    pub world_size: u32,
    /// Samples per batch and rank (b).
    pub batch_size: u32,
    /// Leave the remainder of the epoch unused instead of spreading it over the ranks.
    pub drop_last: bool,
}

impl Layout {
    /// The layout of an epoch of `epoch_len` entries; refuses a zero world or batch size.
    pub fn new(epoch_len: u64, world_size: u32, batch_size: u32, drop_last: bool) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::config("world_size", "must be at least 1"));
        }
        if batch_size == 0 {
            return Err(Error::config("batch_size", "must be at least 1"));
        }
        let layout = Layout {
            epoch_len,
            world_size,
            batch_size,
            drop_last,
        };
        let (n, b, m) = (world_size as u64, batch_size as u64, epoch_len);
        let rem = m % (n * b);
        let full = m / (n * b);
        if drop_last {
            if full == 0 {
                return Err(Error::config(
                    "batch_size",
                    format!("{m} samples make no full global batch of {n} ranks x {b}; lower batch_size or set drop_last=False"),
                ));
            }
        } else if rem > 0 && rem < n && (b < 2 || full == 0) {
            return Err(Error::config(
                "drop_last",
                format!(
                    "{m} samples cannot be split into the same number of batches on {n} ranks with batch size {b} \
                     (the last {rem} samples are fewer than the ranks); set drop_last=True"
                ),
            ));
        }
        Ok(layout)
    }

    /// The batches of `rank`: ranges of positions in the epoch's global order.
    pub fn rank_batches(&self, rank: u32) -> Vec<std::ops::Range<u64>> {
        let (n, b, m, r) = (
            self.world_size as u64,
            self.batch_size as u64,
            self.epoch_len,
            rank as u64,
        );
        let round = n * b;
        let full = m / round;
        let rem = m % round;
        let mut out: Vec<std::ops::Range<u64>> =
            (0..full).map(|h| h * round + r * b..h * round + (r + 1) * b).collect();
        if rem == 0 || self.drop_last {
            return out;
        }
        let split = |base: u64, count: u64| {
            let (q, x) = (count / n, count % n);
            let start = base + r * q + r.min(x);
            start..start + q + u64::from(r < x)
        };
        if rem >= n {
            out.push(split(full * round, rem));
        } else {
            out.pop();
            let base = (full - 1) * round;
            let first = n * (b - 1) + rem;
            out.push(split(base, first));
            out.push(base + first + r..base + first + r + 1);
        }
        out
    }

    /// Number of batches every rank gets per epoch.
    pub fn batches_per_rank(&self) -> u64 {
        self.rank_batches(0).len() as u64
    }
}

/// Where each epoch's global order comes from.
#[derive(Clone, Debug)]
pub enum Order {
    /// A fresh seeded permutation of the whole dataset every epoch.
    Shuffle {
        /// Samples in the dataset.
        num_samples: u32,
        /// The shuffle seed; every rank derives the same permutations from it.
        seed: u64,
    },
    /// Explicit global orders, one per epoch (any sampler, materialised ahead). Entries are
    /// sample indices; repeats and subsets are allowed.
    Explicit {
        /// Samples in the dataset (every entry is below it).
        num_samples: u32,
        /// The global order of each epoch, in epoch order.
        epochs: Vec<Vec<u32>>,
    },
}

/// Every epoch's access stream for one rank (or all ranks) of a job.
#[derive(Clone, Debug)]
pub struct Schedule {
    /// Where each epoch's global order comes from.
    pub order: Order,
    /// Number of epochs in the run.
    pub epochs: u32,
    /// Number of ranks the global order is split among.
    pub world_size: u32,
    /// Samples per batch and rank.
    pub batch_size: u32,
    /// Leave each epoch's remainder unused (see [`Layout`]).
    pub drop_last: bool,
}

impl Schedule {
    /// A schedule of `epochs` epochs, each a fresh permutation of `num_samples` samples drawn
    /// from `seed`; refuses datasets beyond `u32` samples and invalid layouts.
    pub fn shuffle(
        num_samples: u64,
        world_size: u32,
        batch_size: u32,
        epochs: u32,
        seed: u64,
        drop_last: bool,
    ) -> Result<Self> {
        let num_samples = checked_num_samples(num_samples)?;
        let s = Schedule {
            order: Order::Shuffle { num_samples, seed },
            epochs,
            world_size,
            batch_size,
            drop_last,
        };
        s.layout(0)?;
        Ok(s)
    }

    /// A schedule with one given global order per epoch; refuses entries outside the dataset
    /// and invalid layouts.
    pub fn explicit(
        num_samples: u64,
        orders: Vec<Vec<u32>>,
        world_size: u32,
        batch_size: u32,
        drop_last: bool,
    ) -> Result<Self> {
        let num_samples = checked_num_samples(num_samples)?;
        for (e, order) in orders.iter().enumerate() {
            if let Some(pos) = order.iter().position(|&k| k >= num_samples) {
                return Err(Error::config(
                    "order",
                    format!(
                        "epoch {e} position {pos}: sample {} is outside the dataset of {num_samples} samples",
                        order[pos]
                    ),
                ));
            }
        }
        let epochs = orders.len() as u32;
        let s = Schedule {
            order: Order::Explicit {
                num_samples,
                epochs: orders,
            },
            epochs,
            world_size,
            batch_size,
            drop_last,
        };
        for e in 0..epochs {
            s.layout(e)?;
        }
        Ok(s)
    }

    /// Samples in the dataset.
    pub fn num_samples(&self) -> u32 {
        match &self.order {
            Order::Shuffle { num_samples, .. } | Order::Explicit { num_samples, .. } => *num_samples,
        }
    }

    /// How `epoch`'s global order is split into batches per rank (an epoch past an explicit
    /// schedule's last is empty).
    pub fn layout(&self, epoch: u32) -> Result<Layout> {
        let len = match &self.order {
            Order::Shuffle { num_samples, .. } => *num_samples as u64,
            Order::Explicit { epochs, .. } => epochs.get(epoch as usize).map_or(0, |o| o.len() as u64),
        };
        Layout::new(len, self.world_size, self.batch_size, self.drop_last)
    }

    /// The global order of `epoch` (before it is split among ranks).
    pub fn global_order(&self, epoch: u32) -> Vec<u32> {
        match &self.order {
            Order::Shuffle { num_samples, seed } => epoch_permutation(*num_samples, *seed, epoch as u64),
            Order::Explicit { epochs, .. } => epochs[epoch as usize].clone(),
        }
    }

    /// Split one epoch's global order into the streams of the given ranks, batch by batch.
    pub fn split(&self, epoch: u32, global: &[u32], ranks: &[u32]) -> Result<Vec<RankEpoch>> {
        let layout = self.layout(epoch)?;
        Ok(ranks
            .iter()
            .map(|&r| {
                let batches = layout.rank_batches(r);
                let mut samples = Vec::with_capacity(batches.iter().map(|b| (b.end - b.start) as usize).sum());
                let mut batch_ends = Vec::with_capacity(batches.len());
                for b in batches {
                    samples.extend_from_slice(&global[b.start as usize..b.end as usize]);
                    batch_ends.push(samples.len() as u32);
                }
                RankEpoch { samples, batch_ends }
            })
            .collect())
    }

    /// One rank's stream for one epoch.
    pub fn rank_epoch(&self, rank: u32, epoch: u32) -> Result<RankEpoch> {
        self.check_rank(rank)?;
        if epoch >= self.epochs {
            return Err(Error::config(
                "epoch",
                format!("epoch {epoch} is outside the job's {} epochs", self.epochs),
            ));
        }
        let global = self.global_order(epoch);
        Ok(self.split(epoch, &global, &[rank])?.remove(0))
    }

    /// The streams of several ranks for every epoch, computed with one shuffle per epoch
    /// (epochs in parallel). `out[e][i]` belongs to `ranks[i]`.
    pub fn streams(&self, ranks: &[u32]) -> Result<Vec<Vec<RankEpoch>>> {
        self.streams_from(ranks, 0)
    }

    /// Like [`Schedule::streams`] for epochs `first..epochs` only (resuming a run).
    pub fn streams_from(&self, ranks: &[u32], first: u32) -> Result<Vec<Vec<RankEpoch>>> {
        use rayon::prelude::*;
        for &r in ranks {
            self.check_rank(r)?;
        }
        (first.min(self.epochs)..self.epochs)
            .into_par_iter()
            .map(|e| {
                let global = self.global_order(e);
                self.split(e, &global, ranks)
            })
            .collect()
    }

    fn check_rank(&self, rank: u32) -> Result<()> {
        if rank >= self.world_size {
            return Err(Error::config(
                "rank",
                format!("rank {rank} is outside world size {}", self.world_size),
            ));
        }
        Ok(())
    }
}

fn checked_num_samples(num_samples: u64) -> Result<u32> {
    u32::try_from(num_samples).map_err(|_| {
        Error::config(
            "num_samples",
            format!("{num_samples} exceeds the supported 4,294,967,295"),
        )
    })
}

/// One rank's samples in one epoch, with the end position of each batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEpoch {
    /// The rank's sample indices in consumption order.
    pub samples: Vec<u32>,
    /// For each batch, the index into `samples` just past its last sample.
    pub batch_ends: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn golden_permutation() {
        // Pinned forever: changing these changes every user's training order. The values agree
        // with the independent pure-Python statement in tests/reference_shuffle.py.
        assert_eq!(epoch_permutation(10, 0, 0), GOLDEN_10_S0_E0);
        assert_eq!(epoch_permutation(10, 0, 1), GOLDEN_10_S0_E1);
        assert_eq!(epoch_permutation(10, 42, 0), GOLDEN_10_S42_E0);
        let big = epoch_permutation(1_000_000, 7, 3);
        assert_eq!(&big[..5], GOLDEN_1M_S7_E3_HEAD);
    }

    const GOLDEN_10_S0_E0: [u32; 10] = [1, 5, 4, 8, 7, 3, 0, 6, 2, 9];
    const GOLDEN_10_S0_E1: [u32; 10] = [6, 4, 5, 2, 7, 8, 0, 3, 1, 9];
    const GOLDEN_10_S42_E0: [u32; 10] = [2, 7, 4, 5, 8, 3, 1, 0, 6, 9];
    const GOLDEN_1M_S7_E3_HEAD: &[u32] = &[915427, 304784, 320191, 925672, 618118];

    #[test]
    fn original_four_rank_example_is_balanced() {
        // 8000 samples, 4 ranks, batch 32: 62 full global batches and 64 left over.
        let l = Layout::new(8000, 4, 32, false).unwrap();
        let counts: Vec<u64> = (0..4)
            .map(|r| l.rank_batches(r).iter().map(|b| b.end - b.start).sum())
            .collect();
        assert_eq!(counts, vec![2000, 2000, 2000, 2000]);
        assert!((0..4).all(|r| l.rank_batches(r).len() == 63));
    }

    #[test]
    fn small_remainder_is_resplit() {
        // 4 ranks x 8 = 32 per round; 66 = 2 rounds + 2.
        let l = Layout::new(66, 4, 8, false).unwrap();
        let sizes: Vec<Vec<u64>> = (0..4)
            .map(|r| l.rank_batches(r).iter().map(|b| b.end - b.start).collect())
            .collect();
        assert_eq!(sizes[0], vec![8, 8, 1]);
        assert_eq!(sizes[3], vec![8, 7, 1]);
        assert!(Layout::new(66, 4, 1, false).is_err());
        assert!(Layout::new(3, 4, 8, false).is_err());
        assert!(Layout::new(66, 4, 1, true).is_ok());
    }

    fn check_partition(m: u64, n: u32, b: u32, drop_last: bool) {
        let Ok(l) = Layout::new(m, n, b, drop_last) else { return };
        let mut seen = vec![0u8; m as usize];
        let nb = l.rank_batches(0).len();
        for r in 0..n {
            let batches = l.rank_batches(r);
            assert_eq!(batches.len(), nb, "rank {r} batch count");
            for bt in batches {
                assert!(bt.end > bt.start && bt.end - bt.start <= b as u64);
                for p in bt {
                    seen[p as usize] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&c| c <= 1));
        let used = seen.iter().filter(|&&c| c == 1).count() as u64;
        if drop_last {
            assert_eq!(used, m / (n as u64 * b as u64) * n as u64 * b as u64);
        } else {
            assert_eq!(used, m);
        }
    }

    proptest! {
        #[test]
        fn shuffle_is_permutation(n in 0u32..2000, seed: u64, epoch in 0u64..100) {
            let mut p = epoch_permutation(n, seed, epoch);
            p.sort_unstable();
            prop_assert_eq!(p, (0..n).collect::<Vec<_>>());
        }

        #[test]
        fn layout_partitions_each_epoch(m in 1u64..3000, n in 1u32..17, b in 1u32..70, drop_last: bool) {
            check_partition(m, n, b, drop_last);
        }
    }

    #[test]
    fn epochs_differ_and_seed_matters() {
        assert_ne!(epoch_permutation(100, 1, 0), epoch_permutation(100, 1, 1));
        assert_ne!(epoch_permutation(100, 1, 0), epoch_permutation(100, 2, 0));
    }
}
