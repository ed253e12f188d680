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

use kernels::{LogitEdit, SampleSpec, SampledRow};

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

    /// How a backend samples a row with these parameters ([`kernels::Backend::sample_rows`]),
    /// given the step's `edits` and draw `u` from [`Sampler::device_spec`].
    pub fn sample_spec<'a>(&self, edits: &'a [LogitEdit], u: f64) -> SampleSpec<'a> {
        SampleSpec {
            temperature: if self.is_greedy() { 0.0 } else { self.temperature },
            top_k: self.top_k.max(0) as usize,
            top_p: self.top_p,
            min_p: self.min_p,
            u,
            edits,
            logprobs: self.logprobs,
        }
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
        for e in self.edits(p, n_generated, end_ids) {
            logits[e.id as usize] = e.apply(logits[e.id as usize]);
        }
        let token = match self.uniform(p) {
            None => argmax(logits),
            Some(u) => self.draw(p, logits, u),
        };
        self.record(token);
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

    /// The logit edits of this step, one per token id, in id order: logit bias, end
    /// tokens masked while `n_generated < min_tokens`, then the repetition penalty (prompt
    /// and output tokens) and the presence / frequency penalties (output tokens).
    pub fn edits(&self, p: &SamplingParams, n_generated: usize, end_ids: &[u32]) -> Vec<LogitEdit> {
        type Edits = std::collections::BTreeMap<u32, LogitEdit>;
        fn entry(m: &mut Edits, id: u32) -> &mut LogitEdit {
            m.entry(id).or_insert(LogitEdit { id, add: 0.0, rep: 1.0, sub: 0.0 })
        }
        let mut m = Edits::new();
        for &(id, b) in &p.logit_bias {
            entry(&mut m, id).add += b;
        }
        if n_generated < p.min_tokens {
            for &id in end_ids.iter().chain(&p.stop_token_ids) {
                entry(&mut m, id).add = f32::NEG_INFINITY;
            }
        }
        if p.repetition_penalty != 1.0 {
            for &id in self.prompt_tokens.iter().chain(self.counts.keys()) {
                entry(&mut m, id).rep = p.repetition_penalty;
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&id, &c) in &self.counts {
                entry(&mut m, id).sub = p.frequency_penalty * c as f32 + p.presence_penalty;
            }
        }
        m.into_values().collect()
    }

    /// The draw's uniform number in [0, 1) for a non-greedy sample (one per sample).
    fn uniform(&mut self, p: &SamplingParams) -> Option<f64> {
        (!p.is_greedy()).then(|| (self.rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64))
    }

    /// Counts `token` as sampled (presence / frequency penalties).
    fn record(&mut self, token: u32) {
        *self.counts.entry(token).or_insert(0) += 1;
    }

    /// Records `token` as if this sampler had just sampled it elsewhere (the first
    /// token, sampled by a prefill worker that started from the same seed): counts it
    /// for the penalties and advances the random stream by the one draw a non-greedy
    /// sample takes, so the rest of the sequence matches an undivided run.
    pub fn accept(&mut self, p: &SamplingParams, token: u32) {
        self.uniform(p);
        self.record(token);
    }

    /// Whether this step's sample is a bare argmax of the raw logits that no earlier token
    /// changes: greedy, no logprobs, no logit edits now (`n_generated` tokens so far), and
    /// no penalties (which would depend on tokens not read yet). Such rows may be sampled
    /// deferred ([`kernels::Backend::sample_rows_deferred`]).
    pub fn defers(&self, p: &SamplingParams, n_generated: usize, end_ids: &[u32]) -> bool {
        p.is_greedy()
            && p.logprobs.is_none()
            && p.repetition_penalty == 1.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
            && self.edits(p, n_generated, end_ids).is_empty()
    }

    /// What a backend needs to sample this step where the logits are: the edits and the
    /// draw's uniform number (taken from the stream now, as [`Sampler::sample`] would).
    pub fn device_spec(&mut self, p: &SamplingParams, n_generated: usize, end_ids: &[u32]) -> (Vec<LogitEdit>, f64) {
        let edits = self.edits(p, n_generated, end_ids);
        (edits, self.uniform(p).unwrap_or(0.0))
    }

    /// Finishes a row a backend sampled ([`kernels::Backend::sample_rows`]) with the
    /// `edits` and `u` of [`Sampler::device_spec`]. `None` when the backend's candidates
    /// do not settle the draw (top-k beyond them, or top-p mass they do not reach): call
    /// again with `full`, the row's edited logits.
    pub fn finish_device(
        &mut self,
        p: &SamplingParams,
        row: &SampledRow,
        edits: &[LogitEdit],
        u: f64,
        full: Option<&[f32]>,
    ) -> Option<(u32, Option<TokenLogprob>)> {
        let (token, edited) = match (row.token, full) {
            (Some(t), _) => (t, None),
            (None, Some(logits)) => (self.draw(p, logits, u), Some(logits)),
            (None, None) => {
                let inv_t = 1.0 / p.temperature;
                self.candidates.clear();
                self.candidates.extend(row.candidates.iter().map(|&(i, l)| (i, l * inv_t)));
                let mut c = std::mem::take(&mut self.candidates);
                let t = finish_draw(p, &mut c, Some((row.n_finite, row.z_all)), u);
                self.candidates = c;
                (t?, None)
            }
        };
        self.record(token);
        let lp = p.logprobs.map(|n| {
            let raw = match edits.binary_search_by_key(&token, |e| e.id) {
                Ok(i) => row.edit_orig[i],
                Err(_) if row.token.is_some() => row.token_raw_logit,
                Err(_) => match edited {
                    Some(l) => l[token as usize],
                    None => row.candidates.iter().find(|c| c.0 == token).map_or(f32::NAN, |c| c.1),
                },
            };
            let mut top = row.top.clone();
            top.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            top.truncate(n);
            TokenLogprob {
                token,
                logprob: raw - row.lse,
                top: top.into_iter().map(|(t, l)| (t, l - row.lse)).collect(),
            }
        });
        Some((token, lp))
    }

    fn draw(&mut self, p: &SamplingParams, logits: &[f32], u: f64) -> u32 {
        let inv_t = 1.0 / p.temperature;
        let mut c = std::mem::take(&mut self.candidates);
        c.clear();
        c.extend(
            logits.iter().enumerate().filter(|(_, l)| **l > f32::NEG_INFINITY).map(|(i, l)| (i as u32, l * inv_t)),
        );
        let t = if c.is_empty() { argmax(logits) } else { finish_draw(p, &mut c, None, u).expect("all candidates") };
        self.candidates = c;
        t
    }
}

/// The draw over candidates `c` of (id, scaled logit): all tokens with a finite logit
/// (`partial: None`), or only the best of them by scaled logit, with how many there are
/// in all and Σ exp(scaled − max) over all. Top-k, then top-p over the probabilities in
/// descending order, then min-p; then the kept tokens in id order, the first whose
/// running sum exceeds `u` × their total. `None` when a partial list cannot settle it.
fn finish_draw(p: &SamplingParams, c: &mut Vec<(u32, f32)>, partial: Option<(usize, f64)>, u: f64) -> Option<u32> {
    let n_all = partial.map_or(c.len(), |(n, _)| n);
    let by_logit_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    // A "partial" list that holds every finite token is complete (its own sums are used).
    let mut complete = c.len() >= n_all;
    if p.top_k > 0 && (p.top_k as usize) < n_all {
        let k = p.top_k as usize;
        if k > c.len() {
            return None;
        }
        if k < c.len() {
            c.select_nth_unstable_by(k - 1, by_logit_desc);
            c.truncate(k);
        }
        complete = true;
    }
    let max = c.iter().fold(f32::NEG_INFINITY, |m, x| m.max(x.1));
    let mut sum = 0f64;
    for x in c.iter_mut() {
        x.1 = (x.1 - max).exp();
        sum += x.1 as f64;
    }
    // Probabilities are now in `.1` (unnormalised).
    if p.top_p < 1.0 {
        let mass = if complete { sum } else { partial.map_or(sum, |(_, z)| z) };
        let target = p.top_p as f64 * mass;
        // Most of the mass usually sits in a few hundred tokens: sort those first and
        // fall back to a full sort only when they do not reach `target`.
        let by_p_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let head = 1024.min(c.len());
        if head < c.len() {
            c.select_nth_unstable_by(head - 1, by_p_desc);
        }
        c[..head].sort_unstable_by(by_p_desc);
        let reach = |c: &[(u32, f32)]| {
            let mut cum = 0f64;
            c.iter()
                .position(|x| {
                    cum += x.1 as f64;
                    cum >= target
                })
                .map(|i| i + 1)
        };
        let cut = match reach(&c[..head]) {
            Some(k) => k,
            None if head < c.len() => {
                c.sort_unstable_by(by_p_desc);
                reach(c).unwrap_or(c.len())
            }
            None if complete => c.len(),
            None => return None,
        };
        c.truncate(cut);
    } else if !complete {
        return None;
    }
    if p.min_p > 0.0 {
        let pmax = c.iter().fold(0f32, |m, x| m.max(x.1));
        let floor = p.min_p * pmax;
        c.retain(|x| x.1 >= floor);
    }
    c.sort_unstable_by_key(|x| x.0);
    let total: f64 = c.iter().map(|x| x.1 as f64).sum();
    let target = u * total;
    let mut acc = 0f64;
    for x in c.iter() {
        acc += x.1 as f64;
        if target < acc {
            return Some(x.0);
        }
    }
    Some(c.last().expect("non-empty").0)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What a device backend hands back for one row (the `Backend::sample_rows`
    /// contract), made here on the CPU: the edits applied, the raw logprobs, and either
    /// the token (greedy, or a draw without top-k / top-p) or the best `cap` candidates.
    fn device_row(p: &SamplingParams, raw: &[f32], edits: &[LogitEdit], u: f64, cap: usize) -> (SampledRow, Vec<f32>) {
        let mut l = raw.to_vec();
        let mut orig = Vec::new();
        for e in edits {
            orig.push(l[e.id as usize]);
            l[e.id as usize] = e.apply(l[e.id as usize]);
        }
        let mut row = SampledRow { edit_orig: orig, ..Default::default() };
        if let Some(n) = p.logprobs {
            row.lse = log_sum_exp(raw);
            let mut scratch = Vec::new();
            row.top = top_n(raw, n, &mut scratch);
            row.top.reverse(); // unordered, as a device leaves them
        }
        let inv_t = 1.0 / p.temperature;
        let finite: Vec<(u32, f32)> =
            l.iter().enumerate().filter(|(_, v)| **v > f32::NEG_INFINITY).map(|(i, v)| (i as u32, *v)).collect();
        // As the kernel decides: candidates only when top-k or top-p can cut.
        let truncates = !p.is_greedy() && ((p.top_k > 0 && (p.top_k as usize) < finite.len()) || p.top_p < 1.0);
        if truncates && !finite.is_empty() {
            let max = finite.iter().fold(f32::NEG_INFINITY, |m, x| m.max(x.1 * inv_t));
            row.z_all = finite.iter().map(|x| (x.1 * inv_t - max).exp() as f64).sum();
            row.n_finite = finite.len();
            let mut c = finite.clone();
            c.sort_by(|a, b| (b.1 * inv_t).total_cmp(&(a.1 * inv_t)).then(a.0.cmp(&b.0)));
            let mut m = c.len().min(cap);
            if p.top_k > 0 {
                m = m.min(p.top_k as usize);
            }
            c.truncate(m);
            c.reverse();
            row.candidates = c;
        } else {
            let t = if p.is_greedy() || finite.is_empty() {
                argmax(&l)
            } else {
                let mut c: Vec<(u32, f32)> = finite.iter().map(|x| (x.0, x.1 * inv_t)).collect();
                finish_draw(p, &mut c, None, u).unwrap()
            };
            row.token = Some(t);
            row.token_raw_logit = raw[t as usize];
        }
        (row, l)
    }

    /// Host sampling and device-style sampling (candidates finished on the host, falling
    /// back to the full edited row when they do not settle the draw) pick the same
    /// tokens and logprobs, step after step (so the penalties see the same counts).
    #[test]
    fn device_rows_finish_like_host_sampling() {
        let vocab = 3000;
        let base = SamplingParams { temperature: 0.8, seed: Some(5), logprobs: Some(3), ..Default::default() };
        let cases = [
            SamplingParams { temperature: 0.0, ..base.clone() },
            base.clone(),
            SamplingParams { top_k: 40, ..base.clone() },
            SamplingParams { top_k: 2000, ..base.clone() },
            SamplingParams { top_p: 0.9, ..base.clone() },
            SamplingParams { top_p: 0.999, top_k: 500, min_p: 0.01, ..base.clone() },
            SamplingParams { min_p: 0.2, ..base.clone() },
            SamplingParams {
                top_p: 0.5,
                repetition_penalty: 1.3,
                presence_penalty: 0.5,
                frequency_penalty: 0.3,
                logit_bias: vec![(7, 5.0), (8, -100.0)],
                min_tokens: 3,
                ..base.clone()
            },
        ];
        let (mut fallbacks, mut from_candidates) = (0, 0);
        for (ci, p) in cases.iter().enumerate() {
            for cap in [8usize, 1024] {
                let prompt = [7u32, 9, 11, 2999];
                let (mut host, mut dev) = (Sampler::new(p, &prompt), Sampler::new(p, &prompt));
                let mut x = 0x1234_5678_9abc_def0u64 ^ ci as u64;
                for step in 0..12 {
                    let raw: Vec<f32> = (0..vocab)
                        .map(|_| {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 12.0
                        })
                        .collect();
                    let end = [5u32];
                    let want = host.sample(p, &mut raw.clone(), step, &end);
                    let (edits, u) = dev.device_spec(p, step, &end);
                    let (row, edited) = device_row(p, &raw, &edits, u, cap);
                    let got = match dev.finish_device(p, &row, &edits, u, None) {
                        Some(g) => {
                            from_candidates += usize::from(row.token.is_none());
                            g
                        }
                        None => {
                            fallbacks += 1;
                            dev.finish_device(p, &row, &edits, u, Some(&edited)).unwrap()
                        }
                    };
                    assert_eq!(got.0, want.0, "case {ci}, cap {cap}, step {step}");
                    let (g, w) = (got.1.unwrap(), want.1.unwrap());
                    assert_eq!(g.token, w.token);
                    assert!((g.logprob - w.logprob).abs() < 1e-6, "case {ci}: {} vs {}", g.logprob, w.logprob);
                    assert_eq!(
                        g.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                        w.top.iter().map(|t| t.0).collect::<Vec<_>>()
                    );
                }
            }
        }
        // Both host paths were taken: candidates that settle the draw, and the fallback.
        assert!(from_candidates > 0 && fallbacks > 0, "{from_candidates} settled, {fallbacks} fell back");
    }
}
