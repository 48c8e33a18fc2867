"""{{name}}: an output parser. Takes the first JSON object in the model's text (code fences and
prose around it are dropped) and checks the schema's top-level `required` keys."""

import json

import wit_world
from componentize_py_types import Err
from wit_world.imports import types


def fail(code, message):
    return Err(types.PluginError(code=code, message=message))


class WitWorld(wit_world.WitWorld):
    def parse(self, text, schema):
        start = text.find("{")
        if start < 0:
            raise fail("no-json", "the text holds no JSON object")
        try:
            value, end = json.JSONDecoder().raw_decode(text, start)
        except ValueError:
            raise fail("no-json", "the JSON object in the text does not parse")
        repairs = []
        if start > 0 or end < len(text.rstrip()):
            repairs.append("dropped text around the JSON object")
        if schema is not None:
            for key in json.loads(schema).get("required", []):
                if key not in value:
                    raise fail("schema-mismatch", f"missing required key {key!r}")
        return wit_world.Parsed(json=json.dumps(value), repairs=repairs)
