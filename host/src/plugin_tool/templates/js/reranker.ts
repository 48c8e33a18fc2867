// {{name}}: a reranker. Scores each candidate by the share of the query's words it contains,
// times a boost for candidates whose metadata field `tier` equals config `boost_tier`.

import { configGet } from "gateway:plugins/host@0.2.0";

// `metadata` keeps each field's type: `tier: "gold"` is a text value, `tags: ["a"]` a text list.
type Candidate = {
  id: string;
  documentId?: string;
  text: string;
  metadata: [string, Value][];
  score: number;
};
type Scored = { id: string; score: number };

function pluginError(code: string, message: string): Error & { payload: PluginError } {
  return Object.assign(new Error(message), { payload: { code, message } });
}

function words(text: string): string[] {
  return text.toLowerCase().split(/[^a-z0-9]+/).filter((w) => w.length > 0);
}

export function rerank(query: string, candidates: Candidate[]): Scored[] {
  const terms = words(query);
  if (terms.length === 0) {
    throw pluginError("invalid-input", "the query has no words");
  }
  const boostTier = configGet("boost_tier");
  return candidates.map((c) => {
    const have = new Set(words(c.text));
    let score = terms.filter((t) => have.has(t)).length / terms.length;
    const tier = c.metadata.find(([k]) => k === "tier")?.[1];
    if (boostTier?.tag === "text" && tier?.tag === "text" && tier.val === boostTier.val) score *= 1.5;
    return { id: c.id, score };
  });
}
