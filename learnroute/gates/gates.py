"""Per-layer gates over the candidate methods, learned budget shares, and hardening.

Per layer ``l``: logits ``θ_l`` (M,) over the candidate methods give the mixture
``π_l = softmax(θ_l / T)`` (optionally Gumbel-perturbed, optionally straight-through
one-hot); budget logits ``β`` give shares ``softmax(β)`` over the compressible layers and
per-layer budgets ``k_l = f·k̄ + (1 - f)·softmax(β)_l · L·k̄`` (a floor ``f`` of the mean,
capped at the context with the excess handed to the other layers, total fixed).

Soft keep-masks per (layer, KV head), from each method's scores as ranks in [0, 1]
(:mod:`learnroute.methods.mixing`):

- **score mixing**: ``m = softtopk(Σ_m π_m r_m, k_l)``;
- **mask mixing**: ``m = Σ_m π_m softtopk(r_m, k_l)`` (each method's own top-k, mixed).

Both sum to ``k_l`` per head. Hardening takes the argmax method per layer and rounds the
budgets to integers with the exact total.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from learnroute.gates.topk import hard_topk_mask, soft_topk
from learnroute.methods.mixing import mix_ranks

MIXING = ("score", "mask")
LEARN = ("both", "methods", "budgets", "none")  # none: frozen gates (a fixed route; an adapter trains)


def round_exact(budgets: list[float], total: int, cap: int) -> list[int]:
    """Integers >= 1 and <= ``cap`` summing to ``total`` (largest remainder first).

    ``total`` is clipped into [len, len·cap]. Used to harden learned budgets: the route
    keeps exactly the KV bytes the budget promises.
    """
    L = len(budgets)
    total = max(L, min(int(total), L * cap))
    ints = [min(cap, max(1, math.floor(b))) for b in budgets]
    short = total - sum(ints)
    # Largest fractional remainder first, then larger budget first (deterministic).
    order = sorted(range(L), key=lambda i: (-(budgets[i] - math.floor(budgets[i])), -budgets[i], i))
    while short != 0:
        moved = False
        for i in order if short > 0 else reversed(order):
            if short > 0 and ints[i] < cap:
                ints[i] += 1
                short -= 1
                moved = True
            elif short < 0 and ints[i] > 1:
                ints[i] -= 1
                short += 1
                moved = True
            if short == 0:
                break
        if not moved:  # cannot happen after clipping total; guard against an endless loop
            break
    return ints


class Gates(nn.Module):
    """Gate logits ``theta`` (L, M) and budget logits ``beta`` (L,) for one model.

    ``free`` marks the layers routes can compress (sliding-window layers get no gate:
    their rows stay unused). ``learn`` picks what trains: ``both``, ``methods`` (budgets
    stay at their initial shares, uniform by default) or ``budgets`` (methods stay at
    their initial argmax: ``init_methods`` required). ``init_methods`` / ``init_shares``
    warm-start from a route (e.g. a profile-guided one); ``init_logit`` is the logit
    given to a layer's initial method.
    """

    def __init__(
        self,
        methods: list[str],
        free: list[bool],
        *,
        learn: str = "both",
        init_methods: list[str] | None = None,
        init_shares: list[float] | None = None,
        init_logit: float = 4.0,
        budget_floor: float = 0.05,
    ) -> None:
        super().__init__()
        if learn not in LEARN:
            raise ValueError(f"learn must be one of {', '.join(LEARN)}, got {learn!r}")
        if learn == "budgets" and init_methods is None:
            raise ValueError("learning budgets only needs per-layer methods (init_methods)")
        if not 0.0 <= budget_floor < 1.0:
            raise ValueError(f"budget_floor must be in [0, 1), got {budget_floor}")
        self.methods = list(methods)
        self.learn = learn
        self.budget_floor = float(budget_floor)
        self.register_buffer("free", torch.tensor(free, dtype=torch.bool), persistent=False)
        L, M = len(free), len(methods)
        theta = torch.zeros(L, M)
        if init_methods is not None:
            for layer, m in enumerate(init_methods):
                theta[layer, self.methods.index(m)] = init_logit
        beta = torch.zeros(L)
        if init_shares is not None:
            beta = torch.tensor(init_shares, dtype=torch.float32).clamp_min(1e-6).log()
        self.theta = nn.Parameter(theta, requires_grad=learn in ("both", "methods"))
        self.beta = nn.Parameter(beta, requires_grad=learn in ("both", "budgets"))

    @property
    def n_layers(self) -> int:
        return self.theta.shape[0]

    # ------------------------------------------------------------------ mixtures and budgets

    def mixture(
        self, temperature: float = 1.0, *, gumbel: torch.Generator | None = None, straight_through: bool = False
    ) -> torch.Tensor:
        """π (L, M): softmax(θ / T), Gumbel-perturbed when a generator is given; with
        ``straight_through`` the forward value is the one-hot argmax and the gradient is
        the soft one's. Methods that do not train are one-hot at their argmax."""
        if not self.theta.requires_grad:
            return self.hard_mixture()
        logits = self.theta
        if gumbel is not None:
            u = torch.rand(logits.shape, generator=gumbel).clamp(1e-10, 1 - 1e-10).to(logits.device)
            logits = logits - torch.log(-torch.log(u))  # + Gumbel(0, 1) noise
        pi = torch.softmax(logits / temperature, dim=-1)  # (L, M)
        if straight_through:
            hard = torch.nn.functional.one_hot(pi.argmax(-1), pi.shape[-1]).to(pi.dtype)
            pi = hard + pi - pi.detach()
        return pi

    def hard_mixture(self) -> torch.Tensor:
        """One-hot π (L, M) at each layer's argmax method (what hardening keeps)."""
        return torch.nn.functional.one_hot(self.theta.detach().argmax(-1), len(self.methods)).float()

    def shares(self) -> torch.Tensor:
        """Budget shares (L,) over the free layers (zero on fixed ones), summing to 1."""
        logits = self.beta.masked_fill(~self.free, float("-inf"))
        return torch.softmax(logits, dim=0)

    def budgets(self, mean_k: float, n: int) -> torch.Tensor:
        """Soft per-layer budgets (L,) in tokens for a mean of ``mean_k`` tokens per free
        layer and a context of ``n`` tokens: floor plus shares of the rest, capped at
        ``n`` with the excess handed to uncapped layers (total ``L_free · mean_k`` fixed).
        Fixed layers get ``n`` (their cache is never compressed)."""
        free = self.free
        n_free = int(free.sum())
        mean_k = min(float(mean_k), float(n))
        total = mean_k * n_free
        floor = self.budget_floor * mean_k
        shares = self.shares()
        k = floor + (total - floor * n_free) * shares  # (L,)
        capped = torch.zeros_like(free)
        for _ in range(self.n_layers):  # water filling: at most L rounds
            over = (k > n) & free
            if not bool(over.any()):
                break
            capped = capped | over  # capped layers stay at n: later excess goes elsewhere
            excess = (k - n).clamp_min(0).masked_fill(~free, 0).sum()
            room = shares.masked_fill(capped | ~free, 0)
            k = torch.where(capped, torch.full_like(k, float(n)), k + excess * room / room.sum().clamp_min(1e-12))
        return torch.where(free, k, torch.full_like(k, float(n)))

    def hard_budgets(self, mean_k: float, n: int) -> list[int]:
        """Integer budgets per layer with the exact total ``round(L_free · mean_k)``."""
        k = self.budgets(mean_k, n).detach().tolist()
        free = [i for i in range(self.n_layers) if bool(self.free[i])]
        ints = round_exact([k[i] for i in free], round(min(mean_k, n) * len(free)), n)
        out = [n] * self.n_layers
        for i, b in zip(free, ints):
            out[i] = b
        return out

    # ------------------------------------------------------------------ masks

    def soft_masks(
        self,
        ranks: torch.Tensor,
        mean_k: float,
        *,
        temperature: float,
        tau: float,
        mixing: str = "score",
        relaxation: str = "sigmoid",
        gumbel: torch.Generator | None = None,
        straight_through: bool = False,
        tau_scale: str = "rank",
    ) -> torch.Tensor:
        """Soft keep-masks (L, H, n) from per-method ranks ``ranks`` (L, M, H, n).

        Rows of fixed layers are all ones (never compressed). Each free row sums to its
        layer's budget ``k_l`` (to the relaxation's tolerance). ``tau`` is in rank units
        (``tau_scale="rank"``) or in units of the layer's kept fraction ``k_l / n``
        (``"budget"``): then a layer keeping 5 tokens gets as sharp a mask, relative to
        what it keeps, as one keeping 500. In rank units a layer keeping 0.5 % of a 1k
        context with tau = 0.02 spreads its 5 tokens' worth of mask over ~40 tokens at
        ~0.15 each, so the soft route reads the context far less than its hard route does.
        """
        L, M, H, n = ranks.shape
        pi = self.mixture(temperature, gumbel=gumbel, straight_through=straight_through)  # (L, M)
        k = self.budgets(mean_k, n)  # (L,)
        if tau_scale == "budget":
            t = tau * (k.detach() / n).clamp_min(1.0 / n)  # (L,): per-layer temperature in rank units
        elif tau_scale == "rank":
            t = torch.full_like(k, float(tau))
        else:
            raise ValueError(f"tau_scale must be 'rank' or 'budget', got {tau_scale!r}")
        if mixing == "score":
            mixed = mix_ranks(ranks, pi)  # (L, H, n)
            masks = soft_topk(relaxation, mixed, k[:, None].expand(L, H), t[:, None].expand(L, H))  # (L, H, n)
        elif mixing == "mask":
            per_method = soft_topk(
                relaxation, ranks, k[:, None, None].expand(L, M, H), t[:, None, None].expand(L, M, H)
            )  # (L, M, H, n)
            masks = torch.einsum("lmhn,lm->lhn", per_method, pi)  # (L, H, n)
        else:
            raise ValueError(f"mixing must be one of {', '.join(MIXING)}, got {mixing!r}")
        return torch.where(self.free[:, None, None], masks, torch.ones_like(masks))

    def hard_masks(self, ranks: torch.Tensor, mean_k: float) -> torch.Tensor:
        """0/1 keep-masks (L, H, n) of the hardened route: each layer's argmax method and
        its integer budget (what the engine would keep, up to ties in the scores)."""
        L, M, H, n = ranks.shape
        idx = self.theta.detach().argmax(-1)  # (L,)
        chosen = ranks.gather(1, idx.view(L, 1, 1, 1).expand(L, 1, H, n)).squeeze(1)  # (L, H, n)
        k = torch.tensor(self.hard_budgets(mean_k, n), device=ranks.device)  # (L,)
        masks = hard_topk_mask(chosen, k[:, None].expand(L, H))  # (L, H, n)
        return torch.where(self.free[:, None, None], masks, torch.ones_like(masks))

    def entropy(self, temperature: float = 1.0) -> torch.Tensor:
        """Mean entropy of π over the free layers (nats); the sharpening term's value."""
        logp = torch.log_softmax(self.theta / temperature, dim=-1)  # (L, M)
        ent = -(logp.exp() * logp).sum(-1)  # (L,)
        return ent[self.free].mean()
