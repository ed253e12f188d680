//! The prefill worker (`disagg prefill`): `disagg.v1.PrefillWorker` over gRPC.
//!
//! For each request it submits an exporting request to its engine: the engine thread
//! hands the prompt's KV over layer by layer as each layer of each step completes
//! (see engine::scheduler), and a task here posts every range to the decode worker's
//! KV receiver while later layers are still computing. The call answers with the
//! first token once the receiver has verified every block. If the caller goes away,
//! the engine request is aborted and its blocks are freed.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::handle::EngineHandle;
use engine::kv::blocks_for;
use engine::scheduler::KvChunk;
use kv_transfer::{Fault, KvSender, XferDesc};
use opentelemetry::KeyValue;
use proto::v1::prefill_worker_server::{PrefillWorker, PrefillWorkerServer};
use proto::v1::{PrefillRequest, PrefillResponse, WorkerInfo, WorkerInfoRequest};
use rpc::telemetry::{SpanSpec, Telemetry, TraceParent};
use tonic::{Request, Response, Status};

/// Per-role metrics of a prefill worker.
pub struct PrefillMetrics {
    pub registry: prometheus::Registry,
    pub requests: prometheus::IntCounter,
    pub failures: prometheus::IntCounter,
    pub transfer_bytes: prometheus::IntCounter,
    pub transfer_seconds: prometheus::Histogram,
}

impl PrefillMetrics {
    fn new() -> Self {
        let registry = prometheus::Registry::new();
        let requests = prometheus::IntCounter::new("disagg:prefill_requests_total", "Prefill requests served").unwrap();
        let failures =
            prometheus::IntCounter::new("disagg:prefill_failures_total", "Prefill requests that failed").unwrap();
        let transfer_bytes =
            prometheus::IntCounter::new("disagg:kv_transfer_bytes_total", "KV bytes sent to decode workers").unwrap();
        let transfer_seconds = prometheus::Histogram::with_opts(
            prometheus::HistogramOpts::new(
                "disagg:kv_transfer_seconds",
                "Prefill start to the receiver's verification of the last KV block",
            )
            .buckets(prometheus::exponential_buckets(0.001, 2.0, 16).unwrap()),
        )
        .unwrap();
        for m in [&requests, &failures, &transfer_bytes] {
            registry.register(Box::new(m.clone())).unwrap();
        }
        registry.register(Box::new(transfer_seconds.clone())).unwrap();
        PrefillMetrics { registry, requests, failures, transfer_bytes, transfer_seconds }
    }
}

pub struct PrefillService {
    engine: EngineHandle,
    fault: Fault,
    pub metrics: Arc<PrefillMetrics>,
    telemetry: Option<Arc<Telemetry>>,
}

impl PrefillService {
    /// `fault` injects transfer failures (tests; `DISAGG_KV_FAULT`).
    pub fn new(engine: EngineHandle, fault: Fault) -> Self {
        PrefillService { engine, fault, metrics: Arc::new(PrefillMetrics::new()), telemetry: None }
    }

    /// Records this worker's part of each request as spans (see `rpc::telemetry`).
    pub fn with_telemetry(mut self, t: Arc<Telemetry>) -> Self {
        self.telemetry = Some(t);
        self
    }

    pub fn into_server(self) -> PrefillWorkerServer<PrefillService> {
        PrefillWorkerServer::new(self).max_decoding_message_size(64 << 20)
    }
}

/// Aborts a task when dropped (the call was cancelled).
struct AbortOnDrop(tokio::task::JoinHandle<Result<u64, Status>>);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[tonic::async_trait]
impl PrefillWorker for PrefillService {
    async fn prefill(&self, req: Request<PrefillRequest>) -> Result<Response<PrefillResponse>, Status> {
        let t0 = Instant::now();
        let parent = req.metadata().get("traceparent").and_then(|v| v.to_str().ok()).and_then(TraceParent::parse);
        let r = req.into_inner();
        let mine = rpc::transfer_layout(&self.engine.kv_shape);
        let Some(theirs) = r.kv_layout.as_ref().map(rpc::layout_from_proto) else {
            return Err(Status::invalid_argument("kv_layout is required"));
        };
        if theirs != mine {
            return Err(Status::failed_precondition(format!(
                "incompatible KV layout: this prefill worker has [{mine}], the receiver [{theirs}]"
            )));
        }
        if r.kv_target.is_empty() {
            return Err(Status::invalid_argument("kv_target is required (host:port of the KV receiver)"));
        }
        self.metrics.requests.inc();
        let params = rpc::sampling_from_proto(r.sampling);
        let prompt_len = r.prompt_ids.len();
        let total = blocks_for(prompt_len, mine.block_size as usize) as u32;
        // The receiver has the first `skip` blocks cached: the transfer carries the
        // rest, numbered from 0.
        let skip = r.skip_blocks;
        if skip >= total {
            return Err(Status::invalid_argument(format!(
                "skip_blocks is {skip} but the prompt has {total} blocks; at least the last block must be sent"
            )));
        }
        let n_blocks = total - skip;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<KvChunk>();
        let sink = Box::new(move |mut c: KvChunk| {
            c.first_block -= skip;
            let _ = tx.send(c);
        });
        let r_id = r.request_id.clone();
        let mut stream =
            self.engine.submit_exporting(r.prompt_ids, params, sink, skip as usize).map_err(rpc::submit_status)?;
        let (target, ticket, fault) = (r.kv_target, r.ticket, self.fault);
        let mut sender = AbortOnDrop(tokio::spawn(async move {
            let mut s = KvSender::connect(&target, ticket, mine, n_blocks, fault)
                .await
                .map_err(|e| Status::unavailable(format!("KV transfer to {target}: {e}")))?;
            while let Some(c) = rx.recv().await {
                let d = XferDesc { layer: c.layer, first_block: c.first_block, n_blocks: c.n_blocks };
                if let Err(e) = s.send(d, &c.data).await {
                    let e = s.reason().await.unwrap_or(e);
                    return Err(Status::unavailable(format!("KV transfer to {target}: {e}")));
                }
            }
            s.finish().await.map_err(|e| Status::unavailable(format!("KV transfer to {target}: {e}")))
        }));
        // A transfer that fails before the first token stops the prompt's compute at
        // once. (It can also end successfully just after the first token, when the
        // engine closed the sink: then take the token.)
        let mut done_transfer: Option<u64> = None;
        let first = tokio::select! {
            biased;
            f = stream.next() => f,
            r = &mut sender.0 => {
                match r.unwrap_or_else(|e| Err(Status::internal(format!("KV sender task: {e}")))) {
                    Ok(bytes) => {
                        done_transfer = Some(bytes);
                        stream.next().await
                    }
                    Err(e) => {
                        self.metrics.failures.inc();
                        tracing::warn!(request = %r_id, error = %e.message(), "KV transfer failed before the first token");
                        return Err(e);
                    }
                }
            }
        };
        let mut first_at = t0;
        let result = async {
            let Some(first) = first else {
                return Err(Status::unavailable(stream.error().unwrap_or("the engine stopped").to_string()));
            };
            first_at = Instant::now();
            let token = *first.out.new_token_ids.first().ok_or_else(|| Status::internal("no first token"))?;
            let cached = first.out.cached_tokens as u32;
            let logprob = first.out.logprobs.into_iter().next().map(rpc::logprob_to_proto);
            let bytes = match done_transfer {
                Some(b) => b,
                None => tokio::time::timeout(Duration::from_secs(120), &mut sender.0)
                    .await
                    .map_err(|_| Status::deadline_exceeded("the KV transfer did not complete in 120 s"))?
                    .map_err(|e| Status::internal(format!("KV sender task: {e}")))??,
            };
            Ok((token, logprob, bytes, cached))
        }
        .await;
        if let Some(t) = &self.telemetry {
            let end = Instant::now();
            let root = SpanSpec {
                name: "prefill_worker",
                start: t0,
                end,
                attributes: vec![
                    KeyValue::new("disagg.request_id", r.request_id.clone()),
                    KeyValue::new("gen_ai.usage.input_tokens", prompt_len as i64),
                    KeyValue::new("disagg.ok", result.is_ok()),
                ],
            };
            let span = |name, start, end| SpanSpec { name, start, end, attributes: Vec::new() };
            let ids = parent.map(|p| p.child()).unwrap_or_else(TraceParent::new_root);
            // The transfer runs beside the prefill (layer by layer) and ends after it.
            t.record_tree(parent, ids, root, &[span("prefill", t0, first_at), span("kv_transfer", t0, end)]);
        }
        match result {
            Ok((first_token, first_logprob, kv_bytes, cached_tokens)) => {
                let secs = t0.elapsed().as_secs_f64();
                self.metrics.transfer_bytes.inc_by(kv_bytes);
                self.metrics.transfer_seconds.observe(secs);
                Ok(Response::new(PrefillResponse {
                    first_token,
                    first_logprob,
                    kv_bytes,
                    seconds: secs,
                    cached_tokens,
                }))
            }
            Err(e) => {
                self.metrics.failures.inc();
                tracing::warn!(request = %r.request_id, error = %e.message(), "prefill failed");
                Err(e)
            }
        }
    }

    async fn info(&self, _: Request<WorkerInfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        Ok(Response::new(rpc::worker_info("prefill", &self.engine)))
    }

    type KvEventsStream = rpc::KvEventStream;

    async fn kv_events(
        &self,
        _: Request<proto::v1::KvEventsRequest>,
    ) -> Result<Response<Self::KvEventsStream>, Status> {
        Ok(Response::new(rpc::kv_event_stream(&self.engine)?))
    }
}
