//! Models with random weights of real shapes (`--model random:NAME[:SEED]`), for
//! benchmarks and for comparisons against a reference that builds the same weights.
//!
//! Every weight is a deterministic function of the seed, the tensor's GGUF name and the
//! element's index: `u = splitmix64(seed ^ xxh3(name) + index·φ)`, the top 24 bits of
//! `u` mapped to a uniform value in [−a, a) with `a = 0.02·√3` (the variance of
//! N(0, 0.02²)), rounded to bf16. Norm weights are 1. The tokenizer is synthetic: token
//! `i` is the word `t{i}` (no special tokens), enough to serve and to decode ids.

use crate::config::{ModelConfig, RopeScaling};
use crate::model::WeightSource;
use crate::tokenizer::Tokenizer;
use crate::EngineError;
use kernels::quant::GgmlType;

/// The named shapes.
pub const NAMES: &[&str] = &["llama3-8b", "smollm2-135m"];

/// `random:NAME[:SEED]` → (name, seed).
pub fn parse(model: &str) -> Option<Result<(String, u64), EngineError>> {
    let rest = model.strip_prefix("random:")?;
    let (name, seed) = match rest.split_once(':') {
        Some((n, s)) => match s.parse() {
            Ok(s) => (n, s),
            Err(_) => return Some(Err(EngineError::Model(format!("random:{rest}: the seed must be a number")))),
        },
        None => (rest, 0),
    };
    if !NAMES.contains(&name) {
        return Some(Err(EngineError::Model(format!(
            "random:{name} is not a known shape; use one of {}",
            NAMES.iter().map(|n| format!("random:{n}")).collect::<Vec<_>>().join(", ")
        ))));
    }
    Some(Ok((name.to_string(), seed)))
}

/// The shape of a named model.
pub fn config(name: &str) -> ModelConfig {
    match name {
        // Llama-3.1-8B.
        "llama3-8b" => ModelConfig {
            name: "random llama3-8b".into(),
            n_layers: 32,
            hidden: 4096,
            ffn: 14336,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            vocab: 128256,
            rms_eps: 1e-5,
            rope_theta: 500000.0,
            rope_interleaved: false,
            rope_scaling: Some(RopeScaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            }),
            max_context: 131072,
            tied_embeddings: false,
        },
        // SmolLM2-135M.
        _ => ModelConfig {
            name: "random smollm2-135m".into(),
            n_layers: 30,
            hidden: 576,
            ffn: 1536,
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
            vocab: 49152,
            rms_eps: 1e-5,
            rope_theta: 100000.0,
            rope_interleaved: false,
            rope_scaling: None,
            max_context: 8192,
            tied_embeddings: true,
        },
    }
}

/// A tokenizer whose token `i` is the word `t{i}`.
pub fn tokenizer(vocab: usize) -> Result<Tokenizer, EngineError> {
    let words: serde_json::Map<String, serde_json::Value> =
        (0..vocab).map(|i| (format!("t{i}"), serde_json::Value::from(i))).collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": words, "unk_token": "t0"}
    });
    Tokenizer::from_json(&json.to_string())
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The weights of `random:NAME:SEED`.
pub struct RandomSource {
    pub cfg: ModelConfig,
    pub seed: u64,
}

impl RandomSource {
    fn shape(&self, name: &str) -> Option<(usize, usize)> {
        let c = &self.cfg;
        let (qd, kvd) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        if name == "token_embd.weight" || (name == "output.weight" && !c.tied_embeddings) {
            return Some((c.vocab, c.hidden));
        }
        let rest = name.strip_prefix("blk.")?.split_once('.')?.1;
        Some(match rest {
            "attn_q.weight" => (qd, c.hidden),
            "attn_k.weight" | "attn_v.weight" => (kvd, c.hidden),
            "attn_output.weight" => (c.hidden, qd),
            "ffn_gate.weight" | "ffn_up.weight" => (c.ffn, c.hidden),
            "ffn_down.weight" => (c.hidden, c.ffn),
            _ => return None,
        })
    }
}

impl WeightSource for RandomSource {
    fn matrix(&self, name: &str) -> Result<(GgmlType, usize, usize, Vec<u8>), EngineError> {
        let (rows, cols) =
            self.shape(name).ok_or_else(|| EngineError::Model(format!("random model has no matrix {name}")))?;
        let base = self.seed ^ xxhash_rust::xxh3::xxh3_64(name.as_bytes());
        let a = 0.02f32 * 3f32.sqrt();
        let n = rows * cols;
        let mut out = vec![0u8; n * 2];
        let threads = std::thread::available_parallelism().map(|t| t.get()).unwrap_or(1).min(32);
        let per = n.div_ceil(threads).max(1 << 16);
        std::thread::scope(|s| {
            for (c, chunk) in out.chunks_mut(per * 2).enumerate() {
                s.spawn(move || {
                    for (j, b) in chunk.chunks_exact_mut(2).enumerate() {
                        let i = (c * per + j) as u64;
                        let u = splitmix64(base.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
                        let x = ((u >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a;
                        b.copy_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes());
                    }
                });
            }
        });
        Ok((GgmlType::BF16, rows, cols, out))
    }

    fn vector(&self, name: &str) -> Result<Vec<f32>, EngineError> {
        if name.ends_with("norm.weight") {
            return Ok(vec![1.0; self.cfg.hidden]);
        }
        Err(EngineError::Model(format!("random model has no vector {name}")))
    }

    fn has(&self, name: &str) -> bool {
        name.ends_with("norm.weight") || self.shape(name).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_weights_are_deterministic() {
        assert_eq!(parse("random:llama3-8b").unwrap().unwrap(), ("llama3-8b".to_string(), 0));
        assert_eq!(parse("random:smollm2-135m:7").unwrap().unwrap(), ("smollm2-135m".to_string(), 7));
        assert!(parse("random:gpt5").unwrap().is_err());
        assert!(parse("model.gguf").is_none());
        let src = RandomSource { cfg: config("smollm2-135m"), seed: 1 };
        let (ty, r, c, w) = src.matrix("blk.0.attn_k.weight").unwrap();
        assert_eq!((ty, r, c, w.len()), (GgmlType::BF16, 192, 576, 192 * 576 * 2));
        assert_eq!(w, src.matrix("blk.0.attn_k.weight").unwrap().3);
        assert_ne!(w, src.matrix("blk.1.attn_k.weight").unwrap().3);
        let other = RandomSource { cfg: config("smollm2-135m"), seed: 2 };
        assert_ne!(w, other.matrix("blk.0.attn_k.weight").unwrap().3);
        // Uniform in [-a, a): mean near 0, variance near 0.02².
        let v: Vec<f32> =
            w.chunks_exact(2).map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()).collect();
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32;
        assert!(mean.abs() < 1e-3 && (var.sqrt() - 0.02).abs() < 1e-3, "mean {mean} std {}", var.sqrt());
        assert!(!src.has("output.weight"), "SmolLM2 ties its output to the embedding");
        let tok = tokenizer(100).unwrap();
        assert_eq!(tok.decode(&[5, 7], false).unwrap(), "t5 t7");
        assert_eq!(tok.encode("t5 t7").unwrap(), vec![5, 7]);
    }
}
