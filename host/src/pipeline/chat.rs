//! The chat pipeline, one for every model. The body is parsed once into a typed request
//! (`ChatRequest::parse`), then, in this order:
//! 1. every check the body decides: fields, roles, tools, `response_format`, sampling (`parse`);
//! 2. every check the tenant's policy decides: retrieval settings and the collection, the
//!    bound plugins (`plan`);
//! 3. every check the target decides: the model's window against `max_tokens` and the
//!    messages' own length, the output grammar, what the target cannot run (`Local::check`,
//!    `upstream_checks`);
//! 4. the token reservation, on an estimate of the prompt;
//! 5. retrieval, the prompt stage (template plugin or chat template), the exact prompt
//!    (the final window check, and the reservation grown to the exact need), the logits
//!    processors; then the target: the local engine or an upstream replica set.
//!
//! Nothing that costs the tenant (search tokens, plugin time, a reservation) runs before the
//! checks a request can fail for reasons its body alone shows. Local and upstream models
//! differ only in step 3 and the target: an upstream runs no logits processor (the decode
//! loop is remote), takes messages (a template plugin must return messages) and strips a
//! generic list of control tokens from retrieved text (its tokenizer is not ours).

use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Map, Value};

use super::cache::Keyed;
use super::constraint;
use super::generation::{self, encode, Generation, MAX_TOP_LOGPROBS};
use super::grounding;
use super::openai::{
    ChatCompletionRequest, ChatMessageIn, Document, MessageContent, RagField, ResponseFormat,
};
use super::output::{self, OutputStage};
use super::prompt::PromptStage;
use super::responses::Finisher;
use super::upstream::{self, Sent};
use super::{Error, Stages};
use crate::common::Endpoint;
use crate::engine::chat_template::{ChatMessage, Role};
use crate::engine::{Engine, EventStream};
use crate::plugins::{ContextChunk, PluginKind};
use crate::search::request::{RagSettings, RerankChoice};
use crate::structured::tools::{self, ToolSet};
use crate::structured::Format;
use crate::tenancy::{Caller, Outcome, Reservation};
use crate::upstream::Pool;

/// Where a request is generated.
pub enum Target {
    Local(Arc<Engine>),
    Upstream(Arc<Pool>),
}

/// A chat request, parsed and checked against everything its body decides.
pub struct ChatRequest {
    pub model: String,
    messages: Vec<ChatMessage>,
    tools: Option<ToolSet>,
    format: Option<(Format, &'static str)>,
    response_format: Option<ResponseFormat>,
    gen: Generation,
    rag: Option<RagField>,
    documents: Vec<Document>,
    /// The body as sent, for an upstream: fields the gateway does not read pass through.
    body: Map<String, Value>,
    /// What the ledger records the request as (a Responses request runs as a chat).
    pub endpoint: Endpoint,
    /// A Responses request: what shapes (and stores) the answer.
    pub responses: Option<Arc<Finisher>>,
    /// A Responses request: its body as sent, which the answer echoes, for the cache's key.
    pub origin: Option<Map<String, Value>>,
}

/// What the tenant's policy adds to a request: its retrieval and its output parser.
pub struct Plan {
    rag: Option<RagSettings>,
    output: Option<OutputStage>,
}

/// A local generation under way: what the edge needs to answer from its streams.
pub struct LocalRun {
    pub engine: Arc<Engine>,
    pub responses: Option<Arc<Finisher>>,
    pub streams: Vec<EventStream>,
    pub gen: Generation,
    pub output: Option<OutputStage>,
    pub tools: Option<Arc<ToolSet>>,
    pub citations: Option<Vec<Value>>,
    pub reservation: Reservation,
}

pub enum Served {
    /// Boxed: a local run is large, and the upstream outcome small.
    Local(Box<LocalRun>),
    Upstream {
        pool: Arc<Pool>,
        sent: Sent,
    },
}

/// The parts of the prompt that do not depend on the template: client passages and retrieved
/// chunks, with their citations.
struct Grounding {
    context: Vec<ContextChunk>,
    citations: Option<Vec<Value>>,
}

impl ChatRequest {
    pub fn parse(body: &[u8]) -> Result<Self, Error> {
        Self::from_value(serde_json::from_slice(body)?)
    }

    /// A chat request from its parsed body.
    pub fn from_value(value: Value) -> Result<Self, Error> {
        let req = ChatCompletionRequest::deserialize(&value)?;
        let body = super::into_object(value)?;
        if req.messages.is_empty() {
            return Err(Error::invalid(
                "messages",
                "`messages` must contain at least one message.",
            ));
        }
        let tools = constraint::toolset(req.tools, req.tool_choice, req.parallel_tool_calls)?;
        let messages = req
            .messages
            .into_iter()
            .map(message)
            .collect::<Result<Vec<_>, _>>()?;
        constraint::check_history(&messages, tools.as_ref())?;
        let format = constraint::format(req.response_format.as_ref(), req.guided)?;
        let logprobs = chat_logprobs(req.logprobs, req.top_logprobs)?;
        // `max_completion_tokens` replaced `max_tokens` in OpenAI's API: it wins when both are
        // sent, for every target.
        let max_tokens = req.max_completion_tokens.or(req.max_tokens);
        let gen = generation::generation(req.sampling, max_tokens, logprobs)?;
        Ok(Self {
            model: req.model,
            messages,
            tools,
            format,
            response_format: req.response_format,
            gen,
            rag: req.rag,
            documents: req.documents.unwrap_or_default(),
            body,
            endpoint: Endpoint::Chat,
            responses: None,
            origin: None,
        })
    }

    /// The tenant's retrieval and output parser, checked: the collection exists and may be
    /// read, the bound plugins are installed and of their kind.
    pub fn plan(&self, stages: &Stages, caller: &Caller) -> Result<Plan, Error> {
        let rag = grounding::settings(self.rag.clone(), caller)?;
        if let Some(r) = &rag {
            stages.retrieval.open(caller, &r.collection)?;
        }
        // With tools the answer may be calls, which are not the parser's JSON.
        let output = match self.tools {
            Some(_) => None,
            None => output::stage(&stages.plugins, caller, self.response_format.as_ref())?,
        };
        let policy = &caller.tenant.policy;
        if let Some(name) = &policy.prompt_template {
            stages
                .plugins
                .bound(&caller.tenant, name, PluginKind::PromptTemplate)?;
        }
        if let Some(name) = &policy.logits_processor {
            stages
                .plugins
                .bound(&caller.tenant, name, PluginKind::LogitsProcessor)?;
        }
        Ok(Plan { rag, output })
    }

    /// The request as the response cache keys it, with the retrieval `plan` adds.
    pub fn keyed(&self, plan: &Plan) -> Keyed {
        let mut k = Keyed::new(self.endpoint, &self.model, &self.body);
        // Whole: a Response echoes every field it was sent (`user`, `metadata`, ...).
        if let Some(origin) = &self.origin {
            k.canonical
                .insert("responses".into(), Value::Object(origin.clone()));
        }
        k.messages = self
            .messages
            .iter()
            .map(|m| (m.role.as_str().to_string(), m.content.clone()))
            .collect();
        k.collection = plan.rag.as_ref().map(|r| r.collection.clone());
        if let Some(RerankChoice::Plugin(name)) = plan
            .rag
            .as_ref()
            .and_then(|r| r.search(String::new()).rerank)
        {
            k.plugins.push(name);
        }
        k.retrieval = format!("{:?}", plan.rag);
        k
    }

    /// Runs the request on `target`. For an upstream, `may_fall_back` gives the reservation
    /// back when no replica answers, so that the next model of the chain can take it.
    pub async fn serve(
        &self,
        stages: &Stages,
        caller: &Caller,
        plan: &Plan,
        target: &Target,
        may_fall_back: bool,
    ) -> Result<Served, Error> {
        match target {
            Target::Local(engine) => self.local(stages, caller, plan, engine).await,
            Target::Upstream(pool) => {
                let prepared = self.prepare_upstream(stages, caller, plan, pool).await?;
                let path = "/chat/completions";
                let sent = upstream::send(&stages.metrics, pool, prepared, path, may_fall_back);
                Ok(Served::Upstream {
                    pool: pool.clone(),
                    sent: sent.await,
                })
            }
        }
    }

    async fn local(
        &self,
        stages: &Stages,
        caller: &Caller,
        plan: &Plan,
        engine: &Arc<Engine>,
    ) -> Result<Served, Error> {
        let model = engine.info.name.as_str();
        let floor = prompt_floor(engine, &self.messages).await?;
        let window = engine.info.max_model_len;
        check_window(window, floor, self.gen.max_tokens)?;
        let mut gen = self.gen.clone();
        gen.cache_salt = caller.tenant.cache_salt;
        gen.weight = caller.tenant.policy.weight;
        gen.constraint =
            constraint::constraint(engine, self.format.clone(), self.tools.as_ref()).await?;
        let completion = gen.max_tokens.unwrap_or(window.saturating_sub(floor));
        let estimate = (floor + gen.n * completion) as u64;
        // Nothing is counted against the prompt until the engine has it: a request refused
        // before then is charged no prompt tokens.
        let reservation = self.reserve(stages, caller, model, 0, estimate).await?;
        let run = LocalRun {
            engine: engine.clone(),
            responses: self.responses.clone(),
            streams: Vec::new(),
            gen,
            output: plan.output.clone(),
            tools: self.tools.clone().map(Arc::new),
            citations: None,
            reservation,
        };
        let run = self
            .local_stages(stages, caller, plan.rag.as_ref(), run)
            .await;
        fail_settled(run).map(|r| Served::Local(Box::new(r)))
    }

    /// The local stages after the reservation: grounding, the prompt, the exact check,
    /// processors, submission.
    async fn local_stages(
        &self,
        stages: &Stages,
        caller: &Caller,
        rag: Option<&RagSettings>,
        mut run: LocalRun,
    ) -> Result<LocalRun, (Error, Reservation)> {
        let engine = run.engine.clone();
        let model = engine.info.name.as_str();
        let specials = engine_specials(&engine);
        let staged = async {
            let grounding = self.ground(stages, caller, rag, &specials).await?;
            run.citations = grounding.citations;
            let stage = PromptStage {
                engine: &engine,
                model,
                tools: self.tools.as_ref(),
                plugins: &stages.plugins,
            };
            let text = stage
                .run(caller, self.messages.clone(), grounding.context)
                .await?;
            // The template already wrote any BOS it wants.
            let prompt = encode(&engine, vec![text], false, "messages")
                .await?
                .remove(0);
            let mut reqs = run.gen.requests(&engine, prompt, "messages")?;
            let exact = reqs[0].prompt.len() as u64;
            let need = exact + reqs.iter().map(|r| r.max_tokens as u64).sum::<u64>();
            let more = need.saturating_sub(run.reservation.reserved());
            stages
                .tenancy
                .reserve_more(caller, &mut run.reservation, more)
                .await
                .map_err(Error::Denied)?;
            stages
                .processors
                .attach(caller, model, &engine, &mut reqs)
                .await?;
            let streams = reqs
                .into_iter()
                .map(|r| engine.submit(r).map_err(Error::from))
                .collect::<Result<Vec<_>, _>>()?;
            run.reservation.set_prompt_tokens(exact);
            Ok(streams)
        };
        match staged.await {
            Ok(streams) => {
                run.streams = streams;
                Ok(run)
            }
            Err(e) => Err((e, run.reservation)),
        }
    }

    async fn reserve(
        &self,
        stages: &Stages,
        caller: &Caller,
        model: &str,
        prompt: u64,
        total: u64,
    ) -> Result<Reservation, Error> {
        stages
            .tenancy
            .reserve_tokens(caller, model, self.endpoint, prompt, total)
            .await
            .map_err(Error::Denied)
    }

    /// Client passages and, when the plan retrieves, the chunks found, numbered after them;
    /// the target's control tokens stripped from both.
    async fn ground(
        &self,
        stages: &Stages,
        caller: &Caller,
        rag: Option<&RagSettings>,
        specials: &[String],
    ) -> Result<Grounding, Error> {
        let mut context = grounding::documents(&self.documents, specials);
        let mut citations = None;
        if let Some(r) = rag {
            let first = context.len() + 1;
            let (chunks, cites) = stages
                .retrieval
                .retrieve(caller, r, &self.messages, specials, first)
                .await?;
            context.extend(chunks);
            citations = Some(cites);
        }
        Ok(Grounding { context, citations })
    }
}

/// Settles the reservation of a request that failed after it was taken and before the target
/// had it (a reservation dropped unsettled is a cancellation).
fn fail_settled<T>(r: Result<T, (Error, Reservation)>) -> Result<T, Error> {
    r.map_err(|(e, reservation)| settle_refused(e, reservation))
}

/// A limit that refused the exact prompt gives the estimate back with no ledger row, as a
/// refusal at admission does; any other failure is the request's, recorded as failed. Either
/// way no prompt tokens are charged: the target never had the prompt.
fn settle_refused(e: Error, reservation: Reservation) -> Error {
    match e {
        Error::Denied(_) => reservation.release(),
        _ => reservation.end(Outcome::Failed),
    }
    e
}

/// The fewest tokens the prompt can have: the messages' own text, tokenized (a template and
/// grounding only add to it).
async fn prompt_floor(engine: &Arc<Engine>, messages: &[ChatMessage]) -> Result<usize, Error> {
    let texts: Vec<String> = messages.iter().map(|m| m.content.clone()).collect();
    let ids = encode(engine, texts, false, "messages").await?;
    Ok(ids.iter().map(Vec::len).sum())
}

/// The prompt's lower bound and `max_tokens` against the window, with OpenAI's message.
fn check_window(window: usize, floor: usize, max_tokens: Option<usize>) -> Result<(), Error> {
    let over = match max_tokens {
        Some(m) => floor.saturating_add(m) > window,
        None => floor >= window,
    };
    if !over {
        return Ok(());
    }
    let message = match max_tokens {
        Some(m) => format!(
            "This model's maximum context length is {window} tokens. However, you requested at \
             least {} tokens ({floor} in the messages, {m} for the completion). Please reduce the \
             messages or `max_tokens`.",
            floor.saturating_add(m)
        ),
        None => format!(
            "This model's maximum context length is {window} tokens, and the messages have at \
             least {floor}. Please shorten them."
        ),
    };
    Err(Error::invalid("messages", message))
}

/// Every added token of the model, special or not: each is matched as one control token when
/// the prompt is encoded (`<|im_end|>`, but also `<tool_call>` or `</think>` in other models).
fn engine_specials(engine: &Engine) -> Vec<String> {
    engine
        .tokenizer
        .get_added_tokens_decoder()
        .into_values()
        .map(|t| t.content)
        .collect()
}

/// Chat's `logprobs` + `top_logprobs` as the engine takes them: None, or the count of
/// alternatives per token.
fn chat_logprobs(logprobs: bool, top: Option<usize>) -> Result<Option<usize>, Error> {
    match (logprobs, top) {
        (false, Some(_)) => Err(Error::invalid(
            "top_logprobs",
            "`top_logprobs` requires `logprobs` to be true.",
        )),
        (true, Some(k)) if k > MAX_TOP_LOGPROBS => Err(Error::invalid(
            "top_logprobs",
            format!("`top_logprobs` must be at most {MAX_TOP_LOGPROBS}."),
        )),
        (true, k) => Ok(Some(k.unwrap_or(0))),
        (false, None) => Ok(None),
    }
}

fn message(m: ChatMessageIn) -> Result<ChatMessage, Error> {
    let role = Role::parse(&m.role).ok_or_else(|| {
        Error::invalid(
            "messages",
            format!(
                "Unknown message role {:?}; use system, developer, user, assistant or tool.",
                m.role
            ),
        )
    })?;
    let content = match m.content {
        None => String::new(),
        Some(MessageContent::Text(t)) => t,
        Some(MessageContent::Parts(parts)) => {
            let mut s = String::new();
            for p in parts {
                match (p.kind.as_str(), p.text) {
                    ("text", Some(t)) => s.push_str(&t),
                    (kind, _) => {
                        return Err(Error::invalid(
                            "messages",
                            format!("Content parts of type {kind:?} are not supported; send text."),
                        ))
                    }
                }
            }
            s
        }
    };
    let tool_calls = m
        .tool_calls
        .unwrap_or_default()
        .into_iter()
        .map(|c| tools::history_call(c.id, c.function.name, &c.function.arguments))
        .collect();
    Ok(ChatMessage {
        role,
        content,
        name: m.name,
        tool_calls,
        tool_call_id: m.tool_call_id,
    })
}

mod remote;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_counts_the_messages_and_the_completion() {
        assert!(check_window(100, 10, Some(90)).is_ok());
        assert!(check_window(100, 10, Some(91)).is_err());
        assert!(check_window(100, 99, None).is_ok());
        assert!(check_window(100, 100, None).is_err());
        let Err(Error::Invalid { param, message }) = check_window(8, 1, Some(usize::MAX)) else {
            panic!("accepted");
        };
        assert_eq!(param, "messages");
        assert!(message.contains("maximum context length is 8"), "{message}");
    }

    #[test]
    fn the_body_is_checked_before_any_stage() {
        let cases = [
            (r#"{"model": "m", "messages": []}"#, "messages"),
            (
                r#"{"model": "m", "messages": [{"role": "robot", "content": "x"}]}"#,
                "messages",
            ),
            (
                r#"{"model": "m", "messages": [{"role": "user", "content": "x"}],
                   "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}"#,
                "response_format",
            ),
            (
                r#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}"#,
                "top_logprobs",
            ),
        ];
        for (body, param) in cases {
            match ChatRequest::parse(body.as_bytes()) {
                Err(Error::Invalid { param: p, .. }) => assert_eq!(p, param, "{body}"),
                Err(e) => panic!("{body}: {e}"),
                Ok(_) => panic!("{body}: accepted"),
            }
        }
        assert!(matches!(
            ChatRequest::parse(b"[\"m\", []]"),
            Err(Error::Json(_))
        ));
    }

    #[test]
    fn a_responses_request_is_a_chat_request() {
        let body = serde_json::json!({"model": "m", "instructions": "Be brief.", "input": [
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}]});
        let t = super::super::responses::translate(&body, Vec::new()).unwrap();
        let req = ChatRequest::from_value(t.chat).unwrap();
        let roles: Vec<Role> = req.messages.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            [Role::System, Role::User, Role::Assistant, Role::Tool]
        );
    }

    #[test]
    fn max_completion_tokens_wins_over_max_tokens() {
        let body = r#"{"model": "m", "messages": [{"role": "developer", "content": "x"}],
                       "max_tokens": 50, "max_completion_tokens": 7}"#;
        let req = ChatRequest::parse(body.as_bytes()).unwrap();
        assert_eq!(req.gen.max_tokens, Some(7));
        assert_eq!(req.messages[0].role, Role::System);
    }
}
