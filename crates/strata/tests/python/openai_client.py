"""The official `openai` Python client against a Strata endpoint (argv[1]: base URL, argv[2]:
model id). Exits non-zero with the failed check's message; prints one line per check passed."""

import json
import sys

import openai

base, model, mode = sys.argv[1], sys.argv[2], sys.argv[3]  # mode: single or pd
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
msgs = [{"role": "user", "content": "count with me: one two three"}]
greedy = dict(model=model, messages=msgs, max_tokens=6, temperature=0)


def check(name, cond, detail=""):
    if not cond:
        sys.exit(f"FAILED {name}: {detail}")
    print(f"ok {name}")


def refused(name, field, **kw):
    try:
        client.chat.completions.create(**{**greedy, **kw})
    except openai.BadRequestError as e:
        param = (e.body or {}).get("param")
        check(name, param == field, f"param {param!r}, expected {field!r}: {e.body}")
        return
    sys.exit(f"FAILED {name}: accepted")


# Plain chat, usage, ids.
r = client.chat.completions.create(**greedy, extra_body={"ignore_eos": True})
check("chat", isinstance(r.choices[0].message.content, str) and r.usage.completion_tokens == 6, r)
check("chat id", r.id.startswith("chatcmpl-") and r.created > 0, r.id)
again = client.chat.completions.create(**greedy, extra_body={"ignore_eos": True})
check("ids are unique", again.id != r.id)
check("greedy is repeatable", again.choices[0].message.content == r.choices[0].message.content)

# Streaming with usage.
chunks = list(client.chat.completions.create(**greedy, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True}))
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
check("stream", text == r.choices[0].message.content, (text, r.choices[0].message.content))
check("stream usage", chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6)

# A batch of prompts: each its own choices, in OpenAI's order (prompt p's at p·n ..).
texts = ["one two three", "four five", "six"]
plain = dict(model=model, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
singles = [client.completions.create(prompt=t, **plain) for t in texts]
b = client.completions.create(prompt=texts, n=2, **plain)
check("batch indices", [c.index for c in b.choices] == list(range(6)), b)
check("batch order", all(b.choices[2 * i + j].text == singles[i].choices[0].text
                         for i in range(3) for j in range(2)), (b, singles))
check("batch usage", b.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
      and b.usage.completion_tokens == 18, b.usage)
tb = client.completions.create(model=model, prompt=[[40, 41, 42], [43, 44]], max_tokens=2,
                               temperature=0, echo=True, logprobs=1,
                               extra_body={"ignore_eos": True})
check("token-list batch with echo", [len(c.logprobs.token_logprobs) for c in tb.choices] == [5, 4]
      and tb.choices[0].text.startswith("()*") and tb.choices[1].text.startswith("+,"), tb)
got = {}
for c in client.completions.create(prompt=texts, stream=True, **plain):
    for ch in c.choices:
        got[ch.index] = got.get(ch.index, "") + ch.text
check("batch streamed", [got.get(i) for i in range(3)] == [s.choices[0].text for s in singles], got)
try:
    client.completions.create(model=model, prompt=["a"] * 65, max_tokens=1)
    sys.exit("FAILED a batch of 65 prompts: accepted")
except openai.BadRequestError as e:
    check("a batch of 65 refused", (e.body or {}).get("param") == "prompt", e.body)

# Log probabilities, consistent with the greedy choice.
lp = client.chat.completions.create(**greedy, logprobs=True, top_logprobs=2,
                                    extra_body={"ignore_eos": True})
content = lp.choices[0].logprobs.content
check("logprobs count", len(content) == 6, len(content))
check("logprobs greedy", all(t.token == t.top_logprobs[0].token and t.logprob <= 0 for t in content))
c = client.completions.create(model=model, prompt="one two three", max_tokens=4, temperature=0,
                              logprobs=2, extra_body={"ignore_eos": True})
check("completion logprobs", len(c.choices[0].logprobs.token_logprobs) == 4)
# The prompt's log probabilities (an evaluation harness's loglikelihood call), and best_of.
e = client.completions.create(model=model, prompt="one two three", max_tokens=1, temperature=0,
                              echo=True, logprobs=1)
elp = e.choices[0].logprobs
check(f"echo with logprobs ({mode})", elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
      and len(elp.tokens) == e.usage.prompt_tokens + 1
      and all(x <= 0 for x in elp.token_logprobs[1:])
      and e.choices[0].text.startswith("one two three"), e)
b = client.completions.create(model=model, prompt="one two three", max_tokens=4, temperature=1,
                              seed=2, n=1, best_of=3, extra_body={"ignore_eos": True})
check(f"best_of ({mode})", len(b.choices) == 1 and b.usage.completion_tokens == 12, b)

# Sampling fields.
s = client.chat.completions.create(**greedy, frequency_penalty=1.0, presence_penalty=0.5,
                                   logit_bias={"77": 5}, seed=3)
check("penalties and bias", s.choices[0].finish_reason in ("stop", "length"))

# Documented no-ops pass; refusals name the field; unknown fields are refused.
n = client.chat.completions.create(**greedy, user="u1", store=False, metadata={"k": "v"})
check("no-ops", n.choices[0].message.content is not None)
refused("unknown field", "max_tokns", extra_body={"max_tokns": 3})
two = client.chat.completions.create(**greedy, n=2, extra_body={"ignore_eos": True})
check(f"n = 2 ({mode})", [c.index for c in two.choices] == [0, 1]
      and two.choices[0].message.content == r.choices[0].message.content
      and two.choices[1].message.content == r.choices[0].message.content, two)
refused("echo", "echo", extra_body={"echo": True})
if mode == "single":
    # n = 4 costs one prefill: the worker's computed prompt tokens grow by the prompt once
    # (and at most a page per choice), not four times.
    import urllib.request

    def misses():
        text = urllib.request.urlopen(f"{base}/metrics").read().decode()
        return sum(float(l.split()[-1]) for l in text.splitlines()
                   if l.startswith("strata_cache_miss_tokens_total"))
    before = misses()
    long = " ".join(f"w{i}" for i in range(150))
    f = client.completions.create(model=model, prompt=long, n=4, max_tokens=2, temperature=1,
                                  seed=5)
    computed = misses() - before
    check("n = 4 costs one prefill", len(f.choices) == 4
          and computed <= f.usage.prompt_tokens + 4 * 64, (computed, f.usage))

# Structured output: a JSON schema, 20 of 20 valid at temperature 1.
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
valid = 0
for seed in range(20):
    j = client.chat.completions.create(model=model, messages=msgs, temperature=1, seed=seed,
                                       max_tokens=100, response_format=fmt)
    try:
        o = json.loads(j.choices[0].message.content)
        valid += (set(o) == {"name", "age"} and isinstance(o["name"], str) and len(o["name"]) <= 8
                  and isinstance(o["age"], int) and 0 <= o["age"] <= 150)
    except ValueError:
        pass
check(f"json_schema 20/20 at temperature 1 ({mode})", valid == 20, valid)
jo = client.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=100,
                                    response_format={"type": "json_object"})
check("json_object", jo.choices[0].finish_reason != "stop"
      or isinstance(json.loads(jo.choices[0].message.content), dict), jo)
refused("a bad schema", "response_format",
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}})

# Tools: a forced call whose arguments validate; the call and its answer in the history.
tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"], "additionalProperties": False}}}]
t = client.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice="required",
                                   parallel_tool_calls=False, temperature=1, seed=1, max_tokens=100)
calls = t.choices[0].message.tool_calls or []
check(f"tool_choice required ({mode})", t.choices[0].finish_reason == "tool_calls" and len(calls) >= 1
      and calls[0].function.name == "get_weather"
      and isinstance(json.loads(calls[0].function.arguments)["city"], str), t)
history = msgs + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
                  {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
h = client.chat.completions.create(model=model, messages=history, tools=tools, max_tokens=4)
check("tool answer in history", h.choices[0].message is not None, h)
st = list(client.chat.completions.create(model=model, messages=msgs, tools=tools, stream=True,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                         max_tokens=100))
deltas = [tc for c in st if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
streamed_args = "".join(d.function.arguments or "" for d in deltas)
check("streamed tool call (arguments as deltas)", len(deltas) > 2 and deltas[0].function.name == "get_weather"
      and deltas[0].id and all(d.index == 0 and d.id is None for d in deltas[1:])
      and isinstance(json.loads(streamed_args), dict), deltas)

# Models and request ids.
m = client.models.retrieve(model)
check("models.retrieve", m.id == model, m)
raw = client.chat.completions.with_raw_response.create(**greedy,
                                                      extra_headers={"X-Request-Id": "py-1"})
check("x-request-id", raw.headers.get("x-request-id") == "py-1", dict(raw.headers))
try:
    client.models.retrieve("no-such-model")
    sys.exit("FAILED unknown model: found")
except openai.NotFoundError:
    check("unknown model", True)
print("all checks passed")
