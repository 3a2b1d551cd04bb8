"""The README's code for writing the neutral format from verl, TRL, AReaL and tinker runs as printed, on stand-ins
holding each framework's fields with their shapes and dtypes, and the log it writes reads back."""
import re
import types
from pathlib import Path

import numpy as np
import torch

from lab.diagnose import diagnose

README = Path(__file__).resolve().parents[1] / "README.md"
B, T = 8, 6


def snippets() -> dict:
    section = README.read_text().split("### Your own run", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    head, *parts = re.split(r"\n(?=# (?:verl|TRL|AReaL|tinker)\b)", code)
    out = {p[2:].split()[0].rstrip(":"): p for p in parts}
    out["tinker"], out["close"] = out["tinker"].split("\nlog.close()")
    return {"head": head, **out}


def test_readme_writer_code_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = snippets()
    assert set(code) == {"head", "verl", "TRL", "AReaL", "tinker", "close"}
    g = torch.Generator().manual_seed(0)
    lp = lambda: -torch.rand(B, T, generator=g)  # noqa: E731
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).long()
    tokens = lambda: torch.randint(0, 50, (B, T), generator=g)  # noqa: E731
    ns = {"torch": torch, "np": np}
    exec(code["head"], ns)

    batch = types.SimpleNamespace(  # verl's DataProto after compute_advantage
        batch={"responses": tokens(), "response_mask": mask, "rollout_log_probs": lp().bfloat16(),
               "old_log_probs": lp(), "advantages": torch.randn(B, T), "token_level_scores": torch.rand(B, T)},
        non_tensor_batch={"uid": np.array(list("aabbccdd"), dtype=object)})
    exec(code["verl"], dict(ns, self=types.SimpleNamespace(global_steps=1), batch=batch))

    class GRPOTrainer:  # what TRL's _generate_and_score_completions returns
        state = types.SimpleNamespace(global_step=2)

        def _generate_and_score_completions(self, inputs):
            return {"completion_ids": tokens(), "completion_mask": mask, "sampling_per_token_logps": lp(),
                    "old_per_token_logps": lp(), "advantages": torch.randn(B)}

    trl = dict(ns, GRPOTrainer=GRPOTrainer)
    exec(code["TRL"], trl)
    trainer = trl["LoggingGRPOTrainer"]()
    for _ in range(2):  # two generation batches in one optimiser step
        trainer._generate_and_score_completions(None)

    areal = {"input_ids": tokens(), "loss_mask": mask, "logprobs": lp(), "prox_logp": lp(),
             "versions": torch.randint(0, 3, (B, T)), "advantages": torch.randn(B, T), "rewards": torch.rand(B)}
    exec(code["AReaL"], dict(ns, batch=areal, global_step=3))

    tensor = lambda t: types.SimpleNamespace(to_torch=lambda: t)  # noqa: E731  tinker's TensorData
    lengths = (3, 5, 4)
    data = [types.SimpleNamespace(loss_fn_inputs={"target_tokens": tensor(torch.randint(0, 50, (n,))),
                                                  "mask": tensor(torch.ones(n)), "logprobs": tensor(-torch.rand(n)),
                                                  "advantages": tensor(torch.full((n,), 0.5))}) for n in lengths]
    exec(code["tinker"], dict(ns, data_D=data, training_logprobs_D=[-torch.rand(n) for n in lengths], i_batch=4))
    ns["log"].close()

    d = diagnose(tmp_path / "rollout_log", progress=False)
    assert d.summary["n_steps"] == 4 and d.summary["n_sequences"] == 4 * B + len(lengths)
