//! What the router and both workers share: conversions between engine types and the
//! protobuf messages of `proto` (one dialect everywhere), the workers' `/metrics`
//! endpoint, and discovery through etcd ([`discovery`]).
#![forbid(unsafe_code)]

pub mod discovery;
pub mod telemetry;

use engine::handle::SubmitError;
use engine::sampling::{SamplingParams, TokenLogprob};
use engine::scheduler::{FinishReason, RequestOutput};
use engine::EngineError;
use kernels::KvShape;
use proto::v1 as pb;

/// Sampling parameters from the wire; unset fields take the engine's defaults.
pub fn sampling_from_proto(p: Option<pb::SamplingParams>) -> SamplingParams {
    let p = p.unwrap_or_default();
    let d = SamplingParams::default();
    SamplingParams {
        max_tokens: p.max_tokens.map(|m| m as usize),
        min_tokens: p.min_tokens as usize,
        temperature: p.temperature.unwrap_or(d.temperature),
        top_k: p.top_k.unwrap_or(d.top_k),
        top_p: p.top_p.unwrap_or(d.top_p),
        min_p: p.min_p.unwrap_or(d.min_p),
        seed: p.seed,
        repetition_penalty: p.repetition_penalty.unwrap_or(d.repetition_penalty),
        presence_penalty: p.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: p.frequency_penalty.unwrap_or(d.frequency_penalty),
        stop: p.stop,
        stop_token_ids: p.stop_token_ids,
        ignore_eos: p.ignore_eos,
        logprobs: p.logprobs.map(|n| n as usize),
        logit_bias: p.logit_bias.into_iter().collect(),
        skip_special_tokens: p.skip_special_tokens.unwrap_or(true),
        cache_salt: p.cache_salt,
    }
}

/// Sampling parameters onto the wire, every field explicit (round-trips exactly).
pub fn sampling_to_proto(p: &SamplingParams) -> pb::SamplingParams {
    pb::SamplingParams {
        max_tokens: p.max_tokens.map(|m| m as u32),
        min_tokens: p.min_tokens as u32,
        temperature: Some(p.temperature),
        top_k: Some(p.top_k),
        top_p: Some(p.top_p),
        min_p: Some(p.min_p),
        seed: p.seed,
        repetition_penalty: Some(p.repetition_penalty),
        presence_penalty: Some(p.presence_penalty),
        frequency_penalty: Some(p.frequency_penalty),
        stop: p.stop.clone(),
        stop_token_ids: p.stop_token_ids.clone(),
        ignore_eos: p.ignore_eos,
        logprobs: p.logprobs.map(|n| n as u32),
        logit_bias: p.logit_bias.iter().copied().collect(),
        skip_special_tokens: Some(p.skip_special_tokens),
        cache_salt: p.cache_salt.clone(),
    }
}

pub fn logprob_to_proto(l: TokenLogprob) -> pb::TokenLogprob {
    pb::TokenLogprob {
        token_id: l.token,
        logprob: l.logprob,
        top: l.top.into_iter().map(|(t, x)| pb::TopLogprob { token_id: t, logprob: x }).collect(),
    }
}

pub fn logprob_from_proto(l: pb::TokenLogprob) -> TokenLogprob {
    TokenLogprob {
        token: l.token_id,
        logprob: l.logprob,
        top: l.top.into_iter().map(|t| (t.token_id, t.logprob)).collect(),
    }
}

pub fn finish_to_proto(f: &Option<FinishReason>) -> i32 {
    (match f {
        None => pb::FinishReason::Unspecified,
        Some(FinishReason::Stop) => pb::FinishReason::Stop,
        Some(FinishReason::Length) => pb::FinishReason::Length,
        Some(FinishReason::Abort) => pb::FinishReason::Abort,
    }) as i32
}

pub fn finish_from_proto(f: i32) -> Option<FinishReason> {
    match pb::FinishReason::try_from(f).unwrap_or(pb::FinishReason::Unspecified) {
        pb::FinishReason::Unspecified => None,
        pb::FinishReason::Stop => Some(FinishReason::Stop),
        pb::FinishReason::Length => Some(FinishReason::Length),
        pb::FinishReason::Abort => Some(FinishReason::Abort),
    }
}

/// One engine output as a streamed response (`prompt_ids` only on the first).
pub fn output_to_proto(o: RequestOutput, prompt_ids: Vec<u32>) -> pb::GenerateResponse {
    let done = o.finish.is_some();
    pb::GenerateResponse {
        token_ids: o.new_token_ids,
        text: o.new_text,
        logprobs: o.logprobs.into_iter().map(logprob_to_proto).collect(),
        finish_reason: finish_to_proto(&o.finish),
        usage: done.then_some(pb::Usage {
            prompt_tokens: o.prompt_tokens as u32,
            completion_tokens: o.completion_tokens as u32,
            cached_tokens: o.cached_tokens as u32,
        }),
        prompt_token_ids: prompt_ids,
    }
}

/// A streamed response back into an engine output of request `id`.
pub fn output_from_proto(
    r: pb::GenerateResponse,
    id: u64,
    prompt_tokens: usize,
    completion_tokens: usize,
) -> RequestOutput {
    RequestOutput {
        id,
        new_token_ids: r.token_ids,
        new_text: r.text,
        logprobs: r.logprobs.into_iter().map(logprob_from_proto).collect(),
        finish: finish_from_proto(r.finish_reason),
        prompt_tokens,
        completion_tokens,
        // Sent with the usage, on the last response.
        cached_tokens: r.usage.map_or(0, |u| u.cached_tokens as usize),
        scheduled_at: None,
    }
}

pub fn layout_to_proto(s: &KvShape) -> pb::KvLayout {
    pb::KvLayout {
        n_layers: s.n_layers as u32,
        block_size: s.block_size as u32,
        n_kv_heads: s.n_kv_heads as u32,
        head_dim: s.head_dim as u32,
        dtype_bytes: s.dtype.bytes() as u32,
    }
}

pub fn layout_from_proto(l: &pb::KvLayout) -> kv_transfer::KvLayout {
    kv_transfer::KvLayout {
        n_layers: l.n_layers,
        block_size: l.block_size,
        n_kv_heads: l.n_kv_heads,
        head_dim: l.head_dim,
        dtype_bytes: l.dtype_bytes,
    }
}

pub fn transfer_layout(s: &KvShape) -> kv_transfer::KvLayout {
    layout_from_proto(&layout_to_proto(s))
}

/// The model identity workers compare at registration: name and architecture.
pub fn model_identity(c: &engine::config::ModelConfig) -> String {
    c.identity()
}

/// The gRPC status for a refused submission.
pub fn submit_status(e: SubmitError) -> tonic::Status {
    match e {
        SubmitError::Invalid(EngineError::Busy(m)) | SubmitError::Busy(m) => tonic::Status::resource_exhausted(m),
        SubmitError::Invalid(e) => tonic::Status::invalid_argument(e.to_string()),
        SubmitError::Overloaded(_) => tonic::Status::resource_exhausted(e.to_string()),
        SubmitError::Stopped => tonic::Status::unavailable(e.to_string()),
    }
}

/// Worker info of a local engine.
pub fn worker_info(role: &str, e: &engine::handle::EngineHandle) -> pb::WorkerInfo {
    let st = e.stats();
    pb::WorkerInfo {
        role: role.into(),
        model: model_identity(&e.model),
        kv_layout: Some(layout_to_proto(&e.kv_shape)),
        kv_blocks_total: st.kv_blocks_total as u32,
        kv_blocks_used: st.kv_blocks_used as u32,
        running: st.running as u32,
        waiting: st.waiting as u32,
        max_model_len: e.limits.max_model_len as u32,
        vocab_size: e.limits.vocab as u32,
        backend: e.backend.to_string(),
        in_flight: e.in_flight() as u32,
        kv_blocks_cached: st.kv_blocks_cached as u32,
        prefix_cache_queries: st.prefix_cache_queries,
        prefix_cache_hits: st.prefix_cache_hits,
    }
}

/// Serves `GET /metrics` (Prometheus text) for a worker: its role's `registry` plus
/// the engine's queue depths and KV usage at scrape time.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    registry: prometheus::Registry,
    engine: engine::handle::EngineHandle,
    role: &'static str,
) -> std::io::Result<()> {
    use axum::routing::get;
    let gauges = prometheus::IntGaugeVec::new(
        prometheus::Opts::new("disagg:worker_state", "Engine state of this worker at scrape time"),
        &["role", "what"],
    )
    .expect("valid metric");
    registry.register(Box::new(gauges.clone())).expect("registered once");
    let app = axum::Router::new().route(
        "/metrics",
        get(move || {
            let (registry, engine, gauges) = (registry.clone(), engine.clone(), gauges.clone());
            async move {
                let st = engine.stats();
                for (what, v) in [
                    ("running", st.running),
                    ("waiting", st.waiting),
                    ("kv_blocks_used", st.kv_blocks_used),
                    ("kv_blocks_total", st.kv_blocks_total),
                    ("kv_blocks_cached", st.kv_blocks_cached),
                    ("host_blocks_cached", st.host_blocks_cached),
                    ("prefix_cache_queries", st.prefix_cache_queries as usize),
                    ("prefix_cache_hits", st.prefix_cache_hits as usize),
                    ("in_flight", engine.in_flight()),
                ] {
                    gauges.with_label_values(&[role, what]).set(v as i64);
                }
                let mut out = String::new();
                let _ = prometheus::TextEncoder::new().encode_utf8(&registry.gather(), &mut out);
                out
            }
        }),
    );
    axum::serve(listener, app).await
}

/// Prefix-cache events onto the wire.
pub fn kv_events_to_proto(b: engine::handle::KvEventBatch) -> pb::KvEventBatch {
    use engine::scheduler::{CacheTier, KvEvent};
    use pb::kv_event::{Kind, Tier};
    let tier = |t: CacheTier| match t {
        CacheTier::Device => Tier::Device as i32,
        CacheTier::Host => Tier::Host as i32,
    };
    pb::KvEventBatch {
        seq: b.seq,
        snapshot: b.snapshot,
        events: b
            .events
            .into_iter()
            .map(|e| match e {
                KvEvent::Stored { tier: t, hashes } => pb::KvEvent { kind: Kind::Stored as i32, tier: tier(t), hashes },
                KvEvent::Removed { tier: t, hashes } => {
                    pb::KvEvent { kind: Kind::Removed as i32, tier: tier(t), hashes }
                }
            })
            .collect(),
    }
}

/// A worker's stream of prefix-cache events.
pub type KvEventStream =
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::KvEventBatch, tonic::Status>> + Send>>;

/// The server side of `KvEvents` for a worker's engine.
pub fn kv_event_stream(engine: &engine::handle::EngineHandle) -> Result<KvEventStream, tonic::Status> {
    use tokio_stream::StreamExt;
    let rx = engine.subscribe_kv_events().map_err(submit_status)?;
    let s = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(|b| Ok(kv_events_to_proto(b)));
    Ok(Box::pin(s))
}

/// Prefix-cache events from the wire (unknown kinds or tiers are skipped).
pub fn kv_events_from_proto(b: pb::KvEventBatch) -> engine::handle::KvEventBatch {
    use engine::scheduler::{CacheTier, KvEvent};
    use pb::kv_event::{Kind, Tier};
    let events = b
        .events
        .into_iter()
        .filter_map(|e| {
            let tier = match Tier::try_from(e.tier).ok()? {
                Tier::Device => CacheTier::Device,
                Tier::Host => CacheTier::Host,
            };
            Some(match Kind::try_from(e.kind).ok()? {
                Kind::Stored => KvEvent::Stored { tier, hashes: e.hashes },
                Kind::Removed => KvEvent::Removed { tier, hashes: e.hashes },
            })
        })
        .collect();
    engine::handle::KvEventBatch { seq: b.seq, snapshot: b.snapshot, events }
}
