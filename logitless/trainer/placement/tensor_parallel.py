"""The tensor-parallel rollout (rollout.tensor_parallel = N) beside FSDP2: each group of N consecutive ranks decodes
with one copy of the policy split over its ranks, so the rollout holds 1/N of the decode weights per rank.

    torchrun --nproc-per-node 2 -m logitless train CONFIG rollout.tensor_parallel=2

- The split is transformers' own plan for the family (`config.base_model_tp_plan`, the model class's `_tp_plan`)
  applied with `torch.distributed.tensor.parallel.parallelize_module` over the group's mesh: q/k/v and gate/up are
  split by output rows (ColwiseParallel: each rank computes its heads and its share of the MLP), o and down by
  input columns (`tp_styles.RowwiseFp32Sum`: each rank's partial product kept in fp32, all-reduced in fp32 and
  rounded once to the model's dtype, as one device's GEMM accumulates the whole product; torch's RowwiseParallel
  would round each partial to bf16 and sum those in bf16, which in bf16 put the split rollout 2.8-3.6x as far
  from the trainer's logprobs as the one-rank rollout on CPU, 1.0-1.3x summed in fp32), the embedding and the
  lm_head by vocabulary rows. The attention code reads its head counts from the projections' outputs
  (`view(..., -1, head_dim)`), so each rank runs the model's own attention on its heads, and its KV cache holds
  those heads only. The lm_head's logits stay split by vocabulary rows: each rank holds its own columns
  (`vocab_shard()`), and the engine's draw reduces over the group (`rollout/vocab_split.py`: each rank's Gumbel-max
  race and log-sum-exp over its columns, a gather of a few numbers per row, the same combine on every rank), so
  no [B, V] logits are gathered and every rank draws the tokens and logprobs the whole rows would give. Top-k,
  top-p, min-p and the repetition penalty need the whole distribution: with them the engine gathers the rows.
  (`split_vocab=False`, or a vocabulary too small to give every rank a column: the logits gathered, as
  transformers' plan does.)
- `TensorParallelCopy` is the replica (`parallel.make_replica`'s counterpart): a skeleton of the plain model with
  only this rank's slices allocated, written by `sync` from the FSDP2 shards one FSDP unit (a decoder layer, then
  the root) at a time: the unit is all-gathered (`unshard`), this rank's slice of each weight copied, the unit
  resharded. No rank ever holds more than one unit beside its slices. With LoRA each slice is merged on its own:
  W[rows] + (B[rows] @ A) x scaling for a row split, W[:, cols] + (B @ A[:, cols]) x scaling for a column split,
  the sum in fp32 and rounded once, as `MergedRolloutCopy` does for the whole weight.
- `GroupDecode` wraps the static engine: each generate gathers the group's prompts and seeds, decodes their union
  in one batch on every rank of the group, each part of it drawing from the random streams its own rank's call
  would (`SamplingOptions.streams`), and returns this rank's rows, so the tokens and logprobs are those of the
  one-rank rollout of the same rows. Every rank of the group draws the same tokens (the collectives give every
  rank the same sums, and the draw's combine the same token), so all stop together; the automatic KV budget is
  the group's smallest, so all decode the same waves. On CUDA the group decodes without torch.compile (dynamo
  cannot trace the replica's DTensor weights there yet); its eager step is captured as one CUDA graph per wave
  wherever the step graph applies (rollout.step_graph=false: eager).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from logitless.rollout.engine import unwrap_model
from logitless.rollout.fused import tensor_at
from logitless.rollout.layouts import text_config
from logitless.rollout.sleep import SleepableMemory
from logitless.rollout.types import Prompt, RolloutBatch, RolloutTiming, SamplingOptions
from logitless.rollout.vocab_split import VocabShard, shard_of
from logitless.rollout.weights import fresh_copy, lora_layers, merge_refusal
from logitless.trainer.distributed.fsdp_offload import device_full_tensor
from logitless.trainer.distributed.fsdp_units import Lend, by_unit, gathered, no_lend
from logitless.trainer.placement.tp_episodes import GroupDriver, driver_spec

KEY = "rollout.tensor_parallel"
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")  # model_type values whose attention takes its heads per rank
BACKENDS = ("static",)  # engines that decode a group's union with each part's own random streams
SPLITS = {"colwise", "rowwise", "embedding_rowwise"}  # the entries of transformers' base-model plans `style` maps


def style(name: str) -> Any:
    """The torch ParallelStyle of a transformers tp_plan entry (None: replicated, nothing to split)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from logitless.trainer.placement.tp_styles import RowwiseFp32Sum

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseFp32Sum,
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
              "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
              "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
    if name.startswith("replicated"):
        return None
    if name not in styles:
        raise ValueError(f"{KEY}: transformers' plan entry {name!r} is not one it applies; set {KEY}=1")
    return styles[name]()


def family_refusal(config: Any, n: int) -> str | None:
    """Why a model of `config` (a transformers config) cannot decode split over `n` ranks (None if it can)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kind = getattr(cfg, "model_type", None)
    if kind not in FAMILIES:
        return (f"model_type {kind!r} is not one of the families it splits ({', '.join(FAMILIES)}); set {KEY}=1")
    plan = getattr(cfg, "base_model_tp_plan", None) or {}
    unknown = sorted({s for s in plan.values() if not s.startswith("replicated")} - SPLITS)
    if not plan or unknown:
        return f"transformers' tensor-parallel plan of {kind!r} is {plan or 'missing'}; set {KEY}=1"
    sizes = {"num_attention_heads": cfg.num_attention_heads,
             "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
             "intermediate_size": cfg.intermediate_size}
    odd = [f"{k}={v}" for k, v in sizes.items() if v % n]
    if odd:
        fits = [d for d in range(1, n + 1) if all(v % d == 0 for v in sizes.values())]
        return (f"the model's {', '.join(odd)} cannot be split over {n} ranks; set {KEY} to one that divides "
                f"them all (at most {n}: {', '.join(map(str, fits))})")
    return None


def check_tensor_parallel(cfg: Any, world_size: int, model_config: Any = None) -> None:
    """Refuse a rollout.tensor_parallel that cannot run on `world_size` ranks (and, given its config, the model),
    naming the setting and the fix; nothing to check at 1."""
    n = cfg.rollout.tensor_parallel
    if n == 1:
        return
    if world_size == 1:
        raise ValueError(f"{KEY}={n} splits the rollout over {n} ranks of torchrun; launch with torchrun "
                         f"--nproc-per-node {n} (or a multiple of {n}), or set {KEY}=1")
    if world_size % n:
        raise ValueError(f"{KEY}={n} must divide the number of ranks ({world_size}): set it to one of "
                         f"{', '.join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)}")
    if cfg.rollout.backend not in (*BACKENDS, "auto"):
        raise ValueError(f"{KEY}={n} decodes with backend {' or '.join(BACKENDS)} (each rank's rows keep their own "
                         f"random streams in the group's batch); set rollout.backend=static, or {KEY}=1")
    refused = [
        (cfg.model.lora and cfg.rollout.merge_lora is False, "rollout.merge_lora=false",
         "rollout.merge_lora unset (the split replica holds merged weights)"),
        (cfg.rollout.fuse_projections is True, "rollout.fuse_projections=true", "rollout.fuse_projections unset"),
        (cfg.rollout.weight_copy == "in_place", "rollout.weight_copy=in_place",
         "rollout.weight_copy=sleep or resident"),
        (cfg.train.fsdp_offload, "train.fsdp_offload=true", "train.fsdp_offload=false"),
    ]
    for on, setting, fix in refused:
        if on:
            raise ValueError(f"{setting} is not supported with {KEY}={n} yet; set {fix}")
    if model_config is not None:
        why = family_refusal(model_config, n)
        if why is not None:
            raise ValueError(f"{KEY}={n}: {why}")


def tp_mesh(world_size: int, n: int, device: torch.device) -> Any:
    """This rank's group of `n` consecutive ranks: the "tp" dimension of the ("dp", "tp") device mesh of all ranks
    (a collective: every rank makes the mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size // n, n), mesh_dim_names=("dp", "tp"))["tp"]


def split_plan(model: nn.Module, split_vocab: bool = False) -> dict[str, Any]:
    """{module path pattern: ParallelStyle} of a transformers causal LM (`model`: the plain model): transformers'
    base-model plan under the base model's prefix, the class's plan (the lm_head, its logits gathered), and the
    embedding's vocabulary rows (its lookup all-reduced, exact: one rank holds each row). split_vocab: the lm_head's
    logits stay split by vocabulary rows (each rank its own columns, `vocab_split.py` draws from them)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    why = family_refusal(model.config, 1)  # (the sizes are checked against the group's size before)
    if why is not None:
        raise ValueError(f"{KEY}: {why}")
    prefix = model.base_model_prefix
    plan = {f"{prefix}.{k}": style(v) for k, v in text_config(model).base_model_tp_plan.items()}
    plan.update({k: style(v) for k, v in (getattr(type(model), "_tp_plan", None) or {}).items()})
    plan[f"{prefix}.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    if split_vocab:
        head = model.get_output_embeddings()
        plan[next(name for name, m in model.named_modules() if m is head)] = ColwiseParallel()  # output Shard(-1)
    return {k: v for k, v in plan.items() if v is not None}


def skeleton(base: nn.Module, merged: Sequence[str]) -> nn.Module:
    """A frozen eval-mode copy of `base` with every parameter on the meta device (buffers copied), its LoRA layers
    `merged` replaced by their base layers (the merged weights' home)."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False) for p in base.parameters()}
    out = fresh_copy(base, memo).eval()
    for name in merged:
        out.set_submodule(name, out.get_submodule(name).get_base_layer())
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a replica tensor: a DTensor's local shard itself (the tensor it holds, not a view, so
    that `SleepableMemory` can move its storage), a plain tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def local_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this rank holds of `module` (a DTensor counts its local shard; tied ones once)."""
    seen = {id(p): local(p) for p in module.parameters()}
    return sum(t.numel() * t.element_size() for t in seen.values())


class TensorParallelCopy:
    """The rollout's split replica of the policy (see the module docstring): `model` runs the group's collectives in
    its forward; `sync(sharded)` rewrites this rank's slices from the FSDP2 model, `release()` frees those each sync
    rewrites (with sleep). Made from the model before sharding, whose weights it never reads: its parameters are on
    the meta device until `materialize()` allocates this rank's slices (after sharding, so that the device never
    holds the whole model beside them), and the first sync fills every slice. split_vocab: the lm_head's logits
    stay split by vocabulary rows (`vocab_shard()`, the default; False: gathered whole on every rank)."""

    groups: list = []  # no fused projections (rollout.fuse_projections)

    def __init__(self, model: nn.Module, mesh: Any, device: torch.device, sleep: bool = False,
                 split_vocab: bool = True):
        from torch.distributed.tensor.parallel import parallelize_module

        base = unwrap_model(model)
        self.merged = [name for name, _ in lora_layers(base)]
        if hasattr(model, "peft_config"):
            why = merge_refusal(model)
            extra = [n for n, p in model.named_parameters() if p.requires_grad and ".lora_A." not in n
                     and ".lora_B." not in n]
            if why is not None or extra:
                raise ValueError(f"{KEY}={mesh.size()} holds merged LoRA weights, but "
                                 f"{why or f'{extra[0]} trains outside the adapters'}; set {KEY}=1")
        self.mesh, self.size, self.rank = mesh, mesh.size(), mesh.get_local_rank()
        self.device, self.sleep = device, sleep
        self.model = skeleton(base, self.merged)
        self.vocab = self.model.get_output_embeddings().weight.shape[0]
        # the logits stay split by vocabulary rows where every rank holds some (any real vocabulary)
        self.split_vocab = split_vocab and (self.size - 1) * -(-self.vocab // self.size) < self.vocab
        parallelize_module(self.model, mesh, split_plan(self.model, self.split_vocab))
        tied = getattr(text_config(self.model), "tie_word_embeddings", False)
        if tied:  # split alike (vocabulary rows), held once
            self.model.get_output_embeddings().weight = self.model.get_input_embeddings().weight
        self.model.requires_grad_(False)
        names = [n for n, _ in self.model.named_parameters()]
        trainable = {n for n, p in base.named_parameters() if p.requires_grad}
        merged = set(self.merged)
        # rewritten at every sync: the merged LoRA layers' weights, or (full fine-tuning) the trainable ones
        self.changing = [n for n in names if n.endswith(".weight") and n.rpartition(".")[0] in merged] if merged \
            else [n for n in names if n in trainable]
        self._filled = False  # the frozen slices are written once, by the first sync
        self.memory: SleepableMemory | None = None

    def vocab_shard(self) -> VocabShard | None:
        """This rank's columns of the logits and the group's gather (None: the logits are gathered whole)."""
        if not self.split_vocab:
            return None
        mesh, n = self.mesh, self.size

        def gather(t: torch.Tensor) -> torch.Tensor:
            from torch.distributed._functional_collectives import all_gather_tensor

            return all_gather_tensor(t.contiguous(), 0, mesh).view(n, *t.shape)

        return shard_of(self.vocab, n, self.rank, gather)

    def materialize(self) -> None:
        """Allocate this rank's slices on the device (contents undefined until the first `sync`). With sleep, those
        each sync rewrites are allocated in the sleepable range only (placeholders until it maps them), so the
        device never holds them twice."""
        if next(self.model.parameters()).device.type != "meta":
            return
        asleep = set(self.changing) if self.sleep else set()
        for name, p in list(self.model.named_parameters()):  # (a tied weight once)
            owner, _, leaf = name.rpartition(".")
            self.model.get_submodule(owner)._parameters[leaf] = nn.Parameter(
                _empty(p, self.device, placeholder=name in asleep), requires_grad=False)
        if getattr(text_config(self.model), "tie_word_embeddings", False):
            self.model.get_output_embeddings().weight = self.model.get_input_embeddings().weight
        for m in self.model.modules():  # (the rotary frequencies: copied with the skeleton)
            m._buffers = {k: None if b is None else b.to(self.device) for k, b in m._buffers.items()}
        if asleep:
            self.memory = SleepableMemory([local(tensor_at(self.model, n)) for n in self.changing], fill=False)

    def release(self) -> None:
        if self.memory is not None:
            self.memory.sleep()

    @torch.no_grad()
    def sync(self, sharded: nn.Module, lend: Lend = no_lend) -> None:
        """Write this rank's slice of every weight from the FSDP2 shards of `sharded` (all of them the first time,
        then those that train), one unit all-gathered at a time (its shards read within `lend`, e.g. lent back
        from host memory for that unit alone). A collective over every rank (the same units in the same order on
        each)."""
        self.materialize()
        if self.memory is not None:
            self.memory.wake()
        src, changing = unwrap_model(sharded), set(self.changing)
        for unit, names in by_unit(sharded, [n for n, _ in self.model.named_parameters()], base=src):
            todo = [n for n in names if not self._filled or n in changing]
            if not todo:
                continue
            with gathered(unit, lend):
                for name in todo:
                    self._write(src, name)
        self._filled = True

    def _piece(self, full: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """This rank's slice of `full` as `dst` (a replica tensor) splits it."""
        dim = _split_dim(dst)
        piece = full if dim is None else torch.chunk(full, self.size, dim=dim)[self.rank]
        if piece.shape != local(dst).shape:
            raise RuntimeError(f"{KEY}: a slice of shape {tuple(piece.shape)} for a shard of {tuple(local(dst).shape)}")
        return piece

    def _write(self, src: nn.Module, name: str) -> None:
        dst = tensor_at(self.model, name)
        out = local(dst)
        owner, _, leaf = name.rpartition(".")
        full = lambda t: device_full_tensor(t, out.device)  # noqa: E731  (a unit not unsharded: gathered here)
        if owner not in self.merged or leaf != "weight":  # as is (a merged layer's bias: its base layer's)
            held = getattr(src.get_submodule(owner).get_base_layer(), leaf) if owner in self.merged else \
                tensor_at(src, name)
            out.copy_(self._piece(full(held), dst))
            return
        layer, dim = src.get_submodule(owner), _split_dim(dst)
        w = self._piece(full(layer.get_base_layer().weight), dst).float()
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                b, a = full(layer.lora_B[adapter].weight), full(layer.lora_A[adapter].weight)
                if dim == 0:
                    b = torch.chunk(b, self.size, dim=0)[self.rank]
                elif dim == 1:
                    a = torch.chunk(a, self.size, dim=1)[self.rank]
                w = w + ((b @ a) * layer.scaling[adapter]).float()
        out.copy_(w)


def _empty(p: torch.Tensor, device: torch.device, placeholder: bool = False) -> torch.Tensor:
    """An uninitialized tensor like the meta parameter `p` (a DTensor: its local shard) on `device`; a placeholder
    holds one element expanded to the shape (`SleepableMemory(fill=False)` gives it its memory)."""
    shape = local(p).shape
    out = torch.empty((1,) * len(shape), dtype=p.dtype, device=device).expand(shape) if placeholder else \
        torch.empty(shape, dtype=p.dtype, device=device)
    if not hasattr(p, "placements"):
        return out
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(out, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _split_dim(t: torch.Tensor) -> int | None:
    """The dimension a replica tensor is split along over the group (None: replicated or a plain tensor)."""
    for p in getattr(t, "placements", ()):
        if p.is_shard():
            return p.dim
    return None


# ----------------------------------------------------------------------------------------------------------
# The group's decode


def prompt_rows(batch: RolloutBatch, start: int, count: int, G: int) -> RolloutBatch:
    """The rows of prompts [start, start + count) of `batch`, with prompt indices from 0 and the padding only those
    rows need (left prompt columns, right completion columns): the batch a call with those prompts alone returns."""
    rows = slice(start * G, (start + count) * G)
    pmask, cmask = batch.prompt_mask[rows], batch.completion_mask[rows]
    used = pmask.any(0).nonzero()
    left = int(used[0]) if len(used) else pmask.shape[1]
    T = max(1, int(cmask.sum(1).max())) if cmask.numel() else 1
    cut = {"prompt_ids": (left, None), "prompt_mask": (left, None), "completion_ids": (0, T),
           "completion_mask": (0, T), "sampler_logp": (0, T), "env_mask": (0, T), "prompt_routes": (left, None),
           "completion_routes": (0, T)}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor):
            v = v[rows]
            if f.name in cut:
                v = v[:, cut[f.name][0] : cut[f.name][1]]
        elif isinstance(v, list):
            v = v[rows]
        out[f.name] = v
    out["prompt_index"] = out["prompt_index"] - start
    t = batch.timing
    tokens = int(out["completion_mask"].sum())
    out["timing"] = RolloutTiming(t.seconds, tokens, tokens / t.seconds if t.seconds > 0 else 0.0,
                                  t.generate_seconds, dict(t.parts))
    return RolloutBatch(**out)


class GroupDecode:
    """The static engine of a tensor-parallel group (see the module docstring): `generate` is a collective over the
    group; every other attribute is the wrapped engine's (read and set)."""

    OWN = ("engine", "group", "device", "size", "rank")

    def __init__(self, engine: Any, group: Any, device: torch.device, vocab: VocabShard | None = None):
        own = dict(engine=engine, group=group, device=device, size=dist.get_world_size(group),
                   rank=dist.get_rank(group))
        self.__dict__.update(own)
        if device.type == "cuda" and engine.compile is None:
            # no torch.compile on CUDA: dynamo fails on the replica's DTensor weights there (fake-tensor errors on the
            # embedding and on weights in sleepable memory, torch 2.11; bench/LOG.md). The step graph captures the
            # eager step instead, collectives included, wherever it applies (rollout.step_graph unset; false: eager):
            # at 7B on two H100s the eager split decode did not finish two steps in 170 s, the captured one decoded
            # 27,980 tokens/s (bench/results/fsdp_h100x2_7b_tp2_{eager_incomplete_e6c2ab5,graph_91af055}.json)
            engine.compile = False
            engine.capture_eager = True
        engine.shared_budget = self.smallest
        engine.vocab_shard = vocab  # the replica's logits: this rank's columns (None: the whole rows)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["engine"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.OWN:
            self.__dict__[name] = value
        else:
            setattr(self.engine, name, value)  # e.g. the memory plan's rollout.max_kv_gib

    def smallest(self, budget: float | None) -> float | None:
        """The group's smallest KV budget (None: no cap anywhere)."""
        t = torch.tensor([math.inf if budget is None else float(budget)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return None if math.isinf(float(t)) else float(t)

    def generate(self, prompts: Sequence[Prompt], options: SamplingOptions, episodes: Any = None) -> RolloutBatch:
        """This rank's rows of the group's union decode: the tokens and logprobs of `engine.generate(prompts,
        options, episodes)` on one rank (with `episodes`, each rank's driver answers its own rows: `tp_episodes.py`).
        When every rank of the group asks for the same call (an eval split over the groups), it is decoded once and
        every rank gets all of it."""
        parts: list[Any] = [None] * self.size
        dist.all_gather_object(parts, (list(prompts), options, driver_spec(episodes)), group=self.group)
        # every rank sees the same parts, so every rank raises alike (none is left waiting in a collective)
        joint = joint_options([(mine, o) for mine, o, _ in parts],
                              f"{KEY}: the ranks of a group decode together, so each must give its rollout")
        if any(spec != parts[0][2] for _, _, spec in parts):
            raise ValueError(f"{KEY}: the ranks of a group decode their episodes together, so each must run episodes "
                             "or none, with the same turn-end ids, turn stops and max_turn_tokens")
        if all(p == parts[0] for p in parts):  # one call: the group's first rank answers every episode
            if episodes is not None:
                episodes = GroupDriver(episodes, self.group, self.rank, [len(prompts)], shared=True)
            return self.engine.generate(prompts, options, episodes=episodes)
        union = [p for mine, _, _ in parts for p in mine]
        if episodes is not None:  # this rank's driver answers its own rows; the replies are gathered every turn
            episodes = GroupDriver(episodes, self.group, self.rank, [len(mine) for mine, _, _ in parts])
        batch = self.engine.generate(union, joint, episodes=episodes)
        start = sum(len(mine) for mine, _, _ in parts[: self.rank])
        return prompt_rows(batch, start, len(prompts), options.num_generations)


def joint_options(parts: Sequence[tuple[Sequence[Prompt], SamplingOptions]], who: str) -> SamplingOptions:
    """The options of one decode of every part's prompts in order, each part drawing from the random streams its own
    call would (`SamplingOptions.streams`: the part's seed, its prompt count). Refused, `who` + the reason, unless
    every part has a seed, no streams of its own, and the same other options."""
    rest = [dataclasses.replace(o, seed=None, streams=None) for _, o in parts]
    if any(o.seed is None or o.streams is not None for _, o in parts) or any(r != rest[0] for r in rest):
        raise ValueError(f"{who} a seed (SamplingOptions.seed), no streams of its own, and the same other sampling "
                         "options")
    return dataclasses.replace(parts[0][1], streams=[(o.seed, len(mine)) for mine, o in parts])


def group_decode(engine: Any, replica: TensorParallelCopy) -> GroupDecode:
    """`engine` (decoding `replica.model`) with the replica's group."""
    return GroupDecode(engine, replica.mesh.get_group(), replica.device, replica.vocab_shard())
