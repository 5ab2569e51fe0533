#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code, unused_imports))]
//! The SIMD kernels against the scalar reference code (the oracle): dot products on random blocks with
//! realistic scales (relative error < 1e-5 of sum |w * a|), integer parts exact (unit scales, results that
//! are exact integers in f32), activation quantizers byte for byte. Skipped, with a note, on CPUs without the
//! kernel set.

use super::table::{Kernels, MatmulPos, Orders, VecDotFn};
use crate::quant::format::{GgmlType, QK_K};
use crate::quant::scalar::{dequantize_scalar, quantize_scalar, vec_dot_scalar};

/// Tiny xorshift64* generator: deterministic, no dependencies.
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub(super) fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }

    /// Roughly normal, mean 0, times a per-call random magnitude (activations are not all of one scale).
    pub(super) fn floats(&mut self, n: usize) -> Vec<f32> {
        let mag = [0.01f32, 1.0, 30.0][(self.next_u64() % 3) as usize];
        (0..n)
            .map(|_| (self.unit() + self.unit() + self.unit() + self.unit() - 2.0) * 1.7 * mag)
            .collect()
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }

    /// Uniform integer in lo..=hi.
    fn int(&mut self, lo: i32, hi: i32) -> i32 {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as i32
    }
}

/// The kernel set under test (llama.cpp's default orders), or `None` (with a note) when this CPU lacks it.
pub(super) fn simd_kernels() -> Option<Kernels> {
    simd_kernels_with(Orders::LLAMA_CPP_DEFAULT)
}

fn simd_kernels_with(orders: Orders) -> Option<Kernels> {
    #[cfg(target_arch = "x86_64")]
    {
        let k = super::x86_avx2::detect(orders, true);
        if k.is_none() {
            eprintln!("note: this CPU lacks AVX2/FMA/F16C; SIMD kernel tests skipped");
        }
        k
    }
    #[cfg(target_arch = "aarch64")]
    {
        let _ = orders;
        super::aarch64_neon::detect()
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        let _ = orders;
        eprintln!("note: no SIMD kernel set for this architecture; SIMD kernel tests skipped");
        None
    }
}

/// Every dot-product kernel of both tables (default and plain orders): (type, slot name, kernel).
fn all_dot_kernels() -> Vec<(GgmlType, &'static str, VecDotFn)> {
    let mut out = Vec::new();
    for orders in [Orders::LLAMA_CPP_DEFAULT, Orders::PLAIN] {
        let Some(k) = simd_kernels_with(orders) else { return out };
        for ty in GgmlType::ALL {
            let t = ty as usize;
            let slots = [
                ("vec_dot", k.vec_dot[t]),
                ("unpacked", k.vec_dot_unpacked[t]),
                ("gemm4", k.vec_dot_gemm4[t]),
                ("tiled", k.vec_dot_tiled[t]),
            ];
            for (name, f) in slots {
                if let Some(f) = f {
                    out.push((ty, name, f));
                }
            }
        }
    }
    out
}

/// Byte offsets of the f16 scale fields (d, dmin, m, s) inside one block of `ty`.
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q8_1 => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => &[],
    }
}

fn put_f16(b: &mut [u8], v: f32) {
    b[..2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
}

/// A random weight row: random quant bits, f16 scales of magnitude 0.001..0.1 and random sign; float types
/// from random floats.
pub(super) fn random_weights(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let size = ty.row_bytes(n).unwrap();
    let mut row = vec![0u8; size];
    if ty.block_size() == 1 {
        quantize_scalar(ty, &rng.floats(n), &mut row);
        return row;
    }
    row = rng.bytes(size);
    for block in row.chunks_exact_mut(ty.type_size()) {
        for &off in f16_fields(ty) {
            let sign = if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
            put_f16(&mut block[off..], sign * rng.uniform(0.001, 0.1));
        }
        if ty == GgmlType::Q8_K {
            block[0..4].copy_from_slice(&rng.uniform(0.001, 0.1).to_le_bytes());
        }
    }
    row
}

pub(super) fn quantized_acts(act_ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; act_ty.row_bytes(x.len()).unwrap()];
    quantize_scalar(act_ty, x, &mut out);
    out
}

fn dequant(ty: GgmlType, row: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    dequantize_scalar(ty, row, &mut out);
    out
}

/// Element counts to test for `ty`: 1, 7 and 11 blocks, 4096 and 8960 elements (and odd float lengths).
fn lengths(ty: GgmlType) -> Vec<usize> {
    let bs = ty.block_size();
    let mut v = vec![bs, 7 * bs, 11 * bs, 4096, 8960];
    if bs == 1 {
        v.extend([31, 32, 33, 63, 64, 100, 127]);
    }
    v
}

#[test]
fn vec_dot_matches_scalar_on_random_blocks() {
    let kernels = all_dot_kernels();
    if kernels.is_empty() {
        return;
    }
    let mut rng = Rng::new(1);
    for &(ty, slot, simd) in &kernels {
        for n in lengths(ty) {
            for _ in 0..6 {
                let w = random_weights(ty, n, &mut rng);
                let act = quantized_acts(ty.act_type(), &rng.floats(n));
                let nb = n / ty.block_size();
                let (wd, ad) = (dequant(ty, &w, n), dequant(ty.act_type(), &act, n));
                let scale: f64 = wd.iter().zip(&ad).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                let want = vec_dot_scalar(ty, nb, &w, &act) as f64;
                let got = simd(nb, &w, &act) as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * scale + 1e-30,
                    "{ty} ({slot}) n={n}: simd {got} vs scalar {want} (sum|w*a| {scale})"
                );
            }
        }
    }
    // x86: 14 vec_dot (every weight type but F32... see the table) + 2 unpacked + 1 gemm4 + 5 tiled; aarch64:
    // the six 32-element block formats and five K-quants, in both tables (2 x 11). Both make 22.
    let want = 22;
    assert!(kernels.len() >= want, "only {} SIMD dot products", kernels.len());
}

/// With unit scales and small activation quants every partial sum is an exact integer in f32, so the SIMD
/// and scalar results must be equal: this checks the integer parts bit for bit.
#[test]
fn vec_dot_integer_parts_are_exact() {
    let mut rng = Rng::new(2);
    for (ty, slot, simd) in all_dot_kernels() {
        if ty.block_size() == 1 {
            continue;
        }
        for nb in [1usize, 3, 7] {
            for _ in 0..20 {
                let n = nb * ty.block_size();
                let mut w = rng.bytes(ty.row_bytes(n).unwrap());
                for block in w.chunks_exact_mut(ty.type_size()) {
                    for &off in f16_fields(ty) {
                        put_f16(&mut block[off..], 1.0);
                    }
                    if ty == GgmlType::Q8_K {
                        block[0..4].copy_from_slice(&1.0f32.to_le_bytes());
                    }
                }
                let act = unit_scale_acts(ty.act_type(), n, &mut rng);
                let want = vec_dot_scalar(ty, nb, &w, &act);
                let got = simd(nb, &w, &act);
                assert_eq!(got, want, "{ty} ({slot}) nb={nb}");
                assert_eq!(got, got.round(), "{ty} ({slot}) nb={nb}: not an integer");
            }
        }
    }
}

/// An activation row with d = 1 and quants in -1..=1 (consistent `s` / `bsums`).
fn unit_scale_acts(act_ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let mut row = vec![0u8; act_ty.row_bytes(n).unwrap()];
    let (qk, off) = match act_ty {
        GgmlType::Q8_0 => (32, 2),
        GgmlType::Q8_1 => (32, 4),
        GgmlType::Q8_K => (QK_K, 4),
        _ => unreachable!(),
    };
    for block in row.chunks_exact_mut(act_ty.type_size()) {
        let q: Vec<i8> = (0..qk).map(|_| rng.int(-1, 1) as i8).collect();
        for (b, &v) in block[off..off + qk].iter_mut().zip(&q) {
            *b = v as u8;
        }
        let sum: i32 = q.iter().map(|&v| v as i32).sum();
        match act_ty {
            GgmlType::Q8_K => {
                block[0..4].copy_from_slice(&1.0f32.to_le_bytes());
                for (j, g) in q.chunks_exact(16).enumerate() {
                    let s: i16 = g.iter().map(|&v| v as i16).sum();
                    block[off + qk + 2 * j..][..2].copy_from_slice(&s.to_le_bytes());
                }
            }
            GgmlType::Q8_1 => {
                put_f16(&mut block[0..], 1.0);
                put_f16(&mut block[2..], sum as f32);
            }
            _ => put_f16(&mut block[0..], 1.0),
        }
    }
    row
}

/// Activation rows that exercise the rounding corners: ties (x * id exactly k + 0.5), equal |max| of both
/// signs, zeros and -0, subnormals, huge values, infinities and NaNs.
fn tricky_rows(rng: &mut Rng, n: usize) -> Vec<Vec<f32>> {
    let mut rows = Vec::new();
    for mag in [1e-38f32, 1e-6, 1.0, 1e3, 1e30] {
        rows.push(rng.floats(n).iter().map(|v| v * mag).collect());
    }
    // Ties: amax 127 gives id = 1 (Q8_0/Q8_1), max -127 gives iscale = 1 (Q8_K).
    rows.push(
        (0..n)
            .map(|i| match i % 32 {
                0 => -127.0,
                _ => rng.int(-126, 125) as f32 + 0.5,
            })
            .collect(),
    );
    // Equal |max| with both signs, the first one negative or positive.
    rows.push((0..n).map(|i| [3.0, -3.0, 1.0, 0.5][i % 4] * if (i / 64) % 2 == 0 { 1.0 } else { -1.0 }).collect());
    rows.push(vec![0.0; n]);
    rows.push((0..n).map(|i| if i % 3 == 0 { -0.0 } else { 0.0 }).collect());
    rows.push((0..n).map(|i| f32::from_bits(1 + (i as u32 % 100))).collect());
    let mut special = rng.floats(n);
    for (i, v) in special.iter_mut().enumerate() {
        match i % 97 {
            5 => *v = f32::INFINITY,
            17 => *v = f32::NEG_INFINITY,
            40 if i > 300 => *v = f32::NAN,
            _ => {}
        }
    }
    rows.push(special);
    rows.push((0..n).map(|i| if i % 256 == 3 { f32::NAN } else { 0.0 }).collect());
    rows
}

// The AVX2 set's own kernels and llama.cpp's x86 kernel choice.
#[cfg(target_arch = "x86_64")]
#[test]
fn quantize_act_is_byte_exact() {
    let Some(k) = simd_kernels() else { return };
    let mut rng = Rng::new(3);
    for act_ty in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8_K, GgmlType::F16] {
        let simd = k.quantize(act_ty).expect("SIMD quantizer");
        for n in [QK_K, 7 * QK_K, 4096, 8960] {
            let mut rows = tricky_rows(&mut rng, n);
            for _ in 0..20 {
                rows.push(rng.floats(n));
            }
            for x in rows {
                let size = act_ty.row_bytes(n).unwrap();
                let (mut want, mut got) = (vec![0xAAu8; size], vec![0x55u8; size]);
                quantize_scalar(act_ty, &x, &mut want);
                simd(&x, &mut got);
                if let Some(i) = want.iter().zip(&got).position(|(a, b)| a != b) {
                    panic!("{act_ty} n={n}: byte {i} differs: scalar {} simd {}", want[i], got[i]);
                }
            }
        }
        // Odd F16 lengths (the tail after groups of 8).
        if act_ty == GgmlType::F16 {
            for n in [1usize, 7, 9, 33] {
                let x = rng.floats(n);
                let (mut want, mut got) = (vec![0u8; 2 * n], vec![1u8; 2 * n]);
                quantize_scalar(act_ty, &x, &mut want);
                simd(&x, &mut got);
                assert_eq!(want, got, "F16 n={n}");
            }
        }
    }
}

// The AVX2 set's own kernels and llama.cpp's x86 kernel choice.
#[cfg(target_arch = "x86_64")]
#[test]
fn dequantize_f16_is_exact_for_every_half() {
    let Some(k) = simd_kernels() else { return };
    let simd = k.dequantize(GgmlType::F16).expect("SIMD F16 dequantizer");
    let src: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
    for n in [65536usize, 65535, 13] {
        let (mut want, mut got) = (vec![0.0f32; n], vec![1.0f32; n]);
        dequantize_scalar(GgmlType::F16, &src[..2 * n], &mut want);
        simd(&src[..2 * n], &mut got);
        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
            // Signaling NaNs come back quieted from F16C; any NaN is a NaN.
            assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "half {i:#06x}: {a} vs {b}");
        }
    }
}

/// The kernels never read past short slices (release builds of `vec_dot` pass them through).
#[test]
fn short_rows_are_clamped() {
    let mut rng = Rng::new(4);
    for (ty, slot, simd) in all_dot_kernels() {
        let n = 4 * ty.block_size();
        let w = random_weights(ty, n, &mut rng);
        let act = quantized_acts(ty.act_type(), &rng.floats(n));
        let one_w = ty.row_bytes(ty.block_size()).unwrap();
        let one_a = ty.act_type().row_bytes(ty.block_size()).unwrap();
        let want = simd(1, &w, &act);
        assert_eq!(simd(4, &w[..one_w], &act), want, "{ty} ({slot}): short weights");
        assert_eq!(simd(4, &w, &act[..one_a]), want, "{ty} ({slot}): short activations");
        assert_eq!(simd(0, &w, &act), 0.0, "{ty} ({slot}): empty");
    }
}

/// `vec_dot_at` picks llama.cpp's kernel for each position in a matmul. Kernels are told apart by their
/// results on a row where their float orders give different bits.
// The AVX2 set's own kernels and llama.cpp's x86 kernel choice.
#[cfg(target_arch = "x86_64")]
#[test]
fn matmul_positions_pick_llama_cpp_kernels() {
    let Some(k) = simd_kernels() else { return };
    let mut rng = Rng::new(6);
    let pos = |w_rows, act_rows, act_row| MatmulPos { w_rows, act_rows, act_row };
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q4_0, GgmlType::Q8_0] {
        let n = 4096;
        let nb = n / ty.block_size();
        // A row on which the candidate kernels of `ty` all give different results.
        let (w, act) = loop {
            let w = random_weights(ty, n, &mut rng);
            let act = quantized_acts(ty.act_type(), &rng.floats(n));
            let t = ty as usize;
            let mut r: Vec<u32> = [k.vec_dot[t], k.vec_dot_unpacked[t], k.vec_dot_gemm4[t], k.vec_dot_tiled[t]]
                .iter()
                .flatten()
                .map(|f| f(nb, &w, &act).to_bits())
                .collect();
            let len = r.len();
            r.sort_unstable();
            r.dedup();
            if r.len() == len {
                break (w, act);
            }
        };
        let run = |f: Option<VecDotFn>| f.map(|f| f(nb, &w, &act).to_bits());
        let at = |p: MatmulPos| run(k.vec_dot_at(ty, p));
        let t = ty as usize;
        let (vd, unpacked, gemm4, tiled) =
            (run(k.vec_dot[t]), run(k.vec_dot_unpacked[t]), run(k.vec_dot_gemm4[t]), run(k.vec_dot_tiled[t]));
        match ty {
            GgmlType::Q4_K => {
                assert_eq!(at(pos(64, 1, 0)), vd, "decode: GEMV");
                assert_eq!(at(pos(64, 5, 3)), gemm4, "rows 0..4 of 5: GEMM");
                assert_eq!(at(pos(64, 5, 4)), vd, "row 4 of 5: GEMV");
                assert_eq!(at(pos(64, 3, 0)), vd, "3 rows: GEMV");
                assert_eq!(at(pos(64, 9, 8)), vd, "repacked matrices skip the tiled path");
                assert_eq!(at(pos(60, 1, 0)), unpacked, "not repacked: plain dot");
                assert_eq!(at(pos(60, 8, 0)), tiled, "not repacked, 8 rows: tiled");
            }
            GgmlType::Q6_K => {
                assert_eq!(at(pos(64, 7, 0)), vd);
                assert_eq!(at(pos(64, 8, 7)), tiled);
                assert_eq!(at(pos(61, 100, 50)), tiled);
            }
            GgmlType::Q4_0 => {
                // GEMV and GEMM of repacked Q4_0 sum alike.
                assert_eq!(at(pos(64, 1, 0)), vd);
                assert_eq!(at(pos(64, 8, 0)), vd);
                assert_eq!(at(pos(36, 8, 0)), unpacked);
            }
            _ => {
                assert_eq!(at(pos(64, 1, 0)), vd);
                assert_eq!(at(pos(64, 16, 9)), vd);
            }
        }
    }
}

/// The public entry points use the best set this CPU has (AVX-512 where it has F, BW, DQ, VL and VNNI, as
/// llama.cpp's native build would) unless `NINFER_CPU` forces another.
#[cfg(target_arch = "x86_64")]
#[test]
fn entry_points_use_the_detected_set() {
    if ["NINFER_CPU", "NINFER_Q4_ORDER", "GGML_CPU_TILED_MM"].iter().any(|v| std::env::var_os(v).is_some()) {
        eprintln!("note: a kernel-selection variable is set; dispatch check skipped");
        return;
    }
    if simd_kernels().is_none() {
        return;
    }
    let fp16 = is_x86_feature_detected!("avx512fp16");
    let want = match super::x86_avx512::available() {
        true if fp16 => "avx512fp16",
        true => "avx512",
        false => "avx2",
    };
    assert_eq!(super::isa(), want);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K] {
        assert!(super::has_simd_vec_dot(ty), "{ty}");
    }
    let mut rng = Rng::new(5);
    let n = 512;
    let x = rng.floats(n);
    for ty in [GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::F16] {
        let w = random_weights(ty, n, &mut rng);
        let mut act = vec![0u8; ty.act_type().row_bytes(n).unwrap()];
        crate::quant::quantize_act(ty.act_type(), &x, &mut act);
        let simd = super::kernels().vec_dot(ty).unwrap();
        assert_eq!(crate::quant::vec_dot(ty, n, &w, &act), simd(n / ty.block_size(), &w, &act), "{ty}");
        let p = MatmulPos { w_rows: 64, act_rows: 1, act_row: 0 };
        assert_eq!(super::vec_dot_matmul(ty, n, &w, &act, p), simd(n / ty.block_size(), &w, &act), "{ty}");
    }
}

#[test]
fn atoi_reads_switches_like_c() {
    use super::table::atoi;
    assert_eq!(atoi("0"), 0);
    assert_eq!(atoi("1"), 1);
    assert_eq!(atoi(" 12abc"), 12);
    assert_eq!(atoi("-3"), -3);
    assert_eq!(atoi("off"), 0);
    assert_eq!(atoi(""), 0);
}

/// On aarch64 the entry points dispatch to the NEON set; its K-quant products are the reference code with NEON
/// int8 products, so they equal the scalar reference bit for bit.
#[cfg(target_arch = "aarch64")]
#[test]
fn entry_points_use_neon_on_aarch64() {
    if std::env::var_os("NINFER_CPU").is_some() {
        return;
    }
    assert_eq!(super::isa(), "neon");
    let mut rng = Rng::new(31);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q2_K,
               GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
        assert!(super::has_simd_vec_dot(ty), "{ty}");
    }
    for ty in [GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
        for nb in [1usize, 3, 7] {
            let n = nb * ty.block_size();
            let w = random_weights(ty, n, &mut rng);
            let act = quantized_acts(ty.act_type(), &rng.floats(n));
            let neon = super::kernels().vec_dot(ty).unwrap()(nb, &w, &act);
            assert_eq!(neon.to_bits(), vec_dot_scalar(ty, nb, &w, &act).to_bits(), "{ty} nb {nb}");
        }
    }
}
