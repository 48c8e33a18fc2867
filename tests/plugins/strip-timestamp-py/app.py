"""A cache key that drops timestamps (`YYYY-MM-DDTHH:MM:SS` with `Z` or `±HH:MM`) and `[ts=...]`
tags from every message, and keys on the model, the messages (`role: content` lines) and the
parameters, one per line; a request with `NOCACHE` in any message is not cached. The Rust
crate `tests/plugins/strip-timestamp` is the same plugin and gives the same keys."""

import re

import wit_world

VOLATILE = re.compile(
    r"\[ts=[^\]]*\]|[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:Z|[+-][0-9]{2}:[0-9]{2})"
)


class WitWorld(wit_world.WitWorld):
    def key(self, request):
        if any("NOCACHE" in m.content for m in request.messages):
            return None
        lines = [request.model]
        lines += [f"{m.role}: {VOLATILE.sub('', m.content)}" for m in request.messages]
        lines.append(request.parameters)
        return "\n".join(lines)
