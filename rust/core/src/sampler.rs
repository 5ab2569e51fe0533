//! Token sampling as a chain, in llama.cpp's default order: top-k, top-p, min-p, temperature, seeded draw.
//! Temperature <= 0 is greedy (argmax, first index on ties). The same seed gives the same tokens.

use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplerParams {
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0.0 disables.
    pub min_p: f32,
    pub seed: u64,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, seed: 0 }
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
        Ok(())
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
    /// (token, logit or probability) candidates, reused between calls.
    cand: Vec<(u32, f32)>,
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
        Ok(Sampler { params, rng: Rng::new(params.seed), cand: Vec::new() })
    }

    /// Temperature 0: `sample` returns the first maximum.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0
    }

    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        if logits.is_empty() {
            return Err(Error::InvalidArgument("cannot sample from an empty logits vector".into()));
        }
        let p = self.params;
        if p.temperature <= 0.0 {
            return Ok(argmax(logits));
        }
        let cand = &mut self.cand;
        cand.clear();
        cand.extend(logits.iter().enumerate().filter(|(_, v)| !v.is_nan()).map(|(i, &v)| (i as u32, v)));
        if cand.is_empty() {
            return Err(Error::InvalidArgument("every logit is NaN".into()));
        }
        let by_logit_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, by_logit_desc);
            cand.truncate(p.top_k);
        }
        cand.sort_unstable_by(by_logit_desc);
        // Probabilities of the surviving candidates (softmax on the untempered logits, as llama.cpp's filters do).
        let max = cand[0].1;
        let probs: Vec<f32> = cand.iter().map(|c| (c.1 - max).exp()).collect();
        let total: f32 = probs.iter().sum();
        let mut keep = cand.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, pr) in probs.iter().enumerate() {
                cum += pr / total;
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
        // Temperature, then a seeded draw from the renormalised distribution.
        let weights: Vec<f64> = cand.iter().map(|c| (((c.1 - max) / p.temperature) as f64).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut r = self.rng.uniform() * total;
        for (c, w) in cand.iter().zip(&weights) {
            if r < *w {
                return Ok(c.0);
            }
            r -= w;
        }
        Ok(cand[cand.len() - 1].0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplerParams {
        SamplerParams { temperature, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 7 }
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
}
