//! Running an [`EngineCore`] on its own thread and talking to it over channels.
//!
//! Rules this module keeps:
//! - The engine thread is the only owner of the core; clients hold cheap
//!   [`EngineHandle`] clones.
//! - Requests are validated in the caller's thread against [`Limits`], so bad requests
//!   fail fast with the engine's own message and never reach the engine.
//! - Dropping a [`RequestStream`] before it finished aborts the request: its KV blocks
//!   are freed in the engine's next loop iteration, without waiting for a step.
//! - At most `max_in_flight` requests are accepted at once; beyond that `submit` says
//!   the engine is over capacity instead of queueing without bound.
//! - A step's outputs reach their streams in order. By default the engine thread sends
//!   each one itself (a cross-thread wake per stream); after
//!   [`EngineHandle::deliver_on`] it hands each step's outputs to one task on a tokio
//!   runtime in a single message, and that task sends them (wakes local to the runtime).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kernels::Backend;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::config::ModelConfig;
use crate::sampling::SamplingParams;
use crate::sampling::TokenLogprob;
use crate::scheduler::{
    EngineCore, EngineStats, KvChunk, KvEvent, KvSink, Limits, RequestId, RequestOutput, Reservation,
};
use crate::tokenizer::Tokenizer;
use crate::EngineError;
use kernels::KvShape;
use tokio::sync::oneshot;

/// One output of a request, when the engine produced it (`at`: once per step) and when
/// it was handed to the request's channel (`sent`: by the engine thread's loop over the
/// step's outputs, or by the delivery task; the same as `at` where nothing lies between).
#[derive(Debug, Clone)]
pub struct StreamItem {
    pub out: RequestOutput,
    pub at: Instant,
    pub sent: Instant,
}

/// Where a request's outputs go: each item, or the error that ended the request.
pub type Outputs = UnboundedSender<Result<StreamItem, String>>;

/// `1`: the gateway has engine outputs delivered by a task on its runtime
/// ([`EngineHandle::deliver_on`]); otherwise the engine thread sends each itself. Off by
/// default until measured where it matters (a GPU engine at hundreds of streams).
pub const OUTPUT_TASK_ENV: &str = "DISAGG_OUTPUT_TASK";

/// Whether [`OUTPUT_TASK_ENV`] asks for the delivery task.
pub fn output_task_wanted() -> bool {
    std::env::var(OUTPUT_TASK_ENV).is_ok_and(|v| v == "1")
}

/// One step's outputs, each with the stream it goes to.
type Batch = Vec<(Outputs, StreamItem)>;

/// Prefix-cache events of one engine step, numbered: a subscriber that sees a gap in
/// `seq` has missed events and should subscribe again (which starts with a snapshot).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventBatch {
    pub seq: u64,
    /// The whole cache as it is now (the first batch of every subscription).
    pub snapshot: bool,
    pub events: Vec<KvEvent>,
}

/// What travels with a request besides its prompt and sampling, for remote engines.
#[derive(Clone, Debug, Default)]
pub struct RequestMeta {
    /// The W3C `traceparent` of the caller's span, when traces are on.
    pub trace: Option<String>,
    /// A session (conversation) key: a routing hint to keep a conversation's turns
    /// where its KV is cached.
    pub session: Option<String>,
}

/// An engine in another process (the disaggregated cluster, reached over gRPC),
/// served through the same [`EngineHandle`] as a local one.
pub trait RemoteEngine: Send + Sync + 'static {
    /// Starts request `id`. Its outputs, in order, or the error that ended it, go to
    /// `tx`. Dropping the returned guard cancels the request.
    fn start(
        &self,
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        meta: RequestMeta,
        tx: Outputs,
    ) -> Box<dyn Send + Sync>;
    /// Aggregate statistics of the engines behind it.
    fn stats(&self) -> EngineStats;
}

#[derive(Clone)]
enum Link {
    Local(Sender<Command>),
    Remote(Arc<dyn RemoteEngine>),
}

enum Command {
    Add {
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        tx: Outputs,
        /// The sink, and the blocks not to send.
        export: Option<(KvSink, usize)>,
    },
    Reserve {
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        tx: Outputs,
        reply: oneshot::Sender<Result<Reservation, EngineError>>,
    },
    Import {
        id: RequestId,
        chunk: KvChunk,
    },
    Activate {
        id: RequestId,
        token: u32,
        logprob: Option<TokenLogprob>,
        cached_tokens: usize,
        reply: oneshot::Sender<Result<(), EngineError>>,
    },
    SubscribeKv(UnboundedSender<KvEventBatch>),
    /// From now on, hand each step's outputs to this delivery task.
    Deliver(UnboundedSender<Batch>),
    Abort(RequestId),
    Shutdown,
}

struct Shared {
    stats: Mutex<EngineStats>,
    in_flight: AtomicUsize,
    next_id: AtomicU64,
    /// A delivery task has been started ([`EngineHandle::deliver_on`]), and the steps'
    /// output batches it has sent on.
    delivering: AtomicBool,
    delivered_batches: AtomicU64,
}

/// A cheap, cloneable handle to an engine running on its own thread.
#[derive(Clone)]
pub struct EngineHandle {
    link: Link,
    shared: Arc<Shared>,
    pub tokenizer: Arc<Tokenizer>,
    pub model: Arc<ModelConfig>,
    pub limits: Limits,
    pub backend: Arc<String>,
    pub kv_shape: KvShape,
    max_in_flight: usize,
}

/// Why a request was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("{0}")]
    Invalid(EngineError),
    #[error("the server is over capacity ({0} requests in flight); retry later")]
    Overloaded(usize),
    #[error("the engine has stopped")]
    Stopped,
    /// Valid, but this engine cannot take it now (no free KV blocks for a reservation).
    #[error("{0}")]
    Busy(String),
}

impl EngineHandle {
    /// Moves `core` onto a new thread and returns a handle to it.
    pub fn spawn<B>(core: EngineCore<B>, max_in_flight: usize) -> EngineHandle
    where
        B: Backend + Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            stats: Mutex::new(core.stats()),
            in_flight: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
            delivering: Default::default(),
            delivered_batches: AtomicU64::new(0),
        });
        let handle = EngineHandle {
            link: Link::Local(tx),
            tokenizer: core.tokenizer.clone(),
            model: Arc::new(core.model.cfg.clone()),
            limits: core.limits(),
            backend: Arc::new(core.backend().describe()),
            kv_shape: core.kv_shape(),
            shared: shared.clone(),
            max_in_flight,
        };
        std::thread::Builder::new()
            .name("disagg-engine".into())
            .spawn(move || engine_loop(core, rx, shared))
            .expect("spawning the engine thread");
        handle
    }

    /// A handle whose requests run on `remote`; `limits` and the rest describe the
    /// engines behind it.
    pub fn remote(
        remote: Arc<dyn RemoteEngine>,
        tokenizer: Arc<Tokenizer>,
        model: Arc<ModelConfig>,
        limits: Limits,
        backend: String,
        kv_shape: KvShape,
        max_in_flight: usize,
    ) -> EngineHandle {
        EngineHandle {
            link: Link::Remote(remote),
            shared: Arc::new(Shared {
                stats: Mutex::new(EngineStats::default()),
                in_flight: AtomicUsize::new(0),
                next_id: AtomicU64::new(1),
                delivering: Default::default(),
                delivered_batches: AtomicU64::new(0),
            }),
            tokenizer,
            model,
            limits,
            backend: Arc::new(backend),
            kv_shape,
            max_in_flight,
        }
    }

    fn local(&self) -> Result<&Sender<Command>, SubmitError> {
        match &self.link {
            Link::Local(tx) => Ok(tx),
            Link::Remote(_) => Err(SubmitError::Invalid(EngineError::Unsupported(
                "KV import is only possible on a local engine".into(),
            ))),
        }
    }

    /// Submits a request. The returned stream yields its outputs; dropping it early
    /// cancels the request.
    pub fn submit(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<RequestStream, SubmitError> {
        self.submit_traced(prompt, params, RequestMeta::default())
    }

    /// [`EngineHandle::submit`] with `meta` for a remote engine: its trace (a W3C
    /// `traceparent`) makes the remote spans join the caller's trace, and the returned
    /// stream carries it.
    pub fn submit_traced(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        meta: RequestMeta,
    ) -> Result<RequestStream, SubmitError> {
        let trace = meta.trace.clone();
        let mut st = self.start_traced(prompt, params, meta, |id, prompt, params, tx| Command::Add {
            id,
            prompt,
            params,
            tx,
            export: None,
        })?;
        st.trace = trace;
        Ok(st)
    }

    /// Submits a prefill-only request: it ends after its first token, and the engine
    /// thread hands its prompt's KV to `sink` layer by layer as it is computed, from
    /// block `skip_blocks` on (the receiver has the blocks before cached).
    pub fn submit_exporting(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        sink: KvSink,
        skip_blocks: usize,
    ) -> Result<RequestStream, SubmitError> {
        // Only the first token is generated here, whatever max_tokens the client asked.
        let params = SamplingParams { max_tokens: Some(1), ..params };
        self.start(prompt, params, move |id, prompt, params, tx| Command::Add {
            id,
            prompt,
            params,
            tx,
            export: Some((sink, skip_blocks)),
        })
    }

    /// Reserves KV blocks for `prompt`, whose KV another worker computes: feed it with
    /// [`EngineHandle::import_kv`], then [`EngineHandle::activate`] it. The stream
    /// yields its outputs from the first token on; dropping it frees the blocks.
    /// Returns the stream and what was reserved (blocks of the cached prefix need no
    /// import).
    pub async fn reserve(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<(RequestStream, Reservation), SubmitError> {
        let (reply, answer) = oneshot::channel();
        let stream =
            self.start(prompt, params, |id, prompt, params, tx| Command::Reserve { id, prompt, params, tx, reply })?;
        match answer.await {
            Ok(Ok(n)) => Ok((stream, n)),
            Ok(Err(EngineError::Busy(m))) => Err(SubmitError::Busy(m)),
            Ok(Err(e)) => Err(SubmitError::Invalid(e)),
            Err(_) => Err(SubmitError::Stopped),
        }
    }

    /// Writes a chunk of a reserved request's KV (checked by the transfer layer; an
    /// engine-side mismatch aborts the request).
    pub fn import_kv(&self, id: RequestId, chunk: KvChunk) {
        if let Ok(tx) = self.local() {
            let _ = tx.send(Command::Import { id, chunk });
        }
    }

    /// Starts a reserved request whose KV has all been imported, with the first token
    /// sampled by the prefill worker (and the prompt tokens its cache supplied).
    pub async fn activate(
        &self,
        id: RequestId,
        token: u32,
        logprob: Option<TokenLogprob>,
        cached_tokens: usize,
    ) -> Result<(), SubmitError> {
        let (reply, answer) = oneshot::channel();
        self.local()?
            .send(Command::Activate { id, token, logprob, cached_tokens, reply })
            .map_err(|_| SubmitError::Stopped)?;
        answer.await.map_err(|_| SubmitError::Stopped)?.map_err(SubmitError::Invalid)
    }

    /// Subscribes to the engine's prefix-cache events: the first batch is a snapshot
    /// of the whole cache, then every change follows in order.
    pub fn subscribe_kv_events(&self) -> Result<UnboundedReceiver<KvEventBatch>, SubmitError> {
        let (tx, rx) = unbounded_channel();
        self.local()?.send(Command::SubscribeKv(tx)).map_err(|_| SubmitError::Stopped)?;
        Ok(rx)
    }

    fn start(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        command: impl FnOnce(RequestId, Vec<u32>, SamplingParams, Outputs) -> Command,
    ) -> Result<RequestStream, SubmitError> {
        self.start_traced(prompt, params, RequestMeta::default(), command)
    }

    fn start_traced(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        meta: RequestMeta,
        command: impl FnOnce(RequestId, Vec<u32>, SamplingParams, Outputs) -> Command,
    ) -> Result<RequestStream, SubmitError> {
        self.limits.validate(&prompt, &params).map_err(SubmitError::Invalid)?;
        let n = self.shared.in_flight.fetch_add(1, Ordering::SeqCst);
        if n >= self.max_in_flight {
            self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Overloaded(n));
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = unbounded_channel();
        let cancel = match &self.link {
            Link::Local(link) => {
                if link.send(command(id, prompt, params, tx)).is_err() {
                    self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
                    return Err(SubmitError::Stopped);
                }
                Cancel::Local(link.clone())
            }
            Link::Remote(r) => Cancel::Remote(Some(r.start(id, prompt, params, meta, tx))),
        };
        Ok(RequestStream { id, rx, cancel, shared: self.shared.clone(), finished: false, error: None, trace: None })
    }

    pub fn stats(&self) -> EngineStats {
        match &self.link {
            Link::Local(_) => self.shared.stats.lock().unwrap_or_else(|e| e.into_inner()).clone(),
            Link::Remote(r) => r.stats(),
        }
    }

    /// Requests accepted and not yet finished or cancelled.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// Has each engine step's outputs delivered by one task on `rt`: the engine thread
    /// sends a single message per step instead of waking every stream itself, and the
    /// task's wakes are local to the runtime. Per request the order stays as it was.
    /// Only the first call per engine starts a task (two would race each other); nothing
    /// changes for an engine in another process. `rt` must keep running while the
    /// engine serves.
    pub fn deliver_on(&self, rt: &tokio::runtime::Handle) {
        if let Link::Local(tx) = &self.link {
            if self.shared.delivering.swap(true, Ordering::SeqCst) {
                return;
            }
            let (btx, mut brx) = unbounded_channel::<Batch>();
            let shared = self.shared.clone();
            rt.spawn(async move {
                while let Some(batch) = brx.recv().await {
                    for (tx, mut item) in batch {
                        // A stream dropped meanwhile has asked the engine to abort it.
                        item.sent = Instant::now();
                        let _ = tx.send(Ok(item));
                    }
                    shared.delivered_batches.fetch_add(1, Ordering::Relaxed);
                }
            });
            let _ = tx.send(Command::Deliver(btx));
        }
    }

    /// Steps' output batches a delivery task has sent on (0 without one).
    pub fn delivered_batches(&self) -> u64 {
        self.shared.delivered_batches.load(Ordering::Relaxed)
    }

    /// Stops the engine thread (requests in flight end without a finish reason).
    pub fn shutdown(&self) {
        if let Link::Local(tx) = &self.link {
            let _ = tx.send(Command::Shutdown);
        }
    }
}

/// The outputs of one request, in order; the last one has `finish` set.
pub struct RequestStream {
    pub id: RequestId,
    rx: UnboundedReceiver<Result<StreamItem, String>>,
    cancel: Cancel,
    shared: Arc<Shared>,
    finished: bool,
    error: Option<String>,
    /// The W3C `traceparent` it was submitted with, if any.
    pub trace: Option<String>,
}

enum Cancel {
    Local(Sender<Command>),
    Remote(Option<Box<dyn Send + Sync>>),
}

impl RequestStream {
    /// The next output, or `None` when the request has finished (or the engine stopped).
    pub async fn next(&mut self) -> Option<StreamItem> {
        if self.finished {
            return None;
        }
        let item = self.rx.recv().await;
        self.note(item)
    }

    /// Blocking form of [`RequestStream::next`], for synchronous callers.
    pub fn blocking_next(&mut self) -> Option<StreamItem> {
        if self.finished {
            return None;
        }
        let item = self.rx.blocking_recv();
        self.note(item)
    }

    /// Why the stream ended before the request finished, if it did.
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }

    fn note(&mut self, item: Option<Result<StreamItem, String>>) -> Option<StreamItem> {
        match item {
            Some(Ok(i)) => {
                if i.out.finish.is_some() {
                    self.finish();
                }
                Some(i)
            }
            Some(Err(e)) => {
                self.error = Some(e);
                self.finish();
                None
            }
            None => {
                self.error.get_or_insert_with(|| "the engine stopped before the request finished".into());
                self.finish();
                None
            }
        }
    }

    fn finish(&mut self) {
        if !self.finished {
            self.finished = true;
            self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.finished {
            match &mut self.cancel {
                Cancel::Local(tx) => {
                    let _ = tx.send(Command::Abort(self.id));
                }
                Cancel::Remote(guard) => drop(guard.take()),
            }
            self.finish();
        }
    }
}

fn engine_loop<B: Backend>(mut core: EngineCore<B>, rx: Receiver<Command>, shared: Arc<Shared>) {
    let mut senders: HashMap<RequestId, Outputs> = HashMap::new();
    // The delivery task, once asked for (`EngineHandle::deliver_on`).
    let mut deliver: Option<UnboundedSender<Batch>> = None;
    // Prefix-cache event subscribers, and the number of the last batch sent.
    let mut subs: (Vec<UnboundedSender<KvEventBatch>>, u64) = (Vec::new(), 0);
    core.record_kv_events(true);
    let publish = |core: &mut EngineCore<B>, subs: &mut (Vec<UnboundedSender<KvEventBatch>>, u64)| {
        *shared.stats.lock().unwrap_or_else(|e| e.into_inner()) = core.stats();
        let events = core.take_kv_events();
        if !events.is_empty() && !subs.0.is_empty() {
            subs.1 += 1;
            let b = KvEventBatch { seq: subs.1, snapshot: false, events };
            subs.0.retain(|s| s.send(b.clone()).is_ok());
        }
    };
    let mut pending: Option<Command> = None;
    loop {
        // Take every pending command; block only when there is nothing to compute.
        let mut first = if let Some(c) = pending.take() {
            Some(c)
        } else if core.has_work() {
            match rx.try_recv() {
                Ok(c) => Some(c),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        } else {
            match rx.recv_timeout(Duration::from_millis(500)) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        };
        while let Some(cmd) = first.take().or_else(|| rx.try_recv().ok()) {
            match cmd {
                Command::Add { id, prompt, params, tx, export } => match match export {
                    None => core.add_request(id, prompt, params),
                    Some((sink, skip)) => core.add_exporting(id, prompt, params, sink, skip),
                } {
                    Ok(()) => {
                        senders.insert(id, tx);
                    }
                    // Validated by the caller (bar an exporting request's skip);
                    // report the failure to the client rather than leave it waiting.
                    Err(e) => {
                        tracing::error!(request = id, error = %e, "request rejected by the engine after validation");
                        let _ = tx.send(Err(e.to_string()));
                    }
                },
                Command::Reserve { id, prompt, params, tx, reply } => {
                    let r = core.reserve(id, prompt, params);
                    if r.is_ok() {
                        senders.insert(id, tx);
                    }
                    let _ = reply.send(r);
                }
                Command::Import { id, chunk } => {
                    if let Err(e) = core.import_kv(id, &chunk) {
                        tracing::error!(request = id, error = %e, "KV import failed; aborting the request");
                        core.abort(id);
                        senders.remove(&id);
                    }
                }
                Command::Activate { id, token, logprob, cached_tokens, reply } => {
                    match core.activate(id, token, logprob, cached_tokens) {
                        Ok(out) => {
                            let done = out.finish.is_some();
                            let at = Instant::now();
                            let sent = senders
                                .get(&id)
                                .is_some_and(|tx| tx.send(Ok(StreamItem { out, at, sent: at })).is_ok());
                            if !sent {
                                core.abort(id);
                            }
                            if done || !sent {
                                senders.remove(&id);
                            }
                            let _ = reply.send(Ok(()));
                        }
                        Err(e) => {
                            core.abort(id);
                            senders.remove(&id);
                            let _ = reply.send(Err(e));
                        }
                    }
                }
                Command::SubscribeKv(tx) => {
                    // Events recorded before this point go out first (to the others),
                    // so the snapshot and the numbering line up.
                    publish(&mut core, &mut subs);
                    let snap = KvEventBatch { seq: subs.1, snapshot: true, events: core.kv_snapshot() };
                    if tx.send(snap).is_ok() {
                        subs.0.push(tx);
                    }
                }
                Command::Deliver(tx) => deliver = Some(tx),
                Command::Abort(id) => {
                    core.abort(id);
                    senders.remove(&id);
                }
                Command::Shutdown => {
                    publish(&mut core, &mut subs);
                    return;
                }
            }
        }
        if core.has_work() {
            let steps = core.stats().steps;
            let outs = core.step();
            if outs.is_empty() && core.stats().steps == steps {
                // Work exists but none could be scheduled (waiting for blocks held by
                // requests whose KV is still arriving): wait for a command instead of
                // spinning. (A call that only read a deferred step's tokens ran no step
                // but has outputs, often the requests' last: they go out below.)
                if let Ok(c) = rx.recv_timeout(Duration::from_millis(2)) {
                    pending = Some(c);
                }
                continue;
            }
            // Stats (and prefix-cache events) first: whoever reads the stats after their
            // request's last output then sees the step that produced it.
            publish(&mut core, &mut subs);
            let at = Instant::now();
            let mut aborted = false;
            let mut batch: Batch = Vec::with_capacity(if deliver.is_some() { outs.len() } else { 0 });
            for out in outs {
                let id = out.id;
                let done = out.finish.is_some();
                let mut item = StreamItem { out, at, sent: at };
                let delivered = match (senders.get(&id), &deliver) {
                    // The delivery task sends it; a stream already closed is not.
                    (Some(tx), Some(_)) if !tx.is_closed() => {
                        batch.push((tx.clone(), item));
                        true
                    }
                    (Some(tx), None) => {
                        item.sent = Instant::now();
                        tx.send(Ok(item)).is_ok()
                    }
                    _ => false,
                };
                if !delivered {
                    // The client is gone: stop spending compute and KV on it.
                    core.abort(id);
                    senders.remove(&id);
                    aborted = true;
                } else if done {
                    senders.remove(&id);
                }
            }
            if let Some(d) = deliver.as_ref().filter(|_| !batch.is_empty()) {
                if let Err(e) = d.send(batch) {
                    // The task's runtime is gone: send this step's outputs here, and
                    // every later step's too.
                    for (tx, item) in e.0 {
                        let _ = tx.send(Ok(item));
                    }
                    deliver = None;
                }
            }
            if !aborted {
                continue; // published above, nothing changed since
            }
        }
        publish(&mut core, &mut subs);
    }
}
