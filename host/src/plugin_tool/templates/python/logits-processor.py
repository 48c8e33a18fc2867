"""{{name}}: a logits processor. The model never writes a token containing one of the words in
config `deny` (a list, or one comma-separated text; any case). One instance serves one
sequence, so the banned list is computed once, at its start, and kept in the module."""

import wit_world
from wit_world.imports import host, types, vocabulary

banned = []


class WitWorld(wit_world.WitWorld):
    def start(self, request):
        global banned
        deny = host.config_get("deny")
        if isinstance(deny, types.Value_TextList):
            items = deny.value
        elif isinstance(deny, types.Value_Text):
            items = deny.value.split(",")
        else:
            items = []
        words = [w.strip() for w in items if w.strip()]
        banned = sorted({t for w in words for t in vocabulary.tokens_containing(w, True)})
        return wit_world.Decision(banned=banned, biases=[], stop=False)

    def step(self, tokens, text):
        return wit_world.Decision(banned=banned, biases=[], stop=False)
