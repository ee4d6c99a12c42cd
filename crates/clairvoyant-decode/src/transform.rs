//! torchvision's geometric transforms with its parameter semantics, on decoded RGB images,
//! and the per-sample random stream that makes random augmentations reproducible.

use std::cell::RefCell;

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};

use crate::image::Rgb;
use crate::Error;

/// Resampling filter. Both are Pillow's antialiased convolution filters (support widened by the
/// downscale factor), which is what torchvision applies to PIL images whatever `antialias` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interpolation {
    /// Pillow's BILINEAR (triangle filter).
    Bilinear,
    /// Pillow's BICUBIC (a = -0.5, fast_image_resize's CatmullRom).
    Bicubic,
}

impl Interpolation {
    fn alg(self) -> ResizeAlg {
        match self {
            Interpolation::Bilinear => ResizeAlg::Convolution(FilterType::Bilinear),
            Interpolation::Bicubic => ResizeAlg::Convolution(FilterType::CatmullRom),
        }
    }
}

/// `Resize`'s `size`: an int (the shorter side) or `(h, w)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Size {
    /// The shorter side becomes this many pixels, keeping the aspect ratio.
    Shorter(u32),
    /// Exactly `h` x `w`.
    Exact {
        /// Rows.
        h: u32,
        /// Columns.
        w: u32,
    },
}

/// One transform, parameters as torchvision names them; sizes are `(h, w)`.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// `RandomResizedCrop(size=(h, w), scale, ratio, interpolation)`.
    RandomResizedCrop {
        /// Output rows.
        h: u32,
        /// Output columns.
        w: u32,
        /// Range of the crop's area as a fraction of the image's.
        scale: (f64, f64),
        /// Range of the crop's aspect ratio (width / height).
        ratio: (f64, f64),
        /// Resampling filter.
        interpolation: Interpolation,
    },
    /// `RandomHorizontalFlip(p)`.
    RandomHorizontalFlip {
        /// Probability of flipping.
        p: f64,
    },
    /// `Resize(size, interpolation, max_size)`.
    Resize {
        /// Target size.
        size: Size,
        /// Upper bound on the longer side when `size` is the shorter one.
        max_size: Option<u32>,
        /// Resampling filter.
        interpolation: Interpolation,
    },
    /// `CenterCrop((h, w))`.
    CenterCrop {
        /// Output rows.
        h: u32,
        /// Output columns.
        w: u32,
    },
}

/// The random stream of one sample: SplitMix64 (Steele, Lea, Flood 2014) started from
/// `key = mix(mix(mix(seed) ^ epoch) ^ sample)`, `mix` being SplitMix64's finaliser. The same
/// (seed, epoch, sample) gives the same draws on any machine and any thread count; nothing
/// depends on which thread decodes the sample or in which order.
#[derive(Clone, Debug)]
pub struct SampleRng(u64);

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl SampleRng {
    /// The stream of `sample` in `epoch` of the job seeded `seed`.
    pub fn new(seed: u64, epoch: u64, sample: u64) -> Self {
        SampleRng(mix(mix(mix(seed) ^ epoch) ^ sample))
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }
    /// Uniform in [0, 1) with 53 random bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }
    /// Uniform integer in [0, n) (Lemire's multiply-shift; bias below 2^-40 for image sizes).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// Python's `round` (half to even), as torchvision's parameter code uses it.
fn pyround(x: f64) -> i64 {
    x.round_ties_even() as i64
}

/// `RandomResizedCrop.get_params`: `(top, left, h, w)` of the crop in an image of `width` x
/// `height`. Ten draws of area fraction in `scale` and log-uniform aspect ratio in `ratio`, the
/// first that fits wins, its position uniform; otherwise the centered crop clamped to `ratio`.
pub fn rrc_params(
    width: u32,
    height: u32,
    scale: (f64, f64),
    ratio: (f64, f64),
    rng: &mut SampleRng,
) -> (u32, u32, u32, u32) {
    let (wf, hf) = (width as f64, height as f64);
    let area = wf * hf;
    let (lr0, lr1) = (ratio.0.ln(), ratio.1.ln());
    for _ in 0..10 {
        let target = area * rng.uniform(scale.0, scale.1);
        let aspect = rng.uniform(lr0, lr1).exp();
        let w = pyround((target * aspect).sqrt());
        let h = pyround((target / aspect).sqrt());
        if 0 < w && w <= width as i64 && 0 < h && h <= height as i64 {
            let i = rng.below((height as i64 - h + 1) as u64) as u32;
            let j = rng.below((width as i64 - w + 1) as u64) as u32;
            return (i, j, h as u32, w as u32);
        }
    }
    let in_ratio = wf / hf;
    let (rmin, rmax) = (ratio.0.min(ratio.1), ratio.0.max(ratio.1));
    let (w, h) = if in_ratio < rmin {
        (width, pyround(wf / rmin) as u32)
    } else if in_ratio > rmax {
        (pyround(hf * rmax) as u32, height)
    } else {
        (width, height)
    };
    ((height - h) / 2, (width - w) / 2, h, w)
}

/// `Resize`'s output `(h, w)` for an input of `w` x `h` (torchvision's
/// `_compute_resized_output_size`: the shorter side becomes `size`, the longer one
/// `int(size * long / short)`, then `max_size` caps the longer side).
pub fn resize_output(width: u32, height: u32, size: Size, max_size: Option<u32>) -> (u32, u32) {
    match size {
        Size::Exact { h, w } => (h, w),
        Size::Shorter(s) => {
            let (short, long) = if width <= height {
                (width, height)
            } else {
                (height, width)
            };
            let mut ns = s;
            let mut nl = ((s as u64 * long as u64) as f64 / short as f64) as u32;
            if let Some(m) = max_size {
                if nl > m {
                    ns = ((m as u64 * ns as u64) as f64 / nl as f64) as u32;
                    nl = m;
                }
            }
            if width <= height {
                (nl, ns)
            } else {
                (ns, nl)
            }
        }
    }
}

/// Copy the `h` x `w` window at (`top`, `left`) (the image must contain it).
fn crop(img: &Rgb, top: u32, left: u32, h: u32, w: u32) -> Rgb {
    let mut out = Rgb::new(w, h);
    let (sw, row) = (img.width as usize * 3, w as usize * 3);
    for y in 0..h as usize {
        let s = (top as usize + y) * sw + left as usize * 3;
        out.data[y * row..(y + 1) * row].copy_from_slice(&img.data[s..s + row]);
    }
    out
}

thread_local! {
    // A resizer keeps scratch buffers; one per decode thread avoids reallocating them per image.
    static RESIZER: RefCell<Resizer> = RefCell::new(Resizer::new());
}

/// Resample to `h` x `w` with Pillow's convolution semantics (fast_image_resize is a SIMD port of
/// Pillow's resampling).
pub fn resize(img: &Rgb, h: u32, w: u32, interpolation: Interpolation) -> Result<Rgb, Error> {
    if (img.width, img.height) == (w, h) {
        return Ok(img.clone());
    }
    if h == 0 || w == 0 || img.width == 0 || img.height == 0 {
        return Err(Error::Corrupt {
            reason: format!("cannot resize {}x{} to {w}x{h}", img.width, img.height),
        });
    }
    let src = ImageRef::new(img.width, img.height, &img.data, PixelType::U8x3).map_err(|e| Error::Corrupt {
        reason: format!("resize source: {e}"),
    })?;
    let mut dst = Image::new(w, h, PixelType::U8x3);
    let opts = ResizeOptions::new().resize_alg(interpolation.alg());
    RESIZER
        .with(|r| r.borrow_mut().resize(&src, &mut dst, &opts))
        .map_err(|e| Error::Corrupt {
            reason: format!("resize: {e}"),
        })?;
    Ok(Rgb {
        width: w,
        height: h,
        data: dst.into_vec(),
    })
}

/// `CenterCrop`: the window at `round((H - h) / 2)`, zero padding (as torchvision pads) where
/// the image is smaller than the crop.
pub fn center_crop(img: &Rgb, h: u32, w: u32) -> Rgb {
    // Per axis: (source start, destination start, length).
    fn axis(input: u32, out: u32) -> (usize, usize, usize) {
        if input >= out {
            (pyround((input - out) as f64 / 2.0) as usize, 0, out as usize)
        } else {
            (0, ((out - input) / 2) as usize, input as usize)
        }
    }
    if img.width >= w && img.height >= h {
        let (sy, _, _) = axis(img.height, h);
        let (sx, _, _) = axis(img.width, w);
        return crop(img, sy as u32, sx as u32, h, w);
    }
    let (sy, dy, ly) = axis(img.height, h);
    let (sx, dx, lx) = axis(img.width, w);
    let mut out = Rgb::new(w, h);
    let (sw, dw) = (img.width as usize * 3, w as usize * 3);
    for y in 0..ly {
        let s = (sy + y) * sw + sx * 3;
        let d = (dy + y) * dw + dx * 3;
        out.data[d..d + lx * 3].copy_from_slice(&img.data[s..s + lx * 3]);
    }
    out
}

/// Mirror left to right in place.
pub fn hflip(img: &mut Rgb) {
    let row = img.width as usize * 3;
    for r in img.data.chunks_exact_mut(row) {
        let n = r.len() / 3;
        for x in 0..n / 2 {
            let (a, b) = (x * 3, (n - 1 - x) * 3);
            for c in 0..3 {
                r.swap(a + c, b + c);
            }
        }
    }
}

impl Op {
    /// Check the parameters as torchvision's constructors do.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |key: &str, reason: String| {
            Err(Error::Config {
                key: key.into(),
                reason,
            })
        };
        match *self {
            Op::RandomResizedCrop { h, w, scale, ratio, .. } => {
                if h == 0 || w == 0 {
                    return bad("RandomResizedCrop.size", format!("({h}, {w}) must be positive"));
                }
                if !(scale.0 > 0.0 && scale.0 <= scale.1) {
                    return bad("RandomResizedCrop.scale", format!("{scale:?} must be 0 < lo <= hi"));
                }
                if !(ratio.0 > 0.0 && ratio.1 > 0.0 && ratio.0.is_finite() && ratio.1.is_finite()) {
                    return bad("RandomResizedCrop.ratio", format!("{ratio:?} must be positive"));
                }
            }
            Op::RandomHorizontalFlip { p } => {
                if !(0.0..=1.0).contains(&p) {
                    return bad("RandomHorizontalFlip.p", format!("{p} not in [0, 1]"));
                }
            }
            Op::Resize { size, max_size, .. } => match size {
                Size::Shorter(0) | Size::Exact { h: 0, .. } | Size::Exact { w: 0, .. } => {
                    return bad("Resize.size", format!("{size:?} must be positive"));
                }
                Size::Shorter(s) if max_size.is_some_and(|m| m <= s) => {
                    return bad("Resize.max_size", format!("{max_size:?} must exceed size {s}"));
                }
                Size::Exact { .. } if max_size.is_some() => {
                    return bad("Resize.max_size", "only allowed with an int size".into());
                }
                _ => {}
            },
            Op::CenterCrop { h, w } => {
                if h == 0 || w == 0 {
                    return bad("CenterCrop.size", format!("({h}, {w}) must be positive"));
                }
            }
        }
        Ok(())
    }

    /// Output `(h, w)` if it does not depend on the input.
    pub fn fixed_size(&self) -> Option<(u32, u32)> {
        match *self {
            Op::RandomResizedCrop { h, w, .. } | Op::CenterCrop { h, w } => Some((h, w)),
            Op::Resize {
                size: Size::Exact { h, w },
                ..
            } => Some((h, w)),
            _ => None,
        }
    }

    /// Apply to one image, drawing from the sample's random stream.
    pub fn apply(&self, img: Rgb, rng: &mut SampleRng) -> Result<Rgb, Error> {
        Ok(match *self {
            Op::RandomResizedCrop {
                h,
                w,
                scale,
                ratio,
                interpolation,
            } => {
                let (i, j, ch, cw) = rrc_params(img.width, img.height, scale, ratio, rng);
                let c = if (i, j, ch, cw) == (0, 0, img.height, img.width) {
                    img
                } else {
                    crop(&img, i, j, ch, cw)
                };
                resize(&c, h, w, interpolation)?
            }
            Op::RandomHorizontalFlip { p } => {
                let mut img = img;
                if rng.unit() < p {
                    hflip(&mut img);
                }
                img
            }
            Op::Resize {
                size,
                max_size,
                interpolation,
            } => {
                let (h, w) = resize_output(img.width, img.height, size, max_size);
                resize(&img, h, w, interpolation)?
            }
            Op::CenterCrop { h, w } => center_crop(&img, h, w),
        })
    }
}
