"""Run the README's first command block, in order, as a new user would on a fresh clone (issue #33).

Every line of the first ```bash block of README.md is run with bash from the repository root; each must exit 0. The
run uses a fresh qdeploy cache (QDEPLOY_CACHE in a temporary folder) so nothing a developer's earlier runs cached
(trained demo weights, exports, calibration ranges) helps it, and every example config a command names is checked
not to read ../shared (a user's clone does not have it). `.ci/run` calls this after `make test`.

    python bench/ci/readme_walkthrough.py [--keep-cache] [--json docs/results/first-run/readme_walkthrough.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def readme_commands(readme: Path) -> list[str]:
    """The command lines of the README's first ```bash block, comments and blank lines dropped."""
    block = re.search(r"```bash\n(.*?)```", readme.read_text(encoding="utf-8"), re.S)
    if block is None:
        raise SystemExit(f"{readme}: no ```bash block")
    lines = []
    for raw in block.group(1).splitlines():
        line = re.sub(r"\s+#.*$", "", raw).strip()  # a trailing comment (commands here never hold ' #')
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def configs_reading_shared(commands: list[str]) -> list[str]:
    """Example configs named by the commands that read ../shared (they would fail on a user's clone)."""
    bad = []
    for cmd in commands:
        for word in cmd.split():
            if word.endswith((".yaml", ".yml")) and (REPO / word).is_file() and "shared/" in (REPO / word).read_text():
                bad.append(word)
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep-cache", action="store_true", help="use the normal qdeploy cache instead of a fresh one")
    parser.add_argument("--json", type=Path, default=None, help="also write the per-command results here")
    args = parser.parse_args()
    commands = readme_commands(REPO / "README.md")
    shared = configs_reading_shared(commands)
    if shared:
        print(f"README commands name configs that read ../shared: {', '.join(shared)}", file=sys.stderr)
        return 1
    env = dict(os.environ)
    tmp = None
    if not args.keep_cache:
        tmp = tempfile.TemporaryDirectory(prefix="qdeploy-walkthrough-")
        env["QDEPLOY_CACHE"] = tmp.name
    rows, failed = [], None
    for cmd in commands:
        print(f"$ {cmd}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(["bash", "-c", cmd], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        seconds = time.perf_counter() - t0
        tail = proc.stdout.strip().splitlines()[-3:]
        rows.append({"command": cmd, "exit_code": proc.returncode, "seconds": round(seconds, 1), "last_lines": tail})
        print(f"  exit {proc.returncode} in {seconds:.1f} s" + "".join(f"\n  | {t}" for t in tail), flush=True)
        if proc.returncode != 0:
            failed = cmd
            print(proc.stdout[-4000:], file=sys.stderr)
            break
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": "python bench/ci/readme_walkthrough.py", "machine": platform.node(),
                                         "cpu_count": os.cpu_count(), "python": platform.python_version(),
                                         "fresh_cache": not args.keep_cache, "steps": rows}, indent=2) + "\n")
    if tmp is not None:
        tmp.cleanup()
    if failed:
        print(f"README walkthrough failed at: {failed}", file=sys.stderr)
        return 1
    print(f"README walkthrough: {len(rows)} commands, all exit 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
