//! API keys: random, shown once, stored only as SHA-256.

use sha2::{Digest, Sha256};

pub fn hash(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// A new key (`gw-` + 32 random bytes, hex) and the policy line that admits it.
pub fn new_key(tenant: &str, id: &str) -> (String, String) {
    let bytes: [u8; 32] = rand::random();
    let key = format!("gw-{}", crate::common::hex(&bytes));
    let line = format!(
        "# tenant {tenant}: add under its [[tenants]] entry\nkeys = [{{ id = \"{id}\", sha256 = \"{}\" }}]",
        crate::common::hex(&hash(&key))
    );
    (key, line)
}
