"""instructor (pinned in scripts/requirements-instructor.txt, in its own virtual environment:
its jiter pin conflicts with the openai client the other scripts use) in TOOLS mode against a
Strata endpoint: a response model with nested models (its JSON schema references them through
`$defs`) comes back validated, 10 times at temperature 1, without instructor retrying.

python3 instructor_client.py BASE_URL MODEL MODE
"""

import sys
from typing import List, Literal

import instructor
import openai
from pydantic import BaseModel, Field

BASE, MODEL, MODE = sys.argv[1], sys.argv[2], sys.argv[3]


class Address(BaseModel):
    city: str = Field(max_length=8)
    zip: int = Field(ge=0, le=99999)


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    name: str = Field(max_length=6)


class Person(BaseModel):
    name: str = Field(max_length=8)
    home: Address
    pets: List[Pet] = Field(max_length=2)


raw = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0)
client = instructor.from_openai(raw, mode=instructor.Mode.TOOLS)
schema = Person.model_json_schema()
assert "$defs" in schema, schema
for seed in range(10):
    p = client.chat.completions.create(
        model=MODEL,
        response_model=Person,
        messages=[{"role": "user", "content": "Describe a person with a home and pets."}],
        max_tokens=300,
        temperature=1,
        seed=seed,
        max_retries=0,
    )
    assert isinstance(p, Person) and isinstance(p.home, Address), p
    print(f"ok instructor TOOLS nested ({MODE}) {seed}: {p.model_dump_json()}")
print("all checks passed")
