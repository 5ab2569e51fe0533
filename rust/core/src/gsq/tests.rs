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
    uniform_floats(seed, n, 0.5).iter().map(|u| 1.0 + u).collect()
}

fn steps(steps: usize) -> Options {
    Options { steps }
}

fn weighted_err(w: &[f32], q: &[f32], h: &[f32]) -> f64 {
    w.iter().zip(q).zip(h).map(|((&a, &b), &hj)| hj as f64 * ((a - b) as f64).powi(2)).sum()
}

/// Weights with outliers, as real weight matrices have.
fn weights_with_outliers(seed: u64, n: usize) -> Vec<f32> {
    let mut w = gaussian(seed, n, 0.02);
    for i in (0..n).step_by(61) {
        w[i] *= 12.0;
    }
    w
}

#[test]
fn codes_pack_and_unpack() {
    for bits in [3, 4] {
        let l = Layout::new(bits, 2).unwrap();
        let codes: Vec<u8> = (0..GROUP).map(|i| ((i * 5 + 3) % (1 << bits)) as u8).collect();
        let mut rec = vec![0xAAu8; l.record_bytes()];
        pack_codes(l, &codes, &mut rec);
        for (i, &c) in codes.iter().enumerate() {
            assert_eq!(code_at(l, &rec, i), c, "{bits}-bit code {i}");
        }
        assert!(rec[..OFF_PLANE0].iter().all(|&b| b == 0xAA), "packing wrote outside the planes");
        assert!(rec[l.slots_offset()..].iter().all(|&b| b == 0xAA), "packing wrote into the slots");
    }
}

#[test]
fn layout_sizes_and_validation() {
    let l = Layout::new(3, 2).unwrap();
    assert_eq!(l.record_bytes(), 64);
    assert_eq!(l.bits_per_weight(), 4.0);
    assert_eq!(Layout::new(3, 0).unwrap().bits_per_weight(), 3.75);
    assert_eq!(Layout::new(4, 2).unwrap().record_bytes(), 80);
    assert!(Layout::new(2, 2).is_err());
    assert!(Layout::new(3, 3).is_err());
    assert!(Layout::new(3, 18).is_err());
    assert!(l.row_bytes(200).is_err());
    assert_eq!(l.row_bytes(896).unwrap(), 7 * 64);
}

#[test]
fn stored_error_is_the_reported_error_and_dots_match_dequantize() {
    for (k, (bits, slots)) in [(3, 0), (3, 2), (3, 6), (4, 2), (4, 16)].into_iter().enumerate() {
        let l = Layout::new(bits, slots).unwrap();
        let n = 1024;
        let w = weights_with_outliers(10 + k as u64, n);
        let h = importances(20 + k as u64, n);
        let mut rec = vec![0u8; l.row_bytes(n).unwrap()];
        let stats = quantize_row(l, &w, &h, &steps(20), &mut rec);
        let mut deq = vec![0f32; n];
        dequantize_row(l, &rec, &mut deq).unwrap();
        let err = weighted_err(&w, &deq, &h);
        assert!((err - stats.err).abs() <= 1e-5 * stats.weight, "{bits}/{slots}: {err} vs {}", stats.err);
        assert!(slots == 0 || stats.slots_used > 0, "{bits}/{slots}: no slot used");
        let x = gaussian(30 + k as u64, n, 1.0);
        let want: f64 = deq.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
        let mag: f64 = deq.iter().zip(&x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
        let got = dot_row(l, &rec, &x).unwrap() as f64;
        assert!((got - want).abs() <= 1e-5 * mag, "{got} vs {want}");
        // int8 activations: within their rounding (about 1/254 of each block's largest value per term)
        let q8 = dot_row_q8(l, &rec, &ActQ8::from_f32(&x)) as f64;
        assert!((q8 - want).abs() <= 1e-2 * mag, "int8 {q8} vs f32 {want} (terms {mag})");
    }
}

#[test]
fn four_bit_codes_and_rco_and_slots_lower_the_error() {
    let n = 128 * 64;
    let w = weights_with_outliers(2, n);
    let h = vec![1.0f32; n];
    let run = |bits, slots, s| {
        let l = Layout::new(bits, slots).unwrap();
        let mut rec = vec![0u8; l.row_bytes(n).unwrap()];
        quantize_row(l, &w, &h, &steps(s), &mut rec)
    };
    let fit = run(3, 0, 0);
    let rco = run(3, 0, 50);
    let slotted = run(3, 4, 50);
    let four = run(4, 0, 50);
    // Sub-block scales beat one min/max grid per 128 weights by far; RCO, slots and a fourth bit add to it.
    assert!(fit.err < 0.5 * fit.err_rtn, "sub-block fit {} vs RTN {}", fit.err, fit.err_rtn);
    assert!(rco.err <= fit.err, "RCO {} vs its start {}", rco.err, fit.err);
    assert!(slotted.err < 0.8 * rco.err && slotted.slots_used > 0, "slots {} vs none {}", slotted.err, rco.err);
    assert!(four.err < 0.4 * rco.err, "4-bit {} vs 3-bit {}", four.err, rco.err);
}

#[test]
fn importances_steer_the_error() {
    // Columns with high importance get a lower error than the same weights with low importance.
    let n = 128 * 32;
    let w = gaussian(6, n, 0.02);
    let h: Vec<f32> = (0..n).map(|i| if i % 2 == 0 { 100.0 } else { 1.0 }).collect();
    let l = Layout::new(3, 0).unwrap();
    let mut rec = vec![0u8; l.row_bytes(n).unwrap()];
    quantize_row(l, &w, &h, &steps(20), &mut rec);
    let mut deq = vec![0f32; n];
    dequantize_row(l, &rec, &mut deq).unwrap();
    let err = |par: usize| -> f64 { (par..n).step_by(2).map(|i| ((w[i] - deq[i]) as f64).powi(2)).sum() };
    assert!(err(0) < 0.8 * err(1), "important {} vs unimportant {}", err(0), err(1));
}

#[test]
fn quantization_is_deterministic_for_any_thread_count() {
    let (rows, cols) = (16, 512);
    let w = weights_with_outliers(4, rows * cols);
    let h = importances(5, cols);
    let l = Layout::new(3, 2).unwrap();
    let (a, sa) = quantize_matrix(l, &w, cols, &h, &steps(30), 1).unwrap();
    let (b, sb) = quantize_matrix(l, &w, cols, &h, &steps(30), 3).unwrap();
    assert_eq!(a, b);
    assert_eq!(sa, sb);
}

#[test]
fn bad_sizes_are_errors() {
    let l = Layout::new(3, 2).unwrap();
    let mut out = vec![0f32; 256];
    assert!(dequantize_row(l, &[0u8; 10], &mut out).is_err());
    assert!(dot_row(l, &[0u8; 10], &out).is_err());
    assert!(quantize_matrix(l, &[0.0; 200], 100, &[1.0; 100], &steps(1), 1).is_err());
    assert!(quantize_matrix(l, &[0.0; 256], 128, &[1.0; 100], &steps(1), 1).is_err());
}

#[test]
fn simd_dot_matches_the_scalar_reference() {
    // The kernel this CPU picks (AVX2 where available) against `dot_row_q8`, for 3- and 4-bit codes, with slots
    // used and random bytes (every code, nibble and slot value). Both sum the same integers per record, so only
    // the f32 combination order differs: relative 1e-5 of the sum of |terms|. A kernel that drops a sub-block, a
    // plane, a min or a slot is off by far more.
    for (k, (bits, slots)) in [(3, 0), (3, 2), (3, 16), (4, 0), (4, 2), (4, 10)].into_iter().enumerate() {
        let l = Layout::new(bits, slots).unwrap();
        let n = 1024;
        let w = weights_with_outliers(40 + k as u64, n);
        let h = importances(50 + k as u64, n);
        let mut rec = vec![0u8; l.row_bytes(n).unwrap()];
        let st = quantize_row(l, &w, &h, &steps(10), &mut rec);
        assert!(slots == 0 || st.slots_used > 0, "{bits}/{slots}: {st:?}");
        // A second row of random bytes (f16 fields kept finite; slot positions >= 128 included).
        let mut rnd: Vec<u8> = uniform_floats(70 + k as u64, rec.len(), 1.0).iter().map(|u| (u * 127.0 + 128.0) as u8).collect();
        for r in rnd.chunks_exact_mut(l.record_bytes()) {
            r[1] &= 0x3b;
            r[3] &= 0x3b;
        }
        for row in [&rec, &rnd] {
            let x = ActQ8::from_f32(&gaussian(60 + k as u64, n, 1.0));
            let mut deq = vec![0f32; n];
            dequantize_row(l, row, &mut deq).unwrap();
            let mag: f32 = deq.iter().enumerate().map(|(i, a)| (a * x.q[i] as f32 * x.d[i / GROUP]).abs()).sum();
            let want = dot_row_q8(l, row, &x);
            let got = crate::quant::simd::gsq_dot_q8(l, row, &x);
            assert!((got - want).abs() <= 1e-5 * mag, "{bits}/{slots}: {got} vs {want} (isa {})", crate::quant::simd::isa());
            // Part of a row (fewer records) sums only those.
            let rb = l.record_bytes();
            let part = ActQ8 { d: x.d[..2].to_vec(), q: x.q[..2 * GROUP].to_vec(), bsums: x.bsums[..16].to_vec() };
            let p = crate::quant::simd::gsq_dot_q8(l, &row[..2 * rb], &part);
            assert!((p - dot_row_q8(l, &row[..2 * rb], &part)).abs() <= 1e-5 * mag);
        }
    }
}

/// Throughput of the picked GSQ-RCO kernel against the Q4_K one on 2048 rows of 1536 (single thread):
/// `cargo test --release -p ninfer-core --lib gsq_kernel_speed -- --ignored --nocapture`.
#[test]
#[ignore]
fn gsq_kernel_speed() {
    use crate::quant::{quantize_act, vec_dot, GgmlType};
    let (n, rows) = (1536, 2048);
    for (bits, slots) in [(3, 0), (3, 2), (4, 0)] {
    let l = Layout::new(bits, slots).unwrap();
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
        let xa = ActQ8::from_f32(&x);
        let s: f32 = (0..rows).map(|r| crate::quant::simd::gsq_dot_q8(l, &recs[r * rb..(r + 1) * rb], &xa)).sum();
        let tg = t.elapsed();
        let t = std::time::Instant::now();
        let qb = GgmlType::Q4_K.row_bytes(n).unwrap();
        let s2: f32 = (0..rows).map(|r| vec_dot(GgmlType::Q4_K, n, &q4[r * qb..(r + 1) * qb], &xq)).sum();
        let tq = t.elapsed();
        println!("GSQ-RCO {bits}-bit, {slots} slots: {:?} ({s}), Q4_K {:?} ({s2})", tg, tq);
    }
    }
}
