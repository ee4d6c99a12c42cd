//! Compare JPEG decoders on the same files, one thread:
//! `cargo run --release -p clairvoyant-decode --example jpeg_decoders -- FILE.jpg...`
//! Prints images/s for zune-jpeg (used by the crate) and jpeg-decoder (the `image` crate's).

use std::time::Instant;

fn main() {
    let files: Vec<Vec<u8>> = std::env::args()
        .skip(1)
        .map(|p| std::fs::read(&p).expect("read"))
        .collect();
    assert!(!files.is_empty(), "usage: jpeg_decoders FILE.jpg...");
    let passes = 5;
    let time = |name: &str, f: &dyn Fn(&[u8]) -> usize| {
        let mut best = f64::MAX;
        let mut bytes = 0;
        for _ in 0..passes {
            let t = Instant::now();
            for b in &files {
                bytes += f(b);
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "{name:>13}: {:8.1} images/s ({} files, best of {passes}, {bytes} bytes out)",
            files.len() as f64 / best,
            files.len()
        );
    };
    time("zune-jpeg", &|b| {
        clairvoyant_decode::decode_rgb(b, false).expect("zune").data.len()
    });
    time("jpeg-decoder", &|b| {
        jpeg_decoder::Decoder::new(b).decode().expect("jpeg-decoder").len()
    });
}
