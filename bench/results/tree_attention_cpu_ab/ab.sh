#!/bin/bash
# usage: OLD_TREE=/path/to/built/worktree bash ab.sh THREADS DTYPE ROUNDS   (DTYPE: fp32 | bf16)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
new_tree=$(git -C "$here" rev-parse --show-toplevel)
. "$new_tree/${EAGLE_VENV:-.venv}/bin/activate"
for i in $(seq "$3"); do
  for t in old new; do
    if [ "$t" = old ]; then d=${OLD_TREE:?a worktree of the old commit, built in place}; else d=$new_tree; fi
    echo "== $t round $i"
    (cd "$d" && PYTHONPATH="$d" python "$here/best_of.py" "$1" "$2")
  done
done
