"""{{name}}: a logits processor. The model never writes a token containing one of the words in
config `deny` (comma-separated, any case). One instance serves one sequence, so the banned list
is computed once, at its start, and kept in the module."""

import wit_world
from wit_world.imports import host, vocabulary

banned = []


class WitWorld(wit_world.WitWorld):
    def start(self, request):
        global banned
        words = [w.strip() for w in (host.config_get("deny") or "").split(",") if w.strip()]
        banned = sorted({t for w in words for t in vocabulary.tokens_containing(w, True)})
        return wit_world.Decision(banned=banned, biases=[], stop=False)

    def step(self, tokens, text):
        return wit_world.Decision(banned=banned, biases=[], stop=False)
