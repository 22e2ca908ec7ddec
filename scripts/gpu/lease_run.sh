#!/usr/bin/env bash
# Every GPU check of one short lease (issue 21), each part under its own time limit, its output under OUT:
#   1. megatron-core 0.16.1 and 0.19.2 from wheels into their own folders, the native kernels built;
#   2. at once: the `gpu` pytest tier (megatron-core 0.16.1), the per-stage memory check, and Megatron's own
#      pretrain() (megatron-core 0.19.2: pretrain_gpt.py, ckpt=ours with alpha 0.5 against ckpt=no alpha 0);
#   3. alone on the GPU (timings): the copy kernels, the offload overlap, attention with and without dropout
#      (scripts/gpu/bench_attention_dropout.py: flash and cuDNN), a GEMM sustained for 20 s (bf16) and
#      10 s (fp8) beside the SM clock (scripts/gpu/sustained_gemm.py), two driver steps under the kernel
#      profiler (scripts/gpu/driver_steps.py --profile), the driver's training steps, the same steps at narrow
#      widths (driver_steps.py --host: the host's dispatch time of each) and the cost model's ground truth
#      (committed from the first lease: it gets what LEASE_S leaves).
# The parts land in OUT/parts.tgz (packed again after each stage, so a run stopped at its limit keeps what it
# measured).
# scripts/gpu/report.py --from-parts DIR (DIR: parts.tgz unpacked) then writes the report from these files
# (scripts/gpu_check.sh runs the same parts one after the other, without time limits).
#
#   OUT=DIR bash scripts/gpu/lease_run.sh [--dry-run]
#
# Environment (defaults): LEASE_S (560: the whole run's deadline in seconds; every part's limit is cut to what is
# left of it, and a part with under 15 s left is skipped with a line, so one 10-minute device command ends with its
# parts packed), OUT (docs/gpu-reports/parts), PYTHON (python3), WHEELS_OLD / WHEELS_NEW (.whl/
# megatron-core-0.16.1-cp312 / .whl/megatron-core-0.19.2-cp312), TESTS_S (180), GT_BUDGET_S (90),
# NATIVE_ITERS (20), XDIST (4: pytest-xdist workers, 0 for none), STEPS (the driver_steps.py cases, all when
# empty), STEPS_ITERS (6: iterations a case runs; its step time is the median after the first two), PROFILE (the
# cases profiled by kernel kind: llama-1b/no/0 llama-1b/ours/0.5), HOST (the cases run at narrow widths: the four
# llama-1b ones and llama-3b/ours/0.5), SKIP (parts left out, any of attention sustained profile steps host gt: a
# second, shorter lease measures only what the first did not), GT_TIMEOUT_S (150),
# TEST_TIMEOUT_S (100: one gpu-tier test's limit).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$ROOT/docs/gpu-reports/parts}
PYTHON=${PYTHON:-python3}
WHEELS_OLD=${WHEELS_OLD:-$ROOT/.whl/megatron-core-0.16.1-cp312}
WHEELS_NEW=${WHEELS_NEW:-$ROOT/.whl/megatron-core-0.19.2-cp312}
TESTS_S=${TESTS_S:-180}
GT_BUDGET_S=${GT_BUDGET_S:-90}
NATIVE_ITERS=${NATIVE_ITERS:-20}
XDIST=${XDIST:-4}
STEPS=${STEPS:-}
STEPS_ITERS=${STEPS_ITERS:-6}
GT_TIMEOUT_S=${GT_TIMEOUT_S:-150}
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-100}
LEASE_S=${LEASE_S:-560}
PROFILE=${PROFILE:-llama-1b/no/0 llama-1b/ours/0.5}
HOST=${HOST:-llama-1b/no/0 llama-1b/ours/0 llama-1b/ours/0.5 llama-1b/full/0 llama-3b/ours/0.5}
SKIP=${SKIP:-}
for part in $SKIP; do
  [[ " attention sustained profile steps host gt " == *" $part "* ]] \
    || { echo "lease_run.sh: error: SKIP has $part (valid: attention sustained profile steps host gt)" >&2; exit 2; }
done
skipped() { [[ " $SKIP " == *" $1 "* ]] && echo "skipped (SKIP): $1"; }
SITE_OLD=/tmp/h3t-site-old
SITE_NEW=/tmp/h3t-site-new
NATIVE=(--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256
        --micro-batch-size 4 --global-batch-size 8 --train-iters "$NATIVE_ITERS" --lr 1e-3 --min-lr 1e-4
        --lr-warmup-iters 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --bf16
        --transformer-impl local --no-persist-layer-norm --log-interval 1 --eval-iters 0 --seed 1234
        --attention-dropout 0 --hidden-dropout 0 --no-gradient-accumulation-fusion --eval-interval 1000)
# (--no-gradient-accumulation-fusion: Megatron-LM's default fusion needs NVIDIA apex's fused_weight_gradient_mlp_cuda,
# which the GPU machine lacks; megatron-core 0.19.2 refuses to build ColumnParallelLinear without it; its loop also
# needs --eval-interval with --train-iters)
if [[ ${1:-} == --dry-run ]]; then
  echo "LEASE_S=$LEASE_S OUT=$OUT PYTHON=$PYTHON WHEELS_OLD=$WHEELS_OLD WHEELS_NEW=$WHEELS_NEW TESTS_S=$TESTS_S GT_BUDGET_S=$GT_BUDGET_S"
  echo "PROFILE=$PROFILE HOST=$HOST SKIP=$SKIP STEPS=$STEPS STEPS_ITERS=$STEPS_ITERS"
  echo -n "native: "; printf '%q ' "$PYTHON" -m torch.distributed.run --nproc-per-node 1 pretrain_gpt.py "${NATIVE[@]}"; echo
  exit 0
elif [[ $# -gt 0 ]]; then
  echo "lease_run.sh: error: unknown argument $1 (valid: --dry-run)" >&2; exit 2
fi
PARTS=$(mktemp -d)
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH=$ROOT
stamp() { echo "== $(date +%T) $*"; }
START=$SECONDS
# cap N: N seconds, or what is left of LEASE_S (less 5 s to pack) when that is less; 0 when under 15 s are left
cap() { local left=$((LEASE_S - (SECONDS - START) - 5)); ((left < 15)) && { echo 0; return; }; echo $((left < $1 ? left : $1)); }
# run_capped N CMD...: CMD under timeout (cap N), or a line saying it was skipped
run_capped() { local t; t=$(cap "$1"); shift; if ((t == 0)); then echo "skipped (LEASE_S=$LEASE_S spent): $*" | cut -c1-160; return 124; fi; timeout "$t" "$@"; }
pack() { tar czf "$OUT/parts.tgz" -C "$PARTS" .; }
stamp "start on $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
"$PYTHON" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
"$PYTHON" -c "import datetime, json, sys, torch; json.dump({'gpu': torch.cuda.get_device_name(), 'date': \
datetime.date.today().isoformat(), 'torch': torch.__version__, 'cuda': torch.version.cuda}, sys.stdout)" >"$PARTS/meta.json"
for pair in "$WHEELS_OLD:$SITE_OLD" "$WHEELS_NEW:$SITE_NEW"; do
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "${pair#*:}" "${pair%%:*}"/*.whl \
    || echo "installing ${pair%%:*} failed"
done
# Megatron's pretrain() runs make in megatron/core/datasets (Megatron-LM's checkout has the Makefile; a wheel ships
# the built helpers_cpp but no Makefile): a no-op Makefile stands in for the checkout.
[[ -f $SITE_NEW/megatron/core/datasets/Makefile ]] || printf 'all:\n\t@true\n' >"$SITE_NEW/megatron/core/datasets/Makefile"
stamp "build"
H3T_BUILD_CUDA=1 run_capped 150 "$PYTHON" setup.py -q build_ext --inplace --parallel 8 >"$PARTS/build.log" 2>&1 \
  || echo "build failed: $(tail -n 5 "$PARTS/build.log")"
"$PYTHON" -c "import h3t_ext.kernels as k; print('kernels:', k.active_backend('cuda'), k.native_unavailable_reason('cuda'))" 2>&1 | tail -n 1
stamp "copy kernel tests alone"
PYTHONPATH=$ROOT:$SITE_OLD run_capped 60 "$PYTHON" -X faulthandler -m pytest -q -p no:cacheprovider -p no:xdist \
  tests/gpu/test_kernels_cuda.py 2>&1 | tail -n 30

stamp "native (0.19.2), stage memory and the gpu tier (0.16.1), at once"
native() {  # $1: name, $2: port, then flags
  local name=$1 port=$2; shift 2
  PYTHONPATH=$ROOT:$SITE_NEW run_capped 170 "$PYTHON" -m torch.distributed.run --nproc-per-node 1 --master-port "$port" \
    pretrain_gpt.py "${NATIVE[@]}" "$@" >"$PARTS/native-$name.log" 2>&1
  echo "native $name exit $?"
}
native ours 29611 --ckpt ours --offload-alpha 0.5 &
native no 29612 --ckpt no --offload-alpha 0 &
PYTHONPATH=$ROOT:$SITE_OLD run_capped 175 "$PYTHON" scripts/gpu/stage_memory.py --json --timeout-s "$(cap 170)" \
  >"$PARTS/stage_memory.json" 2>&1 &
XD=(); [[ $XDIST -gt 0 ]] && XD=(-n "$XDIST")
# -v: a result line per test as it ends (report.py counts them when the cap stops pytest before its XML);
# pytest-timeout (in the lease image) fails a test that hangs instead of the whole tier
"$PYTHON" -c "import pytest_timeout" 2>/dev/null && XD+=(--timeout "$TEST_TIMEOUT_S")
PYTHONPATH=$ROOT:$SITE_OLD run_capped "$TESTS_S" "$PYTHON" -m pytest -v -m gpu tests/gpu -p no:cacheprovider "${XD[@]}" \
  --junitxml="$PARTS/gpu_tests.xml" >"$PARTS/gpu_tests.txt" 2>&1
grep -E "(PASSED|FAILED|ERROR)|passed|failed" "$PARTS/gpu_tests.txt" | tail -n 30
wait
grep -h "lm loss" "$PARTS"/native-*.log | head -n 4; tail -n 2 "$PARTS/stage_memory.json" | cut -c1-600
pack
stamp "timings, alone on the GPU"
export PYTHONPATH=$ROOT:$SITE_OLD
run_capped 60 "$PYTHON" scripts/gpu/bench_copy_cuda.py --json >"$PARTS/copies.json" 2>&1 \
  || echo "copies failed: $(tail -n 2 "$PARTS/copies.json")"
run_capped 100 "$PYTHON" scripts/gpu/bench_offload_overlap.py --json >"$PARTS/overlap.json" 2>&1 \
  || echo "overlap failed: $(tail -n 2 "$PARTS/overlap.json")"
skipped attention || run_capped 60 "$PYTHON" scripts/gpu/bench_attention_dropout.py --json >"$PARTS/attention_dropout.json" 2>&1 \
  || echo "attention dropout failed: $(tail -n 2 "$PARTS/attention_dropout.json")"
tail -c 600 "$PARTS/copies.json"; echo; tail -c 600 "$PARTS/overlap.json"; echo
tail -c 600 "$PARTS/attention_dropout.json"; echo
pack
for prec_s in bf16:20 fp8:10; do  # the clock a GPU at its power limit sustains (report.py's SUSTAINED)
  skipped sustained || run_capped 90 "$PYTHON" scripts/gpu/sustained_gemm.py --precision "${prec_s%%:*}" --seconds "${prec_s#*:}" \
    --json "$PARTS/sustained-${prec_s%%:*}.json" 2>&1 | tail -n 1
done
pack
# where a driver step's GPU time goes, by kernel kind (driver_steps.py --compare prints it beside the model's terms)
skipped profile || run_capped 150 "$PYTHON" scripts/gpu/driver_steps.py --profile --iters 4 --only $PROFILE \
  --json "$PARTS/driver_profile.json" 2>&1
pack
ONLY=(); [[ -n $STEPS ]] && ONLY=(--only $STEPS)
skipped steps || run_capped 300 "$PYTHON" scripts/gpu/driver_steps.py --json "$PARTS/driver_steps.json" \
  --iters "$STEPS_ITERS" "${ONLY[@]}" 2>&1
pack
# the same steps at narrow widths: the host's time to dispatch each (the eager stack's steps are not all GPU time)
skipped host || run_capped 150 "$PYTHON" scripts/gpu/driver_steps.py --host --json "$PARTS/driver_host.json" \
  --iters "$STEPS_ITERS" --only $HOST 2>&1
pack
GT_T=$(cap "$GT_TIMEOUT_S"); GT_B=$((GT_T - 30 < GT_BUDGET_S ? GT_T - 30 : GT_BUDGET_S))
((GT_B < 10)) && GT_T=0  # under 10 s of budget measures nothing worth the start-up
skipped gt || run_capped "$GT_T" "$PYTHON" scripts/gpu/ground_truth.py --budget-s "$GT_B" \
  --json "$PARTS/ground_truth.json" >"$PARTS/ground_truth.txt" 2>&1 || echo "ground truth failed: $(tail -n 3 "$PARTS/ground_truth.txt")"
tail -n 3 "$PARTS/ground_truth.txt"
pack
stamp "done"
