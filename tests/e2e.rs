//! End-to-end: the real `gateway` binary, real SmolLM2 weights, real HTTP over loopback.

mod support;

use std::io::Write;

use serde_json::{json, Value};
use support::{Server, MODEL};

fn chat(content: &str) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 24})
}

fn error_of(v: &Value) -> (&str, Option<&str>) {
    let e = &v["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "error body has a message: {v}"
    );
    assert!(
        e.get("code").is_some() && e.get("param").is_some(),
        "error body has code and param: {v}"
    );
    (e["type"].as_str().unwrap(), e["param"].as_str())
}

#[test]
fn greedy_chat_answers_and_stream_matches() {
    let s = Server::start(&[]);
    let (status, body) = s.post(
        "/v1/chat/completions",
        &chat("What is the capital of France?"),
    );
    assert_eq!(status, 200, "{body}");
    let text = body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        text.contains("Paris"),
        "greedy answer mentions Paris: {text:?}"
    );
    assert_eq!(body["object"], "chat.completion");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    let u = &body["usage"];
    assert_eq!(
        u["total_tokens"],
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );

    // Logprobs cover exactly the content: their bytes concatenate to it, no stop token.
    let mut lp_req = chat("What is the capital of France?");
    lp_req["logprobs"] = json!(true);
    lp_req["top_logprobs"] = json!(3);
    let (_, lp_body) = s.post("/v1/chat/completions", &lp_req);
    let entries = lp_body["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    let bytes: Vec<u8> = entries
        .iter()
        .flat_map(|e| {
            e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
        })
        .collect();
    assert_eq!(String::from_utf8(bytes).unwrap(), text);
    assert!(entries
        .iter()
        .all(|e| e["top_logprobs"].as_array().unwrap().len() == 3));

    let mut req = chat("What is the capital of France?");
    req["stream"] = json!(true);
    req["stream_options"] = json!({"include_usage": true});
    let events = s.stream("/v1/chat/completions", &req);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk" && c["id"] == chunks[0]["id"]));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        streamed, text,
        "streamed deltas concatenate to the non-streamed answer"
    );
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(
        usage_chunk["usage"]["completion_tokens"],
        u["completion_tokens"]
    );
    // The same prompt again: its full KV blocks come from the prefix cache.
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
    let cached = usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt = u["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached > 0 && cached < prompt && cached.is_multiple_of(16),
        "cached {cached} of {prompt}"
    );
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, vec![&json!("stop")]);
}

#[test]
fn completions_sampling_stop_logprobs_and_n() {
    let s = Server::start(&[]);
    let base = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.9, "seed": 42, "n": 2});
    let (st, a) = s.post("/v1/completions", &base);
    assert_eq!(st, 200, "{a}");
    let (_, b) = s.post("/v1/completions", &base);
    let texts = |v: &Value| {
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["text"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(texts(&a).len(), 2);
    assert_eq!(texts(&a), texts(&b), "same seed, same output");
    // A prompt long enough for the prompt kernels: its choices may be prefilled in one step
    // or in two, and must sample alike either way.
    let long = json!({"model": MODEL, "prompt": "Once upon a time, in a village by the sea, there lived an old", "max_tokens": 12, "temperature": 0.9, "seed": 7, "n": 2});
    let runs: Vec<_> = (0..3)
        .map(|_| texts(&s.post("/v1/completions", &long).1))
        .collect();
    assert!(
        runs.iter().all(|r| r == &runs[0]),
        "same seed, same output: {runs:?}"
    );
    assert_eq!(a["object"], "text_completion");
    assert_eq!(a["choices"][1]["index"], 1);
    assert_eq!(
        a["usage"]["completion_tokens"], 24,
        "two choices of 12 tokens each: {a}"
    );

    // Greedy continuation, then the same request cut at a stop string found in it.
    let greedy = json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "logprobs": 3});
    let (_, g) = s.post("/v1/completions", &greedy);
    let full = g["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(g["choices"][0]["finish_reason"], "length");
    let lp = &g["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 16);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 3);
    assert!(lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .all(|x| x.as_f64().unwrap() <= 0.0));
    let words: Vec<&str> = full.split_whitespace().collect();
    let stop = words[words.len() / 2];
    let mut cut = greedy.clone();
    cut["stop"] = json!([stop]);
    let (_, c) = s.post("/v1/completions", &cut);
    let cut_text = c["choices"][0]["text"].as_str().unwrap();
    assert_eq!(c["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        cut_text,
        &full[..full.find(stop).unwrap()],
        "text stops right before {stop:?}"
    );

    // Streaming completions end the same way.
    let mut streamed = cut.clone();
    streamed["stream"] = json!(true);
    let events = s.stream("/v1/completions", &streamed);
    let text: String = events[..events.len() - 1]
        .iter()
        .map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(text, cut_text);
}

#[test]
fn concurrent_requests_are_batched() {
    let s = Server::start(&[]);
    let questions = [
        "the sea", "a cat", "the moon", "a tree", "rain", "music", "a city", "bread",
    ];
    std::thread::scope(|scope| {
        let handles: Vec<_> = questions
            .iter()
            .map(|q| {
                let s = &s;
                scope.spawn(move || {
                    s.post(
                        "/v1/chat/completions",
                        &chat(&format!("Write one sentence about {q}.")),
                    )
                })
            })
            .collect();
        for h in handles {
            let (status, body) = h.join().unwrap();
            assert_eq!(status, 200, "{body}");
            assert!(!body["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .is_empty());
        }
    });
    let label = format!("{{model=\"{MODEL}\"}}");
    let steps = s.metric(&format!("gateway_batch_sequences_count{label}"));
    let single = s.metric(&format!(
        "gateway_batch_sequences_bucket{{model=\"{MODEL}\",le=\"1\"}}"
    ));
    assert!(
        steps > single,
        "some steps ran more than one sequence ({single} of {steps} ran one)"
    );
    assert!(s.metric(&format!("gateway_generation_tokens_total{label}")) > 0.0);
    s.wait_metric(&format!("gateway_running_sequences{label}"), 0.0);
}

#[test]
fn client_disconnect_frees_kv_blocks() {
    let s = Server::start(&[]);
    let body = json!({"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 2000, "ignore_eos": true, "stream": true}).to_string();
    let sock = s.raw_request("/v1/completions", &body);
    let label = format!("{{model=\"{MODEL}\"}}");
    s.wait_until(
        &format!("gateway_kv_blocks_used{label}"),
        |v| v > 0.0,
        "> 0 while the stream runs",
    );
    drop(sock);
    s.wait_metric(&format!("gateway_running_sequences{label}"), 0.0);
    s.wait_metric(&format!("gateway_kv_blocks_used{label}"), 0.0);
    let cancelled =
        format!("gateway_requests_total{{finish_reason=\"cancelled\",model=\"{MODEL}\"}}");
    assert_eq!(s.metric(&cancelled), 1.0);
}

#[test]
fn bad_inputs_get_openai_errors() {
    let s = Server::start(&["--max-body-bytes", "4096"]);
    let cases: Vec<(String, u16, Option<&str>)> = vec![
        ("{not json".into(), 400, None),
        (json!({"model": MODEL}).to_string(), 400, None),
        (json!({"model": MODEL, "messages": []}).to_string(), 400, Some("messages")),
        (json!({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}).to_string(), 400, Some("messages")),
        (json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 7}).to_string(), 400, Some("temperature")),
        (json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 0}).to_string(), 400, Some("top_p")),
        (json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 99}).to_string(), 400, Some("n")),
        (json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).to_string(), 400, Some("max_tokens")),
        (json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}).to_string(), 400, Some("messages")),
        (json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}).to_string(), 400, Some("top_logprobs")),
        (json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": 1}}).to_string(), 400, Some("logit_bias")),
        (json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logit_bias": {"7": 500}}).to_string(), 400, Some("logit_bias")),
        (json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999999": 1}}).to_string(), 400, Some("logit_bias")),
        (json!({"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]}).to_string(), 404, Some("model")),
        (json!({"model": MODEL, "messages": [{"role": "user", "content": "x".repeat(5000)}]}).to_string(), 413, None),
    ];
    for (body, want, param) in cases {
        let (status, v) = s.post_raw("/v1/chat/completions", body.clone());
        assert_eq!(status, want, "status for {body:.80}: {v}");
        let (kind, p) = error_of(&v);
        assert_eq!(kind, "invalid_request_error");
        assert_eq!(p, param, "param for {body:.80}");
    }
    // max_tokens near usize::MAX must not wrap around the context check.
    let huge = json!({"model": MODEL, "prompt": "hi", "max_tokens": u64::MAX, "ignore_eos": true});
    let (status, v) = s.post("/v1/completions", &huge);
    assert_eq!((status, error_of(&v).1), (400, Some("prompt")), "{v}");
    let (status, v) = s.post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": [999999]}),
    );
    assert_eq!((status, error_of(&v).1), (400, Some("prompt")));
    let (status, v) = s.post("/v1/nope", &json!({}));
    assert_eq!(status, 404);
    error_of(&v);
    let (status, _) = s.get("/v1/chat/completions");
    assert_eq!(status, 405);
    // The server is still healthy after all of that.
    assert_eq!(s.get("/health").0, 200);
}

#[test]
fn overload_is_refused_with_503() {
    let dir = std::env::temp_dir().join(format!("gateway-overload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("gateway.toml");
    std::fs::write(
        &cfg,
        format!("ledger = \"{}/usage.sqlite\"\n[[models]]\nname = \"{MODEL}\"\npath = \"{}\"\n[models.engine]\nmax_num_seqs = 1\nmax_waiting = 1\n", dir.display(), support::model_path()),
    )
    .unwrap();
    let s = Server::start(&["--config", cfg.to_str().unwrap()]).remove_on_drop(&dir);
    let long = json!({"model": MODEL, "prompt": "Count:", "max_tokens": 4000, "ignore_eos": true, "stream": true}).to_string();
    let _running = s.raw_request("/v1/completions", &long);
    // The second request waits in the queue on a socket of its own; the third finds it full.
    let mut queued = std::net::TcpStream::connect(s.addr()).unwrap();
    write!(queued, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{long}", long.len()).unwrap();
    s.wait_metric(&format!("gateway_queue_depth{{model=\"{MODEL}\"}}"), 1.0);
    let (status, v) = s.post_raw("/v1/completions", long);
    assert_eq!(status, 503);
    assert_eq!(v["error"]["code"], "server_overloaded");
    drop(queued);
}

#[test]
fn models_health_and_metrics_endpoints() {
    let s = Server::start(&[]);
    let (status, body) = s.get("/v1/models");
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], MODEL);
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(s.get(&format!("/v1/models/{MODEL}")).0, 200);
    assert_eq!(s.get("/v1/models/nope").0, 404);
    assert_eq!(s.get("/health").0, 200);
    let (_, metrics) = s.get("/metrics");
    for name in [
        "gateway_queue_depth",
        "gateway_running_sequences",
        "gateway_kv_blocks_used",
        "gateway_kv_blocks_total",
        "gateway_time_to_first_token_seconds",
        "gateway_inter_token_latency_seconds",
        "gateway_prompt_tokens_total",
        "gateway_generation_tokens_total",
    ] {
        assert!(metrics.contains(name), "/metrics exposes {name}");
    }
    // vLLM's names, as Kubernetes inference routers and KEDA read them.
    let vllm = |series: &str| s.metric(&format!("{series}{{model_name=\"{MODEL}\"}}"));
    assert_eq!(vllm("vllm:num_requests_waiting"), 0.0);
    assert_eq!(vllm("vllm:num_requests_running"), 0.0);
    let usage = vllm("vllm:kv_cache_usage_perc");
    assert!((0.0..=1.0).contains(&usage), "{usage}");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("vllm:cache_config_info{")
                && l.contains("block_size=\"16\"")
                && l.ends_with(" 1")),
        "{metrics}"
    );
}

#[test]
fn official_openai_python_sdk_works_unchanged() {
    let s = Server::start(&[]);
    assert!(s.sdk_script("openai_sdk.py", MODEL).contains("Paris"));
}

#[test]
fn preempted_sequences_resume_with_identical_output() {
    // 24 KV blocks of 16 tokens: four concurrent 40-token prompts generating 80 tokens each
    // need ~32, so the newest get preempted and recomputed; greedy output must not change.
    let block_bytes = 2 * 30 * 16 * 3 * 64 * 2;
    let s = Server::start(&["--kv-cache-bytes", &(24 * block_bytes).to_string()]);
    let prompts: Vec<String> = ["ocean", "forest", "desert", "mountain"]
        .iter()
        .map(|w| format!("Write a long, detailed story about a journey across the {w}. It begins on a cold morning"))
        .collect();
    let body = |p: &str| json!({"model": MODEL, "prompt": p, "max_tokens": 80, "temperature": 0, "ignore_eos": true});
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| {
            s.post("/v1/completions", &body(p)).1["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let preempt = format!("gateway_preemptions_total{{model=\"{MODEL}\"}}");
    assert_eq!(s.metric(&preempt), 0.0, "one at a time fits");
    let together: Vec<String> = std::thread::scope(|scope| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| scope.spawn(|| s.post("/v1/completions", &body(p))))
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join().unwrap().1["choices"][0]["text"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect()
    });
    assert!(
        s.metric(&preempt) > 0.0,
        "the pool was too small for all four: preemption happened"
    );
    assert_eq!(
        together, alone,
        "preempted and resumed sequences produce the same greedy text"
    );
}
