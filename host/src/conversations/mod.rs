//! Stored responses of the Responses API, per tenant, in the ledger's database: the response
//! object, the input items of its turn, and the items of the whole conversation before its
//! output (what `previous_response_id` continues from). Ids of another tenant are missing,
//! not forbidden. Old responses go after the retention period, and a tenant's oldest when it
//! holds more than its cap.

use std::path::Path;

use serde_json::Value;

mod postgres;
mod sqlite;

/// One stored response.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub response: Value,
    /// This turn's input items, as `input_items` lists them.
    pub input: Vec<Value>,
    /// The conversation's items up to this turn's output: earlier turns' inputs and outputs,
    /// then this turn's input.
    pub context: Vec<Value>,
}

/// A stored response as its three text columns (the JSON as sent) and their size.
struct Encoded {
    response: String,
    input: String,
    context: String,
    bytes: i64,
}

impl Stored {
    fn encode(&self) -> Result<Encoded, StoreError> {
        let (response, input, context) = (
            serde_json::to_string(&self.response)?,
            serde_json::to_string(&self.input)?,
            serde_json::to_string(&self.context)?,
        );
        let bytes = (response.len() + input.len() + context.len()) as i64;
        Ok(Encoded {
            response,
            input,
            context,
            bytes,
        })
    }

    fn decode(response: &str, input: &str, context: &str) -> Result<Self, StoreError> {
        Ok(Self {
            response: serde_json::from_str(response)?,
            input: serde_json::from_str(input)?,
            context: serde_json::from_str(context)?,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the response store failed: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("the response store (PostgreSQL) failed: {0}")]
    Postgres(#[from] ::postgres::Error),
    #[error("a stored response is not valid JSON: {0}")]
    Corrupt(#[from] serde_json::Error),
}

/// A page of `input_items`.
pub struct Page {
    pub items: Vec<Value>,
    pub has_more: bool,
}

pub struct Conversations {
    db: Db,
    retention_s: i64,
    max_bytes_per_tenant: u64,
}

/// Where the responses are: the ledger's SQLite file, or PostgreSQL shared by replicas.
enum Db {
    Sqlite(sqlite::Db),
    /// Boxed: the client is large, and there is one store per process.
    Postgres(Box<postgres::Db>),
}

/// The same call on either store.
macro_rules! on_db {
    ($db:expr, $d:ident => $call:expr) => {
        match $db {
            Db::Sqlite($d) => $call,
            Db::Postgres($d) => $call,
        }
    };
}

impl Conversations {
    /// Opens (or creates) the store in the SQLite file at `path` (the ledger's).
    pub fn open(path: &Path, cfg: &crate::config::ResponsesConfig) -> Result<Self, StoreError> {
        Ok(Self::with(Db::Sqlite(sqlite::Db::open(path)?), cfg))
    }

    /// The store in the PostgreSQL database at `url` (`[cluster] postgres`), shared by every
    /// replica; connected on first use.
    pub fn open_postgres(url: &str, cfg: &crate::config::ResponsesConfig) -> Self {
        Self::with(Db::Postgres(Box::new(postgres::Db::open(url))), cfg)
    }

    fn with(db: Db, cfg: &crate::config::ResponsesConfig) -> Self {
        Self {
            db,
            retention_s: (cfg.retention_days * 86_400).min(i64::MAX as u64) as i64,
            max_bytes_per_tenant: cfg.max_mb_per_tenant.saturating_mul(1 << 20),
        }
    }

    /// Stores `stored` under `id`, durable when this returns; then expires what the
    /// retention period and the tenant's cap say must go.
    pub fn put(&self, tenant: &str, id: &str, stored: &Stored) -> Result<(), StoreError> {
        let now = unix_now();
        on_db!(&self.db, d => d.put(tenant, id, now, stored))?;
        on_db!(&self.db, d => d.expire(now - self.retention_s))?;
        on_db!(&self.db, d => d.cap(tenant, self.max_bytes_per_tenant))
    }

    /// The tenant's response `id`, unless it expired.
    pub fn get(&self, tenant: &str, id: &str) -> Result<Option<Stored>, StoreError> {
        on_db!(&self.db, d => d.get(tenant, id, unix_now() - self.retention_s))
    }

    /// Deletes the tenant's response `id`; false if it had none.
    pub fn delete(&self, tenant: &str, id: &str) -> Result<bool, StoreError> {
        on_db!(&self.db, d => d.delete(tenant, id))
    }

    /// A page of response `id`'s input items: at most `limit`, after the item `after` (an
    /// item id), in `order` (`asc` or `desc`).
    pub fn input_items(
        &self,
        tenant: &str,
        id: &str,
        after: Option<&str>,
        limit: usize,
        descending: bool,
    ) -> Result<Option<Page>, StoreError> {
        let Some(stored) = self.get(tenant, id)? else {
            return Ok(None);
        };
        let mut items = stored.input;
        if descending {
            items.reverse();
        }
        let start = match after {
            Some(a) => items
                .iter()
                .position(|i| i["id"] == a)
                .map_or(items.len(), |p| p + 1),
            None => 0,
        };
        let rest: Vec<Value> = items.into_iter().skip(start).collect();
        let has_more = rest.len() > limit;
        Ok(Some(Page {
            items: rest.into_iter().take(limit).collect(),
            has_more,
        }))
    }
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(n: usize) -> Stored {
        Stored {
            response: json!({"id": format!("resp_{n}"), "output": []}),
            input: (0..n)
                .map(|i| json!({"id": format!("in_{i}"), "type": "message"}))
                .collect(),
            context: vec![json!({"role": "user", "content": "x".repeat(1000)})],
        }
    }

    #[test]
    fn responses_are_per_tenant_paged_deleted_and_capped() {
        let dir = std::env::temp_dir().join(format!("gateway-conv-{}", rand::random::<u32>()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = crate::config::ResponsesConfig {
            retention_days: 30,
            max_mb_per_tenant: 1,
        };
        let c = Conversations::open(&dir.join("ledger.sqlite"), &cfg).unwrap();
        c.put("acme", "resp_a", &stored(5)).unwrap();
        assert_eq!(c.get("acme", "resp_a").unwrap(), Some(stored(5)));
        assert_eq!(
            c.get("globex", "resp_a").unwrap(),
            None,
            "another tenant's id"
        );
        let page = c
            .input_items("acme", "resp_a", None, 2, false)
            .unwrap()
            .unwrap();
        assert_eq!(page.items[0]["id"], "in_0");
        assert!(page.has_more);
        let page = c
            .input_items("acme", "resp_a", Some("in_3"), 2, false)
            .unwrap()
            .unwrap();
        assert_eq!((page.items.len(), page.has_more), (1, false));
        let page = c
            .input_items("acme", "resp_a", None, 1, true)
            .unwrap()
            .unwrap();
        assert_eq!(page.items[0]["id"], "in_4");
        assert!(!c.delete("globex", "resp_a").unwrap());
        assert!(c.delete("acme", "resp_a").unwrap());
        assert_eq!(c.get("acme", "resp_a").unwrap(), None);
        // ~1 KB each against a 1 MiB cap: the oldest go, the newest stay.
        for i in 0..1500 {
            c.put("acme", &format!("r{i}"), &stored(1)).unwrap();
        }
        assert_eq!(c.get("acme", "r0").unwrap(), None);
        assert!(c.get("acme", "r1499").unwrap().is_some());
        let _ = std::fs::remove_dir_all(dir);
    }
}
