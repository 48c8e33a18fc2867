//! One call of each plugin kind, from a case's JSON arguments to its result as JSON.

use std::sync::Arc;

use anyhow::{anyhow, bail};
use serde_json::{json, Value};

use crate::plugins::vocab::VocabIndex;
use crate::plugins::{
    CacheRequest, Candidate, ChatRequest, ContextChunk, Decision, Message, Plugin, PluginKind,
    RenderedPrompt, Runtime, SequenceStart, TenantValues,
};

fn text(v: &Value, key: &str) -> anyhow::Result<String> {
    v[key]
        .as_str()
        .map(String::from)
        .ok_or_else(|| anyhow!("the input needs a string `{key}`"))
}

fn opt_text(v: &Value, key: &str) -> Option<String> {
    v[key].as_str().map(String::from)
}

fn list<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v[key].as_array().map_or(&[], Vec::as_slice)
}

fn fail(e: crate::plugins::CallError) -> anyhow::Error {
    anyhow!("the plugin {e}")
}

pub async fn call(
    p: &Arc<Plugin>,
    rt: &Arc<Runtime>,
    values: &TenantValues,
    input: &Value,
) -> anyhow::Result<Value> {
    match p.kind() {
        PluginKind::PromptTemplate => render(p, rt, values, input).await,
        PluginKind::Reranker => rerank(p, rt, values, input).await,
        PluginKind::OutputParser => {
            let schema = match &input["schema"] {
                Value::Null => None,
                Value::String(s) => Some(s.clone()),
                v => Some(v.to_string()),
            };
            let parsed = p
                .parse(rt, values, &text(input, "text")?, schema.as_deref())
                .await
                .map_err(fail)?;
            let json: Value = serde_json::from_str(&parsed.json)?;
            Ok(json!({"json": json, "repairs": parsed.repairs}))
        }
        PluginKind::LogitsProcessor => process(p, rt, values, input).await,
        PluginKind::CacheKey => cache_key(p, rt, values, input).await,
    }
}

fn messages(input: &Value) -> anyhow::Result<Vec<Message>> {
    list(input, "messages")
        .iter()
        .map(|m| {
            Ok(Message {
                role: text(m, "role")?,
                content: text(m, "content")?,
                name: opt_text(m, "name"),
            })
        })
        .collect()
}

/// A cache-key plugin's key for the case's request: `parameters` may be a JSON object (made
/// canonical, as the gateway sends it) or the JSON text itself.
async fn cache_key(
    p: &Arc<Plugin>,
    rt: &Arc<Runtime>,
    values: &TenantValues,
    input: &Value,
) -> anyhow::Result<Value> {
    let parameters = match &input["parameters"] {
        Value::Null => "{}".to_string(),
        Value::String(s) => s.clone(),
        v => crate::plugins::canonical_json(v),
    };
    let request = CacheRequest {
        model: opt_text(input, "model").unwrap_or_else(|| "local".into()),
        endpoint: opt_text(input, "endpoint").unwrap_or_else(|| "chat".into()),
        messages: messages(input)?,
        parameters,
    };
    let key = p.cache_key(rt, values, &request).await.map_err(fail)?;
    Ok(json!({ "key": key }))
}

async fn render(
    p: &Arc<Plugin>,
    rt: &Arc<Runtime>,
    values: &TenantValues,
    input: &Value,
) -> anyhow::Result<Value> {
    let request = ChatRequest {
        model: opt_text(input, "model").unwrap_or_else(|| "local".into()),
        messages: messages(input)?,
        context: list(input, "context")
            .iter()
            .map(|c| {
                Ok(ContextChunk {
                    id: text(c, "id")?,
                    text: text(c, "text")?,
                    title: opt_text(c, "title"),
                })
            })
            .collect::<anyhow::Result<_>>()?,
    };
    Ok(match p.render(rt, values, &request).await.map_err(fail)? {
        RenderedPrompt::Prompt(t) => json!({"prompt": t}),
        RenderedPrompt::Messages(ms) => json!({"messages": ms
            .iter()
            .map(|m| match &m.name {
                Some(name) => json!({"role": m.role, "content": m.content, "name": name}),
                None => json!({"role": m.role, "content": m.content}),
            })
            .collect::<Vec<_>>()}),
    })
}

async fn rerank(
    p: &Arc<Plugin>,
    rt: &Arc<Runtime>,
    values: &TenantValues,
    input: &Value,
) -> anyhow::Result<Value> {
    let candidates: Vec<Candidate> = list(input, "candidates")
        .iter()
        .map(|c| {
            let metadata = c["metadata"]
                .as_object()
                .map(|m| crate::plugins::metadata(m.iter()))
                .unwrap_or_default();
            Ok(Candidate {
                id: text(c, "id")?,
                document_id: opt_text(c, "document_id"),
                text: text(c, "text")?,
                metadata,
                score: c["score"].as_f64().unwrap_or(0.0) as f32,
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let query = text(input, "query")?;
    let mut scored = p
        .rerank(rt, values, &query, &candidates)
        .await
        .map_err(fail)?;
    scored.sort_by(|a, b| b.score.total_cmp(&a.score));
    Ok(
        json!({"results": scored.iter().map(|s| json!({"id": s.id, "score": s.score})).collect::<Vec<_>>()}),
    )
}

fn decision(d: &Decision) -> Value {
    json!({"banned": d.banned, "biases": d.biases, "stop": d.stop})
}

/// A logits processor over the case's own small `vocabulary`: started on `prompt`, then
/// stepped once per id in `tokens` (each with that token's text), as the engine would.
async fn process(
    p: &Arc<Plugin>,
    rt: &Arc<Runtime>,
    values: &TenantValues,
    input: &Value,
) -> anyhow::Result<Value> {
    let vocab: Vec<String> = list(input, "vocabulary")
        .iter()
        .map(|t| t.as_str().map(String::from))
        .collect::<Option<_>>()
        .ok_or_else(|| anyhow!("`vocabulary` must be a list of token texts"))?;
    if vocab.is_empty() {
        bail!("a logits processor's input needs a `vocabulary` (token texts; ids are positions)");
    }
    let tokens: Vec<u32> = list(input, "tokens")
        .iter()
        .map(|t| {
            t.as_u64()
                .filter(|&t| (t as usize) < vocab.len())
                .map(|t| t as u32)
        })
        .collect::<Option<_>>()
        .ok_or_else(|| anyhow!("`tokens` must be ids within the vocabulary"))?;
    let vocab = Arc::new(VocabIndex::new(vocab));
    let start = SequenceStart {
        model: opt_text(input, "model").unwrap_or_else(|| "local".into()),
        prompt: opt_text(input, "prompt").unwrap_or_default(),
        max_tokens: input["max_tokens"].as_u64().unwrap_or(256) as u32,
    };
    let (mut processor, first) = p
        .start_processor(rt, values, vocab.clone(), start)
        .await
        .map_err(fail)?;
    // Steps block on the runtime from outside it, as the engine's threads do.
    let steps = tokio::task::spawn_blocking(move || {
        tokens
            .iter()
            .map(|&t| processor.step(&[t], &vocab.text(t)).map(|d| decision(&d)))
            .collect::<Result<Vec<_>, _>>()
    })
    .await?
    .map_err(fail)?;
    Ok(json!({"start": decision(&first), "steps": steps}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_name_what_is_missing() {
        let v = json!({"query": 3});
        assert!(text(&v, "query")
            .unwrap_err()
            .to_string()
            .contains("`query`"));
        assert_eq!(list(&v, "candidates").len(), 0);
        assert_eq!(
            opt_text(&json!({"name": "a"}), "name").as_deref(),
            Some("a")
        );
    }
}
