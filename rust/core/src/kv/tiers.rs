//! A tiered KV cache: each sequence's blocks change precision as they age. The sink block (a sequence's first
//! `block_size` tokens) and the blocks holding its newest `l1` tokens stay in f16 (L1); the next older `l2` tokens
//! go to q8_0 (L2); older blocks to q4_0 in the L3 `Ring` (anonymous memory, or a file). Rows are stored
//! Hadamard-rotated in every tier, so a block is requantized without changing basis; a block's K offset (its mean
//! key) is taken when it is first quantized. Each move happens once, after the step that aged the block
//! (`settle`); blocks never move back.
//!
//! Each block also keeps, per layer and KV head, the element-wise min and max of its keys (Quest's summary):
//! attention at a decode step scores the old blocks against the query by the upper bound of q·k they give, and
//! reads only the best (`TierConfig::select` tokens) besides the sinks and L1 (`cpu::attention_tiered`).

use crate::error::{Error, Result};
use crate::kv::blocks::{BlockHome, Placement, Precision, SeqId};
use crate::kv::cache::{mean_row, rotated, store_row, KvCache, KvConfig};
use crate::kv::prefetch::{Job, PrefetchStats, Prefetcher};
use crate::kv::ring::Ring;
use crate::kv::shortlist::Shortlist;
use crate::kv::tier_config::{tier, KvMemory, TierConfig, Tiers};
use crate::quant::{dequantize_row, GgmlType};

impl KvCache {
    /// A tiered cache (see the module). `cfg`'s cache types must be f16: the tiers set the precisions.
    pub fn new_tiered(cfg: KvConfig, tiers: TierConfig) -> Result<KvCache> {
        if cfg.k_type != GgmlType::F16 || cfg.v_type != GgmlType::F16 {
            return Err(Error::InvalidArgument(format!(
                "a tiered KV cache sets its own precisions (f16, q8_0, q4_0); the cache types must be f16, not {}/{}",
                cfg.k_type, cfg.v_type
            )));
        }
        if cfg.head_dim_k % 32 != 0 || cfg.head_dim_v % 32 != 0 {
            return Err(Error::InvalidArgument(format!(
                "a tiered KV cache needs head sizes divisible by 32 (q8_0/q4_0 blocks), the model has {}/{}",
                cfg.head_dim_k, cfg.head_dim_v
            )));
        }
        if tiers.l1 < cfg.block_size {
            return Err(Error::InvalidArgument(format!(
                "the L1 tier must hold at least one block of {} tokens, got {}",
                cfg.block_size, tiers.l1
            )));
        }
        let mut kv = KvCache::new(cfg)?;
        (kv.rotate_k, kv.rotate_v) = (true, true);
        let q4 = |hd: usize| GgmlType::Q4_0.row_bytes(cfg.n_head_kv * hd);
        let slot = cfg.n_layer * cfg.block_size * (q4(cfg.head_dim_k)? + q4(cfg.head_dim_v)?);
        let ring = Ring::new(slot, cfg.max_blocks, tiers.l3_file.as_deref())?;
        let prefetch = (tiers.select > 0).then(Prefetcher::new);
        kv.tiers = Some(Tiers { cfg: tiers, prefetch, ring, shortlists: Default::default() });
        Ok(kv)
    }

    /// A tiered cache's settings; None for a plain cache.
    pub fn tier_config(&self) -> Option<&TierConfig> {
        self.tiers.as_ref().map(|t| &t.cfg)
    }

    /// Read `select` tokens of the older tiers from the next decode step on (0: all of them), the cache's contents
    /// unchanged: a budget sweep over one prefill (selection applies to decode rows only). The prefetch thread is
    /// made with the cache, so only a cache made with selection can change its budget.
    pub fn set_select(&mut self, select: usize) -> Result<()> {
        match &mut self.tiers {
            Some(t) if t.prefetch.is_some() => {
                t.cfg.select = select;
                t.shortlists.clear();
                Ok(())
            }
            Some(_) => Err(Error::InvalidArgument(
                "this tiered KV cache was made without selection (kv_select 0): it has no prefetch thread to change \
                 the budget of"
                    .into(),
            )),
            None => Err(Error::InvalidArgument("the KV cache is not tiered: it has no selection budget".into())),
        }
    }

    /// Move `seq`'s blocks to the tiers their age now gives (a tiered cache; no-op otherwise). Call after a step's
    /// rows are written in every layer: a block moves only once its last position is written.
    pub fn settle(&mut self, seq: SeqId) -> Result<()> {
        let Some(t) = &self.tiers else { return Ok(()) };
        let (l1, l2) = (t.cfg.l1, t.cfg.l2);
        let (len, bs) = (self.seq_len(seq), self.cfg.block_size);
        let table = self.books.table(seq).to_vec();
        for (i, &b) in table.iter().enumerate().skip(1) {
            let end = (i + 1) * bs;
            if end + l1 > len {
                break; // this block and the later ones hold some of the newest l1 tokens
            }
            let want = if end + l1 + l2 > len { Precision::Q8_0 } else { Precision::Q4_0 };
            let have = self.books.home(b).expect("a held block has a home").k;
            if tier(want) > tier(have) {
                self.move_block(b, i, want)?;
            }
        }
        Ok(())
    }

    /// Requantize every layer of the full block `b` (the `block_index`-th of its sequences) to `to`, in memory
    /// (q8_0) or into a ring slot (q4_0, whose keys lose the model's key bias first, `key_bias`).
    fn move_block(&mut self, b: u32, block_index: usize, to: Precision) -> Result<()> {
        let (kd, vd) = (self.cfg.n_head_kv * self.cfg.head_dim_k, self.cfg.n_head_kv * self.cfg.head_dim_v);
        let bs = self.cfg.block_size;
        let to_type = crate::kv::cache::ggml_type(to);
        let (k_rb, v_rb) = (self.row_bytes(to_type, true), self.row_bytes(to_type, false));
        let mut layers = Vec::with_capacity(self.cfg.n_layer);
        let (mut keys, mut vals) = (vec![0.0f32; bs * kd], vec![0.0f32; bs * vd]);
        for layer in 0..self.cfg.n_layer {
            let view = self.view(b as usize, layer);
            for slot in 0..bs {
                dequantize_row(view.k_type, &view.k[slot * view.k_row_bytes..][..view.k_row_bytes], &mut keys[slot * kd..(slot + 1) * kd])?;
                dequantize_row(view.v_type, &view.v[slot * view.v_row_bytes..][..view.v_row_bytes], &mut vals[slot * vd..(slot + 1) * vd])?;
            }
            let old_offset = view.k_offset.expect("a tiered cache rotates its keys").to_vec();
            let bias = match to {
                Precision::Q4_0 => self.key_bias.as_ref().and_then(|kb| kb.term(layer, block_index)),
                _ => None,
            };
            // A block first quantized, or losing the key bias, takes its mean key as offset; a quantized one keeps
            // its own.
            let offset = if rotated(view.k_type) && bias.is_none() {
                old_offset.clone()
            } else {
                let (hd, mut row) = (self.cfg.head_dim_k, vec![0.0f32; kd]);
                for (t, key) in keys.chunks_exact_mut(kd).enumerate() {
                    key.iter_mut().zip(&old_offset).for_each(|(x, &o)| *x += o);
                    if let Some(term) = &bias {
                        for (g, head) in row.chunks_exact_mut(hd).enumerate() {
                            term.rotated_bias(t, g, head);
                        }
                        key.iter_mut().zip(&row).for_each(|(x, &y)| *x -= y);
                    }
                }
                let mean = mean_row(&keys, kd, false);
                for key in keys.chunks_exact_mut(kd) {
                    key.iter_mut().zip(&mean).for_each(|(x, &o)| *x -= o);
                }
                mean
            };
            let (mut k_bytes, mut v_bytes) = (vec![0u8; bs * k_rb], vec![0u8; bs * v_rb]);
            for slot in 0..bs {
                store_row(to_type, &keys[slot * kd..(slot + 1) * kd], &mut k_bytes[slot * k_rb..(slot + 1) * k_rb])?;
                store_row(to_type, &vals[slot * vd..(slot + 1) * vd], &mut v_bytes[slot * v_rb..(slot + 1) * v_rb])?;
            }
            layers.push((k_bytes, v_bytes, offset));
        }
        self.books.set_home(b, BlockHome { placement: Placement::Host, k: to, v: to });
        self.provision(b)?;
        for (layer, (k_bytes, v_bytes, offset)) in layers.into_iter().enumerate() {
            let (k, v) = self.rows_mut(b as usize, layer);
            k.copy_from_slice(&k_bytes);
            v.copy_from_slice(&v_bytes);
            self.blocks[b as usize].k_offset[layer] = offset;
        }
        Ok(())
    }

    /// Append `n` positions of synthetic keys and values (uniform in [-1, 1), from `seed`) to `seq` in every layer,
    /// moving blocks down the tiers as it goes: a cache at depth for measuring decode speed and memory without a
    /// real prefill (`ninfer bench --kv-fill random`). Works on a plain cache too.
    pub fn fill_random(&mut self, seq: SeqId, n: usize, seed: u64) -> Result<()> {
        self.check_extend(seq, n)?;
        let (kd, vd) = (self.cfg.n_head_kv * self.cfg.head_dim_k, self.cfg.n_head_kv * self.cfg.head_dim_v);
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut uniform = move || {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            ((state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        };
        // Block-sized writes, as a prompt's batches would make them (so quantized blocks get their offsets).
        let mut done = 0;
        while done < n {
            let start = self.extend(seq, (n - done).min(self.cfg.block_size))?;
            let m = self.seq_len(seq) - start;
            let rows: Vec<(SeqId, usize)> = (start..start + m).map(|p| (seq, p)).collect();
            for layer in 0..self.cfg.n_layer {
                let k: Vec<f32> = (0..m * kd).map(|_| uniform()).collect();
                let v: Vec<f32> = (0..m * vd).map(|_| uniform()).collect();
                self.write_rows(layer, &rows, &k, &v)?;
            }
            self.settle(seq)?;
            done += m;
        }
        Ok(())
    }

    /// Whether the `block_index`-th block of `seq` is in the L3 ring.
    pub fn in_l3(&self, seq: SeqId, block_index: usize) -> bool {
        self.blocks[self.books.table(seq)[block_index] as usize].ring_slot.is_some()
    }

    /// Count the reads of `layer` of the L3 blocks `blocks` (block indices of `seq`) with the prefetch thread (if
    /// any): brought in ahead or not. Attention reads them in place either way.
    pub fn take_l3(&self, layer: usize, seq: SeqId, blocks: &[usize]) {
        let Some(p) = self.tiers.as_ref().and_then(|t| t.prefetch.as_ref()) else { return };
        for &i in blocks {
            p.take(self.books.table(seq)[i], layer);
        }
    }

    /// Ask the prefetch thread (if any) to bring in `layer` of the L3 blocks `blocks` of `seq` for the next step.
    pub fn prefetch_next(&self, layer: usize, seq: SeqId, blocks: &[usize]) {
        let Some(p) = self.tiers.as_ref().and_then(|t| t.prefetch.as_ref()) else { return };
        let jobs = blocks
            .iter()
            .map(|&i| {
                let b = self.books.table(seq)[i];
                let v = self.view(b as usize, layer);
                Job { block: b, layer, k: (v.k.as_ptr(), v.k.len()), v: (v.v.as_ptr(), v.v.len()) }
            })
            .collect();
        p.request(layer, jobs);
    }

    /// The shortlist a decode step at `pos` of `seq` may rank for `layer` and KV head `g` instead of every older
    /// block (`TierConfig::rescan`); None: rank them all, then `keep_shortlist`.
    pub fn shortlist(&self, layer: usize, seq: SeqId, g: usize, pos: usize) -> Option<Shortlist> {
        let t = self.tiers.as_ref()?;
        (t.cfg.rescan > 1).then(|| t.shortlists.get(seq, layer, g, pos, t.cfg.rescan)).flatten()
    }

    /// Whether decode steps keep shortlists (`rescan` > 1).
    pub fn keeps_shortlists(&self) -> bool {
        self.tiers.as_ref().is_some_and(|t| t.cfg.rescan > 1)
    }

    pub fn keep_shortlist(&self, layer: usize, seq: SeqId, g: usize, list: Shortlist) {
        if let Some(t) = &self.tiers {
            t.shortlists.keep(seq, layer, g, list);
        }
    }

    /// Drop `seq`'s shortlists (its contents changed other than by growing).
    pub(super) fn forget_shortlists(&self, seq: SeqId) {
        if let Some(t) = &self.tiers {
            t.shortlists.forget(seq);
        }
    }

    /// The prefetch thread's counts; None without one (no selection).
    pub fn prefetch_stats(&self) -> Option<PrefetchStats> {
        self.tiers.as_ref().and_then(|t| t.prefetch.as_ref()).map(|p| p.stats())
    }

    /// The key summary of `layer` in the `block_index`-th block of `seq`: element-wise (min, max) of its keys
    /// [n_head_kv * head_dim_k] in the stored (rotated) basis; empty slices for a plain cache.
    pub fn key_summary(&self, layer: usize, seq: SeqId, block_index: usize) -> (&[f32], &[f32]) {
        let b = &self.blocks[self.books.table(seq)[block_index] as usize];
        (&b.k_min[layer], &b.k_max[layer])
    }

    /// What the blocks in use hold, by tier.
    pub fn memory(&self) -> KvMemory {
        let mut m = KvMemory::default();
        for (id, block) in self.blocks.iter().enumerate() {
            if self.books.ref_count(id as u32) == 0 {
                continue;
            }
            let home = self.books.home(id as u32).expect("a held block has a home");
            let bytes = match block.ring_slot {
                Some(_) => self.tiers.as_ref().expect("ring slots belong to a tiered cache").ring.slot_bytes(),
                None => block.k.iter().chain(&block.v).map(|l| l.len()).sum(),
            };
            let t = match tier(home.k) {
                0 => &mut m.l1,
                1 => &mut m.l2,
                _ => &mut m.l3,
            };
            t.blocks += 1;
            t.bytes += bytes;
            m.meta_bytes += 4 * block.k_offset.iter().chain(&block.k_min).chain(&block.k_max).map(|x| x.len()).sum::<usize>();
        }
        m
    }
}

#[cfg(test)]
mod tests;
