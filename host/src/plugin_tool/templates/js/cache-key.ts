// {{name}}: a cache key. Two requests share a cached answer when their parameters and messages
// match once volatile text is dropped: ISO-8601 timestamps (`2026-12-05T04:24:11Z`) and
// `request-id: <token>`. A request whose last user message names one of config
// `no_cache_intents` (a list of words) is not cached at all.

import { configGet } from "gateway:plugins/host@0.2.0";

type Message = { role: string; content: string; name?: string };
// `parameters` is canonical JSON (keys sorted): tools, response_format, sampling fields, ...
type CacheRequest = { model: string; endpoint: string; messages: Message[]; parameters: string };

const VOLATILE =
  /[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?(?:Z|[+-][0-9]{2}:[0-9]{2})?|request-id:\s*\S*/gi;

function pluginError(code: string, message: string): Error & { payload: PluginError } {
  return Object.assign(new Error(message), { payload: { code, message } });
}

/** `text` without timestamps and `request-id: <token>`, its whitespace collapsed. */
function clean(text: string): string {
  return text.replace(VOLATILE, "").split(/\s+/).filter((w) => w.length > 0).join(" ");
}

function words(text: string): string[] {
  return text.toLowerCase().split(/[^a-z0-9]+/).filter((w) => w.length > 0);
}

/** The words of config `no_cache_intents`: a list, or one comma-separated text. */
function noCacheIntents(): Set<string> {
  const value = configGet("no_cache_intents");
  if (value === undefined) return new Set();
  if (value.tag === "text-list") return new Set(value.val.map((w) => w.trim().toLowerCase()));
  if (value.tag === "text") return new Set(value.val.split(",").map((w) => w.trim().toLowerCase()));
  throw pluginError("invalid-config", "no_cache_intents must be a list of words");
}

/** The text to key the request on, or `undefined`: do not cache it. */
export function key(request: CacheRequest): string | undefined {
  const intents = noCacheIntents();
  const lastUser = request.messages.filter((m) => m.role === "user").pop();
  if (lastUser && words(lastUser.content).some((w) => intents.has(w))) return undefined;
  // The gateway keeps the tenant, model and versions in the key itself; the endpoint is ours to
  // add, so that a completion's prompt never shares a chat message's answer.
  const lines = [request.endpoint, request.parameters];
  for (const m of request.messages) lines.push(`${m.role}: ${clean(m.content)}`);
  return lines.join("\n");
}
