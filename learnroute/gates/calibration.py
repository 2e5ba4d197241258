"""Calibration samples for training: each prefilled once into a :class:`CalibItem` (what
every training step needs of it), reused across runs through an explicit
:class:`CalibrationStore`, or drawn fresh as training goes (:class:`Stream`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from learnroute.route import Route


@dataclass
class CalibItem:
    """One calibration sample, prefilled once: what every training step needs of it."""

    sample_id: str
    task: str
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (1, H_kv, n_l, d)
    ranks: torch.Tensor  # (L, M, H_kv, n): per-method ranks in [0, 1] (fixed layers: zeros)
    ids: torch.Tensor  # (1, q + a): question then reference answer
    positions: torch.Tensor  # (1, q + a): original positions after the context
    keep: slice  # logits at these positions predict the answer tokens
    target: torch.Tensor  # (a,)
    ref_logp: torch.Tensor | None  # (a, V) full-cache log-probs (for the KL term)

    @property
    def n_tokens(self) -> int:
        return int(self.ranks.shape[-1])


def prepare_item(engine, task: str, sample, methods: list[str], with_ref: bool) -> CalibItem:
    """Prefill ``sample`` once, rank every method's scores in every compressible layer."""
    from learnroute import _hf
    from learnroute.methods.mixing import rank_normalize
    from learnroute.profile import teacher_forcing

    tf = teacher_forcing(engine, sample)
    with torch.no_grad():
        prefill = engine.prefill(tf.prompt)
        n = prefill.n_tokens
        engine.check_routes([Route.homogeneous(m, engine.n_layers, 1) for m in methods], n)
        h = prefill.layers[0].keys.shape[1]
        ranks = torch.zeros(engine.n_layers, len(methods), h, n, device=engine.model.device)  # (L, M, H_kv, n)
        for layer in range(engine.n_layers):
            if engine.is_fixed(layer, prefill.layer_tokens[layer], n):
                continue
            for j, m in enumerate(methods):
                ranks[layer, j] = rank_normalize(engine.scores(prefill, layer, m)[0])  # (H_kv, n)
        kv = [(c.keys, c.values) for c in prefill.layers]
        ref = None
        if with_ref:
            logits = _hf.forward_tokens(engine.model, kv, tf.ids, tf.positions, keep=tf.keep)  # (1, a, V)
            ref = torch.log_softmax(logits[0].float(), -1)  # (a, V)
    # Drop the capture's hidden states and memoised scores: only keys/values are needed.
    del prefill
    return CalibItem(sample.id, task, kv, ranks, tf.ids, tf.positions, tf.keep, tf.answer[0], ref)


@dataclass
class CalibrationStore:
    """Calibration items shared by the training runs it is handed to
    (``run_train(..., calibration=store)``), by (model, device, protocol, methods, KL term,
    sample id); read-only during training.

    A study trains a dozen variants on one calibration set, and ``run_train_seeds`` one run
    per seed: each would prefill and score every sample again (~3 s per 1k-token sample on
    2 CPU cores). A run given no store keeps its items only while it runs, so nothing holds
    calibration caches through later stages; :meth:`clear` releases a store's.
    """

    items: dict[tuple, CalibItem] = field(default_factory=dict)

    def clear(self) -> None:
        self.items.clear()


def calibration_items(run, pairs: list, indices: list[int], store: CalibrationStore) -> dict[int, CalibItem]:
    """This process's calibration items (``run``: the training run's set-up), each made once
    in ``store``."""
    from tqdm import tqdm

    config = run.config
    # The sample id fixes task, split, context length, seed and index; the model is
    # named by its path (or the default) and its converted name.
    same = (config.model, run.name, str(run.acc.device), config.query_aware, tuple(config.methods), config.kl_weight > 0)
    items = {}
    for i in tqdm(indices, desc="prefill", disable=not run.progress or not run.main):
        key = (*same, pairs[i][1].id)
        if key not in store.items:
            task, sample = pairs[i]
            store.items[key] = prepare_item(run.engine, task, sample, config.methods, config.kl_weight > 0)
        items[i] = store.items[key]
    return items


# Stream samples are indexed from here on in each family's calibration stream, far past any
# fixed set (``tasks``' counts): the stream never repeats a validation sample.
STREAM_OFFSET = 1_000_000


class Stream:
    """Fresh calibration samples as training goes (``stream`` per step), from the calibration
    split of ``tasks``' families weighted by their counts. Step ``s`` draws the samples
    ``(family, STREAM_OFFSET + s·stream + j)``, the family from the step's seed, so a
    resumed run draws what an uninterrupted one does. With ``stream_pool`` the batch is
    ``batch_size`` samples drawn from the last ``stream_pool`` drawn; prefills are made on
    demand and the last ``max(stream_pool, stream)`` kept."""

    def __init__(self, run) -> None:
        from collections import OrderedDict

        self.run, self.config = run, run.config
        self.families = list(self.config.tasks)
        self.weights = torch.tensor([float(self.config.tasks[f]) for f in self.families])
        self.cache: OrderedDict[str, CalibItem] = OrderedDict()
        self.keep = max(self.config.stream_pool, self.config.stream)

    def drawn(self, step: int) -> list[tuple[str, int]]:
        """(family, index) of the samples step ``step`` draws fresh."""
        rng = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step + 7)
        picks = torch.multinomial(self.weights, self.config.stream, replacement=True, generator=rng).tolist()
        return [(self.families[f], STREAM_OFFSET + step * self.config.stream + j) for j, f in enumerate(picks)]

    def batch(self, step: int, rng: torch.Generator) -> list[tuple[str, int]]:
        """The step's batch: its fresh samples, or ``batch_size`` of the pool (which ends with them)."""
        if not self.config.stream_pool:
            return self.drawn(step)
        per = self.config.stream
        first = max(0, step + 1 - self.config.stream_pool // per)
        pool = [x for s in range(first, step + 1) for x in self.drawn(s)][-self.config.stream_pool :]
        order = torch.randperm(len(pool), generator=rng)[: self.config.batch_size]
        return [pool[int(i)] for i in order]

    def item(self, family: str, index: int) -> CalibItem:
        """The sample's prefill (made once while it stays in the pool)."""
        from learnroute import adapter as _adapter
        from learnroute.tasks.ruler import make_sample

        config = self.config
        sample = make_sample(family, self.run.engine.tokenizer, config.context_tokens, "calibration", config.seed, index)
        if sample.split != "calibration":  # a programming error, never user input
            raise RuntimeError("gates must train on calibration samples only")
        if sample.id not in self.cache:
            # An adapter being trained is on for the step; the prefill and the KL reference
            # are the base model's, as for the fixed set (prefilled before the adapter existed).
            with _adapter.adapters_off(self.run.model):
                self.cache[sample.id] = prepare_item(self.run.engine, family, sample, config.methods, config.kl_weight > 0)
            while len(self.cache) > self.keep:
                self.cache.popitem(last=False)
        self.cache.move_to_end(sample.id)
        return self.cache[sample.id]
