"""LoRA on mixtures of experts (model.lora_target_experts): what peft adapts in each family (the fused expert stacks,
never the router), the per-expert rank, and the rollout's merged copies (one process: MergedLoraWeights; torchrun's
replica: MergedRolloutCopy) computing what the unmerged trainer computes, expert deltas included."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

from logitless.models import completion_logprobs
from logitless.models.experts import expert_modules, set_experts_implementation
from logitless.rollout import make_engine
from logitless.rollout.weights import MergedLoraWeights, delta_weight, lora_layers
from logitless.trainer.config.schema import ModelConfig
from logitless.trainer.policy.lora_targets import expert_targets
from logitless.trainer.policy.modeling import prepare_for_training
from logitless.trainer.distributed.parallel import MergedRolloutCopy
from tests.test_rollout_weights import perturb
from tests.test_rollout_families import TOK
from tests.test_rollout_weights import OPTS, PROMPTS

COMMON = dict(vocab_size=len(TOK), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, initializer_range=0.2, pad_token_id=TOK.pad_token_id, bos_token_id=None,
              eos_token_id=TOK.eos_token_id)
FAMILIES = {  # tiny fp32 mixtures of experts: 8 experts (gpt_oss 4), 2 per token
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=32, head_dim=16,
                                           num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "olmoe": lambda: tf.OlmoeConfig(**COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "mixtral": lambda: tf.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2),
    "gpt_oss": lambda: tf.GptOssConfig(**COMMON, intermediate_size=32, head_dim=16, num_local_experts=4,
                                       num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"]),
}
ROUTERS = ("mlp.gate", "mlp.router")  # the routers' module names (a custom module, not a linear layer)


def moe_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation="eager").eval()


def lora_cfg(experts: bool, **kw) -> ModelConfig:
    return ModelConfig(lora_r=4, lora_alpha=8, lora_target_experts=experts, gradient_checkpointing=False,
                       mlp_chunk_tokens=None, compile_layers=False, liger_kernels=False, **kw)


def adapted(model) -> dict[str, tuple[int, ...]]:
    """{qualified adapted parameter (LoRA removed from the name): lora_A's shape} of a peft model."""
    out = {}
    for name, layer in lora_layers(model):
        path = name.removeprefix("base_model.model.")
        while path.endswith(".base_layer"):
            path = path.removesuffix(".base_layer")
        out[f"{path}.{getattr(layer, 'parameter_name', None) or 'weight'}"] = tuple(layer.lora_A["default"].weight.shape)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_all_linear_adapts_no_router_and_experts_only_when_asked(family):
    """peft would rewrite "all-linear" on qwen2_moe-style and mixtral models into LoRA on the experts and the router;
    logitless targets what the config names: the linear layers, plus the two expert stacks with lora_target_experts,
    an adapter per expert of rank lora_r // k."""
    plain = adapted(prepare_for_training(moe_model(family), lora_cfg(False)))
    assert plain and not any(".experts." in n for n in plain)
    assert not any(n.rpartition(".")[0].endswith(ROUTERS) for n in plain)
    assert any(n.endswith("self_attn.q_proj.weight") for n in plain)
    if family == "qwen2_moe":  # the shared expert is a dense MLP of linear layers: adapted as such
        assert any(n.endswith("shared_expert.gate_proj.weight") for n in plain)

    model = moe_model(family)
    targets = expert_targets(model, lora_cfg(True))
    assert targets == {"experts.down_proj": (2, 4.0), "experts.gate_up_proj": (2, 4.0)}  # rank 4 // k=2, alpha 8*2/4
    with_experts = adapted(prepare_for_training(model, lora_cfg(True)))
    experts = {n: s for n, s in with_experts.items() if ".experts." in n}
    assert set(with_experts) - set(experts) == set(plain)  # the same linear layers, and no router
    E = FAMILIES[family]().num_local_experts if family in ("mixtral", "gpt_oss") else FAMILIES[family]().num_experts
    for layer in range(2):
        for param in ("gate_up_proj", "down_proj"):
            rows, _ = experts[f"model.layers.{layer}.mlp.experts.{param}"]
            assert rows == 2 * E  # lora_A: [E x rank, in]
    for _, layer in lora_layers(model):
        if getattr(layer, "parameter_name", None):
            assert layer.scaling["default"] == 8 / 4  # every adapter's scale is lora_alpha / lora_r


def test_lora_target_experts_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="model.lora_target_experts=true adds LoRA.*model.lora=false"):
        ModelConfig(lora=False, lora_target_experts=True)
    with pytest.raises(ValueError, match="no dropout.*model.lora_dropout=0"):
        ModelConfig(lora_target_experts=True, lora_dropout=0.1)
    dense = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**{k: v for k, v in COMMON.items()},
                                                               intermediate_size=64))
    with pytest.raises(ValueError, match="LlamaForCausalLM has no fused expert weights.*lora_target_experts=false"):
        prepare_for_training(dense, lora_cfg(True))


@pytest.fixture(scope="module")
def expert_lora_models():
    """qwen3_moe, olmoe and gpt_oss (transposed stacks with biases) with LoRA on attention and experts, adapters
    moved off zero (built once)."""
    out = {}
    for family in ("qwen3_moe", "olmoe", "gpt_oss"):
        model = prepare_for_training(moe_model(family), lora_cfg(True))
        perturb(model, 0)
        out[family] = model.eval()
    return out


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """The trainer's logprobs (the fused op) of ids[:, 6:] after ids[:, :6]."""
    mask = torch.ones_like(ids)
    with torch.no_grad():
        return completion_logprobs(model, ids[:, :6], mask[:, :6], ids[:, 6:], mask[:, 6:], temperature=0.8)[0]


def _tolerance(model, ids: torch.Tensor) -> float:
    """How far a merged copy's fp32 logprobs may be from the unmerged model's: 1e-5, or twice the unmerged fp32
    model's own error against its float64 copy where that is larger (gpt_oss's tiny random model, whose logits
    are large: 2e-5 to 3e-5 there, rounding of W + ΔW against W x + B A x)."""
    exact = copy.deepcopy(model).double()
    set_experts_implementation(exact, "eager")  # (torch's grouped GEMM has no float64)
    exact = _logprobs(exact, ids)
    return max(1e-5, 2 * float((_logprobs(model, ids).double() - exact).abs().max()))


@pytest.mark.parametrize("mode", ["resident", "in_place"])
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "gpt_oss"])
def test_merged_copy_computes_the_unmerged_policy_expert_deltas_included(expert_lora_models, family, mode,
                                                                         one_thread):
    model = expert_lora_models[family]
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    unmerged = _logprobs(model, ids)
    weights = MergedLoraWeights(model, mode)
    weights.sync()
    merged_model = weights.module
    assert not lora_layers(merged_model) and expert_modules(merged_model)
    torch.testing.assert_close(_logprobs(merged_model, ids), unmerged, atol=_tolerance(model, ids), rtol=0)
    weights.release()
    with model.disable_adapter():  # the check can fail: the base weights alone give other logprobs
        assert (_logprobs(model, ids) - unmerged).abs().max() > 1e-2
    if mode == "resident":  # the expert stacks are copies of their own (the base weights untouched), the rest shared
        stack = merged_model.model.layers[0].mlp.experts.gate_up_proj
        base = model.get_base_model().model.layers[0].mlp.experts.base_layer.base_layer.gate_up_proj
        assert stack.data_ptr() != base.data_ptr() and not torch.equal(stack, base)
        E, H, I2 = base.shape
        assert weights.extra_bytes >= 2 * 2 * E * H * I2 // 2 * 4  # (both stacks of both layers, fp32)
    else:  # written back exactly after the rollout
        assert (_logprobs(model, ids) - unmerged).abs().max() == 0


def test_static_engine_decodes_the_merged_expert_lora_policy(expert_lora_models, one_thread):
    """The rollout path: the static engine on the merged copy samples tokens whose logprobs are the unmerged
    trainer's (expert deltas merged, the router computing from the same hidden states)."""
    model = expert_lora_models["qwen3_moe"]
    eng = make_engine("static", model, TOK, check_every=4, weights=MergedLoraWeights(model, "resident"))
    b = eng.generate(PROMPTS, OPTS)
    with torch.no_grad():
        lp = completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                                 temperature=OPTS.temperature)[0]
    torch.testing.assert_close(b.sampler_logp, lp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "gpt_oss"])
def test_torchrun_replica_merges_the_expert_deltas(expert_lora_models, family, one_thread):
    """MergedRolloutCopy (the replica under torchrun; here unsharded on one process, as tests/test_parallel_replica.py
    checks it) forms each expert's ΔW from the gathered factors as peft does, and its logprobs are the policy's."""
    model = expert_lora_models[family]
    for _, layer in lora_layers(model):
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        torch.testing.assert_close(delta_weight(layer, "default", a, b), layer.get_delta_weight("default"))
    replica = MergedRolloutCopy(model)
    replica.sync(model)
    assert not lora_layers(replica.model)
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_logprobs(replica.model, ids), _logprobs(model, ids), atol=_tolerance(model, ids),
                               rtol=0)


@pytest.mark.parametrize("experts", [False, True])
def test_a_saved_adapter_loads_back_in_plain_peft(tmp_path, experts, one_thread):
    """The adapter a run saves names its layers one by one, so peft's own loader (whose transformers-4 rewrite runs
    on loading) rebuilds the same adapters: the same logprobs, expert stacks included."""
    from peft import PeftModel

    model = prepare_for_training(moe_model("qwen3_moe"), lora_cfg(experts))
    perturb(model, 0)
    model.eval().save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(moe_model("qwen3_moe"), tmp_path).eval()
    assert sorted(n for n, _ in loaded.named_parameters() if "lora_" in n) == sorted(
        n for n, _ in model.named_parameters() if "lora_" in n)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_logprobs(loaded, ids), _logprobs(model, ids), atol=0, rtol=0)
