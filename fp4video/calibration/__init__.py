"""``fp4video.calibrate``: find where a model needs precision, and the cheapest attention per site.

    import fp4video
    result = fp4video.calibrate(pipe, ["a cat on the grass", "a city at night"],
                                holdout=["a dog running"], budget=0.1,
                                call=dict(height=480, width=832, num_frames=81, num_inference_steps=40))
    result.write("calib/")              # policy.yaml, report.json, report.md, heatmap.png, as one set
    fp4video.install(pipe, result.policy)

The pipeline runs on the prompts with stock attention. At every site (expert × block × kind ×
denoising step) each candidate (fp4video methods and the external backends installed) runs on
the very inputs of each stock call and is compared with its output (worst head's relative L2 and
cosine); only these statistics are kept. Per site the cheapest candidate within the budget
(:class:`~fp4video.calibration.plan.Budget`, unit documented there) is chosen, and the result is a
:class:`~fp4video.integration.Policy` routing exactly that plan. The report predicts the step's
speed-up against stock and against each candidate alone, checks the plan on hold-out prompts, and
measures for a sample of sites how their error carries to the transformer's output.

Block-sparse candidates (``sparse=``: a method run on a dynamic or static selection of key tiles,
:mod:`fp4video.sparse`) are measured the same way on the selection each call would get, and cost
their method's time × :func:`~fp4video.calibration.plan.sparse_time` of their measured density at
the site; the policy names the chosen ones with ``sparsity:``.

With ``linear=["fp8-rowwise", ...]`` the transformer's linear layers are calibrated in the same
forwards (:mod:`.linear`): per linear site (expert × block × kind of linear layer) each method's
relative L2 error against the layer's own fp32 product and the time it saves, and within the same
budget the method saving the most, as ``result.linear_policy`` (a run config's ``linear:``).

A bare transformer calibrates too: ``calibrate(transformer, [inputs, ...])`` with each input a
dict of the transformer's keyword arguments (one forward each; no denoising step is known, so the
policy is per block and kind).

:func:`replan` chooses again from a written ``report.json`` at another budget or among fewer
candidates, measuring nothing; the report is validated first (:mod:`.schema`).

Where each step lives: :mod:`.run` (the measuring run, its :class:`~.run.Settings`), :mod:`.measure`
(the observer), :mod:`.linear` (the linear layers), :mod:`.costs` (timings and costs), :mod:`.plan`
(budget, choice, policy),
:mod:`.candidates` (what is tried), :mod:`.report` (the files' contents), :mod:`.files` (written as
one set), :mod:`.schema` (report.json's fields), :mod:`.replan` (choosing again), :mod:`.result`
(:class:`Calibration`).
"""

from __future__ import annotations

from .candidates import DEFAULT_CANDIDATES, DEFAULT_SPARSE, OPTIONAL_BACKENDS, sparse_targets
from .plan import Budget, SiteStats, plan_of_policy
from .replan import replan
from .result import FALLBACK, Calibration
from .run import calibrate

__all__ = ["calibrate", "replan", "Calibration", "Budget", "DEFAULT_CANDIDATES", "OPTIONAL_BACKENDS", "DEFAULT_SPARSE",
           "FALLBACK", "sparse_targets", "plan_of_policy", "SiteStats"]
