//! The CPU matmul kernels against the reference dequantization, across ISAs, batch
//! sizes and modes.

use kernels::cpu::matmul::{matmul, Input, MatmulMode, OutSpec, Q8Acts};
use kernels::cpu::{Isa, PackedMatrix, ThreadPool};
use kernels::quant::{dequantize_row, quantize_row, GgmlType};
use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};

const TYPES: [GgmlType; 6] =
    [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::F32, GgmlType::F16, GgmlType::BF16];

fn randn(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            // Sum of uniforms: roughly normal, deterministic.
            let s: f32 = (0..4).map(|_| (rng.next_u32() as f32 / u32::MAX as f32) - 0.5).sum();
            s * scale
        })
        .collect()
}

/// A random matrix stored as `ty`, and its exact dequantized values.
fn matrix(rng: &mut ChaCha8Rng, ty: GgmlType, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let vals = randn(rng, rows * cols, 0.5);
    let mut bytes = Vec::new();
    for r in 0..rows {
        bytes.extend(quantize_row(ty, &vals[r * cols..(r + 1) * cols]));
    }
    let rb = ty.row_bytes(cols).unwrap();
    let mut deq = vec![0f32; rows * cols];
    for r in 0..rows {
        dequantize_row(ty, &bytes[r * rb..(r + 1) * rb], &mut deq[r * cols..(r + 1) * cols]);
    }
    (bytes, deq)
}

fn run(pool: &ThreadPool, isa: Isa, mode: MatmulMode, w: &PackedMatrix, x: &[f32], n_tokens: usize) -> Vec<f32> {
    let mut q8 = Q8Acts::default();
    q8.quantize(pool, isa, x, n_tokens, w.cols);
    let mut out = vec![0f32; n_tokens * w.rows];
    let input = Input { x, q8: Some(&q8), n_tokens };
    matmul(pool, isa, mode, w, &input, OutSpec { out: &mut out, ld: w.rows, col0: 0, accumulate: false });
    out
}

#[test]
fn packed_rows_equal_reference_dequantization() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for ty in TYPES {
        let (rows, cols) = (37, 96);
        let (bytes, deq) = matrix(&mut rng, ty, rows, cols);
        let m = PackedMatrix::from_ggml(ty, rows, cols, &bytes).unwrap();
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            m.dequantize_row(r, &mut row);
            assert_eq!(row, deq[r * cols..(r + 1) * cols], "{ty:?} row {r}");
        }
    }
}

#[test]
fn isas_agree_bit_for_bit_and_batches_are_invariant() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let pool = ThreadPool::new(2);
    for ty in TYPES {
        // 40 rows: two full tiles and a partial one.
        let (rows, cols, n_tokens) = (40, 128, 13);
        let (bytes, _) = matrix(&mut rng, ty, rows, cols);
        let w = PackedMatrix::from_ggml(ty, rows, cols, &bytes).unwrap();
        let x = randn(&mut rng, n_tokens * cols, 2.0);
        for mode in [MatmulMode::Q8, MatmulMode::F32] {
            let reference = run(&pool, Isa::Scalar, mode, &w, &x, n_tokens);
            for isa in Isa::all_supported() {
                let got = run(&pool, isa, mode, &w, &x, n_tokens);
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    reference.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{ty:?} {mode:?} {isa:?} differs from scalar"
                );
                // One token at a time gives the same bits as the batch.
                for t in [0, 5, 12] {
                    let one = run(&pool, isa, mode, &w, &x[t * cols..(t + 1) * cols], 1);
                    assert_eq!(
                        one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        got[t * rows..(t + 1) * rows].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{ty:?} {mode:?} {isa:?} token {t} alone differs"
                    );
                }
            }
        }
    }
}

#[test]
fn results_match_a_double_precision_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let pool = ThreadPool::new(2);
    for ty in TYPES {
        let (rows, cols, n_tokens) = (48, 256, 5);
        let (bytes, deq) = matrix(&mut rng, ty, rows, cols);
        let w = PackedMatrix::from_ggml(ty, rows, cols, &bytes).unwrap();
        let x = randn(&mut rng, n_tokens * cols, 2.0);
        for mode in [MatmulMode::Q8, MatmulMode::F32] {
            let got = run(&pool, Isa::current(), mode, &w, &x, n_tokens);
            // In Q8 mode the reference uses the activations as the kernel sees them:
            // quantized to 8 bits per block of 32. Then both sides compute the same sum
            // and only f32 rounding separates them.
            let xs: Vec<f32> = if mode == MatmulMode::Q8 && ty.is_quantized() {
                let mut q8 = Q8Acts::default();
                q8.quantize(&pool, Isa::Scalar, &x, n_tokens, cols);
                (0..n_tokens * cols).map(|i| q8.qs[i] as f32 * q8.d[i / 32]).collect()
            } else {
                x.clone()
            };
            for t in 0..n_tokens {
                for r in 0..rows {
                    let mut want = 0f64;
                    let mut mag = 0f64;
                    for k in 0..cols {
                        let p = deq[r * cols + k] as f64 * xs[t * cols + k] as f64;
                        want += p;
                        mag += p.abs();
                    }
                    let g = got[t * rows + r] as f64;
                    // f32 accumulation over `cols` terms: error ≲ cols · 2⁻²⁴ · Σ|terms|.
                    let tol = mag * cols as f64 * 6e-8 + 1e-6;
                    assert!((g - want).abs() <= tol, "{ty:?} {mode:?} t{t} r{r}: {g} vs {want} (tol {tol})");
                }
            }
        }
    }
}

#[test]
fn accumulate_adds_to_the_output_and_column_offsets_are_respected() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let pool = ThreadPool::new(2);
    let (rows, cols, n_tokens) = (16, 64, 3);
    let (bytes, _) = matrix(&mut rng, GgmlType::Q4_1, rows, cols);
    let w = PackedMatrix::from_ggml(GgmlType::Q4_1, rows, cols, &bytes).unwrap();
    let x = randn(&mut rng, n_tokens * cols, 1.0);
    let plain = run(&pool, Isa::current(), MatmulMode::Q8, &w, &x, n_tokens);
    let mut q8 = Q8Acts::default();
    q8.quantize(&pool, Isa::current(), &x, n_tokens, cols);
    let ld = 40;
    let mut out = vec![1.0f32; n_tokens * ld];
    let input = Input { x: &x, q8: Some(&q8), n_tokens };
    matmul(&pool, Isa::current(), MatmulMode::Q8, &w, &input, OutSpec { out: &mut out, ld, col0: 8, accumulate: true });
    for t in 0..n_tokens {
        for c in 0..ld {
            let want = if (8..24).contains(&c) { 1.0 + plain[t * rows + c - 8] } else { 1.0 };
            assert_eq!(out[t * ld + c], want, "t{t} c{c}");
        }
    }
}

#[test]
fn bad_shapes_are_errors_not_panics() {
    assert!(PackedMatrix::from_ggml(GgmlType::Q4_1, 4, 33, &[0; 4 * 40]).is_err());
    assert!(PackedMatrix::from_ggml(GgmlType::Q4_1, 4, 32, &[0; 10]).is_err());
}
