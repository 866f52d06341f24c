"""Summarize a mutmut run (run from its scratch folder): score, and the surviving mutants split into those that
only change an error or warning message and those that change behaviour (listed with their diff line).

    python scripts/mutation_report.py                                  # in the folder where `mutmut run` ran
    python scripts/mutation_report.py --recheck REPO tests/test_x.py   # re-run the survivors against tests
                                                                        # of the checkout REPO (e.g. new ones)

--recheck copies REPO/tests into the mutated tree and runs each survivor's mutant, and each mutant that the run's
tests never reached ("no tests"), one forked pytest per mutant (torch imported once), against the given test
files; those they kill count as killed. "No tests" mutants left are listed with the survivors.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

MESSAGE_STARTS = ("raise ", 'f"', "f'", '"', "'", "warnings.warn(")


def mutmut(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "mutmut", *args], capture_output=True, text=True).stdout


def changed_lines(name: str) -> list[str]:
    diff = mutmut("show", name).splitlines()
    return [ln for ln in diff if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]


def recheck(names: list[str], repo: Path, tests: list[str]) -> set[str]:
    """The mutants among `names` that fail `tests` (paths relative to `repo`), run in ./mutants."""
    import pytest
    import torch  # imported once, before forking

    torch.set_num_threads(1)  # no intra-op pool for a forked child to deadlock in (see mutation.sh)

    shutil.rmtree("mutants/tests", ignore_errors=True)
    shutil.copytree(repo / "tests", "mutants/tests", ignore=shutil.ignore_patterns("__pycache__"))
    killed = set()
    for name in ["", *names]:  # "" first: the unmutated code must pass, or the recheck means nothing
        pid = os.fork()
        if pid == 0:
            os.environ["MUTANT_UNDER_TEST"] = name
            os.chdir("mutants")
            sys.path.insert(0, os.getcwd())
            signal.alarm(120)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os._exit(int(pytest.main(["-x", "-q", "--tb=no", "-p", "no:cacheprovider", *tests])))
        _, code = os.waitpid(pid, 0)
        if code != 0 and not name:
            raise SystemExit("the tests fail on the unmutated code in ./mutants (source changed since the run?)")
        if code != 0:
            killed.add(name)
    return killed


def main() -> None:
    status = Counter()
    survived, untested = [], []
    for line in mutmut("results", "--all", "true").splitlines():
        name, _, state = line.strip().rpartition(": ")
        if not name:
            continue
        status[state] += 1
        if state == "survived":
            survived.append(name)
        elif state == "no tests":  # code the run's tests never reach: new tests may
            untested.append(name)
    if len(sys.argv) > 2 and sys.argv[1] == "--recheck":
        newly = recheck(survived + untested, Path(sys.argv[2]).resolve(), sys.argv[3:])
        print(f"recheck: {len(newly & set(survived))} of {len(survived)} survivors and {len(newly & set(untested))} "
              f"of {len(untested)} untested mutants killed by {' '.join(sys.argv[3:])}")
        status["killed"] += len(newly)
        status["survived"] -= len(newly & set(survived))
        status["no tests"] -= len(newly & set(untested))
        survived = [n for n in survived if n not in newly]
        untested = [n for n in untested if n not in newly]
    survived = survived + untested  # a mutant no test reaches is a bug the suite would miss, too
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
