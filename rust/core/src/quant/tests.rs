//! Unit tests of the quant module: the type table against GGML's, known values, llama.cpp's rounding rules,
//! round trips, and every `vec_dot` against the dot product of the dequantized rows.

use super::float::{f16_at, put_f16};
use super::math::nearest_int;
use super::*;
use crate::error::Error;
use half::{bf16, f16};

/// Tiny xorshift64* generator: deterministic, no dependencies.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next_u64(&mut self) -> u64 {
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

    /// Roughly normal (Irwin-Hall with 4 terms), mean 0.
    fn normalish(&mut self) -> f32 {
        (self.unit() + self.unit() + self.unit() + self.unit() - 2.0) * 1.7
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }

    fn floats(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.normalish()).collect()
    }
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

/// A random valid row of `n` elements of `ty`: random quant bits, sane scales (|d| in 0.01..0.1, no NaN/inf);
/// float types come from random floats.
fn random_row(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let size = ty.row_bytes(n).unwrap();
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            let x = rng.floats(n);
            let mut row = vec![0u8; size];
            quantize_row(ty, &x, &mut row).unwrap();
            row
        }
        _ => {
            let mut row = rng.bytes(size);
            for block in row.chunks_exact_mut(ty.type_size()) {
                for &off in f16_fields(ty) {
                    let sign = if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
                    put_f16(&mut block[off..], sign * rng.uniform(0.01, 0.1));
                }
                if ty == GgmlType::Q8_K {
                    block[0..4].copy_from_slice(&rng.uniform(0.01, 0.1).to_le_bytes());
                }
            }
            row
        }
    }
}

fn dequant(ty: GgmlType, row: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    dequantize_row(ty, row, &mut out).unwrap();
    out
}

fn quant_act(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; ty.row_bytes(x.len()).unwrap()];
    quantize_act(ty, x, &mut out);
    out
}

#[test]
fn table_matches_ggml() {
    // (id, name, block size, type size) from ggml.c's type_traits.
    let expected: [(u32, &str, usize, usize); 15] = [
        (0, "F32", 1, 4),
        (1, "F16", 1, 2),
        (2, "Q4_0", 32, 18),
        (3, "Q4_1", 32, 20),
        (6, "Q5_0", 32, 22),
        (7, "Q5_1", 32, 24),
        (8, "Q8_0", 32, 34),
        (9, "Q8_1", 32, 36),
        (10, "Q2_K", 256, 84),
        (11, "Q3_K", 256, 110),
        (12, "Q4_K", 256, 144),
        (13, "Q5_K", 256, 176),
        (14, "Q6_K", 256, 210),
        (15, "Q8_K", 256, 292),
        (30, "BF16", 1, 2),
    ];
    for (ty, &(id, name, bs, ts)) in GgmlType::ALL.iter().zip(&expected) {
        assert_eq!(
            (ty.id(), ty.name(), ty.block_size(), ty.type_size()),
            (id, name, bs, ts)
        );
        assert_eq!(GgmlType::from_id(id), Some(*ty));
        assert_eq!(ty.to_string(), name);
    }
    for id in [4, 5, 16, 29, 31, 39, 1000, u32::MAX] {
        assert_eq!(GgmlType::from_id(id), None, "id {id}");
    }
}

#[test]
fn act_types_follow_llama_cpp() {
    use GgmlType::*;
    let pairs = [
        (F32, F32),
        (F16, F16),
        (BF16, BF16),
        (Q4_0, Q8_0),
        (Q5_0, Q8_0),
        (Q8_0, Q8_0),
        (Q4_1, Q8_1),
        (Q5_1, Q8_1),
        (Q2_K, Q8_K),
        (Q3_K, Q8_K),
        (Q4_K, Q8_K),
        (Q5_K, Q8_K),
        (Q6_K, Q8_K),
    ];
    for (w, a) in pairs {
        assert_eq!(w.act_type(), a, "{w}");
        assert!(a.is_act_type());
    }
    for ty in GgmlType::ALL {
        assert!(ty.act_type().is_act_type());
    }
}

#[test]
fn row_bytes_and_its_errors() {
    assert_eq!(GgmlType::Q4_K.row_bytes(4096).unwrap(), 16 * 144);
    assert_eq!(GgmlType::Q8_0.row_bytes(64).unwrap(), 68);
    assert_eq!(GgmlType::F16.row_bytes(7).unwrap(), 14);
    assert_eq!(GgmlType::Q6_K.row_bytes(0).unwrap(), 0);
    match GgmlType::Q4_K.row_bytes(100) {
        Err(Error::BadModel(msg)) => assert!(msg.contains("Q4_K") && msg.contains("100"), "{msg}"),
        other => panic!("expected BadModel, got {other:?}"),
    }
    assert!(matches!(GgmlType::Q4_0.row_bytes(33), Err(Error::BadModel(_))));
    assert!(matches!(GgmlType::F32.row_bytes(usize::MAX), Err(Error::BadModel(_))));
}

#[test]
fn size_errors() {
    let mut out = vec![0.0f32; 32];
    assert!(matches!(
        dequantize_row(GgmlType::Q4_0, &[0u8; 17], &mut out),
        Err(Error::BadModel(_))
    ));
    assert!(matches!(
        dequantize_row(GgmlType::Q4_0, &[0u8; 19], &mut out),
        Err(Error::BadModel(_))
    ));
    let mut odd = vec![0.0f32; 31];
    assert!(matches!(
        dequantize_row(GgmlType::Q4_0, &[0u8; 18], &mut odd),
        Err(Error::BadModel(_))
    ));

    let x = vec![0.5f32; 256];
    let mut dst = vec![0u8; 144];
    assert!(matches!(
        quantize_row(GgmlType::Q4_K, &x, &mut dst),
        Err(Error::UnsupportedType(_))
    ));
    let mut dst = vec![0u8; 8 * 34 + 1];
    assert!(matches!(
        quantize_row(GgmlType::Q8_0, &x, &mut dst),
        Err(Error::InvalidArgument(_))
    ));
    let mut dst = vec![0u8; 34];
    assert!(matches!(
        quantize_row(GgmlType::Q8_0, &x[..31], &mut dst),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn known_values() {
    // Q4_0: d = 0.5; byte 0 = 0x9F -> element 0 = (15 - 8) * 0.5, element 16 = (9 - 8) * 0.5.
    let mut b = [0x88u8; 18];
    b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
    b[2] = 0x9F;
    let y = dequant(GgmlType::Q4_0, &b, 32);
    assert_eq!(y[0], 3.5);
    assert_eq!(y[16], 0.5);
    assert!(y.iter().enumerate().all(|(i, &v)| i == 0 || i == 16 || v == 0.0));

    // Q5_0: fifth bit of element 1 set -> (0 | 16) - 16 = 0; element 0 with nibble 0 and no bit -> -16 * d.
    let mut b = [0u8; 22];
    b[0..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
    b[2] = 0b10;
    let y = dequant(GgmlType::Q5_0, &b, 32);
    assert_eq!((y[0], y[1]), (-16.0, 0.0));

    // Q8_K: d is an f32.
    let mut b = vec![0u8; 292];
    b[0..4].copy_from_slice(&0.25f32.to_le_bytes());
    b[4] = (-8i8) as u8;
    b[5] = 3;
    let y = dequant(GgmlType::Q8_K, &b, 256);
    assert_eq!((y[0], y[1], y[2]), (-2.0, 0.75, 0.0));

    // BF16 / F16 / F32 decode.
    let mut b = Vec::new();
    b.extend_from_slice(&bf16::from_f32(-1.5).to_le_bytes());
    b.extend_from_slice(&bf16::from_f32(3.0).to_le_bytes());
    assert_eq!(dequant(GgmlType::BF16, &b, 2), vec![-1.5, 3.0]);
    let mut b = Vec::new();
    for v in [0.1f32, 2.0, -7.25, 65504.0, 1e-7, 0.0, -0.0, 1.0, 3.0] {
        b.extend_from_slice(&f16::from_f32(v).to_le_bytes());
    }
    let y = dequant(GgmlType::F16, &b, 9);
    assert_eq!(y[1..5], [2.0, -7.25, 65504.0, f16::from_f32(1e-7).to_f32()]);
    assert_eq!(y[8], 3.0);
    assert_eq!(dequant(GgmlType::F32, &1.25f32.to_le_bytes(), 1), vec![1.25]);
}

#[test]
fn f16_and_bf16_round_to_nearest_even_like_ggml() {
    // GGML's bf16: NaN -> quiet NaN, else (u + 0x7fff + ((u >> 16) & 1)) >> 16.
    fn ggml_bf16(v: f32) -> u16 {
        let u = v.to_bits();
        if (u & 0x7fff_ffff) > 0x7f80_0000 {
            return ((u >> 16) | 64) as u16;
        }
        ((u as u64 + (0x7fff + ((u >> 16) & 1)) as u64) >> 16) as u16
    }
    let mut rng = Rng::new(7);
    let mut x: Vec<f32> = (0..4096).map(|_| f32::from_bits(rng.next_u64() as u32)).collect();
    x.extend([
        0.0,
        -0.0,
        1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        f32::MIN_POSITIVE,
    ]);
    x.extend([f32::from_bits(0x3f80_8000), f32::from_bits(0x3f81_8000)]); // exact bf16 ties
    let b = quant_act(GgmlType::BF16, &x);
    for (v, got) in x.iter().zip(b.chunks_exact(2)) {
        assert_eq!(u16::from_le_bytes([got[0], got[1]]), ggml_bf16(*v), "{v:e}");
    }

    // f16 ties: 1 + 2^-11 is halfway between 1 and 1 + 2^-10 -> 1 (even); 1 + 3 * 2^-11 -> 1 + 2^-9.
    let x = [
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
        65520.0,
        1e-8,
        -2.5,
        0.1,
        7.0,
        3.0,
        1.0,
    ];
    let b = quant_act(GgmlType::F16, &x);
    let h: Vec<u16> = b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
    assert_eq!(h[0], 0x3c00);
    assert_eq!(h[1], 0x3c02);
    assert_eq!(h[2], 0x7c00); // rounds up to +inf
    assert_eq!(h[3], 0x0000); // below half the smallest subnormal
    for (v, &bits) in x.iter().zip(&h) {
        assert_eq!(bits, f16::from_f32(*v).to_bits());
    }
}

#[test]
fn q8_rounding_rules() {
    // amax = 127 makes the Q8_0 scale exactly 1: llama.cpp's x86 path rounds halves to even.
    let mut x = vec![0.0f32; 32];
    x[0] = 127.0;
    x[1] = 2.5;
    x[2] = -2.5;
    x[3] = 0.5;
    let b = quant_act(GgmlType::Q8_0, &x);
    assert_eq!(f16_at(&b[0..2]), 1.0);
    assert_eq!([b[2] as i8, b[3] as i8, b[4] as i8, b[5] as i8], [127, 2, -2, 0]);

    // Q8_1 additionally stores s = d * sum(q).
    let b = quant_act(GgmlType::Q8_1, &x);
    assert_eq!((f16_at(&b[0..2]), f16_at(&b[2..4])), (1.0, 127.0));

    // Q8_K: max = 127 gives iscale = -1 exactly; nearest_int rounds halves to even.
    let mut x = vec![0.0f32; 256];
    x[0] = 127.0;
    x[1] = 2.5;
    x[2] = 3.5;
    x[3] = -0.5;
    let b = quant_act(GgmlType::Q8_K, &x);
    assert_eq!(f32::from_le_bytes([b[0], b[1], b[2], b[3]]), -1.0);
    assert_eq!([b[4] as i8, b[5] as i8, b[6] as i8, b[7] as i8], [-127, -2, -4, 0]);
    assert_eq!(i16::from_le_bytes([b[260], b[261]]), -133);
}

#[test]
fn q8_k_blocks_are_consistent() {
    let mut rng = Rng::new(11);
    let mut x = rng.floats(3 * 256);
    x[256..512].fill(0.0); // an all-zero block
    let b = quant_act(GgmlType::Q8_K, &x);
    let y = dequant(GgmlType::Q8_K, &b, x.len());
    for (blk, (xb, yb)) in b.chunks_exact(292).zip(x.chunks_exact(256).zip(y.chunks_exact(256))) {
        let qs = &blk[4..260];
        for (j, s) in blk[260..].chunks_exact(2).enumerate() {
            let sum: i32 = qs[16 * j..16 * j + 16].iter().map(|&q| (q as i8) as i32).sum();
            assert_eq!(i16::from_le_bytes([s[0], s[1]]) as i32, sum);
        }
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (a, b) in xb.iter().zip(yb) {
            assert!((a - b).abs() <= amax / 127.0 * 0.5 * 1.001 + 1e-7, "{a} vs {b}");
        }
    }
    assert!(b[292..584].iter().all(|&v| v == 0));
}

#[test]
fn round_trips_within_format_bounds() {
    let mut rng = Rng::new(3);
    let n = 32 * 40;
    let x = rng.floats(n);

    // Q8_0: |x - q * f16(d)| <= d / 2 + 127 * |d - f16(d)|, with |d - f16(d)| <= d * 2^-11.
    let mut b = vec![0u8; GgmlType::Q8_0.row_bytes(n).unwrap()];
    quantize_row(GgmlType::Q8_0, &x, &mut b).unwrap();
    let y = dequant(GgmlType::Q8_0, &b, n);
    for (xb, yb) in x.chunks_exact(32).zip(y.chunks_exact(32)) {
        let d = xb.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
        for (a, b) in xb.iter().zip(yb) {
            assert!((a - b).abs() <= d * (0.5 + 127.0 / 2048.0) + 1e-7, "Q8_0 {a} vs {b}");
        }
    }
    // Q8_0 through quantize_row and quantize_act agree.
    assert_eq!(b, quant_act(GgmlType::Q8_0, &x));

    // Q4_0: steps of |d| = amax / 8; error <= |d| / 2, or |d| for the clamped opposite extreme.
    let mut b = vec![0u8; GgmlType::Q4_0.row_bytes(n).unwrap()];
    quantize_row(GgmlType::Q4_0, &x, &mut b).unwrap();
    let y = dequant(GgmlType::Q4_0, &b, n);
    for (xb, yb) in x.chunks_exact(32).zip(y.chunks_exact(32)) {
        let d = xb.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 8.0;
        for (a, b) in xb.iter().zip(yb) {
            assert!((a - b).abs() <= d * (1.0 + 8.0 / 2048.0) + 1e-7, "Q4_0 {a} vs {b}");
        }
        // The extreme value itself is exact up to the f16 rounding of d.
        let (i, &m) = xb
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
            .unwrap();
        assert!((yb[i] - m).abs() <= d * 8.0 / 2048.0 + 1e-7);
    }

    // The other formats: within one step.
    for (ty, levels) in [(GgmlType::Q4_1, 15.0), (GgmlType::Q5_0, 16.0), (GgmlType::Q5_1, 31.0)] {
        let mut b = vec![0u8; ty.row_bytes(n).unwrap()];
        quantize_row(ty, &x, &mut b).unwrap();
        let y = dequant(ty, &b, n);
        for (xb, yb) in x.chunks_exact(32).zip(y.chunks_exact(32)) {
            let (lo, hi) = xb.iter().fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
            let step = (hi - lo).max(hi.abs().max(lo.abs())) / levels;
            for (a, b) in xb.iter().zip(yb) {
                assert!((a - b).abs() <= step * 1.01 + 1e-6, "{ty} {a} vs {b}");
            }
        }
    }

    // F16 / BF16 / F32.
    for (ty, rel) in [
        (GgmlType::F16, 1.0 / 2048.0),
        (GgmlType::BF16, 1.0 / 256.0),
        (GgmlType::F32, 0.0),
    ] {
        let mut b = vec![0u8; ty.row_bytes(n).unwrap()];
        quantize_row(ty, &x, &mut b).unwrap();
        let y = dequant(ty, &b, n);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= a.abs() * rel + 1e-7, "{ty} {a} vs {b}");
        }
    }
}

/// Every weight type's `vec_dot` against the f64 dot product of the dequantized rows.
#[test]
fn vec_dot_matches_dequantized_dot() {
    let mut rng = Rng::new(42);
    for ty in GgmlType::ALL {
        for &n in &[256usize, 768, 2048] {
            for _ in 0..4 {
                let w = random_row(ty, n, &mut rng);
                let x = rng.floats(n);
                let act = quant_act(ty.act_type(), &x);
                let wd = dequant(ty, &w, n);
                let ad = dequant(ty.act_type(), &act, n);
                let reference: f64 = wd.iter().zip(&ad).map(|(&a, &b)| a as f64 * b as f64).sum();
                let scale: f64 = wd.iter().zip(&ad).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                let got = vec_dot(ty, n, &w, &act) as f64;
                assert!(
                    (got - reference).abs() <= 1e-4 * scale + 1e-6,
                    "{ty} n={n}: vec_dot {got} vs reference {reference} (scale {scale})"
                );
            }
        }
    }
}

#[test]
fn float_dots_handle_tails() {
    let mut rng = Rng::new(5);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for n in [1usize, 7, 8, 9, 13, 100] {
            let w = random_row(ty, n, &mut rng);
            let act = quant_act(ty, &rng.floats(n));
            let (wd, ad) = (dequant(ty, &w, n), dequant(ty, &act, n));
            let reference: f64 = wd.iter().zip(&ad).map(|(&a, &b)| a as f64 * b as f64).sum();
            let scale: f64 = wd.iter().zip(&ad).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            let got = vec_dot(ty, n, &w, &act) as f64;
            assert!((got - reference).abs() <= 1e-5 * scale + 1e-7, "{ty} n={n}");
        }
    }
}

/// A quantized dot product is close to the true f32 dot product (activation quantization error only).
#[test]
fn vec_dot_close_to_float_dot() {
    let mut rng = Rng::new(9);
    let n = 1024;
    let x = rng.floats(n);
    for ty in GgmlType::ALL {
        let w = random_row(ty, n, &mut rng);
        let wd = dequant(ty, &w, n);
        let exact: f64 = wd.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
        let scale: f64 = wd.iter().zip(&x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
        let got = vec_dot(ty, n, &w, &quant_act(ty.act_type(), &x)) as f64;
        assert!((got - exact).abs() <= 0.02 * scale, "{ty}: {got} vs {exact}");
    }
}

#[test]
fn vec_dot_zero_length() {
    for ty in GgmlType::ALL {
        assert_eq!(vec_dot(ty, 0, &[], &[]), 0.0);
    }
}

#[test]
fn f16_decode_is_exact_for_every_half() {
    for bits in 0..=u16::MAX {
        let ours = float::f16_to_f32(bits);
        let reference = f16::from_bits(bits).to_f32();
        if reference.is_nan() {
            assert!(ours.is_nan(), "{bits:#06x}");
        } else {
            assert_eq!(ours.to_bits(), reference.to_bits(), "{bits:#06x}");
        }
    }
}

#[test]
fn rounding_helpers_match_libm() {
    let mut rng = Rng::new(13);
    let mut values: Vec<f32> = (0..100_000).map(|_| rng.uniform(-200.0, 200.0)).collect();
    for k in -300..=300 {
        let h = k as f32 * 0.5; // every half and integer in range
        values.extend([h, h.next_up(), h.next_down()]);
    }
    values.extend([0.0, -0.0, 0.49999997, -0.49999997, 1e-30, 4194303.0, -4194303.0]);
    for v in values {
        assert_eq!(nearest_int(v), v.round_ties_even() as i32, "nearest_int({v:e})");
    }
}
