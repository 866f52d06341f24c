#!/usr/bin/env bash
# The GPU runs that decide the features built and tested on CPU (bench/LOG.md: decode and two_gpu were run on two
# H100s at 88ed670, decode_lb and e2e_lb on an H200 at db1535a; decode_lb took the place of the decode_next stage
# the LOG planned). Each stage fits in about 10 minutes; results and logs go to OUT_DIR.
#
#   bash bench/gpu_pending.sh decode OUT_DIR QWEN2.5_TOKENIZER     # one GPU: rollout.decode_attention=triton
#   bash bench/gpu_pending.sh two_gpu OUT_DIR QWEN2.5_TOKENIZER    # two GPUs: rollout.device, sync and async
#   bash bench/gpu_pending.sh decode_lb OUT_DIR QWEN2.5_TOKENIZER [ROWS]  # one GPU: the trainer's decode at T = 1,024
#   bash bench/gpu_pending.sh e2e_lb OUT_DIR QWEN2.5_TOKENIZER     # one GPU: the step with and without length buckets
#   bash bench/gpu_pending.sh gen_parts OUT_DIR QWEN2.5_TOKENIZER  # one GPU: where the step's generate phase goes
#   bash bench/gpu_pending.sh update_parts OUT_DIR QWEN2.5_TOKENIZER [ROWS]  # one GPU: where the update's time goes
#   bash bench/gpu_pending.sh sampler OUT_DIR QWEN2.5_TOKENIZER    # one GPU: the Triton token draw, tested and timed
#   bash bench/gpu_pending.sh step_graph OUT_DIR QWEN2.5_TOKENIZER # one GPU: the decode step as one CUDA graph
#   bash bench/gpu_pending.sh step_graph_e2e OUT_DIR QWEN2.5_TOKENIZER  # one GPU: the GRPO step with and without it
#   bash bench/gpu_pending.sh attn_rules OUT_DIR QWEN2.5_TOKENIZER # one GPU: the decode kernel's scan and stage rules
#   bash bench/gpu_pending.sh moe OUT_DIR QWEN2.5_TOKENIZER        # one GPU: grouped_mm experts, tested and timed
#   bash bench/gpu_pending.sh moe_exactness OUT_DIR QWEN2.5_TOKENIZER  # one GPU: MoE families with routing replay
#
# decode: the kernel's GPU tests, then the decode step with and without it at 128 and 512 rows (prof_decode).
# two_gpu: the rollout.device GPU test, then three bench_e2e runs of the same settings (T = 1,024, Liger,
# packed 16k-token micro-batches, compiled layers): everything on cuda:0; the rollout on cuda:1; the rollout on
# cuda:1 with train.async_rollout. Issue 14's async bound is read against the first run's generate and update.
# decode_lb: the decode the trainer runs (fused projections, the kernel) at 1,024 new tokens, over the whole cache
# and over 4 length buckets, at ROWS rows (128 and 512 by default; one row count per command fits its 10 minutes);
# at 128 rows also with the kernel's length split below 2 programs per SM (the rule before db1535a), to compare.
# e2e_lb: the synchronous step of the two_gpu stage's settings on one GPU, with rollout.length_buckets=4 and 1 (the
# default), then the decode kernel's GPU tests in the time left.
# moe: the experts backend's GPU tests (grouped_mm against eager in bf16, the decode step captured over grouped_mm
# experts), then bench_e2e steps of gpt-oss-20b's shape (42 GB in bf16: fits one GPU and the disk, where the
# 61 GB of Qwen3-30B-A3B would not; LoRA on attention and experts, T = 256, 4 x 4 rows).
# moe_exactness: the MoE families' exactness with routing replay (tests/test_moe_exactness.py), then the same
# table saved by bench/gpu_exactness.py (GPT-2's tokenizer from $LOGITLESS_SHARED/tokenizers/gpt2).
set -euo pipefail
stage="${1:?stage: decode, decode_lb, e2e_lb, gen_parts, update_parts, sampler, step_graph, step_graph_e2e, attn_rules, moe, moe_exactness or two_gpu}"
out="${2:?OUT_DIR}"
tok="${3:?folder of the Qwen2.5 tokenizer}"
cd "$(dirname "$0")/.."
mkdir -p "$out"
commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
export PYTHONUNBUFFERED=1
# the GPU tests find the tokenizers through LOGITLESS_SHARED (tests/conftest.py) when TOKENIZER is .../tokenizers/NAME
export LOGITLESS_SHARED="${LOGITLESS_SHARED:-$(cd "$(dirname "$tok")/.." && pwd)}"
# the GRPO step every bench_e2e stage times: T = 1,024, Liger, packed 16k-token micro-batches, compiled layers
step=(--tokenizer "$tok" --systems logitless --T 1024 --commit "$commit" --set model.liger_kernels=true
      --set train.packed=true --set train.micro_batch_tokens=16384 --set model.compile_layers=true)
case "$stage" in
decode)
  python -m pytest -m gpu -q tests/test_triton_decode.py tests/test_rollout_gpu.py 2>&1 | tee "$out/gpu_tests_decode.log"
  for rows in 128 512; do
    python bench/prof_decode.py --tokenizer "$tok" --out "$out" --rows "$rows" --new 512 --commit "$commit" \
      --decode-attention triton 2>&1 | tee "$out/prof_decode_${rows}.log"
  done
  ;;
decode_lb)
  for rows in ${4:-128 512}; do
    for lb in 1 4; do
      python bench/prof_decode.py --tokenizer "$tok" --out "$out" --rows "$rows" --new 1024 --commit "$commit" \
        --baseline-attention triton --fuse-baseline --length-buckets "$lb" 2>&1 | tee "$out/prof_decode_${rows}_lb${lb}.log"
    done
    if [ "$rows" = 128 ]; then
      python bench/prof_decode.py --tokenizer "$tok" --out "$out" --rows 128 --new 1024 --commit "$commit" \
        --baseline-attention triton --fuse-baseline --min-rows-per-sm 2 2>&1 | tee "$out/prof_decode_128_rps2.log"
    fi
  done
  ;;
e2e_lb)
  python bench/bench_e2e.py "${step[@]}" --steps 4 --out "$out/lb4" --set rollout.length_buckets=4 2>&1 \
    | tee "$out/e2e_lb4.log"
  python bench/bench_e2e.py "${step[@]}" --steps 4 --out "$out/lb1" 2>&1 | tee "$out/e2e_lb1.log"
  timeout 100 python -m pytest -m gpu -q tests/test_triton_decode.py tests/test_rollout_gpu.py 2>&1 \
    | tee "$out/gpu_tests_decode.log" || true
  ;;
gen_parts)
  # rollout.profile=true splits the engine's call into its parts (prefill, forward, sample, host checks, and around
  # them the prompts, the weights' sync and release, the release of the generation state, the batch), with a sync
  # around each; their sum against the generate phase shows what lies outside the engine's call
  python bench/bench_e2e.py "${step[@]}" --steps 3 --set rollout.profile=true --out "$out/gen_parts" 2>&1 \
    | tee "$out/e2e_gen_parts.log"
  ;;
update_parts)
  # one packed, compiled LoRA micro-batch of ROWS x 1,024 completion tokens (32 by default: the 32k-token
  # micro-batch of the 39 % MFU runs), the trainer's on-policy loss with the gradient hint, no checkpointing;
  # kernel time by group (GEMMs, attention, the logprob op, inductor's kernels) and the GPU's busy share
  python bench/bench_update.py --tokenizer "$tok" --out "$out/update_parts" --rows "${4:-32}" --hint --no-checkpointing \
    --variants lora_autocast+packed+compiled --commit "$commit" 2>&1 | tee "$out/update_parts.log"
  ;;
sampler)
  # rollout.sampler_kernel: the GPU tests of the draw, then the trainer's decode at T = 1,024 (128 and 512 rows)
  # with the Triton draw (profiled) and the compiled torch draw (timed in the same process), then the step
  timeout 150 python -m pytest -m gpu -q tests/test_triton_sampling.py tests/test_fused_sampler.py \
    tests/test_rollout_gpu.py tests/test_sampling_stats.py 2>&1 | tee "$out/gpu_tests_sampler.log" || true
  for rows in 128 512; do
    python bench/prof_decode.py --tokenizer "$tok" --out "$out" --rows "$rows" --new 1024 --commit "$commit" \
      --baseline-attention triton --fuse-baseline --baseline-sampler triton --sampler torch \
      2>&1 | tee "$out/prof_decode_${rows}_sampler.log"
  done
  python bench/bench_e2e.py "${step[@]}" --steps 3 --out "$out/e2e_sampler" 2>&1 | tee "$out/e2e_sampler.log"
  ;;
step_graph)
  # rollout.step_graph: its GPU tests with the rollout's, then the trainer's decode at T = 1,024 and 128 rows with the
  # step graph (profiled) and without it (timed in the same process), then the attention kernel's launch sweep
  timeout 170 python -m pytest -m gpu -q tests/test_step_graph.py tests/test_triton_sampling.py \
    tests/test_triton_decode.py tests/test_rollout_gpu.py 2>&1 | tee "$out/gpu_tests_step_graph.log" || true
  timeout 200 python bench/prof_decode.py --tokenizer "$tok" --out "$out" --rows 128 --new 1024 --commit "$commit" \
    --baseline-attention triton --fuse-baseline --baseline-sampler triton --baseline-step-graph on --step-graph off \
    2>&1 | tee "$out/prof_decode_128_step_graph.log" || true
  timeout 200 python bench/tune_decode_attention.py --out "$out" --commit "$commit" 2>&1 \
    | tee "$out/tune_decode_attention.log" || true
  ;;
step_graph_e2e)
  # the GRPO step (128 rows) with the step graph (auto: on) and without it, then the decode alone at 512 rows
  python bench/bench_e2e.py "${step[@]}" --steps 4 --out "$out/e2e_graph" 2>&1 | tee "$out/e2e_graph.log"
  python bench/bench_e2e.py "${step[@]}" --steps 4 --out "$out/e2e_nograph" --set rollout.step_graph=false 2>&1 \
    | tee "$out/e2e_nograph.log"
  timeout 200 python bench/prof_decode.py --tokenizer "$tok" --out "$out" --rows 512 --new 1024 --commit "$commit" \
    --baseline-attention triton --fuse-baseline --baseline-sampler triton --baseline-step-graph on --step-graph off \
    2>&1 | tee "$out/prof_decode_512_step_graph.log" || true
  ;;
attn_rules)
  # the decode kernel's scan and stage rules (a9ea2c5's successor) against the configuration before them, the
  # trainer's decode at T = 1,024, each row count in two processes one after the other
  for rows in 128 512; do
    for legacy in "" "--block-scan 512 --few-stages-from 1000000"; do
      timeout 240 python bench/prof_decode.py --tokenizer "$tok" --out "$out" --rows "$rows" --new 1024 \
        --commit "$commit" --baseline-attention triton --fuse-baseline --baseline-sampler triton \
        --baseline-step-graph on $legacy 2>&1 | tee -a "$out/prof_decode_attn_rules.log" || true
    done
  done
  ;;
moe)
  python -m pytest -m gpu -q tests/test_moe_experts.py 2>&1 | tee "$out/gpu_tests_moe.log"
  timeout 420 python bench/bench_e2e.py --tokenizer "$tok" --out "$out" --systems logitless --commit "$commit" \
    --shape gpt-oss-20b --T 256 --steps 2 --prompts 4 --G 4 --micro 4 --model-root "$out/models" \
    --set model.lora_target_experts=true 2>&1 | tee "$out/e2e_moe.log" || true
  ;;
moe_exactness)
  python -m pytest -m gpu -q -s tests/test_moe_exactness.py 2>&1 | tee "$out/gpu_tests_moe_exactness.log"
  python bench/gpu_exactness.py --out "$out" --commit "$commit" \
    --families qwen3_moe,olmoe,mixtral,qwen2_moe,gpt_oss_moe,deepseek_v3 2>&1 | tee "$out/gpu_exactness_moe.log"
  ;;
two_gpu)
  python -m pytest -m gpu -q tests/test_rollout_device.py 2>&1 | tee "$out/gpu_tests_rollout_device.log"
  common=("${step[@]}" --steps 5)
  python bench/bench_e2e.py "${common[@]}" --out "$out/one_gpu" 2>&1 | tee "$out/e2e_one_gpu.log"
  python bench/bench_e2e.py "${common[@]}" --out "$out/rollout_gpu" --set rollout.device=cuda:1 \
    2>&1 | tee "$out/e2e_rollout_gpu.log"
  python bench/bench_e2e.py "${common[@]}" --out "$out/rollout_gpu_async" --set rollout.device=cuda:1 \
    --set train.async_rollout=true --set objective.sampler_is_mode=token_truncate \
    --set objective.sampler_is_clip_max=2.0 2>&1 | tee "$out/e2e_rollout_gpu_async.log"
  ;;
*)
  echo "unknown stage $stage: use decode, decode_lb, e2e_lb, gen_parts, update_parts, sampler, step_graph, step_graph_e2e, attn_rules, moe, moe_exactness or two_gpu" >&2
  exit 2
  ;;
esac
