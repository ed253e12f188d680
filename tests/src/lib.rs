//! Shared helpers for the cross-crate tests: fixtures and engines on the embedded model.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use engine::load::{cpu_engine, EngineOptions};
use engine::scheduler::EngineCore;
use kernels::cpu::CpuBackend;
use kernels::KvDtype;
use serde::Deserialize;

pub fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data")
}

#[derive(Deserialize, Debug, Clone)]
pub struct TopLogits {
    pub ids: Vec<u32>,
    pub logits: Vec<f32>,
}

#[derive(Deserialize, Debug, Clone)]
pub struct Case {
    pub name: String,
    pub text: String,
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub greedy_text: String,
    pub top_logits: Vec<TopLogits>,
    pub messages: Option<Vec<engine::tokenizer::ChatMessage>>,
}

#[derive(Deserialize, Debug)]
pub struct Reference {
    pub model: String,
    pub reference: String,
    pub cases: Vec<Case>,
}

/// The transformers reference for the embedded model (see tests/data/make_reference.py).
pub fn reference() -> Reference {
    let text = std::fs::read_to_string(data_dir().join("smollm2_reference.json")).expect("fixture");
    serde_json::from_str(&text).expect("fixture parses")
}

/// The reference logits at the last prompt position of a case.
pub fn reference_logits(case: &str) -> Vec<f32> {
    let bytes = std::fs::read(
        data_dir()
            .join("smollm2_logits")
            .join(format!("{case}.f32")),
    )
    .expect("fixture");
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Options for test engines: one thread (tests run in parallel), a modest cache.
pub fn test_options() -> EngineOptions {
    EngineOptions {
        threads: 1,
        kv_cache_mib: 64,
        kv_dtype: KvDtype::F16,
        ..EngineOptions::default()
    }
}

/// An engine on the embedded model.
pub fn engine(opts: &EngineOptions) -> EngineCore<CpuBackend> {
    cpu_engine(opts).expect("the embedded model loads")
}
