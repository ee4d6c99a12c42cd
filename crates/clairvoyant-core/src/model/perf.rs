//! The model's estimates: per-reader and per-thread rates, fetch, write and read times, and the
//! choice of the fastest source (NoPFS Sec. 4, notation in the module docs).

use super::{ClassKind, Location, SystemModel};

impl SystemModel {
    /// Per-reader PFS throughput t(γ)/γ in MB/s.
    pub fn pfs_per_reader_mbps(&self, readers: u32) -> f64 {
        let g = readers.max(1) as f64;
        self.pfs.read_mbps.at(g) / g
    }

    /// Per-thread read throughput r_j(p_j)/p_j of class j in MB/s.
    pub fn class_read_per_thread_mbps(&self, class: usize) -> f64 {
        let c = &self.classes[class];
        let p = c.threads.max(1) as f64;
        c.read_mbps.at(p) / p
    }

    /// Per-thread staging write throughput w_0(p_0)/p_0 in MB/s.
    pub fn staging_write_per_thread_mbps(&self) -> f64 {
        let p = self.staging.threads.max(1) as f64;
        self.staging.write_mbps.at(p) / p
    }

    /// Estimated seconds to fetch `bytes` from `loc` with `readers` concurrent PFS readers:
    /// fetch_{i,2,j} = s/(r_j(p_j)/p_j) for a local class, fetch_{i,0,0} = s/(t(γ)/γ) plus the
    /// open latency for the PFS.
    pub fn fetch_seconds(&self, loc: Location, bytes: u64, readers: u32) -> f64 {
        let mb = bytes as f64 / 1e6;
        match loc {
            Location::Class(j) => mb / self.class_read_per_thread_mbps(j).max(1e-9),
            Location::Pfs => self.pfs.open_latency_s + mb / self.pfs_per_reader_mbps(readers).max(1e-9),
        }
    }

    /// fetch_{i,1,j} = s/min(b_c, r_j(p_j)/p_j): seconds to fetch `bytes` from class j of another
    /// worker. None without an interconnect (`interconnect_mbps` unset).
    pub fn remote_fetch_seconds(&self, class: usize, bytes: u64) -> Option<f64> {
        let bc = self.interconnect_mbps?;
        let rate = bc.min(self.class_read_per_thread_mbps(class));
        Some(bytes as f64 / 1e6 / rate.max(1e-9))
    }

    /// write_i(k) = max(s/β, s/(w_0(p_0)/p_0)): seconds to preprocess and store `bytes` in the
    /// staging buffer (both pipelined). Without β (`preprocess_mbps` unset) only the write counts.
    pub fn write_seconds(&self, bytes: u64) -> f64 {
        let mb = bytes as f64 / 1e6;
        let write = mb / self.staging_write_per_thread_mbps().max(1e-9);
        match self.preprocess_mbps {
            Some(beta) if beta > 0.0 => write.max(mb / beta),
            _ => write,
        }
    }

    /// read_i(k) = fetch_i(k) + write_i(k): seconds to bring `bytes` from `loc` into staging.
    pub fn read_seconds(&self, loc: Location, bytes: u64, readers: u32) -> f64 {
        self.fetch_seconds(loc, bytes, readers) + self.write_seconds(bytes)
    }

    /// The location with the smallest estimated fetch time for a sample of `bytes`: the PFS with
    /// `readers` concurrent readers, or one of the enabled classes in `local` (the classes that
    /// hold the sample). A class wins only when strictly faster than the PFS, so a class slower
    /// than the source is never read from; among equal classes the first listed wins.
    pub fn fastest_source(&self, bytes: u64, local: &[usize], readers: u32) -> Location {
        let mut best = Location::Pfs;
        let mut best_t = self.fetch_seconds(Location::Pfs, bytes, readers);
        for &j in local {
            let Some(c) = self.classes.get(j) else {
                debug_assert!(false, "class {j} out of range ({} classes)", self.classes.len());
                continue;
            };
            if !c.enabled() {
                continue;
            }
            let t = self.fetch_seconds(Location::Class(j), bytes, readers);
            if t < best_t {
                best = Location::Class(j);
                best_t = t;
            }
        }
        best
    }

    /// Classes worth caching in: enabled, and faster to read than fetching from the PFS
    /// for a sample of `typical_bytes` (a class slower than the source is never routed through).
    pub fn useful_classes(&self, typical_bytes: u64, readers: u32) -> Vec<usize> {
        let pfs = self.fetch_seconds(Location::Pfs, typical_bytes, readers);
        (0..self.classes.len())
            .filter(|&j| {
                self.classes[j].capacity > 0 && self.fetch_seconds(Location::Class(j), typical_bytes, readers) < pfs
            })
            .collect()
    }

    /// D = Σ_{j≥1} d_j: bytes of all enabled storage classes (the staging buffer excluded).
    pub fn local_capacity(&self) -> u64 {
        self.classes.iter().map(|c| c.capacity).fold(0u64, u64::saturating_add)
    }

    /// Index of the class called `name`.
    pub fn class_index(&self, name: &str) -> Option<usize> {
        self.classes.iter().position(|c| c.name == name)
    }

    /// Index of the memory class, if any.
    pub fn memory_class(&self) -> Option<usize> {
        self.classes.iter().position(|c| c.kind == ClassKind::Memory)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{ClassSpec, Curve, PfsSpec, StagingSpec};
    use super::*;

    fn two_tier(pfs_mbps: f64, class_mbps: f64) -> SystemModel {
        SystemModel {
            staging: StagingSpec::new(64 << 20, 2),
            pfs: PfsSpec {
                read_mbps: Curve::constant(pfs_mbps),
                open_latency_s: 0.0,
            },
            classes: vec![ClassSpec {
                name: "ssd".into(),
                kind: ClassKind::Directory { path: "/x".into() },
                capacity: 1 << 30,
                threads: 1,
                read_mbps: Curve::constant(class_mbps),
                write_mbps: Curve::constant(class_mbps),
            }],
            interconnect_mbps: None,
            compute_mbps: None,
            preprocess_mbps: None,
        }
    }

    #[test]
    fn fastest_source_picks_class_only_when_faster() {
        // Class faster than the PFS: the class, if it holds the sample.
        let m = two_tier(100.0, 1000.0);
        assert_eq!(m.fastest_source(1 << 20, &[0], 1), Location::Class(0));
        assert_eq!(m.fastest_source(1 << 20, &[], 1), Location::Pfs);
        // Source faster than the class: the PFS even when the class holds it.
        let m = two_tier(2000.0, 500.0);
        assert_eq!(m.fastest_source(1 << 20, &[0], 1), Location::Pfs);
        // Equal: the PFS (a class must be strictly faster).
        let m = two_tier(500.0, 500.0);
        assert_eq!(m.fastest_source(1 << 20, &[0], 1), Location::Pfs);
        // Many readers share t(γ): the class wins again.
        let mut m = two_tier(2000.0, 500.0);
        m.pfs.read_mbps = Curve::linear_up_to(2000.0, 1);
        assert_eq!(m.fastest_source(1 << 20, &[0], 8), Location::Class(0));
        // A disabled class is never picked.
        let mut m = two_tier(100.0, 1000.0);
        m.classes[0].capacity = 0;
        assert_eq!(m.fastest_source(1 << 20, &[0], 1), Location::Pfs);
        // Open latency counts: tiny samples from a high-latency PFS come from the class.
        let mut m = two_tier(2000.0, 1000.0);
        m.pfs.open_latency_s = 0.01;
        assert_eq!(m.fastest_source(1000, &[0], 1), Location::Class(0));
    }

    #[test]
    fn fastest_source_prefers_the_faster_class() {
        let mut m = two_tier(100.0, 1000.0);
        let mut mem = m.classes[0].clone();
        mem.name = "memory".into();
        mem.kind = ClassKind::Memory;
        mem.read_mbps = Curve::constant(10_000.0);
        m.classes.insert(0, mem);
        assert_eq!(m.fastest_source(1 << 20, &[1, 0], 1), Location::Class(0));
        assert_eq!(m.fastest_source(1 << 20, &[1], 1), Location::Class(1));
    }

    #[test]
    fn write_and_read_seconds() {
        let mut m = two_tier(100.0, 1000.0);
        m.staging.threads = 2;
        m.staging.write_mbps = Curve::linear_up_to(1000.0, 4); // w_0(2)/2 = 1000 MB/s
        assert!((m.write_seconds(10_000_000) - 0.01).abs() < 1e-12);
        m.preprocess_mbps = Some(100.0); // β slower than the copy: it dominates
        assert!((m.write_seconds(10_000_000) - 0.1).abs() < 1e-12);
        m.preprocess_mbps = Some(1e6);
        assert!((m.write_seconds(10_000_000) - 0.01).abs() < 1e-12);
        let r = m.read_seconds(Location::Pfs, 10_000_000, 1);
        assert!((r - (0.1 + 0.01)).abs() < 1e-12);
        assert_eq!(m.remote_fetch_seconds(0, 1_000_000), None);
        m.interconnect_mbps = Some(100.0);
        assert!((m.remote_fetch_seconds(0, 1_000_000).unwrap() - 0.01).abs() < 1e-12);
    }
}
