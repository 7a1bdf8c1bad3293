"""Writes tiny_chat.jsonl (160 conversations) and tiny_chat_eval.jsonl (24): short, made-up chats in the format
TRL and the OpenAI API use (system / user / assistant / tool roles), for `examples/sft_qwen3_moe_lora.yaml`.
Deterministic: `python examples/data/make_tiny_chat.py` rewrites the same files."""

import json
import random
from pathlib import Path

CAPITALS = {"France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo", "Egypt": "Cairo",
            "Canada": "Ottawa", "Peru": "Lima", "Kenya": "Nairobi", "Norway": "Oslo", "Chile": "Santiago"}
OPPOSITES = {"hot": "cold", "up": "down", "big": "small", "fast": "slow", "light": "dark", "early": "late",
             "open": "closed", "full": "empty", "happy": "sad", "old": "new"}
SOUNDS = {"cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa", "owl": "hoot"}
WEATHER = {"Paris": "sunny, 21 C", "Oslo": "snow, -3 C", "Lima": "cloudy, 18 C", "Tokyo": "rain, 15 C"}
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def conversation(rng: random.Random) -> dict:
    kind = rng.choice(["add", "capital", "opposite", "sound", "two_turns", "system", "tool", "spell"])
    if kind == "add":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return {"messages": [user(f"What is {a} plus {b}?"), assistant(f"{a} plus {b} is {a + b}.")]}
    if kind == "capital":
        country = rng.choice(sorted(CAPITALS))
        return {"messages": [user(f"What is the capital of {country}?"),
                             assistant(f"The capital of {country} is {CAPITALS[country]}.")]}
    if kind == "opposite":
        word = rng.choice(sorted(OPPOSITES))
        return {"messages": [user(f"What is the opposite of {word}?"),
                             assistant(f"The opposite of {word} is {OPPOSITES[word]}.")]}
    if kind == "sound":
        animal = rng.choice(sorted(SOUNDS))
        return {"messages": [user(f"What sound does a {animal} make?"), assistant(f"A {animal} says {SOUNDS[animal]}.")]}
    if kind == "two_turns":
        a, b = rng.randint(1, 5), rng.randint(1, 5)
        return {"messages": [user(f"What is {a} plus {b}?"), assistant(f"{a} plus {b} is {a + b}."),
                             user("And times two?"), assistant(f"{a + b} times two is {2 * (a + b)}.")]}
    if kind == "system":
        country = rng.choice(sorted(CAPITALS))
        return {"messages": [{"role": "system", "content": "Answer with one word."},
                             user(f"Capital of {country}?"), assistant(f"{CAPITALS[country]}.")]}
    if kind == "tool":
        city = rng.choice(sorted(WEATHER))
        call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
        return {"messages": [user(f"What is the weather in {city}?"),
                             {"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "content": WEATHER[city]},
                             assistant(f"In {city} it is {WEATHER[city]}.")]}
    n = rng.randint(0, 10)
    return {"messages": [user(f"Spell the number {n}."), assistant(f"{n} is spelled {NUMBERS[n]}.")]}


def write(path: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps(conversation(rng)) + "\n")


if __name__ == "__main__":
    here = Path(__file__).parent
    write(here / "tiny_chat.jsonl", 160, seed=0)
    write(here / "tiny_chat_eval.jsonl", 24, seed=1)
