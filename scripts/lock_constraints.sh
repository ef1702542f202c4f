#!/usr/bin/env bash
# Re-resolves pyproject.toml's test environment in a scratch venv (`make install` without constraints) and writes
# constraints.txt (the versions `make install` then uses). Each line carries the resolving Python's version as a
# marker, so other Pythons resolve freely. Run `make test` afterwards: the file is only worth committing once the
# suite passes with it.
set -euo pipefail
cd "$(dirname "$0")/.."
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
make -s install VENV="$scratch/venv" CONSTRAINTS= ${PY:+PY="$PY"} ${TORCH:+TORCH="$TORCH"}
pyver=$("$scratch/venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
{
  echo "# Versions the test suite passed with on a fresh machine (python $pyver, the CPU build of torch): \`make install\`"
  echo "# resolves the test environment under them, so a new upstream release cannot break CI unseen. Other Pythons"
  echo "# resolve freely (the marker). Refresh: \`bash scripts/lock_constraints.sh\`, then \`make test\`."
  "$scratch/venv/bin/pip" freeze | grep -v -i -E '^-e |^gptoss|^torch==' | sed "s/\$/ ; python_version == \"$pyver\"/"
} > constraints.txt
echo "wrote constraints.txt ($(grep -c '==' constraints.txt) pins, python $pyver)"
