//! The disaggregated roles: `disagg prefill`, `disagg decode`, `disagg router`, and
//! `disagg up`, which runs them all as separate processes on loopback.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use engine::handle::EngineHandle;
use router::cluster::ClusterOptions;
use router::{AppState, GatewayConfig};

use crate::serve::{init_logging, otlp, shutdown_signal};
use crate::EngineArgs;

#[derive(Args, Debug)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// gRPC port (0 picks a free one; the ready line says which).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Requests accepted at once; more get RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 1024)]
    pub max_in_flight: usize,
    /// Serve Prometheus metrics (GET /metrics) on this port (0 picks one).
    #[arg(long)]
    pub metrics_port: Option<u16>,
    /// Register in etcd at this endpoint (e.g. http://127.0.0.1:2379), under a lease.
    #[arg(long)]
    pub etcd: Option<String>,
    /// Host others use to reach this worker (default: --host).
    #[arg(long)]
    pub advertise_host: Option<String>,
    /// Export this worker's spans over OTLP/gRPC to this endpoint.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

impl WorkerArgs {
    fn advertised(&self) -> String {
        self.advertise_host.clone().unwrap_or_else(|| self.host.clone())
    }

    /// Keeps this worker registered in etcd when `--etcd` is given.
    fn register(&self, role: &str, port: u16, engine: &EngineHandle) {
        let Some(ep) = self.etcd.clone() else { return };
        let l = rpc::layout_to_proto(&engine.kv_shape);
        let reg = rpc::discovery::Registration {
            role: role.into(),
            addr: format!("http://{}:{port}", self.advertised()),
            model: rpc::model_identity(&engine.model),
            kv_layout: [l.n_layers, l.block_size, l.n_kv_heads, l.head_dim, l.dtype_bytes],
            kv_blocks_total: engine.limits.n_blocks as u32,
        };
        tokio::spawn(rpc::discovery::register_forever(ep, reg));
    }
}

/// Starts the worker's /metrics server when asked; returns a note for the ready line.
async fn metrics(
    w: &WorkerArgs,
    registry: prometheus::Registry,
    engine: EngineHandle,
    role: &'static str,
) -> anyhow::Result<String> {
    let Some(port) = w.metrics_port else { return Ok(String::new()) };
    let l = worker_listener(&w.host, port).await?;
    let at = l.local_addr()?;
    tokio::spawn(rpc::serve_metrics(l, registry, engine, role));
    Ok(format!(" (metrics http://{at}/metrics)"))
}

#[derive(Args, Debug)]
pub struct DecodeArgs {
    #[command(flatten)]
    pub worker: WorkerArgs,
    /// Port of the KV receiver that prefill workers push into (0 picks one).
    #[arg(long, default_value_t = 0)]
    pub kv_port: u16,
}

/// How the router chooses workers (see router::cluster).
#[derive(Args, Clone, Debug)]
pub struct RoutingArgs {
    /// Worker choice: kv-aware (prefix overlap and load), least-loaded or round-robin.
    #[arg(long, default_value = "kv-aware")]
    pub routing: String,
    /// Randomises kv-aware choices (0: always the cheapest worker, ties round-robin).
    #[arg(long, default_value_t = 0.0)]
    pub router_temperature: f64,
    /// Do not follow the workers' KV events; predict their caches from routing
    /// decisions instead (approximate mode).
    #[arg(long)]
    pub no_kv_events: bool,
}

impl RoutingArgs {
    pub fn options(&self) -> anyhow::Result<router::cluster::RoutingOptions> {
        let policy = self.routing.parse().map_err(|e: String| anyhow::anyhow!("--routing: {e}"))?;
        if !(self.router_temperature >= 0.0 && self.router_temperature.is_finite()) {
            anyhow::bail!("--router-temperature must be a number ≥ 0, got {}", self.router_temperature);
        }
        Ok(router::cluster::RoutingOptions {
            policy,
            temperature: self.router_temperature,
            kv_events: !self.no_kv_events,
            ..Default::default()
        })
    }

    /// These flags as arguments for a child `disagg router`.
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec![
            "--routing".to_string(),
            self.routing.clone(),
            "--router-temperature".into(),
            self.router_temperature.to_string(),
        ];
        if self.no_kv_events {
            v.push("--no-kv-events".into());
        }
        v
    }
}

#[derive(Args, Debug)]
pub struct RouterArgs {
    /// The model to tokenize for; workers must serve the same one.
    #[arg(long, default_value = engine::fetch::EMBEDDED_NAME)]
    pub model: String,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Prefill workers' gRPC addresses (host:port or http://host:port), comma-separated.
    #[arg(long, value_delimiter = ',', num_args = 0..)]
    pub prefill: Vec<String>,
    /// Decode workers' gRPC addresses, comma-separated.
    #[arg(long, value_delimiter = ',', num_args = 0..)]
    pub decode: Vec<String>,
    /// Discover workers in etcd at this endpoint (in addition to any listed).
    #[arg(long)]
    pub etcd: Option<String>,
    /// Prompts shorter than this many tokens are prefilled on the decode worker
    /// (conditional disaggregation); 0 sends every prompt to a prefill worker.
    #[arg(long, default_value_t = 0)]
    pub local_prefill_below: usize,
    #[command(flatten)]
    pub routing: RoutingArgs,
    #[arg(long, env = "DISAGG_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The model name clients use (default: the --model argument).
    #[arg(long)]
    pub served_model_name: Option<String>,
    #[arg(long, default_value_t = 1024)]
    pub max_in_flight: usize,
    /// Also serve the gRPC API (disagg.v1.Inference + health) on this port.
    #[arg(long)]
    pub grpc_port: Option<u16>,
    /// Export traces over OTLP/gRPC to this endpoint; they continue in the workers.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

#[derive(Args, Debug)]
pub struct UpArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Gateway port.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Prefill workers.
    #[arg(long, default_value_t = 1)]
    pub prefill: usize,
    /// Decode workers.
    #[arg(long, default_value_t = 1)]
    pub decode: usize,
    /// See `disagg router --local-prefill-below`.
    #[arg(long, default_value_t = 0)]
    pub local_prefill_below: usize,
    #[command(flatten)]
    pub routing: RoutingArgs,
    /// Use this etcd for discovery. Default: a private etcd on loopback when `etcd` is
    /// installed, else static worker lists.
    #[arg(long)]
    pub etcd: Option<String>,
    /// Do not use etcd (static worker lists).
    #[arg(long)]
    pub no_etcd: bool,
    #[arg(long, env = "DISAGG_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
}

fn grpc_url(a: &str) -> String {
    if a.starts_with("http://") || a.starts_with("https://") {
        a.to_string()
    } else {
        format!("http://{a}")
    }
}

async fn worker_listener(host: &str, port: u16) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind((host, port))
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {host}:{port}: {e}; choose another --port or --host"))
}

fn load(e: &EngineArgs, max_in_flight: usize) -> anyhow::Result<EngineHandle> {
    let opts = e.options()?;
    Ok(engine::load::spawn_engine(&opts, max_in_flight)?)
}

pub fn prefill(a: WorkerArgs) -> anyhow::Result<()> {
    init_logging();
    let engine = load(&a.engine, a.max_in_flight)?;
    let fault: kv_transfer::Fault =
        std::env::var(kernels::env::KV_FAULT).unwrap_or_default().parse().map_err(|e: String| anyhow::anyhow!(e))?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let listener = worker_listener(&a.host, a.port).await?;
        let addr = listener.local_addr()?;
        let mut svc = prefill_node::PrefillService::new(engine.clone(), fault);
        let tel = otlp(&a.otlp_endpoint, "disagg-prefill")?.map(Arc::new);
        if let Some(t) = &tel {
            svc = svc.with_telemetry(t.clone());
        }
        a.register("prefill", addr.port(), &engine);
        let note = metrics(&a, svc.metrics.registry.clone(), engine, "prefill").await?;
        serve_worker(listener, svc.into_server(), tel, format!("disagg prefill worker ready at http://{addr}{note}"))
            .await
    })
}

/// Serves a worker's gRPC service (with grpc.health.v1) until Ctrl-C/SIGTERM, after
/// printing its ready line; then flushes its traces.
async fn serve_worker<S>(
    listener: tokio::net::TcpListener,
    svc: S,
    tel: Option<Arc<rpc::telemetry::Telemetry>>,
    ready: String,
) -> anyhow::Result<()>
where
    S: tonic::codegen::Service<
            tonic::codegen::http::Request<tonic::body::Body>,
            Response = tonic::codegen::http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<S>().await;
    println!("{ready}");
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(svc)
        .serve_with_incoming_shutdown(router::grpc::incoming(listener), shutdown_signal())
        .await?;
    if let Some(t) = tel {
        t.shutdown();
    }
    Ok(())
}

pub fn decode(a: DecodeArgs) -> anyhow::Result<()> {
    init_logging();
    let w = a.worker;
    let engine = load(&w.engine, w.max_in_flight)?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let listener = worker_listener(&w.host, w.port).await?;
        let addr = listener.local_addr()?;
        let receiver = kv_transfer::KvReceiver::bind(&format!("{}:{}", w.host, a.kv_port)).await.map_err(|e| {
            anyhow::anyhow!("cannot listen on {}:{} for KV: {e}; choose another --kv-port", w.host, a.kv_port)
        })?;
        let kv_host = w.advertised();
        let kv_addr = receiver.local_addr();
        let mut svc = decode_node::DecodeService::new(engine.clone(), Arc::new(receiver), &kv_host);
        let tel = otlp(&w.otlp_endpoint, "disagg-decode")?.map(Arc::new);
        if let Some(t) = &tel {
            svc = svc.with_telemetry(t.clone());
        }
        w.register("decode", addr.port(), &engine);
        let note = metrics(&w, svc.metrics.registry.clone(), engine, "decode").await?;
        let ready = format!("disagg decode worker ready at http://{addr} (KV receiver {kv_addr}){note}");
        serve_worker(listener, svc.into_server(), tel, ready).await
    })
}

pub fn router(a: RouterArgs) -> anyhow::Result<()> {
    init_logging();
    if a.decode.is_empty() && a.etcd.is_none() {
        anyhow::bail!("give at least one decode worker with --decode HOST:PORT, or --etcd URL to discover them");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port)).await.map_err(|e| {
            anyhow::anyhow!("cannot listen on {}:{}: {e}; choose another --port or --host", a.host, a.port)
        })?;
        let addr = listener.local_addr()?;
        let cfg = GatewayConfig {
            served_model_name: a.served_model_name.clone().unwrap_or_else(|| a.model.clone()),
            api_key: a.api_key.clone().filter(|k| !k.is_empty()),
            spin: router::spin_default(false).map_err(anyhow::Error::msg)?,
            ..GatewayConfig::default()
        };
        let state = AppState::new(cfg);
        if let Some(t) = otlp(&a.otlp_endpoint, "disagg-router")? {
            let _ = state.telemetry.set(t);
        }
        let server = tokio::spawn(router::serve(listener, state.clone(), shutdown_signal()));
        if let Some(port) = a.grpc_port {
            let gl = tokio::net::TcpListener::bind((a.host.as_str(), port)).await?;
            println!("disagg gRPC at {}", gl.local_addr()?);
            tokio::spawn(router::grpc::serve(gl, state.clone(), shutdown_signal()));
        }
        let prefill: Vec<String> = a.prefill.iter().map(|x| grpc_url(x)).collect();
        let decode: Vec<String> = a.decode.iter().map(|x| grpc_url(x)).collect();
        // With etcd: start from what is registered (waiting for a decode worker), then
        // follow it.
        let (mut discovered_prefill, mut discovered_decode) = (Vec::new(), Vec::new());
        let mut etcd_events = None;
        let mut from_etcd = std::collections::HashSet::new();
        if let Some(ep) = a.etcd.clone() {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            tokio::spawn(rpc::discovery::watch_forever(ep.clone(), move |e| {
                let _ = tx.send(e);
            }));
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            let mut known: Vec<rpc::discovery::Registration> = Vec::new();
            while !known.iter().any(|r| r.role == "decode") && decode.is_empty() {
                match tokio::time::timeout_at(deadline, rx.recv()).await {
                    Ok(Some(rpc::discovery::Event::Sync(all))) => known = all,
                    Ok(Some(rpc::discovery::Event::Put(r))) => known.push(r),
                    Ok(Some(rpc::discovery::Event::Delete(role, addr))) => {
                        known.retain(|r| !(r.role == role && r.addr == addr))
                    }
                    Ok(None) | Err(_) => anyhow::bail!("no decode worker registered in etcd at {ep} within 60 s"),
                }
            }
            for r in known {
                let (listed, found) = if r.role == "decode" {
                    (&decode, &mut discovered_decode)
                } else {
                    (&prefill, &mut discovered_prefill)
                };
                if !listed.contains(&r.addr) && !found.contains(&r.addr) {
                    found.push(r.addr.clone());
                    from_etcd.insert((r.role, r.addr));
                }
            }
            etcd_events = Some(rx);
        }
        let opts = ClusterOptions {
            model: a.model.clone(),
            prefill,
            decode,
            discovered_prefill,
            discovered_decode,
            local_prefill_below: a.local_prefill_below,
            routing: a.routing.options()?,
            max_in_flight: a.max_in_flight,
            wait: Duration::from_secs(60),
        };
        let (handle, cluster) = router::cluster::connect(&opts).await.map_err(|e| anyhow::anyhow!(e))?;
        if let Some(rx) = etcd_events {
            tokio::spawn(router::cluster::follow_etcd(cluster, rx, from_etcd));
        }
        state.set_engine(handle);
        println!("disagg serving '{}' at http://{addr}/v1", state.cfg.served_model_name);
        server.await??;
        if let Some(t) = state.telemetry.get() {
            t.shutdown();
        }
        Ok(())
    })
}

/// A child process of `disagg up` and what it is.
pub(crate) struct Proc {
    name: String,
    child: Child,
}

/// How `disagg up` starts a worker again after it exits: the same arguments at the
/// address it first got, so the router (its static list or etcd) finds it where it was.
struct Respawn {
    args: Vec<String>,
    marker: &'static str,
    exits: Restarts,
    /// When it was last ready (its uptime at an exit).
    ready_at: std::time::Instant,
    /// While it starts again: its ready line's channel and the time it has to send it.
    starting: Option<(mpsc::Receiver<String>, std::time::Instant)>,
}

/// A worker that exits within `RESTART_WINDOW` of its start this many times in a row
/// is not started again: the cluster stops instead of looping on a crash.
const MAX_RESTARTS: usize = 3;
const RESTART_WINDOW: Duration = Duration::from_secs(60);

/// A worker's exits in a row that came soon after its start.
#[derive(Default)]
struct Restarts {
    quick: usize,
}

impl Restarts {
    /// Records an exit after `uptime`; false when it is the `MAX_RESTARTS`+1-th quick
    /// exit in a row (a worker that ran `RESTART_WINDOW` or longer starts the count over).
    fn allow(&mut self, uptime: Duration) -> bool {
        self.quick = if uptime < RESTART_WINDOW { self.quick + 1 } else { 0 };
        self.quick <= MAX_RESTARTS
    }
}

/// The port of a ready line's `http://host:port` address.
fn port_of(url: &str) -> anyhow::Result<u16> {
    url.rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no port in the address {url:?}"))
}

/// Has the child get SIGTERM when this process ends, however it ends: a killed `disagg up`
/// leaves no worker holding a GPU's memory, nor an etcd its port. (The signal follows the
/// thread that spawned the child; every caller spawns from the main thread, which lives as
/// long as the process.) The crate's one `unsafe` outside the allocator: `pre_exec`.
#[allow(unsafe_code)]
fn dies_with_parent(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe, and the closure touches nothing else.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

/// Starts `disagg ARGS…` and waits for its ready line (the one containing `marker`);
/// returns the process and that line. Later output is passed through.
pub(crate) fn spawn_role(
    name: &str,
    args: &[String],
    marker: &str,
    timeout: Duration,
) -> anyhow::Result<(Proc, String)> {
    let (mut p, rx) = start_role(name, args, marker)?;
    match rx.recv_timeout(timeout) {
        Ok(line) => Ok((p, line)),
        Err(_) => {
            let status = p.child.try_wait()?;
            let _ = p.child.kill();
            let _ = p.child.wait();
            match status {
                Some(s) => anyhow::bail!("the {name} exited before it was ready ({s}); its error is above"),
                None => anyhow::bail!("the {name} was not ready within {} s", timeout.as_secs()),
            }
        }
    }
}

/// Starts `disagg ARGS…`; its ready line (the one containing `marker`) comes on the
/// returned channel, its other output is passed through.
fn start_role(name: &str, args: &[String], marker: &str) -> anyhow::Result<(Proc, mpsc::Receiver<String>)> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped());
    let mut child = dies_with_parent(&mut cmd).spawn()?;
    let out = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    let marker = marker.to_string();
    let label = name.to_string();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if !sent && line.contains(&marker) {
                let _ = tx.send(line);
                sent = true;
            } else {
                eprintln!("[{label}] {line}");
            }
        }
    });
    Ok((Proc { name: name.to_string(), child }, rx))
}

pub(crate) fn url_in(line: &str) -> anyhow::Result<String> {
    line.split_whitespace()
        .find(|w| w.starts_with("http://"))
        .map(|w| w.trim_end_matches("/v1").to_string())
        .ok_or_else(|| anyhow::anyhow!("no address in the ready line {line:?}"))
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Starts a private etcd on loopback (temporary data directory) when `etcd` is
/// installed; returns it with its client URL.
fn start_etcd() -> anyhow::Result<Option<(Proc, String, std::path::PathBuf)>> {
    if Command::new("etcd").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_err() {
        return Ok(None);
    }
    let (client, peer) = (free_port()?, free_port()?);
    let dir = std::env::temp_dir().join(format!("disagg-etcd-{}-{client}", std::process::id()));
    let c = format!("http://127.0.0.1:{client}");
    let p = format!("http://127.0.0.1:{peer}");
    let mut cmd = Command::new("etcd");
    cmd.args(["--name", "disagg", "--data-dir"])
        .arg(&dir)
        .args(["--listen-client-urls", &c, "--advertise-client-urls", &c])
        .args(["--listen-peer-urls", &p, "--initial-advertise-peer-urls", &p])
        .args(["--initial-cluster", &format!("disagg={p}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let child = dies_with_parent(&mut cmd).spawn()?;
    let mut proc = Proc { name: "etcd".into(), child };
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while std::net::TcpStream::connect(("127.0.0.1", client)).is_err() {
        if std::time::Instant::now() > deadline || proc.child.try_wait()?.is_some() {
            let _ = proc.child.kill();
            anyhow::bail!("the private etcd did not start (data dir {}); pass --etcd URL or --no-etcd", dir.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(Some((proc, c, dir)))
}

pub(crate) fn stop_all(procs: &mut [Proc]) {
    for p in procs.iter_mut() {
        // SIGTERM first, so servers shut down cleanly; SIGKILL after a grace period.
        let _ = Command::new("kill").arg("-TERM").arg(p.child.id().to_string()).status();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    for p in procs.iter_mut() {
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = p.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = p.child.kill();
        let _ = p.child.wait();
    }
}

/// How long a worker may take from its start to its ready line (model load included).
const WORKER_START: Duration = Duration::from_secs(300);

pub fn up(a: UpArgs) -> anyhow::Result<()> {
    if a.decode == 0 {
        anyhow::bail!("--decode must be at least 1");
    }
    let opts = a.engine.options()?;
    // Fetch the model once, before workers race for it.
    engine::load::resolve(&opts.model)?;
    let workers = a.prefill + a.decode;
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let threads = if a.engine.threads > 0 { a.engine.threads } else { (cores / workers).max(1) };
    // On one GPU the workers share vLLM's default fraction of its memory (each worker's
    // fraction is its own), unless the cache's size was given.
    let mut e = a.engine.clone();
    if opts.gpu_memory_utilization.is_some() && e.gpu_memory_utilization.is_none() && e.kv_cache_mib.is_none() {
        let share = crate::GPU_MEMORY_UTILIZATION_DEFAULT / workers as f64;
        eprintln!("disagg up: {workers} workers on {}, each at --gpu-memory-utilization {share:.3}", e.device);
        e.gpu_memory_utilization = Some(share);
    }
    let e = &e;
    let engine_args = e.to_args(threads);
    let mut procs: Vec<Proc> = Vec::new();
    let mut etcd_dir = None;
    let etcd = match (&a.etcd, a.no_etcd) {
        (_, true) => None,
        (Some(ep), false) => Some(ep.clone()),
        (None, false) => match start_etcd()? {
            Some((p, url, dir)) => {
                eprintln!("disagg up: private etcd at {url}");
                procs.push(p);
                etcd_dir = Some(dir);
                Some(url)
            }
            None => None,
        },
    };
    let with_etcd = |mut args: Vec<String>| {
        if let Some(ep) = &etcd {
            args.extend(["--etcd".to_string(), ep.clone()]);
        }
        args
    };
    // Per process in `procs`: how to start it again when it exits (workers only).
    let mut respawn: Vec<Option<Respawn>> = procs.iter().map(|_| None).collect();
    let result = (|| -> anyhow::Result<String> {
        let (mut prefill, mut decode) = (Vec::new(), Vec::new());
        let roles = [("prefill", a.prefill, "prefill worker ready"), ("decode", a.decode, "decode worker ready")];
        for (role, n, marker) in roles {
            for i in 0..n {
                let mut args = vec![role.to_string(), "--port".into(), "0".into()];
                args.extend(engine_args.iter().cloned());
                let mut args = with_etcd(args);
                let (p, line) = spawn_role(&format!("{role}-{i}"), &args, marker, WORKER_START)?;
                let url = url_in(&line)?;
                args[2] = port_of(&url)?.to_string();
                procs.push(p);
                let ready_at = std::time::Instant::now();
                respawn.push(Some(Respawn { args, marker, exits: Restarts::default(), ready_at, starting: None }));
                if role == "prefill" { &mut prefill } else { &mut decode }.push(url);
            }
        }
        let mut args = vec![
            "router".to_string(),
            "--model".into(),
            e.model.clone(),
            "--port".into(),
            a.port.to_string(),
            "--local-prefill-below".into(),
            a.local_prefill_below.to_string(),
        ];
        args.extend(a.routing.to_args());
        // With etcd the router discovers the workers; without, it gets the lists.
        if etcd.is_none() {
            args.extend(["--decode".into(), decode.join(",")]);
            if !prefill.is_empty() {
                args.extend(["--prefill".into(), prefill.join(",")]);
            }
        }
        let mut args = with_etcd(args);
        if let Some(k) = &a.api_key {
            args.push("--api-key".into());
            args.push(k.clone());
        }
        let (p, line) = spawn_role("router", &args, "disagg serving", Duration::from_secs(120))?;
        procs.push(p);
        respawn.push(None);
        url_in(&line)
    })();
    let url = match result {
        Ok(u) => u,
        Err(e) => {
            stop_all(&mut procs);
            if let Some(d) = &etcd_dir {
                let _ = std::fs::remove_dir_all(d);
            }
            return Err(e);
        }
    };
    println!(
        "disagg cluster up: {} prefill + {} decode workers ({threads} threads each), router pid {}",
        a.prefill,
        a.decode,
        procs.last().map(|p| p.child.id()).unwrap_or(0)
    );
    println!("disagg serving '{}' at {url}/v1", e.model);
    // Stop everything on Ctrl-C / SIGTERM, or when the router or etcd dies, or a worker
    // exits too often; a worker that exits is started again at its address (the router
    // retries its failed requests elsewhere meanwhile, and reads its KV events afresh).
    let (stop_tx, stop_rx) = mpsc::channel::<String>();
    {
        let tx = stop_tx.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(shutdown_signal());
            let _ = tx.send(String::new());
        });
    }
    let reason = loop {
        if let Ok(r) = stop_rx.recv_timeout(Duration::from_millis(200)) {
            break r;
        }
        let mut died = None;
        for (p, again) in procs.iter_mut().zip(respawn.iter_mut()) {
            // A worker starting again: ready yet? (Not waited for here, so that Ctrl-C
            // and the other processes are still watched meanwhile.)
            if let Some(r) = again.as_mut() {
                if let Some((rx, deadline)) = &r.starting {
                    match rx.try_recv() {
                        Ok(line) => {
                            eprintln!("disagg up: {} started again (pid {}): {line}", p.name, p.child.id());
                            r.starting = None;
                            r.ready_at = std::time::Instant::now();
                        }
                        Err(_) if std::time::Instant::now() > *deadline => {
                            died = Some(format!(
                                "the {} was not ready within {} s of its restart",
                                p.name,
                                WORKER_START.as_secs()
                            ));
                            break;
                        }
                        Err(_) => {}
                    }
                }
            }
            let Ok(Some(status)) = p.child.try_wait() else { continue };
            let what = format!("the {} (pid {}) exited: {status}", p.name, p.child.id());
            let Some(r) = again else {
                died = Some(what);
                break;
            };
            let uptime = if r.starting.is_some() { Duration::ZERO } else { r.ready_at.elapsed() };
            if !r.exits.allow(uptime) {
                died = Some(format!(
                    "{what}; its last {} exits each came within {} s of its start",
                    MAX_RESTARTS + 1,
                    RESTART_WINDOW.as_secs()
                ));
                break;
            }
            eprintln!("disagg up: {what}; starting it again");
            match start_role(&p.name, &r.args, r.marker) {
                Ok((q, rx)) => {
                    *p = q;
                    r.starting = Some((rx, std::time::Instant::now() + WORKER_START));
                }
                Err(e) => {
                    died = Some(format!("{what}, and could not be started again: {e}"));
                    break;
                }
            }
        }
        if let Some(d) = died {
            break d;
        }
    };
    stop_all(&mut procs);
    if let Some(d) = &etcd_dir {
        let _ = std::fs::remove_dir_all(d);
    }
    if reason.is_empty() {
        println!("disagg cluster stopped");
        Ok(())
    } else {
        anyhow::bail!("{reason}; stopped the cluster")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_is_started_again_until_it_exits_soon_after_its_start_too_often() {
        let mut r = Restarts::default();
        let soon = Duration::from_secs(5);
        for i in 0..MAX_RESTARTS {
            assert!(r.allow(soon), "quick exit {i}");
        }
        assert!(!r.allow(soon), "one quick exit too many in a row");
        // A worker that ran a while starts the count over.
        let mut r = Restarts::default();
        for _ in 0..10 {
            assert!(r.allow(soon));
            assert!(r.allow(soon));
            assert!(r.allow(RESTART_WINDOW));
        }
    }

    #[test]
    fn the_port_comes_from_the_ready_address() {
        assert_eq!(port_of("http://127.0.0.1:40053").unwrap(), 40053);
        assert_eq!(port_of("http://[::1]:8000/").unwrap(), 8000);
        assert!(port_of("http://127.0.0.1").is_err());
    }
}
