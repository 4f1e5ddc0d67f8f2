"""Soak: run the seeded fault schedules (tests/e2e/test_fault_schedules.py) for many seeds.

    .venv/bin/python bench/soak.py [--seeds 50] [--start 1] [--chunk 10] [--out var/soak]

Runs pytest on the module with `--seed N` for seeds start .. start+seeds-1, `--chunk` seeds
per pytest run (each run creates its own test database once, and its own PostgreSQL cluster,
migrated once, which every seed crashes: tests/private_postgres.py), and prints one line per seed
as it finishes - held, or failed with its first violations - and a total, e.g.
"50 seeds: 50 held, 0 failed". The test writes each seed's result to <out>/results.jsonl and
a failed seed's full report (schedule, violations, rows, log lines) to `<out>/seed-N.txt`
(DOVECOTE_FAULT_RESULTS_DIR); replay one with
`make test PYTEST_ARGS="tests/e2e/test_fault_schedules.py --seed N"`.
Exit status 1 when any seed failed. A seed takes about 30-60 s here.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULE = "tests/e2e/test_fault_schedules.py"

# Stopped by SIGTERM (`timeout`, CI): pytest, our child, is stopped with us by the `finally`.
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def run_chunk(seeds: list[int], out: Path, seen: set[int]) -> Iterator[tuple[int, bool, str, list[str]]]:
    """Run pytest over these seeds; yield (seed, held, summary, first violations) as each
    seed finishes (the test appends a line to <out>/results.jsonl)."""
    results = out / "results.jsonl"
    args = [sys.executable, "-m", "pytest", MODULE, "-q", "-p", "no:cacheprovider"]
    for seed in seeds:
        args += ["--seed", str(seed)]
    log = (out / f"pytest-{seeds[0]}-{seeds[-1]}.log").open("w")
    env = {**os.environ, "DOVECOTE_FAULT_RESULTS_DIR": str(out)}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            done = proc.poll() is not None
            for line in results.read_text().splitlines() if results.exists() else []:
                result = json.loads(line)
                if result["seed"] in seeds and result["seed"] not in seen:
                    seen.add(result["seed"])
                    yield result["seed"], result["held"], result["summary"], result["problems"]
            if done:
                break
            time.sleep(1)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
        log.close()
    for seed in seeds:
        if seed not in seen:
            # No result line: the test errored before its checks (see the pytest log).
            seen.add(seed)
            yield seed, False, "", [f"no result: pytest exited {proc.returncode}, see {log.name}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=50, help="how many seeds (default 50)")
    parser.add_argument("--start", type=int, default=1, help="first seed (default 1)")
    parser.add_argument("--chunk", type=int, default=10, help="seeds per pytest run (default 10)")
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "soak", help="where failure reports go")
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    for old in [options.out / "results.jsonl", *options.out.glob("seed-*.txt")]:
        old.unlink(missing_ok=True)  # a previous soak's results
    seeds = list(range(options.start, options.start + options.seeds))
    held: list[int] = []
    failed: list[int] = []
    started = time.monotonic()
    seen: set[int] = set()
    for i in range(0, len(seeds), options.chunk):
        for seed, ok, summary, problems in run_chunk(seeds[i : i + options.chunk], options.out, seen):
            if ok:
                held.append(seed)
                print(f"seed {seed}: held  {summary.partition(': ')[2]}", flush=True)
                continue
            failed.append(seed)
            print(f"seed {seed}: FAILED ({options.out / f'seed-{seed}.txt'})", flush=True)
            for line in problems[:3]:
                print(f"    - {line[:200]}", flush=True)
    minutes = (time.monotonic() - started) / 60
    print(f"{len(seeds)} seeds: {len(held)} held, {len(failed)} failed ({minutes:.1f} min)")
    if failed:
        print("failed seeds: " + " ".join(map(str, failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
