"""The mismatch study's fixtures (the suite's own, such as no_network and one_thread, come from the root
conftest.py)."""
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory) -> Path:
    """A tiny Hugging Face MoE (8 experts, top 2; no tokenizer) whose large weights make a flipped route change the
    output a lot, saved once for the session."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    path = tmp_path_factory.mktemp("mixtral")
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=128, initializer_range=0.2)
    MixtralForCausalLM(cfg).eval().save_pretrained(path)
    return path
