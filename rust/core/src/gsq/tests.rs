use super::format::{code_at, pack_codes, OFF_PLANE0};
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

/// Q2_K written by the optimiser reads back through the engine's Q2_K dequantizer with the reported error, beats
/// a plain min/max 2-bit grid per 16 weights by a wide margin, and does not depend on the thread count.
#[test]
fn q2_k_rows_read_back_as_reported() {
    let (rows, cols) = (6, 512);
    let w = weights_with_outliers(41, rows * cols);
    let h = importances(42, cols);
    let (a, sa) = quantize_matrix_q2_k(&w, cols, &h, &steps(20), 1).unwrap();
    let (b, sb) = quantize_matrix_q2_k(&w, cols, &h, &steps(20), 3).unwrap();
    assert_eq!((&a, sa), (&b, sb));
    assert_eq!(a.len(), rows * cols / 256 * 84); // llama.cpp's block_q2_K: 84 bytes a 256 weights
    let mut deq = vec![0f32; rows * cols];
    crate::quant::dequantize_row(crate::quant::GgmlType::Q2_K, &a, &mut deq).unwrap();
    let hh: Vec<f32> = h.iter().cycle().take(rows * cols).copied().collect();
    let err = weighted_err(&w, &deq, &hh);
    assert!((err - sa.err).abs() <= 1e-5 * sa.weight, "{err} vs {}", sa.err);
    // the baseline: each 16 weights on their own min/max 4-level grid, in f32 (more than Q2_K stores)
    let plain: f64 = w
        .chunks_exact(16)
        .zip(hh.chunks_exact(16))
        .map(|(w, h)| {
            let (lo, hi) = w.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
            let step = (hi - lo) / 3.0;
            let q: Vec<f32> = w.iter().map(|&x| lo + ((x - lo) / step).round() * step).collect();
            weighted_err(w, &q, h)
        })
        .sum();
    assert!(err < 0.8 * plain, "Q2_K {err} vs plain 2-bit {plain}");
    assert!(quantize_matrix_q2_k(&w[..384], 384, &h[..384], &steps(1), 1).is_err(), "a row of 1.5 blocks");
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
            let xf = gaussian(60 + k as u64, n, 1.0);
            let x = ActQ8::from_f32(&xf);
            let mut deq = vec![0f32; n];
            dequantize_row(l, row, &mut deq).unwrap();
            let mag: f32 = deq.iter().enumerate().map(|(i, a)| (a * x.q[i] as f32 * x.d[i / GROUP]).abs()).sum();
            let want = dot_row_q8(l, row, &x);
            let got = crate::quant::simd::gsq_dot_q8(l, row, &x);
            assert!((got - want).abs() <= 1e-5 * mag, "{bits}/{slots}: {got} vs {want} (isa {})", crate::quant::simd::isa());
            // Part of a row (fewer records) sums only those.
            let rb = l.record_bytes();
            let part = ActQ8::from_f32(&xf[..2 * GROUP]);
            let p = crate::quant::simd::gsq_dot_q8(l, &row[..2 * rb], &part);
            assert!((p - dot_row_q8(l, &row[..2 * rb], &part)).abs() <= 1e-5 * mag);
        }
    }
}

#[test]
fn simd_dot_rows_match_the_scalar_reference_on_every_layout() {
    // Every code width with 0..16 slots, rows of random bytes (every code, scale, min, slot value) whose slots
    // sit at the sub-block and chunk edges (and carry the high position bit, which readers drop), dotted by
    // the multi-row entry point (rows of several lengths, one row, part of a row) against `dot_row_q8` row by
    // row. The integers are the reference's; only the f32 order differs: relative 1e-5 of the sum of |terms|.
    let edges = [0usize, 15, 16, 31, 32, 47, 48, 63, 64, 79, 95, 96, 111, 112, 126, 127];
    for bits in [3, 4] {
        for slots in (0..=16).step_by(2) {
            let l = Layout::new(bits, slots).unwrap();
            for (k, n) in [128usize, 896, 1536].into_iter().enumerate() {
                let rows = 5;
                let rb = l.row_bytes(n).unwrap();
                let seed = 100 + 10 * bits as u64 + slots as u64 + 1000 * k as u64;
                let mut w: Vec<u8> = uniform_floats(seed, rows * rb, 1.0).iter().map(|u| (u * 127.0 + 128.0) as u8).collect();
                for (ri, rec) in w.chunks_exact_mut(l.record_bytes()).enumerate() {
                    rec[1] &= 0x3b;
                    rec[3] &= 0x3b;
                    for s in 0..slots {
                        let pos = edges[(s + ri) % edges.len()] as u8 | if (s + ri) % 3 == 0 { 0x80 } else { 0 };
                        rec[l.slots_offset() + 2 * s] = pos;
                    }
                }
                let xf = gaussian(seed + 1, n, 1.0);
                let x = ActQ8::from_f32(&xf);
                let mut got = vec![0f32; rows];
                crate::quant::simd::gsq_dot_rows(l, &w, rb, &x, &mut got);
                for (r, &g) in got.iter().enumerate() {
                    let row = &w[r * rb..(r + 1) * rb];
                    let mut deq = vec![0f32; n];
                    dequantize_row(l, row, &mut deq).unwrap();
                    let mag: f32 = deq.iter().enumerate().map(|(i, a)| (a * x.q[i] as f32 * x.d[i / GROUP]).abs()).sum();
                    let want = dot_row_q8(l, row, &x);
                    assert!((g - want).abs() <= 1e-5 * mag, "{bits}/{slots} n {n} row {r}: {g} vs {want}");
                    assert_eq!(crate::quant::simd::gsq_dot_q8(l, row, &x).to_bits(), g.to_bits(), "one row vs rows");
                }
                // Activations for fewer records than the rows hold: only those records.
                if n > GROUP {
                    let part = ActQ8::from_f32(&xf[..GROUP]);
                    let want = dot_row_q8(l, &w[..rb], &part);
                    let mut one = [0f32];
                    crate::quant::simd::gsq_dot_rows(l, &w[..rb], rb, &part, &mut one);
                    assert!((one[0] - want).abs() <= 1e-5 * want.abs().max(1.0), "{bits}/{slots}: part {} vs {want}", one[0]);
                }
            }
        }
    }
}

#[test]
fn simd_quantization_is_byte_exact() {
    // Random blocks of several magnitudes, exact ties (amax 127: d = 1, values k + 1/2 on both sides), a zero
    // block, a NaN and an infinity, a tiny block whose reciprocal scale overflows: every field as the reference.
    let mut x = gaussian(11, 8 * GROUP, 1.0);
    x[GROUP..2 * GROUP].iter_mut().for_each(|v| *v *= 1e-3);
    x[2 * GROUP..3 * GROUP].iter_mut().for_each(|v| *v *= 1e4);
    for (i, v) in x[3 * GROUP..4 * GROUP].iter_mut().enumerate() {
        *v = if i == 0 { 127.0 } else { (i as f32 - 64.0) * 0.5 };
    }
    x[4 * GROUP..5 * GROUP].fill(0.0);
    x[5 * GROUP + 3] = f32::NAN;
    x[6 * GROUP + 7] = f32::INFINITY;
    x[7 * GROUP..8 * GROUP].iter_mut().enumerate().for_each(|(i, v)| *v = 1e-38 * (i as f32 - 60.0) / 64.0);
    let mut want = ActQ8::default();
    want.quantize(&x);
    let mut got = ActQ8 { d: vec![9.0], q: vec![1; 5], bsums: vec![2; 3], qx: vec![3; 7] };
    crate::quant::simd::gsq_quantize(&x, &mut got);
    assert_eq!(got.q, want.q, "isa {}", crate::quant::simd::isa());
    assert_eq!(got.bsums, want.bsums);
    assert_eq!(got.qx, want.qx);
    assert_eq!(got.d.iter().map(|d| d.to_bits()).collect::<Vec<_>>(), want.d.iter().map(|d| d.to_bits()).collect::<Vec<_>>());
    assert!(want.q[3 * GROUP..4 * GROUP].contains(&3) && want.q[3 * GROUP..4 * GROUP].contains(&-3), "ties");
}

#[test]
fn slot_lookup_tables_give_back_the_activations() {
    // qx XOR-ed over chunks 0..=k (in its layout) is chunk k of q.
    let x = ActQ8::from_f32(&gaussian(3, 2 * GROUP, 1.0));
    for b in 0..2 {
        let (q, qx) = (&x.q[b * GROUP..(b + 1) * GROUP], &x.qx[b * GROUP..(b + 1) * GROUP]);
        let mut run = [0u8; SUB];
        for k in 0..GROUP / SUB {
            let off = 32 * (k % 4) + 16 * (k / 4);
            run.iter_mut().zip(&qx[off..off + SUB]).for_each(|(r, &v)| *r ^= v);
            assert!(run.iter().zip(&q[SUB * k..SUB * (k + 1)]).all(|(&r, &v)| r == v as u8), "block {b} chunk {k}");
        }
    }
}

/// Throughput of the picked GSQ-RCO kernel against the GGML kernels of the source models (Q4_K, Q6_K: 1.5B;
/// Q5_0, Q8_0: 0.5B) on 2048 rows of 1536 (single thread, the rows' bytes cache-resident: compute only), the
/// fastest of 30 runs: `cargo test --release -p ninfer-core --lib gsq_kernel_speed -- --ignored --nocapture`.
#[test]
#[ignore]
fn gsq_kernel_speed() {
    use crate::quant::{quantize_act, vec_dot, GgmlType};
    use std::time::{Duration, Instant};
    let (n, rows, reps) = (1536, 2048, 30);
    let x = gaussian(8, n, 1.0);
    let best = |f: &mut dyn FnMut() -> f32| -> (Duration, f32) {
        let mut b = Duration::MAX;
        let mut s = 0.0;
        for _ in 0..reps {
            let t = Instant::now();
            s = f();
            b = b.min(t.elapsed());
        }
        (b, s)
    };
    let mut line = String::new();
    for (bits, slots) in [(3, 0), (3, 2), (4, 0), (4, 4), (4, 8), (4, 12)] {
        let l = Layout::new(bits, slots).unwrap();
        let w = gaussian(7, n, 0.02);
        let mut rec = vec![0u8; l.row_bytes(n).unwrap()];
        quantize_row(l, &w, &vec![1.0; n], &steps(5), &mut rec);
        let rb = rec.len();
        let recs: Vec<u8> = (0..rows).flat_map(|_| rec.iter().copied()).collect();
        let (t, s) = best(&mut || {
            let xa = ActQ8::from_f32(&x);
            (0..rows).map(|r| crate::quant::simd::gsq_dot_q8(l, &recs[r * rb..(r + 1) * rb], &xa)).sum()
        });
        line += &format!("GSQ{bits}/{slots} {:.0} us ({s:.3})  ", t.as_secs_f64() * 1e6);
    }
    println!("{line}");
    let mut line = String::new();
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q5_0, GgmlType::Q8_0] {
        let qb = ty.row_bytes(n).unwrap();
        let wq: Vec<u8> = (0..qb * rows).map(|i| (i * 37 % 251) as u8 & if i % 34 < 2 { 0x3b } else { 0xff }).collect();
        let mut xq = vec![0u8; ty.act_type().row_bytes(n).unwrap()];
        let (t, s) = best(&mut || {
            quantize_act(ty.act_type(), &x, &mut xq);
            (0..rows).map(|r| vec_dot(ty, n, &wq[r * qb..(r + 1) * qb], &xq)).sum()
        });
        line += &format!("{ty} {:.0} us ({:.3})  ", t.as_secs_f64() * 1e6, s.is_finite());
    }
    println!("{line}");
}

#[cfg(target_arch = "aarch64")]
#[test]
fn neon_dot_gives_the_scalar_references_bits() {
    // The NEON kernel (quant::simd::aarch64_neon::gsq) sums the reference's integers and combines them in its f32
    // order, so every row's result is the reference's to the bit: random records of every code width, with and
    // without slots (slot positions with the high bit, which readers drop), rows of one to twelve records.
    if std::env::var("NINFER_CPU").is_err() {
        assert_eq!(crate::quant::simd::isa(), "neon");
    }
    for bits in [3, 4] {
        for slots in [0, 2, 6, 16] {
            let l = Layout::new(bits, slots).unwrap();
            for (k, n) in [128usize, 640, 1536].into_iter().enumerate() {
                let seed = 7000 + 100 * bits as u64 + slots as u64 + 10 * k as u64;
                let mut row: Vec<u8> =
                    uniform_floats(seed, l.row_bytes(n).unwrap(), 1.0).iter().map(|u| (u * 127.0 + 128.0) as u8).collect();
                for rec in row.chunks_exact_mut(l.record_bytes()) {
                    rec[1] &= 0x3b;
                    rec[3] &= 0x3b;
                }
                let x = ActQ8::from_f32(&gaussian(seed + 1, n, 1.0));
                let want = dot_row_q8(l, &row, &x);
                let got = crate::quant::simd::gsq_dot_q8(l, &row, &x);
                assert_eq!(got.to_bits(), want.to_bits(), "{bits}/{slots} n {n}: {got} vs {want}");
            }
        }
    }
}
