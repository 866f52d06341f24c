"""What stays refused around observations with images, checked without model weights (a byte-level ChatML
tokenizer): an environment's image on a text model (named), a malformed observation, a tool returning an image
(named), an engine without image inputs (the static engine) given an `ImageReply`, and agent settings that cannot
show a prompt's images."""

from __future__ import annotations

import pytest
import torch

from logitless.agents.environment import check_step
from logitless.agents.tools import AgentFatalError, function_tool, run_call
from logitless.data.prompts import PromptRow
from logitless.rollout.episodes import ImageReply, Replies, TurnEnd, checked_replies
from tests.agent_fixtures import chatml_tokenizer, make_agent, run_turns
from vlm_fixtures import shape_image

PLAY = [PromptRow([{"role": "user", "content": "Play."}])]


def test_an_image_observation_on_a_text_model_names_the_environment():
    tok = chatml_tokenizer()
    driver = make_agent(tok, environment="vlm_fixtures:CounterScreen").driver(PLAY, 1)
    driver.begin(1, 1)
    with pytest.raises(ValueError, match=r"agent.environment: CounterScreen.step\(\) holds an image, but the model is "
                                         "a text model"):
        run_turns(driver, tok, ["3<|im_end|>"])


@pytest.mark.parametrize("obs, message", [
    (3, "returned an observation of type int"), ([], "returned an observation of type list"),
    ([{"type": "image", "image": 3}], "returned the content block"), ([{"type": "text"}], "returned the content block"),
])
def test_a_malformed_observation_names_the_environment_step(obs, message):
    with pytest.raises(TypeError, match=r"Env\.step\(\) " + message):
        check_step("Env", (obs, None, False))
    blocks, reward, _ = check_step("Env", (shape_image(1), 1.0, False))  # a PIL image is one image block
    assert [b["type"] for b in blocks] == ["image"] and reward == 1.0


def screenshot() -> object:
    """Takes a screenshot."""
    return shape_image(2)


def test_a_tool_returning_an_image_stops_the_run_naming_the_tool():
    tool = function_tool(screenshot, {}, 5.0)
    with pytest.raises(AgentFatalError, match="the tool 'screenshot' returned an image"):
        run_call(tool, {}, None)


def test_an_engine_without_image_inputs_refuses_an_image_reply():
    reply = ImageReply([1, 2], {"pixel_values": torch.zeros(4, 3)})
    turns = [TurnEnd(0, [5], "eos", 10)]
    with pytest.raises(ValueError, match="row 0 holds images.*rollout.backend=hf"):
        checked_replies([reply], turns, 100)
    (got,) = checked_replies([reply], turns, 100, images=True)
    assert isinstance(got, ImageReply) and got.ids == [1, 2]
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        checked_replies([ImageReply([1, 200], reply.images)], turns, 100, images=True)

    class Once:
        turn_end_ids, turn_stops, max_turn_tokens = (), (), None

        def respond(self, turns):
            return [reply]

    replies = Replies(Once(), 100)  # as the static engine asks
    with pytest.raises(ValueError, match="holds images"):
        replies.submit(turns)


def test_a_prompts_image_needs_a_vision_language_model():
    tok = chatml_tokenizer()
    row = PromptRow([{"role": "user", "content": [{"type": "image", "image": shape_image(1)},
                                                  {"type": "text", "text": "Play."}]}])
    with pytest.raises(ValueError, match="prompt 0 holds an image, but the model is a text model"):
        make_agent(tok, environment="vlm_fixtures:CounterScreen").driver([row], 1)


@pytest.mark.parametrize("agent, message", [
    ({"driver": "tests.episode_driver:ScriptedDriver"}, "agent.driver=tests.episode_driver:ScriptedDriver: your own "
                                                        "driver renders the prompts"),
    ({"environment": "vlm_fixtures:CounterScreen", "format": "raw"}, "agent.format=raw: raw-text prompts cannot show"),
])
def test_agent_settings_that_cannot_show_a_prompts_image_are_refused(agent, message):
    from logitless.agents.options import AgentOptions
    from logitless.trainer.config.schema import TrainerConfig
    from logitless.trainer.policy.vision import check_image_rows

    cfg = TrainerConfig()
    cfg.rollout.backend = "hf"
    cfg.agent = AgentOptions(**agent)
    rows = [PromptRow([{"role": "user", "content": [{"type": "image", "image": shape_image(1)}]}])]
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check_image_rows(cfg, rows)
