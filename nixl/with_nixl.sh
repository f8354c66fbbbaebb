#!/usr/bin/env bash
# Runs a command beside the real NIXL: builds libplugin_FERRY.so, installs
# NIXL's wheel from PyPI into a throwaway venv (without torch: NIXL's Python
# API does not need it), makes a plugin folder with our plugin beside links
# to the wheel's own plugins (UCX stays available), exports NIXL_PLUGIN_DIR
# and NIXL_PY (the venv's python), and keeps ferry on loopback.
#
#   nixl/with_nixl.sh [--release] COMMAND [ARGS...]
#
# NIXL_VERSION picks the release (checked: 1.5.1, the newest installable:
# the `nixl` 1.5.2 meta-package requires nixl-cu12==1.5.2, which PyPI does
# not have). FERRY_NIXL_VENV reuses a venv instead of making one;
# FERRY_NIXL_PLUGIN uses that libplugin_FERRY.so instead of building one.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
profile=debug
if [ "${1:-}" = "--release" ]; then profile=release; shift; fi
version=${NIXL_VERSION:-1.5.1}

# FERRY_NIXL_PLUGIN: a plugin built elsewhere (an A/B of two builds).
if [ -n "${FERRY_NIXL_PLUGIN:-}" ]; then
    plugin=$FERRY_NIXL_PLUGIN
else
    (cd "$root" && cargo build -q -p ferry-nixl $([ "$profile" = release ] && echo --release))
    plugin="$root/target/$profile/libplugin_FERRY.so"
fi

# NIXL_CUDA=12|13 picks the wheel (nixl-cu12 or nixl-cu13); by default the
# CUDA major version the driver reports (nvidia-smi), 12 without a GPU.
cuda=${NIXL_CUDA:-}
if [ -z "$cuda" ]; then
    cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -n 1 || true)
    [ -n "$cuda" ] && [ "$cuda" -ge 13 ] && cuda=13 || cuda=12
fi
case "$cuda" in
    12 | 13) ;;
    *) echo "with_nixl.sh: NIXL_CUDA=$cuda: 12 or 13" >&2; exit 2 ;;
esac
mod=nixl_cu$cuda

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
venv=${FERRY_NIXL_VENV:-$work/venv}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --no-deps "nixl==$version" "nixl-cu$cuda==$version"
    "$venv/bin/pip" install -q numpy pytest
fi
libs=$("$venv/bin/python" -c "import $mod, os; print(os.path.join(os.path.dirname(os.path.dirname($mod.__file__)), '.$mod.mesonpy.libs', 'plugins'))")
mkdir -p "$work/plugins"
for p in "$libs"/*.so; do ln -s "$p" "$work/plugins/"; done
ln -s "$plugin" "$work/plugins/libplugin_FERRY.so"
# The wheel's plugins find their libraries by $ORIGIN, which a link in
# another folder changes: name those folders.
export LD_LIBRARY_PATH="$libs/..:$libs/../../$mod.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NIXL_PLUGIN_DIR="$work/plugins" NIXL_PY="$venv/bin/python"
export FERRY_LISTEN_ADDR=127.0.0.1 FERRY_ADVERTISE_ADDR=127.0.0.1
"$@"
