// The CRM field reranker of `plugins/crm-field-reranker`, in TypeScript: scores each
// candidate by how many of the query's terms it contains, then applies the tenant's metadata
// boosts and a recency decay. Same configuration, same ranking as the Rust plugin:
// - `boosts`: `field=value:factor` rules, a list or one comma-separated text, e.g.
//   `["tier=enterprise:1.5"]`; a list field (`tags = ["vip"]`) matches when one item does;
// - `recency_field`: a metadata field holding a date (`YYYY-MM-DD...`) or Unix seconds;
// - `recency_half_life_days`: a candidate this many days older than the newest one in the set
//   gets half the boost (default 30).

import { configGet } from "gateway:plugins/host@0.2.0";

// The reranker world's types as componentize-js presents them: records as objects with
// camelCase fields, `option` as `undefined`, and a `result` error as a thrown value whose
// `payload` is the error record.
export type Candidate = {
  id: string;
  documentId?: string;
  text: string;
  metadata: [string, Value][];
  score: number;
};

export type Scored = { id: string; score: number };

export type PluginError = { code: string; message: string };

/** An exception that reaches the gateway as `err(plugin-error)`. */
function pluginError(code: string, message: string): Error & { payload: PluginError } {
  return Object.assign(new Error(message), { payload: { code, message } });
}

const STOP_WORDS = new Set([
  "a", "an", "and", "are", "as", "at", "be", "by", "do", "does", "for", "from", "how", "i", "in",
  "is", "it", "my", "of", "on", "or", "the", "to", "what", "when", "where", "which", "why",
  "with",
]);

type Boost = { field: string; value: string; factor: number };

/** A value as text: numbers and booleans as their text, lists joined with commas. */
function asText(v: Value): string {
  return v.tag === "text-list" ? v.val.join(",") : String(v.val);
}

/** A number, or text that spells one. */
function asNumber(v: Value): number | undefined {
  if (v.tag === "number") return v.val;
  const t = v.tag === "text" ? v.val.trim() : "";
  return t !== "" && Number.isFinite(Number(t)) ? Number(t) : undefined;
}

function parseBoosts(spec: Value | undefined): Boost[] {
  const rules = spec === undefined ? [] : spec.tag === "text-list" ? spec.val : asText(spec).split(",");
  return rules
    .map((r) => r.trim())
    .filter((r) => r.length > 0)
    .map((rule) => {
      const eq = rule.indexOf("=");
      const colon = rule.lastIndexOf(":");
      const factor = Number(rule.slice(colon + 1).trim());
      if (eq < 0 || colon < eq || !Number.isFinite(factor) || rule.slice(colon + 1).trim() === "") {
        throw pluginError("invalid-config", `boost rule ${JSON.stringify(rule)} is not field=value:factor`);
      }
      return { field: rule.slice(0, eq).trim(), value: rule.slice(eq + 1, colon).trim(), factor };
    });
}

function fieldValue(c: Candidate, field: string): Value | undefined {
  return c.metadata.find(([k]) => k === field)?.[1];
}

/** Whether a metadata value is `wanted` (any case); a list matches when one of its items does. */
function matches(v: Value, wanted: string): boolean {
  const w = wanted.toLowerCase();
  return v.tag === "text-list" ? v.val.some((i) => i.toLowerCase() === w) : asText(v).toLowerCase() === w;
}

/** Days since the Unix epoch of a `YYYY-MM-DD` prefix or a Unix-seconds value. */
function days(value: Value): number | undefined {
  const secs = asNumber(value);
  if (secs !== undefined) return secs / 86_400;
  if (value.tag !== "text") return undefined;
  const m = /^(\d{4})-(\d{2})-(\d{2})/.exec(value.val);
  if (!m) return undefined;
  const [y, mo, d] = [Number(m[1]), Number(m[2]), Number(m[3])];
  if (mo < 1 || mo > 12 || d < 1 || d > 31) return undefined;
  return Date.UTC(y, mo - 1, d) / 86_400_000;
}

function normalize(word: string): string {
  const w = word.toLowerCase();
  // Plural folding is enough to match "invoices" with "invoice" in CRM records.
  const stem = w.endsWith("s") ? w.slice(0, -1) : "";
  return stem.length > 2 && !stem.endsWith("s") ? stem : w;
}

// Split at whitespace and ASCII punctuation: StarlingMonkey's regular expressions have no
// Unicode property classes, so non-ASCII punctuation stays inside words (where the Rust
// plugin splits).
function words(text: string): string[] {
  return text.split(/[\s!-\/:-@[-`{-~]+/).filter((w) => w.length > 0);
}

function terms(query: string): string[] {
  const out: string[] = [];
  for (const w of words(query)) {
    if (STOP_WORDS.has(w.toLowerCase())) continue;
    const t = normalize(w);
    if (!out.includes(t)) out.push(t);
  }
  return out;
}

export function rerank(query: string, candidates: Candidate[]): Scored[] {
  const boosts = parseBoosts(configGet("boosts"));
  const queryTerms = terms(query);
  if (queryTerms.length === 0) {
    throw pluginError("invalid-input", "the query has no searchable terms");
  }
  const field = configGet("recency_field");
  const recencyField = field === undefined ? undefined : asText(field);
  let halfLife = 30;
  const halfLifeSpec = configGet("recency_half_life_days");
  if (halfLifeSpec !== undefined) {
    halfLife = asNumber(halfLifeSpec) ?? NaN;
    if (!(halfLife > 0)) {
      throw pluginError("invalid-config", `recency_half_life_days ${JSON.stringify(asText(halfLifeSpec))} is not a positive number`);
    }
  }
  const ages = candidates.map((c) => {
    const v = recencyField === undefined ? undefined : fieldValue(c, recencyField);
    return v === undefined ? undefined : days(v);
  });
  const newest = Math.max(-Infinity, ...ages.filter((a): a is number => a !== undefined));
  return candidates.map((c, i) => {
    const have = new Set(words(c.text).map(normalize));
    const matched = queryTerms.filter((t) => have.has(t)).length;
    let score = matched / queryTerms.length;
    for (const b of boosts) {
      const v = fieldValue(c, b.field);
      if (v !== undefined && matches(v, b.value)) score *= b.factor;
    }
    const age = ages[i];
    if (recencyField !== undefined && age !== undefined) {
      score *= Math.pow(0.5, (newest - age) / halfLife);
    }
    return { id: c.id, score };
  });
}
