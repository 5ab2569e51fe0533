use super::*;
use crate::kv::rotation;

fn config(block_size: usize, n_ctx: usize) -> KvConfig {
    KvConfig {
        n_layer: 2,
        n_head_kv: 2,
        head_dim_k: 64,
        head_dim_v: 64,
        k_type: GgmlType::F16,
        v_type: GgmlType::F16,
        block_size,
        n_ctx,
        max_blocks: 2 * n_ctx / block_size,
    }
}

fn row(seed: u64) -> Vec<f32> {
    let mut r = crate::test_rng::uniform_floats(seed, 128, 1.0);
    r.iter_mut().enumerate().for_each(|(i, x)| *x += if i % 64 == 5 { 6.0 } else { 0.3 });
    r
}

/// Append `n` positions to `seq`, writing row(seed + pos) as K and V in both layers, one position per step.
fn grow(kv: &mut KvCache, seq: SeqId, n: usize) {
    for _ in 0..n {
        let p = kv.extend(seq, 1).unwrap();
        for l in 0..2 {
            let r = row(1000 * seq as u64 + p as u64);
            kv.write(l, seq, p, &r, &r).unwrap();
        }
        kv.settle(seq).unwrap();
    }
}

/// The key stored at `pos` read back (offset added, rotated back).
fn read_key(kv: &KvCache, layer: usize, seq: SeqId, pos: usize) -> Vec<f32> {
    let bs = kv.cfg.block_size;
    let view = kv.block_view(layer, seq, pos / bs);
    let mut k = vec![0.0f32; 128];
    dequantize_row(view.k_type, &view.k[pos % bs * view.k_row_bytes..][..view.k_row_bytes], &mut k).unwrap();
    k.iter_mut().zip(view.k_offset.unwrap()).for_each(|(x, &o)| *x += o);
    rotation::rotate(&mut k, 64);
    k
}

#[test]
fn blocks_move_down_the_tiers_once_as_a_sequence_grows() {
    for file in [false, true] {
        let path = std::env::temp_dir().join(format!("ninfer-tiers-test-{}", std::process::id()));
        let tiers = TierConfig { l1: 32, l2: 32, select: 0, l3_file: file.then(|| path.clone()), ..Default::default() };
        let mut kv = KvCache::new_tiered(config(16, 256), tiers).unwrap();
        grow(&mut kv, 3, 150);
        // Blocks of 16: 0 sink, 1..=4 L3 (ends at 80 <= 150 - 64), 5..=6 L2, 7..=9 L1 (the last partial).
        let precisions: Vec<&str> =
            kv.books().table(3).iter().map(|&b| kv.books().home(b).unwrap().k.name()).collect();
        assert_eq!(precisions, ["f16", "q4_0", "q4_0", "q4_0", "q4_0", "q8_0", "q8_0", "f16", "f16", "f16"]);
        let m = kv.memory();
        assert_eq!((m.l1.blocks, m.l2.blocks, m.l3.blocks), (4, 2, 4));
        // f16 2 layers x 16 rows x (K 256 + V 256) bytes; q8_0 rows 136, q4_0 rows 72.
        assert_eq!((m.l1.bytes, m.l2.bytes, m.l3.bytes), (4 * 2 * 16 * 512, 2 * 2 * 16 * 272, 4 * 2 * 16 * 144));
        // Every tier reads back close to what was written: f16, then 8 and 4 bits after rotation and offsets.
        for (pos, tol) in [(3usize, 0.01f32), (140, 0.01), (90, 0.03), (40, 0.3)] {
            let want = row(3000 + pos as u64);
            let got = read_key(&kv, 1, 3, pos);
            let err = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(err < tol, "position {pos}: max error {err}");
        }
        // Summaries bound the keys of their block (stored basis, offset included).
        let (lo, hi) = kv.key_summary(0, 3, 2);
        for p in 32..48 {
            let mut k = row(3000 + p);
            rotation::rotate(&mut k, 64);
            assert!(k.iter().zip(lo.iter().zip(hi)).all(|(x, (a, b))| a <= x && x <= b));
        }
        if file {
            assert_eq!(std::fs::metadata(&path).unwrap().len() as usize, 32 * 2 * 16 * 144);
        }
        // Freed ring slots are reused: a second sequence after the first is removed touches no more of the ring.
        let touched = kv.allocated_bytes();
        kv.remove(3);
        grow(&mut kv, 4, 150);
        assert_eq!(kv.allocated_bytes(), touched);
        let _ = std::fs::remove_file(&path);
    }
}

#[test]
fn a_fork_of_a_tiered_sequence_reads_the_same_rows() {
    let mut kv = KvCache::new_tiered(config(16, 256), TierConfig { l1: 16, l2: 16, ..Default::default() }).unwrap();
    grow(&mut kv, 0, 100);
    kv.fork(0, 1, 70).unwrap(); // blocks 0..=3 shared, the 6 rows of block 4 (in L2) copied
    assert_eq!(kv.books().home(kv.books().table(1)[4]).unwrap().k, Precision::Q8_0);
    for pos in [5usize, 40, 66, 69] {
        assert_eq!(read_key(&kv, 0, 1, pos), read_key(&kv, 0, 0, pos), "position {pos}");
    }
    kv.truncate(1, 50).unwrap(); // into shared block 3 (in L3): a copy of its 2 rows in a ring slot of its own
    let b = kv.books().table(1)[3];
    assert_ne!(b, kv.books().table(0)[3]);
    assert_eq!(kv.books().home(b).unwrap().k, Precision::Q4_0);
    assert_eq!(read_key(&kv, 1, 1, 49), read_key(&kv, 1, 0, 49));
}

#[test]
fn bad_tier_settings_are_errors() {
    let e = |cfg: KvConfig, t: TierConfig| KvCache::new_tiered(cfg, t).err().unwrap().to_string();
    let mut q8 = config(16, 64);
    q8.k_type = GgmlType::Q8_0;
    assert!(e(q8, TierConfig { l1: 16, ..Default::default() }).contains("the cache types must be f16, not Q8_0/F16"));
    assert!(e(config(16, 64), TierConfig { l1: 8, ..Default::default() }).contains("at least one block of 16 tokens"));
}

#[test]
fn a_random_fill_reaches_depth_in_every_tier() {
    let mut kv = KvCache::new_tiered(config(16, 256), TierConfig { l1: 32, l2: 32, ..Default::default() }).unwrap();
    kv.fill_random(0, 200, 1).unwrap();
    assert_eq!(kv.seq_len(0), 200);
    let m = kv.memory();
    // 13 blocks: the sink; 1..=7 in L3 (ending at or before 200 - 64); 8..=9 in L2; 10..=12 (holding the newest
    // 32, 168..199) in L1.
    assert_eq!((m.l1.blocks, m.l2.blocks, m.l3.blocks), (4, 2, 7));
    let e = kv.fill_random(0, 100, 1).unwrap_err().to_string();
    assert!(e.contains("n_ctx=256"), "{e}");
    assert_eq!(kv.seq_len(0), 200, "nothing appended on error");
}
