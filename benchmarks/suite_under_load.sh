#!/usr/bin/env bash
# The test suite beside busy processes: timeouts are safety nets, so the suite must pass on a machine several
# times slower than the one it was measured on. Usage, from the repository root:
#
#     bash benchmarks/suite_under_load.sh 4 -m "not slow"   # the fast subset beside 4 busy processes
#     bash benchmarks/suite_under_load.sh 3                  # the whole suite beside 3
#
# The first argument is the number of busy processes (each spins one core at 100%); the rest go to
# `python -m pytest`. Prints the load average before and after, and pytest's exit status is the script's.
set -u
cd "$(dirname "$0")/.."
BUSY=${1:?usage: suite_under_load.sh BUSY_PROCESSES [pytest arguments]}
shift
PY=${PYTHON:-python}
pids=()
for _ in $(seq "$BUSY"); do
  "$PY" -c "while True: pass" &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
echo "busy processes: $BUSY on $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg)"
start=$(date +%s)
"$PY" -m pytest "$@"
status=$?
echo "pytest exit status $status after $(( $(date +%s) - start )) s beside $BUSY busy processes;" \
     "load average $(cut -d' ' -f1-3 /proc/loadavg)"
exit $status
