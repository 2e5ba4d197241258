"""Decode-time LoRA adapters (peft): trained with a route, active only after compression.

A route decides what the cache keeps; an adapter can teach the model to read the
compressed cache. It acts on the tokens decoded after compression (question and answer)
only: the prefill runs with every adapter off, so the cached keys and values are exactly
the base model's, and compression, KV bytes and the prefill-once design are unchanged.

An adapter is peft LoRA (rank, alpha, target modules such as ``q_proj`` or ``down_proj``;
dropout 0) injected into the model in place (:func:`peft.inject_adapter_in_model`); with
it off, every LoRA layer returns its base layer's output unchanged. On disk it is peft's
own format (``adapter_config.json`` and ``adapter_model.safetensors``, keys prefixed
``base_model.model.``), so ``peft.PeftModel.from_pretrained(model, folder)`` loads it too.
A route names its adapter in ``provenance["adapter"]`` (a folder relative to the route
file, see :class:`learnroute.route.Route`).

Switching (everything restores the model in ``finally``):

- :func:`using` (context manager): inside, one adapter on (attached first if needed,
  detached again at exit) or every adapter off (``None``);
- :func:`adapters_off`: the prefill's scope (free when peft was never imported);
- :func:`attached`: attach several adapters for a block (the engine's decode batches);
- :func:`set_active` (no scope): what :class:`learnroute.RoutedPress` leaves for
  kvpress's decoding, which runs after the press context; :func:`adapter_scope` undoes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from learnroute.route import RouteError

ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_TARGETS = ["gate_proj", "up_proj", "down_proj"]
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # what peft's PeftModel.save_pretrained puts before every key
_REGISTRY = "_learnroute_adapters"  # model attribute: name -> Adapter attached to it


class AdapterError(RouteError):
    """An adapter that cannot be used: missing folder, wrong format, made for another model."""


def lora_config(rank: int, alpha: float, targets: list[str], base_model: str | None = None):
    """peft LoraConfig of a decode-time adapter (dropout 0: training and decoding agree)."""
    from peft import LoraConfig

    return LoraConfig(
        r=int(rank),
        lora_alpha=alpha,
        target_modules=list(targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


@dataclass(eq=False)
class Adapter:
    """A LoRA adapter: peft config, weights, and where it came from.

    ``state`` maps peft's state-dict keys without prefix or adapter name (e.g.
    ``model.layers.0.self_attn.q_proj.lora_A.weight``) to tensors. Attached to a model
    it lives there as adapter ``name``; the live weights are then the model's.
    """

    config: Any  # peft.LoraConfig
    state: dict[str, torch.Tensor]
    path: Path | None = None
    name: str = field(default="")

    @classmethod
    def new(cls, rank: int, alpha: float, targets: list[str], base_model: str | None = None) -> Adapter:
        """A fresh adapter: attached to a model, its weights are peft's LoRA init (B = 0,
        so the model's outputs are unchanged until it trains)."""
        return cls(lora_config(rank, alpha, targets, base_model), {})

    def __post_init__(self) -> None:
        if not self.name:
            seed = str(self.path.resolve()) if self.path is not None else str(id(self))
            self.name = "lr" + hashlib.sha1(seed.encode()).hexdigest()[:12]

    # ------------------------------------------------------------------ disk

    @classmethod
    def load(cls, path: str | Path) -> Adapter:
        """Read an adapter folder (peft format, safetensors); clear errors for a missing
        folder or files, another peft method, or non-LoRA weights."""
        from peft import PeftConfig
        from safetensors.torch import load_file

        path = Path(path)
        if not path.is_dir():
            raise AdapterError(f"adapter folder {path} does not exist")
        problems = [f"{path / f} is missing" for f in (CONFIG_FILE, WEIGHTS_FILE) if not (path / f).is_file()]
        if problems:
            raise AdapterError(f"{path} is not a peft adapter folder:\n  " + "\n  ".join(problems))
        try:
            config = PeftConfig.from_pretrained(str(path))
        except Exception as e:  # noqa: BLE001 (peft raises several types for a bad config)
            raise AdapterError(f"{path / CONFIG_FILE}: cannot be read as a peft config: {e}") from None
        if str(getattr(config, "peft_type", "")) not in ("LORA", "PeftType.LORA"):
            raise AdapterError(f"{path} holds a {config.peft_type} adapter; learnroute runs LoRA adapters")
        state = {k.removeprefix(PREFIX): v for k, v in load_file(str(path / WEIGHTS_FILE)).items()}
        bad = sorted(k for k in state if not k.endswith((".lora_A.weight", ".lora_B.weight")))
        if bad or not state:
            what = f"weights other than LoRA A/B matrices ({bad[:3]})" if bad else "no weights"
            raise AdapterError(f"{path / WEIGHTS_FILE} holds {what}")
        return cls(config, state, path)

    def save(self, path: str | Path, model: nn.Module | None = None) -> Path:
        """Write the adapter folder in peft's format (the live weights of ``model`` if it is
        attached there, else ``state``)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = read_state(model, self) if model is not None and self.name in _registry(model) else self.state
        self.config.save_pretrained(str(path))
        tensors = {PREFIX + k: v.detach().cpu().contiguous() for k, v in sorted(state.items())}
        tmp = path / f".{WEIGHTS_FILE}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(path / WEIGHTS_FILE)
        return path

    # ------------------------------------------------------------------ checks

    @property
    def base_model(self) -> str | None:
        return getattr(self.config, "base_model_name_or_path", None)

    def problems(self, model: nn.Module, model_name: str | None = None) -> list[str]:
        """Why this adapter does not fit ``model`` (empty if it does): another base model
        name, target modules that do not exist or are not linear, shapes that differ."""
        problems = []
        if self.base_model and model_name and Path(self.base_model).name != Path(model_name).name:
            problems.append(f"adapter was made for model {Path(self.base_model).name!r}, not {Path(model_name).name!r}")
        modules = dict(model.named_modules())
        ranks = set()
        for key, tensor in sorted(self.state.items()):
            where, _, kind = key.rpartition(".lora_")
            module = _base_layer(modules.get(where))
            if module is None:
                problems.append(f"{key}: the model has no module {where!r}")
                continue
            if not isinstance(module, nn.Linear):
                problems.append(f"{key}: {where!r} is a {type(module).__name__}, not a linear layer")
                continue
            if tensor.dim() != 2:
                problems.append(f"{key}: expected a matrix, got shape {tuple(tensor.shape)}")
                continue
            if kind == "A.weight":
                ranks.add(tensor.shape[0])
                if tensor.shape[1] != module.in_features:
                    problems.append(
                        f"{key}: shape {tuple(tensor.shape)} does not fit {where!r} ({module.in_features} inputs)"
                    )
            else:
                ranks.add(tensor.shape[1])
                if tensor.shape[0] != module.out_features:
                    problems.append(
                        f"{key}: shape {tuple(tensor.shape)} does not fit {where!r} ({module.out_features} outputs)"
                    )
            if len(problems) >= 12:
                problems.append("...")
                break
        return problems

    def check(self, model: nn.Module, model_name: str | None = None) -> None:
        """Raise :class:`AdapterError` listing every problem, before any forward."""
        problems = self.problems(model, model_name)
        if problems:
            where = f" {self.path}" if self.path is not None else ""
            raise AdapterError(f"adapter{where} does not fit the model:\n  " + "\n  ".join(problems))


def _base_layer(module: nn.Module | None) -> nn.Module | None:
    """The original layer of a LoRA-wrapped one (or the module itself)."""
    if module is None:
        return None
    get = getattr(module, "get_base_layer", None)
    return get() if callable(get) else module


# ---------------------------------------------------------------------------- model state


def _registry(model: nn.Module, create: bool = False) -> dict[str, Adapter]:
    """Adapters attached to ``model`` (by name); the attribute exists only while some are."""
    if create:
        return model.__dict__.setdefault(_REGISTRY, {})
    return model.__dict__.get(_REGISTRY) or {}


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    """Every peft layer in the model (none, without importing peft, if peft never was)."""
    if "peft" not in sys.modules or not _registry(model):
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def _lora_params(model: nn.Module, name: str) -> dict[str, nn.Parameter]:
    """Live LoRA weights of adapter ``name``, by state key (sorted)."""
    out = {}
    for key, p in model.named_parameters():
        if f".{name}." in key and (".lora_A." in key or ".lora_B." in key):
            out[key.replace(f".{name}.", ".")] = p
    return dict(sorted(out.items()))


def read_state(model: nn.Module, adapter: Adapter) -> dict[str, torch.Tensor]:
    """The adapter's current weights in ``model`` (detached copies on the CPU)."""
    return {k: p.detach().cpu().clone() for k, p in _lora_params(model, adapter.name).items()}


def trainable_params(model: nn.Module, adapter: Adapter) -> dict[str, nn.Parameter]:
    """The adapter's live parameters in ``model`` by state key (for an optimiser)."""
    return _lora_params(model, adapter.name)


def _names(layer: nn.Module) -> set[str]:
    """Adapters a LoRA layer holds (its ``lora_A`` ModuleDict's keys)."""
    return set(getattr(layer, "lora_A", {}).keys())


def _snapshot(model: nn.Module):
    layers = _lora_layers(model)
    lora = [p for layer in layers for n, p in layer.named_parameters() if "lora_" in n]
    return (
        [(layer, list(layer.active_adapters), layer.disable_adapters) for layer in layers],
        [(p, p.requires_grad) for p in lora],
    )


def _restore(snapshot) -> None:
    layers, grads = snapshot
    for layer, active, disabled in layers:
        layer.enable_adapters(not disabled)
        layer.set_adapter([a for a in active if a in _names(layer)] or active)
    for p, flag in grads:
        p.requires_grad_(flag)


def attach(model: nn.Module, adapter: Adapter, model_name: str | None = None) -> None:
    """Inject ``adapter`` into ``model`` (no-op if it is there) with its weights. The
    model's behaviour is unchanged: the new adapter starts off, the adapters that were
    active stay so, and no base parameter changes its ``requires_grad``."""
    if adapter.name in _registry(model):
        return
    adapter.check(model, model_name)
    from peft import inject_adapter_in_model

    state = _snapshot(model)
    grads = [(p, p.requires_grad) for p in model.parameters()]
    had_config = "peft_config" in model.__dict__
    saved_config = model.__dict__.pop("peft_config", None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inject_adapter_in_model(adapter.config, model, adapter_name=adapter.name)
    except ValueError as e:  # e.g. target modules not found
        raise AdapterError(f"adapter {adapter.path or adapter.name} cannot be injected: {e}") from None
    finally:
        model.__dict__.pop("peft_config", None)
        if had_config:
            model.__dict__["peft_config"] = saved_config
        for p, flag in grads:
            p.requires_grad_(flag)
    _registry(model, create=True)[adapter.name] = adapter
    live = _lora_params(model, adapter.name)
    missing = sorted(set(live) - set(adapter.state))
    extra = sorted(set(adapter.state) - set(live))
    if adapter.state:
        if missing or extra:
            detach(model, adapter)
            what = (f"lacks weights for {missing[:3]}" if missing else "") + (" and " if missing and extra else "")
            what += f"has weights its target_modules do not cover: {extra[:3]}" if extra else ""
            raise AdapterError(f"adapter {adapter.path or adapter.name} {what}")
        with torch.no_grad():
            for key, p in live.items():
                p.copy_(adapter.state[key].to(p.device, p.dtype))
    # Injection activates the new adapter on every layer: put back what was active (or off).
    layers, grads_before = state
    prev = next((active for _, active, disabled in layers if not disabled), None)
    for layer in _lora_layers(model):
        if prev is None:
            layer.set_adapter([adapter.name], inference_mode=True)
            layer.enable_adapters(False)
        else:
            layer.enable_adapters(True)
            layer.set_adapter(prev, inference_mode=True)
    for p, flag in grads_before:
        p.requires_grad_(flag)
    for p in live.values():
        p.requires_grad_(False)


def detach(model: nn.Module, adapter: Adapter | str) -> None:
    """Remove an adapter; layers left with none are replaced by their base layers again."""
    name = adapter if isinstance(adapter, str) else adapter.name
    reg = _registry(model)
    if name not in reg:
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, BaseTunerLayer):
                continue
            if name in _names(child):
                with warnings.catch_warnings():  # "adapter X was active which is now deleted": intended
                    warnings.simplefilter("ignore")
                    child.delete_adapter(name)
            if not _names(child):
                setattr(parent, child_name, child.get_base_layer())
    del reg[name]
    if not reg:
        model.__dict__.pop(_REGISTRY, None)


def set_active(model: nn.Module, adapter: Adapter | None, *, trainable: bool = False) -> None:
    """Turn ``adapter`` on (and every other one off), or every adapter off with None. The
    adapter must be attached. ``trainable`` makes its weights require grad."""
    layers = _lora_layers(model)
    if adapter is not None and adapter.name not in _registry(model):
        raise AdapterError(f"adapter {adapter.path or adapter.name} is not attached to the model")
    for layer in layers:
        if adapter is None:
            layer.enable_adapters(False)
        else:
            layer.enable_adapters(True)
            layer.set_adapter([adapter.name], inference_mode=not trainable)
    if adapter is not None and not trainable:
        for p in _lora_params(model, adapter.name).values():
            p.requires_grad_(False)


@contextlib.contextmanager
def using(model: nn.Module, adapter: Adapter | None, *, trainable: bool = False) -> Iterator[None]:
    """Inside: ``adapter`` on (attached first if it is not, detached at exit), or every
    adapter off. The previous state is restored in ``finally``."""
    if adapter is None and not _lora_layers(model):
        yield
        return
    fresh = adapter is not None and adapter.name not in _registry(model)
    if fresh:
        attach(model, adapter)
    snapshot = _snapshot(model)
    try:
        set_active(model, adapter, trainable=trainable)
        yield
    finally:
        _restore(snapshot)
        if fresh:
            detach(model, adapter)


def adapters_off(model: nn.Module):
    """The prefill's scope: every adapter off (a no-op context when none is attached)."""
    return using(model, None)


@contextlib.contextmanager
def attached(model: nn.Module, adapters: list[Adapter], model_name: str | None = None) -> Iterator[None]:
    """Attach ``adapters`` (off) for the block; those attached here are detached at exit."""
    fresh = []
    try:
        for a in adapters:
            if a.name not in _registry(model):
                attach(model, a, model_name)
                fresh.append(a)
        yield
    finally:
        for a in reversed(fresh):
            detach(model, a)


@contextlib.contextmanager
def adapter_scope(model: nn.Module) -> Iterator[None]:
    """Undo what happens to the model's adapters inside (e.g. RoutedPress leaving its
    route's adapter attached and on for kvpress's decoding): adapters attached inside
    are detached, the previous on/off state comes back."""
    before = set(_registry(model))
    snapshot = _snapshot(model)
    try:
        yield
    finally:
        for name in [n for n in _registry(model) if n not in before]:
            detach(model, name)
        _restore(snapshot)


def attached_names(model: nn.Module) -> list[str]:
    return list(_registry(model))

