"""Structured output and tool calling through the official OpenAI Python SDK, unchanged.

Usage: openai_sdk_structured.py BASE_URL DEFAULT_MODEL TOOL_MODEL

- `chat.completions.parse(response_format=<pydantic model>)` returns a parsed object on the
  default model;
- json_object and json_schema answers to 10 varied prompts each parse and validate (with the
  `jsonschema` validator) on TOOL_MODEL;
- named and required tool_choice give valid calls whose arguments match their schema, on both
  models; streamed tool-call deltas reassemble (with the SDK's stream helper) to the same call;
- a whole round trip: call, tool result, final answer.
"""
import json
import sys

import jsonschema
import pydantic
from openai import OpenAI

base_url, default_model, tool_model = sys.argv[1], sys.argv[2], sys.argv[3]
c = OpenAI(base_url=base_url, api_key="anything")


class Contact(pydantic.BaseModel):
    name: str
    email: str
    company: str


r = c.chat.completions.parse(
    model=default_model,
    messages=[{"role": "user", "content": "Extract the contact: Ann Smith, ann@acme.com, works at Acme."}],
    response_format=Contact,
    temperature=0,
    max_tokens=120,
)
contact = r.choices[0].message.parsed
assert isinstance(contact, Contact), r
assert r.choices[0].finish_reason == "stop", r

PROMPTS = [
    "Describe a customer named Ann from Paris.",
    "Give the order 1234 with two items.",
    "A support ticket about a broken printer.",
    "The company Acme, founded 1999, 50 employees.",
    "A meeting on Monday at 10 with Bob.",
    "A product: red shoes, size 42, price 59.90.",
    "An invoice for 3 hours of consulting.",
    "The lead Maria Garcia, interested in the premium plan.",
    "A task: call the client back tomorrow.",
    "Contact details of John, phone 555-1234.",
]

for p in PROMPTS:
    r = c.chat.completions.create(
        model=tool_model,
        messages=[{"role": "user", "content": p + " Answer in JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", (p, text)
    assert isinstance(json.loads(text), dict), (p, text)

RECORD = {
    "type": "object",
    "properties": {
        "kind": {"type": "string", "enum": ["customer", "order", "ticket", "company", "meeting", "product", "invoice", "lead", "task", "contact"]},
        "title": {"type": "string", "maxLength": 80},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "email": {"type": ["string", "null"]}},
            "required": ["name", "email"],
            "additionalProperties": False,
        },
    },
    "required": ["kind", "title", "priority", "tags", "owner"],
    "additionalProperties": False,
}

for p in PROMPTS:
    r = c.chat.completions.create(
        model=tool_model,
        messages=[{"role": "user", "content": "File this as a CRM record: " + p}],
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD, "strict": True}},
        temperature=0,
        max_tokens=200,
    )
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", (p, text)
    jsonschema.validate(json.loads(text), RECORD)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TICKET = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "priority": {"type": "integer", "minimum": 1, "maximum": 3}},
    "required": ["title", "priority"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "create_ticket", "description": "Open a support ticket", "parameters": TICKET}},
]
SCHEMAS = {"get_weather": WEATHER, "create_ticket": TICKET}


def check_calls(message, names):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_"), call
        assert call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


for model in (default_model, tool_model):
    ask = [{"role": "user", "content": "My printer is broken, please open a ticket."}]
    named = {"type": "function", "function": {"name": "create_ticket"}}
    r = c.chat.completions.create(model=model, messages=ask, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=80)
    check_calls(r.choices[0].message, {"create_ticket"})
    assert r.choices[0].finish_reason == "tool_calls", r
    whole = r.choices[0].message.tool_calls

    with c.chat.completions.stream(model=model, messages=ask, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=80) as s:
        for _ in s:
            pass
        streamed = s.get_final_completion().choices[0].message.tool_calls
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        (t.function.name, t.function.arguments) for t in whole
    ], (streamed, whole)

    r = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=120,
    )
    check_calls(r.choices[0].message, set(SCHEMAS))

# A round trip on the tool model: the call, its result, then an answer that uses it.
ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
r = c.chat.completions.create(
    model=tool_model,
    messages=ask,
    tools=TOOLS,
    tool_choice={"type": "function", "function": {"name": "get_weather"}},
    temperature=0,
    max_tokens=60,
)
call = r.choices[0].message.tool_calls[0]
history = ask + [
    r.choices[0].message.model_dump(exclude_none=True),
    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "unit": "celsius", "sky": "sunny"})},
]
r = c.chat.completions.create(model=tool_model, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=60)
final = r.choices[0].message
assert final.content and not final.tool_calls, final
assert "18" in final.content, final.content

print("structured ok:", contact.model_dump_json(), whole[0].function.arguments, "|", final.content)
