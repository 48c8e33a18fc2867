"""Drives `/v1/responses` with the official OpenAI Python SDK, unchanged: plain and with
instructions, `text.format` json_schema parsed by `responses.parse` into a pydantic model,
streaming (event order checked) through `responses.stream` and `stream=True`, a function-tool
round trip with `function_call_output`, `previous_response_id` across three turns, `retrieve`,
`delete`, `input_items.list`, and the SDK's error for each unsupported field.

Prints the id of a stored response, for the caller's durability check."""
import json
import sys

import openai
from openai import OpenAI
from pydantic import BaseModel

base_url, model = sys.argv[1], sys.argv[2]
key = sys.argv[3] if len(sys.argv) > 3 else "anything"
c = OpenAI(base_url=base_url, api_key=key)

r = c.responses.create(model=model, input="What is the capital of France?", temperature=0,
                       max_output_tokens=24)
assert r.object == "response" and r.status == "completed", r
assert "Paris" in r.output_text, r.output_text
assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0, r.usage
assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
assert r.id.startswith("resp_")

r = c.responses.create(model=model, instructions="Answer with one word.",
                       input=[{"role": "user", "content": [{"type": "input_text", "text": "Capital of Italy?"}]}],
                       temperature=0, max_output_tokens=8, metadata={"ticket": "42"})
assert r.metadata == {"ticket": "42"}, r.metadata
assert r.instructions == "Answer with one word."

cut = c.responses.create(model=model, input="Count from one to fifty in words.", temperature=0,
                         max_output_tokens=4)
assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens", cut


class City(BaseModel):
    name: str
    country: str


parsed = c.responses.parse(model=model, input="Give the capital of France as JSON with name and country.",
                           text_format=City, temperature=0, max_output_tokens=48)
assert isinstance(parsed.output_parsed, City), parsed
assert parsed.output_parsed.name, parsed.output_parsed

# Streaming through the SDK's helper: the events in OpenAI's order, the text the same as whole.
whole = c.responses.create(model=model, input="What is 2+2?", temperature=0, max_output_tokens=40)
kinds, deltas = [], []
with c.responses.stream(model=model, input="What is 2+2?", temperature=0, max_output_tokens=40) as s:
    for e in s:
        kinds.append(e.type)
        if e.type == "response.output_text.delta":
            deltas.append(e.delta)
    final = s.get_final_response()
assert kinds[:2] == ["response.created", "response.in_progress"], kinds
assert kinds[-1] == "response.completed", kinds
want = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done"]
positions = [kinds.index(k) for k in want]
assert positions == sorted(positions), kinds
assert "".join(deltas) == whole.output_text == final.output_text, (deltas, whole.output_text)
seqs = []
for e in c.responses.create(model=model, input="What is 2+2?", temperature=0, max_output_tokens=40, stream=True):
    seqs.append(e.sequence_number)
assert seqs == list(range(len(seqs))), seqs

# A function-tool round trip: the call, then its output fed back.
tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "strict": True,
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
call_r = c.responses.create(model=model, input="What is the weather in Paris?", tools=tools,
                            tool_choice={"type": "function", "name": "get_weather"},
                            temperature=0, max_output_tokens=64)
calls = [o for o in call_r.output if o.type == "function_call"]
assert calls and calls[0].name == "get_weather", call_r.output
args = json.loads(calls[0].arguments)
assert set(args) == {"city"}, args
after = c.responses.create(model=model, previous_response_id=call_r.id, tools=tools,
                           input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                   "output": json.dumps({"temp_c": 18, "sky": "clear"})}],
                           temperature=0, max_output_tokens=32)
assert after.status == "completed" and after.output_text, after
assert after.previous_response_id == call_r.id

# Three turns by previous_response_id: the first turn's fact reaches the third.
t1 = c.responses.create(model=model, input="My name is Ada. Remember it.", temperature=0, max_output_tokens=16)
t2 = c.responses.create(model=model, previous_response_id=t1.id, input="I live in Paris.", temperature=0,
                        max_output_tokens=16)
t3 = c.responses.create(model=model, previous_response_id=t2.id, input="What is my name?", temperature=0,
                        max_output_tokens=16)
assert t3.usage.input_tokens > t2.usage.input_tokens > t1.usage.input_tokens, (t1.usage, t2.usage, t3.usage)
# The earlier turns are a prefix of this prompt: the prefix cache serves them.
assert t3.usage.input_tokens_details.cached_tokens > 0, t3.usage

got = c.responses.retrieve(t2.id)
assert got.id == t2.id and got.output_text == t2.output_text
items = c.responses.input_items.list(t2.id)
assert [i.type for i in items.data] == ["message"], items
assert items.data[0].content[0].text == "I live in Paris."

gone = c.responses.create(model=model, input="Say hi.", temperature=0, max_output_tokens=4)
c.responses.delete(gone.id)
try:
    c.responses.retrieve(gone.id)
    raise SystemExit("a deleted response must be gone")
except openai.NotFoundError:
    pass
try:
    c.responses.create(model=model, previous_response_id="resp_nope", input="x", max_output_tokens=4)
    raise SystemExit("an unknown previous_response_id must be refused")
except openai.NotFoundError:
    pass

unstored = c.responses.create(model=model, input="Say hi.", temperature=0, max_output_tokens=4, store=False)
try:
    c.responses.retrieve(unstored.id)
    raise SystemExit("store=false must store nothing")
except openai.NotFoundError:
    pass

for extra, field in [({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                     ({"background": True}, "background"),
                     ({"reasoning": {"effort": "high"}}, "reasoning"),
                     ({"truncation": "auto"}, "truncation")]:
    try:
        c.responses.create(model=model, input="x", max_output_tokens=4, **extra)
        raise SystemExit(f"{field} must be refused")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == field, (field, e.body)

print(t1.id)
