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

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kernels::Backend;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::config::ModelConfig;
use crate::sampling::SamplingParams;
use crate::scheduler::{EngineCore, EngineStats, Limits, RequestId, RequestOutput};
use crate::tokenizer::Tokenizer;
use crate::EngineError;

/// One output of a request and when the engine produced it.
#[derive(Debug, Clone)]
pub struct StreamItem {
    pub out: RequestOutput,
    pub at: Instant,
}

enum Command {
    Add { id: RequestId, prompt: Vec<u32>, params: SamplingParams, tx: UnboundedSender<StreamItem> },
    Abort(RequestId),
    Shutdown,
}

struct Shared {
    stats: Mutex<EngineStats>,
    in_flight: AtomicUsize,
    next_id: AtomicU64,
}

/// A cheap, cloneable handle to an engine running on its own thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Command>,
    shared: Arc<Shared>,
    pub tokenizer: Arc<Tokenizer>,
    pub model: Arc<ModelConfig>,
    pub limits: Limits,
    pub backend: Arc<String>,
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
        });
        let handle = EngineHandle {
            tx,
            tokenizer: core.tokenizer.clone(),
            model: Arc::new(core.model.cfg.clone()),
            limits: core.limits(),
            backend: Arc::new(core.backend().describe()),
            shared: shared.clone(),
            max_in_flight,
        };
        std::thread::Builder::new()
            .name("disagg-engine".into())
            .spawn(move || engine_loop(core, rx, shared))
            .expect("spawning the engine thread");
        handle
    }

    /// Submits a request. The returned stream yields its outputs; dropping it early
    /// cancels the request.
    pub fn submit(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<RequestStream, SubmitError> {
        self.limits.validate(&prompt, &params).map_err(SubmitError::Invalid)?;
        let n = self.shared.in_flight.fetch_add(1, Ordering::SeqCst);
        if n >= self.max_in_flight {
            self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Overloaded(n));
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = unbounded_channel();
        if self.tx.send(Command::Add { id, prompt, params, tx }).is_err() {
            self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Stopped);
        }
        Ok(RequestStream { id, rx, tx: self.tx.clone(), shared: self.shared.clone(), finished: false })
    }

    pub fn stats(&self) -> EngineStats {
        self.shared.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Requests accepted and not yet finished or cancelled.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// Stops the engine thread (requests in flight end without a finish reason).
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

/// The outputs of one request, in order; the last one has `finish` set.
pub struct RequestStream {
    pub id: RequestId,
    rx: UnboundedReceiver<StreamItem>,
    tx: Sender<Command>,
    shared: Arc<Shared>,
    finished: bool,
}

impl RequestStream {
    /// The next output, or `None` when the request has finished (or the engine stopped).
    pub async fn next(&mut self) -> Option<StreamItem> {
        if self.finished {
            return None;
        }
        let item = self.rx.recv().await;
        self.note(&item);
        item
    }

    /// Blocking form of [`RequestStream::next`], for synchronous callers.
    pub fn blocking_next(&mut self) -> Option<StreamItem> {
        if self.finished {
            return None;
        }
        let item = self.rx.blocking_recv();
        self.note(&item);
        item
    }

    fn note(&mut self, item: &Option<StreamItem>) {
        match item {
            Some(i) if i.out.finish.is_some() => self.finish(),
            None => self.finish(),
            _ => {}
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
            let _ = self.tx.send(Command::Abort(self.id));
            self.finish();
        }
    }
}

fn engine_loop<B: Backend>(mut core: EngineCore<B>, rx: Receiver<Command>, shared: Arc<Shared>) {
    let mut senders: HashMap<RequestId, UnboundedSender<StreamItem>> = HashMap::new();
    let publish = |core: &EngineCore<B>| {
        *shared.stats.lock().unwrap_or_else(|e| e.into_inner()) = core.stats();
    };
    loop {
        // Take every pending command; block only when there is nothing to compute.
        let mut first = if core.has_work() {
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
                Command::Add { id, prompt, params, tx } => match core.add_request(id, prompt, params) {
                    Ok(()) => {
                        senders.insert(id, tx);
                    }
                    // Validated by the caller; a failure here is a bug, but report it
                    // to the client rather than leaving it waiting.
                    Err(e) => {
                        tracing::error!(request = id, error = %e, "request rejected by the engine after validation");
                        drop(tx);
                    }
                },
                Command::Abort(id) => {
                    core.abort(id);
                    senders.remove(&id);
                }
                Command::Shutdown => {
                    publish(&core);
                    return;
                }
            }
        }
        if core.has_work() {
            let outs = core.step();
            let at = Instant::now();
            for out in outs {
                let id = out.id;
                let done = out.finish.is_some();
                let delivered = senders.get(&id).is_some_and(|tx| tx.send(StreamItem { out, at }).is_ok());
                if !delivered {
                    // The client is gone: stop spending compute and KV on it.
                    core.abort(id);
                    senders.remove(&id);
                } else if done {
                    senders.remove(&id);
                }
            }
        }
        publish(&core);
    }
}
