//! The route handlers. Each parses its body with [`openai::parse`], checks the model,
//! turns the request into engine submissions, and shapes the answer as OpenAI does.
//!
//! Cancellation: the engine streams of a request are owned by the handler future (or,
//! when streaming, by the response body). When the client goes away, hyper drops them,
//! and dropping a `RequestStream` aborts its request in the engine at once.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::handle::{EngineHandle, RequestStream, StreamItem};
use engine::sampling::{SamplingParams, TokenLogprob};
use engine::scheduler::FinishReason;
use engine::tokenizer::Tokenizer;
use futures::stream::{self, BoxStream, StreamExt};
use rand_core::{OsRng, TryRngCore};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::openai::{self, ChatRequest, CompletionRequest, DetokenizeRequest, Prompt, TokenizeRequest};
use crate::AppState;

type AppResult = Result<Response, ApiError>;

/// Bytes of an oversized body read and thrown away before answering 413, so that a
/// client still writing gets to read the answer; past this the connection is closed.
const DRAIN_LIMIT: usize = 64 << 20;

async fn read_body(s: &AppState, body: Body) -> Result<Bytes, ApiError> {
    let limit = s.cfg.max_body_bytes;
    let mut data = body.into_data_stream();
    let mut buf = Vec::new();
    let mut seen = 0usize;
    while let Some(chunk) = data.next().await {
        let chunk = chunk.map_err(|_| ApiError::invalid(None, "the request body could not be read"))?;
        seen += chunk.len();
        if seen <= limit {
            buf.extend_from_slice(&chunk);
        } else if seen > DRAIN_LIMIT {
            break;
        }
    }
    if seen > limit {
        return Err(ApiError::too_large(limit));
    }
    Ok(Bytes::from(buf))
}

/// Tokenizes on the blocking pool: a prompt of megabytes takes long enough to stall the
/// async workers (and with them every other stream) if done inline.
async fn tokenize_off_thread(
    tok: Arc<Tokenizer>,
    texts: Vec<String>,
    with_bos: bool,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let texts_len: usize = texts.iter().map(String::len).sum();
    let work = move || -> Result<Vec<Vec<u32>>, ApiError> {
        texts
            .iter()
            .map(|t| if with_bos { tok.encode_prompt(t) } else { tok.encode(t) }.map_err(ApiError::from))
            .collect()
    };
    // Short prompts (the common case) take microseconds: the hop to the blocking pool
    // would cost more than it saves.
    if texts_len <= 32 << 10 {
        return work();
    }
    tokio::task::spawn_blocking(work).await.map_err(|_| ApiError::internal("tokenization failed"))?
}

/// For `disagg bench serve` (`record_timings`, else nothing): the marks inside a
/// request's time before submission ([`crate::InProbe`], recorded with its timing). No
/// await lies between the body read and submission for prompts tokenized in place, so
/// one thread's use is measured (none is kept where the task moved to another thread).
struct InMarks(Option<(crate::InProbe, std::thread::ThreadId)>);

impl InMarks {
    fn body_read(s: &AppState, at: Instant) -> InMarks {
        InMarks(s.cfg.record_timings.then(|| {
            let p = crate::InProbe {
                body_read: at,
                parsed: at,
                tokenized: at,
                usage_read: crate::ThreadUsage::now(),
                usage_submitted: None,
            };
            (p, std::thread::current().id())
        }))
    }

    fn parsed(&mut self) {
        if let Some((p, _)) = &mut self.0 {
            p.parsed = Instant::now();
        }
    }

    fn tokenized(&mut self) {
        if let Some((p, _)) = &mut self.0 {
            p.tokenized = Instant::now();
        }
    }

    /// Just after submission.
    fn submitted(&mut self) {
        if let Some((p, thread)) = &mut self.0 {
            p.usage_submitted = crate::ThreadUsage::now();
            if std::thread::current().id() != *thread {
                p.usage_read = None;
            }
        }
    }

    /// What the request's trackers record with its timing.
    fn probe(&self) -> Option<crate::InProbe> {
        self.0.map(|(p, _)| p)
    }
}

fn check_model(s: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != s.cfg.served_model_name => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
}

fn request_id(prefix: &str) -> String {
    let mut b = [0u8; 12];
    let _ = OsRng.try_fill_bytes(&mut b);
    format!("{prefix}-{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>())
}

fn now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// JSON cannot hold -inf; OpenAI reports impossible tokens as -9999.
fn lp(x: f32) -> f32 {
    if x.is_finite() {
        x
    } else {
        -9999.0
    }
}

pub async fn health(State(s): State<Arc<AppState>>) -> AppResult {
    s.engine()?;
    Ok(Json(json!({})).into_response())
}

pub async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let stats = s.engine.get().map(|e| e.stats()).unwrap_or_default();
    ([("content-type", "text/plain; version=0.0.4")], s.metrics.render(&stats)).into_response()
}

pub async fn models(State(s): State<Arc<AppState>>) -> AppResult {
    let e = s.engine()?;
    Ok(Json(json!({
        "object": "list",
        "data": [{
            "id": s.cfg.served_model_name,
            "object": "model",
            "created": s.created,
            "owned_by": "disagg",
            "root": e.model.name,
            "max_model_len": e.limits.max_model_len,
        }]
    }))
    .into_response())
}

pub async fn tokenize(State(s): State<Arc<AppState>>, body: Body) -> AppResult {
    let e = s.engine()?.clone();
    let req: TokenizeRequest = openai::parse(&read_body(&s, body).await?)?;
    check_model(&s, req.model.as_deref())?;
    let ids = match (&req.prompt, &req.messages) {
        (Some(p), None) => {
            let with_bos = req.add_special_tokens.unwrap_or(true);
            tokenize_off_thread(e.tokenizer.clone(), vec![p.clone()], with_bos).await?.remove(0)
        }
        (None, Some(_)) => {
            let chat = ChatRequest {
                model: String::new(),
                messages: req.messages.clone().unwrap_or_default(),
                max_completion_tokens: None,
                logprobs: None,
                top_logprobs: None,
                add_generation_prompt: req.add_generation_prompt,
                sampling: Default::default(),
                unsupported: Default::default(),
                extra: Default::default(),
            };
            let text = e.tokenizer.apply_chat_template(&chat.messages()?, req.add_generation_prompt.unwrap_or(true))?;
            tokenize_off_thread(e.tokenizer.clone(), vec![text], false).await?.remove(0)
        }
        _ => return Err(ApiError::invalid(Some("prompt".into()), "give exactly one of 'prompt' or 'messages'")),
    };
    Ok(Json(json!({"count": ids.len(), "max_model_len": e.limits.max_model_len, "tokens": ids})).into_response())
}

pub async fn detokenize(State(s): State<Arc<AppState>>, body: Body) -> AppResult {
    let e = s.engine()?.clone();
    let req: DetokenizeRequest = openai::parse(&read_body(&s, body).await?)?;
    check_model(&s, req.model.as_deref())?;
    if let Some(bad) = req.tokens.iter().find(|t| **t as usize >= e.limits.vocab) {
        return Err(ApiError::invalid(
            Some("tokens".into()),
            format!("{bad} is not a token id (vocabulary size {})", e.limits.vocab),
        ));
    }
    let text = e.tokenizer.decode(&req.tokens, false)?;
    Ok(Json(json!({"prompt": text})).into_response())
}

/// Per-choice latency accounting into the vLLM-style histograms.
pub(crate) struct Tracker {
    arrival: Instant,
    submitted: Instant,
    id: String,
    route: &'static str,
    last: Option<Instant>,
    first: Option<Instant>,
    scheduled: Option<Instant>,
    /// The first output that carried text: engine time, handed to the stream, taken
    /// from it by the handler, and when the gateway had its bytes ready.
    first_text: Option<(Instant, Instant, Instant, Instant)>,
    /// When the handler took the output it is shaping now from its stream (set by
    /// `observe`, which runs first on every output).
    polled: Option<Instant>,
    /// The same for the second output that carried text.
    second_text: Option<(Instant, Instant)>,
    /// Inside the time before submission (`record_timings` only).
    in_probe: Option<crate::InProbe>,
    done: bool,
    /// Ids of this request's `request` span, chosen at submission (traces on).
    ids: Option<crate::telemetry::TraceParent>,
    /// Counts this choice as being answered while it lives (`DISAGG_GATEWAY_SPIN`).
    _spin: crate::SpinGuard,
}

impl Tracker {
    pub(crate) fn new(s: &AppState, arrival: Instant, id: &str, submitted: Instant, route: &'static str) -> Tracker {
        Tracker {
            _spin: s.spin.enter(),
            arrival,
            submitted,
            id: id.to_string(),
            route,
            last: None,
            first: None,
            scheduled: None,
            first_text: None,
            polled: None,
            second_text: None,
            in_probe: None,
            done: false,
            ids: None,
        }
    }

    /// Records `probe` with the request's timing.
    pub(crate) fn with_in_probe(mut self, probe: Option<crate::InProbe>) -> Tracker {
        self.in_probe = probe;
        self
    }

    /// Uses the ids of `traceparent` (the one the request was submitted with).
    pub(crate) fn with_trace(mut self, traceparent: Option<&str>) -> Tracker {
        self.ids = traceparent.and_then(crate::telemetry::TraceParent::parse);
        self
    }

    /// Metrics for one engine output.
    pub(crate) fn observe(&mut self, s: &AppState, item: &StreamItem) {
        self.polled = Some(Instant::now());
        let m = &s.metrics;
        match self.last {
            None => {
                let ttft = item.at.duration_since(self.arrival).as_secs_f64();
                m.time_to_first_token.observe(ttft);
                let sched = item.out.scheduled_at.unwrap_or(item.at);
                m.queue_time.observe(sched.saturating_duration_since(self.submitted).as_secs_f64());
                self.first = Some(item.at);
                self.scheduled = item.out.scheduled_at;
            }
            Some(prev) => m.inter_token_latency.observe(item.at.duration_since(prev).as_secs_f64()),
        }
        self.last = Some(item.at);
        m.generation_tokens.inc_by(item.out.new_token_ids.len() as u64);
        if let Some(f) = &item.out.finish {
            m.e2e_latency.observe(item.at.duration_since(self.arrival).as_secs_f64());
            m.request_success.with_label_values(&[f.as_str()]).inc();
        }
    }

    /// Notes that the gateway has the bytes for `item` ready to send (now); at the end,
    /// records the request's timing and trace spans when those are enabled.
    pub(crate) fn emitted(&mut self, s: &AppState, item: &StreamItem) {
        let now = Instant::now();
        let polled = self.polled.unwrap_or(now);
        if !item.out.new_text.is_empty() {
            if self.first_text.is_none() {
                self.first_text = Some((item.at, item.sent, polled, now));
            } else if self.second_text.is_none() {
                self.second_text = Some((item.at, now));
            }
        }
        let Some(f) = &item.out.finish else { return };
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        tracing::debug!(
            request_id = %self.id,
            route = self.route,
            prompt_tokens = item.out.prompt_tokens,
            completion_tokens = item.out.completion_tokens,
            finish_reason = f.as_str(),
            e2e_ms = now.duration_since(self.arrival).as_secs_f64() * 1e3,
            "request finished"
        );
        if s.cfg.record_timings {
            let (engine_first_text, sent_first_text, polled_first_text, emit_first_text) =
                self.first_text.unwrap_or((item.at, item.sent, polled, now));
            s.timings.lock().unwrap_or_else(|e| e.into_inner()).push(crate::RequestTiming {
                id: self.id.clone(),
                arrival: self.arrival,
                submitted: self.submitted,
                engine_first_text,
                sent_first_text,
                polled_first_text,
                emit_first_text,
                second_text: self.second_text,
                engine_finish: item.at,
                sent_finish: item.sent,
                polled_finish: polled,
                emit_finish: now,
                in_probe: self.in_probe,
            });
        }
        if let Some(t) = s.telemetry.get() {
            t.record(&crate::telemetry::RequestSpans {
                ids: self.ids,
                id: &self.id,
                route: self.route,
                arrival: self.arrival,
                submitted: self.submitted,
                scheduled: self.scheduled,
                first_token: self.first.unwrap_or(item.at),
                finished: item.at,
                emitted: now,
                prompt_tokens: item.out.prompt_tokens,
                completion_tokens: item.out.completion_tokens,
                finish_reason: f.as_str(),
            });
        }
    }
}

/// Submits `n` choices of one prompt (seeded choices get seeds `seed + i`).
fn submit_n(
    s: &AppState,
    e: &EngineHandle,
    prompt: &[u32],
    params: &SamplingParams,
    n: usize,
    session: Option<&str>,
) -> Result<Vec<RequestStream>, ApiError> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut p = params.clone();
        p.seed = p.seed.map(|x| x.wrapping_add(i as u64));
        // On failure the streams already submitted are dropped here, which aborts them.
        // With traces on, each choice's `request` span gets its ids now, so a remote
        // engine's spans can join its trace.
        let trace = s.telemetry.get().map(|_| crate::telemetry::TraceParent::new_root().header());
        let meta = engine::handle::RequestMeta { trace, session: session.map(str::to_string) };
        out.push(e.submit_traced(prompt.to_vec(), p, meta)?);
    }
    s.metrics.prompt_tokens.inc_by(prompt.len() as u64);
    Ok(out)
}

/// A finished choice, collected.
#[derive(Default)]
struct Collected {
    ids: Vec<u32>,
    text: String,
    logprobs: Vec<TokenLogprob>,
    finish: Option<FinishReason>,
    cached: usize,
}

async fn collect(mut st: RequestStream, s: &AppState, mut t: Tracker) -> Result<Collected, ApiError> {
    let mut c = Collected::default();
    while let Some(item) = st.next().await {
        t.observe(s, &item);
        t.emitted(s, &item);
        c.ids.extend(&item.out.new_token_ids);
        c.text.push_str(&item.out.new_text);
        c.logprobs.extend(item.out.logprobs);
        if let Some(f) = item.out.finish {
            c.finish = Some(f);
            c.cached = item.out.cached_tokens;
            return Ok(c);
        }
    }
    Err(ApiError::unavailable(st.error().unwrap_or("the engine stopped before the request finished")))
}

/// Collects every choice of a non-streaming request concurrently; returns them in
/// order with the total number of generated tokens.
async fn collect_all(
    streams: Vec<RequestStream>,
    s: &AppState,
    arrival: Instant,
    id: &str,
    submitted: Instant,
    route: &'static str,
    in_probe: Option<crate::InProbe>,
) -> Result<(Vec<Collected>, usize), ApiError> {
    let results = futures::future::join_all(streams.into_iter().map(|st| {
        let t = Tracker::new(s, arrival, id, submitted, route).with_trace(st.trace.as_deref()).with_in_probe(in_probe);
        collect(st, s, t)
    }))
    .await;
    let choices = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    let completion = choices.iter().map(|c| c.ids.len()).sum();
    Ok((choices, completion))
}

fn finish_str(f: &Option<FinishReason>) -> Value {
    match f {
        Some(FinishReason::Stop) => "stop".into(),
        Some(FinishReason::Length) => "length".into(),
        Some(FinishReason::Abort) => "abort".into(),
        None => Value::Null,
    }
}

fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let b = tok.token_bytes(id);
    (String::from_utf8_lossy(&b).into_owned(), b)
}

fn chat_logprobs(tok: &Tokenizer, lps: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let (t, b) = token_text(tok, l.token);
            json!({
                "token": t, "logprob": lp(l.logprob), "bytes": b,
                "top_logprobs": l.top.iter().map(|(id, x)| {
                    let (t, b) = token_text(tok, *id);
                    json!({"token": t, "logprob": lp(*x), "bytes": b})
                }).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "content": content })
}

/// Legacy completions logprobs; `offset` is where this piece's text starts.
fn completion_logprobs(tok: &Tokenizer, lps: &[TokenLogprob], mut offset: usize) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top = Vec::new();
    let mut offsets = Vec::new();
    for l in lps {
        let (t, _) = token_text(tok, l.token);
        offsets.push(offset);
        offset += t.len();
        tokens.push(t);
        token_logprobs.push(lp(l.logprob));
        let m: serde_json::Map<String, Value> =
            l.top.iter().map(|(id, x)| (token_text(tok, *id).0, json!(lp(*x)))).collect();
        top.push(Value::Object(m));
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
}

/// `cached`: per choice, the prompt tokens its engine took from the prefix cache; the
/// `n` choices of one prompt count it once (the best of them), as its prompt tokens.
fn usage(prompt: usize, completion: usize, cached: &[usize], n: usize) -> Value {
    let cached: usize = cached.chunks(n.max(1)).map(|c| c.iter().copied().max().unwrap_or(0)).sum();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// One merged stream over several choices: `(choice index, item)`, or the reason a
/// choice ended without finishing (once, as its last element).
fn merge(streams: Vec<(usize, RequestStream)>) -> BoxStream<'static, (usize, Result<StreamItem, String>)> {
    stream::select_all(streams.into_iter().map(|(i, st)| {
        stream::unfold(Some(st), move |st| async move {
            let mut st = st?;
            match st.next().await {
                Some(it) => Some(((i, Ok(it)), Some(st))),
                None => st.error().map(|e| ((i, Err(e.to_string())), None)),
            }
        })
        .boxed()
    }))
    .boxed()
}

fn event(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

/// How one endpoint shapes its streamed chunks.
trait ChunkFormat: Send + 'static {
    /// The chunk for one engine output of choice `i`, if it carries anything.
    /// Returns the event's JSON text (built directly on the common path, which runs
    /// once per token per stream).
    fn piece(&mut self, i: usize, out: &engine::scheduler::RequestOutput) -> Option<String>;
    /// A chunk object around `choices`.
    fn chunk(&self, choices: Value) -> Value;
    /// The trailing chunk with usage only.
    fn usage_chunk(&self, usage: Value) -> Value {
        let mut v = self.chunk(json!([]));
        v["usage"] = usage;
        v
    }
}

/// Drives the merged engine streams into server-sent events: the formatter's chunks,
/// a usage chunk when asked, then `[DONE]`. Owning the streams, it cancels them when
/// the response body is dropped (client gone).
struct EventStream<F: ChunkFormat> {
    merged: BoxStream<'static, (usize, Result<StreamItem, String>)>,
    pending: std::collections::VecDeque<Event>,
    trackers: Vec<Tracker>,
    state: Arc<AppState>,
    format: F,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Per choice, from its last output; choices come `n` per prompt.
    cached: Vec<usize>,
    n: usize,
    include_usage: bool,
    done: bool,
}

impl<F: ChunkFormat> EventStream<F> {
    fn into_body(self, head: Vec<Event>) -> Response {
        let mut me = self;
        me.pending.extend(head);
        let events = stream::unfold(me, |mut me| async move {
            loop {
                if let Some(ev) = me.pending.pop_front() {
                    return Some((Ok::<_, Infallible>(ev), me));
                }
                if me.done {
                    return None;
                }
                match me.merged.next().await {
                    Some((_, Err(reason))) => {
                        // A choice ended without finishing (a worker failed): say so in
                        // the stream, as OpenAI-compatible servers do, and end it.
                        let err = ApiError::unavailable(reason);
                        me.pending.push_back(event(&err.body()));
                        me.pending.push_back(Event::default().data("[DONE]"));
                        me.done = true;
                    }
                    Some((i, Ok(item))) => {
                        me.trackers[i].observe(&me.state, &item);
                        me.completion_tokens += item.out.new_token_ids.len();
                        if item.out.finish.is_some() {
                            me.cached[i] = item.out.cached_tokens;
                        }
                        if let Some(text) = me.format.piece(i, &item.out) {
                            me.pending.push_back(Event::default().data(text));
                        }
                        me.trackers[i].emitted(&me.state, &item);
                    }
                    None => {
                        if me.include_usage {
                            let u = usage(me.prompt_tokens, me.completion_tokens, &me.cached, me.n);
                            me.pending.push_back(event(&me.format.usage_chunk(u)));
                        }
                        me.pending.push_back(Event::default().data("[DONE]"));
                        me.done = true;
                    }
                }
            }
        });
        Sse::new(events).keep_alive(KeepAlive::default()).into_response()
    }
}

struct ChatChunks {
    id: String,
    created: u64,
    model: String,
    tok: Arc<Tokenizer>,
    want_lp: bool,
    envelope: Option<String>,
}

impl ChatChunks {
    /// `{"id":…,"object":…,"created":…,"model":…,"choices":[` for hand-built chunks.
    fn envelope(&mut self) -> &str {
        let (id, created, model) = (&self.id, self.created, &self.model);
        self.envelope.get_or_insert_with(|| {
            format!(
                r#"{{"id":{},"object":"chat.completion.chunk","created":{created},"model":{},"choices":["#,
                Value::from(id.as_str()),
                Value::from(model.as_str())
            )
        })
    }
}

/// `"stop"`, `"length"`, … or `null`, as JSON text.
fn finish_json(f: &Option<FinishReason>) -> &'static str {
    match f {
        Some(FinishReason::Stop) => r#""stop""#,
        Some(FinishReason::Length) => r#""length""#,
        Some(FinishReason::Abort) => r#""abort""#,
        None => "null",
    }
}

impl ChunkFormat for ChatChunks {
    fn chunk(&self, choices: Value) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model, "choices": choices})
    }

    fn piece(&mut self, i: usize, o: &engine::scheduler::RequestOutput) -> Option<String> {
        if o.new_text.is_empty() && !self.want_lp && o.finish.is_none() {
            return None;
        }
        if self.want_lp {
            let delta = if o.new_text.is_empty() { json!({}) } else { json!({"content": o.new_text}) };
            let lps = chat_logprobs(&self.tok, &o.logprobs);
            let v = self
                .chunk(json!([{"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish_str(&o.finish)}]));
            return Some(v.to_string());
        }
        let delta = if o.new_text.is_empty() {
            "{}".to_string()
        } else {
            format!(r#"{{"content":{}}}"#, Value::from(o.new_text.as_str()))
        };
        let fin = finish_json(&o.finish);
        Some(format!(r#"{}{{"index":{i},"delta":{delta},"logprobs":null,"finish_reason":{fin}}}]}}"#, self.envelope()))
    }
}

/// The session a request belongs to (a routing hint): the `x-session-id` header, else
/// the OpenAI `user` field.
fn session<'a>(headers: &'a HeaderMap, sampling: &'a openai::Sampling) -> Option<&'a str> {
    headers.get("x-session-id").and_then(|v| v.to_str().ok()).or(sampling.user.as_deref()).filter(|s| !s.is_empty())
}

pub async fn chat(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> AppResult {
    let arrival = Instant::now();
    let e = s.engine()?.clone();
    let body = read_body(&s, body).await?;
    let mut marks = InMarks::body_read(&s, Instant::now());
    let req: ChatRequest = openai::parse(&body)?;
    openai::reject_extra(&req.extra)?;
    req.unsupported.check()?;
    check_model(&s, Some(&req.model))?;
    let messages = req.messages()?;
    marks.parsed();
    let text = e.tokenizer.apply_chat_template(&messages, req.add_generation_prompt.unwrap_or(true))?;
    let prompt = tokenize_off_thread(e.tokenizer.clone(), vec![text], false).await?.remove(0);
    marks.tokenized();
    let max_tokens = req.max_completion_tokens.or(req.sampling.max_tokens);
    let params = req.sampling.to_params(max_tokens, req.top_logprobs()?, e.limits.vocab)?;
    let n = req.sampling.n();
    let streams = submit_n(&s, &e, &prompt, &params, n, session(&headers, &req.sampling)).map_err(ApiError::in_chat)?;
    let submitted = Instant::now();
    marks.submitted();
    let format = ChatChunks {
        id: request_id("chatcmpl"),
        created: now_s(),
        model: s.cfg.served_model_name.clone(),
        tok: e.tokenizer.clone(),
        want_lp: params.logprobs.is_some(),
        envelope: None,
    };
    if !req.sampling.stream() {
        let (results, completion) =
            collect_all(streams, &s, arrival, &format.id, submitted, "/v1/chat/completions", marks.probe()).await?;
        let cached: Vec<usize> = results.iter().map(|c| c.cached).collect();
        let mut choices = Vec::with_capacity(n);
        for (i, c) in results.into_iter().enumerate() {
            choices.push(json!({
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": if format.want_lp { chat_logprobs(&e.tokenizer, &c.logprobs) } else { Value::Null },
                "finish_reason": finish_str(&c.finish),
            }));
            if req.sampling.return_token_ids == Some(true) {
                choices[i]["token_ids"] = json!(c.ids);
            }
        }
        return Ok(Json(json!({
            "id": format.id, "object": "chat.completion", "created": format.created, "model": format.model,
            "choices": choices, "usage": usage(prompt.len(), completion, &cached, n),
        }))
        .into_response());
    }
    // OpenAI opens each choice with a chunk that carries the role.
    let head = (0..n)
        .map(|i| event(&format.chunk(json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]))))
        .collect();
    let traces: Vec<Option<String>> = streams.iter().map(|st| st.trace.clone()).collect();
    Ok(EventStream {
        merged: merge(streams.into_iter().enumerate().collect()),
        pending: Default::default(),
        trackers: (0..n)
            .map(|i| {
                Tracker::new(&s, arrival, &format.id, submitted, "/v1/chat/completions")
                    .with_trace(traces[i].as_deref())
                    .with_in_probe(marks.probe())
            })
            .collect(),
        state: s.clone(),
        format,
        prompt_tokens: prompt.len(),
        completion_tokens: 0,
        cached: vec![0; n],
        n,
        include_usage: req.sampling.include_usage(),
        done: false,
    }
    .into_body(head))
}

struct CompletionChunks {
    id: String,
    created: u64,
    model: String,
    tok: Arc<Tokenizer>,
    want_lp: bool,
    /// Text emitted so far per choice (for logprob text offsets).
    offsets: Vec<usize>,
    envelope: Option<String>,
}

impl ChunkFormat for CompletionChunks {
    fn chunk(&self, choices: Value) -> Value {
        json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "choices": choices})
    }

    fn piece(&mut self, i: usize, o: &engine::scheduler::RequestOutput) -> Option<String> {
        if o.new_text.is_empty() && !self.want_lp && o.finish.is_none() {
            return None;
        }
        if self.want_lp {
            let lps = completion_logprobs(&self.tok, &o.logprobs, self.offsets[i]);
            self.offsets[i] += o.new_text.len();
            let v = self.chunk(
                json!([{"index": i, "text": o.new_text, "logprobs": lps, "finish_reason": finish_str(&o.finish)}]),
            );
            return Some(v.to_string());
        }
        self.offsets[i] += o.new_text.len();
        let envelope = self.envelope.get_or_insert_with(|| {
            format!(
                r#"{{"id":{},"object":"text_completion","created":{},"model":{},"choices":["#,
                Value::from(self.id.as_str()),
                self.created,
                Value::from(self.model.as_str())
            )
        });
        Some(format!(
            r#"{envelope}{{"index":{i},"text":{},"logprobs":null,"finish_reason":{}}}]}}"#,
            Value::from(o.new_text.as_str()),
            finish_json(&o.finish)
        ))
    }
}

pub async fn completions(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> AppResult {
    let arrival = Instant::now();
    let e = s.engine()?.clone();
    let body = read_body(&s, body).await?;
    let mut marks = InMarks::body_read(&s, Instant::now());
    let req: CompletionRequest = openai::parse(&body)?;
    openai::reject_extra(&req.extra)?;
    req.unsupported.check()?;
    check_model(&s, Some(&req.model))?;
    let echo = req.echo.unwrap_or(false);
    let logprobs = req.logprobs.map(|n| n as usize);
    if echo && logprobs.is_some() {
        return Err(ApiError::invalid(
            Some("echo".into()),
            "echo together with logprobs (prompt logprobs) is not supported; drop one of them",
        ));
    }
    marks.parsed();
    let prompts: Vec<Vec<u32>> = match &req.prompt {
        Prompt::Text(t) => tokenize_off_thread(e.tokenizer.clone(), vec![t.clone()], true).await?,
        Prompt::Texts(ts) => tokenize_off_thread(e.tokenizer.clone(), ts.clone(), true).await?,
        Prompt::Ids(ids) => vec![ids.clone()],
        Prompt::IdLists(l) => l.clone(),
    };
    marks.tokenized();
    if prompts.is_empty() || prompts.len() > 64 {
        return Err(ApiError::invalid(Some("prompt".into()), "give between 1 and 64 prompts"));
    }
    let params = req.sampling.to_params(req.sampling.max_tokens.or(Some(16)), logprobs, e.limits.vocab)?;
    let n = req.sampling.n();
    let mut streams = Vec::new();
    for p in &prompts {
        streams.extend(submit_n(&s, &e, p, &params, n, session(&headers, &req.sampling))?);
    }
    let submitted = Instant::now();
    marks.submitted();
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    // With echo, each choice's text starts with its prompt.
    let prefixes: Vec<String> = prompts
        .iter()
        .flat_map(|p| {
            let t = if echo { e.tokenizer.decode(p, false).unwrap_or_default() } else { String::new() };
            std::iter::repeat_n(t, n)
        })
        .collect();
    let mut format = CompletionChunks {
        id: request_id("cmpl"),
        created: now_s(),
        model: s.cfg.served_model_name.clone(),
        tok: e.tokenizer.clone(),
        want_lp: logprobs.is_some(),
        offsets: prefixes.iter().map(String::len).collect(),
        envelope: None,
    };
    let total = streams.len();
    if !req.sampling.stream() {
        let (results, completion) =
            collect_all(streams, &s, arrival, &format.id, submitted, "/v1/completions", marks.probe()).await?;
        let cached: Vec<usize> = results.iter().map(|c| c.cached).collect();
        let mut choices = Vec::with_capacity(total);
        for (i, c) in results.into_iter().enumerate() {
            choices.push(json!({
                "index": i,
                "text": format!("{}{}", prefixes[i], c.text),
                "logprobs": if format.want_lp { completion_logprobs(&e.tokenizer, &c.logprobs, prefixes[i].len()) } else { Value::Null },
                "finish_reason": finish_str(&c.finish),
            }));
            if req.sampling.return_token_ids == Some(true) {
                choices[i]["token_ids"] = json!(c.ids);
            }
        }
        return Ok(Json(json!({
            "id": format.id, "object": "text_completion", "created": format.created, "model": format.model,
            "choices": choices, "usage": usage(prompt_tokens, completion, &cached, n),
        }))
        .into_response());
    }
    let head = prefixes
        .iter()
        .enumerate()
        .filter(|(_, p)| !p.is_empty())
        .map(|(i, p)| event(&format.chunk(json!([{"index": i, "text": p, "logprobs": null, "finish_reason": null}]))))
        .collect();
    format.offsets = prefixes.iter().map(String::len).collect();
    let traces: Vec<Option<String>> = streams.iter().map(|st| st.trace.clone()).collect();
    Ok(EventStream {
        merged: merge(streams.into_iter().enumerate().collect()),
        pending: Default::default(),
        trackers: (0..total)
            .map(|i| {
                Tracker::new(&s, arrival, &format.id, submitted, "/v1/completions")
                    .with_trace(traces[i].as_deref())
                    .with_in_probe(marks.probe())
            })
            .collect(),
        state: s.clone(),
        format,
        prompt_tokens,
        completion_tokens: 0,
        cached: vec![0; total],
        n,
        include_usage: req.sampling.include_usage(),
        done: false,
    }
    .into_body(head))
}
