"""Soak: run the seeded fault schedules (tests/e2e/test_fault_schedules.py) for many seeds.

    .venv/bin/python bench/soak.py [--seeds 50] [--start 1] [--chunk 10] [--out var/soak]

Runs pytest on the module with `--seed N` for seeds start .. start+seeds-1, `--chunk` seeds
per pytest run (each run creates its own test database once), and prints one line per seed
- held, or failed with its first violations - and a total, e.g. "50 seeds: 50 held, 0 failed".
The full failure report of each failed seed (schedule, violations, rows, log lines) is
written to `<out>/seed-N.txt`; replay one with
`make test PYTEST_ARGS="tests/e2e/test_fault_schedules.py --seed N"`.
Exit status 1 when any seed failed. A seed takes about 30-60 s here.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULE = "tests/e2e/test_fault_schedules.py"

# Stopped by SIGTERM (`timeout`, CI): pytest, our child, is stopped with us by the `finally`.
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def run_chunk(seeds: list[int], out: Path) -> dict[int, tuple[bool, str, str]]:
    """{seed: (held, summary line, failure text)} for one pytest run over these seeds."""
    xml = out / f"junit-{seeds[0]}-{seeds[-1]}.xml"
    args = [sys.executable, "-m", "pytest", MODULE, "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    args += ["-o", "junit_logging=system-out"]
    for seed in seeds:
        args += ["--seed", str(seed)]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
    results: dict[int, tuple[bool, str, str]] = {}
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            match = re.search(r"\[seed(\d+)\]", case.get("name", ""))
            if not match:
                continue
            seed = int(match.group(1))
            stdout = "".join(node.text or "" for node in case.iter("system-out"))
            summary = next((ln for ln in stdout.splitlines() if ln.startswith(f"seed {seed}:")), "")
            bad = [node for node in case if node.tag in ("failure", "error")]
            text = "\n".join((node.get("message") or "") + "\n" + (node.text or "") for node in bad)
            results[seed] = (not bad, summary, text)
    for seed in seeds:
        results.setdefault(seed, (False, "", f"pytest exited {proc.returncode} without a result for this seed"))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=50, help="how many seeds (default 50)")
    parser.add_argument("--start", type=int, default=1, help="first seed (default 1)")
    parser.add_argument("--chunk", type=int, default=10, help="seeds per pytest run (default 10)")
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "soak", help="where failure reports go")
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    seeds = list(range(options.start, options.start + options.seeds))
    held: list[int] = []
    failed: list[int] = []
    started = time.monotonic()
    for i in range(0, len(seeds), options.chunk):
        chunk = seeds[i : i + options.chunk]
        for seed, (ok, summary, text) in sorted(run_chunk(chunk, options.out).items()):
            if ok:
                held.append(seed)
                print(f"seed {seed}: held  {summary.partition(': ')[2]}", flush=True)
                continue
            failed.append(seed)
            report = options.out / f"seed-{seed}.txt"
            report.write_text(text)
            violations = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("- ")][:3]
            print(f"seed {seed}: FAILED ({report})", flush=True)
            for line in violations or text.strip().splitlines()[:3]:
                print(f"    {line[:200]}", flush=True)
    minutes = (time.monotonic() - started) / 60
    print(f"{len(seeds)} seeds: {len(held)} held, {len(failed)} failed ({minutes:.1f} min)")
    if failed:
        print("failed seeds: " + " ".join(map(str, failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
