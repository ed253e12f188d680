//! Traces: with an OTLP endpoint, each request is exported as a `request` span with
//! `queue`, `prefill` and `decode` children; without one, nothing is exported.

use disagg_tests::{test_options, Collector, TestServer};
use opentelemetry_proto::tonic::trace::v1::Span;
use router::GatewayConfig;
use serde_json::json;

#[test]
fn requests_become_request_queue_prefill_decode_spans() {
    let mut o = test_options();
    o.threads = 2;
    let with = TestServer::start(&o, GatewayConfig::default(), 64);
    let without = TestServer::start(&o, GatewayConfig::default(), 64);
    let collector = Collector::default();
    let spans = collector.0.clone();
    let endpoint = collector.start(&with.rt);
    with.rt.block_on(async {
        let t = router::telemetry::Telemetry::otlp(&endpoint, "disagg-test").unwrap();
        let _ = with.state.telemetry.set(t);
    });
    let client = reqwest::Client::new();
    for srv in [&with, &without] {
        srv.rt.block_on(async {
            for stream in [false, true] {
                let body = json!({"model": "smollm2-135m-instruct", "prompt": "Secret prompt text", "max_tokens": 4, "stream": stream});
                let r = client.post(format!("{}/v1/completions", srv.url)).body(body.to_string()).send().await.unwrap();
                assert_eq!(r.status().as_u16(), 200);
                r.bytes().await.unwrap();
            }
        });
        srv.wait_idle();
    }
    with.rt.block_on(async { with.state.telemetry.get().unwrap().shutdown() });
    let spans = spans.lock().unwrap().clone();
    let roots: Vec<&Span> = spans.iter().filter(|s| s.name == "request").collect();
    assert_eq!(
        roots.len(),
        2,
        "one request span per request of the traced server: {:?}",
        spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    for root in roots {
        let kids: Vec<&Span> = spans.iter().filter(|s| s.parent_span_id == root.span_id).collect();
        let mut names: Vec<&str> = kids.iter().map(|s| s.name.as_str()).collect();
        names.sort();
        assert_eq!(names, ["decode", "prefill", "queue"]);
        for k in &kids {
            assert_eq!(k.trace_id, root.trace_id);
            assert!(
                k.start_time_unix_nano >= root.start_time_unix_nano && k.end_time_unix_nano <= root.end_time_unix_nano
            );
            assert!(k.end_time_unix_nano >= k.start_time_unix_nano);
        }
        let attrs = format!("{:?}", root.attributes);
        assert!(attrs.contains("gen_ai.usage.output_tokens") && !attrs.contains("Secret"), "{attrs}");
    }
    assert!(without.state.telemetry.get().is_none());
}
