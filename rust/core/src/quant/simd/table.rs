//! The kernel table every kernel set fills ([`Kernels`]: per-type function pointers, `None` where the scalar code
//! runs), the function types of its slots, and the description of llama.cpp's matmul paths it mirrors
//! ([`Orders`], [`MatmulPos`]). The architecture modules (`x86_avx2`, `aarch64_neon`) build tables of this type
//! and `simd/mod.rs` picks one, so neither imports the other both ways.

use crate::gsq::format as gsq;
use crate::quant::format::GgmlType;

/// Dot-product kernel: `(nb, w, act)` with `nb` the number of blocks (elements for the float types). Kernels
/// clamp `nb` to the whole blocks both slices hold, so a short row never reads out of bounds.
pub(in crate::quant) type VecDotFn = fn(usize, &[u8], &[u8]) -> f32;
/// Tile kernel: `(nb, w, w_stride, nr, act, act_stride, nc, out)` computes the `nr x nc` dot products of `nr`
/// weight rows (`w_stride` bytes apart) with `nc` activation rows into `out[r * nc + c]`, each summed exactly as
/// the `vec_dot` kernel of its type sums it. A tile that does not fit its slices yields NaNs.
pub(in crate::quant) type TileFn = fn(usize, &[u8], usize, usize, &[u8], usize, usize, &mut [f32]);
/// Quantization kernel: writes the whole blocks that fit both `x` and `dst`.
pub(in crate::quant) type QuantizeFn = fn(&[f32], &mut [u8]);
/// Dequantization kernel: writes the whole blocks that fit both `src` and `dst`.
pub(in crate::quant) type DequantizeFn = fn(&[u8], &mut [f32]);

/// GSQ-RCO dot products: `(layout, w, stride, x, out)`, rows `i` of `out.len()` rows (`w[i * stride..]`, whole
/// records within `stride` bytes) with int8 activations (`gsq::dot_row_q8` each; the records that row and `x`
/// both cover) into `out[i]`.
pub(in crate::quant) type GsqDotFn = fn(gsq::Layout, &[u8], usize, &gsq::ActQ8, &mut [f32]);
/// GSQ-RCO activation quantization (`gsq::ActQ8::quantize`, byte-exact).
pub(in crate::quant) type GsqQuantizeFn = fn(&[f32], &mut gsq::ActQ8);

/// Table slots: GGML type ids run up to 30 (BF16).
pub(super) const SLOTS: usize = 31;

type Slots<F> = [Option<F>; SLOTS];

/// One kernel set: per-type function pointers, `None` where the scalar code (or, for the variant slots, the
/// `vec_dot` slot) runs.
pub(in crate::quant) struct Kernels {
    pub(super) name: &'static str,
    /// Whether Q4_0 / Q4_K matrices count as repacked (llama.cpp's default on AVX2 CPUs).
    pub(super) repacked_q4: bool,
    /// One activation row (decode), matrices with a row count divisible by 8.
    pub(super) vec_dot: Slots<VecDotFn>,
    /// Where it differs from `vec_dot`: matrices llama.cpp does not repack (row count not divisible by 8).
    pub(super) vec_dot_unpacked: Slots<VecDotFn>,
    /// Repacked matrices, activation rows processed four at a time (GEMM).
    pub(super) vec_dot_gemm4: Slots<VecDotFn>,
    /// Non-repacked K-quant matrices in matmuls with 8 or more activation rows.
    pub(super) vec_dot_tiled: Slots<VecDotFn>,
    /// Tiles (several weight rows and/or activation rows per call) of the plain (`vec_dot_unpacked` or
    /// `vec_dot`), repacked GEMV (`vec_dot`), `vec_dot_gemm4` and `vec_dot_tiled` products.
    pub(super) vec_dot_tile: Slots<TileFn>,
    pub(super) vec_dot_tile_gemv: Slots<TileFn>,
    pub(super) vec_dot_tile_gemm4: Slots<TileFn>,
    pub(super) vec_dot_tile_tiled: Slots<TileFn>,
    /// The tile shape (weight rows, activation rows) per call a `vec_dot_tile_gemm4` kernel wants, where it is not
    /// matmul's default: a kernel that repacks its weight rows at each call wants many activation rows to share
    /// the cost.
    pub(super) tile_shape_gemm4: Slots<(usize, usize)>,
    /// The same for the `vec_dot_tile_tiled` kernels.
    pub(super) tile_shape_tiled: Slots<(usize, usize)>,
    /// The same for the plain `vec_dot_tile` kernels.
    pub(super) tile_shape_plain: Slots<(usize, usize)>,
    pub(super) quantize: Slots<QuantizeFn>,
    pub(super) dequantize: Slots<DequantizeFn>,
    /// GSQ-RCO rows (not a GGML type; docs/gsq-rco.md) and their activations.
    pub(super) gsq_dot: Option<GsqDotFn>,
    pub(super) gsq_quantize: Option<GsqQuantizeFn>,
}

impl Kernels {
    /// The empty table: everything scalar.
    pub(super) const SCALAR: Kernels = Kernels {
        name: "scalar",
        repacked_q4: false,
        vec_dot: [None; SLOTS],
        vec_dot_unpacked: [None; SLOTS],
        vec_dot_gemm4: [None; SLOTS],
        vec_dot_tiled: [None; SLOTS],
        vec_dot_tile: [None; SLOTS],
        vec_dot_tile_gemv: [None; SLOTS],
        vec_dot_tile_gemm4: [None; SLOTS],
        vec_dot_tile_tiled: [None; SLOTS],
        tile_shape_gemm4: [None; SLOTS],
        tile_shape_tiled: [None; SLOTS],
        tile_shape_plain: [None; SLOTS],
        quantize: [None; SLOTS],
        dequantize: [None; SLOTS],
        gsq_dot: None,
        gsq_quantize: None,
    };

    #[inline]
    pub(in crate::quant) fn vec_dot(&self, ty: GgmlType) -> Option<VecDotFn> {
        self.vec_dot[ty as usize]
    }

    /// Which of llama.cpp's matmul paths sums the dot product at `pos` (see [`vec_dot_matmul`]).
    #[inline]
    fn path(&self, ty: GgmlType, pos: MatmulPos) -> Path {
        let t = ty as usize;
        // llama.cpp repacks Q4_0 / Q4_K matrices with a row count divisible by 8.
        if self.repacked_q4 && matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_K) && pos.w_rows.is_multiple_of(8) {
            let in_group_of_4 = pos.act_rows >= 4 && pos.act_row < pos.act_rows - pos.act_rows % 4;
            return if in_group_of_4 && self.vec_dot_gemm4[t].is_some() { Path::Gemm4 } else { Path::Gemv };
        }
        // Its tiled K-quant kernel runs on (unrepacked) matmuls of 8 or more activation rows.
        if pos.act_rows >= 8 && self.vec_dot_tiled[t].is_some() {
            return Path::Tiled;
        }
        Path::Plain
    }

    /// The kernel llama.cpp's CPU backend would sum this dot product with (see [`vec_dot_matmul`]).
    #[inline]
    pub(in crate::quant) fn vec_dot_at(&self, ty: GgmlType, pos: MatmulPos) -> Option<VecDotFn> {
        let t = ty as usize;
        match self.path(ty, pos) {
            Path::Gemm4 => self.vec_dot_gemm4[t],
            Path::Gemv => self.vec_dot[t],
            Path::Tiled => self.vec_dot_tiled[t],
            Path::Plain => self.vec_dot_unpacked[t].or(self.vec_dot[t]),
        }
    }

    /// The tile version of the kernel [`Kernels::vec_dot_at`] picks at `pos`, if there is one.
    #[inline]
    pub(in crate::quant) fn vec_dot_tile_at(&self, ty: GgmlType, pos: MatmulPos) -> Option<TileFn> {
        let t = ty as usize;
        match self.path(ty, pos) {
            Path::Gemm4 => self.vec_dot_tile_gemm4[t],
            Path::Gemv => self.vec_dot_tile_gemv[t],
            Path::Tiled => self.vec_dot_tile_tiled[t],
            Path::Plain => self.vec_dot_tile[t],
        }
    }

    /// The tile shape the kernel of [`Kernels::vec_dot_tile_at`] wants per call, if it has a preference.
    #[inline]
    pub(in crate::quant) fn tile_shape_at(&self, ty: GgmlType, pos: MatmulPos) -> Option<(usize, usize)> {
        match self.path(ty, pos) {
            Path::Gemm4 => self.tile_shape_gemm4[ty as usize],
            Path::Tiled => self.tile_shape_tiled[ty as usize],
            Path::Plain => self.tile_shape_plain[ty as usize],
            Path::Gemv => None,
        }
    }

    #[inline]
    pub(in crate::quant) fn quantize(&self, ty: GgmlType) -> Option<QuantizeFn> {
        self.quantize[ty as usize]
    }

    #[inline]
    pub(in crate::quant) fn dequantize(&self, ty: GgmlType) -> Option<DequantizeFn> {
        self.dequantize[ty as usize]
    }
}

/// llama.cpp's matmul paths on the CPU, as far as they sum dot products differently.
#[derive(Clone, Copy)]
enum Path {
    /// Repacked matrix, activation rows in a group of four (`ggml_gemm_*`).
    Gemm4,
    /// Repacked matrix, other activation rows (`ggml_gemv_*`).
    Gemv,
    /// The tiled K-quant GEMM.
    Tiled,
    /// `ggml_vec_dot_*` (or llamafile's GEMM, which sums the same way).
    Plain,
}

/// The lower-cased value of environment variable `name`, if set.
pub(super) fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|v| v.trim().to_ascii_lowercase())
}

// `Orders` and `atoi` describe llama.cpp's x86 matmul paths; other architectures do not use them.
/// C's `atoi`, as llama.cpp reads its switches: optional sign and leading digits, 0 when there are none.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) fn atoi(s: &str) -> i64 {
    let s = s.trim_start();
    let (neg, digits) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let v = digits
        .bytes()
        .take_while(u8::is_ascii_digit)
        .fold(0i64, |v, d| v.saturating_mul(10).saturating_add((d - b'0') as i64));
    if neg {
        -v
    } else {
        v
    }
}

/// Which of llama.cpp's matmul paths the kernel table mirrors.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) struct Orders {
    /// Q4_0 / Q4_K matrices are repacked (llama.cpp without `--no-repack`).
    pub(super) repacked_q4: bool,
    /// K-quant matmuls with >= 8 activation rows use the tiled kernel (llama.cpp without `GGML_CPU_TILED_MM=0`).
    pub(super) tiled: bool,
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl Orders {
    #[cfg(test)]
    pub(super) const LLAMA_CPP_DEFAULT: Orders = Orders { repacked_q4: true, tiled: true };
    #[cfg(test)]
    pub(super) const PLAIN: Orders = Orders { repacked_q4: false, tiled: false };

    pub(super) fn from_env() -> Orders {
        Orders {
            repacked_q4: !matches!(env("NINFER_Q4_ORDER").as_deref(), Some("vec_dot" | "vecdot" | "no-repack")),
            tiled: env("GGML_CPU_TILED_MM").is_none_or(|v| atoi(&v) != 0),
        }
    }
}

/// Where a dot product sits in a matmul `out[act_row][r] = dot(w[r], act[act_row])`: that decides which of
/// llama.cpp's kernels (and float summation orders) its CPU backend would use for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulPos {
    /// Rows of the weight matrix (output features).
    pub w_rows: usize,
    /// Activation rows (tokens) of the matmul.
    pub act_rows: usize,
    /// The activation row of this dot product, `0..act_rows`.
    pub act_row: usize,
}
