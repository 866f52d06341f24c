"""Model-based rewards: a sequence-classification reward model (`model:NAME_OR_PATH`) and an LLM judge
(`judge:NAME_OR_PATH`), each a reward function `(prompts, completions, **row_fields) -> list[float]`.

    reward:
      reward_funcs: [numeric_answer, "model:Skywork/Skywork-Reward-V2-Qwen3-0.6B", "judge:Qwen/Qwen3-0.6B"]
      reward_options:
        "model:Skywork/Skywork-Reward-V2-Qwen3-0.6B": {batch_size: 16, device: "cuda:1"}
        "judge:Qwen/Qwen3-0.6B": {parser: number, score_range: [0, 10]}

`RewardModel` is TRL's reward-model path: prompt + completion (chat prompts: the conversation with the completion as
the assistant's turn, through the reward model's own chat template) scored by `AutoModelForSequenceClassification`,
the logit of `label` (0) as the reward; batched (`batch_size`), right-padded, truncated from the left at
`max_length` so the completion's end is kept.

`Judge` asks a causal LM about each completion with a prompt template (`template`, a str.format string with
{prompt}, {completion} and any row field such as {answer}), through the judge's chat template when it has one:
- `parser: yes_no` (default): one forward pass, no generation; the reward is P(yes) / (P(yes) + P(no)) at the
  judge's next token, the probabilities summed over the first tokens of "Yes", " Yes", "yes", " yes" (and No).
  It always yields a number in [0, 1].
- `parser: number`: greedy generation of up to `max_new_tokens` tokens; the first match of `pattern` (a number) is
  the score, mapped from `score_range` [lo, hi] to [0, 1]. A reply with no number or one outside the range is an
  error of that sample: reward.on_error decides (raise, or error_penalty), never a silent 0.

Both load their weights once (`load`, called by the trainer with the training device before the first step, or at
the first call), on `device` (None: the training device) in `dtype` ("auto": bf16 on CUDA, fp32 elsewhere). Before
the policy loads, `check` reads their config and tokenizer (no weights): a `model:` that names a causal LM (its score
head would be random) or a `judge:` that names a sequence classifier is refused.
"""

from __future__ import annotations

import inspect
import re
import string
from pathlib import Path
from typing import Any, Literal, Sequence

import torch

# architectures with a score head instead of an LM head (transformers' names end so)
SCORE_ARCHITECTURES = ("ForSequenceClassification", "ForRewardModel", "RewardModel")
YES_NO_TEMPLATE = (
    "Here is a question and an answer.\n\nQuestion:\n{prompt}\n\nAnswer:\n{completion}\n\n"
    "Is the answer correct and well reasoned? Reply with Yes or No."
)
NUMBER_TEMPLATE = (
    "Here is a question and an answer.\n\nQuestion:\n{prompt}\n\nAnswer:\n{completion}\n\n"
    "Rate the answer from 0 (wrong) to 10 (perfect). Reply with the number only."
)


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _prompt_text(prompt: Any) -> str:
    """A prompt as text: raw text as is; chat messages as "role: content" lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


class _ModelReward:
    """Shared parts: name, device, dtype, lazy loading."""

    kind = ""

    def __init__(self, name_or_path: str, *, device: str | None, dtype: str, batch_size: int, revision: str | None,
                 trust_remote_code: bool):
        if not name_or_path:
            raise ValueError(f"reward '{self.kind}:': give a hub name or a local folder after '{self.kind}:'")
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"reward '{self.kind}:{name_or_path}': dtype must be auto, float32, bfloat16 or float16, "
                             f"got {dtype!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"reward '{self.kind}:{name_or_path}': batch_size must be a positive int, got {batch_size!r}")
        self.name_or_path, self.device_name, self.dtype_name = name_or_path, device, dtype
        self.batch_size, self.revision, self.trust_remote_code = batch_size, revision, trust_remote_code
        self.__name__ = Path(name_or_path.rstrip("/")).name or name_or_path  # the metric name: reward/<name>/mean
        self.model: Any = None
        self.tokenizer: Any = None

    def load(self, device: torch.device | str | None = None) -> None:
        """Load the weights (once) on `device` option, else `device`, else the CPU."""
        if self.model is not None:
            return
        dev = torch.device(self.device_name or device or "cpu")
        from transformers import AutoTokenizer

        kw = {"revision": self.revision, "trust_remote_code": self.trust_remote_code}
        self.tokenizer = self._tokenizer(AutoTokenizer.from_pretrained(self.name_or_path, **kw))
        self.model = self._load_model(dtype=_dtype(self.dtype_name, dev), **kw).to(dev).eval()
        self.model.requires_grad_(False)

    def _tokenizer(self, tok: Any) -> Any:
        """`tok` with a pad token (its EOS when it has none: batches are padded), before the model is built."""
        if tok.pad_token_id is None:
            if tok.eos_token is None:
                raise ValueError(f"reward '{self.kind}:{self.name_or_path}': its tokenizer has neither a pad nor an "
                                 "EOS token, so its batches cannot be padded; set pad_token in the tokenizer's files "
                                 "(tokenizer_config.json), or reward_options batch_size: 1")
            tok.pad_token = tok.eos_token
        return tok

    def check(self) -> None:
        """What can be checked without the weights, before the policy loads: the kind of model its config.json
        names (`_check_config`) and its tokenizer (a pad or EOS token). ValueError naming the reward and the fix."""
        from transformers import AutoConfig, AutoTokenizer

        kw = {"revision": self.revision, "trust_remote_code": self.trust_remote_code}
        self._check_config(AutoConfig.from_pretrained(self.name_or_path, **kw))
        self._tokenizer(AutoTokenizer.from_pretrained(self.name_or_path, **kw))

    def _check_config(self, config: Any) -> None:
        raise NotImplementedError

    def _load_model(self, **kw: Any) -> Any:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


class RewardModel(_ModelReward):
    """`model:NAME_OR_PATH`: the logit `label` of a sequence-classification model on prompt + completion."""

    kind = "model"

    def __init__(self, name_or_path: str, *, device: str | None = None, dtype: str = "auto", batch_size: int = 32,
                 max_length: int | None = None, label: int = 0, revision: str | None = None,
                 trust_remote_code: bool = False):
        super().__init__(name_or_path, device=device, dtype=dtype, batch_size=batch_size, revision=revision,
                         trust_remote_code=trust_remote_code)
        self.max_length, self.label = max_length, label

    def _check_config(self, config: Any) -> None:
        """Refuse a model whose config names only architectures without a score head (a causal LM): loaded as a
        sequence classifier, its head would be random weights and every reward noise."""
        names = list(getattr(config, "architectures", None) or [])
        if names and not any(a.endswith(SCORE_ARCHITECTURES) for a in names):
            raise ValueError(
                f"reward.reward_funcs 'model:{self.name_or_path}': its config names the architecture(s) {names}, "
                "not a sequence-classification reward model, so its score head would be randomly initialised and "
                "the rewards noise. Name a reward model (architectures ending in ForSequenceClassification, e.g. "
                f"Skywork/Skywork-Reward-V2-Qwen3-0.6B), or ask this model as an LLM judge: 'judge:{self.name_or_path}'"
            )

    def _load_model(self, **kw: Any) -> Any:
        from transformers import AutoModelForSequenceClassification

        model, info = AutoModelForSequenceClassification.from_pretrained(self.name_or_path, output_loading_info=True,
                                                                         **kw)
        head = [k for k in info.get("missing_keys", []) if k.split(".")[0] in ("score", "classifier")]
        if head:  # a checkpoint without a score head (its config named none): the head would be random
            raise ValueError(
                f"reward.reward_funcs 'model:{self.name_or_path}': its weights hold no score head ({head[0]} is "
                "missing), so it is not a trained reward model and its rewards would be noise. Name a reward model, "
                f"or ask this model as an LLM judge: 'judge:{self.name_or_path}'"
            )
        if model.config.pad_token_id is None:  # the model finds each row's last token by the pad id
            model.config.pad_token_id = self.tokenizer.pad_token_id
        if not 0 <= self.label < model.config.num_labels:
            raise ValueError(f"reward 'model:{self.name_or_path}': label={self.label} but the model has "
                             f"{model.config.num_labels} output(s); set reward_options label in 0..{model.config.num_labels - 1}")
        return model

    def texts(self, prompts: Sequence[Any], completions: Sequence[str]) -> list[str]:
        """What the model reads: prompt + completion; for chat prompts the conversation with the completion as the
        assistant's message, through the reward model's chat template."""
        out = []
        for p, c in zip(prompts, completions):
            if isinstance(p, str):
                out.append(p + c)
            elif getattr(self.tokenizer, "chat_template", None):
                out.append(self.tokenizer.apply_chat_template(list(p) + [{"role": "assistant", "content": c}],
                                                              tokenize=False))
            else:
                raise ValueError(f"reward 'model:{self.name_or_path}': the prompts are chat messages but its tokenizer "
                                 "has no chat template; use raw-text prompts (data.options.chat=false) or a reward "
                                 "model with a chat template")
        return out

    @torch.no_grad()
    def __call__(self, prompts: list[Any], completions: list[str], **row_fields: Any) -> list[float]:
        self.load()
        texts = self.texts(prompts, completions)
        limit = self.max_length or getattr(self.model.config, "max_position_embeddings", None)
        self.tokenizer.truncation_side = "left"
        out: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[start : start + self.batch_size], return_tensors="pt", padding=True,
                                 padding_side="right", truncation=limit is not None, max_length=limit,
                                 add_special_tokens=False).to(self.device)
            logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits  # [b, labels]
            out.extend(logits[:, self.label].float().tolist())
        return out


class Judge(_ModelReward):
    """`judge:NAME_OR_PATH`: a causal LM asked about each completion (see the module docstring)."""

    kind = "judge"

    def __init__(self, name_or_path: str, *, parser: Literal["yes_no", "number"] = "yes_no",
                 template: str | None = None, system_prompt: str | None = None, chat: bool | None = None,
                 yes: Sequence[str] = ("Yes", " Yes", "yes", " yes"), no: Sequence[str] = ("No", " No", "no", " no"),
                 pattern: str = r"-?\d+(?:\.\d+)?", score_range: Sequence[float] = (0.0, 10.0),
                 max_new_tokens: int = 8, device: str | None = None, dtype: str = "auto", batch_size: int = 16,
                 revision: str | None = None, trust_remote_code: bool = False):
        super().__init__(name_or_path, device=device, dtype=dtype, batch_size=batch_size, revision=revision,
                         trust_remote_code=trust_remote_code)
        where = f"reward 'judge:{name_or_path}'"
        if parser not in ("yes_no", "number"):
            raise ValueError(f"{where}: parser must be 'yes_no' or 'number', got {parser!r}")
        self.template = template if template is not None else (YES_NO_TEMPLATE if parser == "yes_no" else NUMBER_TEMPLATE)
        fields = [f for _, f, _, _ in string.Formatter().parse(self.template) if f]
        if "completion" not in fields:
            raise ValueError(f"{where}: template must contain '{{completion}}', got {self.template!r}")
        self.fields = [f for f in dict.fromkeys(fields) if f not in ("prompt", "completion")]
        self.row_fields = self.fields  # checked against the data's first rows before the policy loads
        try:
            self.pattern = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{where}: pattern {pattern!r} is not a regular expression ({e})") from None
        lo, hi = (float(x) for x in score_range)
        if not hi > lo:
            raise ValueError(f"{where}: score_range must be [low, high] with high > low, got {list(score_range)}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"{where}: max_new_tokens must be a positive int, got {max_new_tokens!r}")
        self.parser, self.system_prompt, self.chat = parser, system_prompt, chat
        self.yes, self.no, self.score_range, self.max_new_tokens = list(yes), list(no), (lo, hi), max_new_tokens

    def _check_config(self, config: Any) -> None:
        """Refuse a model whose config names only sequence-classification architectures: it has no LM head."""
        names = list(getattr(config, "architectures", None) or [])
        if names and all(a.endswith(SCORE_ARCHITECTURES) for a in names):
            raise ValueError(
                f"reward.reward_funcs 'judge:{self.name_or_path}': its config names the architecture(s) {names}, a "
                f"reward model without a language-model head, which cannot answer as a judge; use "
                f"'model:{self.name_or_path}' for it, or name a causal LM after 'judge:'"
            )

    def _load_model(self, **kw: Any) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.name_or_path, **kw)

    def questions(self, prompts: Sequence[Any], completions: Sequence[str], row_fields: dict[str, Any]) -> list[str]:
        """The judge's input text for each sample: the filled template, through its chat template when it has one
        (and `chat` is not false), else after the system prompt."""
        missing = [f for f in self.fields if f not in row_fields]
        if missing:
            raise ValueError(f"reward 'judge:{self.name_or_path}': its template names {missing}, which the rows do not "
                             f"have (row fields: {sorted(row_fields)})")
        use_chat = self.chat if self.chat is not None else bool(getattr(self.tokenizer, "chat_template", None))
        out = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            text = self.template.format(prompt=_prompt_text(p), completion=c, **{f: row_fields[f][i] for f in self.fields})
            if use_chat:
                messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
                messages.append({"role": "user", "content": text})
                out.append(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
            else:
                out.append(f"{self.system_prompt}\n\n{text}" if self.system_prompt else text)
        return out

    def _token_ids(self, words: Sequence[str]) -> list[int]:
        ids = {self.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in words if w}
        return sorted(ids)

    def parse(self, reply: str) -> float | ValueError:
        """The score of a generated reply in [0, 1], or the error to report for it."""
        m = self.pattern.search(reply)
        if m is None:
            return ValueError(f"judge reply {reply!r} holds no score (pattern {self.pattern.pattern!r})")
        x = float(m.group(1) if m.groups() else m.group(0))
        lo, hi = self.score_range
        if not lo <= x <= hi:
            return ValueError(f"judge reply {reply!r}: score {x} outside score_range [{lo}, {hi}]")
        return (x - lo) / (hi - lo)

    @torch.no_grad()
    def __call__(self, prompts: list[Any], completions: list[str], **row_fields: Any) -> list[float | Exception]:
        self.load()
        texts = self.questions(prompts, completions, row_fields)
        out: list[float | Exception] = []
        yes, no = self._token_ids(self.yes), self._token_ids(self.no)
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[start : start + self.batch_size], return_tensors="pt", padding=True,
                                 padding_side="left", add_special_tokens=False).to(self.device)
            if self.parser == "yes_no":
                logits = self.model(**enc).logits[:, -1].float()  # [b, V] at the next token
                p = torch.softmax(logits, dim=-1)
                p_yes, p_no = p[:, yes].sum(-1), p[:, no].sum(-1)
                out.extend((p_yes / (p_yes + p_no)).tolist())
            else:
                gen = self.model.generate(**enc, do_sample=False, max_new_tokens=self.max_new_tokens,
                                          pad_token_id=self.tokenizer.pad_token_id)
                replies = self.tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                out.extend(self.parse(r) for r in replies)
        return out


def model_reward(spec: str, **options: Any) -> RewardModel | Judge:
    """The reward function of a `model:NAME_OR_PATH` or `judge:NAME_OR_PATH` spec with its reward_options."""
    kind, _, name = spec.partition(":")
    cls = RewardModel if kind == "model" else Judge
    params = [n for n, p in inspect.signature(cls.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY]
    unknown = [o for o in options if o not in params]
    if unknown:
        raise ValueError(f"reward '{spec}' has no option {unknown[0]!r}; its options are {params}")
    return cls(name, **options)


def load_reward_models(fns: Sequence[Any], device: torch.device | str) -> None:
    """Load the weights of the model-based rewards among `fns` (on their `device` option, else `device`)."""
    for fn in fns:
        if isinstance(fn, _ModelReward):
            fn.load(device)
