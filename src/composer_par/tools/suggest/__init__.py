"""Suggest a plan: every layout the installed plugins offer, those that fit, ranked by
predicted step time.

Each installed plugin says what suggest may try of it (``composer_par_suggest``): the
sizes its mesh dim may take and the options it may run with at given sizes of every dim
(:class:`~composer_par.plugin.SuggestAxis`). Suggest tries every combination of the dims'
sizes that fills ``nodes x devices_per_node`` ranks and divides the global batch
(``global_batch`` sequences per step, by default ``micro_batch`` x the world: each data
shard runs its share in micro-batches, accumulated or as a pipeline's microbatches), with
every choice of each plugin there, estimates each with the plugins' own terms
(:mod:`composer_par.estimate`), and ranks those whose per-rank memory fits the device by
predicted step time (compute, the communication nothing hides, a pipeline's bubble),
then by the least recomputation, then by memory. Along a first-fit axis (activation
checkpointing's mode) the choices go from the fastest to the leanest and the first that
fits is kept. The best whose plan file validates is printed as that plan file, with why
it has each of its choices; the runners-up each with the reason it lost. Pure Python: no
torch, no plugin named.

Its modules: ``space`` (the candidate layouts), ``ranking`` (:func:`suggest`),
``explain`` (why and why not) and ``report`` (the plan file and the text).
"""

from composer_par.tools.suggest.explain import reason_lost, why_best
from composer_par.tools.suggest.ranking import Ranked, Suggestion, rank_key, suggest
from composer_par.tools.suggest.report import format_suggestion, plan_file, validate
from composer_par.tools.suggest.space import Candidate, Pick, families, plugin_axes

__all__ = ["Candidate", "Pick", "Ranked", "Suggestion", "families", "format_suggestion",
           "plan_file", "plugin_axes", "rank_key", "reason_lost", "suggest", "validate",
           "why_best"]
