//! Structured output and tool calling end to end, over HTTP against the real binary: the
//! official Python and Node SDKs (tests/openai_sdk_structured.py, tests/openai_sdk_node.cjs)
//! on the default model and Qwen2.5 1.5B, vLLM's extension fields, the stream shape of tool
//! calls, and a precise 400 for each bad request.

mod support;

use std::process::Command;

use serde_json::{json, Value};
use support::{Server, MODEL};

const QWEN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf"
);

fn start_with_qwen() -> Server {
    assert!(
        std::path::Path::new(QWEN).exists(),
        "{QWEN} is missing: run host/scripts/fetch-real-models.sh"
    );
    Server::start(&["--model", &format!("qwen={QWEN}")])
}

fn chat(s: &Server, body: Value) -> Value {
    let (status, v) = s.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    v
}

fn refused(s: &Server, path: &str, body: Value) -> (String, String) {
    let (status, v) = s.post(path, &body);
    assert_eq!(status, 400, "{v}");
    let e = &v["error"];
    assert_eq!(e["type"], "invalid_request_error", "{v}");
    (
        e["param"].as_str().unwrap_or_default().to_string(),
        e["message"].as_str().unwrap().to_string(),
    )
}

#[test]
fn the_official_sdks_get_parsed_objects_and_tool_calls() {
    let s = start_with_qwen();
    let out = s.client(
        Command::new("python3"),
        "openai_sdk_structured.py",
        &[MODEL, "qwen"],
    );
    assert!(out.contains("structured ok"), "{out}");
    let modules = std::env::var("GATEWAY_NODE_MODULES").unwrap_or_else(|_| {
        let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
        format!("{home}/.cache/gateway-test-npm/node_modules")
    });
    assert!(
        std::path::Path::new(&modules).join("openai").exists(),
        "the OpenAI Node SDK is missing from {modules}: run host/scripts/test.sh"
    );
    let mut node = Command::new("node");
    node.env("NODE_PATH", &modules);
    let out = s.client(node, "openai_sdk_node.cjs", &[MODEL]);
    assert!(out.contains("node sdk ok"), "{out}");
    // Every request above compiled or reused a grammar; repeats were cache hits.
    let hits = s.metric("gateway_grammar_cache_total{model=\"qwen\",result=\"hit\"}");
    assert!(hits >= 10.0, "{hits} grammar cache hits");
}

#[test]
fn vllm_fields_constrain_both_endpoints() {
    let s = Server::start(&[]);
    let v = chat(
        &s,
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Is the sky green?"}],
               "guided_choice": ["yes", "no"], "max_tokens": 8}),
    );
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(["yes", "no"].contains(&text), "{text}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // Thousands of choices (regex metacharacters in them) are one alternation, not a row of
    // grammar alternatives past the parser's limits.
    let many: Vec<String> = (0..5000).map(|i| format!("acct-{i}.(eu)")).collect();
    let v = chat(
        &s,
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Pick an account."}],
               "guided_choice": many, "max_tokens": 16}),
    );
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(many.iter().any(|m| m == text), "{text}");

    let (status, v) = s.post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "The order number is", "max_tokens": 12, "n": 3,
                "temperature": 1.0, "seed": 7, "structured_outputs": {"regex": " [A-Z]{2}-[0-9]{4}"}}),
    );
    assert_eq!(status, 200, "{v}");
    for c in v["choices"].as_array().unwrap() {
        let t = c["text"].as_str().unwrap();
        let b = t.as_bytes();
        assert!(
            b.len() == 8
                && b[0] == b' '
                && b[1..3].iter().all(u8::is_ascii_uppercase)
                && b[3] == b'-'
                && b[4..].iter().all(u8::is_ascii_digit),
            "{t:?}"
        );
        assert_eq!(c["finish_reason"], "stop");
    }

    // A schema as JSON text (vLLM's guided_json), with logprobs for every emitted token:
    // nothing is forced when logprobs are asked for.
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
                        "required": ["n"], "additionalProperties": false});
    let v = chat(
        &s,
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Pick a number."}],
               "guided_json": schema.to_string(), "logprobs": true, "max_tokens": 30,
               "temperature": 0}),
    );
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    let parsed: Value = serde_json::from_str(text).expect(text);
    assert!(parsed["n"].is_i64(), "{text}");
    let tokens = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let joined: String = tokens
        .iter()
        .map(|t| t["token"].as_str().unwrap())
        .collect();
    assert_eq!(joined, text);
    assert!(tokens.iter().all(|t| t["logprob"].as_f64().unwrap() <= 0.0));
}

#[test]
fn streamed_tool_calls_open_with_id_and_name_then_carry_arguments() {
    let s = Server::start(&[]);
    let body = json!({
        "model": MODEL, "stream": true, "max_tokens": 80, "temperature": 0,
        "messages": [{"role": "user", "content": "Look up the account Acme."}],
        "tools": [{"type": "function", "function": {"name": "lookup_account",
            "parameters": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}},
                           "required": ["name"], "additionalProperties": false}}}],
        "tool_choice": {"type": "function", "function": {"name": "lookup_account"}},
    });
    let events = s.stream("/v1/chat/completions", &body);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let deltas: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert!(deltas.len() >= 2, "{chunks:?}");
    let first = deltas[0];
    assert_eq!(first["index"], 0);
    assert!(first["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(first["type"], "function");
    assert_eq!(first["function"]["name"], "lookup_account");
    assert_eq!(first["function"]["arguments"], "");
    let args: String = deltas[1..]
        .iter()
        .map(|d| d["function"]["arguments"].as_str().unwrap())
        .collect();
    let args: Value = serde_json::from_str(&args).expect(&args);
    assert!(args["name"].is_string(), "{args}");
    let last = &chunks.last().unwrap()["choices"][0];
    assert_eq!(last["finish_reason"], "tool_calls");
    // No content deltas besides the role's empty opening one.
    assert!(chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .all(str::is_empty));
}

#[test]
fn bad_structured_requests_name_the_field() {
    let s = Server::start(&[]);
    let user = json!([{"role": "user", "content": "hi"}]);
    let weather = json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
    let cases = [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                "schema": {"type": "object", "if": {"type": "object"}, "then": {}}}}}),
            "response_format",
            "if",
        ),
        (
            json!({"guided_regex": "[a-", "max_tokens": 4}),
            "guided_regex",
            "not supported",
        ),
        (
            json!({"guided_choice": ["a"], "guided_regex": "a"}),
            "guided_choice",
            "Only one",
        ),
        (
            json!({"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
            "nope",
        ),
        (
            json!({"tool_choice": "required"}),
            "tool_choice",
            "needs `tools`",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}),
            "tools[0].function.name",
            "bad name!",
        ),
        (
            json!({"tools": [weather, {"type": "function", "function": {"name": "f",
                "parameters": {"type": "object", "properties": {"x": {"not": {}}}}}}]}),
            "tools[1].function.parameters",
            "\"not\"",
        ),
    ];
    for (extra, param, says) in cases {
        let mut body = json!({"model": MODEL, "messages": user});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (p, message) = refused(&s, "/v1/chat/completions", body);
        assert_eq!(p, param, "{message}");
        assert!(message.contains(says), "{param}: {message}");
    }
    let call = json!({"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}});
    let histories = [
        (
            json!([{"role": "user", "content": "hi"},
                   {"role": "tool", "tool_call_id": "call_9", "content": "{}"}]),
            "messages[1].tool_call_id",
        ),
        (
            json!([{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"}]),
            "messages[1].tool_call_id",
        ),
        (
            json!([{"role": "user", "content": "hi"},
                   {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "unknown_fn", "arguments": "{}"}}]}]),
            "messages[1].tool_calls[0].function.name",
        ),
    ];
    for (messages, param) in histories {
        let body = json!({"model": MODEL, "messages": messages, "tools": [weather]});
        assert_eq!(refused(&s, "/v1/chat/completions", body).0, param);
    }
    // A well-formed history is accepted.
    let ok = json!({"model": MODEL, "max_tokens": 4, "tools": [weather], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 3}"}]});
    chat(&s, ok);
}
