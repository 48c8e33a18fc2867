//! `[responses]`: how long the Responses API keeps stored responses, and how much per tenant.

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResponsesConfig {
    /// Stored responses older than this are deleted (and their `previous_response_id` is a
    /// 404 from then on).
    pub retention_days: u64,
    /// The most a tenant's stored responses may take (MiB of JSON); beyond it the oldest go.
    pub max_mb_per_tenant: u64,
}

impl Default for ResponsesConfig {
    fn default() -> Self {
        Self {
            retention_days: 30,
            max_mb_per_tenant: 256,
        }
    }
}
