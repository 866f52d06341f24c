"""A vision-language model's processor: transformers' own, or its class without the video processor where
torchvision is missing."""

from __future__ import annotations

import importlib.util
from typing import Any

from logitless.rollout.static_rows import VISION_EPISODES_REFUSAL
from logitless.rollout.vision import prompt_images
from logitless.trainer.config.schema import ModelConfig, TrainerConfig
from logitless.trainer.policy.modeling import resolve_source

VISION_INSTALL_HINT = "pip install 'logitless[vision]'"


def processor_class(config: Any) -> type:
    """The transformers processor class of a vision-language model's config (e.g. Qwen2_5_VLProcessor)."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name

    name = PROCESSOR_MAPPING_NAMES.get(config.model_type)
    cls = processor_class_from_name(name) if name else None
    if cls is None:
        raise ValueError(f"model_type {config.model_type!r} has no transformers processor class; logitless trains "
                         "vision-language models whose processor transformers ships (Qwen2.5-VL, Qwen3-VL, Gemma 3)")
    return cls


def image_only(cls: type) -> type:
    """`cls` (a processor class whose __init__ takes a video_processor) as a processor of images and text only.

    transformers builds a Qwen-VL processor with its video processor, which needs torchvision even where no video is
    ever processed; the image processor has a PIL backend. The subclass leaves the video processor out (a video
    input then fails in the processor's own code) and is otherwise the class itself: same chat template, same
    placeholder expansion, same outputs."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        cls.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__doc__": image_only.__doc__})


def with_tokenizer(cls: type, tokenizer: Any) -> type:
    """`cls` (a processor class) taking `tokenizer` as its tokenizer in `from_pretrained` instead of reading the
    folder's again (the run has it loaded; a 150k-token vocabulary takes seconds to read)."""
    load = cls._load_tokenizer_from_pretrained.__func__ if hasattr(cls, "_load_tokenizer_from_pretrained") else None

    def given(kls, sub_processor_type, *args, **kwargs):
        return tokenizer if sub_processor_type == "tokenizer" else load(kls, sub_processor_type, *args, **kwargs)

    return type(cls.__name__, (cls,), {"_load_tokenizer_from_pretrained": classmethod(given), "__doc__": cls.__doc__})


def load_processor(cfg: ModelConfig, tokenizer: Any) -> Any:
    """The processor of the vision-language model `cfg` names (its tokenizer is `tokenizer`, left-padding, the pad
    token the run uses): the model type's transformers processor class (with trust_remote_code and torchvision,
    AutoProcessor: the folder may name its own), without its video processor where torchvision is missing
    (`image_only`, images through the PIL backend)."""
    from transformers import AutoConfig, AutoProcessor

    source, _ = resolve_source(cfg)
    kwargs = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    try:
        torchvision = importlib.util.find_spec("torchvision") is not None
        if torchvision and cfg.trust_remote_code:  # the folder may name a processor class of its own
            processor = AutoProcessor.from_pretrained(source, **kwargs)
        else:
            cls = processor_class(AutoConfig.from_pretrained(source, **kwargs))
            import inspect

            if not torchvision and "video_processor" in inspect.signature(cls.__init__).parameters:
                cls = image_only(cls)
            processor = with_tokenizer(cls, tokenizer).from_pretrained(source, **kwargs)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"model.name_or_path={cfg.name_or_path!r}: the vision-language model's processor cannot be "
                         f"loaded ({str(e).splitlines()[0] if str(e) else type(e).__name__}); the folder needs its "
                         "processor files (preprocessor_config.json, the tokenizer, a chat template that renders "
                         f"images), or install the full processor stack: {VISION_INSTALL_HINT}") from None
    processor.tokenizer = tokenizer
    if not getattr(processor, "chat_template", None):
        raise ValueError(f"model.name_or_path={cfg.name_or_path!r}: the processor has no chat template, which "
                         "renders each image's placeholder; use the model's instruct processor files")
    return processor


def decodes_static(cfg: TrainerConfig) -> bool:
    """Whether the run's rollout is the static engine: rollout.backend=static, or "auto" where it means static
    whatever the model (a static-only rollout option set, or train.async_rollout; `memory.auto.rollout_backend`
    picks hf for a vision-language model otherwise)."""
    r = cfg.rollout
    return r.backend == "static" or (r.backend == "auto" and bool(r.static_settings() or cfg.train.async_rollout))


def check_image_rows(cfg: TrainerConfig, rows: list[Any], world_size: int = 1) -> bool:
    """Whether some prompt row has images; refuses, before any model loads, the settings that cannot train them
    yet: rollout.backend=continuous (no image inputs in its decode loop); a split or shared decode
    (rollout.tensor_parallel > 1; rollout.device under torchrun, `world_size` > 1), which hands the ranks their rows
    without their images; on the static engine multi-turn episodes (its turns are prefilled as token ids) and
    train.async_rollout (its rollout in flight is checkpointed without images); agents whose prompts cannot carry
    images (agent.driver: your own driver renders the prompts; agent.format=raw: raw text). (Packing is checked
    against the model's config: `checks.model`.)"""
    if not any(prompt_images(r.prompt) for r in rows):
        return False
    r = cfg.rollout
    if r.backend not in ("hf", "static", "auto"):
        raise ValueError(f"rollout.backend={r.backend}: rows with images are decoded by rollout.backend=hf or static "
                         "only (its decode loop has no image inputs or M-RoPE positions yet); set rollout.backend=hf "
                         "or static")
    if r.tensor_parallel > 1:
        raise ValueError(f"rollout.tensor_parallel={r.tensor_parallel}: the split rollout does not decode rows with "
                         "images yet; set rollout.tensor_parallel=1")
    if r.device is not None and world_size > 1:
        raise ValueError(f"rollout.device={r.device} under torchrun: rank 0's decode of every rank's prompts does not "
                         "hand the ranks their rows' images yet; unset rollout.device (each rank decodes its own rows)")
    if decodes_static(cfg) and cfg.agent.enabled:
        raise ValueError(VISION_EPISODES_REFUSAL)
    if cfg.train.async_rollout:
        raise ValueError("train.async_rollout=true checkpoints the rollout it keeps in flight without its rows' "
                         "images (a resumed run could not train on it); set train.async_rollout=false")
    if cfg.agent.driver is not None:
        raise ValueError(f"agent.driver={cfg.agent.driver}: your own driver renders the prompts, and the rows' images "
                         "would not reach the model; use agent.environment / agent.tools (the built-in driver "
                         "shows a prompt's images), or drop the rows' images")
    if cfg.agent.enabled and cfg.agent.format == "raw":
        raise ValueError("agent.format=raw: raw-text prompts cannot show the rows' images; use a chat format "
                         "(agent.format=auto) or drop the rows' images")
    return True
