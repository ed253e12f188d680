//! Errors as OpenAI's API returns them: `{"error": {"message", "type", "param", "code"}}`
//! with the matching HTTP status. The one place where failures become HTTP.
//!
//! Messages say what to change; they never echo the prompt or internal details.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use engine::handle::SubmitError;
use engine::EngineError;
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400: a value the client sent is invalid; `param` names it.
    pub fn invalid(param: impl Into<Option<String>>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.into(),
            code: None,
        }
    }

    /// 400 for a parameter this server does not implement.
    pub fn unsupported(param: &str) -> Self {
        ApiError {
            code: Some("unsupported_parameter"),
            ..Self::invalid(Some(param.to_string()), format!("the parameter '{param}' is not supported by this server"))
        }
    }

    pub fn unparsable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_json"),
        }
    }

    pub fn too_large(limit: usize) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("the request body is larger than {limit} bytes"),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
        }
    }

    pub fn model_not_found(model: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("the model '{}' does not exist; GET /v1/models lists the served model", truncate(model)),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "missing or incorrect API key; send it as 'Authorization: Bearer KEY'".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn overloaded(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            kind: "rate_limit_error",
            param: None,
            code: Some("overloaded"),
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("unavailable"),
        }
    }

    pub fn not_found(path: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("no route for {}", truncate(path)),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
        }
    }

    pub fn method_not_allowed() -> Self {
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: "method not allowed for this route".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("method_not_allowed"),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// In a chat request the prompt is made of the messages: an error about the prompt
    /// names `messages` as its param.
    pub fn in_chat(mut self) -> Self {
        if self.param.as_deref() == Some("prompt") {
            self.param = Some("messages".into());
        }
        self
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

fn truncate(s: &str) -> String {
    let mut t: String = s.chars().take(80).collect();
    if t.len() < s.len() {
        t.push('…');
    }
    t
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::InvalidRequest(m) => {
                // The engine names the parameter first in its messages ("top_p must…",
                // "the prompt has…").
                let param = m
                    .strip_prefix("the ")
                    .unwrap_or(&m)
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .next()
                    .filter(|w| w.contains('_') || ["temperature", "logprobs", "stop", "prompt", "n"].contains(w))
                    .map(str::to_string);
                ApiError::invalid(param, m)
            }
            EngineError::Unsupported(m) => ApiError::invalid(None, m),
            EngineError::Model(m) => ApiError::internal(m),
            EngineError::Busy(m) => ApiError::overloaded(m),
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Invalid(e) => e.into(),
            SubmitError::Overloaded(_) | SubmitError::Busy(_) => ApiError::overloaded(e.to_string()),
            SubmitError::Stopped => ApiError::unavailable(e.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS || self.status == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut().insert("retry-after", HeaderValue::from_static("1"));
        }
        r
    }
}
