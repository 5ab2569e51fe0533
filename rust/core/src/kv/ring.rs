//! The L3 ring of a tiered KV cache: fixed-size slots, one per block that has moved to the oldest tier, in one
//! memory map. Anonymous memory by default (pages become resident only when a slot is first written), or a file
//! (`--kv-l3-file`) for contexts past RAM, whose pages the kernel may write back and drop under memory pressure.
//!
//! Slots are handed out in order and reused from a free list when their blocks are freed, so the map's touched
//! part is as large as the most blocks that were in L3 at once.

use std::fs::OpenOptions;
use std::path::Path;

use memmap2::{MmapMut, MmapOptions};

use crate::error::{Error, Result};

pub struct Ring {
    map: MmapMut,
    slot_bytes: usize,
    n_slots: usize,
    /// Slots handed out so far: 0..next; the free ones among them are in `free`.
    next: usize,
    free: Vec<usize>,
}

impl Ring {
    /// A ring of `n_slots` slots of `slot_bytes`, in anonymous memory, or in the file at `path` (created or
    /// truncated, sized to the whole ring; a sparse file on file systems that have them).
    pub fn new(slot_bytes: usize, n_slots: usize, path: Option<&Path>) -> Result<Ring> {
        let len = slot_bytes
            .checked_mul(n_slots)
            .ok_or_else(|| Error::InvalidArgument(format!("an L3 ring of {n_slots} slots of {slot_bytes} bytes")))?
            .max(1);
        let map = match path {
            None => MmapOptions::new()
                .len(len)
                .map_anon()
                .map_err(|e| Error::InvalidArgument(format!("cannot map {len} bytes for the L3 KV ring: {e}")))?,
            Some(p) => {
                let what = |e: std::io::Error| {
                    Error::InvalidArgument(format!("L3 KV file {}: {e}", p.display()))
                };
                let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(p).map_err(what)?;
                file.set_len(len as u64).map_err(what)?;
                // SAFETY: the file was just created or truncated by this process and is used only through this map.
                unsafe { MmapOptions::new().len(len).map_mut(&file) }.map_err(what)?
            }
        };
        Ok(Ring { map, slot_bytes, n_slots, next: 0, free: Vec::new() })
    }

    /// A slot for a block; None when every slot is held.
    pub fn alloc(&mut self) -> Option<usize> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        (self.next < self.n_slots).then(|| {
            self.next += 1;
            self.next - 1
        })
    }

    pub fn release(&mut self, slot: usize) {
        debug_assert!(slot < self.next && !self.free.contains(&slot));
        self.free.push(slot);
    }

    pub fn slot(&self, slot: usize) -> &[u8] {
        &self.map[slot * self.slot_bytes..(slot + 1) * self.slot_bytes]
    }

    pub fn slot_mut(&mut self, slot: usize) -> &mut [u8] {
        &mut self.map[slot * self.slot_bytes..(slot + 1) * self.slot_bytes]
    }

    /// Slots held by blocks now.
    pub fn slots_in_use(&self) -> usize {
        self.next - self.free.len()
    }

    /// Bytes of the map ever written (the most slots in use at once): its resident part, unless the kernel has
    /// written a file's pages back.
    pub fn touched_bytes(&self) -> usize {
        self.next * self.slot_bytes
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_reused_and_a_file_holds_the_bytes() {
        let dir = std::env::temp_dir().join(format!("ninfer-ring-test-{}", std::process::id()));
        for path in [None, Some(dir.as_path())] {
            let mut r = Ring::new(100, 3, path).unwrap();
            let (a, b) = (r.alloc().unwrap(), r.alloc().unwrap());
            r.slot_mut(b).fill(7);
            assert_eq!((a, b, r.slots_in_use(), r.touched_bytes()), (0, 1, 2, 200));
            r.release(a);
            assert_eq!(r.alloc(), Some(0));
            assert_eq!(r.alloc(), Some(2));
            assert_eq!(r.alloc(), None, "every slot held");
            assert!(r.slot(1).iter().all(|&x| x == 7) && r.slot(2).iter().all(|&x| x == 0));
            if let Some(p) = path {
                r.map.flush().unwrap();
                let bytes = std::fs::read(p).unwrap();
                assert_eq!(bytes.len(), 300);
                assert!(bytes[100..200].iter().all(|&x| x == 7));
            }
        }
        let _ = std::fs::remove_file(&dir);
        let e = Ring::new(10, 1, Some(Path::new("/nonexistent-dir/x"))).err().unwrap().to_string();
        assert!(e.contains("L3 KV file /nonexistent-dir/x"), "{e}");
    }
}
