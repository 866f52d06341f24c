"""`logitless export RUN [--merged] [--push-to-hub REPO]`: a trained run as folders a serving stack loads directly.

    <output>/adapter/   (LoRA runs) the PEFT adapter (adapter_model.safetensors, adapter_config.json), its tokenizer
                        and a model card: `PeftModel.from_pretrained(base_model, "<output>/adapter")`
    <output>/merged/    (--merged, or any full fine-tuning run) the policy with its adapters merged into the weights,
                        as safetensors, with its tokenizer and a model card:
                        `AutoModelForCausalLM.from_pretrained("<output>/merged")`, vLLM, SGLang, TGI, ...

RUN is a run folder (its newest intact checkpoint), its checkpoints folder or one step folder; `--output` defaults
to `<run folder>/export`. The model card names the base model, the training settings and the run's last metrics.
`--push-to-hub REPO` uploads the merged folder (else the adapter folder) with `huggingface_hub`; it is refused
before any work when the hub cannot be used (HF_HUB_OFFLINE or no network) or no token is set.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from logitless.configlib import from_dict
from logitless.models.nf4_experts import dequantize_experts
from logitless.trainer import checkpoint as ckpt
from logitless.trainer.config.schema import TrainerConfig

HUB_PROBE_TIMEOUT_S = 10.0


@dataclass
class ExportResult:
    adapter: Path | None  # the PEFT adapter folder (LoRA runs)
    merged: Path | None  # the merged model folder (--merged, full fine-tuning)
    pushed: str | None = None  # the hub repository's URL


def check_hub(repo: str) -> None:
    """Refuse a push that cannot happen, in one line, before anything is loaded: offline mode, no token, or a hub
    that does not answer."""
    from huggingface_hub import constants, get_token

    if not repo.strip():
        raise ValueError("--push-to-hub needs a repository name, e.g. --push-to-hub me/qwen2.5-1.5b-grpo")
    offline = constants.is_offline_mode() or any(
        os.environ.get(f, "").lower() in ("1", "true", "yes") for f in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if offline:
        raise ValueError(f"--push-to-hub {repo}: the Hugging Face hub is switched off here (HF_HUB_OFFLINE); nothing "
                         "was exported. Unset HF_HUB_OFFLINE to push, or export without --push-to-hub and upload the "
                         "folder later (`hf upload REPO FOLDER`)")
    if get_token() is None:
        raise ValueError(f"--push-to-hub {repo}: no Hugging Face token (log in with `hf auth login` or set HF_TOKEN); "
                         "nothing was exported")
    import httpx

    try:
        httpx.get(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S)
    except httpx.HTTPError as e:
        raise ValueError(f"--push-to-hub {repo}: the Hugging Face hub ({constants.ENDPOINT}) cannot be reached "
                         f"({type(e).__name__}); nothing was exported. Export without --push-to-hub and upload the "
                         "folder when online (`hf upload REPO FOLDER`)") from None


def run_config(checkpoint: Path) -> TrainerConfig:
    """The config the checkpoint was trained with."""
    saved = ckpt.checkpoint_config(checkpoint)
    if saved is None:
        raise ValueError(f"{checkpoint} holds no config.yaml (nor does its run folder): cannot tell the base model")
    return from_dict(TrainerConfig, saved)


def load_policy(cfg: TrainerConfig, checkpoint: Path, device: str = "cpu") -> tuple[Any, Any]:
    """(the trained policy as the run computed it: base model + adapters or full weights, eval mode; its tokenizer)."""
    from logitless.trainer.policy.modeling import load_model_and_tokenizer, prepare_for_training

    model_cfg = dataclasses.replace(cfg.model, device=device, gradient_checkpointing=False, activation_offload=False,
                                    attn_implementation=None)
    model, tokenizer, _ = load_model_and_tokenizer(model_cfg, trainable=False)
    if cfg.model.lora:
        model = prepare_for_training(model, model_cfg)
    ckpt.load_model_weights(model, checkpoint / "model")
    return model.eval(), tokenizer


def gguf_source(cfg: TrainerConfig) -> str | None:
    """The GGUF file the run trained on (the demo's, a .gguf path, or model.gguf_file), else None."""
    from logitless.trainer.policy.modeling import DEMO_GGUF_FILE

    name = cfg.model.name_or_path
    if not name:
        return DEMO_GGUF_FILE
    if cfg.model.gguf_file:
        return Path(cfg.model.gguf_file).name
    return Path(name).name if name.endswith(".gguf") else None


def model_card(cfg: TrainerConfig, checkpoint: Path, merged: bool) -> str:
    """A model card (README.md with metadata) for the exported folder."""
    from huggingface_hub import ModelCard, ModelCardData

    from logitless.trainer.report.metrics import read_metrics
    from logitless.trainer.policy.modeling import DEMO_BASE_MODEL

    base = cfg.model.name_or_path or DEMO_BASE_MODEL
    step = ckpt.checkpoint_step(checkpoint)
    try:
        records = [r for r in read_metrics(checkpoint.parent.parent) if r.get("step", 0) <= step]
    except (FileNotFoundError, ValueError):
        records = []
    last: dict[str, Any] = {}
    for r in records:
        last.update({k: v for k, v in r.items() if isinstance(v, (int, float)) and not k.startswith(("time/", "memory/"))})
    shown = [k for k in ("reward/mean", "accuracy", "eval/accuracy", "completion/length_mean") if k in last]
    data = ModelCardData(library_name="transformers" if merged else "peft", base_model=base,
                         tags=["logitless", "grpo", "reinforcement-learning", *([] if merged else ["lora"])])
    o, t, r = cfg.objective, cfg.train, cfg.rollout
    gguf = gguf_source(cfg)
    lines = [
        "---", data.to_yaml(), "---", "",
        f"# {checkpoint.parent.parent.name}", "",
        f"`{base}` fine-tuned with reinforcement learning ({o.loss_type}, β = {o.beta}) by "
        "[logitless](https://pypi.org/project/logitless/)" + (" and merged into its weights." if merged else
                                                             ", as a LoRA adapter."),
        "",
        *([f"Trained on `{gguf}`, a GGUF quantization of `{base}` (dequantized when loaded): its weights differ from "
           f"`{base}`'s by the quantization, so the policy as trained is "
           + ("these merged weights." if merged else f"this adapter on the weights of `{gguf}`, and on `{base}` "
                                                     "itself a close approximation of it."), ""] if gguf else []),
        f"- steps: {step} (of train.max_steps = {t.max_steps}), {t.prompts_per_step} prompts × "
        f"{r.num_generations} samples each, up to {r.max_completion_length} new tokens",
        f"- data: `{cfg.data.task}`; rewards: {', '.join(f'`{f}`' for f in cfg.reward.reward_funcs)}",
        f"- LoRA: r = {cfg.model.lora_r}, alpha = {cfg.model.lora_alpha}" if cfg.model.lora else "- full fine-tuning",
        *([f"- last logged {', '.join(f'{k} = {last[k]:.4g}' for k in shown)}"] if shown else []),
        "",
        "```python",
        *(["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
           'model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO")',
           'tokenizer = AutoTokenizer.from_pretrained("PATH_OR_REPO")'] if merged else
          ["from peft import PeftModel", "from transformers import AutoModelForCausalLM", "",
           f'model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{base}"), "PATH_OR_REPO")']),
        "```", "",
    ]
    return str(ModelCard("\n".join(lines)))


def _fresh_folder(path: Path, made: list[Path]) -> Path:
    """Create `path` (recorded in `made`, to be removed if the export fails)."""
    if not path.exists():
        path.mkdir(parents=True)
        made.append(path)
    return path


def check_output(out: Path) -> None:
    """--output is a folder, or can be made one, that this process can write: checked before the model loads."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output {out} is a file; give a folder (the export writes adapter/ and merged/ into it)")
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output {out}: {existing} is not a writable folder; nothing was exported. Choose another "
                         "--output")


def dense(model: Any) -> Any:
    """`model` saveable as plain safetensors: a model loaded from a GGUF file and dequantized on load (the only
    way logitless trains one) is an ordinary dense model that still carries the GGUF quantizer, which
    `save_pretrained` refuses; the quantizer and its config entry are dropped. Weights kept in GGUF blocks are
    refused, naming the fix."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None or quantizer.quantization_config.quant_method != "gguf":
        return model
    if getattr(quantizer, "packed_modules", None):
        raise ValueError("the model keeps GGUF-quantized weights, which cannot be saved as safetensors; export the "
                         "adapter alone (without --merged)")
    model.hf_quantizer, model.is_quantized = None, False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def export_run(run: str | Path, *, output: str | Path | None = None, merged: bool = False,
               push_to_hub: str | None = None, private: bool = True) -> ExportResult:
    """Export the newest intact checkpoint of `run` (see the module docstring); returns the folders written."""
    from logitless.trainer.rundir import run_dir_of_checkpoint

    checkpoint = ckpt.resolve_checkpoint(run, flag="export")
    cfg = run_config(checkpoint)
    merged = merged or not cfg.model.lora
    out = Path(output) if output is not None else run_dir_of_checkpoint(checkpoint) / "export"
    check_output(out)
    for t in ([out / "adapter"] if cfg.model.lora else []) + ([out / "merged"] if merged else []):
        if t.exists() and (not t.is_dir() or any(t.iterdir())):  # before anything slow
            raise ValueError(f"--output {out}: {t} exists and is not empty; nothing was changed. Choose another "
                             "--output or delete it")
    if push_to_hub is not None:
        check_hub(push_to_hub)
    result = ExportResult(adapter=None, merged=None)
    model, tokenizer = load_policy(cfg, checkpoint)
    made: list[Path] = []  # folders this export created: removed if it fails, so a rerun is not refused
    try:
        if cfg.model.lora:
            folder = _fresh_folder(out / "adapter", made)
            for f in (checkpoint / "model").iterdir():
                shutil.copy2(f, folder / f.name)
            _base_in_adapter_config(folder, cfg)
            tokenizer.save_pretrained(folder)
            (folder / "README.md").write_text(model_card(cfg, checkpoint, merged=False))
            result.adapter = folder
        if merged:
            folder = _fresh_folder(out / "merged", made)
            plain = dense(model.merge_and_unload() if cfg.model.lora else model)
            dequantize_experts(plain)  # 4-bit expert stacks (QLoRA on a mixture of experts) saved as plain weights
            plain.save_pretrained(folder, safe_serialization=True)
            tokenizer.save_pretrained(folder)
            (folder / "README.md").write_text(model_card(cfg, checkpoint, merged=True))
            result.merged = folder
    except BaseException as e:
        for folder in reversed(made):
            shutil.rmtree(folder, ignore_errors=True)
        if isinstance(e, OSError):
            raise RuntimeError(f"export to {out} failed: {ckpt.failure_reason(e)} ({e.filename or out}); nothing "
                               "was left there. Free space or choose another --output") from None
        raise
    if push_to_hub is not None:
        from huggingface_hub import HfApi

        api = HfApi()
        url = api.create_repo(push_to_hub, private=private, exist_ok=True)
        api.upload_folder(repo_id=url.repo_id, folder_path=str(result.merged or result.adapter),
                          commit_message=f"logitless export of {checkpoint.parent.parent.name} step "
                                         f"{ckpt.checkpoint_step(checkpoint)}")
        result.pushed = str(url)
    return result


def _base_in_adapter_config(folder: Path, cfg: TrainerConfig) -> None:
    """adapter_config.json names the base model by its hub name or folder (the training process may have loaded it
    from a GGUF file or a path relative to the run)."""
    path = folder / "adapter_config.json"
    if not path.is_file():
        return
    conf = json.loads(path.read_text())
    conf["base_model_name_or_path"] = cfg.model.name_or_path or "HuggingFaceTB/SmolLM2-135M-Instruct"
    path.write_text(json.dumps(conf, indent=2))

