//! The interface every compute backend implements, and the types it speaks.
//!
//! API Boundary: the engine's model code is written once against [`Backend`]; a backend
//! owns its buffers (host memory for the CPU, device memory for CUDA) and its kernels.
//! Everything that crosses this boundary per step is small host metadata
//! ([`StepBatch`]): token positions, KV slots and block tables, never tensors.

use crate::cpu::ops::KvDtype;
use crate::quant::GgmlType;
use crate::KernelError;

/// One matrix as a file stores it: `rows × cols`, row-major, ggml type `ty`.
pub struct WeightPart<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: &'a [u8],
}

/// Shape of the paged KV cache: per layer, `n_blocks` blocks of `block_size` token slots,
/// each slot holding `n_kv_heads × head_dim` keys and as many values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub n_layers: usize,
    pub n_blocks: usize,
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub dtype: KvDtype,
}

impl KvShape {
    /// Bytes of one block in one layer, keys and values together.
    pub fn block_bytes_per_layer(&self) -> usize {
        2 * self.block_size * self.n_kv_heads * self.head_dim * self.dtype.bytes()
    }

    pub fn total_bytes(&self) -> usize {
        self.n_layers * self.n_blocks * self.block_bytes_per_layer()
    }
}

/// A logit change made before sampling, one per token id: `l ← rep(l + add) − sub`, with
/// rep(v) = v / rep for v > 0 and v · rep otherwise (the repetition penalty; 1: none).
/// `add` carries the logit bias, or −∞ for an end token masked by `min_tokens`; `sub`
/// the presence and frequency penalties.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogitEdit {
    pub id: u32,
    pub add: f32,
    pub rep: f32,
    pub sub: f32,
}

impl LogitEdit {
    pub fn apply(&self, v: f32) -> f32 {
        let v = v + self.add;
        let v = if self.rep != 1.0 {
            if v > 0.0 {
                v / self.rep
            } else {
                v * self.rep
            }
        } else {
            v
        };
        v - self.sub
    }
}

/// Most candidates a backend hands back for the host to finish top-k / top-p with.
pub const SAMPLE_CANDIDATES: usize = 1024;

/// How one row of logits is sampled where it is ([`Backend::sample_rows`]); the
/// semantics are `engine::sampling::Sampler`'s.
#[derive(Clone, Debug)]
pub struct SampleSpec<'a> {
    /// 0: greedy (the first largest edited logit).
    pub temperature: f32,
    /// 0: off.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    /// The draw's uniform number in [0, 1) (unused when greedy).
    pub u: f64,
    /// Distinct ids.
    pub edits: &'a [LogitEdit],
    /// `Some(n)`: the raw logits' log-sum-exp and their `n` best (n ≤ 20).
    pub logprobs: Option<usize>,
}

impl SampleSpec<'_> {
    /// Greedy, no edits, no logprobs: only the argmax matters.
    pub fn plain_greedy(&self) -> bool {
        self.temperature <= 0.0 && self.edits.is_empty() && self.logprobs.is_none()
    }
    /// Whether the backend leaves the draw to the host (top-k or top-p truncation).
    pub fn truncates(&self) -> bool {
        self.temperature > 0.0 && (self.top_k > 0 || self.top_p < 1.0)
    }
}

/// What a backend sampled for one row.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SampledRow {
    /// The token, when the backend drew it; `None`: the host finishes from `candidates`.
    pub token: Option<u32>,
    /// The raw (unedited) logit of `token`.
    pub token_raw_logit: f32,
    /// (id, edited logit) of the best tokens by scaled logit (unordered, at most
    /// [`SAMPLE_CANDIDATES`]), how many tokens have a finite edited logit, and
    /// Σ exp(l/T − max) over all of them.
    pub candidates: Vec<(u32, f32)>,
    pub n_finite: usize,
    pub z_all: f64,
    /// The raw logits' log-sum-exp and their best (id, logit), unordered (logprobs only).
    pub lse: f32,
    pub top: Vec<(u32, f32)>,
    /// Each edit's logit before it, in the order of the spec's edits.
    pub edit_orig: Vec<f32>,
}

/// The largest step an engine will run, for a device backend to size its scratch once
/// at start (so that no step allocates, and running out of memory is a load-time error).
#[derive(Clone, Copy, Debug)]
pub struct StepLimits {
    /// Tokens in one step (`--max-batched-tokens`).
    pub max_tokens: usize,
    /// Sequences in one step, and rows whose logits are taken (`--max-num-seqs`).
    pub max_seqs: usize,
    /// Block-table entries of one step, summed over its sequences.
    pub max_table_entries: usize,
    /// The widest input of any weight matrix (its column count).
    pub widest_input: usize,
    pub attn: AttnShape,
}

/// Attention geometry (grouped-query: `n_heads / n_kv_heads` query heads share a KV head).
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

impl AttnShape {
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    /// Width of one token's fused `[q | k | v]` row.
    pub fn qkv_dim(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }
}

/// Rotary embedding: the inverse frequency of each dimension pair, and the pair layout.
#[derive(Clone, Debug)]
pub struct Rope {
    /// Pairs are (2i, 2i+1) when true (GGUF llama), (i, i + d/2) when false (HF).
    pub interleaved: bool,
    /// `head_dim / 2` inverse frequencies, scaling already applied.
    pub inv_freq: Vec<f32>,
}

/// The tokens of one sequence in a step: batch rows `rows`, at consecutive positions
/// starting at `pos0`, attending to everything before them through `block_table`.
#[derive(Clone, Debug)]
pub struct SeqSpan<'a> {
    pub rows: std::ops::Range<usize>,
    pub pos0: usize,
    pub block_table: &'a [u32],
}

/// A token of a step that the step before sampled with [`Backend::sample_rows_deferred`]
/// and the host has not read yet: row `row`'s id is that step's sampled row `from`
/// (async scheduling: the next step is launched before the last one's tokens are read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FedToken {
    pub row: u32,
    pub from: u32,
}

/// What a forward step needs besides the tensors.
#[derive(Clone, Debug)]
pub struct StepBatch<'a> {
    pub n_tokens: usize,
    pub seqs: &'a [SeqSpan<'a>],
    pub block_size: usize,
    /// Rows whose token ids the backend takes from the last deferred sample (their ids in
    /// the step's `tokens` are placeholders).
    pub fed: &'a [FedToken],
}

impl StepBatch<'_> {
    /// The KV slot (block × block_size + offset) of position `pos` of sequence `s`.
    #[inline]
    pub fn slot(&self, s: usize, pos: usize) -> usize {
        self.seqs[s].block_table[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }
}

/// Counts of a backend's step graphs since it was made: steps replayed from a captured
/// graph, shapes captured (the step that captures a shape also runs from its graph),
/// captured shapes dropped to make room for others, and shapes held now. A replayable
/// step counted in neither of the first two ran op by op (a shape's first step, graphs
/// off, a failed capture, a step the backend does not replay).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphCounts {
    pub replayed: u64,
    pub captured: u64,
    pub dropped: u64,
    pub held: usize,
}

/// The first index of the largest value (NaN never wins; all −∞ gives 0): greedy
/// sampling, the same on every backend.
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &x) in v.iter().enumerate() {
        if x > best_v {
            best_v = x;
            best = i;
        }
    }
    best as u32
}

/// A compute backend. See the module docs for the boundary it keeps.
pub trait Backend {
    /// A weight matrix made of one or more parts stacked by rows (e.g. fused Q|K|V).
    type Linear: Send + Sync;
    /// A small f32 weight vector (norms).
    type Vector: Send + Sync;
    /// An activation buffer of f32-equivalent elements.
    type Act: Send;
    /// The paged KV cache of all layers.
    type Kv: Send;

    /// One line about the backend: device, threads, ISA, modes.
    fn describe(&self) -> String;
    fn linear(&self, parts: &[WeightPart]) -> Result<Self::Linear, KernelError>;
    fn vector(&self, v: &[f32]) -> Self::Vector;
    fn act(&self, len: usize) -> Result<Self::Act, KernelError>;
    fn kv_cache(&self, shape: KvShape) -> Result<Self::Kv, KernelError>;
    /// Allocates the scratch that steps up to `limits` need (a device backend: at start,
    /// before the KV cache takes the rest of the memory).
    fn reserve(&mut self, limits: &StepLimits) -> Result<(), KernelError> {
        let _ = limits;
        Ok(())
    }

    /// Takes a step's host metadata before its ops run: the token ids, the batch
    /// (positions, slots, block tables), the RoPE frequencies, the attention geometry and
    /// the rows whose logits are wanted. A device backend uploads it here, once per step,
    /// so the ops of [`Backend::run_step`]'s body read only device memory. The ops' own
    /// `ids`, `batch` and `rows` arguments are then this step's.
    fn begin_step(&mut self, tokens: &[u32], batch: &StepBatch, rope: &Rope, attn: &AttnShape, logit_rows: &[u32]) {
        let _ = (tokens, batch, rope, attn, logit_rows);
    }

    /// Runs `body`, the ops of the step prepared by [`Backend::begin_step`]. `replayable`
    /// promises that the body launches the same ops on the same buffers for every step of
    /// this batch shape (decode only, no per-layer hook): a backend may then capture it
    /// once and replay it (CUDA graphs) instead of running it.
    fn run_step(&mut self, replayable: bool, body: &mut dyn FnMut(&mut Self))
    where
        Self: Sized,
    {
        let _ = replayable;
        body(self)
    }

    /// `out[t] = table[ids[t]]` (rows of the embedding matrix).
    fn embed(&mut self, table: &Self::Linear, ids: &[u32], out: &mut Self::Act);
    fn rms_norm(&mut self, x: &Self::Act, w: &Self::Vector, eps: f32, n_tokens: usize, out: &mut Self::Act);
    /// `out[t] (+)= W · x[t]` for `n_tokens` rows; `out` rows are `W.rows` wide.
    fn matmul(&mut self, w: &Self::Linear, x: &Self::Act, n_tokens: usize, out: &mut Self::Act, accumulate: bool);
    /// Rotates q and k of each token of the fused `[q|k|v]` rows in place and writes k, v
    /// into the KV cache at the tokens' slots.
    fn rope_write_kv(
        &mut self,
        qkv: &mut Self::Act,
        layer: usize,
        batch: &StepBatch,
        rope: &Rope,
        attn: &AttnShape,
        kv: &mut Self::Kv,
    );
    /// Causal attention of each token's q over its sequence's cached keys and values.
    /// Where [`Backend::norm_qkv_rope`] left RoPE and the KV write of this layer to the
    /// attention (a fused backend's choice), the attention does them first (so `kv` is
    /// written).
    fn attention(
        &mut self,
        qkv: &Self::Act,
        layer: usize,
        batch: &StepBatch,
        attn: &AttnShape,
        kv: &mut Self::Kv,
        out: &mut Self::Act,
    );
    /// `x[t] += W_o · attention(t)`: the attention and the output projection with its
    /// residual add, which a backend may fuse (`out` is scratch it may leave unwritten).
    /// `next_norm`: the RMSNorm weight the next op applies to `x`, a hint with which a
    /// backend may leave that norm's inputs ready as it writes `x` (the result is the same
    /// to float rounding, and a backend may ignore it).
    #[allow(clippy::too_many_arguments)]
    fn attention_residual(
        &mut self,
        qkv: &Self::Act,
        layer: usize,
        batch: &StepBatch,
        attn: &AttnShape,
        kv: &mut Self::Kv,
        out: &mut Self::Act,
        w_o: &Self::Linear,
        x: &mut Self::Act,
        next_norm: Option<&Self::Vector>,
    ) {
        let _ = next_norm;
        self.attention(qkv, layer, batch, attn, kv, out);
        self.matmul(w_o, out, batch.n_tokens, x, true);
    }
    /// `out = silu(g) ⊙ u` for rows `[g | u]` of width `2 * ff`.
    fn silu_mul(&mut self, gu: &Self::Act, n_tokens: usize, ff: usize, out: &mut Self::Act);
    /// `out[t] = W · rms_norm(x[t], norm)`: the step's norm and the matmul after it, which
    /// a backend may fuse. `h` is scratch for the normalised rows; a fused backend may
    /// leave it unwritten, so callers never read it afterwards.
    #[allow(clippy::too_many_arguments)]
    fn norm_matmul(
        &mut self,
        x: &Self::Act,
        norm: &Self::Vector,
        eps: f32,
        n_tokens: usize,
        h: &mut Self::Act,
        w: &Self::Linear,
        out: &mut Self::Act,
    ) {
        self.rms_norm(x, norm, eps, n_tokens, h);
        self.matmul(w, h, n_tokens, out, false);
    }
    /// `qkv[t] = W_qkv · rms_norm(x[t], norm)`, then q and k rotated in place and k, v
    /// written into the KV cache: [`Backend::norm_matmul`] and
    /// [`Backend::rope_write_kv`], which a backend may fuse (`h` as for `norm_matmul`),
    /// or leave RoPE and the KV write to the layer's attention, which must come next.
    #[allow(clippy::too_many_arguments)]
    fn norm_qkv_rope(
        &mut self,
        x: &Self::Act,
        norm: &Self::Vector,
        eps: f32,
        h: &mut Self::Act,
        w_qkv: &Self::Linear,
        qkv: &mut Self::Act,
        layer: usize,
        batch: &StepBatch,
        rope: &Rope,
        attn: &AttnShape,
        kv: &mut Self::Kv,
    ) {
        self.norm_matmul(x, norm, eps, batch.n_tokens, h, w_qkv, qkv);
        self.rope_write_kv(qkv, layer, batch, rope, attn, kv);
    }
    /// `out[t] = silu(g) ⊙ u` where `[g | u] = W · rms_norm(x[t], norm)` (through the
    /// scratch `h` and `gu`, which a fused backend may leave unwritten; `gu` is `2 · ff`
    /// wide): the norm, the gate/up matmul and SiLU·gate, which a backend may fuse.
    #[allow(clippy::too_many_arguments)]
    fn norm_matmul_silu(
        &mut self,
        x: &Self::Act,
        norm: &Self::Vector,
        eps: f32,
        n_tokens: usize,
        h: &mut Self::Act,
        w: &Self::Linear,
        gu: &mut Self::Act,
        ff: usize,
        out: &mut Self::Act,
    ) {
        self.rms_norm(x, norm, eps, n_tokens, h);
        self.matmul(w, h, n_tokens, gu, false);
        self.silu_mul(gu, n_tokens, ff, out);
    }
    /// `x[t] += W_down · (silu(g) ⊙ u)` where `[g | u] = W_gu · rms_norm(x[t], norm)`:
    /// the whole SwiGLU block with its residual add, which a backend may fuse further
    /// than [`Backend::norm_matmul_silu`] (`h`, `gu` and `act` are scratch it may leave
    /// unwritten). `next_norm` as for [`Backend::attention_residual`].
    #[allow(clippy::too_many_arguments)]
    fn mlp_residual(
        &mut self,
        x: &mut Self::Act,
        norm: &Self::Vector,
        eps: f32,
        n_tokens: usize,
        h: &mut Self::Act,
        gate_up: &Self::Linear,
        gu: &mut Self::Act,
        ff: usize,
        act: &mut Self::Act,
        down: &Self::Linear,
        next_norm: Option<&Self::Vector>,
    ) {
        let _ = next_norm;
        self.norm_matmul_silu(x, norm, eps, n_tokens, h, gate_up, gu, ff, act);
        self.matmul(down, act, n_tokens, x, true);
    }
    /// `out[i] = x[rows[i]]`, rows of width `dim`.
    fn gather_rows(&mut self, x: &Self::Act, rows: &[u32], dim: usize, out: &mut Self::Act);
    /// Copies the first `out.len()` elements of `x` to host memory.
    fn to_host(&mut self, x: &Self::Act, out: &mut [f32]);

    /// Appends layer `layer` of the physical `blocks` to `out` in the transfer layout
    /// ([`KvShape::block_bytes_per_layer`] bytes per block: its keys, then its values,
    /// each `[kv_head][slot][head_dim]` in the cache's element type). The layout is the
    /// same for every backend, so KV moves between backends unchanged.
    /// The shape `kv` was made with.
    fn kv_shape(&self, kv: &Self::Kv) -> KvShape;
    fn kv_export(&mut self, kv: &Self::Kv, layer: usize, blocks: &[u32], out: &mut Vec<u8>);
    /// Writes `data` (the transfer layout, `blocks.len()` blocks) into layer `layer` of
    /// the physical `blocks`.
    fn kv_import(&mut self, kv: &mut Self::Kv, layer: usize, blocks: &[u32], data: &[u8]);

    /// Whether [`Backend::sample_rows`] samples on this backend (then the engine hands
    /// it every sampled row of a step instead of copying the logits to the host).
    fn samples_on_device(&self) -> bool {
        false
    }

    /// Samples row `r` of `x` (rows of `dim`, in place: the edits are applied to it) as
    /// `specs[r]` says, into `out[r]`; the engine's sampler finishes what the backend
    /// leaves to the host (see [`SampledRow`]). Returns false when the backend does not
    /// sample (the caller then copies the logits to the host).
    fn sample_rows(&mut self, x: &mut Self::Act, dim: usize, specs: &[SampleSpec], out: &mut Vec<SampledRow>) -> bool {
        let _ = (x, dim, specs, out);
        false
    }

    /// Whether [`Backend::sample_rows_deferred`] may be used: plain-greedy rows sampled
    /// where the logits are, read later, and fed to the next step without the host.
    fn defers_sampling(&self) -> bool {
        false
    }

    /// Takes the argmax of each of the first `rows` rows of `x` (rows of `dim`; plain
    /// greedy rows only) where the logits are, without waiting for them: the next step
    /// may take them as input ([`StepBatch::fed`]) and [`Backend::collect_sampled`] reads
    /// them, oldest first. Only when [`Backend::defers_sampling`].
    fn sample_rows_deferred(&mut self, x: &Self::Act, dim: usize, rows: usize) {
        let _ = (x, dim, rows);
        unreachable!("this backend does not defer sampling")
    }

    /// The token ids of the oldest deferred sample not read yet, waiting for them.
    fn collect_sampled(&mut self, out: &mut Vec<u32>) {
        let _ = out;
        unreachable!("this backend does not defer sampling")
    }

    /// How the replayable steps given to [`Backend::run_step`] have run so far (CUDA
    /// graphs); zeros for a backend that runs every step's ops.
    fn graph_counts(&self) -> GraphCounts {
        GraphCounts::default()
    }

    /// Diagnostics for benchmarks: time per op so far, `(op, seconds, calls)`, when the
    /// backend records it (CUDA with `DISAGG_CUDA_PROFILE`).
    fn op_profile(&self) -> Vec<(&'static str, f64, u64)> {
        Vec::new()
    }
    /// The device's measured copy bandwidth (read + write, GB/s), where it has one.
    fn copy_bandwidth_gbps(&self) -> Option<f64> {
        None
    }
    /// The device's measured read bandwidth (a kernel streaming a buffer, GB/s): the
    /// ceiling of a decode step, which reads weights and KV and writes little.
    fn read_bandwidth_gbps(&self) -> Option<f64> {
        None
    }
}
