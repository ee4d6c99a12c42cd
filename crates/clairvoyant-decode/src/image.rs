//! Decoding JPEG and PNG bytes to 8-bit RGB the way torchvision's `ImageFolder` sees them
//! (`PIL.Image.open(f).convert("RGB")`), with EXIF orientation applied only when asked.

use std::io::Cursor;

use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

use crate::Error;

/// Largest width or height accepted (Pillow's decompression-bomb guard is in pixels; ours is
/// per side, which bounds one decoded image to 3 * 16384^2 bytes).
pub const MAX_SIDE: u32 = 16_384;

/// An 8-bit RGB image, rows top to bottom, pixels interleaved (HWC).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rgb {
    /// Columns.
    pub width: u32,
    /// Rows.
    pub height: u32,
    /// `height * width * 3` bytes, R G B per pixel.
    pub data: Vec<u8>,
}

impl Rgb {
    /// A black image of the given size.
    pub fn new(width: u32, height: u32) -> Self {
        Rgb {
            width,
            height,
            data: vec![0; width as usize * height as usize * 3],
        }
    }
}

/// Decode JPEG or PNG bytes (told apart by their signature) to RGB.
///
/// Grayscale is replicated to three channels, CMYK/YCCK JPEGs are converted as Pillow's
/// `convert("RGB")` does (Adobe inverted CMYK, R = C'K'/255), alpha is dropped without
/// compositing (also as `convert("RGB")`), 16-bit PNG keeps the high byte. With
/// `exif_orientation`, the EXIF Orientation tag is applied as `PIL.ImageOps.exif_transpose`;
/// without it the pixels are left as stored, which is what `ImageFolder`'s loader does.
pub fn decode_rgb(bytes: &[u8], exif_orientation: bool) -> Result<Rgb, Error> {
    let img = if bytes.starts_with(&[0xFF, 0xD8]) {
        decode_jpeg(bytes)?
    } else if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        decode_png(bytes)?
    } else {
        return Err(Error::Corrupt {
            reason: "neither a JPEG nor a PNG signature".into(),
        });
    };
    if exif_orientation {
        if let Some(o) = orientation(bytes) {
            return Ok(orient(img, o));
        }
    }
    Ok(img)
}

fn decode_jpeg(bytes: &[u8]) -> Result<Rgb, Error> {
    // Strict mode: a truncated or damaged stream is an error, as in Pillow (whose
    // LOAD_TRUNCATED_IMAGES is off by default), never a silently gray-filled image.
    let opts = DecoderOptions::default()
        .set_strict_mode(true)
        .set_max_width(MAX_SIDE as usize)
        .set_max_height(MAX_SIDE as usize)
        .jpeg_set_out_colorspace(ColorSpace::RGB);
    let mut dec = JpegDecoder::new_with_options(ZCursor::new(bytes), opts);
    dec.decode_headers().map_err(|e| Error::Corrupt {
        reason: format!("JPEG: {e:?}"),
    })?;
    let (w, h) = dec.dimensions().ok_or(Error::Corrupt {
        reason: "JPEG: no dimensions".into(),
    })?;
    let (w, h) = (w as u32, h as u32);
    let gray = dec.input_colorspace() == Some(ColorSpace::Luma);
    if gray {
        // Decode luma alone and replicate, as Pillow's L -> RGB does.
        dec.set_options(opts.jpeg_set_out_colorspace(ColorSpace::Luma));
    }
    let raw = dec.decode().map_err(|e| Error::Corrupt {
        reason: format!("JPEG: {e:?}"),
    })?;
    let data = if gray {
        raw.iter().flat_map(|&v| [v, v, v]).collect()
    } else {
        raw
    };
    if data.len() != w as usize * h as usize * 3 {
        return Err(Error::Corrupt {
            reason: format!("JPEG: decoded {} bytes for {w}x{h}", data.len()),
        });
    }
    Ok(Rgb {
        width: w,
        height: h,
        data,
    })
}

fn decode_png(bytes: &[u8]) -> Result<Rgb, Error> {
    let corrupt = |e: png::DecodingError| Error::Corrupt {
        reason: format!("PNG: {e}"),
    };
    let mut dec = png::Decoder::new(Cursor::new(bytes));
    // Palette -> RGB(A), low bit depths -> 8 bits, 16 bits -> high byte (Pillow's RGB;16B).
    dec.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = dec.read_info().map_err(corrupt)?;
    let (w, h) = (reader.info().width, reader.info().height);
    if w > MAX_SIDE || h > MAX_SIDE {
        return Err(Error::Corrupt {
            reason: format!("PNG: {w}x{h} exceeds {MAX_SIDE} per side"),
        });
    }
    let size = reader.output_buffer_size().ok_or(Error::Corrupt {
        reason: "PNG: image too large".into(),
    })?;
    let mut buf = vec![0; size];
    let info = reader.next_frame(&mut buf).map_err(corrupt)?;
    let (w, h) = (info.width, info.height);
    let px = w as usize * h as usize;
    let src = &buf[..info.buffer_size()];
    let data = match info.color_type {
        png::ColorType::Rgb => src.to_vec(),
        png::ColorType::Rgba => src.chunks_exact(4).flat_map(|p| [p[0], p[1], p[2]]).collect(),
        png::ColorType::Grayscale => src.iter().flat_map(|&v| [v, v, v]).collect(),
        png::ColorType::GrayscaleAlpha => src.chunks_exact(2).flat_map(|p| [p[0], p[0], p[0]]).collect(),
        png::ColorType::Indexed => {
            return Err(Error::Corrupt {
                reason: "PNG: palette not expanded".into(),
            });
        }
    };
    if data.len() != px * 3 {
        return Err(Error::Corrupt {
            reason: format!("PNG: decoded {} bytes for {w}x{h}", data.len()),
        });
    }
    Ok(Rgb {
        width: w,
        height: h,
        data,
    })
}

/// The EXIF Orientation (1..=8) of a JPEG or PNG, if it has one.
pub fn orientation(bytes: &[u8]) -> Option<u32> {
    let exif = exif::Reader::new().read_from_container(&mut Cursor::new(bytes)).ok()?;
    let f = exif.get_field(exif::Tag::Orientation, exif::In::PRIMARY)?;
    f.value.get_uint(0).filter(|o| (1..=8).contains(o))
}

/// Apply an EXIF orientation as `PIL.ImageOps.exif_transpose` does.
pub fn orient(img: Rgb, o: u32) -> Rgb {
    let (w, h) = (img.width as usize, img.height as usize);
    // (transposed, flip x, flip y) applied to the stored image, mapping output -> input.
    let (t, fx, fy) = match o {
        2 => (false, true, false), // FLIP_LEFT_RIGHT
        3 => (false, true, true),  // ROTATE_180
        4 => (false, false, true), // FLIP_TOP_BOTTOM
        5 => (true, false, false), // TRANSPOSE
        6 => (true, false, true),  // ROTATE_270 (90 degrees clockwise)
        7 => (true, true, true),   // TRANSVERSE
        8 => (true, true, false),  // ROTATE_90 (90 degrees counter-clockwise)
        _ => return img,
    };
    let (ow, oh) = if t { (h, w) } else { (w, h) };
    let mut out = Rgb::new(ow as u32, oh as u32);
    for y in 0..oh {
        for x in 0..ow {
            // Position in the transposed (or not) frame, then flipped.
            let (mut sx, mut sy) = if t { (y, x) } else { (x, y) };
            if fx {
                sx = w - 1 - sx;
            }
            if fy {
                sy = h - 1 - sy;
            }
            let s = (sy * w + sx) * 3;
            let d = (y * ow + x) * 3;
            out.data[d..d + 3].copy_from_slice(&img.data[s..s + 3]);
        }
    }
    out
}
