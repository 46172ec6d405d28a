#!/usr/bin/env bash
# One command for a machine with a GPU: the `gpu` test suite, then the GPU benchmarks
# (optimizer step, preconditioned training step, a short AdamW-vs-Gefen run, the depth
# axis's projection), written as OUT_DIR/report.md and OUT_DIR/report.json, and
# benchmarks/gefen_step.py's tables as OUT_DIR/gefen_step/gefen_step.{md,json}.
#
#   scripts/gpu_check.sh OUT_DIR            # on a GPU: about 6-8 minutes
#   scripts/gpu_check.sh OUT_DIR --quick    # tiny sizes; runs on CPU in a minute or two
#
# Without CUDA the gpu suite is only collected (its tests fail on purpose there).
#
# Runs from the source tree (PYTHONPATH), installs nothing and needs no network: torch,
# and for the HF / Lightning tests transformers and lightning, must be there already.
# Extra arguments go to scripts/gpu_check.py (e.g. --sections depth,training);
# GPU_CHECK_SUITE_S (default 240) caps the suite's seconds.
# Exit status 1 when a suite test or a section failed; the report says which and why.
set -uo pipefail

if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    echo "usage: scripts/gpu_check.sh OUT_DIR [--quick] [gpu_check.py options]" >&2
    exit 2
fi
out=$1
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python}

suite_started=$SECONDS
suite_args=(--suite-xml "$out/gpu_suite.xml")
if "$python" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    # -m gpu replaces the default "not slow and not gpu" selection. The suite gets
    # GPU_CHECK_SUITE_S seconds (default 240) so the benchmarks still run inside a
    # lent device's time: SIGINT stops pytest cleanly, its JUnit XML keeps the tests
    # that ran, and the report says the suite was cut (timeout exits 124).
    timeout --signal=INT --kill-after=30 "${GPU_CHECK_SUITE_S:-240}" \
        "$python" -m pytest -q -m gpu -p no:cacheprovider \
        --junitxml="$out/gpu_suite.xml" tests > "$out/gpu_suite.log" 2>&1
    suite_status=$?
else
    # a gpu test fails on purpose without CUDA; here the suite is only collected
    "$python" -m pytest -q -m gpu --collect-only -p no:cacheprovider tests \
        > "$out/gpu_suite.log" 2>&1
    suite_status=$?
    suite_args=(--suite-collected "$out/gpu_suite.log")
    echo "no CUDA device: the gpu suite was collected, not run" >&2
fi
echo "gpu suite: $((SECONDS - suite_started)) s, pytest exit $suite_status (log: $out/gpu_suite.log)" >&2

# The optimizer-step benchmark: GPT-2 small's 124 M parameters on the GPU, fp32 and bf16
# parameters (about 2-3 minutes); its quick layout, fp32 only, without CUDA.
step_args=(--out "$out/gefen_step")
if "$python" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    step_args+=(--device cuda --budget-s 30)
    if [[ " $* " == *" --quick "* ]]; then
        step_args+=(--quick --repeats 3)
    fi
else
    step_args+=(--device cpu --quick --repeats 3 --dtypes float32)
fi
step_started=$SECONDS
"$python" benchmarks/gefen_step.py "${step_args[@]}" > "$out/gefen_step.log" 2>&1
step_status=$?
echo "gefen_step.py: $((SECONDS - step_started)) s, exit $step_status (tables: $out/gefen_step/gefen_step.md)" >&2

"$python" scripts/gpu_check.py --out "$out" "${suite_args[@]}" \
    --suite-exit "$suite_status" --suite-seconds "$((SECONDS - suite_started))" "$@"
status=$?
if [ "$step_status" -ne 0 ]; then
    echo "benchmarks/gefen_step.py failed (exit $step_status): see $out/gefen_step.log" >&2
    status=1
fi
exit "$status"
