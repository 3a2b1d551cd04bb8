"""Exercises whose answers the notebooks check.

Each solution is computed by the lesson's own functions when asked for (never typed in), and ``check`` compares a
student's answer with it: numbers within a relative tolerance, whole numbers exactly, choices by their letter or
their text (case and surrounding spaces ignored). The verdict renders as one line of Markdown in a notebook.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Callable

from lab.errors import LabError

KINDS = ("number", "integer", "choice")


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check: ``ok`` is True (right), False (wrong) or None (no answer yet)."""

    key: str
    ok: bool | None
    message: str

    def __bool__(self) -> bool:
        return bool(self.ok)

    def _repr_markdown_(self) -> str:
        mark = {True: "✅ **right**", False: "❌ **not yet**", None: "✏️ **no answer yet**"}[self.ok]
        return f"{mark} ({self.key}): {self.message}"

    def __repr__(self) -> str:
        mark = {True: "right", False: "not yet", None: "no answer yet"}[self.ok]
        return f"[{mark}] {self.key}: {self.message}"


@dataclass(frozen=True)
class Exercise:
    """One question. ``solution()`` computes the answer; ``check(answer)`` returns a Verdict."""

    key: str
    question: str  # Markdown
    solution: Callable[[], object]
    kind: str = "number"
    rtol: float = 0.02  # numbers: |answer - solution| <= rtol |solution| + atol
    atol: float = 1e-9
    choices: tuple = ()  # kind "choice": ((letter, text), ...)
    hint: str = ""  # shown with a wrong answer
    explanation: str = ""  # shown with the solution
    options: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise LabError(f"exercise kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "choice" and not self.choices:
            raise LabError(f"choice exercise {self.key!r} needs its choices")

    def answer(self):
        """The solution, computed now by the lesson's functions (a choice: its letter)."""
        value = self.solution()
        if self.kind == "integer":
            return int(value)
        if self.kind == "number":
            return float(value)
        return str(value)

    def _choice_letter(self, answer) -> str | None:
        text = str(answer).strip().lower().rstrip(").").strip("(")
        for letter, label in self.choices:
            if text in (letter.lower(), label.strip().lower()):
                return letter
        return None

    def check(self, answer) -> Verdict:
        if answer is None:
            return Verdict(self.key, None, "set your answer and run the cell again")
        right = self.answer()
        if self.kind == "choice":
            letter = self._choice_letter(answer)
            if letter is None:
                letters = ", ".join(letter for letter, _ in self.choices)
                return Verdict(self.key, False, f"answer with one of the letters {letters}")
            ok = letter == right
        else:
            if isinstance(answer, bool) or not isinstance(answer, numbers.Real) or not math.isfinite(answer):
                return Verdict(self.key, False, f"answer with a finite number, got {answer!r}")
            if self.kind == "integer":
                ok = float(answer).is_integer() and int(answer) == right
            else:
                ok = abs(float(answer) - right) <= self.rtol * abs(right) + self.atol
        if ok:
            return Verdict(self.key, True, self.explanation or "that is it")
        return Verdict(self.key, False, self.hint or "check the formula above and try again")

    def solution_markdown(self) -> str:
        right = self.answer()
        if self.kind == "choice":
            right = f"({right}) {dict(self.choices)[right]}"
        elif self.kind == "number":
            right = f"{right:.4g}"
        text = f"**{self.key}**: {right}"
        return text + (f". {self.explanation}" if self.explanation else "")


def question_markdown(ex: Exercise) -> str:
    """The question with its choices as a Markdown list."""
    text = ex.question
    if ex.kind == "choice":
        text += "\n\n" + "\n".join(f"- ({letter}) {label}" for letter, label in ex.choices)
    return text
