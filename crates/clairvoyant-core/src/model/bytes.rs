//! Byte sizes as people write them in a configuration file or the environment ("512MiB",
//! "8 GiB", "1.5GB"), and capacities limited to the free space that holds them.

const UNITS: &[(&str, u64)] = &[
    ("b", 1),
    ("kb", 1_000),
    ("mb", 1_000_000),
    ("gb", 1_000_000_000),
    ("tb", 1_000_000_000_000),
    ("kib", 1 << 10),
    ("mib", 1 << 20),
    ("gib", 1 << 30),
    ("tib", 1 << 40),
];

/// Parse a byte size: `"0"`, `"4096"`, `"512MiB"`, `"8 GiB"`, `"1.5GB"` (units B, kB, MB, GB,
/// TB in powers of 1000 and KiB, MiB, GiB, TiB in powers of 1024, any case). The error says what
/// is allowed.
pub fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    const HELP: &str = "expected a byte count such as 0, 1048576, \"512MiB\", \"8 GiB\" or \"1.5GB\" \
                        (units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)";
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (num, unit) = (t[..split].replace('_', ""), t[split..].trim().to_ascii_lowercase());
    if num.is_empty() {
        return Err(format!("found {s:?}; {HELP}"));
    }
    let Some(&(_, mult)) =
        UNITS
            .iter()
            .find(|(u, _)| *u == unit)
            .or(if unit.is_empty() { Some(&UNITS[0]) } else { None })
    else {
        return Err(format!("found {s:?}: unknown unit {unit:?}; {HELP}"));
    };
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).ok_or_else(|| format!("found {s:?}: too large"));
    }
    let x: f64 = num.parse().map_err(|_| format!("found {s:?}; {HELP}"))?;
    let bytes = x * mult as f64;
    if mult == 1 && x.fract() != 0.0 {
        return Err(format!("found {s:?}: a fraction of a byte; {HELP}"));
    }
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("found {s:?}: too large"));
    }
    Ok(bytes.round() as u64)
}

/// A byte size for people: `"1.0 TiB"`, `"55.3 GiB"`, `"800 B"`.
pub fn human_bytes(n: u64) -> String {
    for (unit, mult) in [
        ("TiB", 1u64 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ] {
        if n >= mult {
            return format!("{:.1} {unit}", n as f64 / mult as f64);
        }
    }
    format!("{n} B")
}

/// Format a byte size for a config file: `"8 GiB"`, `"512 MiB"` when exact, else the integer.
/// [`parse_bytes`] reads it back exactly.
pub fn format_bytes(n: u64) -> String {
    for (unit, mult) in [("TiB", 1u64 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)] {
        if n > 0 && n.is_multiple_of(mult) {
            return format!("\"{} {unit}\"", n / mult);
        }
    }
    n.to_string()
}

/// A configured capacity limited to what the file system holding `path` has free; a warning
/// naming `field` says so when it clamps.
pub fn clamp_to_free(field: &str, capacity: u64, path: &std::path::Path) -> u64 {
    let Ok(free) = crate::sysinfo::free_space(path) else {
        return capacity;
    };
    if capacity <= free {
        return capacity;
    }
    crate::tier::warn_once(
        field,
        &format!(
            "{field} is {} but {} has {} free; using {}",
            format_bytes(capacity),
            path.display(),
            format_bytes(free),
            format_bytes(free)
        ),
    );
    free
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("0"), Ok(0));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("8 GiB"), Ok(8 << 30));
        assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("2kb"), Ok(2000));
        assert_eq!(parse_bytes(" 1_000 B "), Ok(1000));
        for bad in ["", "GiB", "-1", "1.5", "12 parsecs", "1e3", "99999999999 TiB"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} accepted");
        }
        for n in [0, 1, 1 << 20, 3 << 30, 5 << 40, 123_456_789, u64::MAX] {
            let f = format_bytes(n);
            assert_eq!(parse_bytes(f.trim_matches('"')), Ok(n), "{f}");
        }
    }
}
