//! GGUF container: a defensive header parser over a memory map (ARCHITECTURE.md, decision 7).
//!
//! Every count, length and offset read from the file is checked against the bytes that remain before it is used,
//! so a hostile or truncated file gives `Error::BadFile` naming the file and the field, never a panic or an
//! out-of-bounds read. Tensor data is not copied: `GgufFile::tensor_data` hands out slices of the map.
//!
//! Layout (version 2 and 3): magic "GGUF", u32 version, u64 tensor_count, u64 kv_count, kv pairs, tensor infos,
//! padding to `general.alignment` (default 32), tensor data.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{Error, Result};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_DIMS: usize = 4;

/// Every GGML type id the container may name: (id, name, elements per block, bytes per block).
/// Sizes let the parser bounds-check tensors of types the engine cannot compute with (they are reported, not run).
const GGML_TYPES: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 36),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
];

/// Name, block size and block bytes of a GGML type id, if the id is known.
pub fn ggml_type_layout(id: u32) -> Option<(&'static str, u64, u64)> {
    GGML_TYPES.iter().find(|t| t.0 == id).map(|t| (t.1, t.2, t.3))
}

/// A metadata value. Arrays are views into the map (`MetaArray`): a hostile count cannot make the parser hold more
/// memory than the file's own bytes, and arrays nobody reads are never decoded.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(MetaArray),
}

/// An array value: its element type (GGUF's value type ids) and where its elements lie in the file. Numeric and
/// bool elements are `count` fixed-size values from `offset`; string elements are length-prefixed, checked at
/// parse time to lie inside the header (decode them with `GgufFile::strings`).
#[derive(Clone, Debug, PartialEq)]
pub struct MetaArray {
    pub elem_type: u32,
    pub count: u64,
    /// Absolute offset of the first element.
    pub offset: usize,
    /// Bytes the elements take in the file.
    pub n_bytes: usize,
}

/// Bytes of one fixed-size array element by GGUF value type (None: strings, which carry their own length).
pub fn meta_elem_size(elem_type: u32) -> Option<usize> {
    match elem_type {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

/// A name or text taken from a file, as it may appear in a message. A plain name (letters, digits and `._-+:/`, up
/// to 80 characters, as every real key and tensor name is) is shown as it is; anything else is quoted, with control
/// and non-ASCII characters escaped (so terminal escape codes cannot act on the screen) and cut to 80 characters,
/// as Python's `ninfer.errors.shown` shows strings.
pub fn shown(text: &str) -> String {
    const LIMIT: usize = 80;
    let plain = |c: char| c.is_ascii_alphanumeric() || "._-+:/".contains(c);
    if !text.is_empty() && text.len() <= LIMIT && text.chars().all(plain) {
        return text.to_string();
    }
    let mut out = String::from("'");
    for c in text.chars() {
        if out.len() >= LIMIT + 8 {
            break;
        }
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("\\'"),
            ' '..='~' => out.push(c),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x100 => out.push_str(&format!("\\x{:02x}", c as u32)),
            c if (c as u32) < 0x10000 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push_str(&format!("\\U{:08x}", c as u32)),
        }
    }
    out.push('\'');
    if out.len() > LIMIT {
        out.truncate(LIMIT - 3);
        out.push_str("...");
    }
    out
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) if v >= 0 => Some(v as u64),
            MetaValue::I16(v) if v >= 0 => Some(v as u64),
            MetaValue::I32(v) if v >= 0 => Some(v as u64),
            MetaValue::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
}

/// One entry of the tensor index. `offset` is absolute in the file; `n_bytes` is checked to lie inside it.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: dims[0] is the contiguous (row) dimension.
    pub dims: Vec<u64>,
    pub type_id: u32,
    pub offset: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed, memory-mapped GGUF file. Cheap to share: the map is reference-counted.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: Vec<(String, MetaValue)>,
    pub tensors: Vec<TensorInfo>,
    pub data_offset: u64,
    pub alignment: u64,
    map: Arc<Mmap>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile> {
        let shown = path.display().to_string();
        let file = File::open(path).map_err(|e| Error::BadFile(format!("{shown}: cannot open model file: {e}")))?;
        let len = file.metadata()?.len();
        if len < 24 {
            return Err(Error::BadFile(format!("{shown}: file is {len} bytes, too small to be a GGUF file")));
        }
        // SAFETY: the map is read-only; the file may change under us only if another process truncates it, which
        // is the usual caveat of every mmap-based loader (llama.cpp included).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::BadFile(format!("{shown}: cannot map file: {e}")))?;
        let Header { version, metadata, tensors, data_offset, alignment } = parse(&map, &shown)?;
        Ok(GgufFile { path: path.to_path_buf(), version, metadata, tensors, data_offset, alignment, map: Arc::new(map) })
    }

    pub fn file_size(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The bytes of a tensor, borrowed from the map (bounds were checked at parse time).
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        &self.map[info.offset as usize..(info.offset + info.n_bytes) as usize]
    }

    /// The bytes of a numeric or bool array's elements, little-endian, borrowed from the map.
    pub fn array_bytes(&self, a: &MetaArray) -> &[u8] {
        &self.map[a.offset..a.offset + a.n_bytes]
    }

    /// A string array's elements, decoded as the parser checked them (invalid UTF-8 replaced, as for keys).
    pub fn strings<'a>(&'a self, a: &MetaArray) -> impl Iterator<Item = std::borrow::Cow<'a, str>> + 'a {
        array_strings(&self.map, a)
    }

    /// The shared map, for weights that must outlive this struct.
    pub fn map(&self) -> Arc<Mmap> {
        Arc::clone(&self.map)
    }
}

/// A bounds-checked little-endian cursor over the header bytes.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    file: &'a str,
}

impl<'a> Reader<'a> {
    fn bad(&self, what: &str) -> Error {
        Error::BadFile(format!("{}: {what} (at byte {} of {})", self.file, self.pos, self.buf.len()))
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.bad(&format!("{what} runs past the end of the file")));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        if n > self.remaining() as u64 {
            return Err(self.bad(&format!("{what}: string length {n} runs past the end of the file")));
        }
        let bytes = self.take(n as usize, what)?;
        // Token texts of some vocabularies are not valid UTF-8; keep them readable rather than failing the load.
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    /// A value of `type_id`; `key` is how messages name it (`key 'name'`, already shown).
    fn value(&mut self, type_id: u32, key: &str, depth: usize) -> Result<MetaValue> {
        let v = match type_id {
            0 => MetaValue::U8(self.take(1, key)?[0]),
            1 => MetaValue::I8(self.take(1, key)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.take(2, key)?.try_into().unwrap())),
            3 => MetaValue::I16(i16::from_le_bytes(self.take(2, key)?.try_into().unwrap())),
            4 => MetaValue::U32(self.u32(key)?),
            5 => MetaValue::I32(self.u32(key)? as i32),
            6 => MetaValue::F32(f32::from_bits(self.u32(key)?)),
            7 => match self.take(1, key)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(self.bad(&format!("{key}: bool byte {b} is neither 0 nor 1"))),
            },
            8 => MetaValue::Str(self.string(key)?),
            9 => {
                if depth > 0 {
                    return Err(self.bad(&format!("{key}: nested arrays are not supported")));
                }
                let elem_type = self.u32(key)?;
                let count = self.u64(key)?;
                let min_size = match (elem_type, meta_elem_size(elem_type)) {
                    (_, Some(n)) => n as u64,
                    (8, None) => 8,
                    (9, None) => return Err(self.bad(&format!("{key}: nested arrays are not supported"))),
                    (t, None) => {
                        return Err(self.bad(&format!("{key}: unknown array element type {t}")))
                    }
                };
                // Reject absurd counts before walking them.
                if count.checked_mul(min_size).is_none_or(|need| need > self.remaining() as u64) {
                    return Err(self.bad(&format!("{key}: array of {count} elements runs past the end of the file")));
                }
                let offset = self.pos;
                if elem_type == 8 {
                    for _ in 0..count {
                        let n = self.u64(key)?;
                        if n > self.remaining() as u64 {
                            return Err(self.bad(&format!("{key}: string length {n} runs past the end of the file")));
                        }
                        self.pos += n as usize;
                    }
                } else {
                    let bytes = self.take((count * min_size) as usize, key)?;
                    if elem_type == 7 {
                        if let Some(b) = bytes.iter().find(|&&b| b > 1) {
                            return Err(self.bad(&format!("{key}: bool byte {b} is neither 0 nor 1")));
                        }
                    }
                }
                MetaValue::Array(MetaArray { elem_type, count, offset, n_bytes: self.pos - offset })
            }
            10 => MetaValue::U64(self.u64(key)?),
            11 => MetaValue::I64(self.u64(key)? as i64),
            12 => MetaValue::F64(f64::from_bits(self.u64(key)?)),
            t => return Err(self.bad(&format!("{key}: unknown value type {t}"))),
        };
        Ok(v)
    }
}

/// The elements of a string array of `buf` (empty for other element types). The parser checked every length.
fn array_strings<'a>(buf: &'a [u8], a: &MetaArray) -> impl Iterator<Item = std::borrow::Cow<'a, str>> + 'a {
    let mut pos = a.offset;
    let count = if a.elem_type == 8 { a.count } else { 0 };
    (0..count).map(move |_| {
        let n = u64::from_le_bytes(buf[pos..pos + 8].try_into().unwrap()) as usize;
        let text = String::from_utf8_lossy(&buf[pos + 8..pos + 8 + n]);
        pos += 8 + n;
        text
    })
}

/// What the header says, before it is tied to a map.
struct Header {
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<TensorInfo>,
    data_offset: u64,
    alignment: u64,
}

impl Header {
    #[cfg(test)]
    fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

fn parse(buf: &[u8], file: &str) -> Result<Header> {
    let mut r = Reader { buf, pos: 0, file };
    let magic = r.take(4, "magic")?;
    if magic != MAGIC {
        return Err(Error::BadFile(format!("{file}: not a GGUF file (magic bytes {magic:02x?}, expected \"GGUF\")")));
    }
    let version = r.u32("version")?;
    if version != 2 && version != 3 {
        return Err(Error::BadFile(format!("{file}: GGUF version {version} is not supported (2 and 3 are)")));
    }
    let n_tensors = r.u64("tensor count")?;
    let n_kv = r.u64("metadata count")?;
    // The smallest kv pair is 8 (key length) + 4 (type) + 1 bytes; the smallest tensor info 8 + 4 + 8 + 4 + 8.
    if n_kv.checked_mul(13).is_none_or(|need| need > r.remaining() as u64) {
        return Err(r.bad(&format!("metadata count {n_kv} is larger than the file can hold (truncated or corrupt file)")));
    }
    if n_tensors.checked_mul(32).is_none_or(|need| need > r.remaining() as u64) {
        return Err(r.bad(&format!("tensor count {n_tensors} is larger than the file can hold (truncated or corrupt file)")));
    }

    let mut metadata: Vec<(String, MetaValue)> = Vec::with_capacity(n_kv as usize);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..n_kv {
        let key = r.string("metadata key")?;
        let what = format!("key {}", shown(&key));
        let type_id = r.u32(&what)?;
        let value = r.value(type_id, &what, 0)?;
        if !seen.insert(key.clone()) {
            return Err(r.bad(&format!("duplicate metadata {what}")));
        }
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
            _ => {
                let v = match v {
                    MetaValue::Str(text) => shown(text),
                    MetaValue::Array(a) => format!("an array of {} elements", a.count),
                    v => format!("{v:?}"),
                };
                return Err(r.bad(&format!("general.alignment {v} is not a power of two up to 2^20")));
            }
        },
    };

    struct RawTensor {
        name: String,
        dims: Vec<u64>,
        type_id: u32,
        rel_offset: u64,
    }
    let mut raw = Vec::with_capacity(n_tensors as usize);
    let mut names = std::collections::HashSet::new();
    for _ in 0..n_tensors {
        let name = r.string("tensor name")?;
        let what = format!("tensor {}", shown(&name));
        let n_dims = r.u32(&what)? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(r.bad(&format!("{what}: {n_dims} dimensions (1 to {MAX_DIMS} allowed)")));
        }
        let mut dims = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            dims.push(r.u64(&what)?);
        }
        let type_id = r.u32(&what)?;
        let rel_offset = r.u64(&what)?;
        if !names.insert(name.clone()) {
            return Err(r.bad(&format!("duplicate {what}")));
        }
        raw.push(RawTensor { name, dims, type_id, rel_offset });
    }

    let data_offset = (r.pos as u64).div_ceil(alignment) * alignment;
    let file_len = buf.len() as u64;
    let mut tensors = Vec::with_capacity(raw.len());
    for t in raw {
        let name = &shown(&t.name);
        let Some((type_name, block, type_size)) = ggml_type_layout(t.type_id) else {
            return Err(Error::UnsupportedType(format!("{file}: tensor {name} has unknown GGML type id {}", t.type_id)));
        };
        let n_elem = t
            .dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n < 1 << 48)
            .ok_or_else(|| Error::BadFile(format!("{file}: tensor {name}: dimensions {:?} are absurd", t.dims)))?;
        if t.dims[0] % block != 0 {
            return Err(Error::BadFile(format!(
                "{file}: tensor {name}: row length {} is not a multiple of the {type_name} block size {block}",
                t.dims[0]
            )));
        }
        let n_bytes = n_elem / block * type_size;
        if t.rel_offset % alignment != 0 {
            return Err(Error::BadFile(format!(
                "{file}: tensor {name}: data offset {} is not aligned to {alignment}",
                t.rel_offset
            )));
        }
        let end = data_offset.checked_add(t.rel_offset).and_then(|o| o.checked_add(n_bytes));
        match end {
            Some(end) if end <= file_len => {}
            _ => {
                return Err(Error::BadFile(format!(
                    "{file}: tensor {name} ({type_name}, {n_bytes} bytes at offset {}) runs past the end of the \
                     file ({file_len} bytes): the file is truncated or corrupt",
                    data_offset.saturating_add(t.rel_offset)
                )))
            }
        }
        tensors.push(TensorInfo {
            name: t.name,
            dims: t.dims,
            type_id: t.type_id,
            offset: data_offset + t.rel_offset,
            n_bytes,
        });
    }

    Ok(Header { version, metadata, tensors, data_offset, alignment })
}

#[cfg(test)]
mod tests;
