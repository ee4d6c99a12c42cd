//! What a plan report takes (`clairvoyant plan`, one node or several), as one typed value
//! checked once: errors name the field.

use crate::error::{Error, Result};
use crate::schedule::Schedule;

/// A run and a node's storage classes to report the placement of.
#[derive(Clone, Debug, Default)]
pub struct ReportSpec {
    /// Samples in the dataset.
    pub num_samples: u64,
    /// Ranks of the job.
    pub world_size: u32,
    /// Epochs of the run.
    pub epochs: u32,
    /// Samples per batch on each rank.
    pub batch_size: u32,
    /// Seed of the shuffle.
    pub seed: u64,
    /// Whether each epoch's last partial global batch is dropped.
    pub drop_last: bool,
    /// One size for every sample, or one per sample.
    pub sample_bytes: Vec<u64>,
    /// Every storage class's name and capacity in bytes, fastest first.
    pub classes: Vec<(String, u64)>,
}

impl ReportSpec {
    /// The placement report for `ranks` (the ranks of one node), as JSON.
    pub fn report(&self, ranks: &[u32]) -> Result<serde_json::Value> {
        if ranks.is_empty() {
            return Err(Error::config("ranks", "must name at least one rank"));
        }
        if let Some(r) = ranks.iter().find(|&&r| r >= self.world_size) {
            return Err(Error::config(
                "ranks",
                format!("rank {r} is outside world size {}", self.world_size),
            ));
        }
        let schedule = self.schedule()?;
        super::report(&schedule, ranks, |k| self.size(k), &self.classes)
    }

    /// The cluster-wide placement report for `nodes` (each node's ranks), every node with these
    /// classes, with node `node`'s placement in full, as JSON.
    pub fn cluster_report(&self, nodes: &[Vec<u32>], node: usize) -> Result<serde_json::Value> {
        let mut all: Vec<u32> = nodes.iter().flatten().copied().collect();
        all.sort_unstable();
        if all != (0..self.world_size).collect::<Vec<u32>>() {
            return Err(Error::config(
                "nodes",
                format!("{nodes:?} must hold each rank of world size {} once", self.world_size),
            ));
        }
        let schedule = self.schedule()?;
        super::cluster_report(&schedule, nodes, node, |k| self.size(k), &self.classes)
    }

    /// The run's schedule, once the sizes are checked.
    fn schedule(&self) -> Result<Schedule> {
        let n = self.sample_bytes.len();
        if n != 1 && n as u64 != self.num_samples {
            return Err(Error::config(
                "sample_bytes",
                format!(
                    "{n} sizes for {} samples (give one size or one per sample)",
                    self.num_samples
                ),
            ));
        }
        Schedule::shuffle(
            self.num_samples,
            self.world_size,
            self.batch_size,
            self.epochs,
            self.seed,
            self.drop_last,
        )
    }

    fn size(&self, k: u32) -> u64 {
        match self.sample_bytes.as_slice() {
            [one] => *one,
            each => each[k as usize],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ReportSpec {
        ReportSpec {
            num_samples: 64,
            world_size: 4,
            epochs: 2,
            batch_size: 4,
            seed: 1,
            drop_last: false,
            sample_bytes: vec![100],
            classes: vec![("memory".into(), 3200)],
        }
    }

    fn says(e: Error, key: &str, text: &str) {
        assert!(e.to_string().contains(text), "{e}");
        assert!(matches!(e, Error::Config { key: k, .. } if k == key));
    }

    #[test]
    fn reports_need_ranks_inside_the_world_and_one_size_or_one_per_sample() {
        assert!(spec().report(&[0, 1]).is_ok());
        assert!(spec().cluster_report(&[vec![0, 1], vec![2, 3]], 1).is_ok());
        says(spec().report(&[]).unwrap_err(), "ranks", "at least one rank");
        says(
            spec().report(&[4]).unwrap_err(),
            "ranks",
            "rank 4 is outside world size 4",
        );
        says(
            spec().cluster_report(&[vec![0, 1], vec![1, 3]], 0).unwrap_err(),
            "nodes",
            "must hold each rank of world size 4 once",
        );
        let sizes = ReportSpec {
            sample_bytes: vec![1, 2, 3],
            ..spec()
        };
        says(
            sizes.report(&[0]).unwrap_err(),
            "sample_bytes",
            "3 sizes for 64 samples",
        );
    }
}
