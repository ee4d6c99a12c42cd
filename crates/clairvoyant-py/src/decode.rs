//! Bindings of `clairvoyant_decode`: a batch of encoded images (bytes or uint8 numpy arrays)
//! decoded and transformed into a caller's preallocated numpy array (a pinned torch tensor's
//! `.numpy()` view shares its memory), with the GIL released.

use clairvoyant_decode::{Error, Interpolation, Op, OutBuf, Output, Pipeline, Plan, SampleKey, Size};
use numpy::PyReadonlyArray1;
use numpy::{PyReadwriteArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::ConfigError;

pyo3::import_exception!(clairvoyant.errors, CorruptError);

fn to_py(e: Error, names: Option<&[String]>) -> PyErr {
    match e {
        Error::Sample { index, sample, source } => {
            let name = names
                .and_then(|n| n.get(index))
                .map(|n| format!(" ({n})"))
                .unwrap_or_default();
            CorruptError::new_err(format!("sample {sample}{name}, batch position {index}: {source}"))
        }
        Error::Config { .. } => ConfigError::new_err(e.to_string()),
        Error::Corrupt { .. } => CorruptError::new_err(e.to_string()),
        _ => ConfigError::new_err(e.to_string()),
    }
}

fn interp(s: &str) -> PyResult<Interpolation> {
    match s {
        "bilinear" => Ok(Interpolation::Bilinear),
        "bicubic" => Ok(Interpolation::Bicubic),
        _ => Err(ConfigError::new_err(format!(
            "interpolation {s:?}: only 'bilinear' and 'bicubic'"
        ))),
    }
}

/// One op from its tuple form (see `_native.pyi`).
fn op(t: &Bound<'_, PyAny>) -> PyResult<Op> {
    let kind: String = t.get_item(0)?.extract()?;
    Ok(match kind.as_str() {
        "random_resized_crop" => {
            let (_, h, w, scale, ratio, i): (String, u32, u32, (f64, f64), (f64, f64), String) = t.extract()?;
            Op::RandomResizedCrop {
                h,
                w,
                scale,
                ratio,
                interpolation: interp(&i)?,
            }
        }
        "hflip" => Op::RandomHorizontalFlip {
            p: t.get_item(1)?.extract()?,
        },
        "resize" => {
            let (_, size, max_size, i): (String, Vec<u32>, Option<u32>, String) = t.extract()?;
            let size = match size[..] {
                [s] => Size::Shorter(s),
                [h, w] => Size::Exact { h, w },
                _ => return Err(ConfigError::new_err(format!("Resize.size {size:?}: one or two ints"))),
            };
            Op::Resize {
                size,
                max_size,
                interpolation: interp(&i)?,
            }
        }
        "center_crop" => {
            let (_, h, w): (String, u32, u32) = t.extract()?;
            Op::CenterCrop { h, w }
        }
        _ => return Err(ConfigError::new_err(format!("unknown transform {kind:?}"))),
    })
}

/// A decode + transform pipeline with its own pool of decode threads.
#[pyclass(name = "DecodePipeline", frozen, module = "clairvoyant._native")]
pub struct PyDecodePipeline {
    inner: Pipeline,
}

#[pymethods]
impl PyDecodePipeline {
    #[new]
    #[pyo3(signature = (ops, output, mean=None, std=None, exif_orientation=false, threads=0))]
    fn new(
        py: Python<'_>,
        ops: Vec<Bound<'_, PyAny>>,
        output: &str,
        mean: Option<[f32; 3]>,
        std: Option<[f32; 3]>,
        exif_orientation: bool,
        threads: usize,
    ) -> PyResult<Self> {
        let ops = ops.iter().map(op).collect::<PyResult<Vec<_>>>()?;
        let output = match output {
            "uint8_hwc" => Output::U8Hwc,
            "uint8_chw" => Output::U8Chw,
            "float32_chw" => Output::F32Chw {
                mean: mean.unwrap_or([0.0; 3]),
                std: std.unwrap_or([1.0; 3]),
            },
            _ => {
                return Err(ConfigError::new_err(format!(
                    "output {output:?}: uint8_hwc, uint8_chw or float32_chw"
                )))
            }
        };
        let plan = Plan {
            ops,
            output,
            exif_orientation,
        };
        let inner = py.detach(|| Pipeline::new(plan, threads)).map_err(|e| to_py(e, None))?;
        Ok(PyDecodePipeline { inner })
    }

    /// Shape of one sample: (H, W, 3) or (3, H, W).
    #[getter]
    fn sample_shape(&self) -> (usize, usize, usize) {
        let [a, b, c] = self.inner.sample_shape();
        (a, b, c)
    }

    #[getter]
    fn threads(&self) -> usize {
        self.inner.threads()
    }

    /// Decode `inputs[i]` into `out[i]` with the random stream of (seed, epoch, samples[i]).
    #[pyo3(signature = (inputs, samples, seed, epoch, out, names=None))]
    #[allow(clippy::too_many_arguments)] // the Python signature; each is one keyword argument there
    fn run(
        &self,
        py: Python<'_>,
        inputs: Vec<Bound<'_, PyAny>>,
        samples: Vec<u64>,
        seed: u64,
        epoch: u64,
        out: &Bound<'_, PyAny>,
        names: Option<Vec<String>>,
    ) -> PyResult<()> {
        // Borrow every input first (bytes, or a read-only borrow of a uint8 array), then slice.
        let mut arrays: Vec<Option<PyReadonlyArray1<'_, u8>>> = Vec::with_capacity(inputs.len());
        for (i, b) in inputs.iter().enumerate() {
            if b.is_instance_of::<PyBytes>() {
                arrays.push(None);
            } else {
                let a = b.extract::<PyReadonlyArray1<'_, u8>>().map_err(|_| {
                    ConfigError::new_err(format!("input {i} is neither bytes nor a 1-D uint8 numpy array"))
                })?;
                arrays.push(Some(a));
            }
        }
        let mut slices: Vec<&[u8]> = Vec::with_capacity(inputs.len());
        for (i, (b, a)) in inputs.iter().zip(&arrays).enumerate() {
            slices.push(match a {
                Some(a) => a
                    .as_slice()
                    .map_err(|_| ConfigError::new_err(format!("input {i} is not contiguous")))?,
                None => b.cast::<PyBytes>()?.as_bytes(),
            });
        }
        let keys: Vec<SampleKey> = samples
            .iter()
            .map(|&sample| SampleKey { seed, epoch, sample })
            .collect();
        let names = names.as_deref();
        if let Ok(mut a) = out.extract::<PyReadwriteArrayDyn<'_, u8>>() {
            check_shape(a.shape(), samples.len(), self.inner.sample_shape())?;
            let buf = a
                .as_slice_mut()
                .map_err(|_| ConfigError::new_err("out must be C-contiguous"))?;
            py.detach(|| self.inner.run_batch(&slices, &keys, OutBuf::U8(buf)))
                .map_err(|e| to_py(e, names))
        } else if let Ok(mut a) = out.extract::<PyReadwriteArrayDyn<'_, f32>>() {
            check_shape(a.shape(), samples.len(), self.inner.sample_shape())?;
            let buf = a
                .as_slice_mut()
                .map_err(|_| ConfigError::new_err("out must be C-contiguous"))?;
            py.detach(|| self.inner.run_batch(&slices, &keys, OutBuf::F32(buf)))
                .map_err(|e| to_py(e, names))
        } else {
            Err(ConfigError::new_err(
                "out must be a writable numpy uint8 or float32 array",
            ))
        }
    }
}

fn check_shape(shape: &[usize], n: usize, sample: [usize; 3]) -> PyResult<()> {
    if shape != [n, sample[0], sample[1], sample[2]] {
        return Err(ConfigError::new_err(format!(
            "out has shape {shape:?}, expected {:?}",
            [n, sample[0], sample[1], sample[2]]
        )));
    }
    Ok(())
}

/// `RandomResizedCrop`'s `(top, left, h, w)` for a `width` x `height` image as the native
/// pipeline draws it for (seed, epoch, sample); for tests and for checking reproducibility.
#[pyfunction]
pub fn random_resized_crop_params(
    width: u32,
    height: u32,
    scale: (f64, f64),
    ratio: (f64, f64),
    seed: u64,
    epoch: u64,
    sample: u64,
) -> (u32, u32, u32, u32) {
    let mut rng = clairvoyant_decode::SampleRng::new(seed, epoch, sample);
    clairvoyant_decode::transform::rrc_params(width, height, scale, ratio, &mut rng)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDecodePipeline>()?;
    m.add_function(wrap_pyfunction!(random_resized_crop_params, m)?)
}
