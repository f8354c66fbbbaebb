#!/bin/bash
# TCP segments per op (issue 29): /proc/net/snmp's Tcp OutSegs, and the
# pure ACKs received (TcpExt TCPPureAcks), around a 4 KiB x32 WRITE run
# over tcp with 1 shard and with 4 shards fed by one thread. Loopback
# counts both processes' segments; divide by the ops the run printed
# (ops_per_s x ~(SECS + warm-up)).
#
#   benches/tcp_segments.sh [FERRY_BIN]     (SECS=2 by default)
set -euo pipefail
BIN=${1:-target/release/ferry}
outsegs() { awk '/^Tcp:/{getline; print $12}' /proc/net/snmp; }
pureacks() {
  awk '/^TcpExt:/{if(!h){for(i=1;i<=NF;i++) if($i=="TCPPureAcks") c=i; h=1} else print $c}' /proc/net/netstat
}
for args in "--shards 1" "--shards 4 --conns 4"; do
  s0=$(outsegs) a0=$(pureacks)
  # shellcheck disable=SC2086
  "$BIN" bench --transport tcp --sizes 4K --op write --seconds "${SECS:-2}" $args --json 2>/dev/null | tail -1
  s1=$(outsegs) a1=$(pureacks)
  echo "$args: OutSegs $((s1 - s0)), pure ACKs received $((a1 - a0))"
done
