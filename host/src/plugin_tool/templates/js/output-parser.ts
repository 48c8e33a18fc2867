// {{name}}: an output parser. Takes the first JSON object in the model's text (code fences and
// prose around it are dropped) and checks the schema's top-level `required` keys.

type Parsed = { json: string; repairs: string[] };

function pluginError(code: string, message: string): Error & { payload: PluginError } {
  return Object.assign(new Error(message), { payload: { code, message } });
}

/** The first `{...}` that parses, trying each closing brace from the last one back. */
function firstObject(text: string): { value: Record<string, unknown>; start: number; end: number } {
  const start = text.indexOf("{");
  if (start < 0) throw pluginError("no-json", "the text holds no JSON object");
  for (let end = text.lastIndexOf("}"); end > start; end = text.lastIndexOf("}", end - 1)) {
    try {
      const value = JSON.parse(text.slice(start, end + 1));
      if (value !== null && typeof value === "object" && !Array.isArray(value)) {
        return { value, start, end: end + 1 };
      }
    } catch {
      // Not this brace: try the one before.
    }
  }
  throw pluginError("no-json", "the JSON object in the text does not parse");
}

export function parse(text: string, schema: string | undefined): Parsed {
  const { value, start, end } = firstObject(text);
  const repairs: string[] = [];
  if (start > 0 || end < text.trimEnd().length) repairs.push("dropped text around the JSON object");
  if (schema !== undefined) {
    const required: unknown = JSON.parse(schema).required ?? [];
    for (const key of Array.isArray(required) ? required : []) {
      if (!(key in value)) throw pluginError("schema-mismatch", `missing required key ${JSON.stringify(key)}`);
    }
  }
  return { json: JSON.stringify(value), repairs };
}
