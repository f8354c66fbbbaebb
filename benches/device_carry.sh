#!/usr/bin/env bash
# Builds here (release, stripped) what benches/device_run.sh runs on the GPU
# machine, into target/carry (the device tool's `carry`, 64 MiB at most):
# the CLI, the GPU suite's test binary, the NIXL plugin, the Python wheel,
# UCCL v0.1.1's p2p/tests (from a UCCL checkout: $UCCL_REPO, a git
# directory) with a one-line `uccl` package that is ferry.p2p.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
c=target/carry
mkdir -p $c/wheel $c/uccl/uccl
cargo build -q --release -p ferry-cli -p ferry-nixl
gpu=$(cargo test -q --release -p ferry-cli --test gpu --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu" and m.get("executable"):
        print(m["executable"])')
cp target/release/ferry "$gpu" target/release/libplugin_FERRY.so $c/
mv $c/$(basename "$gpu") $c/gpu
strip $c/ferry $c/gpu
# The plugin keeps its symbol table: the NIXL suite's vtable check reads it.
strip --strip-debug $c/libplugin_FERRY.so
rm -f $c/wheel/*.whl
python3 -m pip wheel -q --no-deps -w $c/wheel ./python
if [ -n "${UCCL_REPO:-}" ]; then
    for f in test_engine_send.py test_engine_read.py test_engine_write.py \
        test_register_memory_cache.py test_remove_remote_endpoint.py; do
        git --git-dir="$UCCL_REPO" show v0.1.1:p2p/tests/$f > $c/uccl/$f
    done
    echo "from ferry import p2p  # noqa: F401 (UCCL's tests import uccl.p2p)" > $c/uccl/uccl/__init__.py
fi
du -sh $c
