//! `GgufFile`: the parsed header of a memory-mapped GGUF file, with metadata converted to Python values.

use std::path::PathBuf;
use std::sync::Arc;

use ninfer_core::gguf::{ggml_type_layout, GgufFile, MetaValue};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use numpy::IntoPyArray;
use pyo3::IntoPyObjectExt;

use crate::errors::to_py;

/// One row of `GgufFile.tensors()`: (name, type id, type name, dims in GGML order, absolute offset, bytes).
type TensorEntry = (String, u32, &'static str, Vec<u64>, u64, u64);

#[pyclass(name = "GgufFile", module = "ninfer._core", frozen)]
pub struct PyGgufFile {
    pub inner: Arc<GgufFile>,
}

/// A fixed-size little-endian array as a numpy array of its own dtype (one copy, the file's bytes and no more).
fn numeric<'py, T: numpy::Element, const N: usize>(
    py: Python<'py>,
    bytes: &[u8],
    from_le: fn([u8; N]) -> T,
) -> Py<PyAny> {
    let values: Vec<T> = bytes.chunks_exact(N).map(|c| from_le(c.try_into().unwrap())).collect();
    values.into_pyarray(py).into_any().unbind()
}

/// Scalars become Python values, string arrays lists of str, numeric and bool arrays numpy arrays (a list of Python
/// ints would take 8 to 36 bytes for each byte of a hostile u8 array).
fn to_python(py: Python<'_>, file: &GgufFile, v: &MetaValue) -> PyResult<Py<PyAny>> {
    Ok(match v {
        MetaValue::U8(x) => x.into_py_any(py)?,
        MetaValue::I8(x) => x.into_py_any(py)?,
        MetaValue::U16(x) => x.into_py_any(py)?,
        MetaValue::I16(x) => x.into_py_any(py)?,
        MetaValue::U32(x) => x.into_py_any(py)?,
        MetaValue::I32(x) => x.into_py_any(py)?,
        MetaValue::U64(x) => x.into_py_any(py)?,
        MetaValue::I64(x) => x.into_py_any(py)?,
        MetaValue::F32(x) => x.into_py_any(py)?,
        MetaValue::F64(x) => x.into_py_any(py)?,
        MetaValue::Bool(x) => x.into_py_any(py)?,
        MetaValue::Str(s) => s.into_py_any(py)?,
        MetaValue::Array(a) => {
            let b = file.array_bytes(a);
            match a.elem_type {
                0 => numeric(py, b, u8::from_le_bytes),
                1 => numeric(py, b, i8::from_le_bytes),
                2 => numeric(py, b, u16::from_le_bytes),
                3 => numeric(py, b, i16::from_le_bytes),
                4 => numeric(py, b, u32::from_le_bytes),
                5 => numeric(py, b, i32::from_le_bytes),
                6 => numeric(py, b, f32::from_le_bytes),
                7 => numeric(py, b, |[x]: [u8; 1]| x != 0),
                10 => numeric(py, b, u64::from_le_bytes),
                11 => numeric(py, b, i64::from_le_bytes),
                12 => numeric(py, b, f64::from_le_bytes),
                _ => {
                    let list = PyList::empty(py);
                    for text in file.strings(a) {
                        list.append(text.as_ref())?;
                    }
                    list.into_any().unbind()
                }
            }
        }
    })
}

#[pymethods]
impl PyGgufFile {
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let file = py.detach(|| GgufFile::open(&path)).map_err(to_py)?;
        Ok(PyGgufFile { inner: Arc::new(file) })
    }

    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.path.clone()
    }

    #[getter]
    fn version(&self) -> u32 {
        self.inner.version
    }

    #[getter]
    fn file_size(&self) -> u64 {
        self.inner.file_size()
    }

    #[getter]
    fn data_offset(&self) -> u64 {
        self.inner.data_offset
    }

    /// All metadata as a dict: scalars as Python values, string arrays as lists, other arrays as numpy arrays.
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in &self.inner.metadata {
            d.set_item(k, to_python(py, &self.inner, v)?)?;
        }
        Ok(d)
    }

    /// The tensor index: (name, type id, type name, dims in GGML order, absolute offset, bytes) per tensor.
    fn tensors(&self) -> Vec<TensorEntry> {
        self.inner
            .tensors
            .iter()
            .map(|t| {
                let name = ggml_type_layout(t.type_id).map_or("unknown", |l| l.0);
                (t.name.clone(), t.type_id, name, t.dims.clone(), t.offset, t.n_bytes)
            })
            .collect()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyGgufFile>()
}
