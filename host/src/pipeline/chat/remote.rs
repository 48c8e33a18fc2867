//! The chat pipeline's upstream target: the request made ready for a pool of replicas (the
//! client's body with the grounded or templated messages), and what an upstream cannot serve.

use std::sync::Arc;

use serde_json::Value;

use super::super::upstream::{self, Prepared};
use super::super::{grounding, Error, PluginCalls, Stages};
use super::{check_window, settle_refused, ChatRequest, Plan};
use crate::plugins::ContextChunk;
use crate::tenancy::Caller;
use crate::upstream::Pool;

impl ChatRequest {
    pub(super) async fn prepare_upstream(
        &self,
        stages: &Stages,
        caller: &Caller,
        plan: &Plan,
        pool: &Arc<Pool>,
    ) -> Result<Prepared, Error> {
        self.upstream_checks(caller, pool)?;
        let n = self.gen.n as u64;
        let completion = self
            .gen
            .max_tokens
            .map_or(pool.cfg.default_max_tokens, |m| m as u64);
        let messages = self.raw_messages();
        let estimate = upstream::estimate(&json_text(&messages));
        let total = estimate + n * completion;
        let mut reservation = self.reserve(stages, caller, &pool.name, 0, total).await?;
        let specials: Vec<String> = grounding::CONTROL_TOKENS
            .iter()
            .map(|s| s.to_string())
            .collect();
        let staged = async {
            let grounding = self
                .ground(stages, caller, plan.rag.as_ref(), &specials)
                .await?;
            let messages = match &caller.tenant.policy.prompt_template {
                Some(name) => {
                    let plugin =
                        self.templated(&stages.plugins, caller, pool, name, grounding.context);
                    plugin.await?
                }
                None => grounding::ground_values(messages, &grounding.context),
            };
            let text = json_text(&messages);
            let exact = upstream::estimate(&text);
            let more = exact.saturating_sub(estimate);
            stages
                .tenancy
                .reserve_more(caller, &mut reservation, more)
                .await
                .map_err(Error::Denied)?;
            reservation.set_prompt_tokens(exact);
            Ok::<_, Error>((messages, text, grounding.citations))
        };
        let (messages, text, citations) = match staged.await {
            Ok(done) => done,
            Err(e) => return Err(settle_refused(e, reservation)),
        };
        let replaced = [
            ("messages", Some(Value::Array(messages))),
            ("rag", None),
            ("documents", None),
        ];
        let stream = self.gen.stream;
        Ok(Prepared {
            body: upstream::body(self.body.clone(), pool, stream, replaced),
            stream,
            client_usage: self.gen.include_usage,
            chain: crate::upstream::prefix_chain(&caller.tenant.name, &text),
            output: plan.output.clone(),
            citations,
            reservation,
            debug: caller.debug.clone(),
            responses: self.responses.clone(),
        })
    }

    /// What an upstream model cannot serve: a logits processor (it runs in the decode loop,
    /// which is remote), or `max_tokens` beyond the replicas' configured window.
    fn upstream_checks(&self, caller: &Caller, pool: &Pool) -> Result<(), Error> {
        let tenant = &caller.tenant;
        if let Some(p) = &tenant.policy.logits_processor {
            return Err(upstream::remote_decode(&tenant.name, p, &pool.name));
        }
        match pool.cfg.max_model_len {
            Some(window) => check_window(window, 1, self.gen.max_tokens),
            None => Ok(()),
        }
    }

    /// The tenant's prompt-template plugin over the conversation, for an upstream, which takes
    /// messages: a plugin that renders a finished prompt cannot serve it.
    async fn templated(
        &self,
        calls: &PluginCalls,
        caller: &Caller,
        pool: &Pool,
        name: &str,
        context: Vec<ContextChunk>,
    ) -> Result<Vec<Value>, Error> {
        let messages = self.messages.clone();
        let rendered = calls
            .render(caller, name, &pool.name, messages, context)
            .await?;
        match rendered {
            crate::plugins::RenderedPrompt::Messages(ms) => Ok(ms
                .into_iter()
                .map(|m| {
                    let mut v = serde_json::json!({"role": m.role, "content": m.content});
                    if let Some(n) = m.name {
                        v["name"] = Value::String(n);
                    }
                    v
                })
                .collect()),
            crate::plugins::RenderedPrompt::Prompt(_) => Err(Error::invalid(
                "model",
                format!(
                    "The prompt_template plugin `{name}` renders a finished prompt, but model `{}` \
                     is served upstream, which takes messages: have the plugin return messages.",
                    pool.name
                ),
            )),
        }
    }

    /// The messages as the client sent them (content parts, tool calls and all), for an
    /// upstream that reads them itself.
    fn raw_messages(&self) -> Vec<Value> {
        match self.body.get("messages") {
            Some(Value::Array(m)) => m.clone(),
            _ => Vec::new(),
        }
    }
}

/// Messages as the JSON text sent upstream (for the estimate and prefix affinity).
fn json_text(messages: &[Value]) -> String {
    serde_json::to_string(messages).expect("JSON values serialize")
}
