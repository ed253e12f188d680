//! Shared helpers for the cross-crate tests: fixtures and engines on the embedded model.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::sync::Arc;

use engine::load::{cpu_engine, EngineOptions};
use engine::scheduler::EngineCore;
use kernels::cpu::CpuBackend;
use kernels::KvDtype;
use serde::Deserialize;

pub fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data")
}

#[derive(Deserialize, Debug, Clone)]
pub struct TopLogits {
    pub ids: Vec<u32>,
    pub logits: Vec<f32>,
}

#[derive(Deserialize, Debug, Clone)]
pub struct Case {
    pub name: String,
    pub text: String,
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub greedy_text: String,
    pub top_logits: Vec<TopLogits>,
    pub messages: Option<Vec<engine::tokenizer::ChatMessage>>,
}

#[derive(Deserialize, Debug)]
pub struct Reference {
    pub model: String,
    pub reference: String,
    pub cases: Vec<Case>,
}

/// The transformers reference for the embedded model (see tests/data/make_reference.py).
pub fn reference() -> Reference {
    let text = std::fs::read_to_string(data_dir().join("smollm2_reference.json")).expect("fixture");
    serde_json::from_str(&text).expect("fixture parses")
}

/// The reference logits at the last prompt position of a case.
pub fn reference_logits(case: &str) -> Vec<f32> {
    let bytes = std::fs::read(data_dir().join("smollm2_logits").join(format!("{case}.f32"))).expect("fixture");
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Options for test engines: one thread (tests run in parallel), a modest cache.
pub fn test_options() -> EngineOptions {
    EngineOptions { threads: 1, kv_cache_mib: 64, kv_dtype: KvDtype::F16, ..EngineOptions::default() }
}

/// An engine on the embedded model.
pub fn engine(opts: &EngineOptions) -> EngineCore<CpuBackend> {
    cpu_engine(opts).expect("the embedded model loads")
}

/// A gateway on a real loopback socket, serving an engine on the embedded model.
pub struct TestServer {
    pub url: String,
    pub engine: engine::handle::EngineHandle,
    pub state: Arc<router::AppState>,
    pub rt: tokio::runtime::Runtime,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl TestServer {
    pub fn start(opts: &EngineOptions, cfg: router::GatewayConfig, max_in_flight: usize) -> TestServer {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let core = engine(opts);
        let handle = engine::handle::EngineHandle::spawn(core, max_in_flight);
        let state = router::AppState::new(cfg);
        state.set_engine(handle.clone());
        let (tx, rx) = tokio::sync::oneshot::channel();
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let st = state.clone();
        rt.spawn(async move {
            let _ = router::serve(listener, st, async move {
                let _ = rx.await;
            })
            .await;
        });
        TestServer { url, engine: handle, state, rt, stop: Some(tx) }
    }

    /// Starts the gRPC service beside the HTTP one; returns its `http://` address.
    pub fn start_grpc(&self) -> String {
        let listener = self.rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let st = self.state.clone();
        self.rt.spawn(async move {
            let _ = router::grpc::serve(listener, st, std::future::pending()).await;
        });
        url
    }

    /// Waits until the engine holds no KV blocks and runs nothing (or panics after 10 s).
    pub fn wait_idle(&self) {
        let t0 = std::time::Instant::now();
        loop {
            let s = self.engine.stats();
            if s.kv_blocks_used == 0 && s.running == 0 && s.waiting == 0 && self.engine.in_flight() == 0 {
                return;
            }
            assert!(t0.elapsed().as_secs() < 10, "engine not idle: {s:?}, in flight {}", self.engine.in_flight());
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.engine.shutdown();
    }
}

/// A Python with the official `openai` SDK, installed once into a venv under the
/// target directory (the test setup; CI needs only python3 and PyPI access).
pub fn python_with_openai() -> PathBuf {
    const OPENAI: &str = "openai==3.57.0";
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/py-openai");
    let py = dir.join("bin/python");
    let marker = dir.join(format!(".installed-{OPENAI}"));
    std::fs::create_dir_all(dir.parent().unwrap()).unwrap();
    let lock = std::fs::File::create(dir.with_extension("lock")).unwrap();
    lock.lock().unwrap();
    if !marker.exists() {
        let run = |cmd: &mut std::process::Command| {
            let st = cmd.status().expect("python3 runs");
            assert!(st.success(), "{cmd:?} failed");
        };
        run(std::process::Command::new("python3").args(["-m", "venv"]).arg(&dir));
        run(std::process::Command::new(&py).args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            OPENAI,
        ]));
        std::fs::write(&marker, "").unwrap();
    }
    py
}

/// A fake OTLP/gRPC trace collector that keeps every span it receives.
#[derive(Clone, Default)]
pub struct Collector(pub Arc<std::sync::Mutex<Vec<opentelemetry_proto::tonic::trace::v1::Span>>>);

#[tonic::async_trait]
impl opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceService for Collector {
    async fn export(
        &self,
        req: tonic::Request<opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest>,
    ) -> Result<
        tonic::Response<opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse>,
        tonic::Status,
    > {
        let mut spans = self.0.lock().unwrap();
        for rs in req.into_inner().resource_spans {
            for ss in rs.scope_spans {
                spans.extend(ss.spans);
            }
        }
        Ok(tonic::Response::new(Default::default()))
    }
}

impl Collector {
    /// Serves the collector on a loopback port (inside `rt`); returns its endpoint URL.
    pub fn start(&self, rt: &tokio::runtime::Runtime) -> String {
        use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceServiceServer;
        let svc = TraceServiceServer::new(self.clone());
        rt.block_on(async {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(svc)
                    .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l)),
            );
            format!("http://{addr}")
        })
    }
}
