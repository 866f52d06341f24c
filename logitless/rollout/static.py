"""Backend "static": our own decode loop over the transformers model with a static KV cache.

- Prefill once per prompt (n rows, not n*G), then copy the prompt's KV G times into a [B, heads, L, d] static cache
  (`kv_cache.py`: full-length in every layer, so sliding-window and chunked layers are masked by the model's own
  mask functions exactly as in a full forward; layouts it cannot decode exactly are refused at construction).
- Each decode step is the model's forward on [B, 1] tokens; on CUDA it is compiled with CUDA graphs
  (`get_compiled_call`, mode "reduce-overhead"), so a step costs one graph replay instead of ~1000 launches.
  With "sdpa" attention, decode attention runs without expanding the KV cache to all query heads
  (`attention.gqa_decode_attention`).
- Sampling runs on the GPU without host syncs: the same transformers processors as backend "hf" (repetition
  penalty, temperature, top-k, top-p, min-p), then exponential-race sampling (argmax p / Exp(1), exact
  categorical sampling); finished rows emit the pad id. Stop strings are checked on the host every
  `check_every` steps, which is also when the loop exits early once every row is done.
- The recorded logprob is log_softmax(raw_logits / T)[token], as documented in `types.py`.

The KV cache lives only for one `generate` call; its length is rounded up to `cache_multiple` tokens and never
shrinks across calls, so calls with different prompt lengths reuse the compiled graph. A new row count B
(num_prompts * G) compiles a new graph (~25 s for a 1.5B model on an H200); the CUDA-graph memory pool of the
compiled step stays allocated while the model lives. Parameters are graph inputs read in place (CUDA graphs
read them by address), so in-place optimizer steps between rollouts are seen without recompiling (checked with
torch.compile on CPU: logprobs follow an in-place weight change to 7e-6).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from transformers.generation.configuration_utils import CompileConfig

from .engine import build_batch, generation_mode, prepare_prompts, seeded, sync, unwrap_model
from .attention import gqa_decode
from .hf import sampling_processors
from .kv_cache import STATIC_LAYER_TYPES, decode_cache, prefill_cache
from .layouts import check_layout
from .types import Prompt, RolloutBatch, SamplingOptions


def sample_step(
    logits: torch.Tensor,  # [B, V] fp32 raw logits
    history: torch.Tensor,  # [B, L] prompt + generated ids so far (for repetition penalty)
    processors: list,
    logp_temperature: float,
    greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], logp [B]); logp = log_softmax(logits / T)[token]. Equivalent to transformers' sampling
    with the same processors (a different but exact way to draw from the same categorical)."""
    scaled = logits / logp_temperature if logp_temperature != 1.0 else logits
    lse = torch.logsumexp(scaled, dim=-1)  # [B]
    scores = logits
    for proc in processors:
        scores = proc(history, scores)
    if greedy:
        token = scores.argmax(-1)
    else:
        probs = torch.softmax(scores, dim=-1)
        token = (probs / torch.empty_like(probs).exponential_()).argmax(-1)
    logp = scaled.gather(1, token[:, None]).squeeze(1) - lse
    return token, logp


class StaticEngine:
    """Fast sampler with a static KV cache and a CUDA-graph-compiled decode step.

    compile: compile the decode step (default: on CUDA only). check_every: host-side stop-string /
    all-finished checks every that many steps. cache_multiple: round the cache length up to this.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        compile: bool | None = None,
        check_every: int = 32,
        cache_multiple: int = 128,
    ):
        if check_every < 1 or cache_multiple < 1:
            raise ValueError(
                f"StaticEngine: check_every={check_every} and cache_multiple={cache_multiple} must both be >= 1"
            )
        check_layout(unwrap_model(model), "static", STATIC_LAYER_TYPES)
        self.model = model
        self.tokenizer = tokenizer
        self.compile = compile
        self.check_every = check_every
        self.cache_multiple = cache_multiple
        self._max_len = 0

    def _forward(self, device: torch.device):
        base = unwrap_model(self.model)
        use_compile = device.type == "cuda" if self.compile is None else self.compile
        if use_compile:
            return base.get_compiled_call(CompileConfig(fullgraph=False, mode="reduce-overhead", dynamic=False)), True
        return base.__call__, False

    def generate(self, prompts: Sequence[Prompt], options: SamplingOptions) -> RolloutBatch:
        prep = prepare_prompts(self.model, self.tokenizer, prompts, options)
        pad_id, eos_ids, device, ctx = prep.pad_id, prep.eos_ids, prep.device, prep.context
        ids, mask = prep.ids, prep.mask  # [n, P]
        G, (n, P), S = options.num_generations, ids.shape, options.max_new_tokens
        B = n * G
        # cache length only grows across calls (like transformers' static cache), so varying prompt lengths
        # compile a few graphs at most instead of one per length
        L = max(-(-(P + S) // self.cache_multiple) * self.cache_multiple, self._max_len)
        if ctx is not None:
            L = max(min(L, ctx), P + S)
        self._max_len = L
        processors = sampling_processors(options)
        greedy = options.temperature == 0
        base = unwrap_model(self.model)
        with generation_mode(self.model), seeded(options.seed, device), gqa_decode(base.config):
            sync(device)
            tg = time.perf_counter()
            # prefill the n distinct prompts
            pos = (mask.cumsum(1) - 1).clamp(min=0)
            pre_cache = prefill_cache()
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=pre_cache,
                             use_cache=True, logits_to_keep=1)
            first_logits = out.logits[:, -1].float().repeat_interleave(G, 0)  # [B, V]
            del out
            cache = decode_cache(pre_cache, G, L)
            del pre_cache
            full_mask = torch.zeros((B, L), dtype=torch.long, device=device)
            full_mask[:, :P] = mask.repeat_interleave(G, 0)
            full_mask[:, P : P + S] = 1  # future slots are hidden by causality (query offset = cache length)
            history = torch.full((B, P + S), pad_id, dtype=torch.long, device=device)
            history[:, :P] = ids.repeat_interleave(G, 0)
            logps = torch.zeros((B, S), dtype=torch.float32, device=device)
            next_pos = mask.sum(1).repeat_interleave(G, 0)[:, None]  # [B, 1] position of the next token
            done = torch.zeros(B, dtype=torch.bool, device=device)
            eos_t = torch.tensor(eos_ids if not options.ignore_eos else [], dtype=torch.long, device=device)
            forward, compiled = self._forward(device)
            logits, steps = first_logits, 0
            for t in range(S):
                token, logp = sample_step(logits, history[:, : P + t], processors, options.logp_temperature, greedy)
                token = torch.where(done, pad_id, token)
                history[:, P + t] = token
                logps[:, t] = logp
                if eos_t.numel():
                    done = done | torch.isin(token, eos_t)
                steps = t + 1
                if t + 1 == S:
                    break
                if (t + 1) % self.check_every == 0 and self._all_done(done, history, P, steps, options):
                    break
                if compiled:
                    torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs were consumed
                logits = forward(input_ids=token[:, None], attention_mask=full_mask, position_ids=next_pos,
                                 past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()
                next_pos = next_pos + 1
            sync(device)
            gen_s = time.perf_counter() - tg
            completion = history[:, P : P + steps].cpu()
            logps = logps[:, :steps].cpu()
            del cache, full_mask, history, logits, first_logits
        return build_batch(self.tokenizer, prep, completion, logps, torch.full((B,), steps, dtype=torch.long), gen_s)

    def _all_done(
        self, done: torch.Tensor, history: torch.Tensor, P: int, steps: int, options: SamplingOptions
    ) -> bool:
        """Host check (one sync): mark rows whose text contains a stop string as done; True if all rows are."""
        if options.stop:
            pending = (~done).nonzero().flatten().tolist()
            if pending:
                rows = history[pending, P : P + steps].tolist()
                texts = self.tokenizer.batch_decode(rows, skip_special_tokens=False)
                hit = [b for b, text in zip(pending, texts) if any(s in text for s in options.stop)]
                if hit:
                    done[hit] = True
        return bool(done.all())
