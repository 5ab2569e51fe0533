use super::*;
use crate::test_rng::uniform_floats;

/// Roughly normal samples (sum of 12 uniforms), the same for the same seed.
fn gaussian(seed: u64, n: usize, sigma: f32) -> Vec<f32> {
    uniform_floats(seed, 12 * n, 0.5)
        .chunks_exact(12)
        .map(|c| c.iter().sum::<f32>() * sigma)
        .collect()
}

/// Importances in [0.5, 1.5).
fn importances(seed: u64, n: usize) -> Vec<f32> {
    uniform_floats(seed, n, 0.5)
        .iter()
        .map(|u| 1.0 + u)
        .collect()
}

fn steps(steps: usize) -> Options {
    Options { steps, sparsity: true }
}

fn weighted_err(w: &[f32], q: &[f32], h: &[f32]) -> f64 {
    w.iter()
        .zip(q)
        .zip(h)
        .map(|((&a, &b), &hj)| hj as f64 * ((a - b) as f64).powi(2))
        .sum()
}

#[test]
fn codes_pack_and_unpack() {
    let codes: Vec<u8> = (0..64).map(|i| ((i * 5 + 3) % 8) as u8).collect();
    let mut packed = vec![0u8; 24];
    pack_codes(&codes, &mut packed);
    for (i, &c) in codes.iter().enumerate() {
        assert_eq!(code_at(&packed, i), c);
    }
}

#[test]
fn layout_sizes_and_validation() {
    let l = Layout::new(128, 2).unwrap();
    assert_eq!(l.record_bytes(), 4 + 48 + 4);
    assert_eq!(l.bits_per_weight(), 3.5);
    assert_eq!(Layout::new(128, 0).unwrap().bits_per_weight(), 3.25);
    assert!(Layout::new(96, 2).is_err());
    assert!(Layout::new(128, 3).is_err());
    assert!(l.row_bytes(200).is_err());
}

#[test]
fn stored_error_is_the_reported_error_and_dot_matches_dequantize() {
    for (k, (group, slots)) in [(32, 0), (64, 2), (128, 2), (128, 4), (256, 8)]
        .into_iter()
        .enumerate()
    {
        let l = Layout::new(group, slots).unwrap();
        let n = 1024;
        let w = gaussian(10 + k as u64, n, 0.02);
        let h = importances(20 + k as u64, n);
        let mut rec = vec![0u8; l.row_bytes(n).unwrap()];
        let stats = quantize_row(l, &w, &h, &steps(20), &mut rec);
        let mut deq = vec![0f32; n];
        dequantize_row(l, &rec, &mut deq).unwrap();
        let err = weighted_err(&w, &deq, &h);
        assert!(
            (err - stats.err).abs() <= 1e-6 * stats.weight,
            "{group}/{slots}: {err} vs {}",
            stats.err
        );
        let x = gaussian(30 + k as u64, n, 1.0);
        let want: f64 = deq.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
        let got = dot_row(l, &rec, &x) as f64;
        assert!(
            (got - want).abs() <= 1e-4 * want.abs().max(1e-3),
            "{got} vs {want}"
        );
    }
}

#[test]
fn rco_and_residual_slots_beat_round_to_nearest() {
    let n = 128 * 64;
    let mut w = gaussian(2, n, 0.02);
    for i in (0..n).step_by(97) {
        w[i] *= 12.0; // outliers, as real weight matrices have
    }
    let h = vec![1.0f32; n];
    let plain = Layout::new(128, 0).unwrap();
    let slotted = Layout::new(128, 2).unwrap();
    let mut rec = vec![0u8; plain.row_bytes(n).unwrap()];
    let rco = quantize_row(plain, &w, &h, &steps(50), &mut rec);
    assert!(
        rco.err < 0.8 * rco.err_rtn,
        "RCO {} vs RTN {}",
        rco.err,
        rco.err_rtn
    );
    let mut rec2 = vec![0u8; slotted.row_bytes(n).unwrap()];
    let res = quantize_row(slotted, &w, &h, &steps(50), &mut rec2);
    assert!(
        res.err < 0.6 * rco.err,
        "slots {} vs no slots {}",
        res.err,
        rco.err
    );
    assert!(res.slots_used > 0);
}

#[test]
fn sparse_groups_keep_exact_zeros() {
    let n = 128 * 16;
    let g = gaussian(3, n, 0.05);
    let w: Vec<f32> = (0..n)
        .map(|i| if i % 3 == 0 { g[i] + 0.08 } else { 0.0 })
        .collect();
    let h = vec![1.0f32; n];
    let l = Layout::new(128, 2).unwrap();
    let mut rec = vec![0u8; l.row_bytes(n).unwrap()];
    let stats = quantize_row(l, &w, &h, &steps(30), &mut rec);
    assert!(stats.sparse_groups > 0, "{stats:?}");
    let mut deq = vec![1f32; n];
    dequantize_row(l, &rec, &mut deq).unwrap();
    let kept = w
        .iter()
        .zip(&deq)
        .filter(|(&a, &b)| a == 0.0 && b == 0.0)
        .count();
    // Sparse mode is chosen where it lowers the error (6 of 16 groups here); its zero codes decode to exact zeros,
    // and nearly all are where the weights were zero (a few small weights round to zero).
    assert!(deq.iter().filter(|&&b| b == 0.0).count() >= stats.zeros);
    assert!(kept >= stats.zeros * 9 / 10 && stats.zeros > w.len() / 8, "{kept} zeros kept; {stats:?}");
}

#[test]
fn quantization_is_deterministic() {
    let w = gaussian(4, 4096, 0.03);
    let h = importances(5, 4096);
    let l = Layout::new(64, 2).unwrap();
    let (mut a, mut b) = (
        vec![0u8; l.row_bytes(4096).unwrap()],
        vec![0u8; l.row_bytes(4096).unwrap()],
    );
    quantize_row(l, &w, &h, &steps(30), &mut a);
    quantize_row(l, &w, &h, &steps(30), &mut b);
    assert_eq!(a, b);
}

#[test]
fn dequantize_rejects_wrong_sizes() {
    let l = Layout::new(128, 2).unwrap();
    let mut out = vec![0f32; 256];
    assert!(dequantize_row(l, &[0u8; 10], &mut out).is_err());
}

#[test]
fn without_sparsity_no_group_is_sparse() {
    let n = 128 * 16;
    let g = gaussian(3, n, 0.05);
    let w: Vec<f32> = (0..n).map(|i| if i % 3 == 0 { g[i] + 0.08 } else { 0.0 }).collect();
    let h = vec![1.0f32; n];
    let l = Layout::new(128, 2).unwrap();
    let mut rec = vec![0u8; l.row_bytes(n).unwrap()];
    let with = quantize_row(l, &w, &h, &steps(30), &mut rec);
    let without = quantize_row(l, &w, &h, &Options { steps: 30, sparsity: false }, &mut rec);
    assert!(with.sparse_groups > 0 && without.sparse_groups == 0, "{with:?} / {without:?}");
    assert_eq!(without.zeros, 0);
    assert!(rec.chunks_exact(l.record_bytes()).all(|r| r[1] & 0x80 == 0), "a sign bit marks a sparse group");
    assert!(with.err < without.err, "sparsity should help on these weights: {with:?} / {without:?}");
}

#[test]
fn simd_dot_matches_the_scalar_reference() {
    // The kernel this CPU picks (AVX2 where available) against `dot_row`, on every layout shape, dense and
    // sparse groups, slots used; a kernel that drops a group, a slot or a sign is off by far more than the
    // tolerance (f32 sums in another order: relative 1e-5 of the sum of |terms|).
    for (k, (group, slots)) in [(32, 0), (64, 2), (128, 0), (128, 4), (256, 16)].into_iter().enumerate() {
        let l = Layout::new(group, slots).unwrap();
        let n = 1024;
        let mut w = gaussian(40 + k as u64, n, 0.02);
        for i in (0..n).step_by(5) {
            w[i] = 0.0; // sparse groups
        }
        for i in (0..n).step_by(61) {
            w[i] *= 15.0; // slots
        }
        let h = importances(50 + k as u64, n);
        let mut rec = vec![0u8; l.row_bytes(n).unwrap()];
        let st = quantize_row(l, &w, &h, &steps(10), &mut rec);
        assert!(st.sparse_groups > 0 && (slots == 0 || st.slots_used > 0), "{group}/{slots}: {st:?}");
        let x = gaussian(60 + k as u64, n, 1.0);
        let mut deq = vec![0f32; n];
        dequantize_row(l, &rec, &mut deq).unwrap();
        let mag: f32 = deq.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
        let want = dot_row(l, &rec, &x);
        let got = crate::quant::simd::gsq_dot(l, &rec, &x);
        assert!((got - want).abs() <= 1e-5 * mag, "{group}/{slots}: {got} vs {want} (isa {})", crate::quant::simd::isa());
        // Part of a row (fewer records) sums only those.
        let rb = l.record_bytes();
        let part = crate::quant::simd::gsq_dot(l, &rec[..2 * rb], &x[..2 * group]);
        assert!((part - dot_row(l, &rec[..2 * rb], &x[..2 * group])).abs() <= 1e-5 * mag);
    }
}

/// Throughput of the picked GSQ-RCO kernel against the Q4_K one on one 8960 x 1536 matrix's worth of rows
/// (single thread): `cargo test --release -p ninfer-core --lib gsq_kernel_speed -- --ignored --nocapture`.
#[test]
#[ignore]
fn gsq_kernel_speed() {
    use crate::quant::{quantize_act, vec_dot, GgmlType};
    let (n, rows) = (1536, 2048);
    let l = Layout::new(128, 4).unwrap();
    let w = gaussian(7, n, 0.02);
    let mut rec = vec![0u8; l.row_bytes(n).unwrap()];
    quantize_row(l, &w, &vec![1.0; n], &steps(5), &mut rec);
    let recs: Vec<u8> = (0..rows).flat_map(|_| rec.iter().copied()).collect();
    let x = gaussian(8, n, 1.0);
    let q4 = vec![0x55u8; GgmlType::Q4_K.row_bytes(n).unwrap() * rows];
    let mut xq = vec![0u8; GgmlType::Q8_K.row_bytes(n).unwrap()];
    quantize_act(GgmlType::Q8_K, &x, &mut xq);
    for _ in 0..3 {
        let t = std::time::Instant::now();
        let rb = l.row_bytes(n).unwrap();
        let s: f32 = (0..rows).map(|r| crate::quant::simd::gsq_dot(l, &recs[r * rb..(r + 1) * rb], &x)).sum();
        let tg = t.elapsed();
        let t = std::time::Instant::now();
        let qb = GgmlType::Q4_K.row_bytes(n).unwrap();
        let s2: f32 = (0..rows).map(|r| vec_dot(GgmlType::Q4_K, n, &q4[r * qb..(r + 1) * qb], &xq)).sum();
        let tq = t.elapsed();
        println!("GSQ-RCO {:?} ({s}), Q4_K {:?} ({s2})", tg, tq);
    }
}
