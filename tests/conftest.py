"""Shared fixtures: the real SmolLM2 tokenizer, tiny random Llama models, the default model.

Marker ``slow``: the test runs the default model, SmolLM2-135M-Instruct (fixture ``smol``,
``lr.load_model()``, or a command without ``model=``), seconds to minutes each on 2 CPU
cores. ``pytest -m "not slow"`` is the quick loop: tiny random models and the real
tokenizer only (the ``tokenizer`` fixture loads the tokenizer files, not the weights).
A test that asks for ``smol`` is marked slow here even if its decorator is forgotten.
"""

from __future__ import annotations

import pytest
import torch

import learnroute as lr
from learnroute.demo import needle_sample
from learnroute.models import default_model_dir

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smol():
    """The default model (converted once from the bundled GGUF, then cached)."""
    return lr.load_model()


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer alone (converting the model once if it never was)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "smol" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


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


# The per-layer recipe that was TrainConfig's default before the recommended one (issue 57):
# tests of per-layer mixtures over methods that need no keydiff candidate pin it.
PER_LAYER = {"learn": "both", "granularity": "layer", "init_method": None, "stages": "one"}
