//! Paged KV cache (ARCHITECTURE.md, decision 4).
//!
//! Storage is a pool of fixed-size blocks of `block_size` token positions. One block id covers every layer (each
//! layer has its own K and V buffers for it), and each sequence has a block table: position p of a sequence lives
//! in block `table[p / block_size]`, slot `p % block_size`. Several sequences share the pool, and may share blocks
//! (a forked prompt prefix); truncation (speculative rollback, prompt reuse) returns whole blocks at once.
//!
//! Two parts, one job each: `blocks::BlockManager` keeps the books (tables, free list, reference counts, each
//! block's home) and knows no bytes; a backend keeps the storage and executes the `BlockCopy`s the books hand it.
//! `cache::KvCache` is the CPU's storage (with `tiers`, blocks change precision by age and the oldest live in the
//! L3 `ring`); the CUDA backend holds its page pools in Python over the same books (`ninfer._core.BlockManager`).

pub mod blocks;
pub mod cache;
pub mod fitted_q4;
pub mod key_bias;
pub mod key_scales;
pub mod prefetch;
pub mod ring;
pub mod rotation;
pub mod shortlist;
pub mod tier_config;
pub mod tiers;

pub use blocks::{BlockCopy, BlockHome, BlockManager, Placement, Precision, SeqId};
pub use cache::{BlockView, KvCache, KvConfig};
pub use key_bias::{BiasTerm, KeyBias};
pub use key_scales::KeyScales;
pub use prefetch::PrefetchStats;
pub use shortlist::Shortlist;
pub use tier_config::{BlockScorer, KvMemory, TierConfig, TierUse};
