# The `ferry bench` flags of each named point, for benches/ab.sh and
# benches/rounds.sh (sourced, not run).
#
#   shm-lat    same-host 8-byte WRITE round trip (embedded shard)
#   shm-lat-f  the same with --baseline: the cache-line ping-pong of the
#              same run beside it (builds before 23c7c15 do not measure it)
#   tcp-lat    tcp 8-byte WRITE round trip, with the raw TCP ping-pong
#   shm-lat-m, tcp-lat-m: the round trips on two managed shards
#   shm-4k, tcp-4k: 4 KiB x32 WRITE
#   shm-4k-s4, tcp-4k-s4, shm-4k-s8: the same from one submitting thread
#              over --shards N --conns N
point_args() { # point -> its flags on stdout; unknown: a message, status 1
    case "$1" in
        shm-lat) echo "--transport shm --sizes 4K --op write --latency --batch 1" ;;
        shm-lat-f) echo "--transport shm --sizes 4K --op write --latency --batch 1 --baseline --rounds 1" ;;
        tcp-lat) echo "--transport tcp --sizes 4K --op write --latency --batch 1 --baseline --rounds 1" ;;
        shm-lat-m) echo "--transport shm --sizes 4K --op write --latency --batch 1 --shards 2" ;;
        tcp-lat-m) echo "--transport tcp --sizes 4K --op write --latency --batch 1 --shards 2" ;;
        shm-4k) echo "--transport shm --sizes 4K --op write" ;;
        tcp-4k) echo "--transport tcp --sizes 4K --op write" ;;
        shm-4k-s4) echo "--transport shm --sizes 4K --op write --shards 4 --conns 4" ;;
        tcp-4k-s4) echo "--transport tcp --sizes 4K --op write --shards 4 --conns 4" ;;
        shm-4k-s8) echo "--transport shm --sizes 4K --op write --shards 8 --conns 8" ;;
        *) echo "unknown point $1 (see benches/points.sh)" >&2; return 1 ;;
    esac
}
