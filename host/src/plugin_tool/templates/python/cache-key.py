"""{{name}}: a cache key. Two requests share a cached answer when their parameters and messages
match once volatile text is dropped: ISO-8601 timestamps (`2026-12-05T04:24:11Z`) and
`request-id: <token>`. A request whose last user message names one of config
`no_cache_intents` (a list of words) is not cached at all."""

import re

import wit_world
from componentize_py_types import Err
from wit_world.imports import host, types

VOLATILE = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?(?:Z|[+-][0-9]{2}:[0-9]{2})?"
    r"|request-id:\s*\S*",
    re.IGNORECASE,
)
WORD = re.compile(r"\w+")


def clean(text):
    """`text` without timestamps and `request-id: <token>`, its whitespace collapsed."""
    return " ".join(VOLATILE.sub("", text).split())


def no_cache_intents():
    """The words of config `no_cache_intents`: a list, or one comma-separated text."""
    value = host.config_get("no_cache_intents")
    if value is None:
        return set()
    if isinstance(value, types.Value_TextList):
        return {w.strip().lower() for w in value.value}
    if isinstance(value, types.Value_Text):
        return {w.strip().lower() for w in value.value.split(",")}
    raise Err(types.PluginError(code="invalid-config", message="no_cache_intents must be a list of words"))


class WitWorld(wit_world.WitWorld):
    def key(self, request):
        intents = no_cache_intents()
        users = [m for m in request.messages if m.role == "user"]
        if users and any(w.lower() in intents for w in WORD.findall(users[-1].content)):
            return None
        # The gateway keeps the tenant, model and versions in the key itself; the endpoint is
        # ours to add, so that a completion's prompt never shares a chat message's answer.
        lines = [request.endpoint, request.parameters]
        lines += [f"{m.role}: {clean(m.content)}" for m in request.messages]
        return "\n".join(lines)
