//! Token sampling as a chain, in llama.cpp's order: logit bias, penalties (repetition, presence, frequency over
//! the last `repeat_last_n` tokens), top-k, typical, top-p, min-p, temperature, seeded draw. Temperature <= 0 is
//! greedy (argmax after bias and penalties, first index on ties). The same seed gives the same tokens.
//!
//! A sampler remembers the tokens it drew (and any prompt tokens given to `accept`) for the penalties.
//! A token mask (`set_mask`, constrained decoding: a grammar's allowed tokens as a bitmask) applies to the next
//! draw only, before everything else in the chain: a token whose bit is clear cannot be drawn.
//! `thread` runs samplers on a dedicated thread that can be pinned to a core and raised to SCHED_FIFO.

pub mod thread;

use std::collections::{HashMap, VecDeque};

use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct SamplerParams {
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0.0 disables.
    pub min_p: f32,
    /// Locally typical sampling; 1.0 disables.
    pub typical_p: f32,
    /// llama.cpp's repeat penalty: logits of recent tokens divided by it (multiplied when negative); 1.0 disables.
    pub repeat_penalty: f32,
    /// How many recent tokens the penalties look at; 0 disables them.
    pub repeat_last_n: usize,
    /// Subtracted once from the logit of every token present in the window; 0.0 disables.
    pub presence_penalty: f32,
    /// Subtracted per occurrence in the window; 0.0 disables.
    pub frequency_penalty: f32,
    /// (token, bias) added to the logits before anything else; -inf bans a token.
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            typical_p: 1.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }
}

impl SamplerParams {
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidArgument(what));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!("temperature must be a finite number >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.typical_p > 0.0 && self.typical_p <= 1.0) {
            return bad(format!("typical_p must be in (0, 1], got {}", self.typical_p));
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            return bad(format!("repeat_penalty must be a finite number > 0, got {}", self.repeat_penalty));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !v.is_finite() {
                return bad(format!("{name} must be a finite number, got {v}"));
            }
        }
        if let Some((t, b)) = self.logit_bias.iter().find(|(_, b)| b.is_nan() || *b == f32::INFINITY) {
            return bad(format!("logit_bias for token {t} must be a finite number or -inf, got {b}"));
        }
        Ok(())
    }

    fn penalties_on(&self) -> bool {
        self.repeat_last_n > 0
            && (self.repeat_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0)
    }
}

/// xoshiro256** seeded through splitmix64: small, fast and reproducible across platforms.
#[derive(Clone, Debug)]
struct Rng([u64; 4]);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^ (x >> 31)
        };
        Rng([next(), next(), next(), next()])
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

pub struct Sampler {
    pub params: SamplerParams,
    rng: Rng,
    /// The last `repeat_last_n` accepted tokens (only kept while a penalty is on).
    history: VecDeque<u32>,
    /// (token, logit or probability) candidates, reused between calls.
    cand: Vec<(u32, f32)>,
    /// The chain's final distribution as (token, weight), most likely first (`distribution`), reused.
    dist: Vec<(u32, f64)>,
    /// The next draw's allowed tokens: bit t % 32 of word t / 32 set for token t (tokens past it are banned).
    mask: Option<Vec<u32>>,
}

fn allowed(mask: &[u32], t: usize) -> bool {
    mask.get(t / 32).is_some_and(|w| (w >> (t % 32)) & 1 == 1)
}

/// The `n` most likely tokens under the softmax of the raw logits, as (token, log-probability), most likely first
/// (ties by token id), and the log-probability of `chosen`. What llama-server reports for `n_probs`.
pub fn top_logprobs(logits: &[f32], n: usize, chosen: u32) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().filter(|v| !v.is_nan()).map(|&v| ((v - max) as f64).exp()).sum();
    let log_z = max + (sum.ln() as f32);
    let lp = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v - log_z };
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let by_desc = |a: &u32, b: &u32| lp(logits[*b as usize]).total_cmp(&lp(logits[*a as usize])).then(a.cmp(b));
    let n = n.min(idx.len());
    if n > 0 && n < idx.len() {
        idx.select_nth_unstable_by(n - 1, by_desc);
    }
    idx.truncate(n);
    idx.sort_unstable_by(by_desc);
    let chosen_lp = logits.get(chosen as usize).map_or(f32::NEG_INFINITY, |&v| lp(v));
    (chosen_lp, idx.into_iter().map(|t| (t, lp(logits[t as usize]))).collect())
}

pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The first maximum among the tokens `mask` allows (NaN never wins); None if it allows none.
fn masked_argmax(logits: &[f32], mask: &[u32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (w, &bits) in mask.iter().enumerate() {
        let mut bits = bits;
        while bits != 0 {
            let t = w * 32 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            match logits.get(t) {
                Some(&v) if !v.is_nan() && best.is_none_or(|b| v > b.1) => best = Some((t, v)),
                Some(_) => {}
                None => return best.map(|b| b.0 as u32),
            }
        }
    }
    best.map(|b| b.0 as u32)
}

impl Sampler {
    pub fn new(params: SamplerParams) -> Result<Sampler> {
        params.validate()?;
        let rng = Rng::new(params.seed);
        Ok(Sampler { params, rng, history: VecDeque::new(), cand: Vec::new(), dist: Vec::new(), mask: None })
    }

    /// Allow only the tokens whose bit is set in `words` (bit t % 32 of word t / 32) for the next draw (`sample`,
    /// or the first row of `verify`); the mask is used once.
    pub fn set_mask(&mut self, words: Vec<u32>) {
        self.mask = Some(words);
    }

    /// Temperature 0: `sample` returns the first maximum.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0
    }

    /// Whether `sample` is a plain argmax of the logits (greedy with no bias and no penalty), which the GPU
    /// backend may compute on the device.
    pub fn is_plain_argmax(&self) -> bool {
        self.is_greedy() && self.params.logit_bias.is_empty() && !self.params.penalties_on()
    }

    /// Record tokens for the penalties' window (the prompt, as llama-server does; drawn tokens are recorded by
    /// `sample` itself).
    pub fn accept(&mut self, tokens: &[u32]) {
        if !self.params.penalties_on() {
            return;
        }
        let n = self.params.repeat_last_n;
        for &t in tokens.iter().skip(tokens.len().saturating_sub(n)) {
            if self.history.len() == n {
                self.history.pop_front();
            }
            self.history.push_back(t);
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        let t = self.draw(logits)?;
        self.accept(&[t]);
        Ok(t)
    }

    /// Verify drafted tokens by rejection sampling (Leviathan et al. 2023; Chen et al. 2023) for a deterministic
    /// proposer, whose proposal is one-hot at each drafted token. rows: [drafts.len() + 1][n_vocab], row i the
    /// logits after the prefix plus drafts[..i]. For each draft: accept it with probability p(draft) under the
    /// chain's distribution for its row (the penalties see the tokens accepted so far); on a rejection, draw the
    /// replacement from p with the draft removed and renormalised, and stop. All accepted: a bonus token from the
    /// last row. Returns the accepted drafts plus the replacement or bonus token, each recorded for the
    /// penalties. The output tokens are distributed exactly as successive `sample` calls would draw them; greedy
    /// samplers give exactly those tokens (and touch no random state).
    pub fn verify(&mut self, rows: &[&[f32]], drafts: &[u32]) -> Result<Vec<u32>> {
        if rows.len() != drafts.len() + 1 {
            return Err(Error::InvalidArgument(format!(
                "verify needs one logits row per draft plus one, got {} rows for {} drafts",
                rows.len(),
                drafts.len()
            )));
        }
        if let Some(i) = rows.iter().position(|r| r.is_empty() || r.iter().any(|v| v.is_nan())) {
            return Err(Error::InvalidArgument(format!("logits row {i} is empty or holds NaN")));
        }
        let mut out = Vec::with_capacity(rows.len());
        for (row, &draft) in rows.iter().zip(drafts) {
            let total = self.distribution(row)?;
            let token = if self.is_greedy() {
                self.dist[0].0
            } else {
                let w = self.dist.iter().find(|c| c.0 == draft).map_or(0.0, |c| c.1);
                if self.rng.uniform() < w / total {
                    draft
                } else {
                    let u = self.rng.uniform();
                    pick(&self.dist, u, Some(draft))
                }
            };
            self.accept(&[token]);
            out.push(token);
            if token != draft {
                return Ok(out);
            }
        }
        out.push(self.sample(rows[drafts.len()])?);
        Ok(out)
    }

    fn draw(&mut self, logits: &[f32]) -> Result<u32> {
        self.distribution(logits)?;
        if self.is_greedy() {
            return Ok(self.dist[0].0);
        }
        let u = self.rng.uniform();
        Ok(pick(&self.dist, u, None))
    }

    /// The chain's final distribution over the surviving candidates: fills `self.dist` with (token, weight), most
    /// likely first, and returns the weights' sum (a token's probability is weight / sum; candidates not listed
    /// have probability 0). Greedy: the first maximum alone, weight 1.
    fn distribution(&mut self, logits: &[f32]) -> Result<f64> {
        self.dist.clear();
        if logits.is_empty() {
            return Err(Error::InvalidArgument("cannot sample from an empty logits vector".into()));
        }
        let mask = self.mask.take();
        if self.is_plain_argmax() {
            let t = match &mask {
                None => argmax(logits),
                Some(m) => masked_argmax(logits, m).ok_or_else(|| {
                    Error::InvalidArgument("every logit is NaN or not allowed by the token mask".into())
                })?,
            };
            self.dist.push((t, 1.0));
            return Ok(1.0);
        }
        let p = &self.params;
        let cand = &mut self.cand;
        cand.clear();
        cand.extend(logits.iter().enumerate().map(|(i, &v)| (i as u32, v)));
        if let Some(m) = &mask {
            for (i, c) in cand.iter_mut().enumerate() {
                if !allowed(m, i) {
                    c.1 = f32::NEG_INFINITY;
                }
            }
        }
        // Logit bias, then penalties, on the full vocabulary (candidate i is token i here).
        for &(t, b) in &p.logit_bias {
            let c = cand.get_mut(t as usize).ok_or_else(|| {
                Error::InvalidArgument(format!("logit_bias names token {t}, past the vocabulary of {}", logits.len()))
            })?;
            c.1 += b;
        }
        if p.penalties_on() {
            let mut counts: HashMap<u32, u32> = HashMap::new();
            for &t in &self.history {
                *counts.entry(t).or_default() += 1;
            }
            for (t, n) in counts {
                if let Some(c) = cand.get_mut(t as usize) {
                    c.1 = if c.1 <= 0.0 { c.1 * p.repeat_penalty } else { c.1 / p.repeat_penalty };
                    c.1 -= n as f32 * p.frequency_penalty + p.presence_penalty;
                }
            }
        }
        cand.retain(|c| !c.1.is_nan() && c.1 != f32::NEG_INFINITY);
        if cand.is_empty() {
            let why = if mask.is_some() { ", or not allowed by the token mask" } else { "" };
            return Err(Error::InvalidArgument(format!("every logit is NaN or banned (-inf){why}")));
        }
        let by_logit_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.temperature <= 0.0 {
            let first_max = cand.iter().min_by(|a, b| by_logit_desc(a, b)).map_or(0, |c| c.0);
            self.dist.push((first_max, 1.0));
            return Ok(1.0);
        }
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, by_logit_desc);
            cand.truncate(p.top_k);
        }
        cand.sort_unstable_by(by_logit_desc);
        // Probabilities of the surviving candidates (softmax on the untempered logits, as llama.cpp's filters do).
        let softmax = |cand: &[(u32, f32)]| -> Vec<f32> {
            let max = cand[0].1;
            let e: Vec<f32> = cand.iter().map(|c| (c.1 - max).exp()).collect();
            let total: f32 = e.iter().sum();
            e.into_iter().map(|v| v / total).collect()
        };
        if p.typical_p < 1.0 {
            // Keep the tokens whose surprise is closest to the entropy, up to typical_p of the mass.
            let probs = softmax(cand);
            let entropy: f32 = probs.iter().filter(|&&q| q > 0.0).map(|&q| -q * q.ln()).sum();
            let mut order: Vec<usize> = (0..cand.len()).collect();
            let shift = |i: usize| (-probs[i].ln() - entropy).abs();
            order.sort_by(|&a, &b| shift(a).total_cmp(&shift(b)).then(a.cmp(&b)));
            let mut cum = 0.0;
            let mut keep = order.len();
            for (i, &j) in order.iter().enumerate() {
                cum += probs[j];
                if cum > p.typical_p {
                    keep = i + 1;
                    break;
                }
            }
            let kept: Vec<(u32, f32)> = order[..keep].iter().map(|&j| cand[j]).collect();
            *cand = kept;
            cand.sort_unstable_by(by_logit_desc);
        }
        let probs = softmax(cand);
        let mut keep = cand.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, pr) in probs.iter().enumerate() {
                cum += pr;
                if cum >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            // probs[0] is the largest: keep tokens with p >= min_p * p_max.
            keep = keep.min(probs.iter().take_while(|&&pr| pr >= p.min_p * probs[0]).count().max(1));
        }
        cand.truncate(keep);
        // Temperature: the weights of the renormalised distribution the seeded draw samples from.
        let max = cand[0].1;
        let temperature = p.temperature;
        self.dist.extend(cand.iter().map(|c| (c.0, (((c.1 - max) / temperature) as f64).exp())));
        Ok(self.dist.iter().map(|c| c.1).sum())
    }
}

/// Inverse-CDF draw from (token, weight) with u in [0, 1), `skip` (a rejected draft) left out and the rest
/// renormalised; the last candidate when rounding runs past the end.
fn pick(dist: &[(u32, f64)], u: f64, skip: Option<u32>) -> u32 {
    let kept = || dist.iter().filter(move |c| Some(c.0) != skip);
    let total: f64 = kept().map(|c| c.1).sum();
    let mut r = u * total;
    for &(t, w) in kept() {
        if r < w {
            return t;
        }
        r -= w;
    }
    kept().next_back().or(dist.last()).map_or(0, |c| c.0)
}

#[cfg(test)]
mod tests;
