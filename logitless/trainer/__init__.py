"""The trainer: config sections, the GRPO loop, checkpoints, metrics, evaluation (see `loop.py`)."""

from logitless.trainer.checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint, save_checkpoint
from logitless.trainer.config.schema import TrainerConfig, load_train_config
from logitless.trainer.evaluate import EvalResult, evaluate, evaluate_config
from logitless.trainer.loop import TrainResult, train
from logitless.trainer.report.plot import plot_run

__all__ = [
    "CheckpointError",
    "EvalResult",
    "TrainResult",
    "TrainerConfig",
    "evaluate",
    "evaluate_config",
    "load_checkpoint",
    "load_train_config",
    "plot_run",
    "resolve_checkpoint",
    "save_checkpoint",
    "train",
]
