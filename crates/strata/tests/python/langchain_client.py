"""langchain-openai against a Strata endpoint (argv[1]: base URL, argv[2]: model id, argv[3]:
single or pd): `bind_tools` with tool_choice="required" returns a tool call whose arguments
validate against the tool's schema; `with_structured_output` (json_schema) returns a valid
object 20 times out of 20 at temperature 1. Exits non-zero with the failed check's message."""

import sys

from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field, ValidationError

base, model, mode = sys.argv[1], sys.argv[2], sys.argv[3]


def check(name, cond, detail=""):
    if not cond:
        sys.exit(f"FAILED {name}: {detail}")
    print(f"ok {name}")


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=10, description="the city")
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=150)


llm = ChatOpenAI(base_url=f"{base}/v1", api_key="unused", model=model, temperature=1,
                 max_tokens=120, max_retries=0)

ai = llm.bind_tools([GetWeather], tool_choice="required").invoke("What is the weather in Paris?")
calls = ai.tool_calls
check(f"bind_tools required ({mode})", len(calls) >= 1 and calls[0]["name"] == "GetWeather", ai)
try:
    GetWeather.model_validate(calls[0]["args"])
    check("tool arguments validate against the schema", True)
except ValidationError as e:
    check("tool arguments validate against the schema", False, e)

structured = llm.with_structured_output(Person, method="json_schema")
people = [structured.invoke(f"Invent a person, number {i}.") for i in range(20)]
check(f"with_structured_output 20/20 at temperature 1 ({mode})",
      all(isinstance(p, Person) for p in people), people)
print("all checks passed")
