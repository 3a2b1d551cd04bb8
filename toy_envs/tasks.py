"""Synthetic tasks with verifiable rewards, written in a character-level vocabulary, as lab environments.

Vocabulary (``TOKENIZER``, 13 ids): the digits "0".."9" are ids 0..9, then "+" (10), "=" (11), "," (12). Responses
are digits only, so an env's response vocabulary is V = 10 (ids 0..9; larger with ``distractors``, below) and a
response of T tokens has 10^T possible values; prompts use every id. Each task has a fixed prompt length P and
answer length T:

- ``addition`` (difficulty d, digits per operand): "47+05=" -> "052": a + b with both operands zero-padded to d
  digits and the sum to d + 1 digits. P = 2d + 2, T = d + 1, 10^(2d) problems.
- ``sorting`` (difficulty L, list length): "3,1,2=" -> "123": the digits in ascending order. P = 2L, T = L,
  10^L problems.
- ``chain`` (difficulty k, steps): "3+4+5+1=" -> "723": running sums mod 10, s_i = (a_0 + ... + a_i) mod 10 for
  i = 1..k; each answer digit needs the one before it (multi-step). P = 2k + 2, T = k, 10^(k+1) problems.
- ``copy`` (difficulty T, digits): "3141=" -> "3141": the prompt's digits repeated. P = T + 1, T from 1 to
  ``COPY_MAX`` (answers of a thousand tokens and more), 10^T problems. Answer token t sits T + 1 positions after
  its source, so every position needs the same long-range look-up; with the ``dense`` reward each of the T
  positions earns its own credit.

Problems are numbered by ``codes``: one integer per problem (addition, sorting, chain: difficulty at most 8), or
for ``copy`` the problem's T digits themselves, a row [T] (10^T problems do not fit an integer at T > 18).

Vocabulary size (``distractors``, default 0). A task's response vocabulary is the first V token ids, V = 10 +
``distractors``: with d > 0 the digits are joined by d wrong tokens, first the prompt's symbols "+", "=", ","
(ids 10..12), then fresh ids 13.. that appear in no prompt (decoded as "#"). No answer ever holds one, so a model
trained on the task learns to put almost no probability on them, as a language model puts almost none on most of
its vocabulary; only the size of the space the policy spreads its mass over changes. This is how the lab varies V on
a real task without changing the task itself (the on-policy distillation study, ``lab.engine.distill``). A model of
the task needs max(13, V) token ids (``lab.policies.transformer.env_config`` grows the embedding to fit).

Each env holds ``n_prompts`` training prompts and ``n_heldout`` held-out prompts, disjoint, drawn without
replacement with the env's ``seed`` (held-out first, so the held-out set does not move when ``n_prompts``
changes): ``prompt_tokens`` [n_prompts, P], ``answers`` [n_prompts, T] and ``heldout_prompt_tokens``,
``heldout_answers``. Prompt ids index the training set. Rewards (deterministic, verifiable):

- ``target``: 1 if the response equals the answer, else 0 (exact match);
- ``dense``: the fraction of answer positions right, (1/T) sum_t 1[y_t = a_t] (per-position partial credit).

The env interface is ``toy_envs.bandits.SequenceBandit``'s (no end token: every response has T tokens).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
from lab.lazy import torch

from lab.errors import LabError
from toy_envs.bandits import DEFAULT_ENUM_LIMIT


class CharTokenizer:
    """One token per character of ``chars`` (id = position)."""

    def __init__(self, chars: str):
        self.chars = chars
        self.ids = {c: i for i, c in enumerate(chars)}

    @property
    def size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        bad = sorted(set(text) - set(self.ids))
        if bad:
            raise LabError(f"characters {''.join(bad)!r} are not in the vocabulary {self.chars!r}")
        return torch.tensor([self.ids[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        """A string for a 1-d sequence of ids; a list of strings for a 2-d batch."""
        ids = np.asarray(ids.cpu() if hasattr(ids, "cpu") else ids)
        if ids.ndim > 1:
            return [self.decode(row) for row in ids]
        return "".join(self.chars[int(i)] for i in ids)


TOKENIZER = CharTokenizer("0123456789+=,")
PLUS, EQUALS, COMMA = (TOKENIZER.ids[c] for c in "+=,")
TASKS = ("addition", "sorting", "chain", "copy")
COPY_MAX = 8192  # the longest copy answer (T); memory is checked where a model runs on it
TASK_REWARDS = ("target", "dense")
INSTRUCTIONS = {
    "addition": "Add the two numbers; answer with the sum zero-padded to {T} digits.",
    "sorting": "Sort the digits in ascending order; answer with the {T} sorted digits.",
    "chain": "Answer with the running sums mod 10 after each addition ({T} digits).",
    "copy": "Repeat the {T} digits.",
}


def _digits(x: np.ndarray, n: int) -> np.ndarray:
    """Base-10 digits of integers x [N], most significant first: [N, n]."""
    powers = 10 ** np.arange(n - 1, -1, -1, dtype=np.int64)
    return x[:, None] // powers % 10


def _interleave(digits: np.ndarray, sep: int, end: int) -> np.ndarray:
    """d0 sep d1 sep ... d_{n-1} end: [N, 2n]."""
    N, n = digits.shape
    out = np.full((N, 2 * n), sep, dtype=np.int64)
    out[:, 0::2] = digits
    out[:, -1] = end
    return out


@dataclass(frozen=True)
class Task:
    """A task env (see the module doc). ``difficulty``: digits per operand (addition), list length (sorting),
    steps (chain) or digits (copy)."""

    name: str
    task: str = "addition"
    difficulty: int = 2
    n_prompts: int = 32
    n_heldout: int = 64
    reward: str = "target"
    seed: int = 0
    description: str = ""
    distractors: int = 0  # wrong tokens added to the response vocabulary (see the module doc): V = 10 + distractors

    eos = False

    def __post_init__(self):
        if self.task not in TASKS:
            raise LabError(f"unknown task {self.task!r}; choose one of {', '.join(TASKS)}")
        if self.reward not in TASK_REWARDS:
            raise LabError(f"unknown reward {self.reward!r} for a task env; choose one of {', '.join(TASK_REWARDS)}")
        for field in ("difficulty", "n_prompts"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LabError(f"env field {field} must be a positive integer, got {value!r}")
        if not isinstance(self.distractors, int) or isinstance(self.distractors, bool) or \
                not 0 <= self.distractors <= 1_000_000:
            raise LabError(f"env field distractors must be a whole number from 0 to 1,000,000, got "
                           f"{self.distractors!r}")
        if not isinstance(self.n_heldout, int) or isinstance(self.n_heldout, bool) or self.n_heldout < 0:
            raise LabError(f"env field n_heldout must be a non-negative integer, got {self.n_heldout!r}")
        cap = COPY_MAX if self.task == "copy" else 8
        if self.difficulty > cap:
            raise LabError(f"difficulty {self.difficulty} is too large for task {self.task}; use at most {cap}")
        if self.n_prompts + self.n_heldout > self.space:
            raise LabError(f"task {self.task} at difficulty {self.difficulty} has {self.space:,} problems, fewer "
                           f"than n_prompts + n_heldout = {self.n_prompts + self.n_heldout:,}")

    # ---- sizes ----
    @property
    def vocab_size(self) -> int:
        """V, the response vocabulary: the 10 digits and the distractors."""
        return 10 + self.distractors

    @property
    def length(self) -> int:
        """T, the answer length."""
        return self.difficulty + (self.task == "addition")

    @property
    def prompt_length(self) -> int:
        return {"addition": 2 * self.difficulty + 2, "sorting": 2 * self.difficulty,
                "chain": 2 * self.difficulty + 2, "copy": self.difficulty + 1}[self.task]

    @property
    def space(self) -> int:
        """How many distinct problems the task has."""
        return 10 ** {"addition": 2 * self.difficulty, "sorting": self.difficulty, "chain": self.difficulty + 1,
                      "copy": self.difficulty}[self.task]

    @property
    def rows(self) -> bool:
        """Whether a problem's code is a row of digits (copy) rather than one integer."""
        return self.task == "copy"

    @property
    def tokenizer(self) -> CharTokenizer:
        return TOKENIZER

    @property
    def instruction(self) -> str:
        """The task in words (for models that need to be told, e.g. a pretrained LM)."""
        return INSTRUCTIONS[self.task].format(T=self.length)

    @property
    def sequences_per_prompt(self) -> int:
        return self.vocab_size**self.length

    @property
    def num_pairs(self) -> int:
        return self.n_prompts * self.sequences_per_prompt

    # ---- problems ----
    def problems(self, codes) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt tokens [N, P] and answers [N, T] (long tensors) of problem numbers ``codes`` [N] in range(space)
        (copy: digit rows [N, T])."""
        prompts, answers = self.problem_arrays(codes)
        return torch.from_numpy(prompts), torch.from_numpy(answers)

    def problem_arrays(self, codes) -> tuple[np.ndarray, np.ndarray]:
        """``problems`` as int64 numpy arrays (the definition of the task's problems)."""
        if self.rows:
            digits = np.asarray(codes, dtype=np.int64).reshape(-1, self.difficulty)
            return np.concatenate([digits, np.full((len(digits), 1), EQUALS)], 1), digits.copy()
        codes = np.asarray(codes, dtype=np.int64).reshape(-1)
        d, N = self.difficulty, codes.shape[0]
        if self.task == "addition":
            a, b = codes // 10**d, codes % 10**d
            cols = [_digits(a, d), np.full((N, 1), PLUS), _digits(b, d), np.full((N, 1), EQUALS)]
            return np.concatenate(cols, 1).astype(np.int64), _digits(a + b, d + 1)
        digits = _digits(codes, d if self.task == "sorting" else d + 1)
        if self.task == "sorting":
            return _interleave(digits, COMMA, EQUALS), np.sort(digits, axis=1)
        return _interleave(digits, PLUS, EQUALS), digits.cumsum(1)[:, 1:] % 10

    @property
    def example(self) -> str:
        """The first training problem with its answer, as text (numpy only: listing envs loads no torch)."""
        prompt, answer = self.problem_arrays(_codes(self)[self.n_heldout:self.n_heldout + 1])
        return f"{TOKENIZER.decode(prompt[0])}{TOKENIZER.decode(answer[0])}"

    def _split(self):
        return _split(self)

    @property
    def prompt_codes(self) -> torch.Tensor:
        return self._split()[1]

    @property
    def heldout_codes(self) -> torch.Tensor:
        return self._split()[0]

    @property
    def prompt_tokens(self) -> torch.Tensor:
        """The training prompts [n_prompts, P] (prompt id i is row i)."""
        return self._split()[2]

    @property
    def answers(self) -> torch.Tensor:
        return self._split()[3]

    @property
    def heldout_prompt_tokens(self) -> torch.Tensor:
        """Held-out prompts [n_heldout, P], disjoint from the training prompts (for evaluation)."""
        return self._split()[4]

    @property
    def heldout_answers(self) -> torch.Tensor:
        return self._split()[5]

    def sample_problems(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """n problems drawn uniformly from the task's space without the held-out ones (training data for a
        warm start): prompt tokens [n, P], answers [n, T]."""
        held = self.heldout_codes
        codes = torch.empty((0, self.difficulty) if self.rows else 0, dtype=torch.long)
        while codes.shape[0] < n:  # rejection of the held-out codes; one round unless they are most of the space
            if self.rows:
                draw = torch.randint(10, (2 * n, self.difficulty), generator=generator)
                seen = torch.zeros(2 * n, dtype=torch.bool)
                for row in held:  # n_heldout comparisons of [2n, T]
                    seen |= (draw == row).all(-1)
            else:
                draw = torch.randint(self.space, (2 * n,), generator=generator)
                seen = torch.isin(draw, held)
            codes = torch.cat([codes, draw[~seen]])
        return self.problems(codes[:n])

    # ---- the env interface ----
    def check_enumerable(self, limit: int = DEFAULT_ENUM_LIMIT) -> None:
        if self.num_pairs > limit:
            raise LabError(
                f"env {self.name!r} has {self.num_pairs:,} (prompt, response) pairs, above the enumeration limit "
                f"{limit:,}; use Monte Carlo mode (--reference mc) or raise the limit (--enum-limit)")

    def enumerate(self, limit: int = DEFAULT_ENUM_LIMIT):
        """All (prompt, response) pairs: prompts [N], tokens [N, T] (long), mask [N, T] (float64, all ones)."""
        self.check_enumerable(limit)
        return _enumerate(self)

    def mask_of(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.ones(tokens.shape, dtype=torch.float64)

    def expected_reward(self, prompts, tokens, mask, split: str = "train") -> torch.Tensor:
        """The reward [N] (float64) of responses ``tokens`` [N, T] to prompt ids ``prompts`` [N] of ``split``
        (train or heldout): exact match (target) or the fraction of positions right (dense)."""
        answers = {"train": self.answers, "heldout": self.heldout_answers}[split]
        right = (tokens == answers[prompts]).double() * mask.double()
        if self.reward == "target":
            return (right.sum(-1) == self.length).double()
        return right.sum(-1) / self.length

    def sample_reward(self, prompts, tokens, mask, generator: torch.Generator) -> torch.Tensor:
        """The verifier's reward: deterministic, so the expected reward itself."""
        return self.expected_reward(prompts, tokens, mask)

    def decode(self, tokens) -> str | list[str]:
        tokens = torch.as_tensor(tokens)
        if self.distractors and tokens.numel() and int(tokens.max()) >= TOKENIZER.size:  # fresh ids: "#"
            return CharTokenizer(TOKENIZER.chars + "#" * (self.vocab_size - TOKENIZER.size)).decode(tokens)
        return TOKENIZER.decode(tokens)


@functools.lru_cache(maxsize=32)
def _split(env: Task):
    """(held-out codes, training codes, their prompts and answers), as tensors."""
    codes = torch.as_tensor(_codes(env), dtype=torch.long)
    held, train = codes[:env.n_heldout], codes[env.n_heldout:]
    return (held, train, *env.problems(train), *env.problems(held))


@functools.lru_cache(maxsize=32)
def _codes(env: Task) -> np.ndarray:
    """The held-out then the training problem numbers: the first n_heldout + n_prompts values of a seeded random
    order of the space (a permutation for small spaces, else the distinct values of an i.i.d. stream in order of
    first appearance)."""
    rng = np.random.default_rng([env.seed, TASKS.index(env.task), env.difficulty])
    need = env.n_heldout + env.n_prompts
    if env.rows and env.space <= 2**20:  # digit rows of a permutation of a small space
        return _digits(rng.permutation(env.space)[:need], env.difficulty)
    if env.rows:  # distinct digit rows in order of first appearance
        stream = rng.integers(10, size=(need + 64, env.difficulty))
        _, first = np.unique(stream, axis=0, return_index=True)
    elif env.space <= 2**20:
        return rng.permutation(env.space)[:need]
    else:
        stream = rng.integers(env.space, size=4 * need + 64)  # collisions are rare in spaces above 2^20
        _, first = np.unique(stream, return_index=True)
    codes = stream[np.sort(first)][:need]
    if len(codes) < need:
        raise LabError(f"could not draw {need:,} distinct problems from {env.space:,}; ask for fewer prompts")
    return codes


@functools.lru_cache(maxsize=8)
def _enumerate(env: Task):
    V, T = env.vocab_size, env.length
    grid = torch.cartesian_prod(*[torch.arange(V)] * T).reshape(-1, T) if T > 1 else torch.arange(V)[:, None]
    prompts = torch.arange(env.n_prompts).repeat_interleave(grid.shape[0])
    tokens = grid.repeat(env.n_prompts, 1)
    return prompts, tokens, torch.ones(tokens.shape, dtype=torch.float64)


def _described(t: Task) -> Task:
    d = t.difficulty
    words = {"addition": f"{d}-digit addition", "sorting": f"sorting {d} digits",
             "chain": f"{d}-step running sums mod 10", "copy": f"copying {d} digits"}[t.task]
    example = t.example if t.length <= 16 else f"{t.example[:8]}…{t.example[-8:]} ({t.prompt_length} + {d} tokens)"
    credit = "exact match" if t.reward == "target" else "per-position partial credit"
    extra = f"; V = {t.vocab_size} ({t.distractors} distractor tokens)" if t.distractors else ""
    return dataclasses.replace(t, description=f"{words}, e.g. {example}; {credit}; {t.n_heldout} held out{extra}")


def _preset(name, task, difficulty, n_prompts, reward="target", n_heldout=64):
    return _described(Task(name, task, difficulty, n_prompts, n_heldout, reward=reward))


PRESETS = {
    p.name: p
    for p in [
        _preset("add2", "addition", 2, 32),
        _preset("add2_dense", "addition", 2, 32, "dense"),
        _preset("sort3", "sorting", 3, 32),
        _preset("sort3_dense", "sorting", 3, 32, "dense"),
        _preset("chain3", "chain", 3, 32),
        _preset("chain3_dense", "chain", 3, 32, "dense"),
        _preset("add4", "addition", 4, 128),
        _preset("sort6", "sorting", 6, 128),
        _preset("chain6", "chain", 6, 128),
        _preset("copy6", "copy", 6, 128),
        _preset("copy64", "copy", 64, 128),
        _preset("copy64_dense", "copy", 64, 128, "dense"),
        _preset("copy256", "copy", 256, 128),
        _preset("copy1024", "copy", 1024, 16, n_heldout=16),
        _preset("copy1024_dense", "copy", 1024, 16, "dense", n_heldout=16),
    ]
}


def names() -> list[str]:
    return list(PRESETS)


def make(name: str, **overrides) -> Task:
    """A named task preset with fields overridden by keyword (``make('add2', n_prompts=64)``)."""
    if name not in PRESETS:
        raise LabError(f"unknown task env {name!r}; known: {', '.join(PRESETS)}")
    from lab.typed import check_overrides

    overrides = check_overrides(Task, overrides, "env field", fixed=("name", "description"))
    return _described(dataclasses.replace(PRESETS[name], **overrides)) if overrides else PRESETS[name]
