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
    /// Work on the blocking pool panicked or was cancelled.
    #[error("{what} task failed: {cause}")]
    Task { what: &'static str, cause: String },
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

impl Error {
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        Error::Invalid {
            param,
            message: message.into(),
        }
    }
}
