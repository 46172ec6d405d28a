"""End-to-end tests of ``leantrain compare`` with tiny settings."""

import json
import math
import re
import time

import pytest
import torch

from leantrain.cli import build_parser, main
from leantrain.compare import OPTIMIZERS, PEERS, VARIANTS
from leantrain.compare import curvature as compare_curvature
from leantrain.compare import depth as compare_depth
from leantrain.compare import memory as compare_memory
from leantrain.compare.peers import PEER_COLUMNS
from leantrain.compare.single_model import METRICS
from leantrain.data import load_stdlib_text


def _table_rows(markdown: str) -> list[list[str]]:
    lines = [ln for ln in markdown.splitlines() if ln.startswith("| ")]
    # Cells are split on "|" that is not escaped as "\|".
    return [
        [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", ln[1:-1])]
        for ln in lines
    ]


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
    # Gefen with fp32 momentum: 4 B of momentum plus factors or blocks: under 8.
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
    assert {"adamw", "gefen8", "gefen4", "gefen-fp32"} <= set(VARIANTS)
    assert {"gefen8-factored", "gefen4-blocks", "gefen4-noclip"} <= set(VARIANTS)
    # One registry, one name per optimizer: both lists name its entries.
    assert set(VARIANTS) | set(PEERS) <= set(OPTIMIZERS)
    model = torch.nn.Linear(2, 3)
    make = {name: OPTIMIZERS[name].factory for name in ("gefen4-noclip", "gefen4")}
    group = make["gefen4-noclip"](model, 1e-3, 1e-2).param_groups[0]
    assert group["update_clip"] is None and group["momentum_bits"] == 4
    assert make["gefen4"](model, 1e-3, 1e-2).param_groups[0]["update_clip"] == "auto"


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


def test_compare_peers_mlp_table_and_files(tmp_path, capsys):
    out, stdout = _run(
        tmp_path,
        capsys,
        *("--model", "mlp", "--steps", "3", "--batch-size", "8"),
        *("--peers", "adamw-fused,gefen8"),
    )
    md = (out / "compare.md").read_text()
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((out / "compare.json").read_text())
    assert "/proc/self/clear_refs" in md and "VmHWM" in md
    rows = _table_rows(md)
    assert rows == _table_rows(stdout)
    header, body = rows[0], rows[2:]
    assert header == PEER_COLUMNS
    # The baseline of the ratio is run even when not asked for, first.
    names = [r["name"] for r in record["results"]]
    assert names == [r[0] for r in body] == ["adamw-foreach", "adamw-fused", "gefen8"]
    results = {r["name"]: r for r in record["results"]}
    assert all(r["status"] == "ok" for r in results.values()), results
    base = results["adamw-foreach"]
    for row in body:
        res = results[row[0]]
        assert row[1] == f"{res['state_bytes_per_param']:.3f}"
        assert row[3] == f"{res['step_ms']:.2f}"
        assert row[4] == f"{res['step_ms'] / base['step_ms']:.2f}"
        assert row[6] == f"{res['val_loss']:.4f}"
        assert res["first_step_s"] > 0 and res["peak_step_mib"] >= 0
        assert len(res["train_losses"]) == 3
    # AdamW state: two fp32 moments + a 4-byte step per tensor, independent of how
    # it is stepped; Gefen 8-bit about 1 byte per parameter.
    n_params = 64 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    for name in ("adamw-foreach", "adamw-fused"):
        assert results[name]["state_bytes_per_param"] == pytest.approx(
            8 + 4 * 6 / n_params
        )
    assert 0.9 < results["gefen8"]["state_bytes_per_param"] < 1.5
    # Same init, same batches: foreach and fused AdamW are one algorithm.
    assert results["adamw-fused"]["train_losses"] == pytest.approx(
        base["train_losses"], rel=1e-5
    )
    assert results["gefen8"]["train_losses"][0] == base["train_losses"][0]


def test_compare_precond_table_target_and_unavailable(tmp_path, capsys, monkeypatch):
    from leantrain.precond.registry import PRECOND_METHODS, MethodSpec

    # A registered method whose module is not there must be listed, not dropped.
    monkeypatch.setitem(
        PRECOND_METHODS, "ghost", MethodSpec("leantrain.precond.no_such", "Nope")
    )
    out, stdout = _run(
        tmp_path,
        capsys,
        *("--steps", "4", "--batch-size", "16", "--precond", "kfac,shampoo,ghost"),
    )
    md = (out / "compare.md").read_text()
    record = json.loads((out / "compare.json").read_text())
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert record["settings"].startswith("MLP")  # small model by default
    assert "small models" in md
    rows = _table_rows(md)
    assert rows == _table_rows(stdout)
    body = rows[2:]
    assert [r[0] for r in body] == ["sgd", "adamw", "kfac", "shampoo", "ghost"]
    results = {r["name"]: r for r in record["results"]}
    assert results["ghost"]["status"].startswith("unavailable")
    assert "no_such" in body[4][1]
    ran = [results[n] for n in ("sgd", "adamw", "kfac", "shampoo")]
    assert all(r["status"] == "ok" for r in ran), ran
    # Same init and first batch everywhere: the first losses agree.
    assert {round(r["train_losses"][0], 5) for r in ran} == {
        round(ran[0]["train_losses"][0], 5)
    }
    # Target: AdamW's train loss, the mean of the last 10% (here 1) of its steps.
    window = max(1, 4 // 10)
    adamw_tail = results["adamw"]["train_losses"][-window:]
    assert record["target"] == pytest.approx(sum(adamw_tail) / window)
    for row, r in zip(body, ran, strict=False):
        assert row[2] == f"{r['step_ms'] / results['sgd']['step_ms']:.2f}"
        assert row[3] == f"{r['train_loss']:.4f}" and row[4] == f"{r['val_loss']:.4f}"
        # Steps to target, recomputed: first full window whose mean <= target.
        means = [
            sum(r["train_losses"][s - window : s]) / window
            for s in range(window, len(r["train_losses"]) + 1)
        ]
        hit = next(
            (
                s
                for s, m in zip(range(window, 5), means, strict=True)
                if m <= record["target"]
            ),
            None,
        )
        assert r["steps_to_target"] == hit
        assert row[5] == ("-" if hit is None else str(hit))
    assert results["adamw"]["steps_to_target"] is not None
    # Step times are measured, not asserted: on a shared machine a few steps of any
    # method can come out faster than a few of SGD. They must be real times.
    assert all(results[m]["step_ms"] > 0 for m in ("sgd", "kfac", "shampoo"))


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--peers", "adamw-fused,nope"], ["nope", "gefen8", "adafactor"]),
        (["--peers", "gefen8,gefen8"], ["twice"]),
        (["--precond", "kfac,nope"], ["nope", "shampoo", "kfac"]),
        (["--precond", ""], ["preconditioning method", "kfac"]),
        (["--peers", "--precond", "kfac"], ["not allowed with"]),
        (["--optimizers", "adamw", "--peers"], ["not allowed with"]),
    ],
)
def test_bad_peer_and_method_names_exit_2(argv, needles, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--out", str(tmp_path), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_compare_help_describes_the_three_axes_and_groups_the_options(capsys):
    text = _help(capsys, "compare")
    assert "usage: leantrain compare [AXIS] [options]" in text
    assert "With no axis and no single-model option: the three axes" in text
    for axis in ("memory", "curvature", "depth"):
        assert f" {axis} {axis}: " in text  # "memory memory: AdamW against ..."
    # The options of the axes come first, the single-model ones under their heading.
    single = text.index("single-model comparison: Any of these")
    assert text.index("--seed SEED") < single < text.index("--steps STEPS")
    assert text.index("--workers WORKERS") < single < text.index("--model")
    assert "(default 2)" in text and "output folder (default leantrain-compare)" in text


M, C, D = compare_memory.DEFAULT, compare_curvature.DEFAULT, compare_depth.DEFAULT


@pytest.mark.parametrize(
    "axis, settings, runs",
    [
        (
            "memory",
            [f"for {M.steps} steps of {M.batch_size} sequences", f"lr {M.lr}"],
            len(M.optimizers) * len(M.seeds),
        ),
        (
            "curvature",
            [f"for {C.steps} steps of {C.batch_size} images", *C.methods],
            1 + len(C.methods),
        ),
        (
            "depth",
            [f"a GPT of {D.n_layer} blocks", f"median of {D.repeats} rounds"],
            2,
        ),
    ],
)
def test_axis_help_shows_its_own_settings_and_options(axis, settings, runs, capsys):
    text = _help(capsys, "compare", axis)
    assert text.startswith(f"usage: leantrain compare {axis} [-h] [--seed SEED]")
    assert all(n in text for n in settings), text
    assert f"processes for the axis' {runs} independent runs (default 2)" in text
    assert "--seed SEED" in text and "(default 0)" in text
    for option in ("--model", "--optimizers", "--steps", "--lr", "--peers"):
        assert option not in text  # the single-model options are not the axis'


@pytest.mark.parametrize(
    "argv, axis, seed, workers",
    [
        (["compare"], None, 0, 2),
        (["compare", "--seed", "3", "memory"], "memory", 3, 2),
        (["compare", "memory", "--seed", "5", "--workers", "1"], "memory", 5, 1),
        (["compare", "--workers", "1", "depth", "--seed", "4"], "depth", 4, 1),
        (["compare", "--model", "mlp", "--steps", "4"], None, 0, 2),
    ],
)
def test_options_before_and_after_the_axis(argv, axis, seed, workers):
    args = build_parser().parse_args(argv)
    assert (args.axis, args.seed, args.workers, args.threads) == (
        axis,
        seed,
        workers,
        1,
    )
    assert args.out == "leantrain-compare"


@pytest.mark.slow
def test_default_compare_finishes_in_three_minutes(tmp_path, capsys):
    # The real default: the three axes, their runs on two processes.
    start = time.perf_counter()
    out, stdout = _run(tmp_path, capsys, tiny=False)
    elapsed = time.perf_counter() - start
    assert elapsed < 180
    record = json.loads((out / "compare.json").read_text())
    md = (out / "compare.md").read_text()
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(record["axes"]) == ["memory", "curvature", "depth"]
    for title in ("## memory", "## curvature", "## depth"):
        assert title in md and title in stdout
    memory = record["axes"]["memory"]
    assert set(memory["runs"]) == {"adamw", "gefen8", "gefen4"}
    assert all(len(rs) == 3 for rs in memory["runs"].values())  # three seeds each
    # Every run has left the first plateau (training loss about 2.5 nats/byte there)
    # and beats the best context-free model, the unigram entropy of the bytes.
    train = load_stdlib_text().train.long()
    p = torch.bincount(train, minlength=256).double() / len(train)
    unigram_entropy = float(-(p[p > 0] * p[p > 0].log()).sum())
    losses = [r["val_loss"] for rs in memory["runs"].values() for r in rs]
    assert max(losses) < min(2.4, unigram_entropy)
    curvature = record["axes"]["curvature"]
    assert [r["name"] for r in curvature["rows"]] == ["adamw", "kfac", "shampoo"]
    assert all(r["status"] == "ok" for r in curvature["rows"])
    depth = record["axes"]["depth"]
    assert depth["accuracy"]["output_rel_diff"] < 0.05
    assert set(depth["projected_speedup"]["measured"]) == {"8", "32", "128"}
    assert math.isfinite(depth["measured_speedup"])
