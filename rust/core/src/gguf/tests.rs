//! The GGUF parser against hand-made files: valid ones, and every kind of bad count, offset, length and name.

use super::*;

/// A tiny writer for hand-made test files.
fn header(n_tensors: u64, kvs: &[(&str, u32, Vec<u8>)]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&n_tensors.to_le_bytes());
    b.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
    for (k, t, v) in kvs {
        b.extend_from_slice(&(k.len() as u64).to_le_bytes());
        b.extend_from_slice(k.as_bytes());
        b.extend_from_slice(&t.to_le_bytes());
        b.extend_from_slice(v);
    }
    b
}

fn tensor_info(b: &mut Vec<u8>, name: &str, dims: &[u64], ty: u32, off: u64) {
    b.extend_from_slice(&(name.len() as u64).to_le_bytes());
    b.extend_from_slice(name.as_bytes());
    b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
    for d in dims {
        b.extend_from_slice(&d.to_le_bytes());
    }
    b.extend_from_slice(&ty.to_le_bytes());
    b.extend_from_slice(&off.to_le_bytes());
}

fn err_of(buf: &[u8]) -> String {
    match parse(buf, "t.gguf") {
        Err(e) => e.to_string(),
        Ok(_) => panic!("expected an error"),
    }
}

#[test]
fn parses_a_valid_file() {
    let mut b = header(1, &[("general.architecture", 8, [&5u64.to_le_bytes()[..], b"llama"].concat())]);
    tensor_info(&mut b, "w", &[32, 2], 0, 0);
    b.resize(b.len().div_ceil(32) * 32 + 256, 0);
    let f = parse(&b, "t.gguf").unwrap();
    assert_eq!(f.get("general.architecture"), Some(&MetaValue::Str("llama".into())));
    assert_eq!(f.tensors[0].n_bytes, 256);
}

#[test]
fn rejects_bad_magic_and_version() {
    let mut b = header(0, &[]);
    b[0] = b'X';
    assert!(err_of(&b).contains("not a GGUF file"));
    let mut b = header(0, &[]);
    b[4] = 9;
    assert!(err_of(&b).contains("version 9"));
}

#[test]
fn rejects_absurd_counts_and_lengths() {
    let mut b = header(0, &[]);
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(err_of(&b).contains("tensor count"));
    let b = header(0, &[("k", 8, u64::MAX.to_le_bytes().to_vec())]);
    assert!(err_of(&b).contains("string length"));
    let arr = [&8u32.to_le_bytes()[..], &(1u64 << 60).to_le_bytes()].concat();
    assert!(err_of(&header(0, &[("k", 9, arr)])).contains("array of"));
}

#[test]
fn arrays_are_views_checked_at_parse_time() {
    let strs = [&8u32.to_le_bytes()[..], &2u64.to_le_bytes(), &2u64.to_le_bytes(), b"ab", &1u64.to_le_bytes(), b"c"]
        .concat();
    let u16s = [&2u32.to_le_bytes()[..], &3u64.to_le_bytes(), &[1, 0, 2, 0, 3, 0]].concat();
    let b = header(0, &[("s", 9, strs), ("n", 9, u16s)]);
    let f = parse(&b, "t.gguf").unwrap();
    let Some(MetaValue::Array(s)) = f.get("s") else { panic!() };
    assert_eq!(array_strings(&b, s).collect::<Vec<_>>(), ["ab", "c"]);
    let Some(MetaValue::Array(n)) = f.get("n") else { panic!() };
    assert_eq!((n.elem_type, n.count, &b[n.offset..n.offset + n.n_bytes]), (2, 3, &[1u8, 0, 2, 0, 3, 0][..]));
    // A string whose length runs past the end, and a bool array with a byte that is not 0 or 1.
    let bad = [&8u32.to_le_bytes()[..], &1u64.to_le_bytes(), &99u64.to_le_bytes(), b"x"].concat();
    assert!(err_of(&header(0, &[("s", 9, bad)])).contains("key s: string length 99 runs past the end"));
    let bools = [&7u32.to_le_bytes()[..], &2u64.to_le_bytes(), &[1, 7]].concat();
    assert!(err_of(&header(0, &[("b", 9, bools)])).contains("key b: bool byte 7 is neither 0 nor 1"));
}

#[test]
fn names_from_the_file_are_quoted_escaped_and_cut() {
    assert_eq!(shown("blk.0.attn_q.weight"), "blk.0.attn_q.weight");
    assert_eq!(shown("a b"), "'a b'");
    assert_eq!(shown("\x1b[2Jok\n"), "'\\x1b[2Jok\\n'");
    let long = shown(&"x".repeat(10_000_000));
    assert_eq!(long.len(), 80);
    assert!(long.ends_with("..."));
    // A key of ten million bytes with an escape code: the message stays one short line.
    let key = format!("\x1b[2J{}", "k".repeat(10_000_000));
    let msg = err_of(&header(0, &[(&key, 99, vec![])]));
    assert!(msg.len() < 200 && !msg.contains('\x1b') && msg.contains("unknown value type 99"), "{msg}");
}

#[test]
fn rejects_tensor_past_end_and_bad_blocks() {
    let mut b = header(1, &[]);
    tensor_info(&mut b, "w", &[32, 2], 0, 0);
    b.resize(b.len().div_ceil(32) * 32 + 100, 0);
    assert!(err_of(&b).contains("tensor w (F32, 256 bytes"));
    let mut b = header(1, &[]);
    tensor_info(&mut b, "q", &[33, 2], 2, 0);
    b.resize(4096, 0);
    assert!(err_of(&b).contains("not a multiple of the Q4_0 block size 32"));
    let mut b = header(1, &[]);
    tensor_info(&mut b, "u", &[32], 99, 0);
    b.resize(4096, 0);
    assert!(err_of(&b).contains("unknown GGML type id 99"));
    let mut b = header(1, &[]);
    tensor_info(&mut b, "big", &[1 << 40, 1 << 40], 0, 0);
    b.resize(4096, 0);
    assert!(err_of(&b).contains("absurd"));
}
