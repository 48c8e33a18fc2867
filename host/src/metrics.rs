//! One Prometheus registry for the whole gateway.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

mod cache;
pub use cache::CacheMetrics;

pub struct Metrics {
    registry: Registry,
    pub queue_depth: IntGaugeVec,
    pub running_seqs: IntGaugeVec,
    pub kv_blocks_used: IntGaugeVec,
    pub kv_blocks_total: IntGaugeVec,
    pub kv_utilisation: prometheus::GaugeVec,
    pub batch_seqs: HistogramVec,
    pub batch_tokens: HistogramVec,
    pub ttft: HistogramVec,
    pub inter_token: HistogramVec,
    pub prompt_tokens: IntCounterVec,
    pub generation_tokens: IntCounterVec,
    pub prefix_cache_hit_tokens: IntCounterVec,
    pub preemptions: IntCounterVec,
    pub spec_draft_tokens: IntCounterVec,
    pub spec_accepted_tokens: IntCounterVec,
    pub requests: IntCounterVec,
    pub http_requests: IntCounterVec,
    pub http_latency: Histogram,
    pub plugin_calls: IntCounterVec,
    pub plugin_failures: IntCounterVec,
    pub plugin_seconds: HistogramVec,
    pub search_seconds: HistogramVec,
    pub indexed_chunks: IntCounterVec,
    pub tenant_requests: IntCounterVec,
    pub tenant_tokens: IntCounterVec,
    pub tenant_rejections: IntCounterVec,
    pub edge: EdgeMetrics,
    pub ledger: LedgerMetrics,
    pub grammar: GrammarMetrics,
    pub vllm: VllmMetrics,
    pub upstream: UpstreamMetrics,
    pub shared: SharedMetrics,
    pub cache: CacheMetrics,
}

/// The gauges Kubernetes inference routers (the Gateway API Inference Extension's endpoint
/// picker) and KEDA examples read from a model server, under vLLM's names and meanings, so a
/// gateway replica can sit in an InferencePool unchanged.
pub struct VllmMetrics {
    /// Requests submitted and not yet running (vLLM: in the scheduler's waiting queue).
    pub waiting: IntGaugeVec,
    pub running: IntGaugeVec,
    /// Share of KV-cache blocks in use, 0 to 1.
    pub kv_usage: prometheus::GaugeVec,
    /// Always 1; the labels carry the cache layout.
    pub cache_config: IntGaugeVec,
}

impl VllmMetrics {
    fn new(r: &Registry) -> Self {
        let name = &["model_name"];
        let gauge =
            |n: &str, h: &str| reg(r, IntGaugeVec::new(Opts::new(n, h), name).expect("valid"));
        Self {
            waiting: gauge(
                "vllm:num_requests_waiting",
                "Requests waiting to be scheduled",
            ),
            running: gauge("vllm:num_requests_running", "Requests in the running batch"),
            kv_usage: reg(
                r,
                prometheus::GaugeVec::new(
                    Opts::new("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full"),
                    name,
                )
                .expect("valid"),
            ),
            cache_config: reg(
                r,
                IntGaugeVec::new(
                    Opts::new("vllm:cache_config_info", "KV-cache configuration (labels)"),
                    &["model_name", "block_size", "num_gpu_blocks"],
                )
                .expect("valid"),
            ),
        }
    }
}

/// State shared with other replicas: limits in Redis, plugins and policies in PostgreSQL.
pub struct SharedMetrics {
    /// Redis calls that failed or timed out, by operation.
    pub redis_errors: IntCounterVec,
    /// Admissions and reservations made on this process's own limits because Redis did not
    /// answer (failure mode `open`).
    pub local_fallbacks: prometheus::IntCounter,
    /// PostgreSQL calls of the plugin and policy replication that failed, by operation.
    pub postgres_errors: IntCounterVec,
    /// Plugin and policy changes made through another replica and applied here, by kind.
    pub changes_applied: IntCounterVec,
}

impl SharedMetrics {
    fn new(r: &Registry) -> Self {
        Self {
            redis_errors: reg(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "gateway_redis_errors_total",
                        "Redis calls that failed or timed out",
                    ),
                    &["op"],
                )
                .expect("valid"),
            ),
            local_fallbacks: reg(
                r,
                prometheus::IntCounter::new(
                    "gateway_shared_limits_local_total",
                    "Requests limited on this process's own counters because Redis did not answer",
                )
                .expect("valid"),
            ),
            postgres_errors: reg(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "gateway_postgres_errors_total",
                        "PostgreSQL calls of the plugin and policy replication that failed",
                    ),
                    &["op"],
                )
                .expect("valid"),
            ),
            changes_applied: reg(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "gateway_cluster_changes_applied_total",
                        "Plugin and policy changes read from PostgreSQL and applied here",
                    ),
                    &["kind"],
                )
                .expect("valid"),
            ),
        }
    }
}

/// Models served by upstream replicas: what each replica was asked and answered, and how the
/// pool chose and judged it.
pub struct UpstreamMetrics {
    /// By status code, or `connect` / `timeout`.
    pub requests: IntCounterVec,
    /// Choices, `by` load or prefix affinity.
    pub picks: IntCounterVec,
    pub ejections: IntCounterVec,
    pub retries: IntCounterVec,
    /// Requests a model sent down its fallback chain, by the model that served them.
    pub fallbacks: IntCounterVec,
    pub outstanding: IntGaugeVec,
    /// The last health probe answered (1) or not (0).
    pub up: IntGaugeVec,
}

impl UpstreamMetrics {
    fn new(r: &Registry) -> Self {
        let counter = |n: &str, h: &str, l: &[&str]| {
            reg(r, IntCounterVec::new(Opts::new(n, h), l).expect("valid"))
        };
        let gauge = |n: &str, h: &str| {
            reg(
                r,
                IntGaugeVec::new(Opts::new(n, h), &["model", "replica"]).expect("valid"),
            )
        };
        Self {
            requests: counter(
                "gateway_upstream_requests_total",
                "Requests sent to upstream replicas, by status code (or connect, timeout)",
                &["model", "replica", "code"],
            ),
            picks: counter(
                "gateway_upstream_picks_total",
                "Replica choices, by what decided (load or prefix)",
                &["model", "replica", "by"],
            ),
            ejections: counter(
                "gateway_upstream_ejections_total",
                "Replicas taken out after a failure",
                &["model", "replica"],
            ),
            retries: counter(
                "gateway_upstream_retries_total",
                "Requests tried again on another replica",
                &["model"],
            ),
            fallbacks: counter(
                "gateway_upstream_fallbacks_total",
                "Requests served by a fallback model",
                &["model", "served_by"],
            ),
            outstanding: gauge(
                "gateway_upstream_outstanding",
                "Requests in flight on each replica",
            ),
            up: gauge(
                "gateway_upstream_up",
                "The replica's last health probe succeeded",
            ),
        }
    }
}

/// Constrained decoding: grammar compiles (and cache hits) and the per-step token masks.
pub struct GrammarMetrics {
    pub compile_seconds: HistogramVec,
    pub cache: IntCounterVec,
    pub mask_seconds: HistogramVec,
    pub forced_tokens: IntCounterVec,
    pub processor_seconds: HistogramVec,
}

impl GrammarMetrics {
    fn new(r: &Registry) -> Self {
        let hist = |n: &str, h: &str, b: Vec<f64>| {
            let opts = HistogramOpts::new(n, h).buckets(b);
            reg(r, HistogramVec::new(opts, &["model"]).expect("valid"))
        };
        let counter = |n: &str, h: &str, l: &[&str]| {
            reg(r, IntCounterVec::new(Opts::new(n, h), l).expect("valid"))
        };
        Self {
            compile_seconds: hist(
                "gateway_grammar_compile_seconds",
                "Time to compile a response_format / tool grammar (cache misses only)",
                vec![1e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.5, 2.0],
            ),
            cache: counter(
                "gateway_grammar_cache_total",
                "Grammar lookups by result (hit, miss)",
                &["model", "result"],
            ),
            mask_seconds: hist(
                "gateway_grammar_mask_seconds",
                "Time to compute one sequence's token mask for one step (overlapped with the forward pass)",
                vec![1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.05],
            ),
            forced_tokens: counter(
                "gateway_grammar_forced_tokens_total",
                "Tokens the grammar forced, appended without a sampling step",
                &["model"],
            ),
            processor_seconds: hist(
                "gateway_logits_processor_step_seconds",
                "One logits-processor plugin call for one sequence and step (overlapped with the forward pass)",
                vec![5e-6, 1e-5, 1.5e-5, 2e-5, 3e-5, 4e-5, 5e-5, 7.5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 0.02, 0.1],
            ),
        }
    }
}

/// The usage ledger's writer, read when `/metrics` is scraped.
pub struct LedgerMetrics {
    failing: prometheus::IntGauge,
    pending: prometheus::IntGauge,
    spilled: prometheus::IntGauge,
    failures: prometheus::IntCounter,
}

impl LedgerMetrics {
    fn new(r: &Registry) -> Self {
        let gauge = |n: &str, h: &str| reg(r, prometheus::IntGauge::new(n, h).expect("valid"));
        Self {
            failing: gauge(
                "gateway_ledger_failing",
                "1 while neither the usage ledger nor its spill file takes writes",
            ),
            pending: gauge(
                "gateway_ledger_pending_rows",
                "Usage rows held in memory, not yet on disk",
            ),
            spilled: gauge(
                "gateway_ledger_spilled_rows",
                "Usage rows in the spill file, waiting to be replayed into the ledger",
            ),
            failures: reg(
                r,
                prometheus::IntCounter::new(
                    "gateway_ledger_write_failures_total",
                    "Batches the usage ledger refused to write",
                )
                .expect("valid"),
            ),
        }
    }

    /// The writer's state: failing, rows pending in memory and in the spill file, and the
    /// count of failed writes so far.
    pub fn observe(&self, failing: bool, pending: usize, spilled: usize, failures: u64) {
        self.failing.set(failing as i64);
        self.pending.set(pending as i64);
        self.spilled.set(spilled as i64);
        let seen = self.failures.get();
        self.failures.inc_by(failures.saturating_sub(seen));
    }
}

/// The HTTP edge: connections open, refused and closed by a deadline.
pub struct EdgeMetrics {
    pub open_connections: prometheus::IntGauge,
    pub refused: IntCounterVec,
    pub closed: IntCounterVec,
    pub accept_errors: prometheus::IntCounter,
}

impl EdgeMetrics {
    fn new(r: &Registry) -> Self {
        let counter = |n: &str, h: &str, l: &[&str]| {
            reg(r, IntCounterVec::new(Opts::new(n, h), l).expect("valid"))
        };
        Self {
            open_connections: reg(
                r,
                prometheus::IntGauge::new(
                    "gateway_open_connections",
                    "Client connections open, all listeners",
                )
                .expect("valid"),
            ),
            refused: counter(
                "gateway_connections_refused_total",
                "Connections turned away by a cap (max_connections, max_connections_per_client)",
                &["reason"],
            ),
            closed: counter(
                "gateway_connections_closed_total",
                "Connections closed by a deadline (header_timeout, idle_timeout, tls_handshake_timeout)",
                &["reason"],
            ),
            accept_errors: reg(
                r,
                prometheus::IntCounter::new(
                    "gateway_accept_errors_total",
                    "Failed accepts (out of file descriptors, mostly)",
                )
                .expect("valid"),
            ),
        }
    }

    pub fn closed(&self, reason: &str) {
        self.closed.with_label_values(&[reason]).inc();
    }
}

fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, m: T) -> T {
    r.register(Box::new(m.clone()))
        .expect("metric names are unique");
    m
}

impl Metrics {
    // Long, but a table rather than logic: one declaration (name, help, labels) per metric.
    // Long by design: one registration per series, in the order of the struct's fields, so a
    // new metric is one entry here; there is no logic in it to split out.
    pub fn new() -> Self {
        let r = Registry::new();
        let model = &["model"];
        let gauge =
            |n: &str, h: &str| reg(&r, IntGaugeVec::new(Opts::new(n, h), model).expect("valid"));
        let counter = |n: &str, h: &str, l: &[&str]| {
            reg(&r, IntCounterVec::new(Opts::new(n, h), l).expect("valid"))
        };
        let hist = |n: &str, h: &str, b: Vec<f64>| {
            reg(
                &r,
                HistogramVec::new(HistogramOpts::new(n, h).buckets(b), model).expect("valid"),
            )
        };
        let secs = vec![
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        ];
        let sizes = vec![
            1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
        ];
        Self {
            queue_depth: gauge("gateway_queue_depth", "Requests waiting for admission"),
            running_seqs: gauge(
                "gateway_running_sequences",
                "Sequences in the running batch",
            ),
            kv_blocks_used: gauge(
                "gateway_kv_blocks_used",
                "KV cache blocks referenced by sequences",
            ),
            kv_blocks_total: gauge("gateway_kv_blocks_total", "KV cache blocks in the pool"),
            kv_utilisation: reg(
                &r,
                prometheus::GaugeVec::new(
                    Opts::new(
                        "gateway_kv_utilisation",
                        "Tokens stored / capacity of allocated blocks",
                    ),
                    model,
                )
                .expect("valid"),
            ),
            batch_seqs: hist(
                "gateway_batch_sequences",
                "Sequences per engine step",
                sizes.clone(),
            ),
            batch_tokens: hist("gateway_batch_tokens", "Tokens per engine step", sizes),
            ttft: hist(
                "gateway_time_to_first_token_seconds",
                "Arrival to first generated token",
                secs.clone(),
            ),
            inter_token: hist(
                "gateway_inter_token_latency_seconds",
                "Time between generated tokens",
                vec![
                    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 1.0,
                ],
            ),
            prompt_tokens: counter(
                "gateway_prompt_tokens_total",
                "Prompt tokens processed",
                model,
            ),
            generation_tokens: counter(
                "gateway_generation_tokens_total",
                "Tokens generated",
                model,
            ),
            prefix_cache_hit_tokens: counter(
                "gateway_prefix_cache_hit_tokens_total",
                "Prompt tokens served from the prefix cache",
                model,
            ),
            preemptions: counter(
                "gateway_preemptions_total",
                "Sequences preempted for KV blocks",
                model,
            ),
            spec_draft_tokens: counter(
                "gateway_spec_draft_tokens_total",
                "Prompt-lookup draft tokens verified",
                model,
            ),
            spec_accepted_tokens: counter(
                "gateway_spec_accepted_tokens_total",
                "Draft tokens accepted (each saves one decode step)",
                model,
            ),
            requests: counter(
                "gateway_requests_total",
                "Finished generations by reason",
                &["model", "finish_reason"],
            ),
            http_requests: counter(
                "gateway_http_requests_total",
                "HTTP responses by route and status",
                &["route", "status"],
            ),
            http_latency: reg(
                &r,
                Histogram::with_opts(
                    HistogramOpts::new("gateway_http_request_seconds", "Time to response head")
                        .buckets(secs),
                )
                .expect("valid"),
            ),
            plugin_calls: counter(
                "gateway_plugin_calls_total",
                "Plugin calls by tenant and plugin",
                &["tenant", "plugin"],
            ),
            plugin_failures: counter(
                "plugin_failures_total",
                "Failed plugin calls by cause (trap, panic, timeout, memory, invalid_output, rejected, busy)",
                &["tenant", "plugin", "cause"],
            ),
            plugin_seconds: reg(
                &r,
                HistogramVec::new(
                    HistogramOpts::new("gateway_plugin_call_seconds", "Plugin call time, instantiation included")
                        .buckets(vec![1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 0.02, 0.05, 0.1]),
                    &["kind"],
                )
                .expect("valid"),
            ),
            search_seconds: reg(
                &r,
                HistogramVec::new(
                    HistogramOpts::new("gateway_search_seconds", "Collection search time (query embedding, both indexes, fusion), reranking excluded")
                        .buckets(vec![1e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.5]),
                    &["mode"],
                )
                .expect("valid"),
            ),
            indexed_chunks: counter(
                "gateway_indexed_chunks_total",
                "Chunks embedded and indexed into collections, by tenant",
                &["tenant"],
            ),
            tenant_requests: counter(
                "gateway_tenant_requests_total",
                "Admitted requests by tenant and outcome (ok, error, cancelled)",
                &["tenant", "status"],
            ),
            tenant_tokens: counter(
                "gateway_tenant_tokens_total",
                "Tokens settled to tenants (prompt, completion)",
                &["tenant", "kind"],
            ),
            tenant_rejections: counter(
                "gateway_tenant_rejections_total",
                "Requests turned away by a tenant limit, by limit",
                &["tenant", "reason"],
            ),
            edge: EdgeMetrics::new(&r),
            ledger: LedgerMetrics::new(&r),
            grammar: GrammarMetrics::new(&r),
            vllm: VllmMetrics::new(&r),
            upstream: UpstreamMetrics::new(&r),
            shared: SharedMetrics::new(&r),
            cache: CacheMetrics::new(&r),
            registry: r,
        }
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is utf-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
