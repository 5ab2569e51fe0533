//! The key bias tables of `ninfer_core::kv::key_bias` and the key scales of `ninfer_core::kv::key_scales` for the
//! CUDA backend's quantized caches, computed by the CPU engine's own code (so both backends store the same keys).

use ninfer_core::cpu::rope::{block_start_turns, roped_bias_slots, RopeParams};
use ninfer_core::kv::key_bias::{pair, settle_slow_pairs, slot_mean};
use ninfer_core::model::Model;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::to_py;
use crate::gguf::PyGgufFile;
use crate::spec;

/// A layer's key bias tables: (slots, turns, fast, slow, mean).
type Tables<'py> = (Bound<'py, PyArray2<f32>>, Bound<'py, PyArray1<f32>>, Bound<'py, PyArray2<i32>>, Bound<'py, PyArray1<f32>>,
                    Bound<'py, PyArray1<f32>>);

/// The tables of layer `layer`'s key bias `bias` ([n_head_kv * head_dim] f32) for pages of `page_size` positions and
/// a context of `n_ctx`: (slots [page_size][n_head_kv * head_dim], the bias roped to each slot of a page starting at
/// position 0, its slow pairs settled to their page mean (`settle_slow_pairs`); turns [n_pages][rope_dims] as (cos,
/// sin) pairs of each page start's angles without RoPE's magnitude; fast [n_head_kv][most fast pairs of a head, at
/// least 1], each head's fast pairs ascending, then -1; slow [n_head_kv * head_dim], the settled part of a slot's
/// row, zero in the fast pairs; mean [n_head_kv * head_dim], the slots' mean as the CPU's keys scorer takes it).
#[pyfunction]
fn key_bias_tables<'py>(
    py: Python<'py>,
    spec: &Bound<'py, PyAny>,
    layer: usize,
    bias: PyReadonlyArray1<'py, f32>,
    page_size: usize,
    n_ctx: usize,
) -> PyResult<Tables<'py>> {
    let s = spec::extract(spec)?;
    let ls = s.layers.get(layer).ok_or_else(|| PyValueError::new_err(format!("no layer {layer}")))?;
    let kd = s.n_head_kv * s.head_dim;
    let b = bias.as_slice()?;
    if b.len() != kd || page_size == 0 {
        return Err(PyValueError::new_err(format!("a key bias of {kd} values and pages of some positions, got {} and {page_size}", b.len())));
    }
    let p = RopeParams::new(ls.rope_base, ls.rope_freq_scale, s.rope_dims, &s.rope_yarn);
    let mut slots = roped_bias_slots(b, &p, s.head_dim, s.rope_dims, s.rope_neox, page_size);
    let fast = settle_slow_pairs(&mut slots, s.n_head_kv, s.head_dim, s.rope_dims, s.rope_neox, page_size);
    let half = s.rope_dims / 2;
    // (at least one column: a layer whose bias never turns within a page lists one -1 a head)
    let n_fast = fast.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let mut fast_table = vec![-1i32; s.n_head_kv * n_fast];
    let mut slow = slots[..kd].to_vec();
    for (g, pairs) in fast.iter().enumerate() {
        for (k, &i) in pairs.iter().enumerate() {
            fast_table[g * n_fast + k] = i as i32;
            let (a, b) = pair(i, half, s.rope_neox);
            slow[g * s.head_dim + a] = 0.0;
            slow[g * s.head_dim + b] = 0.0;
        }
    }
    let turns: Vec<f32> = block_start_turns(&p, s.rope_dims, page_size, n_ctx).into_iter().flat_map(|(c, sn)| [c, sn]).collect();
    let mean = slot_mean(&slots, kd, page_size);
    let slots = slots.into_pyarray(py).reshape([page_size, kd])?;
    let fast_table = fast_table.into_pyarray(py).reshape([s.n_head_kv, n_fast])?;
    Ok((slots, turns.into_pyarray(py), fast_table, slow.into_pyarray(py), mean.into_pyarray(py)))
}

/// The key scales of a KV cache with 4-bit keys (`Model::key_scales`) for the model `file` of `spec`: per layer, None or
/// [n_head_kv * head_dim] f32 powers of two (keys are stored times them, queries read divided by them).
#[pyfunction]
#[pyo3(signature = (file, spec, *, threads))]
fn key_scales<'py>(py: Python<'py>, file: &PyGgufFile, spec: &Bound<'py, PyAny>, threads: usize)
                   -> PyResult<Vec<Option<Bound<'py, PyArray1<f32>>>>> {
    let s = spec::extract(spec)?;
    let file = file.inner.clone();
    let scales = py.detach(move || Model::load(&file, s, threads)?.key_scales()).map_err(to_py)?;
    Ok((0..scales.n_layer()).map(|il| scales.layer(il).map(|v| v.to_vec().into_pyarray(py))).collect())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(key_scales, m)?)?;
    m.add_function(wrap_pyfunction!(key_bias_tables, m)?)
}
