//! `GET /admin/overview`: every model with its load and health, and the last minutes of the
//! gateway's rates, sampled from the same counters and gauges `/metrics` exports, so the
//! console's chart and a Prometheus dashboard never disagree.

use std::collections::VecDeque;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use http::StatusCode;
use prometheus::core::Collector;
use serde_json::{json, Value};

use super::{json_response, AppState, Response};

/// How often a sample is taken, and how many are kept (ten minutes).
const INTERVAL: Duration = Duration::from_secs(2);
const KEPT: usize = 300;

/// Counter totals at one instant; rates are the differences of two.
#[derive(Clone, Copy, Default)]
struct Totals {
    requests: f64,
    errors: f64,
    refused: f64,
    tokens: f64,
}

#[derive(Clone, Copy)]
struct Sample {
    at: i64,
    requests_per_s: f64,
    errors_per_s: f64,
    refused_per_s: f64,
    tokens_per_s: f64,
    running: f64,
    waiting: f64,
    kv_usage: f64,
}

/// The kept samples, and the totals the next one is measured from.
#[derive(Default)]
pub struct History(parking_lot::Mutex<Kept>);

#[derive(Default)]
struct Kept {
    samples: VecDeque<Sample>,
    last: Option<(Instant, Totals)>,
}

/// Samples every `INTERVAL` for as long as the gateway's state lives.
pub fn start(state: &Arc<AppState>) {
    let weak: Weak<AppState> = Arc::downgrade(state);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(state) = weak.upgrade() else { return };
            sample(&state);
        }
    });
}

fn sample(state: &AppState) {
    let now = Instant::now();
    let totals = totals(state);
    let load = load(state);
    let mut h = state.overview.0.lock();
    if let Some((then, before)) = h.last {
        let secs = now.duration_since(then).as_secs_f64().max(1e-3);
        let rate = |a: f64, b: f64| ((a - b) / secs).max(0.0);
        let s = Sample {
            at: crate::tenancy::unix_now(),
            requests_per_s: rate(totals.requests, before.requests),
            errors_per_s: rate(totals.errors, before.errors),
            refused_per_s: rate(totals.refused, before.refused),
            tokens_per_s: rate(totals.tokens, before.tokens),
            running: load.0,
            waiting: load.1,
            kv_usage: load.2,
        };
        if h.samples.len() == KEPT {
            h.samples.pop_front();
        }
        h.samples.push_back(s);
    }
    h.last = Some((now, totals));
}

/// The sum of a counter family's series whose labels pass `keep`.
fn sum(c: &impl Collector, keep: impl Fn(&[prometheus::proto::LabelPair]) -> bool) -> f64 {
    c.collect()
        .iter()
        .flat_map(|f| f.get_metric())
        .filter(|m| keep(m.get_label()))
        .map(|m| m.get_counter().get_value())
        .sum()
}

fn totals(state: &AppState) -> Totals {
    let m = &state.metrics;
    let status = |labels: &[prometheus::proto::LabelPair], class: u8| {
        labels
            .iter()
            .any(|l| l.name() == "status" && l.value().as_bytes().first() == Some(&class))
    };
    // Probes and the admin API's own polling are not traffic.
    let api = |labels: &[prometheus::proto::LabelPair]| {
        labels.iter().any(|l| {
            l.name() == "route"
                && !matches!(
                    l.value(),
                    "health" | "ready" | "metrics" | "admin" | "other"
                )
        })
    };
    Totals {
        requests: sum(&m.http_requests, api),
        errors: sum(&m.http_requests, |l| api(l) && status(l, b'5')),
        refused: sum(&m.http_requests, |l| api(l) && status(l, b'4')),
        tokens: sum(&m.tenant_tokens, |l| {
            l.iter()
                .any(|p| p.name() == "kind" && p.value() == "completion")
        }),
    }
}

/// Running and waiting sequences (local and upstream) and the fullest local KV cache.
fn load(state: &AppState) -> (f64, f64, f64) {
    let v = &state.metrics.vllm;
    let (mut running, mut waiting, mut kv) = (0.0, 0.0, 0.0f64);
    for name in state.engines.keys() {
        running += v.running.with_label_values(&[name]).get() as f64;
        waiting += v.waiting.with_label_values(&[name]).get() as f64;
        kv = kv.max(v.kv_usage.with_label_values(&[name]).get());
    }
    for name in state.upstreams.names() {
        if let Some(pool) = state.upstreams.get(name) {
            for r in pool.replicas_view() {
                running += r["running"].as_f64().unwrap_or(0.0);
                waiting += r["waiting"].as_f64().unwrap_or(0.0);
            }
        }
    }
    (running, waiting, kv)
}

/// `GET /admin/overview`.
pub fn overview(state: &AppState) -> Response {
    let v = &state.metrics.vllm;
    let mut models: Vec<Value> = state
        .engines
        .keys()
        .map(|name| {
            json!({
                "id": name, "kind": "local",
                "running": v.running.with_label_values(&[name]).get(),
                "waiting": v.waiting.with_label_values(&[name]).get(),
                "kv_usage": v.kv_usage.with_label_values(&[name]).get(),
            })
        })
        .collect();
    for name in state.upstreams.names() {
        let replicas = state
            .upstreams
            .get(name)
            .map(|p| p.replicas_view())
            .unwrap_or_default();
        models.push(json!({"id": name, "kind": "upstream", "replicas": replicas}));
    }
    for name in state.embedders.keys() {
        models.push(json!({"id": name, "kind": "embedding"}));
    }
    let h = state.overview.0.lock();
    let col = |f: fn(&Sample) -> f64| h.samples.iter().map(f).collect::<Vec<f64>>();
    let series = json!({
        "interval_s": INTERVAL.as_secs(),
        "t": h.samples.iter().map(|s| s.at).collect::<Vec<_>>(),
        "requests_per_s": col(|s| s.requests_per_s),
        "errors_per_s": col(|s| s.errors_per_s),
        "refused_per_s": col(|s| s.refused_per_s),
        "tokens_per_s": col(|s| s.tokens_per_s),
        "running": col(|s| s.running),
        "waiting": col(|s| s.waiting),
        "kv_usage": col(|s| s.kv_usage),
    });
    let last = h.samples.back();
    let rate = |f: fn(&Sample) -> f64| last.map_or(0.0, f);
    let now = crate::tenancy::unix_now();
    json_response(
        StatusCode::OK,
        &json!({
            "now": now,
            "uptime_s": (now - state.started as i64).max(0),
            "models": models,
            "rates": {
                "requests_per_s": rate(|s| s.requests_per_s),
                "errors_per_s": rate(|s| s.errors_per_s),
                "refused_per_s": rate(|s| s.refused_per_s),
                "tokens_per_s": rate(|s| s.tokens_per_s),
            },
            "series": series,
        }),
    )
}
