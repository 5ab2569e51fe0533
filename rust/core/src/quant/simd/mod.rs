//! Run-time selected SIMD kernels behind the public entry points of [`crate::quant`].
//!
//! The scalar code of `float.rs`, `legacy.rs` and `kquants.rs` stays the reference and the fallback. At the
//! first call, [`kernels`] inspects the CPU once (`is_x86_feature_detected!`) and builds a [`Kernels`] table:
//! optional function pointers per GGML type for the dot products, activation quantization and
//! `dequantize_row`. A missing entry means "use the scalar code". The entry points in `quant/mod.rs` look the
//! table up (one atomic load once initialised) and fall back to the scalar match.
//!
//! Kernel sets, chosen from the CPU's features the way llama.cpp built with `-march=native` chooses its code
//! paths on the same CPU (its results are what the parity tests compare against):
//! - `avx512` / `avx512fp16` (`x86_avx512`): CPUs with AVX-512 F, BW, DQ, VL and VNNI; the `avx2` set with
//!   VNNI int8 products and the kernels whose float order or rounding llama.cpp's AVX-512 build changes (the
//!   second name where the CPU also has AVX512-FP16, which changes the f16 attention accumulation);
//! - `avx2`: x86-64 AVX2 + FMA + F16C (`x86_avx2`), with the integer layout and float summation order of
//!   llama.cpp's own AVX2 kernels, so results are bit-identical to llama.cpp running on the same machine
//!   (checked against its `libggml-cpu.so`); activation quantization is byte-exact with the scalar code.
//! - `neon` (aarch64, `aarch64_neon`): the 32-element block formats' dot products, exact integer parts, float
//!   sums in their own order (not llama.cpp's); the K-quants' int8 products under the scalar unpacking; GSQ-RCO
//!   rows with the scalar reference's bits; everything else scalar there.
//!
//! llama.cpp does not sum every dot product of a matmul the same way: on AVX2 it repacks Q4_0 / Q4_K matrices
//! and runs GEMV/GEMM kernels on them, and runs a "tiled" kernel for K-quant matmuls with 8 or more activation
//! rows. [`vec_dot_matmul`] picks the matching kernel from the position of the dot product in its matmul;
//! [`crate::quant::vec_dot`] is the single-activation-row (decode) case.
//!
//! Environment (read once, at the first quant call; [`check_cpu_env`] reports a bad value at model load):
//! - `NINFER_CPU=avx512|avx2|scalar` forces a kernel set (one this CPU has), to compare paths or debug
//!   numeric differences: `avx2` is what an AVX2-only host runs, `scalar` the reference code;
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
#[cfg(target_arch = "x86_64")]
mod x86_avx512;

mod table;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tile_tests;
#[cfg(test)]
mod vecops_tests;
pub mod vecops;

pub use table::MatmulPos;
pub use vecops::VecOps;

use table::{env, Kernels, TileFn};

static KERNELS: OnceLock<Kernels> = OnceLock::new();

/// The kernel set of this CPU, detected on the first call.
#[inline]
pub(super) fn kernels() -> &'static Kernels {
    KERNELS.get_or_init(detect)
}

/// A kernel set `NINFER_CPU` can ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CpuPath {
    Avx512,
    Avx2,
    Scalar,
}

/// The path `NINFER_CPU` forces (`None`: the best this CPU has), or the message for a value that names none.
fn forced_path() -> std::result::Result<Option<CpuPath>, String> {
    match env("NINFER_CPU").as_deref() {
        None | Some("" | "auto") => Ok(None),
        Some("avx512") => Ok(Some(CpuPath::Avx512)),
        Some("avx2") => Ok(Some(CpuPath::Avx2)),
        Some("scalar") => Ok(Some(CpuPath::Scalar)),
        Some(v) => Err(format!("NINFER_CPU={v:?} names no CPU path: use avx512, avx2 or scalar, or leave it unset")),
    }
}

/// Whether this CPU can run `path`.
fn cpu_has(path: CpuPath) -> bool {
    match path {
        CpuPath::Scalar => true,
        #[cfg(target_arch = "x86_64")]
        CpuPath::Avx512 => x86_avx512::available(),
        #[cfg(target_arch = "x86_64")]
        CpuPath::Avx2 => {
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        CpuPath::Avx512 | CpuPath::Avx2 => false,
    }
}

/// `Err` naming the problem when `NINFER_CPU` is set to something other than a path this CPU has; the model
/// loaders call it so that a typo is an error at load rather than a silent fallback.
pub fn check_cpu_env() -> Result<()> {
    let path = forced_path().map_err(crate::error::Error::InvalidArgument)?;
    match path {
        Some(p) if !cpu_has(p) => Err(crate::error::Error::InvalidArgument(format!(
            "NINFER_CPU={} but this CPU lacks it ({})",
            format!("{p:?}").to_ascii_lowercase(),
            match p {
                CpuPath::Avx512 => "needs AVX-512 F, BW, DQ, VL and VNNI plus AVX2, FMA and F16C",
                _ => "needs AVX2, FMA and F16C",
            }
        ))),
        _ => Ok(()),
    }
}

/// The path to run: the forced one if this CPU has it, else the best it has (a bad `NINFER_CPU` is reported by
/// [`check_cpu_env`]).
fn chosen_path() -> Option<CpuPath> {
    forced_path().ok().flatten().filter(|&p| cpu_has(p))
}

fn detect() -> Kernels {
    let forced = chosen_path();
    if forced == Some(CpuPath::Scalar) {
        return Kernels::SCALAR;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let orders = table::Orders::from_env();
        if forced.is_none_or(|p| p == CpuPath::Avx512) {
            if let Some(k) = x86_avx512::detect(orders) {
                return k;
            }
        }
        if let Some(k) = x86_avx2::detect(orders, false) {
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

/// The element-wise primitives of the kernel set [`kernels`] runs, detected on the first call.
pub fn vec_ops() -> &'static VecOps {
    static OPS: OnceLock<&'static VecOps> = OnceLock::new();
    OPS.get_or_init(|| {
        let forced = chosen_path();
        if forced == Some(CpuPath::Scalar) {
            return &VecOps::SCALAR;
        }
        #[cfg(target_arch = "x86_64")]
        {
            if forced.is_none_or(|p| p == CpuPath::Avx512) {
                if let Some(ops) = x86_avx512::detect_vec_ops() {
                    return ops;
                }
            }
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
    shape: Option<(usize, usize)>,
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

    /// The tile (weight rows, activation rows) this kernel is fastest at per call, if it differs from what suits
    /// the others (a few rows by a few activation rows): a kernel that repacks its weight rows at each call wants
    /// many activation rows to share that work.
    #[inline]
    pub fn shape(&self) -> Option<(usize, usize)> {
        self.shape
    }
}

/// The tile kernel for the dot products of a matmul of type `ty` whose first product is at `pos`; every product
/// of a tile must share the kernel choice of `pos` (same matmul, activation rows on the same side of
/// llama.cpp's GEMM/GEMV split at `act_rows - act_rows % 4`). Each product of a tile equals
/// [`vec_dot_matmul`] at its position, bit for bit. `None` when this kernel set has none (then call
/// [`vec_dot_matmul`] per product).
pub fn tile_kernel(ty: GgmlType, pos: MatmulPos) -> Option<TileKernel> {
    let k = kernels();
    k.vec_dot_tile_at(ty, pos).map(|f| TileKernel { f, block_size: ty.block_size(), shape: k.tile_shape_at(ty, pos) })
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

/// Name of the kernel set the quant entry points use on this machine: `"avx512fp16"`, `"avx512"`, `"avx2"`,
/// `"neon"` or `"scalar"`.
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
