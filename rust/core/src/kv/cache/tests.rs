use super::*;

fn cache(max_blocks: usize) -> KvCache {
    KvCache::new(KvConfig {
        n_layer: 2,
        n_head_kv: 1,
        head_dim_k: 32,
        head_dim_v: 32,
        k_type: GgmlType::F16,
        v_type: GgmlType::Q8_0,
        block_size: 4,
        n_ctx: 12,
        max_blocks,
    })
    .unwrap()
}

#[test]
fn extends_truncates_and_reuses_blocks() {
    let mut kv = cache(5);
    assert_eq!(kv.extend(7, 6).unwrap(), 0);
    assert_eq!(kv.blocks_in_use(), 2);
    assert_eq!(kv.extend(7, 1).unwrap(), 6);
    kv.truncate(7, 3).unwrap();
    assert_eq!((kv.seq_len(7), kv.blocks_in_use()), (3, 1));
    assert_eq!(kv.extend(8, 12).unwrap(), 0);
    assert_eq!(kv.blocks_in_use(), 4);
    kv.remove(8);
    kv.remove(7);
    assert_eq!(kv.blocks_in_use(), 0);
    assert_eq!(kv.blocks.len(), 4, "freed blocks are kept for reuse");
}

#[test]
fn overflow_is_an_error_and_changes_nothing() {
    let mut kv = cache(3);
    kv.extend(1, 10).unwrap();
    let e = kv.extend(1, 3).unwrap_err().to_string();
    assert!(e.contains("n_ctx=12"), "{e}");
    let e = kv.extend(2, 4).unwrap_err().to_string();
    assert!(e.contains("KV cache is full"), "{e}");
    assert_eq!((kv.seq_len(1), kv.seq_len(2)), (10, 0));
}

#[test]
fn writes_land_in_the_right_slot() {
    let mut kv = cache(3);
    kv.extend(0, 6).unwrap();
    let k: Vec<f32> = (0..32).map(|i| i as f32).collect();
    kv.write(1, 0, 5, &k, &k).unwrap();
    let view = kv.block_view(1, 0, 1);
    let row = &view.k[view.k_row_bytes..2 * view.k_row_bytes];
    assert_eq!(half::f16::from_le_bytes([row[6], row[7]]).to_f32(), 3.0);
}

/// The rows a fork or a truncation into a shared block copies read back equal to the source's, in every
/// layer, and later writes to the copy leave the source alone.
#[test]
fn forks_and_truncations_copy_the_bytes() {
    let mut kv = cache(6);
    kv.extend(0, 10).unwrap();
    let row = |p: usize, l: usize| -> Vec<f32> { (0..32).map(|i| (p * 100 + l * 10 + i) as f32 / 64.0).collect() };
    for p in 0..10 {
        for l in 0..2 {
            kv.write(l, 0, p, &row(p, l), &row(p, l)).unwrap();
        }
    }
    kv.fork(0, 1, 7).unwrap(); // block 0 shared, block 1's 3 positions copied
    assert_eq!((kv.books().table(1)[0], kv.blocks_in_use()), (kv.books().table(0)[0], 4));
    for l in 0..2 {
        for b in 0..2 {
            let n = if b == 0 { 4 } else { 3 };
            let (a, c) = (kv.block_view(l, 0, b), kv.block_view(l, 1, b));
            assert_eq!(&c.k[..n * c.k_row_bytes], &a.k[..n * a.k_row_bytes]);
            assert_eq!(&c.v[..n * c.v_row_bytes], &a.v[..n * a.v_row_bytes]);
        }
    }
    kv.extend(1, 1).unwrap();
    kv.write(0, 1, 7, &row(99, 0), &row(99, 0)).unwrap();
    assert_ne!(kv.block_view(0, 1, 1).k, kv.block_view(0, 0, 1).k, "the fork writes into its own block");
    // Sequence 2 shares both of 0's full blocks; truncating it into the second copies that block's 2 rows.
    kv.fork(0, 2, 8).unwrap();
    kv.truncate(2, 6).unwrap();
    assert_ne!(kv.books().table(2)[1], kv.books().table(0)[1]);
    let (a, c) = (kv.block_view(1, 0, 1), kv.block_view(1, 2, 1));
    assert_eq!(&c.k[..2 * c.k_row_bytes], &a.k[..2 * a.k_row_bytes]);
}

#[test]
fn spare_buffers_are_handed_out_again_zeroed_and_by_length() {
    let mut spare = SpareBuffers::default();
    let (a, b) = (vec![7u8; 64], vec![9u8; 32]);
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    spare.give(vec![a, b, Vec::new()]);
    let got = spare.take(2, 64);
    assert_eq!(got[0].as_ptr(), pa, "the spare 64-byte buffer first");
    assert!(got.iter().all(|x| x.len() == 64 && x.iter().all(|&v| v == 0)));
    let got = spare.take(1, 32);
    assert_eq!((got[0].as_ptr(), got[0].as_slice()), (pb, &[0u8; 32][..]));
    assert_eq!(spare.take(1, 32)[0].len(), 32, "a new one when none is spare");
}
