//! Model hyper-parameters, read from GGUF metadata or a Hugging Face `config.json`.

use serde::Deserialize;

use crate::gguf::{Gguf, Value};
use crate::EngineError;

/// A Llama-family model's shape and numerics.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub name: String,
    pub n_layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// GGUF stores Q/K rows so that RoPE pairs are adjacent; HF keeps halves apart.
    pub rope_interleaved: bool,
    /// Llama 3 style frequency scaling, if any.
    pub rope_scaling: Option<RopeScaling>,
    pub max_context: usize,
    pub tied_embeddings: bool,
}

/// Llama 3.1's "llama3" RoPE scaling.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: f32,
}

impl ModelConfig {
    /// What two engines must share to exchange KV or cache: name and architecture.
    pub fn identity(&self) -> String {
        format!(
            "{} (layers {}, hidden {}, heads {}/{}, head dim {}, ffn {}, vocab {})",
            self.name, self.n_layers, self.hidden, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn, self.vocab
        )
    }

    /// The inverse frequency of each RoPE dimension pair, with scaling applied.
    /// Computed as the float references do: `1 / theta^(2i/d)` rounded to f32.
    pub fn rope_inv_freq(&self, freq_factors: Option<&[f32]>) -> Vec<f32> {
        let d = self.head_dim;
        (0..d / 2)
            .map(|i| {
                let base = (1.0 / (self.rope_theta as f64).powf((2 * i) as f64 / d as f64)) as f32;

                match (&self.rope_scaling, freq_factors) {
                    (_, Some(ff)) => base / ff[i],
                    (Some(s), None) => llama3_scale(base, s),
                    (None, None) => base,
                }
            })
            .collect()
    }

    fn check(self) -> Result<Self, EngineError> {
        let bad = |what: String| Err(EngineError::Model(format!("unusable model config: {what}")));
        if self.n_layers == 0 || self.hidden == 0 || self.ffn == 0 || self.vocab == 0 {
            return bad("zero layers, width or vocabulary".into());
        }
        if self.n_heads == 0 || self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!("{} heads cannot share {} KV heads", self.n_heads, self.n_kv_heads));
        }
        if !self.head_dim.is_multiple_of(2) || self.head_dim == 0 {
            return bad(format!("head dim {} must be even", self.head_dim));
        }
        for (what, n) in [("hidden size", self.hidden), ("FFN size", self.ffn)] {
            if n % 32 != 0 {
                return Err(EngineError::Unsupported(format!("{what} {n} is not a multiple of 32")));
            }
        }
        Ok(self)
    }

    pub fn from_gguf(g: &Gguf) -> Result<Self, EngineError> {
        let arch = g.get("general.architecture").and_then(Value::as_str).unwrap_or("");
        if arch != "llama" {
            return Err(EngineError::Unsupported(format!(
                "model architecture '{arch}' is not supported yet; supported: llama (Llama, SmolLM, Mistral-7B-style GGUFs)"
            )));
        }
        let u = |k: &str| -> Result<usize, EngineError> {
            g.get(&format!("llama.{k}"))
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| EngineError::Model(format!("GGUF metadata lacks llama.{k}")))
        };
        let f = |k: &str, default: f64| g.get(&format!("llama.{k}")).and_then(Value::as_f64).unwrap_or(default);
        let hidden = u("embedding_length")?;
        let n_heads = u("attention.head_count")?;
        let vocab = match u("vocab_size") {
            Ok(v) => v,
            Err(_) => g
                .get("tokenizer.ggml.tokens")
                .and_then(Value::as_array)
                .map(|a| a.len())
                .ok_or_else(|| EngineError::Model("GGUF metadata lacks the vocabulary size".into()))?,
        };
        let rope_scaling = match g.get("llama.rope.scaling.type").and_then(Value::as_str) {
            Some("llama3") => Some(RopeScaling {
                factor: f("rope.scaling.factor", 8.0) as f32,
                low_freq_factor: f("rope.scaling.low_freq_factor", 1.0) as f32,
                high_freq_factor: f("rope.scaling.high_freq_factor", 4.0) as f32,
                original_max_position_embeddings: f("rope.scaling.original_context_length", 8192.0) as f32,
            }),
            Some("none") | None => None,
            Some(other) => {
                return Err(EngineError::Unsupported(format!("RoPE scaling '{other}' is not supported yet")))
            }
        };
        ModelConfig {
            name: g
                .get("general.name")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| g.path.file_stem().unwrap_or_default().to_string_lossy().into_owned()),
            n_layers: u("block_count")?,
            hidden,
            ffn: u("feed_forward_length")?,
            n_heads,
            n_kv_heads: u("attention.head_count_kv").unwrap_or(n_heads),
            head_dim: u("attention.key_length").unwrap_or(hidden / n_heads.max(1)),
            vocab,
            rms_eps: f("attention.layer_norm_rms_epsilon", 1e-5) as f32,
            rope_theta: f("rope.freq_base", 10000.0) as f32,
            rope_interleaved: true,
            rope_scaling,
            max_context: u("context_length").unwrap_or(4096),
            tied_embeddings: g.tensor("output.weight").is_none(),
        }
        .check()
    }

    pub fn from_hf_json(text: &str) -> Result<Self, EngineError> {
        #[derive(Deserialize)]
        struct Hf {
            model_type: Option<String>,
            hidden_size: usize,
            intermediate_size: usize,
            num_hidden_layers: usize,
            num_attention_heads: usize,
            num_key_value_heads: Option<usize>,
            head_dim: Option<usize>,
            vocab_size: usize,
            rms_norm_eps: Option<f32>,
            rope_theta: Option<f32>,
            rope_scaling: Option<serde_json::Value>,
            rope_parameters: Option<serde_json::Value>,
            max_position_embeddings: Option<usize>,
            tie_word_embeddings: Option<bool>,
            _name_or_path: Option<String>,
        }
        let hf: Hf = serde_json::from_str(text)
            .map_err(|e| EngineError::Model(format!("config.json is not a usable Llama config: {e}")))?;
        let mt = hf.model_type.as_deref().unwrap_or("");
        if mt != "llama" {
            return Err(EngineError::Unsupported(format!(
                "model_type '{mt}' in config.json is not supported yet; supported: llama"
            )));
        }
        // transformers ≥ 5 writes `rope_parameters`; older versions `rope_theta` and
        // `rope_scaling`.
        let params = hf.rope_parameters.as_ref().or(hf.rope_scaling.as_ref());
        let theta = hf
            .rope_theta
            .or_else(|| hf.rope_parameters.as_ref()?.get("rope_theta")?.as_f64().map(|v| v as f32))
            .unwrap_or(10000.0);
        let rope_type = params
            .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let rope_scaling = match rope_type {
            "default" => None,
            "llama3" => Some(
                serde_json::from_value::<RopeScaling>(params.cloned().unwrap_or_default())
                    .map_err(|e| EngineError::Model(format!("bad llama3 rope scaling in config.json: {e}")))?,
            ),
            other => return Err(EngineError::Unsupported(format!("RoPE type '{other}' is not supported yet"))),
        };
        ModelConfig {
            name: hf._name_or_path.unwrap_or_default(),
            n_layers: hf.num_hidden_layers,
            hidden: hf.hidden_size,
            ffn: hf.intermediate_size,
            n_heads: hf.num_attention_heads,
            n_kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim: hf.head_dim.unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1)),
            vocab: hf.vocab_size,
            rms_eps: hf.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: theta,
            rope_interleaved: false,
            rope_scaling,
            max_context: hf.max_position_embeddings.unwrap_or(4096),
            tied_embeddings: hf.tie_word_embeddings.unwrap_or(false),
        }
        .check()
    }
}

/// Llama 3.1 frequency scaling of one inverse frequency.
fn llama3_scale(inv_freq: f32, s: &RopeScaling) -> f32 {
    let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
    let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
    let wavelen = 2.0 * std::f32::consts::PI / inv_freq;
    if wavelen < high_wavelen {
        inv_freq
    } else if wavelen > low_wavelen {
        inv_freq / s.factor
    } else {
        let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * inv_freq / s.factor + smooth * inv_freq
    }
}
