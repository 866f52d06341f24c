"""Model-based rewards (`model:PATH` reward models, `judge:PATH` LLM judges) and async reward functions: tiny
random models built from configs, saved and loaded by path; batched scores equal one-sample forwards; a failing
judge reply follows reward.on_error; async functions run concurrently; all of them score a real training run."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from logitless.rewards import RewardFunctionError, get_reward_fn, score_completions
from logitless.rewards.models import Judge, RewardModel
from logitless.trainer.config.schema import load_train_config
from logitless.trainer.loop import train
from logitless.trainer.preflight import validate_config
from tests.conftest import TINY_LORA_QUIET, reward_module, tiny_qwen2

VOCAB = 50_257
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _config(**kw):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256, **kw)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, gpt2_tokenizer):
    """A tiny sequence-classification reward model and a tiny causal-LM judge, each with a GPT-2 tokenizer that has
    a chat template, saved in folders as a user's would be."""
    from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification

    root = tmp_path_factory.mktemp("reward_models")
    tok = copy.deepcopy(gpt2_tokenizer)
    tok.chat_template = CHAT
    torch.manual_seed(1)
    Qwen2ForSequenceClassification(_config(num_labels=1)).save_pretrained(root / "rm")
    Qwen2ForCausalLM(_config()).save_pretrained(root / "judge")
    for name in ("rm", "judge"):
        tok.save_pretrained(root / name)
    return root


PROMPTS = ["1 + 2 =", "What is 12 - 5?", "7 =", "A much longer prompt, so that the rows of a batch pad: 3 + 4 ="]
COMPLETIONS = [" 3", " 7, since 12 - 5 = 7.", " x", " 7"]


def test_reward_model_batched_equals_one_row_forwards(saved):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm = get_reward_fn(f"model:{saved / 'rm'}", batch_size=3)
    assert isinstance(rm, RewardModel) and rm.__name__ == "rm"
    got = rm(PROMPTS, COMPLETIONS)
    model = AutoModelForSequenceClassification.from_pretrained(saved / "rm").eval()
    tok = AutoTokenizer.from_pretrained(saved / "rm")
    want = []
    for p, c in zip(PROMPTS, COMPLETIONS):  # the oracle: one unpadded row at a time
        ids = tok(p + c, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            want.append(model(input_ids=ids).logits[0, 0].item())
    assert got == pytest.approx(want, abs=1e-5) and len(set(got)) == 4


def test_reward_model_reads_chat_prompts_through_its_chat_template(saved):
    rm = RewardModel(str(saved / "rm"))
    rm.load("cpu")
    messages = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    assert rm.texts(messages, COMPLETIONS[:2]) == [
        f"<|user|>{p}\n<|assistant|>{c}\n" for p, c in zip(PROMPTS[:2], COMPLETIONS[:2])]
    chat = rm(messages, COMPLETIONS[:2])
    assert chat == pytest.approx([rm([t], [""])[0] for t in rm.texts(messages, COMPLETIONS[:2])], abs=1e-5)


def test_yes_no_judge_equals_the_probability_of_yes(saved):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    judge = get_reward_fn(f"judge:{saved / 'judge'}", batch_size=3, template="Q: {prompt}\nA: {completion}\nRight? ({answer})")
    got = judge(PROMPTS, COMPLETIONS, answer=["3", "7", "7", "7"])
    model = AutoModelForCausalLM.from_pretrained(saved / "judge").eval()
    tok = AutoTokenizer.from_pretrained(saved / "judge")
    yes = sorted({tok(w)["input_ids"][0] for w in ("Yes", " Yes", "yes", " yes")})
    no = sorted({tok(w)["input_ids"][0] for w in ("No", " No", "no", " no")})
    for p, c, a, g in zip(PROMPTS, COMPLETIONS, ["3", "7", "7", "7"], got):
        text = f"<|user|>Q: {p}\nA: {c}\nRight? ({a})\n<|assistant|>"  # the judge's chat template
        with torch.no_grad():
            probs = torch.softmax(model(**tok(text, return_tensors="pt")).logits[0, -1].float(), -1)
        assert g == pytest.approx((probs[yes].sum() / (probs[yes].sum() + probs[no].sum())).item(), abs=1e-5)
    assert all(0 < g < 1 for g in got)


def test_number_judge_parses_scores_and_reports_unparsable_replies(saved):
    judge = Judge(str(saved / "judge"), parser="number", score_range=[1, 5], max_new_tokens=3)
    assert judge.parse("Score: 4 of 5") == 0.75 and judge.parse("1") == 0.0
    assert "holds no score" in str(judge.parse("no idea")) and "outside score_range" in str(judge.parse("9"))
    with pytest.raises(RewardFunctionError, match=r"reward function 'judge' raised ValueError: judge reply .* on sample 0"):
        score_completions([judge], None, PROMPTS, COMPLETIONS, [{}] * 4)  # a random judge writes no number
    scores = score_completions([judge], None, PROMPTS, COMPLETIONS, [{}] * 4, on_error="penalty", penalty=-1.0)
    assert scores.num_errors == [4] and scores.rewards.view(-1).tolist() == [-1.0] * 4


def test_model_reward_options_are_checked(saved):
    with pytest.raises(ValueError, match=r"has no option 'batchsize'; its options are \['device', 'dtype', 'batch_size'"):
        get_reward_fn(f"model:{saved / 'rm'}", batchsize=4)
    with pytest.raises(ValueError, match=r"template must contain '\{completion\}'"):
        get_reward_fn(f"judge:{saved / 'judge'}", template="{prompt}")
    with pytest.raises(ValueError, match=r"parser must be 'yes_no' or 'number'"):
        get_reward_fn(f"judge:{saved / 'judge'}", parser="likert")


ASYNC_MODULE = '''
import asyncio

EVENTS = {}
CALLS = []

def _events():
    loop = asyncio.get_running_loop()
    return EVENTS.setdefault(id(loop), (asyncio.Event(), asyncio.Event()))

async def ping(prompts, completions, **fields):
    """Waits for pong: it returns only if pong runs at the same time (sequential calls would time out)."""
    a, b = _events()
    a.set()
    await asyncio.wait_for(b.wait(), 5)
    return [float(len(c)) for c in completions]

async def pong(prompts, completions, **fields):
    a, b = _events()
    b.set()
    await asyncio.wait_for(a.wait(), 5)
    return [1.0] * len(completions)

async def slow(prompts, completions, **fields):
    await asyncio.sleep(60)  # a call that hangs (a judging API that never answers)
    return [0.0] * len(completions)

async def flaky(prompts, completions, **fields):
    """Raises for the batch and for completions holding 'x': the per-sample rerun finds them."""
    CALLS.append(len(completions))
    if len(completions) > 1 or "x" in completions[0]:
        raise KeyError("x")
    return [0.5]
'''


@pytest.fixture
def async_module(tmp_path, monkeypatch):
    reward_module(tmp_path, monkeypatch, "async_rewards", ASYNC_MODULE)
    import async_rewards

    return async_rewards


def test_async_reward_functions_run_concurrently(async_module):
    fns = [get_reward_fn("async_rewards:ping"), get_reward_fn("numeric_answer"), get_reward_fn("async_rewards:pong")]
    s = score_completions(fns, None, PROMPTS, COMPLETIONS, [{"answer": "3"}] * 4)
    assert s.rewards[:, 0].tolist() == [float(len(c)) for c in COMPLETIONS] and s.rewards[:, 2].tolist() == [1.0] * 4
    assert s.rewards[:, 1].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_async_reward_errors_follow_on_error(async_module):
    fn = [get_reward_fn("async_rewards:flaky")]
    with pytest.raises(RewardFunctionError, match=r"'flaky' raised KeyError: 'x' on sample 2"):
        score_completions(fn, None, PROMPTS, COMPLETIONS, [{}] * 4)
    s = score_completions(fn, None, PROMPTS, COMPLETIONS, [{}] * 4, on_error="penalty", penalty=-2.0)
    assert s.rewards.view(-1).tolist() == [0.5, 0.5, -2.0, 0.5] and s.num_errors == [1]

    async def main():  # also from inside a running event loop (a notebook)
        return score_completions(fn, None, PROMPTS, COMPLETIONS, [{}] * 4, on_error="penalty", penalty=-2.0)

    assert asyncio.run(main()).rewards.view(-1).tolist() == [0.5, 0.5, -2.0, 0.5]


def test_async_reward_past_reward_timeout_is_cancelled(async_module):
    fn = [get_reward_fn("async_rewards:slow"), get_reward_fn("async_rewards:pong")]
    with pytest.raises(RewardFunctionError, match=r"'slow' did not return within reward.timeout_s=0.2 s on a batch "
                                                  r"of 4 completions"):
        score_completions(fn[:1], None, PROMPTS, COMPLETIONS, [{}] * 4, timeout_s=0.2)
    s = score_completions(fn[:1], None, PROMPTS, COMPLETIONS, [{}] * 4, on_error="penalty", penalty=-1.0, timeout_s=0.2)
    assert s.rewards.view(-1).tolist() == [-1.0] * 4 and s.num_errors == [4] and "timeout_s" in s.error_texts[0]


def test_reward_model_judge_and_async_functions_score_a_training_run(saved, gpt2_tokenizer, async_module, tmp_path,
                                                                     one_thread):
    tok = copy.deepcopy(gpt2_tokenizer)
    tok.pad_token, tok.padding_side = tok.eos_token, "left"
    rm, judge = f"model:{saved / 'rm'}", f"judge:{saved / 'judge'}"
    cfg = load_train_config(None, [
        f"train.output_dir={tmp_path / 'run'}", "train.max_steps=2", "train.prompts_per_step=2",
        "train.micro_batch_size=8", "rollout.num_generations=4", "rollout.max_completion_length=4",
        "data.options={difficulty: 1, n: 40, chat: false}", *TINY_LORA_QUIET, "checkpoint.save_steps=0",
        f"reward.reward_funcs=[numeric_answer, '{rm}', '{judge}', 'async_rewards:ping', 'async_rewards:pong']",
        f"reward.reward_options={{'{rm}': {{batch_size: 3}}, '{judge}': {{template: 'Is {{completion}} the value of "
        f"{{prompt}} ({{answer}})?'}}}}",
        "reward.reward_weights=[1.0, 0.5, 2.0, 0.0, 0.0]", "optim.learning_rate=0.05",
    ])
    validate_config(cfg)
    records = train(cfg, model=tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1), tokenizer=tok).records
    for r in records:
        assert r["reward/rm/std"] > 0 and 0 < r["reward/judge/mean"] < 1 and r["reward/judge/std"] > 0
        assert r["reward/mean"] == pytest.approx(
            r["reward/numeric_answer/mean"] + 0.5 * r["reward/rm/mean"] + 2.0 * r["reward/judge/mean"], abs=1e-5)
        assert r["reward/pong/mean"] == 1.0 and r["grad_norm"] > 0


@pytest.mark.gpu
def test_reward_model_and_judge_run_in_bf16_on_the_gpu(saved):
    """On CUDA the models load in bf16 on the named device; scores stay close to the fp32 CPU ones."""
    rm_cpu, rm_gpu = RewardModel(str(saved / "rm"), device="cpu"), RewardModel(str(saved / "rm"), device="cuda")
    judge_cpu, judge_gpu = Judge(str(saved / "judge"), device="cpu"), Judge(str(saved / "judge"), device="cuda")
    for fn in (rm_gpu, judge_gpu):
        fn.load("cpu")  # the option wins over the training device
        assert fn.device.type == "cuda" and next(fn.model.parameters()).dtype == torch.bfloat16
    assert rm_gpu(PROMPTS, COMPLETIONS) == pytest.approx(rm_cpu(PROMPTS, COMPLETIONS), abs=0.05)
    assert judge_gpu(PROMPTS, COMPLETIONS) == pytest.approx(judge_cpu(PROMPTS, COMPLETIONS), abs=0.02)


def test_a_missing_reward_model_is_refused_before_anything_loads(tmp_path, monkeypatch):
    from logitless.trainer.checks.sources import SourceError, check_sources

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing = tmp_path / "nowhere" / "rm"
    cfg = load_train_config(None, [f"reward.reward_funcs=[numeric_answer, 'model:{missing}']"])
    with pytest.raises(SourceError, match=rf"reward.reward_funcs 'model:{missing}': '{missing}': no such folder"):
        check_sources(cfg)
    cfg = load_train_config(None, ["reward.reward_funcs=[numeric_answer, 'judge:nobody/no-such-judge-model']"])
    with pytest.raises(SourceError, match=r"reward.reward_funcs 'judge:nobody/no-such-judge-model': model "
                                          r"'nobody/no-such-judge-model' is not in the local Hugging Face cache"):
        check_sources(cfg)
