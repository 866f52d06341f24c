"""Model and tokenizer loading (hub name, local folder or GGUF file), LoRA through peft, the reference policy."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import sys
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from logitless.models.compiled import EAGER_NUMERICS
from logitless.models.experts import (
    expert_modules,
    resolve_experts_implementation,
    set_experts_implementation,
)
from logitless.models.lm_head import decoder_layers
from logitless.models.nf4_experts import nf4_options_of, quantize_experts
from logitless.models.tiled_mlp import check_tileable, tile_mlps
from logitless.models.varlen import NAME as VARLEN_ATTENTION
from logitless.models.varlen import register as register_varlen_attention
from logitless.models.vision import is_vision_language, model_class, vision_modules
from logitless.rollout.weights import fresh_copy
from logitless.trainer.config.schema import ModelConfig
from logitless.trainer.policy.lora_targets import add_lora
from logitless.trainer.policy.sources import (  # noqa: F401 (re-exported: where the model comes from)
    DEMO_BASE_MODEL,
    DEMO_GGUF_FILE,
    DEMO_GGUF_PACKAGE,
    DEMO_INSTALL_HINT,
    demo_gguf,
    load_tokenizer,
    resolve_source,
)

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _fix_special_tokens(tok, model) -> None:
    """Make the tokenizer's EOS/pad agree with the model config.

    Tokenizers converted from GGUF metadata may carry a wrong EOS (SmolLM2's reads `<|im_start|>`); the GGUF's
    own `eos_token_id`, which transformers puts in the model config, is the one generation must stop on.
    """
    config = model.config.get_text_config(decoder=True)  # a vision-language model's ids are its text config's
    eos = getattr(config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    if isinstance(eos, int) and tok.eos_token_id != eos and eos < len(tok):
        tok.eos_token = tok.convert_ids_to_tokens(eos)
    if tok.pad_token is None:
        pad = getattr(config, "pad_token_id", None)
        tok.pad_token = tok.convert_ids_to_tokens(pad) if isinstance(pad, int) and pad < len(tok) else tok.eos_token
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tok.pad_token_id


def load_model_and_tokenizer(cfg: ModelConfig, *, trainable: bool = True, place: torch.device | None = None):
    """Load the causal LM (and tokenizer) named by `cfg`; wrap it with LoRA adapters when `cfg.lora`.

    Returns (model, tokenizer, device). With `trainable=False` no adapters are added (evaluation of a base model).
    place: where the weights are loaded, when not on `device` (train.fsdp_offload loads into host memory, in the
    dtype of `device`).
    """
    device = resolve_device(cfg.device)
    model = load_model(cfg, device, place)
    tok = load_tokenizer(cfg)
    _fix_special_tokens(tok, model)
    if trainable:
        model = prepare_for_training(model, cfg)
    return model, tok, device


def load_model(cfg: ModelConfig, device: torch.device, place: torch.device | None = None):
    """The causal LM named by `cfg` for `device` (an image-text-to-text model for a vision-language config): in
    `cfg.dtype`, or NF4 4-bit base weights when `cfg.load_in_4bit`; its weights on `place` when given, else on
    `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = resolve_dtype(cfg.dtype, device)
    source, gguf = resolve_source(cfg)
    kwargs = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code, "dtype": dtype}
    if gguf:
        kwargs["gguf_file"] = gguf
    # (4-bit: refuses a missing bitsandbytes before anything is read)
    quantization = nf4_config(device, dtype) if cfg.load_in_4bit else None
    auto = AutoModelForCausalLM if gguf else model_class(
        AutoConfig.from_pretrained(source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code))
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
        if cfg.attn_implementation == VARLEN_ATTENTION:
            register_varlen_attention()
    if quantization is not None:  # quantized while loading, straight onto the device (a 4-bit model cannot be moved after)
        index = "cpu" if device.type == "cpu" else device.index if device.index is not None else torch.cuda.current_device()
        kwargs.update(quantization_config=quantization, device_map={"": index})
        model = auto.from_pretrained(source, **kwargs)
        quantize_model_experts(model)
    else:
        model = auto.from_pretrained(source, **kwargs).to(place or device)
    impl = resolve_experts_implementation(cfg.experts_implementation, device, dtype)[0]
    if not set_experts_implementation(model, impl) and cfg.experts_implementation != "auto" and expert_modules(model):
        raise ValueError(f"model.experts_implementation={cfg.experts_implementation}: {type(model).__name__} runs its "
                         "experts with its own code (not transformers' experts backends); set "
                         "model.experts_implementation=auto")
    return model


def quantize_model_experts(model) -> int:
    """Store a 4-bit (QLoRA) mixture of experts' fused expert stacks in 4-bit too, as its linear layers are
    (`models.nf4_experts`: same quant type, block size and double quantization); returns the experts modules changed
    (0 for a dense model). bitsandbytes quantizes linear layers only, and the stacks are most of an MoE's bytes."""
    options = nf4_options_of(model)
    if options is None or not expert_modules(model):
        return 0
    return quantize_experts(model, options)


def no_router_logits(model: Any) -> Any:
    """`model` with a mixture of experts' output_router_logits off: the GRPO objective has no router load-balancing
    (aux) loss, so the forwards need not collect every layer's router logits (a checkpoint may switch it on; with
    it on, transformers' Qwen-MoE forward also fails on a one-token decode step with a longer attention mask)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "output_router_logits", False):
        cfg.output_router_logits = False
    return model


QLORA_INSTALL_HINT = "pip install 'logitless[qlora]'  (bitsandbytes)"


def require_cuda_package(package: str, setting: str, hint: str, device: torch.device) -> None:
    """Refuse `setting` on a non-CUDA device or without `package` installed, naming the fix."""
    if device.type != "cuda":
        raise ValueError(
            f"{setting} needs a CUDA GPU ({package}'s kernels), but the model is on {device}; "
            f"turn it off to train on {device.type}"
        )
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"{setting} needs the `{package}` package, which is not installed: {hint}")


def require_bitsandbytes(setting: str, device: torch.device) -> None:
    """Refuse `setting` (4-bit weights) on a device bitsandbytes has no 4-bit kernels for, or without the package:
    its CUDA kernels, or its torch CPU backend (bitsandbytes >= 0.48), which the CPU tests use."""
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"{setting} runs bitsandbytes' 4-bit kernels on a CUDA GPU or the CPU, but the model is on "
                         f"{device}; set model.device=cuda (or cpu)")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError(f"{setting} needs the `bitsandbytes` package, which is not installed: {QLORA_INSTALL_HINT}")


def nf4_config(device: torch.device, dtype: torch.dtype):
    """transformers' BitsAndBytesConfig of QLoRA: NF4 with double quantization, compute in `dtype`, lm_head
    left unquantized (the fused op reads its [V, H] weight). The expert stacks of a mixture of experts get the same
    quantization after loading (`quantize_model_experts`)."""
    from transformers import BitsAndBytesConfig

    require_bitsandbytes("model.load_in_4bit=true", device)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,  # 4-bit weights stored in a float dtype: shardable by FSDP2 like the rest
        llm_int8_skip_modules=["lm_head"],
    )


def prepare_for_training(model, cfg: ModelConfig):
    """Turn a mixture of experts' router logits off (`no_router_logits`), add LoRA adapters (peft) when `cfg.lora`,
    enable gradient checkpointing when asked, tile the MLPs
    (`model.mlp_chunk_tokens`), compile the layers. Settings still "auto" (decided per run by `trainer.auto.resolve`)
    count as off here.

    A 4-bit (QLoRA) model gets what peft's `prepare_model_for_kbit_training` does for it except the fp32 upcast
    of every non-quantized weight: that would double the embedding and lm_head memory and run the fused op's
    GEMMs in fp32; they stay in the compute dtype, as in LoRA on an unquantized model.
    """
    no_router_logits(model)
    freeze_vision(model, cfg)  # a vision-language model's tower keeps its weights unless model.train_vision
    if cfg.load_in_4bit and not getattr(model, "is_loaded_in_4bit", False):
        raise ValueError(
            "model.load_in_4bit=true but the given model is not 4-bit quantized; load it through logitless "
            "(model.name_or_path), or pass a model loaded with a 4-bit BitsAndBytesConfig"
        )
    if cfg.load_in_4bit:
        one_cpu_4bit_path(model)
    if isinstance(cfg.mlp_chunk_tokens, int):
        check_tileable(model, cfg.mlp_chunk_tokens)  # before anything is changed
    if cfg.liger_kernels is True:
        apply_liger_kernels(model)
    if cfg.gradient_checkpointing is True:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        if cfg.lora:
            model.enable_input_require_grads()
    if cfg.lora:
        base = adapter_base_name(model)
        model = add_lora(model, cfg)
        if base is not None:  # what adapter_config.json names as the adapter's base
            for adapter in model.peft_config.values():
                adapter.base_model_name_or_path = base
    if isinstance(cfg.mlp_chunk_tokens, int):
        tile_mlps(model, cfg.mlp_chunk_tokens)
    if cfg.compile_layers is True:
        compile_layers(model)
    return model


def one_cpu_4bit_path(model) -> None:
    """On a CPU with AVX512-BF16, bitsandbytes runs a 4-bit layer called in eval mode without gradients through
    another kernel, repacking its weight in place, with other roundings than the training path: the trainer's
    no-grad logprobs (and the rollout's) would differ from its own forward. Keep every layer on the one path."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def freeze_vision(model, cfg: ModelConfig) -> None:
    """With model.train_vision=false, the vision tower (and projector) of a vision-language model keep their weights:
    requires_grad off (full fine-tuning trains the language model and the lm_head only). No-op for a text model."""
    if cfg.train_vision or not is_vision_language(model):
        return
    for module in vision_modules(model):
        module.requires_grad_(False)


def adapter_base_name(model) -> str | None:
    """The base model a saved adapter should name (adapter_config.json `base_model_name_or_path`) when it is not
    the model's own name: for the embedded demo, the hub model its GGUF was converted from, which plain PEFT
    (`PeftModel.from_pretrained`) can load, instead of the wheel's folder that holds only the GGUF. The run's
    config.yaml keeps `model.name_or_path: ''`, so logitless itself (eval, --resume) loads the local GGUF offline."""
    loaded_from = getattr(model, "name_or_path", None)
    if not loaded_from:
        return None
    spec = importlib.util.find_spec(DEMO_GGUF_PACKAGE)
    folders = [Path(loc).resolve() for loc in (spec.submodule_search_locations or [])] if spec is not None else []
    return DEMO_BASE_MODEL if Path(loaded_from).resolve() in folders else None


def compile_layers(model) -> None:
    """`torch.compile` every decoder layer of `model` in place (`nn.Module.compile`, dynamic shapes). Gradient
    checkpointing wraps the compiled call, so the recompute runs the compiled graph too. Equivalent to the
    uncompiled model (same gradients to float rounding: inductor keeps eager's bf16 roundings, `models.compiled`)."""
    for layer in decoder_layers(model):
        layer.compile(dynamic=True, options=EAGER_NUMERICS)


LIGER_INSTALL_HINT = "pip install 'logitless[liger]'  (liger-kernel)"


def apply_liger_kernels(model) -> None:
    """Liger-Kernel's RMSNorm, SwiGLU (GeGLU) and RoPE kernels in `model`'s layers, through Liger's own
    `apply_liger_kernel_to_<model type>(model=...)`; the cross-entropy and fused-linear-cross-entropy patches stay
    off (they would replace the forward whose hidden states the fused op reads). The kernels run in eager
    forwards and backwards (the update, the `hf` rollout); a forward traced by torch.compile (the `static`
    engine's decode graph, which cannot trace Liger's Triton kernels) runs the transformers code instead
    (`outside_compile`). Models of the type built later in the process stay plain (copies of this one do not)."""
    setting = "model.liger_kernels=true"
    if importlib.util.find_spec("liger_kernel") is None:
        raise ImportError(f"{setting} needs the `liger_kernel` package, which is not installed: {LIGER_INSTALL_HINT}")
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        raise ValueError(f"{setting}: Liger-Kernel has no kernels for model type {model_type!r}; it supports "
                         f"{sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)}. Set model.liger_kernels=false for this model")
    require_cuda_package("liger_kernel", setting, LIGER_INSTALL_HINT, next(model.parameters()).device)
    wanted = dict(rope=True, rms_norm=True, swiglu=True, geglu=True, cross_entropy=False,
                  fused_linear_cross_entropy=False)
    params = inspect.signature(apply).parameters
    outside_compile(model, sys.modules[type(model).__module__],
                    lambda: apply(model=model, **{k: v for k, v in wanted.items() if k in params}))


def _eager_or_traced(self, *args, **kwargs):
    """A patched module's forward: the kernel's forward in eager mode, the module's own under torch.compile."""
    fn = self._plain_forward if torch.compiler.is_compiling() else self._kernel_forward
    return fn(self, *args, **kwargs)


def outside_compile(model, modeling, patch) -> None:
    """Run `patch()` (which rebinds `forward` of `model`'s modules and replaces names in the `modeling` module, as
    Liger's `apply_liger_kernel_to_*` does) so that what it patched runs only outside torch.compile:
    - a module whose forward it rebound gets a forward that dispatches on `torch.compiler.is_compiling()` (a
      bound method, so a deep copy of the model dispatches on its own weights);
    - a function it replaced in `modeling` gets the same dispatch, and runs the kernel on tensors of `model`'s device
      type only (every model of the type calls it, one on another device too);
    - a class it replaced in `modeling` is put back (models built later stay plain)."""
    before = {m: m.__dict__.get("forward") for m in model.modules()}
    names = dict(vars(modeling))
    device = next(model.parameters()).device.type
    patch()
    for m, old in before.items():
        new = m.__dict__.get("forward")
        if new is not None and new is not old:
            m._kernel_forward = new.__func__
            m._plain_forward = old.__func__ if old is not None else type(m).forward
            m.__dict__["forward"] = types.MethodType(_eager_or_traced, m)
    for name, new in list(vars(modeling).items()):
        old = names.get(name)
        if old is None or new is old:
            continue
        if isinstance(new, type):
            setattr(modeling, name, old)
        elif callable(new):
            setattr(modeling, name, functools.wraps(old)(
                lambda *a, _k=new, _o=old, **kw: (_k if _kernel_applies(a, kw, device) else _o)(*a, **kw)))


def _kernel_applies(args: tuple, kwargs: dict, device: str) -> bool:
    """Whether a patched module-level function (shared by every model of the type in the process) runs the kernel:
    outside torch.compile, on tensors of the patched model's device type (another model of the type, e.g. a reward
    model on the CPU, runs the plain function)."""
    if torch.compiler.is_compiling():
        return False
    first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None)
    return first is None or first.device.type == device


def lora_autocast_dtype(model, cfg: ModelConfig) -> torch.dtype | None:
    """The dtype the trainer's forwards autocast to for `cfg.lora_compute` (see ModelConfig), or None (no
    autocast: full fine-tuning, fp32 adapters, an fp32 model)."""
    if not cfg.lora or cfg.lora_compute == "fp32" or not is_peft_model(model):
        return None
    dtype = model.get_input_embeddings().weight.dtype  # the compute dtype (also of a 4-bit model)
    if dtype in (torch.bfloat16, torch.float16):
        return dtype
    if cfg.lora_compute == "autocast":
        raise ValueError(f"model.lora_compute=autocast computes the adapters in the model's dtype, which is "
                         f"{str(dtype).removeprefix('torch.')} "
                         "here; set model.dtype=bfloat16 (or float16), or model.lora_compute=auto")
    return None


class LoraCompute:
    """How the trainer's forwards run the LoRA adapters (`model.lora_compute`). With autocast, `stage()` wraps a
    stage's forwards and backwards and turns peft's cast of the LoRA input to the fp32 adapter dtype off (also
    while the backward recomputes checkpointed layers), and `forward()` wraps each forward in torch.autocast in
    the model's dtype (the recompute restores it): the adapter GEMMs, their [N, out] outputs and their backward
    run in bf16/fp16, the fp32 adapter weights stay the optimizer's masters. Otherwise both do nothing."""

    def __init__(self, model, cfg: ModelConfig):
        self.model, self.dtype = model, lora_autocast_dtype(model, cfg)
        self.device_type = model.get_input_embeddings().weight.device.type if self.dtype is not None else "cpu"

    def stage(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        from peft.helpers import disable_input_dtype_casting

        return disable_input_dtype_casting(self.model)

    def forward(self):
        return torch.autocast(self.device_type, dtype=self.dtype) if self.dtype is not None else contextlib.nullcontext()


@contextmanager
def attention_backends(cfg: ModelConfig) -> Iterator[None]:
    """torch's sdpa backends for the length of a run: cuDNN's attention off unless `model.cudnn_attention`.

    cuDNN's sdpa builds a graph for each new (rows, columns) shape (0.1-3 s on an H200, `bench/LOG.md`), and the
    trainer's micro-batches and the rollout's prefills change shape nearly every call; flash and memory-efficient
    attention, which sdpa picks instead, have no per-shape cost. The previous setting is restored on exit.
    """
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(before and cfg.cudnn_attention)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class ReferencePolicy:
    """The frozen initial policy for the KL term (`objective.beta > 0`).

    For a LoRA model it is the same model with its adapters disabled (no second copy in memory); for full
    fine-tuning it is a frozen deep copy taken at construction.
    """

    def __init__(self, model, device: torch.device | None = None):
        self._copy = None
        if not is_peft_model(model):  # on `device` (None: the model's)
            self._copy = fresh_copy(model).eval().requires_grad_(False).to(device)

    @contextmanager
    def use(self, model) -> Iterator[torch.nn.Module]:
        """Context giving the module that computes reference log-probs."""
        if self._copy is not None:
            yield self._copy
        else:
            with model.disable_adapter():
                yield model


@torch.no_grad()
def check_packed_attention(model) -> None:
    """Refuse `train.packed=true` for a model whose attention does not keep packed rows apart.

    Runs two short rows padded and packed (one sequence, position_ids restarting per row) and compares the
    completion logprobs: transformers' packed-sequence masks (sdpa, eager, flex_attention) and varlen flash
    attention give the same values; an attention path that ignores the row boundaries does not.
    """
    from logitless.models import completion_logprobs, lm_head_of

    weight = lm_head_of(model).weight
    device, vocab = weight.device, weight.shape[0]
    ids = torch.randint(0, min(vocab, 1000), (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    was_training = model.training
    model.eval()
    try:
        args = (model, ids[:, :4], mask[:, :4], ids[:, 4:], mask[:, 4:])
        padded, packed = completion_logprobs(*args)[0], completion_logprobs(*args, packed=True)[0]
    finally:
        model.train(was_training)
    tol = 1e-3 if weight.dtype == torch.float32 else 5e-2
    if not torch.allclose(padded, packed, atol=tol, rtol=0):
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        raise ValueError(
            f"train.packed=true: this model's attention (attn_implementation={impl!r}) mixes packed rows (logprobs "
            f"differ by {float((padded - packed).abs().max()):.3g} from the padded forward). Set "
            f"model.attn_implementation to {VARLEN_ATTENTION}, flash_attention_2, flex_attention or sdpa, or set "
            "train.packed=false"
        )
