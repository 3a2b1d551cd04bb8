"""Task envs: the character tokenizer, problems and answers checked against Python arithmetic, rewards by hand,
prompt splits, enumeration sizes, and the preset registry beside the bandits."""
import pytest
import torch

import toy_envs
from lab.cli import cmd_envs
from lab.errors import LabError
from toy_envs import bandits, tasks
from toy_envs.tasks import TOKENIZER

BANDITS = ["tiny_target", "tiny_parity", "small_dense", "small_bernoulli", "small_eos", "medium_target",
           "large_parity", "large_dense", "long_dense", "long_parity", "long_eos"]


def test_tokenizer_round_trip():
    assert TOKENIZER.chars == "0123456789+=," and TOKENIZER.size == 13
    for text in ["47+05=052", "3,1,2=123", "3+4+5+1=723", ""]:
        assert TOKENIZER.decode(TOKENIZER.encode(text)) == text
    assert TOKENIZER.encode("09+=,").tolist() == [0, 9, 10, 11, 12]
    assert TOKENIZER.decode(torch.tensor([[1, 10, 2], [3, 11, 4]])) == ["1+2", "3=4"]
    with pytest.raises(LabError, match="not in the vocabulary"):
        TOKENIZER.encode("1*2")


def test_problems_by_hand():
    add = toy_envs.make("add2")
    x, a = add.problems(torch.tensor([4705, 9999, 0]))
    assert TOKENIZER.decode(x) == ["47+05=", "99+99=", "00+00="] and TOKENIZER.decode(a) == ["052", "198", "000"]
    x, a = toy_envs.make("sort3").problems(torch.tensor([312, 90, 999]))
    assert TOKENIZER.decode(x) == ["3,1,2=", "0,9,0=", "9,9,9="] and TOKENIZER.decode(a) == ["123", "009", "999"]
    x, a = toy_envs.make("chain3").problems(torch.tensor([3451, 9999]))
    assert TOKENIZER.decode(x) == ["3+4+5+1=", "9+9+9+9="] and TOKENIZER.decode(a) == ["723", "876"]


def _answer(task: str, prompt: str) -> str:
    """The answer computed from the prompt text with Python."""
    body = prompt.rstrip("=")
    if task == "addition":
        a, b = body.split("+")
        return str(int(a) + int(b)).zfill(len(a) + 1)
    if task == "sorting":
        return "".join(sorted(body.split(",")))
    if task == "copy":
        return body
    digits = [int(c) for c in body.split("+")]
    return "".join(str(sum(digits[:i + 1]) % 10) for i in range(1, len(digits)))


@pytest.mark.parametrize("name", tasks.names())
def test_every_answer_matches_python(name):
    env = toy_envs.make(name)
    assert env.prompt_tokens.shape == (env.n_prompts, env.prompt_length)
    assert env.heldout_prompt_tokens.shape == (env.n_heldout, env.prompt_length)
    assert env.answers.shape == (env.n_prompts, env.length) and int(env.answers.max()) < env.vocab_size
    for prompts, answers in [(env.prompt_tokens, env.answers), (env.heldout_prompt_tokens, env.heldout_answers),
                             env.sample_problems(50, torch.Generator().manual_seed(0))]:
        for p, a in zip(TOKENIZER.decode(prompts), TOKENIZER.decode(answers)):
            assert _answer(env.task, p) == a, (p, a)


def test_rewards_by_hand():
    env = toy_envs.make("add2")
    answer = env.answers[3]
    wrong_last = answer.clone()
    wrong_last[2] = (wrong_last[2] + 1) % 10
    wrong_two = (answer + torch.tensor([1, 0, 1])) % 10
    tokens = torch.stack([answer, wrong_last, wrong_two, (answer + 1) % 10])
    prompts, mask = torch.full((4,), 3), torch.ones(4, 3)
    assert env.expected_reward(prompts, tokens, mask).tolist() == [1.0, 0.0, 0.0, 0.0]
    dense = toy_envs.make("add2_dense")
    assert dense.expected_reward(prompts, tokens, mask).tolist() == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])
    g = torch.Generator().manual_seed(0)
    assert torch.equal(dense.sample_reward(prompts, tokens, mask, g), dense.expected_reward(prompts, tokens, mask))
    held = env.expected_reward(torch.tensor([0, 1]), env.heldout_answers[:2], torch.ones(2, 3), split="heldout")
    assert held.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("name", tasks.names())
def test_enumeration_sizes(name):
    env = toy_envs.make(name)
    assert env.num_pairs == env.n_prompts * 10**env.length and env.eos is False
    if env.num_pairs > toy_envs.DEFAULT_ENUM_LIMIT:
        with pytest.raises(LabError, match="Monte Carlo"):
            env.enumerate()
        return
    prompts, tokens, mask = env.enumerate()
    assert tokens.shape == (env.num_pairs, env.length) and (mask == 1).all()
    assert len({(int(p), tuple(t.tolist())) for p, t in zip(prompts[::7], tokens[::7])}) == len(prompts[::7])
    r = env.expected_reward(prompts, tokens, mask)
    if env.reward == "target":
        assert r.sum() == env.n_prompts  # exactly one right answer per prompt
    else:
        assert r.max() == 1 and r.min() == 0 and set(r.unique().tolist()) == {0, 1 / 3, 2 / 3, 1}


def test_small_presets_enumerate_large_ones_need_monte_carlo():
    small = [n for n in tasks.names() if toy_envs.make(n).num_pairs <= toy_envs.DEFAULT_ENUM_LIMIT]
    large = [n for n in tasks.names() if n not in small]
    assert {"add2", "sort3", "chain3"} <= set(small) and {"add4", "sort6", "chain6"} <= set(large)
    assert all(toy_envs.make(n).length == 3 for n in small)


def test_copy_tasks_have_long_answers_with_per_position_credit():
    x, a = toy_envs.make("copy6").problems(torch.tensor([[3, 1, 4, 1, 5, 9], [0, 0, 0, 0, 0, 7]]))
    assert TOKENIZER.decode(x) == ["314159=", "000007="] and TOKENIZER.decode(a) == ["314159", "000007"]
    for name, T in [("copy64", 64), ("copy256", 256), ("copy1024", 1024)]:
        env = toy_envs.make(name)
        assert env.length == T and env.prompt_length == T + 1 and env.space == 10**T
        codes = torch.cat([env.heldout_codes, env.prompt_codes])
        assert codes.shape == (env.n_heldout + env.n_prompts, T)
        assert codes.unique(dim=0).shape[0] == codes.shape[0]  # distinct problems, held-out ones apart
        assert torch.equal(env.answers, env.prompt_tokens[:, :T])
    dense = toy_envs.make("copy1024_dense")
    answer = dense.answers[:1]
    wrong = answer.clone()
    wrong[0, ::4] = (wrong[0, ::4] + 1) % 10  # a quarter of the positions wrong
    tokens, prompts, mask = torch.cat([answer, wrong]), torch.zeros(2, dtype=torch.long), torch.ones(2, 1024)
    assert dense.expected_reward(prompts, tokens, mask).tolist() == [1.0, 0.75]
    assert toy_envs.make("copy1024").expected_reward(prompts, tokens, mask).tolist() == [1.0, 0.0]
    held = {tuple(r) for r in toy_envs.make("copy6", n_heldout=500).heldout_codes.tolist()}
    x, _ = toy_envs.make("copy6", n_heldout=500).sample_problems(2000, torch.Generator().manual_seed(0))
    assert not held & {tuple(r) for r in x[:, :6].tolist()}  # warm-start data never shows a held-out prompt
    x, _ = toy_envs.make("copy6", difficulty=2, n_prompts=20, n_heldout=80).sample_problems(
        300, torch.Generator().manual_seed(0))
    assert x[:, :2].unique(dim=0).shape[0] == 20  # the 80 held-out problems of 100 are never drawn
    with pytest.raises(LabError, match="at most 8192"):
        toy_envs.make("copy6", difficulty=10_000)
    with pytest.raises(LabError, match="at most 8"):
        toy_envs.make("chain6", difficulty=64)


def test_prompt_splits_are_fixed_disjoint_and_seeded():
    env = toy_envs.make("sort3")
    train, held = set(env.prompt_codes.tolist()), set(env.heldout_codes.tolist())
    assert len(train) == env.n_prompts and len(held) == env.n_heldout and not train & held
    assert torch.equal(toy_envs.make("sort3").prompt_tokens, env.prompt_tokens)  # fixed
    more = toy_envs.make("sort3", n_prompts=64)
    assert torch.equal(more.heldout_codes, env.heldout_codes)  # held-out set stays put
    assert torch.equal(more.prompt_codes[:32], env.prompt_codes)
    other = toy_envs.make("sort3", seed=1)
    assert not torch.equal(other.prompt_codes, env.prompt_codes)
    big = toy_envs.make("chain6")  # drawn from an i.i.d. stream in a space above 2^20
    codes = torch.cat([big.heldout_codes, big.prompt_codes])
    assert codes.unique().numel() == codes.numel() == big.n_prompts + big.n_heldout
    everything = toy_envs.make("sort3", difficulty=2, n_prompts=100, n_heldout=0)  # the whole space
    assert sorted(everything.prompt_codes.tolist()) == list(range(100))
    x, _ = toy_envs.make("sort3", difficulty=2, n_prompts=20, n_heldout=80).sample_problems(
        500, torch.Generator().manual_seed(0))
    held = {tuple(r) for r in toy_envs.make("sort3", difficulty=2, n_prompts=20, n_heldout=80)
            .heldout_prompt_tokens.tolist()}
    assert not held & {tuple(r) for r in x.tolist()}  # warm-start data never shows a held-out prompt
    with pytest.raises(LabError, match="fewer than"):
        toy_envs.make("sort3", difficulty=2, n_prompts=90)


def test_registry_keeps_the_bandits_and_adds_the_tasks():
    assert toy_envs.names() == BANDITS + tasks.names()
    for name in BANDITS:
        assert toy_envs.make(name) == bandits.make(name)
    assert isinstance(toy_envs.make("add2"), toy_envs.Task)
    env = toy_envs.make("chain3", difficulty=4, reward="dense")
    assert env.length == 4 and env.prompt_length == 10 and "4-step" in env.description
    with pytest.raises(LabError, match="unknown env 'nope'.*add2"):
        toy_envs.make("nope")
    with pytest.raises(LabError, match="unknown env field"):
        toy_envs.make("add2", length=5)
    with pytest.raises(LabError, match="unknown reward"):
        toy_envs.make("add2", reward="parity")
    with pytest.raises(LabError, match="positive integer"):
        toy_envs.make("add2", difficulty=0)


def test_lab_envs_lists_the_tasks(capsys):
    assert cmd_envs(None) == 0
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if row.startswith("add2 "))
    assert "32" in line and " 10 " in line and "32,000" in line and "addition" in line


@pytest.mark.slow
def test_long_answers_fit_the_transformer_and_its_memory_budget():
    """The context grows to P + T - 1 on long tasks; the training memory check counts the attention, quadratic in
    the context: copy1024 fits 8 GiB with 16 responses a rollout and is refused, one line, with 256."""
    from lab.engine.training import ROLLOUT_MEMORY_BUDGET, TrainConfig, attention_memory
    from lab.policies.transformer import SIZES, TransformerPolicy

    assert TransformerPolicy.for_env(toy_envs.make("copy6"), "small").config == SIZES["small"]
    assert TransformerPolicy.for_env(toy_envs.make("copy64"), "small").config.block_size == 128
    cfg = SIZES["small"]
    assert attention_memory(cfg, 2049, 8, 16) == 4 * 2049**2 * 4 * max(3 * 2 * 8, 2 * 16)
    small = TrainConfig(env="copy1024", policy="transformer", size="small", rollout_batch=16, group_size=4,
                        minibatches=2, steps=1)
    small.validate()
    assert attention_memory(cfg, 2049, 8, 16) < small.rollout_memory() < ROLLOUT_MEMORY_BUDGET
    with pytest.raises(LabError, match=r"needs about 100\.\d GiB .*attention"):
        TrainConfig(env="copy1024", policy="transformer", size="small", rollout_batch=256, group_size=4).validate()


@pytest.mark.slow
def test_warm_starts_of_long_tasks_go_in_micro_batches_or_are_refused():
    from lab import pretrain
    from lab.policies.transformer import TransformerPolicy, env_config, size_config

    assert pretrain.micro_batch(toy_envs.make("copy6"), size_config("small")) == pretrain.BATCH
    env = toy_envs.make("copy1024")
    micro = pretrain.micro_batch(env, env_config(env, "small"))
    assert 1 <= micro < pretrain.BATCH
    with pytest.raises(LabError, match="one sequence of 'copy6'.*GiB"):
        pretrain.pretrain(toy_envs.make("copy6", difficulty=8192, n_prompts=2, n_heldout=2), "small")
    short = toy_envs.make("copy6")
    policy = TransformerPolicy.for_env(short, "test")
    theta = policy.init_params(1.0, torch.Generator().manual_seed(0), torch.float32)
    whole = pretrain.accuracies(policy, theta, short.prompt_tokens, short.answers)
    parts = pretrain.accuracies(policy, theta, short.prompt_tokens, short.answers, chunk=7)
    assert parts == pytest.approx(whole, rel=1e-5)


@pytest.mark.slow
def test_a_run_beyond_the_budget_is_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "lab.cli", "train", "--policy", "transformer", "--env", "copy1024",
                          "--rollout-batch", "256", "--group-size", "4", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "GiB" in out.stderr
    assert not (tmp_path / "run").exists()
