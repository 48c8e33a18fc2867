//! Each pool's probe loop: every `probe_ms`, each replica's health path (a failed probe takes
//! it out until one succeeds; an ejected replica comes back only once its cool-down has
//! passed *and* it answers) and its `/metrics` (vLLM's gauges weigh its load).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::{read_capped, Pool, Replica};

pub(super) fn spawn(pool: &Arc<Pool>) {
    let weak = Arc::downgrade(pool);
    let every = Duration::from_millis(pool.cfg.probe_ms);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(pool) = Weak::upgrade(&weak) else {
                return;
            };
            all(&pool).await;
        }
    });
}

/// One round: the DNS entries re-resolved, then probes over every replica, concurrently.
pub(super) async fn all(pool: &Pool) {
    pool.discover().await;
    let replicas = pool.replicas.read().clone();
    let rounds = replicas.iter().map(|r| round(pool, r));
    futures_util::future::join_all(rounds).await;
}

async fn round(pool: &Pool, r: &Replica) {
    // Probes may take at most one interval, so a slow replica never piles them up.
    let limit = Duration::from_millis(pool.cfg.probe_ms.max(200));
    if !pool.cfg.health_path.is_empty() {
        let url = format!("{}{}", r.origin, pool.cfg.health_path);
        let ok = matches!(
            tokio::time::timeout(limit, pool.client.get(url).send()).await,
            Ok(Ok(resp)) if resp.status().is_success()
        );
        let was = r.healthy.swap(ok, Ordering::Relaxed);
        if was != ok {
            tracing::warn!(model = %pool.name, replica = %r.url, healthy = ok, "upstream replica health changed");
        }
        pool.metrics
            .upstream
            .up
            .with_label_values(&[&pool.name, &r.label])
            .set(ok as i64);
    }
    if pool.cfg.scrape_metrics {
        scrape(pool, r, limit).await;
    }
}

async fn scrape(pool: &Pool, r: &Replica, limit: Duration) {
    let url = format!("{}/metrics", r.origin);
    let text = match tokio::time::timeout(limit, pool.client.get(url).send()).await {
        Ok(Ok(resp)) if resp.status().is_success() => read_capped(resp, 4 << 20).await,
        _ => return,
    };
    let text = String::from_utf8_lossy(&text);
    // vLLM's names (which a gateway exports too), else llama.cpp server's (`--metrics`).
    let gauge = |names: &[&str]| {
        names
            .iter()
            .find_map(|name| gauge_sum(&text, name, &pool.model))
    };
    if let Some(w) = gauge(&["vllm:num_requests_waiting", "llamacpp:requests_deferred"]) {
        r.waiting.store(w as usize, Ordering::Relaxed);
    }
    if let Some(n) = gauge(&["vllm:num_requests_running", "llamacpp:requests_processing"]) {
        r.running.store(n as usize, Ordering::Relaxed);
    }
    // vLLM before 0.10 named it gpu_cache_usage_perc.
    if let Some(kv) = gauge(&["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]) {
        r.kv_milli.store((kv * 1000.0) as usize, Ordering::Relaxed);
    }
}

/// The sum of a gauge's series for `model` (its `model_name` label), or of all its series when
/// none carries that model (a server that labels it otherwise). None when it is absent.
pub(super) fn gauge_sum(text: &str, name: &str, model: &str) -> Option<f64> {
    let mut all = None::<f64>;
    let mut mine = None::<f64>;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (labels, value) = match rest.chars().next() {
            Some('{') => match rest.split_once('}') {
                Some((l, v)) => (&l[1..], v),
                None => continue,
            },
            Some(' ') => ("", rest),
            _ => continue,
        };
        let Some(v) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
        else {
            continue;
        };
        *all.get_or_insert(0.0) += v;
        if labels.contains(&format!("model_name=\"{model}\"")) {
            *mine.get_or_insert(0.0) += v;
        }
    }
    mine.or(all)
}

#[cfg(test)]
mod tests {
    use super::gauge_sum;

    #[test]
    fn gauges_are_read_per_model_or_summed() {
        let text = "# HELP vllm:num_requests_waiting x\n\
            vllm:num_requests_waiting{model_name=\"a\"} 3\n\
            vllm:num_requests_waiting{model_name=\"b\"} 4\n\
            vllm:num_requests_waiting_total 99\n\
            vllm:num_requests_running 2.0\n";
        assert_eq!(gauge_sum(text, "vllm:num_requests_waiting", "a"), Some(3.0));
        assert_eq!(gauge_sum(text, "vllm:num_requests_waiting", "c"), Some(7.0));
        assert_eq!(gauge_sum(text, "vllm:num_requests_running", "a"), Some(2.0));
        assert_eq!(gauge_sum(text, "vllm:kv_cache_usage_perc", "a"), None);
    }
}
