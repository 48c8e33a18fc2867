//! The request fields of structured output and tool calling, checked and turned into the
//! engine's constraint: `response_format`, vLLM's `structured_outputs` / `guided_*`, `tools`,
//! `tool_choice`, and the tool turns of the history.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use serde_json::Value;

use super::openai::{GuidedFields, ResponseFormat, ToolIn};
use super::Error;
use crate::engine::chat_template::{ChatMessage, Role};
use crate::engine::constraint::{Constraint, GrammarError};
use crate::engine::Engine;
use crate::structured::tools::{Tool, ToolChoice, ToolSet};
use crate::structured::Format;

/// Tools per request: each one's schema is compiled into the call grammar.
const MAX_TOOLS: usize = 128;

/// The one output constraint a request asks for, and the parameter that asked.
pub fn format(
    response_format: Option<&ResponseFormat>,
    guided: GuidedFields,
) -> Result<Option<(Format, &'static str)>, Error> {
    let mut found: Vec<(Format, &'static str)> = Vec::new();
    match response_format {
        Some(ResponseFormat::JsonObject) => found.push((Format::JsonObject, "response_format")),
        Some(ResponseFormat::JsonSchema { json_schema }) => match &json_schema.schema {
            Some(s) => found.push((
                Format::JsonSchema(strict(s.clone(), json_schema.strict)),
                "response_format",
            )),
            None => return Err(schema_required()),
        },
        Some(ResponseFormat::Text) | None => {}
    }
    if let Some(s) = guided.guided_json {
        found.push((
            Format::JsonSchema(schema_value(s, "guided_json")?),
            "guided_json",
        ));
    }
    found.extend(
        guided
            .guided_regex
            .map(|r| (Format::Regex(r), "guided_regex")),
    );
    found.extend(
        guided
            .guided_choice
            .map(|c| (Format::Choice(c), "guided_choice")),
    );
    found.extend(
        guided
            .guided_grammar
            .map(|g| (Format::Grammar(g), "guided_grammar")),
    );
    if let Some(so) = guided.structured_outputs {
        let p = "structured_outputs";
        if let Some(s) = so.json {
            found.push((Format::JsonSchema(schema_value(s, p)?), p));
        }
        found.extend(so.regex.map(|r| (Format::Regex(r), p)));
        found.extend(so.choice.map(|c| (Format::Choice(c), p)));
        found.extend(so.grammar.map(|g| (Format::Grammar(g), p)));
        if so.json_object == Some(true) {
            found.push((Format::JsonObject, p));
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(_, p)| *p).collect();
        return Err(Error::invalid(
            found[1].1,
            format!("Only one structured-output constraint per request; got {names:?}."),
        ));
    }
    if let Some((Format::Choice(c), p)) = found.first() {
        if c.is_empty() {
            return Err(Error::invalid(p, "The list of choices must not be empty."));
        }
    }
    Ok(found.pop())
}

/// A tool's or response format's schema as decoded: strict (no properties beyond those
/// listed, `structured::strict_schema`) unless the request says `strict: false`.
fn strict(schema: Value, asked: Option<bool>) -> Value {
    match asked {
        Some(false) => schema,
        _ => crate::structured::strict_schema(schema),
    }
}

/// A `json_schema` response format without its schema.
pub fn schema_required() -> Error {
    Error::invalid(
        "response_format",
        "`response_format.json_schema.schema` is required for type json_schema.",
    )
}

/// vLLM takes a schema as an object or as its JSON text.
fn schema_value(v: Value, param: &'static str) -> Result<Value, Error> {
    match v {
        Value::String(s) => serde_json::from_str(&s)
            .map_err(|e| Error::invalid(param, format!("`{param}` is not valid JSON: {e}"))),
        v => Ok(v),
    }
}

/// Compiles (or finds in the cache) a grammar on the blocking pool: a cold compile of a large
/// schema takes milliseconds.
pub async fn compile(
    engine: &Arc<Engine>,
    grammar: TopLevelGrammar,
    param: &'static str,
) -> Result<Constraint, Error> {
    compiled(engine, grammar)
        .await?
        .map_err(|e| Error::invalid(param, format!("`{param}` is not supported: {}", e.0)))
}

async fn compiled(
    engine: &Arc<Engine>,
    grammar: TopLevelGrammar,
) -> Result<Result<Constraint, GrammarError>, Error> {
    let grammars = engine.grammars.clone();
    crate::pipeline::blocking("grammar", move || grammars.compile(&grammar)).await
}

/// `tools`, `tool_choice` and `parallel_tool_calls` checked; `None` when the request has no
/// tools or turns them off.
pub fn toolset(
    tools: Option<Vec<ToolIn>>,
    choice: Option<Value>,
    parallel: Option<bool>,
) -> Result<Option<ToolSet>, Error> {
    let tools = tools.unwrap_or_default();
    if tools.len() > MAX_TOOLS {
        return Err(Error::invalid(
            "tools",
            format!("At most {MAX_TOOLS} tools per request."),
        ));
    }
    let tools = tools
        .into_iter()
        .enumerate()
        .map(|(i, t)| tool(i, t))
        .collect::<Result<Vec<_>, _>>()?;
    let choice = tool_choice(choice, &tools)?;
    if tools.is_empty() || choice == ToolChoice::None {
        return Ok(None);
    }
    Ok(Some(ToolSet {
        tools,
        choice,
        parallel: parallel.unwrap_or(true),
    }))
}

fn tool(i: usize, t: ToolIn) -> Result<Tool, Error> {
    let at = |field: &str| format!("tools[{i}]{field}");
    if t.kind != "function" {
        return Err(Error::invalid_at(
            at(".type"),
            format!("Tool type {:?} is not supported; use \"function\".", t.kind),
        ));
    }
    let f = t
        .function
        .ok_or_else(|| Error::invalid_at(at(".function"), "A function tool needs `function`."))?;
    let name = f.name.unwrap_or_default();
    let valid = (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if !valid {
        return Err(Error::invalid_at(
            at(".function.name"),
            format!("Function name {name:?} must be 1-64 letters, digits, underscores or dashes."),
        ));
    }
    let parameters = f
        .parameters
        .unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}}));
    if !parameters.is_object() {
        return Err(Error::invalid_at(
            at(".function.parameters"),
            "`parameters` must be a JSON schema object.",
        ));
    }
    Ok(Tool {
        name,
        description: f.description,
        parameters,
        strict: f.strict != Some(false),
    })
}

fn tool_choice(choice: Option<Value>, tools: &[Tool]) -> Result<ToolChoice, Error> {
    let p = "tool_choice";
    let choice = match choice {
        None if tools.is_empty() => ToolChoice::None,
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(Error::invalid(
                    p,
                    format!("`tool_choice` {other:?} is not one of none, auto, required."),
                ))
            }
        },
        Some(v) => match v["function"]["name"].as_str() {
            Some(name) if v["type"] == "function" => ToolChoice::Named(name.to_string()),
            _ => {
                return Err(Error::invalid(
                    p,
                    "`tool_choice` must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                ))
            }
        },
    };
    match &choice {
        ToolChoice::Required | ToolChoice::Named(_) if tools.is_empty() => Err(Error::invalid(
            p,
            "`tool_choice` needs `tools`: there is no function to call.",
        )),
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => Err(Error::invalid(
            p,
            format!("`tool_choice` names {n:?}, which is not in `tools`."),
        )),
        _ => Ok(choice),
    }
}

/// The call grammar, compiled: always, so a bad schema is a 400 whatever the choice; attached
/// only when the choice constrains. On failure each tool is compiled alone to name the one.
async fn tool_constraint(
    engine: &Arc<Engine>,
    tools: &ToolSet,
) -> Result<Option<Constraint>, Error> {
    let grammar = tools.grammar();
    match compile(engine, grammar, "tools").await {
        Ok(c) => Ok(tools.constrains().then_some(c)),
        Err(e) => {
            for (i, t) in tools.tools.iter().enumerate() {
                if let Err(one) = compiled(engine, ToolSet::tool_grammar(t)).await? {
                    return Err(Error::invalid_at(
                        format!("tools[{i}].function.parameters"),
                        format!("The schema of {:?} is not supported: {}", t.name, one.0),
                    ));
                }
            }
            Err(e)
        }
    }
}

/// The grammar the choices follow: the calls' when the tool choice forces a call, else the
/// response format's, if any.
pub async fn constraint(
    engine: &Arc<Engine>,
    format: Option<(Format, &'static str)>,
    tools: Option<&ToolSet>,
) -> Result<Option<Constraint>, Error> {
    if let Some(t) = tools {
        if let Some(c) = tool_constraint(engine, t).await? {
            return Ok(Some(c));
        }
    }
    match format {
        Some((f, param)) => Ok(Some(compile(engine, f.grammar(), param).await?)),
        None => Ok(None),
    }
}

/// Tool turns must fit together: each `tool` message answers a call made earlier, and calls
/// name functions the request offers (when it offers any).
pub fn check_history(messages: &[ChatMessage], tools: Option<&ToolSet>) -> Result<(), Error> {
    let mut calls: Vec<&str> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        for (j, c) in m.tool_calls.iter().enumerate() {
            if m.role != Role::Assistant {
                return Err(Error::invalid_at(
                    format!("messages[{i}].tool_calls"),
                    "Only assistant messages carry `tool_calls`.",
                ));
            }
            if tools.is_some_and(|t| !t.tools.iter().any(|f| f.name == c.function.name)) {
                return Err(Error::invalid_at(
                    format!("messages[{i}].tool_calls[{j}].function.name"),
                    format!(
                        "The call names {:?}, which is not in `tools`.",
                        c.function.name
                    ),
                ));
            }
            calls.push(&c.id);
        }
        if m.role == Role::Tool {
            let at = format!("messages[{i}].tool_call_id");
            match m.tool_call_id.as_deref() {
                None => {
                    return Err(Error::invalid_at(
                        at,
                        "A tool message needs `tool_call_id`.",
                    ))
                }
                Some(id) if !calls.contains(&id) => {
                    return Err(Error::invalid_at(
                        at,
                        format!("No earlier assistant tool call has id {id:?}."),
                    ))
                }
                Some(_) => {}
            }
        }
    }
    Ok(())
}
