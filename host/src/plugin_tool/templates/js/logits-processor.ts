// {{name}}: a logits processor. The model never writes a token containing one of the words in
// config `deny` (a list, or one comma-separated text; any case). One instance serves one
// sequence, so the banned list is computed once, at its start, and kept in the module.

import { configGet } from "gateway:plugins/host@0.2.0";
import { tokensContaining } from "gateway:plugins/vocabulary@0.2.0";

type SequenceStart = { model: string; prompt: string; maxTokens: number };
type Decision = { banned: number[]; biases: [number, number][]; stop: boolean };

let banned: number[] = [];

export function start(_request: SequenceStart): Decision {
  const deny = configGet("deny");
  const list = deny === undefined ? [] : deny.tag === "text-list" ? deny.val : String(deny.val).split(",");
  const words = list.map((w) => w.trim()).filter((w) => w);
  banned = [...new Set(words.flatMap((w) => Array.from(tokensContaining(w, true))))].sort((a, b) => a - b);
  return { banned, biases: [], stop: false };
}

export function step(_tokens: Uint32Array, _text: string): Decision {
  return { banned, biases: [], stop: false };
}
