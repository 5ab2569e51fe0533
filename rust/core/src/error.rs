//! The one error enum of the core. The binding maps each variant to its own Python exception class
//! (python/ninfer/errors.py), so every message must name the file, tensor or limit it is about.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    /// The model file is malformed: bad magic, offsets past the end, absurd counts, wrong sizes.
    #[error("{0}")]
    BadFile(String),
    /// A tensor type the engine cannot compute with.
    #[error("{0}")]
    UnsupportedType(String),
    /// A model description the executor cannot run (missing tensor, inconsistent shapes).
    #[error("{0}")]
    BadModel(String),
    /// A sequence would grow past the context or the KV cache has no free blocks.
    #[error("{0}")]
    ContextOverflow(String),
    /// An argument outside its valid range (unknown sequence id, empty input, ...).
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T> = std::result::Result<T, Error>;
