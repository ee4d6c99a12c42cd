//! The rules of a system description, checked once for every model however it was made (a file,
//! detection, a probe, a simulation scenario); errors name the field.

use super::{ClassKind, ClassSpec, SystemModel, MAX_THREADS};
use crate::error::{Error, Result};

/// Whether `name` may name a class: non-empty, `[A-Za-z0-9_-]` only.
pub(super) fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Dotted key prefix of class `i` named `name`: `class.<name>` when the name is usable, else
/// `class[i]`.
pub(super) fn class_key(name: &str, i: usize) -> String {
    if valid_name(name) {
        format!("class.{name}")
    } else {
        format!("class[{i}]")
    }
}

fn check_threads(key: &str, threads: u32) -> Result<()> {
    if threads == 0 {
        return Err(Error::config(key, "is 0; at least 1 prefetch thread is needed"));
    }
    if threads > MAX_THREADS {
        return Err(Error::config(
            key,
            format!("is {threads}; at most {MAX_THREADS} threads are allowed"),
        ));
    }
    Ok(())
}

fn check_rate(key: &str, v: Option<f64>) -> Result<()> {
    match v {
        Some(x) if !x.is_finite() || x <= 0.0 => Err(Error::config(
            key,
            format!("is {x}; must be a finite throughput > 0 MB/s (or left out)"),
        )),
        _ => Ok(()),
    }
}

impl SystemModel {
    /// Check every field; errors name the field (`staging.threads`, `class.ssd.capacity`, ...).
    ///
    /// Rules: staging capacity > 0 and 1..=[`MAX_THREADS`] threads; every curve has points with
    /// x ≥ 1 strictly increasing and y > 0; the PFS open latency is finite and ≥ 0; class names
    /// are non-empty, made of `[A-Za-z0-9_-]` and unique; enabled classes have 1..=MAX_THREADS
    /// threads; directory classes have a path, and no two share one; at most one memory class
    /// (memory is shared through one segment); `interconnect_mbps`, `compute_mbps` and
    /// `preprocess_mbps`, when given, are > 0.
    pub fn validate(&self) -> Result<()> {
        self.validate_staging_and_pfs()?;
        for (i, c) in self.classes.iter().enumerate() {
            self.validate_class(i, c)?;
        }
        check_rate("interconnect_mbps", self.interconnect_mbps)?;
        check_rate("compute_mbps", self.compute_mbps)?;
        check_rate("preprocess_mbps", self.preprocess_mbps)?;
        Ok(())
    }

    fn validate_staging_and_pfs(&self) -> Result<()> {
        if self.staging.capacity == 0 {
            return Err(Error::config(
                "staging.capacity",
                "is 0; the staging buffer needs a positive capacity, e.g. \"256 MiB\"",
            ));
        }
        check_threads("staging.threads", self.staging.threads)?;
        self.staging.write_mbps.check("staging.write_mbps")?;
        self.pfs.read_mbps.check("pfs.read_mbps")?;
        let lat = self.pfs.open_latency_s;
        if !lat.is_finite() || lat < 0.0 {
            return Err(Error::config(
                "pfs.open_latency_ms",
                format!("is {} ms; must be finite and >= 0", lat * 1e3),
            ));
        }
        Ok(())
    }

    /// Class `i`, against itself and the classes before it.
    fn validate_class(&self, i: usize, c: &ClassSpec) -> Result<()> {
        let key = class_key(&c.name, i);
        if !valid_name(&c.name) {
            return Err(Error::config(
                format!("{key}.name"),
                format!(
                    "is {:?}; a class name is non-empty and uses only letters, digits, '_' and '-'",
                    c.name
                ),
            ));
        }
        let before = &self.classes[..i];
        if let Some(first) = before.iter().position(|o| o.name == c.name) {
            return Err(Error::config(
                format!("{key}.name"),
                format!("'{}' names classes {first} and {i}; class names must be unique", c.name),
            ));
        }
        check_kind(&key, c, before)?;
        if c.enabled() {
            check_threads(&format!("{key}.threads"), c.threads)?;
        }
        c.read_mbps.check(&format!("{key}.read_mbps"))?;
        c.write_mbps.check(&format!("{key}.write_mbps"))
    }
}

/// At most one memory class; a directory class has a path of its own.
fn check_kind(key: &str, c: &ClassSpec, before: &[ClassSpec]) -> Result<()> {
    match &c.kind {
        ClassKind::Memory => match before.iter().find(|o| o.kind == ClassKind::Memory) {
            Some(other) => Err(Error::config(
                format!("{key}.kind"),
                format!(
                    "is \"memory\" but class '{}' is already the memory class; at most one memory \
                     class is allowed (node memory is shared through one segment)",
                    other.name
                ),
            )),
            None => Ok(()),
        },
        ClassKind::Directory { path } => {
            if path.as_os_str().is_empty() {
                return Err(Error::config(
                    format!("{key}.path"),
                    "is empty; a directory class needs a path",
                ));
            }
            let dup = before
                .iter()
                .find(|o| matches!(&o.kind, ClassKind::Directory { path: p } if p == path));
            match dup {
                Some(o) => Err(Error::config(
                    format!("{key}.path"),
                    format!(
                        "{} is also the path of class '{}'; each directory class needs its own",
                        path.display(),
                        o.name
                    ),
                )),
                None => Ok(()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::super::test_support::{key_of, parse, sample};
    use super::super::{ClassKind, Curve};
    use super::*;

    fn invalid_key(f: impl FnOnce(&mut SystemModel)) -> String {
        let mut m = sample();
        f(&mut m);
        match m.validate() {
            Err(Error::Config { key, .. }) => key,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    // One test per validation rule; each asserts the key.

    #[test]
    fn rule_staging_capacity_positive() {
        assert_eq!(invalid_key(|m| m.staging.capacity = 0), "staging.capacity");
        assert_eq!(key_of(parse("[staging]\ncapacity = \"0\"\n")), "staging.capacity");
    }

    #[test]
    fn rule_staging_threads() {
        assert_eq!(invalid_key(|m| m.staging.threads = 0), "staging.threads");
        assert_eq!(invalid_key(|m| m.staging.threads = MAX_THREADS + 1), "staging.threads");
    }

    #[test]
    fn rule_class_threads_when_enabled() {
        assert_eq!(invalid_key(|m| m.classes[1].threads = 0), "class.ssd.threads");
        let mut m = sample();
        m.classes[1].threads = 0;
        m.classes[1].capacity = 0; // disabled: threads do not matter
        m.validate().unwrap();
    }

    #[test]
    fn rule_curve_x_at_least_one() {
        assert_eq!(
            invalid_key(|m| m.pfs.read_mbps = Curve(vec![(0.0, 10.0), (2.0, 20.0)])),
            "pfs.read_mbps"
        );
    }

    #[test]
    fn rule_curve_x_increasing() {
        assert_eq!(
            invalid_key(|m| m.classes[0].read_mbps = Curve(vec![(1.0, 10.0), (4.0, 20.0), (4.0, 30.0)])),
            "class.memory.read_mbps"
        );
        assert_eq!(
            invalid_key(|m| m.classes[1].write_mbps = Curve(vec![(2.0, 10.0), (1.0, 20.0)])),
            "class.ssd.write_mbps"
        );
    }

    #[test]
    fn rule_curve_y_positive() {
        assert_eq!(
            invalid_key(|m| m.staging.write_mbps = Curve(vec![(1.0, 0.0)])),
            "staging.write_mbps"
        );
        assert_eq!(
            invalid_key(|m| m.pfs.read_mbps = Curve(vec![(1.0, f64::NAN)])),
            "pfs.read_mbps"
        );
        assert_eq!(
            key_of(parse("[pfs]\nread_mbps = [[1, 100.0], [2, -1.0]]\n")),
            "pfs.read_mbps"
        );
    }

    #[test]
    fn rule_curve_not_empty() {
        assert_eq!(key_of(parse("[pfs]\nread_mbps = []\n")), "pfs.read_mbps");
    }

    #[test]
    fn rule_open_latency() {
        assert_eq!(invalid_key(|m| m.pfs.open_latency_s = -1.0), "pfs.open_latency_ms");
    }

    #[test]
    fn rule_unique_class_names() {
        assert_eq!(
            invalid_key(|m| m.classes[1].name = "memory".into()),
            "class.memory.name"
        );
    }

    #[test]
    fn rule_class_name_format() {
        assert_eq!(invalid_key(|m| m.classes[1].name = String::new()), "class[1].name");
        assert_eq!(invalid_key(|m| m.classes[1].name = "my ssd".into()), "class[1].name");
    }

    #[test]
    fn rule_directory_needs_path() {
        assert_eq!(
            invalid_key(|m| m.classes[1].kind = ClassKind::Directory { path: PathBuf::new() }),
            "class.ssd.path"
        );
    }

    #[test]
    fn rule_directory_paths_distinct() {
        let key = invalid_key(|m| {
            let mut c = m.classes[1].clone();
            c.name = "ssd2".into();
            m.classes.push(c);
        });
        assert_eq!(key, "class.ssd2.path");
    }

    #[test]
    fn rule_one_memory_class() {
        let key = invalid_key(|m| {
            let mut c = m.classes[0].clone();
            c.name = "ram2".into();
            m.classes.push(c);
        });
        assert_eq!(key, "class.ram2.kind");
    }

    #[test]
    fn rule_optional_rates_positive() {
        assert_eq!(invalid_key(|m| m.interconnect_mbps = Some(0.0)), "interconnect_mbps");
        assert_eq!(invalid_key(|m| m.compute_mbps = Some(-1.0)), "compute_mbps");
        assert_eq!(
            invalid_key(|m| m.preprocess_mbps = Some(f64::INFINITY)),
            "preprocess_mbps"
        );
    }
}
