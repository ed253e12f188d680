//! Sampling parameters, their validation, and the per-sequence sampler.
//!
//! Order of operations on a step's logits (as vLLM does):
//! logprobs are taken from the raw logits; then logit bias, `min_tokens` (end tokens
//! masked), repetition / presence / frequency penalties; then greedy argmax when
//! `temperature == 0`, else temperature, top-k, softmax, top-p, min-p and a draw from
//! the sequence's own seeded ChaCha8 stream. A sequence's draws depend only on its own
//! seed and its own logits, so batching and preemption never change its tokens.

use std::collections::HashMap;

use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::EngineError;

/// Most alternatives a request may ask logprobs for (OpenAI's limit).
pub const MAX_LOGPROBS: usize = 20;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct SamplingParams {
    /// Tokens to generate at most; `None`: up to the context length.
    pub max_tokens: Option<usize>,
    /// Tokens to generate at least before an end token or stop string may end it.
    pub min_tokens: usize,
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 or -1 disables.
    pub top_k: i32,
    /// 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub min_p: f32,
    pub seed: Option<u64>,
    /// 1 disables; applies to prompt and output tokens.
    pub repetition_penalty: f32,
    /// Applies to output tokens.
    pub presence_penalty: f32,
    /// Applies to output tokens.
    pub frequency_penalty: f32,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Return the chosen token's logprob and this many top alternatives.
    pub logprobs: Option<usize>,
    pub logit_bias: Vec<(u32, f32)>,
    pub skip_special_tokens: bool,
    /// Salts this request's prefix-cache block hashes (vLLM's `cache_salt`): requests
    /// share cached KV only when their salts are equal.
    pub cache_salt: Option<String>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: None,
            min_tokens: 0,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            logit_bias: Vec::new(),
            skip_special_tokens: true,
            cache_salt: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Default::default() }
    }

    /// Checks every value; the error names the parameter and the allowed range.
    pub fn validate(&self, vocab: usize) -> Result<(), EngineError> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if let Some(0) = self.max_tokens {
            return bad("max_tokens must be at least 1".into());
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 || self.temperature > 100.0 {
            return bad(format!("temperature must be between 0 and 100, got {}", self.temperature));
        }
        if self.top_k < -1 {
            return bad(format!("top_k must be -1 or 0 (disabled) or a positive number, got {}", self.top_k));
        }
        if !self.top_p.is_finite() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !self.min_p.is_finite() || !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 || self.repetition_penalty > 10.0 {
            return bad(format!("repetition_penalty must be in (0, 10], got {}", self.repetition_penalty));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !v.is_finite() || !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if let Some(n) = self.logprobs {
            if n > MAX_LOGPROBS {
                return bad(format!("logprobs (top alternatives) must be at most {MAX_LOGPROBS}, got {n}"));
            }
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return bad("stop strings must not be empty".into());
        }
        for &id in &self.stop_token_ids {
            if id as usize >= vocab {
                return bad(format!("stop_token_ids: {id} is not a token id (vocabulary size {vocab})"));
            }
        }
        for &(id, bias) in &self.logit_bias {
            if id as usize >= vocab {
                return bad(format!("logit_bias: {id} is not a token id (vocabulary size {vocab})"));
            }
            if !bias.is_finite() || !(-100.0..=100.0).contains(&bias) {
                return bad(format!("logit_bias values must be in [-100, 100], got {bias} for token {id}"));
            }
        }
        if let Some(m) = self.max_tokens {
            if self.min_tokens > m {
                return bad(format!("min_tokens ({}) must not exceed max_tokens ({m})", self.min_tokens));
            }
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature < 1e-5
    }
}

/// The chosen token's log-probability and the top alternatives (from the raw logits).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Per-sequence sampling state.
pub struct Sampler {
    rng: ChaCha8Rng,
    /// Output token counts (presence/frequency penalties).
    counts: HashMap<u32, u32>,
    /// Prompt tokens (repetition penalty), only when that penalty is on.
    prompt_tokens: Vec<u32>,
    candidates: Vec<(u32, f32)>,
    /// The unprocessed logits, kept when logprobs are requested.
    raw: Vec<f32>,
}

impl Sampler {
    pub fn new(params: &SamplingParams, prompt: &[u32]) -> Self {
        let rng = match params.seed {
            Some(s) => ChaCha8Rng::seed_from_u64(s),
            None => ChaCha8Rng::from_os_rng(),
        };
        let mut prompt_tokens = Vec::new();
        if params.repetition_penalty != 1.0 {
            prompt_tokens = prompt.to_vec();
            prompt_tokens.sort_unstable();
            prompt_tokens.dedup();
        }
        Sampler { rng, counts: HashMap::new(), prompt_tokens, candidates: Vec::new(), raw: Vec::new() }
    }

    /// Picks the next token from `logits` (modified in place). `n_generated` and
    /// `end_ids` serve `min_tokens`.
    pub fn sample(
        &mut self,
        p: &SamplingParams,
        logits: &mut [f32],
        n_generated: usize,
        end_ids: &[u32],
    ) -> (u32, Option<TokenLogprob>) {
        // Logprobs describe the model's distribution: take them before any processing.
        let raw_lse = p.logprobs.map(|_| {
            self.raw.clear();
            self.raw.extend_from_slice(logits);
            log_sum_exp(logits)
        });
        for &(id, b) in &p.logit_bias {
            logits[id as usize] += b;
        }
        if n_generated < p.min_tokens {
            for &id in end_ids.iter().chain(&p.stop_token_ids) {
                logits[id as usize] = f32::NEG_INFINITY;
            }
        }
        if p.repetition_penalty != 1.0 {
            let rp = p.repetition_penalty;
            let apply = |l: &mut f32| *l = if *l > 0.0 { *l / rp } else { *l * rp };
            for &id in &self.prompt_tokens {
                apply(&mut logits[id as usize]);
            }
            for &id in self.counts.keys() {
                if self.prompt_tokens.binary_search(&id).is_err() {
                    apply(&mut logits[id as usize]);
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&id, &c) in &self.counts {
                logits[id as usize] -= p.frequency_penalty * c as f32 + p.presence_penalty;
            }
        }
        let token = if p.is_greedy() { argmax(logits) } else { self.draw(p, logits) };
        *self.counts.entry(token).or_insert(0) += 1;
        let lp = raw_lse.map(|lse| TokenLogprob {
            token,
            logprob: self.raw[token as usize] - lse,
            top: top_n(&self.raw, p.logprobs.unwrap_or(0), &mut self.candidates)
                .into_iter()
                .map(|(t, l)| (t, l - lse))
                .collect(),
        });
        (token, lp)
    }

    /// Records `token` as if this sampler had just sampled it elsewhere (the first
    /// token, sampled by a prefill worker that started from the same seed): counts it
    /// for the penalties and advances the random stream by the one draw a non-greedy
    /// sample takes, so the rest of the sequence matches an undivided run.
    pub fn accept(&mut self, p: &SamplingParams, token: u32) {
        if !p.is_greedy() {
            self.rng.next_u64();
        }
        *self.counts.entry(token).or_insert(0) += 1;
    }

    fn draw(&mut self, p: &SamplingParams, logits: &[f32]) -> u32 {
        let inv_t = 1.0 / p.temperature;
        let c = &mut self.candidates;
        c.clear();
        c.extend(
            logits.iter().enumerate().filter(|(_, l)| **l > f32::NEG_INFINITY).map(|(i, l)| (i as u32, l * inv_t)),
        );
        if c.is_empty() {
            return argmax(logits);
        }
        let by_logit_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && (p.top_k as usize) < c.len() {
            let k = p.top_k as usize;
            c.select_nth_unstable_by(k - 1, by_logit_desc);
            c.truncate(k);
        }
        let max = c.iter().fold(f32::NEG_INFINITY, |m, x| m.max(x.1));
        let mut sum = 0f64;
        for x in c.iter_mut() {
            x.1 = (x.1 - max).exp();
            sum += x.1 as f64;
        }
        // Probabilities are now in `.1` (unnormalised); sort the likely ones first.
        if p.top_p < 1.0 {
            let target = p.top_p as f64 * sum;
            // Most of the mass usually sits in a few hundred tokens: sort those first
            // and fall back to a full sort only when they do not reach `target`.
            let head = 1024.min(c.len());
            let by_p_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
            if head < c.len() {
                c.select_nth_unstable_by(head - 1, by_p_desc);
            }
            c[..head].sort_unstable_by(by_p_desc);
            let mut cum = 0f64;
            let mut cut = None;
            for (i, x) in c[..head].iter().enumerate() {
                cum += x.1 as f64;
                if cum >= target {
                    cut = Some(i + 1);
                    break;
                }
            }
            let cut = match cut {
                Some(k) => k,
                None => {
                    c.sort_unstable_by(by_p_desc);
                    let mut cum = 0f64;
                    c.iter()
                        .position(|x| {
                            cum += x.1 as f64;
                            cum >= target
                        })
                        .map(|i| i + 1)
                        .unwrap_or(c.len())
                }
            };
            c.truncate(cut);
        }
        if p.min_p > 0.0 {
            let pmax = c.iter().fold(0f32, |m, x| m.max(x.1));
            let floor = p.min_p * pmax;
            c.retain(|x| x.1 >= floor);
        }
        let total: f64 = c.iter().map(|x| x.1 as f64).sum();
        let u = (self.rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64) * total;
        let mut acc = 0f64;
        for x in c.iter() {
            acc += x.1 as f64;
            if u < acc {
                return x.0;
            }
        }
        c.last().expect("non-empty").0
    }
}

/// Index of the largest value; the lowest index among equals. NaN never wins.
pub use kernels::backend::argmax;

pub fn log_sum_exp(v: &[f32]) -> f32 {
    let max = v.iter().fold(f32::NEG_INFINITY, |m, x| m.max(*x));
    if max == f32::NEG_INFINITY {
        return max;
    }
    let s: f64 = v.iter().map(|x| ((x - max) as f64).exp()).sum();
    max + s.ln() as f32
}

/// The `n` largest (token, logit) pairs, largest first (ties: lower id first).
pub fn top_n(v: &[f32], n: usize, scratch: &mut Vec<(u32, f32)>) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    scratch.clear();
    scratch.extend(v.iter().enumerate().map(|(i, l)| (i as u32, *l)));
    let cmp = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let n = n.min(scratch.len());
    if n < scratch.len() {
        scratch.select_nth_unstable_by(n - 1, cmp);
    }
    let mut top = scratch[..n].to_vec();
    top.sort_unstable_by(cmp);
    top
}
