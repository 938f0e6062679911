#!/usr/bin/env bash
# The GPU acceptance run of issues 6 and 7 (KDA and MoE kernels), in priority order, each step under its
# own time limit so that one slow step cannot take the others' time. Run on the device machine from the
# repository root, with the peer wheels in .whl/ (carried):
#     bash benchmarks/gpu_acceptance.sh [steps]      # steps: any of 0123456789cdkmnpr (default 1234), e.g. "13", "25", "4"
# Next (docs/benchmarks.md, "Still to run"): "0", then "p", on an H200 with fla, two calls (the KDA decode's loads
# issued first, timed on an H100 only, and the Mosaic GPU kernels with the state by TMA, tma, never run on a GPU),
# then "4" on an H200. What each step measured, and on which card, is in docs/benchmarks.md, one section a
# session; "1" is the KDA tests (all 37 passed in 313 s on a cold H200).
# A step's time limit can be changed with LIMIT_<step>=seconds, e.g. LIMIT_1=360 (steps 0 and r: LIMIT_0a and
# LIMIT_ra for their tests, LIMIT_0b and LIMIT_r for the rest); step 2's shapes with SHAPES_2.
# Writes $OUT/<step>.txt (and the benchmarks' JSON). pytest prints each test's duration, so the next run
# knows where the compile time goes.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STEPS=${1:-1234}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "peer wheels not installed: the benchmarks run without fla and jla"
export PYTHONPATH=$PWD:/tmp/site
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false

step() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*" | tee "$OUT/$name.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | grep -v -i "deprecat\|warn" >> "$OUT/$name.txt"
  echo "== $name done in $((SECONDS - t0))s" | tee -a "$OUT/$name.txt"
}

case $STEPS in *0*)  # KDA decode: its GPU tests (the value tiles' race check and the Mosaic GPU kernels
  # included), then the default, the one launch, and the Mosaic GPU kernels with the state by TMA through shared
  # memory (tma: one launch, split whole V and in tiles of 64 and 32; KDA_DECODE_CANDIDATES, JSON) at N = 1, 32,
  # 256 with fla
  [ -n "${KDA_DECODE_CANDIDATES:-}" ] || \
    KDA_DECODE_CANDIDATES='[{}, {"split": false}, {"tma": true, "split": false}, {"tma": true, "split": true},
      {"tma": true, "split": true, "block_v": 64}, {"tma": true, "split": true, "block_v": 32}]'
  XLA_FLAGS=--xla_gpu_autotune_level=0 step 0-kda-decode-tests ${LIMIT_0a:-260} \
    python3 -m pytest -q -rf --tb=line --durations=0 -p no:cacheprovider -W ignore tests/gpu/test_kda_gpu.py -k decode
  step 0-kda-decode-bench ${LIMIT_0b:-320} python3 -u benchmarks/kda.py --only decode --json "$OUT/kda_decode.json" \
    --decode-tunings "$KDA_DECODE_CANDIDATES" ;;
esac
case $STEPS in *p*)  # the split KDA decode's launches alone (prologue, state kernel at KDA_PARTS_STATE's tunings
  # with the copy bandwidth of the same run, the XLA norm) at N = 32 and 256, and a kernel that only streams the
  # pool on the state kernel's grid (in place or not, the slot read first or not): why the H200 reads less of its
  # copy. The Triton default and block_v 32 (the best two on the H200, thirty-sixth session), against the state
  # kernel on Mosaic GPU (tma: the tile through shared memory by TMA, not held in registers) at whole V, 64
  # and 32 columns a program
  [ -n "${KDA_PARTS_STATE:-}" ] || KDA_PARTS_STATE='[{}, {"block_v": 32}, {"tma": true},
    {"tma": true, "block_v": 64}, {"tma": true, "block_v": 32}]'
  export KDA_PARTS_STATE; step p-kda-decode-parts ${LIMIT_p:-300} python3 -u tests/gpu/probe_kda_decode_parts.py ;;
esac
case $STEPS in *n*)  # tail tiles narrowed to their used slots, run widest first: the narrow GPU tests, then the
  # gate+up kernel alone at 16384 tokens, the default against narrow 16 and 32, and the default again (H100,
  # thirty-seventh session: no gain)
  XLA_FLAGS=--xla_gpu_autotune_level=0 step n-narrow-tests ${LIMIT_na:-200} python3 -m pytest -q -rf --tb=short \
    --durations=0 -p no:cacheprovider -W ignore tests/gpu/test_moe_gpu.py \
    -k "mosaic_gpu_prefill and (tuning11 or tuning12 or tuning13 or tuning14)"
  MGPU_GATE_UP_ONLY=1 MGPU_TOKENS=16384 MGPU_TUNINGS='[{"quick": true}, {"quick": true, "narrow": 16},
    {"quick": true, "narrow": 32}, {"quick": true}]' \
    step n-narrow-gate-up ${LIMIT_n:-300} python3 -u tests/gpu/probe_mgpu_routed.py ;;
esac
case $STEPS in *d*)  # the Mosaic GPU path at decode token counts (tiles of 16 and 32 slots) against the Triton
  # decode kernels: whether weight streaming by TMA with a warpgroup of its own reads more of the copy bandwidth
  MGPU_TOKENS=16,512 MGPU_TUNINGS='[{"quick": true, "tile_t": 16}, {"quick": true, "tile_t": 32}]' \
    step d-moe-mgpu-decode ${LIMIT_d:-300} python3 -u tests/gpu/probe_mgpu_routed.py ;;
esac
case $STEPS in *k*)  # the KDA prefill's chunk table with its sequence search by compare_all (the default since
  # the twenty-fifth session) and by jnp's default loop, in place at both target shapes
  step k-kda-chunk-search ${LIMIT_k:-300} python3 -u tests/gpu/probe_kda_chunk_search.py ;;
esac
case $STEPS in *r*)  # the routed experts on Mosaic GPU: compiled through the switch against the pure op (uneven,
  # empty, one-expert routing), then timed against the Triton whole path at 4096 and 16384 tokens
  XLA_FLAGS=--xla_gpu_autotune_level=0 step r-moe-mgpu-tests ${LIMIT_ra:-240} \
    python3 -m pytest -q -rf --tb=short --durations=0 -p no:cacheprovider -W ignore tests/gpu/test_moe_gpu.py -k mosaic
  step r-moe-mgpu-routed ${LIMIT_r:-480} python3 -u tests/gpu/probe_mgpu_routed.py ;;
esac
case $STEPS in *1*)  # the references' fp32 GEMMs need no autotuning for a correctness check
  XLA_FLAGS=--xla_gpu_autotune_level=0 step 1-kda-tests ${LIMIT_1:-480} \
    python3 -m pytest -q -rf --tb=line --durations=0 -p no:cacheprovider -W ignore tests/gpu/test_kda_gpu.py ;;
esac
case $STEPS in *2*)
  # each shape with its peers: about 5 minutes on a cold machine for the first (compiles, the XLA reference),
  # under 3 for the next; on 2026-12-04 the default 420 s ended inside the second shape's peers
  step 2-kda-bench ${LIMIT_2:-560} python3 -u benchmarks/kda.py --only prefill --reps 10 --json "$OUT/kda.json" \
    --prefill-shapes ${SHAPES_2:-1x8192x96,16x4096x12} ;;
esac
case $STEPS in *3*)
  XLA_FLAGS=--xla_gpu_autotune_level=0 step 3-moe-tests ${LIMIT_3:-120} \
    python3 -m pytest -q -rf --tb=line --durations=0 -p no:cacheprovider -W ignore tests/gpu/test_moe_gpu.py \
    -k "scale_bytes or latent_moe or bit_exact" ;;
esac
case $STEPS in *4*)
  # (ARGS_4: more options, e.g. --no-sweep: the sweep's swap candidates are slower, twenty-third and twenty-seventh
  # sessions, and with the checked decode they failed to compile on jax 0.11.2's Triton)
  step 4-moe-bench ${LIMIT_4:-300} python3 -u benchmarks/moe.py --out "$OUT" --budget-s 270 ${ARGS_4:-} ;;
esac
case $STEPS in *5*)  # the prefill sweep around the default, phase 1's chunks per program included
  step 5-kda-sweep ${LIMIT_5:-300} python3 -u benchmarks/kda.py --sweep --only prefill --reps 10 --prefill-shapes 1x8192x96 \
    --json "$OUT/kda_sweep.json" ;;
esac
case $STEPS in *6*)  # the MoE tile sweep alone (MMA shapings swap / split around both defaults, or the JSON list
  # MOE_CANDIDATES: benchmarks/moe.py --candidates), each candidate's output checked against the default's
  step 6-moe-sweep ${LIMIT_6:-300} python3 -u benchmarks/moe.py --out "$OUT" --no-torch --sweep-only --budget-s 280 \
    ${MOE_CANDIDATES:+--candidates "$MOE_CANDIDATES"} ;;
esac
case $STEPS in *7*)  # prefill tunings (KDA_CANDIDATES, a JSON list of overrides of the default; {} is the
  # default) timed three times in turn at both target shapes (--rounds), without peers
  [ -n "${KDA_CANDIDATES:-}" ] || KDA_CANDIDATES='[{}, {"phase1_products": "tf32"}]'
  step 7-kda-candidates ${LIMIT_7:-400} python3 -u benchmarks/kda.py --only prefill --no-peers --reps 5 --rounds 3 \
    --prefill-shapes ${SHAPES_7:-1x8192x96,16x4096x12} --json "$OUT/kda_candidates.json" \
    --tunings "$KDA_CANDIDATES" ;;
esac
case $STEPS in *8*)  # MoE by device time (benchmarks/timing.py), with the decoder the model runs on real scales
  step 8-moe-device-time ${LIMIT_8:-300} python3 -u benchmarks/moe.py --out "$OUT" --no-torch --no-sweep \
    --tokens 16,512,4096 --budget-s 280 ;;
esac
case $STEPS in *9*)  # each prefill phase alone, by Nsight Compute (duration, DRAM, L2 hits, occupancy), for
  # the default and NCU_PREFILL's tunings (JSON list; null is the default) at NCU_PREFILL_SHAPE
  step 9-kda-phases ${LIMIT_9:-200} ncu --clock-control none -k regex:kda_prefill --csv --metrics \
    gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes.sum,lts__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread \
    python3 tests/gpu/probe_ncu.py P ;;
esac
case $STEPS in *c*)  # prefill with checkpoints every 64 tokens (prefix caching): the packed/checkpoint GPU
  # tests, then the timing with and without checkpoints, alternating twice (the first call compiles the
  # XLA reference: about 450 s in all on a cold machine, 2026-12-05; LIMIT_ca, LIMIT_cb per step)
  XLA_FLAGS=--xla_gpu_autotune_level=0 step c-kda-checkpoint-tests ${LIMIT_ca:-150} \
    python3 -m pytest -q -rf --tb=line --durations=0 -p no:cacheprovider -W ignore tests/gpu/test_kda_gpu.py -k packed
  for run in 1-0 1-64 2-0 2-64; do  # round-checkpoint
    step c-kda-checkpoint-$run ${LIMIT_cb:-150} python3 -u benchmarks/kda.py --only prefill --no-peers --reps 10 \
      --prefill-shapes ${SHAPES_c:-1x8192x96,16x4096x12} --checkpoint ${run#*-}
  done ;;
esac
case $STEPS in *m*)  # MoE prefill on Mosaic GPU (experimental): one expert's warp-specialised MXFP4 GEMM against
  # the dequantised product and beside a dense bf16 jnp.dot, at 256..4096 tokens (MGPU_T, MGPU_TUNINGS)
  step m-moe-mgpu ${LIMIT_m:-300} python3 -u tests/gpu/probe_mgpu_mxfp4.py ;;
esac
tail -n 25 "$OUT"/*.txt
