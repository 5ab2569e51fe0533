//! The CPU's KV storage: the K and V bytes of every block, for every layer. The books (which blocks each sequence
//! holds, the free list, sharing, each block's precision) are a `BlockManager`; this file executes its copies and
//! reads and writes rows.
//!
//! A K or V row is one token's heads, [n_head_kv * head_dim], stored in its block's precision (F32, F16, Q8_0 or
//! Q4_0); a head's slice of a row is addressable because head_dim is a multiple of the type's block size. Rows of
//! a quantized type (q8_0, q4_0) are stored Hadamard-rotated per head (`rotation`), keys less a per-block offset;
//! attention rotates the query and its output to match (`rotates_k`, `rotates_v`, `BlockView::k_offset`). Q4_0
//! key rows of a model with a key bias hold the key less its roped bias (`key_bias`, `BlockView::k_bias`).
//!
//! A tiered cache (`tiers`) gives blocks different precisions by age and keeps its oldest in the L3 `ring`.

use crate::error::{Error, Result};
use crate::kv::blocks::{BlockCopy, BlockHome, BlockManager, Placement, Precision, SeqId};
use crate::kv::tier_config::Tiers;
use crate::kv::key_bias::{BiasTerm, KeyBias};
use crate::kv::key_scales::KeyScales;
use crate::kv::{fitted_q4, rotation};
use crate::quant::{dequantize_row, quantize_row, GgmlType};

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

/// The storage of one block, kept for reuse after a free.
#[derive(Default)]
pub(super) struct Block {
    /// Outside the ring: k[layer] [block_size * K row bytes of the block's precision], likewise v; empty in it.
    pub(super) k: Vec<Vec<u8>>,
    pub(super) v: Vec<Vec<u8>>,
    /// In the L3 ring: its slot, which holds per layer the K rows then the V rows.
    pub(super) ring_slot: Option<usize>,
    /// A rotated K cache: k_offset[layer] [n_head_kv * head_dim_k] was subtracted from every key stored in the
    /// block (set when its first slot is written, or when a tiered cache first quantizes it). Empty otherwise.
    pub(super) k_offset: Vec<Vec<f32>>,
    /// Per layer, what the quantized key at position 0 lost: the key as stored (rotated, less the offset and any
    /// key bias) less its row read back, [n_head_kv * head_dim_k]; empty unless the block holds a quantized key
    /// at position 0. That key is most sequences' attention sink: most of each query's weight goes to it, so its
    /// 4-bit error moves every output (about a third of a q4_0 cache's KL to f16; docs/journal/kv-q4-keys.md).
    pub(super) k_sink: Vec<Vec<f32>>,
    /// A tiered cache: per layer, the element-wise min and max [n_head_kv * head_dim_k] of the keys written
    /// (stored basis, offset included), the block's summary for selection. Empty otherwise.
    pub(super) k_min: Vec<Vec<f32>>,
    pub(super) k_max: Vec<Vec<f32>>,
}

/// One layer of one block as attention reads it: rows of `k_row_bytes` / `v_row_bytes` in `k_type` / `v_type`,
/// slot i holding position `block_index * block_size + i`.
pub struct BlockView<'a> {
    pub k: &'a [u8],
    pub v: &'a [u8],
    pub k_type: GgmlType,
    pub v_type: GgmlType,
    pub k_row_bytes: usize,
    pub v_row_bytes: usize,
    /// What was subtracted from every stored key ([n_head_kv * head_dim_k], rotated basis): q·k is the stored
    /// key's dot product plus q·offset. None for an unrotated cache.
    pub k_offset: Option<&'a [f32]>,
    /// The block holding position 0: what its key at slot 0 lost to quantization ([n_head_kv * head_dim_k], the
    /// stored basis): q·k at slot 0 adds q·k_sink.
    pub k_sink: Option<&'a [f32]>,
    /// What else was taken out of every stored key (q4_0 keys of a layer with a key bias): q·k adds the bias'
    /// share (`BiasTerm`, in the unrotated basis). Set by `block_view`, which knows the block's positions.
    pub k_bias: Option<BiasTerm<'a>>,
}

/// Rows of one block written at once from which their mean becomes the block's K offset (fewer say too little
/// about the mean).
const OFFSET_MIN_ROWS: usize = 16;

pub struct KvCache {
    pub cfg: KvConfig,
    pub(super) books: BlockManager,
    /// [books.blocks_created()]: storage of block id i at index i.
    pub(super) blocks: Vec<Block>,
    /// Whether K / V rows are stored Hadamard-rotated (quantized types, and every row of a tiered cache).
    pub(super) rotate_k: bool,
    pub(super) rotate_v: bool,
    /// A rotated K cache, per layer: the mean rotated key of the latest block written with at least
    /// OFFSET_MIN_ROWS rows at once, given to blocks begun with fewer; each block's own offset is subtracted from
    /// its keys before they are quantized. Keys share a large common component per channel; without it the 4-bit
    /// steps are much coarser. Attention adds q·offset back per block, so scores are unchanged.
    pub(super) k_offsets: Vec<Option<Vec<f32>>>,
    /// A tiered cache's settings and L3 ring.
    pub(super) tiers: Option<Tiers>,
    /// The model's key bias, taken out of q4_0 key rows before they are quantized (`set_key_bias`).
    pub(super) key_bias: Option<KeyBias>,
    /// A rotated K cache's key scales (`key_scales`, `scale_keys`): its keys are stored as s ⊙ k.
    pub(super) key_scales: Option<KeyScales>,
    /// Layer buffers that blocks gave up when their precision changed, by length, for the next blocks of that
    /// precision: a tiered cache moves every block f16 -> q8_0 -> L3, and freeing those buffers while each block's
    /// small summaries stay allocated between them fragments the heap (glibc kept 186 MiB of 1.9 GiB at 160K
    /// positions of Qwen2.5-Coder-1.5B, dev/kv-resident.py).
    pub(super) spare: SpareBuffers,
}

/// Byte buffers by length, handed out again zeroed.
#[derive(Default)]
pub(super) struct SpareBuffers(std::collections::HashMap<usize, Vec<Vec<u8>>>);

impl SpareBuffers {
    fn give(&mut self, bufs: Vec<Vec<u8>>) {
        for b in bufs {
            if b.capacity() > 0 {
                self.0.entry(b.len()).or_default().push(b);
            }
        }
    }

    /// `n` buffers of `len` zero bytes, spare ones first.
    fn take(&mut self, n: usize, len: usize) -> Vec<Vec<u8>> {
        let spare = self.0.get_mut(&len);
        let mut out = Vec::with_capacity(n);
        if let Some(pool) = spare {
            while out.len() < n {
                let Some(mut b) = pool.pop() else { break };
                b.fill(0);
                out.push(b);
            }
        }
        out.resize_with(n, || vec![0; len]);
        out
    }
}

/// The mean of `rows` ([n, k_dim]), leaving out the first if `skip_first` (position 0: a BOS or sink key, often
/// far from the rest).
pub(super) fn mean_row(rows: &[f32], k_dim: usize, skip_first: bool) -> Vec<f32> {
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
pub(super) fn store_row(ty: GgmlType, x: &[f32], dst: &mut [u8]) -> Result<()> {
    if ty == GgmlType::Q4_0 && dst.len() == ty.row_bytes(x.len())? {
        fitted_q4::quantize_q4_0_fitted(x, dst);
        return Ok(());
    }
    quantize_row(ty, x, dst)
}

/// Whether rows of `ty` are stored rotated: the quantized types, whose shared block scales outliers would set.
pub(super) fn rotated(ty: GgmlType) -> bool {
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

pub(super) fn ggml_type(p: Precision) -> GgmlType {
    match p {
        Precision::F32 => GgmlType::F32,
        Precision::F16 => GgmlType::F16,
        Precision::Q8_0 => GgmlType::Q8_0,
        Precision::Q4_0 => GgmlType::Q4_0,
    }
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
            rotate_k: rotated(cfg.k_type),
            rotate_v: rotated(cfg.v_type),
            k_offsets: vec![None; cfg.n_layer],
            cfg,
            blocks: Vec::new(),
            tiers: None,
            key_bias: None,
            key_scales: None,
            spare: SpareBuffers::default(),
        })
    }

    /// Store keys times `scales` and read them with queries divided by them (`scale_keys`), from the first write
    /// on. A no-op for a cache that never stores q4_0 keys, as for the key bias: q8_0's error is too small to move
    /// (simulated KL 0.00006), and f16 keys have none.
    pub fn set_key_scales(&mut self, scales: Option<KeyScales>) -> Result<()> {
        if self.books.blocks_in_use() > 0 {
            return Err(Error::InvalidArgument("key scales are set before the cache holds any row".into()));
        }
        self.key_scales = scales.filter(|s| self.stores_q4_keys() && s.any());
        Ok(())
    }

    /// Whether keys are ever stored in 4 bits (a q4_0 K cache, or a tiered cache's L3): the caches that take the
    /// model's key scales and key bias.
    pub fn stores_q4_keys(&self) -> bool {
        self.cfg.k_type == GgmlType::Q4_0 || self.tiers.is_some()
    }

    /// The key scales in use (None: keys stored as they come).
    pub fn key_scales(&self) -> Option<&KeyScales> {
        self.key_scales.as_ref()
    }

    /// Layer il's new keys and queries into the cache's scaled form (keys times the scales, queries divided by
    /// them: the same scores), before `write_rows` and attention. No-op without scales.
    pub fn scale_keys(&self, il: usize, q: &mut [f32], k: &mut [f32]) {
        if let Some(s) = &self.key_scales {
            s.apply(il, q, k);
        }
    }

    /// Take the model's key bias out of q4_0 key rows from now on (before the first write: rows stored earlier
    /// would be read as if it had been). A no-op for a cache that never stores q4_0 keys.
    pub fn set_key_bias(&mut self, bias: Option<KeyBias>) -> Result<()> {
        if self.books.blocks_in_use() > 0 {
            return Err(Error::InvalidArgument("a key bias is set before the cache holds any row".into()));
        }
        if let Some(kb) = bias.as_ref().filter(|kb| kb.block_size() != self.cfg.block_size) {
            return Err(Error::InvalidArgument(format!(
                "key bias tables for blocks of {} positions given to a cache of blocks of {}",
                kb.block_size(),
                self.cfg.block_size
            )));
        }
        self.key_bias = bias.filter(|_| self.stores_q4_keys());
        Ok(())
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

    /// Bytes currently held by block storage (in use or free for reuse): K and V bytes in memory and the L3
    /// ring's touched part.
    pub fn allocated_bytes(&self) -> usize {
        let in_memory: usize =
            self.blocks.iter().flat_map(|b| b.k.iter().chain(&b.v)).map(|l| l.len()).sum();
        in_memory + self.tiers.as_ref().map_or(0, |t| t.ring.touched_bytes())
    }

    /// Whether `seq` can grow by `n` positions (the error `extend` would give, nothing changed).
    pub fn check_extend(&self, seq: SeqId, n: usize) -> Result<()> {
        self.books.check_extend(seq, n)
    }

    /// Grow `seq` by `n` positions, allocating blocks as needed. Returns the first new position.
    /// Fails without changing anything if the sequence would pass n_ctx or the pool is exhausted.
    pub fn extend(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        let held = self.books.table(seq).len();
        let start = self.books.extend(seq, n)?;
        self.grow_storage();
        for i in held..self.books.table(seq).len() {
            let b = self.books.table(seq)[i];
            self.provision(b)?;
        }
        Ok(start)
    }

    /// Keep the first `len` positions of `seq` and free the blocks past them. Fails (changing nothing) only when
    /// the new last block is partial and shared with another sequence and no block is free for `seq`'s own copy.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let copies = self.books.truncate(seq, len)?;
        self.forget_shortlists(seq);
        self.run(&copies)
    }

    /// Drop a sequence and free all its blocks.
    pub fn remove(&mut self, seq: SeqId) {
        self.forget_shortlists(seq);
        self.books.remove(seq)
    }

    /// Make `dst` (replacing what it held) a sequence of the first `len` positions of `src`, sharing its whole
    /// blocks and copying a partial last one: a prompt prefix computed once serves several sequences.
    pub fn fork(&mut self, src: SeqId, dst: SeqId, len: usize) -> Result<()> {
        let copies = self.books.fork(src, dst, len)?;
        self.forget_shortlists(dst);
        self.run(&copies)
    }

    /// Storage slots for the ids the books handed out since the last call (sized by `provision`).
    fn grow_storage(&mut self) {
        while self.blocks.len() < self.books.blocks_created() {
            self.blocks.push(Block::default());
        }
    }

    /// Size block `b`'s storage for the precision the books give it: K and V bytes in memory, or a slot of the
    /// L3 ring (a tiered cache's 4-bit blocks); offsets and summaries as the cache keeps them.
    pub(super) fn provision(&mut self, b: u32) -> Result<()> {
        let home = self.books.home(b).expect("an allocated block has a home");
        let (kt, vt) = (ggml_type(home.k), ggml_type(home.v));
        let (kd, vd) = (self.cfg.n_head_kv * self.cfg.head_dim_k, self.cfg.n_head_kv * self.cfg.head_dim_v);
        let (n_layer, bs) = (self.cfg.n_layer, self.cfg.block_size);
        let in_ring = self.tiers.is_some() && home.k == Precision::Q4_0;
        if let Some(p) = self.tiers.as_ref().and_then(|t| t.prefetch.as_ref()) {
            p.invalidate(b); // (waits for the prefetch thread: the ring may change below)
        }
        let block = &mut self.blocks[b as usize];
        if let Some(slot) = block.ring_slot.take() {
            self.tiers.as_mut().expect("ring slots belong to a tiered cache").ring.release(slot);
        }
        if in_ring {
            let ring = &mut self.tiers.as_mut().expect("checked").ring;
            let slot = ring.alloc().ok_or_else(|| Error::ContextOverflow("the L3 KV ring is full".into()))?;
            block.ring_slot = Some(slot);
            self.spare.give(std::mem::replace(&mut block.k, vec![Vec::new(); n_layer]));
            self.spare.give(std::mem::replace(&mut block.v, vec![Vec::new(); n_layer]));
        } else {
            let (kb, vb) = (bs * kt.row_bytes(kd)?, bs * vt.row_bytes(vd)?);
            let sized = |x: &[Vec<u8>], len: usize| x.len() == n_layer && x.iter().all(|l| l.len() == len);
            if !(sized(&block.k, kb) && sized(&block.v, vb)) {
                self.spare.give(std::mem::take(&mut block.k));
                self.spare.give(std::mem::take(&mut block.v));
                block.k = self.spare.take(n_layer, kb);
                block.v = self.spare.take(n_layer, vb);
            }
        }
        let offset_len = if self.rotate_k { kd } else { 0 };
        block.k_offset.resize_with(n_layer, Vec::new);
        block.k_offset.iter_mut().for_each(|o| o.resize(offset_len, 0.0));
        block.k_sink.resize_with(n_layer, Vec::new);
        block.k_sink.iter_mut().for_each(Vec::clear);
        // (A block's first write resets its summary.)
        let summary_len = if self.tiers.is_some() { kd } else { 0 };
        for (m, init) in [(&mut block.k_min, f32::INFINITY), (&mut block.k_max, f32::NEG_INFINITY)] {
            m.resize_with(n_layer, Vec::new);
            m.iter_mut().for_each(|x| x.resize(summary_len, init));
        }
        Ok(())
    }

    /// Execute the books' copies: the first n_positions rows of K and V, in every layer, with the source's
    /// precision, offsets and summaries.
    fn run(&mut self, copies: &[BlockCopy]) -> Result<()> {
        self.grow_storage();
        for c in copies {
            debug_assert_ne!(c.src, c.dst);
            let home = self.books.home(c.src).expect("a copied block has a home");
            self.books.set_home(c.dst, home);
            self.provision(c.dst)?;
            for layer in 0..self.cfg.n_layer {
                let (k, v) = {
                    let view = self.view(c.src as usize, layer);
                    (view.k[..c.n_positions * view.k_row_bytes].to_vec(), view.v[..c.n_positions * view.v_row_bytes].to_vec())
                };
                let (dk, dv) = self.rows_mut(c.dst as usize, layer);
                dk[..k.len()].copy_from_slice(&k);
                dv[..v.len()].copy_from_slice(&v);
                let (src, dst) = (c.src as usize, c.dst as usize);
                let s = &self.blocks[src];
                let (o, sink, lo, hi) =
                    (s.k_offset[layer].clone(), s.k_sink[layer].clone(), s.k_min[layer].clone(), s.k_max[layer].clone());
                let d = &mut self.blocks[dst];
                (d.k_offset[layer], d.k_sink[layer], d.k_min[layer], d.k_max[layer]) = (o, sink, lo, hi);
            }
        }
        Ok(())
    }

    fn locate(&self, seq: SeqId, pos: usize) -> (usize, usize) {
        debug_assert!(pos < self.books.seq_len(seq));
        let bs = self.cfg.block_size;
        (self.books.table(seq)[pos / bs] as usize, pos % bs)
    }

    /// The K and V types of block `b`.
    pub(super) fn block_types(&self, b: usize) -> (GgmlType, GgmlType) {
        let home = self.books.home(b as u32).expect("an allocated block has a home");
        (ggml_type(home.k), ggml_type(home.v))
    }

    /// The K and V bytes of `layer` in block `b`, wherever they live.
    pub(super) fn rows_mut(&mut self, b: usize, layer: usize) -> (&mut [u8], &mut [u8]) {
        let (kt, vt) = self.block_types(b);
        let (kb, vb) = (self.row_bytes(kt, true) * self.cfg.block_size, self.row_bytes(vt, false) * self.cfg.block_size);
        let block = &mut self.blocks[b];
        match block.ring_slot {
            Some(slot) => {
                let tiers = self.tiers.as_mut().expect("ring slots belong to a tiered cache");
                if let Some(p) = &tiers.prefetch {
                    p.invalidate(b as u32); // (a write into an L3 block, after a truncation)
                }
                let bytes = tiers.ring.slot_mut(slot);
                let (k, v) = bytes[layer * (kb + vb)..(layer + 1) * (kb + vb)].split_at_mut(kb);
                (k, v)
            }
            None => (&mut block.k[layer], &mut block.v[layer]),
        }
    }

    /// Bytes of one K (`is_k`) or V row of type `ty`.
    pub(super) fn row_bytes(&self, ty: GgmlType, is_k: bool) -> usize {
        let hd = if is_k { self.cfg.head_dim_k } else { self.cfg.head_dim_v };
        ty.row_bytes(self.cfg.n_head_kv * hd).expect("head sizes were checked against the cache types")
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
        // Keys bound for q4_0 rows lose the model's key bias first, rotated as they are (`key_bias`; the order the
        // CUDA backend's kv_key_unbias takes); the summaries see whole keys.
        let unbiased = self.key_bias.as_ref().filter(|kb| kb.has(layer)).and_then(|kb| {
            let q4 = |&(s, p): &(SeqId, usize)| self.block_types(self.locate(s, p).0).0 == GgmlType::Q4_0;
            rows.iter().any(q4).then(|| {
                let (hd, bs) = (self.cfg.head_dim_k, self.cfg.block_size);
                let (mut adj, mut b) = (k.to_vec(), vec![0.0f32; k_dim]);
                for (t, r) in rows.iter().enumerate().filter(|(_, r)| q4(r)) {
                    let term = kb.term(layer, r.1 / bs).expect("positions below n_ctx are tabled");
                    for (g, head) in b.chunks_exact_mut(hd).enumerate() {
                        term.rotated_bias(r.1 % bs, g, head);
                    }
                    adj[t * k_dim..(t + 1) * k_dim].iter_mut().zip(&b).for_each(|(x, &y)| *x -= y);
                }
                adj
            })
        });
        let k_stored: &[f32] = unbiased.as_deref().unwrap_or(&k);
        let v = self.stored_form(v, self.rotate_v, self.cfg.head_dim_v);
        let bs = self.cfg.block_size;
        let mut k_row = vec![0.0f32; k_dim];
        for (t, &(seq, pos)) in rows.iter().enumerate() {
            let (b, slot) = self.locate(seq, pos);
            debug_assert_eq!(self.books.ref_count(b as u32), 1, "a write into a block another sequence reads");
            let (k_type, v_type) = self.block_types(b);
            let (kb, vb) = (self.row_bytes(k_type, true), self.row_bytes(v_type, false));
            let key = &k[t * k_dim..(t + 1) * k_dim];
            let block = &mut self.blocks[b];
            if slot == 0 {
                // A block begun by this batch: a quantized one's K offset is the mean of the batch's keys in it
                // when there are enough of them (and becomes the layer's for blocks begun with fewer), else the
                // layer's. (A tiered cache's f16 blocks get theirs when they are first quantized.)
                let run = rows[t..].iter().take_while(|&&(s, p)| s == seq && p / bs == pos / bs).count();
                let run = (run >= OFFSET_MIN_ROWS).then_some((t, run, pos == 0));
                if rotated(k_type) {
                    begin_offset(&mut self.k_offsets[layer], &mut block.k_offset[layer], k_stored, k_dim, run);
                } else {
                    block.k_offset[layer].fill(0.0);
                }
                block.k_min[layer].fill(f32::INFINITY);
                block.k_max[layer].fill(f32::NEG_INFINITY);
            }
            for ((lo, hi), &x) in block.k_min[layer].iter_mut().zip(block.k_max[layer].iter_mut()).zip(key) {
                *lo = lo.min(x);
                *hi = hi.max(x);
            }
            k_row.copy_from_slice(&k_stored[t * k_dim..(t + 1) * k_dim]);
            k_row.iter_mut().zip(&block.k_offset[layer]).for_each(|(x, &o)| *x -= o);
            let (k_dst, _) = self.rows_mut(b, layer);
            store_row(k_type, &k_row, &mut k_dst[slot * kb..(slot + 1) * kb])?;
            if pos == 0 {
                let mut sink = Vec::new();
                if rotated(k_type) {  // (the quantized types)
                    sink.resize(k_dim, 0.0);
                    dequantize_row(k_type, &k_dst[..kb], &mut sink)?;
                    sink.iter_mut().zip(&k_row).for_each(|(r, &x)| *r = x - *r);
                }
                self.blocks[b].k_sink[layer] = sink;
            }
            let (_, v_dst) = self.rows_mut(b, layer);
            store_row(v_type, &v[t * v_dim..(t + 1) * v_dim], &mut v_dst[slot * vb..(slot + 1) * vb])?;
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

    /// `layer` of block id `b`.
    pub(super) fn view(&self, b: usize, layer: usize) -> BlockView<'_> {
        let (k_type, v_type) = self.block_types(b);
        let (k_row_bytes, v_row_bytes) = (self.row_bytes(k_type, true), self.row_bytes(v_type, false));
        let (kb, vb) = (k_row_bytes * self.cfg.block_size, v_row_bytes * self.cfg.block_size);
        let block = &self.blocks[b];
        let (k, v) = match block.ring_slot {
            Some(slot) => {
                let bytes = self.tiers.as_ref().expect("ring slots belong to a tiered cache").ring.slot(slot);
                bytes[layer * (kb + vb)..(layer + 1) * (kb + vb)].split_at(kb)
            }
            None => (&block.k[layer][..], &block.v[layer][..]),
        };
        let k_offset = self.rotate_k.then(|| &block.k_offset[layer][..]);
        let k_sink = block.k_sink.get(layer).filter(|r| !r.is_empty()).map(|r| &r[..]);
        BlockView { k, v, k_type, v_type, k_row_bytes, v_row_bytes, k_offset, k_sink, k_bias: None }
    }

    /// Drop every block's k_sink (a test's cache reading only its codes).
    #[cfg(test)]
    pub(crate) fn forget_sinks(&mut self) {
        self.blocks.iter_mut().for_each(|b| b.k_sink.iter_mut().for_each(Vec::clear));
    }

    /// `layer` of the `block_index`-th block of `seq`'s table (slots valid below `seq_len`).
    pub fn block_view(&self, layer: usize, seq: SeqId, block_index: usize) -> BlockView<'_> {
        let mut view = self.view(self.books.table(seq)[block_index] as usize, layer);
        if view.k_type == GgmlType::Q4_0 {
            view.k_bias = self.key_bias.as_ref().and_then(|kb| kb.term(layer, block_index));
        }
        view
    }
}

#[cfg(test)]
mod tests;
