"""Multi-turn episodes on the static engine: the KV cache lives across turns, observations are prefilled into it,
and the sampler's logprobs of the model's tokens equal the trainer's on the whole sequence (fp32, 1e-5), on full,
sliding-window and alternating layouts whose windows bite, with turns and observations of different lengths."""

from __future__ import annotations

import pytest
import torch

from logitless.models import completion_logprobs
from logitless.rollout import SamplingOptions, make_engine
from logitless.rollout.episodes import EpisodeDriver, EpisodeRecord, TurnEnd
from logitless.rollout import static_turns
from logitless.rollout.kv_cache import set_visible
from logitless.rollout.static_turns import relayout
from tests.test_rollout_families import TOK, make_model

PROMPTS = ["The quick brown fox", "Hi there, how are you?", "2+2 is"]


class ScriptedDriver:
    """Answers turn k of row r with an observation of 3 + (r + 2k) % 7 tokens, and ends row r's episode after
    1 + r % 3 turns: rows end at different turns, observations differ in length."""

    def __init__(self, turn_end_ids=(), max_turn_tokens: int | None = 6, turns: int = 3):
        self.turn_end_ids, self.turn_stops, self.max_turn_tokens = list(turn_end_ids), [], max_turn_tokens
        self.turns = turns
        self.seen: list[TurnEnd] = []

    def begin(self, num_rows: int, num_generations: int) -> None:
        self.count = [0] * num_rows

    def respond(self, turns: list[TurnEnd]) -> list[list[int] | None]:
        out = []
        for te in turns:
            self.seen.append(te)
            k = self.count[te.row]
            self.count[te.row] += 1
            if k + 1 >= 1 + te.row % self.turns:
                out.append(None)
            else:
                out.append([(te.row * 31 + k * 7 + j) % 250 for j in range(3 + (te.row + 2 * k) % 7)])
        return out

    def finish(self) -> list[EpisodeRecord]:
        return [EpisodeRecord(turns=c) for c in self.count]


def trainer_logprobs(model, b) -> torch.Tensor:
    with torch.no_grad():
        lp, _ = completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                                    temperature=0.9)
    return lp


@pytest.mark.parametrize("multiple", [1, static_turns.VISIBLE_MULTIPLE])
@pytest.mark.parametrize("family", ["llama", "qwen2_sliding", "mistral_window", "gemma2", "gpt2"])
def test_model_tokens_are_sampled_from_the_trainers_distribution_across_turns(family, multiple, monkeypatch):
    """Also with each observation's prefill reading only the slots it fills (multiple=1), not all the cache's."""
    monkeypatch.setattr(static_turns, "VISIBLE_MULTIPLE", multiple)
    seen = []
    monkeypatch.setattr(static_turns, "set_visible", lambda cache, n: seen.append((n, cache.layers[0].max_cache_len))
                        or set_visible(cache, n))
    model = make_model(family)
    driver = ScriptedDriver(turn_end_ids=range(40, 70))  # ~1/9 of the vocabulary ends a turn: turns of all lengths
    assert isinstance(driver, EpisodeDriver)
    engine = make_engine("static", model, TOK, check_every=2)
    b = engine.generate(PROMPTS, SamplingOptions(num_generations=2, temperature=0.9, max_new_tokens=40, seed=3,
                                                 ignore_eos=True), episodes=driver)
    reads, full = seen[0::2], seen[1::2]  # each prefill's visible slots, then the whole cache again
    assert all(n == L for n, L in full) and reads and all(n <= L for n, L in reads)
    assert multiple > 1 or all(n < L for n, L in reads)  # multiple=1: the prefills read fewer slots than the cache
    model_tok = b.loss_mask().bool()
    env = b.env_mask.bool() & b.completion_mask.bool()
    assert env.any() and model_tok.any()
    assert (b.sampler_logp[env] == 0).all()
    turns = [r.turns for r in b.episodes]
    assert turns == [1 + r % 3 for r in range(6)]  # each row ran the turns its script gave it
    lp = trainer_logprobs(model, b)
    diff = (lp - b.sampler_logp)[model_tok].abs()
    assert diff.max() < 1e-5, f"{family}: max |Δ logp| {diff.max():.2e} on model tokens"
    # the streams: each row's model turns and observations in order, as the driver saw and wrote them
    for r in range(6):
        ids = b.completion_ids[r][b.completion_mask[r].bool()].tolist()
        model_turns = [te.ids for te in driver.seen if te.row == r]
        assert [t for t, e in zip(ids, b.env_mask[r].tolist()) if not e] == sum(model_turns, [])


def test_a_one_turn_episode_draws_what_a_single_turn_rollout_draws():
    model = make_model("llama")

    class OneTurn(ScriptedDriver):
        def respond(self, turns):
            return [None] * len(turns)

    opts = SamplingOptions(num_generations=2, temperature=1.0, max_new_tokens=12, seed=9, ignore_eos=True)
    single = make_engine("static", model, TOK).generate(PROMPTS, opts)
    episode = make_engine("static", model, TOK).generate(PROMPTS, opts, episodes=OneTurn(max_turn_tokens=None))
    assert torch.equal(single.completion_ids, episode.completion_ids)
    assert torch.allclose(single.sampler_logp, episode.sampler_logp, atol=1e-6)
    assert not episode.env_mask.any() and not episode.truncated.any()


def test_an_episode_calls_profile_names_each_part_of_its_turns():
    """rollout.profile=true: the seconds of an episode call are split into its decode steps, its turns' host work,
    the driver's answers, the observations' prefills and the batch built after (as a single-turn call's are)."""
    model = make_model("llama")
    opts = SamplingOptions(num_generations=2, temperature=0.9, max_new_tokens=30, seed=5, ignore_eos=True)
    b = make_engine("static", model, TOK, profile=True).generate(PROMPTS, opts, episodes=ScriptedDriver())
    around = {"prepare", "weights_sync", "weights_release", "release_gc", "release_cache", "batch"}
    assert set(b.timing.parts) == {"prefill", "step", "turn_host", "respond", "observation"} | around
    assert all(v >= 0 for v in b.timing.parts.values())
    assert b.env_mask.any()  # observations were prefilled


def test_budgets_end_turns_and_episodes_and_mark_truncation():
    model = make_model("llama")

    class LongReplies(ScriptedDriver):
        def respond(self, turns):
            self.seen += turns
            return [list(range(100, 120)) for _ in turns]  # 20 tokens each time, never ends by itself

    driver = LongReplies(max_turn_tokens=5)
    b = make_engine("static", model, TOK).generate(
        PROMPTS[:1], SamplingOptions(num_generations=2, temperature=0.9, max_new_tokens=33, seed=1, ignore_eos=True),
        episodes=driver)
    assert (b.completion_mask.sum(1) == 33).all()  # the budget bounds model and observation tokens together
    assert b.truncated.all() and not b.finished.any()
    # turn (5) + observation (20) + turn (5) leave 3 tokens: the second observation is cut to them, no third turn
    assert [(te.ended, len(te.ids), te.room) for te in driver.seen] == [("length", 5, 28)] * 2 + [("length", 5, 3)] * 2
    assert b.env_mask[:, -3:].all() and b.env_mask[:, 5:25].all() and not b.env_mask[:, 25:30].any()
    lp = trainer_logprobs(model, b)
    assert (lp - b.sampler_logp)[b.loss_mask().bool()].abs().max() < 1e-5


def test_relayout_right_aligns_each_rows_visible_slots_in_order():
    from transformers import DynamicCache

    from logitless.rollout.kv_cache import decode_cache

    pre = DynamicCache()
    k = torch.arange(2 * 1 * 6 * 2, dtype=torch.float32).view(2, 1, 6, 2)
    pre.update(k, -k, 0)
    cache = decode_cache(pre, torch.tensor([0, 1]), 8)
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 1, 1], [1, 1, 0, 0, 0, 1, 0, 0]])
    end = relayout(cache, mask, 6)
    assert end == 3  # row 0 has 3 visible slots below 6, row 1 has 3
    assert mask[:, :3].tolist() == [[1, 1, 1], [1, 1, 1]]
    keys = cache.layers[0].keys
    assert keys[0, 0, :3, 0].tolist() == k[0, 0, [1, 2, 4], 0].tolist()
    assert keys[1, 0, :3, 0].tolist() == k[1, 0, [0, 1, 5], 0].tolist()
    assert cache.layers[0].values[1, 0, :3, 1].tolist() == (-k)[1, 0, [0, 1, 5], 1].tolist()
    assert int(cache.layers[0].cumulative_length) == 3


def test_relayout_moves_nothing_where_every_visible_slot_is_in_place():
    """Rows right-aligned already (equal turn lengths): the keys and values stay, read by no gather; the mask and
    the write position are set as when slots move."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import DynamicCache

    from logitless.rollout.kv_cache import decode_cache

    pre = DynamicCache()
    k = torch.randn(2, 1, 6, 2)
    pre.update(k, -k, 0)
    for rows, moved in (([[0, 1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0, 1, 1]], False),
                        ([[1, 0, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0, 1, 1]], True)):  # row 0: slot 0 goes to 1
        cache = decode_cache(pre, torch.tensor([0, 1]), 8)
        mask = torch.tensor(rows)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            end = relayout(cache, mask, 4)
        gathers = sum(e.count for e in prof.key_averages() if e.key == "aten::gather")
        assert gathers == (1 + 2 * len(cache.layers) if moved else 1)  # the slot order, then each layer's K and V
        assert end == 4 and int(cache.layers[0].cumulative_length) == 4
        assert mask[:, :4].tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]
        keys = cache.layers[0].keys
        assert torch.equal(keys[1, :, :4], k[1, :, :4]) and torch.equal(keys[0, :, 2:4], k[0, :, 2:4])
        assert torch.equal(keys[0, :, 1], k[0, :, 0] if moved else k[0, :, 1])


def test_the_static_engine_refuses_what_its_episodes_cannot_do():
    model = make_model("llama")
    engine = make_engine("static", model, TOK)
    with pytest.raises(ValueError, match=r"rollout\.repetition_penalty .* use rollout\.backend=hf"):
        engine.generate(PROMPTS, SamplingOptions(repetition_penalty=1.2, max_new_tokens=4), episodes=ScriptedDriver())
    with pytest.raises(TypeError, match="does not implement"):
        engine.generate(PROMPTS, SamplingOptions(max_new_tokens=4), episodes=object())


def test_driver_mistakes_are_named_as_on_the_hf_engine():
    """The static engine checks a driver's replies and records with the hf engine's checks (one per fault)."""
    engine = make_engine("static", make_model("llama"), TOK)
    options = SamplingOptions(num_generations=2, max_new_tokens=12, seed=0, ignore_eos=True)

    class Short(ScriptedDriver):
        def respond(self, turns):
            return super().respond(turns)[:-1]

    class Reply(ScriptedDriver):
        def __init__(self, reply):
            super().__init__(max_turn_tokens=3)
            self.reply = reply

        def respond(self, turns):
            return [self.reply for _ in turns]

    class NoRecords(ScriptedDriver):
        def finish(self):
            return super().finish()[:-2]

    class Dicts(ScriptedDriver):
        def finish(self):
            return [{"turns": 1} for _ in self.count]

    with pytest.raises(ValueError, match="answered 5 replies to 6 turns"):
        engine.generate(PROMPTS, options, episodes=Short())
    with pytest.raises(ValueError, match="row 0 holds token id 999, outside the model's vocabulary of 258"):
        engine.generate(PROMPTS, options, episodes=Reply([5, 999]))
    with pytest.raises(TypeError, match="reply for row 0 must be a list of token ids or None, got 'text'"):
        engine.generate(PROMPTS, options, episodes=Reply("text"))
    with pytest.raises(ValueError, match="finish\\(\\) returned 4 records for 6 episodes"):
        engine.generate(PROMPTS, options, episodes=NoRecords())
    with pytest.raises(TypeError, match="finish\\(\\) record 0 must be an EpisodeRecord, got dict"):
        engine.generate(PROMPTS, options, episodes=Dicts())
    with pytest.raises(ValueError, match="max_turn_tokens=0 must be a positive int or None"):
        engine.generate(PROMPTS, options, episodes=ScriptedDriver(max_turn_tokens=0))
    # a tensor reply is taken as its ids
    b = engine.generate(PROMPTS, options, episodes=Reply(torch.tensor([7, 8])))
    assert b.env_mask.any() and (b.completion_ids[b.env_mask.bool()] < 9).all()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen2_sliding"])
def test_compiled_episodes_on_cuda_match_the_trainer_as_single_turn_decoding_does(family):
    """On CUDA at the engine's defaults (compiled step, step graph, Triton kernels), bf16: the episodes decode
    through their captured step graph, and their mismatch with the trainer on model tokens stays within 1.5x (mean)
    and 2x (max) of a single-turn rollout's with the same engine, model and token count, measured in the same test."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = make_model(family).to("cuda", torch.bfloat16)

    def mismatch(b):
        b = b.to("cuda")
        with torch.no_grad():
            lp, _ = completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                                        temperature=1.0)
        d = (lp - b.sampler_logp)[b.loss_mask().bool()].abs()
        return float(d.mean()), float(d.max())

    from logitless.rollout import step_graph

    captured = []
    real = step_graph.capture

    def counted(fn, side):
        graph = real(fn, side)
        captured.append(1)
        return graph

    engine = make_engine("static", model, TOK)
    opts = SamplingOptions(num_generations=8, temperature=1.0, max_new_tokens=64, seed=2, ignore_eos=True)
    single = mismatch(engine.generate(PROMPTS, opts))
    driver = ScriptedDriver(turn_end_ids=range(40, 70), max_turn_tokens=12, turns=4)
    step_graph.capture = counted
    try:
        b = engine.generate(PROMPTS, opts, episodes=driver)
    finally:
        step_graph.capture = real
    # the episodes' one wave decoded through its captured step (30 turn-end ids: torch.isin's sort, a device sync,
    # failed this capture until the step compared ids by broadcasting)
    assert captured == [1]
    assert b.env_mask.any() and max(r.turns for r in b.episodes) >= 3
    multi = mismatch(b)
    assert multi[0] <= 1.5 * single[0] and multi[1] <= 2 * single[1], (family, multi, single)
