//! The sampler thread: one dedicated OS thread that owns a `Sampler` per slot and samples a whole decode batch
//! at a time, so sampling never waits behind the matmul workers. It can be pinned to a core (`sched_setaffinity`)
//! and raised to SCHED_FIFO; when the process lacks the right, it runs unpinned / at normal priority and says so
//! once in `warnings`.
//!
//! Callers hand over the batch's logits (moved, not copied) and block on a one-shot reply channel. A slot's
//! sampler is created by `configure` (validated on the caller's thread, so a bad parameter is the caller's error).

use std::collections::HashMap;
use std::sync::mpsc::{channel, sync_channel, Sender, SyncSender};
use std::sync::Mutex;
use std::thread::JoinHandle;

use super::{top_logprobs, Sampler, SamplerParams};
use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadOptions {
    /// Pin the thread to this CPU core.
    pub core: Option<usize>,
    /// Run the thread under SCHED_FIFO (priority 1).
    pub realtime: bool,
}

/// One slot's draw: the token, and when the slot asked for `n_probs`, the token's log-probability and the
/// `n_probs` most likely tokens with theirs (from the raw logits).
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub probs: Option<(f32, Vec<(u32, f32)>)>,
}

struct Slot {
    sampler: Sampler,
    n_probs: usize,
}

enum Job {
    Configure { slot: u32, sampler: Box<Slot> },
    Accept { slot: u32, tokens: Vec<u32> },
    Mask { slot: u32, words: Vec<u32> },
    Remove { slot: u32 },
    /// logits: [slots.len(), n_vocab], row i for slots[i].
    Sample { slots: Vec<u32>, logits: Vec<f32>, reply: SyncSender<Result<Vec<Sampled>>> },
    /// logits: [drafts.len() + 1, n_vocab].
    Verify { slot: u32, logits: Vec<f32>, drafts: Vec<u32>, reply: SyncSender<Result<Vec<u32>>> },
}

pub struct SamplerThread {
    tx: Mutex<Option<Sender<Job>>>,
    handle: Option<JoinHandle<()>>,
    /// What could not be applied (pinning, real-time priority), one line each.
    pub warnings: Vec<String>,
}

fn gone() -> Error {
    Error::InvalidArgument("the sampler thread has stopped".into())
}

impl SamplerThread {
    pub fn spawn(opts: ThreadOptions) -> Result<SamplerThread> {
        let (tx, rx) = channel::<Job>();
        let (ready_tx, ready_rx) = sync_channel::<Vec<String>>(1);
        let handle = std::thread::Builder::new().name("ninfer-sampler".into()).spawn(move || {
            let _ = ready_tx.send(apply_options(opts));
            let mut samplers: HashMap<u32, Box<Slot>> = HashMap::new();
            for job in rx {
                match job {
                    Job::Configure { slot, sampler } => {
                        samplers.insert(slot, sampler);
                    }
                    Job::Accept { slot, tokens } => {
                        if let Some(s) = samplers.get_mut(&slot) {
                            s.sampler.accept(&tokens);
                        }
                    }
                    Job::Mask { slot, words } => {
                        if let Some(s) = samplers.get_mut(&slot) {
                            s.sampler.set_mask(words);
                        }
                    }
                    Job::Remove { slot } => {
                        samplers.remove(&slot);
                    }
                    Job::Sample { slots, logits, reply } => {
                        let _ = reply.send(sample_rows(&mut samplers, &slots, &logits));
                    }
                    Job::Verify { slot, logits, drafts, reply } => {
                        let _ = reply.send(verify_rows(&mut samplers, slot, &logits, &drafts));
                    }
                }
            }
        })?;
        let warnings = ready_rx.recv().map_err(|_| gone())?;
        Ok(SamplerThread { tx: Mutex::new(Some(tx)), handle: Some(handle), warnings })
    }

    fn send(&self, job: Job) -> Result<()> {
        let tx = self.tx.lock().map_err(|_| gone())?;
        tx.as_ref().ok_or_else(gone)?.send(job).map_err(|_| gone())
    }

    /// Give `slot` a fresh sampler (new seed, empty penalty window); `n_probs` > 0 also reports probabilities.
    pub fn configure(&self, slot: u32, params: SamplerParams, n_probs: usize) -> Result<()> {
        let sampler = Box::new(Slot { sampler: Sampler::new(params)?, n_probs });
        self.send(Job::Configure { slot, sampler })
    }

    /// Feed tokens (a prompt) into `slot`'s penalty window.
    pub fn accept(&self, slot: u32, tokens: Vec<u32>) -> Result<()> {
        self.send(Job::Accept { slot, tokens })
    }

    /// Allow only the tokens set in `words` (bit t % 32 of word t / 32) for `slot`'s next draw (constrained
    /// decoding); jobs run in order, so a mask sent before a `sample` applies to it.
    pub fn set_mask(&self, slot: u32, words: Vec<u32>) -> Result<()> {
        self.send(Job::Mask { slot, words })
    }

    pub fn remove(&self, slot: u32) -> Result<()> {
        self.send(Job::Remove { slot })
    }

    /// One draw per slot from logits [slots.len(), n_vocab].
    pub fn sample(&self, slots: Vec<u32>, logits: Vec<f32>) -> Result<Vec<Sampled>> {
        if slots.is_empty() || logits.is_empty() || !logits.len().is_multiple_of(slots.len()) {
            return Err(Error::InvalidArgument(format!(
                "{} logits do not split into rows for {} slots",
                logits.len(),
                slots.len()
            )));
        }
        let (reply, answer) = sync_channel(1);
        self.send(Job::Sample { slots, logits, reply })?;
        answer.recv().map_err(|_| gone())?
    }

    /// `Sampler::verify` on `slot`'s sampler: logits [drafts.len() + 1, n_vocab]; the accepted drafts plus one
    /// token (the replacement of the first rejected draft, or the bonus token).
    pub fn verify(&self, slot: u32, logits: Vec<f32>, drafts: Vec<u32>) -> Result<Vec<u32>> {
        let n_rows = drafts.len() + 1;
        if logits.is_empty() || !logits.len().is_multiple_of(n_rows) {
            return Err(Error::InvalidArgument(format!(
                "{} logits do not split into {n_rows} rows for {} drafts",
                logits.len(),
                drafts.len()
            )));
        }
        let (reply, answer) = sync_channel(1);
        self.send(Job::Verify { slot, logits, drafts, reply })?;
        answer.recv().map_err(|_| gone())?
    }
}

impl Drop for SamplerThread {
    fn drop(&mut self) {
        if let Ok(mut tx) = self.tx.lock() {
            tx.take();
        }
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn sample_rows(samplers: &mut HashMap<u32, Box<Slot>>, slots: &[u32], logits: &[f32]) -> Result<Vec<Sampled>> {
    let n_vocab = logits.len() / slots.len();
    let mut out = Vec::with_capacity(slots.len());
    for (&slot, row) in slots.iter().zip(logits.chunks_exact(n_vocab)) {
        let s = samplers
            .get_mut(&slot)
            .ok_or_else(|| Error::InvalidArgument(format!("slot {slot} has no sampler configured")))?;
        let token = s.sampler.sample(row)?;
        let probs = (s.n_probs > 0).then(|| top_logprobs(row, s.n_probs, token));
        out.push(Sampled { token, probs });
    }
    Ok(out)
}

fn verify_rows(samplers: &mut HashMap<u32, Box<Slot>>, slot: u32, logits: &[f32], drafts: &[u32]) -> Result<Vec<u32>> {
    let s = samplers
        .get_mut(&slot)
        .ok_or_else(|| Error::InvalidArgument(format!("slot {slot} has no sampler configured")))?;
    let rows: Vec<&[f32]> = logits.chunks_exact(logits.len() / (drafts.len() + 1)).collect();
    s.sampler.verify(&rows, drafts)
}

/// Pin and raise the calling thread as asked; a line for each thing the OS refused.
#[cfg(target_os = "linux")]
fn apply_options(opts: ThreadOptions) -> Vec<String> {
    let mut warnings = Vec::new();
    if let Some(core) = opts.core {
        // SAFETY: cpu_set_t is plain data; CPU_SET only writes inside it for core < CPU_SETSIZE (checked).
        let rc = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if core < libc::CPU_SETSIZE as usize {
                libc::CPU_SET(core, &mut set);
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
            } else {
                -1
            }
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            warnings.push(format!("sampler thread not pinned to core {core}: {e}; it runs on any core"));
        }
    }
    if opts.realtime {
        let param = libc::sched_param { sched_priority: 1 };
        // SAFETY: pthread_self is this thread; param is a valid sched_param.
        let rc = unsafe { libc::pthread_setschedparam(libc::pthread_self(), libc::SCHED_FIFO, &param) };
        if rc != 0 {
            let e = std::io::Error::from_raw_os_error(rc);
            warnings.push(format!(
                "sampler thread not raised to SCHED_FIFO: {e} (needs CAP_SYS_NICE or RLIMIT_RTPRIO); it runs at \
                 normal priority"
            ));
        }
    }
    warnings
}

#[cfg(not(target_os = "linux"))]
fn apply_options(opts: ThreadOptions) -> Vec<String> {
    let mut warnings = Vec::new();
    if opts.core.is_some() || opts.realtime {
        warnings.push("sampler thread pinning and SCHED_FIFO are only supported on Linux; ignored".into());
    }
    warnings
}

#[cfg(test)]
mod tests {
    use super::*;

    fn greedy() -> SamplerParams {
        SamplerParams { temperature: 0.0, ..Default::default() }
    }

    #[test]
    fn samples_a_batch_per_slot() {
        let t = SamplerThread::spawn(ThreadOptions::default()).unwrap();
        assert!(t.warnings.is_empty());
        let tokens = |v: Vec<Sampled>| v.into_iter().map(|s| s.token).collect::<Vec<_>>();
        t.configure(0, greedy(), 0).unwrap();
        t.configure(5, SamplerParams { logit_bias: vec![(2, 10.0)], ..greedy() }, 2).unwrap();
        let logits = vec![0.0, 1.0, 0.0, 0.0, 1.0, 0.0];
        let out = t.sample(vec![0, 5], logits.clone()).unwrap();
        assert_eq!(out[0].probs, None);
        // Slot 5 reports the raw logits' top 2 (token 1 first) and its biased draw's log-probability.
        let (lp, top) = out[1].probs.clone().unwrap();
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 0]);
        assert!(lp < top[0].1);
        assert_eq!(tokens(out), vec![1, 2]);
        // Penalties see the accepted prompt.
        t.configure(0, SamplerParams { repeat_penalty: 100.0, ..greedy() }, 0).unwrap();
        t.accept(0, vec![1]).unwrap();
        assert_eq!(tokens(t.sample(vec![0], vec![0.5, 1.0, 0.0]).unwrap()), vec![0]);
        // A mask applies to the slot's next draw only.
        t.set_mask(0, vec![0b100]).unwrap();
        assert_eq!(tokens(t.sample(vec![0], vec![0.5, 1.0, 0.0]).unwrap()), vec![2]);
        t.remove(5).unwrap();
        assert!(t.sample(vec![5], vec![0.0, 1.0, 0.0]).is_err());
        assert!(t.sample(vec![0, 5], vec![0.0; 5]).is_err());
        // Verify on the slot's sampler: tokens 1 and 0 (both in the window) score 0.01 and 0.005, so draft 0 is
        // rejected and replaced by 1; an uneven split, an unknown slot and an empty row are errors.
        assert_eq!(t.verify(0, vec![0.5, 1.0, 0.0, 0.5, 1.0, 0.0], vec![0]).unwrap(), vec![1]);
        assert!(t.verify(0, vec![0.0; 5], vec![1]).is_err());
        assert!(t.verify(5, vec![0.0; 4], vec![1]).is_err());
        assert!(t.verify(0, Vec::new(), vec![1]).is_err());
    }

    #[test]
    fn pins_or_says_why_not() {
        let t = SamplerThread::spawn(ThreadOptions { core: Some(0), realtime: true }).unwrap();
        // Core 0 always exists; SCHED_FIFO depends on the process's rights: either way, no panic and at most one
        // line per request.
        assert!(t.warnings.len() <= 2);
        let t = SamplerThread::spawn(ThreadOptions { core: Some(100_000), realtime: false }).unwrap();
        assert_eq!(t.warnings.len(), 1, "{:?}", t.warnings);
        t.configure(1, greedy(), 0).unwrap();
        assert_eq!(t.sample(vec![1], vec![0.0, 2.0]).unwrap()[0].token, 1);
    }
}
