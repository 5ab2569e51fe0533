//! The block manager's books: reuse, failures that change nothing, sharing by fork, reference counts, copies on
//! truncation into a shared block, and a random run checked against a model of what every sequence holds.

use std::collections::{BTreeMap, HashMap};

use super::*;

fn books(max_blocks: usize) -> BlockManager {
    BlockManager::new(4, max_blocks, 12).unwrap()
}

#[test]
fn extend_truncate_and_remove_reuse_blocks() {
    let mut m = books(5);
    assert_eq!(m.extend(7, 6).unwrap(), 0);
    assert_eq!((m.table(7), m.blocks_in_use(), m.n_free()), (&[0, 1][..], 2, 3));
    assert_eq!(m.extend(7, 1).unwrap(), 6);
    assert!(m.truncate(7, 3).unwrap().is_empty());
    assert_eq!((m.seq_len(7), m.table(7), m.blocks_in_use()), (3, &[0][..], 1));
    assert_eq!(m.extend(8, 12).unwrap(), 0);
    assert_eq!(m.table(8), &[1, 2, 3], "the freed block is reused before a new id");
    m.remove(8);
    m.remove(7);
    assert_eq!((m.blocks_in_use(), m.n_free(), m.blocks_created()), (0, 5, 4));
    assert_eq!((m.seq_len(7), m.table(7)), (0, &[][..]));
}

#[test]
fn failures_change_nothing() {
    let mut m = books(3);
    m.extend(1, 10).unwrap();
    let before = m.clone();
    let e = m.extend(1, 3).unwrap_err().to_string();
    assert_eq!(e, "sequence 1 would hold 13 tokens, more than the context size n_ctx=12");
    let e = m.extend(2, 4).unwrap_err().to_string();
    assert_eq!(e, "KV cache is full: sequence 2 needs 1 more blocks of 4 tokens, 0 are free");
    assert!(m.check_extend(1, 2).is_ok() && m.check_extend(2, 1).is_err());
    let e = m.fork(1, 1, 4).unwrap_err().to_string();
    assert!(e.contains("into itself"), "{e}");
    let e = m.fork(1, 2, 11).unwrap_err().to_string();
    assert_eq!(e, "cannot fork 11 positions of sequence 1, which holds 10");
    let e = m.fork(1, 2, 6).unwrap_err().to_string();
    assert!(e.starts_with("KV cache is full: forking 6 positions of sequence 1 into sequence 2"), "{e}");
    m.fork(1, 2, 8).unwrap(); // whole blocks only: no fresh block needed
    let shared = m.clone();
    let e = m.truncate(2, 5).unwrap_err().to_string();
    assert!(e.starts_with("KV cache is full: truncating sequence 2 to 5 tokens"), "{e}");
    assert_eq!(m, shared);
    m.remove(2);
    assert_eq!(m, before, "removing the fork gives the books back");
}

#[test]
fn fork_shares_whole_blocks_and_copies_a_partial_one() {
    let mut m = books(8);
    m.extend(0, 10).unwrap(); // blocks 0 1 2, the last holding 2 positions
    let copies = m.fork(0, 1, 6).unwrap();
    assert_eq!(m.table(1), &[0, 3]);
    assert_eq!(copies, [BlockCopy { src: 1, dst: 3, n_positions: 2 }]);
    assert_eq!((m.ref_count(0), m.ref_count(1), m.ref_count(3)), (2, 1, 1));
    assert_eq!(m.blocks_in_use(), 4, "a shared block counts once");
    // A fork on a block boundary shares everything and copies nothing.
    assert!(m.fork(0, 2, 8).unwrap().is_empty());
    assert_eq!((m.table(2), m.ref_count(1)), (&[0, 1][..], 2));
    // Forking into an existing sequence replaces it.
    assert!(m.fork(2, 1, 4).unwrap().is_empty());
    assert_eq!((m.table(1), m.seq_len(1), m.ref_count(0), m.ref_count(3)), (&[0][..], 4, 3, 0));
    // The forked sequence grows into blocks of its own.
    assert_eq!(m.extend(1, 1).unwrap(), 4);
    assert_eq!(m.ref_count(*m.table(1).last().unwrap()), 1);
}

#[test]
fn blocks_are_freed_when_their_last_user_goes() {
    let mut m = books(6);
    m.extend(0, 8).unwrap();
    m.fork(0, 1, 8).unwrap();
    m.fork(0, 2, 4).unwrap();
    assert_eq!((m.ref_count(0), m.ref_count(1), m.blocks_in_use()), (3, 2, 2));
    m.remove(0);
    assert_eq!((m.ref_count(0), m.ref_count(1), m.n_free()), (2, 1, 4));
    m.remove(1);
    assert_eq!((m.ref_count(0), m.ref_count(1), m.n_free()), (1, 0, 5));
    m.truncate(2, 0).unwrap();
    assert_eq!((m.ref_count(0), m.blocks_in_use(), m.seq_len(2)), (0, 0, 0));
}

#[test]
fn truncating_into_a_shared_block_copies_it() {
    let mut m = books(6);
    m.extend(0, 8).unwrap();
    m.fork(0, 1, 8).unwrap();
    let copies = m.truncate(1, 6).unwrap();
    assert_eq!(copies, [BlockCopy { src: 1, dst: 2, n_positions: 2 }]);
    assert_eq!((m.table(0), m.table(1)), (&[0, 1][..], &[0, 2][..]));
    assert_eq!((m.ref_count(1), m.ref_count(2)), (1, 1));
    // On a block boundary the kept blocks stay shared.
    assert!(m.truncate(1, 4).unwrap().is_empty());
    assert_eq!((m.table(1), m.ref_count(0), m.ref_count(2)), (&[0][..], 2, 0));
}

#[test]
fn homes_are_set_on_allocation() {
    let device = BlockHome { placement: Placement::Device, k: Precision::F16, v: Precision::Q8_0 };
    let mut m = books(4).with_home(device);
    assert_eq!(m.home(0), None);
    m.extend(0, 5).unwrap();
    assert_eq!((m.home(0), m.home(1), m.home(2)), (Some(device), Some(device), None));
    assert_eq!(Placement::from_name("host"), Some(Placement::Host));
    assert_eq!(Precision::from_name("q4_0"), Some(Precision::Q4_0));
    assert_eq!(Precision::from_name("q4_1"), None);
}

/// xorshift64*: a deterministic stream for the random run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n
    }
}

/// Storage that executes the books' copies: every block slot holds the value last written to it.
struct Store {
    slots: HashMap<u32, Vec<u64>>,
}

impl Store {
    fn copy(&mut self, c: BlockCopy) {
        let src = self.slots[&c.src][..c.n_positions].to_vec();
        self.slots.get_mut(&c.dst).unwrap()[..c.n_positions].copy_from_slice(&src);
    }
}

/// Structural invariants, and every sequence reads back through its table what the model says it holds.
fn check(m: &BlockManager, model: &BTreeMap<SeqId, Vec<u64>>, store: &Store) {
    let bs = m.block_size();
    let mut holders = vec![0u32; m.blocks_created()];
    for (&seq, values) in model {
        let table = m.table(seq);
        assert_eq!(m.seq_len(seq), values.len());
        assert_eq!(table.len(), values.len().div_ceil(bs));
        for (p, v) in values.iter().enumerate() {
            assert_eq!(store.slots[&table[p / bs]][p % bs], *v, "sequence {seq} position {p}");
        }
        for &b in table {
            holders[b as usize] += 1;
        }
        if values.len() % bs != 0 {
            assert_eq!(m.ref_count(*table.last().unwrap()), 1, "sequence {seq}'s partial last block is shared");
        }
    }
    let non_empty = m.tables.values().filter(|t| t.len > 0).count();
    assert_eq!(non_empty, model.values().filter(|v| !v.is_empty()).count(), "a sequence the model lacks");
    for (b, &n) in holders.iter().enumerate() {
        assert_eq!(m.ref_count(b as u32), n, "block {b}'s count");
        assert_eq!(m.free.contains(&(b as u32)), n == 0, "block {b} is free iff no table holds it");
    }
    assert_eq!(m.free.len(), holders.iter().filter(|&&n| n == 0).count(), "the free list has no duplicates");
    assert_eq!(m.blocks_in_use() + m.n_free(), m.max_blocks());
}

#[test]
fn random_operations_keep_the_books_consistent() {
    let (bs, max_blocks, n_ctx) = (4, 10, 22);
    let mut m = BlockManager::new(bs, max_blocks, n_ctx).unwrap();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut model: BTreeMap<SeqId, Vec<u64>> = BTreeMap::new();
    let mut store = Store { slots: HashMap::new() };
    let (mut next_value, mut failures, mut copies) = (1u64, 0, 0);
    for _ in 0..20_000 {
        let seq = rng.below(4) as SeqId;
        let len = model.get(&seq).map_or(0, Vec::len);
        let before = m.clone();
        let result = match rng.below(10) {
            0..=3 => {
                let n = rng.below(2 * bs + 1);
                m.extend(seq, n).map(|start| {
                    assert_eq!(start, len);
                    for b in 0..m.blocks_created() as u32 {
                        store.slots.entry(b).or_insert_with(|| vec![0; bs]);
                    }
                    // Write the new positions, as a forward pass would.
                    let values = model.entry(seq).or_default();
                    for p in start..start + n {
                        store.slots.get_mut(&m.table(seq)[p / bs]).unwrap()[p % bs] = next_value;
                        values.push(next_value);
                        next_value += 1;
                    }
                    Vec::new()
                })
            }
            4..=6 => {
                let keep = rng.below(len + 2);
                m.truncate(seq, keep).inspect(|_| {
                    if let Some(v) = model.get_mut(&seq) {
                        v.truncate(keep);
                    }
                })
            }
            7 => {
                m.remove(seq);
                model.remove(&seq);
                Ok(Vec::new())
            }
            _ => {
                let dst = rng.below(4) as SeqId;
                let n = rng.below(len + 2);
                m.fork(seq, dst, n).inspect(|_| {
                    let values = model.get(&seq).map_or(Vec::new(), |v| v[..n].to_vec());
                    model.insert(dst, values);
                })
            }
        };
        match result {
            Ok(cs) => {
                for b in 0..m.blocks_created() as u32 {
                    store.slots.entry(b).or_insert_with(|| vec![0; bs]);
                }
                copies += cs.len();
                for c in cs {
                    assert_eq!(m.ref_count(c.dst), 1, "a copy goes into a block of one sequence");
                    store.copy(c);
                }
            }
            Err(_) => {
                assert_eq!(m, before, "a failed operation changed the books");
                failures += 1;
            }
        }
        check(&m, &model, &store);
    }
    // The run must reach the interesting cases, or it checks little.
    assert!(failures > 100 && copies > 100, "failures {failures}, copies {copies}");
}
