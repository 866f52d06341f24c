"""`python -m logitless ...` is `logitless ...`."""

from logitless.cli import run

run()
