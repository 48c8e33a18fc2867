//! Which tenant a request belongs to, until the tenancy module lands: the bearer key looked up
//! in the config's `[[tenants]]`, else the tenant `default`.

use std::collections::HashMap;
use std::sync::Arc;

use crate::config::TenantConfig;
use crate::plugins::TenantValues;

pub struct Tenant {
    pub name: Arc<str>,
    /// Keys this tenant's prefix-cache entries apart from every other tenant's.
    pub cache_salt: u64,
    pub cfg: TenantConfig,
    pub values: TenantValues,
}

pub struct Tenants {
    by_key: HashMap<String, Arc<Tenant>>,
    default: Arc<Tenant>,
}

impl Tenants {
    pub fn new(configs: &[TenantConfig]) -> Self {
        let mut by_key = HashMap::new();
        let mut default = None;
        for cfg in configs {
            let t = Arc::new(Tenant {
                name: cfg.name.as_str().into(),
                cache_salt: salt(&cfg.name),
                values: Arc::new(cfg.config.clone()),
                cfg: cfg.clone(),
            });
            for k in &cfg.api_keys {
                by_key.insert(k.clone(), t.clone());
            }
            if cfg.name == "default" {
                default = Some(t);
            }
        }
        let default = default.unwrap_or_else(|| {
            Arc::new(Tenant {
                name: "default".into(),
                cache_salt: salt("default"),
                cfg: TenantConfig {
                    name: "default".into(),
                    ..TenantConfig::default()
                },
                values: TenantValues::default(),
            })
        });
        Self { by_key, default }
    }

    pub fn resolve(&self, headers: &http::HeaderMap) -> Arc<Tenant> {
        bearer(headers)
            .and_then(|k| self.by_key.get(k))
            .unwrap_or(&self.default)
            .clone()
    }
}

pub fn bearer(headers: &http::HeaderMap) -> Option<&str> {
    headers
        .get(http::header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

fn salt(tenant: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    tenant.hash(&mut h);
    h.finish()
}
