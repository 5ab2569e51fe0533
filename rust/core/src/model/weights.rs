//! Weights resolved from a GGUF file against a ModelSpec: big matrices stay in the memory map (zero-copy), small
//! vectors (norms, biases) are dequantized to f32 once at load.

use std::ops::Range;
use std::sync::Arc;

use memmap2::Mmap;

use super::embedding::{Embedding, SplitRows};
use super::spec::ModelSpec;
use crate::error::{Error, Result};
use crate::gguf::{ggml_type_layout, GgufFile};
use crate::gsq;
use crate::quant::{dequantize_row, GgmlType};

/// A 2-D weight matrix in its GGML block format. Row r (n_cols elements) holds output feature r.
pub struct Matrix {
    pub name: String,
    /// The GGML block type; F32 for a GSQ-RCO matrix, whose products take f32 activations.
    pub ty: GgmlType,
    /// Some for a GSQ-RCO matrix (rows of group records instead of GGML blocks).
    pub gsq: Option<gsq::Layout>,
    pub n_cols: usize,
    pub n_rows: usize,
    row_bytes: usize,
    range: Range<usize>,
    map: Arc<Mmap>,
}

impl Matrix {
    #[inline]
    pub fn data(&self) -> &[u8] {
        &self.map[self.range.clone()]
    }

    #[inline]
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Pin this matrix's pages of the memory map in RAM (mlock): the CPU half of a split model reads them every
    /// token, and a page cache under memory pressure would otherwise read them from disk again and again.
    pub fn lock(&self) -> std::io::Result<()> {
        #[cfg(unix)]
        {
            // SAFETY: sysconf has no preconditions; mlock only pins pages of a range this mapping owns.
            let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
            let base = self.data().as_ptr() as usize;
            let start = base & !(page - 1);
            let len = base + self.data().len() - start;
            let r = unsafe { libc::mlock(start as *const libc::c_void, len) };
            if r != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    }

    /// Row r dequantized to f32 (embedding lookups).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<()> {
        let start = r * self.row_bytes;
        let row = &self.data()[start..start + self.row_bytes];
        match self.gsq {
            Some(layout) => gsq::dequantize_row(layout, row, out),
            None => dequantize_row(self.ty, row, out),
        }
    }
}

#[cfg(test)]
impl Matrix {
    /// A matrix over a copy of `bytes` (whole rows of `ty`, `n_cols` elements each), for kernel tests.
    pub(crate) fn from_bytes(ty: GgmlType, n_cols: usize, bytes: &[u8]) -> Matrix {
        let row_bytes = ty.row_bytes(n_cols).expect("whole blocks");
        let mut map = memmap2::MmapMut::map_anon(bytes.len().max(1)).expect("anonymous map");
        map[..bytes.len()].copy_from_slice(bytes);
        Matrix {
            name: format!("test {ty}"),
            ty,
            gsq: None,
            n_cols,
            n_rows: bytes.len() / row_bytes,
            row_bytes,
            range: 0..bytes.len(),
            map: Arc::new(map.make_read_only().expect("read-only map")),
        }
    }
}

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    pub wo: Matrix,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Matrix,
    pub w_up: Matrix,
    pub w_down: Matrix,
    pub post_ffn_norm: Option<Vec<f32>>,
}

impl Weights {
    /// mlock every matrix the layer loop and the output head read (not the token embedding: lookups are rare).
    pub fn lock(&self) -> std::io::Result<()> {
        for l in &self.layers {
            for m in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
                m.lock()?;
            }
        }
        self.output.lock()
    }
}

pub struct Weights {
    pub token_embd: Embedding,
    pub output_norm: Vec<f32>,
    pub output: Matrix,
    pub layers: Vec<LayerWeights>,
    pub n_ff: usize,
}

struct Loader<'a> {
    file: &'a GgufFile,
    gsq: &'a [(String, usize, usize)],
}

impl Loader<'_> {
    fn missing(&self, name: &str) -> Error {
        Error::BadModel(format!("{}: tensor {name} is missing", self.file.path.display()))
    }

    fn compute_type(&self, name: &str, type_id: u32) -> Result<GgmlType> {
        let ty = GgmlType::from_id(type_id).filter(|t| !matches!(t, GgmlType::Q8_1 | GgmlType::Q8_K));
        ty.ok_or_else(|| {
            let type_name = ggml_type_layout(type_id).map_or("unknown", |l| l.0);
            Error::UnsupportedType(format!(
                "{}: tensor {name} has type {type_name} (id {type_id}), which ninfer cannot compute with yet",
                self.file.path.display()
            ))
        })
    }

    /// A GSQ-RCO matrix: its I8 records must be exactly [rows, layout.row_bytes(n_cols)].
    fn gsq_matrix(&self, name: &str, n_cols: usize, n_rows: Option<usize>, bits: usize, slots: usize) -> Result<Matrix> {
        let info = self.file.tensor(name).ok_or_else(|| self.missing(name))?;
        let path = self.file.path.display();
        let layout = gsq::Layout::new(bits, slots).map_err(|e| Error::BadModel(format!("{path}: tensor {name}: {e}")))?;
        let row_bytes = layout.row_bytes(n_cols).map_err(|e| Error::BadModel(format!("{path}: tensor {name}: {e}")))?;
        let rows = info.dims[1..].iter().product::<u64>() as usize;
        if info.type_id != 24 || info.dims[0] as usize != row_bytes || n_rows.is_some_and(|r| r != rows) {
            return Err(Error::BadModel(format!(
                "{path}: GSQ-RCO tensor {name} is stored as type {} with shape {:?}, expected I8 [{row_bytes}, {}]",
                info.type_id,
                info.dims,
                n_rows.map_or("?".to_string(), |r| r.to_string())
            )));
        }
        let start = info.offset as usize;
        Ok(Matrix {
            name: name.to_string(),
            ty: GgmlType::F32,
            gsq: Some(layout),
            n_cols,
            n_rows: rows,
            row_bytes,
            range: start..start + info.n_bytes as usize,
            map: self.file.map(),
        })
    }

    /// A [n_rows, n_cols] matrix with the expected shape.
    fn matrix(&self, name: &str, n_cols: usize, n_rows: Option<usize>) -> Result<Matrix> {
        if let Some((_, bits, slots)) = self.gsq.iter().find(|g| g.0 == name) {
            return self.gsq_matrix(name, n_cols, n_rows, *bits, *slots);
        }
        let info = self.file.tensor(name).ok_or_else(|| self.missing(name))?;
        let ty = self.compute_type(name, info.type_id)?;
        let cols = info.dims[0] as usize;
        let rows = info.dims[1..].iter().product::<u64>() as usize;
        if cols != n_cols || n_rows.is_some_and(|r| r != rows) {
            return Err(Error::BadModel(format!(
                "{}: tensor {name} has shape {:?}, expected [{n_cols}, {}]",
                self.file.path.display(),
                info.dims,
                n_rows.map_or("?".to_string(), |r| r.to_string())
            )));
        }
        let row_bytes = ty.row_bytes(cols)?;
        let start = info.offset as usize;
        Ok(Matrix {
            name: name.to_string(),
            ty,
            gsq: None,
            n_cols: cols,
            n_rows: rows,
            row_bytes,
            range: start..start + info.n_bytes as usize,
            map: self.file.map(),
        })
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let info = self.file.tensor(name).ok_or_else(|| self.missing(name))?;
        let ty = self.compute_type(name, info.type_id)?;
        if info.n_elements() != len as u64 {
            return Err(Error::BadModel(format!(
                "{}: tensor {name} has {} elements, expected {len}",
                self.file.path.display(),
                info.n_elements()
            )));
        }
        let mut out = vec![0.0f32; len];
        dequantize_row(ty, self.file.tensor_data(info), &mut out)?;
        Ok(out)
    }

    fn opt_vector(&self, name: &Option<String>, len: usize) -> Result<Option<Vec<f32>>> {
        name.as_ref().map(|n| self.vector(n, len)).transpose()
    }
}

impl Weights {
    pub fn load(file: &GgufFile, spec: &ModelSpec) -> Result<Weights> {
        let ld = Loader { file, gsq: &spec.gsq };
        let e = spec.n_embd;
        let q_dim = spec.n_head * spec.head_dim;
        let k_dim = spec.n_head_kv * spec.head_dim;
        let v_dim = spec.n_head_kv * spec.head_dim_v;
        let token_embd = match spec.embd_split {
            Some(layout) => Embedding::Split(SplitRows::load(file, &spec.token_embd, layout, e, spec.n_vocab)?),
            None => Embedding::Matrix(ld.matrix(&spec.token_embd, e, Some(spec.n_vocab))?),
        };
        if spec.embd_split.is_some() && spec.output == spec.token_embd {
            return Err(Error::BadModel(format!(
                "{}: the token embedding {} is split by rows, so it cannot be the output head too",
                file.path.display(),
                spec.token_embd
            )));
        }
        let output = ld.matrix(&spec.output, e, Some(spec.n_vocab))?;
        // No layers is allowed: the CPU half of a split model can hold just the output head.
        let n_ff = match spec.layers.first() {
            Some(l) => ld.matrix(&l.w_gate, e, None)?.n_rows,
            None => 0,
        };
        let mut layers = Vec::with_capacity(spec.layers.len());
        for l in &spec.layers {
            layers.push(LayerWeights {
                attn_norm: ld.vector(&l.attn_norm, e)?,
                wq: ld.matrix(&l.wq, e, Some(q_dim))?,
                wk: ld.matrix(&l.wk, e, Some(k_dim))?,
                wv: ld.matrix(&l.wv, e, Some(v_dim))?,
                wo: ld.matrix(&l.wo, spec.n_head * spec.head_dim_v, Some(e))?,
                bq: ld.opt_vector(&l.bq, q_dim)?,
                bk: ld.opt_vector(&l.bk, k_dim)?,
                bv: ld.opt_vector(&l.bv, v_dim)?,
                q_norm: ld.opt_vector(&l.q_norm, spec.head_dim)?,
                k_norm: ld.opt_vector(&l.k_norm, spec.head_dim)?,
                post_attn_norm: ld.opt_vector(&l.post_attn_norm, e)?,
                ffn_norm: ld.vector(&l.ffn_norm, e)?,
                w_gate: ld.matrix(&l.w_gate, e, Some(n_ff))?,
                w_up: ld.matrix(&l.w_up, e, Some(n_ff))?,
                w_down: ld.matrix(&l.w_down, n_ff, Some(e))?,
                post_ffn_norm: ld.opt_vector(&l.post_ffn_norm, e)?,
            });
        }
        if spec.rope_dims > spec.head_dim || !spec.rope_dims.is_multiple_of(2) {
            return Err(Error::BadModel(format!(
                "rope dimension {} must be even and at most the head size {}",
                spec.rope_dims, spec.head_dim
            )));
        }
        if spec.n_head_kv == 0 || !spec.n_head.is_multiple_of(spec.n_head_kv) {
            return Err(Error::BadModel(format!(
                "{} attention heads cannot be shared by {} KV heads",
                spec.n_head, spec.n_head_kv
            )));
        }
        Ok(Weights { token_embd, output_norm: ld.vector(&spec.output_norm, e)?, output, layers, n_ff })
    }
}
