"""The README's examples run as written, in full, each in a namespace of its own
(a copied block must run alone), and show what they say they show: falling losses,
Gefen's byte of state, MGRIT's falling residuals; K-FAC's loop ends lower than the
same loop without preconditioning (slow)."""

import math
import re
import statistics
from pathlib import Path

import pytest
import torch

from tests.test_docs_examples import parse

README = Path(__file__).resolve().parents[1] / "README.md"


def _assert_falls(losses: list[float], label: str) -> None:
    assert all(math.isfinite(v) for v in losses), f"{label}: a loss is not finite"
    last = statistics.fmean(losses[-10:])
    assert last < 0.75 * losses[0], f"{label}: loss {losses[0]:.3f} -> {last:.3f}"


def test_readme_examples_run(capsys):
    blocks = parse(README.read_text())
    assert len(blocks) == 3  # one per axis
    assert not any(block.replacements for block in blocks)  # run as written
    spaces = []
    for i, block in enumerate(blocks):
        namespace: dict = {"__name__": "readme_example"}
        exec(compile(block.source(), f"README.md#{i}", "exec"), namespace)
        spaces.append(namespace)
    out = capsys.readouterr().out
    bytes_per_param = float(re.search(r"([\d.]+) bytes of optimizer state", out)[1])
    # the memory example: Gefen 8-bit, every matrix factored (1.055 on GPT.default());
    # AdamW's is 8
    assert bytes_per_param < 1.06
    _assert_falls(spaces[0]["losses"], "memory")
    _assert_falls(spaces[1]["losses"], "curvature")
    residuals = spaces[2]["model"].stack.stats.forward.history
    assert len(residuals) >= 2 and residuals[-1] < residuals[0]  # MGRIT converges


@pytest.mark.slow
def test_readme_curvature_example_ends_below_the_unpreconditioned_loop():
    """The same block with ``opt = sgd`` (no preconditioning), same init and
    batches: K-FAC's last-10-step mean loss is lower on each of three seeds."""
    source = parse(README.read_text())[1].source()
    plain = source.replace(
        'precondition_in_loop(sgd, model, "kfac", config={'
        '"preconditioner_interval": 10, "curvature_interval": 10})',
        "sgd",
    )
    assert plain != source
    for seed in range(3):
        finals = []
        for code in (source, plain):
            torch.manual_seed(seed)
            namespace: dict = {"__name__": "readme_example"}
            exec(compile(code, "README.md#1", "exec"), namespace)
            finals.append(statistics.fmean(namespace["losses"][-10:]))
        assert finals[0] < finals[1], (
            f"seed {seed}: K-FAC {finals[0]:.3f}, SGD {finals[1]:.3f}"
        )


def setup_commands() -> list[str]:
    """The README's set-up block: one command per line, comments dropped."""
    text = README.read_text()
    setup = text[text.index("## Set up") :]
    lines = re.search(r"```bash\n(.*?)```", setup, re.S)[1].strip().splitlines()
    return [line.split("#")[0].strip() for line in lines]


def test_readme_setup_gives_two_commands():
    commands = setup_commands()
    assert len(commands) == 2
    assert "leantrain compare" in commands[0] and "pytest" in commands[1]
    # the main job installs the extra the command needs (tqdm, matplotlib, sklearn)
    assert '-e ".[compare]"' in commands[0]


def test_ci_runs_the_readme_test_command_in_a_fresh_venv():
    """.ci/run runs the README's test command as written, and installs the project
    the way the main-job command does (the same torch pin), in a new venv."""
    main_job, tests = setup_commands()
    ci = (README.parent / ".ci" / "run").read_text()
    ci_lines = [line.strip() for line in ci.splitlines()]
    assert any(line.startswith(tests) for line in ci_lines), tests  # same line
    install = re.match(r'(pip install \S+) -e "?\.', main_job)
    assert install, main_job
    assert tests.startswith(install[1] + ' -e ".[test]"')  # same torch, same way
    assert re.search(r"python3 -m venv ", ci)  # a new venv every run
    assert ci.index("python3 -m venv") < ci.index(tests)
