#!/usr/bin/env bash
# A/B of two builds of ferry, measured alternately in the same minutes:
# the way every latency claim in docs/benchmarks-log.md is made.
#
#   benches/ab.sh [--rounds N] [--seconds S] [--points LIST] REV_A REV_B
#
# REV is any git revision (built in a worktree under $AB_DIR, default
# /tmp/ferry-ab: outside this workspace), a path to a built `ferry` binary
# (used as it is: for a machine without Rust), or `.`
# for the working tree as it is now (built with `cargo build --release`).
# Each round runs every point with A, then with B (the order flips every
# round, so neither build always runs first); then per point the median of
# the rounds for each build and the ratio B / A.
#
# Points (--points, comma-separated; default shm-lat,tcp-lat,shm-4k,tcp-4k):
#   shm-lat   same-host 8-byte WRITE round trip: p50 / p99 / p999 us
#   shm-lat-f the same with --baseline: also each build's p50 and p99 over
#             the cache-line ping-pong of the same run (the floor under a
#             same-host round trip; builds before 23c7c15 do not measure it)
#   tcp-lat   tcp 8-byte WRITE round trip, with the raw TCP ping-pong of
#             the same run: p50 / p99 us and p99 / raw p99
#   shm-4k    same-host 4 KiB x32 WRITE, GB/s
#   tcp-4k    tcp 4 KiB x32 WRITE, GB/s
#   shm-4k-s4 / tcp-4k-s4: the same with --shards 4 --conns 4 (one
#             submitting thread feeding four shards)
#   (and the others benches/points.sh names)
# Extra bench flags for every point: AB_FLAGS="...". Raw lines go to
# target/ab/ab.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3 seconds=1 points=shm-lat,tcp-lat,shm-4k,tcp-4k
while [ $# -gt 2 ]; do
    case "$1" in
        --rounds) rounds=$2; shift 2 ;;
        --seconds) seconds=$2; shift 2 ;;
        --points) points=$2; shift 2 ;;
        *) echo "ab.sh: unknown flag $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
[ $# -eq 2 ] || { sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
# shellcheck source=benches/points.sh
. benches/points.sh
dir=${AB_DIR:-/tmp/ferry-ab}
mkdir -p target/ab/bin "$dir"

build() { # rev name -> target/ab/bin/name
    local rev=$1 name=$2
    if [ -f "$rev" ] && [ -x "$rev" ]; then
        [ "$rev" -ef "target/ab/bin/$name" ] || cp "$rev" "target/ab/bin/$name"
        return
    fi
    if [ "$rev" = . ]; then
        cargo build --release -q -p ferry-cli
        cp target/release/ferry "target/ab/bin/$name"
        return
    fi
    local sha wt pkg="-p ferry-cli"
    sha=$(git rev-parse --verify "$rev^{commit}")
    wt=$dir/wt-$sha
    [ -d "$wt" ] || git worktree add -q --detach "$wt" "$sha"
    # Before the workspace split the binary lived in the library's crate.
    [ -f "$wt/cli/Cargo.toml" ] || pkg="--bin ferry"
    # One target directory for both revisions: dependencies build once.
    # shellcheck disable=SC2086
    (cd "$wt" && CARGO_TARGET_DIR="$dir/target" cargo build --release -q $pkg)
    cp "$dir/target/release/ferry" "target/ab/bin/$name"
}
echo "building A = $1 and B = $2 ..." >&2
build "$1" A
build "$2" B

run_point() { # bin point -> one JSON line per measured row, tagged
    local bin=$1 p=$2 args
    args=$(point_args "$p") || exit 2
    # shellcheck disable=SC2086
    "$bin" bench $args --seconds "$seconds" --json ${AB_FLAGS:-} 2>/dev/null
}

out=target/ab/ab.jsonl
: > "$out"
IFS=, read -r -a plist <<< "$points"
for r in $(seq 1 "$rounds"); do
    order="A B"
    [ $((r % 2)) -eq 0 ] && order="B A"
    for p in "${plist[@]}"; do
        for who in $order; do
            echo "round $r/$rounds: $p on $who" >&2
            run_point "target/ab/bin/$who" "$p" | sed "s/^{/{\"build\":\"$who\",\"point\":\"$p\",\"round\":$r,/" >> "$out"
        done
    done
done
python3 benches/ab_table.py "$out" "$1" "$2"
