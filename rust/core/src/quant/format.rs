//! The GGML block formats as data: the type table ([`GgmlType`]), block sizes in elements and bytes, and the
//! block layouts the SIMD kernels read ([`BlockFormat`]; the field tables are in the `legacy` and `kquants`
//! module docs). The bottom of `quant` with `math`: it imports nothing of the crate but `error`, and everything
//! else in `quant` (scalar reference code, SIMD kernels, entry points) builds on it.

use crate::error::{Error, Result};

/// Elements in a K-quant super-block.
pub const QK_K: usize = 256;
/// Bytes of the packed 6-bit scales and mins of Q4_K and Q5_K (and of the 6-bit scales of Q3_K).
pub const K_SCALE_SIZE: usize = 12;
/// Elements in a block of the legacy formats (Q4_0 .. Q8_1).
pub const QK_LEGACY: usize = 32;

// Bytes of a block of the legacy formats (`legacy`'s table).
pub(super) const Q4_0_BYTES: usize = 2 + QK_LEGACY / 2;
pub(super) const Q4_1_BYTES: usize = 4 + QK_LEGACY / 2;
pub(super) const Q5_0_BYTES: usize = 2 + 4 + QK_LEGACY / 2;
pub(super) const Q5_1_BYTES: usize = 4 + 4 + QK_LEGACY / 2;
pub(super) const Q8_0_BYTES: usize = 2 + QK_LEGACY;
pub(super) const Q8_1_BYTES: usize = 4 + QK_LEGACY;

// Bytes of a K-quant super-block (`kquants`' table).
pub(super) const Q2_K_BYTES: usize = QK_K / 16 + QK_K / 4 + 2 + 2;
pub(super) const Q3_K_BYTES: usize = QK_K / 8 + QK_K / 4 + 12 + 2;
pub(super) const Q4_K_BYTES: usize = 2 + 2 + K_SCALE_SIZE + QK_K / 2;
pub(super) const Q5_K_BYTES: usize = 2 + 2 + K_SCALE_SIZE + QK_K / 8 + QK_K / 2;
pub(super) const Q6_K_BYTES: usize = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;
pub(super) const Q8_K_BYTES: usize = 4 + QK_K + 2 * (QK_K / 16);

/// A GGML tensor element type the engine knows. The discriminants are GGML's type ids (`enum ggml_type`).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    BF16 = 30,
}

impl GgmlType {
    /// Every type of the table, in id order.
    pub const ALL: [GgmlType; 15] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::BF16,
    ];

    /// The type with GGML id `id`, or `None` for ids this engine does not know (including GGML's removed
    /// Q4_2/Q4_3 ids 4 and 5 and the IQ formats).
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|t| t.id() == id)
    }

    /// GGML's id of the type (the value stored in GGUF tensor infos).
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The type's name as GGML spells it (`ggml_type_name`).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q8_1 => "Q8_1",
            GgmlType::Q2_K => "Q2_K",
            GgmlType::Q3_K => "Q3_K",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
            GgmlType::Q8_K => "Q8_K",
            GgmlType::BF16 => "BF16",
        }
    }

    /// Elements per block (1 for the plain float types).
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 | GgmlType::Q8_1 => {
                QK_LEGACY
            }
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K | GgmlType::Q8_K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => Q4_0_BYTES,
            GgmlType::Q4_1 => Q4_1_BYTES,
            GgmlType::Q5_0 => Q5_0_BYTES,
            GgmlType::Q5_1 => Q5_1_BYTES,
            GgmlType::Q8_0 => Q8_0_BYTES,
            GgmlType::Q8_1 => Q8_1_BYTES,
            GgmlType::Q2_K => Q2_K_BYTES,
            GgmlType::Q3_K => Q3_K_BYTES,
            GgmlType::Q4_K => Q4_K_BYTES,
            GgmlType::Q5_K => Q5_K_BYTES,
            GgmlType::Q6_K => Q6_K_BYTES,
            GgmlType::Q8_K => Q8_K_BYTES,
        }
    }

    /// Bytes of a row of `n` elements; `Error::BadModel` if `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Result<usize> {
        let bs = self.block_size();
        if !n.is_multiple_of(bs) {
            return Err(Error::BadModel(format!(
                "a row of {n} elements is not a whole number of {} blocks ({bs} elements each)",
                self.name()
            )));
        }
        (n / bs)
            .checked_mul(self.type_size())
            .ok_or_else(|| Error::BadModel(format!("a {} row of {n} elements is too large to address", self.name())))
    }

    /// The type activations are quantized to before a dot product with weights of this type: llama.cpp CPU
    /// backend's `vec_dot_type`. Q8_1 and Q8_K pair with themselves.
    pub fn act_type(self) -> GgmlType {
        match self {
            GgmlType::F32 => GgmlType::F32,
            GgmlType::F16 => GgmlType::F16,
            GgmlType::BF16 => GgmlType::BF16,
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => GgmlType::Q8_0,
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q8_1 => GgmlType::Q8_1,
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K | GgmlType::Q8_K => {
                GgmlType::Q8_K
            }
        }
    }

    /// Whether `quantize_act` accepts this type (it is some type's `act_type`).
    pub fn is_act_type(self) -> bool {
        matches!(
            self,
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0 | GgmlType::Q8_1 | GgmlType::Q8_K
        )
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `Error::BadModel` unless `src_len` bytes are exactly one row of `n` elements of type `ty`.
pub(crate) fn check_row_size(ty: GgmlType, src_len: usize, n: usize) -> Result<()> {
    let expected = ty.row_bytes(n)?;
    if src_len != expected {
        return Err(Error::BadModel(format!("a {ty} row of {n} elements takes {expected} bytes, got {src_len}")));
    }
    Ok(())
}

/// How a 32-element weight format and its activation format (Q8_0 or Q8_1) lay out a block: what every SIMD
/// kernel set reads blocks by (`simd::x86_avx2::legacy`, `simd::aarch64_neon`). Implemented by the marker
/// types below, one per format.
pub(super) trait BlockFormat {
    /// Bytes of a weight block.
    const WB: usize;
    /// Bytes of an activation block.
    const AB: usize;
    /// Offset of the 32 int8 quants in an activation block.
    const A_QS: usize;
    /// Weight codes are signed (-16..=15, -8..=7, int8) rather than 0..=31. (The NEON kernels widen every code to
    /// a signed byte, so only the x86 ones ask.)
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    const SIGNED: bool;
    /// The weight block has a min `m` (f16 at byte 2) and the activation block its sum `s` (f16 at byte 2).
    const MIN: bool;
}

pub(super) struct Q4_0;
pub(super) struct Q4_1;
pub(super) struct Q5_0;
pub(super) struct Q5_1;
pub(super) struct Q8_0;
pub(super) struct Q8_1;

macro_rules! block_format {
    ($ty:ident, $wb:expr, $ab:expr, $a_qs:expr, signed: $signed:expr, min: $min:expr) => {
        impl BlockFormat for $ty {
            const WB: usize = $wb;
            const AB: usize = $ab;
            const A_QS: usize = $a_qs;
            const SIGNED: bool = $signed;
            const MIN: bool = $min;
        }
    };
}

block_format!(Q4_0, Q4_0_BYTES, Q8_0_BYTES, 2, signed: true, min: false);
block_format!(Q4_1, Q4_1_BYTES, Q8_1_BYTES, 4, signed: false, min: true);
block_format!(Q5_0, Q5_0_BYTES, Q8_0_BYTES, 2, signed: true, min: false);
block_format!(Q5_1, Q5_1_BYTES, Q8_1_BYTES, 4, signed: false, min: true);
block_format!(Q8_0, Q8_0_BYTES, Q8_0_BYTES, 2, signed: true, min: false);
block_format!(Q8_1, Q8_1_BYTES, Q8_1_BYTES, 4, signed: true, min: false);
