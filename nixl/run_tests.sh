#!/usr/bin/env bash
# The NIXL plugin's tests with the real NIXL (nixl/tests/test_nixl.py),
# over same-host shm and over 127.0.0.1 tcp (set-up: nixl/with_nixl.sh).
#
#   nixl/run_tests.sh [--release] [pytest args...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
rel=()
if [ "${1:-}" = "--release" ]; then rel=(--release); shift; fi
run() {
    # The plugin's default (shards run by NIXL's polling threads and their
    # helpers) over shm and tcp, then ferry's own shard threads.
    for mode in shm,caller tcp,caller shm,threads; do
        transport=${mode%,*} drive=${mode#*,}
        echo "== NIXL ${NIXL_VERSION:-1.5.1}, backend FERRY, FERRY_TRANSPORT=$transport FERRY_DRIVE=$drive"
        FERRY_TRANSPORT=$transport FERRY_DRIVE=$drive "$NIXL_PY" -m pytest -q -p no:cacheprovider \
            "$here/tests/test_nixl.py" "$@"
    done
}
export -f run
export here
"$here/with_nixl.sh" "${rel[@]}" bash -c 'run "$@"' run "$@"
