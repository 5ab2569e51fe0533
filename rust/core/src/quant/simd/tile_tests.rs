#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code, unused_imports))]
//! The tile kernels (several dot products per call) against the single kernels whose sums they must reproduce
//! bit for bit, and the AVX-512 VNNI kernels against the AVX2 ones.

use super::table::{Kernels, Orders, VecDotFn};
use super::tests::{quantized_acts, random_weights, simd_kernels, Rng};
use crate::quant::format::GgmlType;

/// Every tile kernel of the table with the single kernel whose sums it must reproduce.
fn all_tile_kernels(k: &Kernels) -> Vec<(GgmlType, &'static str, super::TileFn, VecDotFn)> {
    let mut out = Vec::new();
    for t in 0..super::table::SLOTS {
        let Some(ty) = GgmlType::from_id(t as u32) else { continue };
        let plain = k.vec_dot_unpacked[t].or(k.vec_dot[t]);
        let slots = [
            ("plain", k.vec_dot_tile[t], plain),
            ("gemv", k.vec_dot_tile_gemv[t], if k.repacked_q4 { k.vec_dot[t] } else { None }),
            ("gemm4", k.vec_dot_tile_gemm4[t], k.vec_dot_gemm4[t]),
            ("tiled", k.vec_dot_tile_tiled[t], k.vec_dot_tiled[t]),
        ];
        for (name, tile, single) in slots {
            if let Some(tile) = tile {
                out.push((ty, name, tile, single.unwrap_or_else(|| panic!("{ty} {name} tile without its kernel"))));
            }
        }
    }
    out
}

/// Every tile kernel of the AVX2 and (where the CPU has it) AVX-512 sets, in every shape 1..=4 x 1..=9 (the
/// instanced ones and the one-at-a-time fallback), gives the products of its single kernel bit for bit, on rows
/// of 1, 3 and 11 blocks; a tile that does not fit its slices gives NaNs instead of reading out of bounds.
#[cfg(target_arch = "x86_64")]
#[test]
fn dot_tiles_equal_single_products_bit_for_bit() {
    let avx512 = super::x86_avx512::detect(Orders::LLAMA_CPP_DEFAULT);
    if avx512.is_none() {
        eprintln!("note: this CPU lacks AVX-512 F/BW/DQ/VL/VNNI; only the AVX2 tiles are tested here");
    }
    for k in [simd_kernels(), avx512].into_iter().flatten() {
        check_tiles(&k);
    }
}

#[cfg(target_arch = "x86_64")]
fn check_tiles(k: &Kernels) {
    let tiles = all_tile_kernels(k);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K] {
        assert!(tiles.iter().any(|t| t.0 == ty), "{ty} has a tile kernel");
    }
    let mut rng = Rng::new(11);
    for (ty, name, tile, single) in tiles {
        let act_ty = ty.act_type();
        for nb in [1usize, 3, 11] {
            let n = nb * ty.block_size();
            let (rb, ab) = (ty.row_bytes(n).unwrap(), act_ty.row_bytes(n).unwrap());
            let w: Vec<u8> = (0..13).flat_map(|_| random_weights(ty, n, &mut rng)).collect();
            let a: Vec<u8> = (0..9).flat_map(|_| quantized_acts(act_ty, &rng.floats(n))).collect();
            for nr in 1..=13 {  // (several passes of rows, then the rest)
                for nc in 1..=9 {
                    let mut out = vec![0.0f32; nr * nc];
                    tile(nb, &w, rb, nr, &a, ab, nc, &mut out);
                    for r in 0..nr {
                        for c in 0..nc {
                            let want = single(nb, &w[r * rb..(r + 1) * rb], &a[c * ab..(c + 1) * ab]);
                            assert_eq!(
                                out[r * nc + c].to_bits(),
                                want.to_bits(),
                                "{} {ty} {name} nb {nb} tile {nr}x{nc} ({r},{c}): {} vs {want}",
                                k.name,
                                out[r * nc + c]
                            );
                        }
                    }
                }
            }
            let mut out = vec![0.0f32; 4];
            tile(nb, &w[..3 * rb], rb, 4, &a, ab, 1, &mut out);
            assert!(out.iter().all(|v| v.is_nan()), "{ty} {name}: a tile past the weights' end is refused");
        }
    }
}

/// The tile kernels that want larger tiles than the others (`Kernels::tile_shape_gemm4` / `_tiled`: the AVX-512
/// repacked Q4_K GEMM and tiled Q6_K) give their single kernel's bits in shapes around theirs: rows in one, two and a part of a group of
/// lanes, activation rows in and past their groups; also on blocks at the extremes of the integer sums (all codes
/// 15 with scales and mins 63 against activations of -128, 127 or mixed), where a kernel that overflowed or
/// rounded its integer parts would differ.
#[cfg(target_arch = "x86_64")]
#[test]
fn wide_tiles_equal_single_products_bit_for_bit() {
    let Some(k) = super::x86_avx512::detect(Orders::LLAMA_CPP_DEFAULT) else {
        eprintln!("note: this CPU lacks AVX-512 F/BW/DQ/VL/VNNI; its wide tiles are not tested here");
        return;
    };
    let mut rng = Rng::new(41);
    let mut tested = 0;
    for (ty, name, tile, single) in all_tile_kernels(&k) {
        let shape = match name {
            "gemm4" => k.tile_shape_gemm4[ty as usize],
            "tiled" => k.tile_shape_tiled[ty as usize],
            "plain" => k.tile_shape_plain[ty as usize],
            _ => None,
        };
        let Some((rows, cols)) = shape else { continue };
        let act_ty = ty.act_type();
        for (nb, extreme) in [(1usize, false), (6, false), (35, false), (2, true)] {
            let n = nb * ty.block_size();
            let (rb, ab) = (ty.row_bytes(n).unwrap(), act_ty.row_bytes(n).unwrap());
            let (nr_max, nc_max) = (2 * rows + 3, cols + 5);
            let mut w: Vec<u8> = (0..nr_max).flat_map(|_| random_weights(ty, n, &mut rng)).collect();
            let mut a: Vec<u8> = (0..nc_max).flat_map(|_| quantized_acts(act_ty, &rng.floats(n))).collect();
            if extreme {
                extreme_blocks(ty, &mut w, &mut a, &mut rng);
            }
            for (nr, nc) in [(rows, cols), (1, 4), (rows - 3, 7), (rows + 1, 4), (nr_max, nc_max), (2 * rows, 9), (3, nc_max)] {
                let mut out = vec![0.0f32; nr * nc];
                tile(nb, &w, rb, nr, &a, ab, nc, &mut out);
                for r in 0..nr {
                    for c in 0..nc {
                        let want = single(nb, &w[r * rb..(r + 1) * rb], &a[c * ab..(c + 1) * ab]);
                        let got = out[r * nc + c];
                        let at = format!("{ty} {name} nb {nb} {nr}x{nc} ({r},{c})");
                        assert_eq!(got.to_bits(), want.to_bits(), "{at}: {got} vs {want}");
                    }
                }
            }
        }
        tested += 1;
    }
    // Q4_K's GEMM and Q6_K's tiled lane tiles; Q4_0, Q5_0 and Q8_0's paired-row tiles
    assert_eq!(tested, 5, "the AVX-512 set has five wide tile kernels");
}

/// Weights of `ty` and their activations at the extremes of the integer sums. Q4_K / Q6_K: every code at its
/// maximum (15, 63), scales and mins at theirs (63; Q6_K's signed scales all 127 or all -128, per block); Q8_K
/// activation quants -128 or 127 (whole blocks of one or the other, or mixed), bsums to match. Q4_0 / Q5_0 / Q8_0:
/// every code at its lowest or highest (per block), Q8_0 activation quants -127 or 127 (the quantizer's range).
fn extreme_blocks(ty: GgmlType, w: &mut [u8], a: &mut [u8], rng: &mut Rng) {
    use crate::quant::format::{Q8_K_BYTES, QK_K, QK_LEGACY};
    for b in w.chunks_exact_mut(ty.type_size()) {
        let high = rng.next_u64() & 1 == 0;
        match ty {
            GgmlType::Q4_K => b[4..].fill(0xFF),
            GgmlType::Q6_K => {
                b[..192].fill(0xFF);
                b[192..208].fill(if high { 127 } else { 0x80 });
            }
            GgmlType::Q4_0 | GgmlType::Q5_0 => b[2..].fill(if high { 0xFF } else { 0 }),
            GgmlType::Q8_0 => b[2..].fill(if high { 127 } else { 0x80 }),
            _ => panic!("no extreme blocks written for {ty}"),
        }
    }
    if ty.act_type() == GgmlType::Q8_0 {
        for b in a.chunks_exact_mut(2 + QK_LEGACY) {
            let kind = rng.next_u64() % 3;
            for q in &mut b[2..] {
                let neg = kind == 0 || (kind == 2 && rng.next_u64() & 1 == 0);
                *q = if neg { (-127i8) as u8 } else { 127 };
            }
        }
        return;
    }
    for b in a.chunks_exact_mut(Q8_K_BYTES) {
        let kind = rng.next_u64() % 3;
        for i in 0..QK_K {
            let q: i8 = match kind {
                0 => -128,
                1 => 127,
                _ => if rng.next_u64() & 1 == 0 { -128 } else { 127 },
            };
            b[4 + i] = q as u8;
        }
        for j in 0..QK_K / 16 {
            let s: i16 = b[4 + 16 * j..4 + 16 * (j + 1)].iter().map(|&q| q as i8 as i16).sum();
            b[4 + QK_K + 2 * j..][..2].copy_from_slice(&s.to_le_bytes());
        }
    }
}

/// On CPUs with AVX-512 VNNI: its legacy-format products and tiles give the AVX2 kernels' bits exactly.
#[test]
fn vnni_kernels_equal_avx2_kernels_bit_for_bit() {
    #[cfg(target_arch = "x86_64")]
    {
        let (Some(avx2), Some(vnni)) = (
            super::x86_avx2::detect(Orders::PLAIN, false),
            super::x86_avx2::detect(Orders::PLAIN, true),
        ) else {
            return;
        };
        if !(is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl")) {
            eprintln!("note: this CPU lacks AVX-512 VNNI; the VNNI kernels are not tested here");
            return;
        }
        let mut rng = Rng::new(21);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q8_1] {
            let t = ty as usize;
            let act_ty = ty.act_type();
            for nb in [1usize, 7, 11, 128] {
                let n = nb * ty.block_size();
                let (rb, ab) = (ty.row_bytes(n).unwrap(), act_ty.row_bytes(n).unwrap());
                let w: Vec<u8> = (0..2).flat_map(|_| random_weights(ty, n, &mut rng)).collect();
                let a: Vec<u8> = (0..4).flat_map(|_| quantized_acts(act_ty, &rng.floats(n))).collect();
                let (d0, d1) = (avx2.vec_dot[t].unwrap(), vnni.vec_dot[t].unwrap());
                assert_eq!(d0(nb, &w[..rb], &a[..ab]).to_bits(), d1(nb, &w[..rb], &a[..ab]).to_bits(), "{ty} nb {nb}");
                let (mut o0, mut o1) = ([0.0f32; 8], [0.0f32; 8]);
                avx2.vec_dot_tile[t].unwrap()(nb, &w, rb, 2, &a, ab, 4, &mut o0);
                vnni.vec_dot_tile[t].unwrap()(nb, &w, rb, 2, &a, ab, 4, &mut o1);
                assert_eq!(o0.map(f32::to_bits), o1.map(f32::to_bits), "{ty} nb {nb} 2x4 tile");
            }
        }
    }
}
