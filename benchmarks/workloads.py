"""The suffix decoding benchmark's workloads, built at run time; the model writes every output.

- **agent**: a multi-turn tool-calling loop. Each session asks for a trip plan; every assistant
  turn should be one JSON function call, and the loop answers it with a tool result computed
  here (deterministic made-up data), appended to the conversation for the next turn.
- **code_edit**: rewrite a function with one change. The functions are Python's own standard
  library, read with `inspect` from the interpreter running the benchmark.
- **rl**: RL rollouts, n = 8 samples at temperature 0.8 of one math prompt each.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
from dataclasses import dataclass, field
from typing import Any

AGENT_SYSTEM = (
    "You are a travel agent that acts only by calling tools. Tools:\n"
    "- get_weather(city): today's weather in a city\n"
    "- get_population(city): how many people live in a city\n"
    "- convert_currency(amount, from_currency, to_currency): money conversion\n"
    "- book_hotel(city, nights): books a hotel\n"
    "Reply with exactly one JSON object per turn and nothing else, for example:\n"
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    "After each tool result, call the next tool the plan needs."
)
AGENT_TASKS = [
    ("Lisbon", "Porto", "USD"), ("Vienna", "Salzburg", "GBP"), ("Kyoto", "Osaka", "JPY"), ("Quebec", "Montreal", "CAD"),
    ("Seville", "Granada", "CHF"), ("Bergen", "Tromso", "SEK"), ("Krakow", "Gdansk", "PLN"), ("Cusco", "Lima", "PEN"),
]
# Standard-library functions to edit: (module, qualified name, the parameter to rename).
CODE_FUNCTIONS = [
    ("shlex", "quote", "s"),
    ("fnmatch", "filter", "names"),
    ("string", "capwords", "s"),
    ("html", "escape", "s"),
    ("textwrap", "indent", "text"),
    ("colorsys", "rgb_to_hls", "r"),
    ("textwrap", "dedent", "text"),
    ("difflib", "get_close_matches", "word"),
]
RL_PROMPTS = [
    "Tom has 17 boxes with 23 apples in each box. How many apples does he have? Think step by step, "
    "then give the final answer.",
    "A shop sells pens at 3 dollars each. Anna buys 14 pens and pays with a 50 dollar note. How much "
    "change does she get? Think step by step, then give the final answer.",
]
RL_SAMPLES, RL_TEMPERATURE, RL_SEED = 8, 0.8, 1234


@dataclass(slots=True)
class AgentSession:
    city: str
    other: str
    currency: str
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [
            {"role": "system", "content": AGENT_SYSTEM},
            {"role": "user", "content": f"Plan a weekend in {self.city} and {self.other}: the weather in both, "
                                        f"the population of {self.city}, 500 {self.currency} in EUR, and a "
                                        f"hotel for 2 nights in {self.city}."},
        ]

    def answer(self, reply: str) -> None:
        """The assistant's turn, then the tool's result (or the parse error an agent would show)."""
        self.messages.append({"role": "assistant", "content": reply})
        self.messages.append({"role": "user", "content": "Tool result: " + tool_result(reply)})


def _number(text: str, low: int, high: int) -> int:
    return low + int(hashlib.sha256(text.encode()).hexdigest(), 16) % (high - low)


def tool_result(reply: str) -> str:
    """A deterministic tool answer for a JSON call (made-up data), or the error for a bad one."""
    found = re.search(r"\{.*\}", reply, re.S)
    try:
        call = json.loads(found.group(0)) if found else None
    except json.JSONDecodeError:
        call = None
    if not isinstance(call, dict) or not isinstance(call.get("arguments"), dict):
        return json.dumps({"error": "reply with one JSON object with name and arguments"})
    name, args = str(call.get("name")), call["arguments"]
    key = json.dumps(args, sort_keys=True)
    if name == "get_weather":
        return json.dumps({"city": args.get("city"), "temperature_c": _number(key, -5, 32),
                           "conditions": ["sunny", "cloudy", "rain", "windy"][_number(key, 0, 4)]})
    if name == "get_population":
        return json.dumps({"city": args.get("city"), "population": _number(key, 50_000, 3_000_000)})
    if name == "convert_currency":
        return json.dumps({"amount": args.get("amount"), "to_currency": args.get("to_currency"),
                           "result": round(_number(key, 100, 1000) * 1.07, 2)})
    if name == "book_hotel":
        return json.dumps({"city": args.get("city"), "nights": args.get("nights"),
                           "confirmation": f"H{_number(key, 10000, 99999)}"})
    return json.dumps({"error": f"unknown tool {name}"})


def agent_sessions(count: int) -> list[AgentSession]:
    return [AgentSession(*AGENT_TASKS[i % len(AGENT_TASKS)]) for i in range(count)]


def code_edit_messages(count: int) -> list[list[dict[str, str]]]:
    out = []
    for module_name, name, param in CODE_FUNCTIONS[:count]:
        module = importlib.import_module(module_name)
        source = inspect.getsource(getattr(module, name))
        out.append([{"role": "user", "content":
                     f"Here is a Python function:\n\n```python\n{source}```\n\nRewrite it with one change: rename "
                     f"the parameter `{param}` to `{param}_in` everywhere. Reply with the complete function only."}])
    return out


def rl_messages(count: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": p}] for p in RL_PROMPTS[:count]]


def sampling(kind: str, max_tokens: int) -> Any:
    from verispec import SamplingParams

    if kind == "rl":
        return SamplingParams(temperature=RL_TEMPERATURE, n=RL_SAMPLES, seed=RL_SEED, max_tokens=max_tokens)
    if kind == "code":  # the answer ends with the code block (its closing fence), as an editor reads it
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=["\n```\n"])
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)
