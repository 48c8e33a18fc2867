//! Read-only admin views a console (or a script) shows: usage as CSV, each tenant's
//! collections with their documents, chunks and bytes on disk.

use bytes::Bytes;
use http::StatusCode;
use serde_json::{json, Value};

use super::error::ApiError;
use super::{json_response, AppState, Response};

/// The columns of a usage row, in order (`day` or `model` second).
const USAGE: [&str; 8] = [
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "failed_requests",
    "cached_requests",
    "mean_latency_ms",
    "plugin_ms",
];

/// `/admin/usage?format=csv`: one header line, then a line per row (RFC 4180 quoting).
pub fn usage_csv(group: &str, rows: &[Value]) -> Response {
    let mut out = format!("tenant,{group},{}\r\n", USAGE.join(","));
    for r in rows {
        let cells = ["tenant", group]
            .iter()
            .chain(USAGE.iter())
            .map(|k| match &r[*k] {
                Value::String(s) => quoted(s),
                Value::Null => String::new(),
                v => v.to_string(),
            })
            .collect::<Vec<_>>();
        out.push_str(&cells.join(","));
        out.push_str("\r\n");
    }
    http::Response::builder()
        .header(http::header::CONTENT_TYPE, "text/csv; charset=utf-8")
        .header(
            http::header::CONTENT_DISPOSITION,
            "attachment; filename=\"usage.csv\"",
        )
        .body(http_body_util::BodyExt::boxed_unsync(
            http_body_util::Full::new(Bytes::from(out)),
        ))
        .expect("static headers are valid")
}

/// A CSV cell: quoted when it holds a comma, quote or line break; a leading `=`, `+`, `-` or
/// `@` is prefixed with `'` so a spreadsheet does not run it as a formula.
fn quoted(s: &str) -> String {
    let s = match s.chars().next() {
        Some('=' | '+' | '-' | '@') => format!("'{s}"),
        _ => s.to_string(),
    };
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s
    }
}

/// `GET /admin/collections[?tenant=]`: each tenant's collections with documents, chunks and
/// bytes on disk.
pub async fn collections(state: &AppState, query: Option<&str>) -> Result<Response, ApiError> {
    let mut only = None;
    for (k, v) in super::bodies::query_pairs(query) {
        match k {
            "tenant" => only = Some(v.to_string()),
            _ => {
                return Err(ApiError::invalid(
                    None,
                    format!("Unknown query parameter `{k}`; use tenant."),
                ))
            }
        }
    }
    let tenants = only.map_or_else(|| state.tenancy.tenant_names(), |t| vec![t]);
    let all = state.collections.clone();
    // Sizes walk folders: off the runtime.
    let data = crate::pipeline::blocking("collection sizes", move || {
        let mut data = Vec::new();
        for t in tenants {
            for c in all.list(&t) {
                data.push(
                    json!({"tenant": t, "name": c.name, "documents": c.documents(),
                                 "chunks": c.chunks(), "bytes": folder_bytes(&c.dir)}),
                );
            }
        }
        data
    })
    .await?;
    Ok(json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": data}),
    ))
}

fn folder_bytes(dir: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => folder_bytes(&e.path()),
            Ok(_) => e.metadata().map_or(0, |m| m.len()),
            Err(_) => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_cells_are_quoted_and_never_formulas() {
        assert_eq!(quoted("acme"), "acme");
        assert_eq!(quoted("a,b"), "\"a,b\"");
        assert_eq!(quoted("say \"hi\""), "\"say \"\"hi\"\"\"");
        assert_eq!(quoted("=SUM(A1)"), "'=SUM(A1)");
    }
}
