#!/usr/bin/env bash
# Judge one surviving mutant: run chosen tests with it switched on (mutmut's trampoline).
#   bash tests/property/check_mutant.sh NAME [pytest args, e.g. tests/property/test_x.py]
# Run from the repo root after `mutmut run` (it leaves the mutated core in mutants/).
# The tests, sim and executors are the working tree's; HYPOTHESIS_PROFILE defaults to ci.
# Prints KILLED (the tests failed) or SURVIVED.
set -u
name=$1; shift
root=$PWD
[[ -d $root/mutants/deepinfer ]] || { echo "no mutants/deepinfer: run mutmut first" >&2; exit 2; }
scratch=$(mktemp -d /tmp/check-mutant-XXXX)
for d in tests sim executors kernels traces examples benchmarks; do cp -r "$root/$d" "$scratch/"; done
cp "$root/pyproject.toml" "$scratch/"
cp -r "$root/mutants/deepinfer" "$scratch/deepinfer"
cd "$scratch"
MUTANT_UNDER_TEST=$name PYTHONPATH=$scratch HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci} \
  timeout "${MUT_TIMEOUT:-900}" python -m pytest -x -q -p no:cacheprovider "$@" > "$scratch.log" 2>&1
rc=$?
tail -3 "$scratch.log"
rm -rf "$scratch"
if [[ $rc -eq 0 ]]; then echo "SURVIVED $name"; else echo "KILLED $name (rc $rc, log $scratch.log)"; fi
