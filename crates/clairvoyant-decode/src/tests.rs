//! Unit tests on synthetic images (PNG-encoded with the `png` crate); comparisons with Pillow
//! and torchvision are in tests/test_decode.py.

use super::*;
use crate::transform::{center_crop, resize_output, rrc_params};

fn png_bytes(w: u32, h: u32, color: png::ColorType, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, w, h);
        enc.set_color(color);
        enc.set_depth(png::BitDepth::Eight);
        let mut wr = enc.write_header().unwrap();
        wr.write_image_data(data).unwrap();
    }
    out
}

fn gradient(w: u32, h: u32) -> Vec<u8> {
    (0..h * w)
        .flat_map(|i| [(i % w) as u8, (i / w) as u8, ((i * 7) % 251) as u8])
        .collect()
}

fn rrc(h: u32, w: u32) -> Op {
    Op::RandomResizedCrop {
        h,
        w,
        scale: (0.08, 1.0),
        ratio: (0.75, 4.0 / 3.0),
        interpolation: Interpolation::Bilinear,
    }
}

#[test]
fn png_rgb_rgba_gray_decode_to_rgb() {
    let rgb = gradient(5, 4);
    let d = decode_rgb(&png_bytes(5, 4, png::ColorType::Rgb, &rgb), false).unwrap();
    assert_eq!((d.width, d.height, &d.data), (5, 4, &rgb));
    let rgba: Vec<u8> = rgb.chunks(3).flat_map(|p| [p[0], p[1], p[2], 17]).collect();
    assert_eq!(
        decode_rgb(&png_bytes(5, 4, png::ColorType::Rgba, &rgba), false)
            .unwrap()
            .data,
        rgb
    );
    let gray: Vec<u8> = (0..20).collect();
    let g = decode_rgb(&png_bytes(5, 4, png::ColorType::Grayscale, &gray), false).unwrap();
    assert_eq!(&g.data[9..12], &[3, 3, 3]);
}

#[test]
fn garbage_and_truncation_are_corrupt() {
    assert!(matches!(decode_rgb(b"hello", false), Err(Error::Corrupt { .. })));
    let b = png_bytes(8, 8, png::ColorType::Rgb, &gradient(8, 8));
    assert!(matches!(
        decode_rgb(&b[..b.len() / 2], false),
        Err(Error::Corrupt { .. })
    ));
    assert!(matches!(
        decode_rgb(&[0xFF, 0xD8, 0xFF, 0xE0, 0, 16], false),
        Err(Error::Corrupt { .. })
    ));
}

#[test]
fn orientations_match_their_definitions() {
    // 3 x 2 image whose pixel values are their index.
    let img = Rgb {
        width: 3,
        height: 2,
        data: (0..6u8).flat_map(|v| [v, v, v]).collect(),
    };
    let px = |r: &Rgb| r.data.iter().step_by(3).copied().collect::<Vec<_>>();
    // Stored rows: [0 1 2] [3 4 5].
    assert_eq!(px(&image::orient(img.clone(), 2)), [2, 1, 0, 5, 4, 3]);
    assert_eq!(px(&image::orient(img.clone(), 3)), [5, 4, 3, 2, 1, 0]);
    assert_eq!(px(&image::orient(img.clone(), 4)), [3, 4, 5, 0, 1, 2]);
    assert_eq!(px(&image::orient(img.clone(), 5)), [0, 3, 1, 4, 2, 5]);
    // 6: rotate 90 degrees clockwise.
    assert_eq!(px(&image::orient(img.clone(), 6)), [3, 0, 4, 1, 5, 2]);
    assert_eq!(px(&image::orient(img.clone(), 7)), [5, 2, 4, 1, 3, 0]);
    // 8: rotate 90 degrees counter-clockwise.
    assert_eq!(px(&image::orient(img.clone(), 8)), [2, 5, 1, 4, 0, 3]);
    assert_eq!(image::orient(img.clone(), 1), img);
}

#[test]
fn rng_is_a_function_of_seed_epoch_sample() {
    let draws = |s, e, i| {
        let mut r = SampleRng::new(s, e, i);
        (0..4).map(|_| r.next_u64()).collect::<Vec<_>>()
    };
    assert_eq!(draws(1, 2, 3), draws(1, 2, 3));
    assert_ne!(draws(1, 2, 3), draws(1, 3, 3));
    assert_ne!(draws(1, 2, 3), draws(1, 2, 4));
    assert_ne!(draws(1, 2, 3), draws(2, 2, 3));
    let mut r = SampleRng::new(0, 0, 0);
    for _ in 0..1000 {
        let u = r.unit();
        assert!((0.0..1.0).contains(&u));
        assert!(r.below(7) < 7);
    }
}

#[test]
fn rrc_params_fit_and_fall_back_to_center() {
    let mut rng = SampleRng::new(5, 0, 0);
    for _ in 0..2000 {
        let (i, j, h, w) = rrc_params(500, 375, (0.08, 1.0), (0.75, 4.0 / 3.0), &mut rng);
        assert!(h > 0 && w > 0 && i + h <= 375 && j + w <= 500, "{i} {j} {h} {w}");
    }
    // A scale no draw can satisfy forces the fallback: a 1000x10 image is wider than 4/3, so the
    // centered crop is 10 high and round(10 * 4/3) = 13 wide.
    let mut rng = SampleRng::new(5, 0, 1);
    assert_eq!(
        rrc_params(1000, 10, (50.0, 60.0), (0.75, 4.0 / 3.0), &mut rng),
        (0, 493, 10, 13)
    );
}

#[test]
fn resize_sizes_follow_torchvision() {
    assert_eq!(resize_output(500, 375, Size::Shorter(256), None), (256, 341));
    assert_eq!(resize_output(375, 500, Size::Shorter(256), None), (341, 256));
    assert_eq!(resize_output(1000, 100, Size::Shorter(50), Some(300)), (30, 300));
    assert_eq!(resize_output(9, 9, Size::Exact { h: 4, w: 6 }, None), (4, 6));
}

#[test]
fn center_crop_rounds_half_to_even_and_pads_with_zero() {
    let img = Rgb {
        width: 5,
        height: 1,
        data: (0..5u8).flat_map(|v| [v, v, v]).collect(),
    };
    // (5 - 2) / 2 = 1.5 rounds to 2.
    assert_eq!(center_crop(&img, 1, 2).data, [2, 2, 2, 3, 3, 3]);
    let p = center_crop(&img, 3, 7);
    assert_eq!((p.width, p.height), (7, 3));
    assert!(p.data[..21].iter().all(|&v| v == 0));
    assert_eq!(&p.data[21..24], &[0, 0, 0]);
    assert_eq!(&p.data[24..27], &[0, 0, 0]);
    assert_eq!(&p.data[27..30], &[1, 1, 1]);
}

#[test]
fn batch_is_reproducible_and_thread_count_independent() {
    let b = png_bytes(64, 48, png::ColorType::Rgb, &gradient(64, 48));
    let plan = Plan {
        ops: vec![rrc(16, 16), Op::RandomHorizontalFlip { p: 0.5 }],
        output: Output::F32Chw {
            mean: [0.485, 0.456, 0.406],
            std: [0.229, 0.224, 0.225],
        },
        exif_orientation: false,
    };
    let inputs: Vec<&[u8]> = vec![&b; 8];
    let keys: Vec<SampleKey> = (0..8)
        .map(|s| SampleKey {
            seed: 3,
            epoch: 1,
            sample: s,
        })
        .collect();
    let run = |threads| {
        let p = Pipeline::new(plan.clone(), threads).unwrap();
        assert_eq!(p.sample_shape(), [3, 16, 16]);
        let mut out = vec![0f32; 8 * p.sample_len()];
        p.run_batch(&inputs, &keys, OutBuf::F32(&mut out)).unwrap();
        out
    };
    let a = run(1);
    assert_eq!(a, run(3));
    // Different samples got different crops.
    let n = 3 * 16 * 16;
    assert_ne!(a[..n], a[n..2 * n]);
}

#[test]
fn batch_error_names_the_first_failing_sample() {
    let good = png_bytes(32, 32, png::ColorType::Rgb, &gradient(32, 32));
    let plan = Plan {
        ops: vec![Op::CenterCrop { h: 8, w: 8 }],
        output: Output::U8Chw,
        exif_orientation: false,
    };
    let p = Pipeline::new(plan, 2).unwrap();
    let inputs: Vec<&[u8]> = vec![&good, b"nope", &good, &good[..40]];
    let keys: Vec<SampleKey> = (0..4)
        .map(|s| SampleKey {
            seed: 0,
            epoch: 0,
            sample: 100 + s,
        })
        .collect();
    let mut out = vec![0u8; 4 * p.sample_len()];
    let e = p.run_batch(&inputs, &keys, OutBuf::U8(&mut out)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Sample {
                index: 1,
                sample: 101,
                ..
            }
        ),
        "{e}"
    );
    // Wrong buffer size and type are refused before any work.
    assert!(matches!(
        p.run_batch(&inputs, &keys, OutBuf::U8(&mut out[1..])),
        Err(Error::Output { .. })
    ));
    let mut f = vec![0f32; 4 * p.sample_len()];
    assert!(matches!(
        p.run_batch(&inputs, &keys, OutBuf::F32(&mut f)),
        Err(Error::Output { .. })
    ));
}

#[test]
fn plans_without_a_fixed_size_are_refused() {
    let plan = Plan {
        ops: vec![
            Op::CenterCrop { h: 8, w: 8 },
            Op::Resize {
                size: Size::Shorter(4),
                max_size: None,
                interpolation: Interpolation::Bilinear,
            },
        ],
        output: Output::U8Hwc,
        exif_orientation: false,
    };
    assert!(matches!(Pipeline::new(plan, 1), Err(Error::Config { .. })));
    let plan = Plan {
        ops: vec![Op::RandomHorizontalFlip { p: 1.5 }, rrc(4, 4)],
        output: Output::U8Hwc,
        exif_orientation: false,
    };
    assert!(matches!(Pipeline::new(plan, 1), Err(Error::Config { .. })));
}

mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// RandomResizedCrop's window always lies inside the image and is non-empty, whatever
        /// the draws, sizes and (sane) parameters; the same key gives the same window.
        #[test]
        fn rrc_window_fits(
            w in 4u32..3000, h in 4u32..3000,
            lo in 0.01f64..1.0, span in 0.0f64..1.0,
            r0 in 0.25f64..1.0, r1 in 1.0f64..4.0,
            key in any::<u64>(),
        ) {
            let scale = (lo, lo + span);
            let mut rng = SampleRng::new(key, 1, 2);
            let (i, j, ch, cw) = rrc_params(w, h, scale, (r0, r1), &mut rng);
            prop_assert!(ch >= 1 && cw >= 1 && i + ch <= h && j + cw <= w, "{i} {j} {ch} {cw} in {w}x{h}");
            let mut again = SampleRng::new(key, 1, 2);
            prop_assert_eq!(rrc_params(w, h, scale, (r0, r1), &mut again), (i, j, ch, cw));
        }

        /// CenterCrop always yields the requested size, padding or not.
        #[test]
        fn center_crop_size(w in 1u32..64, h in 1u32..64, cw in 1u32..80, ch in 1u32..80) {
            let img = Rgb::new(w, h);
            let c = center_crop(&img, ch, cw);
            prop_assert_eq!((c.width, c.height, c.data.len()), (cw, ch, (cw * ch * 3) as usize));
        }
    }
}
