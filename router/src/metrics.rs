//! Prometheus metrics, named and shaped like vLLM's (`vllm:` becomes `disagg:`).
//!
//! Labels never carry prompts, user names or error messages.

use prometheus::{Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};

pub struct Metrics {
    registry: Registry,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_latency: Histogram,
    pub queue_time: Histogram,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    pub request_success: IntCounterVec,
    pub http_errors: IntCounterVec,
    pub running: IntGauge,
    pub waiting: IntGauge,
    pub kv_usage: prometheus::Gauge,
    pub preemptions: IntGauge,
    pub prefix_queries: IntGauge,
    pub prefix_hits: IntGauge,
}

fn histogram(name: &str, help: &str, buckets: &[f64]) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec())).expect("valid histogram")
}

impl Metrics {
    pub fn new(model: &str) -> Metrics {
        let registry = Registry::new_custom(None, Some([("model_name".to_string(), model.to_string())].into()))
            .expect("valid registry");
        let lat = [
            0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0,
        ];
        let itl = [
            0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
            0.75, 1.0, 2.5,
        ];
        let m = Metrics {
            time_to_first_token: histogram(
                "disagg:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                &lat,
            ),
            inter_token_latency: histogram(
                "disagg:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                &itl,
            ),
            e2e_latency: histogram(
                "disagg:e2e_request_latency_seconds",
                "Histogram of end to end request latency in seconds.",
                &lat,
            ),
            queue_time: histogram(
                "disagg:request_queue_time_seconds",
                "Histogram of time from arrival to the first scheduled step, in seconds (includes the first step).",
                &lat,
            ),
            prompt_tokens: IntCounter::new("disagg:prompt_tokens_total", "Number of prefill tokens processed.")
                .unwrap(),
            generation_tokens: IntCounter::new(
                "disagg:generation_tokens_total",
                "Number of generation tokens processed.",
            )
            .unwrap(),
            request_success: IntCounterVec::new(
                Opts::new("disagg:request_success_total", "Count of successfully processed requests."),
                &["finished_reason"],
            )
            .unwrap(),
            http_errors: IntCounterVec::new(
                Opts::new("disagg:http_errors_total", "Requests answered with an error, by HTTP status."),
                &["status"],
            )
            .unwrap(),
            running: IntGauge::new("disagg:num_requests_running", "Number of requests in model execution batches.")
                .unwrap(),
            waiting: IntGauge::new("disagg:num_requests_waiting", "Number of requests waiting to be processed.")
                .unwrap(),
            kv_usage: prometheus::Gauge::new(
                "disagg:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
            )
            .unwrap(),
            preemptions: IntGauge::new("disagg:num_preemptions", "Cumulative number of preemptions.").unwrap(),
            prefix_queries: IntGauge::new(
                "disagg:prefix_cache_queries",
                "Cumulative prompt tokens looked up in the prefix cache (all engines).",
            )
            .unwrap(),
            prefix_hits: IntGauge::new(
                "disagg:prefix_cache_hits",
                "Cumulative prompt tokens found in the prefix cache (all engines).",
            )
            .unwrap(),
            registry,
        };
        let r = &m.registry;
        for c in [
            Box::new(m.time_to_first_token.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(m.inter_token_latency.clone()),
            Box::new(m.e2e_latency.clone()),
            Box::new(m.queue_time.clone()),
            Box::new(m.prompt_tokens.clone()),
            Box::new(m.generation_tokens.clone()),
            Box::new(m.request_success.clone()),
            Box::new(m.http_errors.clone()),
            Box::new(m.running.clone()),
            Box::new(m.waiting.clone()),
            Box::new(m.kv_usage.clone()),
            Box::new(m.preemptions.clone()),
            Box::new(m.prefix_queries.clone()),
            Box::new(m.prefix_hits.clone()),
        ] {
            r.register(c).expect("metric names are unique");
        }
        m
    }

    /// The text exposition, with engine gauges refreshed from `stats`.
    pub fn render(&self, stats: &engine::scheduler::EngineStats) -> String {
        self.running.set(stats.running as i64);
        self.waiting.set(stats.waiting as i64);
        self.preemptions.set(stats.preemptions as i64);
        self.prefix_queries.set(stats.prefix_cache_queries as i64);
        self.prefix_hits.set(stats.prefix_cache_hits as i64);
        let total = stats.kv_blocks_total.max(1) as f64;
        self.kv_usage.set(stats.kv_blocks_used as f64 / total);
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf).expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }
}
