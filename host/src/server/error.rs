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

impl ApiError {
    /// A plugin call failed. Faults of the plugin (trap, panic, deadline, memory, bad output)
    /// are the gateway's 500s; a plugin refusing its input is the request's 422.
    pub fn plugin(tenant: &str, plugin: &str, e: &crate::plugins::CallError) -> Self {
        use crate::plugins::CallError;
        let (status, code) = match e {
            CallError::Rejected { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "plugin_rejected"),
            CallError::Trap(_) => (StatusCode::INTERNAL_SERVER_ERROR, "plugin_trap"),
            CallError::Panic(_) => (StatusCode::INTERNAL_SERVER_ERROR, "plugin_panic"),
            CallError::Timeout { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "plugin_timeout"),
            CallError::Memory { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "plugin_memory_limit"),
            CallError::InvalidOutput(_) => {
                (StatusCode::INTERNAL_SERVER_ERROR, "plugin_invalid_output")
            }
            CallError::Busy(_) => (StatusCode::SERVICE_UNAVAILABLE, "plugin_busy"),
        };
        Self {
            status,
            kind: "plugin_error",
            message: format!("Plugin `{plugin}` of tenant `{tenant}` {e}"),
            param: None,
            code: Some(code),
            // Busy is the tenant's quota or the shared pool: a slot frees within a deadline.
            retry_after: matches!(e, CallError::Busy(_)).then_some(1),
            debug: None,
        }
    }

    /// The tenant's policy names a plugin that is not installed (or is of another kind).
    pub fn plugin_missing(tenant: &str, message: String) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "plugin_error",
            message: format!("Tenant `{tenant}`: {message}"),
            param: None,
            code: Some("plugin_not_installed"),
            retry_after: None,
            debug: None,
        }
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            code: Some("invalid_api_key"),
            retry_after: None,
            debug: None,
        }
    }
}

impl ApiError {
    /// 403: the tenant's policy does not allow what the request names.
    pub fn forbidden(param: &'static str, message: String) -> Self {
        Self {
            status: StatusCode::FORBIDDEN,
            kind: "permission_error",
            message,
            param: Some(param.into()),
            code: Some("not_allowed"),
            retry_after: None,
            debug: None,
        }
    }

    /// 429 for a tenant limit; the code names the limit.
    pub fn limited(r: crate::tenancy::limits::Rejection) -> Self {
        let retry = r
            .retry_after
            .map(|d| d.as_secs_f64().ceil().max(1.0) as u64);
        let message = match retry {
            Some(s) => format!("{} Retry after {s} s.", r.message),
            None => r.message,
        };
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: "rate_limit_error",
            message,
            param: None,
            code: Some(r.limit),
            retry_after: retry,
            debug: None,
        }
    }

    pub fn denied(d: crate::tenancy::Denied) -> Self {
        match d {
            crate::tenancy::Denied::Unauthenticated(m) => Self::unauthorized(m),
            crate::tenancy::Denied::Limited(r) => Self::limited(r),
            crate::tenancy::Denied::LedgerUnavailable => Self {
                status: StatusCode::SERVICE_UNAVAILABLE,
                kind: "server_error",
                message: "The usage ledger cannot be written (disk full or failing), so billable requests are refused until it recovers.".into(),
                param: None,
                code: Some("ledger_unavailable"),
                retry_after: Some(5),
                debug: None,
            },
            crate::tenancy::Denied::LimitsUnavailable => Self {
                status: StatusCode::SERVICE_UNAVAILABLE,
                kind: "server_error",
                message: "The store of the limits all replicas share (Redis) does not answer, and the gateway is configured to refuse requests it cannot count (redis_failure = \"closed\").".into(),
                param: None,
                code: Some("limits_unavailable"),
                retry_after: Some(1),
                debug: None,
            },
        }
    }
}

impl From<crate::search::SearchError> for ApiError {
    fn from(e: crate::search::SearchError) -> Self {
        use crate::search::SearchError;
        let (status, kind, code) = match &e {
            SearchError::Invalid(_) => (StatusCode::BAD_REQUEST, "invalid_request_error", None),
            SearchError::NotFound(_) => (
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("collection_not_found"),
            ),
            SearchError::Conflict(_) => (
                StatusCode::CONFLICT,
                "invalid_request_error",
                Some("collection_exists"),
            ),
            SearchError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
            SearchError::Unavailable(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("store_unavailable"),
            ),
        };
        Self {
            status,
            kind,
            message: e.to_string(),
            param: None,
            code,
            retry_after: None,
            debug: None,
        }
    }
}

/// The one mapping of a pipeline stage's failure to its status and OpenAI error.
impl From<crate::pipeline::Error> for ApiError {
    fn from(e: crate::pipeline::Error) -> Self {
        use crate::pipeline::Error;
        match e {
            Error::Invalid { param, message } => Self::invalid(param, message),
            Error::Forbidden { param, message } => Self::forbidden(param, message),
            Error::PluginMissing { tenant, message } => Self::plugin_missing(&tenant, message),
            Error::Plugin(f) => Self {
                debug: f.debug.map(Box::new),
                ..Self::plugin(&f.tenant, &f.plugin, &f.cause)
            },
            Error::Denied(d) => Self::denied(d),
            Error::Search(e) => Self::from(e),
            Error::Task { .. } => Self::internal(e.to_string()),
        }
    }
}

/// A generation that failed midway: a processor's fault as the plugin error it is, a grammar
/// that ran into the parser's limits as the request's 400, anything else as the server's.
impl From<crate::engine::EngineError> for ApiError {
    fn from(e: crate::engine::EngineError) -> Self {
        use crate::engine::EngineError;
        use crate::pipeline::processors::ProcessorFailure;
        match &e {
            EngineError::Processor(p) => {
                if let Some(f) = p.downcast_ref::<ProcessorFailure>() {
                    return Self::plugin(&f.tenant, &f.plugin, &f.error);
                }
            }
            EngineError::Grammar(why) => {
                return Self::invalid(
                    None,
                    format!("The output constraint failed partway through the answer: {why}. Simplify the schema, regex or grammar."),
                )
            }
            _ => {}
        }
        Self::internal(e.to_string())
    }
}

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
