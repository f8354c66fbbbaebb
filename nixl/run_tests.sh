#!/usr/bin/env bash
# The NIXL plugin's tests with the real NIXL (nixl/tests/test_nixl.py):
# builds libplugin_FERRY.so, installs NIXL's wheel from PyPI into a
# throwaway venv (without torch: NIXL's Python API does not need it), makes
# a plugin folder with our plugin beside links to the wheel's own plugins
# (UCX stays available), and runs the suite over same-host shm and over
# 127.0.0.1 tcp.
#
#   nixl/run_tests.sh [--release] [pytest args...]
#
# NIXL_VERSION picks the release (checked: 1.5.1, the newest installable:
# the `nixl` 1.5.2 meta-package requires nixl-cu12==1.5.2, which PyPI does
# not have). FERRY_NIXL_VENV reuses a venv instead of making one.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
profile=debug
if [ "${1:-}" = "--release" ]; then profile=release; shift; fi
version=${NIXL_VERSION:-1.5.1}

cd "$root"
cargo build -q -p ferry-nixl $([ "$profile" = release ] && echo --release)
plugin="$root/target/$profile/libplugin_FERRY.so"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
venv=${FERRY_NIXL_VENV:-$work/venv}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --no-deps "nixl==$version" "nixl-cu12==$version"
    "$venv/bin/pip" install -q numpy pytest
fi
libs=$("$venv/bin/python" -c 'import nixl_cu12, os; print(os.path.join(os.path.dirname(os.path.dirname(nixl_cu12.__file__)), ".nixl_cu12.mesonpy.libs", "plugins"))')
mkdir -p "$work/plugins"
for p in "$libs"/*.so; do ln -s "$p" "$work/plugins/"; done
ln -s "$plugin" "$work/plugins/libplugin_FERRY.so"
export NIXL_PLUGIN_DIR="$work/plugins"
# Tests stay on loopback (FERRY_ADVERTISE_ADDR puts it in the metadata).
export FERRY_LISTEN_ADDR=127.0.0.1 FERRY_ADVERTISE_ADDR=127.0.0.1
for transport in shm tcp; do
    echo "== NIXL $version, backend FERRY, FERRY_TRANSPORT=$transport"
    FERRY_TRANSPORT=$transport "$venv/bin/python" -m pytest -q -p no:cacheprovider \
        "$root/nixl/tests/test_nixl.py" "$@"
done
