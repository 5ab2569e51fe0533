//! The books of the paged KV cache: which blocks each sequence's positions live in, which blocks are free, and how
//! many sequences hold each block. No K or V bytes here: a backend keeps the storage (the CPU's `KvCache`, the
//! CUDA engine's page pools) and executes the `BlockCopy` instructions these books hand it.
//!
//! Position p of a sequence lives in block `table[p / block_size]`, slot `p % block_size`. Sequences may share
//! blocks (`fork`): a block's reference count is the number of tables holding it, and it returns to the free list
//! when that count reaches zero.
//!
//! Invariant: a block a sequence may still write into, its partial last block, is held by that sequence alone.
//! `extend` then writes only into blocks no other sequence reads, so sharing needs no copy-on-write later; the
//! copies happen where a partial block would otherwise become shared: `fork` of a length inside a block gives the
//! new sequence a fresh block for that part, and `truncate` to a length inside a shared block swaps in a fresh
//! block. Either returns a `BlockCopy` for the storage to execute before the next write.

use std::collections::HashMap;

use crate::error::{Error, Result};

pub type SeqId = u32;

/// Copy the first `n_positions` slots of block `src` into block `dst` (every layer, K and V).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: u32,
    pub dst: u32,
    pub n_positions: usize,
}

/// Where a block's bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    Device,
    Host,
}

/// The element format a block's K or V rows are stored in (the cache types a KV cache supports).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    F32,
    F16,
    Q8_0,
    Q4_0,
}

/// Where a block lives and in what precision. Every block gets its cache's one home when it is allocated; a
/// tiered cache changes it per block as the block ages (`set_home`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockHome {
    pub placement: Placement,
    pub k: Precision,
    pub v: Precision,
}

impl Placement {
    pub fn name(self) -> &'static str {
        match self {
            Placement::Device => "device",
            Placement::Host => "host",
        }
    }

    pub fn from_name(name: &str) -> Option<Placement> {
        [Placement::Device, Placement::Host].into_iter().find(|p| p.name() == name)
    }
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::Q8_0 => "q8_0",
            Precision::Q4_0 => "q4_0",
        }
    }

    pub fn from_name(name: &str) -> Option<Precision> {
        [Precision::F32, Precision::F16, Precision::Q8_0, Precision::Q4_0].into_iter().find(|p| p.name() == name)
    }
}

#[derive(Default, Clone, Debug, PartialEq)]
struct Table {
    /// [len.div_ceil(block_size)] block ids.
    blocks: Vec<u32>,
    len: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BlockManager {
    block_size: usize,
    max_blocks: usize,
    n_ctx: usize,
    /// The home every block is given when allocated.
    home: BlockHome,
    tables: HashMap<SeqId, Table>,
    /// [blocks created]: how many tables hold each block; 0 for a block on the free list.
    refs: Vec<u32>,
    /// [blocks created]: each block's home, set when it was last allocated.
    homes: Vec<BlockHome>,
    /// Blocks created and not held by any table. Ids are created in order 0, 1, ... only when this is empty, so a
    /// backend that allocates storage lazily grows it to `blocks_created()`.
    free: Vec<u32>,
}

impl BlockManager {
    /// Books for `max_blocks` blocks of `block_size` positions, each sequence at most `n_ctx` positions long.
    /// Blocks are homed on the host in f16 until `with_home` says otherwise.
    pub fn new(block_size: usize, max_blocks: usize, n_ctx: usize) -> Result<BlockManager> {
        if block_size == 0 || n_ctx == 0 || max_blocks == 0 {
            return Err(Error::InvalidArgument("KV cache sizes must be positive".into()));
        }
        if u32::try_from(max_blocks).is_err() {
            return Err(Error::InvalidArgument(format!("{max_blocks} KV blocks are more than block ids can name")));
        }
        let home = BlockHome { placement: Placement::Host, k: Precision::F16, v: Precision::F16 };
        Ok(BlockManager {
            block_size,
            max_blocks,
            n_ctx,
            home,
            tables: HashMap::new(),
            refs: Vec::new(),
            homes: Vec::new(),
            free: Vec::new(),
        })
    }

    /// The same books, giving every block allocated from now on `home`.
    pub fn with_home(mut self, home: BlockHome) -> BlockManager {
        self.home = home;
        self
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    pub fn seq_len(&self, seq: SeqId) -> usize {
        self.tables.get(&seq).map_or(0, |t| t.len)
    }

    /// The block ids of `seq`'s positions, in order (empty for an unknown sequence).
    pub fn table(&self, seq: SeqId) -> &[u32] {
        self.tables.get(&seq).map_or(&[], |t| &t.blocks)
    }

    /// Blocks held by at least one sequence; a block shared by several counts once.
    pub fn blocks_in_use(&self) -> usize {
        self.refs.len() - self.free.len()
    }

    /// Blocks that can still be allocated (freed ones and ones never created).
    pub fn n_free(&self) -> usize {
        self.free.len() + self.max_blocks - self.refs.len()
    }

    /// Block ids handed out so far: every id in a table is below this.
    pub fn blocks_created(&self) -> usize {
        self.refs.len()
    }

    /// How many sequences hold `block` (0 if it is free or was never created).
    pub fn ref_count(&self, block: u32) -> u32 {
        self.refs.get(block as usize).copied().unwrap_or(0)
    }

    /// Where `block` lives and in what precision; `None` for an id never allocated.
    pub fn home(&self, block: u32) -> Option<BlockHome> {
        self.homes.get(block as usize).copied()
    }

    /// Give `block` a new home: a tiered cache moving it to another tier, or a copy taking its source's. It keeps
    /// it until it is freed (a block allocated again gets the books' home).
    pub fn set_home(&mut self, block: u32, home: BlockHome) {
        self.homes[block as usize] = home;
    }

    /// Whether `seq` can grow by `n` positions: the error `extend` would give, without changing anything.
    pub fn check_extend(&self, seq: SeqId, n: usize) -> Result<()> {
        let (len, held) = self.tables.get(&seq).map_or((0, 0), |t| (t.len, t.blocks.len()));
        let new_len = len + n;
        if new_len > self.n_ctx {
            return Err(Error::ContextOverflow(format!(
                "sequence {seq} would hold {new_len} tokens, more than the context size n_ctx={}",
                self.n_ctx
            )));
        }
        let need = new_len.div_ceil(self.block_size).saturating_sub(held);
        if need > self.n_free() {
            return Err(Error::ContextOverflow(format!(
                "KV cache is full: sequence {seq} needs {need} more blocks of {} tokens, {} are free",
                self.block_size,
                self.n_free()
            )));
        }
        Ok(())
    }

    /// Grow `seq` by `n` positions, allocating blocks as needed; returns the first new position. Fails without
    /// changing anything if the sequence would pass n_ctx or the pool has too few free blocks.
    pub fn extend(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        self.check_extend(seq, n)?;
        let mut t = self.tables.remove(&seq).unwrap_or_default();
        let start = t.len;
        t.len += n;
        while t.blocks.len() < t.len.div_ceil(self.block_size) {
            t.blocks.push(self.alloc());
        }
        self.tables.insert(seq, t);
        Ok(start)
    }

    /// Keep the first `len` positions of `seq` (nothing happens if it holds no more) and release the blocks past
    /// them. If the new last block is partial and shared, `seq` gets a fresh block with a copy of its part: the one
    /// copy returned. That needs a free block, so only then can this fail (ContextOverflow, nothing changed);
    /// truncating back to a length the sequence had before its last `extend` never copies.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<Vec<BlockCopy>> {
        let Some(t) = self.tables.get(&seq) else { return Ok(Vec::new()) };
        if len >= t.len {
            return Ok(Vec::new());
        }
        let keep = len.div_ceil(self.block_size);
        let in_block = len % self.block_size;
        let shared_last = in_block != 0 && self.refs[t.blocks[keep - 1] as usize] > 1;
        if shared_last {
            let freed = t.blocks[keep..].iter().filter(|&&b| self.refs[b as usize] == 1).count();
            if self.n_free() + freed == 0 {
                return Err(Error::ContextOverflow(format!(
                    "KV cache is full: truncating sequence {seq} to {len} tokens needs a block of its own for the \
                     last {in_block}, which it shares, and none is free"
                )));
            }
        }
        let mut t = self.tables.remove(&seq).expect("looked up above");
        for b in t.blocks.drain(keep..) {
            self.release(b);
        }
        t.len = len;
        let mut copies = Vec::new();
        if shared_last {
            let (old, new) = (t.blocks[keep - 1], self.alloc());
            t.blocks[keep - 1] = new;
            self.release(old);
            copies.push(BlockCopy { src: old, dst: new, n_positions: in_block });
        }
        self.tables.insert(seq, t);
        Ok(copies)
    }

    /// Drop `seq` and release its blocks.
    pub fn remove(&mut self, seq: SeqId) {
        if let Some(t) = self.tables.remove(&seq) {
            for b in t.blocks {
                self.release(b);
            }
        }
    }

    /// Make `dst` (replacing whatever it held) a sequence of `src`'s first `len` positions: the whole blocks are
    /// shared, a partial last block is a fresh block of `dst`'s own, with the copy returned. Fails without changing
    /// anything if `src` holds fewer positions, `dst` is `src`, or a fresh block is needed and none is free.
    pub fn fork(&mut self, src: SeqId, dst: SeqId, len: usize) -> Result<Vec<BlockCopy>> {
        if src == dst {
            return Err(Error::InvalidArgument(format!("cannot fork sequence {src} into itself")));
        }
        let src_len = self.seq_len(src);
        if len > src_len {
            return Err(Error::InvalidArgument(format!(
                "cannot fork {len} positions of sequence {src}, which holds {src_len}"
            )));
        }
        let (full, in_block) = (len / self.block_size, len % self.block_size);
        if in_block != 0 {
            // Blocks only dst holds come free when it is replaced.
            let freed = self.table(dst).iter().filter(|&&b| self.refs[b as usize] == 1).count();
            if self.n_free() + freed == 0 {
                return Err(Error::ContextOverflow(format!(
                    "KV cache is full: forking {len} positions of sequence {src} into sequence {dst} needs a block \
                     for the last {in_block}, and none is free"
                )));
            }
        }
        self.remove(dst);
        let src_blocks = self.table(src)[..len.div_ceil(self.block_size)].to_vec();
        let mut blocks = src_blocks[..full].to_vec();
        for &b in &blocks {
            self.refs[b as usize] += 1;
        }
        let mut copies = Vec::new();
        if in_block != 0 {
            let new = self.alloc();
            blocks.push(new);
            copies.push(BlockCopy { src: src_blocks[full], dst: new, n_positions: in_block });
        }
        self.tables.insert(dst, Table { blocks, len });
        Ok(copies)
    }

    /// A block for one table: a freed one, else a new id. The caller has checked `n_free() > 0`.
    fn alloc(&mut self) -> u32 {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                debug_assert!(self.refs.len() < self.max_blocks);
                self.refs.push(0);
                self.homes.push(self.home);
                (self.refs.len() - 1) as u32
            }
        };
        self.refs[id as usize] = 1;
        self.homes[id as usize] = self.home;
        id
    }

    /// One table lets go of `block`; the last one returns it to the free list.
    fn release(&mut self, block: u32) {
        let r = &mut self.refs[block as usize];
        *r -= 1;
        if *r == 0 {
            self.free.push(block);
        }
    }
}

#[cfg(test)]
mod tests;
