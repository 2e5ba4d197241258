"""``learnroute study``: learned vs profile-guided vs homogeneous routes, end to end.

The package in the order a reader follows a run: :mod:`~learnroute.study.config` (what a
study is), :mod:`~learnroute.study.recipe` (its stages), :mod:`~learnroute.study.manifest`
(what each exported route is), :mod:`~learnroute.study.analysis` (the comparisons) and
:mod:`~learnroute.study.render` (study.md and the plots).

Stages (each a sub-folder of the study folder, each resumable on its own):

1. ``profile/``: per-layer damage on **calibration** samples -> ``profile_<b>.json``
   (per-layer best method) and ``profile_<b>_alloc.json`` (+ sensitivity budgets);
2. ``train/<variant>/``: learned gates per variant (the main route and the ablations),
   on the same calibration samples;
3. ``routes/``: every learned route exported (hardened; mixtures where asked), each warm
   variant's untrained start, and ``manifest.json``: per route its name, kind (learned,
   seed, per_budget, mixture, start, imported), variant, seed, start (or start_of) and
   pinned budget, which the bench and the analysis read instead of parsing file names;
4. ``bench_<protocol>/``: **eval** samples (a disjoint seed stream): the full cache, every
   homogeneous method, pyramid, profile-guided and learned routes at every budget;
5. ``placement/``: a route with several methods (a variant's or the profile's) among
   random placements of its methods;
6. ``study.json`` / ``study.md``: the answers, with paired bootstrap intervals. Each
   comparison's key says what it compares (``vs_best_homogeneous``, ``vs_adakv_best``,
   ``vs_profile_alloc``, ``vs_start``, ``variants_vs_main``, ``per_head``, ``task_wins``,
   ``gap_recovered``, ``main_vs_smaller_budget``, ``placement``); study.md labels them
   with the study's question numbers (Q1 ... Q9).

Finished stages are skipped (a train variant with its ``route.json``, a profile with its
``profile.json``); bench and placement skip finished samples themselves. ``analyze``
rebuilds the answers from the folders alone (``learnroute report STUDY_FOLDER``).
"""

from learnroute.study.analysis import analyze
from learnroute.study.config import StudyConfig, route_name
from learnroute.study.recipe import run_study
from learnroute.study.render import summary_table, to_markdown

__all__ = ["StudyConfig", "analyze", "route_name", "run_study", "summary_table", "to_markdown"]
