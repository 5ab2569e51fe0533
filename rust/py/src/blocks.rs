//! `BlockManager`: the KV cache's books (ninfer-core's `kv::BlockManager`) for a backend that keeps its own storage,
//! as the CUDA engine keeps its page pools. Only conversions here; every rule lives in the core.

use ninfer_core::kv::{BlockCopy, BlockHome, BlockManager, Placement, Precision};
use ninfer_core::Error;
use pyo3::prelude::*;

use crate::errors::to_py;

/// A copy the storage must execute: (src block, dst block, n_positions).
type CopyPy = (u32, u32, usize);

fn copies(c: Vec<BlockCopy>) -> Vec<CopyPy> {
    c.into_iter().map(|c| (c.src, c.dst, c.n_positions)).collect()
}

fn precision(what: &str, name: &str) -> PyResult<Precision> {
    Precision::from_name(name).ok_or_else(|| {
        to_py(Error::InvalidArgument(format!("{what} precision '{name}' is not one of f32, f16, q8_0, q4_0")))
    })
}

/// The books of a paged KV cache: per-sequence block tables, a free list and a reference count per block. It holds
/// no K or V data: the caller keeps one storage slot per block id in [0, max_blocks) and executes the copies these
/// methods return, before the next write into their destination blocks.
///
/// Position p of sequence `seq` lives in block `table(seq)[p // block_size]`, slot `p % block_size`.
///
/// Sequences may share blocks (`fork`). A block a sequence may still write into, its partial last block, is
/// never shared: so a sequence writes only the positions `extend` gave it, into blocks no other sequence reads.
/// A copy `(src, dst, n_positions)` means: copy slots [0, n_positions) of block src to block dst, in every layer,
/// K and V. Methods that fail raise ContextOverflowError or InvalidArgumentError and change nothing.
#[pyclass(name = "BlockManager", module = "ninfer._core")]
pub struct PyBlockManager {
    inner: BlockManager,
}

#[pymethods]
impl PyBlockManager {
    /// Books for `max_blocks` blocks of `block_size` positions, each sequence at most `n_ctx` positions long.
    /// `placement` ('device' or 'host') and `k_precision` / `v_precision` ('f32', 'f16', 'q8_0', 'q4_0') are
    /// recorded for every block allocated (see `placement`).
    #[new]
    #[pyo3(signature = (block_size, max_blocks, n_ctx, *, placement="device", k_precision="f16", v_precision="f16"))]
    fn new(
        block_size: usize,
        max_blocks: usize,
        n_ctx: usize,
        placement: &str,
        k_precision: &str,
        v_precision: &str,
    ) -> PyResult<Self> {
        let placement = Placement::from_name(placement).ok_or_else(|| {
            to_py(Error::InvalidArgument(format!("placement '{placement}' is not 'device' or 'host'")))
        })?;
        let home = BlockHome { placement, k: precision("K", k_precision)?, v: precision("V", v_precision)? };
        let inner = BlockManager::new(block_size, max_blocks, n_ctx).map_err(to_py)?.with_home(home);
        Ok(PyBlockManager { inner })
    }

    /// Grow `seq` by `n` positions (a new sequence starts at 0), taking free blocks as needed; returns the first
    /// new position. ContextOverflowError if the sequence would pass n_ctx or too few blocks are free.
    fn extend(&mut self, seq: u32, n: usize) -> PyResult<usize> {
        self.inner.extend(seq, n).map_err(to_py)
    }

    /// Keep the first `n` positions of `seq` (nothing happens if it holds no more) and release the blocks past
    /// them. Returns the copies to execute: one if the new last block is partial and was shared, so `seq` got a
    /// fresh block of its own (then ContextOverflowError if none is free); none otherwise, and never when going
    /// back to a length the sequence had before its last `extend`.
    fn truncate(&mut self, seq: u32, n: usize) -> PyResult<Vec<CopyPy>> {
        self.inner.truncate(seq, n).map(copies).map_err(to_py)
    }

    /// Drop `seq` and release its blocks (a block returns to the free list when no sequence holds it).
    fn remove(&mut self, seq: u32) {
        self.inner.remove(seq)
    }

    /// Make `dst` (replacing what it held) the first `n` positions of `src`: src's whole blocks are shared, a
    /// partial last block becomes a fresh block of dst's, and its copy is returned. InvalidArgumentError if src
    /// holds fewer than n positions or dst is src; ContextOverflowError if a fresh block is needed and none is free.
    fn fork(&mut self, src: u32, dst: u32, n: usize) -> PyResult<Vec<CopyPy>> {
        self.inner.fork(src, dst, n).map(copies).map_err(to_py)
    }

    /// Block ids of `seq`'s positions, in order (empty for an unknown sequence).
    fn table(&self, seq: u32) -> Vec<u32> {
        self.inner.table(seq).to_vec()
    }

    /// Positions `seq` holds (0 for an unknown sequence).
    fn seq_len(&self, seq: u32) -> usize {
        self.inner.seq_len(seq)
    }

    /// Blocks held by at least one sequence; a shared block counts once.
    fn blocks_in_use(&self) -> usize {
        self.inner.blocks_in_use()
    }

    /// Blocks that can still be allocated.
    fn n_free(&self) -> usize {
        self.inner.n_free()
    }

    /// How many sequences hold `block` (0 when it is free).
    fn ref_count(&self, block: u32) -> u32 {
        self.inner.ref_count(block)
    }

    #[getter]
    fn max_blocks(&self) -> usize {
        self.inner.max_blocks()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    #[getter]
    fn n_ctx(&self) -> usize {
        self.inner.n_ctx()
    }

    /// (placement, k_precision, v_precision) of `block` as set when it was last allocated, e.g.
    /// ('device', 'f16', 'f16'). InvalidArgumentError for an id never allocated.
    fn placement(&self, block: u32) -> PyResult<(&'static str, &'static str, &'static str)> {
        let h = self.inner.home(block).ok_or_else(|| {
            to_py(Error::InvalidArgument(format!("block {block} has never been allocated")))
        })?;
        Ok((h.placement.name(), h.k.name(), h.v.name()))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBlockManager>()
}
