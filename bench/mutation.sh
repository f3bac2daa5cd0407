#!/usr/bin/env bash
# Mutation testing of the modules whose mistakes mislead a user (bench/mutation.py says how):
#   bash bench/mutation.sh [checklist|search|config|codecheck|history ...]
# Needs requirements-dev.txt (mutmut); copies go to .mutation/ (ignored by git). Exits 1 where a group
# misses the goal (85% of its mutants killed, equivalent ones listed in bench/mutation_equivalent.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
exec python bench/mutation.py "$@"
