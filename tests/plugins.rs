//! Tenant plugins end to end: templates, output parsers and rerankers as a real gateway
//! process serves them with real components, driven over HTTP; faults and hot reload are in
//! `plugin_faults.rs`.

mod support;

use serde_json::{json, Value};
use support::plugin_gateway::*;
use support::MODEL;

#[test]
fn the_template_plugin_writes_the_prompt() {
    let (s, dir) = start();
    let question = json!({"role": "user", "content": "How do I reset my password?"});
    // The plugin puts the tenant's persona in front: the same as another tenant sending
    // that system message itself, token for token.
    let (st, via_plugin) = s.post_as("sk-acme", "/v1/chat/completions", &chat(json!([question])));
    assert_eq!(st, 200, "{via_plugin}");
    let (_, by_hand) = s.post_as(
        "sk-plain",
        "/v1/chat/completions",
        &chat(json!([{"role": "system", "content": PERSONA}, question])),
    );
    assert_eq!(
        via_plugin["usage"]["prompt_tokens"],
        by_hand["usage"]["prompt_tokens"]
    );
    // Tenants never share prefix-cache entries: the other tenant's identical prompt missed.
    assert_eq!(
        by_hand["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    assert_eq!(
        via_plugin["choices"][0]["message"],
        by_hand["choices"][0]["message"]
    );

    // Documents become numbered sources after the citation instruction.
    let mut req = chat(json!([question]));
    req["documents"] = json!([{"id": "kb-7", "title": "Passwords", "text": "Use the Forgot link."}, {"text": "Admins can reset any user."}]);
    let (st, grounded) = s.post_as("sk-acme", "/v1/chat/completions", &req);
    assert_eq!(st, 200, "{grounded}");
    let system = format!("{PERSONA}\n\n{CITE}\n\n[1] Passwords: Use the Forgot link.\n\n[2] Admins can reset any user.");
    let (_, by_hand) = s.post_as(
        "sk-plain",
        "/v1/chat/completions",
        &chat(json!([{"role": "system", "content": system}, question])),
    );
    support::assert_same_prompt(&grounded, &by_hand);

    // Without a template plugin, documents become numbered sources in the system message.
    let (st, grounded) = s.post_as("sk-plain", "/v1/chat/completions", &req);
    assert_eq!(st, 200, "{grounded}");
    let system = format!(
        "{}\n\n[1] Passwords\nUse the Forgot link.\n\n[2] Admins can reset any user.",
        support::GROUNDING
    );
    let (_, by_hand) = s.post_as(
        "sk-plain",
        "/v1/chat/completions",
        &chat(json!([{"role": "system", "content": system}, question])),
    );
    support::assert_same_prompt(&grounded, &by_hand);
    // The plugin refusing its input is the request's error (422), naming the plugin.
    let (st, err) = s.post_as(
        "sk-acme",
        "/v1/chat/completions",
        &chat(json!([{"role": "system", "content": "x"}])),
    );
    assert_eq!(st, 422, "{err}");
    assert_eq!(err["error"]["code"], "plugin_rejected");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`persona`"),
        "{err}"
    );
    // Time spent in plugins is part of each request's ledger row.
    let (st, usage) = s.request("GET", "/admin/usage?tenant=acme", vec![], Some(ADMIN));
    assert_eq!(st, 200, "{usage}");
    assert!(
        usage["data"][0]["plugin_ms"].as_f64().unwrap() > 0.0,
        "{usage}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_output_parser_returns_validated_json() {
    let (s, dir) = start();
    // Greedy decoding with batch-invariant kernels: the model answers with the same JSON every
    // time ({"name": "Ada", "city": "Paris"} on the default model).
    let ask = |extra: Value| {
        let mut r = json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": "Give a JSON object with keys name and city for a customer called Ada from Paris. Answer with JSON only."}],
            "temperature": 0,
            "max_tokens": 40,
            "response_format": {"type": "json_object"},
        });
        r.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        r
    };
    let (st, body) = s.post_as("sk-acme", "/v1/chat/completions", &ask(json!({})));
    assert_eq!(st, 200, "{body}");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    let v: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{content}: {e}"));
    assert_eq!(v["name"], "Ada", "{v}");
    assert!(body["choices"][0]["repairs"].is_array(), "{body}");
    // Cut off mid-object, the answer still comes back as JSON, with what was fixed.
    let (st, body) = s.post_as(
        "sk-acme",
        "/v1/chat/completions",
        &ask(json!({"max_tokens": 12})),
    );
    assert_eq!(st, 200, "{body}");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        serde_json::from_str::<Value>(content).unwrap().is_object(),
        "{content}"
    );
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert!(
        body["choices"][0]["repairs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r.as_str().unwrap().starts_with("closed")),
        "{body}"
    );

    // Streaming: raw deltas, then the parsed value in the final chunk.
    let events = s.stream_as(
        "sk-acme",
        "/v1/chat/completions",
        &ask(json!({"stream": true})),
    );
    assert_eq!(events.last().unwrap(), "[DONE]");
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["parsed"], v, "{last}");
    let streamed: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&streamed).unwrap(),
        v,
        "deltas carry the raw text"
    );

    // An output that does not meet the schema is reported with the schema's complaint. The
    // schema itself is enforced while decoding, so only a cut (max_tokens) leaves it unmet.
    let schema = json!({"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object", "required": ["invoice_total_cents"]}}});
    let (st, body) = s.post_as(
        "sk-acme",
        "/v1/chat/completions",
        &ask(json!({"response_format": schema, "max_tokens": 1})),
    );
    assert_eq!(st, 422, "{body}");
    assert_eq!(body["error"]["code"], "plugin_rejected");

    // A parser that claims success with non-JSON is caught by the host.
    let (st, body) = s.post_as(
        "sk-bad",
        "/v1/chat/completions",
        &chat(json!([{"role": "user", "content": "hi"}])),
    );
    assert_eq!(st, 500, "{body}");
    assert_eq!(body["error"]["code"], "plugin_invalid_output");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`bad` of tenant `badco`"),
        "{body}"
    );
    assert_eq!(failures(&s, "badco", "bad", "invalid_output"), 1.0);

    // A template that returns a role no chat template knows is caught by the host too.
    let (st, body) = s.post_as(
        "sk-odd",
        "/v1/chat/completions",
        &chat(json!([{"role": "user", "content": "hi"}])),
    );
    assert_eq!(
        (st, body["error"]["code"].as_str()),
        (500, Some("plugin_invalid_output")),
        "{body}"
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("\"narrator\""),
        "{body}"
    );
    assert_eq!(failures(&s, "oddrole", "narrator", "invalid_output"), 1.0);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_policy_binding_a_plugin_of_the_wrong_kind_is_refused() {
    let (s, dir) = start();
    let policy = std::fs::read_to_string(dir.join("policies.toml")).unwrap();
    let wrong = policy.replace("output_parser = \"json\"", "output_parser = \"ranker\"");
    assert_ne!(wrong, policy);
    let (st, body) = s.request("PUT", "/admin/policies", wrong.into_bytes(), Some(ADMIN));
    assert_eq!(st, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("output_parser = \"ranker\" is installed as kind `reranker`"),
        "{message}"
    );
    // The policy in force is unchanged, and a binding of the right kind is accepted.
    let (st, _) = s.request("PUT", "/admin/policies", policy.into_bytes(), Some(ADMIN));
    assert_eq!(st, 200);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn rerank_is_served_by_the_tenant_plugin() {
    let (s, dir) = start();
    let (st, body) = s.post_as(
        "sk-acme",
        "/v1/rerank",
        &json!({"query": "export invoices", "documents": rerank_docs(), "top_n": 2}),
    );
    assert_eq!(st, 200, "{body}");
    let results = body["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    // Both terms match document 0 (1.0); one term and the enterprise boost give document 2 1.0
    // too (0.5 × 2), and ties keep input order.
    assert_eq!(results[0]["index"], 0);
    assert_eq!(results[0]["relevance_score"], 1.0);
    assert_eq!(results[1]["index"], 2);
    assert_eq!(results[1]["document"]["tier"], "enterprise");
    assert_eq!(body["model"], "ranker");

    let bad = |b: Value| s.post_as("sk-acme", "/v1/rerank", &b);
    assert_eq!(bad(json!({"query": " ", "documents": ["a"]})).0, 400);
    assert_eq!(bad(json!({"query": "q", "documents": []})).0, 400);
    assert_eq!(
        bad(json!({"query": "q", "documents": [{"title": "no text"}]})).0,
        400
    );
    assert_eq!(
        bad(json!({"query": "q", "documents": ["a"], "model": "nope"})).0,
        404
    );
    // Another tenant's plugin is not visible, and a tenant without a reranker must name one.
    assert_eq!(
        bad(json!({"query": "q", "documents": ["a"], "model": "faulty"})).0,
        404
    );
    let (st, body) = s.post_as(
        "sk-plain",
        "/v1/rerank",
        &json!({"query": "q", "documents": ["a"]}),
    );
    assert_eq!(st, 400, "{body}");
    assert_eq!(body["error"]["param"], "model");
    let _ = std::fs::remove_dir_all(dir);
}
