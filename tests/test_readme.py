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


def test_readme_setup_gives_two_commands():
    text = README.read_text()
    setup = text[text.index("## Set up") :]
    commands = re.search(r"```bash\n(.*?)```", setup, re.S)[1].strip().splitlines()
    assert len(commands) == 2
    assert "leantrain compare" in commands[0] and "pytest" in commands[1]
