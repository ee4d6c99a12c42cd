//! A synthetic source: given sizes, deterministic bytes computed on read. For tests and for
//! measuring the engine's own overhead without any storage underneath.

use std::path::PathBuf;

use crate::error::Result;
use crate::source::Source;

/// A dataset of samples with the given sizes and labels, whose bytes are computed on read.
pub struct Synthetic {
    sizes: Vec<u64>,
    labels: Vec<i64>,
}

impl Synthetic {
    /// Sample `k` has `sizes[k]` bytes and label `labels[k]` (0 where `labels` is shorter).
    pub fn new(sizes: Vec<u64>, labels: Vec<i64>) -> Synthetic {
        Synthetic { sizes, labels }
    }

    /// Byte `i` of sample `k`.
    pub fn byte(k: u32, i: usize) -> u8 {
        (k as usize).wrapping_mul(31).wrapping_add(i) as u8
    }
}

impl Source for Synthetic {
    fn len(&self) -> usize {
        self.sizes.len()
    }
    fn size(&self, k: u32) -> u64 {
        self.sizes[k as usize]
    }
    fn label(&self, k: u32) -> i64 {
        self.labels.get(k as usize).copied().unwrap_or(0)
    }
    fn path(&self, k: u32) -> PathBuf {
        PathBuf::from(format!("synthetic/{k}"))
    }
    fn read_into(&self, k: u32, buf: &mut [u8]) -> Result<()> {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = Self::byte(k, i);
        }
        Ok(())
    }
    fn fingerprint(&self) -> u64 {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for (s, l) in self.sizes.iter().zip(self.labels.iter().chain(std::iter::repeat(&0))) {
            h = (h ^ s).wrapping_mul(0x0100_0000_01b3);
            h = (h ^ *l as u64).wrapping_mul(0x0100_0000_01b3);
        }
        h
    }
}
