"""{{name}}: a prompt template. Puts the tenant's persona (config `persona`) first and the
retrieved passages after it as numbered sources."""

import wit_world
from componentize_py_types import Err
from wit_world.imports import host, types


class WitWorld(wit_world.WitWorld):
    def render(self, request):
        if not any(m.role == "user" for m in request.messages):
            raise Err(types.PluginError(code="invalid-input", message="the conversation has no user message"))
        persona = host.config_get("persona")
        # Configuration values keep the policy's type: text is a `types.Value_Text`.
        if isinstance(persona, types.Value_Text):
            system = persona.value
        else:
            system = "You are a helpful CRM assistant."
        for i, chunk in enumerate(request.context, start=1):
            system += f"\n\n[{i}] {chunk.text}"
        messages = [types.Message(role="system", content=system, name=None)]
        messages += [m for m in request.messages if m.role != "system"]
        # The gateway applies the model's own chat template to these messages.
        return wit_world.RenderedPrompt_Messages(messages)
