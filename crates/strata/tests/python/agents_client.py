"""The OpenAI Agents SDK (openai-agents, pinned in scripts/requirements-test.txt) with its default
model (the Responses API) against a Strata worker: an agent whose function tool must be called
(`tool_choice="required"`, stopping at the first tool's result) calls it with arguments that
validate, and the run's final output is the tool's result.

python3 agents_client.py BASE_URL MODEL MODE
"""

import sys
from typing import Literal

from agents import (
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

base, model, mode = sys.argv[1], sys.argv[2], sys.argv[3]
set_tracing_disabled(True)
set_default_openai_api("responses")
set_default_openai_client(AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0))

calls = []


@function_tool
def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
    """The weather in a city."""
    calls.append(city)
    return f"sunny in {city!r}"


agent = Agent(
    name="weather",
    instructions="Answer with the weather tool.",
    model=model,
    tools=[get_weather],
    tool_use_behavior="stop_on_first_tool",
    model_settings=ModelSettings(tool_choice="required", max_tokens=200, temperature=0),
)
result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
if not calls or not isinstance(calls[0], str):
    sys.exit(f"FAILED agent tool call: {calls} {result}")
if result.final_output != f"sunny in {calls[0]!r}":
    sys.exit(f"FAILED agent final output: {result.final_output!r}")
print(f"ok agents SDK ({mode}): get_weather({calls[0]!r}) → {result.final_output!r}")
print("all checks passed")
