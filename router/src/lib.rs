//! The router: the OpenAI-compatible HTTP gateway in front of the engine.
//!
//! Today it serves one engine in the same process (`disagg serve`, aggregated mode).
//! The disaggregated path (prefill and decode workers) plugs in behind the same
//! handlers: they talk to an [`EngineHandle`]-shaped backend, not to the engine.
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions` (both with `stream`),
//! `GET /v1/models`, `POST /tokenize`, `POST /detokenize`, `GET /health`, `GET /metrics`.
//! Every error is OpenAI's JSON error shape (see [`error`]).

pub mod cluster;
pub mod error;
pub mod grpc;
pub(crate) mod handlers;
pub mod kv_index;
pub mod metrics;
pub mod openai;
/// OTLP traces (shared with the workers; see `rpc::telemetry`).
pub use rpc::telemetry;

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use engine::handle::EngineHandle;
use subtle::ConstantTimeEq;

pub use error::ApiError;

#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// The name clients put in `model`.
    pub served_model_name: String,
    /// When set, `/v1/*`, `/tokenize` and `/detokenize` need `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// Keep a per-request timing record (for `disagg bench serve`).
    pub record_timings: bool,
    /// A task keeps a runtime worker awake while requests are answered ([`spin_choice`]).
    pub spin: bool,
}

/// Inside a request's time before submission (`disagg bench serve`): when its body had
/// been read (before that: waiting for the client's bytes), parsed and checked, and
/// tokenized; and the handler thread's resource use from the body read to submission,
/// which tells a stall's kind apart (on the CPU, preempted, blocked, faulting).
#[derive(Clone, Copy, Debug)]
pub struct InProbe {
    pub body_read: std::time::Instant,
    pub parsed: std::time::Instant,
    pub tokenized: std::time::Instant,
    /// The thread's use at the body read and at submission (None where unavailable).
    pub usage_read: Option<ThreadUsage>,
    pub usage_submitted: Option<ThreadUsage>,
}

/// The calling thread's resource use so far: CPU time (`CLOCK_THREAD_CPUTIME_ID`, exact;
/// getrusage's lags by up to a tick), page faults and context switches
/// (`getrusage(RUSAGE_THREAD)`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ThreadUsage {
    pub cpu_s: f64,
    pub minor_faults: u64,
    pub major_faults: u64,
    /// Switches away while waiting (a lock, I/O, a page brought in) and forced ones
    /// (preempted by another task).
    pub voluntary_switches: u64,
    pub involuntary_switches: u64,
}

impl ThreadUsage {
    #[cfg(target_os = "linux")]
    pub fn now() -> Option<ThreadUsage> {
        // SAFETY: getrusage writes the struct it is given and nothing else.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) } != 0 {
            return None;
        }
        let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes the struct it is given.
        if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
            return None;
        }
        Some(ThreadUsage {
            cpu_s: t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9,
            minor_faults: u.ru_minflt as u64,
            major_faults: u.ru_majflt as u64,
            voluntary_switches: u.ru_nvcsw as u64,
            involuntary_switches: u.ru_nivcsw as u64,
        })
    }

    #[cfg(not(target_os = "linux"))]
    pub fn now() -> Option<ThreadUsage> {
        None
    }

    /// What was used from `self` to `later` (same thread).
    pub fn until(&self, later: &ThreadUsage) -> ThreadUsage {
        ThreadUsage {
            cpu_s: later.cpu_s - self.cpu_s,
            minor_faults: later.minor_faults.saturating_sub(self.minor_faults),
            major_faults: later.major_faults.saturating_sub(self.major_faults),
            voluntary_switches: later.voluntary_switches.saturating_sub(self.voluntary_switches),
            involuntary_switches: later.involuntary_switches.saturating_sub(self.involuntary_switches),
        }
    }
}

/// When one request passed the gateway's and the engine's milestones (same clock).
#[derive(Clone, Debug)]
pub struct RequestTiming {
    /// The response id (`cmpl-…`, `chatcmpl-…`).
    pub id: String,
    /// The handler started.
    pub arrival: std::time::Instant,
    /// The engine accepted the request.
    pub submitted: std::time::Instant,
    /// The engine produced the first output that carried text; the gateway had its
    /// event bytes ready.
    pub engine_first_text: std::time::Instant,
    /// When the engine's loop (or the delivery task) handed that output to the request's
    /// stream, and when the handler took it from there: "first_out" is engine → handed
    /// (the send loop) → taken (the handler's wake) → emitted (its shaping of the bytes).
    pub sent_first_text: std::time::Instant,
    pub polled_first_text: std::time::Instant,
    pub emit_first_text: std::time::Instant,
    /// The same for the second output that carried text (None for a one-token answer):
    /// tells a request's first output's delivery apart from any early one's.
    pub second_text: Option<(std::time::Instant, std::time::Instant)>,
    /// The engine produced the last output; the gateway had the final event ready.
    pub engine_finish: std::time::Instant,
    /// The same split for the last output.
    pub sent_finish: std::time::Instant,
    pub polled_finish: std::time::Instant,
    pub emit_finish: std::time::Instant,
    /// Inside the time before submission (the HTTP handlers; None elsewhere).
    pub in_probe: Option<InProbe>,
}

impl RequestTiming {
    /// Time this request spent in the gateway rather than in the engine: parsing,
    /// tokenization and validation before submission, plus shaping the last output.
    pub fn gateway_e2e_s(&self) -> f64 {
        self.submitted.duration_since(self.arrival).as_secs_f64()
            + self.emit_finish.duration_since(self.engine_finish).as_secs_f64()
    }

    /// The same for the first token.
    pub fn gateway_first_token_s(&self) -> f64 {
        self.submitted.duration_since(self.arrival).as_secs_f64()
            + self.emit_first_text.duration_since(self.engine_first_text).as_secs_f64()
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            served_model_name: engine::fetch::EMBEDDED_NAME.into(),
            api_key: None,
            max_body_bytes: 4 << 20,
            record_timings: false,
            spin: false,
        }
    }
}

pub struct AppState {
    engine: OnceLock<EngineHandle>,
    pub cfg: GatewayConfig,
    pub metrics: metrics::Metrics,
    created: u64,
    /// Filled when `cfg.record_timings` is set.
    pub timings: std::sync::Mutex<Vec<RequestTiming>>,
    /// Set when traces are exported.
    pub telemetry: OnceLock<telemetry::Telemetry>,
    /// Requests being answered, for the spinning task (`DISAGG_GATEWAY_SPIN`).
    pub(crate) spin: Arc<Spin>,
}

/// `1`: while any request is being answered, a task of the gateway's runtime yields in a
/// loop, so one worker thread stays awake and takes an engine output's wake from its
/// queue instead of a parked worker being woken for it; `0`: never. Unset: see
/// [`spin_choice`].
pub const SPIN_ENV: &str = "DISAGG_GATEWAY_SPIN";

/// Fewest cores with which the gateway spins by default: the engine's thread, the
/// spinning worker, and cores to spare for the other workers and tokenization.
pub const SPIN_MIN_CORES: usize = 4;

/// Whether the gateway spins ([`SPIN_ENV`]'s value `env`, if set, decides). By default
/// it does when the engine runs on a GPU and the machine has [`SPIN_MIN_CORES`]: on the
/// 16-core H200 host it cut the handler's wake (first output p99 0.16-0.18 → 0.010-0.015
/// ms at one stream) and every run kept the added p99 under 1 ms, at no loss of tokens/s
/// (docs/PERF.md); a CPU engine needs the cores (on the 2-core VM it lost 77-90% of its
/// tokens/s to the spinning worker), and a cluster's router has no engine beside it.
pub fn spin_choice(env: Option<&str>, engine_on_gpu: bool, cores: usize) -> Result<bool, String> {
    match env {
        Some("1") => Ok(true),
        Some("0") => Ok(false),
        Some(v) => Err(format!("{SPIN_ENV}={v}: give 1 (spin) or 0 (never), or unset it for the default")),
        None => Ok(engine_on_gpu && cores >= SPIN_MIN_CORES),
    }
}

/// [`spin_choice`] for this process and machine.
pub fn spin_default(engine_on_gpu: bool) -> Result<bool, String> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    spin_choice(std::env::var(SPIN_ENV).ok().as_deref(), engine_on_gpu, cores)
}

/// The count of requests being answered and the spinning task's wake-up.
#[derive(Default)]
pub(crate) struct Spin {
    streams: std::sync::atomic::AtomicUsize,
    idle: tokio::sync::Notify,
}

impl Spin {
    /// Counts a request until the guard drops.
    pub(crate) fn enter(self: &Arc<Spin>) -> SpinGuard {
        if self.streams.fetch_add(1, std::sync::atomic::Ordering::AcqRel) == 0 {
            self.idle.notify_one();
        }
        SpinGuard(self.clone())
    }

    /// Yields in a loop while requests are counted; waits for the first otherwise.
    async fn run(&self) {
        loop {
            if self.streams.load(std::sync::atomic::Ordering::Acquire) == 0 {
                // (A request counted between the load and here leaves a permit.)
                self.idle.notified().await;
            } else {
                tokio::task::yield_now().await;
            }
        }
    }
}

/// One request counted by [`Spin`].
pub(crate) struct SpinGuard(Arc<Spin>);

impl Drop for SpinGuard {
    fn drop(&mut self) {
        self.0.streams.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

impl AppState {
    pub fn new(cfg: GatewayConfig) -> Arc<AppState> {
        Arc::new(AppState {
            engine: OnceLock::new(),
            metrics: metrics::Metrics::new(&cfg.served_model_name),
            cfg,
            created: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            timings: Default::default(),
            telemetry: OnceLock::new(),
            spin: Default::default(),
        })
    }

    /// Makes the gateway ready: from now on requests go to `engine` (the first one set).
    /// With `DISAGG_OUTPUT_TASK=1`, its outputs are delivered by a task on the runtime
    /// this is called in ([`EngineHandle::deliver_on`]).
    pub fn set_engine(&self, engine: EngineHandle) {
        if self.engine.set(engine).is_ok() && engine::handle::output_task_wanted() {
            if let (Ok(rt), Some(e)) = (tokio::runtime::Handle::try_current(), self.engine.get()) {
                e.deliver_on(&rt);
            }
        }
    }

    pub fn engine(&self) -> Result<&EngineHandle, ApiError> {
        self.engine.get().ok_or_else(|| ApiError::unavailable("the model is still loading; retry shortly"))
    }
}

/// The HTTP application.
pub fn app(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(handlers::health))
        .route("/metrics", get(handlers::metrics))
        .route("/v1/models", get(handlers::models))
        .route("/v1/chat/completions", post(handlers::chat))
        .route("/v1/completions", post(handlers::completions))
        .route("/tokenize", post(handlers::tokenize))
        .route("/detokenize", post(handlers::detokenize))
        .fallback(|req: Request| async move { ApiError::not_found(req.uri().path()) })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

/// API-key check (constant-time) and error accounting, around every route.
async fn guard(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let protected = path.starts_with("/v1/") || path == "/tokenize" || path == "/detokenize";
    if let (true, Some(key)) = (protected, &s.cfg.api_key) {
        let given = req
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        // Compare equal-length digests so neither content nor length leaks through timing.
        let ok: bool = digest(given.as_bytes()).ct_eq(&digest(key.as_bytes())).into();
        if !ok {
            s.metrics.http_errors.with_label_values(&["401"]).inc();
            return ApiError::unauthorized().into_response();
        }
    }
    let resp = next.run(req).await;
    if resp.status().as_u16() >= 400 {
        s.metrics.http_errors.with_label_values(&[resp.status().as_str()]).inc();
    }
    resp
}

/// SHA-256 of the key: comparing digests in constant time leaks neither the content
/// nor the length of the configured key.
fn digest(b: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(b).into()
}

/// Serves `app` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    // Streamed tokens are small writes: without TCP_NODELAY, Nagle's algorithm and the
    // peer's delayed ACKs hold them back by ~40 ms on a kept-alive connection.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    if state.cfg.spin {
        let spin = state.spin.clone();
        tokio::spawn(async move { spin.run().await });
    }
    axum::serve(listener, app(state).into_make_service_with_connect_info::<SocketAddr>())
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gateway_spins_beside_a_gpu_engine_with_cores_to_spare_unless_told() {
        assert_eq!(spin_choice(None, true, 16), Ok(true));
        assert_eq!(spin_choice(None, true, SPIN_MIN_CORES - 1), Ok(false));
        assert_eq!(spin_choice(None, false, 16), Ok(false));
        assert_eq!(spin_choice(Some("0"), true, 16), Ok(false));
        assert_eq!(spin_choice(Some("1"), false, 2), Ok(true));
        let e = spin_choice(Some("yes"), true, 16).unwrap_err();
        assert!(e.contains("DISAGG_GATEWAY_SPIN=yes") && e.contains("give 1"), "{e}");
    }

    #[test]
    fn the_spinning_task_counts_each_request_until_it_ends() {
        let spin = Arc::<Spin>::default();
        let count = || spin.streams.load(std::sync::atomic::Ordering::Acquire);
        let (a, b) = (spin.enter(), spin.enter());
        assert_eq!(count(), 2);
        drop(a);
        assert_eq!(count(), 1);
        drop(b);
        assert_eq!(count(), 0);
    }
}
