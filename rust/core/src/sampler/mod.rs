//! Token sampling as a chain, in llama.cpp's order: logit bias, penalties (repetition, presence, frequency over
//! the last `repeat_last_n` tokens), top-k, typical, top-p, min-p, temperature, seeded draw. Temperature <= 0 is
//! greedy (argmax after bias and penalties, first index on ties). The same seed gives the same tokens.
//!
//! A sampler remembers the tokens it drew (and any prompt tokens given to `accept`) for the penalties.
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

impl Sampler {
    pub fn new(params: SamplerParams) -> Result<Sampler> {
        params.validate()?;
        let rng = Rng::new(params.seed);
        Ok(Sampler { params, rng, history: VecDeque::new(), cand: Vec::new(), dist: Vec::new() })
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
        if self.is_plain_argmax() {
            self.dist.push((argmax(logits), 1.0));
            return Ok(1.0);
        }
        let p = &self.params;
        let cand = &mut self.cand;
        cand.clear();
        cand.extend(logits.iter().enumerate().map(|(i, &v)| (i as u32, v)));
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
            return Err(Error::InvalidArgument("every logit is NaN or banned (-inf)".into()));
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
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplerParams {
        SamplerParams { temperature, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 7, ..Default::default() }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(params(0.0)).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]).unwrap(), 1);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let draw = || {
            let mut s = Sampler::new(params(1.0)).unwrap();
            (0..50).map(|_| s.sample(&logits).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(draw(), draw());
        assert!(draw().iter().any(|&t| t != draw()[0]), "temperature 1 must not be greedy");
    }

    #[test]
    fn filters_restrict_the_support() {
        let logits = [5.0f32, 4.0, 1.0, 0.0, -3.0];
        let mut s = Sampler::new(SamplerParams { top_k: 2, ..params(5.0) }).unwrap();
        assert!((0..200).all(|_| s.sample(&logits).unwrap() < 2));
        // p(0) ~ 0.72, p(1) ~ 0.27: top_p 0.5 keeps only token 0.
        let mut s = Sampler::new(SamplerParams { top_p: 0.5, ..params(5.0) }).unwrap();
        assert!((0..200).all(|_| s.sample(&logits).unwrap() == 0));
        // min_p 0.3: p(1)/p(0) = e^-1 ~ 0.37 survives, p(2)/p(0) ~ 0.018 does not.
        let mut s = Sampler::new(SamplerParams { min_p: 0.3, ..params(5.0) }).unwrap();
        let seen: std::collections::BTreeSet<u32> = (0..400).map(|_| s.sample(&logits).unwrap()).collect();
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![0, 1]);
    }

    #[test]
    fn rejects_bad_parameters() {
        assert!(Sampler::new(SamplerParams { top_p: 0.0, ..params(1.0) }).is_err());
        assert!(Sampler::new(params(f32::NAN)).is_err());
        assert!(Sampler::new(SamplerParams { min_p: 2.0, ..params(1.0) }).is_err());
    }

    #[test]
    fn logit_bias_and_penalties_move_the_greedy_choice() {
        let logits = [1.0f32, 3.0, 2.0, -1.0];
        let mut s = Sampler::new(SamplerParams { logit_bias: vec![(3, 5.0)], ..params(0.0) }).unwrap();
        assert_eq!(s.sample(&logits).unwrap(), 3);
        let mut s = Sampler::new(SamplerParams { logit_bias: vec![(1, f32::NEG_INFINITY)], ..params(0.0) }).unwrap();
        assert_eq!(s.sample(&logits).unwrap(), 2);
        // Repeat penalty 2: token 1 (seen) drops to 1.5 < 2.0; a negative logit is multiplied, not divided.
        let mut s = Sampler::new(SamplerParams { repeat_penalty: 2.0, ..params(0.0) }).unwrap();
        s.accept(&[1, 3]);
        assert_eq!(s.sample(&logits).unwrap(), 2);
        // The draw itself is remembered: token 2 (now seen) drops to 1.0, below token 1's 1.5.
        assert_eq!(s.sample(&logits).unwrap(), 1);
        // Presence 1.5 and frequency 0.5 on token 1 seen twice: 3 - 1.5 - 1.0 = 0.5 < 2.0 (token 2).
        let mut s =
            Sampler::new(SamplerParams { presence_penalty: 1.5, frequency_penalty: 0.5, ..params(0.0) }).unwrap();
        s.accept(&[1, 1]);
        assert_eq!(s.sample(&logits).unwrap(), 2);
        // Outside the window the penalty no longer applies.
        let mut s = Sampler::new(SamplerParams { repeat_penalty: 10.0, repeat_last_n: 1, ..params(0.0) }).unwrap();
        s.accept(&[1, 0]);
        assert_eq!(s.sample(&logits).unwrap(), 1);
        // Without penalties or bias, greedy stays the plain argmax.
        assert!(Sampler::new(params(0.0)).unwrap().is_plain_argmax());
        assert!(!Sampler::new(SamplerParams { repeat_penalty: 1.1, ..params(0.0) }).unwrap().is_plain_argmax());
    }

    #[test]
    fn top_logprobs_are_the_log_softmax() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let (chosen, top) = top_logprobs(&logits, 3, 2);
        let z = logits.iter().map(|v| v.exp()).sum::<f32>().ln();
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        assert!((top[0].1 - (3.0 - z)).abs() < 1e-6 && (chosen - (2.0 - z)).abs() < 1e-6);
        assert_eq!(top_logprobs(&logits, 10, 0).1.len(), 4);
    }

    #[test]
    fn typical_keeps_the_tokens_nearest_the_entropy() {
        // Token 0 has p = 0.742 (surprise 0.30) and 19 tail tokens p = 0.0136 each (surprise 4.30); the entropy is
        // 1.33, so token 0 is the most typical and, holding more than 0.2 of the mass, the only one kept.
        let mut logits = vec![0.0f32; 20];
        logits[0] = 4.0;
        let mut s = Sampler::new(SamplerParams { typical_p: 0.2, ..params(1.0) }).unwrap();
        assert!((0..300).all(|_| s.sample(&logits).unwrap() == 0));
        let mut s = Sampler::new(params(1.0)).unwrap();
        assert!((0..300).any(|_| s.sample(&logits).unwrap() != 0));
    }

    #[test]
    fn rejects_bad_chain_parameters() {
        assert!(Sampler::new(SamplerParams { typical_p: 0.0, ..params(1.0) }).is_err());
        assert!(Sampler::new(SamplerParams { repeat_penalty: 0.0, ..params(1.0) }).is_err());
        assert!(Sampler::new(SamplerParams { presence_penalty: f32::NAN, ..params(1.0) }).is_err());
        assert!(Sampler::new(SamplerParams { logit_bias: vec![(0, f32::INFINITY)], ..params(1.0) }).is_err());
        let mut s = Sampler::new(SamplerParams { logit_bias: vec![(9, 1.0)], ..params(1.0) }).unwrap();
        assert!(s.sample(&[0.0, 1.0]).is_err());
        let mut s = Sampler::new(SamplerParams { logit_bias: vec![(0, f32::NEG_INFINITY)], ..params(1.0) }).unwrap();
        assert!(s.sample(&[0.0]).is_err());
    }
    /// The chain's distribution for `row` as probabilities by token (0 for tokens the filters drop).
    fn probs(s: &mut Sampler, row: &[f32]) -> Vec<f64> {
        let total = s.distribution(row).unwrap();
        let mut p = vec![0.0; row.len()];
        for &(t, w) in &s.dist {
            p[t as usize] = w / total;
        }
        p
    }

    /// Pearson's chi-square of `counts` against `p` (infinite when a token of probability 0 occurs), and the total
    /// variation distance.
    fn chi_square(counts: &[u64], p: &[f64]) -> (f64, f64) {
        let n: u64 = counts.iter().sum();
        let mut chi2 = 0.0;
        let mut tv = 0.0;
        for (&c, &q) in counts.iter().zip(p) {
            let expect = q * n as f64;
            chi2 += if q > 0.0 { (c as f64 - expect).powi(2) / expect } else if c > 0 { f64::INFINITY } else { 0.0 };
            tv += (c as f64 / n as f64 - q).abs() / 2.0;
        }
        (chi2, tv)
    }

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Rule {
        Verify,
        /// Wrong: accept the draft whenever p(draft) > 0.
        AcceptIfPossible,
        /// Wrong: on a rejection, draw the replacement from p itself (the draft not removed).
        ReplaceFromP,
    }

    /// The first token out of a K = 1 verification under `rule`.
    fn first_token(s: &mut Sampler, row: &[f32], draft: u32, rule: Rule) -> u32 {
        if rule == Rule::Verify {
            return s.verify(&[row, row], &[draft]).unwrap()[0];
        }
        let total = s.distribution(row).unwrap();
        let w = s.dist.iter().find(|c| c.0 == draft).map_or(0.0, |c| c.1);
        let accept = if rule == Rule::AcceptIfPossible { w > 0.0 } else { s.rng.uniform() < w / total };
        if accept {
            draft
        } else {
            let u = s.rng.uniform();
            pick(&s.dist, u, if rule == Rule::ReplaceFromP { None } else { Some(draft) })
        }
    }

    #[test]
    fn verify_draws_the_first_token_from_p() {
        // Top-k 5 drops token 5, min-p 0.1 drops token 4 (e^-3 ~ 0.05 of the maximum); at temperature 0.7 the
        // rest have p ~ (0.542, 0.265, 0.130, 0.063). Draft 1 is a candidate, draft 4 is not (p = 0).
        let row = [2.0f32, 1.5, 1.0, 0.5, -1.0, -3.0];
        let sampler = || {
            Sampler::new(SamplerParams { temperature: 0.7, top_k: 5, min_p: 0.1, top_p: 1.0, ..params(0.7) }).unwrap()
        };
        let p = probs(&mut sampler(), &row);
        assert!(p[4] == 0.0 && p[5] == 0.0 && (p[1] - 0.265).abs() < 1e-3, "{p:?}");
        // 3 degrees of freedom: P(chi2 > 35) ~ 1e-7 for a correct rule; a wrong rule moves p(draft 1) from 0.265
        // to 1 or to 0.46, a chi-square in the thousands at this n.
        let n = 100_000;
        let run = |draft: u32, rule: Rule| {
            let mut s = sampler();
            let mut counts = [0u64; 6];
            for _ in 0..n {
                counts[first_token(&mut s, &row, draft, rule) as usize] += 1;
            }
            let (chi2, tv) = chi_square(&counts, &p);
            eprintln!("draft {draft} {rule:?}: chi2 {chi2:.2} (3 df), total variation {tv:.4}, counts {counts:?}");
            chi2
        };
        assert!(run(1, Rule::Verify) < 35.0);
        assert!(run(4, Rule::Verify) < 35.0);
        assert!(run(1, Rule::AcceptIfPossible) > 1000.0);
        assert!(run(1, Rule::ReplaceFromP) > 1000.0);
    }

    #[test]
    fn greedy_verify_equals_successive_samples() {
        // 5 rows of 40 logits in 0.0..4.0 with many ties (only 9 values), and a row whose maximum appears twice.
        let mut rows: Vec<Vec<f32>> =
            (0..5).map(|r| (0..40).map(|i| ((i * 7 + r * 13) % 9) as f32 * 0.5).collect()).collect();
        rows[2][3] = 9.0;
        rows[2][30] = 9.0;
        let refs: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        for p in [params(0.0), SamplerParams { repeat_penalty: 1.5, ..params(0.0) }] {
            let firsts: Vec<u32> = rows.iter().map(|r| argmax(r)).collect();
            // All accepted; a mismatch at 0; the second maximum of row 2 (the first maximum wins); out of vocab.
            let tie = vec![firsts[0], firsts[1], 30, 0];
            for drafts in [firsts[..4].to_vec(), vec![firsts[0] + 1, 0, 0, 0], tie, vec![99; 4]] {
                let mut chain = Sampler::new(p.clone()).unwrap();
                let mut want = Vec::new();
                for (i, row) in rows.iter().enumerate() {
                    want.push(chain.sample(row).unwrap());
                    if i == 4 || want[i] != drafts[i] {
                        break;
                    }
                }
                let mut s = Sampler::new(p.clone()).unwrap();
                assert_eq!(s.verify(&refs, &drafts).unwrap(), want, "{p:?} {drafts:?}");
                // The same window afterwards: the next draws agree too.
                assert_eq!(s.sample(&rows[0]).unwrap(), chain.sample(&rows[0]).unwrap());
            }
        }
        let f: Vec<u32> = rows.iter().map(|r| argmax(r)).collect();
        let tie = Sampler::new(params(0.0)).unwrap().verify(&refs, &[f[0], f[1], 30, 0]).unwrap();
        assert_eq!(tie, vec![f[0], f[1], 3]);
    }

    #[test]
    fn verify_penalties_see_the_accepted_prefix() {
        // Repeat penalty 2: accepting draft 1 lowers token 1 in row 1 to 1.5, below token 2's 2.0, so draft 2 is
        // the argmax there and accepted; the bonus row sees both (1.5 against 1.0 and 1.0).
        let logits = [1.0f32, 3.0, 2.0];
        let mut s = Sampler::new(SamplerParams { repeat_penalty: 2.0, ..params(0.0) }).unwrap();
        assert_eq!(s.verify(&[&logits, &logits, &logits], &[1, 2]).unwrap(), vec![1, 2, 1]);
        // Without the penalty row 1's argmax stays 1: draft 2 is rejected.
        let mut s = Sampler::new(params(0.0)).unwrap();
        assert_eq!(s.verify(&[&logits, &logits, &logits], &[1, 2]).unwrap(), vec![1, 1]);
    }

    #[test]
    fn verify_rejects_bad_rows() {
        let mut s = Sampler::new(params(1.0)).unwrap();
        assert!(s.verify(&[&[0.0, 1.0]], &[1]).is_err());
        assert!(s.verify(&[&[0.0, 1.0], &[]], &[1]).is_err());
        assert!(s.verify(&[&[f32::NAN, f32::NAN], &[0.0, 1.0]], &[1]).is_err());
        let mut g = Sampler::new(params(0.0)).unwrap();
        assert!(g.verify(&[&[0.0, f32::NAN], &[0.0, 1.0]], &[1]).is_err());
        // A draft past the vocabulary is never accepted, and a verify with no drafts is one draw.
        assert_eq!(g.verify(&[&[0.0, 1.0], &[1.0, 0.0]], &[7]).unwrap(), vec![1]);
        assert_eq!(g.verify(&[&[0.0, 1.0]], &[]).unwrap(), vec![1]);
    }
}
