//! The SIMD element-wise primitives against their scalar definitions: bit-identical results on random inputs of
//! every length 0..=140 (so every tail), including values that take ggml_v_expf's slow lanes and masked -inf.

use super::vecops::VecOps;

fn simd_ops() -> Option<&'static VecOps> {
    #[cfg(target_arch = "x86_64")]
    {
        let ops = super::x86_avx2::detect_vec_ops();
        if ops.is_none() {
            eprintln!("note: this CPU lacks AVX2/FMA/F16C; the SIMD primitives are not tested here");
        }
        ops
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

use crate::test_rng::uniform_floats as floats;

fn f16_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect()
}

fn f16_values(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn element_wise_primitives_equal_the_scalar_definitions() {
    let Some(simd) = simd_ops() else { return };
    let scalar = &VecOps::SCALAR;
    for n in 0..=140 {
        let seed = n as u64 + 1;
        let x = floats(seed, n, 3.0);
        let y0 = floats(seed + 100, n, 3.0);
        let a = floats(seed + 200, 1, 2.0)[0];
        let run = |ops: &VecOps, which: usize| -> (Vec<f32>, f64) {
            let mut y = y0.clone();
            let mut sum = 0.0;
            match which {
                0 => (ops.axpy)(&mut y, &x, a),
                1 => {
                    y = f16_values(&y0);
                    (ops.axpy_f16)(&mut y, &f16_bytes(&x), a)
                }
                2 => (ops.scale)(&mut y, a),
                3 => (ops.scale_f16)(&mut y, a),
                4 => (ops.swiglu)(&mut y, &x),
                _ => {
                    // Scores: a mix of ordinary values, masked cells and values far below the max.
                    for (i, v) in y.iter_mut().enumerate() {
                        *v = match i % 5 {
                            0 => f32::NEG_INFINITY,
                            1 => *v * 60.0,
                            _ => *v,
                        };
                    }
                    sum = (ops.exp_shifted)(&mut y, 1.5)
                }
            }
            (y, sum)
        };
        // axpy_rows: up to 5 rows of n.
        let k = n % 6;
        let rows = floats(seed + 300, k * n, 3.0);
        let w = floats(seed + 400, k, 2.0);
        let (mut ya, mut yb) = (y0.clone(), y0.clone());
        (simd.axpy_rows)(&mut ya, &rows, &w);
        (scalar.axpy_rows)(&mut yb, &rows, &w);
        assert_eq!(bits(&ya), bits(&yb), "axpy_rows, n = {n}, k = {k}");
        for which in 0..6 {
            let ((a, sa), (b, sb)) = (run(simd, which), run(scalar, which));
            assert_eq!(bits(&a), bits(&b), "primitive {which}, n = {n}");
            assert_eq!(sa.to_bits(), sb.to_bits(), "primitive {which} sum, n = {n}");
        }
    }
}

#[test]
fn swiglu_takes_the_slow_exp_lanes_exactly() {
    let Some(simd) = simd_ops() else { return };
    let x: Vec<f32> = (0..64).map(|i| (i as f32 - 32.0) * 7.3).collect(); // |x| up to 233: exp over/underflows
    let up = vec![1.25f32; 64];
    let (mut a, mut b) = (x.clone(), x.clone());
    (simd.swiglu)(&mut a, &up);
    (VecOps::SCALAR.swiglu)(&mut b, &up);
    assert_eq!(bits(&a), bits(&b));
}

#[test]
fn dot_cols_is_a_sequential_fma_chain_per_column() {
    let Some(simd) = simd_ops() else { return };
    for (dk, w) in [(64, 64), (128, 64), (3, 7), (64, 40), (1, 1), (17, 33)] {
        let q = floats(dk as u64, dk, 2.0);
        let kt = floats(w as u64 + 7, dk * w, 2.0);
        let (mut a, mut b) = (vec![0.0; w], vec![0.0; w]);
        (simd.dot_cols)(&q, &kt, &mut a);
        (VecOps::SCALAR.dot_cols)(&q, &kt, &mut b);
        assert_eq!(bits(&a), bits(&b), "dk {dk}, w {w}");
        // And the chain really is sequential: column 0 recomputed by hand.
        let want = (0..dk).fold(0.0f32, |acc, d| q[d].mul_add(kt[d * w], acc));
        assert_eq!(a[0].to_bits(), want.to_bits());
    }
}

/// `accumulate_f16` of every table this CPU runs equals its definition: the same table's `scale_f16` and
/// `axpy_f16` called key by key and head by head (so AVX512-FP16's half-precision columns too), for head counts
/// around the eight kept in registers, every column tail and rescales (a new running max) at any key.
#[test]
fn accumulate_f16_equals_the_per_key_primitives() {
    #[cfg(target_arch = "x86_64")]
    let simd = [super::x86_avx2::detect_vec_ops(), super::x86_avx512::detect_vec_ops()];
    #[cfg(not(target_arch = "x86_64"))]
    let simd: [Option<&VecOps>; 0] = [];
    for ops in std::iter::once(&VecOps::SCALAR).chain(simd.into_iter().flatten()) {
        for (heads, n, keys) in [(1, 64, 5), (7, 64, 32), (6, 128, 9), (9, 130, 4), (8, 17, 3), (3, 256, 2), (2, 0, 3), (4, 8, 0)] {
            let seed = (heads * 1000 + n * 10 + keys) as u64;
            let stride = 2 * n + 2 * 16; // rows of a cache block: other heads' values between them
            let v: Vec<u8> = f16_bytes(&floats(seed, keys * stride / 2 + n, 3.0));
            let ys0 = f16_values(&floats(seed + 1, heads * n, 3.0));
            let vs = floats(seed + 2, keys * heads, 1.0).iter().map(|x| x.abs()).collect::<Vec<_>>();
            // ms: 0 at the first key (the empty accumulator's rescale), then a few rescales, 1 otherwise.
            let ms: Vec<f32> = (0..keys * heads)
                .map(|i| if i < heads { 0.0 } else if i % 5 == 2 { 0.37 + (i % 7) as f32 * 0.05 } else { 1.0 })
                .collect();
            let mut got = ys0.clone();
            (ops.accumulate_f16)(&mut got, n, &v, stride, &ms, &vs);
            let mut want = ys0.clone();
            for j in 0..keys {
                for (h, y) in want.chunks_exact_mut(n.max(1)).enumerate().take(if n == 0 { 0 } else { heads }) {
                    if ms[j * heads + h] != 1.0 {
                        (ops.scale_f16)(y, ms[j * heads + h]);
                    }
                    (ops.axpy_f16)(y, &v[j * stride..][..2 * n], vs[j * heads + h]);
                }
            }
            assert_eq!(bits(&got), bits(&want), "{}: {heads} heads, {n} columns, {keys} keys", ops.name);
            assert!(keys == 0 || n == 0 || got != ys0, "the accumulation changed nothing");
        }
    }
}
