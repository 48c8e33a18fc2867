//! The audit log: every change an admin makes (policies, plugins, the response cache), who made
//! it and when, with what changed (the policy's lines removed and added, the plugin's sha256);
//! and every policy version applied through the admin API, whole, to compare and re-apply.
//! In the ledger's database: its SQLite file, or PostgreSQL with `[cluster] postgres`, where
//! every replica's changes land in one log.

use std::path::Path;

use serde_json::Value;

mod postgres;
mod sqlite;

/// One admin change.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    /// Unix seconds.
    pub ts: i64,
    /// The admin account that made it (`admin_token` for the shared token).
    pub actor: String,
    /// What was done: `policy.replace`, `plugin.put`, `plugin.delete`, `cache.clear`.
    pub action: String,
    /// What it was done to: `policies`, `<tenant>/<plugin>`, a tenant.
    pub target: String,
    pub detail: Value,
}

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("the audit log failed: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("the audit log (PostgreSQL) failed: {0}")]
    Postgres(#[from] ::postgres::Error),
    #[error("an audit entry is not valid JSON: {0}")]
    Corrupt(#[from] serde_json::Error),
}

pub enum Audit {
    Sqlite(sqlite::Db),
    /// Boxed: the client is large, and there is one log per process.
    Postgres(Box<postgres::Db>),
}

/// Which entries a listing wants: newest first, at most `limit`, older than `before` (an id).
#[derive(Debug, Default, Clone)]
pub struct Query {
    pub limit: usize,
    pub before: Option<i64>,
    pub actor: Option<String>,
    pub action: Option<String>,
}

impl Audit {
    /// The log in the SQLite file at `path` (the ledger's).
    pub fn open(path: &Path) -> Result<Self, AuditError> {
        Ok(Self::Sqlite(sqlite::Db::open(path)?))
    }

    /// The log in PostgreSQL (`[cluster] postgres`), shared by every replica; connected on
    /// first use.
    pub fn open_postgres(url: &str) -> Self {
        Self::Postgres(Box::new(postgres::Db::open(url)))
    }

    /// Appends `change`, durable when this returns.
    pub fn record(&self, change: &Change) -> Result<(), AuditError> {
        let detail = serde_json::to_string(&change.detail)?;
        match self {
            Self::Sqlite(d) => d.record(change, &detail),
            Self::Postgres(d) => d.record(change, &detail),
        }
    }

    /// Keeps `text` as a policy version applied by `actor`; returns its id.
    pub fn keep_policy(&self, ts: i64, actor: &str, text: &str) -> Result<i64, AuditError> {
        match self {
            Self::Sqlite(d) => d.keep_policy(ts, actor, text),
            Self::Postgres(d) => d.keep_policy(ts, actor, text),
        }
    }

    /// Every kept policy version, newest first: `id`, `ts`, `actor`, `bytes`.
    pub fn policies(&self) -> Result<Vec<Value>, AuditError> {
        let rows = match self {
            Self::Sqlite(d) => d.policies()?,
            Self::Postgres(d) => d.policies()?,
        };
        Ok(rows
            .into_iter()
            .map(|(id, ts, actor, bytes)| {
                serde_json::json!({"id": id, "ts": ts, "actor": actor, "bytes": bytes})
            })
            .collect())
    }

    /// The text of policy version `id`.
    pub fn policy(&self, id: i64) -> Result<Option<String>, AuditError> {
        match self {
            Self::Sqlite(d) => d.policy(id),
            Self::Postgres(d) => d.policy(id),
        }
    }

    /// Entries as JSON objects (`id`, `ts`, `actor`, `action`, `target`, `detail`), newest
    /// first.
    pub fn list(&self, q: &Query) -> Result<Vec<Value>, AuditError> {
        let rows = match self {
            Self::Sqlite(d) => d.list(q)?,
            Self::Postgres(d) => d.list(q)?,
        };
        rows.into_iter()
            .map(|(id, ts, actor, action, target, detail)| {
                let detail: Value = serde_json::from_str(&detail)?;
                Ok(
                    serde_json::json!({"id": id, "ts": ts, "actor": actor, "action": action,
                                      "target": target, "detail": detail}),
                )
            })
            .collect()
    }
}

/// A row as both stores return it.
type Row = (i64, i64, String, String, String, String);

/// A kept policy version as both stores list it: id, ts, actor, bytes.
type Version = (i64, i64, String, i64);

/// The lines of `new` that `old` lacks, and those of `old` that `new` lacks, in order: what a
/// reader of the log needs of a policy change, without a diff algorithm's hunks.
pub fn line_changes(old: &str, new: &str) -> Value {
    let (o, n): (
        std::collections::HashSet<&str>,
        std::collections::HashSet<&str>,
    ) = (old.lines().collect(), new.lines().collect());
    let removed: Vec<&str> = old.lines().filter(|l| !n.contains(l)).collect();
    let added: Vec<&str> = new.lines().filter(|l| !o.contains(l)).collect();
    serde_json::json!({"removed": removed, "added": added})
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn changes_are_listed_newest_first_and_filtered() {
        let dir = std::env::temp_dir().join(format!("gateway-audit-{}", rand::random::<u32>()));
        let a = Audit::open(&dir.join("ledger.sqlite")).unwrap();
        for (i, actor) in ["alice", "bob", "alice"].iter().enumerate() {
            let change = Change {
                ts: 100 + i as i64,
                actor: actor.to_string(),
                action: "policy.replace".into(),
                target: "policies".into(),
                detail: line_changes("a\nb", "a\nc"),
            };
            a.record(&change).unwrap();
        }
        let all = a
            .list(&Query {
                limit: 10,
                ..Default::default()
            })
            .unwrap();
        assert_eq!(all.len(), 3);
        assert_eq!(all[0]["ts"], 102);
        assert_eq!(all[0]["detail"], json!({"removed": ["b"], "added": ["c"]}));
        let alice = Query {
            limit: 10,
            actor: Some("alice".into()),
            ..Default::default()
        };
        assert_eq!(a.list(&alice).unwrap().len(), 2);
        let older = Query {
            limit: 1,
            before: all[0]["id"].as_i64(),
            ..Default::default()
        };
        assert_eq!(a.list(&older).unwrap()[0]["ts"], 101);
        let first = a.keep_policy(1, "alice", "a = 1\n").unwrap();
        let second = a.keep_policy(2, "bob", "a = 2\n").unwrap();
        let versions = a.policies().unwrap();
        assert_eq!(versions[0]["id"], second);
        assert_eq!(versions[1]["actor"], "alice");
        assert_eq!(a.policy(first).unwrap().as_deref(), Some("a = 1\n"));
        assert_eq!(a.policy(second + 1).unwrap(), None);
        let _ = std::fs::remove_dir_all(dir);
    }
}
