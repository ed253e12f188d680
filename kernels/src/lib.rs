//! Compute kernels for disagg behind one backend interface ([`backend::Backend`]).
//!
//! - [`quant`]: the GGML block formats and their reference dequantization.
//! - [`cpu`]: the CPU backend, always built; the reference every other backend is
//!   compared against, and what CI runs.
//! - [`cuda`]: the CUDA backend (in progress): device, NVRTC kernels, first ops.
//! - [`env`]: every environment variable disagg reads.

pub mod backend;
pub mod cpu;
pub mod cuda;
pub mod env;
pub mod quant;

pub use backend::{
    AttnShape, Backend, FedToken, GraphCounts, KvShape, LogitEdit, Rope, SampleSpec, SampledRow, SeqSpan, StepBatch,
    StepLimits, WeightPart, SAMPLE_CANDIDATES,
};
pub use cpu::ops::KvDtype;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("bad shape: {0}")]
    Shape(String),
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// A device that is missing, unusable, or failed (the message says which).
    #[error("{0}")]
    Device(String),
}
