//! The router's disaggregated path: requests go to a decode worker, which has a
//! prefill worker fill its KV (see decode-node). Implements
//! [`engine::handle::RemoteEngine`], so the gateway's handlers serve a cluster exactly
//! as they serve a local engine.
//!
//! Choice of workers (until the KV-aware policy of the prefix-caching issue): the
//! healthy worker of each role with the fewest requests in flight from this router,
//! ties broken round-robin. Prompts shorter than `local_prefill_below` tokens are
//! prefilled on the decode worker itself (conditional disaggregation; 0 disables).
//!
//! Failures: a call that fails before its first token (decode worker unreachable or
//! out of blocks, prefill worker or transfer failed) is retried on other workers, up
//! to [`MAX_ATTEMPTS`] times; once a token was sent, a failure ends the request with
//! an error (the client saw part of the answer). When every decode worker is out of
//! KV blocks, a request waits (backing off up to [`QUEUE_LIMIT`]) instead of failing.
//! Workers are polled for their state
//! every [`POLL`]; one that does not answer is skipped until it does again.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use engine::handle::{Outputs, RemoteEngine, StreamItem};
use engine::sampling::SamplingParams;
use engine::scheduler::{EngineStats, RequestId};
use proto::v1::decode_worker_client::DecodeWorkerClient;
use proto::v1::prefill_worker_client::PrefillWorkerClient;
use proto::v1::{DecodeRequest, WorkerInfo, WorkerInfoRequest};
use tonic::transport::Channel;

pub const MAX_ATTEMPTS: usize = 3;
/// How long a request waits for KV blocks when every decode worker is full.
pub const QUEUE_LIMIT: Duration = Duration::from_secs(60);
pub const POLL: Duration = Duration::from_millis(500);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// One worker as the router sees it.
pub struct Worker {
    /// gRPC address, `http://host:port`.
    pub addr: String,
    pub role: Role,
    channel: Channel,
    in_flight: AtomicUsize,
    healthy: AtomicBool,
    pub info: Mutex<Option<WorkerInfo>>,
}

impl Worker {
    fn new(addr: &str, role: Role) -> Result<Worker, String> {
        let channel = Channel::from_shared(addr.to_string())
            .map_err(|e| format!("worker address {addr:?}: {e}"))?
            .connect_timeout(Duration::from_secs(2))
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(10))
            .keep_alive_while_idle(true)
            .tcp_nodelay(true)
            .connect_lazy();
        Ok(Worker {
            addr: addr.to_string(),
            role,
            channel,
            in_flight: AtomicUsize::new(0),
            healthy: AtomicBool::new(false),
            info: Mutex::new(None),
        })
    }

    async fn fetch_info(&self) -> Result<WorkerInfo, tonic::Status> {
        let call = async {
            match self.role {
                Role::Prefill => PrefillWorkerClient::new(self.channel.clone()).info(WorkerInfoRequest {}).await,
                Role::Decode => DecodeWorkerClient::new(self.channel.clone()).info(WorkerInfoRequest {}).await,
            }
        };
        match tokio::time::timeout(Duration::from_secs(2), call).await {
            Ok(r) => r.map(|r| r.into_inner()),
            Err(_) => Err(tonic::Status::deadline_exceeded("worker info timed out")),
        }
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }
}

/// Counts a request against a worker while it is alive.
struct InFlight(Arc<Worker>);
impl InFlight {
    fn new(w: &Arc<Worker>) -> Self {
        w.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(w.clone())
    }
}
impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What every worker must match: model identity and KV layout (the reference is the
/// first worker accepted, or what the router was started with).
#[derive(Clone, Debug, PartialEq)]
pub struct Compat {
    pub model: String,
    pub kv_layout: proto::v1::KvLayout,
}

pub struct Cluster {
    workers: RwLock<Vec<Arc<Worker>>>,
    compat: Mutex<Option<Compat>>,
    /// Round-robin counters, one per role (a shared one would advance by two per
    /// request and always land on the same decode worker of two).
    rr: [AtomicUsize; 2],
    pub local_prefill_below: usize,
}

impl Cluster {
    pub fn new(local_prefill_below: usize) -> Arc<Cluster> {
        Arc::new(Cluster {
            workers: RwLock::new(Vec::new()),
            compat: Mutex::new(None),
            rr: [AtomicUsize::new(0), AtomicUsize::new(0)],
            local_prefill_below,
        })
    }

    pub fn workers(&self) -> Vec<Arc<Worker>> {
        self.workers.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn compat(&self) -> Option<Compat> {
        self.compat.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Adds a worker after asking for its info: one serving another model or another
    /// KV layout is refused with the reason. Re-adding a known address refreshes it.
    /// Returns the worker and whether it was new.
    pub async fn add(&self, addr: &str, role: Role) -> Result<(Arc<Worker>, bool), String> {
        if let Some(w) = self.workers().into_iter().find(|w| w.addr == addr && w.role == role) {
            return Ok((w, false));
        }
        let w = Arc::new(Worker::new(addr, role)?);
        let info = w
            .fetch_info()
            .await
            .map_err(|e| format!("{} worker {addr} did not answer: {}", role.as_str(), e.message()))?;
        if info.role != role.as_str() {
            return Err(format!("worker {addr} is a {} worker, not {}", info.role, role.as_str()));
        }
        self.check(&info).map_err(|e| format!("{} worker {addr} refused: {e}", role.as_str()))?;
        *w.info.lock().unwrap_or_else(|e| e.into_inner()) = Some(info);
        w.healthy.store(true, Ordering::Relaxed);
        let mut ws = self.workers.write().unwrap_or_else(|e| e.into_inner());
        if let Some(existing) = ws.iter().find(|x| x.addr == addr && x.role == role) {
            return Ok((existing.clone(), false));
        }
        ws.push(w.clone());
        tracing::info!(addr, role = role.as_str(), "worker added");
        Ok((w, true))
    }

    /// Removes a worker (its lease expired, or it was deregistered).
    pub fn remove(&self, addr: &str, role: Role) {
        let mut ws = self.workers.write().unwrap_or_else(|e| e.into_inner());
        let before = ws.len();
        ws.retain(|w| !(w.addr == addr && w.role == role));
        if ws.len() != before {
            tracing::info!(addr, role = role.as_str(), "worker removed");
        }
    }

    fn check(&self, info: &WorkerInfo) -> Result<(), String> {
        let theirs = Compat { model: info.model.clone(), kv_layout: info.kv_layout.unwrap_or_default() };
        let mut c = self.compat.lock().unwrap_or_else(|e| e.into_inner());
        match &*c {
            None => {
                *c = Some(theirs);
                Ok(())
            }
            Some(mine) if mine.model != theirs.model => {
                Err(format!("it serves model {:?}, the cluster serves {:?}", theirs.model, mine.model))
            }
            Some(mine) if mine.kv_layout != theirs.kv_layout => {
                Err(format!("its KV layout {:?} differs from the cluster's {:?}", theirs.kv_layout, mine.kv_layout))
            }
            Some(_) => Ok(()),
        }
    }

    /// Polls every worker's info forever, marking those that do not answer unhealthy.
    pub async fn poll_forever(self: Arc<Self>) {
        loop {
            let ws = self.workers();
            let me = &self;
            let polls = ws.iter().map(|w| async move {
                let r = w.fetch_info().await;
                // A worker restarted at the same address with another model or layout
                // gets no more traffic.
                let ok = match &r {
                    Ok(info) => match me.check(info) {
                        Ok(()) => true,
                        Err(e) => {
                            tracing::warn!(addr = %w.addr, reason = %e, "worker no longer compatible");
                            false
                        }
                    },
                    Err(_) => false,
                };
                if w.healthy.swap(ok, Ordering::Relaxed) != ok {
                    tracing::warn!(addr = %w.addr, role = w.role.as_str(), healthy = ok, "worker health changed");
                }
                if let Ok(info) = r {
                    *w.info.lock().unwrap_or_else(|e| e.into_inner()) = Some(info);
                }
            });
            futures::future::join_all(polls).await;
            tokio::time::sleep(POLL).await;
        }
    }

    /// The healthy worker of `role` with the fewest requests in flight, not in `avoid`
    /// (unless nothing else is left).
    fn pick(&self, role: Role, avoid: &[String]) -> Option<Arc<Worker>> {
        let ws: Vec<Arc<Worker>> = self.workers().into_iter().filter(|w| w.role == role && w.is_healthy()).collect();
        let fresh: Vec<&Arc<Worker>> = ws.iter().filter(|w| !avoid.contains(&w.addr)).collect();
        let pool: Vec<&Arc<Worker>> = if fresh.is_empty() { ws.iter().collect() } else { fresh };
        let min = pool.iter().map(|w| w.in_flight()).min()?;
        let ties: Vec<&&Arc<Worker>> = pool.iter().filter(|w| w.in_flight() == min).collect();
        let i = self.rr[role as usize].fetch_add(1, Ordering::Relaxed) % ties.len();
        Some((*ties[i]).clone())
    }

    async fn run(
        self: Arc<Self>,
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        trace: Option<String>,
        tx: Outputs,
    ) {
        let sampling = rpc::sampling_to_proto(&params);
        let local = prompt.len() < self.local_prefill_below;
        let mut avoid = Vec::new();
        let mut last_error = String::from("no decode worker is available");
        let (mut attempts, mut waited, mut backoff) = (0, Duration::ZERO, Duration::from_millis(20));
        while attempts < MAX_ATTEMPTS {
            let Some(d) = self.pick(Role::Decode, &avoid) else { break };
            // Without a usable prefill worker the decode worker prefills the prompt
            // itself: slower for long prompts, but the request is served.
            let p = if local { None } else { self.pick(Role::Prefill, &avoid) };
            let _dg = InFlight::new(&d);
            let _pg = p.as_ref().map(InFlight::new);
            let req = DecodeRequest {
                prompt_ids: prompt.clone(),
                sampling: Some(sampling.clone()),
                prefill: p.as_ref().map(|p| p.addr.clone()).unwrap_or_default(),
                request_id: format!("{id}"),
            };
            let mut client = DecodeWorkerClient::new(d.channel.clone()).max_decoding_message_size(64 << 20);
            let mut call = tonic::Request::new(req);
            if let Some(v) = trace.as_deref().and_then(|t| t.parse().ok()) {
                call.metadata_mut().insert("traceparent", v);
            }
            let mut stream = match client.generate(call).await {
                Ok(s) => {
                    // The prefill part is over once the call is answered.
                    drop(_pg);
                    s.into_inner()
                }
                Err(e) if e.code() == tonic::Code::ResourceExhausted => {
                    // Out of KV blocks (or requests): another decode worker, or wait
                    // for blocks to free (the request queues here, bounded in time).
                    last_error = format!("decode worker {}: {}", d.addr, e.message());
                    avoid.push(d.addr.clone());
                    let others = self
                        .workers()
                        .iter()
                        .any(|w| w.role == Role::Decode && w.is_healthy() && !avoid.contains(&w.addr));
                    if !others {
                        if waited >= QUEUE_LIMIT {
                            last_error = format!(
                                "every decode worker stayed out of KV blocks for {} s ({last_error})",
                                QUEUE_LIMIT.as_secs()
                            );
                            break;
                        }
                        drop(_dg);
                        tokio::time::sleep(backoff).await;
                        waited += backoff;
                        backoff = (backoff * 2).min(Duration::from_millis(500));
                        avoid.clear();
                    }
                    continue;
                }
                Err(e) => {
                    // Nothing was sent to the client yet: try other workers.
                    attempts += 1;
                    last_error = format!("decode worker {}: {}", d.addr, e.message());
                    tracing::warn!(request = id, error = %last_error, "attempt failed; retrying elsewhere");
                    let retry = matches!(
                        e.code(),
                        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::DeadlineExceeded
                    );
                    if !retry {
                        let _ = tx.send(Err(e.message().to_string()));
                        return;
                    }
                    avoid.push(d.addr.clone());
                    if let Some(p) = &p {
                        avoid.push(p.addr.clone());
                    }
                    continue;
                }
            };
            let mut completion = 0;
            loop {
                match stream.message().await {
                    Ok(Some(r)) => {
                        completion += r.token_ids.len();
                        let out = rpc::output_from_proto(r, id, prompt.len(), completion);
                        let done = out.finish.is_some();
                        if tx.send(Ok(StreamItem { out, at: Instant::now() })).is_err() || done {
                            return;
                        }
                    }
                    Ok(None) => {
                        let _ = tx.send(Err(format!(
                            "decode worker {} ended the stream before the request finished",
                            d.addr
                        )));
                        return;
                    }
                    Err(e) => {
                        let _ = tx.send(Err(format!("decode worker {} failed mid-stream: {}", d.addr, e.message())));
                        return;
                    }
                }
            }
        }
        let _ = tx.send(Err(last_error));
    }

    /// Sum of the workers' last reported state (decode workers' KV).
    fn aggregate(&self) -> EngineStats {
        let mut s = EngineStats::default();
        for w in self.workers() {
            if let Some(i) = &*w.info.lock().unwrap_or_else(|e| e.into_inner()) {
                s.running += i.running as usize;
                s.waiting += i.waiting as usize;
                if w.role == Role::Decode {
                    s.kv_blocks_total += i.kv_blocks_total as usize;
                    s.kv_blocks_used += i.kv_blocks_used as usize;
                }
            }
        }
        s
    }
}

struct AbortOnDrop(tokio::task::AbortHandle);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The cluster behind an [`engine::handle::EngineHandle`]; requests run on `rt`.
pub struct ClusterEngine {
    pub cluster: Arc<Cluster>,
    pub rt: tokio::runtime::Handle,
}

impl RemoteEngine for ClusterEngine {
    fn start(
        &self,
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        trace: Option<String>,
        tx: Outputs,
    ) -> Box<dyn Send + Sync> {
        let task = self.rt.spawn(self.cluster.clone().run(id, prompt, params, trace, tx));
        Box::new(AbortOnDrop(task.abort_handle()))
    }

    fn stats(&self) -> EngineStats {
        self.cluster.aggregate()
    }
}

/// Where the cluster's workers are and how to use them.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// The model the router tokenizes for (workers must serve the same one).
    pub model: String,
    pub prefill: Vec<String>,
    pub decode: Vec<String>,
    /// Workers found in etcd at start: admitted when they can be, skipped otherwise.
    pub discovered_prefill: Vec<String>,
    pub discovered_decode: Vec<String>,
    pub local_prefill_below: usize,
    pub max_in_flight: usize,
    /// How long to wait for the listed workers to answer at start.
    pub wait: Duration,
}

/// Admits one worker, retrying until `deadline` while it does not answer. The first
/// decode worker sets the cluster's KV layout (after its model is checked against the
/// router's).
async fn admit(
    cluster: &Cluster,
    cfg: &engine::config::ModelConfig,
    addr: &str,
    role: Role,
    deadline: Instant,
) -> Result<(), String> {
    loop {
        if role == Role::Decode && cluster.compat().is_none() {
            let w = Worker::new(addr, role)?;
            match w.fetch_info().await {
                Ok(info) => {
                    let mine = rpc::model_identity(cfg);
                    if info.model != mine {
                        return Err(format!(
                            "decode worker {addr} serves model {:?}, the router {:?}",
                            info.model, mine
                        ));
                    }
                    *cluster.compat.lock().unwrap_or_else(|e| e.into_inner()) =
                        Some(Compat { model: mine, kv_layout: info.kv_layout.unwrap_or_default() });
                }
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
                Err(e) => return Err(format!("decode worker {addr} did not answer: {}", e.message())),
            }
        }
        match cluster.add(addr, role).await {
            Ok(_) => return Ok(()),
            Err(e) if e.contains("did not answer") && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Loads the tokenizer, admits the listed workers (waiting up to `wait` for each to
/// answer) and returns the handle the gateway serves, with the cluster behind it.
pub async fn connect(o: &ClusterOptions) -> Result<(engine::handle::EngineHandle, Arc<Cluster>), String> {
    let model = o.model.clone();
    let (cfg, tokenizer) = tokio::task::spawn_blocking(move || {
        let src = engine::load::resolve(&model)?;
        engine::load::load_tokenizer(&src)
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())?;
    let cluster = Cluster::new(o.local_prefill_below);
    // The model identity comes from the router's model, the layout from the first
    // decode worker; every other worker must match both.
    let deadline = Instant::now() + o.wait;
    // Listed workers must be admitted (an error stops the router); discovered ones
    // (etcd) are skipped with a logged reason when they cannot be.
    let mut todo: Vec<(Role, &String, bool)> = Vec::new();
    for (role, list, required) in [
        (Role::Decode, &o.decode, true),
        (Role::Decode, &o.discovered_decode, false),
        (Role::Prefill, &o.prefill, true),
        (Role::Prefill, &o.discovered_prefill, false),
    ] {
        todo.extend(list.iter().map(|a| (role, a, required)));
    }
    for (role, addr, required) in todo {
        let r = admit(&cluster, &cfg, addr, role, if required { deadline } else { Instant::now() }).await;
        match r {
            Ok(()) => {}
            Err(e) if required => return Err(e),
            Err(e) => tracing::warn!(addr = %addr, reason = %e, "registered worker skipped"),
        }
    }
    let decodes: Vec<WorkerInfo> = cluster
        .workers()
        .iter()
        .filter_map(|w| w.info.lock().unwrap_or_else(|e| e.into_inner()).clone())
        .filter(|i| i.role == "decode")
        .collect();
    let Some(first) = decodes.first() else {
        return Err(
            "no decode worker could be admitted; give at least one with --decode or register one in etcd".into()
        );
    };
    if cluster.workers().iter().all(|w| w.role != Role::Prefill) {
        tracing::warn!("no prefill workers: every prompt is prefilled on the decode workers");
    }
    let layout = first.kv_layout.unwrap_or_default();
    let n_blocks = decodes.iter().map(|i| i.kv_blocks_total as usize).min().unwrap_or(0);
    let max_model_len = decodes.iter().map(|i| i.max_model_len as usize).min().unwrap_or(0);
    let limits =
        engine::scheduler::Limits { vocab: cfg.vocab, max_model_len, n_blocks, block_size: layout.block_size as usize };
    let kv_shape = kernels::KvShape {
        n_layers: layout.n_layers as usize,
        n_blocks,
        block_size: layout.block_size as usize,
        n_kv_heads: layout.n_kv_heads as usize,
        head_dim: layout.head_dim as usize,
        dtype: if layout.dtype_bytes == 4 { kernels::KvDtype::F32 } else { kernels::KvDtype::F16 },
    };
    let backend =
        format!("cluster: {} prefill + {} decode workers ({})", o.prefill.len(), o.decode.len(), first.backend);
    let remote = Arc::new(ClusterEngine { cluster: cluster.clone(), rt: tokio::runtime::Handle::current() });
    let handle = engine::handle::EngineHandle::remote(
        remote,
        Arc::new(tokenizer),
        Arc::new(cfg),
        limits,
        backend,
        kv_shape,
        o.max_in_flight,
    );
    tokio::spawn(cluster.clone().poll_forever());
    Ok((handle, cluster))
}

/// Follows etcd registrations (see `rpc::discovery`): admits registered workers (after
/// the same model and layout check as any other; a refusal is logged with its reason)
/// and removes those whose registration ended. Only workers that etcd brought are ever
/// removed by it; workers given on the command line stay.
pub async fn follow_etcd(
    cluster: Arc<Cluster>,
    mut events: tokio::sync::mpsc::UnboundedReceiver<rpc::discovery::Event>,
    mut from_etcd: std::collections::HashSet<(String, String)>,
) {
    use rpc::discovery::Event;
    let role = |r: &str| match r {
        "prefill" => Some(Role::Prefill),
        "decode" => Some(Role::Decode),
        _ => None,
    };
    let admit = |reg: rpc::discovery::Registration| {
        let cluster = cluster.clone();
        async move {
            let Some(r) = role(&reg.role) else {
                tracing::warn!(role = %reg.role, addr = %reg.addr, "ignoring a registration with an unknown role");
                return false;
            };
            match cluster.add(&reg.addr, r).await {
                Ok((_, new)) => new,
                Err(e) => {
                    tracing::warn!(addr = %reg.addr, reason = %e, "worker refused");
                    false
                }
            }
        }
    };
    while let Some(ev) = events.recv().await {
        match ev {
            Event::Sync(all) => {
                let now: std::collections::HashSet<(String, String)> =
                    all.iter().map(|r| (r.role.clone(), r.addr.clone())).collect();
                for (r, addr) in from_etcd.difference(&now) {
                    if let Some(r) = role(r) {
                        cluster.remove(addr, r);
                    }
                }
                from_etcd.retain(|k| now.contains(k));
                for reg in all {
                    let k = (reg.role.clone(), reg.addr.clone());
                    if admit(reg).await {
                        from_etcd.insert(k);
                    }
                }
            }
            Event::Put(reg) => {
                let k = (reg.role.clone(), reg.addr.clone());
                if admit(reg).await {
                    from_etcd.insert(k);
                }
            }
            Event::Delete(r, addr) => {
                if from_etcd.remove(&(r.clone(), addr.clone())) {
                    if let Some(r) = role(&r) {
                        cluster.remove(&addr, r);
                    }
                }
            }
        }
    }
}
