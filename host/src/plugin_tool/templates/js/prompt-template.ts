// {{name}}: a prompt template. Puts the tenant's persona (config `persona`) first and the
// retrieved passages after it as numbered sources.

import { configGet } from "gateway:plugins/host@0.2.0";

type Message = { role: string; content: string; name?: string };
type ChatRequest = {
  model: string;
  messages: Message[];
  context: { id: string; text: string; title?: string }[];
};
type RenderedPrompt = { tag: "prompt"; val: string } | { tag: "messages"; val: Message[] };

function pluginError(code: string, message: string): Error & { payload: PluginError } {
  return Object.assign(new Error(message), { payload: { code, message } });
}

export function render(request: ChatRequest): RenderedPrompt {
  if (!request.messages.some((m) => m.role === "user")) {
    throw pluginError("invalid-input", "the conversation has no user message");
  }
  const persona = configGet("persona");
  let system = persona?.tag === "text" ? persona.val : "You are a helpful CRM assistant.";
  request.context.forEach((c, i) => {
    system += `\n\n[${i + 1}] ${c.text}`;
  });
  const messages: Message[] = [{ role: "system", content: system }];
  messages.push(...request.messages.filter((m) => m.role !== "system"));
  // The gateway applies the model's own chat template to these messages.
  return { tag: "messages", val: messages };
}
