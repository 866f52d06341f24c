"""Backend-independent parts of a rollout: prompt encoding, special tokens, the generation context, and turning
raw sampled tokens into a `RolloutBatch` (EOS, stop strings, masks, texts)."""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from logitless.models.routing import no_route
from logitless.models.vision import ImageInputs

from .types import Prompt, RolloutBatch, RolloutTiming, SamplingOptions
from .vision import encode_with_images, has_blocks, is_processor, text_tokenizer


def unwrap_model(model: Any) -> Any:
    """The transformers model under a PEFT / compile wrapper (whose `generation_config` `generate` reads)."""
    seen = 0
    while seen < 8:
        seen += 1
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            break
    return model


def model_device(model: Any) -> torch.device:
    return next(model.parameters()).device


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether `a` and `b` are one device ("cuda" is the current CUDA device)."""
    def index(d: torch.device) -> int | None:
        return torch.cuda.current_device() if d.type == "cuda" and d.index is None else d.index

    return a.type == b.type and index(a) == index(b)


def context_window(model: Any) -> int | None:
    cfg = unwrap_model(model).config
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    return getattr(cfg, "max_position_embeddings", None)


_warned_pad: set[int] = set()


def resolve_special_tokens(model: Any, tokenizer: Any, options: SamplingOptions) -> tuple[int, list[int]]:
    """(pad id, EOS ids). EOS ids: options.eos_token_ids, else the model's generation config, else the
    tokenizer's. A tokenizer without a pad token pads with EOS (warned once per tokenizer)."""
    if options.eos_token_ids is not None:
        eos = list(options.eos_token_ids)
    else:
        gen_eos = getattr(getattr(unwrap_model(model), "generation_config", None), "eos_token_id", None)
        if gen_eos is None:
            gen_eos = tokenizer.eos_token_id
        eos = [] if gen_eos is None else ([gen_eos] if isinstance(gen_eos, int) else list(gen_eos))
    if not eos and not options.ignore_eos:
        raise ValueError(
            "SamplingOptions.eos_token_ids=None and neither the model's generation_config nor the tokenizer "
            "defines an EOS token: pass eos_token_ids=[...] or set ignore_eos=True"
        )
    pad = tokenizer.pad_token_id
    if pad is None:
        if not eos:
            raise ValueError("tokenizer has no pad token and no EOS token: set tokenizer.pad_token")
        pad = eos[0]
        if id(tokenizer) not in _warned_pad:
            _warned_pad.add(id(tokenizer))
            warnings.warn(f"tokenizer has no pad token; padding with the EOS id {pad}", stacklevel=3)
    return int(pad), [int(e) for e in eos]


def encode_prompts(
    tokenizer: Any, prompts: Sequence[Prompt], options: SamplingOptions, ctx: int | None,
    images: list[dict[str, torch.Tensor] | None] | None = None,
) -> list[list[int]]:
    """Token ids of each prompt (chat messages through the chat template with the generation prompt), with the
    length limit min(max_prompt_length, context window - max_new_tokens) enforced or left-truncated.

    `tokenizer` may be a vision-language model's processor: chat prompts with content blocks (images) then go
    through it (`vision.encode_with_images`), and `images` (a list) receives each prompt's image tensors (None for a
    prompt without images). A prompt with images is never truncated (that would cut an image's placeholders)."""
    processor = tokenizer if is_processor(tokenizer) else None
    tokenizer = text_tokenizer(tokenizer)
    if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of strings or of chat-message lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts=[] is empty: pass at least one prompt")
    limit = options.max_prompt_length
    if ctx is not None:
        room = ctx - options.max_new_tokens
        if room < 1:
            raise ValueError(
                f"SamplingOptions.max_new_tokens={options.max_new_tokens} leaves no room for a prompt in the "
                f"model's context window of {ctx} tokens: lower max_new_tokens"
            )
        limit = room if limit is None else min(limit, room)
    out = []
    for i, p in enumerate(prompts):
        tensors = None
        if has_blocks(p):
            if processor is None:
                raise ValueError(f"prompts[{i}] has content blocks (images) but the model has no processor: load a "
                                 "vision-language model (model.name_or_path) and its processor")
            try:
                ids, tensors = encode_with_images(processor, p, options.chat_template_kwargs)
            except (OSError, ValueError) as e:
                raise ValueError(f"prompts[{i}]: its images cannot be processed ({e})") from None
        elif isinstance(p, str):
            ids = tokenizer(p, add_special_tokens=True)["input_ids"]
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            ids = list(p)  # already token ids (e.g. a chat template rendered with tools by logitless.agents)
        elif isinstance(p, list) and all(isinstance(m, dict) and "role" in m for m in p):
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(
                    f"prompts[{i}] is a chat-message list but the tokenizer has no chat_template: set "
                    "tokenizer.chat_template (e.g. copy it from the instruct model's tokenizer) or pass raw text"
                )
            text = tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True,
                                                 **(options.chat_template_kwargs or {}))
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            raise TypeError(f"prompts[{i}] must be a string, a list of {{'role', 'content'}} dicts or a list of token "
                            f"ids, got {p!r:.80}")
        if len(ids) == 0:
            raise ValueError(f"prompts[{i}] encodes to zero tokens: pass a non-empty prompt")
        if limit is not None and len(ids) > limit:
            if not options.truncate_prompt or tensors is not None:
                raise ValueError(
                    f"prompts[{i}] has {len(ids)} tokens, over the limit of {limit} (max_prompt_length="
                    f"{options.max_prompt_length}, context window={ctx}, max_new_tokens={options.max_new_tokens}): "
                    + ("shorten it, lower max_new_tokens or use smaller images (a prompt with images is never "
                       "truncated)" if tensors is not None else
                       "shorten it, lower max_new_tokens, or set truncate_prompt=True to keep its last tokens")
                )
            ids = ids[-limit:]
        out.append(list(ids))
        if images is not None:
            images.append(tensors)
    return out


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, P] ids left-padded with pad_id, and the [n, P] mask."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def warn_greedy_duplicates(options: SamplingOptions) -> None:
    if options.temperature == 0 and options.num_generations > 1:
        warnings.warn(
            f"temperature=0 (greedy) with num_generations={options.num_generations}: every sample of a prompt is "
            "identical, so group advantages are all zero; use temperature > 0 for GRPO",
            stacklevel=3,
        )


@contextlib.contextmanager
def generation_mode(model: Any, parts: dict[str, float] | None = None,
                    held: Callable[[], bool] | None = None) -> Iterator[None]:
    """Eval mode, no grad, gradient checkpointing off, KV cache on; everything restored afterwards and freed
    memory handed back to the CUDA allocator so training does not pay for generation state.

    The release runs a full garbage collection (a reference cycle may hold the KV cache), unless `held` says that
    nothing the engine allocated is still alive: a full collection of a process holding compiled graphs takes a
    good part of a second (bench/LOG.md). parts: where to add the seconds of the release ("release_gc",
    "release_cache"), for a profile."""
    was_training = model.training
    gc_modules = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    base = unwrap_model(model)
    cfg = getattr(base, "config", None)
    use_cache = getattr(cfg, "use_cache", None)
    try:
        for m in gc_modules:
            m.gradient_checkpointing = False
        if cfg is not None and use_cache is not None:
            cfg.use_cache = True
        model.eval()
        with torch.no_grad():
            yield
    finally:
        for m in gc_modules:
            m.gradient_checkpointing = True
        if cfg is not None and use_cache is not None:
            cfg.use_cache = use_cache
        model.train(was_training)
        t0 = time.perf_counter()
        if held is None or held():
            gc.collect()
        t1 = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if parts is not None:
            parts["release_gc"] = parts.get("release_gc", 0.0) + t1 - t0
            parts["release_cache"] = parts.get("release_cache", 0.0) + time.perf_counter() - t1


def refuse_streams(options: SamplingOptions, backend: str) -> None:
    """Raise where a backend without per-row random streams is asked for `SamplingOptions.streams`."""
    if options.streams is not None:
        raise ValueError(f"SamplingOptions.streams (several calls' prompts decoded as one) needs per-row random "
                         f"streams, which backend {backend!r} does not have: use rollout.backend=static")


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Seed torch's CPU (and this CUDA device's) RNG for the block, restoring the outer RNG state after."""
    if seed is None:
        yield
        return
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stop_cut(tokenizer: Any, ids: list[int], stops: list[str]) -> int | None:
    """Smallest k such that decode(ids[:k]) contains a stop string, or None."""

    def hit(k: int) -> bool:
        text = tokenizer.decode(ids[:k], skip_special_tokens=False)
        return any(s in text for s in stops)

    if not ids or not hit(len(ids)):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if hit(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _cut_text(text: str, stops: list[str]) -> str:
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return text[: min(ends)] if ends else text


@dataclass
class PreparedPrompts:
    """What every backend computes before sampling: validated options, special tokens, encoded prompts."""

    options: SamplingOptions
    pad_id: int
    eos_ids: list[int]
    device: torch.device
    encoded: list[list[int]]  # token ids of each distinct prompt
    ids: torch.Tensor  # [n, P] left-padded, on `device`
    mask: torch.Tensor  # [n, P]
    context: int | None  # the model's context window
    t_start: float  # perf_counter() when the rollout began
    images: ImageInputs | None = None  # each distinct prompt's image tensors (a processor was given and some has)


def prepare_prompts(model: Any, tokenizer: Any, prompts: Sequence[Prompt], options: SamplingOptions) -> PreparedPrompts:
    """Validate the options, resolve pad/EOS ids, encode each distinct prompt once and left-pad: shared by all
    backends. `tokenizer` may be a vision-language model's processor (`encode_prompts`)."""
    t_start = time.perf_counter()
    options.validate()
    warn_greedy_duplicates(options)
    pad_id, eos_ids = resolve_special_tokens(model, text_tokenizer(tokenizer), options)
    device = model_device(model)
    context = context_window(model)
    tensors: list[dict[str, torch.Tensor] | None] = []
    encoded = encode_prompts(tokenizer, prompts, options, context, images=tensors)
    images = ImageInputs(tensors) if any(tensors) else None
    ids, mask = left_pad(encoded, pad_id, device)
    return PreparedPrompts(options, pad_id, eos_ids, device, encoded, ids, mask, context, t_start, images)


def build_batch(
    tokenizer: Any,
    prep: PreparedPrompts,
    raw_ids: torch.Tensor,  # [B, S] sampled tokens (anything after a row stopped is ignored)
    raw_logp: torch.Tensor,  # [B, S] sampler logprobs of raw_ids
    raw_len: torch.Tensor,  # [B] number of valid sampled tokens per row (<= S)
    generate_seconds: float,
    raw_routes: torch.Tensor | None = None,  # [B, P + S, layers, k] routes of prompt_ids + raw_ids (record_routes)
) -> RolloutBatch:
    """Apply EOS (unless ignore_eos) and stop strings, build masks/flags/texts: one definition for all backends.
    The prompts' image tensors (`prep.images`) go with each of their G rows (`RolloutBatch.images`).

    A row ends at its first EOS (kept, mask 1) or right after the token that completes the first stop string
    (kept; the text is cut right after the stop string). finished = ended by EOS or a stop string;
    truncated = produced max_new_tokens tokens without finishing."""
    options, pad_id, eos_ids = prep.options, prep.pad_id, prep.eos_ids
    prompt_ids, prompt_mask, t_start = prep.ids, prep.mask, prep.t_start
    G = options.num_generations
    B = raw_ids.shape[0]
    ids_cpu = raw_ids.detach().to("cpu", torch.long)
    lens = raw_len.detach().to("cpu", torch.long).clone()
    finished = torch.zeros(B, dtype=torch.bool)
    if not options.ignore_eos and eos_ids and ids_cpu.shape[1] > 0:
        pos = torch.arange(ids_cpu.shape[1])
        is_eos = torch.isin(ids_cpu, torch.tensor(eos_ids)) & (pos[None, :] < lens[:, None])  # [B, S]
        has = is_eos.any(1)
        first = torch.where(is_eos, pos[None, :], ids_cpu.shape[1]).min(1).values
        lens = torch.where(has, first + 1, lens)
        finished |= has
    rows = [ids_cpu[b, : int(lens[b])].tolist() for b in range(B)]
    stop_hit = [False] * B
    if options.stop:
        for b in range(B):
            k = _stop_cut(tokenizer, rows[b], options.stop)
            if k is not None:
                rows[b] = rows[b][:k]
                lens[b] = k
                finished[b] = True
                stop_hit[b] = True
    texts = tokenizer.batch_decode(rows, skip_special_tokens=True)
    if options.stop:
        texts = [_cut_text(t, options.stop) if hit else t for t, hit in zip(texts, stop_hit)]
    T = max(1, int(lens.max()))
    pos = torch.arange(T)
    mask = (pos[None, :] < lens[:, None]).long()  # [B, T]
    width = min(T, ids_cpu.shape[1])
    completion_ids = torch.full((B, T), pad_id, dtype=torch.long)
    completion_ids[:, :width] = ids_cpu[:, :width]
    completion_ids = torch.where(mask.bool(), completion_ids, pad_id)
    logp = torch.zeros((B, T), dtype=torch.float32)
    logp[:, :width] = raw_logp.detach().to("cpu", torch.float32)[:, :width]
    logp = logp * mask
    prompt_routes = completion_routes = None
    if raw_routes is not None:  # the sentinel outside the masks (padding, tokens cut by EOS or a stop)
        P, none = prompt_ids.shape[1], no_route(raw_routes.dtype)
        raw_routes = raw_routes.cpu()
        prompt_routes = raw_routes[:, :P].masked_fill(~prompt_mask.cpu().bool().repeat_interleave(G, 0)[..., None, None],
                                                      none)
        completion_routes = raw_routes.new_full((B, T, *raw_routes.shape[2:]), none)
        completion_routes[:, :width] = raw_routes[:, P : P + width]
        # a row's last token has no route: never fed forward, or fed only while other rows decoded on (which
        # varies with the wave, compaction and the loop's exit), and no logprob depends on it
        routed = pos[None, :] < (lens[:, None] - 1)  # [B, T]
        completion_routes.masked_fill_(~routed[..., None, None], none)
    truncated = ~finished & (lens >= options.max_new_tokens)
    num_tokens = int(mask.sum())
    seconds = time.perf_counter() - t_start
    return RolloutBatch(
        prompt_ids=prompt_ids.detach().cpu().repeat_interleave(G, 0),
        prompt_mask=prompt_mask.detach().cpu().repeat_interleave(G, 0),
        completion_ids=completion_ids,
        completion_mask=mask,
        sampler_logp=logp,
        finished=finished,
        truncated=truncated,
        prompt_index=torch.arange(prompt_ids.shape[0]).repeat_interleave(G),
        completions=texts,
        prompt_routes=prompt_routes,
        completion_routes=completion_routes,
        images=None if prep.images is None else prep.images.to("cpu").repeat_interleave(G),
        timing=RolloutTiming(
            seconds=seconds,
            num_tokens=num_tokens,
            tokens_per_s=num_tokens / max(seconds, 1e-9),
            generate_seconds=generate_seconds,
        ),
    )
