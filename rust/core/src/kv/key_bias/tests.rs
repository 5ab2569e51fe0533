use super::*;
use crate::cpu::rope::{block_start_turns, rope_angles, rope_row, roped_bias_slots, RopeParams};
use crate::model::RopeYarn;
use std::sync::Arc;

/// A KeyBias of `layers` (Some: the bias with these RoPE settings) over 2 KV heads of 64, rope_dims 48.
fn key_bias(layers: &[Option<(&[f32], RopeParams)>], neox: bool, n_ctx: usize) -> Option<KeyBias> {
    let tables = layers
        .iter()
        .map(|l| {
            l.map(|(b, p)| LayerBiasTables {
                slots: roped_bias_slots(b, &p, 64, 48, neox, 32),
                starts: Arc::new(block_start_turns(&p, 48, 32, n_ctx)),
            })
        })
        .collect();
    KeyBias::new(tables, 2, 64, 48, neox, 32)
}

fn yarn(ext_factor: f32) -> RopeYarn {
    RopeYarn { ext_factor, attn_factor: 1.0, beta_fast: 32.0, beta_slow: 1.0, n_ctx_orig: 4096 }
}

/// A bias of two KV heads of 64, rope_dims 48 (16 unrotated elements a head), with large slow pairs as Qwen2's.
fn bias() -> Vec<f32> {
    (0..128).map(|i| ((i * 37 % 101) as f32 - 50.0) / (1.0 + (i % 64) as f32 / 8.0)).collect()
}

/// bias(pos) = R(p0) c_t is rope(b_k, pos) as the forward pass ropes a key, for plain RoPE and YaRN, both pairings,
/// positions far past the table's first block.
#[test]
fn the_tabled_bias_is_the_roped_bias() {
    let b = bias();
    for (params, neox) in [
        (RopeParams::new(1e6, 1.0, 48, &yarn(0.0)), true),
        (RopeParams::new(1e4, 0.25, 48, &yarn(1.0)), false),
    ] {
        let kb = key_bias(&[None, Some((&b[..], params))], neox, 200_000).unwrap();
        assert!(kb.term(0, 0).is_none() && !kb.has(0) && kb.has(1));
        let mut angles = Vec::new();
        let mut got = vec![0.0f32; 64];
        for pos in [0usize, 1, 31, 32, 77, 4099, 65_537, 163_839] {
            let mut want = b.clone();
            rope_angles(pos, &params, 48, &mut angles);
            rope_row(&mut want, 64, &angles, neox);
            let term = kb.term(1, pos / 32).unwrap();
            for g in 0..2 {
                term.bias(pos % 32, g, &mut got);
                let err = got.iter().zip(&want[g * 64..]).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
                // f32 angles at 1.6e5 radians are rounded to 1/64 on both sides, differently
                let tol = if pos > 4096 { 0.8 } else { 2e-3 };
                assert!(err < tol, "pos {pos} head {g}: {err}");
                assert_eq!(&got[48..], &want[g * 64 + 48..g * 64 + 64], "unrotated elements pass through");
            }
        }
    }
}

/// The score's share computed from the turned query equals q·bias(pos) for the same tabled bias.
#[test]
fn the_turned_query_scores_the_bias_it_takes_out() {
    let b = bias();
    let params = RopeParams::new(1e6, 1.0, 48, &yarn(0.0));
    let kb = key_bias(&[Some((&b[..], params))], true, 100_000).unwrap();
    let q: Vec<f32> = (0..64).map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0).collect();
    let (mut turned, mut v) = (vec![0.0f32; 64], vec![0.0f32; 64]);
    for pos in [5usize, 40, 99_999] {
        let term = kb.term(0, pos / 32).unwrap();
        term.turn_query(&q, &mut turned);
        let mut shares = vec![0.0f32; 32];
        for g in 0..2 {
            term.bias(pos % 32, g, &mut v);
            let want: f64 = q.iter().zip(&v).map(|(&a, &b)| a as f64 * b as f64).sum();
            term.shares(&turned, g, &mut shares);
            let got = shares[pos % 32] as f64;
            assert!((got - want).abs() < 1e-4 * want.abs().max(1.0), "pos {pos} head {g}: {got} vs {want}");
        }
    }
    assert!(kb.term(0, 100_000 / 32 + 1).is_none(), "past the tabled positions");
}

#[test]
fn no_bias_no_table() {
    assert!(key_bias(&[None, None], true, 1024).is_none());
}

/// Settling keeps the fast pairs' slots as they are and gives every other element its block mean in every slot, the
/// fast pairs holding at least KEPT_VARIATION of the variation (both pairings); one slot a block turns nothing.
#[test]
fn settled_slow_pairs_hold_their_block_mean() {
    let b = bias();
    let p = RopeParams::new(1e6, 1.0, 48, &yarn(0.0));
    for neox in [true, false] {
        let orig = roped_bias_slots(&b, &p, 64, 48, neox, 32);
        let mut settled = orig.clone();
        let fast = settle_slow_pairs(&mut settled, 2, 64, 48, neox, 32);
        for (g, pairs) in fast.iter().enumerate() {
            assert!(!pairs.is_empty() && pairs.len() < 24 && pairs.windows(2).all(|w| w[0] < w[1]), "{pairs:?}");
            let (mut kept, mut total) = (0.0f64, 0.0f64);
            for e in 0..64 {
                let column = |v: &[f32]| (0..32).map(|t| v[t * 128 + g * 64 + e]).collect::<Vec<f32>>();
                let (before, after) = (column(&orig), column(&settled));
                let mean = before.iter().map(|&x| x as f64).sum::<f64>() / 32.0;
                let variation: f64 = before.iter().map(|&x| (x as f64 - mean).powi(2)).sum();
                total += variation;
                let i = if neox { e % 24 } else { e / 2 };
                if e < 48 && pairs.contains(&i) {
                    assert_eq!(before, after);
                    kept += variation;
                } else {
                    assert!(after.iter().all(|&x| (x as f64 - mean).abs() <= 1e-5 * (1.0 + mean.abs())), "element {e}");
                }
            }
            assert!(kept >= 0.999 * total, "{kept} of {total}");
        }
        let mut one = roped_bias_slots(&b, &p, 64, 48, neox, 1);
        let copy = one.clone();
        assert!(settle_slow_pairs(&mut one, 2, 64, 48, neox, 1).iter().all(Vec::is_empty));
        assert_eq!(one, copy);
    }
}
