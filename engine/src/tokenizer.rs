//! Tokenization and chat templates.
//!
//! The tokenizer is built on the `tokenizers` crate: from `tokenizer.json` when the
//! model directory has one, or from GGUF metadata (gpt2-style byte-level BPE: vocab,
//! merges, token types and the named pre-tokenizer). Chat templates are rendered with
//! minijinja configured like transformers' Jinja environment.
//!
//! Rules this module keeps:
//! - Encoding never adds BOS on its own; callers decide (`add_bos` says what the model
//!   expects), so prompt ids are exactly what the model's reference tokenizer gives.
//! - Decoding of a growing output is incremental and never emits broken UTF-8
//!   ([`IncrementalDecoder`]).

use std::path::Path;

use serde::{Deserialize, Serialize};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer as HfTokenizer};

use crate::gguf::{Gguf, Value};
use crate::EngineError;

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// One chat message. `content` is plain text (the gateway flattens content parts).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub struct Tokenizer {
    inner: HfTokenizer,
    pub bos_id: Option<u32>,
    /// Tokens that end generation (EOS and, e.g., `<|im_end|>`-style end-of-turn tokens).
    pub eos_ids: Vec<u32>,
    pub add_bos: bool,
    pub chat_template: Option<String>,
    bos_text: String,
    eos_text: String,
    vocab_size: usize,
}

fn tok_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Model(format!("tokenizer: {e}"))
}

impl Tokenizer {
    pub fn from_gguf(g: &Gguf) -> Result<Self, EngineError> {
        let model = g.get("tokenizer.ggml.model").and_then(Value::as_str).unwrap_or("");
        if model != "gpt2" {
            return Err(EngineError::Unsupported(format!(
                "GGUF tokenizer model '{model}' is not supported yet (supported: gpt2-style byte-level BPE); \
                 use a Hugging Face directory with tokenizer.json instead"
            )));
        }
        let tokens: Vec<String> = g
            .get("tokenizer.ggml.tokens")
            .and_then(Value::as_array)
            .ok_or_else(|| tok_err("GGUF metadata has no tokenizer.ggml.tokens"))?
            .iter()
            .map(|v| v.as_str().map(str::to_string).ok_or_else(|| tok_err("a token is not a string")))
            .collect::<Result<_, _>>()?;
        let types: Vec<u64> = g
            .get("tokenizer.ggml.token_type")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(|v| v.as_u64().unwrap_or(1)).collect())
            .unwrap_or_else(|| vec![1; tokens.len()]);
        let merges: Vec<(String, String)> = g
            .get("tokenizer.ggml.merges")
            .and_then(Value::as_array)
            .ok_or_else(|| tok_err("GGUF metadata has no tokenizer.ggml.merges"))?
            .iter()
            .map(|v| {
                let s = v.as_str().ok_or_else(|| tok_err("a merge is not a string"))?;
                let (a, b) = s.split_once(' ').ok_or_else(|| tok_err(format!("bad merge '{s}'")))?;
                Ok((a.to_string(), b.to_string()))
            })
            .collect::<Result<_, EngineError>>()?;
        let vocab: tokenizers::models::bpe::Vocab =
            tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(tok_err)?;
        let mut inner = HfTokenizer::new(bpe);
        let pre = g.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("default");
        let byte_level = |use_regex: bool| -> PreTokenizerWrapper { ByteLevel::new(false, true, use_regex).into() };
        let split = |pattern: &str| -> Result<PreTokenizerWrapper, EngineError> {
            Ok(Split::new(SplitPattern::Regex(pattern.into()), SplitDelimiterBehavior::Isolated, false)
                .map_err(tok_err)?
                .into())
        };
        let pre_tokenizer: PreTokenizerWrapper = match pre {
            "default" | "gpt2" | "gpt-2" => byte_level(true),
            // SmolLM: every digit on its own, then GPT-2's split.
            "smollm" => Sequence::new(vec![Digits::new(true).into(), byte_level(true)]).into(),
            "llama3" | "llama-v3" | "llama-bpe" => Sequence::new(vec![split(LLAMA3_PATTERN)?, byte_level(false)]).into(),
            "qwen2" | "deepseek-r1-qwen" => Sequence::new(vec![split(QWEN2_PATTERN)?, byte_level(false)]).into(),
            other => {
                return Err(EngineError::Unsupported(format!(
                    "GGUF pre-tokenizer '{other}' is not supported yet (supported: default/gpt2, smollm, llama-bpe, qwen2); \
                     use a Hugging Face directory with tokenizer.json instead"
                )))
            }
        };
        inner.with_pre_tokenizer(Some(pre_tokenizer));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| **t == TOKEN_TYPE_CONTROL || **t == TOKEN_TYPE_USER_DEFINED)
            .map(|(s, t)| AddedToken::from(s.clone(), *t == TOKEN_TYPE_CONTROL))
            .collect();
        inner.add_special_tokens(&specials);
        let id = |k: &str| g.get(k).and_then(Value::as_u64).map(|v| v as u32);
        let bos_id = id("tokenizer.ggml.bos_token_id");
        let mut eos_ids: Vec<u32> = id("tokenizer.ggml.eos_token_id").into_iter().collect();
        if let Some(eot) = id("tokenizer.ggml.eot_token_id") {
            if !eos_ids.contains(&eot) {
                eos_ids.push(eot);
            }
        }
        let text = |i: Option<u32>| i.and_then(|i| tokens.get(i as usize).cloned()).unwrap_or_default();
        Ok(Tokenizer {
            bos_text: text(bos_id),
            eos_text: text(eos_ids.first().copied()),
            inner,
            bos_id,
            eos_ids,
            add_bos: g.get("tokenizer.ggml.add_bos_token").and_then(Value::as_bool).unwrap_or(false),
            chat_template: g.get("tokenizer.chat_template").and_then(Value::as_str).map(str::to_string),
            vocab_size: tokens.len(),
        })
    }

    /// From a Hugging Face directory: tokenizer.json, tokenizer_config.json (chat
    /// template, BOS/EOS, add_bos) and generation_config.json (extra EOS ids).
    pub fn from_hf_dir(dir: &Path) -> Result<Self, EngineError> {
        let inner = HfTokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| tok_err(format!("cannot load {}: {e}", dir.join("tokenizer.json").display())))?;
        let read_json = |name: &str| -> serde_json::Value {
            std::fs::read_to_string(dir.join(name))
                .ok()
                .and_then(|s| serde_json::from_str(&s).ok())
                .unwrap_or(serde_json::Value::Null)
        };
        let tc = read_json("tokenizer_config.json");
        let gc = read_json("generation_config.json");
        let cfg = read_json("config.json");
        let token_text = |v: &serde_json::Value| -> Option<String> {
            match v {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
                _ => None,
            }
        };
        let bos_text = token_text(&tc["bos_token"]).unwrap_or_default();
        let eos_text = token_text(&tc["eos_token"]).unwrap_or_default();
        let bos_id = inner.token_to_id(&bos_text).or_else(|| cfg["bos_token_id"].as_u64().map(|v| v as u32));
        let mut eos_ids: Vec<u32> = inner.token_to_id(&eos_text).into_iter().collect();
        for src in [&gc["eos_token_id"], &cfg["eos_token_id"]] {
            let ids: Vec<u64> = match src {
                serde_json::Value::Number(n) => n.as_u64().into_iter().collect(),
                serde_json::Value::Array(a) => a.iter().filter_map(|v| v.as_u64()).collect(),
                _ => vec![],
            };
            for i in ids {
                if !eos_ids.contains(&(i as u32)) {
                    eos_ids.push(i as u32);
                }
            }
        }
        let chat_template = match &tc["chat_template"] {
            serde_json::Value::String(s) => Some(s.clone()),
            _ => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
        };
        Ok(Tokenizer {
            vocab_size: inner.get_vocab_size(true),
            inner,
            bos_id,
            eos_ids,
            add_bos: tc["add_bos_token"].as_bool().unwrap_or(false),
            chat_template,
            bos_text,
            eos_text,
        })
    }

    /// From a `tokenizer.json` text alone (no special tokens, no chat template).
    pub fn from_json(json: &str) -> Result<Self, EngineError> {
        let inner: HfTokenizer = json.parse().map_err(tok_err)?;
        Ok(Tokenizer {
            vocab_size: inner.get_vocab_size(true),
            inner,
            bos_id: None,
            eos_ids: Vec::new(),
            add_bos: false,
            chat_template: None,
            bos_text: String::new(),
            eos_text: String::new(),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Token ids of `text`, special tokens in the text recognised; no BOS added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        Ok(self.inner.encode_fast(text, false).map_err(tok_err)?.get_ids().to_vec())
    }

    /// Token ids of a prompt as the model expects it (BOS first when the model wants it).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        let mut ids = Vec::new();
        if self.add_bos {
            if let Some(b) = self.bos_id {
                if !text.starts_with(&self.bos_text) || self.bos_text.is_empty() {
                    ids.push(b);
                }
            }
        }
        ids.extend(self.encode(text)?);
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, EngineError> {
        self.inner.decode(ids, skip_special).map_err(tok_err)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The bytes token `id` stands for (for byte-level BPE, possibly part of a UTF-8
    /// character), as OpenAI's logprobs report them.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        if let Some(t) = self.inner.id_to_token(id) {
            let bytes: Option<Vec<u8>> = t.chars().map(byte_level_char_to_byte).collect();
            if let Some(b) = bytes {
                return b;
            }
        }
        self.decode(&[id], false).unwrap_or_default().into_bytes()
    }

    /// Renders `messages` with the model's chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, EngineError> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            EngineError::Unsupported("this model has no chat template; send a plain prompt instead".into())
        })?;
        render_chat(template, messages, add_generation_prompt, &self.bos_text, &self.eos_text)
    }
}

/// GPT-2's byte-level alphabet, inverted: printable bytes stand for themselves, the
/// others were shifted to U+0100 and up in byte order.
fn byte_level_char_to_byte(c: char) -> Option<u8> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let cp = c as u32;
    if cp < 256 && printable(cp) {
        return Some(cp as u8);
    }
    if (256..256 + 68).contains(&cp) {
        let k = cp - 256;
        return (0..256u32).filter(|b| !printable(*b)).nth(k as usize).map(|b| b as u8);
    }
    None
}

/// Renders a Hugging Face chat template the way transformers does (Jinja with
/// `trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, Python-style
/// string methods).
pub fn render_chat(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, EngineError> {
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
        Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
    });
    env.add_template("chat", template)
        .map_err(|e| EngineError::Model(format!("the model's chat template does not parse: {e}")))?;
    let tmpl = env.get_template("chat").expect("just added");
    tmpl.render(minijinja::context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token,
        eos_token => eos_token,
    })
    .map_err(|e| EngineError::InvalidRequest(format!("the chat template rejected the messages: {e}")))
}

/// Turns a growing list of output token ids into text deltas, holding back bytes
/// that do not yet form whole UTF-8 characters (the vLLM/TGI prefix-offset method).
#[derive(Clone, Debug, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special: bool,
}

impl IncrementalDecoder {
    pub fn new(skip_special: bool) -> Self {
        Self { skip_special, ..Default::default() }
    }

    /// Adds one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special).unwrap_or_default();
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special).unwrap_or_default();
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.is_char_boundary(prefix.len()) {
            let delta = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            delta
        } else {
            String::new()
        }
    }

    /// Whatever is still held back (at the end of generation), replacement
    /// characters included.
    pub fn flush(&mut self, tok: &Tokenizer) -> String {
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special).unwrap_or_default();
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special).unwrap_or_default();
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        if full.len() > prefix.len() && full.is_char_boundary(prefix.len()) {
            full[prefix.len()..].to_string()
        } else {
            String::new()
        }
    }
}
