// A streamed `responses.create` through the official OpenAI Node SDK (`openai` on npm),
// unchanged. Usage: node openai_sdk_responses_node.cjs BASE_URL MODEL KEY (with NODE_PATH
// naming the node_modules that holds `openai`).
const assert = require("node:assert/strict");
const OpenAI = require("openai").default;

const [baseURL, model, apiKey] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey });

(async () => {
  const stream = await client.responses.create({
    model,
    input: "What is the capital of France?",
    temperature: 0,
    max_output_tokens: 24,
    stream: true,
  });
  const kinds = [];
  let text = "";
  let done;
  for await (const e of stream) {
    kinds.push(e.type);
    if (e.type === "response.output_text.delta") text += e.delta;
    if (e.type === "response.completed") done = e.response;
  }
  assert.equal(kinds[0], "response.created");
  assert.equal(kinds.at(-1), "response.completed");
  assert.ok(text.includes("Paris"), text);
  assert.equal(done.output[0].content[0].text, text);
  assert.ok(done.usage.output_tokens > 0);
  const got = await client.responses.retrieve(done.id);
  assert.equal(got.output[0].content[0].text, text);
  console.log("node responses ok");
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
