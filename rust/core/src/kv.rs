//! Paged KV cache (ARCHITECTURE.md, decision 4).
//!
//! Storage is a pool of fixed-size blocks of `block_size` token positions. One block id covers every layer (each
//! layer has its own K and V buffers for it), and each sequence owns a block table: position p of a sequence lives
//! in block `table[p / block_size]`, slot `p % block_size`. Several sequences share the pool; truncation (for
//! speculative rollback or prompt reuse) returns whole blocks to the free list at once.
//!
//! A K or V row is one token's heads, [n_head_kv * head_dim], stored in the cache type (F16, Q8_0 or Q4_0); a
//! head's slice of a row is addressable because head_dim is a multiple of the type's block size.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::quant::{quantize_row, GgmlType};

pub type SeqId = u32;

#[derive(Clone, Copy, Debug)]
pub struct KvConfig {
    pub n_layer: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    pub k_type: GgmlType,
    pub v_type: GgmlType,
    pub block_size: usize,
    /// Token positions one sequence may hold.
    pub n_ctx: usize,
    /// Blocks in the whole pool (all sequences together).
    pub max_blocks: usize,
}

/// The K and V bytes of one block, for every layer. Allocated on first use, kept for reuse after a free.
struct Block {
    k: Vec<Vec<u8>>,
    v: Vec<Vec<u8>>,
}

#[derive(Default, Clone)]
struct Sequence {
    blocks: Vec<u32>,
    len: usize,
}

pub struct KvCache {
    pub cfg: KvConfig,
    k_row_bytes: usize,
    v_row_bytes: usize,
    blocks: Vec<Block>,
    free: Vec<u32>,
    seqs: HashMap<SeqId, Sequence>,
}

impl KvCache {
    pub fn new(cfg: KvConfig) -> Result<KvCache> {
        for (what, ty, hd) in [("K", cfg.k_type, cfg.head_dim_k), ("V", cfg.v_type, cfg.head_dim_v)] {
            if !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Q8_0 | GgmlType::Q4_0) {
                return Err(Error::InvalidArgument(format!(
                    "{what} cache type {} is not supported (f32, f16, q8_0, q4_0 are)",
                    ty.name()
                )));
            }
            if hd % ty.block_size() != 0 {
                return Err(Error::InvalidArgument(format!(
                    "{what} cache type {} needs a head size divisible by {}, the model has {hd}",
                    ty.name(),
                    ty.block_size()
                )));
            }
        }
        if cfg.block_size == 0 || cfg.n_ctx == 0 || cfg.max_blocks == 0 {
            return Err(Error::InvalidArgument("KV cache sizes must be positive".into()));
        }
        Ok(KvCache {
            k_row_bytes: cfg.k_type.row_bytes(cfg.n_head_kv * cfg.head_dim_k)?,
            v_row_bytes: cfg.v_type.row_bytes(cfg.n_head_kv * cfg.head_dim_v)?,
            cfg,
            blocks: Vec::new(),
            free: Vec::new(),
            seqs: HashMap::new(),
        })
    }

    pub fn seq_len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.len)
    }

    pub fn blocks_in_use(&self) -> usize {
        self.blocks.len() - self.free.len()
    }

    /// Bytes currently held by allocated blocks (in use or free for reuse).
    pub fn allocated_bytes(&self) -> usize {
        self.blocks.len() * self.cfg.n_layer * self.cfg.block_size * (self.k_row_bytes + self.v_row_bytes)
    }

    /// Grow `seq` by `n` positions, allocating blocks as needed. Returns the first new position.
    /// Fails without changing anything if the sequence would pass n_ctx or the pool is exhausted.
    pub fn extend(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        let cur = self.seqs.get(&seq).cloned().unwrap_or_default();
        let new_len = cur.len + n;
        if new_len > self.cfg.n_ctx {
            return Err(Error::ContextOverflow(format!(
                "sequence {seq} would hold {new_len} tokens, more than the context size n_ctx={}",
                self.cfg.n_ctx
            )));
        }
        let need = new_len.div_ceil(self.cfg.block_size).saturating_sub(cur.blocks.len());
        let can_grow = self.cfg.max_blocks - self.blocks.len();
        if need > self.free.len() + can_grow {
            return Err(Error::ContextOverflow(format!(
                "KV cache is full: sequence {seq} needs {need} more blocks of {} tokens, {} are free",
                self.cfg.block_size,
                self.free.len() + can_grow
            )));
        }
        let mut table = cur.blocks;
        for _ in 0..need {
            let id = match self.free.pop() {
                Some(id) => id,
                None => {
                    let per_layer_k = self.cfg.block_size * self.k_row_bytes;
                    let per_layer_v = self.cfg.block_size * self.v_row_bytes;
                    self.blocks.push(Block {
                        k: (0..self.cfg.n_layer).map(|_| vec![0u8; per_layer_k]).collect(),
                        v: (0..self.cfg.n_layer).map(|_| vec![0u8; per_layer_v]).collect(),
                    });
                    (self.blocks.len() - 1) as u32
                }
            };
            table.push(id);
        }
        self.seqs.insert(seq, Sequence { blocks: table, len: new_len });
        Ok(cur.len)
    }

    /// Keep the first `len` positions of `seq` and free the blocks past them.
    pub fn truncate(&mut self, seq: SeqId, len: usize) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            if len < s.len {
                s.len = len;
                let keep = len.div_ceil(self.cfg.block_size);
                self.free.extend(s.blocks.drain(keep..));
            }
        }
    }

    /// Drop a sequence and free all its blocks.
    pub fn remove(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.remove(&seq) {
            self.free.extend(s.blocks);
        }
    }

    fn locate(&self, seq: SeqId, pos: usize) -> (usize, usize) {
        let s = &self.seqs[&seq];
        debug_assert!(pos < s.len);
        (s.blocks[pos / self.cfg.block_size] as usize, pos % self.cfg.block_size)
    }

    /// Store one token's K and V rows (f32, [n_head_kv * head_dim]) for `layer` at `pos` of `seq`.
    pub fn write(&mut self, layer: usize, seq: SeqId, pos: usize, k: &[f32], v: &[f32]) -> Result<()> {
        let (b, slot) = self.locate(seq, pos);
        let (kb, vb) = (self.k_row_bytes, self.v_row_bytes);
        let (k_type, v_type) = (self.cfg.k_type, self.cfg.v_type);
        let block = &mut self.blocks[b];
        quantize_row(k_type, k, &mut block.k[layer][slot * kb..(slot + 1) * kb])?;
        quantize_row(v_type, v, &mut block.v[layer][slot * vb..(slot + 1) * vb])?;
        Ok(())
    }

    /// The K and V bytes of `layer` in the `block_index`-th block of `seq`'s table. Rows are `k_row_bytes()` /
    /// `v_row_bytes()` long; slot i holds position `block_index * block_size + i` (valid below `seq_len`).
    pub fn block_view(&self, layer: usize, seq: SeqId, block_index: usize) -> (&[u8], &[u8]) {
        let s = &self.seqs[&seq];
        let b = &self.blocks[s.blocks[block_index] as usize];
        (&b.k[layer], &b.v[layer])
    }

    pub fn k_row_bytes(&self) -> usize {
        self.k_row_bytes
    }

    pub fn v_row_bytes(&self) -> usize {
        self.v_row_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(max_blocks: usize) -> KvCache {
        KvCache::new(KvConfig {
            n_layer: 2,
            n_head_kv: 1,
            head_dim_k: 32,
            head_dim_v: 32,
            k_type: GgmlType::F16,
            v_type: GgmlType::Q8_0,
            block_size: 4,
            n_ctx: 12,
            max_blocks,
        })
        .unwrap()
    }

    #[test]
    fn extends_truncates_and_reuses_blocks() {
        let mut kv = cache(5);
        assert_eq!(kv.extend(7, 6).unwrap(), 0);
        assert_eq!(kv.blocks_in_use(), 2);
        assert_eq!(kv.extend(7, 1).unwrap(), 6);
        kv.truncate(7, 3);
        assert_eq!((kv.seq_len(7), kv.blocks_in_use()), (3, 1));
        assert_eq!(kv.extend(8, 12).unwrap(), 0);
        assert_eq!(kv.blocks_in_use(), 4);
        kv.remove(8);
        kv.remove(7);
        assert_eq!(kv.blocks_in_use(), 0);
        assert_eq!(kv.blocks.len(), 4, "freed blocks are kept for reuse");
    }

    #[test]
    fn overflow_is_an_error_and_changes_nothing() {
        let mut kv = cache(3);
        kv.extend(1, 10).unwrap();
        let e = kv.extend(1, 3).unwrap_err().to_string();
        assert!(e.contains("n_ctx=12"), "{e}");
        let e = kv.extend(2, 4).unwrap_err().to_string();
        assert!(e.contains("KV cache is full"), "{e}");
        assert_eq!((kv.seq_len(1), kv.seq_len(2)), (10, 0));
    }

    #[test]
    fn writes_land_in_the_right_slot() {
        let mut kv = cache(3);
        kv.extend(0, 6).unwrap();
        let k: Vec<f32> = (0..32).map(|i| i as f32).collect();
        kv.write(1, 0, 5, &k, &k).unwrap();
        let (kb, _) = kv.block_view(1, 0, 1);
        let row = &kb[kv.k_row_bytes()..2 * kv.k_row_bytes()];
        assert_eq!(half::f16::from_le_bytes([row[6], row[7]]).to_f32(), 3.0);
    }
}
