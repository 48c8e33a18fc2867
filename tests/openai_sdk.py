"""Drives the gateway with the official OpenAI Python SDK, unchanged: chat, streaming chat,
completions, models, and the SDK's own error type for a bad request."""
import sys

import openai
from openai import OpenAI

base_url, model = sys.argv[1], sys.argv[2]
c = OpenAI(base_url=base_url, api_key="anything")

assert model in [m.id for m in c.models.list()]

r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0, max_tokens=24)
answer = r.choices[0].message.content
assert "Paris" in answer, answer
assert r.usage.completion_tokens > 0

parts = []
for chunk in c.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0, max_tokens=24, stream=True):
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
assert "".join(parts) == answer, ("".join(parts), answer)

t = c.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
assert t.choices[0].text

try:
    c.chat.completions.create(model=model, messages=[], max_tokens=4)
    raise SystemExit("empty messages must be rejected")
except openai.BadRequestError as e:
    assert e.status_code == 400

print(answer)
