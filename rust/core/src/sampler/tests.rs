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

fn mask_of(n_vocab: usize, allowed: &[u32]) -> Vec<u32> {
    let mut m = vec![0u32; n_vocab.div_ceil(32)];
    for &t in allowed {
        m[t as usize / 32] |= 1 << (t % 32);
    }
    m
}

#[test]
fn a_mask_restricts_the_next_draw_only() {
    // 70 tokens (three mask words, the last partial); token 69 is the best, 5 the second, 40 the third.
    let mut logits = vec![0.0f32; 70];
    logits[69] = 5.0;
    logits[5] = 4.0;
    logits[40] = 3.0;
    for p in [params(0.0), SamplerParams { repeat_penalty: 1.3, ..params(0.0) }, params(0.7)] {
        let mut s = Sampler::new(p.clone()).unwrap();
        for _ in 0..20 {
            s.set_mask(mask_of(70, &[5, 40]));
            let t = s.sample(&logits).unwrap();
            assert!(t == 5 || t == 40, "{p:?} drew {t}");
        }
        // Greedy picks the best allowed token; the mask is gone afterwards.
        let mut g = Sampler::new(params(0.0)).unwrap();
        g.set_mask(mask_of(70, &[40, 5]));
        assert_eq!(g.sample(&logits).unwrap(), 5);
        assert_eq!(g.sample(&logits).unwrap(), 69);
        // A mask shorter than the vocabulary bans what it does not cover; a mask that allows nothing is an error.
        g.set_mask(mask_of(40, &[3]));
        assert_eq!(g.sample(&logits).unwrap(), 3);
        s.set_mask(mask_of(70, &[]));
        let e = s.sample(&logits).unwrap_err().to_string();
        assert!(e.contains("not allowed by the token mask"), "{e}");
    }
    // NaN never wins a masked argmax; a NaN among allowed tokens is skipped.
    let mut g = Sampler::new(params(0.0)).unwrap();
    let mut l = logits.clone();
    l[5] = f32::NAN;
    g.set_mask(mask_of(70, &[5, 40]));
    assert_eq!(g.sample(&l).unwrap(), 40);
}
