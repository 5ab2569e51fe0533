//! Python access to the GGML block formats of `ninfer_core::quant`, for tests and tools:
//! `dequantize`, `quantize_act`, `vec_dot`, `quantize_row`, `type_info`.
//!
//! Argument errors found here (unknown type id, a length that does not fit the type) raise `ValueError`
//! before any core call; the work itself runs with the GIL released.

use ninfer_core::quant::{self, GgmlType};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::to_py;

/// The type with GGML id `type_id`, or `ValueError` (ids are taken as i64 so negative ones are ValueErrors too).
fn ggml_type(type_id: i64) -> PyResult<GgmlType> {
    u32::try_from(type_id)
        .ok()
        .and_then(GgmlType::from_id)
        .ok_or_else(|| PyValueError::new_err(format!("unknown GGML type id {type_id}")))
}

/// An element count from Python, or `ValueError` if negative.
fn count(n: i64) -> PyResult<usize> {
    usize::try_from(n).map_err(|_| PyValueError::new_err(format!("element count must be >= 0, got {n}")))
}

/// Bytes of a row of `n` elements of `ty`, or `ValueError` when `n` is not a whole number of blocks.
fn row_bytes(ty: GgmlType, n: usize) -> PyResult<usize> {
    ty.row_bytes(n).map_err(|_| {
        PyValueError::new_err(format!(
            "{n} elements is not a whole number of {ty} blocks ({} elements each)",
            ty.block_size()
        ))
    })
}

/// `ValueError` unless `data` is exactly the size of a row of `n` elements of `ty`.
fn check_len(what: &str, ty: GgmlType, n: usize, data: &[u8]) -> PyResult<()> {
    let expected = row_bytes(ty, n)?;
    if data.len() != expected {
        return Err(PyValueError::new_err(format!(
            "{what}: a {ty} row of {n} elements takes {expected} bytes, got {}",
            data.len()
        )));
    }
    Ok(())
}

/// Copy a 1-D float32 array (any strides) into a Vec, so the GIL can be released while working on it.
fn to_vec(x: &PyReadonlyArray1<'_, f32>) -> Vec<f32> {
    match x.as_slice() {
        Ok(s) => s.to_vec(),
        Err(_) => x.as_array().iter().copied().collect(),
    }
}

/// dequantize(type_id, data, n) -> numpy.ndarray[float32]: the `n` elements of a row of GGML type `type_id`.
/// The CPU kernel set chosen for this machine: "avx2" or "scalar".
#[pyfunction]
fn simd_isa() -> &'static str {
    ninfer_core::quant::simd::isa()
}

#[pyfunction]
fn dequantize<'py>(py: Python<'py>, type_id: i64, data: &[u8], n: i64) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let ty = ggml_type(type_id)?;
    let n = count(n)?;
    check_len("dequantize", ty, n, data)?;
    let out = py.detach(|| {
        let mut out = vec![0.0f32; n];
        quant::dequantize_row(ty, data, &mut out).map(|()| out)
    });
    Ok(out.map_err(to_py)?.into_pyarray(py))
}

/// quantize_act(act_type_id, x) -> bytes: an f32 activation row quantized the way llama.cpp does before a dot
/// product (act types: F32, F16, BF16, Q8_0, Q8_1, Q8_K).
#[pyfunction]
fn quantize_act<'py>(
    py: Python<'py>,
    act_type_id: i64,
    x: PyReadonlyArray1<'py, f32>,
) -> PyResult<Bound<'py, PyBytes>> {
    let ty = ggml_type(act_type_id)?;
    if !ty.is_act_type() {
        return Err(PyValueError::new_err(format!(
            "{ty} is not an activation type (expected F32, F16, BF16, Q8_0, Q8_1 or Q8_K)"
        )));
    }
    let x = to_vec(&x);
    let size = row_bytes(ty, x.len())?;
    let out = py.detach(|| {
        let mut out = vec![0u8; size];
        quant::quantize_act(ty, &x, &mut out);
        out
    });
    Ok(PyBytes::new(py, &out))
}

/// vec_dot(type_id, n, w, act) -> float: a weight row of type `type_id` (n elements) dotted with an activation
/// row quantized to that type's activation type (see `quantize_act`).
#[pyfunction]
fn vec_dot(py: Python<'_>, type_id: i64, n: i64, w: &[u8], act: &[u8]) -> PyResult<f32> {
    let ty = ggml_type(type_id)?;
    let n = count(n)?;
    check_len("vec_dot weights", ty, n, w)?;
    check_len("vec_dot activations", ty.act_type(), n, act)?;
    Ok(py.detach(|| quant::vec_dot(ty, n, w, act)))
}

/// quantize_row(type_id, x) -> bytes: a row quantized with llama.cpp's reference quantizer (KV-cache types).
#[pyfunction]
fn quantize_row<'py>(py: Python<'py>, type_id: i64, x: PyReadonlyArray1<'py, f32>) -> PyResult<Bound<'py, PyBytes>> {
    let ty = ggml_type(type_id)?;
    let x = to_vec(&x);
    let size = row_bytes(ty, x.len())?;
    let out = py.detach(|| {
        let mut out = vec![0u8; size];
        quant::quantize_row(ty, &x, &mut out).map(|()| out)
    });
    Ok(PyBytes::new(py, &out.map_err(to_py)?))
}

/// type_info(type_id) -> (name, block_size, type_size).
#[pyfunction]
fn type_info(type_id: i64) -> PyResult<(&'static str, usize, usize)> {
    let ty = ggml_type(type_id)?;
    Ok((ty.name(), ty.block_size(), ty.type_size()))
}

/// Add the quant functions to the `_core` module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(simd_isa, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(quantize_act, m)?)?;
    m.add_function(wrap_pyfunction!(vec_dot, m)?)?;
    m.add_function(wrap_pyfunction!(quantize_row, m)?)?;
    m.add_function(wrap_pyfunction!(type_info, m)?)?;
    Ok(())
}
