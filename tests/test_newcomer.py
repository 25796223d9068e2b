"""What a new user meets first: the README's set-up and snippets, the command line's help, version
and outputs, and the public names the README calls."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _readme_command(number: int) -> str:
    """The command under ``# <number>.`` in the README's set-up block."""
    setup = README[README.index("## Set-up"):README.index("## Quick start")]
    block = setup[setup.index(f"# {number}."):]
    return next(line for line in block.splitlines() if line and not line.startswith("#"))


def _python_blocks(section: str) -> list[str]:
    start = README.index(section)
    end = README.index("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", README[start:end], re.DOTALL)


def test_ci_runs_the_readmes_test_command():
    """.ci/run says it runs exactly the README's test command (set-up included): the two stay one line."""
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == _readme_command(2)


@pytest.mark.parametrize("number", [1, 2])
def test_the_readme_installs_pytorchs_cpu_build(number):
    """Regression (cpu_install_pulls_cuda): ``torch==2.13.0`` from PyPI alone is the Linux wheel that
    pulls the CUDA libraries; both set-up commands take torch from PyTorch's CPU index first."""
    command = _readme_command(number)
    torch_step, rest = command.split(" && .venv/bin/pip install -q -e ", 1)
    assert torch_step.endswith(f"pip install -q --no-deps torch==2.13.0 --index-url {CPU_INDEX}"), torch_step
    assert "torch" not in rest


def test_one_prompt_writes_exactly_the_named_file_several_one_each():
    from fp4video.cli.generate import output_names, several_outputs

    out = Path("calib-tiny.mp4")
    assert output_names(out, 1) == [out]
    names = output_names(out, 2)
    assert names == [Path("calib-tiny_0.mp4"), Path("calib-tiny_1.mp4")]
    said = several_outputs(names)
    assert "2 prompts" in said and all(str(n) in said for n in names)


def test_a_run_of_several_prompts_says_which_files_it_writes(tmp_path):
    """Regression (several_prompts_unannounced): ``--output x.mp4`` with a two-prompt config wrote
    x_0.mp4 and x_1.mp4 without a word; the command says so before it starts and when it ends."""
    out = tmp_path / "x.mp4"
    run = subprocess.run([sys.executable, "-m", "fp4video.cli.main", "generate", "--model", "tiny", "--steps", "1",
                          "--frames", "5", "--prompt", "a cat", "--prompt", "a dog", "--output", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    # the run's own lines; notes (a step rule under --steps 1, say) are counted apart
    lines = [line for line in run.stderr.splitlines()
             if line.startswith("fp4video generate: ") and not line.startswith("fp4video generate: note:")]
    written = [tmp_path / "x_0.mp4", tmp_path / "x_1.mp4"]
    assert all(p.exists() and p.with_suffix(".json").exists() for p in written) and not out.exists()
    assert len(lines) == 2 and all(str(p) in line for p in written for line in lines), lines
    assert "2 prompts" in lines[0] and "wrote 2 videos" in lines[1], lines


def test_the_summary_tells_the_videos_length_from_the_generation_time():
    """Regression (timing_reads_as_duration): the title said "(17 frames, 3.8 s)", which reads as a
    3.8 s video; it gives the video's length (frames / fps) and the generation time apart."""
    from fp4video.cli.generate import video_title

    title = video_title("fp4video.mp4", 17, 16, 3.84)
    assert "17 frames at 16 fps (1.06 s of video)" in title and "generated in 3.8 s" in title, title


def test_register_attention_backends_is_importable_from_fp4video():
    """Regression (readme_name_not_exported): the README says to call it; ``fp4video`` has it."""
    pytest.importorskip("diffusers")
    import fp4video
    from fp4video import register_attention_backends
    from fp4video.integration import dispatcher

    assert register_attention_backends is dispatcher.register_attention_backends
    assert "register_attention_backends" in fp4video.__all__
    assert "fp4video_mxattn" in register_attention_backends(["mxattn"])


def test_version_flag_prints_the_packages_version():
    """Regression (no_version_flag)."""
    import fp4video
    from fp4video.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and out.getvalue().strip() == f"fp4video {fp4video.__version__}"
    tomllib = pytest.importorskip("tomllib")
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == fp4video.__version__


def _parsers(parser, path=("fp4video",)):
    yield " ".join(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def test_help_texts_are_plain_text():
    """Regression (rst_markup_in_help): descriptions come from docstrings, whose ``literals`` and
    :func:`references` --help printed as written."""
    from fp4video.cli.main import build_parser

    markup = re.compile(r"``|:(?:func|mod|class|data|attr|meth|obj|const|exc):`")
    found = {}
    for path, parser in _parsers(build_parser()):
        hits = markup.findall(parser.format_help())
        if hits:
            found[path] = hits
    assert not found, found
    assert len(list(_parsers(build_parser()))) > 8  # every subcommand was looked at


def test_plain_keeps_single_backticks():
    from fp4video.cli.help_text import plain

    assert plain("``fp4video bench``: see :func:`fp4video.sparse.dynamic_selection` and :mod:`.bench_sparse`") == (
        "`fp4video bench`: see `fp4video.sparse.dynamic_selection` and `bench_sparse`")


def test_the_readmes_quick_start_snippets_run_and_sparsity_shows():
    """Regression (readme_sparse_snippet_shows_nothing): the sparse snippet ran on S = 256, one tile
    a side, where a selection keeps everything; it runs where tiles can be skipped and prints the
    density each τ keeps and the distance to the dense call, as the README says."""
    first, *_, sparse = [b for b in _python_blocks("## Quick start") if "fp4_attention" in b and "pipe" not in b]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(first + sparse, "README.md", "exec"), {})
    printed = re.findall(r"tau ([\d.]+): density ([\d.]+), kept ([\d.]+), ([\d.]+)% from dense", out.getvalue())
    assert [p[0] for p in printed] == ["0.9", "0.99"], out.getvalue()
    (d90, k90, e90), (d99, k99, e99) = ((float(d), float(k), float(e)) for _, d, k, e in printed)
    assert d90 < d99 < 1 and e99 < e90 and k90 < k99 <= 1, printed
    for tau, d, k, e in printed:  # the README quotes what it prints
        assert f"tau {tau}: density {d}, kept {k}, {e}% from dense" in README
