#!/usr/bin/env bash
# GPU checks in one pass, for a CUDA machine with jax, flax and pytest installed (no network needed), run from the
# repository root (every bench script runs as `python -m bench.<group>.<script>`):
#   1. the Pallas kernel test suites compiled through Triton (the same tests run interpreted on CPU),
#   2. bench.omnitide.migration_cost: a mode's migration split into plan, copy (at several copy-loop steps) and
#      bookkeeping for a 28-layer cache, plus a profiler trace of three events per mode,
#   3. bench.omnitide.attention_kernel with the Triton kernel (float32 and bfloat16) and with impl=xla, 28 layers per
#      timed call, with a device-kernel census of the 32K checkpoint calls, on layouts captured beforehand on any
#      machine:
#        python -m bench.omnitide.attention_kernel --repeats 0 --save-layouts .layouts/layouts_32k.pkl
# Usage: bench/gpu_checks.sh [OUT_DIR]   (results and logs land in OUT_DIR, default bench/out/gpu)
# Within about 9 minutes (kernel tests and the impl=xla run skipped):
#   TEST_S=0 MIG_S=90 PALLAS_S=75 BF16_S=45 UNROLL_S=45 XLA_S=0 SPLIT_S=0 LOOP_S=90 KCONF_S=120 bench/gpu_checks.sh OUT
# Time limits per step in seconds (0 skips a step): TEST_S, MIG_S, PALLAS_S, BF16_S, XLA_S, UNROLL_S (the bfloat16
# kernel with its 28 calls as straight-line code, no loop counter between them), SPLIT_S (the two runs of the kernel
# with each sequence's active pages split over 8 programs, float32 and bfloat16), LOOP_S (bench.omnitide.layer_loop:
# the decoder's layer scan against the unrolled loop, 8 layers of the 7B shapes in bfloat16), KCONF_S
# (bench.omnitide.kernel_configs: the kernel's block_q / warps / stages / splits grid at the 32K checkpoint, bfloat16).
set -u
out=${1:-bench/out/gpu}
layouts=${LAYOUTS:-.layouts/layouts_32k.pkl}
mkdir -p "$out"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
# One compilation cache for every step, so a later step reuses what an earlier one compiled.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/omnijax_jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
py=${PYTHON:-python3}
{ nvidia-smi -L; $py -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"; } \
    2>&1 | tee "$out/env.log"
[ "${TEST_S:-150}" = 0 ] || timeout "${TEST_S:-150}" $py -m pytest -q -p no:cacheprovider tests/kernels/test_block_sparse_attention.py \
    tests/kernels/test_streaming_topk.py 2>&1 | tee "$out/kernel_tests.log" | tail -25
if [ "${MIG_S:-90}" != 0 ]; then
    echo "== migration_cost (limit ${MIG_S:-90} s)"
    timeout "${MIG_S:-90}" $py -m bench.omnitide.migration_cost --layouts "$layouts" --layers 28 --chunks 64 256 4096 \
        --repeats 5 --out "$out" 2>&1 | grep -v "^  round" | tail -8
    timeout 30 $py -m bench.omnitide.migration_cost --layouts "$layouts" --layers 28 --events 3 --repeats 1 \
        --profile "$out/trace" --out "$out/profiled" 2>&1 | grep -v "^  round" | tail -16
fi
for run in "pallas float32 1 ${PALLAS_S:-150}" "pallas bfloat16 1 ${BF16_S:-110}" "xla float32 1 ${XLA_S:-130}" \
           "pallas bfloat16 1 ${UNROLL_S:-60} --unroll" \
           "pallas float32 8 ${SPLIT_S:-90}" "pallas bfloat16 8 ${SPLIT_S:-90}"; do
    set -- $run
    [ "$4" = 0 ] && continue
    echo "== attention_kernel impl=$1 dtype=$2 splits=$3 ${5:-} (limit $4 s)"
    timeout "$4" $py -m bench.omnitide.attention_kernel --layouts "$layouts" --impl "$1" --dtype "$2" --splits "$3" \
        --inner 28 ${5:-} --repeats 3 --profile "$out/trace_attention_$1_$2_$3${5:+_unrolled}" --out "$out" 2>&1 \
        | grep -v "^  round" | tail -32
done
if [ "${LOOP_S:-120}" != 0 ]; then
    echo "== layer_loop (limit ${LOOP_S:-120} s)"
    timeout "${LOOP_S:-120}" $py -m bench.omnitide.layer_loop --preset qwen2_5_omni_7b --layers 8 --dtype bfloat16 \
        --impl pallas --history 2048 --repeats 10 --out "$out" 2>&1 | tail -6
fi
if [ "${KCONF_S:-180}" != 0 ]; then
    echo "== kernel_configs bfloat16 (limit ${KCONF_S:-180} s)"
    timeout "${KCONF_S:-180}" $py -m bench.omnitide.kernel_configs --layouts "$layouts" --dtype bfloat16 --inner 28 \
        --repeats 3 --out "$out" 2>&1 | grep -v "^  round" | tail -14
fi
