"""The decode state of the `static` engine (`static.py`): what every wave of a call shares (`DecodeCall`), the rows
a wave is decoding (`DecodeRows`, with compaction of finished rows), the rows' random-stream keys when several
calls' prompts decode as one batch (`stream_keys`), and how many shapes of the compiled step those row counts make
(`compiled_variants`, `allow_recompiles`).

Prompts with images (a vision-language model's; the rest of this module): the prefill's image inputs and
positions, each prompt's first decode position, a draw that never picks an image placeholder, and what cannot take
images yet.

- Prefill: the n distinct prompts run the model's own forward once, with their image tensors (`pixel_values`,
  `image_grid_thw`, ...), their token types and, for an M-RoPE model (Qwen2.5-VL, Qwen3-VL), the 3-row positions of
  the model's own `get_rope_index` (`models.vision.image_forward_inputs`: what the trainer's forward passes). The
  vision encoder thus runs once per prompt, and the prompt's keys/values serve its G rows as a text prompt's do.
  Gemma 3's token types make each image's tokens attend to each other both ways in this forward (and nowhere else:
  every later token is text).
- Decode: a row's positions continue after its prompt's. For an M-RoPE model the first completion token of a prompt
  sits at the prompt's largest position + 1 in all three rows (the model's `rope_deltas` plus the prompt's count of
  real tokens: `decode_start`), and every step adds one; the decode step passes these positions explicitly ([b, 1],
  which the model expands to its rows), never relying on the `rope_deltas` the model keeps between calls. Gemma 3
  decodes as text (positions = the count of real tokens, its causal and sliding-window masks).
- Placeholders: the draw never picks an image/video placeholder token (a completion holding one would need an
  image the trainer's forward does not have), and the recorded logprob stays that of the raw distribution
  (`types.py`), as the `hf` engine's `vision.BanPlaceholders` keeps it (`ban_placeholders`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from logitless.models.lm_head import decoder_body
from logitless.models.vision import image_forward_inputs, is_vision_language

from .engine import PreparedPrompts, unwrap_model
from .kv_cache import decode_cache, select_rows, set_visible
from .sampling import StepSampler, row_keys
from .types import SamplingOptions
from .vision import placeholder_tokens

MIN_COMPACT_ROWS = 8  # compact_finished never shrinks a wave below this many rows
RECOMPILE_MARGIN = 4  # compiled decode variants allowed beyond those one engine needs (other engines, eval)


def compiled_variants(rows: int, buckets: int, compact: bool) -> int:
    """Shapes the compiled decode step is compiled for: one per (row count, length bucket); compaction adds the
    powers of two from MIN_COMPACT_ROWS up to below `rows` (`DecodeRows.compacted`'s row counts)."""
    counts = 1 + (sum(1 for k in range(64) if MIN_COMPACT_ROWS <= 2**k < rows) if compact else 0)
    return counts * buckets


def allow_recompiles(variants: int) -> None:
    """Raise dynamo's recompile limit (8 by default) to `variants` + RECOMPILE_MARGIN when it is lower, never lower
    it: past the limit dynamo runs a new shape of the decode step eagerly, ~1000 kernel launches per token
    instead of one graph replay, without an error."""
    need = variants + RECOMPILE_MARGIN
    if torch._dynamo.config.recompile_limit < need:
        torch._dynamo.config.recompile_limit = need


@dataclass
class DecodeCall:
    """What every wave of one `generate` call shares."""

    prep: PreparedPrompts
    options: SamplingOptions
    cache_len: int  # L, slots per row in the decode cache
    prefill: Any  # DynamicCache of the n distinct prompts
    first_logits: torch.Tensor  # [n, V] fp32 logits of each prompt's first completion token
    keys: torch.Tensor  # [B] int64 random-stream key of each row
    codes: torch.Tensor  # [V] int64 hashed vocabulary indices
    filters: list  # repetition penalty / top-k / top-p / min-p processors (no temperature)
    eos: torch.Tensor  # [E] long EOS ids (empty with ignore_eos)
    parts: dict[str, float] = field(default_factory=dict)  # seconds per part of the step (profile=True)
    routing: Any = None  # `models.routing.MoERouting` of the decoding model when the call records routes
    prompt_routes: torch.Tensor | None = None  # [n, P, layers, k] the prompts' routes, recorded at their prefill
    limits: torch.Tensor | None = None  # [B] long tokens each row may draw (max_new_tokens, or `row_limits`)
    # [n] long position of each prompt's first completion token: its count of real tokens, or after an M-RoPE
    # model's image positions (`decode_start`); None: the count of real tokens
    start: torch.Tensor | None = None

    def start_positions(self) -> torch.Tensor:
        """[n] long: the position each prompt's first completion token decodes at (`start`)."""
        return self.prep.mask.sum(1) if self.start is None else self.start


@dataclass
class DecodeRows:
    """The rows a wave is decoding and their decode state; row i writes row `index[i]` of the wave's outputs."""

    index: torch.Tensor  # [b] long
    cache: Any  # static decode cache, b rows
    mask: torch.Tensor  # [b, L] attention mask over the cache slots
    next_pos: torch.Tensor  # [b, 1] position of the next token
    done: torch.Tensor  # [b] bool
    keys: torch.Tensor  # [b] random-stream keys
    logits: torch.Tensor  # [b, V] logits of the next token (the model's dtype; fp32 after the prefill)
    visible: int  # cache slots attention reads (a length bucket)

    @staticmethod
    def start(call: DecodeCall, src: torch.Tensor, keys: torch.Tensor, L: int) -> DecodeRows:
        """Rows whose prompts are `src` [b], with the prompts' keys/values copied into a fresh cache."""
        prep, S = call.prep, call.options.max_new_tokens
        P, device = prep.ids.shape[1], prep.device
        mask = torch.zeros((len(src), L), dtype=torch.long, device=device)
        mask[:, :P] = prep.mask[src]
        mask[:, P : P + S] = 1  # future slots are hidden by causality (query offset = cache length)
        return DecodeRows(torch.arange(len(src), device=device), decode_cache(call.prefill, src, L), mask,
                          call.start_positions()[src][:, None], torch.zeros(len(src), dtype=torch.bool, device=device), keys,
                          call.first_logits[src], L)

    def show(self, visible: int) -> None:
        if visible != self.visible:
            self.visible = visible
            set_visible(self.cache, visible)

    def visible_mask(self) -> torch.Tensor:
        return self.mask if self.visible == self.mask.shape[1] else self.mask[:, : self.visible]

    def compacted(self, token: torch.Tensor) -> tuple[DecodeRows, torch.Tensor]:
        """When at most half the rows are unfinished, the same decode over fewer rows: the unfinished ones, topped
        up with finished ones to a power of two (>= MIN_COMPACT_ROWS), so only a few row counts get a compiled
        graph. Returns (rows, their last tokens). Results do not change: finished rows only emit padding, and
        every row keeps its own random stream."""
        b = len(self.index)
        active = int((~self.done).sum())
        if b <= MIN_COMPACT_ROWS or active > b // 2:
            return self, token
        target = max(MIN_COMPACT_ROWS, 1 << max(active - 1, 0).bit_length())
        sel = torch.argsort(self.done.to(torch.int8), stable=True)[:target]  # unfinished rows first
        cache = select_rows(self.cache, sel)
        picked = DecodeRows(self.index[sel], cache, self.mask[sel], self.next_pos[sel], self.done[sel], self.keys[sel],
                            self.logits[sel], self.visible)
        return picked, token[sel]


def mark_stopped(live: DecodeRows, history: torch.Tensor, start: int, steps: int, stops: Sequence[str],
                 tokenizer: Any) -> bool:
    """Host check (one sync): mark rows whose text (`history[live.index, start : start + steps]`) contains one of
    `stops` as done; True if all rows are."""
    if stops:
        pending = (~live.done).nonzero().flatten().tolist()
        if pending:
            rows = history[live.index[pending], start : start + steps].tolist()
            texts = tokenizer.batch_decode(rows, skip_special_tokens=False)
            hit = [b for b, text in zip(pending, texts) if any(s in text for s in stops)]
            if hit:
                live.done[hit] = True
    return bool(live.done.all())


def stream_keys(streams: Sequence[tuple[int, int]], n: int, G: int, device: torch.device) -> torch.Tensor:
    """[n * G] random-stream keys of the rows of `n` prompts made of parts [(seed, prompts), ...] (in order): a
    part's rows get the keys a call of its prompts alone with its seed gives them (`SamplingOptions.streams`)."""
    if sum(count for _, count in streams) != n:
        raise ValueError(f"SamplingOptions.streams={list(streams)!r} count {sum(c for _, c in streams)} prompts, "
                         f"but the call has {n}")
    sample = torch.arange(G, device=device)
    return torch.cat([row_keys(seed, torch.arange(count, device=device).repeat_interleave(G), sample.repeat(count))
                      for seed, count in streams])


def decode_start(positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[n] long: the text position of each prompt's first completion token given the prompt's M-RoPE positions
    `positions` [3, n, P] (left padding, `mask` [n, P]): its largest position over its real tokens + 1, which is the
    model's `rope_deltas` (`get_rope_index`: max + 1 - real tokens) plus its real tokens. The trainer's
    `get_rope_index` over prompt + completion gives the completion's text tokens these positions on."""
    real = mask.bool()[None].expand_as(positions)
    return positions.masked_fill(~real, -1).amax(dim=(0, 2)) + 1


def prefill_inputs(module: Any, prep: PreparedPrompts
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
    """(position_ids, image inputs, start) of the prefill of the prompts of `prep`: positions [n, P] (the count of
    real tokens before each, as in the trainer's forward) or, for an M-RoPE model, [3, n, P] from its own
    `get_rope_index`; the keyword tensors of a vision-language model's forward beyond ids and mask (the prompts'
    image tensors and token types; {} for a text model); start: for an M-RoPE model [n] long, the position of each
    prompt's first completion token (`decode_start`), else None (its count of real tokens)."""
    positions = (prep.mask.cumsum(1) - 1).clamp(min=0)
    base = unwrap_model(module)
    if not is_vision_language(base):
        return positions, {}, None
    images = None if prep.images is None else prep.images.to(prep.device)  # (each prompt's tensors moved once)
    extra = image_forward_inputs(decoder_body(base), prep.ids, prep.mask, images)
    rope = extra.pop("position_ids", None)
    if rope is None:
        return positions, extra, None
    return rope, extra, decode_start(rope, prep.mask)


def ban_placeholders(draw: StepSampler, ban: torch.Tensor) -> StepSampler:
    """`draw` that never draws the tokens `ban` [k] (long, on the logits' device): it draws from the logits with
    those columns at -inf (the same Gumbel race over the other tokens), and returns the logprob of the drawn token
    under the raw logits: log_softmax(logits / T)[token] = logp' - softplus(lse(banned / T) - lse'), where logp' and
    lse' are the drawn token's logprob and the log-normalizer without the banned columns (lse' = z - logp', z the
    token's scaled logit). No host sync, so a captured decode step holds it."""

    def banned(logits: torch.Tensor, keys: torch.Tensor, step: Any, codes: torch.Tensor, temperature: float,
               greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        held = logits.index_select(1, ban).float() / temperature  # [b, k]
        masked = logits.index_fill(1, ban, float("-inf"))
        token, logp = draw(masked, keys, step, codes, temperature, greedy)
        z = masked.gather(1, token[:, None]).squeeze(1).float() / temperature
        return token, logp - F.softplus(torch.logsumexp(held, -1) - (z - logp))

    return banned


def placeholder_ban(model: Any, device: torch.device) -> torch.Tensor | None:
    """[k] long: the image/video placeholder ids of a vision-language `model` in its vocabulary, on `device`; None
    for a text model (nothing to ban)."""
    ids = placeholder_tokens(unwrap_model(model))
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


def refuse_split_vocabulary(model: Any) -> None:
    """Refuse a vision-language model whose logits are a shard of the vocabulary (a tensor-parallel lm_head): the
    placeholder ban is written for whole rows."""
    if is_vision_language(unwrap_model(model)):
        raise ValueError("rollout.tensor_parallel > 1 splits the vocabulary over the group, which the static engine "
                         "does not decode a vision-language model with yet: set rollout.tensor_parallel=1")


VISION_EPISODES_REFUSAL = (
    "rollout.backend=static does not run multi-turn episodes (agent.tools / agent.environment) of a vision-language "
    "model yet: it prefills each turn's observation as token ids, without image inputs or M-RoPE positions; set "
    "rollout.backend=hf")


def refuse_vision_episodes(model: Any) -> None:
    """Refuse multi-turn episodes of a vision-language model on the static engine: its turn-by-turn cache takes
    observations as token ids, without their images or M-RoPE positions."""
    if is_vision_language(unwrap_model(model)):
        raise ValueError(VISION_EPISODES_REFUSAL)
