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

``n_heads`` > 1 (``granularity: head``): one gate per (layer, KV head) instead of per
layer, "units" ``u = l·H + h``: θ (L·H, M), β (L·H,), budgets water-filled over every free
(layer, head), masks per head from that head's π and budget, and hardening gives a
per-head route (:meth:`learnroute.route.LayerRoute.per_head`). The same relaxations,
floors, caps and rounding: only the number of units changes. With ``layer_totals="fixed"``
each layer's share of the budget stays at its start (a buffer ``layer_shares`` (L,)) and β
learns only how the layer splits it over its heads: ``share_u = s_l · softmax_h(β_l)``.
A ``layer_share_table`` makes those layer shares a function of the budget: a row (L,) per
budget (a two-stage run's first stage, which learned its layer totals per budget),
interpolated linearly in log-budget between rows and held constant beyond the first and last.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from learnroute.gates.topk import soft_topk
from learnroute.methods.budgets import Budget, layer_first_fill, mean_tokens, round_exact, unit_weights, water_fill
from learnroute.methods.mixing import mix_ranks
from learnroute.methods.registry import METHODS
from learnroute.methods.select import kept_count, select
from learnroute.route import LAYER_TOTALS, LayerRoute, Route

MIXING = ("score", "mask")
LEARN = ("both", "methods", "budgets", "none")  # none: frozen gates (a fixed route; an adapter trains)


def layer_shares_at(
    layer_shares: torch.Tensor | None, budgets: torch.Tensor | None, fraction: float
) -> torch.Tensor | None:
    """Fixed layer shares (L,) at mean kept ``fraction``: ``layer_shares`` itself when it is
    one row (L,), else its rows (B, L) at ``budgets`` (B,) interpolated linearly in
    log-budget, the first or last row beyond them (None: learned layer totals)."""
    if layer_shares is None or layer_shares.dim() == 1:
        return layer_shares
    logs = [math.log(b) for b in budgets.tolist()]
    if len(logs) == 1:
        return layer_shares[0]
    x = min(max(math.log(fraction), logs[0]), logs[-1])
    i = max(j for j in range(len(logs) - 1) if logs[j] <= x)  # the row at or below x
    w = (x - logs[i]) / (logs[i + 1] - logs[i])
    return (1 - w) * layer_shares[i] + w * layer_shares[i + 1]  # (L,), sums to 1 as both rows do


def unit_shares(
    beta: torch.Tensor, free_units: torch.Tensor, n_heads: int, layer_shares: torch.Tensor | None = None
) -> torch.Tensor:
    """Budget shares (L·H,) over the free units (zero on fixed ones), summing to 1, from
    budget logits ``beta`` (L·H,): one softmax over every free unit, or, with
    ``layer_shares`` (L,) (fixed layer totals), each layer's share split over its heads by a
    softmax of its own logits."""
    logits = beta.masked_fill(~free_units, float("-inf"))  # (L·H,)
    if layer_shares is None:
        return torch.softmax(logits, dim=0)
    per_layer = logits.view(-1, n_heads)  # (L, H)
    free_layer = free_units.view(-1, n_heads)[:, 0]  # (L,): a layer's heads are all free or all fixed
    within = torch.softmax(per_layer.masked_fill(~free_layer[:, None], 0.0), dim=1)  # (L, H), fixed rows unused
    return (within * layer_shares.to(within)[:, None]).reshape(-1)  # (L·H,); layer_shares is 0 on fixed layers


def share_table(
    table: tuple[list[float], torch.Tensor | list[list[float]]], free: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked per-budget layer shares: budgets (B,) float64 and shares (B, L), each row
    normalised over the ``free`` layers (L,) (zero on the others)."""
    held, rows = table
    L = free.shape[0]
    shares = torch.as_tensor(rows, dtype=torch.float32)  # (B, L)
    if shares.dim() != 2 or shares.shape != (len(held), L):
        raise ValueError(f"layer_share_table needs one row of {L} layer shares per budget "
                         f"({len(held)} budgets), got shape {tuple(shares.shape)}")
    if any(not 0 < b <= 1 for b in held) or any(b >= c for b, c in zip(held, held[1:])):
        raise ValueError(f"layer_share_table's budgets must be increasing fractions in (0, 1], got {held}")
    shares = shares.clamp_min(0) * free.to(shares)[None, :]  # (B, L): no share on fixed layers
    # the budgets exact (float64), as the config gives them: the rows are looked up at those budgets
    return torch.tensor(held, dtype=torch.float64), shares / shares.sum(1, keepdim=True).clamp_min(1e-12)


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
        n_heads: int = 1,
        head_spread: float | None = None,
        layer_totals: str = "learn",
        budget_slope: bool = False,
        ref_budget: float = 0.1,
        layer_share_table: tuple[list[float], torch.Tensor | list[list[float]]] | None = None,
    ) -> None:
        super().__init__()
        if learn not in LEARN:
            raise ValueError(f"learn must be one of {', '.join(LEARN)}, got {learn!r}")
        if learn == "budgets" and init_methods is None:
            raise ValueError("learning budgets only needs per-layer methods (init_methods)")
        if not 0.0 <= budget_floor < 1.0:
            raise ValueError(f"budget_floor must be in [0, 1), got {budget_floor}")
        if n_heads < 1:
            raise ValueError(f"n_heads must be >= 1, got {n_heads}")
        if head_spread is not None and not head_spread >= 1.0:
            raise ValueError(f"head_spread must be >= 1 (a head's budget over its layer's mean), got {head_spread}")
        if layer_totals not in LAYER_TOTALS:
            raise ValueError(f"layer_totals must be one of {', '.join(LAYER_TOTALS)}, got {layer_totals!r}")
        if layer_totals == "fixed" and n_heads == 1:
            raise ValueError("layer_totals='fixed' keeps per-layer budgets and learns their split over heads: "
                             "it needs n_heads > 1")
        self.methods = list(methods)
        self.learn = learn
        self.budget_floor = float(budget_floor)
        self.n_heads = int(n_heads)
        self.head_spread = None if head_spread is None else float(head_spread)
        self.register_buffer("free", torch.tensor(free, dtype=torch.bool), persistent=False)  # (L,) per layer
        # (L·H,): one gate per (layer, KV head) with n_heads > 1, else per layer
        self.register_buffer("free_units", self.free.repeat_interleave(self.n_heads), persistent=False)
        L, M, H = len(free), len(methods), self.n_heads
        U = L * H
        if init_methods is not None and len(init_methods) == L and H > 1:  # a per-layer start: every head alike
            init_methods = [m for m in init_methods for _ in range(H)]
        if init_shares is not None and len(init_shares) == L and H > 1:  # a layer's share split over its heads
            init_shares = [x / H for x in init_shares for _ in range(H)]
        for name, given in (("init_methods", init_methods), ("init_shares", init_shares)):
            if given is not None and len(given) != U:
                raise ValueError(f"{name} has {len(given)} entries; expected {L} (per layer) or {U} (per layer x head)")
        theta = torch.zeros(U, M)
        if init_methods is not None:
            for unit, m in enumerate(init_methods):
                theta[unit, self.methods.index(m)] = init_logit
        beta = torch.zeros(U)
        if init_shares is not None:
            beta = torch.tensor(init_shares, dtype=torch.float32).clamp_min(1e-6).log()
        self.theta = nn.Parameter(theta, requires_grad=learn in ("both", "methods"))
        self.beta = nn.Parameter(beta, requires_grad=learn in ("both", "budgets"))
        # budget_slope: logits beta + log(f / ref_budget) * beta_slope at a kept fraction f,
        # from a zero slope (every budget starts with the same shares), so that each budget
        # gets its own allocation (issue 58)
        self.ref_log = math.log(ref_budget)
        self.beta_slope = nn.Parameter(torch.zeros(U), requires_grad=self.beta.requires_grad) if budget_slope else None
        self.register_buffer("layer_shares", None)  # (L,), or (B, L) per budget, with fixed layer totals
        self.register_buffer("layer_share_budgets", None)  # (B,) float64: the budgets of layer_shares' rows
        if layer_share_table is not None and layer_totals != "fixed":
            raise ValueError("layer_share_table gives fixed layer totals per budget: it needs layer_totals='fixed'")
        if layer_share_table is not None:
            self.layer_share_budgets, self.layer_shares = share_table(layer_share_table, self.free)
        elif layer_totals == "fixed":
            # each free layer's share at the start, the sum of its heads' (uniform without init_shares)
            start = unit_shares(beta, self.free_units, H).view(L, H).sum(1)  # (L, H) -> (L,)
            self.layer_shares = start / start.sum().clamp_min(1e-12)

    @property
    def n_layers(self) -> int:
        return self.theta.shape[0] // self.n_heads

    @property
    def budget_dependent(self) -> bool:
        """Whether the allocation depends on the budget (a budget slope, or fixed layer totals
        per budget), so that each budget must be hardened on its own, not rescaled."""
        return self.beta_slope is not None or self.layer_share_budgets is not None

    # ------------------------------------------------------------------ mixtures and budgets

    def mixture(
        self, temperature: float = 1.0, *, gumbel: torch.Generator | None = None, straight_through: bool = False
    ) -> torch.Tensor:
        """π (L·H, M) per unit (per layer when n_heads is 1): softmax(θ / T), Gumbel-perturbed when a generator is given; with
        ``straight_through`` the forward value is the one-hot argmax and the gradient is
        the soft one's. Methods that do not train are one-hot at their argmax."""
        if not self.theta.requires_grad:
            return self.hard_mixture()
        logits = self.theta
        if gumbel is not None:
            u = torch.rand(logits.shape, generator=gumbel).clamp(1e-10, 1 - 1e-10).to(logits.device)
            logits = logits - torch.log(-torch.log(u))  # + Gumbel(0, 1) noise
        pi = torch.softmax(logits / temperature, dim=-1)  # (L·H, M)
        if straight_through:
            hard = torch.nn.functional.one_hot(pi.argmax(-1), pi.shape[-1]).to(pi.dtype)
            pi = hard + (pi - pi.detach())  # exactly one-hot forward: (1 + p) - p is not 1 in float32
        return pi

    def hard_mixture(self) -> torch.Tensor:
        """One-hot π (L·H, M) at each unit's argmax method (what hardening keeps)."""
        return torch.nn.functional.one_hot(self.theta.detach().argmax(-1), len(self.methods)).float()

    def shares(self, fraction: float | None = None) -> torch.Tensor:
        """Budget shares (L·H,) over the free units (zero on fixed ones), summing to 1; with
        ``budget_slope`` or per-budget layer totals, those for mean kept ``fraction`` (None:
        the reference budget)."""
        logits = self.beta
        if self.beta_slope is not None and fraction is not None:
            logits = self.beta + (math.log(fraction) - self.ref_log) * self.beta_slope  # (L·H,)
        at = math.exp(self.ref_log) if fraction is None else fraction
        return unit_shares(logits, self.free_units, self.n_heads,
                           layer_shares_at(self.layer_shares, self.layer_share_budgets, at))

    def trainable(self) -> list[nn.Parameter]:
        """The parameters that train (theta, beta, beta_slope as ``learn`` says)."""
        return [p for p in (self.theta, self.beta, self.beta_slope) if p is not None and p.requires_grad]

    def budgets(self, mean_k: float, n: int) -> torch.Tensor:
        """Soft per-unit budgets (L·H,) in tokens for a mean of ``mean_k`` tokens per free
        unit and a context of ``n`` tokens: weights ``floor + (1 - floor)·U·share`` water-
        filled to the total ``U_free · mean_k`` with each unit capped at ``n``
        (:mod:`learnroute.methods.budgets`; with fixed layer totals the layers first, then
        each layer's heads, so that a capped head's excess stays in its layer). Fixed layers
        get ``n`` (never compressed)."""
        free = self.free_units
        n_free = int(free.sum())
        mean_k = min(float(mean_k), float(n))
        k = torch.full_like(self.beta, float(n))  # (L·H,)
        if n_free == 0:
            return k
        # the shares at this mean kept fraction (the same at every budget without budget_slope)
        w = unit_weights(self.shares(mean_k / n)[free], self.budget_floor, self.n_heads, self.head_spread)  # (U_free,)
        if self.layer_shares is not None:  # free units come in whole layers
            grid = w.view(-1, self.n_heads)  # (U_free,) -> (L_free, H)
            filled = layer_first_fill(grid, mean_k * n_free, float(n)).reshape(-1)  # (L_free, H) -> (U_free,)
            return k.masked_scatter(free, filled)
        return k.masked_scatter(free, water_fill(w, mean_k * n_free, float(n)))

    def harden(self, budget: Budget, context_tokens: int, model: str | None = None) -> Route:
        """The hardened route at mean ``budget``: each free layer's argmax method, budgets
        from the learned shares (fractions of the context for a fractional budget; tokens
        with the exact total ``L_free · min(budget, context_tokens)`` for a token budget,
        each layer at most ``context_tokens``). Fixed layers keep the nominal budget (the
        engine never compresses them). This is the route export writes and validation runs.
        With n_heads > 1 every free layer is a per-head entry (each head's argmax and budget)."""
        free = self.free_units.tolist()
        n = int(context_tokens)
        k = self.budgets(mean_tokens(budget, n), n).detach().tolist()
        budgets: list[Budget] = [budget] * len(free)
        idx = [i for i, f in enumerate(free) if f]
        if isinstance(budget, float):
            for i in idx:
                budgets[i] = min(1.0, k[i] / n)
        else:
            ints = round_exact([k[i] for i in idx], round(min(budget, n) * len(idx)), n)
            for i, b in zip(idx, ints):
                budgets[i] = b
        methods = [self.methods[i] for i in self.theta.detach().argmax(-1).tolist()]
        H = self.n_heads
        if H == 1:
            return Route.from_layers(methods, budgets, model=model)
        layers = [
            LayerRoute.per_head([LayerRoute(methods[u], budgets[u]) for u in range(l * H, (l + 1) * H)])
            if self.free[l] else LayerRoute(methods[l * H], budget)  # never compressed: nominal
            for l in range(self.n_layers)
        ]
        return Route(layers, model=model, layer_totals="learn" if self.layer_shares is None else "fixed")

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
        if self.n_heads not in (1, H):
            raise ValueError(f"gates for {self.n_heads} heads per layer, but the ranks have {H} KV heads")
        pi = self.mixture(temperature, gumbel=gumbel, straight_through=straight_through)  # (L·G, M), G = n_heads
        k = self.budgets(mean_k, n)  # (L·G,)
        if tau_scale == "budget":
            t = tau * (k.detach() / n).clamp_min(1.0 / n)  # (L·G,): per-unit temperature in rank units
        elif tau_scale == "rank":
            t = torch.full_like(k, float(tau))
        else:
            raise ValueError(f"tau_scale must be 'rank' or 'budget', got {tau_scale!r}")
        G = self.n_heads
        k, t = k.view(L, G).expand(L, H), t.view(L, G).expand(L, H)  # (L, H): per head (G = 1: the layer's)
        pi_h = pi.view(L, G, M).expand(L, H, M)  # (L, H, M)
        if mixing == "score":
            # G = 1: mix_ranks over the layer's π, as before per-head gates existed
            mixed = mix_ranks(ranks, pi) if G == 1 else torch.einsum("lmhn,lhm->lhn", ranks, pi_h.to(ranks.dtype))
            masks = soft_topk(relaxation, mixed, k, t)  # (L, H, n)
        elif mixing == "mask":
            per_method = soft_topk(
                relaxation, ranks, k[:, None, :].expand(L, M, H), t[:, None, :].expand(L, M, H)
            )  # (L, M, H, n)
            masks = torch.einsum("lmhn,lhm->lhn", per_method, pi_h)  # (L, H, n)
        else:
            raise ValueError(f"mixing must be one of {', '.join(MIXING)}, got {mixing!r}")
        return torch.where(self.free[:, None, None], masks, torch.ones_like(masks))

    def hard_masks(self, ranks: torch.Tensor, route: Route) -> torch.Tensor:
        """0/1 keep-masks (L, H, n) of ``route`` (e.g. :meth:`harden`'s) on a sample whose
        per-method ranks are ``ranks`` (L, M, H, n): :func:`route_masks`."""
        return route_masks(route, ranks, self.methods, self.free.tolist())

    def share_divergence(self) -> torch.Tensor:
        """KL(uniform || shares) over the free layers (nats): 0 for uniform budgets, large
        when layers are starved (a share near 0 costs ``log(1 / (L·share))``)."""
        shares = self.shares()[self.free_units]  # (U_free,)
        L = shares.shape[0]
        return (torch.log(torch.tensor(1.0 / L)) - torch.log(shares.clamp_min(1e-30))).mean()

    def slope_penalty(self) -> torch.Tensor:
        """mean(beta'^2) over every unit, the ``slope_weight`` term: 0 at the one shape rescaled
        to every budget. Only for gates with a budget slope."""
        if self.beta_slope is None:
            raise ValueError("these gates learn no budget slope (budget_slope off): there is no slope to penalise")
        return self.beta_slope.pow(2).mean()  # scalar, over (L·H,)

    def entropy(self, temperature: float = 1.0) -> torch.Tensor:
        """Mean entropy of π over the free layers (nats); the sharpening term's value."""
        logp = torch.log_softmax(self.theta / temperature, dim=-1)  # (L·H, M)
        ent = -(logp.exp() * logp).sum(-1)  # (L·H,)
        return ent[self.free_units].mean()


def route_masks(route: Route, ranks: torch.Tensor, methods: list[str], free: list[bool]) -> torch.Tensor:
    """0/1 keep-masks (L, H, n) of ``route`` from per-method ranks (L, M, H, n), through the
    engine's own budget resolution and selection (:func:`learnroute.methods.select.kept_count`,
    :func:`~learnroute.methods.select.select`): the tokens the engine keeps for the route on
    this sample (ranks order tokens as the raw scores do, ties included). Layers that are
    not ``free`` keep everything."""
    L, _, H, n = ranks.shape
    masks = torch.ones(L, H, n, dtype=ranks.dtype, device=ranks.device)  # (L, H, n)
    for layer, e in enumerate(route.layers):
        if e.share is not None:
            raise ValueError(f"layer {layer} shares its budget across heads by scores (share={e.share!r}): "
                             "gates train and validate routes with fixed per-layer or per-head budgets")
        # every head at once, or head by head in a per-head layer
        entries = [(slice(None), e)] if e.heads is None else [(slice(h, h + 1), x) for h, x in enumerate(e.heads)]
        for rows, entry in entries:
            k = kept_count(entry.budget, n, keeps_all=METHODS[entry.method].keeps_all, fixed=not free[layer])
            idx = select(entry.method, entry.mixture, k, n, lambda m: ranks[layer, methods.index(m)][None])  # (1, H, k)
            if idx is not None:
                masks[layer, rows] = torch.zeros_like(masks[layer, rows]).scatter_(-1, idx[0, rows], 1.0)  # (H or 1, n)
    return masks
