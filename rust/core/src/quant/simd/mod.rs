//! Run-time selected SIMD kernels behind the public entry points of [`crate::quant`].
//!
//! The scalar code of `float.rs`, `legacy.rs` and `kquants.rs` stays the reference and the fallback. At the
//! first call, [`kernels`] inspects the CPU once (`is_x86_feature_detected!`) and builds a [`Kernels`] table:
//! optional function pointers per GGML type for the dot products, activation quantization and
//! `dequantize_row`. A missing entry means "use the scalar code". The entry points in `quant/mod.rs` look the
//! table up (one atomic load once initialised) and fall back to the scalar match.
//!
//! Kernel sets, best first:
//! - `avx2+avx512vnni`: the `avx2` set with the legacy formats' int8 products done by AVX-512 VNNI's
//!   `vpdpbusd` (as llama.cpp built for such a CPU does); the same integers, so the same bits;
//! - `avx2`: x86-64 AVX2 + FMA + F16C (`x86_avx2`), with the integer layout and float summation order of
//!   llama.cpp's own AVX2 kernels, so results are bit-identical to llama.cpp running on the same machine
//!   (checked against its `libggml-cpu.so`); activation quantization is byte-exact with the scalar code.
//! - `neon` (aarch64, `aarch64_neon`): the 32-element block formats' dot products, exact integer parts, float
//!   sums in their own order (not llama.cpp's); the K-quants' int8 products under the scalar unpacking; GSQ-RCO
//!   rows with the scalar reference's bits; everything else scalar there.
//! - not yet: wider AVX-512 kernels: add a module and a branch in [`detect`]; a set may start from a lesser
//!   set's table and override entries.
//!
//! llama.cpp does not sum every dot product of a matmul the same way: on AVX2 it repacks Q4_0 / Q4_K matrices
//! and runs GEMV/GEMM kernels on them, and runs a "tiled" kernel for K-quant matmuls with 8 or more activation
//! rows. [`vec_dot_matmul`] picks the matching kernel from the position of the dot product in its matmul;
//! [`crate::quant::vec_dot`] is the single-activation-row (decode) case.
//!
//! Environment (read once, at the first quant call):
//! - `NINFER_SIMD=scalar` (or `off`, `0`, `none`) forces the scalar code, for debugging numeric differences;
//!   `NINFER_SIMD=avx2` keeps AVX2 kernels where AVX-512 VNNI ones would be picked (to compare the two);
//! - `NINFER_Q4_ORDER=vec_dot` sums Q4_0 / Q4_K like llama.cpp run with `--no-repack`;
//! - `GGML_CPU_TILED_MM=0`, the variable llama.cpp itself reads, turns the tiled order off (like llama.cpp).

use std::sync::OnceLock;

use super::format::{check_row_size, GgmlType};
use super::scalar;
use crate::error::Result;
use crate::gsq::format as gsq;

#[cfg(target_arch = "aarch64")]
mod aarch64_neon;
#[cfg(target_arch = "x86_64")]
mod x86_avx2;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod vecops_tests;
pub mod vecops;

pub use vecops::VecOps;

/// Dot-product kernel: `(nb, w, act)` with `nb` the number of blocks (elements for the float types). Kernels
/// clamp `nb` to the whole blocks both slices hold, so a short row never reads out of bounds.
pub(super) type VecDotFn = fn(usize, &[u8], &[u8]) -> f32;
/// Tile kernel: `(nb, w, w_stride, nr, act, act_stride, nc, out)` computes the `nr x nc` dot products of `nr`
/// weight rows (`w_stride` bytes apart) with `nc` activation rows into `out[r * nc + c]`, each summed exactly as
/// the `vec_dot` kernel of its type sums it. A tile that does not fit its slices yields NaNs.
pub(super) type TileFn = fn(usize, &[u8], usize, usize, &[u8], usize, usize, &mut [f32]);
/// Quantization kernel: writes the whole blocks that fit both `x` and `dst`.
pub(super) type QuantizeFn = fn(&[f32], &mut [u8]);
/// Dequantization kernel: writes the whole blocks that fit both `src` and `dst`.
pub(super) type DequantizeFn = fn(&[u8], &mut [f32]);

/// GSQ-RCO dot products: `(layout, w, stride, x, out)`, rows `i` of `out.len()` rows (`w[i * stride..]`, whole
/// records within `stride` bytes) with int8 activations (`gsq::dot_row_q8` each; the records that row and `x`
/// both cover) into `out[i]`.
pub(super) type GsqDotFn = fn(gsq::Layout, &[u8], usize, &gsq::ActQ8, &mut [f32]);
/// GSQ-RCO activation quantization (`gsq::ActQ8::quantize`, byte-exact).
pub(super) type GsqQuantizeFn = fn(&[f32], &mut gsq::ActQ8);

/// Table slots: GGML type ids run up to 30 (BF16).
const SLOTS: usize = 31;

type Slots<F> = [Option<F>; SLOTS];

/// One kernel set: per-type function pointers, `None` where the scalar code (or, for the variant slots, the
/// `vec_dot` slot) runs.
pub(super) struct Kernels {
    name: &'static str,
    /// Whether Q4_0 / Q4_K matrices count as repacked (llama.cpp's default on AVX2 CPUs).
    repacked_q4: bool,
    /// One activation row (decode), matrices with a row count divisible by 8.
    vec_dot: Slots<VecDotFn>,
    /// Where it differs from `vec_dot`: matrices llama.cpp does not repack (row count not divisible by 8).
    vec_dot_unpacked: Slots<VecDotFn>,
    /// Repacked matrices, activation rows processed four at a time (GEMM).
    vec_dot_gemm4: Slots<VecDotFn>,
    /// Non-repacked K-quant matrices in matmuls with 8 or more activation rows.
    vec_dot_tiled: Slots<VecDotFn>,
    /// Tiles (several weight rows and/or activation rows per call) of the plain (`vec_dot_unpacked` or
    /// `vec_dot`), `vec_dot_gemm4` and `vec_dot_tiled` products. The GEMV of repacked matrices has none.
    vec_dot_tile: Slots<TileFn>,
    vec_dot_tile_gemm4: Slots<TileFn>,
    vec_dot_tile_tiled: Slots<TileFn>,
    quantize: Slots<QuantizeFn>,
    dequantize: Slots<DequantizeFn>,
    /// GSQ-RCO rows (not a GGML type; docs/gsq-rco.md) and their activations.
    gsq_dot: Option<GsqDotFn>,
    gsq_quantize: Option<GsqQuantizeFn>,
}

impl Kernels {
    /// The empty table: everything scalar.
    const SCALAR: Kernels = Kernels {
        name: "scalar",
        repacked_q4: false,
        vec_dot: [None; SLOTS],
        vec_dot_unpacked: [None; SLOTS],
        vec_dot_gemm4: [None; SLOTS],
        vec_dot_tiled: [None; SLOTS],
        vec_dot_tile: [None; SLOTS],
        vec_dot_tile_gemm4: [None; SLOTS],
        vec_dot_tile_tiled: [None; SLOTS],
        quantize: [None; SLOTS],
        dequantize: [None; SLOTS],
        gsq_dot: None,
        gsq_quantize: None,
    };

    #[inline]
    pub(super) fn vec_dot(&self, ty: GgmlType) -> Option<VecDotFn> {
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
    pub(super) fn vec_dot_at(&self, ty: GgmlType, pos: MatmulPos) -> Option<VecDotFn> {
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
    pub(super) fn vec_dot_tile_at(&self, ty: GgmlType, pos: MatmulPos) -> Option<TileFn> {
        let t = ty as usize;
        match self.path(ty, pos) {
            Path::Gemm4 => self.vec_dot_tile_gemm4[t],
            Path::Gemv => None,
            Path::Tiled => self.vec_dot_tile_tiled[t],
            Path::Plain => self.vec_dot_tile[t],
        }
    }

    #[inline]
    pub(super) fn quantize(&self, ty: GgmlType) -> Option<QuantizeFn> {
        self.quantize[ty as usize]
    }

    #[inline]
    pub(super) fn dequantize(&self, ty: GgmlType) -> Option<DequantizeFn> {
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

static KERNELS: OnceLock<Kernels> = OnceLock::new();

/// The kernel set of this CPU, detected on the first call.
#[inline]
pub(super) fn kernels() -> &'static Kernels {
    KERNELS.get_or_init(detect)
}

/// The lower-cased value of environment variable `name`, if set.
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|v| v.trim().to_ascii_lowercase())
}

// `Orders` and `atoi` describe llama.cpp's x86 matmul paths; other architectures do not use them.
/// C's `atoi`, as llama.cpp reads its switches: optional sign and leading digits, 0 when there are none.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn atoi(s: &str) -> i64 {
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
struct Orders {
    /// Q4_0 / Q4_K matrices are repacked (llama.cpp without `--no-repack`).
    repacked_q4: bool,
    /// K-quant matmuls with >= 8 activation rows use the tiled kernel (llama.cpp without `GGML_CPU_TILED_MM=0`).
    tiled: bool,
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl Orders {
    #[cfg(test)]
    const LLAMA_CPP_DEFAULT: Orders = Orders { repacked_q4: true, tiled: true };
    #[cfg(test)]
    const PLAIN: Orders = Orders { repacked_q4: false, tiled: false };

    fn from_env() -> Orders {
        Orders {
            repacked_q4: !matches!(env("NINFER_Q4_ORDER").as_deref(), Some("vec_dot" | "vecdot" | "no-repack")),
            tiled: env("GGML_CPU_TILED_MM").is_none_or(|v| atoi(&v) != 0),
        }
    }
}

fn detect() -> Kernels {
    let simd = env("NINFER_SIMD");
    if matches!(simd.as_deref(), Some("scalar" | "off" | "0" | "none")) {
        return Kernels::SCALAR;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let vnni = simd.as_deref() != Some("avx2");
        if let Some(k) = x86_avx2::detect(Orders::from_env(), vnni) {
            return k;
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if let Some(k) = aarch64_neon::detect() {
            return k;
        }
    }
    Kernels::SCALAR
}

// ---------------------------------------------------------------------------------------------------------------
// Public helpers
// ---------------------------------------------------------------------------------------------------------------

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

/// The body of [`crate::quant::vec_dot`] (one activation row, as in decoding): this CPU's kernel, or the scalar
/// code. Also [`vec_dot_matmul`]'s fallback.
pub(super) fn vec_dot(ty: GgmlType, n: usize, w: &[u8], act: &[u8]) -> f32 {
    debug_assert!(
        n.is_multiple_of(ty.block_size()),
        "vec_dot: {n} is not a whole number of {ty} blocks"
    );
    debug_assert!(
        w.len() >= n / ty.block_size() * ty.type_size(),
        "vec_dot: {ty} weight row too short"
    );
    debug_assert!(
        act.len() >= n / ty.block_size() * ty.act_type().type_size(),
        "vec_dot: {} activation row too short",
        ty.act_type()
    );
    let nb = n / ty.block_size();
    match kernels().vec_dot(ty) {
        Some(f) => f(nb, w, act),
        None => scalar::vec_dot_scalar(ty, nb, w, act),
    }
}


/// [`crate::quant::vec_dot`] for the dot product at `pos` of a matmul, summed the way llama.cpp's CPU backend
/// sums that one, so a whole matmul (prefill included) matches llama.cpp bit for bit. On the AVX2 kernel set
/// (llama.cpp defaults, see the module docs for the switches):
/// - Q4_0 / Q4_K matrices with `w_rows % 8 == 0` are repacked by llama.cpp: single rows go through its GEMV,
///   and activation rows `0 .. act_rows - act_rows % 4` (when `act_rows >= 4`) through its GEMM, which for
///   Q4_K sums in a different order;
/// - other K-quant matrices (and Q4_K ones llama.cpp does not repack) in matmuls with `act_rows >= 8` go
///   through its tiled kernel, which sums in its own order;
/// - everything else is `vec_dot` (llama.cpp's llamafile GEMM sums Q8_0/Q4_0/Q5_0 exactly like its dot
///   kernels). Not mirrored: F16/F32/BF16 matrices with `act_rows >= 2`, which llama.cpp runs through
///   llamafile's float GEMM; those get `vec_dot`.
///
/// Without a SIMD kernel set this is `vec_dot` (the scalar code). Same contract as `vec_dot`.
pub fn vec_dot_matmul(ty: GgmlType, n: usize, w: &[u8], act: &[u8], pos: MatmulPos) -> f32 {
    match kernels().vec_dot_at(ty, pos) {
        Some(f) => f(n / ty.block_size(), w, act),
        None => vec_dot(ty, n, w, act),
    }
}

/// The element-wise primitives of this CPU (scalar under `NINFER_SIMD=scalar`), detected on the first call.
pub fn vec_ops() -> &'static VecOps {
    static OPS: OnceLock<&'static VecOps> = OnceLock::new();
    OPS.get_or_init(|| {
        if matches!(env("NINFER_SIMD").as_deref(), Some("scalar" | "off" | "0" | "none")) {
            return &VecOps::SCALAR;
        }
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(ops) = x86_avx2::detect_vec_ops() {
                return ops;
            }
        }
        &VecOps::SCALAR
    })
}

/// The tile kernel for a block of dot products of one matmul (see [`tile_kernel`]).
#[derive(Clone, Copy)]
pub struct TileKernel {
    f: TileFn,
    block_size: usize,
}

impl TileKernel {
    /// The products of `nr` weight rows starting at `w` (`w_stride` bytes apart) of `n` elements with `nc`
    /// activation rows starting at `act` (`act_stride` apart), into `out[r * nc + c]`. A tile that does not fit
    /// its slices yields NaNs.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn run(&self, n: usize, w: &[u8], w_stride: usize, nr: usize, act: &[u8], act_stride: usize, nc: usize, out: &mut [f32]) {
        (self.f)(n / self.block_size, w, w_stride, nr, act, act_stride, nc, out)
    }
}

/// The tile kernel for the dot products of a matmul of type `ty` whose first product is at `pos`; every product
/// of a tile must share the kernel choice of `pos` (same matmul, activation rows on the same side of
/// llama.cpp's GEMM/GEMV split at `act_rows - act_rows % 4`). Each product of a tile equals
/// [`vec_dot_matmul`] at its position, bit for bit. `None` when this kernel set has none (then call
/// [`vec_dot_matmul`] per product).
pub fn tile_kernel(ty: GgmlType, pos: MatmulPos) -> Option<TileKernel> {
    kernels().vec_dot_tile_at(ty, pos).map(|f| TileKernel { f, block_size: ty.block_size() })
}

/// Dot product of one GSQ-RCO row's records with int8 activations `x` (the records both cover): the SIMD kernel of
/// this CPU, or the scalar reference [`crate::gsq::dot_row_q8`]. The caller checks that the sizes match.
#[inline]
pub fn gsq_dot_q8(layout: gsq::Layout, row: &[u8], x: &gsq::ActQ8) -> f32 {
    let mut out = [0.0f32];
    gsq_dot_rows(layout, row, row.len(), x, &mut out);
    out[0]
}

/// [`gsq_dot_q8`] of `out.len()` rows `stride` bytes apart (row `i` at `w[i * stride..]`, `stride` bytes or, for
/// the last one, the rest of `w`), into `out[i]`: the per-call setup of the kernel is shared by the rows.
pub fn gsq_dot_rows(layout: gsq::Layout, w: &[u8], stride: usize, x: &gsq::ActQ8, out: &mut [f32]) {
    match kernels().gsq_dot {
        Some(f) => f(layout, w, stride, x, out),
        None => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = gsq::dot_row_q8(layout, &w[i * stride..((i + 1) * stride).min(w.len())], x);
            }
        }
    }
}

/// Quantize `x` (whole 128-value blocks) into `a` for GSQ-RCO products: this CPU's kernel, byte-exact with the
/// scalar reference [`crate::gsq::ActQ8::quantize`].
pub fn gsq_quantize(x: &[f32], a: &mut gsq::ActQ8) {
    match kernels().gsq_quantize {
        Some(f) => f(x, a),
        None => a.quantize(x),
    }
}

/// Name of the kernel set the quant entry points use on this machine: `"avx2+avx512vnni"`, `"avx2"` or
/// `"scalar"`.
pub fn isa() -> &'static str {
    kernels().name
}

/// Whether [`crate::quant::vec_dot`] for weights of type `ty` runs a SIMD kernel on this machine.
pub fn has_simd_vec_dot(ty: GgmlType) -> bool {
    kernels().vec_dot(ty).is_some()
}

/// Whether [`crate::quant::quantize_act`] to `act_ty` runs a SIMD kernel on this machine.
pub fn has_simd_quantize(act_ty: GgmlType) -> bool {
    kernels().quantize(act_ty).is_some()
}

/// [`crate::quant::vec_dot`] with the scalar reference code, whatever the CPU: the oracle the SIMD kernels
/// are tested against. Same contract as `vec_dot`.
pub fn vec_dot_scalar(ty: GgmlType, n: usize, w: &[u8], act: &[u8]) -> f32 {
    scalar::vec_dot_scalar(ty, n / ty.block_size(), w, act)
}

/// [`crate::quant::quantize_act`] with the scalar reference code (the SIMD kernels are byte-exact with it).
///
/// # Panics
/// If `act_ty` is not an activation type.
pub fn quantize_act_scalar(act_ty: GgmlType, x: &[f32], dst: &mut [u8]) {
    assert!(act_ty.is_act_type(), "{act_ty} is not an activation type");
    scalar::quantize_scalar(act_ty, x, dst);
}

/// [`crate::quant::dequantize_row`] with the scalar reference code.
pub fn dequantize_row_scalar(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    check_row_size(ty, src.len(), dst.len())?;
    scalar::dequantize_scalar(ty, src, dst);
    Ok(())
}
