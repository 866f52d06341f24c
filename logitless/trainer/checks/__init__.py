"""Checks that run before anything slow: `preflight` calls each wing's checks once (config, sources, data, model
config, prompt lengths), for `--dry-run`, `logitless train` and `logitless eval`."""
