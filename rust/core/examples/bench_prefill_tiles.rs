//! Single-threaded throughput of the prefill tile kernels the engine dispatches to on this CPU: a ROWS x K matrix
//! of random blocks times TOKENS quantized activation rows, in the tiles matmul uses (the kernel's own shape, or
//! 2 x 8), as in a prefill matmul of that many tokens.
//!
//!     cargo run --release -p ninfer-core --example bench_prefill_tiles [-- ROWS [K [TOKENS]]]
//!
//! Defaults: 256 x 8960 (a block of Qwen2.5-1.5B's ffn_down rows), 64 tokens; reported as billions of
//! multiply-adds per second per type.

use std::hint::black_box;
use std::time::{Duration, Instant};

use ninfer_core::quant::simd::{self, MatmulPos};
use ninfer_core::quant::{quantize_act, GgmlType};

/// xorshift64*: deterministic, no dependencies.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn normal(&mut self) -> f32 {
        let u = |r: &mut Rng| (r.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        (u(self) + u(self) + u(self) + u(self) - 2.0) * 1.7
    }
}

/// A random `rows x k` quantized matrix: random bits with small f16 super-block scales at `d_at`.
fn random_matrix(ty: GgmlType, rows: usize, k: usize, d_at: &[usize], rng: &mut Rng) -> Vec<u8> {
    let mut m: Vec<u8> = (0..ty.row_bytes(k).unwrap() * rows).map(|_| rng.next_u64() as u8).collect();
    for block in m.chunks_exact_mut(ty.type_size()) {
        for &off in d_at {
            block[off..off + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        }
    }
    m
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let arg = |i: usize, default: usize| args.get(i).copied().unwrap_or(default);
    let (rows, k, tokens) = (arg(0, 256), arg(1, 8960), arg(2, 64));
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    println!("kernel set: {} | {rows} x {k} matrix, {tokens} tokens, 1 thread", simd::isa());
    let types = [(GgmlType::Q4_K, &[0usize, 2][..]), (GgmlType::Q6_K, &[208][..]), (GgmlType::Q5_0, &[0][..]), (GgmlType::Q8_0, &[0][..])];
    for (ty, d_at) in types {
        if ty.row_bytes(k).is_err() {
            println!("{:<5} rows of {k} are not whole blocks", ty.name());
            continue;
        }
        let w = random_matrix(ty, rows, k, d_at, &mut rng);
        let act_ty = ty.act_type();
        let ab = act_ty.row_bytes(k).unwrap();
        let mut a = vec![0u8; ab * tokens];
        for row in a.chunks_exact_mut(ab) {
            let x: Vec<f32> = (0..k).map(|_| rng.normal()).collect();
            quantize_act(act_ty, &x, row);
        }
        let rb = ty.row_bytes(k).unwrap();
        let pos = MatmulPos { w_rows: rows, act_rows: tokens, act_row: 0 };
        let Some(tile) = simd::tile_kernel(ty, pos) else {
            println!("{:<5} no tile kernel", ty.name());
            continue;
        };
        let (tr, tc) = tile.shape().unwrap_or((2, 8));
        let mut out = vec![0.0f32; tr * tc];
        let run = |out: &mut [f32]| {
            for c0 in (0..tokens).step_by(tc) {
                let nc = (tokens - c0).min(tc);
                for r0 in (0..rows).step_by(tr) {
                    let nr = (rows - r0).min(tr);
                    tile.run(k, &w[r0 * rb..], rb, nr, &a[c0 * ab..], ab, nc, &mut out[..nr * nc]);
                    black_box(&out);
                }
            }
        };
        run(&mut out);
        let start = Instant::now();
        let mut calls = 0u32;
        while start.elapsed() < Duration::from_millis(500) {
            run(&mut out);
            calls += 1;
        }
        let secs = start.elapsed().as_secs_f64() / calls as f64;
        let macs = (rows * k * tokens) as f64;
        println!("{:<5} tile {tr:>2} x {tc:>2}: {:7.2} GMAC/s", ty.name(), macs / secs / 1e9);
    }
}
