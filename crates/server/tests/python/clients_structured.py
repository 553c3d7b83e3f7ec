"""Structured outputs and tool calls through real clients against a running Switchyard server:
the official OpenAI Python client (response_format json_schema and json_object, the client's own
`parse` helper with a Pydantic model, vLLM's guided_regex / guided_choice through extra_body,
a tool-call round trip streamed and not) and LangChain's ChatOpenAI (JSON schema output and a
tool call round trip). Every JSON output is checked by the `jsonschema` package, every regex
output by Python's `re`. Arguments: base URL, the small model, the Qwen model (whose chat
template renders tools). Prints "ok" when every check passed; exits non-zero on the first
failure."""
import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import List, Literal

import jsonschema
from openai import OpenAI
from pydantic import BaseModel, Field

base, small, qwen = sys.argv[1], sys.argv[2], sys.argv[3]
client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)


def check(cond, what):
    if not cond:
        print("FAILED:", what, file=sys.stderr)
        sys.exit(1)


# Nested objects, enums, arrays, bounded strings and integers.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
PEOPLE = ["a retired sailor", "a young violinist", "a chess champion", "a baker from Lyon",
          "a software engineer", "a marathon runner", "a beekeeper", "a school teacher",
          "an astronaut", "a librarian"]
ASKS = ["Describe {} as JSON.", "Invent a profile for {}.", "Give me a record for {}.",
        "Fill in the form for {}.", "Make up details about {}."]
PROMPTS = [a.replace("{}", p) for a in ASKS for p in PEOPLE]
check(len(set(PROMPTS)) == 50, "50 different prompts")


def person_answer(model, i, prompt):
    """One request under the strict schema, streamed when i is odd: (text, finish_reason)."""
    args = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=200,
                temperature=0.7, seed=i,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    if i % 2 == 0:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


validator = jsonschema.Draft202012Validator(PERSON)
for model in (small, qwen):
    # All 50 in flight together, half of them streamed.
    with ThreadPoolExecutor(max_workers=50) as pool:
        results = list(pool.map(lambda ip: person_answer(model, *ip), enumerate(PROMPTS)))
    for i, (text, finish) in enumerate(results):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            check(False, f"{model} prompt {i}: not JSON ({e}): {text!r}")
        errors = [e.message for e in validator.iter_errors(value)]
        check(not errors, f"{model} prompt {i}: {errors} in {text!r}")
        check(finish == "stop", f"{model} prompt {i}: finish {finish}")

    # json_object: any JSON object (or, cut off by max_tokens, the start of one).
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        max_tokens=160, temperature=0, response_format={"type": "json_object"})
    t = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        check(isinstance(json.loads(t), dict), f"{model} json_object: {t!r}")
    else:
        check(r.choices[0].finish_reason == "length" and t.startswith("{"), f"{model} json_object: {t!r}")

    # vLLM's guides through extra_body.
    for seed in range(4):
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "When is the meeting?"}],
            max_tokens=20, temperature=1.0, seed=seed,
            extra_body={"guided_regex": r"(Mon|Tue|Wed|Thu|Fri) at [0-9]{2}:[0-9]{2}"})
        t = r.choices[0].message.content
        check(re.fullmatch(r"(Mon|Tue|Wed|Thu|Fri) at [0-9]{2}:[0-9]{2}", t), f"{model} regex {t!r}")
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Is the sky green?"}],
            max_tokens=8, temperature=1.0, seed=seed,
            extra_body={"guided_choice": ["yes", "no", "not sure"]})
        t = r.choices[0].message.content
        check(t in ("yes", "no", "not sure"), f"{model} choice {t!r}")


# The client's own structured-output helper: a Pydantic model in, a parsed object out.
class Address(BaseModel):
    city: str = Field(max_length=24)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    address: Address
    tags: List[str] = Field(max_length=3)


for i, prompt in enumerate(PROMPTS[:4]):
    r = client.chat.completions.parse(model=qwen, messages=[{"role": "user", "content": prompt}],
                                      response_format=Person, max_tokens=200, temperature=0.7, seed=i)
    p = r.choices[0].message.parsed
    check(isinstance(p, Person), f"parse gave {r.choices[0].message.content!r}")
    check(p.role in ("admin", "user", "guest") and 0 <= p.age <= 120, f"parsed {p}")

# A tool call round trip on Qwen, not streamed and streamed.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
USER = {"role": "user", "content": "What is the weather in Paris right now?"}
call_args = dict(model=qwen, messages=[USER], tools=[WEATHER], max_tokens=80, temperature=0,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
r = client.chat.completions.create(**call_args)
check(r.choices[0].finish_reason == "tool_calls", f"finish {r.choices[0].finish_reason}")
calls = r.choices[0].message.tool_calls
check(calls is not None and len(calls) == 1, f"tool calls {calls}")
call = calls[0]
check(call.type == "function" and call.function.name == "get_weather", f"call {call}")
args = json.loads(call.function.arguments)
jsonschema.validate(args, WEATHER["function"]["parameters"])

name, arguments, pieces, finish, ids = "", "", 0, None, []
for chunk in client.chat.completions.create(stream=True, **call_args):
    if not chunk.choices:
        continue
    d = chunk.choices[0].delta
    for tc in d.tool_calls or []:
        check(tc.index == 0, f"call index {tc.index}")
        if tc.id:
            ids.append(tc.id)
        name += (tc.function.name or "") if tc.function else ""
        piece = (tc.function.arguments or "") if tc.function else ""
        pieces += bool(piece)
        arguments += piece
    finish = chunk.choices[0].finish_reason or finish
check(finish == "tool_calls", f"streamed finish {finish}")
check(len(ids) == 1 and name == "get_weather", f"streamed ids {ids}, name {name!r}")
check(arguments == call.function.arguments, f"streamed {arguments!r} != {call.function.arguments!r}")
check(pieces >= 5, f"the arguments came in {pieces} pieces, not token by token")

history = [USER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
           {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
r = client.chat.completions.create(model=qwen, messages=history, tools=[WEATHER], tool_choice="none",
                                   max_tokens=60, temperature=0)
answer = r.choices[0].message.content or ""
check("21" in answer, f"final answer {answer!r}")
check(r.choices[0].message.tool_calls is None, "no calls with tool_choice none")

# LangChain's OpenAI chat model against the same server: structured output and a tool call.
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402

llm = ChatOpenAI(model=qwen, base_url=base + "/v1", api_key="unused", temperature=0,
                 max_tokens=200, max_retries=0, timeout=600)
structured = llm.with_structured_output(PERSON | {"title": "person"}, method="json_schema", strict=True)
value = structured.invoke("Invent a profile for a lighthouse keeper.")
check(isinstance(value, dict), f"langchain structured output {value!r}")
jsonschema.validate(value, PERSON)


@tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """Current weather in a city."""
    return json.dumps({"temperature": 21, "sky": "clear", "city": city, "unit": unit})


with_tools = llm.bind_tools([get_weather], tool_choice="get_weather")
question = HumanMessage("What is the weather in Paris right now?")
ai = with_tools.invoke([question])
check(len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "get_weather", f"langchain calls {ai.tool_calls}")
lc_args = ai.tool_calls[0]["args"]
check(lc_args.get("unit") in ("celsius", "fahrenheit") and lc_args.get("city"), f"langchain args {lc_args}")
result = get_weather.invoke(lc_args)
final = llm.bind_tools([get_weather], tool_choice="none").invoke(
    [question, ai, ToolMessage(result, tool_call_id=ai.tool_calls[0]["id"])])
check("21" in (final.content or ""), f"langchain final answer {final.content!r}")

# Streamed through LangChain, the call chunks join to the same call.
joined = None
for part in with_tools.stream([question]):
    joined = part if joined is None else joined + part
check(joined is not None and joined.tool_calls and joined.tool_calls[0]["name"] == "get_weather",
      f"langchain streamed calls {joined and joined.tool_calls}")
check(joined.tool_calls[0]["args"] == lc_args, f"langchain streamed args {joined.tool_calls[0]['args']}")
print("ok")
