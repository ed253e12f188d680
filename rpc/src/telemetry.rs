//! OpenTelemetry traces over OTLP/gRPC, when an endpoint is configured; nothing is
//! created or exported otherwise. Shared by the router and the workers.
//!
//! Spans are recorded when a request (or a worker's part of it) has finished, from the
//! timestamps taken on the way. At the router each request becomes a `request` span
//! with three children that split its life: `queue` (accepted → first scheduled),
//! `prefill` (scheduled → first token) and `decode` (first token → last token).
//! In the cluster the trace crosses processes: the router picks the trace and span ids
//! of its `request` span up front and sends them to the decode worker as a W3C
//! `traceparent` in the gRPC metadata; the decode worker's `decode_worker` span is its
//! child and is the parent (again through `traceparent`) of the prefill worker's
//! `prefill_worker` span. Attributes carry counts and the finish reason, never prompt
//! or output text.

use std::time::{Instant, SystemTime};

use rand_core::TryRngCore;

use opentelemetry::trace::{
    Span, SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer, TracerProvider,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};

pub struct Telemetry {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

/// Trace and span id of a span, as carried in a W3C `traceparent`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: TraceId,
    pub span_id: SpanId,
}

impl TraceParent {
    /// Fresh random ids (a new trace).
    pub fn new_root() -> TraceParent {
        let mut b = [0u8; 24];
        rand_core::OsRng.try_fill_bytes(&mut b).expect("OS randomness");
        TraceParent {
            trace_id: TraceId::from_bytes(b[..16].try_into().expect("16 bytes")),
            span_id: SpanId::from_bytes(b[16..].try_into().expect("8 bytes")),
        }
    }

    /// A new span id in the same trace.
    pub fn child(&self) -> TraceParent {
        TraceParent { trace_id: self.trace_id, span_id: TraceParent::new_root().span_id }
    }

    /// `00-<trace id>-<span id>-01`.
    pub fn header(&self) -> String {
        format!("00-{}-{}-01", self.trace_id, self.span_id)
    }

    /// Parses a `traceparent` header (version 00); `None` if malformed.
    pub fn parse(h: &str) -> Option<TraceParent> {
        let mut it = h.trim().split('-');
        let (v, t, s, _flags) = (it.next()?, it.next()?, it.next()?, it.next()?);
        if v != "00" || t.len() != 32 || s.len() != 16 {
            return None;
        }
        let trace_id = TraceId::from_hex(t).ok()?;
        let span_id = SpanId::from_hex(s).ok()?;
        (trace_id != TraceId::INVALID && span_id != SpanId::INVALID).then_some(TraceParent { trace_id, span_id })
    }

    fn context(&self) -> Context {
        let sc = SpanContext::new(self.trace_id, self.span_id, TraceFlags::SAMPLED, true, TraceState::default());
        Context::new().with_remote_span_context(sc)
    }
}

thread_local! {
    /// Ids the next span started on this thread takes (trace id only without a parent).
    static PRESET: std::cell::Cell<(Option<TraceId>, Option<SpanId>)> = const { std::cell::Cell::new((None, None)) };
}

/// Random ids, except where [`PRESET`] names the ids of the span being started.
#[derive(Debug, Default)]
struct PresetIds(opentelemetry_sdk::trace::RandomIdGenerator);

impl opentelemetry_sdk::trace::IdGenerator for PresetIds {
    fn new_trace_id(&self) -> TraceId {
        let preset = PRESET.with(|p| {
            let (t, s) = p.get();
            p.set((None, s));
            t
        });
        preset.unwrap_or_else(|| self.0.new_trace_id())
    }

    fn new_span_id(&self) -> SpanId {
        let preset = PRESET.with(|p| {
            let (t, s) = p.get();
            p.set((t, None));
            s
        });
        preset.unwrap_or_else(|| self.0.new_span_id())
    }
}

/// One span of a tree recorded after the fact.
pub struct SpanSpec {
    pub name: &'static str,
    pub start: Instant,
    pub end: Instant,
    pub attributes: Vec<KeyValue>,
}

/// One finished request's milestones (one clock).
pub struct RequestSpans<'a> {
    /// The ids the `request` span takes (sent ahead to the workers); new ones if unset.
    pub ids: Option<TraceParent>,
    pub id: &'a str,
    pub route: &'a str,
    pub arrival: Instant,
    pub submitted: Instant,
    pub scheduled: Option<Instant>,
    pub first_token: Instant,
    pub finished: Instant,
    pub emitted: Instant,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub finish_reason: &'a str,
}

impl Telemetry {
    /// Exports to `endpoint` (e.g. `http://127.0.0.1:4317`) in batches. Must be called
    /// inside a tokio runtime.
    pub fn otlp(endpoint: &str, service_name: &str) -> Result<Telemetry, String> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .build()
            .map_err(|e| e.to_string())?;
        let resource = opentelemetry_sdk::Resource::builder().with_service_name(service_name.to_string()).build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource)
            .with_id_generator(PresetIds::default())
            .build();
        let tracer = provider.tracer("disagg");
        Ok(Telemetry { provider, tracer })
    }

    pub fn record(&self, r: &RequestSpans) {
        let scheduled = r.scheduled.unwrap_or(r.submitted);
        let root = SpanSpec {
            name: "request",
            start: r.arrival,
            end: r.emitted,
            attributes: vec![
                KeyValue::new("disagg.request_id", r.id.to_string()),
                KeyValue::new("http.route", r.route.to_string()),
                KeyValue::new("gen_ai.usage.input_tokens", r.prompt_tokens as i64),
                KeyValue::new("gen_ai.usage.output_tokens", r.completion_tokens as i64),
                KeyValue::new("gen_ai.response.finish_reason", r.finish_reason.to_string()),
            ],
        };
        let child = |name, start, end| SpanSpec { name, start, end, attributes: Vec::new() };
        let children = [
            child("queue", r.submitted, scheduled),
            child("prefill", scheduled, r.first_token),
            child("decode", r.first_token, r.finished),
        ];
        self.record_tree(None, r.ids.unwrap_or_else(TraceParent::new_root), root, &children);
    }

    /// Records `root` with the ids `ids` (under `parent`, a span of another process,
    /// when given) and `children` under it.
    pub fn record_tree(&self, parent: Option<TraceParent>, ids: TraceParent, root: SpanSpec, children: &[SpanSpec]) {
        let now_i = Instant::now();
        let now_s = SystemTime::now();
        let wall = |t: Instant| now_s - now_i.saturating_duration_since(t);
        let t = &self.tracer;
        let parent_cx = parent.map(|p| p.context()).unwrap_or_default();
        // The root span takes the ids chosen in advance (already sent to other
        // processes); the SDK asks the id generator for them while starting it.
        PRESET.with(|p| p.set((Some(ids.trace_id), Some(ids.span_id))));
        let span = t
            .span_builder(root.name)
            .with_start_time(wall(root.start))
            .with_attributes(root.attributes)
            .start_with_context(t, &parent_cx);
        PRESET.with(|p| p.set((None, None)));
        let cx = parent_cx.with_span(span);
        for c in children {
            let mut s = t
                .span_builder(c.name)
                .with_start_time(wall(c.start))
                .with_attributes(c.attributes.clone())
                .start_with_context(t, &cx);
            s.end_with_timestamp(wall(c.end.max(c.start)));
        }
        cx.span().end_with_timestamp(wall(root.end.max(root.start)));
    }

    /// Flushes what is buffered.
    pub fn shutdown(&self) {
        let _ = self.provider.force_flush();
        let _ = self.provider.shutdown();
    }
}
