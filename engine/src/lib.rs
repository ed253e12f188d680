//! The model engine: loading, tokenization, the forward pass, paged KV cache,
//! scheduling and sampling.
#![forbid(unsafe_code)]

pub mod config;
pub mod fetch;
pub mod gguf;
pub mod handle;
pub mod kv;
pub mod load;
pub mod model;
pub mod prefix;
pub mod random;
pub mod sampling;
pub mod scheduler;
pub mod tokenizer;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{0}")]
    Model(String),
    #[error("{0}")]
    Unsupported(String),
    /// A request the engine cannot serve as given; the message names what to change.
    #[error("{0}")]
    InvalidRequest(String),
    /// Valid, but the engine cannot take it now (e.g. no free KV blocks); retry later
    /// or elsewhere.
    #[error("{0}")]
    Busy(String),
}
