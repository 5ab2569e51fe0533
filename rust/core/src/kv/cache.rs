//! The CPU's KV storage: the K and V bytes of every block, for every layer. The books (which blocks each sequence
//! holds, the free list, sharing) are a `BlockManager`; this file executes its copies and reads and writes rows.
//!
//! A K or V row is one token's heads, [n_head_kv * head_dim], stored in the cache type (F32, F16, Q8_0 or Q4_0); a
//! head's slice of a row is addressable because head_dim is a multiple of the type's block size. Rows of a
//! quantized type (q8_0, q4_0) are stored Hadamard-rotated per head (`rotation`); attention rotates the query and
//! its output to match (`rotates_k`, `rotates_v`).

use crate::error::{Error, Result};
use crate::kv::blocks::{BlockCopy, BlockHome, BlockManager, Placement, Precision, SeqId};
use crate::kv::{fitted_q4, rotation};
use crate::quant::{quantize_row, GgmlType};

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

/// The K and V bytes of one block: k[layer] is [block_size * k_row_bytes], v[layer] [block_size * v_row_bytes].
/// Allocated when the books first hand out its id, kept for reuse after a free.
struct Block {
    k: Vec<Vec<u8>>,
    v: Vec<Vec<u8>>,
    /// A rotated K cache: k_offset[layer] [n_head_kv * head_dim_k] was subtracted from every key stored in the
    /// block (set when its first slot is written). Empty when K is not rotated.
    k_offset: Vec<Vec<f32>>,
}

/// Rows of one block written at once from which their mean becomes the block's K offset (fewer say too little
/// about the mean).
const OFFSET_MIN_ROWS: usize = 16;

pub struct KvCache {
    pub cfg: KvConfig,
    k_row_bytes: usize,
    v_row_bytes: usize,
    books: BlockManager,
    /// [books.blocks_created()]: storage of block id i at index i.
    blocks: Vec<Block>,
    /// Whether K / V rows are stored Hadamard-rotated (quantized types).
    rotate_k: bool,
    rotate_v: bool,
    /// A rotated K cache, per layer: the mean rotated key of the latest block written with at least
    /// OFFSET_MIN_ROWS rows at once, given to blocks begun with fewer; each block's own offset is subtracted from
    /// its keys before they are quantized. Keys share a large common component per channel;
    /// without it the 4-bit steps are much finer. Attention adds q·offset back per block, so scores are unchanged.
    k_offsets: Vec<Option<Vec<f32>>>,
}

/// The mean of `rows` ([n, k_dim]), leaving out the first if `skip_first` (position 0: a BOS or sink key, often
/// far from the rest).
fn mean_row(rows: &[f32], k_dim: usize, skip_first: bool) -> Vec<f32> {
    let mut sum = vec![0.0f64; k_dim];
    let used = &rows[if skip_first { k_dim } else { 0 }..];
    for r in used.chunks_exact(k_dim) {
        sum.iter_mut().zip(r).for_each(|(s, &x)| *s += x as f64);
    }
    let n = (used.len() / k_dim).max(1) as f64;
    sum.iter().map(|&s| (s / n) as f32).collect()
}

/// Set the offset of a block begun by a write: with `run` = (first row, rows, whether the first is position 0) of
/// the written `rows` ([n, dim]) in the block, their mean, which also becomes the layer's `latest`; else `latest`
/// (zeros before there is one). No-op for a side stored without offsets (`offset` empty).
fn begin_offset(
    latest: &mut Option<Vec<f32>>,
    offset: &mut [f32],
    rows: &[f32],
    dim: usize,
    run: Option<(usize, usize, bool)>,
) {
    if offset.is_empty() {
        return;
    }
    if let Some((t, n, first_is_bos)) = run {
        *latest = Some(mean_row(&rows[t * dim..(t + n) * dim], dim, first_is_bos));
    }
    match latest {
        Some(o) => offset.copy_from_slice(o),
        None => offset.fill(0.0),
    }
}

/// Quantize a row into the cache: q4_0 with fitted scales (`fitted_q4`), other types as `quantize_row`.
fn store_row(ty: GgmlType, x: &[f32], dst: &mut [u8]) -> Result<()> {
    if ty == GgmlType::Q4_0 && dst.len() == ty.row_bytes(x.len())? {
        fitted_q4::quantize_q4_0_fitted(x, dst);
        return Ok(());
    }
    quantize_row(ty, x, dst)
}

/// Whether rows of `ty` are stored rotated: the quantized types, whose shared block scales outliers would set.
fn rotated(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0)
}

fn precision(ty: GgmlType) -> Option<Precision> {
    Some(match ty {
        GgmlType::F32 => Precision::F32,
        GgmlType::F16 => Precision::F16,
        GgmlType::Q8_0 => Precision::Q8_0,
        GgmlType::Q4_0 => Precision::Q4_0,
        _ => return None,
    })
}

impl KvCache {
    pub fn new(cfg: KvConfig) -> Result<KvCache> {
        let mut home = BlockHome { placement: Placement::Host, k: Precision::F16, v: Precision::F16 };
        for (what, ty, hd, slot) in
            [("K", cfg.k_type, cfg.head_dim_k, &mut home.k), ("V", cfg.v_type, cfg.head_dim_v, &mut home.v)]
        {
            *slot = precision(ty).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{what} cache type {} is not supported (f32, f16, q8_0, q4_0 are)",
                    ty.name()
                ))
            })?;
            if hd % ty.block_size() != 0 {
                return Err(Error::InvalidArgument(format!(
                    "{what} cache type {} needs a head size divisible by {}, the model has {hd}",
                    ty.name(),
                    ty.block_size()
                )));
            }
        }
        Ok(KvCache {
            books: BlockManager::new(cfg.block_size, cfg.max_blocks, cfg.n_ctx)?.with_home(home),
            k_row_bytes: cfg.k_type.row_bytes(cfg.n_head_kv * cfg.head_dim_k)?,
            v_row_bytes: cfg.v_type.row_bytes(cfg.n_head_kv * cfg.head_dim_v)?,
            rotate_k: rotated(cfg.k_type),
            rotate_v: rotated(cfg.v_type),
            k_offsets: vec![None; cfg.n_layer],
            cfg,
            blocks: Vec::new(),
        })
    }

    /// The books: tables, reference counts, free blocks.
    pub fn books(&self) -> &BlockManager {
        &self.books
    }

    pub fn seq_len(&self, seq: SeqId) -> usize {
        self.books.seq_len(seq)
    }

    /// Blocks held by sequences; a block shared by several counts once.
    pub fn blocks_in_use(&self) -> usize {
        self.books.blocks_in_use()
    }

    /// Bytes currently held by allocated blocks (in use or free for reuse).
    pub fn allocated_bytes(&self) -> usize {
        self.blocks.len() * self.cfg.n_layer * self.cfg.block_size * (self.k_row_bytes + self.v_row_bytes)
    }

    /// Whether `seq` can grow by `n` positions (the error `extend` would give, nothing changed).
    pub fn check_extend(&self, seq: SeqId, n: usize) -> Result<()> {
        self.books.check_extend(seq, n)
    }

    /// Grow `seq` by `n` positions, allocating blocks as needed. Returns the first new position.
    /// Fails without changing anything if the sequence would pass n_ctx or the pool is exhausted.
    pub fn extend(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        let start = self.books.extend(seq, n)?;
        self.grow_storage();
        Ok(start)
    }

    /// Keep the first `len` positions of `seq` and free the blocks past them. Fails (changing nothing) only when
    /// the new last block is partial and shared with another sequence and no block is free for `seq`'s own copy.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let copies = self.books.truncate(seq, len)?;
        self.run(&copies);
        Ok(())
    }

    /// Drop a sequence and free all its blocks.
    pub fn remove(&mut self, seq: SeqId) {
        self.books.remove(seq)
    }

    /// Make `dst` (replacing what it held) a sequence of the first `len` positions of `src`, sharing its whole
    /// blocks and copying a partial last one: a prompt prefix computed once serves several sequences.
    pub fn fork(&mut self, src: SeqId, dst: SeqId, len: usize) -> Result<()> {
        let copies = self.books.fork(src, dst, len)?;
        self.run(&copies);
        Ok(())
    }

    /// Storage for the ids the books handed out since the last call.
    fn grow_storage(&mut self) {
        let per_layer_k = self.cfg.block_size * self.k_row_bytes;
        let per_layer_v = self.cfg.block_size * self.v_row_bytes;
        let k_offset_len = if self.rotate_k { self.cfg.n_head_kv * self.cfg.head_dim_k } else { 0 };
        while self.blocks.len() < self.books.blocks_created() {
            self.blocks.push(Block {
                k: (0..self.cfg.n_layer).map(|_| vec![0u8; per_layer_k]).collect(),
                v: (0..self.cfg.n_layer).map(|_| vec![0u8; per_layer_v]).collect(),
                k_offset: (0..self.cfg.n_layer).map(|_| vec![0.0f32; k_offset_len]).collect(),
            });
        }
    }

    /// Execute the books' copies: the first n_positions rows of K and V, in every layer.
    fn run(&mut self, copies: &[BlockCopy]) {
        self.grow_storage();
        let (kb, vb) = (self.k_row_bytes, self.v_row_bytes);
        for c in copies {
            let (src, dst) = (c.src as usize, c.dst as usize);
            debug_assert_ne!(src, dst);
            // Two distinct blocks of one Vec, borrowed together.
            let (src, dst) = if src < dst {
                let (a, b) = self.blocks.split_at_mut(dst);
                (&a[src], &mut b[0])
            } else {
                let (a, b) = self.blocks.split_at_mut(src);
                (&b[0], &mut a[dst])
            };
            for layer in 0..self.cfg.n_layer {
                dst.k[layer][..c.n_positions * kb].copy_from_slice(&src.k[layer][..c.n_positions * kb]);
                dst.v[layer][..c.n_positions * vb].copy_from_slice(&src.v[layer][..c.n_positions * vb]);
                dst.k_offset[layer].copy_from_slice(&src.k_offset[layer]);
            }
        }
    }

    fn locate(&self, seq: SeqId, pos: usize) -> (usize, usize) {
        debug_assert!(pos < self.books.seq_len(seq));
        let bs = self.cfg.block_size;
        (self.books.table(seq)[pos / bs] as usize, pos % bs)
    }

    /// Store one token's K and V rows (f32, [n_head_kv * head_dim]) for `layer` at `pos` of `seq`.
    pub fn write(&mut self, layer: usize, seq: SeqId, pos: usize, k: &[f32], v: &[f32]) -> Result<()> {
        self.write_rows(layer, &[(seq, pos)], k, v)
    }

    /// Store the K and V rows of a batch for `layer`: row t (k [t * n_head_kv * head_dim_k..], likewise v) at
    /// `rows[t]` = (sequence, position).
    pub fn write_rows(&mut self, layer: usize, rows: &[(SeqId, usize)], k: &[f32], v: &[f32]) -> Result<()> {
        let (k_dim, v_dim) = (self.cfg.n_head_kv * self.cfg.head_dim_k, self.cfg.n_head_kv * self.cfg.head_dim_v);
        let k = self.stored_form(k, self.rotate_k, self.cfg.head_dim_k);
        let v = self.stored_form(v, self.rotate_v, self.cfg.head_dim_v);
        let (kb, vb) = (self.k_row_bytes, self.v_row_bytes);
        let (k_type, v_type) = (self.cfg.k_type, self.cfg.v_type);
        let bs = self.cfg.block_size;
        let mut k_row = vec![0.0f32; k_dim];
        for (t, &(seq, pos)) in rows.iter().enumerate() {
            let (b, slot) = self.locate(seq, pos);
            debug_assert_eq!(self.books.ref_count(b as u32), 1, "a write into a block another sequence reads");
            let block = &mut self.blocks[b];
            if slot == 0 {
                // A block begun by this batch: its K offset is the mean of the batch's keys in it when there are
                // enough of them (and becomes the layer's for blocks begun with fewer), else the layer's.
                let run = rows[t..].iter().take_while(|&&(s, p)| s == seq && p / bs == pos / bs).count();
                let run = (run >= OFFSET_MIN_ROWS).then_some((t, run, pos == 0));
                begin_offset(&mut self.k_offsets[layer], &mut block.k_offset[layer], &k, k_dim, run);
            }
            k_row.copy_from_slice(&k[t * k_dim..(t + 1) * k_dim]);
            k_row.iter_mut().zip(&block.k_offset[layer]).for_each(|(x, &o)| *x -= o);
            store_row(k_type, &k_row, &mut block.k[layer][slot * kb..(slot + 1) * kb])?;
            store_row(v_type, &v[t * v_dim..(t + 1) * v_dim], &mut block.v[layer][slot * vb..(slot + 1) * vb])?;
        }
        Ok(())
    }

    /// A row as it is stored: rotated per head if `rotate`.
    fn stored_form<'a>(&self, row: &'a [f32], rotate: bool, head_dim: usize) -> std::borrow::Cow<'a, [f32]> {
        if !rotate {
            return std::borrow::Cow::Borrowed(row);
        }
        let mut r = row.to_vec();
        rotation::rotate(&mut r, head_dim);
        std::borrow::Cow::Owned(r)
    }

    /// Whether K rows are stored Hadamard-rotated: a query must be rotated (`rotation::rotate`) before its dot
    /// products with them.
    pub fn rotates_k(&self) -> bool {
        self.rotate_k
    }

    /// Whether V rows are stored Hadamard-rotated: an attention output (a weighted sum of them) must be rotated
    /// back (`rotation::rotate` again).
    pub fn rotates_v(&self) -> bool {
        self.rotate_v
    }

    /// The K and V bytes of `layer` in the `block_index`-th block of `seq`'s table. Rows are `k_row_bytes()` /
    /// `v_row_bytes()` long; slot i holds position `block_index * block_size + i` (valid below `seq_len`).
    pub fn block_view(&self, layer: usize, seq: SeqId, block_index: usize) -> (&[u8], &[u8]) {
        let b = &self.blocks[self.books.table(seq)[block_index] as usize];
        (&b.k[layer], &b.v[layer])
    }

    /// What was subtracted from the stored keys of `layer` in the `block_index`-th block of `seq` ([n_head_kv *
    /// head_dim_k], rotated basis): q·k is the stored key's dot product plus q·offset. None for an unrotated cache.
    pub fn block_k_offset(&self, layer: usize, seq: SeqId, block_index: usize) -> Option<&[f32]> {
        let b = &self.blocks[self.books.table(seq)[block_index] as usize];
        self.rotate_k.then(|| &b.k_offset[layer][..])
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
        kv.truncate(7, 3).unwrap();
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

    /// The rows a fork or a truncation into a shared block copies read back equal to the source's, in every
    /// layer, and later writes to the copy leave the source alone.
    #[test]
    fn forks_and_truncations_copy_the_bytes() {
        let mut kv = cache(6);
        kv.extend(0, 10).unwrap();
        let row = |p: usize, l: usize| -> Vec<f32> { (0..32).map(|i| (p * 100 + l * 10 + i) as f32 / 64.0).collect() };
        for p in 0..10 {
            for l in 0..2 {
                kv.write(l, 0, p, &row(p, l), &row(p, l)).unwrap();
            }
        }
        kv.fork(0, 1, 7).unwrap(); // block 0 shared, block 1's 3 positions copied
        assert_eq!((kv.books().table(1)[0], kv.blocks_in_use()), (kv.books().table(0)[0], 4));
        for l in 0..2 {
            for b in 0..2 {
                let n = if b == 0 { 4 } else { 3 };
                let (k0, v0) = kv.block_view(l, 0, b);
                let (k1, v1) = kv.block_view(l, 1, b);
                assert_eq!(&k1[..n * kv.k_row_bytes()], &k0[..n * kv.k_row_bytes()]);
                assert_eq!(&v1[..n * kv.v_row_bytes()], &v0[..n * kv.v_row_bytes()]);
            }
        }
        kv.extend(1, 1).unwrap();
        kv.write(0, 1, 7, &row(99, 0), &row(99, 0)).unwrap();
        assert_ne!(kv.block_view(0, 1, 1).0, kv.block_view(0, 0, 1).0, "the fork writes into its own block");
        // Sequence 2 shares both of 0's full blocks; truncating it into the second copies that block's 2 rows.
        kv.fork(0, 2, 8).unwrap();
        kv.truncate(2, 6).unwrap();
        assert_ne!(kv.books().table(2)[1], kv.books().table(0)[1]);
        let (k0, _) = kv.block_view(1, 0, 1);
        let (k2, _) = kv.block_view(1, 2, 1);
        assert_eq!(&k2[..2 * kv.k_row_bytes()], &k0[..2 * kv.k_row_bytes()]);
    }
}
