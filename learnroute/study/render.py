"""The study's tables and plots: ``study.md``, the summary printed after a run, ``scores.png``
and ``routes.png``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from learnroute.route import Route
from learnroute.report import VALID_FULL
from learnroute.study.config import CONTROL_KINDS, route_name


def plot_scores(result: dict[str, Any], main: str, path: Path) -> None:
    """Average score vs budget per protocol: full cache, best homogeneous (per budget),
    profile, profile_alloc, the learned route and its variants."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    protocols = list(result["protocols"].items())
    if not protocols:
        return
    fig, axes = plt.subplots(1, len(protocols), figsize=(5.5 * len(protocols), 4), squeeze=False)
    for ax, (protocol, res) in zip(axes[0], protocols):
        budgets = [e["budget"] for e in res["budgets"]]
        x = list(range(len(budgets)))
        full = res["budgets"][0]["full"] if res["budgets"] else None
        if full is not None:
            ax.axhline(100 * full, color="black", ls="--", lw=1, label="full cache")
        best = [100 * e["avg"].get(e["best_homogeneous"], float("nan")) for e in res["budgets"]]
        ax.plot(x, best, "o-", color="gray", label="best homogeneous (per budget)")
        styles = {"profile": ("tab:orange", ":"), "profile_alloc": ("tab:orange", "-"), main: ("tab:red", "-")}
        routes = ["profile", "profile_alloc", main] + sorted(
            {r for e in res["budgets"] for r in e["avg"] if r.startswith("learned") and r != main}
        )
        for r in routes:
            ys = [100 * e["avg"].get(r, float("nan")) for e in res["budgets"]]
            color, ls = styles.get(r, (None, "--"))
            ax.plot(x, ys, marker="o", ls=ls, color=color, lw=2.5 if r == main else 1.2, label=r, alpha=1 if r in styles else 0.6)
        ax.set_xticks(x, [str(b) for b in budgets])
        ax.set_xlabel("budget (mean kept per layer)")
        ax.set_ylabel(f"average score x100 ({res['n_eval_samples']} eval samples)")
        ax.set_title(f"query-{protocol}", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_routes(learned: Route, profile: Route, path: Path) -> None:
    """Per layer: the learned route's method next to the profile's choice, and the learned
    budgets next to the profile's sensitivity-allocated ones (as multiples of the mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted(set(learned.methods) | set(profile.methods))
    L = learned.n_layers
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(max(6, 0.3 * L), 6), sharex=True)
    a1.scatter(range(L), [methods.index(m) for m in profile.methods], s=80, facecolors="none", edgecolors="tab:orange", label="profile")
    a1.scatter(range(L), [methods.index(m) for m in learned.methods], s=20, color="tab:red", label="learned")
    a1.set_yticks(range(len(methods)), methods, fontsize=8)
    a1.legend(fontsize=7)
    a1.set_title("method per layer", fontsize=9)
    for route, color, label, off in ((profile, "tab:orange", "profile_alloc", -0.2), (learned, "tab:red", "learned", 0.2)):
        mean_b = sum(route.budgets) / L
        a2.bar([i + off for i in range(L)], [b / mean_b for b in route.budgets], width=0.4, color=color, label=label)
    a2.axhline(1.0, color="gray", ls="--", lw=1)
    a2.set_ylabel("budget / mean")
    a2.set_xlabel("layer")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ci(c: dict | None, room: dict | None = None) -> str:
    """A paired difference with its interval and verdict; marked ``(ceiling)`` when ``room``
    (the full cache minus the same reference) is not a win: no room to beat it there."""
    if not c or c.get("diff") is None:
        return "n/a"
    mark = " (ceiling)" if room and room.get("verdict") in ("tie", "loss") else ""
    return f"{100 * c['diff']:+.1f} [{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}] {c['verdict']}{mark}"


def _q12(e: dict[str, Any]) -> tuple[str, str]:
    """Q1 (main minus the best homogeneous route) and Q2 (minus profile_alloc) of one budget's
    answers, each marked where the full cache itself does not beat that reference."""
    room = e.get("headroom") or {}  # absent in a study.json written before it
    return (_ci(e.get("vs_best_homogeneous"), room.get("best_homogeneous")),
            _ci(e.get("vs_profile_alloc"), room.get("profile_alloc")))


CEILING_NOTE = ("'(ceiling)': the full cache itself does not beat that reference at that budget (paired), so "
                "a route beats it only by answering what the full cache gets wrong.")


def _control_lines(res: dict[str, Any], main: str, where: str = "") -> list[str]:
    """study.md's tables of the controls (pyramid: and adakv:<best>), of Q9 (per-head
    learning) and of Q8 (each learned route minus its start), for one protocol and family
    split (``where``: how the split is named in the tables' captions; empty for all)."""
    lines: list[str] = []
    if any(e.get(f"vs_{k}_best") for k in CONTROL_KINDS for e in res["budgets"]):
        lines += ["", f"Controls{where}: `{main}` minus PyramidKV's allocation over layers and Ada-KV's over "
                  "each layer's KV heads, both over the best homogeneous method (paired, x100):", ""]
        lines.append(f"| budget | control route | its score | {main} - it |")
        lines.append("|---|---|---|---|")
        for e in res["budgets"]:
            for k in CONTROL_KINDS:
                if e.get(f"{k}_best"):
                    label = e[f"{k}_best"]
                    if not label.startswith(f"{k}:"):  # the homogeneous route stands in (see _answers)
                        label = f"{k}:{label.split(':', 1)[1]} (= {label}: every KV head scores alike)"
                    lines.append(f"| {e['budget']} | {label} | {100 * e['avg'][e[f'{k}_best']]:.1f} | "
                                 f"{_ci(e.get(f'vs_{k}_best'))} |")
    per_head = sorted({v for e in res["budgets"] for v in e.get("per_head", {})})
    if per_head:
        versus = (f"the main route `{main}` (n/a for itself: the main route is per-head, and Q6 reads the "
                  "per-layer variants against it)" if main in per_head else f"the main per-layer route `{main}`")
        lines += ["", f"Q9{where}, per-head learning (`granularity: head`): each per-head route minus {versus}, "
                  "and minus `adakv:<best homogeneous method>` (paired, x100):", ""]
        lines.append("| route | versus | " + " | ".join(str(e["budget"]) for e in res["budgets"]) + " |")
        lines.append("|---|---|" + "---|" * len(res["budgets"]))
        for v in per_head:
            for key, label in (("vs_main", main), ("vs_adakv", "adakv:<best>")):
                lines.append(f"| {v} | {label} | " + " | ".join(
                    _ci(e.get("per_head", {}).get(v, {}).get(key)) for e in res["budgets"]) + " |")
            ratios = [e.get("per_head", {}).get(v, {}).get("allocated_over_kept") for e in res["budgets"]]
            lines.append(f"| {v} | allocated / kept bytes | "
                         + " | ".join("n/a" if x is None else f"x{x:.2f}" for x in ratios) + " |")
    started = sorted({v for e in res["budgets"] for v in e.get("vs_start", {})})
    if started:
        lines += ["", f"Q8{where}, each learned route minus its untrained start (`<route>_start`, the same "
                  "warm start hardened without training; paired, x100):", ""]
        lines.append("| route | " + " | ".join(str(e["budget"]) for e in res["budgets"]) + " |")
        lines.append("|---|" + "---|" * len(res["budgets"]))
        for v in started:
            lines.append(f"| {v} | " + " | ".join(_ci(e.get("vs_start", {}).get(v)) for e in res["budgets"]) + " |")
    return lines


def _budget_step_lines(res: dict[str, Any], main: str) -> list[str]:
    """More cache, never worse: the main route at each budget minus itself at the next
    smaller one, in every split, a drop (the interval below 0) in bold."""
    names = {"in": "in-family", "out": "out-of-family"}
    splits = [("all", res), *((names.get(k, k), v) for k, v in res.get("families", {}).items())]
    rows = [(name, s) for name, r in splits for s in r.get("main_vs_smaller_budget", [])]
    if not rows:
        return []
    lines = ["", f"More cache, never worse: {main} at each budget minus {main} at the next smaller one "
             "(paired; **drop**: the interval below 0). Last column: the smaller budget minus the full cache; "
             "a route above the full cache must come back down to it by 100 % kept.", "",
             "| split | budgets | difference | worse with more cache | smaller budget − full cache |",
             "|---|---|---|---|---|"]
    for name, s in rows:
        above = s.get("smaller_minus_full")  # absent in a study.json written before it existed
        lines.append(f"| {name} | {s['from']} -> {s['to']} | {_ci(s['vs_smaller_budget'])} | "
                     f"{'**drop**' if s['drop'] else 'no'} | {'n/a' if above is None else f'{100 * above:+.1f}'} |")
    drops = [f"{name} {s['from']} -> {s['to']}" for name, s in rows if s["drop"]]
    if drops:
        lines += ["", f"**{main} answers worse with more cache** at: {', '.join(drops)}."]
    return lines


def to_markdown(result: dict[str, Any], main: str) -> str:
    """The answers to questions 1-8 as tables (scores x100, paired 95 % intervals)."""
    lines = ["# Study results", ""]
    for protocol, res in result["protocols"].items():
        lines += [
            f"## Protocol: query-{protocol}",
            "",
            f"{res['n_eval_samples']} eval samples on the tasks the full cache solves (>= {100 * VALID_FULL:.0f}): "
            f"{', '.join(res['valid_tasks'])}; left out: {', '.join(res['left_out_tasks']) or 'none'}. "
            "Differences are paired over the same samples, with a bootstrap 95 % interval; "
            f"'tie' when it holds 0. {CEILING_NOTE} "
            + (
                "The profile routes are the profile's own at each budget."
                if result["config"].get("profile_all_budgets")
                else f"The profile routes are made at {result['config'].get('profile_budget') or result['config']['budgets'][0]} "
                "and rescaled to the other budgets."
            )
            + (" **No task reaches the threshold with the full cache: averages use every task.**"
               if res.get("no_task_qualifies") else ""),
            "",
            f"| budget | full | best homogeneous | profile | profile_alloc | {main} | "
            f"Q1 {main} - best homog. | Q2 - profile | Q2 - profile_alloc | Q3 task wins/ties/losses | Q5 gap recovered |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for e in res["budgets"]:
            avg = e["avg"]
            fmt = lambda r: f"{100 * avg[r]:.1f}" if r in avg else "n/a"  # noqa: E731
            q3 = e.get("task_wins")
            gap = e.get("gap_recovered")
            q1, q2_alloc = _q12(e)
            lines.append(
                f"| {e['budget']} | {100 * e['full']:.1f} | {fmt(e['best_homogeneous'])} ({e['best_homogeneous']}) | "
                f"{fmt('profile')} | {fmt('profile_alloc')} | {fmt(main)} | {q1} | "
                f"{_ci(e.get('vs_profile'))} | {q2_alloc} | "
                + (f"{q3['wins']}/{q3['ties']}/{q3['losses']} of {q3['tasks']}" if q3 else "n/a")
                + f" | {'n/a' if gap is None else f'{100 * gap:.0f} %'} |"
            )
        lines += _budget_step_lines(res, main)
        lines += _average_lines(res) + _task_lines(res, main)
        variants = sorted({v for e in res["budgets"] for v in e.get("variants_vs_main", {})})
        if variants:
            lines += ["", f"Q6, each variant minus `{main}` (paired, x100):", ""]
            lines.append("| variant | " + " | ".join(str(e["budget"]) for e in res["budgets"]) + " |")
            lines.append("|---|" + "---|" * len(res["budgets"]))
            for v in variants:
                lines.append(f"| {v} | " + " | ".join(_ci(e.get("variants_vs_main", {}).get(v)) for e in res["budgets"]) + " |")
        if "families" in res:
            lines += ["", *_family_table(res["families"], main)]
        lines += _seed_lines(res, main)
        lines += _control_lines(res, main)
        for key, part in res.get("families", {}).items():
            name = {"in": "in-family", "out": "out-of-family"}[key]
            lines += _seed_lines(part, main, f" {name} ({part['n_eval_samples']} samples)")
            lines += _control_lines(part, main, f" {name} ({part['n_eval_samples']} samples)")
        lines.append("")
    if "placement" in result:
        p = result["placement"]
        lines += [
            "## Q4: placement",
            "",
            f"The route `{p.get('variant', main)}` ranks **{p['rank']} of {p['of']}** among random placements of its methods "
            f"({p['ties']} tie with it; better than {100 * p['better_than_fraction']:.0f} %).",
            "",
        ]
    return "\n".join(lines)


def _average_lines(res: dict[str, Any]) -> list[str]:
    """Every route's average (x100) per budget (markdown lines)."""
    lines = ["", "Every route's average (x100) per budget:", ""]
    routes = sorted({r for e in res["budgets"] for r in e["avg"]})
    lines.append("| route | " + " | ".join(str(e["budget"]) for e in res["budgets"]) + " |")
    lines.append("|---|" + "---|" * len(res["budgets"]))
    for r in routes:
        cells = [f"{100 * e['avg'][r]:.1f}" if r in e["avg"] else "" for e in res["budgets"]]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return lines


def _task_lines(res: dict[str, Any], main: str) -> list[str]:
    """Per task, the main route, the best homogeneous and the profile routes (markdown lines)."""
    lines: list[str] = []
    if any(e.get("by_task") for e in res["budgets"]):
        lines += ["", "Per task (x100; every task, also those left out of the averages; best homogeneous: "
                  "the best on average at that budget):", ""]
        lines.append("| task (full cache) | route | " + " | ".join(str(e["budget"]) for e in res["budgets"]) + " |")
        lines.append("|---|---|" + "---|" * len(res["budgets"]))
        for t in sorted(res["full_by_task"]):
            for i, (label, key) in enumerate(((main, main), ("best homogeneous", None),
                                              ("profile", "profile"), ("profile_alloc", "profile_alloc"))):
                cells = []
                for e in res["budgets"]:
                    r = e["best_homogeneous"] if key is None else key
                    v = e.get("by_task", {}).get(r, {}).get(t)
                    cells.append("" if v is None else f"{100 * v:.1f}")
                head = f"{t} ({100 * res['full_by_task'][t]:.1f})" if i == 0 else ""
                lines.append(f"| {head} | {label} | " + " | ".join(cells) + " |")
    return lines


def _seed_lines(res: dict[str, Any], main: str, where: str = "") -> list[str]:
    """The main variant's training seeds (markdown lines): each seed's average and its
    questions 1, 2 and 8, the spread over seeds, and the seeds pooled (a sample's score the
    mean over seeds) with the same questions; none for a study without seeds."""
    if not any(e.get("seeds") for e in res["budgets"]):
        return []
    lines = ["", f"Training seeds of `{main}`{where} (the same samples and split; each seed's average, its "
             "paired differences, and the spread over seeds), x100:", "",
             "| budget | route | average | Q1 - best homog. | Q2 - profile_alloc | Q8 - its start |",
             "|---|---|---|---|---|---|"]
    for e in res["budgets"]:
        sd = e.get("seeds")
        if not sd:
            continue
        for r, v in sd["routes"].items():
            lines.append(f"| {e['budget']} | {r} | {100 * v:.1f} | {_ci(sd['vs_best_homogeneous'][r])} | "
                         f"{_ci(sd.get('vs_profile_alloc', {}).get(r))} | {_ci(sd.get('vs_start', {}).get(r))} |")
        lines.append(f"| {e['budget']} | spread | {100 * sd['min']:.1f}-{100 * sd['max']:.1f} "
                     f"(sd {100 * sd['sd']:.1f}) | | | |")
        pool = sd.get("pooled")  # absent in a study.json written before pooling
        if pool and pool["avg"] is not None:
            lines.append(f"| {e['budget']} | **seeds pooled** | {100 * pool['avg']:.1f} | {_ci(pool.get('vs_best_homogeneous'))} | "
                         f"{_ci(pool.get('vs_profile_alloc'))} | {_ci(pool.get('vs_start'))} |")
    return lines


def _family_table(families: dict[str, Any], main: str) -> list[str]:
    """In-family vs out-of-family answers side by side (markdown lines)."""
    out = [
        "In-family (eval tasks the routes were calibrated on: "
        + ", ".join(families["in"]["valid_tasks"]) + f"; {families['in']['n_eval_samples']} samples) vs "
        "out-of-family (tasks they never saw: " + ", ".join(families["out"]["valid_tasks"])
        + f"; {families['out']['n_eval_samples']} samples), paired x100. {CEILING_NOTE}",
        "",
        f"| budget | family | full | best homogeneous | {main} | Q1 {main} - best homog. | Q2 - profile_alloc | "
        "Q8 - its start |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e_in, e_out in zip(families["in"]["budgets"], families["out"]["budgets"]):
        for label, e in (("in", e_in), ("out", e_out)):
            avg, best = e["avg"], e.get("best_homogeneous")
            fmt = lambda r: f"{100 * avg[r]:.1f}" if r in avg else "n/a"  # noqa: E731
            full = "n/a" if e.get("full") is None else f"{100 * e['full']:.1f}"
            out.append(f"| {e['budget']} | {label} | {full} | {fmt(best)} ({best}) | {fmt(main)} | "
                       f"{' | '.join(_q12(e))} | "
                       f"{_ci(e.get('vs_start', {}).get(main))} |")
    return out


def summary_table(result: dict[str, Any]) -> str:
    """The short table ``make run`` prints: questions 1-3, 5 and 8 per protocol and budget,
    on every eval task and, when the study has both, in-family and out-of-family."""
    lines = ["| protocol | budget | Q1 vs best homog. | Q2 vs profile_alloc | Q8 vs its start | Q3 task wins "
             "| Q5 gap recovered |",
             "|---|---|---|---|---|---|---|"]
    main = route_name(result["config"].get("main_variant", "learned"))
    family_label = {"in": "in-family", "out": "out-of-family"}
    rows = []  # (label, answers): every eval task, then each family split
    for protocol, whole in result["protocols"].items():
        rows.append((protocol, whole))
        rows += [(f"{protocol}, {family_label[k]}", v) for k, v in whole.get("families", {}).items()]
    for label, res in rows:
        for e in res["budgets"]:
            q3 = e.get("task_wins")
            gap = e.get("gap_recovered")
            lines.append(
                f"| {label} | {e['budget']} | {' | '.join(_q12(e))} | {_ci(e.get('vs_start', {}).get(main))} | "
                + (f"{q3['wins']}/{q3['tasks']}" if q3 else "n/a")
                + f" | {'n/a' if gap is None else f'{100 * gap:.0f} %'} |"
            )
    if any("(ceiling)" in line for line in lines):
        lines.append(f"\n{CEILING_NOTE}")
    if "placement" in result:
        p = result["placement"]
        lines.append(
            f"\nQ4: the placement of `{p.get('variant', 'learned')}` ranks {p['rank']} of {p['of']} random placements of its methods."
        )
    return "\n".join(lines)
