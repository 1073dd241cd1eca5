"""The official `openai` client's Responses API (`client.responses.create`) against a Strata
worker: plain, with instructions and input items, streamed (the deltas join into the whole
answer's text), with a function tool (its call, then its output sent back with
`previous_response_id`), with structured output (`text.format` json_schema), and a second turn
by `previous_response_id` that the prefix cache serves; refusals name their field.

python3 responses_client.py BASE_URL MODEL MODE
"""

import json
import sys

import openai

base, model, mode = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def check(name, cond, detail=""):
    if not cond:
        sys.exit(f"FAILED {name}: {detail}")
    print(f"ok {name}")


def refused(name, field, **kw):
    try:
        client.responses.create(model=model, input="hi", max_output_tokens=2, **kw)
    except openai.BadRequestError as e:
        param = (e.body or {}).get("param")
        check(name, param == field, f"param {param!r}, expected {field!r}: {e.body}")
        return
    sys.exit(f"FAILED {name}: accepted")


greedy = dict(model=model, max_output_tokens=8, temperature=0)
r = client.responses.create(input="count with me: one two three", **greedy)
check("plain", r.id.startswith("resp_") and r.object == "response" and isinstance(r.output_text, str), r)
check("plain usage", r.usage.input_tokens > 0 and r.usage.output_tokens > 0
      and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, r.usage)
check("plain status", r.status in ("completed", "incomplete"), r.status)

items = [{"role": "user", "content": [{"type": "input_text", "text": "count with me: one two three"}]}]
r2 = client.responses.create(input=items, instructions="Answer briefly.", **greedy)
check("instructions and items", r2.instructions == "Answer briefly." and isinstance(r2.output_text, str), r2)

# Streamed: the deltas join into the same text as the whole answer.
events = list(client.responses.create(input="count with me: one two three", stream=True, **greedy))
kinds = [e.type for e in events]
check("stream events", kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
      and "response.output_text.delta" in kinds, kinds)
text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
check("stream text", text == r.output_text, (text, r.output_text))
check("stream usage", events[-1].response.usage.output_tokens == r.usage.output_tokens, events[-1])
check("stream sequence", [e.sequence_number for e in events] == list(range(len(events))))

# A function tool: the call, then its output continues the conversation.
tool = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                       "required": ["city"]}}
t = client.responses.create(model=model, input="What is the weather in Paris?", tools=[tool],
                            tool_choice="required", max_output_tokens=200, temperature=0)
calls = [o for o in t.output if o.type == "function_call"]
check("function call", len(calls) >= 1 and calls[0].name == "get_weather"
      and isinstance(json.loads(calls[0].arguments)["city"], str), t.output)
back = client.responses.create(model=model, previous_response_id=t.id, tools=[tool],
                               input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                       "output": "sunny, 21 C"}], **{k: v for k, v in greedy.items() if k != "model"})
check("function output sent back", back.previous_response_id == t.id and back.status in ("completed", "incomplete"), back)
st = client.responses.create(model=model, input="What is the weather in Paris?", tools=[tool],
                             tool_choice="required", max_output_tokens=200, temperature=0, stream=True)
events = list(st)
kinds = [e.type for e in events]
streamed_args = {}
for e in events:
    if e.type == "response.function_call_arguments.delta":
        streamed_args[e.item_id] = streamed_args.get(e.item_id, "") + e.delta
done = {e.item_id: e.arguments for e in events if e.type == "response.function_call_arguments.done"}
check("function call streamed (arguments as deltas)",
      kinds.count("response.function_call_arguments.delta") > 2 and done == streamed_args
      and all(isinstance(json.loads(a)["city"], str) for a in done.values()), kinds)

# Structured output.
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
s = client.responses.create(model=model, input="Describe a person.", max_output_tokens=120, temperature=1,
                            text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}})
v = json.loads(s.output_text)
check("structured output", set(v) == {"name", "age"}, s.output_text)

# A second turn by previous_response_id: the first turn's prefix is served from the cache.
long_q = "Tell me about " + " ".join(f"topic{i}" for i in range(60))
a = client.responses.create(input=long_q, **greedy)
b = client.responses.create(model=model, previous_response_id=a.id, input="And then?",
                            **{k: v for k, v in greedy.items() if k != "model"})
check("previous_response_id cache hit", b.usage.input_tokens > a.usage.input_tokens
      and b.usage.input_tokens_details.cached_tokens >= a.usage.input_tokens // 2, (a.usage, b.usage))

refused("unknown previous response", "previous_response_id", previous_response_id="resp_nope")
refused("reasoning refused", "reasoning", reasoning={"effort": "low"})
refused("truncation auto refused", "truncation", truncation="auto")
refused("hosted tools refused", "tools", tools=[{"type": "web_search"}])
print("all checks passed")
