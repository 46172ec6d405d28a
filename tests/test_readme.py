"""The README's examples run as written (loops shortened by their doc-test directives),
in order, in one namespace, and print what they say they print."""

import re
from pathlib import Path

from tests.test_docs_examples import parse

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run(capsys):
    blocks = parse(README.read_text())
    assert len(blocks) == 3  # one per axis
    namespace: dict = {"__name__": "readme_example"}
    for i, block in enumerate(blocks):
        exec(compile(block.source(), f"README.md#{i}", "exec"), namespace)
    out = capsys.readouterr().out
    bytes_per_param = float(re.search(r"([\d.]+) bytes of optimizer state", out)[1])
    assert bytes_per_param < 1.05  # the memory example: Gefen 8-bit, AdamW's is 8
    residuals = namespace["model"].stack.stats.forward.history
    assert len(residuals) >= 2 and residuals[-1] < residuals[0]  # MGRIT converges


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


def test_ci_runs_the_readme_test_command_in_a_fresh_venv():
    """.ci/run runs the README's test command as written, and installs the project
    the way the main-job command does (the same torch pin), in a new venv."""
    main_job, tests = setup_commands()
    ci = (README.parent / ".ci" / "run").read_text()
    ci_lines = [line.strip() for line in ci.splitlines()]
    assert any(line.startswith(tests) for line in ci_lines), tests  # same line
    install = re.match(r"(pip install \S+) -e \.", main_job)
    assert install, main_job
    assert tests.startswith(install[1] + ' -e ".[test]"')  # same torch, same way
    assert re.search(r"python3 -m venv ", ci)  # a new venv every run
    assert ci.index("python3 -m venv") < ci.index(tests)
