"""Routing record and replay for mixture-of-experts models (`logitless/models/routing.py`): the engines record the
experts each token used, the trainer's forwards replay them. Ground truth for replay is an independent forward
whose routers pick their top-k only among the recorded experts (`masked_routers`), each with its family's own
weight formula written out here."""

from __future__ import annotations

import contextlib
import json
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from logitless.models import completion_logprobs
from logitless.models.experts import set_experts_implementation
from logitless.models.routing import UnsupportedRoutingError, check_routes, no_route, routing_of, routing_scope
from logitless.rollout import SamplingOptions, make_engine
from tests.test_rollout_families import TOK
from tests.test_trainer import tok  # noqa: F401 (fixture: GPT-2, left padding, pad = EOS)

TEMPERATURE = 0.8
PROMPTS = ["The quick brown fox", "Hi there, how are you?", "2+2 is"]
COMMON = dict(vocab_size=len(TOK), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, initializer_range=0.2, pad_token_id=TOK.pad_token_id, bos_token_id=None,
              eos_token_id=TOK.eos_token_id)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
FAMILIES = {
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**COMMON, head_dim=16, intermediate_size=64, moe_intermediate_size=32,
                                           num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                           decoder_sparse_step=1, mlp_only_layers=[]),
    "olmoe": lambda: tf.OlmoeConfig(**COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                    norm_topk_prob=False),
    "mixtral": lambda: tf.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                        sliding_window=None),
    # a shared expert beside the routed ones; layer 0 dense (mlp_only_layers), so one MoE slot
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                           norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[0]),
    "gpt_oss": lambda: tf.GptOssConfig(**COMMON, head_dim=16, intermediate_size=32, num_local_experts=4,
                                       num_experts_per_tok=2, layer_types=["full_attention"] * 2, sliding_window=128,
                                       rope_parameters=ROPE),
    # multi-head latent attention, group-limited sigmoid routing, layer 0 dense (first_k_dense_replace)
    "deepseek_v3": lambda: tf.DeepseekV3Config(**{**COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4},
                                               intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
                                               num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                               first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
                                               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                               routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=ROPE),
}
MOE_LAYERS = {"qwen2_moe": 1, "deepseek_v3": 2}  # the rest: every one of their 2 layers
# GPT-OSS's eager attention (with sinks) mixes packed rows, which the trainer refuses (`check_packed_attention`)
PACKS = [f for f in FAMILIES if f != "gpt_oss"]


def make_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation="eager").eval()


def engine(backend: str, model):
    return make_engine(backend, model, TOK, record_routes=True, **({"check_every": 4} if backend == "static" else {}))


def sample(backend: str, model, G: int = 2):
    opts = SamplingOptions(num_generations=G, temperature=TEMPERATURE, max_new_tokens=8, seed=3, ignore_eos=True)
    return engine(backend, model).generate(PROMPTS, opts)


@pytest.fixture(scope="module")
def rollouts():
    """(model, batch) per (family, backend), sampled once per module."""
    cache: dict = {}

    def get(family: str, backend: str):
        if family not in cache:
            cache[family] = {"model": make_model(family)}
        if backend not in cache[family]:
            cache[family][backend] = sample(backend, cache[family]["model"])
        return cache[family]["model"], cache[family][backend]

    return get


def logprobs(model, b, replay: bool | None, **kw) -> torch.Tensor:
    """completion_logprobs of the batch's tokens; replay None: without routes."""
    routes = {} if replay is None else dict(prompt_routes=b.prompt_routes, completion_routes=b.completion_routes,
                                            replay=replay)
    return completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                               temperature=TEMPERATURE, **routes, **kw)[0]


# ----------------------------------------------------------------------------------------------------------
# The reference: routers whose top-k is taken among the recorded experts only, each family's formula written out


def _masked_forward(router, hidden: torch.Tensor, allowed: torch.Tensor):
    """`router`'s own forward (transformers 5.17's code for its family) with the choice limited to `allowed`
    [N, E] bool."""
    name = next(c.__name__ for c in type(router).__mro__ if c.__name__.endswith(("Router", "TopkRouter")))
    hidden = hidden.reshape(-1, router.hidden_dim)
    if name == "GptOssTopKRouter":
        logits = F.linear(hidden, router.weight, router.bias)
        value, idx = torch.topk(logits.masked_fill(~allowed, float("-inf")), router.top_k, dim=-1)
        return logits, torch.softmax(value, dim=1, dtype=value.dtype), idx
    if name == "DeepseekV3TopkRouter":
        logits = F.linear(hidden.float(), router.weight.float())
        scores = logits.sigmoid()
        choice = (scores + router.e_score_correction_bias).masked_fill(~allowed, float("-inf"))
        idx = torch.topk(choice, router.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) if router.norm_topk_prob else w
        return logits, w * router.routed_scaling_factor, idx
    logits = F.linear(hidden, router.weight)
    probs = torch.softmax(logits.float(), dim=-1)
    value, idx = torch.topk(probs.masked_fill(~allowed, -1.0), router.top_k, dim=-1)
    if name == "MixtralTopKRouter" or router.norm_topk_prob:
        value = value / value.sum(-1, keepdim=True)
    return logits, value if name == "MixtralTopKRouter" else value.to(logits.dtype), idx


@contextlib.contextmanager
def masked_routers(model, routes: torch.Tensor):
    """Every router of `model` chooses among the experts of `routes` [N, layers, k] (the forward's N tokens; tokens
    without a route choose freely)."""
    state = routing_of(model)
    valid = routes[..., 0] != no_route(routes.dtype)  # [N, layers]
    for slot, r in enumerate(state.routers):
        allowed = torch.zeros(routes.shape[0], state.num_experts, dtype=torch.bool)
        allowed.scatter_(1, routes[:, slot].long().clamp(0, state.num_experts - 1), True)
        allowed[~valid[:, slot]] = True
        r.forward = types.MethodType(lambda self, h, a=allowed: _masked_forward(self, h, a), r)
    try:
        yield
    finally:
        for r in state.routers:
            del r.forward


def padded_routes(b) -> torch.Tensor:
    """[B * (P + T), layers, k]: the batch's routes in the padded forward's token order."""
    return torch.cat([b.prompt_routes, b.completion_routes], 1).flatten(0, 1)


@contextlib.contextmanager
def perturbed_routers(model, scale: float = 3.0):
    """Router weights (and a GPT-OSS router's bias) shifted by random noise, so their own top-k changes; restored
    after."""
    state = routing_of(model)
    saved = [r.weight.detach().clone() for r in state.routers]
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for r in state.routers:
            r.weight.add_(torch.randn(r.weight.shape, generator=g) * scale * r.weight.std())
    try:
        yield
    finally:
        with torch.no_grad():
            for r, w in zip(state.routers, saved):
                r.weight.copy_(w)


def disagreement(model, b, replay: bool) -> float:
    """Share of the recorded (token, layer) routes the model's own top-k differs from, in a forward with routes."""
    with torch.no_grad(), routing_scope(model) as state:
        logprobs(model, b, replay)
        stats = state.stats.sum(0)
    return float(stats[0] / stats[1])


# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["static", "hf"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_recorded_routes_match_the_trainer(family, backend, rollouts, one_thread):
    """The sampler's logprobs equal the trainer's with replay on, off, and without routes; the routes cover every
    real token but each row's last (sentinel), each prompt's rows share its prompt routes, and the trainer's own
    top-k agrees with every recorded route (a misaligned route would not)."""
    model, b = rollouts(family, backend)
    state = routing_of(model)
    assert state.layers == MOE_LAYERS.get(family, 2) and b.prompt_routes.dtype == torch.uint8
    assert b.completion_routes.shape == (*b.completion_ids.shape, state.layers, 2)
    none = no_route(torch.uint8)
    recorded = (b.completion_routes != none).all(-1).all(-1)  # [B, T]
    last = b.completion_mask.sum(1) - 1
    assert torch.equal(recorded, b.completion_mask.bool() & (torch.arange(b.completion_ids.shape[1]) < last[:, None]))
    assert torch.equal((b.prompt_routes != none).all(-1).all(-1), b.prompt_mask.bool())
    assert torch.equal(b.prompt_routes[0::2], b.prompt_routes[1::2])  # G = 2 rows of each prompt
    assert int(b.prompt_routes[b.prompt_mask.bool()].max()) < state.num_experts
    with torch.no_grad():
        for replay in (None, False, True):
            torch.testing.assert_close(logprobs(model, b, replay), b.sampler_logp, atol=1e-5, rtol=0)
    assert disagreement(model, b, replay=False) == 0.0
    assert disagreement(model, b, replay=True) == 0.0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replay_keeps_the_samplers_experts(family, rollouts, one_thread):
    """With the routers perturbed after the rollout (their own top-k changes), replay equals a forward whose routers
    choose among the recorded experts only, padded and packed; the model's own routing differs from it."""
    model, b = rollouts(family, "static")
    with perturbed_routers(model), torch.no_grad():
        assert disagreement(model, b, replay=True) > 0.05
        with masked_routers(model, padded_routes(b)):
            reference = logprobs(model, b, None)
        native = logprobs(model, b, None)
        for packed in (False, True) if family in PACKS else (False,):
            torch.testing.assert_close(logprobs(model, b, True, packed=packed), reference, atol=1e-5, rtol=0)
            torch.testing.assert_close(logprobs(model, b, False, packed=packed), native, atol=1e-5, rtol=0)
    assert (native - reference).abs().max() > 1e-3


def grads(model, loss_of) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with routing_scope(model):  # routes stay set through the backward (gradient-checkpoint recompute)
        loss_of().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_replay_gradient_equals_masked_reference(family, checkpointing, rollouts, one_thread):
    """The gradient of a loss on the replayed logprobs equals the masked reference's, the routers' and experts'
    weights included (the replayed weights are recomputed from the live router logits); with gradient
    checkpointing the recompute replays the same routes."""
    model, b = rollouts(family, "static")
    weight = torch.randn(b.completion_ids.shape, generator=torch.Generator().manual_seed(2))
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    try:
        with perturbed_routers(model):
            replayed = grads(model, lambda: (logprobs(model, b, True) * weight).sum())
            with masked_routers(model, padded_routes(b)):
                reference = grads(model, lambda: (logprobs(model, b, None) * weight).sum())
    finally:
        model.eval()
        if checkpointing:
            model.gradient_checkpointing_disable()
    assert replayed.keys() == reference.keys()
    routers = [n for n in replayed if ".router.weight" in n or ".gate.weight" in n]
    experts = [n for n in replayed if ".experts." in n]
    assert len(routers) == routing_of(model).layers and experts
    for n in replayed:
        torch.testing.assert_close(replayed[n], reference[n], atol=1e-5, rtol=1e-4, msg=n)
    assert all(replayed[n].abs().max() > 0 for n in routers + experts)


def test_routes_of_another_shape_are_refused(rollouts, one_thread):
    model, b = rollouts("qwen3_moe", "static")
    with pytest.raises(ValueError, match="prompt_routes .* must start with"):
        completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                            prompt_routes=b.prompt_routes[:, 1:], completion_routes=b.completion_routes)
    with pytest.raises(ValueError, match="MoE layers"):
        routing_of(model).set_forward(torch.zeros(4, 3, 2, dtype=torch.uint8), True)
    bad = b.completion_routes.clone()
    bad[0, 0, 0, 0] = 8  # the model has experts 0..7
    check_routes(b.completion_routes, 8)
    with pytest.raises(ValueError, match=r"outside 0\.\.7"):
        check_routes(bad, 8)


def test_dense_models_are_refused_naming_the_key():
    torch.manual_seed(0)
    dense = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**{**COMMON, "intermediate_size": 32}))
    with pytest.raises(UnsupportedRoutingError, match="model.routing_replay.*not a mixture-of-experts"):
        engine("static", dense)


# ----------------------------------------------------------------------------------------------------------
# The trainer: routes through micro-batches and packing, and a run


@pytest.mark.parametrize("family,packed", [(f, False) for f in FAMILIES] + [(f, True) for f in PACKS])
def test_micro_batches_and_packing_replay_each_rows_routes(family, packed, rollouts, one_thread):
    """Rows split into micro-batches (sorted by length, padding columns trimmed; packed or padded) replay the same
    routes as the whole batch: with the routers perturbed, every micro-batch's logprobs equal the whole batch's
    masked-router reference."""
    from logitless.trainer.batching import make_micro_batches

    model, b = rollouts(family, "static")
    B = b.completion_ids.shape[0]
    with perturbed_routers(model), torch.no_grad():
        with masked_routers(model, padded_routes(b)):
            reference = logprobs(model, b, None)
        micro = make_micro_batches(b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask, b.sampler_logp,
                                   b.truncated, torch.zeros(B), 2, max_tokens=60, packed=packed,
                                   routes=(b.prompt_routes, b.completion_routes))
        assert len(micro) > 1 and any(m.prompt_ids.shape[1] < b.prompt_ids.shape[1] for m in micro)
        got = torch.zeros_like(reference)
        for m in micro:
            lp, _ = completion_logprobs(model, m.prompt_ids, m.prompt_mask, m.completion_ids, m.completion_mask,
                                        temperature=TEMPERATURE, packed=packed, **m.routes)
            got[m.rows, : lp.shape[1]] = lp
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)


def moe_run(tmp_path, tok, *overrides):  # noqa: F811
    from logitless.trainer.config.schema import load_train_config
    from logitless.trainer.loop import train
    from tests.conftest import TINY_LORA_QUIET

    cfg = load_train_config(None, [
        f"train.output_dir={tmp_path}", "train.max_steps=2", "train.prompts_per_step=2", "train.micro_batch_size=2",
        "rollout.num_generations=2", "rollout.max_completion_length=6", "rollout.backend=static",
        "data.options={difficulty: 1, n: 20, chat: false}", "optim.learning_rate=0.05", "train.num_iterations=2",
        "checkpoint.save_steps=100", "train.skip_zero_advantage=false", *TINY_LORA_QUIET, *overrides])
    torch.manual_seed(0)
    config = tf.Qwen3MoeConfig(**{**COMMON, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id,
                                  "eos_token_id": tok.eos_token_id, "max_position_embeddings": 512},
                               head_dim=16, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                               num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                               output_router_logits=True)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return train(cfg, model=model, tokenizer=tok).records


@pytest.mark.parametrize("setting", ["model.lora=false", "model.lora=true", "objective.beta=0.04 train.packed=true"])
def test_trainer_replays_the_rollouts_routes(tmp_path, tok, setting, one_thread):  # noqa: F811
    """Runs on a tiny Qwen3-MoE: routes are recorded and replayed (full fine-tuning; LoRA; a reference model and
    packed micro-batches; two passes, so old logprobs too), the live routers agree with every recorded route before
    the first optimizer step (rollout/route_disagreement 0) and the sampler's logprobs match the trainer's;
    model.routing_replay=false records nothing and logs no disagreement."""
    records = moe_run(tmp_path / "on", tok, *setting.split())
    assert all(r["rollout/route_disagreement"] == 0.0 for r in records)
    assert all(r["rollout/mismatch_max"] < 1e-4 for r in records)
    if setting == "model.lora=false":
        off = moe_run(tmp_path / "off", tok, setting, "model.routing_replay=false")
        assert all("rollout/route_disagreement" not in r for r in off)


def test_step_graph_and_compaction_record_the_same_routes(one_thread, monkeypatch):
    """The static engine's decode through `DecodeStep` (its device step counter; eager off CUDA), with finished rows
    compacted away (rows reordered) and in waves of 5 rows (the last one short) records the routes of the plain loop
    in one wave, which the trainer's own routing reproduces."""
    from logitless.rollout.static_rows import DecodeRows

    compacted, original = [], DecodeRows.compacted

    def spy(self, token):
        out = original(self, token)
        compacted.append(len(out[0].index) < len(self.index))
        return out

    monkeypatch.setattr(DecodeRows, "compacted", spy)
    model = make_model("qwen3_moe")
    prompts = [p + "!" * i for i in range(4) for p in PROMPTS[:2]]  # 8 prompts x G = 2: 16 rows
    opts = SamplingOptions(num_generations=2, temperature=TEMPERATURE, max_new_tokens=12, seed=3,
                           eos_token_ids=list(range(0, 256, 6)))  # a sixth of the bytes end a row: rows end early
    engines = {name: make_engine("static", model, TOK, record_routes=True, check_every=2, **kw)
               for name, kw in {"loop": {}, "step_graph": {"step_graph": True}, "compacted": {"compact_finished": True},
                                "waves": {}}.items()}
    monkeypatch.setattr(engines["waves"], "_wave_size", lambda call, B: 5)
    runs = {name: eng.generate(prompts, opts) for name, eng in engines.items()}
    base = runs["loop"]
    assert any(compacted)
    for name, b in runs.items():
        assert torch.equal(b.completion_ids, base.completion_ids), name
        assert torch.equal(b.completion_routes, base.completion_routes), name
        assert torch.equal(b.prompt_routes, base.prompt_routes), name
    assert disagreement(model, base, replay=False) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("step_graph", [True, False])
def test_compiled_cuda_decode_records_routes(step_graph):
    """On CUDA the static engine records inside its compiled decode (the captured step graph, or the forward alone
    as a CUDA graph): fp32 over batched_mm experts (capturable in fp32), the trainer's own routing agrees with the
    recorded routes and replay reproduces the sampler's logprobs."""
    model = make_model("qwen3_moe").cuda()
    assert set_experts_implementation(model, "batched_mm")
    eng = make_engine("static", model, TOK, record_routes=True, check_every=4, step_graph=step_graph)
    opts = SamplingOptions(num_generations=2, temperature=TEMPERATURE, max_new_tokens=8, seed=3, ignore_eos=True)
    with warnings.catch_warnings():  # (a step that cannot be captured would run uncaptured, with this warning)
        warnings.filterwarnings("error", message=".*could not be captured.*")
        b = eng.generate(PROMPTS, opts).to("cuda")
    recorded = (b.completion_routes != no_route(torch.uint8)).all(-1).all(-1)
    assert int(recorded.sum()) == b.completion_ids.shape[0] * 7  # every fed token of every row
    assert disagreement(model, b, replay=False) == 0.0
    with torch.no_grad():
        torch.testing.assert_close(logprobs(model, b, True), b.sampler_logp, atol=1e-4, rtol=0)


def test_routes_survive_the_batch_handoffs(rollouts, one_thread):
    """Routes follow their rows through the JSON form an async run's checkpoint keeps, through dynamic sampling's
    concatenation (padded with the sentinel like the ids) and row selection, and through a tensor-parallel group's
    per-prompt split."""
    from logitless.trainer.placement.async_rollout import batch_from_json, batch_to_json
    from logitless.trainer.dynamic import concat_batches, select_rows
    from logitless.trainer.placement.tensor_parallel import prompt_rows

    model, b = rollouts("qwen3_moe", "static")
    back = batch_from_json(json.loads(json.dumps(batch_to_json(b))))
    assert back.prompt_routes.dtype == torch.uint8
    assert torch.equal(back.prompt_routes, b.prompt_routes) and torch.equal(back.completion_routes, b.completion_routes)
    short = prompt_rows(b, 2, 1, 2)  # the last prompt's 2 rows, its padding trimmed
    both = concat_batches([b, short], TOK.pad_token_id)
    assert both.prompt_routes.shape[:2] == both.prompt_ids.shape and both.completion_routes.shape[:2] == \
        both.completion_ids.shape
    again = select_rows(both, torch.arange(6, 8))
    with torch.no_grad():
        for part in (short, again):
            assert part.prompt_routes.shape[:2] == part.prompt_ids.shape
            torch.testing.assert_close(logprobs(model, part, True), b.sampler_logp[4:6, : part.completion_ids.shape[1]],
                                       atol=1e-5, rtol=0)
            assert disagreement(model, part, replay=False) == 0.0


def test_a_copys_routers_have_their_own_state(rollouts, one_thread):
    """A copy of a hooked model (a replica or merged rollout copy is one) records its routes while the original
    replays its own (an async rollout during the update): neither disturbs the other."""
    from logitless.trainer.distributed.parallel import copy_to

    model, b = rollouts("qwen3_moe", "static")
    clone = copy_to(model, None)
    assert routing_of(clone) is not routing_of(model)
    assert all(r in list(clone.modules()) for r in routing_of(clone).routers)
    with torch.no_grad(), routing_scope(model) as state:
        logprobs(model, b, True)
        routes, stats = state.routes, state.stats.clone()
        again = sample("static", clone)
        assert state.mode == "replay" and state.routes is routes and torch.equal(state.stats, stats)
    assert torch.equal(again.completion_routes, b.completion_routes) and torch.equal(again.prompt_routes, b.prompt_routes)


@pytest.mark.parametrize("setting,why", [("rollout.backend=continuous", "does not record routes"),
                                         ("agent.tools=[calculator]", "multi-turn episodes")])
def test_routing_replay_true_is_refused_before_the_model_loads(tmp_path, setting, why):
    from logitless.trainer.config.schema import load_train_config
    from logitless.trainer.preflight import validate_config

    cfg = load_train_config(None, [f"train.output_dir={tmp_path}", "model.routing_replay=true", setting])
    with pytest.raises(ValueError, match=f"model.routing_replay=true: .*{why}.*model.routing_replay=auto"):
        validate_config(cfg)
    validate_config(load_train_config(None, [f"train.output_dir={tmp_path}", setting]))  # auto: off there, no error
