"""`logitless train|eval|plot`: the command line.

    logitless train [CONFIG.yaml] [section.key=value ...] [--resume RUN_DIR] [--dry-run]
    logitless eval  [CONFIG.yaml] [section.key=value ...] [--checkpoint RUN_DIR] [--output eval.json]
    logitless plot  RUN_DIR [--output curves.png]

With no CONFIG the embedded demo config is used: LoRA-GRPO on SmolLM2-135M-Instruct learning two-digit arithmetic
on CPU. `--resume RUN_DIR` / `--checkpoint RUN_DIR` without a CONFIG reuse the run's saved config.yaml.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from logitless.configlib import ConfigError


def _split_args(items: list[str]) -> tuple[str | None, list[str]]:
    """(config path or None, overrides): the config is the first item without '='."""
    config, overrides = None, []
    for item in items:
        if "=" in item:
            overrides.append(item)
        elif config is None:
            config = item
        else:
            raise ConfigError(f"unexpected argument {item!r}: give one CONFIG file, then section.key=value overrides")
    return config, overrides


def _run_config(path: str | None) -> Path | None:
    """config.yaml saved in a run folder (given as run folder, checkpoints folder or step folder)."""
    if path is None:
        return None
    from logitless.trainer.checkpoint import resolve_checkpoint

    step_dir = resolve_checkpoint(path)
    candidate = step_dir.parent.parent / "config.yaml"
    return candidate if candidate.is_file() else None


def _load(items: list[str], run_dir: str | None):
    """The run's config.yaml (for --resume/--checkpoint) or the given CONFIG, else the embedded demo; then overrides."""
    from logitless.trainer.config import demo_config, load_train_config

    config, overrides = _split_args(items)
    if config is None:
        config = _run_config(run_dir)
    if config is None:
        return demo_config(overrides)
    return load_train_config(config, overrides)


def cmd_train(args: argparse.Namespace) -> int:
    from logitless.trainer.config import to_yaml

    cfg = _load(args.args, args.resume)
    if args.dry_run:
        print(to_yaml(cfg), end="")
        return 0
    from logitless.trainer.loop import train
    from logitless.trainer.parallel import launched_world, shutdown

    try:
        result = train(cfg, resume=args.resume)  # under torchrun: one rank of a sharded run (trainer/parallel.py)
    finally:
        shutdown()
    if not result.interrupted and launched_world().main:
        print(f"done: {result.step} steps in {result.run_dir}; evaluate with: logitless eval --checkpoint {result.run_dir}")
    return result.exit_code


def cmd_eval(args: argparse.Namespace) -> int:
    from logitless.trainer.evaluate import evaluate_config, write_eval

    cfg = _load(args.args, args.checkpoint)
    if args.dry_run:
        from logitless.trainer.config import to_yaml

        print(to_yaml(cfg), end="")
        return 0
    result = evaluate_config(cfg, args.checkpoint)
    print(result.summary())
    if args.output:
        write_eval(result, args.output)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from logitless.trainer.plot import plot_run

    print(plot_run(args.run_dir, args.output))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="logitless", description="GRPO-family RL fine-tuning of language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a model (no arguments: the embedded CPU demo)")
    p.add_argument("args", nargs="*", metavar="CONFIG|section.key=value", help="a YAML config, then overrides")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue from the latest checkpoint of a run")
    p.add_argument("--dry-run", action="store_true", help="validate and print the resolved config, then exit")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("eval", help="accuracy on the eval split (greedy, or pass@k with eval.pass_k=k)")
    p.add_argument("args", nargs="*", metavar="CONFIG|section.key=value", help="a YAML config, then overrides")
    p.add_argument("--checkpoint", metavar="RUN_DIR", help="evaluate the weights of this run/checkpoint")
    p.add_argument("--output", metavar="FILE", help="write the result and every sample as JSON")
    p.add_argument("--dry-run", action="store_true", help="validate and print the resolved config, then exit")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("plot", help="PNG of the training curves of a run")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--output", metavar="FILE", help="default: RUN_DIR/curves.png")
    p.set_defaults(fn=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
