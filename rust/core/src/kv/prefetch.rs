//! The prefetch thread of a tiered KV cache: it dequantizes the values of the L3 blocks a decode step chose, so that
//! the next step, which mostly chooses the same blocks (selections change slowly from token to token), finds them
//! ready in a hot buffer instead of widening 4-bit rows from the ring (and, with `--kv-l3-file`, faulting pages in)
//! on its critical path. Keys stay 4-bit: attention multiplies them as stored (int8 products), as selection does.
//!
//! Protocol: attention takes each L3 block it reads from here (`take`: a hit when staged, a stall when queued
//! and not yet done, a miss otherwise, when the caller dequantizes it itself the same way), then asks for the
//! blocks of the next step (`request`: this step's choice for the layer; the layer's other staged blocks are
//! dropped). The thread reads ring slots through raw pointers, so the cache waits for it to be idle
//! (`wait_idle`) before any change to the ring and drops a block's staged copies when its storage changes
//! (`invalidate`).

use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::quant::{dequantize_row, GgmlType};

/// The values of one layer of one L3 block, dequantized (stored basis): v [block_size * vd].
pub struct Staged {
    pub v: Vec<f32>,
}

impl Staged {
    /// Dequantize the V rows of `v_type` (row width vd) of one layer of a slot.
    pub fn dequantize(v: &[u8], v_type: GgmlType, vd: usize) -> Staged {
        let v_rb = v_type.row_bytes(vd).unwrap_or(1);
        let n = v.len() / v_rb;
        let mut s = Staged { v: vec![0.0; n * vd] };
        for i in 0..n {
            // Sizes were validated when the cache was built.
            let _ = dequantize_row(v_type, &v[i * v_rb..(i + 1) * v_rb], &mut s.v[i * vd..(i + 1) * vd]);
        }
        s
    }
}

/// Takes from the hot buffer: staged in time, waited for, or not asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    pub hits: u64,
    pub stalls: u64,
    pub misses: u64,
    /// Blocks (times layers) the thread dequantized.
    pub staged: u64,
}

/// One block's layer to stage: where its bytes are in the ring.
pub struct Job {
    pub block: u32,
    pub layer: usize,
    pub v: (*const u8, usize),
}

// SAFETY: the pointers address the ring's memory map, which outlives the thread (the prefetcher is dropped, and
// its thread joined, before the ring), and the ring is not changed while a job is pending (`wait_idle`).
unsafe impl Send for Job {}

struct State {
    ready: HashMap<(u32, usize), Arc<Staged>>,
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
    /// A thread staging blocks' V rows of `v_type` and width vd.
    pub fn new(v_type: GgmlType, vd: usize) -> Prefetcher {
        let shared = Arc::new(Shared {
            state: Mutex::new(State { ready: HashMap::new(), queued: HashSet::new(), stats: PrefetchStats::default() }),
            changed: Condvar::new(),
        });
        let (tx, rx) = channel::<Vec<Job>>();
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("ninfer-kv-prefetch".into())
            .spawn(move || {
                for batch in rx {
                    for job in batch {
                        // SAFETY: see `Job`.
                        let v = unsafe { std::slice::from_raw_parts(job.v.0, job.v.1) };
                        let staged = Arc::new(Staged::dequantize(v, v_type, vd));
                        let mut st = s.state.lock().unwrap_or_else(|e| e.into_inner());
                        if st.queued.remove(&(job.block, job.layer)) {
                            st.ready.insert((job.block, job.layer), staged);
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

    /// The staged copy of `block`'s `layer`, waiting for it if it is queued; None (a miss) if it was not asked for.
    pub fn take(&self, block: u32, layer: usize) -> Option<Arc<Staged>> {
        let mut st = self.state();
        if let Some(s) = st.ready.get(&(block, layer)).cloned() {
            st.stats.hits += 1;
            return Some(s);
        }
        if st.queued.contains(&(block, layer)) {
            st.stats.stalls += 1;
            while st.queued.contains(&(block, layer)) {
                st = self.shared.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            return st.ready.get(&(block, layer)).cloned();
        }
        st.stats.misses += 1;
        None
    }

    /// Stage `jobs` (all of one layer) for the next step; the layer's staged blocks not among them are dropped.
    pub fn request(&self, layer: usize, jobs: Vec<Job>) {
        let mut st = self.state();
        let wanted: HashSet<u32> = jobs.iter().map(|j| j.block).collect();
        st.ready.retain(|&(b, l), _| l != layer || wanted.contains(&b));
        let new: Vec<Job> = jobs
            .into_iter()
            .filter(|j| !st.ready.contains_key(&(j.block, layer)) && !st.queued.contains(&(j.block, layer)))
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

    /// Forget the staged copies of `block` (its storage is about to change).
    pub fn invalidate(&self, block: u32) {
        self.wait_idle();
        self.state().ready.retain(|&(b, _), _| b != block);
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
