#!/usr/bin/env bash
# What a session runs on the GPU machine (the `device` tool: no Rust, no
# internet there), from the repository root, with everything built here
# and carried in target/carry (benches/device_carry.sh makes it):
#   ferry (the CLI), gpu (the GPU suite's test binary), libplugin_FERRY.so,
#   wheel/ferry-*.whl (the Python package), uccl/ (UCCL v0.1.1's own
#   p2p/tests, unchanged, and a one-line `uccl` package that is ferry.p2p).
#
#   benches/device_run.sh tests|benches|ray|short|kv|small|sweep|latency|runner|profile  (results under $OUT)
#
# tests: the GPU suite, the Python suite, UCCL's own tests, the NIXL suite
# on VRAM (nixl-cu13 as installed there) over shm and tcp.
# benches: `ferry bench` and benches/nixl_bench.py points recorded into
# $OUT/results/*.jsonl (benches/record.py) for BENCHMARKS.md's summary.
# ray: Ray (a slimmed wheel and its dependencies in target/carry/rayslim,
# from benches/device_carry.sh with RAY_WHEELS) and the ferry wheel
# installed, python/tests/test_ray.py three times (torch: host and CUDA
# tensors), benches/ray_rdt.py into $OUT/ray_rdt.txt, and the NIXL suite on
# VRAM over shm and tcp (nixl-cu13 as installed there).
set -uo pipefail
what=${1:?tests, benches, ray, short, kv, small, sweep, latency, runner or profile}
carry=$PWD/${FERRY_CARRY:-target/carry}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export FERRY_BIN=$carry/ferry FERRY_COMMIT=${FERRY_COMMIT:-unknown}
export FERRY_LISTEN_ADDR=127.0.0.1 FERRY_ADVERTISE_ADDR=127.0.0.1
py=python3

# NIXL's plugins beside ours (the installed wheel's, found by its module).
nixl_dir() {
    local base plugdir libs
    base=$(cd / && $py -c 'import nixl, os; print(os.path.dirname(os.path.dirname(os.path.realpath(nixl.__file__))))' 2>/dev/null) || {
        echo "NIXL: no nixl module"; return 1; }
    plugdir=$(find "$base" -maxdepth 4 -type f -name 'libplugin_UCX*.so' 2>/dev/null | head -1)
    [ -n "$plugdir" ] || { echo "NIXL: no plugin folder under $base"; return 1; }
    plugdir=$(dirname "$plugdir")
    libs=$(dirname "$plugdir")
    mkdir -p /tmp/nixl-plugins
    for p in "$plugdir"/*.so; do ln -sf "$p" /tmp/nixl-plugins/; done
    ln -sf "$carry/libplugin_FERRY.so" /tmp/nixl-plugins/libplugin_FERRY.so
    export NIXL_PLUGIN_DIR=/tmp/nixl-plugins
    local extra
    extra=$(find "$base" -maxdepth 1 -type d -name '*nixl*.libs' | tr '\n' ':')
    export LD_LIBRARY_PATH="$libs:$extra${LD_LIBRARY_PATH:-}"
    echo "NIXL: plugins from $plugdir"
    $py -m pip list 2>/dev/null | grep -i nixl
    return 0
}

step() { echo "== $*"; }

# One blocking 4 KiB write_ipc from Python (the carried wheel), p50/p99.
python_ipc_op() {
    step "python -m ferry.bench --transport ipc"
    $py -m pip install -q --no-deps --no-index --force-reinstall "$carry"/wheel/ferry-*.whl 2>&1 | tail -2
    (cd / && timeout 120 $py -m ferry.bench --transport ipc --sizes 4K --ferry-bin "$FERRY_BIN" 2>&1 | tail -12)
}

# UCCL v0.1.1's benchmark_uccl.py, unchanged, both ranks on GPU 0, in the
# modes given ("" = its default, two-sided send/recv).
uccl_bench() {
    [ -f "$carry/uccl/benchmark_uccl.py" ] || return 0
    step "UCCL v0.1.1 benchmark_uccl.py, unchanged, both ranks on GPU 0: modes '$*'"
    for mode in "$@"; do
        # The whole output in $OUT (a failure's traceback is above the tail).
        (cd "$carry/uccl" && PYTHONPATH=$carry/uccl${PYTHONPATH:+:$PYTHONPATH} timeout 120 $py -m torch.distributed.run --nproc_per_node=2 \
            benchmark_uccl.py $mode --sizes 256,4096,65536,1048576 --iters 2000 2>&1 | grep -v "^W\|^I\|warn" \
            | tee "$OUT/uccl-bench${mode:-default}.log" | tail -12)
    done
}

# NIXL carried in (device_carry.sh with NIXL_WHEELS), where none is installed.
if [ -f "$carry/nixl-slim.tar.xz" ] && ! (cd / && $py -c 'import nixl._api') 2>/dev/null; then
    mkdir -p /tmp/nixlsite
    $py -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
        "$carry/nixl-slim.tar.xz" /tmp/nixlsite
    export PYTHONPATH=/tmp/nixlsite${PYTHONPATH:+:$PYTHONPATH}
    (cd / && $py -c 'import nixl._api') 2>&1 | tail -3
fi

if [ "$what" = tests ]; then
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    step "GPU suite"
    timeout 240 "$carry/gpu" --ignored --test-threads=1 2>&1 | tail -30
    step "GPU pieces suite"
    timeout 240 "$carry/gpu_pieces" --ignored --test-threads=1 2>&1 | tail -30
    step "python wheel + suite"
    $py -m pip install -q --no-deps --no-index --force-reinstall "$carry"/wheel/ferry-*.whl 2>&1 | tail -2
    (cd python/tests && timeout 200 $py -m pytest -q -p no:cacheprovider -rs 2>&1 | tail -12)
    step "UCCL v0.1.1 p2p/tests, unchanged"
    export PYTHONPATH=$carry/uccl${PYTHONPATH:+:$PYTHONPATH}
    for t in test_engine_read.py test_engine_write.py test_register_memory_cache.py test_remove_remote_endpoint.py; do
        (cd "$carry/uccl" && timeout 120 $py "$t" > "$OUT/uccl-$t.log" 2>&1; echo "$t rc $?"; tail -3 "$OUT/uccl-$t.log")
    done
    (cd "$carry/uccl" && CUDA_VISIBLE_DEVICES= timeout 120 $py test_engine_send.py > "$OUT/uccl-send.log" 2>&1; echo "test_engine_send.py (host memory) rc $?"; tail -3 "$OUT/uccl-send.log")
    if nixl_dir; then
        for t in shm tcp; do
            step "NIXL suite, VRAM, $t"
            FERRY_NIXL_MEM=VRAM FERRY_TRANSPORT=$t timeout 200 $py -m pytest -q -p no:cacheprovider nixl/tests/test_nixl.py 2>&1 | tail -6
        done
    fi
elif [ "$what" = ray ]; then
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    step "install ray and ferry"
    $py -m pip install -q --no-index --find-links "$carry/rayslim" ray 2>&1 | tail -3
    $py -m pip install -q --no-deps --no-index --force-reinstall "$carry"/wheel/ferry-*.whl 2>&1 | tail -2
    $py -c 'import ray, torch, ferry.ray; print("ray", ray.__version__, "torch", torch.__version__, "cuda", torch.cuda.is_available())'
    nixl_dir || true
    # The GPU pieces suite and the gather probe first, where carried (one
    # call for both issues when device time is short).
    if [ -x "$carry/gpu_pieces" ]; then
        step "GPU pieces suite"
        timeout 90 "$carry/gpu_pieces" --ignored --test-threads=1 2>&1 | tail -8 | tee "$OUT/gpu_pieces.txt"
        step "gather probe"
        timeout 40 $py benches/gather_probe.py --shapes 4Kx1,4Kx32,64Kx32,16Kx1024 --rounds 200 --completion 2>&1 | tee "$OUT/probe.txt"
    fi
    # suite, nixl, bench or all (one device call is 10 minutes at most); RAY_RUNS,
    # RAY_SUITE_S, RAY_BENCH_S, RAY_NIXL_S and RAY_SIZES trim them to fit.
    # On the H100 machine a suite run takes ~4 minutes (29 tests, ~8 s each:
    # every test starts its actors' workers, torch and CUDA in each): two
    # runs a call one after another, three side by side. A run cut by its
    # timeout reports the test it was in as failed (pytest dies of the
    # SIGTERM): read the count, not the F.
    part=${2:-all}  # all, or a comma list of suite, nixl, bench
    has() { [ "$part" = all ] || [[ ",$part," == *",$1,"* ]]; }
    # RAY_PARALLEL=1 runs the suite's runs and the NIXL suites side by side
    # (each run its own local Ray cluster: Ray picks free ports), so three
    # runs fit in one call; under that load a flake shows sooner, not later.
    if has suite; then
        for i in $(seq "${RAY_RUNS:-3}"); do
            step "ferry.ray suite, run $i"
            (cd python/tests && timeout "${RAY_SUITE_S:-300}" $py -m pytest -q -p no:cacheprovider -rs test_ray.py > /tmp/ray_suite_$i.txt 2>&1) &
            [ -n "${RAY_PARALLEL:-}" ] || wait
        done
    fi
    if has nixl && [ -n "${NIXL_PLUGIN_DIR:-}" ]; then
        (for t in shm tcp; do
            echo "== NIXL suite, VRAM, $t"
            FERRY_NIXL_MEM=VRAM FERRY_TRANSPORT=$t timeout "${RAY_NIXL_S:-200}" $py -m pytest -q -p no:cacheprovider -rs nixl/tests/test_nixl.py 2>&1 | tail -6
        done > /tmp/nixl_suite.txt 2>&1) &
        [ -n "${RAY_PARALLEL:-}" ] || wait
    fi
    wait
    for i in $(seq "${RAY_RUNS:-3}"); do
        [ -f /tmp/ray_suite_$i.txt ] || continue
        { echo "== ferry.ray suite, run $i"; tail -8 /tmp/ray_suite_$i.txt; } | tee -a "$OUT/ray_suite.txt"
    done
    [ -f /tmp/nixl_suite.txt ] && tee -a "$OUT/nixl_suite.txt" < /tmp/nixl_suite.txt
    rm -f /tmp/ray_suite_*.txt /tmp/nixl_suite.txt
    if has bench; then
        step "benches/ray_rdt.py"
        timeout "${RAY_BENCH_S:-400}" $py benches/ray_rdt.py --sizes "${RAY_SIZES:-4K,1M,64M,1G}" --json 2>&1 | grep -v "WARNING\|INFO" | tee "$OUT/ray_rdt.txt"
    fi
elif [ "$what" = short ]; then
    # What fits beside a Ray call: NIXL on DRAM (the KV-shaped 100 000
    # descriptor request among it) and two-sided latency, into $OUT/results.
    mkdir -p "$OUT/results"
    rec() { local file=$1; shift; $py benches/record.py "$OUT/results/$file.jsonl" "$@"; }
    rec host --label "shm, host memory" -- "$FERRY_BIN" bench --transport shm --op send --sizes 8,4K,64K --json
    rec host --label "tcp, host memory" -- "$FERRY_BIN" bench --transport tcp --op send --sizes 8,4K,64K --json
    if nixl_dir; then
        rec nixl --label "NIXL, DRAM, same host" -- $py benches/nixl_bench.py --op WRITE --sizes 4Kx32,64K,1M,64M,4Kx100000 --json
    fi
elif [ "$what" = kv ]; then
    # The KV shapes (issue 49): the gather kernel alone (benches/
    # gather_probe.py, with and without a second context on the GPU), the
    # GPU pieces suite, then NIXL on VRAM alternating this build (B) with
    # the one in $carry/A (A: libplugin_FERRY.so and ferry of the commit
    # before), a 4 KiB IPC op from Python and from `ferry bench`, and
    # DRAM's 100 000-descriptor request.
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    step "gather probe"
    timeout 90 $py benches/gather_probe.py --completion --shapes 4Kx1,4Kx32,64Kx32,16Kx1024 2>&1 | tee "$OUT/probe.txt"
    timeout 60 $py benches/gather_probe.py --shapes 4Kx1,4Kx32,64Kx32 --neighbour 2>&1 | tee -a "$OUT/probe.txt"
    if [ -x "$carry/gpu_pieces" ]; then
        step "GPU pieces suite"
        timeout 200 "$carry/gpu_pieces" --ignored --test-threads=1 2>&1 | tail -15
    fi
    if nixl_dir; then
        mkdir -p /tmp/nixl-plugins-A
        for p in /tmp/nixl-plugins/*.so; do ln -sf "$(readlink -f "$p")" /tmp/nixl-plugins-A/; done
        ln -sf "$carry/A/libplugin_FERRY.so" /tmp/nixl-plugins-A/libplugin_FERRY.so
        for r in 1 2; do
            for v in B A; do
                dir=/tmp/nixl-plugins; [ $v = A ] && dir=/tmp/nixl-plugins-A
                for op in WRITE READ; do
                    step "NIXL VRAM $op, build $v, round $r"
                    NIXL_PLUGIN_DIR=$dir timeout 100 $py benches/nixl_bench.py --mem vram --backends FERRY --op $op \
                        --rounds 1 --sizes 4Kx32,64Kx32,16Kx1024,1M --json 2>&1 | tee -a "$OUT/nixl_vram_$v.jsonl" | cut -c1-400
                done
            done
        done
        step "NIXL DRAM 4Kx100000 (B)"
        timeout 120 $py benches/nixl_bench.py --op WRITE --sizes 4Kx32,64M,4Kx100000 --json 2>&1 | tee "$OUT/nixl_dram.jsonl" | cut -c1-400
    fi
    step "one 4 KiB IPC op: ferry bench, B (auto, engine, kernel) then A"
    for way in auto engine kernel; do
        echo "-- B, FERRY_GPU_COPY=$way"
        FERRY_GPU_COPY=$way timeout 60 "$FERRY_BIN" bench --transport ipc --op write --sizes 4K --latency --seconds 1 2>&1 | tail -4
    done
    echo "-- A"
    timeout 60 "$carry/A/ferry" bench --transport ipc --op write --sizes 4K --latency --seconds 1 2>&1 | tail -4
    python_ipc_op
    # Its --write-ipc mode puts rank 1 on GPU 1: only with two GPUs.
    uccl_bench "" $([ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ] && echo --write-ipc)
    step "two-sided (B)"
    for t in shm tcp; do
        timeout 60 "$FERRY_BIN" bench --transport $t --op send --sizes 8,4K,64K --seconds 1 2>&1 | tail -5
    done
elif [ "$what" = latency ]; then
    # Where one small op's time goes (issue 49's 6 us from Python): the
    # completion probe with a neighbour's CUDA IPC memory (sync and async
    # copies, a sync copy behind busy streams), one 4 KiB op on an embedded
    # shard (--shards 1) against managed ones (--shards 2: what Python's
    # endpoints use), and the same op from Python.
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    step "completion probe, with a neighbour's IPC memory"
    timeout 120 $py benches/gather_probe.py --completion --neighbour --shapes 4Kx1 --rounds 400 2>&1 | tee "$OUT/probe.txt"
    for t in ipc shm; do
        for n in 1 2; do
            step "one op, $t, --shards $n"
            timeout 60 "$FERRY_BIN" bench --transport $t --op write --sizes 4K --latency --seconds 1 --shards $n 2>&1 | grep latency
        done
    done
    python_ipc_op
    uccl_bench ""
elif [ "$what" = runner ]; then
    # The copy runner (src/gpu/runner/) against a launch per lone copy
    # (FERRY_GPU_RUNNER_US=0), alternating, on the small-op latencies of
    # issue 49: the probe first (a resident kernel in Python, the sync
    # copy's end), the GPU pieces suite (the runner's byte-exact tests),
    # then `ferry bench --latency` embedded and managed, Python's
    # write_ipc and UCCL's benchmark_uccl.py default mode.
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    if [ "${RUNNER_PROBE:-1}" = 1 ]; then
        step "completion probe, with a neighbour's IPC memory"
        timeout 120 $py benches/gather_probe.py --completion --neighbour --shapes 4Kx1 --rounds 400 2>&1 | tee "$OUT/probe.txt"
    fi
    if [ -x "$carry/gpu_pieces" ]; then
        step "GPU pieces suite: the runner's tests and the kernel's way"
        timeout 240 "$carry/gpu_pieces" --ignored --test-threads=1 lone_copies through_the_gather_kernel 2>&1 | tail -14
    fi
    for r in 1 2; do
        for us in 0 100; do
            for n in 1 2; do
                step "round $r, FERRY_GPU_RUNNER_US=$us, one 4 KiB IPC write, --shards $n"
                FERRY_GPU_RUNNER_US=$us timeout 60 "$FERRY_BIN" bench --transport ipc --op write --sizes 4K --latency \
                    --seconds 1 --shards $n 2>&1 | grep latency
            done
            step "round $r, FERRY_GPU_RUNNER_US=$us, two-sided 4 KiB GPU messages, same host"
            FERRY_GPU_RUNNER_US=$us timeout 60 "$FERRY_BIN" bench --transport shm --device gpu --op send --sizes 4K \
                --seconds 1 2>&1 | tail -3
        done
    done
    for us in 0 100; do
        echo "-- FERRY_GPU_RUNNER_US=$us"
        FERRY_GPU_RUNNER_US=$us python_ipc_op
    done
    for us in 0 100; do
        echo "-- FERRY_GPU_RUNNER_US=$us"
        FERRY_GPU_RUNNER_US=$us uccl_bench ""
    done
elif [ "$what" = small ]; then
    # Issue 49's small ops, this build (B) against the one in $carry/A (A:
    # its ferry and wheel), alternating on the same machine: the runner's
    # byte-exact tests (B), one 4 KiB IPC write embedded and managed, a
    # two-sided 4 KiB GPU round trip, Python's write_ipc by layer
    # (benches/py_op_probe.py) and `python -m ferry.bench`, and UCCL's
    # benchmark_uccl.py default mode. A's Python package is installed
    # apart (/tmp/pyA, first on PYTHONPATH for A's runs).
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    if [ -x "$carry/gpu_pieces" ]; then
        step "GPU pieces suite: the runner's tests and the kernel's way (B)"
        timeout 240 "$carry/gpu_pieces" --ignored --test-threads=1 ${SMALL_PIECES:-lone_copies through_the_gather_kernel} 2>&1 | tail -8
    fi
    $py -m pip install -q --no-deps --no-index --force-reinstall "$carry"/wheel/ferry-*.whl 2>&1 | tail -2
    rm -rf /tmp/pyA && $py -m pip install -q --no-deps --no-index --target /tmp/pyA "$carry"/A/wheel/ferry-*.whl 2>&1 | tail -2
    bin_of() { [ "$1" = A ] && echo "$carry/A/ferry" || echo "$carry/ferry"; }
    path_of() { [ "$1" = A ] && echo "/tmp/pyA${PYTHONPATH:+:$PYTHONPATH}" || echo "${PYTHONPATH:-}"; }
    for r in $(seq "${SMALL_ROUNDS:-2}"); do
        for v in B A; do
            for n in 1 2; do
                step "round $r, build $v, one 4 KiB IPC write, --shards $n"
                timeout 60 "$(bin_of $v)" bench --transport ipc --op write --sizes 4K --latency --seconds 1 --shards $n 2>&1 | grep latency
            done
            step "round $r, build $v, two-sided 4 KiB GPU messages, same host"
            timeout 60 "$(bin_of $v)" bench --transport shm --device gpu --op send --sizes 4K --seconds 1 2>&1 | tail -2
        done
    done
    for v in B A; do
        step "build $v: benches/py_op_probe.py"
        (cd / && PYTHONPATH=$(path_of $v) FERRY_BIN=$(bin_of $v) timeout 120 $py "$OLDPWD/benches/py_op_probe.py" --rounds 2000 2>&1 | tail -9)
        [ "${SMALL_PYBENCH:-1}" = 1 ] || continue
        step "build $v: python -m ferry.bench --transport ipc"
        (cd / && PYTHONPATH=$(path_of $v) timeout 120 $py -m ferry.bench --transport ipc --sizes 4K --ferry-bin "$(bin_of $v)" 2>&1 | tail -6)
    done
    for v in ${SMALL_UCCL:-B A}; do
        step "build $v: UCCL"
        PYTHONPATH=$(path_of $v) uccl_bench ""
    done
elif [ "$what" = sweep ]; then
    # One setting's values against each other on NIXL VRAM points, in
    # alternating rounds (the GPU pieces suite first, where carried, with
    # each value): SWEEP_VAR, SWEEP_VALUES, SWEEP_SIZES, SWEEP_ROUNDS; SWEEP_TAG
    # names the run in each line.
    var=${SWEEP_VAR:?SWEEP_VAR}
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    if [ -x "$carry/gpu_pieces" ]; then
        step "GPU pieces suite"
        timeout 200 "$carry/gpu_pieces" --ignored --test-threads=1 2>&1 | tail -12
    fi
    if nixl_dir; then
        for r in $(seq "${SWEEP_ROUNDS:-2}"); do
            for v in ${SWEEP_VALUES:?SWEEP_VALUES}; do
                for op in WRITE READ; do
                    step "NIXL VRAM $op, $var=$v, round $r"
                    env "$var=$v" timeout 100 $py benches/nixl_bench.py --mem vram --backends FERRY --op $op \
                        --rounds 1 --sizes "${SWEEP_SIZES:-4Kx32,64Kx32,16Kx1024,4Kx100000}" --json 2>&1 \
                        | grep '^{' | sed "s/^{/{${SWEEP_TAG:+\"tag\": \"$SWEEP_TAG\", }\"$var\": \"$v\", /" | tee -a "$OUT/sweep.jsonl" | cut -c1-200
                done
            done
        done
    fi
elif [ "$what" = profile ]; then
    # Where a NIXL VRAM post's time goes, by native stacks: py-spy (carried
    # as a wheel: device_carry.sh with PYSPY_WHEELS) samples the bench and
    # its target, the plugin's Rust frames included (with the plugin's
    # default FERRY_DRIVE=caller the shards' passes run inside the post
    # and poll calls); the raw stacks go to $OUT/profile-OP.txt, summed by
    # benches/prof_summary.py (the post call and the polls apart).
    # PROFILE_OPS, PROFILE_SIZES, PROFILE_DRIVE (FERRY_DRIVE), PROFILE_HZ.
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    if ! ls "$carry"/pyspy/py_spy-*.whl >/dev/null 2>&1; then
        echo "profile: no py-spy wheel in $carry/pyspy (device_carry.sh with PYSPY_WHEELS)"; exit 1
    fi
    $py -m pip install -q --no-deps --no-index --target /tmp/pyspy "$carry"/pyspy/py_spy-*.whl 2>&1 | tail -2
    if nixl_dir; then
        for op in ${PROFILE_OPS:-READ WRITE}; do
            step "py-spy: NIXL VRAM $op ${PROFILE_SIZES:-16Kx1024}, FERRY_DRIVE=${PROFILE_DRIVE:-default}"
            ${PROFILE_DRIVE:+env FERRY_DRIVE=$PROFILE_DRIVE} timeout 120 /tmp/pyspy/bin/py-spy record --native --subprocesses \
                -r "${PROFILE_HZ:-3000}" -f raw -o "$OUT/profile-$op.txt" -- \
                $py benches/nixl_bench.py --mem vram --backends FERRY --op $op --rounds 1 \
                --sizes "${PROFILE_SIZES:-16Kx1024}" --json 2>&1 | grep '^{\|py-spy>' | cut -c1-300
            $py benches/prof_summary.py "$OUT/profile-$op.txt" 2>&1 | head -40
        done
    fi
elif [ "$what" = benches ]; then
    mkdir -p "$OUT/results"
    rec() { local file=$1; shift; $py benches/record.py "$OUT/results/$file.jsonl" "$@"; }
    step "ferry bench"
    rec host --label "shm, host memory" -- "$FERRY_BIN" bench --transport shm --op write --sizes 4K,64M --latency --baseline --json
    rec host --label "tcp, host memory" -- "$FERRY_BIN" bench --transport tcp --op write --sizes 4K,64M --latency --baseline --json
    # Two-sided messages (eager up to 8 KiB), a one-sided WRITE beside each.
    rec host --label "shm, host memory" -- "$FERRY_BIN" bench --transport shm --op send --sizes 8,4K,64K --json
    rec host --label "tcp, host memory" -- "$FERRY_BIN" bench --transport tcp --op send --sizes 8,4K,64K --json
    rec gpu --label "CUDA IPC, GPU memory" -- "$FERRY_BIN" bench --transport ipc --op write --sizes 4K,1M,256M --baseline --json
    rec gpu --label "tcp, GPU memory" -- "$FERRY_BIN" bench --transport tcp --device gpu --op write --sizes 64M --baseline --json
    if nixl_dir; then
        step "NIXL"
        for op in WRITE READ; do
            rec nixl --label "NIXL, VRAM, same host" -- $py benches/nixl_bench.py --mem vram --backends FERRY,UCX --op $op --sizes 4Kx32,64Kx32,16Kx1024,1M,256M --json
        done
        # 100 000 descriptors in one request (made once, posted again).
        rec nixl --label "NIXL, VRAM, same host" -- $py benches/nixl_bench.py --mem vram --backends FERRY,UCX --op WRITE --sizes 4Kx100000 --json
        rec nixl --label "NIXL, DRAM, same host" -- $py benches/nixl_bench.py --op WRITE --sizes 4Kx32,64K,1M,64M,4Kx100000 --json
    fi
fi
