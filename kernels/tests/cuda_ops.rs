//! CUDA ops against the CPU ops on the same inputs. The GPU tests exist only with
//! `DISAGG_TEST_CUDA=1` (the GPU machine): without it this binary lists and runs just
//! the no-driver check, so CI never reports a GPU test as passed. Tolerances: these
//! ops are f32 on both sides; the GPU sums in another order (block reduction) and uses
//! its own exp/rsqrt, so a few ulp.

use kernels::cpu::ops::{rms_norm_rows, silu_mul_rows};
use kernels::cuda::CudaDevice;

fn gpu() -> CudaDevice {
    CudaDevice::open(0).expect("DISAGG_TEST_CUDA is set: cuda:0 must open")
}

fn main() {
    use libtest_mimic::{Arguments, Trial};
    let mut tests = vec![Trial::test("without_a_driver_asking_for_cuda_is_a_clear_error", || {
        without_a_driver_asking_for_cuda_is_a_clear_error();
        Ok(())
    })];
    if std::env::var_os(kernels::env::TEST_CUDA).is_some() {
        let gpu_tests: [(&str, fn()); 3] = [
            ("rms_norm_matches_cpu", rms_norm_matches_cpu),
            ("silu_mul_matches_cpu", silu_mul_matches_cpu),
            ("embedding_gathers_rows_exactly_and_refuses_bad_ids", embedding_gathers_rows_exactly_and_refuses_bad_ids),
        ];
        tests.extend(gpu_tests.into_iter().map(|(name, f)| {
            Trial::test(name, move || {
                f();
                Ok(())
            })
        }));
    }
    libtest_mimic::run(&Arguments::from_args(), tests).exit();
}

fn data(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) * 4.0 - 2.0
        })
        .collect()
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1e-3)).fold(0.0, f32::max)
}

fn without_a_driver_asking_for_cuda_is_a_clear_error() {
    if std::env::var_os(kernels::env::TEST_CUDA).is_some() {
        return; // the GPU machine: covered by the tests below
    }
    // On machines without libcuda the error names the device and what to use.
    if let Err(e) = CudaDevice::open(0) {
        let m = e.to_string();
        assert!(m.contains("cuda:0") || m.contains("CUDA"), "{m}");
    }
}

fn rms_norm_matches_cpu() {
    let d = gpu();
    for (n, dim) in [(1, 576), (7, 4096), (33, 5120)] {
        let x = data(n * dim, 1);
        let w = data(dim, 2);
        let mut want = vec![0f32; n * dim];
        for r in 0..n {
            rms_norm_rows(&x[r * dim..(r + 1) * dim], &w, 1e-5, &mut want[r * dim..(r + 1) * dim]);
        }
        let (dx, dw) = (d.upload(&x).unwrap(), d.upload(&w).unwrap());
        let mut out = d.zeros(n * dim).unwrap();
        d.rms_norm(&dx, &dw, 1e-5, n, dim, &mut out).unwrap();
        let got = d.download(&out).unwrap();
        let err = max_rel(&got, &want);
        println!("rms_norm n={n} dim={dim}: max rel err {err:e} on {}", d.describe());
        assert!(err < 1e-5, "rms_norm n={n} dim={dim}: {err}");
    }
}

fn silu_mul_matches_cpu() {
    let d = gpu();
    let (n, ff) = (9, 1536);
    let gu = data(n * 2 * ff, 3);
    let mut want = vec![0f32; n * ff];
    for r in 0..n {
        silu_mul_rows(&gu[r * 2 * ff..(r + 1) * 2 * ff], ff, &mut want[r * ff..(r + 1) * ff]);
    }
    let dgu = d.upload(&gu).unwrap();
    let mut out = d.zeros(n * ff).unwrap();
    d.silu_mul(&dgu, n, ff, &mut out).unwrap();
    let err = max_rel(&d.download(&out).unwrap(), &want);
    println!("silu_mul: max rel err {err:e}");
    assert!(err < 1e-5, "silu_mul: {err}");
}

fn embedding_gathers_rows_exactly_and_refuses_bad_ids() {
    let d = gpu();
    let (vocab, dim) = (1000, 64);
    let table = data(vocab * dim, 4);
    let ids = [0u32, 999, 5, 5, 512];
    let dt = d.upload(&table).unwrap();
    let mut out = d.zeros(ids.len() * dim).unwrap();
    d.embed(&dt, &ids, dim, &mut out).unwrap();
    let got = d.download(&out).unwrap();
    for (r, &id) in ids.iter().enumerate() {
        assert_eq!(&got[r * dim..(r + 1) * dim], &table[id as usize * dim..(id as usize + 1) * dim]);
    }
    assert!(d.embed(&dt, &[1000], dim, &mut out).is_err(), "an id outside the table is refused");
}
