"""Prompts with images on the static engine (`static.py`): the prefill's image inputs and positions, each prompt's
first decode position, a draw that never picks an image placeholder, and what cannot take images yet.

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

from typing import Any

import torch
import torch.nn.functional as F

from logitless.models.lm_head import decoder_body
from logitless.models.vision import image_forward_inputs, is_vision_language

from .engine import PreparedPrompts, unwrap_model
from .sampling import StepSampler
from .vision import placeholder_tokens


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


def refuse_vision_episodes(model: Any) -> None:
    """Refuse multi-turn episodes of a vision-language model on the static engine: its turn-by-turn cache takes
    observations as token ids, without their images or M-RoPE positions."""
    if is_vision_language(unwrap_model(model)):
        raise ValueError("multi-turn episodes (agent.tools / agent.environment) on rollout.backend=static do not take "
                         "a vision-language model yet (observations are prefilled without images or M-RoPE "
                         "positions): set rollout.backend=hf")
