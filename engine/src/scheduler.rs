//! The engine core: continuous batching over the paged KV cache.
//!
//! Each [`EngineCore::step`] builds one batch under a token budget
//! (`max_batched_tokens`): first every running sequence (one token for those decoding,
//! the next chunk for those still prefilling), then waiting sequences in arrival order
//! while budget, sequence slots and free KV blocks last. Prefill is chunked, so long
//! prompts share steps with decodes.
//!
//! Rules this module keeps (Architecture Invariants):
//! - KV accounting is exact: a sequence holds blocks for exactly the tokens it has
//!   computed or is computing this step; finishing, aborting or preempting a sequence
//!   returns all of them at once.
//! - Preemption is by recomputation: when a running sequence needs a block and none is
//!   free, the most recently admitted running sequence gives all of its blocks back and
//!   goes to the front of the queue; when it comes back, its prompt and the tokens it
//!   had generated are prefilled again. Batch-invariant kernels make the recomputed KV
//!   bit-identical, so its output does not change.
//! - Per-step host work is O(batch) plus O(vocab) per sampled sequence.
//!
//! Disaggregation adds two kinds of request (see ARCHITECTURE.md, "KV transfer"):
//! - *exporting* (prefill worker): an ordinary request that ends after its first token;
//!   as each layer of each step completes, the blocks of its prompt that are final are
//!   handed to its [`KvSink`] in the backend's transfer layout. Every block is handed
//!   over exactly once, in block order per layer, before the request's blocks are freed.
//! - *reserved* (decode worker): blocks for a prompt are allocated up front
//!   ([`EngineCore::reserve`]), filled by [`EngineCore::import_kv`], and the request
//!   joins the batch at [`EngineCore::activate`] with the first token the prefill worker
//!   sampled. Until then it is in neither queue; aborting it frees its blocks.
//!
//! Prefix caching (see ARCHITECTURE.md, "Prefix caching"): every fully computed block
//! is registered under its chained hash ([`crate::prefix`]) and stays cached after its
//! sequence ends, until the allocator needs it (LRU). A sequence admitted with no
//! blocks first takes the blocks of its longest cached prefix (leaving at least one
//! token to compute, for its logits) and computes only the rest; with a host tier,
//! evicted blocks are copied to host memory and copied back on a hit. Reservations
//! take their cached prefix the same way, and only the rest is transferred. Every
//! change to the cache is recorded as a [`KvEvent`] for the router's index.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use kernels::{Backend, FedToken, KvShape, LogitEdit, SampleSpec, SampledRow, SeqSpan, StepBatch};
use serde::Serialize;

use crate::kv::{blocks_for, BlockAllocator, HostTier};
use crate::model::{Model, Sampling, Workspace};
use crate::prefix::{extend_hashes, HashSalt};
use crate::sampling::{Sampler, SamplingParams, TokenLogprob};
use crate::tokenizer::{IncrementalDecoder, Tokenizer};
use crate::EngineError;

pub type RequestId = u64;

/// One layer of a range of a sequence's blocks, in the backend's transfer layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvChunk {
    pub layer: u32,
    /// Index of the first block in the sequence (logical, not physical).
    pub first_block: u32,
    pub n_blocks: u32,
    pub data: Vec<u8>,
}

/// Receives an exporting request's KV on the engine thread; must not block.
pub type KvSink = Box<dyn FnMut(KvChunk) + Send>;

/// Which tier of the prefix cache a block is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheTier {
    Device,
    Host,
}

/// A change to an engine's prefix cache, in the order it happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    Stored { tier: CacheTier, hashes: Vec<u64> },
    Removed { tier: CacheTier, hashes: Vec<u64> },
}

/// What [`EngineCore::reserve`] set aside: `n_blocks` for the prompt, of which the
/// first `cached_blocks` came from the prefix cache (only the rest must be imported).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reservation {
    pub n_blocks: usize,
    pub cached_blocks: usize,
}

struct Export {
    sink: KvSink,
    /// Blocks already handed over (for every layer).
    sent_blocks: usize,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end token, a stop token id or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// Cancelled by the client.
    Abort,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// `step`: a step's outputs come back in the order of the step's rows (oldest request
/// first) instead of by delivery priority (see [`EngineCore::step`]); for A/B runs.
pub const OUTPUT_ORDER_ENV: &str = "DISAGG_OUTPUT_ORDER";

/// What one step produced for one request.
#[derive(Clone, Debug, Serialize)]
pub struct RequestOutput {
    pub id: RequestId,
    pub new_token_ids: Vec<u32>,
    pub new_text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Option<FinishReason>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache instead of being computed.
    pub cached_tokens: usize,
    /// On the first output: when the request was first scheduled (its queue time ended).
    #[serde(skip)]
    pub scheduled_at: Option<Instant>,
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Sequences in one batch at most.
    pub max_num_seqs: usize,
    /// Tokens in one step at most (decode tokens plus prefill chunks).
    pub max_batched_tokens: usize,
    /// Context length limit (prompt + output); at most the model's.
    pub max_model_len: usize,
    pub block_size: usize,
    pub n_blocks: usize,
    /// Keep computed blocks for reuse by later requests with the same prefix.
    pub prefix_caching: bool,
    /// Blocks of the host-memory tier of the prefix cache (0: none).
    pub host_cache_blocks: usize,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct EngineStats {
    pub kv_blocks_total: usize,
    pub kv_blocks_used: usize,
    pub running: usize,
    pub waiting: usize,
    pub steps: u64,
    /// Steps in which every scheduled sequence ran exactly one token (decode only: the
    /// steps a CUDA backend can replay from a graph); the rest mixed prefill in.
    pub decode_only_steps: u64,
    /// Steps launched before the tokens of the step before them were read (async
    /// scheduling; see [`EngineCore::step`]).
    pub async_steps: u64,
    /// Seconds spent in the steps that ran, from scheduling to their outputs (host work
    /// and the forward pass); the rest of an engine's wall time it waited for work or
    /// handled commands and delivered outputs.
    pub step_s: f64,
    pub preemptions: u64,
    /// Tokens run through the model (prefill and decode), recomputation included.
    pub forward_tokens: u64,
    /// Blocks registered in the prefix cache (held or not), and in its host tier.
    pub kv_blocks_cached: usize,
    pub host_blocks_cached: usize,
    /// Prompt tokens looked up in the prefix cache, and those found (vLLM's
    /// prefix_cache_queries / prefix_cache_hits).
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// Decode-only steps replayed from a CUDA graph, shapes captured (their step ran from
    /// the new graph), captured shapes dropped to make room for others, and shapes held
    /// now ([`kernels::GraphCounts`]; zeros on the CPU). The other decode-only steps ran
    /// op by op.
    pub graph_replays: u64,
    pub graph_captures: u64,
    pub graphs_dropped: u64,
    pub graphs_held: usize,
}

struct Sequence {
    id: RequestId,
    prompt_len: usize,
    /// Prompt followed by the generated tokens.
    tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache.
    n_computed: usize,
    block_table: Vec<u32>,
    params: SamplingParams,
    max_tokens: usize,
    sampler: Sampler,
    detok: IncrementalDecoder,
    /// Generated text so far, and how much of it was sent.
    text: String,
    sent: usize,
    /// Longest stop string minus one: text held back in case a stop string is forming.
    holdback: usize,
    /// When the sequence was first scheduled.
    scheduled_at: Option<Instant>,
    /// Reserved for KV arriving from elsewhere; not yet in a queue.
    awaiting_kv: bool,
    /// Blocks of a reservation that came from the prefix cache (not imported).
    import_from: usize,
    salt: HashSalt,
    /// Hashes of the full blocks of `tokens` computed so far (may run ahead of
    /// `n_computed`), and how many of its blocks are registered in the cache.
    hashes: Vec<u64>,
    n_registered: usize,
    /// Prompt tokens found in the cache when first admitted.
    cached_tokens: Option<usize>,
    /// Tokens sampled by deferred steps and not read yet (async scheduling; they follow
    /// `tokens`), and the row of the latest one in its step's sample.
    pending: usize,
    feed_row: u32,
}

impl Sequence {
    fn n_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
    /// Its length with the tokens not read yet.
    fn len_all(&self) -> usize {
        self.tokens.len() + self.pending
    }
    /// Whether its tokens not read yet reach `max_tokens` (it ends once they are read).
    fn ends_when_read(&self) -> bool {
        self.pending > 0 && self.len_all() - self.prompt_len >= self.max_tokens
    }
}

pub struct EngineCore<B: Backend> {
    pub model: Model<B>,
    backend: B,
    kv: B::Kv,
    ws: Workspace<B>,
    pub tokenizer: Arc<Tokenizer>,
    pub cfg: EngineConfig,
    alloc: BlockAllocator,
    seqs: HashMap<RequestId, Sequence>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    logits: Vec<f32>,
    stats: EngineStats,
    exports: HashMap<RequestId, Export>,
    model_identity: String,
    host: Option<HostTier>,
    events: Vec<KvEvent>,
    record_events: bool,
    // Per-step scratch, kept to avoid allocation.
    step_tokens: Vec<u32>,
    step_rows: Vec<u32>,
    block_buf: Vec<u8>,
    /// Device sampling: each sampled row's edits and draw, and what the backend returned.
    dev_specs: Vec<(Vec<LogitEdit>, f64)>,
    sampled_rows: Vec<SampledRow>,
    /// Outputs by delivery priority (unless [`OUTPUT_ORDER_ENV`] is `step`).
    priority_order: bool,
    /// The step whose sample was deferred and not read yet (async scheduling): its
    /// sampled sequences in row order; and scratch for the ids read.
    in_flight: Option<Vec<RequestId>>,
    collected: Vec<u32>,
    fed: Vec<FedToken>,
}

impl<B: Backend> EngineCore<B> {
    /// The engine over a model, its workspace (from [`Model::workspace`] for
    /// `cfg.max_batched_tokens` tokens and `cfg.max_num_seqs` logit rows) and its KV cache.
    pub fn new(
        backend: B,
        model: Model<B>,
        tokenizer: Arc<Tokenizer>,
        cfg: EngineConfig,
        ws: Workspace<B>,
        kv: B::Kv,
    ) -> Self {
        assert!(ws.max_tokens >= cfg.max_batched_tokens && ws.max_logits >= cfg.max_num_seqs, "workspace too small");
        let logits = vec![0f32; cfg.max_num_seqs * model.cfg.vocab];
        let shape = backend.kv_shape(&kv);
        let host = (cfg.prefix_caching && cfg.host_cache_blocks > 0)
            .then(|| HostTier::new(cfg.host_cache_blocks, shape.n_layers * shape.block_bytes_per_layer()));
        EngineCore {
            alloc: BlockAllocator::new(cfg.n_blocks, cfg.prefix_caching),
            model_identity: model.cfg.identity(),
            host,
            events: Vec::new(),
            record_events: false,
            block_buf: Vec::new(),
            dev_specs: Vec::new(),
            sampled_rows: Vec::new(),
            stats: EngineStats { kv_blocks_total: cfg.n_blocks, ..Default::default() },
            model,
            backend,
            kv,
            ws,
            tokenizer,
            cfg,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            logits,
            exports: HashMap::new(),
            step_tokens: Vec::new(),
            step_rows: Vec::new(),
            priority_order: !std::env::var(OUTPUT_ORDER_ENV).is_ok_and(|v| v == "step"),
            in_flight: None,
            collected: Vec::new(),
            fed: Vec::new(),
        }
    }

    /// Outputs in the step's row order (false) or by delivery priority (true, the
    /// default; see [`EngineCore::step`]).
    pub fn set_priority_order(&mut self, on: bool) {
        self.priority_order = on;
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend, for switching its modes between steps (A/B checks).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    pub fn stats(&self) -> EngineStats {
        let g = self.backend.graph_counts();
        EngineStats {
            graph_replays: g.replayed,
            graph_captures: g.captured,
            graphs_dropped: g.dropped,
            graphs_held: g.held,
            kv_blocks_used: self.alloc.n_used(),
            kv_blocks_cached: self.alloc.n_cached(),
            host_blocks_cached: self.host.as_ref().map_or(0, |h| h.len()),
            running: self.running.len(),
            waiting: self.waiting.len(),
            ..self.stats.clone()
        }
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || self.in_flight.is_some()
    }

    /// The numbers requests are validated against.
    pub fn limits(&self) -> Limits {
        Limits {
            vocab: self.model.cfg.vocab,
            max_model_len: self.cfg.max_model_len,
            n_blocks: self.cfg.n_blocks,
            block_size: self.cfg.block_size,
        }
    }

    /// Checks a request against the model and the cache; the error names what to change.
    pub fn validate(&self, prompt: &[u32], params: &SamplingParams) -> Result<usize, EngineError> {
        self.limits().validate(prompt, params)
    }

    /// Queues a request. Nothing is allocated until it is scheduled.
    pub fn add_request(&mut self, id: RequestId, prompt: Vec<u32>, params: SamplingParams) -> Result<(), EngineError> {
        let seq = self.new_sequence(id, prompt, params)?;
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
        Ok(())
    }

    /// Queues a prefill-only request: it ends after its first token, and its prompt's
    /// KV goes to `sink` layer by layer as it is computed.
    /// The first `skip_blocks` blocks are not sent (the receiver has them cached).
    pub fn add_exporting(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        mut params: SamplingParams,
        sink: KvSink,
        skip_blocks: usize,
    ) -> Result<(), EngineError> {
        let n_blocks = blocks_for(prompt.len(), self.cfg.block_size);
        if skip_blocks >= n_blocks.max(1) {
            return Err(EngineError::InvalidRequest(format!(
                "skip_blocks is {skip_blocks} but the prompt has {n_blocks} blocks; at least its last block must be sent"
            )));
        }
        params.max_tokens = Some(1);
        self.add_request(id, prompt, params)?;
        self.exports.insert(id, Export { sink, sent_blocks: skip_blocks });
        Ok(())
    }

    /// Allocates the blocks for `prompt`, whose KV will arrive through
    /// [`EngineCore::import_kv`]. Fails with [`EngineError::Busy`] when too few blocks
    /// are free now.
    /// The blocks of its longest cached prefix are taken from the cache; only the rest
    /// need importing (see [`Reservation`]).
    pub fn reserve(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<Reservation, EngineError> {
        let seq = self.new_sequence(id, prompt, params)?;
        let total = blocks_for(seq.prompt_len, self.cfg.block_size);
        self.seqs.insert(id, seq);
        let cached = self.attach_prefix(id);
        let need = total - cached;
        // Keep a block of headroom per running sequence, so reservations (which cannot
        // be preempted while their KV arrives) do not starve running decodes.
        let headroom = self.running.len();
        let seq = self.seqs.get_mut(&id).expect("inserted above");
        if self.alloc.n_free() < need + headroom || !self.alloc.allocate(need, &mut seq.block_table) {
            let free = self.alloc.n_free();
            let mut seq = self.seqs.remove(&id).expect("inserted above");
            self.alloc.release(&mut seq.block_table);
            self.sync_cache();
            return Err(EngineError::Busy(format!(
                "this worker has {free} free KV blocks and the prompt needs {need} (plus {headroom} kept for running requests)"
            )));
        }
        seq.awaiting_kv = true;
        seq.import_from = cached;
        self.sync_cache();
        Ok(Reservation { n_blocks: total, cached_blocks: cached })
    }

    /// What a reserved request holds, while it awaits its KV.
    pub fn reservation(&self, id: RequestId) -> Option<Reservation> {
        self.seqs
            .get(&id)
            .filter(|s| s.awaiting_kv)
            .map(|s| Reservation { n_blocks: s.block_table.len(), cached_blocks: s.import_from })
    }

    /// Writes one chunk of transferred KV into a reserved request's blocks.
    pub fn import_kv(&mut self, id: RequestId, chunk: &KvChunk) -> Result<(), EngineError> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        let Some(seq) = self.seqs.get(&id).filter(|s| s.awaiting_kv) else {
            return bad(format!("request {id} has no KV reservation"));
        };
        let (l, first, n) = (chunk.layer as usize, chunk.first_block as usize, chunk.n_blocks as usize);
        if l >= self.model.cfg.n_layers || first < seq.import_from || first + n > seq.block_table.len() {
            return bad(format!(
                "KV chunk (layer {l}, blocks {first}..{}) is outside the reservation ({} layers, blocks {}..{})",
                first + n,
                self.model.cfg.n_layers,
                seq.import_from,
                seq.block_table.len()
            ));
        }
        let block_bytes = self.kv_shape().block_bytes_per_layer();
        if chunk.data.len() != n * block_bytes {
            return bad(format!("KV chunk has {} bytes; {n} blocks take {}", chunk.data.len(), n * block_bytes));
        }
        self.backend.kv_import(&mut self.kv, l, &seq.block_table[first..first + n], &chunk.data);
        Ok(())
    }

    /// The KV cache's shape (workers exchanging KV must agree on it, bar `n_blocks`).
    pub fn kv_shape(&self) -> KvShape {
        self.backend.kv_shape(&self.kv)
    }

    /// Starts a reserved request whose KV has all arrived: `token` is its first output
    /// token (sampled by the prefill worker). Returns that token's output; the request
    /// then decodes in the batch like any other (or has finished already).
    /// `cached_tokens` is what the prefill worker found in its prefix cache (reported
    /// in usage).
    pub fn activate(
        &mut self,
        id: RequestId,
        token: u32,
        logprob: Option<TokenLogprob>,
        cached_tokens: usize,
    ) -> Result<RequestOutput, EngineError> {
        let vocab = self.model.cfg.vocab;
        let Some(seq) = self.seqs.get_mut(&id).filter(|s| s.awaiting_kv) else {
            return Err(EngineError::InvalidRequest(format!("request {id} has no KV reservation")));
        };
        if token as usize >= vocab {
            return Err(EngineError::InvalidRequest(format!("first token {token} is out of the vocabulary")));
        }
        seq.awaiting_kv = false;
        seq.n_computed = seq.prompt_len;
        seq.cached_tokens = Some(cached_tokens.min(seq.prompt_len));
        Self::register_computed(&mut self.alloc, seq, self.cfg.block_size);
        seq.scheduled_at = Some(Instant::now());
        seq.sampler.accept(&seq.params, token);
        seq.tokens.push(token);
        let out = Self::emit(seq, token, logprob, &self.tokenizer);
        if out.finish.is_some() {
            self.finish(id);
        } else {
            // It holds its blocks already; admission gives it a batch slot.
            self.waiting.push_front(id);
        }
        self.sync_cache();
        Ok(out)
    }

    fn new_sequence(&self, id: RequestId, prompt: Vec<u32>, params: SamplingParams) -> Result<Sequence, EngineError> {
        if self.seqs.contains_key(&id) {
            return Err(EngineError::InvalidRequest(format!("request id {id} is already in use")));
        }
        let max_tokens = self.validate(&prompt, &params)?;
        let holdback = params.stop.iter().map(|s| s.len()).max().unwrap_or(1).saturating_sub(1);
        let salt = HashSalt::new(&self.model_identity, params.cache_salt.as_deref());
        let seq = Sequence {
            import_from: 0,
            salt,
            hashes: Vec::new(),
            n_registered: 0,
            cached_tokens: None,
            id,
            prompt_len: prompt.len(),
            sampler: Sampler::new(&params, &prompt),
            detok: IncrementalDecoder::new(params.skip_special_tokens),
            tokens: prompt,
            n_computed: 0,
            block_table: Vec::new(),
            max_tokens,
            params,
            text: String::new(),
            sent: 0,
            holdback,
            scheduled_at: None,
            awaiting_kv: false,
            pending: 0,
            feed_row: 0,
        };
        Ok(seq)
    }

    /// Cancels a request and frees its blocks now. Returns false if it was unknown.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let Some(mut seq) = self.seqs.remove(&id) else {
            return false;
        };
        self.alloc.release(&mut seq.block_table);
        self.running.retain(|r| *r != id);
        self.waiting.retain(|r| *r != id);
        self.exports.remove(&id);
        true
    }

    fn preempt(&mut self, id: RequestId) {
        let seq = self.seqs.get_mut(&id).expect("running sequence exists");
        self.alloc.release(&mut seq.block_table);
        seq.n_computed = 0;
        seq.n_registered = 0;
        self.running.retain(|r| *r != id);
        self.waiting.push_front(id);
        self.stats.preemptions += 1;
    }

    /// The logits at the last position of `prompt`, computed on its own (in chunks of
    /// the token budget) with KV blocks that are returned before this returns. For
    /// tests and diagnostics; call it when no requests are in flight.
    pub fn score(&mut self, prompt: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.validate(prompt, &SamplingParams { max_tokens: Some(1), ..SamplingParams::greedy() })?;
        let mut table = Vec::new();
        if !self.alloc.allocate(blocks_for(prompt.len(), self.cfg.block_size), &mut table) {
            return Err(EngineError::InvalidRequest("not enough free KV blocks to score this prompt now".into()));
        }
        self.sync_cache();
        let mut pos = 0;
        while pos < prompt.len() {
            let n = (prompt.len() - pos).min(self.cfg.max_batched_tokens);
            let spans = [SeqSpan { rows: 0..n, pos0: pos, block_table: &table }];
            let batch = StepBatch { n_tokens: n, seqs: &spans, block_size: self.cfg.block_size, fed: &[] };
            let last = pos + n == prompt.len();
            let rows = [n as u32 - 1];
            self.model.forward(
                &mut self.backend,
                &mut self.ws,
                &mut self.kv,
                &prompt[pos..pos + n],
                &batch,
                if last { &rows[..] } else { &[] },
                &mut self.logits,
                Sampling::Host,
                None,
            );
            pos += n;
        }
        self.alloc.release(&mut table);
        Ok(self.logits[..self.model.cfg.vocab].to_vec())
    }

    /// Chooses this step's work: `(sequence, tokens to compute)`.
    fn schedule(&mut self) -> Vec<(RequestId, usize)> {
        let bs = self.cfg.block_size;
        let mut budget = self.cfg.max_batched_tokens;
        let mut plan = Vec::new();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let seq = &self.seqs[&id];
            if seq.ends_when_read() {
                // Its last token is on its way: nothing more to compute.
                i += 1;
                continue;
            }
            let n = (seq.len_all() - seq.n_computed).min(budget);
            let mut need = blocks_for(seq.n_computed + n, bs).saturating_sub(seq.block_table.len());
            let mut self_preempted = false;
            // Blocks held by activated requests not yet admitted go first.
            while need > self.alloc.n_free() && self.release_a_waiting_holder(None) {}
            while need > self.alloc.n_free() {
                let victim = *self.running.last().expect("non-empty");
                self.preempt(victim);
                preempted = true;
                if victim == id {
                    self_preempted = true;
                    break;
                }
                let seq = &self.seqs[&id];
                need = blocks_for(seq.n_computed + n, bs).saturating_sub(seq.block_table.len());
            }
            if self_preempted {
                break;
            }
            let seq = self.seqs.get_mut(&id).expect("exists");
            assert!(self.alloc.allocate(need, &mut seq.block_table));
            plan.push((id, n));
            budget -= n;
            i += 1;
        }
        // Requests that already hold their blocks (activated after a KV import) are
        // admitted before anything else, so they never wait behind a request that needs
        // the very blocks they hold. One that needs a block more may take it from
        // another such request (which then recomputes).
        let mut j = 0;
        while !preempted && budget > 0 && self.running.len() < self.cfg.max_num_seqs && j < self.waiting.len() {
            let id = self.waiting[j];
            let seq = &self.seqs[&id];
            if seq.block_table.is_empty() {
                j += 1;
                continue;
            }
            let n = (seq.len_all() - seq.n_computed).min(budget);
            let need = blocks_for(seq.n_computed + n, bs) - seq.block_table.len();
            while need > self.alloc.n_free() && self.release_a_waiting_holder(Some(id)) {}
            let seq = self.seqs.get_mut(&id).expect("waiting sequence exists");
            if !self.alloc.allocate(need, &mut seq.block_table) {
                j += 1;
                continue;
            }
            seq.scheduled_at.get_or_insert_with(Instant::now);
            self.waiting.remove(j);
            self.running.push(id);
            plan.push((id, n));
            budget -= n;
        }
        // Admit new work only when nothing had to be preempted this step.
        while !preempted && budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            // A sequence with no blocks starts from its longest cached prefix.
            let attached = self.seqs[&id].block_table.is_empty();
            if attached {
                self.attach_prefix(id);
            }
            let seq = self.seqs.get_mut(&id).expect("waiting sequence exists");
            let n = (seq.len_all() - seq.n_computed).min(budget);
            let need = blocks_for(seq.n_computed + n, bs) - seq.block_table.len();
            if !self.alloc.allocate(need, &mut seq.block_table) {
                if attached {
                    // Give the prefix back (it stays cached) and wait.
                    self.alloc.release(&mut seq.block_table);
                    seq.n_computed = 0;
                    seq.n_registered = 0;
                }
                break;
            }
            seq.scheduled_at.get_or_insert_with(Instant::now);
            self.waiting.pop_front();
            self.running.push(id);
            plan.push((id, n));
            budget -= n;
        }
        // Blocks evicted to make room are offloaded before anything writes into them.
        self.sync_cache();
        plan
    }

    /// Gives sequence `id`, which holds no blocks, the blocks of its longest cached
    /// prefix: the device tier first, then the host tier (copied into free blocks),
    /// leaving at least one token to compute. Returns the number of blocks.
    fn attach_prefix(&mut self, id: RequestId) -> usize {
        if !self.alloc.caching() {
            return 0;
        }
        let bs = self.cfg.block_size;
        let seq = self.seqs.get_mut(&id).expect("sequence exists");
        debug_assert!(seq.block_table.is_empty());
        extend_hashes(seq.salt, bs, &seq.tokens, &mut seq.hashes);
        let limit = ((seq.tokens.len() - 1) / bs).min(seq.hashes.len());
        let (mut table, hashes) = (std::mem::take(&mut seq.block_table), std::mem::take(&mut seq.hashes));
        while table.len() < limit {
            let Some(b) = self.alloc.block_of(hashes[table.len()]) else { break };
            self.alloc.acquire(b, &mut table);
        }
        let bpl = self.kv_shape().block_bytes_per_layer();
        while table.len() < limit && self.alloc.n_free() > 0 {
            let h = hashes[table.len()];
            let Some(bytes) = self.host.as_mut().and_then(|t| t.get(h)) else { break };
            let mut buf = std::mem::take(&mut self.block_buf);
            buf.clear();
            buf.extend_from_slice(bytes);
            assert!(self.alloc.allocate(1, &mut table));
            // The block may have held another cached block: offload that first.
            self.sync_cache();
            let b = *table.last().expect("allocated");
            for l in 0..self.model.cfg.n_layers {
                self.backend.kv_import(&mut self.kv, l, &[b], &buf[l * bpl..(l + 1) * bpl]);
            }
            self.block_buf = buf;
            self.alloc.register(b, h);
        }
        let n = table.len();
        let seq = self.seqs.get_mut(&id).expect("sequence exists");
        (seq.block_table, seq.hashes) = (table, hashes);
        seq.n_computed = n * bs;
        seq.n_registered = n;
        if seq.cached_tokens.is_none() {
            seq.cached_tokens = Some(n * bs);
            self.stats.prefix_cache_queries += seq.prompt_len as u64;
            self.stats.prefix_cache_hits += (n * bs) as u64;
        }
        n
    }

    /// Registers the blocks of `seq` that are fully computed and not registered yet.
    /// (Tokens not read yet are not: their blocks are registered once they are.)
    fn register_computed(alloc: &mut BlockAllocator, seq: &mut Sequence, bs: usize) {
        let done = seq.n_computed.min(seq.tokens.len());
        let full = done / bs;
        if !alloc.caching() || full <= seq.n_registered {
            return;
        }
        extend_hashes(seq.salt, bs, &seq.tokens[..done], &mut seq.hashes);
        for i in seq.n_registered..full {
            alloc.register(seq.block_table[i], seq.hashes[i]);
        }
        seq.n_registered = full;
    }

    /// Turns the allocator's changes into [`KvEvent`]s, copying evicted blocks to the
    /// host tier (when there is one) before their device blocks are reused.
    fn sync_cache(&mut self) {
        let (stored, evicted) = self.alloc.take_changes();
        if self.record_events && !stored.is_empty() {
            self.events.push(KvEvent::Stored { tier: CacheTier::Device, hashes: stored });
        }
        if evicted.is_empty() {
            return;
        }
        if self.record_events {
            self.events
                .push(KvEvent::Removed { tier: CacheTier::Device, hashes: evicted.iter().map(|e| e.0).collect() });
        }
        let Some(host) = self.host.as_mut() else { return };
        let (mut put, mut dropped) = (Vec::new(), Vec::new());
        for (h, b) in evicted {
            if host.get(h).is_some() {
                continue;
            }
            self.block_buf.clear();
            for l in 0..self.model.cfg.n_layers {
                self.backend.kv_export(&self.kv, l, &[b], &mut self.block_buf);
            }
            dropped.extend(host.put(h, &self.block_buf));
            put.push(h);
        }
        if self.record_events {
            // In this order: a hash stored and dropped again in this batch ends dropped.
            if !put.is_empty() {
                self.events.push(KvEvent::Stored { tier: CacheTier::Host, hashes: put });
            }
            if !dropped.is_empty() {
                self.events.push(KvEvent::Removed { tier: CacheTier::Host, hashes: dropped });
            }
        }
    }

    /// Starts (or stops) recording [`KvEvent`]s; see [`EngineCore::take_kv_events`].
    pub fn record_kv_events(&mut self, on: bool) {
        self.record_events = on;
    }

    /// The events recorded since the last call.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// The whole cache as events (for a subscriber that starts now).
    pub fn kv_snapshot(&self) -> Vec<KvEvent> {
        let mut v = vec![KvEvent::Stored { tier: CacheTier::Device, hashes: self.alloc.cached_hashes().collect() }];
        if let Some(h) = &self.host {
            v.push(KvEvent::Stored { tier: CacheTier::Host, hashes: h.hashes().collect() });
        }
        v
    }

    /// The KV of the block cached under `hash` on the device tier, every layer in the
    /// transfer layout; `None` when it is not there. For tests and diagnostics.
    pub fn cached_block_kv(&mut self, hash: u64) -> Option<Vec<u8>> {
        let b = self.alloc.block_of(hash)?;
        let mut out = Vec::new();
        for l in 0..self.model.cfg.n_layers {
            self.backend.kv_export(&self.kv, l, &[b], &mut out);
        }
        Some(out)
    }

    /// Whether the host tier holds `hash`.
    pub fn host_has(&self, hash: u64) -> bool {
        self.host.as_ref().is_some_and(|h| h.contains(hash))
    }

    /// The salt of requests with `cache_salt` (see [`crate::prefix`]).
    pub fn hash_salt(&self, cache_salt: Option<&str>) -> HashSalt {
        HashSalt::new(&self.model_identity, cache_salt)
    }

    /// Frees the blocks of the last waiting request that holds some (other than
    /// `keep`); it will be prefilled again when admitted. Returns false if none holds any.
    fn release_a_waiting_holder(&mut self, keep: Option<RequestId>) -> bool {
        let Some(&victim) =
            self.waiting.iter().rev().find(|id| Some(**id) != keep && !self.seqs[id].block_table.is_empty())
        else {
            return false;
        };
        let seq = self.seqs.get_mut(&victim).expect("waiting sequence exists");
        self.alloc.release(&mut seq.block_table);
        seq.n_computed = 0;
        seq.n_registered = 0;
        self.stats.preemptions += 1;
        true
    }

    /// Runs one step of continuous batching. Returns what each request produced, by
    /// delivery priority: outputs carrying a request's first text, then requests'
    /// last outputs, then the rest, each group in the step's row order (oldest request
    /// first); with [`OUTPUT_ORDER_ENV`]`=step`, all in row order.
    /// Runs one step and returns the outputs it made available: each sampled sequence's
    /// next token and text, by delivery priority (see below).
    ///
    /// Async scheduling (where the backend [`Backend::defers_sampling`]): a step whose
    /// sampled rows are all plain greedy ([`Sampler::defers`]) leaves its tokens on the
    /// device, and its outputs come from the next call. That call launches the next step
    /// first when it is decode only (every sequence one token, each sampled plainly again),
    /// feeding the tokens not read yet from the device ([`StepBatch::fed`]), and reads
    /// them while the device computes: the host's work (outputs, scheduling, metadata)
    /// overlaps the device's instead of leaving it idle. A sequence that the tokens read
    /// then end has computed one token too many, which is dropped with its blocks; any
    /// other step first reads them, as without async scheduling.
    pub fn step(&mut self) -> Vec<RequestOutput> {
        let t0 = std::time::Instant::now();
        let mut plan = self.schedule();
        let defer_ok = self.backend.defers_sampling();
        let mut prev = self.in_flight.take();
        let overlap = prev.is_some()
            && defer_ok
            && !plan.is_empty()
            && plan.iter().all(|&(id, n)| {
                let s = &self.seqs[&id];
                n == 1 && s.n_computed + 1 == s.len_all() && self.defers(s)
            });
        let mut outputs: Vec<(u8, RequestOutput)> = Vec::new();
        let mut read_first = 0;
        if !overlap {
            if let Some(rows) = prev.take() {
                self.collect(&rows, &mut outputs);
                read_first = outputs.len();
                // Those whose tokens just read ended them.
                plan.retain(|(id, _)| self.seqs.contains_key(id));
            }
        }
        if !plan.is_empty() {
            self.stats.async_steps += u64::from(overlap);
            self.launch(&plan, defer_ok, &mut outputs);
        }
        if let Some(rows) = prev {
            self.collect(&rows, &mut outputs);
        }
        // Delivery priority: whoever sends the outputs on sends them in this order, and a
        // step's last sends wait for all the others (a cross-thread wake each), so the
        // outputs that end a client's wait for its first text or its answer go first.
        if self.priority_order {
            by_priority(&mut outputs, read_first);
        }
        self.sync_cache();
        self.stats.step_s += t0.elapsed().as_secs_f64();
        outputs.into_iter().map(|o| o.1).collect()
    }

    /// Whether `seq`'s next sample may be deferred (it is its next token's whole sample).
    fn defers(&self, seq: &Sequence) -> bool {
        seq.sampler.defers(&seq.params, seq.len_all() - seq.prompt_len, &self.tokenizer.eos_ids)
    }

    /// Runs the step of `plan`. Its tokens are left on the device when `defer_ok` and
    /// every sampled row [`Self::defers`] (then `in_flight` holds the rows); otherwise
    /// they are read and their outputs pushed to `outputs`.
    fn launch(&mut self, plan: &[(RequestId, usize)], defer_ok: bool, outputs: &mut Vec<(u8, RequestOutput)>) {
        self.step_tokens.clear();
        self.step_rows.clear();
        self.fed.clear();
        let mut sampled = Vec::new();
        for &(id, n) in plan {
            let seq = &self.seqs[&id];
            let start = self.step_tokens.len();
            let end = seq.n_computed + n;
            let known = end.min(seq.tokens.len());
            self.step_tokens.extend_from_slice(&seq.tokens[seq.n_computed..known]);
            if end > known {
                // The token the in-flight step sampled for it: taken on the device.
                assert!(end == known + 1 && seq.pending == 1, "one token not read yet, the last of the step");
                self.fed.push(FedToken { row: self.step_tokens.len() as u32, from: seq.feed_row });
                self.step_tokens.push(0);
            }
            if end == seq.len_all() {
                self.step_rows.push((start + n - 1) as u32);
                sampled.push(id);
            }
        }
        let deferred = defer_ok && !sampled.is_empty() && sampled.iter().all(|id| self.defers(&self.seqs[id]));
        // Sampling where the logits are, when the backend does it: each sampled row's
        // edits and draw (taken from its stream now), in the order of the rows.
        let on_device = !deferred && self.backend.samples_on_device();
        self.dev_specs.clear();
        if on_device {
            for id in &sampled {
                let seq = self.seqs.get_mut(id).expect("exists");
                let n_gen = seq.len_all() - seq.prompt_len;
                self.dev_specs.push(seq.sampler.device_spec(&seq.params, n_gen, &self.tokenizer.eos_ids));
            }
        }
        let mut spans = Vec::with_capacity(plan.len());
        let mut start = 0;
        for &(id, n) in plan {
            let seq = &self.seqs[&id];
            spans.push(SeqSpan { rows: start..start + n, pos0: seq.n_computed, block_table: &seq.block_table[..] });
            start += n;
        }
        let batch = StepBatch {
            n_tokens: self.step_tokens.len(),
            seqs: &spans,
            block_size: self.cfg.block_size,
            fed: &self.fed,
        };
        let specs: Vec<SampleSpec> = sampled
            .iter()
            .zip(&self.dev_specs)
            .map(|(id, (edits, u))| self.seqs[id].params.sample_spec(edits, *u))
            .collect();
        // Exporting sequences: (export, blocks final after this step, their physical ids).
        let bs = self.cfg.block_size;
        let mut exporting: Vec<(&mut Export, usize, &[u32])> = Vec::new();
        if !self.exports.is_empty() {
            for (id, ex) in self.exports.iter_mut() {
                let Some(&(_, n)) = plan.iter().find(|p| p.0 == *id) else { continue };
                let seq = &self.seqs[id];
                let done = seq.n_computed + n;
                let upto = if done >= seq.prompt_len { blocks_for(seq.prompt_len, bs) } else { done / bs };
                if upto > ex.sent_blocks {
                    exporting.push((ex, upto, &seq.block_table[..upto]));
                }
            }
        }
        let hooked = !exporting.is_empty();
        let mut export_layer = |be: &mut B, kv: &B::Kv, layer: usize| {
            for (ex, upto, table) in exporting.iter_mut() {
                let mut data = Vec::new();
                be.kv_export(kv, layer, &table[ex.sent_blocks..], &mut data);
                let chunk = KvChunk {
                    layer: layer as u32,
                    first_block: ex.sent_blocks as u32,
                    n_blocks: (*upto - ex.sent_blocks) as u32,
                    data,
                };
                (ex.sink)(chunk);
            }
        };
        let sampling = if deferred {
            Sampling::Deferred
        } else if on_device {
            Sampling::Device(&specs[..], &mut self.sampled_rows)
        } else {
            Sampling::Host
        };
        let sampled_on_device = self.model.forward(
            &mut self.backend,
            &mut self.ws,
            &mut self.kv,
            &self.step_tokens,
            &batch,
            &self.step_rows,
            &mut self.logits,
            sampling,
            if hooked { Some(&mut export_layer) } else { None },
        );
        for (ex, upto, _) in exporting {
            ex.sent_blocks = upto;
        }
        drop(specs);
        drop(spans);
        assert!(
            sampled.is_empty() || sampled_on_device == (on_device || deferred),
            "a backend that samples on the device sampled nothing"
        );
        self.stats.steps += 1;
        self.stats.decode_only_steps += (self.step_tokens.len() == plan.len()) as u64;
        self.stats.forward_tokens += self.step_tokens.len() as u64;
        for &(id, n) in plan {
            let seq = self.seqs.get_mut(&id).expect("exists");
            seq.n_computed += n;
            Self::register_computed(&mut self.alloc, seq, bs);
        }
        if deferred {
            for (row, id) in sampled.iter().enumerate() {
                let seq = self.seqs.get_mut(id).expect("exists");
                seq.pending += 1;
                seq.feed_row = row as u32;
            }
            self.in_flight = Some(sampled);
            return;
        }
        let vocab = self.model.cfg.vocab;
        let m = sampled.len();
        let mut full_logits = false;
        for (row, id) in sampled.into_iter().enumerate() {
            let seq = self.seqs.get_mut(&id).expect("exists");
            let no_text_yet = seq.sent == 0;
            let out = if on_device {
                let (edits, u) = &self.dev_specs[row];
                let res = &self.sampled_rows[row];
                let (token, lp) = match seq.sampler.finish_device(&seq.params, res, edits, *u, None) {
                    Some(done) => done,
                    None => {
                        // The candidates did not settle the draw: the row's edited logits.
                        if !full_logits {
                            self.model.logits_to_host(&mut self.backend, &self.ws, &mut self.logits[..m * vocab]);
                            full_logits = true;
                        }
                        let row_logits = &self.logits[row * vocab..(row + 1) * vocab];
                        seq.sampler.finish_device(&seq.params, res, edits, *u, Some(row_logits)).expect("a full row")
                    }
                };
                seq.tokens.push(token);
                Self::emit(seq, token, lp, &self.tokenizer)
            } else {
                Self::advance(seq, &mut self.logits[row * vocab..(row + 1) * vocab], &self.tokenizer)
            };
            self.deliver(id, no_text_yet, out, outputs);
        }
    }

    /// Reads the tokens of the deferred step whose sampled sequences are `rows` and turns
    /// them into outputs. Rows of sequences gone since (ended by the tokens of the step
    /// before, or aborted) are dropped.
    fn collect(&mut self, rows: &[RequestId], outputs: &mut Vec<(u8, RequestOutput)>) {
        let mut ids = std::mem::take(&mut self.collected);
        self.backend.collect_sampled(&mut ids);
        assert_eq!(ids.len(), rows.len(), "a deferred sample of {} rows", rows.len());
        let bs = self.cfg.block_size;
        for (&id, &token) in rows.iter().zip(&ids) {
            let Some(seq) = self.seqs.get_mut(&id).filter(|s| s.pending > 0) else { continue };
            seq.pending -= 1;
            let no_text_yet = seq.sent == 0;
            let row = SampledRow { token: Some(token), ..Default::default() };
            let (token, lp) = seq.sampler.finish_device(&seq.params, &row, &[], 0.0, None).expect("a drawn token");
            seq.tokens.push(token);
            Self::register_computed(&mut self.alloc, seq, bs);
            let out = Self::emit(seq, token, lp, &self.tokenizer);
            self.deliver(id, no_text_yet, out, outputs);
        }
        self.collected = ids;
    }

    /// Queues `out`, sequence `id`'s output, by its delivery priority: 0 a request's
    /// first text (what its time to first token waits for), 1 its last output, 2 the
    /// rest; and ends the sequence when it is the last.
    fn deliver(
        &mut self,
        id: RequestId,
        no_text_yet: bool,
        out: RequestOutput,
        outputs: &mut Vec<(u8, RequestOutput)>,
    ) {
        let prio = if no_text_yet && !out.new_text.is_empty() {
            0
        } else if out.finish.is_some() {
            1
        } else {
            2
        };
        if out.finish.is_some() {
            self.finish(id);
        }
        outputs.push((prio, out));
    }

    fn finish(&mut self, id: RequestId) {
        self.exports.remove(&id);
        if let Some(mut seq) = self.seqs.remove(&id) {
            self.alloc.release(&mut seq.block_table);
            let n = self.running.len();
            self.running.retain(|r| *r != id);
            if self.running.len() == n {
                // Preempted before its last token was read (async scheduling).
                self.waiting.retain(|r| *r != id);
            }
        }
    }

    /// Samples the next token of `seq` and turns it into output.
    fn advance(seq: &mut Sequence, logits: &mut [f32], tok: &Tokenizer) -> RequestOutput {
        let (token, logprob) = seq.sampler.sample(&seq.params, logits, seq.n_generated(), &tok.eos_ids);
        seq.tokens.push(token);
        Self::emit(seq, token, logprob, tok)
    }

    /// Turns `token`, just appended to `seq`, into output: detokenization, stop
    /// conditions, held-back text.
    fn emit(seq: &mut Sequence, token: u32, logprob: Option<TokenLogprob>, tok: &Tokenizer) -> RequestOutput {
        let n_gen = seq.n_generated();
        let is_end =
            (!seq.params.ignore_eos && tok.eos_ids.contains(&token)) || seq.params.stop_token_ids.contains(&token);
        let mut finish = None;
        if is_end {
            // End tokens are masked until `min_tokens`, so this is a real end.
            finish = Some(FinishReason::Stop);
        } else {
            seq.text.push_str(&seq.detok.push(tok, token));
            if n_gen >= seq.params.min_tokens {
                if let Some(at) = find_stop(&seq.text, &seq.params.stop, seq.sent) {
                    seq.text.truncate(at.max(seq.sent));
                    finish = Some(FinishReason::Stop);
                }
            }
        }
        if finish.is_none() && (n_gen >= seq.max_tokens) {
            finish = Some(FinishReason::Length);
        }
        if finish == Some(FinishReason::Length) {
            // Flush bytes held back for UTF-8, then look for a stop string once more.
            seq.text.push_str(&seq.detok.flush(tok));
            if let Some(at) = find_stop(&seq.text, &seq.params.stop, seq.sent) {
                seq.text.truncate(at.max(seq.sent));
                finish = Some(FinishReason::Stop);
            }
        }
        let end = if finish.is_some() {
            seq.text.len()
        } else {
            let mut e = seq.text.len().saturating_sub(seq.holdback).max(seq.sent);
            while !seq.text.is_char_boundary(e) {
                e -= 1;
            }
            e
        };
        let new_text = seq.text[seq.sent..end].to_string();
        seq.sent = end;
        RequestOutput {
            id: seq.id,
            new_token_ids: vec![token],
            new_text,
            logprobs: logprob.into_iter().collect(),
            finish,
            prompt_tokens: seq.prompt_len,
            completion_tokens: n_gen,
            cached_tokens: seq.cached_tokens.unwrap_or(0),
            scheduled_at: if n_gen == 1 { seq.scheduled_at } else { None },
        }
    }
}

/// Sorts a call's outputs by delivery priority, stably, keeping each request's outputs in
/// the order they were made. A request has one output per step, and a call reads at most
/// two steps' tokens: a deferred step's (the first `read_first` outputs, when it read
/// them before running its own step) and the step it ran; a request with an output in
/// both keeps its second behind its first (its priority raised to the first's).
fn by_priority(outputs: &mut [(u8, RequestOutput)], read_first: usize) {
    if read_first > 0 && read_first < outputs.len() {
        let first: HashMap<RequestId, u8> = outputs[..read_first].iter().map(|o| (o.1.id, o.0)).collect();
        for o in &mut outputs[read_first..] {
            if let Some(&p) = first.get(&o.1.id) {
                o.0 = o.0.max(p);
            }
        }
    }
    outputs.sort_by_key(|o| o.0);
}

/// What a request is checked against: fixed when the engine is built, so clients of an
/// engine running on another thread can validate without a round trip.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub vocab: usize,
    pub max_model_len: usize,
    pub n_blocks: usize,
    pub block_size: usize,
}

impl Limits {
    /// Validates a request; returns the resolved `max_tokens`. The error names what to
    /// change.
    pub fn validate(&self, prompt: &[u32], params: &SamplingParams) -> Result<usize, EngineError> {
        params.validate(self.vocab)?;
        let limit = self.max_model_len;
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest("the prompt is empty; send at least one token".into()));
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "prompt token id {bad} is out of range (vocabulary size {})",
                self.vocab
            )));
        }
        if prompt.len() >= limit {
            return Err(EngineError::InvalidRequest(format!(
                "the prompt has {} tokens but the context length is {limit}; shorten the prompt (at most {} tokens)",
                prompt.len(),
                limit - 1
            )));
        }
        let room = limit - prompt.len();
        let max_tokens = match params.max_tokens {
            Some(m) if m > room => {
                return Err(EngineError::InvalidRequest(format!(
                    "max_tokens is {m} but the prompt ({} tokens) leaves room for {room} in the context length of {limit}; \
                     lower max_tokens or shorten the prompt",
                    prompt.len()
                )))
            }
            Some(m) => m,
            None => room,
        };
        let need = blocks_for(prompt.len() + 1, self.block_size);
        if need > self.n_blocks {
            return Err(EngineError::InvalidRequest(format!(
                "the prompt needs {need} KV blocks but the whole cache has {}; shorten the prompt or give the server a larger KV cache",
                self.n_blocks
            )));
        }
        Ok(max_tokens)
    }
}

/// Byte offset of the first stop string in `text` that ends after `sent - max_len`
/// (earlier ones would have been found before).
fn find_stop(text: &str, stops: &[String], sent: usize) -> Option<usize> {
    let mut best: Option<usize> = None;
    for s in stops {
        let mut from = sent.saturating_sub(s.len());
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        if let Some(i) = text[from..].find(s.as_str()) {
            let at = from + i;
            best = Some(best.map_or(at, |b: usize| b.min(at)));
        }
    }
    best
}

/// Runs requests to completion on `core` and returns each one's tokens and text, in
/// the order given. For tools and tests that drive the engine synchronously.
pub fn run_to_completion<B: Backend>(
    core: &mut EngineCore<B>,
    requests: Vec<(Vec<u32>, SamplingParams)>,
    first_id: RequestId,
) -> Result<Vec<Completed>, EngineError> {
    let n = requests.len();
    let mut done: Vec<Option<Completed>> = (0..n).map(|_| None).collect();
    for (i, (prompt, params)) in requests.into_iter().enumerate() {
        core.add_request(first_id + i as u64, prompt, params)?;
    }
    let t0 = Instant::now();
    let mut acc: HashMap<RequestId, Completed> = HashMap::new();
    while core.has_work() {
        for out in core.step() {
            let c = acc.entry(out.id).or_default();
            c.output_ids.extend(&out.new_token_ids);
            c.text.push_str(&out.new_text);
            c.logprobs.extend(out.logprobs);
            c.prompt_tokens = out.prompt_tokens;
            if c.first_token_s.is_none() {
                c.first_token_s = Some(t0.elapsed().as_secs_f64());
            }
            if let Some(f) = out.finish {
                c.finish = Some(f);
                c.done_s = t0.elapsed().as_secs_f64();
                done[(out.id - first_id) as usize] = acc.remove(&out.id);
            }
        }
    }
    Ok(done.into_iter().map(|c| c.expect("every request finishes")).collect())
}

/// A finished request, as [`run_to_completion`] returns it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Completed {
    pub output_ids: Vec<u32>,
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Option<FinishReason>,
    pub prompt_tokens: usize,
    pub first_token_s: Option<f64>,
    pub done_s: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(id: RequestId, token: u32) -> RequestOutput {
        RequestOutput {
            id,
            new_token_ids: vec![token],
            new_text: String::new(),
            logprobs: Vec::new(),
            finish: None,
            prompt_tokens: 1,
            completion_tokens: 1,
            cached_tokens: 0,
            scheduled_at: None,
        }
    }

    #[test]
    fn priority_never_puts_a_requests_later_output_first() {
        // Read first: request 1's token 10 (priority 2) and request 2's (0); then the step
        // run in the same call: request 1's token 11 finishing it (1), request 3's (0).
        let mut o = vec![(2, out(1, 10)), (0, out(2, 20)), (1, out(1, 11)), (0, out(3, 30))];
        by_priority(&mut o, 2);
        let order: Vec<(RequestId, u32)> = o.iter().map(|o| (o.1.id, o.1.new_token_ids[0])).collect();
        assert_eq!(order, [(2, 20), (3, 30), (1, 10), (1, 11)]);
        // One step's outputs alone: by priority, stable.
        let mut o = vec![(2, out(1, 10)), (1, out(2, 20)), (0, out(3, 30)), (2, out(4, 40))];
        by_priority(&mut o, 0);
        let ids: Vec<RequestId> = o.iter().map(|o| o.1.id).collect();
        assert_eq!(ids, [3, 2, 1, 4]);
    }
}
