//! Why a tenant's request was turned away by one of its limits: what both the local limits
//! (`limits.rs`) and the ones replicas share in Redis (`shared.rs`) answer.

use std::time::Duration;

/// A tenant limit, named as the policy file, the rejection metric and the 429's error code
/// name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    RequestsPerSecond,
    RequestsPerMinute,
    MaxConcurrent,
    TokensPerMinute,
    TokenBudget,
}

impl Limit {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RequestsPerSecond => "requests_per_second",
            Self::RequestsPerMinute => "requests_per_minute",
            Self::MaxConcurrent => "max_concurrent",
            Self::TokensPerMinute => "tokens_per_minute",
            Self::TokenBudget => "token_budget",
        }
    }
}

/// Which limit turned a request away, and when it is worth retrying.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejection {
    pub limit: Limit,
    pub message: String,
    pub retry_after: Option<Duration>,
}
