//! The layering of `lib.rs`'s docs, checked on the source: every `crate::`, `super::`, `self::` or child-module
//! path in a non-test file of `quant/`, `gsq/`, `kv/` and `cpu/` is resolved to the file it names, and
//! - a file imports only files of its own layer or of layers below it (`cpu` may also import `model`, ...);
//! - there is no import cycle among those files;
//! - the KV books (`kv/blocks.rs`) import nothing but `error`: they know no storage, no format, no kernel.
//!
//! A deliberately small parser (comments, inline `#[cfg(test)]` modules and `pub(in ...)` are skipped), enough for
//! the way this crate writes paths; a new file under `quant/` or `gsq/` must be given a layer in [`layer`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// (number, name) of the layer of `file` (a path relative to `src/`), `None` for files outside the layering.
fn layer(file: &str) -> Option<(u8, &'static str)> {
    Some(match file {
        "error.rs" | "quant/math.rs" => (0, "math"),
        "quant/format.rs" | "gsq/format.rs" => (1, "formats"),
        "quant/float.rs" | "quant/legacy.rs" | "quant/kquants.rs" | "quant/scalar.rs" | "gsq/quantize.rs" => {
            (2, "scalar code")
        }
        f if f.starts_with("quant/simd/") => (3, "SIMD kernels"),
        "quant/mod.rs" | "gsq/mod.rs" => (4, "entry points"),
        f if f.starts_with("kv/") => (5, "kv"),
        f if f.starts_with("cpu/") => (6, "cpu"),
        _ => return None,
    })
}

fn is_test_file(file: &str) -> bool {
    let name = file.rsplit('/').next().unwrap_or(file);
    name == "tests.rs" || name.ends_with("_tests.rs") || name == "test_rng.rs"
}

/// Every `.rs` file under `dir`, as paths relative to `root`.
fn rust_files(root: &Path, dir: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path.strip_prefix(root).unwrap().to_string_lossy().replace('\\', "/"));
        }
    }
}

/// The module path of a file: `quant/simd/mod.rs` -> [quant, simd], `lib.rs` -> [].
fn module_of(file: &str) -> Vec<String> {
    let mut parts: Vec<String> = file.trim_end_matches(".rs").split('/').map(str::to_owned).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// The source without comments (outside string literals), `pub(in ...)` visibilities and what follows the first
/// inline `#[cfg(test)] mod name {`.
fn code_of(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let (mut in_str, mut escaped) = (false, false);
    let mut chars = src.chars().peekable();
    while let Some(c) = chars.next() {
        if in_str {
            in_str = escaped || c != '"';
            escaped = !escaped && c == '\\';
        } else if c == '"' {
            in_str = true;
        } else if c == '/' && chars.peek() == Some(&'/') {
            while chars.peek().is_some_and(|&c| c != '\n') {
                chars.next();
            }
            continue;
        }
        out.push(c);
    }
    let mut code = out;
    let mut from = 0;
    while let Some(i) = code[from..].find("#[cfg(test)]").map(|i| i + from) {
        let rest = code[i + "#[cfg(test)]".len()..].trim_start();
        let inline_mod = rest.strip_prefix("mod ").is_some_and(|r| {
            let r = r.trim_start_matches(|c: char| c.is_alphanumeric() || c == '_').trim_start();
            r.starts_with('{')
        });
        if inline_mod {
            code.truncate(i);
            break;
        }
        from = i + 1;
    }
    while let Some(i) = code.find("pub(in ") {
        let j = code[i..].find(')').map_or(code.len(), |j| i + j + 1);
        code.replace_range(i..j, "pub");
    }
    code
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The paths starting at `s` (`a::b::{c, d::e}` gives a::b::c and a::b::d::e), with the rest of `s` after them.
fn parse_path<'a>(mut s: &'a str, prefix: &[String], out: &mut Vec<Vec<String>>) -> &'a str {
    let mut path = prefix.to_vec();
    loop {
        s = s.trim_start();
        if let Some(rest) = s.strip_prefix('{') {
            s = rest;
            loop {
                s = parse_path(s, &path, out).trim_start();
                match s.strip_prefix(',') {
                    Some(rest) => s = rest,
                    None => break,
                }
                if let Some(rest) = s.trim_start().strip_prefix('}') {
                    return rest;
                }
            }
            return s.trim_start().strip_prefix('}').unwrap_or(s);
        }
        let end = s.find(|c: char| !is_ident(c)).unwrap_or(s.len());
        if end == 0 {
            break;
        }
        path.push(s[..end].to_owned());
        s = &s[end..];
        match s.strip_prefix("::") {
            Some(rest) => s = rest,
            None => break,
        }
    }
    if path.len() > prefix.len() {
        out.push(path);
    }
    // A glob, or a renaming: `a::*`, `a::b as c`.
    s = s.trim_start();
    if let Some(rest) = s.strip_prefix('*') {
        s = rest;
    } else if let Some(rest) = s.strip_prefix("as ") {
        let rest = rest.trim_start();
        s = &rest[rest.find(|c: char| !is_ident(c)).unwrap_or(rest.len())..];
    }
    s
}

/// The files of the modules `code` (the source of `module`) names.
fn imports(module: &[String], code: &str, modules: &BTreeMap<Vec<String>, String>) -> BTreeSet<String> {
    let mut paths = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find(|c: char| is_ident(c)) {
        let at_word_start = i == 0 || !rest[..i].ends_with(|c: char| is_ident(c) || c == ':');
        let tail = &rest[i..];
        let end = tail.find(|c: char| !is_ident(c)).unwrap_or(tail.len());
        if at_word_start && tail[end..].starts_with("::") {
            rest = parse_path(tail, &[], &mut paths);
        } else {
            rest = &tail[end..];
        }
    }
    let mut out = BTreeSet::new();
    for p in paths {
        let (mut base, mut segs): (Vec<String>, &[String]) = match p[0].as_str() {
            "crate" => (vec![], &p[1..]),
            "self" => (module.to_vec(), &p[1..]),
            "super" => (module.to_vec(), &p[..]),
            child => {
                let mut m = module.to_vec();
                m.push(child.to_owned());
                if !modules.contains_key(&m) {
                    continue;
                }
                (module.to_vec(), &p[..])
            }
        };
        while segs.first().is_some_and(|s| s == "super") {
            base.pop();
            segs = &segs[1..];
        }
        base.extend(segs.iter().cloned());
        while !base.is_empty() && !modules.contains_key(&base) {
            base.pop();
        }
        if let Some(file) = modules.get(&base) {
            if base != module {
                out.insert(file.clone());
            }
        }
    }
    out
}

#[test]
fn kernels_and_formats_import_only_downwards_and_without_cycles() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&root, &root, &mut files);
    let modules: BTreeMap<Vec<String>, String> = files.iter().map(|f| (module_of(f), f.clone())).collect();
    let checked: Vec<&String> = files
        .iter()
        .filter(|f| !is_test_file(f) && ["quant/", "gsq/", "kv/", "cpu/"].iter().any(|d| f.starts_with(d)))
        .collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut wrong = Vec::new();
    for &f in &checked {
        let Some((l, name)) = layer(f) else {
            wrong.push(format!("{f} has no layer: add it to `layer` in layering_tests.rs (and lib.rs's docs)"));
            continue;
        };
        let src = std::fs::read_to_string(root.join(f)).unwrap();
        let to = imports(&module_of(f), &code_of(&src), &modules);
        for t in &to {
            match layer(t) {
                Some((lt, tname)) if lt > l => wrong.push(format!("{f} ({name}) imports {t} ({tname}), a layer above")),
                None if l < 6 => wrong.push(format!("{f} ({name}) imports {t}, outside the layers")),
                _ => {}
            }
        }
        edges.insert(f.clone(), to.into_iter().filter(|t| layer(t).is_some()).collect());
    }
    // The parser must see the edges that exist, or the checks above pass vacuously.
    for (a, b) in [
        ("quant/simd/vecops.rs", "quant/math.rs"),
        ("quant/simd/x86_avx2/gsq.rs", "gsq/format.rs"),
        ("quant/simd/mod.rs", "quant/scalar.rs"),
        ("quant/mod.rs", "quant/simd/mod.rs"),
        ("gsq/quantize.rs", "quant/format.rs"),
        ("cpu/matmul.rs", "quant/simd/mod.rs"),
        ("kv/cache.rs", "kv/blocks.rs"),
        ("kv/cache.rs", "quant/mod.rs"),
        ("cpu/forward.rs", "kv/mod.rs"),
    ] {
        assert!(edges.get(a).is_some_and(|e| e.contains(b)), "the parser no longer sees {a} -> {b}");
    }
    let books: Vec<&String> = edges["kv/blocks.rs"].iter().filter(|t| *t != "error.rs").collect();
    assert!(books.is_empty(), "kv/blocks.rs (the books) imports {books:?}");
    assert!(wrong.is_empty(), "layering broken:\n{}", wrong.join("\n"));
    // No cycles: a depth-first search finds no edge back to a file on the current path.
    type Edges = BTreeMap<String, BTreeSet<String>>;
    fn visit<'a>(f: &'a str, edges: &'a Edges, state: &mut BTreeMap<&'a str, bool>, path: &mut Vec<&'a str>) {
        match state.get(f) {
            Some(true) => return,
            Some(false) => panic!("import cycle: {} -> {f}", path.join(" -> ")),
            None => {}
        }
        state.insert(f, false);
        path.push(f);
        for t in edges.get(f).into_iter().flatten() {
            visit(t, edges, state, path);
        }
        path.pop();
        state.insert(f, true);
    }
    let mut state = BTreeMap::new();
    for f in edges.keys() {
        visit(f, &edges, &mut state, &mut Vec::new());
    }
}
