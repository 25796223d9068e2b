"""Calibration's inputs, files and structure: a report read back is checked field by field (a
number out of its range is refused, never believed); the files of a calibration are written as one
set; every flag's bad value is one line naming the flag; ``--quiet`` silences the pipeline's own
progress bar; the report says plainly what it predicts; the package's ``__init__`` hands names on.
Property tests perturb every field of a real report.json."""

from __future__ import annotations

import ast
import copy
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("diffusers")

from fp4video.calibration import Calibration, replan  # noqa: E402
from fp4video.cli.main import main  # noqa: E402
from fp4video.integration import Policy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPARSE = "mxattn-pv8+dynamic:0.9"


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    """A real calibration folder of the tiny two-expert Wan pipeline (3 steps), written by the CLI:
    fp8, mxattn-pv8 and a block-sparse candidate, a hold-out prompt, two propagation pairs."""
    out = tmp_path_factory.mktemp("calib") / "c"
    rc = main(["calibrate", "--model", "tiny", "--steps", "3", "--height", "32", "--width", "48", "--frames", "5",
               "--prompt", "a cat", "--holdout", "a bird", "--candidates", "fp16", "fp8", "mxattn-pv8",
               "--sparse", "dynamic:0.9", "--propagation", "2", "--budget", "0.2", "--quiet", "--out", str(out)])
    assert rc == 0
    return out


def _report(calib: Path) -> dict:
    return json.loads((calib / "report.json").read_text())


def _copy(calib: Path, tmp_path: Path, edit=None) -> Path:
    """The calibration folder copied, its report.json changed by ``edit(report)``."""
    d = tmp_path / "edited"
    shutil.copytree(calib, d)
    if edit is not None:
        r = _report(d)
        edit(r)
        (d / "report.json").write_text(json.dumps(r))
    return d


def _cli(capsys, *args) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = main(["calibrate", *map(str, args)])
    return rc, capsys.readouterr().err.strip().splitlines()


def _set(tree, path, value):
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _shape(r: dict) -> str:
    return "x".join(map(str, r["sites"][0]["shape"]))


# --- impossible numbers in a report are refused, never believed ----------------------------------------

IMPOSSIBLE = [
    (lambda r: ("sites", 0, "density", SPARSE), -1, "sites[0].density.mxattn-pv8+dynamic:0.9: must be >= 0, got -1"),
    (lambda r: ("costs", "relative_to_stock", "fp8", _shape(r)), -5, ".fp8.{shape}: must be > 0, got -5"),
    (lambda r: ("sites", 0, "calls"), -3, "sites[0].calls: must be >= 1, got -3"),
    (lambda r: ("sites", 1, "rel_l2", "fp8"), -1, "sites[1].rel_l2.fp8: must be >= 0, got -1"),
    (lambda r: ("sites", 2, "cosine", "mxattn-pv8"), 2, "sites[2].cosine.mxattn-pv8: must be <= 1.001, got 2"),
    (lambda r: ("sites", 0, "holdout", "rel_l2", "fp8"), "-inf", "sites[0].holdout.rel_l2.fp8: must be finite"),
    (lambda r: ("measurements", "shapes", 0, "stock_seconds"), 0, "measurements.shapes[0].stock_seconds: must be > 0"),
    (lambda r: ("measurements", "forward_seconds"), -1, "measurements.forward_seconds: must be > 0, got -1"),
    (lambda r: ("measurements", "forwards"), 0, "measurements.forwards: must be >= 1, got 0"),
    (lambda r: ("num_steps",), -2, "num_steps: must be >= 1, got -2"),
    (lambda r: ("sites", 0, "block"), -1, "sites[0].block: must be >= 0, got -1"),
    (lambda r: ("sites", 0, "step"), 3, "sites[0].step: 3 is not below num_steps 3"),
    (lambda r: ("budget", "rel_l2"), -0.1, "budget.rel_l2: must be > 0"),
    (lambda r: ("propagation", "pairs", 0, "output_rel_l2"), -1, "propagation.pairs[0].output_rel_l2: must be >= 0"),
    (lambda r: ("sites", 0, "rel_l2", "fp8"), "0.1", 'sites[0].rel_l2.fp8: must be a number, got "0.1"'),
    (lambda r: ("sites", 0, "calls"), True, "sites[0].calls: must be a whole number, got true"),
]


@pytest.mark.parametrize("where, value, message", IMPOSSIBLE, ids=[m.split(":")[0] for _, _, m in IMPOSSIBLE])
def test_impossible_numbers_in_a_report_are_refused_naming_the_field(calib, tmp_path, capsys, where, value, message):
    """A report's numbers are checked for their type and range when it is read: ``--from`` on a
    site density of −1, a cost of −5 or ``calls: -3`` is refused in one line naming the field's
    path, before anything is chosen or written (it used to choose, and predict negative speed-ups)."""
    r = _report(calib)
    _set(r, where(r), value)
    d = _copy(calib, tmp_path, lambda rr: _set(rr, where(rr), value))
    rc, err = _cli(capsys, "--from", d, "--out", tmp_path / "out")
    expected = message.format(shape=_shape(r))
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"fp4video calibrate: error: --from {d / 'report.json'}: ") and expected in err[0], err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="^[^\n]*$") as e:  # the API: one line too
        replan(r)
    assert expected in str(e.value)


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), -0.1, 0])
def test_impossible_budgets_given_to_the_api_are_one_line_errors(calib, budget):
    with pytest.raises(ValueError, match="^budget must be a relative L2 error greater than 0 and finite, got [^\n]*$"):
        replan(calib, budget=budget)


def test_a_sound_report_validates_and_chooses_again_as_before(calib):
    """The checks refuse nothing a calibration writes: its report (and a re-chosen one's, chained)
    validates, with non-finite numbers spelled as strings read back as floats."""
    from fp4video.calibration.schema import validate_report

    r = _report(calib)
    assert validate_report(r).num_steps == 3
    again = replan(calib, budget=0.5, candidates=["fp8"])
    validate_report(json.loads(json.dumps(again.report)))
    r["sites"][0]["rel_l2"]["fp8"] = "nan"  # a candidate whose output was not finite: never chosen there
    r["sites"][0]["cosine"]["fp8"] = "nan"
    site = (r["sites"][0]["expert"], r["sites"][0]["block"], r["sites"][0]["kind"], r["sites"][0]["step"])
    assert math.isnan(validate_report(r).sites[0].rel_l2["fp8"])
    assert replan(r, budget=10.0, candidates=["fp8"]).plan[site] == "fp16"


# --- hand-edited reports: every problem one line naming the field --------------------------------------

HAND_EDITED = [
    ("num_steps", 0, "num_steps: must be >= 1, got 0"),
    ("replanned", "x", 'replanned: must be an object ({...}), got "x"'),
    ("calibration", [], "calibration: must be an object ({...}), got []"),
    ("sites", [], "sites: must hold at least 1 entry, got []"),
    ("model", "tiny", 'model: must be an object ({...}), got "tiny"'),
    ("candidates", [], "candidates: must hold at least 1 entry, got []"),
    ("candidates", ["fp16", "fp8"], "sites[0].rel_l2.mxattn-pv8: neither a candidate nor an unavailable one"),
    ("budget", {"rel_l2": 0.1, "match": "backend:_native_cudnn"}, "budget.match: the budget matches"),
    ("fp16_backend", "sage", "fp16_backend: 'sage' quantizes"),
    ("unexpected", 1, "unexpected: not a field of a calibration report"),
]


@pytest.mark.parametrize("field, value, message", HAND_EDITED, ids=[f"{f}={v!r}" for f, v, _ in HAND_EDITED])
def test_hand_edited_reports_are_one_line_naming_the_field(calib, tmp_path, capsys, field, value, message):
    d = _copy(calib, tmp_path, lambda r: r.__setitem__(field, value))
    rc, err = _cli(capsys, "--from", d, "--out", tmp_path / "out")
    assert rc == 2 and len(err) == 1 and message in err[0], err


def test_hand_edited_cost_rows_and_statistics_are_named(calib, tmp_path, capsys):
    def row_as_list(r):
        r["costs"]["relative_to_stock"]["fp8"] = [1, 2]

    def no_row(r):
        del r["costs"]["relative_to_stock"]["mxattn-pv8"]

    def twice(r):
        r["sites"].append(copy.deepcopy(r["sites"][0]))

    for edit, message in ((row_as_list, "costs.relative_to_stock.fp8: must be an object"),
                          (no_row, "costs.relative_to_stock: no row for mxattn-pv8"),
                          (twice, "the same site as sites[0]")):
        d = _copy(calib, tmp_path / edit.__name__, edit)
        rc, err = _cli(capsys, "--from", d, "--out", tmp_path / "out")
        assert rc == 2 and len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("text, message", [
    ("policy: [\n", "not valid YAML"),
    ("steps: -1\n", "steps"),
    ("- a list\n", "expected a mapping"),
])
def test_a_broken_run_config_beside_the_report_is_its_own_one_line_error(calib, tmp_path, capsys, text, message):
    """``run.yaml`` beside the report is read before anything is written; a problem there names
    that file (not a YAML traceback, not the command line)."""
    d = _copy(calib, tmp_path)
    (d / "run.yaml").write_text(text)
    rc, err = _cli(capsys, "--from", d, "--out", tmp_path / "out")
    assert rc == 2 and len(err) == 1, err
    assert str(d / "run.yaml") in err[0] and message in err[0] and "command line" not in err[0], err
    assert not (tmp_path / "out").exists()


def test_calibration_never_records_a_schedule_of_zero_steps():
    """A scheduler whose order exceeds its timesteps places no step (the routing leaves steps
    unknown); calibration records no schedule then (None), never ``num_steps: 0``, which no
    policy can match against, and the report validates."""
    from fp4video.calibration import calibrate
    from fp4video.integration.tiny import tiny_wan_pipeline

    pipe = tiny_wan_pipeline(two_experts=False)
    pipe.scheduler.order = 8  # 2 timesteps // order 8: no step
    call = dict(negative_prompt="", height=32, width=32, num_frames=1, num_inference_steps=2, guidance_scale=1.0,
                max_sequence_length=16)
    result = calibrate(pipe, ["a cat"], candidates=["fp16", "fp8"], call=call, propagation=0, progress=False)
    assert result.num_steps is None and result.report["num_steps"] is None
    assert all(k[3] is None for k in result.plan)
    from fp4video.calibration.schema import validate_report

    validate_report(json.loads(json.dumps(result.report)))


def test_prompts_of_different_schedule_lengths_are_refused():
    from fp4video.calibration import calibrate
    from fp4video.integration.tiny import tiny_wan_pipeline

    pipe = tiny_wan_pipeline(two_experts=False)

    def call(prompt):
        return dict(negative_prompt="", height=32, width=32, num_frames=1, guidance_scale=1.0, max_sequence_length=16,
                    num_inference_steps=2 if prompt == "a cat" else 3)

    with pytest.raises(ValueError, match="schedules of 2, 3 denoising steps"):
        calibrate(pipe, ["a cat", "a dog"], candidates=["fp16", "fp8"], call=call, propagation=0, progress=False)


# --- the files of a calibration: one set, or the previous one untouched ----------------------------------

def _contents(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_a_failed_write_leaves_the_previous_set_intact(calib, tmp_path, capsys):
    """``report.json`` a folder: nothing of the new set is written (no new policy.yaml beside the
    old run.yaml), the command says which file, in one line."""
    out = tmp_path / "out"
    assert _cli(capsys, "--from", calib, "--budget", "0.5", "--out", out)[0] == 0
    (out / "report.json").unlink()
    (out / "report.json").mkdir()
    before = _contents(out)
    rc, err = _cli(capsys, "--from", calib, "--budget", "0.01", "--out", out)
    assert rc == 2 and len(err) == 1 and "report.json is a folder" in err[0], err
    assert _contents(out) == before
    # the API alone (no command line to check first): the same, and no temporary file left
    with pytest.raises(OSError, match="report.json: is a folder") as e:
        replan(calib, budget=0.01).write(out)
    assert "\n" not in str(e.value)
    assert _contents(out) == before and sorted(p.name for p in out.iterdir()) == sorted([*before, "report.json"])


def test_a_write_failing_midway_puts_the_previous_set_back(calib, tmp_path, monkeypatch):
    """A rename failing after others succeeded: the files already renamed in go and the previous
    ones come back, byte for byte; no temporary file is left."""
    import fp4video.calibration.files as files

    out = tmp_path / "out"
    first = replan(calib, budget=0.5)
    first.write(out, extra={"run.yaml": "model: tiny\n"})
    before = _contents(out)
    real = files.os.replace
    failed = []

    def replace(src, dst):  # the new report.md's rename fails, once
        if Path(dst).name == "report.md" and ".partial" in Path(src).name and not failed:
            failed.append(dst)
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(files.os, "replace", replace)
    with pytest.raises(OSError, match="report.md: cannot be put in place .No space left on device.") as e:
        replan(calib, budget=0.01).write(out, extra={"run.yaml": "model: tiny\nsteps: 3\n"})
    assert "\n" not in str(e.value)
    assert _contents(out) == before
    assert sorted(p.name for p in out.iterdir()) == sorted(before)  # nothing hidden left behind


def test_a_stale_run_config_never_sits_beside_a_new_policy(calib, tmp_path):
    """Writing a calibration (without a run config of its own) where an earlier one left
    ``run.yaml`` removes it: it carries the earlier policy."""
    out = tmp_path / "out"
    shutil.copytree(calib, out)
    again = replan(calib, budget=0.01)
    assert again.policy != Policy.model_validate(yaml.safe_load((out / "policy.yaml").read_text()))
    again.write(out)
    assert not (out / "run.yaml").exists()
    assert Policy.model_validate(yaml.safe_load((out / "policy.yaml").read_text())) == again.policy


# --- every flag's bad value: one line naming the flag and the reason -----------------------------------

BAD_FLAGS = [
    (["--sparse", "dynamic:2"], "--sparse: sparse candidate 'dynamic:2': τ is a share", "at most 1, got 2"),
    (["--sparse", "dynamic:0"], "--sparse: sparse candidate 'dynamic:0'", "greater than 0"),
    (["--sparse", "dynamic:nan"], "--sparse: sparse candidate 'dynamic:nan'", "got nan"),
    (["--sparse", "static:-1,2,2"], "--sparse: sparse candidate 'static:-1,2,2'", "whole number from 0, got '-1'"),
    (["--sparse", "static:1,2"], "--sparse: sparse candidate 'static:1,2'", "3 radii"),
    (["--candidates", "backend:fa3_fp8", "--sparse", "dynamic:0.9"], "--sparse: ", "no fp4video method"),
    (["--min-cosine", "nan"], "--min-cosine nan: ", "a cosine"),
    (["--min-cosine", "-1"], "--min-cosine -1.0: ", "greater than -1"),
    (["--budget", "nan"], "--budget nan: ", "greater than 0"),
    (["--budget", "inf"], "--budget inf: ", "finite"),
    (["--transformer", "wan22", "--layers", "-2"], "--layers -2: ", "at least 1"),
    (["--transformer", "wan22", "--forwards", "9"], "--forwards 9: ", "1 to 4"),
    (["--model", "tiny", "--layers", "2"], "--layers ", "is for --transformer"),
    (["--transformer", "wan22", "--holdout", "x"], "--holdout ", "is for a pipeline"),
    (["--match", "nope"], "--match nope: ", "unknown candidate 'nope'"),
    (["--match", "backend:_native_cudnn"], "--match backend:_native_cudnn: ", "exact backend"),
    (["--candidates", "fp8", "mxatn"], "--candidates mxatn: ", "unknown candidate 'mxatn'"),
    (["--costs", "missing.md"], "--costs missing.md: ", "no such file"),
    (["--fp16-backend", "sage"], "--fp16-backend sage: ", "quantizes"),
    (["--fp16-backend", "nope"], "--fp16-backend nope: ", "unknown backend 'nope'"),
    (["--propagation", "-1"], "--propagation -1: ", "0 or more"),
    (["--device", "nonsense"], "--device 'nonsense': ", "not a device name"),
    (["--model", "tiny", "--family", "nope"], "--family nope: ", "'wan'"),
    (["--model", "tiny", "--steps", "0"], "--steps 0: ", "at least 1"),
    (["--model", "tiny", "--height", "50"], "--height 50: ", "multiple of 16"),
    (["--model", "tiny", "--prompt", " "], "--prompt ' ': ", "empty"),
    (["--config", "missing.yaml"], "--config missing.yaml: ", "no such config file"),
]


@pytest.mark.parametrize("args, start, reason", BAD_FLAGS, ids=[" ".join(a) for a, _, _ in BAD_FLAGS])
def test_every_flags_bad_value_is_one_line_naming_the_flag(tmp_path, capsys, args, start, reason):
    rc, err = _cli(capsys, "--out", tmp_path / "o", *args)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"fp4video calibrate: error: {start}") and reason in err[0], err
    assert "For further information" not in err[0] and "command line" not in err[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, start, reason", [
    (["--min-cosine", "nan"], "--min-cosine nan: ", "a cosine"),
    (["--candidates", "sage3"], "--candidates: ", "sage3 not measured"),
    (["--match", "mxattn"], "--match: ", "mxattn not measured"),
    (["--sparse", "dynamic:0.9"], "--sparse ", "measures; --from only chooses again"),
])
def test_flags_with_from_name_the_flag_not_the_report(calib, tmp_path, capsys, args, start, reason):
    rc, err = _cli(capsys, "--from", calib, "--out", tmp_path / "o", *args)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"fp4video calibrate: error: {start}") and reason in err[0], err


# --- --quiet: the pipeline's own progress bar too ----------------------------------------------------------

def test_quiet_silences_the_pipelines_progress_bar_and_restores_it(capfd):
    from fp4video.calibration import calibrate
    from fp4video.integration.tiny import tiny_wan_pipeline

    pipe = tiny_wan_pipeline(two_experts=False)
    pipe.set_progress_bar_config(desc="the user's bar")
    call = dict(negative_prompt="", height=32, width=32, num_frames=1, num_inference_steps=2, guidance_scale=1.0,
                max_sequence_length=16)
    capfd.readouterr()
    calibrate(pipe, ["a cat"], candidates=["fp16", "fp8"], call=call, propagation=0, progress=False)
    err = capfd.readouterr().err
    assert "the user's bar" not in err and "it/s" not in err and "%|" not in err, err
    with torch.no_grad():  # afterwards the pipeline's bar is the user's again
        pipe(prompt="a cat", output_type="latent", generator=torch.Generator().manual_seed(0), **call)
    assert "the user's bar" in capfd.readouterr().err


# --- the report says plainly what it predicts; the heatmap labels experts and marks the budget -------------

def test_report_md_leads_with_the_result_and_lists_what_was_not_measured_last(calib):
    r = _report(calib)
    r["unavailable"]["backend:sage"] = ("backend 'sage' is not installed: Sage Attention backend 'sage' is not "
                                        "usable because of missing package")
    from fp4video.calibration.report import markdown

    md = markdown(replan(r)).splitlines()
    head = "\n".join(md[:md.index("## Chosen per site")])
    assert "backend:sage" not in head and "not installed" not in head
    assert md[md.index("## Not measured") + 2] == "- backend:sage (not installed)"
    assert md.index("## Not measured") > md.index("## Sites")
    text = "\n".join(md)
    assert "step speed-up vs stock (predicted)" in text and "Predicted, not measured" in text
    assert "H200 cost table" in text and "`--costs measure` times the candidates on this device" in text
    r["costs"]["source"] = "measure"
    measured = "\n".join(markdown(replan(r)).splitlines())
    assert "H200" not in measured and "timings on this device" in measured


def test_heatmap_labels_experts_and_marks_the_budget_on_one_error_scale(calib):
    from fp4video.calibration.report import heatmap_figure

    result = replan(calib)
    fig = heatmap_figure(result)
    try:
        images = [im for ax in fig.axes for im in ax.images]
        errors = [im for im in images if im.get_cmap().name.startswith("coolwarm")]
        assert len(errors) == len({k[2] for k in result.plan}) == 2  # one error panel per kind
        assert errors[0].norm is errors[1].norm  # one scale for both
        assert errors[0].norm.vcenter == pytest.approx(math.log10(0.2))  # centred on the budget
        axes = [*fig.axes, *(child for ax in fig.axes for child in ax.child_axes)]  # (the experts' axis is a child)
        labels = {t.get_text() for ax in axes for t in ax.get_xticklabels() + ax.get_yticklabels()}
        assert {"high_noise", "low_noise"} <= labels and "budget 0.2" in labels
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


# --- the package's __init__ hands names on ---------------------------------------------------------------

def test_the_calibration_package_init_only_hands_names_on():
    """The algorithm lives in modules a reader finds by name (run, replan, measure, plan, ...);
    ``__init__`` holds no function or class, and the public API is importable as before."""
    import fp4video
    import fp4video.calibration as calibration
    from fp4video.calibration.run import Settings, calibrate

    tree = ast.parse((ROOT / "fp4video" / "calibration" / "__init__.py").read_text())
    defined = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    assert not defined, defined
    for name in ("calibrate", "replan", "Calibration", "Budget", "DEFAULT_CANDIDATES", "OPTIONAL_BACKENDS",
                 "DEFAULT_SPARSE"):
        assert hasattr(calibration, name) and name in calibration.__all__, name
    assert fp4video.calibrate is calibrate is calibration.calibrate and calibration.Calibration is Calibration
    assert "budget" in Settings.__dataclass_fields__ and "targets" in Settings.__dataclass_fields__


# --- properties: report.json with any field perturbed -------------------------------------------------------

def _paths(tree, prefix=()):
    """Every (path, value) in a JSON tree, the root excepted."""
    out = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for k, v in items:
        out.append((prefix + (k,), v))
        out.extend(_paths(v, prefix + (k,)))
    return out


WRONG = ["x", [], {}, True, None, 1.5, -3, 0, 2, 1e300, "nan", "inf", "-inf", -1e-9]
EXTRA = "zz_extra"


def _perturb(report: dict, path: tuple, how: str, value):
    r = copy.deepcopy(report)
    parent = r
    for key in path[:-1]:
        parent = parent[key]
    if how == "replace":
        parent[path[-1]] = value
    elif how == "delete":
        if not isinstance(parent, dict):
            return None
        del parent[path[-1]]
    else:  # an extra key in the dict at ``path``
        target = parent[path[-1]]
        if not isinstance(target, dict):
            return None
        target[EXTRA] = value
    return r


def _names(path: tuple, how: str) -> set:
    """Names a message about a change at ``path`` may give: the keys along it (an extra key's own)."""
    names = {str(k) for k in path if isinstance(k, str)}
    return names | ({EXTRA} if how == "extra" else set())


def _check_one_line_naming(message: str, path: tuple, how: str):
    assert "\n" not in message and message, message
    assert any(n in message for n in _names(path, how)), (path, how, message)


def _strategy():
    from hypothesis import strategies as st

    return st.tuples(st.integers(min_value=0), st.sampled_from(["replace", "delete", "extra"]), st.sampled_from(WRONG))


def test_property_replan_on_a_perturbed_report_works_or_names_the_field(calib):
    """Any field of a real report changed (a wrong type, out of range, missing, an extra key):
    ``replan`` either chooses (every figure it predicts non-negative) or raises a one-line
    ValueError naming the field."""
    from hypothesis import HealthCheck, given, settings

    report = _report(calib)
    paths = _paths(report)

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(_strategy())
    def check(case):
        i, how, value = case
        path = paths[i % len(paths)][0]
        r = _perturb(report, path, how, value)
        if r is None:
            return
        try:
            result = replan(r)
        except ValueError as e:
            _check_one_line_naming(str(e), path, how)
            return
        p = result.report["prediction"]
        assert p["step_speedup_vs_stock"] >= 0 and (p["attention_speedup_vs_stock"] or 0) >= 0

    check()


def test_property_calibrate_from_a_perturbed_report_works_or_fails_in_one_line(calib, capsys):
    """The same through the command line: exit 0 with a policy that loads, or exit 2 with one
    line naming the field; never a traceback."""
    from hypothesis import HealthCheck, given, settings

    report = _report(calib)
    paths = _paths(report)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(_strategy())
    def check(case):
        i, how, value = case
        path = paths[i % len(paths)][0]
        r = _perturb(report, path, how, value)
        if r is None:
            return
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp) / "c"
            d.mkdir()
            (d / "report.json").write_text(json.dumps(r))
            rc, err = _cli(capsys, "--from", d, "--out", Path(tmp) / "out")
            if rc == 0:
                Policy.model_validate(yaml.safe_load((Path(tmp) / "out" / "policy.yaml").read_text()))
                return
            assert rc == 2 and len(err) == 1 and err[0].startswith("fp4video calibrate: error: --from "), err
            _check_one_line_naming(err[0], path, how)
            assert not (Path(tmp) / "out").exists()

    check()


def test_the_test_model_on_another_family_blames_the_flag(capsys, tmp_path):
    """A check of the whole run config (the test model is Wan's) names the flag that set it, not
    "the default run config"."""
    rc, err = _cli(capsys, "--model", "test", "--family", "hunyuan", "--out", tmp_path / "o")
    assert rc == 2 and len(err) == 1 and err[0].startswith("fp4video calibrate: error: --model test: "), err
    assert "needs family wan" in err[0] and "default run config" not in err[0] and "(top level)" not in err[0]


@pytest.fixture(scope="module")
def smoke_pack(tmp_path_factory) -> Path:
    """A SMOKE test model packed as ``scripts/train_test_model.py --pack`` packs it (its sizes recorded)."""
    from fp4video.testmodel.model import SMOKE, build_pipeline, pack, save_pipeline

    root = tmp_path_factory.mktemp("smoke")
    pack(save_pipeline(build_pipeline(SMOKE), root / "pipe"), root / "pack", extra={"config": SMOKE.model_dump()})
    return root / "pack"


def test_calibrate_takes_a_saved_test_model_at_its_own_sizes(smoke_pack, tmp_path, capsys):
    """``--model DIR`` of a packed test model could not load it (a pack is no diffusers folder); it
    now calibrates as the test model, at the sizes its training recorded, the path kept as given."""
    from fp4video.testmodel.model import SMOKE

    out = tmp_path / "o"
    rc, err = _cli(capsys, "--model", smoke_pack, "--steps", "2", "--candidates", "fp8", "--propagation", "0",
                   "--quiet", "--out", out)
    assert rc == 0, err
    name = _report(out)["model"]["name"]
    assert name == f"{smoke_pack} wan ({SMOKE.height}×{SMOKE.width}, {SMOKE.frames} frames, 2 steps)", name
    run = yaml.safe_load((out / "run.yaml").read_text())
    assert run["model"] == str(smoke_pack) and run["height"] == SMOKE.height and run["frames"] == SMOKE.frames


def test_a_saved_test_model_on_another_family_blames_the_flag(smoke_pack, tmp_path, capsys):
    rc, err = _cli(capsys, "--model", smoke_pack, "--family", "hunyuan", "--out", tmp_path / "o")
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"fp4video calibrate: error: --model {smoke_pack}: "), err
    assert "needs family wan" in err[0]


def test_a_damaged_saved_test_model_is_one_line_for_calibrate(smoke_pack, tmp_path, capsys):
    damaged = shutil.copytree(smoke_pack, tmp_path / "pack")
    (damaged / "transformer.safetensors").unlink()
    rc, err = _cli(capsys, "--model", damaged, "--out", tmp_path / "o")
    assert rc == 2 and len(err) == 1 and "transformer.safetensors is missing" in err[0], err
