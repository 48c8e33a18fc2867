//! Constrained decoding against plain decoding, same prompts, same run: output tok/s at
//! single stream and at concurrency 8, the mask cost per step, and grammar compile time for a
//! 20-property CRM schema, cold and from the cache.

use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};

use super::{median, prompt, request, run_batch, BenchOptions};
use crate::engine::constraint::Constraint;
use crate::engine::Engine;
use crate::metrics::Metrics;
use crate::structured::Format;

/// A CRM contact with 20 typed properties (enums, bounds, formats, nesting), as an extraction
/// request would send it. `nonce` makes each schema distinct, so each compile is cold.
fn crm_schema(nonce: usize) -> Value {
    json!({
        "type": "object",
        "description": format!("CRM contact, variant {nonce}"),
        "properties": {
            "first_name": {"type": "string", "maxLength": 40},
            "last_name": {"type": "string", "maxLength": 40},
            "email": {"type": "string", "format": "email"},
            "phone": {"type": "string", "pattern": "^\\+?[0-9 ()-]{6,20}$"},
            "company": {"type": "string"},
            "title": {"type": "string"},
            "stage": {"enum": ["lead", "qualified", "proposal", "won", "lost"]},
            "score": {"type": "integer", "minimum": 0, "maximum": 100},
            "annual_revenue": {"type": "number", "minimum": 0},
            "employees": {"type": "integer", "minimum": 1},
            "country": {"type": "string", "minLength": 2, "maxLength": 2},
            "city": {"type": "string"},
            "website": {"type": "string", "format": "uri"},
            "opted_in": {"type": "boolean"},
            "last_contacted": {"type": "string", "format": "date"},
            "owner_id": {"type": "string", "pattern": "^usr_[a-z0-9]{8}$"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "source": {"enum": ["web", "referral", "event", "outbound"]},
            "notes": {"type": ["string", "null"]},
            "address": {
                "type": "object",
                "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["street", "zip"],
                "additionalProperties": false,
            },
        },
        "required": ["first_name", "last_name", "email", "company", "stage", "score"],
        "additionalProperties": false,
    })
}

/// Records enough that no generation in the bench completes the grammar: every run decodes
/// the same number of tokens as its unconstrained twin.
fn long_output_schema() -> Value {
    json!({
        "type": "object",
        "properties": {"contacts": {"type": "array", "minItems": 100, "items": crm_schema(0)}},
        "required": ["contacts"],
        "additionalProperties": false,
    })
}

fn compile(engine: &Engine, schema: Value) -> anyhow::Result<Constraint> {
    let grammar = Format::JsonSchema(schema).grammar();
    engine
        .grammars
        .compile(&grammar)
        .map_err(|e| anyhow::anyhow!("bench schema: {e}"))
}

pub(super) async fn rows(
    engine: &Arc<Engine>,
    metrics: &Arc<Metrics>,
    name: &str,
    o: &BenchOptions,
) -> anyhow::Result<()> {
    let (mut cold, mut hot) = (Vec::new(), Vec::new());
    for i in 0..o.repeat.max(3) {
        let t = Instant::now();
        compile(engine, crm_schema(1000 + i))?;
        cold.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        compile(engine, crm_schema(1000 + i))?;
        hot.push(t.elapsed().as_secs_f64() * 1e3);
    }
    println!(
        "| grammar compile, 20-property CRM schema: cold / cached | {:.2} / {:.3} ms |",
        median(cold),
        median(hot)
    );
    let constraint = compile(engine, long_output_schema())?;
    let instruction = engine.encode(
        "<|im_start|>user\nList the contacts from this week's CRM notes as JSON.<|im_end|>\n<|im_start|>assistant\n",
        false,
    )?;
    for c in [1, 8] {
        for forcing in [true, false] {
            let row = Variant {
                engine,
                metrics,
                name,
                o,
                constraint: &constraint,
                instruction: &instruction,
            };
            row.run(c, forcing).await?;
        }
    }
    Ok(())
}

/// One row: plain against constrained decoding at one concurrency.
struct Variant<'a> {
    engine: &'a Arc<Engine>,
    metrics: &'a Arc<Metrics>,
    name: &'a str,
    o: &'a BenchOptions,
    constraint: &'a Constraint,
    instruction: &'a [u32],
}

impl Variant<'_> {
    /// Without `forcing`, both sides ask for logprobs, which turns off forced tokens (every
    /// token is sampled): what is left of the difference is the mask's cost.
    async fn run(&self, c: usize, forcing: bool) -> anyhow::Result<()> {
        let (engine, name, g) = (self.engine, self.name, &self.metrics.grammar);
        let mut rates = [Vec::new(), Vec::new()];
        let forced0 = g.forced_tokens.with_label_values(&[name]).get();
        let mask = g.mask_seconds.with_label_values(&[name]);
        let (sum0, n0) = (mask.get_sample_sum(), mask.get_sample_count());
        for rep in 0..self.o.repeat {
            for (k, constrained) in [false, true].into_iter().enumerate() {
                let reqs = (0..c)
                    .map(|i| {
                        // Distinct prompts, so no sequence rides on another's prefix.
                        let mut p = prompt(engine, 8, 7000 + 100 * rep + i);
                        p.extend(self.instruction);
                        let mut r = request(p, self.o.gen_tokens);
                        r.constraint = constrained.then(|| self.constraint.clone());
                        r.sampling.logprobs = (!forcing).then_some(0);
                        r
                    })
                    .collect();
                let b = run_batch(engine, self.metrics, name, reqs).await?;
                rates[k].push(b.tokens as f64 / b.wall);
            }
        }
        let forced = g.forced_tokens.with_label_values(&[name]).get() - forced0;
        let steps = mask.get_sample_count() - n0;
        let mean_us = (mask.get_sample_sum() - sum0) / steps.max(1) as f64 * 1e6;
        let [plain, json] = rates.map(median);
        let how = match forcing {
            true => "forced tokens on",
            false => "every token sampled",
        };
        println!(
            "| json_schema output, concurrency {c}, {how}: plain / constrained | {plain:.1} / {json:.1} tok/s ({:.2}x); mask {mean_us:.0} µs per sequence-step over {steps} steps, {forced} tokens forced |",
            json / plain
        );
        Ok(())
    }
}
