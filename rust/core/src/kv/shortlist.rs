//! What selection ranked last: per sequence, layer and KV head, the best blocks of the last decode step that ranked
//! every older block, so that the steps until the next such ranking rank only those (`TierConfig::rescan`).
//!
//! A decode step's query moves little from the last one's, and the blocks it needs are nearly always among the
//! best few times the budget of a ranking a few steps back; ranking every older block costs a product a key and
//! query head each step (on the CPU at depth 16K a third of a step), ranking the shortlist a few times the budget's.
//! Blocks that became older since the last full ranking are not on the list and are ranked with it.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use crate::kv::blocks::SeqId;

/// The shortlist holds this many times the budget's blocks.
pub const SHORTLIST_BUDGETS: usize = 4;

/// One (sequence, layer, KV head)'s list: the position of the step that ranked every older block, the first block
/// index past the older part then, and the best blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shortlist {
    pub pos: usize,
    pub end: usize,
    pub blocks: Vec<usize>,
}

#[derive(Default)]
pub struct Shortlists {
    lists: Mutex<HashMap<(SeqId, usize, usize), Shortlist>>,
}

impl Shortlists {
    fn lists(&self) -> MutexGuard<'_, HashMap<(SeqId, usize, usize), Shortlist>> {
        // (a panic elsewhere while it was held leaves plain data: still usable)
        self.lists.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The list a decode step at `pos` may rank instead of every older block: one made at most `rescan` - 1 steps
    /// before it (None: rank every older block, and keep the result with `keep`).
    pub fn get(&self, seq: SeqId, layer: usize, g: usize, pos: usize, rescan: usize) -> Option<Shortlist> {
        let lists = self.lists();
        let s = lists.get(&(seq, layer, g))?;
        (pos >= s.pos && pos - s.pos < rescan).then(|| s.clone())
    }

    pub fn keep(&self, seq: SeqId, layer: usize, g: usize, list: Shortlist) {
        self.lists().insert((seq, layer, g), list);
    }

    /// Drop `seq`'s lists: its contents changed other than by growing (truncation, removal, a fork into it).
    pub fn forget(&self, seq: SeqId) {
        self.lists().retain(|k, _| k.0 != seq);
    }

    /// Drop every list (the budget changed, and with it a list's length).
    pub fn clear(&self) {
        self.lists().clear();
    }
}
