//! The AVX-512 kernels against scalar definitions of llama.cpp's AVX-512 orders, bit for bit (random inputs of
//! every length through the tails). Skipped, with a note, on CPUs without the set's features.

use super::super::vecops::{silu_avx512, VecOps};
use crate::quant::float::f16_to_f32;
use crate::quant::math::ggml_expf_avx512;
use crate::test_rng::uniform_floats as floats;

fn available() -> bool {
    let ok = super::available();
    if !ok {
        eprintln!("note: this CPU lacks AVX-512 F/BW/DQ/VL/VNNI; the AVX-512 kernels are not tested here");
    }
    ok
}

fn f16_round(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

fn f16_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// GCC's `_mm512_reduce_add_ps` of sixteen lanes.
fn reduce16(v: &[f32]) -> f32 {
    let t3: Vec<f32> = (0..8).map(|i| v[i + 8] + v[i]).collect();
    let t6: Vec<f32> = (0..4).map(|i| t3[i + 4] + t3[i]).collect();
    (t6[0] + t6[2]) + (t6[1] + t6[3])
}

/// `ggml_vec_dot_f16` of the AVX-512 build, one element at a time.
fn dot_f16_def(x: &[u8], y: &[u8]) -> f32 {
    let h = |b: &[u8], i: usize| f16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]));
    let n = x.len() / 2;
    let mut acc = [[0.0f32; 16]; 4];
    for step in 0..n / 64 {
        for (j, a) in acc.iter_mut().enumerate() {
            for (l, v) in a.iter_mut().enumerate() {
                let i = step * 64 + 16 * j + l;
                *v = h(x, i).mul_add(h(y, i), *v);
            }
        }
    }
    let lanes: Vec<f32> = (0..16).map(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l])).collect();
    let mut sum = reduce16(&lanes) as f64;
    for i in n & !63..n {
        sum += (h(x, i) * h(y, i)) as f64;
    }
    sum as f32
}

#[test]
fn vec_dot_f16_sums_in_sixteen_lanes() {
    if !available() {
        return;
    }
    for n in (0..=300).chain([576, 1024, 1536]) {
        let (x, y) = (f16_bytes(&floats(n as u64 + 1, n, 2.0)), f16_bytes(&floats(n as u64 + 500, n, 2.0)));
        let got = super::vec_dot_f16(n, &x, &y);
        assert_eq!(got.to_bits(), dot_f16_def(&x, &y).to_bits(), "n = {n}");
    }
    // And it is not the AVX2 order (eight lanes, steps of 32), which would make this test see nothing.
    let n = 128;
    let (x, y) = (f16_bytes(&floats(7, n, 2.0)), f16_bytes(&floats(8, n, 2.0)));
    let avx2 = crate::quant::simd::x86_avx2::detect(crate::quant::simd::table::Orders::PLAIN, false).unwrap();
    let differs = (0..50).any(|s| {
        let (x, y) = (f16_bytes(&floats(s, n, 2.0)), f16_bytes(&floats(s + 99, n, 2.0)));
        (avx2.vec_dot[crate::quant::format::GgmlType::F16 as usize].unwrap())(n, &x, &y) != super::vec_dot_f16(n, &x, &y)
    });
    let _ = (x, y);
    assert!(differs, "the sixteen-lane order never differed from the eight-lane one");
}

#[test]
fn avx512_exp_differs_from_the_avx2_exp_and_stays_close_to_exp() {
    let mut differ = 0;
    for i in -2000..=2000 {
        let x = i as f32 * 0.0437;
        let (got, want) = (ggml_expf_avx512(x), x.exp());
        assert!((got - want).abs() <= 4.0 * f32::EPSILON * want, "exp({x}) = {got}, libm {want}");
        differ += (got != crate::quant::math::ggml_expf(x)) as usize;
    }
    assert!(differ > 100, "only {differ} of 4001 values differ from the AVX2 exp");
    assert_eq!(ggml_expf_avx512(-200.0), 0.0);
    assert_eq!(ggml_expf_avx512(f32::NEG_INFINITY), 0.0);
    assert_eq!(ggml_expf_avx512(100.0), f32::INFINITY);
    // Results below f32's normal range round once (vscalefps), not twice.
    assert!(ggml_expf_avx512(-95.0) > 0.0 && ggml_expf_avx512(-95.0) < f32::MIN_POSITIVE);
}

/// The scalar definitions of the AVX-512 primitives: the table under test with each overridden entry replaced.
fn scalar_defs(fp16: bool) -> VecOps {
    fn exp_shifted(x: &mut [f32], m: f32) -> f64 {
        for v in x.iter_mut() {
            *v = if *v == f32::NEG_INFINITY { 0.0 } else { ggml_expf_avx512(*v - m) };
        }
        let (groups, tail) = x.as_chunks::<16>();
        let sum = groups.iter().fold(0.0f64, |s, g| s + reduce16(g) as f64);
        tail.iter().fold(sum, |s, &v| s + v as f64)
    }
    fn swiglu(gate: &mut [f32], up: &[f32]) {
        for (g, &u) in gate.iter_mut().zip(up) {
            *g = silu_avx512(*g) * u;
        }
    }
    fn axpy_f16(y: &mut [f32], x: &[u8], a: f32) {
        let np = y.len().min(x.len() / 2) & !127;
        let ah = f16_round(a) as f64;
        for (i, (y, h)) in y.iter_mut().zip(x.chunks_exact(2)).enumerate() {
            let x = f16_to_f32(u16::from_le_bytes([h[0], h[1]]));
            *y = if i < np {
                // One rounding of the exact x * f16(a) + y (exact in f64 for halves).
                half::f16::from_f64((x as f64).mul_add(ah, *y as f64)).to_f32()
            } else {
                f16_round(x.mul_add(a, *y))
            };
        }
    }
    fn scale_f16(y: &mut [f32], a: f32) {
        let np = y.len() & !127;
        for (i, v) in y.iter_mut().enumerate() {
            *v = f16_round(*v * if i < np { f16_round(a) } else { a });
        }
    }
    let base = VecOps { exp_shifted, swiglu, ..VecOps::SCALAR };
    if fp16 {
        VecOps { axpy_f16, scale_f16, ..base }
    } else {
        base
    }
}

#[test]
fn element_wise_primitives_equal_their_avx512_definitions() {
    if !available() {
        return;
    }
    let fp16 = super::has_fp16();
    let simd = super::detect_vec_ops().unwrap();
    let def = scalar_defs(fp16);
    for n in (0..=300).chain([512, 640, 1000]) {
        let seed = n as u64 + 1;
        let x = floats(seed, n, 3.0);
        // Values over a wide range, to reach the exp's over/underflow lanes and f16 subnormals.
        let y0: Vec<f32> = floats(seed + 100, n, 3.0).iter().enumerate().map(|(i, v)| v * [1.0, 40.0, 1e-4][i % 3]).collect();
        let y16: Vec<f32> = y0.iter().map(|&v| f16_round(v)).collect();
        let a = floats(seed + 200, 1, 2.0)[0];
        let run = |ops: &VecOps, which: usize| -> (Vec<f32>, f64) {
            let (mut y, mut sum) = (y0.clone(), 0.0);
            match which {
                0 => {
                    y = y16.clone();
                    (ops.axpy_f16)(&mut y, &f16_bytes(&x), a)
                }
                1 => {
                    y = y16.clone();
                    (ops.scale_f16)(&mut y, a)
                }
                2 => (ops.swiglu)(&mut y, &x),
                _ => {
                    for (i, v) in y.iter_mut().enumerate() {
                        if i % 7 == 0 {
                            *v = f32::NEG_INFINITY;
                        }
                    }
                    sum = (ops.exp_shifted)(&mut y, 1.5)
                }
            }
            (y, sum)
        };
        for which in 0..4 {
            let ((a, sa), (b, sb)) = (run(simd, which), run(&def, which));
            assert_eq!(bits(&a), bits(&b), "primitive {which}, n = {n}");
            assert_eq!(sa.to_bits(), sb.to_bits(), "primitive {which} sum, n = {n}");
        }
    }
}

#[test]
fn half_precision_accumulation_rounds_once() {
    // With AVX512-FP16 the V accumulation is vfmadd231ph: x * f16(a) + y rounded once to f16, which differs from
    // rounding x * a + y (f32) to f16 for some inputs; this pins that the kernel takes the half-precision path.
    if !available() || !super::has_fp16() {
        eprintln!("note: no AVX512-FP16 here; the half-precision accumulation is not tested");
        return;
    }
    let simd = super::detect_vec_ops().unwrap();
    let n = 128;
    let mut differ = 0;
    for s in 0..20u64 {
        let x = floats(s, n, 3.0);
        let y: Vec<f32> = floats(s + 1000, n, 3.0).iter().map(|&v| f16_round(v)).collect();
        let a = 0.3 + s as f32 * 0.0123;
        let (mut got, mut f32_path) = (y.clone(), y.clone());
        (simd.axpy_f16)(&mut got, &f16_bytes(&x), a);
        (VecOps::SCALAR.axpy_f16)(&mut f32_path, &f16_bytes(&x), a);
        differ += got.iter().zip(&f32_path).filter(|(a, b)| a != b).count();
    }
    assert!(differ > 0, "the half-precision path never differed from the f32 one");
}
