//! Tenants through the admin API, one at a time: listed with their budget use, read, created or
//! edited from JSON (the policy file's own fields), previewed as a diff of the policy before it
//! is applied (`?dry_run=true`), removed. Each change is an edit of the policy text that keeps
//! the other tenants' formatting and comments, validated exactly as the file is and applied,
//! replicated and audited like any policy replace.

use http::StatusCode;
use serde_json::{json, Map, Value};
use toml_edit::{Array, DocumentMut, InlineTable, Item, Table};

use super::audit::{record, Actor};
use super::error::ApiError;
use super::policies::{document, names};
use super::{json_response, AppState, Response};

/// `GET /admin/tenants`.
pub async fn list(state: &AppState) -> Result<Response, ApiError> {
    let mut data = Vec::new();
    for (name, table) in tenant_tables(&state.tenancy.text())? {
        data.push(view(state, &name, table).await);
    }
    Ok(json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": data}),
    ))
}

/// `/admin/tenants/{tenant}`: `GET`, `PUT[?dry_run=true]` (body: the tenant's fields as JSON),
/// `DELETE`.
pub async fn one(
    state: &AppState,
    actor: &Actor,
    method: &http::Method,
    tenant: &str,
    query: Option<&str>,
    body: Option<bytes::Bytes>,
) -> Result<Response, ApiError> {
    let text = state.tenancy.text();
    let existing = tenant_tables(&text)?.into_iter().find(|(n, _)| n == tenant);
    match (method.as_str(), existing) {
        ("GET", Some((name, table))) => {
            let mut v = view(state, &name, table).await;
            v["toml"] = json!(tenant_toml(&text, tenant)?);
            Ok(json_response(StatusCode::OK, &v))
        }
        ("GET" | "DELETE", None) => Err(ApiError::not_found(&format!("/admin/tenants/{tenant}"))),
        ("PUT", existing) => {
            let dry_run = super::bodies::query_pairs(query)
                .any(|(k, v)| k == "dry_run" && matches!(v, "true" | "1"));
            let fields: Value = serde_json::from_slice(&body.unwrap_or_default())?;
            let Value::Object(fields) = fields else {
                return Err(ApiError::invalid(
                    None,
                    "The body must be a JSON object of the tenant's policy fields.",
                ));
            };
            let next = edited(&text, tenant, Some(&fields))?;
            let action = match existing {
                None => "tenant.create",
                Some(_) => "tenant.update",
            };
            change(state, actor, (&text, next), tenant, (dry_run, action)).await
        }
        ("DELETE", Some(_)) => {
            let next = edited(&text, tenant, None)?;
            change(
                state,
                actor,
                (&text, next),
                tenant,
                (false, "tenant.delete"),
            )
            .await
        }
        _ => Err(ApiError::method_not_allowed(
            method,
            &format!("/admin/tenants/{tenant}"),
        )),
    }
}

/// Checks (dry run) or applies an edited policy; answers with the lines that change.
async fn change(
    state: &AppState,
    actor: &Actor,
    (before, after): (&str, String),
    tenant: &str,
    (dry_run, action): (bool, &str),
) -> Result<Response, ApiError> {
    let diff = crate::audit::line_changes(before, &after);
    if dry_run {
        super::policies::check(state, &after)?;
        return Ok(json_response(
            StatusCode::OK,
            &json!({"status": "valid", "tenant": tenant, "diff": diff}),
        ));
    }
    let version = super::policies::apply(state, actor, after, None).await?;
    let mut detail = diff.clone();
    detail["version"] = json!(version);
    record(state, actor, action, tenant, detail).await;
    let status = if action == "tenant.create" {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok(json_response(
        status,
        &json!({"status": "applied", "tenant": tenant, "version": version, "diff": diff}),
    ))
}

/// A tenant's name and the rest of its table.
type Named = (String, Map<String, Value>);

/// Each tenant's table of the policy text, as JSON (keys left out: they have their own API).
fn tenant_tables(text: &str) -> Result<Vec<Named>, ApiError> {
    let doc: toml::Table = toml::from_str(text)
        .map_err(|e| ApiError::internal(format!("The policy in force does not parse: {e}")))?;
    let tenants = match doc.get("tenants") {
        Some(toml::Value::Array(a)) => a.clone(),
        _ => Vec::new(),
    };
    Ok(tenants
        .into_iter()
        .filter_map(|t| match serde_json::to_value(t) {
            Ok(Value::Object(m)) => Some(m),
            _ => None,
        })
        .filter_map(|mut m| {
            let name = m.remove("name")?.as_str()?.to_string();
            Some((name, m))
        })
        .collect())
}

/// What the console shows of a tenant: its policy, how many keys, and its budget's use in the
/// current period (from the ledger, which every replica writes).
async fn view(state: &AppState, name: &str, mut policy: Map<String, Value>) -> Value {
    let keys = policy
        .remove("keys")
        .and_then(|k| k.as_array().map(Vec::len))
        .unwrap_or(0);
    let budget = match policy.get("token_budget") {
        Some(b) => budget(state, name, b).await,
        None => Value::Null,
    };
    json!({"name": name, "policy": policy, "keys": keys, "budget": budget})
}

async fn budget(state: &AppState, tenant: &str, b: &Value) -> Value {
    let tokens = b["tokens"].as_u64();
    let period: Option<crate::tenancy::policy::Period> =
        serde_json::from_value(b["period"].clone()).ok();
    let (true, Some(period)) = (state.tenancy.ledger.is_some(), period) else {
        return json!({"tokens": tokens, "period": b["period"], "used": null});
    };
    let (tenancy, t) = (state.tenancy.clone(), tenant.to_string());
    let now = crate::tenancy::unix_now();
    let used = crate::pipeline::blocking("budget", move || {
        let ledger = tenancy.ledger.as_ref()?;
        ledger.period_usage(&t, period, now).ok()
    })
    .await
    .ok()
    .flatten();
    let (from, to, used) = match used {
        Some((from, to, used)) => (Some(from), Some(to), Some(used)),
        None => (None, None, None),
    };
    json!({"tokens": tokens, "period": b["period"], "used": used, "from": from, "to": to})
}

/// The `[[tenants]]` table of `tenant` as it is written in the policy text.
fn tenant_toml(text: &str, tenant: &str) -> Result<String, ApiError> {
    let doc = document(text)?;
    let mut one = DocumentMut::new();
    let mut tables = toml_edit::ArrayOfTables::new();
    if let Some(t) = doc
        .get("tenants")
        .and_then(Item::as_array_of_tables)
        .and_then(|ts| ts.iter().find(|t| names(t, tenant)))
    {
        tables.push(t.clone());
    }
    one.insert("tenants", Item::ArrayOfTables(tables));
    Ok(one.to_string())
}

/// The policy text with `tenant`'s table replaced by `fields` (its keys kept), added when it
/// is new, or removed (`None`).
fn edited(
    text: &str,
    tenant: &str,
    fields: Option<&Map<String, Value>>,
) -> Result<String, ApiError> {
    if tenant.is_empty() || tenant.len() > 64 || tenant.contains(['"', '\\', '\n', '/']) {
        return Err(ApiError::invalid(
            "name",
            "A tenant's name must be 1 to 64 characters, without quotes, slashes or line breaks.",
        ));
    }
    let mut doc = document(text)?;
    if !doc.contains_key("tenants") {
        doc.insert("tenants", Item::ArrayOfTables(Default::default()));
    }
    let tables = doc
        .get_mut("tenants")
        .and_then(Item::as_array_of_tables_mut)
        .ok_or_else(|| ApiError::invalid(None, "`tenants` in the policy is not an array of tables (`[[tenants]]`): edit it in the policy file."))?;
    let at = tables.iter().position(|t| names(t, tenant));
    let Some(fields) = fields else {
        if let Some(at) = at {
            tables.remove(at);
        }
        return Ok(doc.to_string());
    };
    let mut table = Table::new();
    table.insert("name", toml_edit::value(tenant));
    if let Some(keys) = at.and_then(|i| tables.get(i)).and_then(|t| t.get("keys")) {
        table.insert("keys", keys.clone());
    }
    for (k, v) in fields {
        if matches!(k.as_str(), "name" | "keys") {
            return Err(ApiError::invalid_at(
                k.clone(),
                format!("`{k}` is not edited here: the name is the path's, keys have their own API (`/admin/tenants/{tenant}/keys`)."),
            ));
        }
        if let Some(v) = value(v) {
            table.insert(k, Item::Value(v));
        }
    }
    match at.and_then(|i| tables.get_mut(i)) {
        // The comment above the table's header belongs to it: it stays.
        Some(t) => {
            *table.decor_mut() = t.decor().clone();
            *t = table;
        }
        None => tables.push(table),
    }
    Ok(doc.to_string())
}

/// A JSON value as TOML (objects as inline tables); `null` is left out.
fn value(v: &Value) -> Option<toml_edit::Value> {
    Some(match v {
        Value::Null => return None,
        Value::Bool(b) => (*b).into(),
        Value::Number(n) => match n.as_i64() {
            Some(i) => i.into(),
            None => n.as_f64()?.into(),
        },
        Value::String(s) => s.as_str().into(),
        Value::Array(a) => toml_edit::Value::Array(a.iter().filter_map(value).collect::<Array>()),
        Value::Object(o) => {
            let mut t = InlineTable::new();
            for (k, v) in o {
                if let Some(v) = value(v) {
                    t.insert(k, v);
                }
            }
            toml_edit::Value::InlineTable(t)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: &str = "# who may call\n[[tenants]]\nname = \"a\" # first\nkeys = [{ id = \"k\", sha256 = \"00\" }]\nmodels = [\"m\"]\n\n[[tenants]]\nname = \"b\"\n";

    #[test]
    fn an_edit_replaces_one_tenant_and_keeps_its_keys_and_the_rest() {
        let fields = json!({"models": ["x", "y"], "weight": 2, "token_budget": {"tokens": 10, "period": "day"}});
        let out = edited(POLICY, "a", fields.as_object()).unwrap();
        assert!(out.starts_with("# who may call\n"), "{out}");
        assert!(
            out.contains("keys = [{ id = \"k\", sha256 = \"00\" }]"),
            "{out}"
        );
        assert!(out.contains("models = [\"x\", \"y\"]"), "{out}");
        assert!(
            out.contains("token_budget = { tokens = 10, period = \"day\" }"),
            "{out}"
        );
        assert!(out.contains("name = \"b\""), "{out}");
        let tables = tenant_tables(&out).unwrap();
        assert_eq!(tables[0].1["weight"], 2);
    }

    #[test]
    fn tenants_are_added_and_removed() {
        let added = edited(POLICY, "c", json!({"weight": 3}).as_object()).unwrap();
        assert_eq!(tenant_tables(&added).unwrap().len(), 3);
        let removed = edited(&added, "a", None).unwrap();
        let names: Vec<_> = tenant_tables(&removed)
            .unwrap()
            .into_iter()
            .map(|t| t.0)
            .collect();
        assert_eq!(names, ["b", "c"]);
        assert!(edited(POLICY, "a\"", json!({}).as_object()).is_err());
        assert!(edited(POLICY, "a", json!({"keys": []}).as_object()).is_err());
    }
}
