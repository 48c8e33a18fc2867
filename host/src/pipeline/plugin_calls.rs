//! Calls into a tenant's plugins: which plugin is bound, and each call run on the blocking pool
//! (a guest computes up to its deadline, which must not stall the runtime's I/O threads), timed,
//! counted and its failure typed.

use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};

use super::{Error, PluginFailure};
use crate::engine::chat_template::ChatMessage;
use crate::metrics::Metrics;
use crate::plugins::{
    CacheRequest, CallError, Candidate, ChatRequest, ContextChunk, Message, Plugin, PluginKind,
    Registry, RenderedPrompt,
};
use crate::tenancy::{Caller, Tenant};

/// What a plugin stage needs: the installed plugins and the metrics their calls update.
#[derive(Clone)]
pub struct PluginCalls {
    pub registry: Arc<Registry>,
    pub metrics: Arc<Metrics>,
}

impl PluginCalls {
    /// The tenant's plugin bound to `kind` under `name`.
    pub fn bound(
        &self,
        tenant: &Tenant,
        name: &str,
        kind: PluginKind,
    ) -> Result<Arc<Plugin>, Error> {
        if !tenant.allows_plugin(name) {
            return Err(Error::Forbidden {
                param: "model",
                message: format!("Tenant `{}` may not use plugin `{name}`.", tenant.name),
            });
        }
        let missing = |message| Error::PluginMissing {
            tenant: tenant.name.to_string(),
            message,
        };
        let plugin = self.registry.get(&tenant.name, name).ok_or_else(|| {
            let why = match self.registry.rejection(&tenant.name, name) {
                Some(reason) => format!(" (its file was rejected: {reason})"),
                None => String::new(),
            };
            missing(format!("the {kind} plugin `{name}` is not installed{why}"))
        })?;
        if plugin.kind() != kind {
            return Err(missing(format!(
                "plugin `{name}` is a {}, not a {kind}",
                plugin.kind()
            )));
        }
        Ok(plugin)
    }

    /// Runs the call `f` makes against `plugin` on the blocking pool, with metrics and the
    /// caller's debugging report on failure.
    pub async fn call<T, F, Fut>(
        &self,
        caller: &Caller,
        plugin: Arc<Plugin>,
        f: F,
    ) -> Result<T, Error>
    where
        T: Send + 'static,
        F: FnOnce(Arc<Plugin>, Arc<crate::plugins::Runtime>, crate::plugins::TenantValues) -> Fut
            + Send
            + 'static,
        Fut: std::future::Future<Output = Result<T, CallError>> + Send + 'static,
    {
        let tenant = &caller.tenant;
        let call = f(
            plugin.clone(),
            self.registry.runtime().clone(),
            tenant.values.clone(),
        );
        let runtime = tokio::runtime::Handle::current();
        let sink = caller.debug.clone();
        let (result, elapsed) = super::blocking("plugin", move || {
            let start = Instant::now();
            let r = crate::plugins::capturing_logs(sink.as_ref(), || runtime.block_on(call));
            (r, start.elapsed())
        })
        .await?;
        caller.plugin_us.fetch_add(
            elapsed.as_micros() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        let m = &self.metrics;
        m.plugin_calls
            .with_label_values(&[&tenant.name, &plugin.name])
            .inc();
        m.plugin_seconds
            .with_label_values(&[plugin.kind().as_str()])
            .observe(elapsed.as_secs_f64());
        let cause = result.as_ref().err().map(CallError::cause);
        plugin.stats.record(elapsed, cause);
        result.map_err(|cause| {
            m.plugin_failures
                .with_label_values(&[&tenant.name, &plugin.name, cause.cause()])
                .inc();
            Error::Plugin(Box::new(PluginFailure {
                tenant: tenant.name.to_string(),
                plugin: plugin.name.to_string(),
                cause,
                debug: caller.debug.as_ref().map(|s| debug_report(s, None)),
            }))
        })
    }

    /// Scores `candidates` (whose ids are their indices) with the reranker `plugin`: (index,
    /// score) pairs, best first, equal scores in input order, at most `top`. The one rerank
    /// of the gateway: search, RAG and `/v1/rerank` all come here.
    pub async fn rerank(
        &self,
        caller: &Caller,
        plugin: Arc<Plugin>,
        query: String,
        candidates: Vec<Candidate>,
        top: usize,
    ) -> Result<Vec<(usize, f32)>, Error> {
        let scored = self
            .call(caller, plugin, move |p, rt, values| async move {
                p.rerank(&rt, &values, &query, &candidates).await
            })
            .await?;
        // The plugin layer checked that every id is a candidate's, once.
        let mut order: Vec<(usize, f32)> = scored
            .into_iter()
            .filter_map(|s| Some((s.id.parse::<usize>().ok()?, s.score)))
            .collect();
        order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        order.truncate(top);
        Ok(order)
    }

    /// The tenant's prompt-template plugin `name` over the conversation (and context chunks)
    /// for `model`: the final prompt text, or rewritten messages.
    pub async fn render(
        &self,
        caller: &Caller,
        name: &str,
        model: &str,
        messages: Vec<ChatMessage>,
        context: Vec<ContextChunk>,
    ) -> Result<RenderedPrompt, Error> {
        let plugin = self.bound(&caller.tenant, name, PluginKind::PromptTemplate)?;
        let request = ChatRequest {
            model: model.to_string(),
            messages: messages
                .into_iter()
                .map(|m| Message {
                    role: m.role.as_str().to_string(),
                    content: m.content,
                    name: m.name,
                })
                .collect(),
            context,
        };
        self.call(caller, plugin, move |p, rt, v| async move {
            p.render(&rt, &v, &request).await
        })
        .await
    }

    /// The tenant's cache-key plugin `name` over `request`: the text the response cache keys
    /// the request on, or `None` when the plugin says not to cache it.
    pub async fn cache_key(
        &self,
        caller: &Caller,
        name: &str,
        request: CacheRequest,
    ) -> Result<Option<String>, Error> {
        let plugin = self.bound(&caller.tenant, name, PluginKind::CacheKey)?;
        self.call(caller, plugin, move |p, rt, v| async move {
            p.cache_key(&rt, &v, &request).await
        })
        .await
    }
}

/// The `gateway_debug` report for a caller that asked for one: the log lines the request's
/// plugins wrote so far and, when given, each choice's text before the output parser.
pub fn debug_report(sink: &crate::common::LogSink, raw: Option<Vec<Value>>) -> Value {
    let logs = sink.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut report = json!({"plugin_logs": logs});
    if let Some(raw) = raw {
        report["raw_text"] = Value::Array(raw);
    }
    report
}
