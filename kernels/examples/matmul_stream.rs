//! Streams a decode step's worth of SmolLM2-shaped weights through the matmul at a
//! given batch size and prints the effective bandwidth (diagnostic, not a test).
//!
//! cargo run --release -p kernels --example matmul_stream -- [threads] [tokens] [reps]

use std::time::Instant;

use kernels::cpu::matmul::{matmul, Input, MatmulMode, OutSpec, Q8Acts};
use kernels::cpu::{Isa, PackedMatrix, ThreadPool};
use kernels::quant::GgmlType;

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().unwrap()).collect();
    let threads = args.first().copied().unwrap_or(2);
    let n_tokens = args.get(1).copied().unwrap_or(1);
    let reps = args.get(2).copied().unwrap_or(50);
    let mut mats = Vec::new();
    let mut seed = 1u8;
    let mut mk = |ty: GgmlType, rows: usize, cols: usize| {
        seed = seed.wrapping_add(1);
        let bytes: Vec<u8> = (0..rows * ty.row_bytes(cols).unwrap())
            .map(|i| if i % 20 < 4 { 0x20 } else { (i as u8).wrapping_mul(seed) })
            .collect();
        PackedMatrix::from_ggml(ty, rows, cols, &bytes).unwrap()
    };
    for _ in 0..30 {
        mats.push(mk(GgmlType::Q4_1, 960, 576));
        mats.push(mk(GgmlType::Q4_1, 576, 576));
        mats.push(mk(GgmlType::Q4_1, 3072, 576));
        mats.push(mk(GgmlType::Q4_1, 576, 1536));
    }
    mats.push(mk(GgmlType::Q8_0, 49152, 576));
    let bytes: usize = mats.iter().map(|m| m.n_bytes()).sum();
    let pool = ThreadPool::new(threads);
    let isa = Isa::current();
    let x: Vec<f32> = (0..n_tokens * 1536).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
    let mut out = vec![0f32; n_tokens * 49152];
    let mut q8 = Q8Acts::default();
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        for m in &mats {
            q8.quantize(&pool, isa, &x, n_tokens, m.cols);
            let input = Input { x: &x, q8: Some(&q8), n_tokens };
            matmul(
                &pool,
                isa,
                MatmulMode::Q8,
                m,
                &input,
                OutSpec { out: &mut out, ld: m.rows, col0: 0, accumulate: false },
            );
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!(
        "threads={threads} tokens={n_tokens} isa={} bytes={:.1}MB best={:.3}ms -> {:.1} GB/s, {:.0} tok/s",
        isa.name(),
        bytes as f64 / 1e6,
        best * 1e3,
        bytes as f64 / best / 1e9,
        n_tokens as f64 / best
    );
}
