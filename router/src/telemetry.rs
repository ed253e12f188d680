//! OpenTelemetry traces over OTLP/gRPC, when an endpoint is configured; nothing is
//! created or exported otherwise.
//!
//! Each finished request becomes a `request` span with three children that split its
//! life: `queue` (accepted → first scheduled), `prefill` (scheduled → first token) and
//! `decode` (first token → last token). Attributes carry counts and the finish reason,
//! never prompt or output text.

use std::time::{Instant, SystemTime};

use opentelemetry::trace::{Span, TraceContextExt, Tracer, TracerProvider};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};

pub struct Telemetry {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

/// One finished request's milestones (one clock).
pub struct RequestSpans<'a> {
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
    pub fn otlp(endpoint: &str, service_name: &str) -> anyhow::Result<Telemetry> {
        let exporter = opentelemetry_otlp::SpanExporter::builder().with_tonic().with_endpoint(endpoint).build()?;
        let resource = opentelemetry_sdk::Resource::builder().with_service_name(service_name.to_string()).build();
        let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build();
        let tracer = provider.tracer("disagg");
        Ok(Telemetry { provider, tracer })
    }

    pub fn record(&self, r: &RequestSpans) {
        let now_i = Instant::now();
        let now_s = SystemTime::now();
        let wall = |t: Instant| now_s - now_i.saturating_duration_since(t);
        let t = &self.tracer;
        let root = t
            .span_builder("request")
            .with_start_time(wall(r.arrival))
            .with_attributes(vec![
                KeyValue::new("disagg.request_id", r.id.to_string()),
                KeyValue::new("http.route", r.route.to_string()),
                KeyValue::new("gen_ai.usage.input_tokens", r.prompt_tokens as i64),
                KeyValue::new("gen_ai.usage.output_tokens", r.completion_tokens as i64),
                KeyValue::new("gen_ai.response.finish_reason", r.finish_reason.to_string()),
            ])
            .start(t);
        let cx = Context::current_with_span(root);
        let scheduled = r.scheduled.unwrap_or(r.submitted);
        for (name, a, b) in [
            ("queue", r.submitted, scheduled),
            ("prefill", scheduled, r.first_token),
            ("decode", r.first_token, r.finished),
        ] {
            let mut s = t.span_builder(name).with_start_time(wall(a)).start_with_context(t, &cx);
            s.end_with_timestamp(wall(b.max(a)));
        }
        cx.span().end_with_timestamp(wall(r.emitted));
    }

    /// Flushes what is buffered.
    pub fn shutdown(&self) {
        let _ = self.provider.force_flush();
        let _ = self.provider.shutdown();
    }
}
