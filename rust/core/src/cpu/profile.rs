//! Where the time of a forward pass goes, for `ninfer bench --profile`: wall time per kind of work, summed over
//! calls while profiling is on. Off (the default), a lap costs one relaxed atomic load.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// Kinds of work of the layer loop and the decode step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    /// Activation quantization and the quantized matrix products (the output head included).
    Matmul,
    /// KV cache writes and attention.
    Attention,
    /// Embedding lookup, norms, RoPE, biases, activations, residual adds, copies.
    Other,
    /// Turning logits into a token.
    Sampling,
}

const KINDS: usize = 4;

#[derive(Default)]
pub struct Profile {
    on: AtomicBool,
    ns: [AtomicU64; KINDS],
    forward_calls: AtomicU64,
}

impl Profile {
    pub fn set_enabled(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    pub fn enabled(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    pub fn reset(&self) {
        for a in &self.ns {
            a.store(0, Ordering::Relaxed);
        }
        self.forward_calls.store(0, Ordering::Relaxed);
    }

    /// Seconds per kind of work and the number of forward calls since the last reset.
    pub fn totals(&self) -> ([(Work, f64); KINDS], u64) {
        let s = |w: Work| (w, self.ns[w as usize].load(Ordering::Relaxed) as f64 * 1e-9);
        (
            [s(Work::Matmul), s(Work::Attention), s(Work::Other), s(Work::Sampling)],
            self.forward_calls.load(Ordering::Relaxed),
        )
    }

    pub(crate) fn count_forward(&self) {
        if self.enabled() {
            self.forward_calls.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A stopwatch whose laps are charged to kinds of work.
    pub fn laps(&self) -> Laps<'_> {
        Laps { profile: self, last: self.enabled().then(Instant::now) }
    }
}

pub struct Laps<'a> {
    profile: &'a Profile,
    last: Option<Instant>,
}

impl Laps<'_> {
    /// Charge the time since the previous lap (or the start) to `work`.
    #[inline]
    pub fn lap(&mut self, work: Work) {
        if let Some(last) = self.last {
            let now = Instant::now();
            self.profile.ns[work as usize].fetch_add((now - last).as_nanos() as u64, Ordering::Relaxed);
            self.last = Some(now);
        }
    }
}

impl Work {
    pub fn name(self) -> &'static str {
        match self {
            Work::Matmul => "matmul",
            Work::Attention => "attention",
            Work::Other => "other",
            Work::Sampling => "sampling",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_are_charged_only_while_enabled() {
        let p = Profile::default();
        let mut l = p.laps();
        std::thread::sleep(std::time::Duration::from_millis(2));
        l.lap(Work::Matmul);
        assert_eq!(p.totals().0[0].1, 0.0);
        p.set_enabled(true);
        // Bounds from the monotonic clock, not from guesses about how long a lap takes (a loaded CI machine
        // can stall any thread for milliseconds): the laps of one stopwatch add up to no more than the time
        // around them, which fails if a lap charged the time since the start again instead of since the last lap.
        let outer = Instant::now();
        let mut l = p.laps();
        std::thread::sleep(std::time::Duration::from_millis(2));
        l.lap(Work::Attention);
        l.lap(Work::Other);
        let around = outer.elapsed().as_secs_f64();
        let (t, _) = p.totals();
        assert!(t[1].1 >= 0.002, "{t:?}");
        assert!(t[1].1 + t[2].1 <= around, "{t:?} around {around}");
        assert_eq!((t[0].1, t[3].1), (0.0, 0.0));
        p.reset();
        assert_eq!(p.totals().0[1].1, 0.0);
    }
}
