"""End-to-end tests of ``leantrain compare`` with tiny settings."""

import json
import math
import time

import pytest
import torch

from leantrain.cli import METRICS, OPTIMIZERS, main
from leantrain.data import load_stdlib_text


def _table_rows(markdown: str) -> list[list[str]]:
    lines = [ln for ln in markdown.splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]


def _run(tmp_path, capsys, *extra, tiny=True):
    """Run ``leantrain compare --out tmp ...``; return (out folder, stdout).

    Tiny runs use one thread: on a loaded shared machine two threads per process
    wait on each other. The default run (``tiny=False``) adds nothing.
    """
    out = tmp_path / "out"
    tiny_options = ("--seed", "3", "--threads", "1") if tiny else ()
    rc = main(["compare", "--out", str(out), *tiny_options, *extra])
    assert rc == 0
    return out, capsys.readouterr().out


def test_compare_mlp_writes_files_and_measured_ratios(tmp_path, capsys):
    out, stdout = _run(
        tmp_path,
        capsys,
        *("--model", "mlp", "--steps", "4", "--batch-size", "16"),
        *("--optimizers", "adamw,gefen8,gefen4"),
    )
    md = (out / "compare.md").read_text()
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((out / "compare.json").read_text())
    assert "compare --out" in md and "torch " + torch.__version__ in md

    rows = _table_rows(md)
    assert rows == _table_rows(stdout)  # printed table == saved table
    header, body = rows[0], rows[2:]
    expected = ["optimizer"]
    for title, _, _ in METRICS:
        expected += [title, "x AdamW"]
    assert header == expected
    assert [r[0] for r in body] == ["AdamW", "Gefen 8-bit", "Gefen 4-bit"]

    results = record["results"]
    base = results[0]
    for row, res in zip(body, results, strict=True):
        for k, (_, attr, fmt) in enumerate(METRICS):
            value, ratio = row[1 + 2 * k], row[2 + 2 * k]
            assert value == fmt.format(res[attr])
            assert ratio == f"{res[attr] / base[attr]:.2f}"
    assert all(c == "1.00" for c in body[0][2::2])  # AdamW against itself

    # Independent state-size check: AdamW holds two fp32 moments + a 4-byte step
    # per tensor; Gefen 8/4-bit hold about 1 and 0.5 byte per parameter.
    n_params = 64 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    assert base["state_bytes_per_param"] == pytest.approx(8 + 4 * 6 / n_params)
    assert 0.9 < results[1]["state_bytes_per_param"] < 1.5
    assert 0.4 < results[2]["state_bytes_per_param"] < 1.0

    # The whole run's wall time covers every timed step.
    timed = sum(3 * (r["step_ms"] + r["fwd_bwd_ms"]) / 1e3 for r in results)
    assert record["wall_s"] > timed
    assert f"{record['wall_s']:.1f} s" in md

    # Same initial weights and same first batch: the first losses agree exactly.
    first = {r["train_losses"][0] for r in results}
    assert len(first) == 1
    assert all(len(r["train_losses"]) == 4 for r in results)


def test_compare_gpt_on_a_text_file_same_data_order(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out, stdout = _run(
        tmp_path,
        capsys,
        *("--model", "gpt", "--data", str(text), "--steps", "3"),
        *("--batch-size", "2", "--optimizers", "adamw,gefen-fp32", "--lr", "1e-3"),
    )
    record = json.loads((out / "compare.json").read_text())
    assert "GPT.default()" in record["settings"] and str(text) in record["settings"]
    a, g = record["results"]
    assert a["train_losses"][0] == g["train_losses"][0]
    # Gefen with fp32 momentum keeps one v per block: between 4 and 8 B/param.
    assert 4.0 <= g["state_bytes_per_param"] < 8.0
    assert all(r["val_loss"] > 0 and r["step_ms"] > 0 for r in record["results"])


def test_compare_cnn_on_a_png_folder(tmp_path, capsys):
    import matplotlib.image as mpimg
    import numpy as np

    rng = np.random.default_rng(0)
    for cls in ("a", "b", "c"):
        (tmp_path / "png" / cls).mkdir(parents=True)
        for i in range(6):
            mpimg.imsave(tmp_path / "png" / cls / f"{i}.png", rng.random((8, 8)))
    out, stdout = _run(
        tmp_path,
        capsys,
        *("--model", "cnn", "--data", str(tmp_path / "png"), "--steps", "2"),
        *("--batch-size", "4", "--optimizers", "gefen8,adamw"),
    )
    record = json.loads((out / "compare.json").read_text())
    assert "CNN" in record["settings"] and "x8x8)" in record["settings"]
    # AdamW is the baseline even when it is not listed first.
    assert record["baseline"] == "adamw"
    body = _table_rows(stdout)[2:]
    assert [r[0] for r in body] == ["Gefen 8-bit", "AdamW"]
    assert all(c == "1.00" for c in body[1][2::2])


def test_registry_names():
    assert {"adamw", "gefen8", "gefen4", "gefen-fp32"} <= set(OPTIMIZERS)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optimizers", "adamw,sgdx"], "sgdx"),
        (["--optimizers", "adamw,adamw"], "twice"),
        (["--steps", "0"], "positive"),
        (["--lr", "-1"], "positive"),
        (["--model", "resnet"], "resnet"),
    ],
)
def test_bad_options_exit_2(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--out", str(tmp_path), *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_data_path_exits_2_naming_it(capsys, tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(SystemExit) as exc:
        main(
            ["compare", "--data", str(missing), "--steps", "1", "--out", str(tmp_path)]
        )
    assert exc.value.code == 2
    assert str(missing) in capsys.readouterr().err


def test_block_size_longer_than_text_exits_2(capsys, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("x" * 200)  # val split: 20 bytes < block_size + 1
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--data", str(short), "--steps", "1", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "block_size" in capsys.readouterr().err


@pytest.mark.slow
def test_default_compare_finishes_in_three_minutes(tmp_path, capsys):
    start = time.perf_counter()
    out, _ = _run(tmp_path, capsys, tiny=False)
    elapsed = time.perf_counter() - start
    record = json.loads((out / "compare.json").read_text())
    names = [r["name"] for r in record["results"]]
    assert names == ["adamw", "gefen8", "gefen4"]
    losses = [r["val_loss"] for r in record["results"]]
    # Every optimizer beats a uniform guess (log 256); AdamW and Gefen 8-bit beat
    # the best context-free model, the unigram entropy of the training bytes, and
    # end close to each other.
    train = load_stdlib_text().train.long()
    p = torch.bincount(train, minlength=256).double() / len(train)
    unigram_entropy = float(-(p[p > 0] * p[p > 0].log()).sum())
    assert max(losses) < math.log(256)
    assert max(losses[:2]) < unigram_entropy
    assert losses[1] / losses[0] < 1.1
    assert elapsed < 180
