"""Print a seeded random sample of mutmut mutant names, one per line, for `scripts/mutation.sh TARGET <names>`:
for a module too slow to run in full, a sample gives an estimate of its score that can be rerun exactly.

    python scripts/mutation_sample.py --seed 17 --n 250 logitless/rollout/hf.py [more files] \
        [--exclude GLOB ...]   # names already run, as fnmatch globs (`*.x_select_rows__*`)

It generates the mutants of the given files with mutmut (in a temporary folder, about 10 s), drops the excluded
names and draws n of the rest uniformly (random.Random(seed).sample over the sorted names), so each file gets a
share in proportion to its mutants.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

GENERATE = """
import os
from mutmut.__main__ import copy_also_copy_files, copy_src_dir, create_mutants, setup_source_paths
os.makedirs("mutants", exist_ok=True)
copy_src_dir(); copy_also_copy_files(); setup_source_paths(); create_mutants(1)
"""


def mutant_names(files: list[str]) -> list[str]:
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as work:
        shutil.copytree(repo / "logitless", Path(work) / "logitless", ignore=shutil.ignore_patterns("__pycache__"))
        Path(work, "setup.cfg").write_text(
            "[mutmut]\nsource_paths = logitless\nonly_mutate =\n" + "".join(f"    {f}\n" for f in files)
        )
        subprocess.run([sys.executable, "-c", GENERATE], cwd=work, check=True, capture_output=True)
        names = []
        for f in files:
            meta = Path(work, "mutants", f + ".meta")
            names += json.loads(meta.read_text())["exit_code_by_key"]
    return sorted(names)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--exclude", nargs="*", default=[])
    a = p.parse_args()
    pool = [n for n in mutant_names(a.files) if not any(fnmatch.fnmatchcase(n, g) for g in a.exclude)]
    sample = random.Random(a.seed).sample(pool, min(a.n, len(pool)))
    print(f"{len(sample)} of {len(pool)} mutants", file=sys.stderr)
    print("\n".join(sorted(sample)))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
