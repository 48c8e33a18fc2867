//! Why a pipeline stage failed, typed so that the edge maps each cause to its status and
//! OpenAI error code in one place, and the ledger can tell a failure from a cancellation.

use crate::plugins::CallError;
use crate::search::SearchError;
use crate::tenancy::Denied;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A field of the request is invalid (400); `param` names it.
    #[error("{message}")]
    Invalid {
        param: &'static str,
        message: String,
    },
    /// A field inside the request is invalid (400); `param` is its path, built at run time
    /// (`tools[2].function.parameters`).
    #[error("{message}")]
    InvalidAt { param: String, message: String },
    /// The tenant's policy does not allow what the request names (403).
    #[error("{message}")]
    Forbidden {
        param: &'static str,
        message: String,
    },
    /// The tenant's policy names a plugin that is not installed, or is of another kind.
    #[error("Tenant `{tenant}`: {message}")]
    PluginMissing { tenant: String, message: String },
    /// A plugin call failed (boxed: it is the largest cause, and errors travel by value).
    #[error("{0}")]
    Plugin(Box<PluginFailure>),
    /// A limit, the ledger or the shared limits turned the stage's reservation away.
    #[error("the reservation was refused: {0:?}")]
    Denied(Denied),
    #[error(transparent)]
    Search(#[from] SearchError),
    /// The store of responses (the Responses API) failed.
    #[error(transparent)]
    Store(crate::conversations::StoreError),
    /// The encoder refused an input or failed.
    #[error(transparent)]
    Embed(#[from] crate::search::embedder::EmbedError),
    /// The target cannot take the request now: a full queue, or a model and all its fallbacks
    /// saturated (503).
    #[error("{0}")]
    Overloaded(String),
    /// The request body is not the endpoint's JSON.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// The local engine refused or lost the request (its loop stopped).
    #[error("{0}")]
    Engine(String),
    /// An upstream model's replicas could not answer.
    #[error("{message}")]
    Upstream {
        failure: UpstreamFailure,
        message: String,
    },
    /// Work on the blocking pool panicked or was cancelled.
    #[error("{what} task failed: {cause}")]
    Task { what: &'static str, cause: String },
}

/// Why no replica of an upstream model answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamFailure {
    /// No replica was available (503).
    Unavailable,
    /// No answer within the first-token timeout (504).
    Timeout,
    /// The replicas could not be reached (502).
    Unreachable,
    /// The replicas answered with server errors, or their answer broke off (502).
    Failed,
}

#[derive(Debug, thiserror::Error)]
#[error("Plugin `{plugin}` of tenant `{tenant}` {cause}")]
pub struct PluginFailure {
    pub tenant: String,
    pub plugin: String,
    pub cause: CallError,
    /// The `gateway_debug` report, for a caller that asked for plugin debugging.
    pub debug: Option<serde_json::Value>,
}

impl From<crate::engine::SubmitError> for Error {
    fn from(e: crate::engine::SubmitError) -> Self {
        match e {
            crate::engine::SubmitError::QueueFull(_) => {
                Error::Overloaded(format!("The server is overloaded: {e}"))
            }
            crate::engine::SubmitError::Stopped => Error::Engine(e.to_string()),
        }
    }
}

impl Error {
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        Error::Invalid {
            param,
            message: message.into(),
        }
    }

    pub fn invalid_at(param: String, message: impl Into<String>) -> Self {
        Error::InvalidAt {
            param,
            message: message.into(),
        }
    }

    pub fn forbidden(param: &'static str, message: impl Into<String>) -> Self {
        Error::Forbidden {
            param,
            message: message.into(),
        }
    }
}
