//! Throughput as a function of threads or concurrent readers: a few measured points,
//! piecewise-linear between them. The one table type of the model (r_j(p), w_j(p), t(γ)) and of
//! the emulated file system's shared bandwidth.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Throughput (MB/s, 10^6 bytes) measured at a few thread or reader counts; piecewise-linear
/// between points, flat beyond the ends.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Curve(pub Vec<(f64, f64)>);

impl Curve {
    /// The same `mbps` at any thread or reader count.
    pub fn constant(mbps: f64) -> Self {
        Curve(vec![(1.0, mbps)])
    }

    /// `per_unit` MB/s per thread up to `max_x` threads, flat after: `[(1, per_unit), (max_x, max_x * per_unit)]`.
    pub fn linear_up_to(per_unit: f64, max_x: u32) -> Self {
        if max_x <= 1 {
            return Curve::constant(per_unit);
        }
        Curve(vec![(1.0, per_unit), (max_x as f64, per_unit * max_x as f64)])
    }

    /// Throughput at `x` threads/readers.
    pub fn at(&self, x: f64) -> f64 {
        let pts = &self.0;
        if pts.is_empty() {
            return 0.0;
        }
        if x <= pts[0].0 {
            return pts[0].1;
        }
        for w in pts.windows(2) {
            let ((x0, y0), (x1, y1)) = (w[0], w[1]);
            if x <= x1 {
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0);
            }
        }
        pts[pts.len() - 1].1
    }

    /// Check the curve: at least one point, every x ≥ 1 and strictly increasing, every y > 0 and
    /// finite. Errors name `key`.
    pub fn check(&self, key: &str) -> Result<()> {
        if self.0.is_empty() {
            return Err(Error::config(
                key,
                "has no points; give one number (MB/s) or [[threads, MB/s], ...]",
            ));
        }
        let mut prev: Option<f64> = None;
        for (i, &(x, y)) in self.0.iter().enumerate() {
            if !x.is_finite() || x < 1.0 {
                return Err(Error::config(
                    key,
                    format!("point {i} has x = {x}; thread/reader counts must be finite and >= 1"),
                ));
            }
            if let Some(p) = prev {
                if x <= p {
                    return Err(Error::config(
                        key,
                        format!("point {i} has x = {x} after x = {p}; x must be strictly increasing"),
                    ));
                }
            }
            if !y.is_finite() || y <= 0.0 {
                return Err(Error::config(
                    key,
                    format!("point {i} (x = {x}) has {y} MB/s; throughput must be finite and > 0"),
                ));
            }
            prev = Some(x);
        }
        Ok(())
    }

    /// Parse the command-line form `"1:60,2:100,4:160,8:200"` (threads or readers:MB/s pairs)
    /// or one number (a constant MB/s), then [`Curve::check`] it; errors name `key`.
    pub fn parse_pairs(text: &str, key: &str) -> Result<Curve> {
        let text = text.trim();
        if let Ok(v) = text.parse::<f64>() {
            let c = Curve::constant(v);
            c.check(key)?;
            return Ok(c);
        }
        let mut points = Vec::new();
        for part in text.split(',') {
            let (x, y) = part.split_once(':').ok_or_else(|| {
                Error::config(
                    key,
                    format!("'{part}' is not readers:MB/s (e.g. 1:60,2:100,4:160,8:200)"),
                )
            })?;
            let num = |s: &str, what: &str| {
                s.trim()
                    .parse::<f64>()
                    .map_err(|_| Error::config(key, format!("'{}' is not {what}", s.trim())))
            };
            points.push((num(x, "a number of readers")?, num(y, "a throughput in MB/s")?));
        }
        let c = Curve(points);
        c.check(key)?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn curve_interpolation() {
        let c = Curve(vec![(1.0, 100.0), (4.0, 400.0), (8.0, 600.0)]);
        assert_eq!(c.at(0.0), 100.0); // before the first point: flat
        assert_eq!(c.at(1.0), 100.0);
        assert_eq!(c.at(2.0), 200.0);
        assert_eq!(c.at(4.0), 400.0);
        assert_eq!(c.at(6.0), 500.0);
        assert_eq!(c.at(8.0), 600.0);
        assert_eq!(c.at(100.0), 600.0); // after the last point: flat
        assert_eq!(Curve::constant(7.0).at(32.0), 7.0);
        assert_eq!(Curve(vec![]).at(1.0), 0.0);
        assert_eq!(Curve::linear_up_to(200.0, 10).at(5.0), 1000.0);
    }

    #[test]
    fn command_line_pairs() {
        let c = Curve::parse_pairs("1:60, 2:100,4:160,8:200", "--bandwidth").unwrap();
        assert_eq!(c, Curve(vec![(1.0, 60.0), (2.0, 100.0), (4.0, 160.0), (8.0, 200.0)]));
        assert_eq!(
            Curve::parse_pairs(" 250 ", "--bandwidth").unwrap(),
            Curve::constant(250.0)
        );
        for (bad, says) in [
            ("", "readers:MB/s"),
            ("1:60,1:70", "increasing"),
            ("0:60", ">= 1"),
            ("1:-5", "> 0"),
            ("1:x", "'x'"),
            ("-3", "> 0"),
        ] {
            let e = Curve::parse_pairs(bad, "--bandwidth").unwrap_err();
            assert!(
                matches!(&e, Error::Config { key, reason } if key == "--bandwidth" && reason.contains(says)),
                "{bad:?}: {e}"
            );
        }
    }
}
