//! Python access to the GSQ-RCO format (`ninfer_core::gsq`): `gsq_quantize`, `gsq_dequantize`, `gsq_dot`.

use ninfer_core::gsq::{self, Layout};
use numpy::{
    IntoPyArray, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_py;

fn layout(group: usize, slots: usize) -> PyResult<Layout> {
    Layout::new(group, slots).map_err(to_py)
}

/// gsq_quantize(w[rows, cols] f32, h[cols] f32, group, slots, steps, threads, sparsity=True) ->
/// (records[rows, row_bytes] u8, stats dict: weight, err_rtn, err, zeros, sparse_groups, slots_used).
#[pyfunction]
#[pyo3(signature = (w, h, *, group, slots, steps, threads, sparsity = true))]
#[allow(clippy::too_many_arguments)]
fn gsq_quantize<'py>(
    py: Python<'py>,
    w: PyReadonlyArray2<'py, f32>,
    h: PyReadonlyArray1<'py, f32>,
    group: usize,
    slots: usize,
    steps: usize,
    threads: usize,
    sparsity: bool,
) -> PyResult<(Bound<'py, PyArray2<u8>>, Bound<'py, PyDict>)> {
    let l = layout(group, slots)?;
    let (rows, cols) = (w.shape()[0], w.shape()[1]);
    // Zero-copy for the contiguous arrays the converter passes (a copy only for a strided view): the largest
    // tensor's f32 copy is what bounds the converter's memory.
    let (w_owned, h_owned);
    let w: &[f32] = match w.as_slice() {
        Ok(s) => s,
        Err(_) => {
            w_owned = w.as_array().iter().copied().collect::<Vec<f32>>();
            &w_owned
        }
    };
    let h: &[f32] = match h.as_slice() {
        Ok(s) => s,
        Err(_) => {
            h_owned = h.as_array().iter().copied().collect::<Vec<f32>>();
            &h_owned
        }
    };
    let (data, stats) = py
        .detach(|| gsq::quantize_matrix(l, w, cols, h, &gsq::Options { steps, sparsity }, threads))
        .map_err(to_py)?;
    let row_bytes = data.len().checked_div(rows).unwrap_or(0);
    let d = PyDict::new(py);
    d.set_item("weight", stats.weight)?;
    d.set_item("err_rtn", stats.err_rtn)?;
    d.set_item("err", stats.err)?;
    d.set_item("zeros", stats.zeros)?;
    d.set_item("sparse_groups", stats.sparse_groups)?;
    d.set_item("slots_used", stats.slots_used)?;
    Ok((data.into_pyarray(py).reshape([rows, row_bytes])?, d))
}

/// gsq_dequantize(data, rows, cols, group, slots) -> f32[rows, cols].
#[pyfunction]
#[pyo3(signature = (data, rows, cols, *, group, slots))]
fn gsq_dequantize<'py>(
    py: Python<'py>,
    data: &[u8],
    rows: usize,
    cols: usize,
    group: usize,
    slots: usize,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let l = layout(group, slots)?;
    let row_bytes = l.row_bytes(cols).map_err(to_py)?;
    if data.len() != rows * row_bytes {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "{rows} GSQ-RCO rows of {cols} weights take {} bytes, got {}",
            rows * row_bytes,
            data.len()
        )));
    }
    let out = py.detach(|| {
        let mut out = vec![0f32; rows * cols];
        for (src, dst) in data
            .chunks_exact(row_bytes.max(1))
            .zip(out.chunks_exact_mut(cols.max(1)))
        {
            gsq::dequantize_row(l, src, dst)?;
        }
        Ok::<_, ninfer_core::Error>(out)
    });
    out.map_err(to_py)?.into_pyarray(py).reshape([rows, cols])
}

/// gsq_dot(row, x, group, slots) -> float: one row's records dotted with f32 activations (the scalar reference).
#[pyfunction]
#[pyo3(signature = (row, x, *, group, slots))]
fn gsq_dot(row: &[u8], x: PyReadonlyArray1<'_, f32>, group: usize, slots: usize) -> PyResult<f32> {
    let l = layout(group, slots)?;
    let x = x.as_slice()?;
    if l.row_bytes(x.len()).map_err(to_py)? != row.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "row bytes do not match the activation length",
        ));
    }
    Ok(gsq::dot_row(l, row, x))
}

/// gsq_row_bytes(cols, group, slots) -> int: bytes of a row's records.
#[pyfunction]
#[pyo3(signature = (cols, *, group, slots))]
fn gsq_row_bytes(cols: usize, group: usize, slots: usize) -> PyResult<usize> {
    layout(group, slots)?.row_bytes(cols).map_err(to_py)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(gsq_row_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(gsq_quantize, m)?)?;
    m.add_function(wrap_pyfunction!(gsq_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(gsq_dot, m)?)?;
    Ok(())
}
