//! The router's disaggregated path: requests go to a decode worker, which has a
//! prefill worker fill its KV (see decode-node). Implements
//! [`engine::handle::RemoteEngine`], so the gateway's handlers serve a cluster exactly
//! as they serve a local engine.
//!
//! Choice of workers ([`Policy`]; ARCHITECTURE.md, "Routing"): round-robin,
//! least-loaded (fewest requests in flight from this router, ties round-robin), or
//! KV-aware: each healthy worker of a role is scored by
//! `cost = new_blocks + load`, where `new_blocks` is the request's blocks the worker
//! does not hold (its overlap, from the [`KvIndex`] fed by the workers' KV events, or
//! predicted from this router's own decisions when events are off) and `load` is the
//! blocks of requests in flight there (for a prefill worker: the blocks it still has
//! to compute). The lowest cost wins, ties round-robin; with a temperature `T > 0` a
//! worker is drawn with weight `exp(-(cost - min) / (T × max(1, max cost)))`. A
//! session key (header `x-session-id` or the `user` field) predicts that the worker
//! that served the session's previous turn still holds that turn's prompt. A prompt
//! whose part not cached at the chosen decode worker is shorter than
//! `local_prefill_below` tokens is prefilled there (conditional disaggregation; 0
//! disables); otherwise a prefill worker computes it, and only the blocks the decode
//! worker does not hold are transferred.
//!
//! Failures: a call that fails before its first token (decode worker unreachable or
//! out of blocks, prefill worker or transfer failed) is retried on other workers, up
//! to [`MAX_ATTEMPTS`] times; once a token was sent, a failure ends the request with
//! an error (the client saw part of the answer). When every decode worker is out of
//! KV blocks, a request waits instead of failing: requests queue first come, first
//! served (see [`BlockQueue`]), and the head of the queue retries (backing off) until a
//! worker takes it; waiting fails after [`QUEUE_LIMIT`] in which no request got blocks.
//! Workers are polled for their state every [`POLL`]; one that does not answer is
//! skipped until it does again.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;

use engine::handle::{Outputs, RemoteEngine, RequestMeta, StreamItem};
use engine::kv::blocks_for;
use engine::prefix::{block_hashes, HashSalt};
use engine::sampling::SamplingParams;
use engine::scheduler::{EngineStats, RequestId};
use proto::v1::decode_worker_client::DecodeWorkerClient;
use proto::v1::prefill_worker_client::PrefillWorkerClient;
use proto::v1::{DecodeRequest, KvEventsRequest, WorkerInfo, WorkerInfoRequest};
use tonic::transport::Channel;

use crate::kv_index::{KvIndex, Overlaps};

pub const MAX_ATTEMPTS: usize = 3;
/// How long requests wait for KV blocks while no request gets any (every decode worker
/// full and none freeing blocks).
pub const QUEUE_LIMIT: Duration = Duration::from_secs(60);
pub const POLL: Duration = Duration::from_millis(500);

/// How the router chooses workers (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    RoundRobin,
    LeastLoaded,
    KvAware,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "round-robin" => Ok(Policy::RoundRobin),
            "least-loaded" => Ok(Policy::LeastLoaded),
            "kv-aware" => Ok(Policy::KvAware),
            _ => Err(format!("unknown routing policy {s:?}; use round-robin, least-loaded or kv-aware")),
        }
    }
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::LeastLoaded => "least-loaded",
            Policy::KvAware => "kv-aware",
        }
    }
}

#[derive(Clone, Debug)]
pub struct RoutingOptions {
    pub policy: Policy,
    /// 0: always the cheapest worker (ties round-robin).
    pub temperature: f64,
    /// Follow the workers' KV events; when off, predict from routing decisions.
    pub kv_events: bool,
    /// How long a predicted block counts (events off).
    pub predict_ttl: Duration,
}

impl Default for RoutingOptions {
    fn default() -> Self {
        RoutingOptions {
            policy: Policy::KvAware,
            temperature: 0.0,
            kv_events: true,
            predict_ttl: Duration::from_secs(120),
        }
    }
}

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
    /// Blocks of the requests in flight here (a prefill worker: blocks to compute).
    load_blocks: AtomicUsize,
    healthy: AtomicBool,
    removed: AtomicBool,
    /// Its slot in the KV index (`usize::MAX`: none).
    slot: AtomicUsize,
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
            load_blocks: AtomicUsize::new(0),
            healthy: AtomicBool::new(false),
            removed: AtomicBool::new(false),
            slot: AtomicUsize::new(usize::MAX),
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

    pub fn load_blocks(&self) -> usize {
        self.load_blocks.load(Ordering::Relaxed)
    }

    /// Its slot in the cluster's KV index.
    pub fn slot(&self) -> Option<usize> {
        Some(self.slot.load(Ordering::Relaxed)).filter(|s| *s != usize::MAX)
    }

    fn key(&self) -> String {
        format!("{}:{}", self.role.as_str(), self.addr)
    }

    async fn kv_events(&self) -> Result<tonic::Streaming<proto::v1::KvEventBatch>, tonic::Status> {
        let r = match self.role {
            Role::Prefill => PrefillWorkerClient::new(self.channel.clone()).kv_events(KvEventsRequest {}).await,
            Role::Decode => DecodeWorkerClient::new(self.channel.clone()).kv_events(KvEventsRequest {}).await,
        };
        r.map(|s| s.into_inner())
    }
}

/// Counts a request (and its blocks) against a worker while it is alive.
struct InFlight(Arc<Worker>, usize);
impl InFlight {
    fn new(w: &Arc<Worker>, blocks: usize) -> Self {
        w.in_flight.fetch_add(1, Ordering::Relaxed);
        w.load_blocks.fetch_add(blocks, Ordering::Relaxed);
        InFlight(w.clone(), blocks)
    }
}
impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.0.load_blocks.fetch_sub(self.1, Ordering::Relaxed);
    }
}

/// What the router knows about one request when choosing its workers.
struct Route {
    /// The cluster's block size, its prompt's blocks (partial last block included) and
    /// full-block hashes.
    block_size: usize,
    blocks: usize,
    hashes: Vec<u64>,
    overlaps: Overlaps,
    /// The worker (address) that served the session's last turn, and that turn's
    /// prompt blocks.
    session: Option<(String, usize)>,
}

impl Route {
    /// Blocks of the request that `w` is expected to hold.
    fn overlap(&self, w: &Worker) -> usize {
        let mut o = self.overlaps.any(w.slot());
        if let Some((addr, n)) = &self.session {
            if w.role == Role::Decode && *addr == w.addr {
                o = o.max(*n);
            }
        }
        o.min(self.hashes.len())
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
    pub routing: RoutingOptions,
    pub index: Mutex<KvIndex>,
    /// Session key → (decode worker address, prompt blocks of its last turn).
    sessions: Mutex<HashMap<String, (String, usize, Instant)>>,
    rng: AtomicU64,
    /// Requests waiting for KV blocks when every decode worker is full.
    queue: BlockQueue,
    /// See [`kernels::env::ROUTER_ADMIT_GRACE_MS`].
    admit_grace: Duration,
}

/// Requests waiting for KV blocks, first come first served. Each holds a ticket (its
/// arrival order); only the lowest waiting ticket, the head, tries the decode workers.
/// An attempt of the head that is not refused within the admit grace has most likely
/// reserved its blocks (the answer waits for the whole prefill), so the head steps
/// aside and the next may try; if that attempt is refused after all, the head takes
/// its place at the front again. A new request queues behind those waiting.
struct BlockQueue {
    state: Mutex<QueueState>,
    changed: tokio::sync::Notify,
}

struct QueueState {
    next: u64,
    /// Tickets held (waiting or in an attempt they stepped aside for).
    live: usize,
    waiting: std::collections::BTreeSet<u64>,
    /// When a request last got a decode worker's blocks: waiting fails only after
    /// [`QUEUE_LIMIT`] without such progress.
    last_admit: Instant,
}

/// A request's place in the [`BlockQueue`]; dropped, it leaves the queue.
struct Ticket<'a> {
    queue: &'a BlockQueue,
    n: u64,
    since: Instant,
}

impl BlockQueue {
    fn new() -> BlockQueue {
        let state = QueueState { next: 0, live: 0, waiting: Default::default(), last_admit: Instant::now() };
        BlockQueue { state: Mutex::new(state), changed: tokio::sync::Notify::new() }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether requests wait for blocks (also one whose attempt is past the grace).
    fn busy(&self) -> bool {
        self.state().live > 0
    }

    fn join(&self) -> Ticket<'_> {
        let mut s = self.state();
        let n = s.next;
        s.next += 1;
        s.live += 1;
        s.waiting.insert(n);
        Ticket { queue: self, n, since: Instant::now() }
    }

    /// A request got its blocks (queued or not): the cluster makes progress.
    fn admitted(&self) {
        self.state().last_admit = Instant::now();
    }
}

impl Ticket<'_> {
    /// When waiting gives up: [`QUEUE_LIMIT`] after the later of this request's arrival
    /// in the queue and the last admission.
    fn deadline(&self) -> Instant {
        self.since.max(self.queue.state().last_admit) + QUEUE_LIMIT
    }

    /// Waits until this ticket is the head (at once if it is); false once the queue
    /// made no progress for [`QUEUE_LIMIT`] (the head's own refusals included).
    async fn turn(&self) -> bool {
        loop {
            // Created before the check, so that no change between them is missed
            // (`notify_waiters` reaches every `Notified` that exists).
            let changed = self.queue.changed.notified();
            let deadline = self.deadline();
            if Instant::now() >= deadline {
                return false;
            }
            if self.queue.state().waiting.first() == Some(&self.n) {
                return true;
            }
            // Woken by a change, or at the deadline (which may have moved meanwhile).
            let _ = tokio::time::timeout_at(deadline.into(), changed).await;
        }
    }

    /// The head's attempt went unanswered past the grace: let the next one try.
    fn step_aside(&self) {
        if self.queue.state().waiting.remove(&self.n) {
            self.queue.changed.notify_waiters();
        }
    }

    /// Back in the queue at this ticket's place (after an attempt it stepped aside for).
    fn rejoin(&self) {
        self.queue.state().waiting.insert(self.n);
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        {
            let mut s = self.queue.state();
            s.waiting.remove(&self.n);
            s.live -= 1;
        }
        self.queue.changed.notify_waiters();
    }
}

/// [`kernels::env::ROUTER_ADMIT_GRACE_MS`], 50 ms by default.
fn admit_grace() -> Duration {
    let ms = std::env::var(kernels::env::ROUTER_ADMIT_GRACE_MS).ok().and_then(|v| v.parse().ok());
    Duration::from_millis(ms.unwrap_or(50))
}

/// The longest pause between the queue head's attempts.
const HEAD_POLL: Duration = Duration::from_millis(100);

/// Sessions remembered at most (the oldest hour is dropped beyond it).
const MAX_SESSIONS: usize = 100_000;

impl Cluster {
    pub fn new(local_prefill_below: usize, routing: RoutingOptions) -> Arc<Cluster> {
        Arc::new(Cluster {
            workers: RwLock::new(Vec::new()),
            compat: Mutex::new(None),
            rr: [AtomicUsize::new(0), AtomicUsize::new(0)],
            local_prefill_below,
            routing,
            index: Mutex::new(KvIndex::new()),
            sessions: Mutex::new(HashMap::new()),
            rng: AtomicU64::new(0x9E37_79B9_7F4A_7C15),
            queue: BlockQueue::new(),
            admit_grace: admit_grace(),
        })
    }

    fn index(&self) -> std::sync::MutexGuard<'_, KvIndex> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
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
    pub async fn add(self: &Arc<Self>, addr: &str, role: Role) -> Result<(Arc<Worker>, bool), String> {
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
        drop(ws);
        match self.index().add_worker(&w.key()) {
            Some(slot) => w.slot.store(slot, Ordering::Relaxed),
            None => tracing::warn!(addr, "the KV index is full; this worker gets no overlap credit"),
        }
        if self.routing.kv_events && w.slot().is_some() {
            tokio::spawn(self.clone().follow_kv_events(w.clone()));
        }
        tracing::info!(addr, role = role.as_str(), "worker added");
        Ok((w, true))
    }

    /// Removes a worker (its lease expired, or it was deregistered), and its blocks
    /// from the KV index.
    pub fn remove(&self, addr: &str, role: Role) {
        let mut ws = self.workers.write().unwrap_or_else(|e| e.into_inner());
        let gone: Vec<Arc<Worker>> = ws.iter().filter(|w| w.addr == addr && w.role == role).cloned().collect();
        ws.retain(|w| !(w.addr == addr && w.role == role));
        drop(ws);
        for w in gone {
            w.removed.store(true, Ordering::Relaxed);
            if let Some(slot) = w.slot() {
                self.index().remove_worker(slot);
            }
            tracing::info!(addr, role = role.as_str(), "worker removed");
        }
    }

    /// Feeds worker `w`'s KV events into the index for as long as it is in the
    /// cluster, subscribing again (from a snapshot) after a lost event or connection.
    async fn follow_kv_events(self: Arc<Self>, w: Arc<Worker>) {
        let Some(slot) = w.slot() else { return };
        let mut backoff = Duration::from_millis(100);
        while !w.removed.load(Ordering::Relaxed) {
            match w.kv_events().await {
                Ok(mut stream) => loop {
                    let batch = match stream.message().await {
                        Ok(Some(b)) => rpc::kv_events_from_proto(b),
                        _ => break,
                    };
                    backoff = Duration::from_millis(100);
                    let mut ix = self.index();
                    // Checked under the index lock: `remove` marks, then clears.
                    if w.removed.load(Ordering::Relaxed) {
                        return;
                    }
                    if let Err(e) = ix.apply(slot, &batch) {
                        tracing::warn!(addr = %w.addr, error = %e, "KV events out of step; subscribing again");
                        break;
                    }
                },
                Err(e) => tracing::debug!(addr = %w.addr, error = %e.message(), "KV events unavailable"),
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
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
            if !self.routing.kv_events {
                self.index().expire(Instant::now(), self.routing.predict_ttl);
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// A healthy worker of `role` by the routing policy, not in `avoid` (unless
    /// nothing else is left).
    fn pick(&self, role: Role, avoid: &[String], route: &Route) -> Option<Arc<Worker>> {
        let ws: Vec<Arc<Worker>> = self.workers().into_iter().filter(|w| w.role == role && w.is_healthy()).collect();
        let fresh: Vec<&Arc<Worker>> = ws.iter().filter(|w| !avoid.contains(&w.addr)).collect();
        let pool: Vec<&Arc<Worker>> = if fresh.is_empty() { ws.iter().collect() } else { fresh };
        if pool.is_empty() {
            return None;
        }
        let cost = |w: &Worker| -> f64 {
            match self.routing.policy {
                Policy::RoundRobin => 0.0,
                Policy::LeastLoaded => w.in_flight() as f64,
                Policy::KvAware => (route.blocks - route.overlap(w) + w.load_blocks()) as f64,
            }
        };
        let costs: Vec<f64> = pool.iter().map(|w| cost(w)).collect();
        let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let t = self.routing.temperature;
        if t > 0.0 && self.routing.policy == Policy::KvAware {
            let scale = t * costs.iter().copied().fold(1.0, f64::max);
            let weights: Vec<f64> = costs.iter().map(|c| (-(c - min) / scale).exp()).collect();
            let mut x = self.random() * weights.iter().sum::<f64>();
            for (w, wt) in pool.iter().zip(&weights) {
                if x < *wt {
                    return Some((*w).clone());
                }
                x -= wt;
            }
            return pool.last().map(|w| (*w).clone());
        }
        let ties: Vec<&&Arc<Worker>> = pool.iter().zip(&costs).filter(|(_, c)| **c == min).map(|(w, _)| w).collect();
        // The session's worker wins a tie.
        if let Some((addr, _)) = &route.session {
            if let Some(w) = ties.iter().find(|w| w.addr == *addr) {
                return Some((**w).clone());
            }
        }
        let i = self.rr[role as usize].fetch_add(1, Ordering::Relaxed) % ties.len();
        Some((*ties[i]).clone())
    }

    /// The decode worker for a request, and the prefill worker unless the decode worker
    /// is to prefill it itself (conditional disaggregation on what it lacks).
    fn choose(&self, route: &Route, prompt_len: usize, avoid: &[String]) -> Option<(Arc<Worker>, Option<Arc<Worker>>)> {
        let d = self.pick(Role::Decode, avoid, route)?;
        let uncached = prompt_len.saturating_sub(route.overlap(&d) * route.block_size);
        let local = uncached < self.local_prefill_below;
        // Without a usable prefill worker the decode worker prefills the prompt itself:
        // slower for long prompts, but the request is served.
        let p = if local { None } else { self.pick(Role::Prefill, avoid, route) };
        Some((d, p))
    }

    /// One routing decision, as a request gets it (hashing, index lookup, scoring),
    /// without sending anything: (decode worker, prefill worker) addresses.
    pub fn decide(
        &self,
        prompt: &[u32],
        params: &SamplingParams,
        session: Option<&str>,
    ) -> Option<(String, Option<String>)> {
        let route = self.route(prompt, params, session);
        let (d, p) = self.choose(&route, prompt.len(), &[])?;
        Some((d.addr.clone(), p.map(|p| p.addr.clone())))
    }

    /// Adds a worker without asking it anything, healthy at once, with the cluster's
    /// compatibility set to `compat` if unset (for benchmarks and tests of routing).
    pub fn add_unchecked(&self, addr: &str, role: Role, compat: &Compat) -> Result<Arc<Worker>, String> {
        self.compat.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(|| compat.clone());
        let w = Arc::new(Worker::new(addr, role)?);
        if let Some(slot) = self.index().add_worker(&w.key()) {
            w.slot.store(slot, Ordering::Relaxed);
        }
        w.healthy.store(true, Ordering::Relaxed);
        self.workers.write().unwrap_or_else(|e| e.into_inner()).push(w.clone());
        Ok(w)
    }

    /// A uniform draw in [0, 1) (xorshift; routing needs no better).
    fn random(&self) -> f64 {
        let mut x = self.rng.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng.store(x, Ordering::Relaxed);
        (x >> 11) as f64 / (1u64 << 53) as f64
    }

    /// What routing needs to know about a request (hashes only when they are used).
    fn route(&self, prompt: &[u32], params: &SamplingParams, session: Option<&str>) -> Route {
        let compat = self.compat();
        let bs = compat.as_ref().map_or(16, |c| c.kv_layout.block_size.max(1) as usize);
        let blocks = blocks_for(prompt.len(), bs);
        let hashes = match &compat {
            Some(c) if self.routing.policy == Policy::KvAware || self.local_prefill_below > 0 => {
                block_hashes(HashSalt::new(&c.model, params.cache_salt.as_deref()), bs, prompt)
            }
            _ => Vec::new(),
        };
        let overlaps = if hashes.is_empty() { Overlaps::default() } else { self.index().overlaps(&hashes) };
        let session = session.and_then(|s| {
            let m = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
            m.get(s).map(|(a, n, _)| (a.clone(), *n))
        });
        Route { block_size: bs, blocks, hashes, overlaps, session }
    }

    /// Notes where a request went: its session's worker, and (events off) the blocks
    /// the chosen workers will now hold.
    fn routed(&self, route: &Route, session: Option<&str>, d: &Worker, p: Option<&Worker>) {
        if let Some(s) = session {
            let mut m = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
            if m.len() >= MAX_SESSIONS {
                let cutoff = Instant::now() - Duration::from_secs(3600);
                m.retain(|_, v| v.2 > cutoff);
            }
            if m.len() < MAX_SESSIONS || m.contains_key(s) {
                m.insert(s.to_string(), (d.addr.clone(), route.hashes.len(), Instant::now()));
            }
        }
        if !self.routing.kv_events && !route.hashes.is_empty() {
            let now = Instant::now();
            let mut ix = self.index();
            for w in std::iter::once(d).chain(p) {
                if let Some(slot) = w.slot() {
                    ix.predict(slot, &route.hashes, now);
                }
            }
        }
    }

    async fn run(
        self: Arc<Self>,
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        meta: RequestMeta,
        tx: Outputs,
    ) {
        let sampling = rpc::sampling_to_proto(&params);
        let trace = meta.trace;
        let session = meta.session.as_deref();
        let route = self.route(&prompt, &params, session);
        let mut avoid = Vec::new();
        let mut last_error = String::from("no decode worker is available");
        let (mut attempts, mut backoff) = (0, Duration::from_millis(20));
        // This request's place in the queue for KV blocks, once it waits for them.
        let mut ticket: Option<Ticket> = None;
        while attempts < MAX_ATTEMPTS {
            if ticket.is_none() && self.queue.busy() {
                // Others wait for blocks: behind them, not before them.
                ticket = Some(self.queue.join());
            }
            if let Some(t) = &ticket {
                if !t.turn().await {
                    last_error = format!(
                        "every decode worker stayed out of KV blocks for {} s ({last_error})",
                        QUEUE_LIMIT.as_secs()
                    );
                    break;
                }
            }
            let Some((d, p)) = self.choose(&route, prompt.len(), &avoid) else { break };
            let _dg = InFlight::new(&d, route.blocks);
            let _pg = p.as_ref().map(|p| InFlight::new(p, route.blocks - route.overlap(p)));
            self.routed(&route, session, &d, p.as_deref());
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
            let answer = match &ticket {
                Some(t) => {
                    let call = client.generate(call);
                    tokio::pin!(call);
                    tokio::select! {
                        r = &mut call => r,
                        _ = tokio::time::sleep(self.admit_grace) => {
                            t.step_aside();
                            call.await
                        }
                    }
                }
                None => client.generate(call).await,
            };
            // Refused or failed: a queued request keeps its place (it may have stepped
            // aside) for its next attempt.
            if let (Err(_), Some(t)) = (&answer, &ticket) {
                t.rejoin();
            }
            let mut stream = match answer {
                Ok(s) => {
                    // Taken: the next in the queue may try.
                    self.queue.admitted();
                    drop(ticket.take());
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
                        // Wait in the queue, at the back the first time.
                        if ticket.is_none() {
                            ticket = Some(self.queue.join());
                        }
                        drop(_dg);
                        tokio::time::sleep(backoff).await;
                        // Only the head polls, so it may poll often.
                        backoff = (backoff * 2).min(HEAD_POLL);
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
                        let at = Instant::now();
                        if tx.send(Ok(StreamItem { out, at, sent: at })).is_err() || done {
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
                s.prefix_cache_queries += i.prefix_cache_queries;
                s.prefix_cache_hits += i.prefix_cache_hits;
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
        meta: RequestMeta,
        tx: Outputs,
    ) -> Box<dyn Send + Sync> {
        let task = self.rt.spawn(self.cluster.clone().run(id, prompt, params, meta, tx));
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
    pub routing: RoutingOptions,
    pub max_in_flight: usize,
    /// How long to wait for the listed workers to answer at start.
    pub wait: Duration,
}

/// Admits one worker, retrying until `deadline` while it does not answer. The first
/// decode worker sets the cluster's KV layout (after its model is checked against the
/// router's).
async fn admit(
    cluster: &Arc<Cluster>,
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
    let cluster = Cluster::new(o.local_prefill_below, o.routing.clone());
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
        dtype: kernels::KvDtype::from_bytes(layout.dtype_bytes).unwrap_or(kernels::KvDtype::F16),
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

#[cfg(test)]
mod tests {
    use super::*;
    use engine::handle::KvEventBatch;
    use engine::scheduler::{CacheTier, KvEvent};

    fn compat() -> Compat {
        Compat { model: "m".into(), kv_layout: proto::v1::KvLayout { block_size: 16, ..Default::default() } }
    }

    /// A cluster of two decode workers (no processes) where `a` caches the first 10
    /// blocks of `prompt`.
    fn two_workers(policy: Policy) -> (Arc<Cluster>, Arc<Worker>, Arc<Worker>, Vec<u32>) {
        let c = Cluster::new(0, RoutingOptions { policy, ..Default::default() });
        let a = c.add_unchecked("http://127.0.0.1:1", Role::Decode, &compat()).unwrap();
        let b = c.add_unchecked("http://127.0.0.1:2", Role::Decode, &compat()).unwrap();
        let prompt: Vec<u32> = (0..200).collect();
        let hashes = block_hashes(HashSalt::new("m", None), 16, &prompt[..160]);
        let events = vec![KvEvent::Stored { tier: CacheTier::Device, hashes }];
        c.index().apply(a.slot().unwrap(), &KvEventBatch { seq: 1, snapshot: true, events }).unwrap();
        let empty = KvEventBatch { seq: 1, snapshot: true, events: vec![] };
        c.index().apply(b.slot().unwrap(), &empty).unwrap();
        (c, a, b, prompt)
    }

    #[test]
    fn kv_aware_goes_to_the_cache_unless_load_outweighs_it() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _g = rt.enter();
        let (c, a, b, prompt) = two_workers(Policy::KvAware);
        let p = SamplingParams::greedy();
        for _ in 0..4 {
            assert_eq!(c.decide(&prompt, &p, None).unwrap().0, a.addr);
        }
        // Another salt shares nothing: a tie, broken round-robin.
        let salted = SamplingParams { cache_salt: Some("t".into()), ..p.clone() };
        let picks: Vec<String> = (0..4).map(|_| c.decide(&prompt, &salted, None).unwrap().0).collect();
        assert!(picks.contains(&a.addr) && picks.contains(&b.addr), "{picks:?}");
        // `a` saves 10 of 13 blocks; 9 blocks in flight there keep it the choice, 11
        // move the request.
        let _load = InFlight::new(&a, 9);
        assert_eq!(c.decide(&prompt, &p, None).unwrap().0, a.addr);
        let _more = InFlight::new(&a, 2);
        assert_eq!(c.decide(&prompt, &p, None).unwrap().0, b.addr);
        // Round-robin ignores the cache.
        let (c, a, b, prompt) = two_workers(Policy::RoundRobin);
        let picks: Vec<String> = (0..4).map(|_| c.decide(&prompt, &p, None).unwrap().0).collect();
        assert_eq!(picks, [a.addr.clone(), b.addr.clone(), a.addr.clone(), b.addr.clone()]);
    }

    #[test]
    fn a_removed_worker_leaves_the_index_and_its_late_events_are_refused() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _g = rt.enter();
        let (c, a, b, prompt) = two_workers(Policy::KvAware);
        let slot = a.slot().unwrap();
        assert_eq!(c.index().worker_blocks(slot), (10, 0));
        c.remove(&a.addr, Role::Decode);
        assert_eq!(c.index().len(), 0);
        assert_eq!(c.decide(&prompt, &SamplingParams::greedy(), None).unwrap().0, b.addr);
        let late = KvEventBatch { seq: 2, snapshot: false, events: vec![] };
        assert!(c.index().apply(slot, &late).is_err());
    }

    #[test]
    fn a_session_names_its_worker_when_the_index_knows_nothing() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _g = rt.enter();
        let (c, a, b, _) = two_workers(Policy::KvAware);
        let other: Vec<u32> = (5000..5200).collect();
        let p = SamplingParams::greedy();
        let route = c.route(&other, &p, Some("s"));
        let (first, _) = c.choose(&route, other.len(), &[]).unwrap();
        c.routed(&route, Some("s"), &first, None);
        for _ in 0..4 {
            assert_eq!(c.decide(&other, &p, Some("s")).unwrap().0, first.addr);
        }
        let _ = (a, b);
    }

    #[test]
    fn the_block_queue_serves_in_arrival_order_and_keeps_a_place_that_stepped_aside() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let q = BlockQueue::new();
            assert!(!q.busy());
            let (a, b, c) = (q.join(), q.join(), q.join());
            assert!(q.busy());
            let now = |t: &Ticket| futures::FutureExt::now_or_never(t.turn());
            assert_eq!(now(&a), Some(true), "the first is the head");
            assert_eq!(now(&b), None, "the second waits");
            // The head's attempt goes unanswered past the grace: the next may try.
            a.step_aside();
            assert_eq!(now(&b), Some(true));
            // Refused after all: the first is the head again, ahead of the second.
            a.rejoin();
            assert_eq!(now(&a), Some(true));
            assert_eq!(now(&b), None);
            // A waiter is woken when the one before it leaves.
            let waiter = async {
                assert!(b.turn().await);
                "b's turn"
            };
            let leave = async {
                tokio::task::yield_now().await;
                drop(a);
            };
            let (got, ()) = tokio::join!(waiter, leave);
            assert_eq!(got, "b's turn");
            drop(b);
            assert_eq!(now(&c), Some(true));
            drop(c);
            assert!(!q.busy());
            // A lone ticket whose attempt is past the grace still counts, so a new
            // request joins the queue behind it: it may try meanwhile, but is behind it
            // again if that attempt is refused after all.
            let d = q.join();
            d.step_aside();
            assert!(q.busy());
            let e = q.join();
            assert_eq!(now(&e), Some(true));
            d.rejoin();
            assert_eq!(now(&e), None);
            drop(d);
            drop(e);
            assert!(!q.busy());
        });
    }
}
