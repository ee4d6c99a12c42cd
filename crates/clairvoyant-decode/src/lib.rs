//! Native image decoding and torchvision-compatible augmentation for training input: JPEG/PNG
//! bytes in, one contiguous batch (uint8 HWC/CHW or normalized float32 CHW) out, samples decoded
//! in parallel on a bounded thread pool. No Python here; `clairvoyant-py` binds it.
#![warn(missing_docs)]

pub mod image;
pub mod transform;

use rayon::prelude::*;

pub use image::{decode_rgb, Rgb};
pub use transform::{Interpolation, Op, SampleRng, Size};

/// What can go wrong, named for what the caller does about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The bytes are not a decodable JPEG/PNG (truncated, damaged, other format).
    #[error("corrupt image: {reason}")]
    Corrupt {
        /// What the decoder found wrong.
        reason: String,
    },
    /// A pipeline parameter is invalid.
    #[error("invalid {key}: {reason}")]
    Config {
        /// The parameter, as the transform names it.
        key: String,
        /// Why its value is refused.
        reason: String,
    },
    /// The caller's buffers do not match the pipeline.
    #[error("output buffer: {reason}")]
    Output {
        /// How the buffer differs from what the pipeline writes.
        reason: String,
    },
    /// One sample of a batch failed; `index` is its position in the batch.
    #[error("sample {sample} (batch position {index}): {source}")]
    Sample {
        /// Position in the batch.
        index: usize,
        /// The sample's id, as the caller gave it.
        sample: u64,
        /// Why it failed.
        source: Box<Error>,
    },
}

/// Layout and type of the batch written by [`Pipeline`].
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    /// uint8, (N, H, W, 3).
    U8Hwc,
    /// uint8, (N, 3, H, W), like `PILToTensor` / `v2.ToImage`.
    U8Chw,
    /// float32, (N, 3, H, W): `v / 255` (`ToTensor`, `ToDtype(float32, scale=True)`), then
    /// `(x - mean) / std` per channel (`Normalize`; mean 0, std 1 for none).
    F32Chw {
        /// Per-channel mean subtracted after scaling to [0, 1].
        mean: [f32; 3],
        /// Per-channel divisor applied after the mean.
        std: [f32; 3],
    },
}

/// A transform list and the output it ends in.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The transforms, applied in order.
    pub ops: Vec<Op>,
    /// What the batch holds after the last transform.
    pub output: Output,
    /// Apply the EXIF Orientation tag (`ImageOps.exif_transpose`). torchvision's `ImageFolder`
    /// does not, so the default is off.
    pub exif_orientation: bool,
}

/// Which random stream a sample uses (see [`SampleRng`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleKey {
    /// The job's seed.
    pub seed: u64,
    /// The epoch the sample is drawn in.
    pub epoch: u64,
    /// The sample's id.
    pub sample: u64,
}

/// The caller's batch buffer.
pub enum OutBuf<'a> {
    /// For [`Output::U8Hwc`] and [`Output::U8Chw`].
    U8(&'a mut [u8]),
    /// For [`Output::F32Chw`].
    F32(&'a mut [f32]),
}

/// A validated plan bound to a decode thread pool.
pub struct Pipeline {
    plan: Plan,
    h: u32,
    w: u32,
    /// Per channel, value -> normalized float (exactly torch's `(v / 255 - mean) / std` in f32).
    lut: Option<Box<[[f32; 256]; 3]>>,
    pool: rayon::ThreadPool,
    /// Process that built the pool: rayon's threads do not survive `fork`, so a pipeline used in
    /// a forked child refuses instead of waiting forever on threads that are not there.
    pid: u32,
}

impl Pipeline {
    /// Validate `plan` (its last sizing transform must fix the output size, so that samples
    /// collate) and start `threads` decode threads (0 = one per CPU).
    pub fn new(plan: Plan, threads: usize) -> Result<Self, Error> {
        let mut size = None;
        for op in &plan.ops {
            op.validate()?;
            match (op.fixed_size(), op) {
                (Some(s), _) => size = Some(s),
                (None, Op::Resize { .. }) => size = None,
                _ => {}
            }
        }
        let (h, w) = size.ok_or_else(|| Error::Config {
            key: "transforms".into(),
            reason: "no transform fixes the output size (end with RandomResizedCrop, CenterCrop or Resize((h, w)))"
                .into(),
        })?;
        let lut = match &plan.output {
            Output::F32Chw { mean, std } => {
                if std.iter().any(|&s| s == 0.0 || !s.is_finite()) {
                    return Err(Error::Config {
                        key: "Normalize.std".into(),
                        reason: format!("{std:?} has a zero"),
                    });
                }
                let mut t = Box::new([[0f32; 256]; 3]);
                for c in 0..3 {
                    for v in 0..256 {
                        t[c][v] = (v as f32 / 255.0 - mean[c]) / std[c];
                    }
                }
                Some(t)
            }
            _ => None,
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("cv-decode-{i}"))
            .build()
            .map_err(|e| Error::Config {
                key: "threads".into(),
                reason: e.to_string(),
            })?;
        Ok(Pipeline {
            plan,
            h,
            w,
            lut,
            pool,
            pid: std::process::id(),
        })
    }

    /// The validated plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Decode threads in the pool.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Shape of one sample in the output layout.
    pub fn sample_shape(&self) -> [usize; 3] {
        let (h, w) = (self.h as usize, self.w as usize);
        match self.plan.output {
            Output::U8Hwc => [h, w, 3],
            _ => [3, h, w],
        }
    }

    /// Elements (bytes for u8, floats for f32) of one sample.
    pub fn sample_len(&self) -> usize {
        self.h as usize * self.w as usize * 3
    }

    /// Decode and transform one image (no output conversion).
    pub fn transform(&self, bytes: &[u8], key: SampleKey) -> Result<Rgb, Error> {
        let mut img = decode_rgb(bytes, self.plan.exif_orientation)?;
        let mut rng = SampleRng::new(key.seed, key.epoch, key.sample);
        for op in &self.plan.ops {
            img = op.apply(img, &mut rng)?;
        }
        if (img.height, img.width) != (self.h, self.w) {
            return Err(Error::Output {
                reason: format!(
                    "transforms gave {}x{}, expected {}x{}",
                    img.height, img.width, self.h, self.w
                ),
            });
        }
        Ok(img)
    }

    fn write(&self, img: &Rgb, out: SampleOut<'_>) {
        let px = self.h as usize * self.w as usize;
        match (out, &self.plan.output) {
            (SampleOut::U8(o), Output::U8Hwc) => o.copy_from_slice(&img.data),
            (SampleOut::U8(o), _) => {
                for (i, p) in img.data.chunks_exact(3).enumerate() {
                    o[i] = p[0];
                    o[px + i] = p[1];
                    o[2 * px + i] = p[2];
                }
            }
            (SampleOut::F32(o), _) => {
                let lut = self.lut.as_ref().expect("f32 output has a table");
                let (r, rest) = o.split_at_mut(px);
                let (g, b) = rest.split_at_mut(px);
                for (i, p) in img.data.chunks_exact(3).enumerate() {
                    r[i] = lut[0][p[0] as usize];
                    g[i] = lut[1][p[1] as usize];
                    b[i] = lut[2][p[2] as usize];
                }
            }
        }
    }

    /// Decode `inputs[i]` with random stream `keys[i]` into sample `i` of `out`, all samples in
    /// parallel on the pipeline's threads. On failure the error of the lowest failing position
    /// is returned (deterministically) and the other samples' contents are unspecified.
    pub fn run_batch(&self, inputs: &[&[u8]], keys: &[SampleKey], out: OutBuf<'_>) -> Result<(), Error> {
        if std::process::id() != self.pid {
            return Err(Error::Config {
                key: "Pipeline".into(),
                reason: "used in a forked child; build a new one in this process".into(),
            });
        }
        if inputs.len() != keys.len() {
            return Err(Error::Output {
                reason: format!("{} inputs but {} keys", inputs.len(), keys.len()),
            });
        }
        let n = self.sample_len();
        let (len, f32_out) = match &out {
            OutBuf::U8(b) => (b.len(), false),
            OutBuf::F32(b) => (b.len(), true),
        };
        if f32_out != matches!(self.plan.output, Output::F32Chw { .. }) {
            return Err(Error::Output {
                reason: format!("element type does not match {:?}", self.plan.output),
            });
        }
        if len != n * inputs.len() {
            return Err(Error::Output {
                reason: format!("{len} elements for {} samples of {n}", inputs.len()),
            });
        }
        let one = |i: usize, o: SampleOut<'_>| -> Result<(), (usize, Error)> {
            let img = self.transform(inputs[i], keys[i]).map_err(|e| (i, e))?;
            self.write(&img, o);
            Ok(())
        };
        let errors: Vec<(usize, Error)> = self.pool.install(|| match out {
            OutBuf::U8(b) => b
                .par_chunks_mut(n)
                .enumerate()
                .filter_map(|(i, o)| one(i, SampleOut::U8(o)).err())
                .collect(),
            OutBuf::F32(b) => b
                .par_chunks_mut(n)
                .enumerate()
                .filter_map(|(i, o)| one(i, SampleOut::F32(o)).err())
                .collect(),
        });
        match errors.into_iter().min_by_key(|(i, _)| *i) {
            None => Ok(()),
            Some((index, e)) => Err(Error::Sample {
                index,
                sample: keys[index].sample,
                source: Box::new(e),
            }),
        }
    }
}

enum SampleOut<'a> {
    U8(&'a mut [u8]),
    F32(&'a mut [f32]),
}

#[cfg(test)]
mod tests;
