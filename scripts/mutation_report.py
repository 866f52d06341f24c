"""Summarize a mutmut run (run from its scratch folder): score, and the surviving mutants split into those that
only change an error or warning message and those that change behaviour (listed with their diff line).

    python scripts/mutation_report.py            # in the folder where `mutmut run` ran
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

MESSAGE_STARTS = ("raise ", 'f"', "f'", '"', "'", "warnings.warn(")


def mutmut(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "mutmut", *args], capture_output=True, text=True).stdout


def changed_lines(name: str) -> list[str]:
    diff = mutmut("show", name).splitlines()
    return [ln for ln in diff if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]


def main() -> None:
    status = Counter()
    survived = []
    for line in mutmut("results", "--all", "true").splitlines():
        name, _, state = line.strip().rpartition(": ")
        if not name:
            continue
        status[state] += 1
        if state == "survived":
            survived.append(name)
    message, behaviour = [], []
    for name in survived:
        lines = changed_lines(name)
        only_message = bool(lines) and all(ln[1:].strip().startswith(MESSAGE_STARTS) for ln in lines)
        (message if only_message else behaviour).append((name, lines))
    killed = status["killed"]
    tested = killed + len(survived)
    print(f"mutants: {dict(status)}")
    if tested:
        print(f"score: {killed}/{tested} = {killed / tested:.1%} killed")
        print(f"message-only survivors: {len(message)}; behaviour survivors: {len(behaviour)}; "
              f"score without message-only: {killed}/{killed + len(behaviour)} = {killed / (killed + len(behaviour)):.1%}")
    for name, lines in behaviour:
        print(f"\n{name}")
        for ln in lines:
            print(f"    {ln.strip()[:150]}")


if __name__ == "__main__":
    main()
