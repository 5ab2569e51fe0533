//! Single-threaded throughput of the quantized dot products and activation quantizers, scalar reference vs
//! the SIMD kernels the engine dispatches to on this CPU.
//!
//!     cargo run --release -p ninfer-core --example bench_dot [-- ROWS [K]]
//!
//! For each weight type: a ROWS x K matrix (default 1024 x 4096) of random blocks dotted with one quantized
//! activation row, row by row, repeated for ~0.3 s; reported as GB/s of weight bytes read and the speedup.

use std::hint::black_box;
use std::time::{Duration, Instant};

use ninfer_core::quant::simd::{self, MatmulPos};
use ninfer_core::quant::{quantize_act, vec_dot, GgmlType};

/// xorshift64*: deterministic, no dependencies.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    fn normal(&mut self) -> f32 {
        (self.unit() + self.unit() + self.unit() + self.unit() - 2.0) * 1.7
    }
}

/// Byte offsets of the f16 scale fields of a block of `ty`.
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => &[],
    }
}

/// A random `rows x k` matrix of `ty`: random quant bits with sane scales, or random floats.
fn random_matrix(ty: GgmlType, rows: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    let rb = ty.row_bytes(k).expect("whole blocks");
    let mut m = vec![0u8; rb * rows];
    if ty.block_size() == 1 {
        let x: Vec<f32> = (0..k).map(|_| rng.normal() * 0.05).collect();
        for row in m.chunks_exact_mut(rb) {
            quantize_act(ty, &x, row);
        }
        return m;
    }
    m.iter_mut().for_each(|b| *b = rng.next_u64() as u8);
    for block in m.chunks_exact_mut(ty.type_size()) {
        for &off in f16_fields(ty) {
            let d = half::f16::from_f32(0.001 + 0.05 * rng.unit());
            block[off..off + 2].copy_from_slice(&d.to_le_bytes());
        }
    }
    m
}

/// Seconds per call of `f`, timed over repeated calls for at least `min`.
fn time_per_call(min: Duration, mut f: impl FnMut()) -> f64 {
    f(); // warm up caches
    let start = Instant::now();
    let mut calls = 0u64;
    while start.elapsed() < min {
        f();
        calls += 1;
    }
    start.elapsed().as_secs_f64() / calls as f64
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let rows = args.first().copied().unwrap_or(1024);
    let k = args.get(1).copied().unwrap_or(4096);
    let min = Duration::from_millis(300);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);

    println!("kernel set: {} | {rows} x {k} matrix, one activation row, 1 thread", simd::isa());
    println!(
        "{:<6} {:>9} {:>12} {:>12} {:>8} {:>14}",
        "type", "MiB", "scalar GB/s", "SIMD GB/s", "speedup", "prefill GB/s"
    );
    let x: Vec<f32> = (0..k).map(|_| rng.normal()).collect();
    let types = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];
    for ty in types {
        let w = random_matrix(ty, rows, k, &mut rng);
        let rb = ty.row_bytes(k).unwrap();
        let mut act = vec![0u8; ty.act_type().row_bytes(k).unwrap()];
        quantize_act(ty.act_type(), &x, &mut act);
        let mut out = vec![0.0f32; rows];

        let scalar = time_per_call(min, || {
            for (o, row) in out.iter_mut().zip(w.chunks_exact(rb)) {
                *o = simd::vec_dot_scalar(ty, k, black_box(row), &act);
            }
            black_box(&out);
        });
        let fast = time_per_call(min, || {
            for (o, row) in out.iter_mut().zip(w.chunks_exact(rb)) {
                *o = vec_dot(ty, k, black_box(row), &act);
            }
            black_box(&out);
        });
        // The kernel a 16-token prefill matmul would use (tiled / GEMM orders where llama.cpp has them).
        let pos = MatmulPos { w_rows: rows, act_rows: 16, act_row: 0 };
        let prefill = time_per_call(min, || {
            for (o, row) in out.iter_mut().zip(w.chunks_exact(rb)) {
                *o = simd::vec_dot_matmul(ty, k, black_box(row), &act, pos);
            }
            black_box(&out);
        });
        let gb = w.len() as f64 / 1e9;
        println!(
            "{:<6} {:>9.1} {:>12.2} {:>12.2} {:>7.1}x {:>14.2}",
            ty.name(),
            w.len() as f64 / (1 << 20) as f64,
            gb / scalar,
            gb / fast,
            scalar / fast,
            gb / prefill
        );
    }

    println!();
    println!("{:<6} {:>14} {:>14} {:>8}", "act", "scalar Melem/s", "SIMD Melem/s", "speedup");
    let n = 4096 * 4;
    let x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
    for act_ty in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8_K, GgmlType::F16] {
        let mut dst = vec![0u8; act_ty.row_bytes(n).unwrap()];
        let scalar = time_per_call(min, || {
            simd::quantize_act_scalar(act_ty, black_box(&x), &mut dst);
            black_box(&dst);
        });
        let fast = time_per_call(min, || {
            quantize_act(act_ty, black_box(&x), &mut dst);
            black_box(&dst);
        });
        println!(
            "{:<6} {:>14.0} {:>14.0} {:>7.1}x",
            act_ty.name(),
            n as f64 / scalar / 1e6,
            n as f64 / fast / 1e6,
            scalar / fast
        );
    }
}
