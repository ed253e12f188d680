//! The gRPC API: streaming generate equal to the engine's own output, status codes,
//! health, and cancellation that frees KV blocks.

use std::time::Duration;

use disagg_tests::{engine, test_options, TestServer};
use engine::sampling::SamplingParams;
use engine::scheduler::run_to_completion;
use proto::v1::inference_client::InferenceClient;
use proto::v1::{generate_request, ChatMessage, ChatPrompt, GenerateRequest, TokenIds, TokenizeRequest};
use router::GatewayConfig;
use tonic::Code;

fn server() -> (TestServer, String) {
    let mut o = test_options();
    o.threads = 2;
    let srv = TestServer::start(&o, GatewayConfig::default(), 4);
    let addr = srv.start_grpc();
    (srv, addr)
}

fn greedy(max_tokens: u32) -> Option<proto::v1::SamplingParams> {
    Some(proto::v1::SamplingParams {
        max_tokens: Some(max_tokens),
        temperature: Some(0.0),
        logprobs: Some(2),
        ..Default::default()
    })
}

#[test]
fn generate_streams_the_engines_tokens() {
    let (srv, addr) = server();
    let mut core = engine(&test_options());
    let want = run_to_completion(
        &mut core,
        vec![(
            vec![504, 3575, 282, 4649, 314],
            SamplingParams { max_tokens: Some(12), logprobs: Some(2), ..SamplingParams::greedy() },
        )],
        0,
    )
    .unwrap()
    .remove(0);
    srv.rt.block_on(async {
        let mut c = InferenceClient::connect(addr.clone()).await.unwrap();
        for prompt in [
            generate_request::Prompt::Text("The capital of France is".into()),
            generate_request::Prompt::TokenIds(TokenIds { ids: vec![504, 3575, 282, 4649, 314] }),
        ] {
            let req = GenerateRequest { model: String::new(), prompt: Some(prompt), sampling: greedy(12) };
            let mut s = c.generate(req).await.unwrap().into_inner();
            let (mut ids, mut text, mut lps): (Vec<u32>, String, Vec<f32>) = (vec![], String::new(), vec![]);
            let (mut first, mut last): (Option<Vec<u32>>, Option<proto::v1::GenerateResponse>) = (None, None);
            while let Some(r) = s.message().await.unwrap() {
                if first.is_none() {
                    first = Some(r.prompt_token_ids.clone());
                }
                ids.extend(&r.token_ids);
                text.push_str(&r.text);
                lps.extend(r.logprobs.iter().map(|l| l.logprob));
                last = Some(r);
            }
            let last = last.unwrap();
            assert_eq!(first.unwrap(), vec![504, 3575, 282, 4649, 314]);
            assert_eq!(ids, want.output_ids);
            assert_eq!(text, want.text);
            assert_eq!(lps, want.logprobs.iter().map(|l| l.logprob).collect::<Vec<_>>());
            assert_eq!(last.finish_reason, proto::v1::FinishReason::Length as i32);
            let u = last.usage.unwrap();
            assert_eq!((u.prompt_tokens, u.completion_tokens), (5, 12));
        }
        // A chat prompt and tokenize agree with the template.
        let chat = ChatPrompt { messages: vec![ChatMessage { role: "user".into(), content: "What is 2+2?".into() }] };
        let t = c
            .tokenize(TokenizeRequest { input: Some(proto::v1::tokenize_request::Input::Chat(chat.clone())) })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(t.token_ids[0], 1);
        let req = GenerateRequest {
            model: String::new(),
            prompt: Some(generate_request::Prompt::Chat(chat)),
            sampling: greedy(32),
        };
        let mut s = c.generate(req).await.unwrap().into_inner();
        let mut text = String::new();
        let mut fin = 0;
        while let Some(r) = s.message().await.unwrap() {
            text.push_str(&r.text);
            fin = r.finish_reason;
        }
        assert!(text.contains('4'), "{text}");
        assert_eq!(fin, proto::v1::FinishReason::Stop as i32);
        let info = c.model_info(proto::v1::ModelInfoRequest {}).await.unwrap().into_inner();
        assert_eq!(info.served_model_name, "smollm2-135m-instruct");
        assert_eq!(info.vocab_size, 49152);
    });
    srv.wait_idle();
}

#[test]
fn bad_requests_get_grpc_status_codes() {
    let (srv, addr) = server();
    srv.rt.block_on(async {
        let mut c = InferenceClient::connect(addr.clone()).await.unwrap();
        let ids = |v: Vec<u32>| Some(generate_request::Prompt::TokenIds(TokenIds { ids: v }));
        let cases = vec![
            (GenerateRequest { model: "other".into(), prompt: ids(vec![1]), sampling: greedy(2) }, Code::NotFound),
            (GenerateRequest { model: String::new(), prompt: None, sampling: greedy(2) }, Code::InvalidArgument),
            (GenerateRequest { model: String::new(), prompt: ids(vec![]), sampling: greedy(2) }, Code::InvalidArgument),
            (
                GenerateRequest { model: String::new(), prompt: ids(vec![1 << 30]), sampling: greedy(2) },
                Code::InvalidArgument,
            ),
            (
                GenerateRequest {
                    model: String::new(),
                    prompt: ids(vec![5]),
                    sampling: Some(proto::v1::SamplingParams { top_p: Some(3.0), ..Default::default() }),
                },
                Code::InvalidArgument,
            ),
        ];
        for (req, code) in cases {
            let err = c.generate(req).await.expect_err("an error status");
            assert_eq!(err.code(), code, "{err:?}");
            assert!(!err.message().is_empty());
        }
    });
    srv.wait_idle();
}

#[test]
fn health_and_cancellation() {
    let (srv, addr) = server();
    srv.rt.block_on(async {
        let ch = tonic::transport::Channel::from_shared(addr.clone()).unwrap().connect().await.unwrap();
        let mut h = tonic_health::pb::health_client::HealthClient::new(ch);
        let r = h
            .check(tonic_health::pb::HealthCheckRequest { service: "disagg.v1.Inference".into() })
            .await
            .unwrap()
            .into_inner();
        // The engine is ready before the service starts, so it reports SERVING at once
        // or within the readiness poll.
        let mut status = r.status;
        for _ in 0..40 {
            if status == tonic_health::pb::health_check_response::ServingStatus::Serving as i32 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
            status = h
                .check(tonic_health::pb::HealthCheckRequest { service: "disagg.v1.Inference".into() })
                .await
                .unwrap()
                .into_inner()
                .status;
        }
        assert_eq!(status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32);

        let mut c = InferenceClient::connect(addr.clone()).await.unwrap();
        let req = GenerateRequest {
            model: String::new(),
            prompt: Some(generate_request::Prompt::Text("Count:".into())),
            sampling: Some(proto::v1::SamplingParams {
                max_tokens: Some(4000),
                ignore_eos: true,
                ..Default::default()
            }),
        };
        let mut s = c.generate(req).await.unwrap().into_inner();
        for _ in 0..3 {
            s.message().await.unwrap().unwrap();
        }
        assert!(srv.engine.stats().kv_blocks_used > 0);
        drop(s);
        let t0 = std::time::Instant::now();
        while srv.engine.stats().kv_blocks_used > 0 || srv.engine.in_flight() > 0 {
            assert!(t0.elapsed() < Duration::from_secs(2), "cancelled call kept its blocks: {:?}", srv.engine.stats());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
}
