"""Shared fixtures: the real SmolLM2 tokenizer, tiny random Llama models, the default model."""

from __future__ import annotations

import pytest
import torch

import learnroute as lr
from learnroute.demo import needle_sample

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smol():
    """The default model (converted once from the bundled GGUF, then cached)."""
    return lr.load_model()


@pytest.fixture(scope="session")
def tokenizer(smol):
    return smol[1]


def make_tiny(tokenizer, n_layers: int = 4, attn: str = "sdpa", seed: int = 0):
    return lr.tiny_llama(
        len(tokenizer), n_layers, seed=seed, attn_implementation=attn, eos_token_id=tokenizer.eos_token_id
    )


@pytest.fixture(scope="session")
def tiny(tokenizer):
    return make_tiny(tokenizer)


@pytest.fixture(scope="session")
def sample(tokenizer):
    """A ~300-token needle sample: long enough for every method's window."""
    return needle_sample(tokenizer, 300, depth=0.5, seed=1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer):
    """A tiny random 4-layer Llama saved as a HF folder, with the real tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
