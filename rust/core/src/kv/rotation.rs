//! The Hadamard rotation a quantized KV cache stores its rows in.
//!
//! Keys and values have a few channels far larger than the rest (outliers), and a 4-bit block of 32 shares one
//! scale, so the outlier sets the step for the whole block. An orthonormal Hadamard transform spreads every
//! channel over all of them; stored rows are then nearly Gaussian and quantize with much less error.
//! (QuaRot; llama.cpp rotates before its quantized cache the same way.)
//!
//! The transform is applied per head to the stored K and V rows. Attention stays exact in real arithmetic because
//! H is orthonormal and symmetric (H·H = I): q·k = (Hq)·(Hk), so the query is rotated the same way; and
//! sum_i w_i (H v_i) = H (sum_i w_i v_i), so the attention output is rotated back with H itself.
//!
//! H is the Walsh-Hadamard matrix of size n scaled by 1/sqrt(n), n the largest power of two dividing the head size
//! (at most the head size), applied to each n-wide piece of a head. Cache types that need rotation have a block
//! size of 32 that divides the head size, so n >= 32.

/// The width of the Hadamard blocks for a head of `head_dim` (the largest power of two dividing it).
pub fn block_width(head_dim: usize) -> usize {
    if head_dim == 0 {
        return 1;
    }
    1 << head_dim.trailing_zeros()
}

/// Rotate every head of `row` ([n_heads * head_dim]) in place: x <- H x per `block_width(head_dim)` piece.
/// Applying it twice gives the row back (up to rounding).
pub fn rotate(row: &mut [f32], head_dim: usize) {
    let n = block_width(head_dim);
    let scale = 1.0 / (n as f32).sqrt();
    for piece in row.chunks_exact_mut(n) {
        fwht(piece);
        piece.iter_mut().for_each(|v| *v *= scale);
    }
}

/// The unnormalised fast Walsh-Hadamard transform of a power-of-two-long slice, in place.
fn fwht(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for start in (0..n).step_by(2 * h) {
            let (a, b) = x[start..start + 2 * h].split_at_mut(h);
            for (u, v) in a.iter_mut().zip(b.iter_mut()) {
                let (s, d) = (*u + *v, *u - *v);
                *u = s;
                *v = d;
            }
        }
        h *= 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_is_orthonormal_and_its_own_inverse() {
        let hd = 64;
        let x: Vec<f32> = crate::test_rng::uniform_floats(7, 2 * hd, 3.0);
        let y: Vec<f32> = crate::test_rng::uniform_floats(8, 2 * hd, 3.0);
        let (mut rx, mut ry) = (x.clone(), y.clone());
        rotate(&mut rx, hd);
        rotate(&mut ry, hd);
        for h in 0..2 {
            let dot = |a: &[f32], b: &[f32]| a[h * hd..(h + 1) * hd].iter().zip(&b[h * hd..]).map(|(p, q)| p * q).sum::<f32>();
            assert!((dot(&x, &y) - dot(&rx, &ry)).abs() < 1e-3, "head {h}: dot products differ");
        }
        let mut back = rx.clone();
        rotate(&mut back, hd);
        for (a, b) in back.iter().zip(&x) {
            assert!((a - b).abs() < 1e-5);
        }
        // A single outlier channel is spread evenly over the whole head.
        let mut spike = vec![0.0f32; hd];
        spike[5] = 8.0;
        rotate(&mut spike, hd);
        assert!(spike.iter().all(|v| (v.abs() - 1.0).abs() < 1e-6), "{spike:?}");
    }

    #[test]
    fn block_width_is_the_power_of_two_part() {
        assert_eq!((block_width(64), block_width(128), block_width(96), block_width(80)), (64, 128, 32, 16));
    }
}
