"""Intent parser for CRM support conversations, in Python: turns the model's answer into
`{"intent", "source", "entities"}` a CRM workflow can route on.

The model may answer with a JSON object (`{"intent": "cancellation", ...}`), possibly inside a
code fence or around prose, or in plain words ("The customer wants to cancel"). The first is
taken as the model said it (when its intent is one the tenant allows); the second is matched
against each intent's keywords. Entities (e-mail addresses, money amounts, order numbers) are
pulled from the whole text either way.

Tenant configuration:
- `intents`: `intent=keyword|keyword` rules, a list (`["cancellation=cancel|terminate",
  "upgrade"]`) or one comma-separated text; an intent without `=` is its own keyword.
  Default: billing, cancellation, upgrade, technical-support, sales.
- `fallback`: the intent to answer when none matches (default: none, a `no-intent` error).
"""

import json
import re

import wit_world
from componentize_py_types import Err
from wit_world.imports import host, types

DEFAULT_INTENTS = (
    "billing=invoice|bill|charge|refund|payment,"
    "cancellation=cancel|terminate|close my account|unsubscribe,"
    "upgrade=upgrade|premium|more seats|higher tier,"
    "technical-support=error|bug|crash|not working|broken|login,"
    "sales=pricing|quote|demo|buy|purchase"
)
EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
AMOUNT = re.compile(r"(?:[$€£]\s?\d[\d,]*(?:\.\d+)?|\d[\d,]*(?:\.\d+)?\s?(?:USD|EUR|GBP))")
ORDER = re.compile(r"(?:order|ticket|case)\s*(?:number|no\.?|id)?\s*#?\s*([A-Z0-9-]{4,})", re.I)


def fail(code, message):
    return Err(types.PluginError(code=code, message=message))


def text_config(key):
    """The tenant's value for `key` as text (a list joined with commas), or None."""
    value = host.config_get(key)
    if isinstance(value, types.Value_TextList):
        return ",".join(value.value)
    if isinstance(value, types.Value_Boolean):
        return "true" if value.value else "false"
    return None if value is None else str(value.value)


def rules(spec):
    """`intent=kw|kw,...` as [(intent, [keywords])]; raises on an empty intent name."""
    out = []
    for rule in filter(None, (r.strip() for r in spec.split(","))):
        name, _, words = rule.partition("=")
        name = name.strip().lower()
        if not name:
            raise fail("invalid-config", f"intent rule {rule!r} has no intent name")
        keywords = [w.strip().lower() for w in words.split("|") if w.strip()] or [name]
        out.append((name, keywords))
    return out


def json_objects(text):
    """Every JSON object in the text, outermost first (fences and prose around them ignored)."""
    decoder = json.JSONDecoder()
    i = text.find("{")
    while i != -1:
        try:
            value, end = decoder.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        if isinstance(value, dict):
            yield value
        i = text.find("{", end)


def entities(text):
    return {
        "emails": sorted(set(EMAIL.findall(text))),
        "amounts": [a.strip() for a in AMOUNT.findall(text)],
        "order_ids": [o.upper() for o in ORDER.findall(text)],
    }


def classify(text, allowed):
    names = [name for name, _ in allowed]
    for obj in json_objects(text):
        said = obj.get("intent")
        if isinstance(said, str) and said.strip().lower() in names:
            return said.strip().lower(), "json"
    low = text.lower()
    best = None
    for name, keywords in allowed:
        hits = [low.find(k) for k in keywords if k in low]
        if hits and (best is None or min(hits) < best[1]):
            best = (name, min(hits))
    return (best[0], "keyword") if best else (None, None)


def check_required(result, schema):
    """The schema's top-level `required` keys must all be in the result."""
    try:
        required = json.loads(schema).get("required", [])
    except (ValueError, AttributeError):
        raise fail("invalid-input", "the schema is not a JSON object")
    missing = [k for k in required if k not in result]
    if missing:
        raise fail("schema-mismatch", f"the schema requires {missing}, which this parser does not produce")


class WitWorld(wit_world.WitWorld):
    def parse(self, text, schema):
        allowed = rules(text_config("intents") or DEFAULT_INTENTS)
        intent, source = classify(text, allowed)
        repairs = []
        if intent is None:
            fallback = text_config("fallback")
            if not fallback:
                raise fail("no-intent", "the text names none of the intents: " + ", ".join(n for n, _ in allowed))
            intent, source = fallback, "fallback"
            repairs.append(f"no intent in the text; used the fallback {fallback!r}")
        result = {"intent": intent, "source": source, "entities": entities(text)}
        if schema is not None:
            check_required(result, schema)
        host.log(host.LogLevel.DEBUG, f"intent {intent} from {source}")
        return wit_world.Parsed(json=json.dumps(result), repairs=repairs)
