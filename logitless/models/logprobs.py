"""Per-token completion logprobs of a causal LM through the fused op, and completion-position gather/scatter."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor, nn

from logitless.models.lm_head import decoder_body, final_hidden_states, lm_head_of, position_ids_from_mask
from logitless.models.routing import no_route, routing_of, routing_scope
from logitless.models.varlen import NAME as VARLEN, packed_kwargs
from logitless.models.vision import ImageInputs, encode_once, image_forward_inputs, is_vision_language, packing_refusal
from logitless.ops import token_logprobs


def _check_mask(mask: Tensor, shape: tuple[int, ...], name: str, of: str) -> Tensor:
    if not isinstance(mask, Tensor) or mask.dim() != 2 or tuple(mask.shape) != tuple(shape[:2]):
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(
            f"{name} must be a [B, L] tensor matching the first two dims {tuple(shape[:2])} of {of}, got {got}"
        )
    if mask.is_floating_point() or mask.is_complex():
        raise ValueError(f"{name} must be bool or integer (0/1), got dtype {mask.dtype}")
    return mask.bool()


def gather_positions(x: Tensor, mask: Tensor) -> Tensor:  # x [B, L, ...], mask [B, L] -> [N, ...]
    """The rows of `x` where `mask` is set, in row-major order: equivalent to `x[mask.bool()]`."""
    return x[_check_mask(mask, tuple(x.shape), "mask", "x")]


def scatter_positions(values: Tensor, mask: Tensor, fill: float = 0.0) -> Tensor:  # [N, ...] -> [B, L, ...]
    """Inverse of `gather_positions`: `out = full([B, L, ...], fill); out[mask] = values` (differentiable)."""
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        raise ValueError(f"mask must be a [B, L] tensor, got {getattr(mask, 'shape', type(mask).__name__)}")
    m = _check_mask(mask, tuple(mask.shape), "mask", "mask")
    n = int(m.sum())
    if values.dim() < 1 or values.shape[0] != n:
        raise ValueError(
            f"values has {values.shape[0] if values.dim() else 'no'} rows but mask has {n} set positions; "
            "pass the output of gather_positions with the same mask"
        )
    out = values.new_full((*m.shape, *values.shape[1:]), fill)
    return out.index_put((m,), values)


def completion_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,  # [B, P] left-padded
    prompt_mask: Tensor,  # [B, P]
    completion_ids: Tensor,  # [B, T] right-padded
    completion_mask: Tensor,  # [B, T] 1 up to and including EOS
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    grad_hint: Tensor | None = None,  # [B, T] expected d loss / d logp (see `token_logprobs`)
    packed: bool = False,
    logp_mask: Tensor | None = None,  # [B, T] the completion positions to compute (within completion_mask)
    prompt_routes: Tensor | None = None,  # [B, P, layers, k] recorded MoE routes of prompt_ids (`models/routing.py`)
    completion_routes: Tensor | None = None,  # [B, T, layers, k] of completion_ids
    replay: bool = True,  # with routes: use them (else only measure the model's own routing against them)
    images: ImageInputs | None = None,  # a vision-language model's image tensors of the B rows (the rollout's)
) -> tuple[Tensor, Tensor | None]:  # logp [B, T] fp32 (0 at padding), entropy [B, T] fp32 or None
    """Log-probability (and entropy) of each completion token under `model` at `temperature`.

    Equivalent to (but never materializing the [B, L, V] logits):

        ids, mask = cat([prompt_ids, completion_ids], 1), cat([prompt_mask, completion_mask], 1)
        logits = model(ids, mask, position_ids=cumsum(mask) - 1).logits.float()   # [B, P+T, V]
        logp_all = log_softmax(logits[:, P-1 : P+T-1] / temperature, -1)          # [B, T, V]
        logp = logp_all.gather(-1, completion_ids[..., None])[..., 0] * completion_mask

    The hidden state that predicts completion token 0 is the last real prompt token (position P-1 for the
    usual left-padded prompts; right-padded prompts work too). Only the N = completion_mask.sum() completion
    positions go through one call of the fused op. Runs under the caller's grad mode (wrap in
    `torch.no_grad()` for the old/reference policy). `grad_hint` (e.g. from
    `logitless.objectives.on_policy_logp_grad`) is passed on to the fused op for its completion positions.

    `packed=True` runs the model padding-free: the real tokens of all rows concatenated into one [1, S]
    sequence with position_ids restarting at 0 for each row and no attention mask, which transformers'
    packed-sequence attention turns into per-row causal attention (varlen flash attention, a flex document
    mask, or a block-diagonal mask for sdpa/eager). Same result as the padded forward, without the padding.

    With `prompt_routes` and `completion_routes` (a mixture-of-experts model, `models/routing.py`) every MoE layer
    routes each token to its recorded experts (`replay`; tokens with the sentinel route and padding route on their
    own), the weights recomputed from the live router; `routing_of(model).stats` then holds the tokens whose own
    top-k differs. The routes stay set until the outermost `routing_scope(model)` ends: run the backward inside one so
    a gradient-checkpoint recompute replays them too. Without routes a MoE model routes on its own.

    A vision-language model's forward also takes `images` (the processor's tensors of each row, `models/vision.py`),
    the token types of the placeholders and, for M-RoPE, the model's own `get_rope_index` positions of the rows as
    padded; the image placeholders are prompt tokens, so they are context and never scored. Rows that share their
    image tensors (a prompt's samples) run the vision encoder once (`vision.encode_once`). Packed, each
    row keeps its own M-RoPE positions (`get_rope_index` of the row, after a text row that restarts at 0 per row:
    transformers' 4-row form); a model without M-RoPE whose image tokens attend both ways (Gemma 3) is refused.
    """
    if not isinstance(prompt_ids, Tensor) or prompt_ids.dim() != 2 or prompt_ids.shape[1] < 1:
        raise ValueError(f"prompt_ids must be a [B, P] tensor with P >= 1, got {getattr(prompt_ids, 'shape', None)}")
    if not isinstance(completion_ids, Tensor) or completion_ids.dim() != 2:
        raise ValueError(f"completion_ids must be a [B, T] tensor, got {getattr(completion_ids, 'shape', None)}")
    if completion_ids.shape[0] != prompt_ids.shape[0]:
        raise ValueError(
            f"prompt_ids has B={prompt_ids.shape[0]} rows but completion_ids has {completion_ids.shape[0]}"
        )
    pmask = _check_mask(prompt_mask, tuple(prompt_ids.shape), "prompt_mask", "prompt_ids")
    cmask = _check_mask(completion_mask, tuple(completion_ids.shape), "completion_mask", "completion_ids")
    tmask = cmask
    if logp_mask is not None and logp_mask is not completion_mask:
        tmask = _check_mask(logp_mask, tuple(completion_ids.shape), "logp_mask", "completion_ids")
        if bool((tmask & ~cmask).any()):
            raise ValueError("logp_mask selects positions outside completion_mask: pass a subset of the completion "
                             "tokens (e.g. completion_mask & ~env_mask)")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    (B, P), T = prompt_ids.shape, completion_ids.shape[1]
    device = prompt_ids.device
    if grad_hint is not None and (not isinstance(grad_hint, Tensor) or tuple(grad_hint.shape) != (B, T)):
        raise ValueError(f"grad_hint must be a [B, T] = [{B}, {T}] tensor like completion_ids, got "
                         f"{list(getattr(grad_hint, 'shape', [])) or type(grad_hint).__name__}")

    # Hidden state that predicts completion token t: position P+t-1 for t >= 1, the last real prompt token for t = 0.
    last_prompt = (torch.arange(P, device=device) * pmask).amax(1)  # [B]
    has_prompt = pmask.any(1)  # [B]
    holes = (cmask[:, 1:] & ~cmask[:, :-1]).any(1) if T > 1 else torch.zeros_like(has_prompt)  # [B]
    bad = (cmask.any(1) & ~has_prompt) | holes
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"row {row}: every row with completion tokens needs at least one prompt token (prompt_mask), and "
            "completion_mask must be right-padded (1s then 0s); got "
            f"prompt_mask={pmask[row].int().tolist()} completion_mask={cmask[row].int().tolist()}"
        )

    head = lm_head_of(model)
    input_ids = torch.cat([prompt_ids, completion_ids], 1)  # [B, L]
    attention_mask = torch.cat([pmask, cmask], 1)  # [B, L]
    routing = routing_of(model)
    routes = None
    if (prompt_routes is None) != (completion_routes is None):
        raise ValueError("pass prompt_routes and completion_routes together (both recorded by the rollout), or neither")
    if prompt_routes is not None:
        if routing is None:
            raise ValueError("prompt_routes/completion_routes were given but the model has no supported MoE router")
        if tuple(prompt_routes.shape[:2]) != (B, P) or tuple(completion_routes.shape[:2]) != (B, T):
            raise ValueError(f"prompt_routes {tuple(prompt_routes.shape)} and completion_routes "
                             f"{tuple(completion_routes.shape)} must start with [B, P] = [{B}, {P}] and [B, T] = "
                             f"[{B}, {T}] like prompt_ids and completion_ids")
        routes = torch.cat([prompt_routes, completion_routes], 1).to(device)  # [B, L, layers, k]
        routes = routes.masked_fill(~attention_mask[..., None, None], no_route(routes.dtype))
    vision = is_vision_language(model)
    refusal = packing_refusal(decoder_body(model)) if packed and vision else None
    if refusal is not None:
        raise ValueError(f"packed=True (train.packed) is not supported for this model yet: {refusal}")
    with routing_scope(model) if routing is not None else contextlib.nullcontext():
        if packed:
            rows_images = (images if images is not None else ImageInputs([None] * B)) if vision else None
            hidden, flat = _packed_hidden(model, input_ids, attention_mask, P, routes, replay,
                                          rows_images)  # [1, S, H], [N]
            if tmask is not cmask:
                flat = flat[tmask[cmask]]  # [n] of the N completion tokens
        else:
            if routing is not None:
                routing.set_forward(None if routes is None else routes.flatten(0, 1), replay, attention_mask.flatten())
            body = decoder_body(model)
            extra = image_forward_inputs(body, input_ids, attention_mask, images) if vision or \
                images is not None else {}
            with encode_once(body, images, extra.get("pixel_values")):  # rows of one prompt: its images once
                hidden = final_hidden_states(model, input_ids, attention_mask.long(), extra.pop("position_ids", None),
                                             **extra)  # [B, L, H]
            L = hidden.shape[1]
            src = (P - 1 + torch.arange(T, device=device)).expand(B, T).clone()  # [B, T]
            src[:, 0] = last_prompt
            flat = (torch.arange(B, device=device)[:, None] * L + src)[tmask]  # [n]
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat)  # [n, H]
    if h.dtype != head.weight.dtype:
        h = h.to(head.weight.dtype)
    targets = completion_ids[tmask]  # [n]
    logp, entropy = token_logprobs(
        h,
        head.weight,
        targets,
        bias=head.bias,
        temperature=temperature / head.logit_multiplier,
        with_entropy=with_entropy,
        grad_hint=None if grad_hint is None else grad_hint.detach()[tmask].float(),
    )
    logp = scatter_positions(logp.float(), tmask)
    if entropy is not None:
        entropy = scatter_positions(entropy.float(), tmask)
    return logp, entropy


def _packed_hidden(model: nn.Module, input_ids: Tensor, mask: Tensor, P: int, routes: Tensor | None = None,
                   replay: bool = True, images: ImageInputs | None = None) -> tuple[Tensor, Tensor]:
    """Final hidden states of the rows' real tokens packed into one sequence, and the packed index of the hidden
    state that predicts each completion token.

    input_ids, mask: [B, L] (L = P + T; a row's real tokens, prompt then completion, in column order). routes:
    [B, L, layers, k] MoE routes of those tokens, packed alike (see `completion_logprobs`). images: a
    vision-language (M-RoPE) model's image tensors of the B rows; the packed positions are then [4, 1, S]: the text
    positions (0.. per row, which delimit the rows) over each row's own M-RoPE positions, packed alike.
    Returns hidden [1, S, H] (S = real tokens of the rows with completion tokens) and flat [N] (N = completion
    tokens), row-major like `mask[:, P:]`.
    """
    keep = mask[:, P:].any(1)  # [B] rows without completion tokens add nothing: left out
    mask = mask & keep[:, None]
    packed_ids = input_ids[mask].unsqueeze(0)  # [1, S]
    position_ids = position_ids_from_mask(mask)[mask].unsqueeze(0)  # [1, S], 0.. per row
    lengths = mask.sum(1)  # [B]
    body = decoder_body(model)
    varlen = getattr(body.config, "_attn_implementation", None) == VARLEN
    extra = packed_kwargs(lengths[lengths > 0]) if varlen else {}  # row boundaries once, not per layer
    if images is not None:  # the kept rows' image tensors, token types and M-RoPE positions, as padded, then packed
        images = images.select(keep.nonzero()[:, 0])
        vision = image_forward_inputs(body, input_ids[keep], mask[keep], images)
        rope = vision.pop("position_ids")[:, mask[keep]]  # [3, S]
        position_ids = torch.cat([position_ids, rope], 0).unsqueeze(1)  # [4, 1, S]
        extra.update({k: v[mask[keep]].unsqueeze(0) if k.endswith("type_ids") else v for k, v in vision.items()})
    routing = routing_of(model)
    if routing is not None:
        routing.set_forward(None if routes is None else routes[mask], replay)
    with encode_once(body, images, extra.get("pixel_values")):  # rows of one prompt: its images once
        hidden = final_hidden_states(model, packed_ids, None, position_ids, **extra)  # [1, S, H]
    index = mask.flatten().long().cumsum(0).view(mask.shape) - 1  # [B, L] packed index of each real token
    # A completion token is predicted by the real token just before it in its row, which is packed right before it.
    flat = index[:, P:][mask[:, P:]] - 1  # [N]
    return hidden, flat
