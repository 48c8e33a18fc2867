"""A base model (no chat template) through the official OpenAI Python SDK: completions, the
same text streamed, and chat refused with the SDK's own 400 error naming the way out."""
import sys

import openai
from openai import OpenAI

base_url, model = sys.argv[1], sys.argv[2]
c = OpenAI(base_url=base_url, api_key="anything")

t = c.completions.create(model=model, prompt="The capital of France is", max_tokens=24, temperature=0)
text = t.choices[0].text
assert "capital" in text, text
assert t.usage.completion_tokens == 24, t.usage

streamed = "".join(
    ch.choices[0].text
    for ch in c.completions.create(model=model, prompt="The capital of France is", max_tokens=24, temperature=0, stream=True)
    if ch.choices
)
assert streamed == text, (streamed, text)

try:
    c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    raise SystemExit("chat on a model without a chat template must be refused")
except openai.BadRequestError as e:
    assert e.status_code == 400
    assert "chat template" in str(e), e

print(text)
