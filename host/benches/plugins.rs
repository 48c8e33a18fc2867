//! Plugin invocation latency: each example plugin and a no-op, called through the gateway's
//! runtime (fresh `Store` + instantiate + call, as a request does), next to the same logic
//! compiled natively, and the TypeScript and Python example plugins. Prints p50/p99 per call.
//!
//! `cargo bench --bench plugins` (builds the components first).

#[path = "../../tests/support/wasm.rs"]
mod wasm;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gateway::config::PluginsConfig;
use gateway::plugins::{self as host, ConfigValue, Registry, Runtime, TenantValues};
use guest_sdk::{prompt_template as gp, reranker as gr};

const WARMUP: usize = 300;
const CALLS: usize = 5000;

fn percentiles(mut samples: Vec<Duration>) -> (f64, f64) {
    samples.sort();
    let at = |q: f64| {
        samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)].as_secs_f64() * 1e6
    };
    (at(0.50), at(0.99))
}

fn time(f: impl FnMut()) -> (f64, f64) {
    time_n(CALLS, f)
}

fn time_n(calls: usize, mut f: impl FnMut()) -> (f64, f64) {
    for _ in 0..WARMUP.min(calls) {
        f();
    }
    let samples = (0..calls)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    percentiles(samples)
}

fn config() -> BTreeMap<String, ConfigValue> {
    let text = |t: &str| ConfigValue::Text(t.into());
    BTreeMap::from([
        (
            "persona".into(),
            text("You are Ava, the support assistant of Acme CRM."),
        ),
        (
            "boosts".into(),
            ConfigValue::TextList(vec!["tier=enterprise:1.5".into(), "status=open:1.2".into()]),
        ),
        ("recency_field".into(), text("updated")),
    ])
}

const MODEL_TEXT: &str = "Sure! Here is the contact:\n```json\n{name: 'Ada Lovelace', 'email': 'ada@example.com', tags: ['vip', 'emea',], active: True,}\n```\nLet me know if you need anything else.";
const INTENT_TEXT: &str = "The customer wants to cancel their subscription (order #A-10423) and asks for a refund of $49.99 to jane.doe@example.com.";
const SCHEMA: &str = r#"{"type":"object","required":["name","email"],"properties":{"name":{"type":"string"},"email":{"type":"string"},"tags":{"type":"array","items":{"type":"string"}}}}"#;

/// Drives one plugin call to completion on a runtime kept for the thread (the call's deadline
/// is a timer), as the gateway's blocking pool does.
fn block<T>(call: impl std::future::Future<Output = T>) -> T {
    thread_local! {
        static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a tokio runtime");
    }
    RT.with(|rt| rt.block_on(call))
}

fn main() {
    let rt = Runtime::new(&PluginsConfig::default()).expect("runtime");
    let reg = Registry::new(rt.clone(), None);
    let install = |krate: &str| {
        reg.install(
            "bench",
            krate,
            &std::fs::read(wasm::component(krate)).unwrap(),
            None,
        )
        .unwrap()
    };
    // The same components with a fresh instance per call (`reuse_instances = false`).
    let cold_rt = Runtime::new(&PluginsConfig {
        reuse_instances: false,
        ..PluginsConfig::default()
    })
    .expect("runtime");
    let cold_reg = Registry::new(cold_rt.clone(), None);
    let cold = |krate: &str| {
        cold_reg
            .install(
                "bench",
                krate,
                &std::fs::read(wasm::component(krate)).unwrap(),
                None,
            )
            .unwrap()
    };
    let values: TenantValues = Arc::new(config());
    let cfg = config();
    let lookup_text = |k: &str| cfg.get(k).map(ConfigValue::as_text);
    let lookup = |k: &str| {
        cfg.get(k).map(|v| match v.clone() {
            ConfigValue::Text(t) => gr::Value::Text(t),
            ConfigValue::Number(n) => gr::Value::Number(n),
            ConfigValue::Boolean(b) => gr::Value::Boolean(b),
            ConfigValue::TextList(l) => gr::Value::TextList(l),
        })
    };

    let messages = [
        ("system", "Reply briefly."),
        ("user", "How do I export my invoices to PDF?"),
    ];
    let chunks = [
        (
            "kb-1",
            "Billing",
            "Open Billing, pick invoices, press Export.",
        ),
        ("kb-2", "PDF", "Exports are PDF by default."),
    ];
    let host_req = host::ChatRequest {
        model: "smollm2".into(),
        messages: messages
            .iter()
            .map(|(r, c)| host::Message {
                role: r.to_string(),
                content: c.to_string(),
                name: None,
            })
            .collect(),
        context: chunks
            .iter()
            .map(|(i, t, x)| host::ContextChunk {
                id: i.to_string(),
                text: x.to_string(),
                title: Some(t.to_string()),
            })
            .collect(),
    };
    let native_req = || gp::ChatRequest {
        model: "smollm2".into(),
        messages: messages
            .iter()
            .map(|(r, c)| gp::Message {
                role: r.to_string(),
                content: c.to_string(),
                name: None,
            })
            .collect(),
        context: chunks
            .iter()
            .map(|(i, t, x)| gp::ContextChunk {
                id: i.to_string(),
                text: x.to_string(),
                title: Some(t.to_string()),
            })
            .collect(),
    };
    type Doc = (String, String, Vec<(String, String)>);
    let docs: Vec<Doc> = (0..20)
        .map(|i| {
            let meta = vec![
                (
                    "tier".to_string(),
                    if i % 3 == 0 { "enterprise" } else { "free" }.to_string(),
                ),
                ("updated".to_string(), format!("2024-03-{:02}", 1 + i % 28)),
            ];
            (
                i.to_string(),
                format!(
                    "Ticket {i}: customer asks how to export invoices and contacts to PDF or CSV"
                ),
                meta,
            )
        })
        .collect();
    let host_cands: Vec<host::Candidate> = docs
        .iter()
        .map(|(id, t, m)| host::Candidate {
            id: id.clone(),
            document_id: None,
            text: t.clone(),
            metadata: m
                .iter()
                .map(|(k, v)| (k.clone(), host::Value::Text(v.clone())))
                .collect(),
            score: 0.0,
        })
        .collect();
    let native_cands = || -> Vec<gr::Candidate> {
        docs.iter()
            .map(|(id, t, m)| gr::Candidate {
                id: id.clone(),
                document_id: None,
                text: t.clone(),
                metadata: m
                    .iter()
                    .map(|(k, v)| (k.clone(), gr::Value::Text(v.clone())))
                    .collect(),
                score: 0.0,
            })
            .collect()
    };
    let query = "export invoices to pdf";

    let (persona, cold_persona) = (
        install("crm-persona-template"),
        cold("crm-persona-template"),
    );
    let (ranker, cold_ranker) = (install("crm-field-reranker"), cold("crm-field-reranker"));
    let (json, cold_json) = (install("json-extract"), cold("json-extract"));
    let (noop, cold_noop) = (install("noop"), cold("noop"));
    // The TypeScript port of the field reranker and the Python intent parser.
    let lang = |dir: &str, reg: &Registry| {
        let wasm = std::fs::read(wasm::language_component(dir)).unwrap();
        reg.install("bench", dir, &wasm, None).unwrap()
    };
    let (ts_ranker, cold_ts_ranker) = (
        lang("crm-field-reranker-ts", &reg),
        lang("crm-field-reranker-ts", &cold_reg),
    );
    let (intent, cold_intent) = (
        lang("intent-parser-py", &reg),
        lang("intent-parser-py", &cold_reg),
    );
    // Fresh instances re-run guest initialisers per call (the schema row takes ms): fewer calls.
    const COLD_CALLS: usize = 500;
    let cold_time = |f: &dyn Fn()| time_n(COLD_CALLS, f);

    type Row<'a> = (&'a str, (f64, f64), (f64, f64), Option<(f64, f64)>);
    let mut rows: Vec<Row> = Vec::new();
    rows.push((
        "no-op (reranker, 20 candidates)",
        time(|| drop(block(noop.rerank(&rt, &values, query, &host_cands)).unwrap())),
        cold_time(&|| {
            drop(block(cold_noop.rerank(&cold_rt, &values, query, &host_cands)).unwrap())
        }),
        None,
    ));
    rows.push((
        "crm-persona-template",
        time(|| drop(block(persona.render(&rt, &values, &host_req)).unwrap())),
        cold_time(&|| drop(block(cold_persona.render(&cold_rt, &values, &host_req)).unwrap())),
        Some(time(|| {
            drop(crm_persona_template::render(native_req(), &lookup_text).unwrap())
        })),
    ));
    rows.push((
        "crm-field-reranker (20 candidates)",
        time(|| drop(block(ranker.rerank(&rt, &values, query, &host_cands)).unwrap())),
        cold_time(&|| {
            drop(block(cold_ranker.rerank(&cold_rt, &values, query, &host_cands)).unwrap())
        }),
        Some(time(|| {
            drop(crm_field_reranker::rerank(query, native_cands(), &lookup).unwrap())
        })),
    ));
    rows.push((
        "crm-field-reranker-ts: TypeScript (20 candidates)",
        time(|| drop(block(ts_ranker.rerank(&rt, &values, query, &host_cands)).unwrap())),
        cold_time(&|| {
            drop(block(cold_ts_ranker.rerank(&cold_rt, &values, query, &host_cands)).unwrap())
        }),
        None,
    ));
    rows.push((
        "intent-parser-py: Python",
        time(|| drop(block(intent.parse(&rt, &values, INTENT_TEXT, None)).unwrap())),
        cold_time(&|| {
            drop(block(cold_intent.parse(&cold_rt, &values, INTENT_TEXT, None)).unwrap())
        }),
        None,
    ));
    rows.push((
        "json-extract (repair, no schema)",
        time(|| drop(block(json.parse(&rt, &values, MODEL_TEXT, None)).unwrap())),
        cold_time(&|| drop(block(cold_json.parse(&cold_rt, &values, MODEL_TEXT, None)).unwrap())),
        Some(time(|| {
            drop(json_extract::parse(MODEL_TEXT, None).unwrap())
        })),
    ));
    rows.push((
        "json-extract (repair + JSON Schema)",
        time(|| drop(block(json.parse(&rt, &values, MODEL_TEXT, Some(SCHEMA))).unwrap())),
        cold_time(&|| {
            drop(block(cold_json.parse(&cold_rt, &values, MODEL_TEXT, Some(SCHEMA))).unwrap())
        }),
        Some(time(|| {
            drop(json_extract::parse(MODEL_TEXT, Some(SCHEMA)).unwrap())
        })),
    ));

    println!("\nplugin call latency in µs: warm = reused instance ({CALLS} calls), fresh = new store + instance per call ({COLD_CALLS} calls), native = the same logic compiled natively");
    println!("| plugin | warm p50 | warm p99 | fresh p50 | fresh p99 | native p50 | native p99 | warm/native p50 |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (name, (w50, w99), (f50, f99), native) in rows {
        match native {
            Some((n50, n99)) => println!("| {name} | {w50:.1} | {w99:.1} | {f50:.1} | {f99:.1} | {n50:.2} | {n99:.2} | {:.1}× |", w50 / n50),
            None => println!("| {name} | {w50:.1} | {w99:.1} | {f50:.1} | {f99:.1} | – | – | – |"),
        }
    }
}
