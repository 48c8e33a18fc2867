//! The `file_search` tool on the tenant's own collections: the tool becomes the chat's `rag`
//! (the collection's hybrid search, its reranker plugin when bound, grounding, citations), and
//! the answer gains a `file_search_call` item and `file_citation` annotations where the text
//! cites a source as `[n]`.

use serde_json::{json, Value};

use super::Error;

/// The chat's `rag` for a `file_search` tool (`tools[i]`): one collection, `max_num_results`,
/// `filters` in OpenAI's comparison / compound form turned into the collection's filter.
pub(super) fn rag(i: usize, t: &Value) -> Result<Value, Error> {
    let at = |f: &str| format!("tools[{i}].{f}");
    let ids = t["vector_store_ids"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let [Value::String(collection)] = ids.as_slice() else {
        return Err(Error::invalid_at(
            at("vector_store_ids"),
            "`vector_store_ids` must name exactly one of the tenant's collections.",
        ));
    };
    let mut rag = json!({"collection": collection});
    match &t["max_num_results"] {
        Value::Null => {}
        Value::Number(n) if n.as_u64().is_some() => rag["top_k"] = json!(n),
        _ => {
            return Err(Error::invalid_at(
                at("max_num_results"),
                "`max_num_results` must be a positive integer.",
            ))
        }
    }
    if !t["filters"].is_null() {
        rag["filter"] =
            filter(&t["filters"]).map_err(|why| Error::invalid_at(at("filters"), why))?;
    }
    if t.get("ranking_options").is_some_and(|r| !r.is_null()) {
        return Err(Error::invalid_at(
            at("ranking_options"),
            "`ranking_options` are not supported: the collection's fusion and the tenant's reranker rank.",
        ));
    }
    Ok(rag)
}

/// OpenAI's `{"type": "eq", "key", "value"}` / `{"type": "and", "filters": [...]}` as the
/// collection filter's `{"key": {"$eq": value}}` / `{"$and": [...]}`.
fn filter(f: &Value) -> Result<Value, String> {
    let kind = f["type"].as_str().unwrap_or_default();
    match kind {
        "and" | "or" => {
            let parts = f["filters"]
                .as_array()
                .ok_or_else(|| format!("a `{kind}` filter needs `filters`"))?
                .iter()
                .map(filter)
                .collect::<Result<Vec<_>, _>>()?;
            Ok(json!({format!("${kind}"): parts}))
        }
        "eq" | "ne" | "gt" | "gte" | "lt" | "lte" | "in" | "nin" => {
            let key = f["key"]
                .as_str()
                .ok_or_else(|| format!("a `{kind}` filter needs `key`"))?;
            Ok(json!({key: {format!("${kind}"): f["value"]}}))
        }
        other => Err(format!(
            "filter type {other:?} is not one of eq, ne, gt, gte, lt, lte, in, nin, and, or"
        )),
    }
}

/// The output item of the search that grounded the answer.
pub(super) fn call_item(query: &str) -> Value {
    json!({"id": format!("fs_{:032x}", rand::random::<u128>()), "type": "file_search_call",
           "status": "completed", "queries": [query], "results": null})
}

/// A `file_citation` for each `[n]` in `text` that names a source the search found, at the
/// marker's character index.
pub(super) fn annotations(text: &str, citations: &Value) -> Vec<Value> {
    let Some(cites) = citations.as_array() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut chars = 0;
    let mut rest = text;
    while let Some(open) = rest.find('[') {
        chars += rest[..open].chars().count();
        let after = &rest[open + 1..];
        let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
        let closed = after[digits.len()..].starts_with(']');
        if let (true, Ok(n)) = (closed, digits.parse::<u64>()) {
            if let Some(c) = cites.iter().find(|c| c["index"].as_u64() == Some(n)) {
                let name = c["title"].as_str().or(c["document_id"].as_str());
                out.push(json!({"type": "file_citation", "file_id": c["document_id"],
                                "filename": name, "index": chars}));
            }
        }
        chars += 1;
        rest = after;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tool_becomes_retrieval_and_citations_annotations() {
        let t = json!({"type": "file_search", "vector_store_ids": ["kb"], "max_num_results": 3,
            "filters": {"type": "and", "filters": [{"type": "eq", "key": "team", "value": "billing"},
                                                   {"type": "gte", "key": "year", "value": 2023}]}});
        assert_eq!(
            rag(0, &t).unwrap(),
            json!({"collection": "kb", "top_k": 3,
                   "filter": {"$and": [{"team": {"$eq": "billing"}}, {"year": {"$gte": 2023}}]}})
        );
        let two = json!({"type": "file_search", "vector_store_ids": ["a", "b"]});
        assert!(rag(0, &two).is_err());
        let cites = json!([{"index": 1, "document_id": "refunds", "title": "Refunds"},
                           {"index": 2, "document_id": "ship"}]);
        let text = "Refunds take five days [1]. Ships fast [2][9] é [x]";
        let a = annotations(text, &cites);
        assert_eq!(a.len(), 2);
        assert_eq!(a[0]["filename"], "Refunds");
        assert_eq!(a[0]["index"], text.find("[1]").unwrap());
        assert_eq!(a[1]["file_id"], "ship");
        assert_eq!(a[1]["filename"], "ship");
    }
}
