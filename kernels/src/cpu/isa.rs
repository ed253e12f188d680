//! Which SIMD instruction set the CPU kernels use, detected once at start.
//!
//! Every kernel exists for each level and performs the same floating-point operations
//! in the same order per output element (integer dot products are exact), so the
//! levels give bit-identical results: the scalar code is the readable reference and the
//! tests compare the others against it bit for bit.

use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL + VNNI (+ FMA, F16C).
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512vnni",
        }
    }

    /// The best level this CPU supports.
    pub fn best_supported() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 =
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            let avx512 = avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni");
            if avx512 {
                return Isa::Avx512;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    /// Every level this CPU can run, lowest first (for tests).
    pub fn all_supported() -> Vec<Isa> {
        let best = Self::best_supported();
        [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| *i <= best).collect()
    }

    /// The level in use: the best supported, or lower when [`crate::env::CPU_ISA`] asks.
    pub fn current() -> Isa {
        static CURRENT: OnceLock<Isa> = OnceLock::new();
        *CURRENT.get_or_init(|| {
            let best = Self::best_supported();
            let wanted = match std::env::var(crate::env::CPU_ISA).ok().as_deref() {
                Some("scalar") => Isa::Scalar,
                Some("avx2") => Isa::Avx2,
                _ => best,
            };
            wanted.min(best)
        })
    }
}
