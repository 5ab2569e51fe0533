//! `GgufFile`: the parsed header of a memory-mapped GGUF file, with metadata converted to Python values.

use std::path::PathBuf;
use std::sync::Arc;

use ninfer_core::gguf::{ggml_type_layout, GgufFile, MetaValue};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use pyo3::IntoPyObjectExt;

use crate::errors::to_py;

#[pyclass(name = "GgufFile", module = "ninfer._core", frozen)]
pub struct PyGgufFile {
    pub inner: Arc<GgufFile>,
}

fn to_python(py: Python<'_>, v: &MetaValue) -> PyResult<Py<PyAny>> {
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
        MetaValue::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(to_python(py, item)?)?;
            }
            list.into_any().unbind()
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

    /// All metadata as a dict of plain Python values (arrays become lists).
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in &self.inner.metadata {
            d.set_item(k, to_python(py, v)?)?;
        }
        Ok(d)
    }

    /// The tensor index: (name, type id, type name, dims in GGML order, absolute offset, bytes) per tensor.
    fn tensors(&self) -> Vec<(String, u32, &'static str, Vec<u64>, u64, u64)> {
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
