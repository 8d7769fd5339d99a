"""Turn the runs of benchmarks/gpu_check.sh into a markdown report (stdout): one row per run, its claims.

python benchmarks/gpu_summary.py RUNS_DIR      # RUNS_DIR holds index.txt, NAME.log and NAME.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def main(runs: Path) -> int:
    rows = [
        line.split("|") for line in (runs / "index.txt").read_text().splitlines() if line.strip()
    ]
    print("\n| run | launcher | args | exit | s | claims holding | device in results | note |")
    print("|---|---|---|---|---|---|---|---|")
    failed_claims, errors = [], []
    for name, launcher, _script, args, rc, secs in sorted(rows):
        stem = re.sub(
            r"[^A-Za-z0-9_.-]", "_", name + "\n"
        )  # as `tr -c` in the script (newline included)
        log, res = runs / f"{stem}.log", runs / f"{stem}.json"
        results = json.loads(res.read_text()) if res.is_file() else {}
        claims = results.get("claims") or {}
        held = sum(1 for c in claims.values() if c.get("holds"))
        failed_claims += [
            f"{name}: {k} = {c.get('value')} (bound {c.get('relation')} {c.get('bound')})"
            for k, c in claims.items()
            if not c.get("holds")
        ]
        note = ""
        if rc != "0" and log.is_file():
            tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][
                -3:
            ]
            note = " / ".join(tail)[-200:].replace("|", "\\|")
            errors.append((name, log.read_text(errors="replace")[-3000:]))
        device = results.get("device", "")
        print(
            f"| {name} | {launcher} | `{args}` | {rc} | {secs} | {held}/{len(claims)} | {device} | {note} |"
        )
    print("\n## Claims that did not hold\n")
    print("\n".join(f"- {c}" for c in failed_claims) or "none")
    peak = []
    for res in sorted(runs.glob("*.json")):
        r = json.loads(res.read_text())
        for row in r.get("table", []) if isinstance(r.get("table"), list) else []:
            if isinstance(row, dict) and row.get("peak_cuda_bytes") is not None:
                peak.append(
                    f"| {row.get('name')} | {row.get('micro_batch')} | {row.get('saved_activation_bytes')} | "
                    f"{row['peak_cuda_bytes'] / 2**20:.1f} |"
                )
    print("\n## Peak CUDA memory per setting (benchmarks/memory_speed.py, one step)\n")
    print(
        "\n".join(
            [
                "| setting | micro-batch | saved activation bytes | peak CUDA MiB |",
                "|---|---|---|---|",
                *peak,
            ]
        )
        if peak
        else "none"
    )
    for name, text in errors:
        print(f"\n## Failed run: {name}\n\n```\n{text}\n```")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
