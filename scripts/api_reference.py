"""Write docs/api.md, the reference of leantrain's public API, from the code itself.

Every name in each public subpackage's ``__all__``, with its signature and the first
paragraph of its docstring. ``tests/test_api_reference.py`` checks that docs/api.md
is what this script writes, so the reference cannot drift from the code:

    python scripts/api_reference.py > docs/api.md
"""

from __future__ import annotations

import importlib
import inspect
import re

PACKAGES = {
    "leantrain.optim": "docs/gefen.md",
    "leantrain.precond": "docs/precond.md",
    "leantrain.precond.curv": "docs/curvature.md",
    "leantrain.layer_parallel": "docs/layer_parallel.md",
    "leantrain.layer_parallel.costs": "docs/layer_parallel.md",
    "leantrain.integrations": "docs/huggingface_lightning.md",
    "leantrain.models": "docs/data_and_models.md",
    "leantrain.data": "docs/data_and_models.md",
}


def first_paragraph(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    return text.replace("|", "\\|")


def signature(name: str, obj: object) -> str:
    if inspect.isclass(obj) or inspect.isfunction(obj):
        try:
            sig = str(inspect.signature(obj))
        except (TypeError, ValueError):
            return name
        sig = re.sub(r"<function (\w+) at 0x[0-9a-f]+>", r"\1", sig)
        sig = re.sub(r"(: |-> )'([^']*)'", r"\1\2", sig)  # string annotations
        if inspect.isclass(obj):
            sig = sig.removesuffix(" -> None")
        return f"{name}{sig}"
    return f"{name}: {type(obj).__name__}"


def render() -> str:
    lines = [
        "# API reference",
        "",
        "Every public name, by subpackage: its signature and what it is. The guides",
        "say how to use them. Written from the docstrings by",
        "`python scripts/api_reference.py > docs/api.md` (a test keeps it current).",
    ]
    for package, guide in PACKAGES.items():
        module = importlib.import_module(package)
        guide_name = guide.removeprefix("docs/")
        lines += ["", f"## `{package}`", "", first_paragraph(module)]
        lines += [f"Guide: [{guide_name}]({guide_name}).", ""]
        for name in module.__all__:
            obj = getattr(module, name)
            lines.append(f"- `{signature(name, obj)}`")
            summary = first_paragraph(obj) if callable(obj) else ""
            if summary:
                lines.append(f"  {summary}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
