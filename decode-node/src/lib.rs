//! The decode worker (`disagg decode`): `disagg.v1.DecodeWorker` over gRPC, and a KV
//! receiver (kv-transfer) that prefill workers push into.
//!
//! Generate, for a request naming a prefill worker:
//! 1. reserve KV blocks for the prompt in the engine (RESOURCE_EXHAUSTED when none);
//!    the blocks of its longest prefix in this worker's prefix cache are taken from
//!    there, and only the rest will be transferred;
//! 2. register a ticket with the KV receiver for that many blocks in this layout;
//! 3. call the prefill worker with the prompt, the blocks to skip, the receiver's
//!    address and the ticket;
//!    meanwhile import each verified KV range into the reserved blocks as it arrives;
//! 4. when the transfer has completed and the prefill call returned the first token,
//!    activate the request: it joins the decode batch and its tokens stream back.
//!
//! Any failure before step 4 (prefill worker gone or unresponsive to HTTP/2
//! keepalive, transfer cut, checksum mismatch) ends the call with a status before the first response, and dropping the
//! reservation frees the blocks; so the router can retry without a duplicate token.
//! A request without a prefill worker is prefilled here (conditional disaggregation).
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engine::handle::EngineHandle;
use engine::scheduler::KvChunk;
use kv_transfer::KvReceiver;
use opentelemetry::KeyValue;
use proto::v1::decode_worker_server::{DecodeWorker, DecodeWorkerServer};
use proto::v1::prefill_worker_client::PrefillWorkerClient;
use proto::v1::{DecodeRequest, GenerateResponse, PrefillRequest, WorkerInfo, WorkerInfoRequest};
use rpc::telemetry::{SpanSpec, Telemetry, TraceParent};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// Per-role metrics of a decode worker.
pub struct DecodeMetrics {
    pub registry: prometheus::Registry,
    pub requests: prometheus::IntCounter,
    pub local_prefills: prometheus::IntCounter,
    pub failures: prometheus::IntCounter,
    pub transfer_bytes: prometheus::IntCounter,
    pub transfer_seconds: prometheus::Histogram,
}

impl DecodeMetrics {
    fn new() -> Self {
        let registry = prometheus::Registry::new();
        let c = |n: &str, h: &str| prometheus::IntCounter::new(n, h).unwrap();
        let requests = c("disagg:decode_requests_total", "Requests served by this decode worker");
        let local_prefills = c("disagg:decode_local_prefills_total", "Requests prefilled on this decode worker");
        let failures = c("disagg:decode_prefill_failures_total", "Requests whose remote prefill or transfer failed");
        let transfer_bytes = c("disagg:kv_transfer_received_bytes_total", "KV bytes received from prefill workers");
        let transfer_seconds = prometheus::Histogram::with_opts(
            prometheus::HistogramOpts::new(
                "disagg:kv_transfer_wait_seconds",
                "Reservation to activation: remote prefill plus KV transfer, as the decode worker waits",
            )
            .buckets(prometheus::exponential_buckets(0.001, 2.0, 16).unwrap()),
        )
        .unwrap();
        for m in [&requests, &local_prefills, &failures, &transfer_bytes] {
            registry.register(Box::new(m.clone())).unwrap();
        }
        registry.register(Box::new(transfer_seconds.clone())).unwrap();
        DecodeMetrics { registry, requests, local_prefills, failures, transfer_bytes, transfer_seconds }
    }
}

pub struct DecodeService {
    engine: EngineHandle,
    receiver: Arc<KvReceiver>,
    /// host:port prefill workers connect to (the receiver's address as others see it).
    kv_addr: String,
    clients: Mutex<HashMap<String, PrefillWorkerClient<Channel>>>,
    pub metrics: Arc<DecodeMetrics>,
    telemetry: Option<Arc<Telemetry>>,
}

impl DecodeService {
    /// `kv_host` is the host prefill workers use to reach this worker's receiver.
    pub fn new(engine: EngineHandle, receiver: Arc<KvReceiver>, kv_host: &str) -> Self {
        let kv_addr = format!("{kv_host}:{}", receiver.local_addr().port());
        DecodeService {
            engine,
            receiver,
            kv_addr,
            clients: Mutex::new(HashMap::new()),
            metrics: Arc::new(DecodeMetrics::new()),
            telemetry: None,
        }
    }

    /// Records this worker's part of each request as spans (see `rpc::telemetry`).
    pub fn with_telemetry(mut self, t: Arc<Telemetry>) -> Self {
        self.telemetry = Some(t);
        self
    }

    pub fn into_server(self) -> DecodeWorkerServer<DecodeService> {
        DecodeWorkerServer::new(self).max_decoding_message_size(64 << 20)
    }

    fn client(&self, addr: &str) -> Result<PrefillWorkerClient<Channel>, Status> {
        let mut m = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = m.get(addr) {
            return Ok(c.clone());
        }
        let ep = Channel::from_shared(addr.to_string())
            .map_err(|e| Status::invalid_argument(format!("prefill address {addr:?}: {e}")))?
            .connect_timeout(Duration::from_secs(5))
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(10))
            .keep_alive_while_idle(true)
            .tcp_nodelay(true);
        let c = PrefillWorkerClient::new(ep.connect_lazy()).max_decoding_message_size(64 << 20);
        m.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// Steps 1–4 of the module docs for one request; returns its engine stream, active.
    async fn prefill_remote(
        &self,
        r: DecodeRequest,
        trace: Option<TraceParent>,
    ) -> Result<engine::handle::RequestStream, Status> {
        let t0 = Instant::now();
        let params = rpc::sampling_from_proto(r.sampling.clone());
        let (stream, res) = self.engine.reserve(r.prompt_ids.clone(), params).await.map_err(rpc::submit_status)?;
        let layout = rpc::layout_to_proto(&self.engine.kv_shape);
        // The transfer covers the blocks after the cached ones, counted from 0.
        let skip = res.cached_blocks as u32;
        let mut inbound =
            self.receiver.expect(rpc::layout_from_proto(&layout), (res.n_blocks - res.cached_blocks) as u32);
        let mut client = self.client(&r.prefill)?;
        let call = PrefillRequest {
            prompt_ids: r.prompt_ids,
            sampling: r.sampling,
            kv_target: self.kv_addr.clone(),
            ticket: inbound.ticket,
            kv_layout: Some(layout),
            request_id: r.request_id.clone(),
            skip_blocks: skip,
        };
        let prefill_addr = r.prefill.clone();
        let mut call = tonic::Request::new(call);
        if let Some(v) = trace.and_then(|t| t.header().parse().ok()) {
            call.metadata_mut().insert("traceparent", v);
        }
        let prefill = async move {
            client.prefill(call).await.map(|x| x.into_inner()).map_err(|e| {
                // Keep codes the router acts on (queue on RESOURCE_EXHAUSTED, no retry
                // on INVALID_ARGUMENT / FAILED_PRECONDITION); the rest is UNAVAILABLE.
                let m = format!("prefill worker {prefill_addr}: {}", e.message());
                match e.code() {
                    tonic::Code::ResourceExhausted => Status::resource_exhausted(m),
                    tonic::Code::InvalidArgument => Status::invalid_argument(m),
                    tonic::Code::FailedPrecondition => Status::failed_precondition(m),
                    _ => Status::unavailable(m),
                }
            })
        };
        let (engine, id) = (self.engine.clone(), stream.id);
        let import = async move {
            let mut bytes = 0u64;
            loop {
                match inbound.recv().await {
                    Ok(Some(c)) => {
                        bytes += c.data.len() as u64;
                        let d = c.desc;
                        engine.import_kv(
                            id,
                            KvChunk {
                                layer: d.layer,
                                first_block: d.first_block + skip,
                                n_blocks: d.n_blocks,
                                data: c.data,
                            },
                        );
                    }
                    Ok(None) => return Ok(bytes),
                    Err(e) => return Err(Status::unavailable(format!("KV transfer: {e}"))),
                }
            }
        };
        // No deadline: a prompt may queue at a busy prefill worker for long. A dead or
        // unreachable prefill worker fails the call (connection errors, HTTP/2
        // keepalive), and a transfer that breaks fails the import.
        let (resp, bytes) = tokio::try_join!(prefill, import)?;
        let logprob = resp.first_logprob.map(rpc::logprob_from_proto);
        // A failed activation means the reservation is gone (e.g. an import was
        // refused): the request can be retried elsewhere.
        self.engine
            .activate(id, resp.first_token, logprob, resp.cached_tokens as usize)
            .await
            .map_err(|e| Status::unavailable(format!("activating the transferred request: {e}")))?;
        self.metrics.transfer_bytes.inc_by(bytes);
        self.metrics.transfer_seconds.observe(t0.elapsed().as_secs_f64());
        Ok(stream)
    }
}

type GenStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DecodeWorker for DecodeService {
    type GenerateStream = GenStream;

    async fn generate(&self, req: Request<DecodeRequest>) -> Result<Response<GenStream>, Status> {
        let arrival = Instant::now();
        let parent = req.metadata().get("traceparent").and_then(|v| v.to_str().ok()).and_then(TraceParent::parse);
        // This worker's span: a child of the router's, parent of the prefill worker's.
        let ids = self.telemetry.as_ref().map(|_| parent.map(|p| p.child()).unwrap_or_else(TraceParent::new_root));
        let r = req.into_inner();
        let remote = !r.prefill.is_empty();
        self.metrics.requests.inc();
        let request_id = r.request_id.clone();
        let mut stream = if r.prefill.is_empty() {
            self.metrics.local_prefills.inc();
            let params = rpc::sampling_from_proto(r.sampling);
            self.engine.submit(r.prompt_ids, params).map_err(rpc::submit_status)?
        } else {
            self.prefill_remote(r, ids).await.inspect_err(|e| {
                self.metrics.failures.inc();
                tracing::warn!(request = %request_id, error = %e.message(), "remote prefill failed");
            })?
        };
        let started = Instant::now();
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let telemetry = self.telemetry.clone();
        tokio::spawn(async move {
            let mut tokens = 0;
            while let Some(item) = stream.next().await {
                let done = item.out.finish.is_some();
                tokens += item.out.new_token_ids.len();
                if tx.send(Ok(rpc::output_to_proto(item.out, Vec::new()))).await.is_err() || done {
                    break;
                }
            }
            if let Some(reason) = stream.error() {
                let _ = tx.send(Err(Status::unavailable(reason.to_string()))).await;
            }
            if let (Some(t), Some(ids)) = (telemetry, ids) {
                let end = Instant::now();
                let root = SpanSpec {
                    name: "decode_worker",
                    start: arrival,
                    end,
                    attributes: vec![
                        KeyValue::new("disagg.request_id", request_id),
                        KeyValue::new("disagg.remote_prefill", remote),
                        KeyValue::new("gen_ai.usage.output_tokens", tokens as i64),
                    ],
                };
                let span = |name, start, end| SpanSpec { name, start, end, attributes: Vec::new() };
                let first = if remote { "kv_wait" } else { "local_prefill_queue" };
                t.record_tree(parent, ids, root, &[span(first, arrival, started), span("decode", started, end)]);
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn info(&self, _: Request<WorkerInfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        Ok(Response::new(rpc::worker_info("decode", &self.engine)))
    }

    type KvEventsStream = rpc::KvEventStream;

    async fn kv_events(
        &self,
        _: Request<proto::v1::KvEventsRequest>,
    ) -> Result<Response<Self::KvEventsStream>, Status> {
        Ok(Response::new(rpc::kv_event_stream(&self.engine)?))
    }
}
