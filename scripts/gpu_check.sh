#!/usr/bin/env bash
# One command for a machine with a GPU: the `gpu` test suite, then the GPU benchmarks
# (optimizer step, preconditioned training step, a short AdamW-vs-Gefen run, the depth
# axis's projection), written as OUT_DIR/report.md and OUT_DIR/report.json.
#
#   scripts/gpu_check.sh OUT_DIR            # on a GPU: sized for 5-6 minutes (untimed)
#   scripts/gpu_check.sh OUT_DIR --quick    # tiny sizes; runs on CPU in a minute or two
#
# Without CUDA the gpu suite is only collected (its tests fail on purpose there).
#
# Runs from the source tree (PYTHONPATH), installs nothing and needs no network: torch,
# and for the HF / Lightning tests transformers and lightning, must be there already.
# Extra arguments go to scripts/gpu_check.py (e.g. --sections depth,training);
# GPU_CHECK_SUITE_S (default 210) caps the suite's seconds.
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
    # GPU_CHECK_SUITE_S seconds (default 210) so the benchmarks still run inside a
    # lent device's time: SIGINT stops pytest cleanly, its JUnit XML keeps the tests
    # that ran, and the report says the suite was cut (timeout exits 124).
    timeout --signal=INT --kill-after=30 "${GPU_CHECK_SUITE_S:-210}" \
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

# The optimizer step is measured once, by gpu_check.py's optimizer_step section
# (leantrain.compare.optimizer_step.measure, the measurement benchmarks/gefen_step.py
# prints): GPU time is scarce, so the benchmark does not run here besides it. The
# report's optimizer-step table has the benchmark's columns, per dtype.

"$python" scripts/gpu_check.py --out "$out" "${suite_args[@]}" \
    --suite-exit "$suite_status" --suite-seconds "$((SECONDS - suite_started))" "$@"
exit $?
