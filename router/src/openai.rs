//! OpenAI request shapes, as the official `openai` SDK sends them, and their
//! translation into engine requests.
//!
//! Unknown fields are rejected (OpenAI does the same: "Unrecognized request argument"),
//! and known fields this server does not implement get a 400 that names them.

use std::collections::HashMap;

use engine::sampling::{SamplingParams, MAX_LOGPROBS};
use engine::tokenizer::ChatMessage;
use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::error::ApiError;

/// Parses a JSON body: 422 when it is not JSON at all, 400 naming the field when a
/// value has the wrong type or an unknown field is present.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::unparsable(format!("the request body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::invalid(None, "the request body must be a JSON object"));
    }
    let raw = value.clone();
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        if let Some(field) = inner.strip_prefix("unknown field `").and_then(|r| r.split('`').next()) {
            let field = if path == "." { field.to_string() } else { format!("{path}.{field}") };
            return ApiError::invalid(Some(field.clone()), format!("unrecognized request argument supplied: {field}"));
        }
        // A required field that is absent is named as such, before any value is blamed.
        if let Some(field) = inner.strip_prefix("missing field `").and_then(|r| r.split('`').next()) {
            let field = if path == "." { field.to_string() } else { format!("{path}.{field}") };
            return ApiError::invalid(Some(field.clone()), format!("missing required parameter '{field}'"));
        }
        // Fields of flattened structs lose their path; find the culprit by trying each
        // top-level field on its own.
        let param = if path == "." { culprit(&raw) } else { Some(path.clone()) };
        let what = param.clone().unwrap_or_else(|| "the request".into());
        // serde's message, without its position suffix (positions refer to our re-encoding).
        let msg = inner.split(" at line ").next().unwrap_or(&inner).to_string();
        ApiError::invalid(param, format!("invalid value for {what}: {msg}"))
    })
}

/// The top-level field whose value does not fit the shared (flattened) fields' types.
fn culprit(v: &serde_json::Value) -> Option<String> {
    let obj = v.as_object()?;
    for (k, val) in obj {
        let single = serde_json::Value::Object([(k.clone(), val.clone())].into_iter().collect());
        let fits = serde_json::from_value::<Sampling>(single.clone()).is_ok()
            && serde_json::from_value::<Unsupported>(single).is_ok();
        if !fits {
            return Some(k.chars().take(64).collect());
        }
    }
    None
}

#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum StopSpec {
    One(String),
    Many(Vec<String>),
}

impl StopSpec {
    fn into_vec(self) -> Vec<String> {
        match self {
            StopSpec::One(s) => vec![s],
            StopSpec::Many(v) => v,
        }
    }
}

#[derive(Deserialize, Debug, Clone, Default)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    #[serde(default)]
    pub continuous_usage_stats: bool,
}

/// Sampling fields shared by chat and completions (OpenAI's and vLLM's extensions).
#[derive(Deserialize, Debug, Clone, Default)]
pub struct Sampling {
    pub max_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub n: Option<u32>,
    pub stop: Option<StopSpec>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub logit_bias: Option<HashMap<String, f32>>,
    pub user: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    // vLLM extensions.
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub min_tokens: Option<u64>,
    pub ignore_eos: Option<bool>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub skip_special_tokens: Option<bool>,
    /// vLLM's `return_token_ids`: non-streaming choices carry their `token_ids`.
    pub return_token_ids: Option<bool>,
    /// vLLM's `cache_salt`: only requests with the same salt share prefix-cache blocks.
    pub cache_salt: Option<String>,
}

/// Most choices per request.
pub const MAX_N: u32 = 64;

impl Sampling {
    /// Engine parameters for choice `i` of `n` (a given seed becomes `seed + i`, so the
    /// choices differ but the request stays reproducible).
    pub fn to_params(
        &self,
        max_tokens: Option<u64>,
        logprobs: Option<usize>,
        vocab: usize,
    ) -> Result<SamplingParams, ApiError> {
        let n = self.n.unwrap_or(1);
        if n == 0 || n > MAX_N {
            return Err(ApiError::invalid(Some("n".into()), format!("n must be between 1 and {MAX_N}, got {n}")));
        }
        if let Some(lp) = logprobs {
            if lp > MAX_LOGPROBS {
                return Err(ApiError::invalid(
                    Some("top_logprobs".into()),
                    format!("top_logprobs must be between 0 and {MAX_LOGPROBS}, got {lp}"),
                ));
            }
        }
        let to_usize = |name: &str, v: u64| -> Result<usize, ApiError> {
            usize::try_from(v)
                .ok()
                .filter(|v| *v <= 1 << 30)
                .ok_or_else(|| ApiError::invalid(Some(name.into()), format!("{name} is too large ({v})")))
        };
        let mut logit_bias = Vec::new();
        for (k, v) in self.logit_bias.iter().flatten() {
            let id: u32 = k.parse().map_err(|_| {
                ApiError::invalid(Some("logit_bias".into()), "logit_bias keys must be token ids (as strings)")
            })?;
            if id as usize >= vocab {
                return Err(ApiError::invalid(
                    Some("logit_bias".into()),
                    format!("logit_bias: {id} is not a token id (vocabulary size {vocab})"),
                ));
            }
            logit_bias.push((id, *v));
        }
        let stop = self.stop.clone().map(StopSpec::into_vec).unwrap_or_default();
        if stop.len() > 16 {
            return Err(ApiError::invalid(Some("stop".into()), "at most 16 stop sequences are allowed"));
        }
        let p = SamplingParams {
            max_tokens: max_tokens.map(|m| to_usize("max_tokens", m)).transpose()?,
            min_tokens: self.min_tokens.map(|m| to_usize("min_tokens", m)).transpose()?.unwrap_or(0),
            temperature: self.temperature.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(0),
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            seed: self.seed.map(|s| s as u64),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            stop,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logprobs,
            logit_bias,
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            cache_salt: self.cache_salt.clone(),
        };
        if p.cache_salt.as_deref().is_some_and(str::is_empty) {
            return Err(ApiError::invalid(Some("cache_salt".into()), "cache_salt must be a non-empty string"));
        }
        if matches!(p.max_tokens, Some(0)) {
            return Err(ApiError::invalid(Some("max_tokens".into()), "max_tokens must be at least 1"));
        }
        p.validate(vocab).map_err(ApiError::from)?;
        Ok(p)
    }

    pub fn n(&self) -> usize {
        self.n.unwrap_or(1) as usize
    }

    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().is_some_and(|o| o.include_usage)
    }
}

/// Parameters we know but do not implement: rejected with a 400 naming them.
#[derive(Deserialize, Debug, Clone, Default)]
pub struct Unsupported {
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
    pub functions: Option<serde_json::Value>,
    pub function_call: Option<serde_json::Value>,
    pub response_format: Option<serde_json::Value>,
    pub audio: Option<serde_json::Value>,
    pub modalities: Option<serde_json::Value>,
    pub prediction: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<serde_json::Value>,
    pub reasoning_effort: Option<serde_json::Value>,
    pub web_search_options: Option<serde_json::Value>,
    pub suffix: Option<serde_json::Value>,
    pub best_of: Option<serde_json::Value>,
    pub store: Option<serde_json::Value>,
    pub service_tier: Option<serde_json::Value>,
    pub metadata: Option<serde_json::Value>,
}

impl Unsupported {
    pub fn check(&self) -> Result<(), ApiError> {
        let set = |v: &Option<serde_json::Value>| v.as_ref().is_some_and(|v| !v.is_null());
        let harmless =
            |v: &Option<serde_json::Value>, ok: serde_json::Value| v.as_ref().is_none_or(|v| v.is_null() || *v == ok);
        for (name, v) in [
            ("tools", &self.tools),
            ("functions", &self.functions),
            ("function_call", &self.function_call),
            ("audio", &self.audio),
            ("prediction", &self.prediction),
            ("reasoning_effort", &self.reasoning_effort),
            ("web_search_options", &self.web_search_options),
            ("suffix", &self.suffix),
            ("metadata", &self.metadata),
        ] {
            if set(v) {
                return Err(ApiError::unsupported(name));
            }
        }
        if !harmless(&self.tool_choice, "none".into()) {
            return Err(ApiError::unsupported("tool_choice"));
        }
        if !harmless(&self.parallel_tool_calls, false.into()) && !harmless(&self.parallel_tool_calls, true.into()) {
            return Err(ApiError::unsupported("parallel_tool_calls"));
        }
        if !harmless(&self.response_format, serde_json::json!({"type": "text"})) {
            return Err(ApiError::unsupported("response_format"));
        }
        if !harmless(&self.modalities, serde_json::json!(["text"])) {
            return Err(ApiError::unsupported("modalities"));
        }
        if !harmless(&self.best_of, 1.into()) {
            return Err(ApiError::unsupported("best_of"));
        }
        if !harmless(&self.store, false.into()) {
            return Err(ApiError::unsupported("store"));
        }
        if !harmless(&self.service_tier, "auto".into()) && !harmless(&self.service_tier, "default".into()) {
            return Err(ApiError::unsupported("service_tier"));
        }
        Ok(())
    }
}

#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize, Debug, Clone)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Deserialize, Debug, Clone)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    pub name: Option<String>,
    pub tool_calls: Option<serde_json::Value>,
    pub tool_call_id: Option<String>,
}

#[derive(Deserialize, Debug, Clone)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<Message>,
    pub max_completion_tokens: Option<u64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    pub add_generation_prompt: Option<bool>,
    #[serde(flatten)]
    pub sampling: Sampling,
    #[serde(flatten)]
    pub unsupported: Unsupported,
    /// Whatever no field above took: rejected in `check`.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// Rejects fields nobody recognised, as OpenAI does.
pub fn reject_extra(extra: &serde_json::Map<String, serde_json::Value>) -> Result<(), ApiError> {
    match extra.keys().next() {
        Some(k) => {
            let k: String = k.chars().take(64).collect();
            Err(ApiError::invalid(Some(k.clone()), format!("unrecognized request argument supplied: {k}")))
        }
        None => Ok(()),
    }
}

impl ChatRequest {
    /// The messages as the chat template takes them: text only, roles checked.
    pub fn messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid(Some("messages".into()), "messages must contain at least one message"));
        }
        let mut out = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            let role = match m.role.as_str() {
                "system" | "user" | "assistant" => m.role.clone(),
                "developer" => "system".to_string(),
                "tool" | "function" => return Err(ApiError::unsupported(&format!("messages[{i}].role: {}", m.role))),
                other => {
                    return Err(ApiError::invalid(
                        Some(format!("messages[{i}].role")),
                        format!(
                            "unknown role '{}'; use system, user or assistant",
                            other.chars().take(32).collect::<String>()
                        ),
                    ))
                }
            };
            if m.tool_calls.as_ref().is_some_and(|v| !v.is_null()) {
                return Err(ApiError::unsupported(&format!("messages[{i}].tool_calls")));
            }
            let _ = (&m.name, &m.tool_call_id);
            let content = match &m.content {
                // Only an assistant turn may come without content (OpenAI's rule: it may
                // carry tool calls instead); a system or user turn without it is a mistake.
                None if role != "assistant" => {
                    return Err(ApiError::invalid(
                        Some(format!("messages[{i}].content")),
                        format!("messages[{i}] ({}) needs 'content'", m.role),
                    ))
                }
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut s = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => s.push_str(t),
                            ("text", None) => {
                                return Err(ApiError::invalid(
                                    Some(format!("messages[{i}].content[{j}].text")),
                                    "a text content part needs 'text'",
                                ))
                            }
                            (other, _) => {
                                return Err(ApiError::invalid(
                                    Some(format!("messages[{i}].content[{j}].type")),
                                    format!(
                                        "content parts of type '{}' are not supported; this model takes text only",
                                        other.chars().take(32).collect::<String>()
                                    ),
                                ))
                            }
                        }
                    }
                    s
                }
            };
            out.push(ChatMessage { role, content });
        }
        Ok(out)
    }

    pub fn top_logprobs(&self) -> Result<Option<usize>, ApiError> {
        match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (false, Some(n)) if n > 0 => {
                Err(ApiError::invalid(Some("top_logprobs".into()), "top_logprobs needs logprobs: true"))
            }
            (true, n) => Ok(Some(n.unwrap_or(0) as usize)),
            _ => Ok(None),
        }
    }
}

#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Deserialize, Debug, Clone)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    pub echo: Option<bool>,
    pub logprobs: Option<u32>,
    #[serde(flatten)]
    pub sampling: Sampling,
    #[serde(flatten)]
    pub unsupported: Unsupported,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<Message>>,
    pub add_generation_prompt: Option<bool>,
    pub add_special_tokens: Option<bool>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}
