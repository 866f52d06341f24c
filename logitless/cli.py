"""`logitless train|eval|plot|export`: the command line.

    logitless train [CONFIG.yaml | --config FILE] [section.key=value ...] [--resume RUN_DIR [--allow-config-change]
                    | --overwrite] [--dry-run]
    logitless eval  [CONFIG.yaml | --config FILE] [section.key=value ...] [--checkpoint RUN_DIR] [--output eval.json]
    logitless plot  RUN_DIR [--output curves.png]
    logitless export RUN_DIR [--merged] [--output DIR] [--push-to-hub REPO]

With no CONFIG the embedded demo config is used: LoRA-GRPO on SmolLM2-135M-Instruct learning two-digit arithmetic
on CPU. `--resume RUN_DIR` / `--checkpoint RUN_DIR` without a CONFIG reuse the run's saved config (a run folder
without one is refused; `eval --checkpoint` then takes the checkpoint's copy). A CONFIG of `-` (or `/dev/stdin`,
or a pipe) is read from standard input. Overrides are one word each (`rollout.temperature=0.7`) and may stand
before or after the flags. Everything that can be checked without the model (options, the model's config, the
first data rows against the rewards, run folder, sources, output paths) is checked first; errors are one line
naming the config key or file and the fix. Ctrl-C says at once what it does (trainer/signals.py); the second one
stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from logitless.configlib import ConfigError


CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def _looks_like_key(item: str) -> bool:
    """True for a dotted name of the config schema ('rollout.temperature', 'optim') that is not a file here."""
    from logitless.configlib import valid_keys
    from logitless.trainer.config.schema import TrainerConfig

    if Path(item).suffix in CONFIG_SUFFIXES or Path(item).exists():
        return False
    keys = valid_keys(TrainerConfig)
    return item in keys or item.partition(".")[0] in keys and "." in item


def _key_without_value(item: str, following: str | None) -> ConfigError:
    value = following if following is not None and "=" not in following and not _looks_like_key(following) else "VALUE"
    return ConfigError(
        f"{item!r} is a config key without a value: write each override as one word key=value, with no spaces "
        f"around '=' (here: {item}={value})"
    )


def _split_args(items: list[str], config_flag: str | None = None) -> tuple[str | None, list[str]]:
    """(config path or None, overrides): the config is `--config` or the first item without '='; every other item
    must be a section.key=value override (a key without '=' or a value split off by spaces is refused, showing the
    one-word form)."""
    config, overrides = config_flag, []
    for i, item in enumerate(items):
        following = items[i + 1] if i + 1 < len(items) else None
        if "=" in item:
            if item.endswith("=") and following is not None and "=" not in following:
                raise ConfigError(f"{item!r} has no value: write each override as one word key=value, with no "
                                  f"spaces around '=' (here: {item}{following})")
            overrides.append(item)
        elif _looks_like_key(item):
            raise _key_without_value(item, following)
        elif config is None:
            config = item
        else:
            hint = (f"the config is {config!r} already (--config and a CONFIG argument?)" if config_flag is not None
                    else f"the config is {config!r}, the first argument without '='")
            raise ConfigError(f"unexpected argument {item!r}: {hint}. Give one CONFIG file (or --config FILE, '-' "
                              "for standard input), then section.key=value overrides")
    if config is not None and Path(config).is_dir():
        hint = f" (to continue or evaluate that run, use --resume {config} / --checkpoint {config})"
        raise ConfigError(f"CONFIG {config!r} is a folder, not a YAML config file{hint}")
    return config, overrides


def _run_config(path: str | None, flag: str) -> Path | None:
    """The config a run folder trains with now (given as run folder, checkpoints folder or step folder), for
    `flag` (--resume, --checkpoint). A folder without one is refused (--resume), or gives its checkpoint's copy
    (--checkpoint); None when the folder does not exist (the claim or checkpoint lookup names it)."""
    if path is None:
        return None
    from logitless.trainer import checkpoint as ckpt
    from logitless.trainer.rundir import run_dir_of_checkpoint
    from logitless.trainer.config.files import current_config

    folder = run_dir_of_checkpoint(path)
    if not folder.is_dir():
        return None
    found = current_config(folder)
    if found is not None:
        return found
    if flag == "--checkpoint":
        try:
            copy = ckpt.resolve_checkpoint(path, flag=flag) / ckpt.RUN_CONFIG
        except ckpt.CheckpointError:
            copy = None
        if copy is not None and copy.is_file():
            return copy
    copies = sorted(folder.glob(f"checkpoints/{ckpt.STEP_PREFIX}*/{ckpt.RUN_CONFIG}"))
    hint = f" Its newest checkpoint holds a copy: cp {copies[-1]} {folder / ckpt.RUN_CONFIG}." if copies else ""
    command = "train" if flag == "--resume" else "eval"
    raise ConfigError(
        f"{flag} {path}: {folder} has no {ckpt.RUN_CONFIG} (the config the run was started with), so there is "
        f"nothing to continue with.{hint} Or give the run's config file: logitless {command} CONFIG.yaml {flag} {path}"
    )


def _load(items: list[str], run_dir: str | None, flag: str, config_flag: str | None = None):
    """The run's config (for --resume/--checkpoint) or the given CONFIG, else the embedded demo; then overrides."""
    from logitless.trainer.config.schema import load_train_config
    from logitless.trainer.demo import demo_config

    config, overrides = _split_args(items, config_flag)
    if config is None:
        config = _run_config(run_dir, flag)
    if config is None:
        return demo_config(overrides)
    return load_train_config(config, overrides)


_stopped_now = False  # a run was stopped at once: `run` exits without the interpreter's shutdown


def _exit_now(signum: int, frame: object) -> None:
    os._exit(128 + signum)


def _end_of_run(now: bool = False) -> None:
    """The run is over and said so: a further Ctrl-C ends the process at once (130), without more output."""
    global _stopped_now
    _stopped_now = _stopped_now or now
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        signal.signal(signal.SIGINT, _exit_now)


def _dry_run(cfg, *, training: bool, ranks: int = 1) -> int:
    """Every check a run makes before its model loads, then the resolved config (stdout) and what was checked
    (stderr, one line each); for training, the settings "auto" decides on this machine and the memory plan
    (stderr, from the model's config), or on `ranks` > 1 (torchrun) the memory model's per-GPU peaks."""
    from logitless.trainer.config.schema import to_yaml
    from logitless.trainer.distributed.parallel import World
    from logitless.trainer.preflight import check_world, preflight

    if training:  # (config only: before the slower checks; one rank refuses a split rollout as a run does)
        check_world(cfg, World(rank=0, size=ranks))
    checked = preflight(cfg, training=training)
    print(to_yaml(cfg), end="")
    for line in checked:
        print(f"checked: {line}", file=sys.stderr)
    if training:
        from logitless.trainer.memory.auto import print_dry_run

        print_dry_run(cfg, ranks=ranks)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from logitless.trainer.preflight import validate_config

    cfg = _load(args.args, args.resume, "--resume", args.config)
    if args.ranks is not None and (args.ranks < 1 or not args.dry_run):
        args.command_parser.error(f"--ranks {args.ranks}: give a rank count of at least 1, with --dry-run")
    if args.dry_run:
        from logitless.trainer.distributed.parallel import launched_world

        return _dry_run(cfg, training=True, ranks=args.ranks or launched_world().size)
    validate_config(cfg)
    from logitless.trainer.loop import train
    from logitless.trainer.distributed.parallel import launched_world, shutdown
    from logitless.trainer.rundir import restart_advice, run_dir_of_checkpoint
    from logitless.trainer.signals import StopNow

    if args.allow_config_change and args.resume is None:
        raise ConfigError("--allow-config-change goes with --resume: it lets a resumed run train with changed settings")
    try:  # under torchrun: one rank of a sharded run (trainer/distributed/parallel.py)
        result = train(cfg, resume=args.resume, overwrite=args.overwrite, allow_config_change=args.allow_config_change)
    except StopNow as e:  # its message was printed when the signal came
        _end_of_run(now=True)
        return e.exit_code
    except KeyboardInterrupt:  # one that came before the run's own handlers (or in place of them)
        _end_of_run()
        run_dir = run_dir_of_checkpoint(args.resume) if args.resume else Path(cfg.train.output_dir).expanduser()
        print(f"interrupted (Ctrl-C); {restart_advice(run_dir.resolve())}", file=sys.stderr)
        return 130
    finally:
        shutdown()
    if not result.interrupted and launched_world().main:
        print(f"done: {result.step} steps in {result.run_dir}; evaluate with: logitless eval --checkpoint {result.run_dir}")
    return result.exit_code


def cmd_eval(args: argparse.Namespace) -> int:
    from logitless.trainer import checkpoint as ckpt
    from logitless.trainer.preflight import check_output_file, check_resume, preflight, validate_config

    cfg = _load(args.args, args.checkpoint, "--checkpoint", args.config)
    validate_config(cfg, training=False)
    if args.output:
        check_output_file(args.output, "--output")
    checkpoint = None
    if args.checkpoint is not None:
        checkpoint = ckpt.resolve_checkpoint(args.checkpoint, flag="--checkpoint")
        check_resume(cfg, checkpoint, flag="--checkpoint", training=False)
    if args.dry_run:
        return _dry_run(cfg, training=False)
    preflight(cfg, training=False)  # sources, the model's config, the eval rows
    from logitless.trainer.evaluate import evaluate_config, write_eval

    result = evaluate_config(cfg, checkpoint)
    print(result.summary())
    if args.output:  # (with an agent, a sample of its episodes beside it: evaluate.traces_path)
        write_eval(result, args.output, step=ckpt.checkpoint_step(checkpoint) if checkpoint is not None else None)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from logitless.trainer.report.plot import plot_run

    print(plot_run(args.run_dir, args.output))  # checks --output's folder and format before drawing
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from logitless.trainer.export import export_run

    result = export_run(args.run_dir, output=args.output, merged=args.merged, push_to_hub=args.push_to_hub,
                        private=not args.public)
    for what, folder in (("adapter", result.adapter), ("merged model", result.merged)):
        if folder is not None:
            print(f"{what}: {folder}")
    if result.pushed:
        print(f"pushed: {result.pushed}")
    return 0


CONFIG_HELP = "the YAML config, as the first positional argument would name it; '-' reads it from standard input"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="logitless", description="GRPO-family RL fine-tuning of language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a model (no arguments: the embedded CPU demo)")
    p.add_argument("args", nargs="*", metavar="CONFIG|section.key=value", help="a YAML config, then overrides")
    p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run, in its folder, from its newest intact checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in train.output_dir (deleted once the new run has finished a step)")
    p.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: continue with settings that change what is trained (saved beside the run's "
                        "config, which is kept)")
    p.add_argument("--dry-run", action="store_true",
                   help="run every check made before the model loads, print the resolved config and what was checked, "
                        "and the settings auto decides here with the memory plan")
    p.add_argument("--ranks", type=int, metavar="N",
                   help="with --dry-run: check and plan for torchrun --nproc-per-node N (FSDP2), with the memory "
                        "model's per-GPU peak of each phase (default: torchrun's WORLD_SIZE, else 1)")
    p.set_defaults(fn=cmd_train, command_parser=p)
    p = sub.add_parser("eval", help="accuracy on the eval split (greedy, or pass@k with eval.pass_k=k)")
    p.add_argument("args", nargs="*", metavar="CONFIG|section.key=value", help="a YAML config, then overrides")
    p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    p.add_argument("--checkpoint", metavar="RUN_DIR", help="evaluate the weights of this run/checkpoint")
    p.add_argument("--output", metavar="FILE", help="write the result and every sample as JSON")
    p.add_argument("--dry-run", action="store_true",
                   help="run every check made before the model loads, print the resolved config and what was checked")
    p.set_defaults(fn=cmd_eval, command_parser=p)
    p = sub.add_parser("plot", help="PNG of the training curves of a run")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--output", metavar="FILE", help="default: RUN_DIR/curves.png (.png, .pdf, .svg, ...)")
    p.set_defaults(fn=cmd_plot, command_parser=p)
    p = sub.add_parser("export", help="the trained policy as a PEFT adapter and/or a merged model with a model card")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (its newest intact checkpoint) or a step folder")
    p.add_argument("--merged", action="store_true", help="also write the model with the adapters merged (safetensors)")
    p.add_argument("--output", metavar="DIR", help="default: RUN_DIR/export")
    p.add_argument("--push-to-hub", metavar="REPO", help="upload the merged model (else the adapter) to this hub repo")
    p.add_argument("--public", action="store_true", help="create the hub repository public (default: private)")
    p.set_defaults(fn=cmd_export, command_parser=p)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with CONFIG and overrides allowed anywhere among the flags (`train --resume RUN
    train.max_steps=80` as well as `train train.max_steps=80 --resume RUN`). An unknown flag is refused naming the
    command's flags (and, for `--section.key=value`, the override's form)."""
    args, extra = build_parser().parse_known_args(argv)
    sub = args.command_parser  # the command's own parser: its errors print its usage line
    for item in extra:
        if item.startswith("-") and item != "-":
            name = item.lstrip("-")
            dashed_override = "=" in name and "." in name.partition("=")[0]
            sub.error(f"unknown option {item!r}" + (f"; overrides are written without dashes: {name}"
                                                      if dashed_override else " (the options are listed above)"))
    if extra and not hasattr(args, "args"):
        sub.error(f"unexpected argument(s) {' '.join(extra)}: `logitless {args.command}` takes no config overrides")
    if extra:
        args.args = list(args.args) + extra
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        _end_of_run()
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError, RuntimeError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def run() -> None:
    """The `logitless` command: `main()`, then exit with its code. After a run stopped at once (a second stop
    signal) the process ends without the interpreter's shutdown, which would wait for a thread still in native
    code (an async rollout's decode): what it wrote is complete already."""
    code = main()
    if _stopped_now:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    run()
