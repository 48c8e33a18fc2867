"""An agent of the OpenAI Agents SDK (`openai-agents` on PyPI), unchanged, with one function
tool, against the gateway's Responses API (the SDK's default model interface), tracing off.
The tool choice is forced on the first turn (the SDK resets it after a call), so a small
model makes the call; the tool's output goes back in a second Responses request, which the
agent takes as its final output. What that answer says is the model's affair (the 1.5B coder
model sometimes answers with its own call as text), so the check is the round trip: the call,
its arguments, and a completed run.

Usage: python3 openai_agents_sdk.py BASE_URL MODEL KEY"""
import asyncio
import sys

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

base_url, model, key = sys.argv[1], sys.argv[2], sys.argv[3]
set_tracing_disabled(True)
client = AsyncOpenAI(base_url=base_url, api_key=key)
looked_up = []


@function_tool
def get_order_status(order_id: str) -> str:
    """Look up the delivery status of a customer's order by its id."""
    looked_up.append(order_id)
    return f"Order {order_id} shipped on 3 May and arrives on Friday."


agent = Agent(
    name="Support",
    instructions="You are a CRM support agent. Answer questions about orders using the get_order_status tool.",
    model=OpenAIResponsesModel(model=model, openai_client=client),
    tools=[get_order_status],
    model_settings=ModelSettings(tool_choice="get_order_status", temperature=0, max_tokens=96),
)

result = asyncio.run(Runner.run(agent, "Where is my order A-1042?", max_turns=4))
assert looked_up == ["A-1042"], looked_up
answer = str(result.final_output)
assert answer.strip(), result
outputs = [i for i in result.to_input_list() if i.get("type") == "function_call_output"]
assert len(outputs) == 1 and "Friday" in outputs[0]["output"], outputs
print("agents sdk ok:", answer)
