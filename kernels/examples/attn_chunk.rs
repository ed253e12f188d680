//! Times the CPU attention of one prefill chunk on a cached prefix, SmolLM2-shaped
//! (9 query heads over 3 KV heads of 64 dims, f16 cache in blocks of 16), with the flash
//! kernel and the two-pass kernel before it, and prints FMA rates (diagnostic, not a test).
//!
//! cargo run --release -p kernels --example attn_chunk -- [threads] [cached] [rows] [reps]

use std::time::Instant;

use kernels::cpu::CpuBackend;
use kernels::{AttnShape, Backend, KvDtype, KvShape, SeqSpan, StepBatch};

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().unwrap()).collect();
    let threads = args.first().copied().unwrap_or(2);
    let cached = args.get(1).copied().unwrap_or(1792);
    let rows = args.get(2).copied().unwrap_or(512);
    let reps = args.get(3).copied().unwrap_or(10);
    let (kvh, g, hd, bs) = (3, 3, 64, 16);
    let attn = AttnShape { n_heads: kvh * g, n_kv_heads: kvh, head_dim: hd, scale: 0.125 };
    let n_blocks = (cached + rows).div_ceil(bs);
    let shape = KvShape { n_layers: 1, n_blocks, block_size: bs, n_kv_heads: kvh, head_dim: hd, dtype: KvDtype::F16 };
    let mut x = 1u32;
    let mut rnd = move || {
        x = x.wrapping_mul(1664525).wrapping_add(1013904223);
        (x >> 9) as f32 / (1 << 23) as f32 - 0.5
    };
    let table: Vec<u32> = (0..n_blocks as u32).collect();
    let cache: Vec<f32> = (0..n_blocks * bs * kvh * hd * 2).map(|_| rnd()).collect();
    let mut bytes = vec![0u8; cache.len() * 2];
    kernels::cpu::ops::f32_to_kv(KvDtype::F16, &cache, &mut bytes);
    let qkv: Vec<f32> = (0..rows * attn.qkv_dim()).map(|_| rnd()).collect();
    let spans = [SeqSpan { rows: 0..rows, pos0: cached, block_table: &table }];
    let batch = StepBatch { n_tokens: rows, seqs: &spans, block_size: bs, fed: &[] };
    // Multiply-adds of the scores and the values (each a q·k or p·v element pair).
    let pairs: f64 = (0..rows).map(|i| (cached + i + 1) as f64).sum::<f64>() * (kvh * g * hd) as f64 * 2.0;
    for flash in [true, false] {
        let mut cpu = CpuBackend::new(threads);
        cpu.set_flash_attention(flash);
        let mut kv = cpu.kv_cache(shape).unwrap();
        cpu.kv_import(&mut kv, 0, &table, &bytes);
        let mut out = vec![0f32; rows * attn.q_dim()];
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            let t = Instant::now();
            cpu.attention(&qkv, 0, &batch, &attn, &mut kv, &mut out);
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "flash={flash} threads={threads} cached={cached} rows={rows} best={:.3}ms -> {:.2} G multiply-adds/s",
            best * 1e3,
            pairs / best / 1e9
        );
    }
}
