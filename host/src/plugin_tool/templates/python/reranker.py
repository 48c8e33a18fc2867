"""{{name}}: a reranker. Scores each candidate by the share of the query's words it contains,
times a boost for candidates whose metadata field `tier` equals config `boost_tier`."""

import re

import wit_world
from componentize_py_types import Err
from wit_world.imports import host, types

WORD = re.compile(r"\w+")


def words(text):
    return [w.lower() for w in WORD.findall(text)]


class WitWorld(wit_world.WitWorld):
    def rerank(self, query, candidates):
        terms = words(query)
        if not terms:
            raise Err(types.PluginError(code="invalid-input", message="the query has no words"))
        # Values keep their type: a text value is a `types.Value_Text`, a list of texts a
        # `types.Value_TextList`, a number a `types.Value_Number`.
        boost_tier = host.config_get("boost_tier")
        out = []
        for c in candidates:
            have = set(words(c.text))
            score = sum(t in have for t in terms) / len(terms)
            if boost_tier is not None and dict(c.metadata).get("tier") == boost_tier:
                score *= 1.5
            out.append(wit_world.Scored(id=c.id, score=score))
        return out
