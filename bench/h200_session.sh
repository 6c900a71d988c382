#!/usr/bin/env bash
# One session's GPU work on the lent H200, in three calls of at most 10 minutes each (see
# bench/RESULTS.md for what each produced). Run from the repository root with the wheels of
# ultralytics, ultralytics-thop, ultralytics-platform, polars and polars-runtime-32 in .whl/
# (the machine has no package index):  bash bench/h200_session.sh census|bench|memory|kernels|diagnose|host-ab|fit|fit-background|fit-seeds|fit-check|amp-bisect|first-call|headroom
# first-call and host-ab alternate this tree with an older one on one host (hosts differ by 2x): before
# the device call, `mkdir -p ab/old && git archive REV fxpasses | tar -x -C ab/old` and carry "ab"
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# the device's torch has no .pyc and the host sets PYTHONDONTWRITEBYTECODE: without a written
# cache every process compiles what it imports (seconds; bench/bytecode.py, RESULTS fortieth session)
unset PYTHONDONTWRITEBYTECODE
export PYTHONPATH=/tmp/site:. YOLO_OFFLINE=1 PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pyc}
python -c "import torch, ultralytics; print('torch', torch.__version__, 'ultralytics', ultralytics.__version__, torch.cuda.get_device_name())"
case "${1:?census, bench, memory, kernels, diagnose, host-ab, fit, fit-background, fit-seeds, fit-check, amp-bisect, first-call or headroom}" in
census)  # the random-loss census on 13 of the 16 CPUs, the GPU tests beside it
    python -m fxpasses.testing.census --cases 10000 --jobs 13 --seed 500 --minutes "${MINUTES:-8.3}" \
        --examples "$OUT/census_examples.txt" > "$OUT/census.txt" 2>&1 &
    census=$!
    FXPASSES_MEASURE_DIR="$OUT" timeout 480 python -m pytest tests -m cuda -q -p no:cacheprovider -rfE \
        > "$OUT/cuda_tests.txt" 2>&1
    echo "cuda tests rc $?"; tail -5 "$OUT/cuda_tests.txt"
    wait $census; echo "census rc $?"; tail -30 "$OUT/census.txt" ;;
bench)  # the real criterion and the reference loss, interleaved against eager, fresh batches
    R=${ROUNDS:-30}
    python bench/interleaved.py --loss real --batch 16 --rounds $R --arms all,compile,compile-ro --out "$OUT/real16"
    python bench/interleaved.py --loss real --batch 16 --amp --rounds $R --arms all --out "$OUT/real16amp"
    python bench/interleaved.py --loss real --batch 4 --rounds $R --arms all --out "$OUT/real4"
    python bench/interleaved.py --loss reference --batch 16 --rounds $R --arms all --out "$OUT/ref16" ;;
kernels)  # where a steady step's GPU time goes, eager and all passes, batch 16
    for A in eager all; do
        python bench/kernels.py --loss real --arm $A --batch 16 > "$OUT/kernels_$A.txt" 2>&1
        echo "kernels $A rc $?"; grep -v Warn "$OUT/kernels_$A.txt" | head -12 | cut -c1-140
    done ;;
diagnose)  # the GPU tests, then where a steady step's host and GPU time go (real criterion, all passes, batch 16)
    FXPASSES_MEASURE_DIR="$OUT" timeout ${TESTS_S:-330} python -m pytest tests -m cuda -q -p no:cacheprovider -rfE \
        > "$OUT/cuda_tests.txt" 2>&1
    echo "cuda tests rc $?"; tail -4 "$OUT/cuda_tests.txt"
    python bench/host_timers.py --loss real --arm all --batch 16 --steps 30 > "$OUT/host_timers_all.txt" 2>&1
    echo "host timers rc $?"; grep -v Warn "$OUT/host_timers_all.txt" | tail -12
    python bench/timeline.py --loss real --arm all --batch 16 --steps 3 --out "$OUT/timeline" > "$OUT/timeline_all.txt" 2>&1
    echo "timeline rc $?"; grep -v Warn "$OUT/timeline_all.txt" | tail -12 | cut -c1-400
    python bench/kernels.py --loss real --arm all --batch 16 > "$OUT/kernels_all.txt" 2>&1
    echo "kernels all rc $?"; grep -v Warn "$OUT/kernels_all.txt" | head -14 | cut -c1-140 ;;
host-ab)  # host time per step of the real criterion (batch 16), this tree and ab/old in alternation
    test -d ab/old/fxpasses || { echo "no ab/old/fxpasses (see the header)"; exit 1; }
    for i in $(seq "${PAIRS:-2}"); do
        echo -n "new: "; python bench/host_timers.py --loss real --arm all --batch 16 --steps 30 2>&1 | grep "  step"
        echo -n "old: "; PYTHONPATH=/tmp/site:ab/old:. python bench/host_timers.py --loss real --arm all --batch 16 \
            --steps 30 2>&1 | grep "  step"
    done ;;
fit)  # complete-fit time of a real model.train(), native against the integration
    python bench/fit.py ${FIT_ARGS:?set FIT_ARGS} --device 0 --out "$OUT/fit" ;;
fit-background)  # complete fits, native against cold fxpasses runs whose passes run in another process
    # (each fxpasses run a store of its own: none reads an earlier one's result), BATCH (4 unless set), PAIRS (3)
    python bench/fit.py --batch ${BATCH:-4} --epochs 5 --pairs ${PAIRS:-3} --deadline-s ${DEADLINE_S:-570} --device 0 \
        --work /tmp/fitw --store "/tmp/fitstores/{run}" --background --out "$OUT/fit_background_b${BATCH:-4}.json" \
        2>&1 | grep -E "fit [0-9]|mAP|FAILED|vs native" ;;
fit-seeds|fit-check)  # the batch-16 AMP fit over trainer seeds, ARMS (native fxpasses unless set; ~50 s an arm),
    # the fxpasses arm with PASSES (e.g. "select"; all three unless set); fit-check: the fxpasses arm alone (seed 0
    # unless SEEDS), every loss call checked against native at equal inputs (~135 s)
    [ "$1" = fit-check ] && { ARMS=${ARMS:-fxpasses}; SEEDS=${SEEDS:-0}; CHECK=--check-calls; }
    for S in ${SEEDS:-1 2 3}; do
        python bench/fit.py --batch 16 --epochs 5 --pairs 1 --seed $S --device 0 --work /tmp/fitw --arms ${ARMS:-native fxpasses} \
            ${PASSES:+--passes $PASSES} ${CHECK:-} --out "$OUT/fit_seed$S.json" 2>&1 | grep -E "fit [0-9]|mAP|FAILED|checked"
    done ;;
amp-bisect)  # which pass the batch-16 fp16 fit's lower mAP follows (seed 0; ~60 s a fit), and the
    # trajectory with the trainer's gradient accumulation (nbs 64 / batch 16 = 4)
    for P in "select capture" "pair select" "pair capture"; do
        python bench/fit.py --batch 16 --epochs 5 --pairs 1 --seed 0 --device 0 --work /tmp/fitw --arms fxpasses \
            --passes $P --out "$OUT/fit_passes_${P// /_}.json" 2>&1 | grep -E "fit [0-9]|mAP|FAILED"
    done
    python bench/trajectory.py --device cuda --batch 16 --steps 30 --accumulate 4 --amp --out "$OUT/traj_acc4" \
        2>&1 | tail -4 ;;
headroom)  # SelectRows' capacity headroom: the default (4, powers of two) against 2 on finer buckets, batch 16
    for H in "--growth 4" "--growth 2 --fine"; do
        python bench/capacity_headroom.py $H interleaved --loss real --batch 16 --rounds ${ROUNDS:-20} --arms all \
            --out "$OUT/headroom_${H//[ -]/}" 2>&1 | grep -v Warn | tail -2
    done
    python bench/kernels.py --loss real --arm all --batch 16 > "$OUT/kernels_all.txt" 2>&1
    echo "kernels all rc $?"; grep -v Warn "$OUT/kernels_all.txt" | head -14 | cut -c1-140 ;;
memory)  # peak GPU memory of the real criterion, eager and all passes, one arm per process
    for B in 16 4; do for A in eager all; do
        python bench/peak_memory.py --loss real --arm $A --batch $B --steps ${STEPS:-30} --pools > "$OUT/memory_${A}_$B.txt" 2>&1
        echo "memory $A b$B rc $?"; tail -12 "$OUT/memory_${A}_$B.txt"
    done; done ;;
first-call)  # the real criterion's first call, this tree and ab/old in alternation
    test -d ab/old/fxpasses || { echo "no ab/old/fxpasses (see the header)"; exit 1; }
    python -m compileall -q fxpasses ab/old/fxpasses  # neither tree pays for its bytecode in a run
    for i in $(seq "${PAIRS:-2}"); do
        echo -n "new: "; python bench/first_call.py --batch 16 --image-size 640 --arms all --device cuda --phases 2>&1 | tail -2
        echo -n "old: "; PYTHONPATH=/tmp/site:ab/old:. python bench/first_call.py --batch 16 --image-size 640 \
            --arms all --device cuda 2>&1 | tail -1
    done ;;
esac
