#!/usr/bin/env bash
# Builds here (release, stripped) what benches/device_run.sh runs on the GPU
# machine, into target/carry (the device tool's `carry`, 64 MiB at most):
# the CLI, the GPU suite's test binary, the NIXL plugin, the Python wheel,
# UCCL v0.1.1's p2p/tests and p2p/benchmarks/benchmark_uccl.py (from a
# UCCL checkout: $UCCL_REPO, a git directory) with a one-line `uccl` package that is ferry.p2p, and NIXL
# for Python 3.12 slimmed from the wheels in $NIXL_WHEELS (`pip download
# nixl-cu13 nixl --no-deps --python-version 3.12 --only-binary=:all:
# --platform manylinux_2_28_x86_64 -d DIR`). RAY_WHEELS (a folder of `pip
# download ray --python-version 3.12 --only-binary=:all: --platform
# manylinux2014_x86_64 --platform any`) adds Ray for `device_run.sh ray`,
# slimmed (its Java jar, web client, source maps and the libraries on top
# of its core); with it the GPU suites are left out, and NIXL_WHEELS still
# fits (the GPU machine has no NIXL of its own: Ray's NIXL transport and
# the NIXL suite need the carried one).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# FERRY_CARRY names another folder (two carries for one warm machine:
# the Ray one does not fit beside the GPU suites and UCCL).
c=${FERRY_CARRY:-target/carry}
mkdir -p $c/wheel $c/uccl/uccl
cargo build -q --release -p ferry-cli -p ferry-nixl
# The GPU suites' test binaries, as $c/gpu and $c/gpu_pieces.
rm -f $c/gpu $c/gpu_pieces
for t in $([ -z "${RAY_WHEELS:-}" ] && echo gpu gpu_pieces); do
    bin=$(cargo test -q --release -p ferry-cli --test $t --no-run --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == sys.argv[1] and m.get("executable"):
        print(m["executable"])' $t)
    cp "$bin" $c/$t
done
cp target/release/ferry target/release/libplugin_FERRY.so $c/
strip $c/ferry $([ -z "${RAY_WHEELS:-}" ] && echo $c/gpu $c/gpu_pieces)
# The plugin keeps its symbol table: the NIXL suite's vtable check reads it.
strip --strip-debug $c/libplugin_FERRY.so
rm -f $c/wheel/*.whl
python3 -m pip wheel -q --no-deps -w $c/wheel ./python
if [ -n "${UCCL_REPO:-}" ]; then
    for f in test_engine_send.py test_engine_read.py test_engine_write.py \
        test_register_memory_cache.py test_remove_remote_endpoint.py; do
        git --git-dir="$UCCL_REPO" show v0.1.1:p2p/tests/$f > $c/uccl/$f
    done
    git --git-dir="$UCCL_REPO" show v0.1.1:p2p/benchmarks/benchmark_uccl.py > $c/uccl/benchmark_uccl.py
    echo "from ferry import p2p  # noqa: F401 (UCCL's tests import uccl.p2p)" > $c/uccl/uccl/__init__.py
fi
# NIXL for the GPU machine, which has none and no internet: the nixl-cu13
# wheel (and the nixl wrapper) for Python 3.12 unpacked without what the
# benches and the suite do not load (its EP kernels, storage plugins and
# their SDKs), as one tar.xz (~11 MB; the whole wheel is 59 MB).
if [ -n "${NIXL_WHEELS:-}" ]; then
    tmp=$(mktemp -d)
    for w in "$NIXL_WHEELS"/nixl_cu13-*cp312*.whl "$NIXL_WHEELS"/nixl-*py3-none-any.whl; do
        (cd "$tmp" && unzip -q -o "$w")
    done
    rm -rf "$tmp"/nixl_ep_cu13 "$tmp"/nixl_cu13.libs/libaws* "$tmp"/nixl_cu13.libs/libazure* \
        "$tmp"/nixl_cu13.libs/libs2n* "$tmp"/nixl_cu13.libs/libxml2* "$tmp"/nixl_cu13.libs/ucx/libucx_perftest*
    for d in "$tmp"/.nixl_cu13.mesonpy.libs/plugins "$tmp"/nixl_cu13.libs/nixl; do
        find "$d" -name '*.so' ! -name libplugin_UCX.so ! -name libplugin_POSIX.so -delete
    done
    tar -C "$tmp" -cf - . | xz -T2 -6 > $c/nixl-slim.tar.xz
    rm -rf "$tmp"
fi
# py-spy for `device_run.sh profile` (native stacks of a NIXL post):
# PYSPY_WHEELS, a folder of `pip download py-spy --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux_2_5_x86_64`.
rm -rf $c/pyspy
if [ -n "${PYSPY_WHEELS:-}" ]; then
    mkdir -p $c/pyspy
    cp "$PYSPY_WHEELS"/py_spy-*.whl $c/pyspy/
fi
rm -rf $c/rayslim
if [ -n "${RAY_WHEELS:-}" ]; then
    mkdir -p $c/rayslim
    for w in "$RAY_WHEELS"/*.whl; do
        case $(basename "$w") in
        ray-*) python3 - "$w" $c/rayslim/$(basename "$w") <<'PY'
import sys, zipfile
# Not loaded by Ray's core or its tensor transports: the Java jar, the
# dashboard's web client, and the libraries on top (rllib, serve, llm,
# tune, train), so that NIXL fits beside Ray in the 64 MiB carry.
gone = ("ray/jars/", "ray/dashboard/client/build/", "ray/rllib/", "ray/serve/", "ray/llm/", "ray/tune/", "ray/train/")
drop = lambda n: n.startswith(gone) or n.endswith(".js.map")
zi, zo = zipfile.ZipFile(sys.argv[1]), zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED, compresslevel=9)
for i in zi.infolist():
    if drop(i.filename):
        continue
    data = zi.read(i.filename)
    if i.filename.endswith(".dist-info/RECORD"):
        data = "".join(l + "\n" for l in data.decode().splitlines() if not drop(l.split(",")[0])).encode()
    zo.writestr(i, data)
zo.close()
PY
        ;;
        *) cp "$w" $c/rayslim/ ;;
        esac
    done
fi
du -sh $c
