#!/usr/bin/env bash
# Mutation testing with mutmut, one module at a time against its fast tests (developer tool, not run by CI).
#
#   pip install mutmut==3.8.1
#   bash scripts/mutation.sh objectives|rewards|checkpoint|ops|ops-cpu|rollout|rollout-cpu|sampling|weights [more mutmut run args]
#
# Works in a scratch copy of the repository (MUTATION_DIR, default a new temporary folder) with a generated
# setup.cfg, so the checkout is never touched; prints the score and the surviving mutants, and leaves the
# copy for `mutmut show <name>` / `mutmut browse` there. One worker at low priority: CPU-friendly, not fast.
set -euo pipefail
cd "$(dirname "$0")/.."
module=${1:?usage: bash scripts/mutation.sh objectives|rewards|checkpoint|ops|ops-cpu|rollout|rollout-cpu|sampling|weights}
shift
case "$module" in
  objectives) mutate="logitless/objectives/*"
              tests="tests/test_objectives.py tests/test_objectives_accum.py tests/test_objectives_hint.py tests/test_advantages.py tests/test_objectives_liger.py tests/test_objectives_reference.py tests/test_options_bounds.py
                     tests/test_policy_loss_edges.py tests/test_objective_inputs.py" ;;
  rewards)    mutate="logitless/rewards/*"
              tests="tests/test_rewards.py tests/test_extraction.py tests/test_rewards_edges.py" ;;
  checkpoint) mutate="logitless/trainer/checkpoint.py"
              tests="tests/test_checkpoint.py tests/test_checkpoint_faults.py tests/test_checkpoint_load.py" ;;
  ops)        mutate="logitless/ops/*"
              tests="tests/test_op.py tests/test_op_chunked.py tests/test_op_memory.py tests/test_triton.py" ;;
  sampling)   mutate="logitless/rollout/sampling.py"
              tests="tests/test_fused_sampler.py tests/test_rollout_waves.py tests/test_sampling_hash.py" ;;
  ops-cpu)    mutate="logitless/ops/chunked.py logitless/ops/token_logprobs.py"
              tests="tests/test_op.py tests/test_op_chunked.py" ;;
  rollout)    mutate="logitless/rollout/*"
              tests="tests/test_rollout.py tests/test_sampling_stats.py tests/test_rollout_units.py" ;;
  weights)    # where the rollout's decode weights live: merged copies, in place, sleeping memory (its CPU parts)
              mutate="logitless/rollout/weights.py logitless/rollout/sleep.py"
              tests="tests/test_rollout_weights.py tests/test_weight_copy.py tests/test_rollout_units.py" ;;
  rollout-cpu) # the rest of rollout/ (sampling.py has its own target) against the faster engine tests: not the
              # chi-square tests, nor test_rollout_families.py (every family x backend: too slow per mutant)
              mutate="logitless/rollout/static.py logitless/rollout/engine.py logitless/rollout/kv_cache.py
                      logitless/rollout/weights.py logitless/rollout/hf.py logitless/rollout/continuous.py
                      logitless/rollout/layouts.py logitless/rollout/attention.py logitless/rollout/types.py
                      logitless/rollout/factory.py"
              tests="tests/test_rollout.py tests/test_rollout_weights.py tests/test_rollout_waves.py
                     tests/test_rollout_units.py" ;;
  *) echo "unknown module '$module'; use objectives, rewards, checkpoint, ops, ops-cpu, rollout, rollout-cpu, sampling or weights" >&2; exit 2 ;;
esac
python=${PYTHON:-python}
work=${MUTATION_DIR:-$(mktemp -d -t logitless-mutation.XXXXXX)}
mkdir -p "$work"
rm -rf "$work/logitless" "$work/tests" "$work/mutants"
cp -r logitless tests "$work/"
find "$work" -name __pycache__ -prune -exec rm -rf {} +
# pytest settings without a [tool.mutmut] table, so that mutmut reads the setup.cfg below
sed -n '/^\[tool.pytest.ini_options\]/,/^\[/p' pyproject.toml | sed '$d' > "$work/pyproject.toml"
{
  echo "[mutmut]"
  echo "source_paths = logitless"
  echo "only_mutate ="
  set -f  # the patterns are for mutmut, not for the shell
  for m in $mutate; do echo "    $m"; done
  set +f
  echo "pytest_add_cli_args_test_selection ="
  for t in $tests; do echo "    $t"; done
  # --tb=no: a failing test prints no tensor reprs; with torch's thread pool inherited across mutmut's fork,
  # formatting a tensor could deadlock the mutant's process until its timeout (a minute or more each)
  printf 'pytest_add_cli_args =\n    -x\n    -q\n    --tb=no\n    -p\n    no:cacheprovider\n    -n\n    0\n'  # one process per mutant (addopts asks for two workers)
} > "$work/setup.cfg"
echo "mutating $mutate in $work against: $tests"
cd "$work"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one worker, one thread: no pool to deadlock in a forked child
nice -n 10 "$python" -m mutmut run --max-children 1 "$@"
"$python" -m mutmut results --all true > results.txt || true
killed=$(grep -c ': killed$' results.txt || true)
survived=$(grep -c ': survived$' results.txt || true)
other=$(grep -vc ': killed$\|: survived$' results.txt || true)
echo "$module: killed $killed, survived $survived, other (timeout / no tests / suspicious) $other"
grep ': survived$' results.txt || true
echo "details: cd $work && $python -m mutmut show <mutant name>"
