//! Python access to the GSQ-RCO format (`ninfer_core::gsq`): `gsq_quantize`, `gsq_dequantize`, `gsq_dot`,
//! `gsq_dot_q8`, and `q2_k_quantize` (llama.cpp's Q2_K by the same optimiser).

use ninfer_core::gsq::{self, Layout};
use numpy::{
    IntoPyArray, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_py;

fn layout(bits: usize, slots: usize) -> PyResult<Layout> {
    Layout::new(bits, slots).map_err(to_py)
}

/// The statistics as a dict: weight, err_rtn, err, slots_used.
fn stats_dict<'py>(py: Python<'py>, stats: &gsq::RowStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("weight", stats.weight)?;
    d.set_item("err_rtn", stats.err_rtn)?;
    d.set_item("err", stats.err)?;
    d.set_item("slots_used", stats.slots_used)?;
    Ok(d)
}

/// Quantize `w` row by row with `quantize` (on the matrix's values and importances, without the GIL):
/// (bytes[rows, row_bytes] u8, stats dict).
fn quantize_with<'py>(
    py: Python<'py>,
    w: PyReadonlyArray2<'py, f32>,
    h: PyReadonlyArray1<'py, f32>,
    quantize: impl FnOnce(&[f32], usize, &[f32]) -> ninfer_core::Result<(Vec<u8>, gsq::RowStats)> + Send,
) -> PyResult<(Bound<'py, PyArray2<u8>>, Bound<'py, PyDict>)> {
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
    let (data, stats) = py.detach(move || quantize(w, cols, h)).map_err(to_py)?;
    let row_bytes = data.len().checked_div(rows).unwrap_or(0);
    Ok((data.into_pyarray(py).reshape([rows, row_bytes])?, stats_dict(py, &stats)?))
}

/// gsq_quantize(w[rows, cols] f32, h[cols] f32, bits, slots, steps, threads) ->
/// (records[rows, row_bytes] u8, stats dict: weight, err_rtn, err, slots_used).
#[pyfunction]
#[pyo3(signature = (w, h, *, bits, slots, steps, threads))]
fn gsq_quantize<'py>(
    py: Python<'py>,
    w: PyReadonlyArray2<'py, f32>,
    h: PyReadonlyArray1<'py, f32>,
    bits: usize,
    slots: usize,
    steps: usize,
    threads: usize,
) -> PyResult<(Bound<'py, PyArray2<u8>>, Bound<'py, PyDict>)> {
    let l = layout(bits, slots)?;
    quantize_with(py, w, h, |w, cols, h| gsq::quantize_matrix(l, w, cols, h, &gsq::Options { steps }, threads))
}

/// q2_k_quantize(w[rows, cols] f32, h[cols] f32, steps, threads) -> (Q2_K blocks[rows, row_bytes] u8, stats dict):
/// llama.cpp's Q2_K by the GSQ-RCO optimiser (cols a multiple of 256).
#[pyfunction]
#[pyo3(signature = (w, h, *, steps, threads))]
fn q2_k_quantize<'py>(
    py: Python<'py>,
    w: PyReadonlyArray2<'py, f32>,
    h: PyReadonlyArray1<'py, f32>,
    steps: usize,
    threads: usize,
) -> PyResult<(Bound<'py, PyArray2<u8>>, Bound<'py, PyDict>)> {
    quantize_with(py, w, h, |w, cols, h| gsq::quantize_matrix_q2_k(w, cols, h, &gsq::Options { steps }, threads))
}

/// gsq_dequantize(data, rows, cols, bits, slots) -> f32[rows, cols].
#[pyfunction]
#[pyo3(signature = (data, rows, cols, *, bits, slots))]
fn gsq_dequantize<'py>(
    py: Python<'py>,
    data: &[u8],
    rows: usize,
    cols: usize,
    bits: usize,
    slots: usize,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let l = layout(bits, slots)?;
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

/// The row and activations of a dot product, checked against each other.
fn dot_args<'a>(row: &[u8], x: &'a PyReadonlyArray1<'_, f32>, bits: usize, slots: usize) -> PyResult<(Layout, &'a [f32])> {
    let l = layout(bits, slots)?;
    let x = x.as_slice()?;
    if l.row_bytes(x.len()).map_err(to_py)? != row.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "row bytes do not match the activation length",
        ));
    }
    Ok((l, x))
}

/// gsq_dot(row, x, bits, slots) -> float: one row's records dotted with f32 activations (dequantized row).
#[pyfunction]
#[pyo3(signature = (row, x, *, bits, slots))]
fn gsq_dot(row: &[u8], x: PyReadonlyArray1<'_, f32>, bits: usize, slots: usize) -> PyResult<f32> {
    let (l, x) = dot_args(row, &x, bits, slots)?;
    gsq::dot_row(l, row, x).map_err(to_py)
}

/// gsq_dot_q8(row, x, bits, slots, simd=True) -> float: the same with x quantized to int8 as the engine does,
/// by this CPU's kernel (simd) or the scalar reference.
#[pyfunction]
#[pyo3(signature = (row, x, *, bits, slots, simd = true))]
fn gsq_dot_q8(row: &[u8], x: PyReadonlyArray1<'_, f32>, bits: usize, slots: usize, simd: bool) -> PyResult<f32> {
    let (l, x) = dot_args(row, &x, bits, slots)?;
    let xq = gsq::ActQ8::from_f32(x);
    Ok(if simd { ninfer_core::quant::simd::gsq_dot_q8(l, row, &xq) } else { gsq::dot_row_q8(l, row, &xq) })
}

/// gsq_row_bytes(cols, bits, slots) -> int: bytes of a row's records.
#[pyfunction]
#[pyo3(signature = (cols, *, bits, slots))]
fn gsq_row_bytes(cols: usize, bits: usize, slots: usize) -> PyResult<usize> {
    layout(bits, slots)?.row_bytes(cols).map_err(to_py)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(gsq_row_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(gsq_quantize, m)?)?;
    m.add_function(wrap_pyfunction!(q2_k_quantize, m)?)?;
    m.add_function(wrap_pyfunction!(gsq_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(gsq_dot, m)?)?;
    m.add_function(wrap_pyfunction!(gsq_dot_q8, m)?)?;
    Ok(())
}
