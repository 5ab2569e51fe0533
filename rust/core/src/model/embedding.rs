//! The token embedding: a matrix, or (a GSQ-RCO size preset's choice for an untied embedding) its rows split by how
//! often text looks them up. The hot rows keep the source's type and the others take a smaller one, so the bytes go
//! where lookups are (docs/journal/gsq-rco-trials.md "Hot embedding rows").
//!
//! A split embedding is one I8 tensor: the hot token ids (u32 little-endian, strictly increasing), then the hot rows
//! in that order, then every other token's row in token order.

use std::sync::Arc;

use memmap2::Mmap;

use super::weights::Matrix;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::quant::{dequantize_row, GgmlType};

/// The layout of a split embedding as the file's metadata declares it: (hot rows' type id, hot rows, other rows'
/// type id).
pub type SplitLayout = (u32, usize, u32);

pub enum Embedding {
    Matrix(Matrix),
    Split(SplitRows),
}

pub struct SplitRows {
    hot_ty: GgmlType,
    cold_ty: GgmlType,
    n_cols: usize,
    /// Per token: its row among the hot rows (HOT set) or among the others.
    slot: Vec<u32>,
    hot_start: usize,
    cold_start: usize,
    map: Arc<Mmap>,
}

const HOT: u32 = 1 << 31;

impl Embedding {
    /// Token `t`'s row as f32 (`out`: n_embd values).
    pub fn dequantize_row(&self, t: usize, out: &mut [f32]) -> Result<()> {
        match self {
            Embedding::Matrix(m) => m.dequantize_row(t, out),
            Embedding::Split(s) => s.dequantize_row(t, out),
        }
    }
}

impl SplitRows {
    /// The split embedding stored as tensor `name` of `file`, with `n_vocab` rows of `n_cols`; every way the tensor
    /// can disagree with the layout (its bytes, the ids' order and range) is a BadModel error naming it.
    pub fn load(file: &GgufFile, name: &str, layout: SplitLayout, n_cols: usize, n_vocab: usize) -> Result<SplitRows> {
        let path = file.path.display();
        let bad = |what: String| Error::BadModel(format!("{path}: split embedding {name}: {what}"));
        let info = file.tensor(name).ok_or_else(|| Error::BadModel(format!("{path}: tensor {name} is missing")))?;
        let (hot_id, n_hot, cold_id) = layout;
        let ty = |id: u32| {
            GgmlType::from_id(id)
                .filter(|t| !matches!(t, GgmlType::Q8_1 | GgmlType::Q8_K))
                .ok_or_else(|| bad(format!("row type id {id} is not one ninfer computes with")))
        };
        let (hot_ty, cold_ty) = (ty(hot_id)?, ty(cold_id)?);
        if n_hot > n_vocab {
            return Err(bad(format!("{n_hot} hot rows in a vocabulary of {n_vocab}")));
        }
        let (hot_rb, cold_rb) = (hot_ty.row_bytes(n_cols)?, cold_ty.row_bytes(n_cols)?);
        let want = 4 * n_hot + n_hot * hot_rb + (n_vocab - n_hot) * cold_rb;
        if info.type_id != 24 || info.n_bytes as usize != want {
            return Err(bad(format!(
                "stored as type {} with {} bytes, expected I8 with {want} ({n_hot} ids and rows of {}, {} rows of {})",
                info.type_id,
                info.n_bytes,
                hot_ty.name(),
                n_vocab - n_hot,
                cold_ty.name()
            )));
        }
        let data = file.tensor_data(info);
        let mut slot = vec![u32::MAX; n_vocab];
        let mut prev: Option<usize> = None;
        for (i, b) in data[..4 * n_hot].chunks_exact(4).enumerate() {
            let id = u32::from_le_bytes(b.try_into().unwrap()) as usize;
            if id >= n_vocab || prev.is_some_and(|p| id <= p) {
                return Err(bad(format!("hot id {id} (entry {i}) is out of range or out of order")));
            }
            slot[id] = HOT | i as u32;
            prev = Some(id);
        }
        let mut cold = 0u32;
        for s in slot.iter_mut().filter(|s| **s == u32::MAX) {
            *s = cold;
            cold += 1;
        }
        let start = info.offset as usize;
        Ok(SplitRows {
            hot_ty,
            cold_ty,
            n_cols,
            slot,
            hot_start: start + 4 * n_hot,
            cold_start: start + 4 * n_hot + n_hot * hot_rb,
            map: file.map(),
        })
    }

    fn dequantize_row(&self, t: usize, out: &mut [f32]) -> Result<()> {
        let s = *self.slot.get(t).ok_or_else(|| {
            Error::InvalidArgument(format!("token id {t} is out of range for a vocabulary of {}", self.slot.len()))
        })?;
        let (ty, start) = if s & HOT != 0 { (self.hot_ty, self.hot_start) } else { (self.cold_ty, self.cold_start) };
        let rb = ty.row_bytes(self.n_cols)?;
        let at = start + (s & !HOT) as usize * rb;
        dequantize_row(ty, &self.map[at..at + rb], out)
    }
}
