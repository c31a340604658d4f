"""Small real-text data sets for the real-model tests (``tests.real.model``): questions a
135M instruct model already half-knows, in TRL's conversational formats, so a first loss is a real
model's loss on real text and a few steps of training visibly move it."""

from __future__ import annotations

#: (country, capital, a wrong capital for the preference data's rejected answers)
_CAPITALS = (
    ("France", "Paris", "Lyon"),
    ("Germany", "Berlin", "Munich"),
    ("Italy", "Rome", "Milan"),
    ("Spain", "Madrid", "Barcelona"),
    ("Japan", "Tokyo", "Osaka"),
    ("Canada", "Ottawa", "Toronto"),
    ("Australia", "Canberra", "Sydney"),
    ("Egypt", "Cairo", "Alexandria"),
    ("Brazil", "Brasília", "Rio de Janeiro"),
    ("Kenya", "Nairobi", "Mombasa"),
    ("Norway", "Oslo", "Bergen"),
    ("Portugal", "Lisbon", "Porto"),
    ("Greece", "Athens", "Thessaloniki"),
    ("Poland", "Warsaw", "Kraków"),
    ("India", "New Delhi", "Mumbai"),
    ("Turkey", "Ankara", "Istanbul"),
)


def _question(country: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the capital of {country}?"}]


def _answer(country: str, city: str) -> list[dict]:
    return [{"role": "assistant", "content": f"The capital of {country} is {city}."}]


def real_sft_rows() -> list[dict]:
    """Conversational prompt-completion rows: "What is the capital of France?" → "The capital of
    France is Paris."."""
    return [
        {"prompt": _question(country), "completion": _answer(country, capital)}
        for country, capital, _ in _CAPITALS
    ]


def real_preference_rows() -> list[dict]:
    """Conversational preference rows: the right capital chosen, a large city that is not it rejected."""
    return [
        {
            "prompt": _question(country),
            "chosen": _answer(country, capital),
            "rejected": _answer(country, wrong),
        }
        for country, capital, wrong in _CAPITALS
    ]


def real_prompt_rows() -> list[dict]:
    """Conversational prompt-only rows (GRPO) with the ``answer`` column that ``contains_answer`` reads."""
    return [{"prompt": _question(country), "answer": capital} for country, capital, _ in _CAPITALS]
