//! The prefetch thread of a tiered KV cache: it brings the L3 blocks a decode step chose into memory for the next
//! step, which mostly chooses the same blocks (selections change slowly from token to token), so that with
//! `--kv-l3-file` their pages are faulted in off the critical path. Attention reads L3 blocks in place, keys and
//! values 4-bit as stored (int8 products for the keys, one 4-bit value row widened at a time): a hot buffer of
//! dequantized values cost more than it saved on the CPU, where the buffer's widening competes with attention for
//! the same cores and the whole block is widened for every KV head while each head reads only its own choice
//! (docs/journal/kv-selection-scorers.md).
//!
//! Protocol: attention takes each L3 block it reads from here (`take`: a hit when brought in, a stall when queued
//! and not yet done, a miss otherwise, when the read itself faults what is missing in), then asks for the blocks of
//! the next step (`request`: this step's choice for the layer; the layer's other blocks are forgotten). The thread
//! reads ring slots through raw pointers, so the cache waits for it to be idle (`wait_idle`) before any change to
//! the ring and forgets a block when its storage changes (`invalidate`).

use std::collections::HashSet;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// Touch one byte of every page of `bytes` (and its last byte), so that a file-backed map's pages are read in.
fn touch(bytes: &[u8]) {
    const PAGE: usize = 4096;
    for i in (0..bytes.len()).step_by(PAGE).chain(bytes.len().checked_sub(1)) {
        // SAFETY: i < bytes.len(); a volatile read so the load is not optimised away.
        unsafe { std::ptr::read_volatile(bytes.as_ptr().add(i)) };
    }
}

/// Takes of L3 blocks: brought in in time, waited for, or not asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    pub hits: u64,
    pub stalls: u64,
    pub misses: u64,
    /// Blocks (times layers) the thread brought in.
    pub staged: u64,
}

/// One block's layer to bring in: where its K and V bytes are in the ring.
pub struct Job {
    pub block: u32,
    pub layer: usize,
    pub k: (*const u8, usize),
    pub v: (*const u8, usize),
}

// SAFETY: the pointers address the ring's memory map, which outlives the thread (the prefetcher is dropped, and
// its thread joined, before the ring), and the ring is not changed while a job is pending (`wait_idle`).
unsafe impl Send for Job {}

struct State {
    ready: HashSet<(u32, usize)>,
    queued: HashSet<(u32, usize)>,
    stats: PrefetchStats,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

pub struct Prefetcher {
    jobs: Option<Sender<Vec<Job>>>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Prefetcher {
    /// A thread bringing blocks in.
    pub fn new() -> Prefetcher {
        let shared = Arc::new(Shared {
            state: Mutex::new(State { ready: HashSet::new(), queued: HashSet::new(), stats: PrefetchStats::default() }),
            changed: Condvar::new(),
        });
        let (tx, rx) = channel::<Vec<Job>>();
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("ninfer-kv-prefetch".into())
            .spawn(move || {
                for batch in rx {
                    for job in batch {
                        for (ptr, len) in [job.k, job.v] {
                            // SAFETY: see `Job`.
                            touch(unsafe { std::slice::from_raw_parts(ptr, len) });
                        }
                        let mut st = s.state.lock().unwrap_or_else(|e| e.into_inner());
                        if st.queued.remove(&(job.block, job.layer)) {
                            st.ready.insert((job.block, job.layer));
                            st.stats.staged += 1;
                        }
                        s.changed.notify_all();
                    }
                }
            })
            .expect("spawning the KV prefetch thread");
        Prefetcher { jobs: Some(tx), shared, thread: Some(thread) }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Count a read of `block`'s `layer`: brought in (a hit), queued (a stall: waits for it), or not asked for (a
    /// miss).
    pub fn take(&self, block: u32, layer: usize) {
        let mut st = self.state();
        if st.ready.contains(&(block, layer)) {
            st.stats.hits += 1;
            return;
        }
        if st.queued.contains(&(block, layer)) {
            st.stats.stalls += 1;
            while st.queued.contains(&(block, layer)) {
                st = self.shared.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            return;
        }
        st.stats.misses += 1;
    }

    /// Bring `jobs` (all of one layer) in for the next step; the layer's blocks not among them are forgotten.
    pub fn request(&self, layer: usize, jobs: Vec<Job>) {
        let mut st = self.state();
        let wanted: HashSet<u32> = jobs.iter().map(|j| j.block).collect();
        st.ready.retain(|&(b, l)| l != layer || wanted.contains(&b));
        let new: Vec<Job> = jobs
            .into_iter()
            .filter(|j| !st.ready.contains(&(j.block, layer)) && !st.queued.contains(&(j.block, layer)))
            .collect();
        if new.is_empty() {
            return;
        }
        st.queued.extend(new.iter().map(|j| (j.block, layer)));
        drop(st);
        if let Some(tx) = &self.jobs {
            let _ = tx.send(new);
        }
    }

    /// Wait until no job is queued (before the ring changes).
    pub fn wait_idle(&self) {
        let mut st = self.state();
        while !st.queued.is_empty() {
            st = self.shared.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Forget `block` (its storage is about to change).
    pub fn invalidate(&self, block: u32) {
        self.wait_idle();
        self.state().ready.retain(|&(b, _)| b != block);
    }

    pub fn stats(&self) -> PrefetchStats {
        self.state().stats
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        self.jobs.take(); // the thread's loop ends when the channel closes
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
