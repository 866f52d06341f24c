#!/bin/bash
# The whole GPU suite (`pytest -m gpu tests/`) on a host with 1, 2 or 4+ GPUs, in shards that run side by side:
#   bash bench/gpu_suite.sh LOG_DIR [all | one-a | one-b | multi | three]
# 4+ GPUs: the exactness matrix in two halves (GPUs 0 and 1; the kernel files beside the first half, the other
# one-GPU files beside the second), then the multi-GPU files on one GPU (GPU 0), while their tests that need two
# GPUs (marked two_gpus) run on GPUs 2,3. 2 GPUs: the one-GPU shards on GPU 0 and 1, then the two_gpus tests on
# both. With 3+ GPUs the tests that need three (marked three_gpus) run last on GPUs 0,1,2 (THREE=0 leaves them out;
# part `three` runs only them). 1 GPU: one pytest process. Each shard's log is LOG_DIR/<shard>.log, its exit status on the log's last
# line, and LOG_DIR/summary.json gathers them; the script exits non-zero when any shard failed. The tests' tokenizers
# ship in tests/fixtures/; carry bitsandbytes, torchao and liger-kernel so nothing skips.
set -u
PY=${PYTHON:-python3}  # the interpreter with torch (PYTHON=.venv/bin/python in a checkout with the venv)
out=${1:?usage: bash bench/gpu_suite.sh LOG_DIR [all | one-a | one-b | multi | three]}
part=${2:-all}  # all, or one part for time-limited calls: one-a, one-b (one GPU, each < 600 s on an H100), multi (2 GPUs), three (3 GPUs)
case $part in all|one-a|one-b|multi|three) ;; *) echo "gpu_suite.sh: unknown part '$part': use all, one-a, one-b, multi or three" >&2; exit 2;; esac
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
X=tests/test_gpu_exactness.py
TWO="tests/test_parallel.py tests/test_tensor_parallel.py tests/test_rollout_device.py tests/test_fsdp_offload.py tests/test_trainer_async.py tests/test_weight_copy.py"
KERNELS="tests/test_triton_gpu.py tests/test_sampling_stats.py tests/test_objectives.py tests/test_fused_sampler.py tests/test_op_gpu.py tests/test_triton_sampling.py tests/test_triton_decode.py tests/test_tiled_mlp.py tests/test_step_graph.py tests/test_models.py tests/test_packing.py"
REST=""
for f in $(grep -l "pytest.mark.gpu" tests/test_*.py); do
  case " $X $TWO $KERNELS " in *" $f "*) ;; *) REST="$REST $f";; esac
done
HALF_A="llama or qwen2_window or qwen3 or mistral or phi3"
HALF_B="gemma2 or gemma3 or granite or gpt_oss or olmo2"
shard() {  # [MARK=...] shard NAME GPUS PYTEST-ARGS...   (MARK: the tests it selects, default "gpu and not three_gpus")
  local name=$1 gpus=$2; shift 2
  echo "$(date +%T) start $name on GPU $gpus" >> "$out/times.txt"
  CUDA_VISIBLE_DEVICES=$gpus "$PY" -m pytest -m "${MARK:-gpu and not three_gpus}" -q -rfEs --durations=8 -p no:cacheprovider "$@" \
    > "$out/$name.log" 2>&1
  echo "exit $?" >> "$out/$name.log"
  echo "$(date +%T) end $name" >> "$out/times.txt"
}
n=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$part" = one-a ]; then  # both exactness halves and the kernel files side by side on GPU 0 (~300 s on an
  # H100), then the multi-GPU files' one-GPU tests alone: they measure the device's free memory (~110 s)
  ( shard exactness_a 0 $X -k "$HALF_A" & shard exactness_b 0 $X -k "$HALF_B" & shard kernels 0 $KERNELS; wait )
  shard multi_gpu_files_on_one 0 $TWO
elif [ "$part" = one-b ]; then  # the other one-GPU files, the trainer's among them (~450 s on an H100)
  shard rest 0 $REST
elif [ "$part" = multi ]; then  # the tests that need two GPUs (one-b runs the multi-GPU files' others on one)
  MARK="gpu and two_gpus" shard multi_gpu 0,1 $TWO
elif [ "$part" = three ]; then
  MARK="gpu and three_gpus" shard three_gpus 0,1,2 tests/
elif [ "$n" -ge 4 ]; then  # about as long as the multi-GPU files alone (~500 s on H100s)
  ( (shard exactness_a 0 $X -k "$HALF_A" & shard kernels 0 $KERNELS; wait); shard multi_gpu_files_on_one 0 $TWO ) &
  ( shard exactness_b 1 $X -k "$HALF_B" & shard rest 1 $REST; wait ) &
  MARK="gpu and two_gpus" shard multi_gpu 2,3 $TWO &
  wait
elif [ "$n" -ge 2 ]; then
  ( shard exactness_a 0 $X -k "$HALF_A"; shard kernels 0 $KERNELS; shard rest 0 $REST ) &
  ( shard exactness_b 1 $X -k "$HALF_B"; shard multi_gpu_files_on_one 1 $TWO ) &
  wait
  MARK="gpu and two_gpus" shard multi_gpu 0,1 $TWO
else
  shard all 0 tests/
fi
if [ "$part" = all ] && [ "$n" -ge 3 ] && [ "${THREE:-1}" != 0 ]; then
  MARK="gpu and three_gpus" shard three_gpus 0,1,2 tests/
fi
fail=0
for f in "$out"/*.log; do
  echo "== $(basename "$f" .log): $(grep -E '[0-9]+ (passed|failed|skipped|error).* in [0-9.]+s' "$f" | tail -1)"
  grep -E "^(FAILED|ERROR) " "$f"
  tail -1 "$f" | grep -q "^exit 0$" || fail=1
done
# LOG_DIR/summary.json: what bench/results/gpu_tests_*.json records (device, versions, commit, each shard's counts,
# failures, skips and logitless's own warnings)
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} "$PY" - "$out" <<'PY'
import importlib.metadata as md, json, os, re, sys, pathlib, torch
out = pathlib.Path(sys.argv[1])
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"
shards = {}
for log in sorted(out.glob("*.log")):
    text = log.read_text(errors="replace")
    last = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|error).* in [0-9.]+s.*?)=*$", text, re.M)
    shards[log.stem] = {"result": last[-1].strip() if last else "no pytest summary (cut short?)",
                        "exit": text.strip().splitlines()[-1] if text.strip() else "",
                        "failed": re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M),
                        "skipped": re.findall(r"^SKIPPED \[\d+\] (.*)$", text, re.M),
                        # logitless's own warnings (a step graph that could not be captured, a fallback) can fail no
                        # test and still be a regression
                        "logitless_warnings": sorted({w[:300] for w in re.findall(
                            r"^\s+\S*logitless/\S+:\d+: (\w*Warning: .*)$", text, re.M)})}
info = {"device": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "versions": {n: version(n) for n in ("torch", "transformers", "peft", "triton", "bitsandbytes", "torchao",
                                             "liger_kernel")},
        "commit": os.environ["COMMIT"]}
(out / "summary.json").write_text(json.dumps({"info": info, "shards": shards}, indent=1))
print(f"wrote {out / 'summary.json'}")
PY
exit $fail
