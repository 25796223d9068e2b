"""What a calibration returns: :class:`Calibration`, the policy with the plan, the statistics it
was chosen from and the report; and what a calibrated policy does with a call its target cannot take."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..integration.policy import Policy

__all__ = ["Calibration", "LinearCalibration", "FALLBACK"]

#: What a calibrated policy does with a call its chosen backend cannot take (a mask or an LSE request
#: the calibration run never made): stock attention, recorded with the target it planned.
FALLBACK = "stock"


@dataclass
class LinearCalibration:
    """What calibration found for the linear layers (:mod:`~fp4video.calibration.linear`):
    ``policy`` (a :class:`~fp4video.integration.linear.LinearPolicy`: a run config's ``linear:``),
    ``plan`` ({(expert, block, kind): method}), ``stats`` ({site:
    :class:`~fp4video.calibration.linear.LinearSiteStats`}), the ``methods`` measured (bf16 first)
    and ``forms`` (how each was measured), the input ``rows`` sampled per call, whether times are
    ``compile``d, and the ``unmeasured`` (expert, block, kind) triples (outside the blocks: bf16)."""

    policy: object
    plan: dict
    stats: dict
    methods: list
    forms: dict
    rows: int
    compile: bool = False
    unmeasured: list = field(default_factory=list)


@dataclass
class Calibration:
    """What :func:`~fp4video.calibration.calibrate` found: ``policy`` (install it), ``plan``
    ({site: target}), ``stats`` ({site: :class:`~fp4video.calibration.plan.SiteStats`}, calibration
    prompts), ``holdout_stats`` (hold-out prompts), ``report`` (a JSON-ready dict), ``linear``
    (the linear layers', with ``calibrate(linear=...)``). Sites are (expert, block, kind, step)
    tuples."""

    policy: Policy
    plan: dict
    stats: dict
    holdout_stats: dict
    report: dict
    num_steps: int | None = None
    candidates: list = field(default_factory=list)
    linear: LinearCalibration | None = None  # with calibrate(linear=...): the linear layers' policy

    @property
    def linear_policy(self):
        """The calibrated :class:`~fp4video.integration.linear.LinearPolicy` (None: the linear
        layers were not calibrated)."""
        return None if self.linear is None else self.linear.policy

    def policy_yaml(self) -> str:
        from .report import policy_yaml

        return policy_yaml(self)

    def write(self, out_dir, extra: dict | None = None) -> dict:
        """Write ``policy.yaml``, ``report.json``, ``report.md`` and ``heatmap.png`` in ``out_dir``
        (and ``extra``: {file name: text}, e.g. the command line's ``run.yaml``) as one set: every
        file goes to a temporary name first and all are renamed in together, so a failure leaves
        the folder's previous set as it was (:func:`~fp4video.calibration.files.write_file_set`). A
        ``run.yaml`` of an earlier calibration that the set does not replace is removed with it
        (it carries the earlier policy). Returns {what: path}."""
        from .files import write_file_set
        from .report import render_files

        files, names = render_files(self)
        for name, text in (extra or {}).items():
            files[name] = text.encode("utf-8") if isinstance(text, str) else text
        written = write_file_set(Path(out_dir), files, stale=("run.yaml",))
        return {what: written[name] for what, name in names.items()}

    def uniform_plan(self, target: str) -> dict:
        """{site: target} of ``target`` everywhere (the FP16 tier where it refused a call)."""
        return {k: target if target not in s.refused else "fp16" for k, s in self.stats.items()}
