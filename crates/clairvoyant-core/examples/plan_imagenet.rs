//! Times the `plan` computation at ImageNet-1k scale (F=1,281,167, N=16, E=90, rank 0).
fn main() {
    let s = clairvoyant_core::schedule::Schedule::shuffle(1_281_167, 16, 32, 90, 0, false).unwrap();
    let t = std::time::Instant::now();
    let r = clairvoyant_core::plan::report(&s, &[0], |_| 110_000, &[("memory".into(), 64 << 30), ("ssd".into(), 0)])
        .unwrap();
    println!(
        "{:.2} s; {} samples > 10 accesses",
        t.elapsed().as_secs_f64(),
        r["frequency_histogram"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(c, _)| c.parse::<u32>().unwrap() > 10)
            .map(|(_, n)| n.as_u64().unwrap())
            .sum::<u64>()
    );
}
