//! `[admin]`: the admin API's listener, its client certificates, and its named accounts.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// A separate listener for `/admin/*` (which the API listener then refuses).
    pub listen: Option<SocketAddr>,
    /// Require client certificates signed by this CA (PEM) on the admin listener; needs `tls`
    /// and `listen`.
    pub client_ca: Option<PathBuf>,
    /// Named admin accounts, each with its own token and a role, beside `admin_token` (which
    /// acts as an `admin` named `admin_token`).
    pub accounts: Vec<AdminAccount>,
}

/// An admin account: `Authorization: Bearer <its token>` on the admin API.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AdminAccount {
    /// Who the audit log says made a change.
    pub name: String,
    pub role: AdminRole,
    /// Lower-case hex SHA-256 of the account's token (`gateway keys new` prints one).
    pub token_sha256: String,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum AdminRole {
    /// Reads and changes.
    Admin,
    /// Reads only: every write is refused with 403.
    Viewer,
}

impl AdminRole {
    pub fn as_str(self) -> &'static str {
        match self {
            AdminRole::Admin => "admin",
            AdminRole::Viewer => "viewer",
        }
    }
}

impl AdminConfig {
    /// Every problem of the accounts, each naming the account.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let mut names = std::collections::HashSet::new();
        for (i, a) in self.accounts.iter().enumerate() {
            let at = format!("admin.accounts[{i}] ({:?})", a.name);
            let hex = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
            if a.token_sha256.len() != 64 || !a.token_sha256.bytes().all(hex) {
                problems.push(format!(
                    "{at}.token_sha256: expected 64 lower-case hex digits (the SHA-256 of the token)"
                ));
            }
            // `admin_token` and `file` name the shared token and policy-file edits in the log.
            let reserved = matches!(a.name.as_str(), "admin_token" | "file");
            if a.name.is_empty() || reserved || !names.insert(&a.name) {
                problems.push(format!(
                    "{at}.name: must be non-empty, unique, and neither `admin_token` nor `file`"
                ));
            }
        }
        problems
    }
}
