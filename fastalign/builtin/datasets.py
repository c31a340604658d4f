"""Small built-in data sets, generated (no download): the defaults of ``fastalign train <objective>``.

Every one is small arithmetic ("What is 3 plus 4?"), whose answer follows from the prompt, so a tiny
model visibly learns within a few dozen CPU steps: SFT's loss falls, DPO's reward accuracy rises.
"""

from __future__ import annotations

import random

_OPERATIONS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}


def _questions(count: int, seed: int) -> list[tuple[str, int, random.Random]]:
    rng = random.Random(seed)
    questions = []
    for _ in range(count):
        a, b = rng.randrange(40), rng.randrange(1, 40)
        word = rng.choice(sorted(_OPERATIONS))
        questions.append((f"What is {a} {word} {b}?", _OPERATIONS[word](a, b), rng))
    return questions


def tiny_sft_rows(count: int = 1024, seed: int = 0) -> list[dict]:
    """Prompt-completion rows: "What is 3 plus 4?" → " The answer is 7."."""
    return [
        {"prompt": prompt, "completion": f" The answer is {answer}."}
        for prompt, answer, _ in _questions(count, seed)
    ]


#: Rejected completions of the preference data: evasions a tiny model tells apart from an answer at once.
_EVASIONS = (" I do not know.", " Please ask someone else.", " That is a hard question.")


def tiny_preference_rows(count: int = 512, seed: int = 0) -> list[dict]:
    """Preference rows: the answer is chosen, an evasion rejected."""
    return [
        {"prompt": prompt, "chosen": f" The answer is {answer}.", "rejected": rng.choice(_EVASIONS)}
        for prompt, answer, rng in _questions(count, seed)
    ]


def tiny_kto_rows(count: int = 512, seed: int = 0) -> list[dict]:
    """Unpaired rows (KTO): each preference pair as a desirable and an undesirable completion."""
    rows = []
    for pair in tiny_preference_rows(count // 2, seed):
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        rows.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    return rows


def tiny_prompt_rows(count: int = 512, seed: int = 0) -> list[dict]:
    """Prompt-only rows (GRPO) with the ``answer`` column that the ``exact_match`` reward reads."""
    return [{"prompt": prompt, "answer": str(answer)} for prompt, answer, _ in _questions(count, seed)]


def digit_ratio(prompts, completions, completion_ids, **columns) -> list[float]:
    """A toy GRPO reward: the fraction of a completion's characters that are digits. Dense (a random
    tiny model already scores a little), so GRPO's mean reward visibly rises within a few CPU steps."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


#: Built-in data set names accepted as ``dataset_name``.
BUILTIN_DATASETS = {
    "tiny-sft": tiny_sft_rows,
    "tiny-preference": tiny_preference_rows,
    "tiny-kto": tiny_kto_rows,
    "tiny-prompts": tiny_prompt_rows,
}
