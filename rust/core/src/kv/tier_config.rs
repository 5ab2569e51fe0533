//! The data of a tiered KV cache (its settings, its L3 ring, what it holds), apart from the code that moves blocks
//! between tiers (`tiers`), so the storage (`cache`) can own them without importing that code.

use std::path::PathBuf;

use crate::kv::blocks::Precision;
use crate::kv::prefetch::Prefetcher;
use crate::kv::ring::Ring;
use crate::kv::shortlist::Shortlists;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct TierConfig {
    /// Newest tokens of each sequence kept in f16 (L1), besides its sink block; at least one block.
    pub l1: usize,
    /// The next older tokens, kept in q8_0 (L2); older ones go to q4_0 in the L3 ring.
    pub l2: usize,
    /// Tokens a decode step reads from the older tiers besides the sinks and L1 (whole blocks, the best by their
    /// key summary); 0: all of them.
    pub select: usize,
    /// The L3 ring's file; None: anonymous memory.
    pub l3_file: Option<PathBuf>,
    /// How selection ranks the older blocks.
    pub scorer: BlockScorer,
    /// Decode steps one ranking of every older block serves: the steps after it, up to `rescan` - 1 of them, rank
    /// only its shortlist (`shortlist`) and the blocks that have become older since. 0 or 1: every step ranks all.
    pub rescan: usize,
}

/// How a decode step with selection ranks the older blocks for a KV head.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BlockScorer {
    /// The largest q·k over the block's stored keys (one int8 product a key and query head; reads every older key,
    /// so an L3 ring in a file is read half through each step).
    #[default]
    Keys,
    /// Quest's upper bound on q·k from the block's element-wise key minimum and maximum (reads only those: cheap,
    /// but in real text it ranks blocks by how widely their keys spread more than by how well they match).
    Bound,
}

impl BlockScorer {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "keys" => Some(BlockScorer::Keys),
            "bound" => Some(BlockScorer::Bound),
            _ => None,
        }
    }
}

pub struct Tiers {
    pub(super) cfg: TierConfig,
    /// With selection: the thread bringing in the next step's L3 blocks. (Declared before the ring: dropped, and its
    /// thread joined, before the memory it reads is unmapped.)
    pub(super) prefetch: Option<Prefetcher>,
    pub(super) ring: Ring,
    /// With selection and `rescan` > 1: what the last full rankings chose.
    pub(super) shortlists: Shortlists,
}

/// Blocks in use in one tier and the bytes of their K and V rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierUse {
    pub blocks: usize,
    pub bytes: usize,
}

/// What a KV cache holds now, by tier (a plain cache's blocks count as L1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvMemory {
    pub l1: TierUse,
    pub l2: TierUse,
    pub l3: TierUse,
    /// Offsets and key summaries of the blocks in use.
    pub meta_bytes: usize,
}

impl KvMemory {
    pub fn total_bytes(&self) -> usize {
        self.l1.bytes + self.l2.bytes + self.l3.bytes + self.meta_bytes
    }
}

/// The tier a precision stands for: 0 (L1, f16 or f32), 1 (L2, q8_0), 2 (L3, q4_0).
pub(super) fn tier(p: Precision) -> usize {
    match p {
        Precision::F32 | Precision::F16 => 0,
        Precision::Q8_0 => 1,
        Precision::Q4_0 => 2,
    }
}

