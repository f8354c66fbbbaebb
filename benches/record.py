#!/usr/bin/env python3
"""Runs a bench that prints JSON lines (`ferry bench --json`,
`benches/nixl_bench.py --json`) and appends each line to a results file
with where it was measured: the path's label, the machine, the commit, the
command and the date. `benches/summary.py` makes BENCHMARKS.md's summary
table from these files.

    benches/record.py benches/results/host.jsonl --label "shm, host memory" \\
        -- ferry bench --transport shm --sizes 4K,64M --baseline --json

--machine and --commit override what is found (nproc and the CPU model,
plus `nvidia-smi`'s GPU name; $FERRY_COMMIT, else `git rev-parse --short
HEAD`: the device machine's copy of the tree is not a checkout of it).
The bench's own lines go through to stdout as they come.
"""

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys


def machine():
    cores = os.cpu_count()
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    text = f"{cores} cores" + (f", {model}" if model else "")
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        if gpu:
            text += f", {len(gpu)} × {gpu[0]}"
    except (OSError, subprocess.SubprocessError):
        pass
    return text


def commit():
    if os.environ.get("FERRY_COMMIT"):
        return os.environ["FERRY_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=20)
        if out.returncode == 0:
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("FERRY_COMMIT", "unknown")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 usage="%(prog)s OUT --label PATH [--machine M] [--commit C] [--command-as TEXT] -- COMMAND ...")
    ap.add_argument("out", help="the results file (JSON lines) to append to")
    ap.add_argument("--label", required=True, help="the path as the summary names it, e.g. 'tcp, host memory'")
    ap.add_argument("--machine", help="instead of what is found")
    ap.add_argument("--commit", help="instead of what is found")
    ap.add_argument("--command-as", help="the command as the summary shows it (default: the one run)")
    argv = sys.argv[1:]
    if "--" not in argv:
        ap.parse_args(argv)  # --help, or what is missing
        ap.error("no command: put it after --")
    cut = argv.index("--")
    a = ap.parse_args(argv[:cut])
    cmd = argv[cut + 1 :]
    if not cmd:
        ap.error("no command after --")
    context = {
        "label": a.label,
        "machine": a.machine or machine(),
        "commit": a.commit or commit(),
        # The program by its name, not where this machine keeps it.
        "command": a.command_as or shlex.join([os.path.basename(cmd[0])] + cmd[1:]),
        "date": datetime.date.today().isoformat(),
    }
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    kept = 0
    with open(a.out, "a") as out:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            row.update(context)
            out.write(json.dumps(row, sort_keys=True) + "\n")
            kept += 1
    rc = proc.wait()
    if rc != 0:
        sys.exit(f"record: the bench exited {rc} ({kept} lines kept)")
    if kept == 0:
        sys.exit("record: the bench printed no JSON line (did it get --json?)")


if __name__ == "__main__":
    main()
