//! The gRPC service (`disagg.v1.Inference`, see proto/): the same generate semantics as
//! the HTTP gateway, streaming tokens, plus the standard grpc.health.v1 service.
//!
//! Status codes: INVALID_ARGUMENT for bad requests (the message names the field),
//! NOT_FOUND for an unknown model, RESOURCE_EXHAUSTED when over capacity, UNAVAILABLE
//! while loading, UNAUTHENTICATED without the API key. A cancelled call drops its
//! engine stream, which aborts the request and frees its KV blocks.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::handle::SubmitError;
use engine::tokenizer::ChatMessage;
use futures::Stream;
use proto::v1::inference_server::{Inference, InferenceServer};
use proto::v1::{
    generate_request, tokenize_request, GenerateRequest, GenerateResponse, ModelInfoRequest, ModelInfoResponse,
    TokenizeRequest, TokenizeResponse,
};
use subtle::ConstantTimeEq;
use tonic::{Request, Response, Status};

use crate::error::ApiError;
use crate::AppState;

pub struct GrpcService {
    state: Arc<AppState>,
}

fn status(e: ApiError) -> Status {
    let msg = e.message.clone();
    match e.status.as_u16() {
        400 | 413 | 422 => Status::invalid_argument(msg),
        401 => Status::unauthenticated(msg),
        404 => Status::not_found(msg),
        429 => Status::resource_exhausted(msg),
        503 => Status::unavailable(msg),
        _ => Status::internal(msg),
    }
}

impl GrpcService {
    fn check_auth<T>(&self, req: &Request<T>) -> Result<(), Status> {
        if let Some(key) = &self.state.cfg.api_key {
            let given = req
                .metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .unwrap_or("");
            let ok: bool = crate::digest(given.as_bytes()).ct_eq(&crate::digest(key.as_bytes())).into();
            if !ok {
                return Err(status(ApiError::unauthorized()));
            }
        }
        Ok(())
    }

    fn chat_text(&self, messages: &[proto::v1::ChatMessage]) -> Result<String, Status> {
        let e = self.state.engine().map_err(status)?;
        let msgs: Vec<ChatMessage> = messages
            .iter()
            .map(|m| match m.role.as_str() {
                "system" | "user" | "assistant" => Ok(ChatMessage { role: m.role.clone(), content: m.content.clone() }),
                other => Err(Status::invalid_argument(format!(
                    "chat.messages.role '{}' is not one of system, user, assistant",
                    other.chars().take(32).collect::<String>()
                ))),
            })
            .collect::<Result<_, _>>()?;
        if msgs.is_empty() {
            return Err(Status::invalid_argument("chat.messages must not be empty"));
        }
        e.tokenizer.apply_chat_template(&msgs, true).map_err(|x| status(x.into()))
    }
}

type GenStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Inference for GrpcService {
    type GenerateStream = GenStream;

    async fn generate(&self, req: Request<GenerateRequest>) -> Result<Response<GenStream>, Status> {
        let arrival = Instant::now();
        self.check_auth(&req)?;
        let e = self.state.engine().map_err(status)?.clone();
        let r = req.into_inner();
        if !r.model.is_empty() && r.model != self.state.cfg.served_model_name {
            return Err(status(ApiError::model_not_found(&r.model)));
        }
        let prompt = match r.prompt {
            Some(generate_request::Prompt::Text(t)) => e.tokenizer.encode_prompt(&t).map_err(|x| status(x.into()))?,
            Some(generate_request::Prompt::TokenIds(ids)) => ids.ids,
            Some(generate_request::Prompt::Chat(c)) => {
                let text = self.chat_text(&c.messages)?;
                e.tokenizer.encode(&text).map_err(|x| status(x.into()))?
            }
            None => return Err(Status::invalid_argument("prompt: give text, token_ids or chat")),
        };
        let params = rpc::sampling_from_proto(r.sampling);
        let trace = self.state.telemetry.get().map(|_| crate::telemetry::TraceParent::new_root().header());
        let mut stream = e
            .submit_traced(prompt.clone(), params, engine::handle::RequestMeta { trace, session: None })
            .map_err(|x: SubmitError| status(x.into()))?;
        self.state.metrics.prompt_tokens.inc_by(prompt.len() as u64);
        let submitted = Instant::now();
        let state = self.state.clone();
        let prompt_len = prompt.len();
        let mut first = Some(prompt);
        let mut tracker = crate::handlers::Tracker::new(
            &state,
            arrival,
            &format!("grpc-{}", stream.id),
            submitted,
            "disagg.v1.Inference/Generate",
        )
        .with_trace(stream.trace.as_deref());
        let out = async_stream(move |tx| async move {
            while let Some(item) = stream.next().await {
                tracker.observe(&state, &item);
                tracker.emitted(&state, &item);
                let o = item.out;
                let done = o.finish.is_some();
                let mut resp = rpc::output_to_proto(o, first.take().unwrap_or_default());
                if let Some(u) = resp.usage.as_mut() {
                    u.prompt_tokens = prompt_len as u32;
                }
                if tx.send(Ok(resp)).await.is_err() || done {
                    return;
                }
            }
            let reason = stream.error().unwrap_or("the engine stopped before the request finished").to_string();
            let _ = tx.send(Err(Status::unavailable(reason))).await;
        });
        Ok(Response::new(out))
    }

    async fn tokenize(&self, req: Request<TokenizeRequest>) -> Result<Response<TokenizeResponse>, Status> {
        self.check_auth(&req)?;
        let e = self.state.engine().map_err(status)?;
        let ids = match req.into_inner().input {
            Some(tokenize_request::Input::Text(t)) => e.tokenizer.encode_prompt(&t),
            Some(tokenize_request::Input::Chat(c)) => e.tokenizer.encode(&self.chat_text(&c.messages)?),
            None => return Err(Status::invalid_argument("input: give text or chat")),
        }
        .map_err(|x| status(x.into()))?;
        Ok(Response::new(TokenizeResponse { token_ids: ids }))
    }

    async fn model_info(&self, req: Request<ModelInfoRequest>) -> Result<Response<ModelInfoResponse>, Status> {
        self.check_auth(&req)?;
        let e = self.state.engine().map_err(status)?;
        Ok(Response::new(ModelInfoResponse {
            served_model_name: self.state.cfg.served_model_name.clone(),
            model: e.model.name.clone(),
            max_model_len: e.limits.max_model_len as u32,
            vocab_size: e.limits.vocab as u32,
            backend: e.backend.to_string(),
        }))
    }
}

/// A stream fed by a task through a small channel: the task stops when the client is
/// gone (send fails), dropping the engine stream with it.
fn async_stream<F, Fut>(f: F) -> GenStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<GenerateResponse, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let fut = f(tx.clone());
    tokio::spawn(async move {
        tokio::select! {
            _ = fut => {}
            _ = tx.closed() => {}
        }
    });
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// Accepted gRPC connections with `TCP_NODELAY`: streamed responses are small writes,
/// and without it Nagle's algorithm holds each back until the peer's delayed ACK
/// (~40 ms), so tokens arrive in bursts.
pub fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// Serves `disagg.v1.Inference` and grpc.health.v1 on `listener` until `shutdown`.
/// Health reports NOT_SERVING until the engine is ready.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_not_serving::<InferenceServer<GrpcService>>().await;
    let ready_state = state.clone();
    tokio::spawn(async move {
        while ready_state.engine().is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        reporter.set_serving::<InferenceServer<GrpcService>>().await;
    });
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(InferenceServer::new(GrpcService { state }))
        .serve_with_incoming_shutdown(incoming(listener), shutdown)
        .await
}
