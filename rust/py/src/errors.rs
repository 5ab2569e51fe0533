//! The one mapping from the core's error enum to ninfer's Python exception classes (python/ninfer/errors.py).

use ninfer_core::Error;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;

fn raise(class: &str, msg: String) -> PyErr {
    Python::attach(|py| {
        match py.import("ninfer.errors").and_then(|m| m.getattr(class)) {
            Ok(cls) => PyErr::from_type(cls.cast_into().expect("ninfer.errors classes are types"), msg),
            // Only if the Python package is broken: still raise something that says what went wrong.
            Err(_) => PyValueError::new_err(msg),
        }
    })
}

pub fn to_py(err: Error) -> PyErr {
    match err {
        Error::BadFile(m) => raise("ModelFileError", m),
        Error::UnsupportedType(m) | Error::BadModel(m) => raise("UnsupportedModelError", m),
        Error::ContextOverflow(m) => raise("ContextOverflowError", m),
        Error::InvalidArgument(m) => raise("InvalidArgumentError", m),
        Error::Io(e) => PyOSError::new_err(e.to_string()),
    }
}
