"""Screenshot-style episodes on a tiny random Qwen2.5-VL and Qwen3-VL (fp32, CPU, `hf` engine): an environment's step returns an
image beside text, the driver appends it through the processor, and later turns and the trainer see every image of
the row. Oracles: the processor's own rendering of the whole conversation, the trainer's forward (sampler logprobs
at 1e-5), the model's own `get_rope_index` over each whole row, and zero gradient at the image tokens."""

from __future__ import annotations

import pytest
import torch

from logitless.agents import Agent, AgentOptions
from logitless.data import PromptRow
from logitless.models import completion_logprobs
from logitless.rollout import SamplingOptions, make_engine
from logitless.trainer.batching import make_micro_batches
from vlm_fixtures import backward_through, build_tiny_vlm, favour_turn_ends, lora_vlm, shape_image

G = 2


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vlm(request, qwen_tokenizer_dir, tmp_path_factory):
    model, tok, processor = lora_vlm(qwen_tokenizer_dir, tmp_path_factory.mktemp("vlm") / "model", request.param)
    favour_turn_ends(model, tok.convert_tokens_to_ids("<|im_end|>"))
    return model, tok, processor


def prompts():
    """A text prompt and one with an image: observations' images come after the prompt's."""
    return [PromptRow([{"role": "user", "content": "Play the counting game."}]),
            PromptRow([{"role": "user", "content": [{"type": "image", "image": shape_image(2, 1)},
                                                    {"type": "text", "text": "Start from this screen."}]}])]


@pytest.fixture(scope="module")
def episodes(vlm):
    model, tok, processor = vlm
    agent = Agent(tok, AgentOptions(environment="vlm_fixtures:CounterScreen", max_turns=3, max_turn_tokens=4),
                  processor=processor)
    driver = agent.driver(prompts(), G)
    engine = make_engine("hf", model, processor)
    options = SamplingOptions(num_generations=G, temperature=1.0, max_new_tokens=80, seed=1)
    return engine.generate(driver.prompt_ids, options, episodes=driver), driver


def test_observation_images_reach_the_batch(vlm, episodes):
    model = vlm[0]
    b, driver = episodes
    image_id = model.get_base_model().config.image_token_id
    assert b.images is not None and len(b.images) == 2 * G
    counts = []
    for r in range(2 * G):
        row = b.images.rows[r]
        ids = torch.cat([b.prompt_ids[r][b.prompt_mask[r].bool()], b.completion_ids[r][b.completion_mask[r].bool()]])
        expected = 0 if row is None else int(row["image_grid_thw"].prod(-1).sum()) // 4
        assert int((ids == image_id).sum()) == expected, r
        counts.append(0 if row is None else row["image_grid_thw"].shape[0])
        assert torch.equal((b.completion_ids[r] == image_id) & b.env_mask[r].bool(), b.completion_ids[r] == image_id)
    assert max(counts) >= 3, counts  # some episode saw the prompt's image and two screens (turns of 2 sizes)
    assert all(m.get("content") != [] for r in driver.finish() for m in r.messages)


def test_the_sequence_is_the_processors_rendering_of_the_whole_conversation(vlm, episodes):
    """Each row (cut before its last model turn) equals the processor's rendering of its conversation with all its
    images, model turns replaced by a sentinel on both sides."""
    _, tok, processor = vlm
    b, driver = episodes
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    sentinel = tok("SENTINEL", add_special_tokens=False)["input_ids"]
    checked = 0
    for r, record in enumerate(driver.finish()):
        env = b.env_mask[r][b.completion_mask[r].bool()].tolist()
        comp = b.completion_ids[r][b.completion_mask[r].bool()].tolist()
        ours = b.prompt_ids[r][b.prompt_mask[r].bool()].tolist()
        k, turns = 0, 0
        while k < len(comp):
            j = k
            while j < len(comp) and env[j] == env[k]:
                j += 1
            if env[k] == 0:
                if j == len(comp):
                    break  # the last model turn: the reference stops at its generation prompt
                assert comp[j - 1] == im_end
                ours += sentinel + [im_end]
                turns += 1
            else:
                ours += comp[k:j]
            k = j
        messages = [dict(m) for m in driver.prompts[r // G]]
        screens = list(prompt_refs(messages))
        shown = [m for m in record.messages if m["role"] == "user"][:turns]
        for n, obs in enumerate(shown, start=1):
            screen = shape_image(n, size=56 + 28 * (n % 2))  # CounterScreen's n-th screen
            content = [{"type": "image", "image": screen} if blk["type"] == "image" else blk for blk in obs["content"]]
            messages += [{"role": "assistant", "content": "SENTINEL"}, {"role": "user", "content": content}]
            screens.append(screen)
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ref = processor(text=[text], images=screens or None, return_tensors="pt")["input_ids"][0].tolist()
        assert ours == ref, r
        checked += turns > 0
    assert checked >= 2


def prompt_refs(messages):
    for m in messages:
        for blk in m["content"] if isinstance(m["content"], list) else []:
            if blk["type"] == "image":
                yield blk["image"]


def test_trainer_reproduces_the_samplers_logprobs_with_every_image(vlm, episodes):
    model = vlm[0]
    b, _ = episodes
    B = b.completion_ids.shape[0]
    trained = b.completion_mask.bool() & ~b.env_mask.bool()
    args = (b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask, b.sampler_logp, b.truncated,
            torch.zeros(B))
    with torch.no_grad():
        for size in (1, B):
            got = torch.zeros_like(b.sampler_logp)
            for m in make_micro_batches(*args, size, images=b.images):
                logp, _ = completion_logprobs(model, m.prompt_ids, m.prompt_mask, m.completion_ids, m.completion_mask,
                                              **m.inputs)
                got[m.rows, : logp.shape[1]] = logp
            err = (got - b.sampler_logp)[trained].abs().max()
            assert err <= 1e-5, (size, err)
        with pytest.raises(ValueError, match="image placeholder tokens but no images"):  # the images are needed
            completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask)


def test_image_tokens_get_no_gradient_and_positions_are_the_whole_rows(vlm, episodes):
    model = vlm[0]
    base = model.get_base_model()
    b, _ = episodes
    positions, hidden = backward_through(model, b, b.completion_mask * (1 - b.env_mask))
    grad = hidden.grad
    ids = torch.cat([b.prompt_ids, b.completion_ids], 1)
    image = ids == base.config.image_token_id
    assert image[:, b.prompt_ids.shape[1]:].sum() > 0 and grad[image].abs().max() == 0
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in model.parameters() if p.requires_grad)
    mask = torch.cat([b.prompt_mask, b.completion_mask], 1).bool()
    for r in range(ids.shape[0]):
        row = ids[r][mask[r]][None]
        grid = b.images.rows[r]["image_grid_thw"] if b.images.rows[r] else None
        own, _ = base.model.get_rope_index(row, mm_token_type_ids=(row == base.config.image_token_id).long(),
                                           image_grid_thw=grid)
        assert torch.equal(positions[:, r][:, mask[r]], own[:, 0]), r


def test_train_two_steps_with_a_screenshot_environment(tmp_path, qwen_tokenizer_dir):
    """`logitless train`: count_shapes prompts (an image each) played as CounterScreen episodes (a screen per step),
    rows packed (each its own M-RoPE positions over all its images), the environment's reward; the trainer's
    forwards reproduce the sampler's logprobs."""
    import json

    import yaml
    from transformers import AutoModelForImageTextToText

    from logitless.cli import main

    folder = build_tiny_vlm(qwen_tokenizer_dir, tmp_path / "model")
    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32)
    favour_turn_ends(model, 151645, target=0.3)  # <|im_end|>: turns of a few tokens
    model.save_pretrained(str(folder))
    cfg = {
        "model": {"name_or_path": str(folder), "lora_r": 4, "lora_alpha": 8, "dtype": "float32"},
        "data": {"task": "count_shapes", "options": {"n": 8, "size": 56}},
        "reward": {"reward_funcs": ["length_target"], "reward_options": {"length_target": {"target": 30}}},
        "agent": {"environment": "vlm_fixtures:CounterScreen", "max_turns": 3, "max_turn_tokens": 4,
                  "trace_episodes": 4},
        "rollout": {"backend": "hf", "num_generations": 2, "max_completion_length": 48},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "prompts_per_step": 2, "packed": True},
        "logging": {"tensorboard": False, "progress": False},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path)]) == 0
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if "trained_rows" in line]
    assert [s["step"] for s in steps] == [1, 2] and all(s["rollout/mismatch_max"] < 1e-4 for s in steps)
    traces = [json.loads(line) for line in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    assert any(t["turns"] >= 2 for t in traces)
    assert any(blk == {"type": "image"} for t in traces for m in t["messages"] if isinstance(m["content"], list)
               for blk in m["content"])
