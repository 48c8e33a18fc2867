use serde_json::{json, Value};

use super::*;

fn param(e: Error) -> String {
    match e {
        Error::Invalid { param, .. } => param.to_string(),
        Error::InvalidAt { param, .. } => param,
        other => panic!("not a 400: {other}"),
    }
}

#[test]
fn a_request_becomes_the_chat_it_means() {
    let body = json!({
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{\"city\":\"Lyon\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
            {"type": "function_call_output", "call_id": "call_2", "output": "21C"}
        ],
        "tools": [{"type": "function", "name": "get_weather", "strict": true,
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": true}},
        "max_output_tokens": 64,
        "include": [], "truncation": "disabled", "prompt_cache_key": "k", "store": false,
    });
    let t = translate(&body, Vec::new()).unwrap();
    let m = &t.chat["messages"];
    assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
    assert_eq!(
        m[1],
        json!({"role": "user", "content": "Weather in Paris?"})
    );
    assert_eq!(
        m[2]["tool_calls"].as_array().unwrap().len(),
        2,
        "one assistant turn, both calls"
    );
    assert_eq!(
        m[3],
        json!({"role": "tool", "tool_call_id": "call_1", "content": "18C"})
    );
    assert_eq!(t.chat["tools"][0]["function"]["name"], "get_weather");
    assert_eq!(t.chat["tools"][0]["function"]["strict"], true);
    assert_eq!(
        t.chat["tool_choice"],
        json!({"type": "function", "function": {"name": "get_weather"}})
    );
    assert_eq!(t.chat["response_format"]["json_schema"]["name"], "w");
    assert_eq!(t.chat["max_completion_tokens"], 64);
    assert!(!t.store);
    assert_eq!(t.chat["stream"], false);
    assert!(
        t.input.iter().all(|i| i["id"].is_string()),
        "input items get ids"
    );
}

#[test]
fn a_continued_conversation_starts_with_the_stored_items() {
    let stored = Stored {
        response: json!({"output": [{"type": "message", "role": "assistant",
                                      "content": [{"type": "output_text", "text": "Hi Ada."}]}]}),
        input: Vec::new(),
        context: vec![json!({"type": "message", "role": "user", "content": "I am Ada."})],
    };
    let t = translate(
        &json!({"model": "m", "input": "Who am I?"}),
        continued(stored),
    )
    .unwrap();
    let roles: Vec<&str> = t.chat["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "user"]);
    assert_eq!(t.chat["messages"][1]["content"], "Hi Ada.");
    assert_eq!(t.context.len(), 3);
    assert_eq!(t.input.len(), 1);
}

#[test]
fn what_is_not_served_is_named() {
    let cases = [
        (json!({"model": "m"}), "input"),
        (
            json!({"model": "m", "input": "x", "background": true}),
            "background",
        ),
        (
            json!({"model": "m", "input": "x", "reasoning": {"effort": "high"}}),
            "reasoning",
        ),
        (
            json!({"model": "m", "input": "x", "truncation": "auto"}),
            "truncation",
        ),
        (
            json!({"model": "m", "input": "x", "include": ["file_search_call.results"]}),
            "include",
        ),
        (json!({"model": "m", "input": "x", "frobnicate": 1}), "body"),
        (
            json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}),
            "tools[0].type",
        ),
        (
            json!({"model": "m", "input": [{"type": "input_image"}]}),
            "input[0].type",
        ),
        (
            json!({"model": "m", "input": [{"role": "robot", "content": "x"}]}),
            "input[0].role",
        ),
        (
            json!({"model": "m", "input": "x", "text": {"format": {"type": "yaml"}}}),
            "text",
        ),
        (
            json!({"model": "m", "input": "x", "metadata": {"k": 1}}),
            "metadata",
        ),
    ];
    for (body, want) in cases {
        match translate(&body, Vec::new()) {
            Err(e) => assert_eq!(param(e), want, "{body}"),
            Ok(_) => panic!("{body}: accepted"),
        }
    }
    // Sent by the SDKs on their own: accepted.
    let neutral = json!({"model": "m", "input": "x", "include": null, "service_tier": "auto",
                         "background": false, "reasoning": {"effort": null}, "stream_options": null});
    translate(&neutral, Vec::new()).unwrap();
}

fn chunk(delta: Value, finish: Option<&str>) -> Value {
    json!({"model": "served", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
}

fn kinds(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap()).collect()
}

#[test]
fn a_streamed_answer_becomes_responses_events_in_order() {
    let t = translate(
        &json!({"model": "m", "input": "x", "stream": true}),
        Vec::new(),
    )
    .unwrap();
    let mut s = t.shape.events();
    let mut events = s.push(&chunk(json!({"role": "assistant", "content": ""}), None));
    events.extend(s.push(&chunk(json!({"content": "Hel"}), None)));
    events.extend(s.push(&chunk(json!({"content": "lo"}), None)));
    events.extend(s.push(&chunk(json!({}), Some("stop"))));
    events.extend(
        s.push(&json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})),
    );
    events.extend(s.finish());
    assert_eq!(
        kinds(&events),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let seqs: Vec<u64> = events
        .iter()
        .map(|e| e["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, (0..events.len() as u64).collect::<Vec<_>>());
    let done = &events[events.len() - 1]["response"];
    assert_eq!(done["output"][0]["content"][0]["text"], "Hello");
    assert_eq!(done["usage"]["total_tokens"], 7);
    assert_eq!(done["model"], "served");
    assert_eq!(s.response()["status"], "completed");
}

#[test]
fn streamed_calls_and_a_cut_answer() {
    let t = translate(&json!({"model": "m", "input": "x"}), Vec::new()).unwrap();
    let mut s = t.shape.events();
    let call = json!({"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                                       "function": {"name": "f", "arguments": "{\"a\""}}]});
    let mut events = s.push(&chunk(call, None));
    let more = json!({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]});
    events.extend(s.push(&chunk(more, None)));
    events.extend(s.push(&chunk(json!({}), Some("length"))));
    events.extend(s.finish());
    assert_eq!(
        kinds(&events)[2..],
        [
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.incomplete",
        ]
    );
    let r = &events[events.len() - 1]["response"];
    assert_eq!(r["output"][0]["arguments"], "{\"a\": 1}");
    assert_eq!(r["output"][0]["call_id"], "call_9");
    assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
}

#[test]
fn a_whole_answer_becomes_a_response() {
    let t = translate(
        &json!({"model": "m", "input": "x", "metadata": {"ticket": "42"}}),
        Vec::new(),
    )
    .unwrap();
    let chat = json!({"model": "served", "choices": [{"index": 0, "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}}});
    let r = t.shape.response(&chat);
    assert_eq!(r["object"], "response");
    assert_eq!(r["status"], "completed");
    assert_eq!(r["output"][0]["type"], "message");
    assert_eq!(r["output"][1]["type"], "function_call");
    assert_eq!(r["usage"]["input_tokens_details"]["cached_tokens"], 2);
    assert_eq!(r["metadata"]["ticket"], "42");
    assert_eq!(r["id"], t.shape.id);
}

#[test]
fn file_search_searches_the_collection_and_cites_it() {
    let body = json!({"model": "m", "input": "How long do refunds take?", "stream": true,
        "tools": [{"type": "file_search", "vector_store_ids": ["kb"], "max_num_results": 2}],
        "tool_choice": {"type": "file_search"}});
    let t = translate(&body, Vec::new()).unwrap();
    assert_eq!(t.chat["rag"], json!({"collection": "kb", "top_k": 2}));
    assert!(t.chat.get("tools").is_none(), "no function tools");
    assert_eq!(t.chat["tool_choice"], "auto");
    let mut s = t.shape.events();
    let mut events = s.push(&chunk(json!({"content": "Five days [1]."}), None));
    let mut last = chunk(json!({}), Some("stop"));
    last["citations"] = json!([{"index": 1, "document_id": "refunds", "title": "Refunds"}]);
    events.extend(s.push(&last));
    events.extend(s.finish());
    assert_eq!(
        kinds(&events)[2..7],
        [
            "response.output_item.added",
            "response.file_search_call.in_progress",
            "response.file_search_call.searching",
            "response.file_search_call.completed",
            "response.output_item.done",
        ]
    );
    let r = &events[events.len() - 1]["response"];
    assert_eq!(r["output"][0]["type"], "file_search_call");
    assert_eq!(
        r["output"][0]["queries"],
        json!(["How long do refunds take?"])
    );
    let notes = &r["output"][1]["content"][0]["annotations"];
    assert_eq!(notes[0]["file_id"], "refunds");
    assert_eq!(notes[0]["index"], 10);
}
