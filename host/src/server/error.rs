//! Errors at the HTTP edge, in the OpenAI error format:
//! `{"error": {"message", "type", "param", "code"}}` with a matching status code.

use http::StatusCode;
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (429s).
    pub retry_after: Option<u64>,
    /// For a caller that asked for plugin debugging: the `gateway_debug` report (raw text,
    /// plugin logs) of a request that failed in its plugins.
    pub debug: Option<Box<serde_json::Value>>,
}

impl ApiError {
    /// An upstream model's replicas failed (502), timed out (504) or none was available (503).
    pub fn upstream(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind: "api_error",
            message: message.into(),
            param: None,
            code: Some(code),
            retry_after: (status == StatusCode::SERVICE_UNAVAILABLE).then_some(1),
            debug: None,
        }
    }

    /// 400: the request is malformed or a field is invalid; `param` names the field.
    pub fn invalid(param: impl Into<Option<&'static str>>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: param.into().map(String::from),
            code: None,
            retry_after: None,
            debug: None,
        }
    }

    /// A 400 whose parameter is a path built at run time (`tools[2].function.parameters`).
    pub fn invalid_at(param: String, message: impl Into<String>) -> Self {
        Self {
            param: Some(param),
            ..Self::invalid(None, message)
        }
    }

    pub fn model_not_found(model: &str, available: &[String]) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!(
                "The model `{model}` does not exist. Available models: {}.",
                available.join(", ")
            ),
            param: Some("model".into()),
            code: Some("model_not_found"),
            retry_after: None,
            debug: None,
        }
    }

    pub fn not_found(path: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!(
                "Unknown route {path}. See /v1/models, /v1/chat/completions, /v1/completions."
            ),
            param: None,
            code: Some("unknown_url"),
            retry_after: None,
            debug: None,
        }
    }

    pub fn method_not_allowed(method: &http::Method, path: &str) -> Self {
        Self {
            status: StatusCode::METHOD_NOT_ALLOWED,
            kind: "invalid_request_error",
            message: format!("{method} is not allowed on {path}."),
            param: None,
            code: Some("method_not_allowed"),
            retry_after: None,
            debug: None,
        }
    }

    /// The body arrived too slowly: a stalled or trickling client (408, as nginx answers).
    pub fn body_timeout(gap_ms: u64, min_rate: u64) -> Self {
        Self {
            status: StatusCode::REQUEST_TIMEOUT,
            kind: "invalid_request_error",
            message: format!(
                "The request body arrived too slowly: more than {gap_ms} ms without data, or under {min_rate} bytes/s."
            ),
            param: None,
            code: Some("request_timeout"),
            retry_after: None,
            debug: None,
        }
    }

    pub fn too_large(limit: usize) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            kind: "invalid_request_error",
            message: format!(
                "Request body is larger than the {limit}-byte limit; send a smaller body."
            ),
            param: None,
            code: Some("request_too_large"),
            retry_after: None,
            debug: None,
        }
    }

    pub fn overloaded(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: Some("server_overloaded"),
            retry_after: None,
            debug: None,
        }
    }

    /// A generation cut at the drain deadline of a shutdown; another replica can take it.
    pub fn shutting_down() -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            message: "The gateway is shutting down and this generation was cut at its drain \
                      deadline (drain_seconds); retry the request."
                .into(),
            param: None,
            code: Some("server_shutting_down"),
            retry_after: None,
            debug: None,
        }
    }

    /// The shared store (PostgreSQL) did not take an admin change; nothing changed anywhere.
    pub fn store_unavailable(e: &crate::cluster::StoreError) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            message: format!(
                "The change could not be stored for the other replicas, so it was not made: {e}"
            ),
            param: None,
            code: Some("store_unavailable"),
            retry_after: Some(1),
            debug: None,
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
            debug: None,
        }
    }

    pub fn body(&self) -> serde_json::Value {
        let mut body = json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}});
        if let Some(d) = &self.debug {
            body["gateway_debug"] = (**d).clone();
        }
        body
    }
}

impl From<serde_json::Error> for ApiError {
    fn from(e: serde_json::Error) -> Self {
        use serde_json::error::Category;
        let msg = match e.classify() {
            Category::Syntax | Category::Eof => format!("Request body is not valid JSON: {e}."),
            _ => format!("Invalid request: {e}."),
        };
        ApiError::invalid(None, msg)
    }
}

mod domains;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugins::CallError;
    use crate::tenancy::Denied;

    #[test]
    fn bodies_have_the_openai_shape() {
        let e = ApiError::invalid("top_p", "`top_p` must be greater than 0.");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let b = e.body();
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["param"], "top_p");
        assert!(b["error"]["code"].is_null());
        assert_eq!(b["error"]["message"], "`top_p` must be greater than 0.");
        let r = super::super::Response::from(&ApiError::too_large(10));
        assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(r.headers()[http::header::CONTENT_TYPE], "application/json");
    }

    #[test]
    fn domain_errors_map_to_status_and_code() {
        let ledger = ApiError::denied(Denied::LedgerUnavailable);
        assert_eq!(
            (ledger.status, ledger.code),
            (StatusCode::SERVICE_UNAVAILABLE, Some("ledger_unavailable"))
        );
        let r = super::super::Response::from(&ledger);
        assert_eq!(r.headers()[http::header::RETRY_AFTER], "5");
        let cases = [
            (CallError::Timeout { ms: 50 }, 500, "plugin_timeout"),
            (CallError::Busy("quota".into()), 503, "plugin_busy"),
            (
                CallError::Rejected {
                    code: "no-json".into(),
                    message: "no JSON".into(),
                },
                422,
                "plugin_rejected",
            ),
            (
                CallError::Memory { limit_mb: 64 },
                500,
                "plugin_memory_limit",
            ),
            (
                CallError::InvalidOutput("x".into()),
                500,
                "plugin_invalid_output",
            ),
        ];
        for (e, status, code) in cases {
            let a = ApiError::plugin("acme", "p", &e);
            assert_eq!((a.status.as_u16(), a.code), (status, Some(code)), "{e}");
            assert_eq!(a.kind, "plugin_error");
            assert!(a.message.contains("`p` of tenant `acme`"), "{}", a.message);
        }
        let timeout = ApiError::body_timeout(10_000, 1024);
        assert_eq!(timeout.status, StatusCode::REQUEST_TIMEOUT);
    }

    #[test]
    fn pipeline_errors_map_once_to_status_and_code() {
        use crate::pipeline::{Error, PluginFailure};
        use crate::search::SearchError;
        let cases: Vec<(Error, u16, &str, Option<&str>)> = vec![
            (
                Error::invalid("rag", "no"),
                400,
                "invalid_request_error",
                None,
            ),
            (
                Error::Forbidden {
                    param: "collection",
                    message: "no".into(),
                },
                403,
                "permission_error",
                Some("not_allowed"),
            ),
            (
                Error::PluginMissing {
                    tenant: "acme".into(),
                    message: "gone".into(),
                },
                500,
                "plugin_error",
                Some("plugin_not_installed"),
            ),
            (
                Error::Denied(Denied::LedgerUnavailable),
                503,
                "server_error",
                Some("ledger_unavailable"),
            ),
            (
                Error::Search(SearchError::NotFound("kb".into())),
                404,
                "invalid_request_error",
                Some("collection_not_found"),
            ),
            (
                Error::Task {
                    what: "index",
                    cause: "panicked".into(),
                },
                500,
                "server_error",
                None,
            ),
        ];
        for (e, status, kind, code) in cases {
            let what = e.to_string();
            let a = ApiError::from(e);
            assert_eq!(
                (a.status.as_u16(), a.kind, a.code),
                (status, kind, code),
                "{what}"
            );
        }
        let invalid = ApiError::from(Error::invalid("rag", "`rag.top_k` must be 1 to 32."));
        assert_eq!(invalid.param.as_deref(), Some("rag"));
        assert_eq!(invalid.message, "`rag.top_k` must be 1 to 32.");
        // A plugin's failure keeps its cause's code and the caller's debugging report.
        let failed = ApiError::from(Error::Plugin(Box::new(PluginFailure {
            tenant: "acme".into(),
            plugin: "p".into(),
            cause: CallError::Timeout { ms: 50 },
            debug: Some(serde_json::json!({"plugin_logs": ["x"]})),
        })));
        assert_eq!(
            (failed.status.as_u16(), failed.code),
            (500, Some("plugin_timeout"))
        );
        assert_eq!(failed.body()["gateway_debug"]["plugin_logs"][0], "x");
        assert!(failed.message.contains("`p` of tenant `acme`"));
    }
}
