// Structured output and tool calling through the official OpenAI Node SDK (`openai` on npm),
// unchanged. Usage: node openai_sdk_node.cjs BASE_URL MODEL (with NODE_PATH naming the
// node_modules that holds `openai`).
const assert = require("node:assert/strict");
const OpenAI = require("openai").default;

const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "anything" });

const TICKET = {
  type: "object",
  properties: { title: { type: "string" }, priority: { type: "integer", minimum: 1, maximum: 3 } },
  required: ["title", "priority"],
  additionalProperties: false,
};
const tools = [
  { type: "function", function: { name: "create_ticket", description: "Open a support ticket", parameters: TICKET } },
];
const messages = [{ role: "user", content: "My printer is broken, please open a ticket." }];
const tool_choice = { type: "function", function: { name: "create_ticket" } };

function checkTicket(call) {
  assert.equal(call.type, "function");
  assert.match(call.id, /^call_/);
  assert.equal(call.function.name, "create_ticket");
  const args = JSON.parse(call.function.arguments);
  assert.equal(typeof args.title, "string");
  assert.ok(Number.isInteger(args.priority) && args.priority >= 1 && args.priority <= 3, call.function.arguments);
  assert.deepEqual(Object.keys(args).sort(), ["priority", "title"]);
}

async function main() {
  const r = await client.chat.completions.create({ model, messages, tools, tool_choice, temperature: 0, max_tokens: 80 });
  const whole = r.choices[0].message.tool_calls;
  assert.ok(whole && whole.length >= 1, JSON.stringify(r));
  whole.forEach(checkTicket);
  assert.equal(r.choices[0].finish_reason, "tool_calls");

  // The SDK's stream helper reassembles the tool-call deltas.
  const stream = client.chat.completions.stream({ model, messages, tools, tool_choice, temperature: 0, max_tokens: 80 });
  const done = await stream.finalChatCompletion();
  const streamed = done.choices[0].message.tool_calls;
  assert.deepEqual(
    streamed.map((c) => [c.function.name, c.function.arguments]),
    whole.map((c) => [c.function.name, c.function.arguments]),
  );

  const j = await client.chat.completions.create({
    model,
    messages: [{ role: "user", content: "Open a ticket for a broken printer, as JSON." }],
    response_format: { type: "json_schema", json_schema: { name: "ticket", schema: TICKET, strict: true } },
    temperature: 0,
    max_tokens: 80,
  });
  assert.equal(j.choices[0].finish_reason, "stop");
  checkTicket({ type: "function", id: "call_x", function: { name: "create_ticket", arguments: j.choices[0].message.content } });

  // A bad tool schema is the SDK's BadRequestError, naming the field.
  try {
    await client.chat.completions.create({
      model,
      messages,
      tools: [{ type: "function", function: { name: "bad", parameters: { type: "object", if: {} } } }],
      tool_choice: "required",
    });
    assert.fail("a schema with an unsupported keyword must be refused");
  } catch (e) {
    assert.ok(e instanceof OpenAI.BadRequestError, String(e));
    assert.equal(e.param, "tools[0].function.parameters");
  }
  console.log("node sdk ok:", whole[0].function.arguments);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
