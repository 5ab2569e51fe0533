use super::*;
use crate::kv::{rotation, BlockScorer, KvConfig, TierConfig};

const HD: usize = 64;
const N_HEAD: usize = 4;
const N_HEAD_KV: usize = 2;

fn shape() -> AttnShape {
    AttnShape { n_head: N_HEAD, n_head_kv: N_HEAD_KV, head_dim: HD, head_dim_v: HD, scale: 0.125, window: None }
}

fn tiered(select: usize) -> KvCache {
    tiered_by(select, BlockScorer::Keys)
}

fn tiered_by(select: usize, scorer: BlockScorer) -> KvCache {
    tiered_with(select, scorer, 1)
}

fn tiered_with(select: usize, scorer: BlockScorer, rescan: usize) -> KvCache {
    let cfg = KvConfig {
        n_layer: 1, n_head_kv: N_HEAD_KV, head_dim_k: HD, head_dim_v: HD, k_type: GgmlType::F16,
        v_type: GgmlType::F16, block_size: 16, n_ctx: 512, max_blocks: 64,
    };
    KvCache::new_tiered(cfg, TierConfig { l1: 32, l2: 32, select, l3_file: None, scorer, rescan }).unwrap()
}

/// Keys with a common component and an outlier channel.
fn key(seed: u64) -> Vec<f32> {
    let mut k = crate::test_rng::uniform_floats(seed, N_HEAD_KV * HD, 1.0);
    k.iter_mut().enumerate().for_each(|(i, x)| *x += if i % HD == 9 { 4.0 } else { 0.2 });
    k
}

/// Fill `seq` with n rows: a prompt batch of `prompt` rows then one row per step, settling after each write.
fn fill(kv: &mut KvCache, n: usize, prompt: usize, keys: &mut Vec<Vec<f32>>, vals: &mut Vec<Vec<f32>>) {
    let rows: Vec<(SeqId, usize)> = (0..prompt).map(|p| (0, p)).collect();
    kv.extend(0, prompt).unwrap();
    keys.extend((0..prompt).map(|p| key(p as u64)));
    vals.extend((0..prompt).map(|p| crate::test_rng::uniform_floats(1 << 20 | p as u64, N_HEAD_KV * HD, 1.0)));
    kv.write_rows(0, &rows, &keys.concat(), &vals.concat()).unwrap();
    kv.settle(0).unwrap();
    for p in prompt..n {
        kv.extend(0, 1).unwrap();
        keys.push(key(p as u64));
        vals.push(crate::test_rng::uniform_floats(1 << 20 | p as u64, N_HEAD_KV * HD, 1.0));
        kv.write(0, 0, p, &keys[p], &vals[p]).unwrap();
        kv.settle(0).unwrap();
    }
}

/// Row `pos` as the cache holds it (each block's own precision), back in the model's basis: [K row, V row].
fn read_back(kv: &KvCache, pos: usize) -> [Vec<f32>; 2] {
    let view = kv.block_view(0, 0, pos / 16);
    let (mut k, mut v) = (vec![0.0f32; N_HEAD_KV * HD], vec![0.0f32; N_HEAD_KV * HD]);
    let slot = pos % 16;
    dequantize_row(view.k_type, &view.k[slot * view.k_row_bytes..][..view.k_row_bytes], &mut k).unwrap();
    dequantize_row(view.v_type, &view.v[slot * view.v_row_bytes..][..view.v_row_bytes], &mut v).unwrap();
    k.iter_mut().zip(view.k_offset.unwrap()).for_each(|(x, &o)| *x += o);
    rotation::rotate(&mut k, HD);
    rotation::rotate(&mut v, HD);
    [k, v]
}

/// softmax(q·k * scale) V in f64 over the given positions, for query head h.
fn direct(rows: &[[Vec<f32>; 2]], positions: &[usize], q: &[f32], h: usize) -> Vec<f64> {
    let g = h / (N_HEAD / N_HEAD_KV);
    let scores: Vec<f64> = positions
        .iter()
        .map(|&p| (0..HD).map(|d| q[d] as f64 * rows[p][0][g * HD + d] as f64).sum::<f64>() * 0.125)
        .collect();
    let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
    let z: f64 = w.iter().sum();
    (0..HD).map(|d| positions.iter().zip(&w).map(|(&p, wi)| wi * rows[p][1][g * HD + d] as f64).sum::<f64>() / z).collect()
}

fn max_err(got: &[f32], want: &[f64]) -> f64 {
    got.iter().zip(want).map(|(&a, b)| (a as f64 - b).abs()).fold(0.0, f64::max)
}

/// With select 0 a tiered cache's attention equals softmax attention over exactly the rows it holds, each in its
/// tier's precision: a decode row (old and recent parts merged by log-sum-exp) and a prefill batch (tiled path).
#[test]
fn select_zero_is_exact_over_the_tiers() {
    let mut kv = tiered(0);
    let (mut keys, mut vals) = (Vec::new(), Vec::new());
    fill(&mut kv, 200, 100, &mut keys, &mut vals);
    let precisions: Vec<_> = kv.books().table(0).iter().map(|&b| kv.books().home(b).unwrap().k.name()).collect();
    assert!(["f16", "q8_0", "q4_0"].iter().all(|p| precisions.contains(p)), "{precisions:?}");
    let held: Vec<[Vec<f32>; 2]> = (0..200).map(|p| read_back(&kv, p)).collect();
    let q = crate::test_rng::uniform_floats(5, 70 * N_HEAD * HD, 1.0);
    for n_rows in [1usize, 70] {
        // The last n_rows positions as query rows over the cache as it stands.
        let rows: Vec<(SeqId, usize)> = (200 - n_rows..200).map(|p| (0, p)).collect();
        let mut out = vec![0.0f32; n_rows * N_HEAD * HD];
        attention(&kv, 0, &rows, &q[..n_rows * N_HEAD * HD], shape(), RowOrder::Batch, &mut out);
        for (t, &(_, pos)) in rows.iter().enumerate() {
            let positions: Vec<usize> = (0..=pos).collect();
            for h in 0..N_HEAD {
                let qh = &q[(t * N_HEAD + h) * HD..][..HD];
                let err = max_err(&out[(t * N_HEAD + h) * HD..][..HD], &direct(&held, &positions, qh, h));
                assert!(err < 3e-3, "{n_rows} rows: row {t} head {h}: error {err}");
            }
        }
    }
}

/// A decode step with a budget reads the block whose keys hold one planted key aligned with the query, and its
/// value dominates the output; a budget covering every old block gives the select-0 result bit for bit.
#[test]
fn selection_finds_the_planted_key() {
    let q = crate::test_rng::uniform_floats(11, N_HEAD * HD, 1.0);
    for planted_at in [37usize, 70, 120] {
        let mut kv = tiered(16);
        let (mut keys, mut vals) = (Vec::new(), Vec::new());
        fill(&mut kv, planted_at, planted_at.min(64), &mut keys, &mut vals);
        // The planted key: both KV heads point along their first query head, far above the rest.
        let mut k = vec![0.0f32; N_HEAD_KV * HD];
        for g in 0..N_HEAD_KV {
            k[g * HD..(g + 1) * HD].copy_from_slice(&q[g * 2 * HD..(g * 2 + 1) * HD]);
        }
        k.iter_mut().for_each(|x| *x *= 3.0);
        let v = vec![5.0f32; N_HEAD_KV * HD];
        kv.extend(0, 1).unwrap();
        kv.write(0, 0, planted_at, &k, &v).unwrap();
        kv.settle(0).unwrap();
        let (mut k2, mut v2) = (keys.clone(), vals.clone());
        k2.push(k);
        v2.push(v);
        let mut rest = (Vec::new(), Vec::new());
        let start = planted_at + 1;
        for p in start..260 {
            rest.0.push(key(p as u64));
            rest.1.push(crate::test_rng::uniform_floats(1 << 20 | p as u64, N_HEAD_KV * HD, 1.0));
            kv.extend(0, 1).unwrap();
            kv.write(0, 0, p, &rest.0[p - start], &rest.1[p - start]).unwrap();
            kv.settle(0).unwrap();
        }
        let mut rq = q.clone();
        rotation::rotate(&mut rq, HD);
        let plan = plan_blocks(&kv, 0, (0, 259), &rq[..2 * HD], 0, shape(), true);
        assert_eq!(plan.old, vec![0, planted_at / 16], "planted at {planted_at}");
        assert_eq!(plan.recent, (14..=16).collect::<Vec<_>>());
        let mut out = vec![0.0f32; N_HEAD * HD];
        attention(&kv, 0, &[(0, 259)], &q, shape(), RowOrder::Batch, &mut out);
        let mean = out[..HD].iter().sum::<f32>() / HD as f32;
        assert!(mean > 4.0, "planted at {planted_at}: the planted value dominates head 0 ({mean})");
    }
    // A budget of every old block reads them all: the same bits as select 0.
    let (mut a, mut b) = (tiered(0), tiered(512));
    let (mut k, mut v) = (Vec::new(), Vec::new());
    fill(&mut a, 230, 70, &mut k, &mut v);
    let (mut k, mut v) = (Vec::new(), Vec::new());
    fill(&mut b, 230, 70, &mut k, &mut v);
    let (mut oa, mut ob) = (vec![0.0f32; N_HEAD * HD], vec![0.0f32; N_HEAD * HD]);
    attention(&a, 0, &[(0, 229)], &q, shape(), RowOrder::Batch, &mut oa);
    attention(&b, 0, &[(0, 229)], &q, shape(), RowOrder::Batch, &mut ob);
    assert_eq!(oa, ob);
}

/// The key scorer reads the block holding the one key that matches the query; Quest's bound reads the block whose
/// keys spread widest though none of them matches (its failure in real text, where blocks differ in spread).
#[test]
fn the_key_scorer_reads_the_matching_block_where_the_bound_reads_the_widest() {
    let q = crate::test_rng::uniform_floats(11, N_HEAD * HD, 1.0);
    for (scorer, want) in [(BlockScorer::Keys, 2usize), (BlockScorer::Bound, 4)] {
        let mut kv = tiered_by(16, scorer);
        for p in 0..200usize {
            let mut k = crate::test_rng::uniform_floats(p as u64, N_HEAD_KV * HD, 0.1);
            if p / 16 == 2 && p % 16 == 5 {
                for g in 0..N_HEAD_KV {  // along the KV head's first query head, twice its length
                    k[g * HD..(g + 1) * HD].iter_mut().zip(&q[g * 2 * HD..]).for_each(|(x, &y)| *x = 2.0 * y);
                }
            }
            if p / 16 == 4 {
                k = crate::test_rng::uniform_floats(1 << 30 | p as u64, N_HEAD_KV * HD, 3.0);
            }
            let v = crate::test_rng::uniform_floats(1 << 20 | p as u64, N_HEAD_KV * HD, 1.0);
            kv.extend(0, 1).unwrap();
            kv.write(0, 0, p, &k, &v).unwrap();
            kv.settle(0).unwrap();
        }
        let mut rq = q.clone();
        rotation::rotate(&mut rq, HD);
        for g in 0..N_HEAD_KV {
            let plan = plan_blocks(&kv, 0, (0, 199), &rq[g * 2 * HD..(g + 1) * 2 * HD], g, shape(), true);
            assert_eq!(plan.old, vec![0, want], "{scorer:?}, KV head {g}");
        }
    }
}

/// A cache of `n` positions whose keys are small but for one key of block 2 along `q`'s first query head of each
/// KV head, one of blocks 1, 3, 4 and 6 along it half as long, one of block 5 against it, and one of block 10
/// against it three times as long.
fn planted(select: usize, rescan: usize, n: usize, q: &[f32]) -> KvCache {
    let mut kv = tiered_with(select, BlockScorer::Keys, rescan);
    for p in 0..n {
        let mut k = crate::test_rng::uniform_floats(p as u64, N_HEAD_KV * HD, 0.1);
        let along = match (p / 16, p % 16) {
            (2, 5) => 2.0,
            (1 | 3 | 4 | 6, 5) => 1.0,
            (5, 5) => -2.0,
            (10, 5) => -3.0,
            _ => 0.0,
        };
        if along != 0.0 {
            for g in 0..N_HEAD_KV {
                k[g * HD..(g + 1) * HD].iter_mut().zip(&q[g * 2 * HD..]).for_each(|(x, &y)| *x = along * y);
            }
        }
        let v = crate::test_rng::uniform_floats(1 << 20 | p as u64, N_HEAD_KV * HD, 1.0);
        kv.extend(0, 1).unwrap();
        kv.write(0, 0, p, &k, &v).unwrap();
        kv.settle(0).unwrap();
    }
    kv
}

/// With rescan N, a decode step ranks every older block once every N steps; the steps between rank that
/// ranking's shortlist (4x the budget's blocks) and the blocks that became older since: a query that turns away
/// finds the block it matches only at the next full ranking, unless that block just became older. Truncation
/// forgets the shortlists.
#[test]
fn between_full_rankings_a_step_ranks_the_last_ones_shortlist() {
    // (each KV head's query heads alike, so that a key against one is against all)
    let head = crate::test_rng::uniform_floats(11, 2 * HD, 1.0);
    let q: Vec<f32> = [&head[..HD], &head[..HD], &head[HD..], &head[HD..]].concat();
    let (mut r1, mut r2) = (q.clone(), q.iter().map(|x| -x).collect::<Vec<f32>>());
    rotation::rotate(&mut r1, HD);
    rotation::rotate(&mut r2, HD);
    let old = |kv: &KvCache, pos: usize, r: &[f32], g: usize| {
        plan_blocks(kv, 0, (0, pos), &r[g * 2 * HD..(g + 1) * 2 * HD], g, shape(), true).old
    };
    for g in 0..N_HEAD_KV {
        // Ranking every step: the turned query finds block 5 at once.
        let every = planted(16, 1, 216, &q);
        assert_eq!(old(&every, 199, &r1, g), vec![0, 2]);
        assert_eq!(old(&every, 200, &r2, g), vec![0, 5]);
        // Every 4 steps: block 5 is not on the first query's shortlist (blocks 2 and three of 1, 3, 4, 6), and the
        // turned query finds it at the ranking at 203.
        let kv = planted(16, 4, 216, &q);
        assert_eq!(old(&kv, 199, &r1, g), vec![0, 2]);
        let between = old(&kv, 200, &r2, g);
        assert_eq!(between.len(), 2);
        assert_ne!(between[1], 5, "KV head {g}");
        assert_eq!(old(&kv, 203, &r2, g), vec![0, 5]);
        // Block 10 is recent at 199 and older at 215: ranked there though it is on no shortlist.
        let kv = planted(16, 32, 216, &q);
        assert_eq!(old(&kv, 199, &r1, g), vec![0, 2]);
        assert_eq!(old(&kv, 215, &r2, g), vec![0, 10]);
        // A truncated sequence ranks every block at its next step.
        let mut kv = planted(16, 32, 216, &q);
        assert_eq!(old(&kv, 199, &r1, g), vec![0, 2]);
        assert_ne!(old(&kv, 200, &r2, g)[1], 5);
        kv.truncate(0, 201).unwrap();
        assert_eq!(old(&kv, 200, &r2, g), vec![0, 5]);
    }
}

/// The L3 blocks a decode step chose are brought in by the prefetch thread for the next: the same query again finds
/// them ready (hits, or stalls when the thread is still at work), and the result is the same bits as when the step
/// read them unannounced (misses): attention reads L3 in place either way.
#[test]
fn the_prefetch_thread_brings_in_the_next_steps_blocks() {
    let mut kv = tiered(32);
    let (mut keys, mut vals) = (Vec::new(), Vec::new());
    fill(&mut kv, 230, 70, &mut keys, &mut vals);
    let q = crate::test_rng::uniform_floats(12, N_HEAD * HD, 1.0);
    let (mut first, mut second) = (vec![0.0f32; N_HEAD * HD], vec![0.0f32; N_HEAD * HD]);
    attention(&kv, 0, &[(0, 229)], &q, shape(), RowOrder::Batch, &mut first);
    let s1 = kv.prefetch_stats().unwrap();
    assert_eq!((s1.hits, s1.stalls), (0, 0));
    assert!(s1.misses >= 2, "{s1:?}"); // 32 tokens = 2 blocks a KV head, most of them in L3
    attention(&kv, 0, &[(0, 229)], &q, shape(), RowOrder::Batch, &mut second);
    let s2 = kv.prefetch_stats().unwrap();
    assert_eq!(s2.misses, s1.misses, "{s2:?}");
    assert_eq!(s2.hits + s2.stalls, s1.misses, "{s2:?}");
    assert_eq!(s2.staged, s1.misses);
    assert_eq!(first, second);
    // A new block moving into L3 waits for the thread and drops nothing still wanted; the cache keeps working.
    kv.extend(0, 1).unwrap();
    kv.write(0, 0, 230, &key(230), &vals[0]).unwrap();
    kv.settle(0).unwrap();
    attention(&kv, 0, &[(0, 230)], &q, shape(), RowOrder::Batch, &mut first);
}
