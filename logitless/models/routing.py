"""Routing record and replay for mixture-of-experts models (R3: the trainer's forwards use the rollout's experts).

Every supported family's MoE block calls its router module, which returns `(router_logits [N, E], weights [N, k],
indices [N, k])` for the block's N tokens (the batch's tokens in row-major order). A forward hook on each router
(installed once, `routing_of`) does what the model's `MoERouting.mode` says:

- "off": nothing (the model's own routing).
- "record": write the router's indices into `MoERouting.sink` (a `RouteSink`), one slot per MoE layer.
- "replay": use `MoERouting.routes[:, slot]` as the indices, and recompute the weights over those experts from the
  live router logits with the family's own rule (`RULES`), so the router still gets a gradient; tokens whose route
  is the sentinel (`NO_ROUTE`: padding, the last sampled token) keep the router's own choice.
- "compare": the model's own routing, only measured against `routes`.

In "replay" and "compare" the hook also stores, per layer, how many tokens' own top-k differs as a set from their
route (`MoERouting.stats`, assigned per forward, never accumulated, so a gradient-checkpoint recompute leaves it
unchanged). While `MoERouting.balance` is a dict (`collect_balance`), the hook also stores each layer's
load-balancing loss in it (`balance_loss`, over the experts the forward used: replayed or its own). The lookup is by
layer slot over the forward's tokens, with no state advanced by a call: the forward and
its checkpoint recompute read the same routes while the routes stay set (`routing_scope`).

Routes are stored compact, [tokens, moe_layers, k]: uint8 (sentinel 255) for models with at most 255 experts,
int16 (sentinel -1) otherwise. Slot i is the i-th MoE layer in module order (dense layers have no slot).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn


def _softmax_gather(always_renorm: bool, cast_back: bool) -> Callable[[nn.Module, Tensor, Tensor], Tensor]:
    """Qwen2/Qwen3-MoE, OLMoE (renormalised if the router's norm_topk_prob, cast back to the logits' dtype), Mixtral
    (always renormalised, fp32): the fp32 softmax over all experts gathered at the chosen ones."""

    def weights(router: nn.Module, logits: Tensor, idx: Tensor) -> Tensor:
        w = torch.softmax(logits.float(), dim=-1).gather(1, idx)
        if always_renorm or router.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(logits.dtype) if cast_back else w

    return weights


def _gpt_oss(router: nn.Module, logits: Tensor, idx: Tensor) -> Tensor:
    """GPT-OSS: softmax over the k gathered logits (in their dtype)."""
    top = logits.gather(1, idx)
    return torch.softmax(top, dim=1, dtype=top.dtype)


def _deepseek_v3(router: nn.Module, logits: Tensor, idx: Tensor) -> Tensor:
    """DeepSeek-V3: the unbiased sigmoid scores gathered (the correction bias and group limit only select),
    normalised if norm_topk_prob, times routed_scaling_factor."""
    w = logits.sigmoid().gather(1, idx)
    if router.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


# router class name -> the weights its forward gives the experts in `idx` [N, k] from its logits [N, E]
RULES: dict[str, Callable[[nn.Module, Tensor, Tensor], Tensor]] = {
    "Qwen3MoeTopKRouter": _softmax_gather(False, True),
    "Qwen2MoeTopKRouter": _softmax_gather(False, True),
    "OlmoeTopKRouter": _softmax_gather(False, True),
    "MixtralTopKRouter": _softmax_gather(True, False),
    "GptOssTopKRouter": _gpt_oss,
    "DeepseekV3TopkRouter": _deepseek_v3,
}


def rule_of(module: nn.Module) -> Callable[[nn.Module, Tensor, Tensor], Tensor] | None:
    """The weight rule of a supported router module (by its class or a base class: torch's parametrization, e.g. a
    LoRA on the router weight, subclasses it), else None."""
    return next((RULES[c.__name__] for c in type(module).__mro__ if c.__name__ in RULES), None)


# config fields that mark a mixture-of-experts model (for the error on an unsupported one)
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def route_dtype(num_experts: int) -> torch.dtype:
    """The compact dtype of routes for a model with `num_experts` experts (one value left for the sentinel)."""
    return torch.uint8 if num_experts <= 255 else torch.int16


def no_route(dtype: torch.dtype) -> int:
    """The sentinel of a route that was never recorded (padding, the last sampled token)."""
    return 255 if dtype == torch.uint8 else -1


class UnsupportedRoutingError(ValueError):
    """A mixture-of-experts model whose routers have no record/replay hook here."""


@dataclass
class RouteSink:
    """Where "record" writes: buffer [R, S, layers, k] (compact), row `rows[i]` of column `step` for the forward's
    token i. `step` is a 0-d long tensor on the buffer's device (a decode step counter read inside the forward, so
    a captured step needs no host sync); rows [N] long (default: 0..N-1)."""

    buffer: Tensor
    step: Tensor
    rows: Tensor | None = None

    def write(self, slot: int, idx: Tensor) -> None:
        rows = self.rows if self.rows is not None else torch.arange(idx.shape[0], device=idx.device)
        self.buffer[:, :, slot].index_put_((rows, self.step.expand(rows.shape[0])), idx.to(self.buffer.dtype))


@dataclass
class ForwardLog:
    """Where "record" writes when every forward's routes are kept (transformers' `generate`): one [N, layers, k]
    tensor per forward, in call order."""

    layers: int
    dtype: torch.dtype
    forwards: list[Tensor] = field(default_factory=list)

    def write(self, slot: int, idx: Tensor) -> None:
        if slot == 0:
            self.forwards.append(torch.full((idx.shape[0], self.layers, idx.shape[1]), no_route(self.dtype),
                                            dtype=self.dtype, device=idx.device))
        self.forwards[-1][:, slot] = idx.to(self.dtype)


@dataclass
class MoERouting:
    """The routers of one model (in layer order) and what their hooks do now (see the module docstring)."""

    routers: list[nn.Module]
    num_experts: int
    top_k: int
    mode: str = "off"
    routes: Tensor | None = None  # [N, layers, k] of the forward's N tokens ("replay", "compare")
    sink: Any = None  # RouteSink or ForwardLog ("record")
    stats: Tensor | None = None  # [layers, 2] fp64: (tokens whose own top-k differs from the route, tokens routed)
    depth: int = 0  # open `routing_scope`s
    token_mask: Tensor | None = None  # [N] bool: the forward's real tokens (None: all of them, e.g. packed)
    balance: dict[int, Tensor] | None = None  # MoE layer slot -> its load-balancing loss (0-d), while collected

    @property
    def layers(self) -> int:
        return len(self.routers)

    @property
    def dtype(self) -> torch.dtype:
        return route_dtype(self.num_experts)

    def empty(self, *shape: int, device: torch.device | str = "cpu") -> Tensor:
        """A [*shape, layers, k] route tensor filled with the sentinel."""
        return torch.full((*shape, self.layers, self.top_k), no_route(self.dtype), dtype=self.dtype, device=device)

    def set_forward(self, routes: Tensor | None, replay: bool, token_mask: Tensor | None = None) -> None:
        """The next forwards' routes [N, layers, k] (None: the model's own routing), replayed or compared, and
        which of their N tokens are real (`token_mask` [N] bool; None: all)."""
        if routes is not None and (routes.dim() != 3 or tuple(routes.shape[1:]) != (self.layers, self.top_k)):
            raise ValueError(f"routes must be [tokens, {self.layers} MoE layers, k={self.top_k}], got "
                             f"{tuple(routes.shape)}: were they recorded from this model?")
        self.mode = "off" if routes is None else "replay" if replay else "compare"
        self.routes = routes
        self.token_mask = token_mask
        self.stats = None if routes is None else torch.zeros((self.layers, 2), dtype=torch.float64,
                                                             device=routes.device)


def balance_loss(logits: Tensor, idx: Tensor, num_experts: int, mask: Tensor | None = None) -> Tensor:
    """The Switch Transformer load-balancing loss of one MoE layer (transformers' `load_balancing_loss_func` for one
    layer): E * sum_e f_e * P_e, with f_e the mean over the real tokens of how many of their k experts are e and P_e
    their mean router probability of e (softmax over all experts, fp32). 1 for uniform routing at k = 1; gradient
    flows through P only. logits [N, E], idx [N, k], mask [N] bool (None: every token). No host sync."""
    probs = torch.softmax(logits.float(), dim=-1)  # [N, E]
    m = probs.new_ones(probs.shape[0]) if mask is None else mask.to(probs.dtype)  # [N]
    n = m.sum().clamp(min=1.0)
    counts = probs.new_zeros(num_experts).index_add_(0, idx.long().flatten(), m.repeat_interleave(idx.shape[1]))
    return num_experts * ((counts / n) * ((probs * m[:, None]).sum(0) / n)).sum()


def _router_hook(module: nn.Module, args: Any, output: tuple[Tensor, Tensor, Tensor]) -> Any:
    """The forward hook of every supported router (see the module docstring)."""
    state, slot = module._logitless_routing
    if state.mode == "off":
        if state.balance is not None:
            state.balance[slot] = balance_loss(output[0], output[2], state.num_experts, state.token_mask)
        return None
    logits, _, idx = output
    if state.mode == "record":
        state.sink.write(slot, idx)
        return None
    routes = state.routes[:, slot]  # [N, k]
    if routes.shape[0] != idx.shape[0]:
        raise ValueError(f"routing replay: the forward routes {idx.shape[0]} tokens but {routes.shape[0]} routes "
                         "were given: the routes must follow the forward's tokens (rows x columns, or packed)")
    valid = routes[:, 0] != no_route(routes.dtype)  # [N]
    given = torch.where(valid[:, None], routes.long(), idx)
    with torch.no_grad():
        differ = (given.sort(-1).values != idx.sort(-1).values).any(-1) & valid
        state.stats[slot] = torch.stack([differ.sum(), valid.sum()]).to(torch.float64)
    if state.balance is not None:  # over the experts this forward uses
        state.balance[slot] = balance_loss(logits, given if state.mode == "replay" else idx, state.num_experts,
                                           state.token_mask)
    if state.mode == "compare":
        return None
    return logits, rule_of(module)(module, logits, given), given


_found: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its MoERouting or None


def routing_of(model: nn.Module) -> MoERouting | None:
    """The routing state of `model`'s supported routers, their hooks installed on first use (shared by every wrapper
    of the same modules); None for a model without supported routers (`is_moe` tells the unsupported ones)."""
    if model in _found:
        return _found[model]
    routers = [m for m in model.modules() if rule_of(m) is not None]
    state = None
    if routers:
        tags = [getattr(r, "_logitless_routing", None) for r in routers]
        state = tags[0][0] if tags[0] is not None else None
        if state is None or state.routers != routers or any(t is None or t[0] is not state for t in tags):
            # untagged, or tags that came with a copy of another model's routers: a state of these routers' own
            state = MoERouting(routers, routers[0].num_experts, routers[0].top_k)
            for slot, (r, tag) in enumerate(zip(routers, tags)):
                if tag is None:  # a copy keeps the hook it was copied with
                    r.register_forward_hook(_router_hook)
                r._logitless_routing = (state, slot)
    _found[model] = state
    return state


def is_moe(model: nn.Module) -> bool:
    """Whether `model`'s (text) config describes a mixture of experts, supported router or not."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return any(getattr(cfg, f, None) for f in MOE_FIELDS)


def require_routing(model: nn.Module, key: str) -> MoERouting:
    """`routing_of(model)`, or a clear error naming config key `key` for a model without supported routers."""
    state = routing_of(model)
    if state is None:
        cfg = getattr(model, "config", None)
        kind = "a mixture-of-experts model whose routers have no routing hook" if is_moe(model) else \
            "not a mixture-of-experts model"
        raise UnsupportedRoutingError(
            f"{key}: model_type {getattr(cfg, 'model_type', '?')!r} is {kind} (supported routers: "
            f"{', '.join(sorted(RULES))}): set {key}=false (or \"auto\")")
    return state


@contextlib.contextmanager
def routing_scope(model: nn.Module) -> Iterator[MoERouting | None]:
    """Routes set inside (by `completion_logprobs(routes=...)`) stay set until the outermost scope ends, so a
    backward's gradient-checkpoint recompute replays them too; then the model routes on its own again."""
    state = routing_of(model)
    if state is None:
        yield None
        return
    state.depth += 1
    try:
        yield state
    finally:
        state.depth -= 1
        if state.depth == 0:
            state.set_forward(None, False)
            state.balance = None


def balance_of(state: MoERouting | None) -> Tensor | None:
    """The mean over MoE layers of the load-balancing losses the last forward stored (`collect_balance`), or None."""
    if state is None or not state.balance:
        return None
    return torch.stack([state.balance[k] for k in sorted(state.balance)]).mean()


def collect_balance(state: MoERouting | None) -> None:
    """From now until the outermost `routing_scope` ends, every forward stores its layers' load-balancing losses."""
    if state is not None:
        state.balance = {}


@contextlib.contextmanager
def recording(model: nn.Module, sink: Any) -> Iterator[None]:
    """Inside, every forward of `model` writes its routes into `sink` (`RouteSink` or `ForwardLog`)."""
    state = require_routing(model, "record_routes")
    saved = state.mode, state.sink
    state.mode, state.sink = "record", sink
    try:
        yield
    finally:
        state.mode, state.sink = saved


def check_routes(routes: Tensor, num_experts: int) -> None:
    """Raise if a recorded route names an expert the model does not have (one host sync)."""
    valid = routes != no_route(routes.dtype)
    if bool((valid & ((routes.long() < 0) | (routes.long() >= num_experts))).any()):
        raise ValueError(f"routes name experts outside 0..{num_experts - 1}: they were recorded from another model")
