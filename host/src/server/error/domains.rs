//! The domains' errors as the client sees them: each cause (tenancy, plugins, search, the
//! engine, a pipeline stage) mapped to its status, type and code here, once.

use http::StatusCode;

use super::ApiError;

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
    pub fn limited(r: crate::tenancy::Rejection) -> Self {
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
            code: Some(r.limit.as_str()),
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

/// An input the embedding model cannot take is the request's; anything else the server's.
impl From<crate::search::embedder::EmbedError> for ApiError {
    fn from(e: crate::search::embedder::EmbedError) -> Self {
        use crate::search::embedder::EmbedError;
        match e {
            EmbedError::TooLong { .. } | EmbedError::BadToken { .. } => {
                Self::invalid("input", e.to_string())
            }
            other => Self::internal(other.to_string()),
        }
    }
}

/// The one mapping of a pipeline stage's failure to its status and OpenAI error.
impl From<crate::pipeline::Error> for ApiError {
    fn from(e: crate::pipeline::Error) -> Self {
        use crate::pipeline::Error;
        match e {
            Error::Invalid { param, message } => Self::invalid(param, message),
            Error::InvalidAt { param, message } => Self::invalid_at(param, message),
            Error::Overloaded(message) => Self::overloaded(message),
            Error::Json(e) => Self::from(e),
            Error::Engine(message) => Self::internal(message),
            Error::Upstream { failure, message } => {
                use crate::pipeline::UpstreamFailure as F;
                let (status, code) = match failure {
                    F::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "upstream_unavailable"),
                    F::Timeout => (StatusCode::GATEWAY_TIMEOUT, "upstream_timeout"),
                    F::Unreachable => (StatusCode::BAD_GATEWAY, "upstream_unavailable"),
                    F::Failed => (StatusCode::BAD_GATEWAY, "upstream_error"),
                };
                Self::upstream(status, code, message)
            }
            Error::Forbidden { param, message } => Self::forbidden(param, message),
            Error::PluginMissing { tenant, message } => Self::plugin_missing(&tenant, message),
            Error::Plugin(f) => Self {
                debug: f.debug.map(Box::new),
                ..Self::plugin(&f.tenant, &f.plugin, &f.cause)
            },
            Error::Denied(d) => Self::denied(d),
            Error::Search(e) => Self::from(e),
            Error::Embed(e) => Self::from(e),
            Error::Store(e) => Self {
                status: StatusCode::SERVICE_UNAVAILABLE,
                kind: "server_error",
                message: e.to_string(),
                param: None,
                code: Some("store_unavailable"),
                retry_after: Some(1),
                debug: None,
            },
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
