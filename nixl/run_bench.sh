#!/usr/bin/env bash
# benches/nixl_bench.py (FERRY against UCX through NIXL's Python API) with
# a release plugin: nixl/run_bench.sh [nixl_bench.py args...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
"$here/with_nixl.sh" --release bash -c '"$NIXL_PY" "$0/../benches/nixl_bench.py" "$@"' "$here" "$@"
