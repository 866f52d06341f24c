"""The mixture-of-experts part of `bench/gpu_exactness.py`: the MoE families' tiny configs, the experts backend a run
picks, and the trainer's logprobs with the sampler's routes replayed or only compared (`models/routing.py`).

Each MoE family decodes with routes recorded (`make_engine(..., record_routes=True)`); the trainer's
`completion_logprobs` then runs twice on the same batch: with the routes replayed (the measured gap, held to `hf`'s
own gap with replay) and with its own routing compared against them (the gap without replay and the expert
disagreement: the share of token x layer whose trainer top-k differs as a set from the sampler's route).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from logitless.models import completion_logprobs
from logitless.models.experts import resolve_experts_implementation, set_experts_implementation
from logitless.models.routing import routing_scope

ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def moe_families(common: dict[str, Any], window: int, layer_types: list[str]) -> dict[str, Callable[[], Any]]:
    """Tiny config of every MoE family with a routing hook: `common` (hidden 256, 4 layers, GPT-2's vocabulary),
    8 experts of width 256, 2 per token; GPT-OSS alternates sliding (`window`) and full attention as its real
    configs do. Named gpt_oss_moe apart from the dense matrix's gpt_oss (4 experts, decoded without routes)."""
    import transformers as tf

    c = {**common, "intermediate_size": 256}
    moe = dict(num_experts_per_tok=2)
    return {
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**c, **moe, head_dim=64, moe_intermediate_size=256, num_experts=8,
                                               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
        "olmoe": lambda: tf.OlmoeConfig(**c, **moe, num_experts=8, norm_topk_prob=False),
        "mixtral": lambda: tf.MixtralConfig(**c, **moe, num_local_experts=8, sliding_window=None),
        # a shared expert beside the routed ones; layer 0 dense (mlp_only_layers)
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**c, **moe, moe_intermediate_size=256,
                                               shared_expert_intermediate_size=256, num_experts=8,
                                               norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[0]),
        "gpt_oss_moe": lambda: tf.GptOssConfig(**{**c, "max_position_embeddings": 131_072}, **moe, head_dim=64,
                                               num_local_experts=8, sliding_window=window, layer_types=layer_types),
        # multi-head latent attention, group-limited sigmoid routing, a shared expert, layer 0 dense
        "deepseek_v3": lambda: tf.DeepseekV3Config(**{**c, "num_key_value_heads": c["num_attention_heads"]}, **moe,
                                                   moe_intermediate_size=256, n_routed_experts=8, n_group=2,
                                                   topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                                                   q_lora_rank=None, kv_lora_rank=64, qk_rope_head_dim=32,
                                                   qk_nope_head_dim=32, v_head_dim=64, routed_scaling_factor=2.5,
                                                   norm_topk_prob=True, rope_parameters=ROPE),
    }


def use_run_experts_backend(model: torch.nn.Module) -> str | None:
    """Set `model`'s experts backend to the one a run picks on its device and dtype (model.experts_implementation
    =auto: grouped_mm on CUDA SM90+ in bf16, else eager), as `trainer/policy/modeling.py load_model` does; the
    engines and the trainer's forwards then share it. None for a model without experts."""
    weight = model.get_input_embeddings().weight
    backend = resolve_experts_implementation("auto", weight.device, weight.dtype)[0]
    return backend if set_experts_implementation(model, backend) else None


@dataclass
class RoutedLogprobs:
    """The trainer's logprobs of a batch given the sampler's routes, and how its own routing compared."""

    logp: torch.Tensor  # [B, T] fp32 on the host
    differ: int  # token x layer whose trainer top-k differs as a set from the recorded route
    routed: int  # token x layer with a recorded route (padding and each row's last token have none)

    @property
    def disagreement(self) -> float:
        return self.differ / self.routed if self.routed else float("nan")


def routed_logprobs(model: torch.nn.Module, args: list[torch.Tensor], batch: Any, temperature: float,
                    replay: bool) -> RoutedLogprobs:
    """`completion_logprobs(model, *args)` (prompt ids and mask, completion ids and mask, on the model's device)
    with `batch`'s recorded routes replayed (`replay`) or only compared with the model's own routing."""
    device = args[0].device
    with routing_scope(model) as state:
        logp = completion_logprobs(model, *args, temperature=temperature, replay=replay,
                                   prompt_routes=batch.prompt_routes.to(device),
                                   completion_routes=batch.completion_routes.to(device))[0]
        differ, routed = state.stats.sum(0).tolist()
    return RoutedLogprobs(logp.float().cpu(), int(differ), int(routed))
