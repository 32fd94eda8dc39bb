#!/usr/bin/env bash
# The checks and benchmarks that wait for a GPU, ready for one lent machine (its image has
# torch + CUDA, transformers and peft, and it cannot download; ember itself comes by PYTHONPATH):
#
# A session lent a GPU has 15 minutes of device time in all, the machine's start included (about
# 30 s), and a warm machine goes back 30 s after a call: two calls back to back, then give_back.
# What is still unmeasured comes first (carry .gpu: Liger-Kernel and torchao):
#
#   DEADLINE=540 bash benchmarks/gpu.sh serve kernels-norms decode                # 1st call (timeout_s 575)
#   DEADLINE=290 bash benchmarks/gpu.sh serve-invariant decode-floor levers       # 2nd (timeout_s 300)
#
# (`serve` re-measures issue 29 pt 4's 64 clients (9.32x on the fourth lease, 11.33x on the third)
# with each path's anatomy: since then the text is read under the next step's forward, the triton
# plan is built in numpy, plans are copied in without syncing the stream and steps are padded to
# quarters of a doubling (1.37x -> 1.09x the tokens fed at 64 clients); beside it, with
# serve.async_steps (each step launched before the last one's ids are read back).
# `kernels-norms` is issue 28's row ops against Liger, each now tuned on the GPU among more
# configs: softmax's long rows with L2 hints, the norm forward's rows and warps, the backward's
# 1- and 2-warp programs, RoPE's tiles and warps.
# `decode` times the fused step with two changes since the fourth lease: a product reads its rows
# once for the norm and the product, and the attention's tile of held slots is the cache's width
# (up to 256 slots, read whole before the wait).
# `serve-invariant` serves with serve.batch_invariant, whose answers must equal the batch-1
# engine's bit for bit (pt 4's equality; never run on a GPU), fp32 then bf16. `decode-floor` times
# the step's chain of launches with no bytes in it, the bound on pt 3 at gpt2-small's shape.
# `levers` starts with llama-small's row, never run whole.
# Then `decode-wide` and `fp8-wide`: points 3 and 2 at widths where bytes and products outweigh
# launches and casts. `all` (issue 29's own rows, 497 s on the fourth lease) re-measures the rest.)
# The leases so far: 2026-11-26, an H200: `all` (its serve stage then failed on its own
# arguments), `serve decode kernels`, `kernels-test`; 2026-11-27, an H100: `all` (serve's flex
# rows fell back to eager FlexAttention, since fixed; train and decode cut at their limits),
# then gpu_train's ember/muon/fp8 rows, the CLI row and decode.py; 2026-11-27, an H200: `all`
# (serve cut at 200 s after its rows, fp8-loss left 37 s: both trimmed since), then
# `kernels-norms serve-host levers` (serve-host and levers' llama-small row failed, fixed since);
# 2026-11-27 22:17, an H200: `all` in 497 s, every stage whole, then `decode-persistent
# kernels-norms serve-host`: benchmarks/RESULTS.md, "One GPU, ...". Later: `fp8-filters`,
# `decode-tuned`, `kernels-train`, `autotune`, `kernels` (its graph column), `kernels-test` whole,
# then `analyze`, `lora`, `plan`, `parallel` (earlier issues' GPU checks, each <= 5 min).
#
# Each stage writes $OUT/<stage>.log (OUT defaults to runs/gpu) and is stopped at its own time
# limit (below) or at DEADLINE seconds after the call began (`all`: 540), whichever comes first,
# so a call stays inside the device's 10 minutes a command with its logs; a stage with under
# 20 s left is skipped and says so. The script exits 1 if any stage failed or was skipped.
# `all` ends by writing $OUT/summary.md: the device, then each stage's tables and findings.
#   env       nvidia-smi, torch, transformers, peft versions                         (45 s)
#   analyze   cpu-quick trained 30 steps on CUDA, then `ember analyze` profile (CUDA
#             activities) and memory (the allocator's history, cuda-snapshot.pickle):
#             the two instrument paths of issue 15 that have not run on a GPU       (180 s)
#   decode    benchmarks/decode.py: fp32 parity first (HF, the graphed engine, ember's fused step:
#             ember/infer/fused.py, five launches a block), then gpt2-small bf16, eager and the
#             fused step graphed, its kernels launched as programmatic dependents (PDL) and
#             without (`all`: with alone, DECODE_VARIANTS), in one run, against transformers'
#             generate (issue 29 point 3), and the fastest row's anatomy: kernels a token, their
#             time against the wall. The compiled
#             + CUDA graphs road (1,600 tok/s on the H200), lookahead and int8 were measured
#             before; their compile would starve fp8-loss (DECODE_ARGS='--variants
#             compiled-graphs fused-graphs' brings them back)                              (170 s)
#   decode-persistent  decode.py's rows for the whole step in one persistent kernel, 16 and 8
#             outputs a task (ember/kernels/persistent.py; fp32 parity first), gpt2-small bf16,
#             graphed, against HF's generate, with the faster one's anatomy; the five-launch step's
#             rows are `decode`'s, the same lease. Its own stage: a wait that never ends on a GPU
#             (the CPU's interpreter runs one program, which cannot show one) costs it alone  (120 s)
#   decode-floor  benchmarks/decode_floor.py: the fused step's 67 dependent launches a token and the
#             persistent step's 61 grid-wide waits, timed with no bytes in them: the tokens/s
#             that the chain alone allows, against the bytes' bound (25% of it: issue 29 pt 3)  (60 s)
#   decode-tuned  decode.py's compiled + graphs row against the same with Engine's TUNED
#             compile (weights frozen into the graph, q/k/v fused, max-autotune), and the
#             faster one's anatomy (issue 29 pt 3's next lever)                       (200 s)
#   decode-wide  decode.py's bf16 rows for gpt2-large (1280 wide, 36 layers), compiled and fused,
#             graphed: each GEMV reads 3-13 MB, against gpt2-small's latency-bound 1-5 MB   (200 s)
#   lora      benchmarks/lora.py, llama-small r=8 on add-2 SFT rows against PEFT:
#             issue 11's target, >= 1.3x PEFT's tokens/s at <= its memory           (300 s)
#   plan      `ember plan gpt2-small --measure` in bf16: predicted against measured,
#             and the caching allocator's peak                                      (240 s)
#   parallel  benchmarks/parallel.py, gpt2-small on one GPU: tokens/s, MFU           (300 s)
#   kernels-test  tests/test_kernels_{norm,ce,attention,int8}.py, test_paged_triton.py,
#             test_fused_decode.py, test_persistent_decode.py and test_invariant.py on CUDA: each kernel against its
#             reference on the GPU itself, the fused step's PDL road and the persistent step (one
#             program an SM there) included (the CPU runs them under the interpreter)        (150 s)
#   kernels   benchmarks/kernels.py: each of ember's kernels against eager, torch.compile
#             and Liger-Kernel (its wheel unpacked into .gpu/, carried: the image
#             lacks it), gpt2-small and llama-small shapes; kernels.json; then --host, each
#             wrapper's host time with the launches stubbed, ember's against Liger's  (300 s)
#             (here, once: pip download liger-kernel torchao==0.18.0 --no-deps -d /tmp/lg
#              --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 &&
#              for w in /tmp/lg/*.whl; do unzip -qo $w -d .gpu; done && rm -rf .gpu/test &&
#              echo /.gpu/ >> .git/info/exclude; torchao is train's fp8 rows: the image lacks it)
#   kernels-norms  kernels.py --ops rms_norm layer_norm softmax rope_qk (launched and from graphs,
#             against Liger; the norms' tuned backward beside its first config untimed) and
#             paged_attention (serving's decode attention against the gather road, eager and
#             compiled), then --host                                                 (200 s)
#   kernels-train  `ember train gpt2-small` with train.kernels=torch, then =triton, on the
#             same batch: tokens/s and peak memory (benchmarks/parallel.py; a CPU dry run:
#             DEV=cpu KCFG=tiny KTOK=2048 KMB=4)                                      (300 s)
#   train     benchmarks/gpu_train.py: ember's gpt2-small step (the preset's road) against
#             transformers' compiled GPT-2, and Muon (issue 29 pt 1; each row printed as it
#             ends, with its wall time; each ember row's anatomy: device time by kind of
#             kernel, and the MFU its GEMMs alone would give; then the floor: the step's
#             products and attention alone, bf16 and fp8, the ceilings on 45% MFU and fp8's 1.2x;
#             `all` leaves the anatomy and the floor out: TRAIN_ARGS)                        (120 s)
#   cli       `ember train gpt2-small` through the CLI (benchmarks/parallel.py's single layout): the
#             preset's own step, 8 micro-batches of 64 × 1024, loader, logging every 5 steps;
#             MFU over steps 6-15, the trainer's second and third logged windows (its first,
#             steps 2-5, holds the warm-up; each window is written at its end, so a stage cut
#             after step 10 still has one; issue 29 pt 1 as worded; a CPU dry run: CCFG=tiny
#             CMB=4)                                                                        (150 s)
#   fp8-loss  gpu_train.py --loss-steps 300: gpt2-small bf16 and fp8 on the python corpus, the
#             same seed and batches; the last 20 steps' mean loss of each, and tokens/s after
#             step 20 (issue 29 pt 2)                                                    (150 s)
#   fp8-filters  gpu_train.py's fp8 rows by train.fp8_linears (the blocks', the MLPs' alone, with the
#             head) against bf16, then the 300-step loss of the head's row against bf16's     (240 s)
#   fp8-wide  gpu_train.py at 2048 wide (gpt2-small's 12 layers, 16 heads of 128: ~0.7B parameters),
#             bf16 against fp8 with the floor: float8 where its GEMMs outweigh its casts, against
#             768 wide where they do not (WIDE: other overrides)                              (180 s)
#   levers    gpu_train.py's lever rows, the unmeasured first: llama-small against
#             LlamaForCausalLM with its floor (issue 29 pt 1's "reported beside it"; its row failed on
#             the third lease, never run since); `ember plan`; then those the third lease measured:
#             CUDA graphs on the whole step, cuDNN and flash attention; 64 rows a micro-batch; Muon
#             at the preset's 524,288 tokens a step (32 micro-batches of 16, "<= 3%"); per-block
#             compile, kernels=triton, hf eager                                             (300 s)
#   autotune  gpu_train.py's ember against train.compile_mode=max-autotune-no-cudagraphs, whose
#             compilation times each GEMM's candidate kernels (issue 29 pt 1's next lever) (300 s)
#   serve     benchmarks/serve.py --device cuda: gpt2-small shape served to 1/16/64/256
#             closed-loop clients, ember's Triton paged kernel with CUDA-graph buckets, without
#             and with serve.async_steps (each step launched before the last one's ids are read
#             back); each road's 64-client anatomy (the device's busy share: host- or
#             device-bound). SERVE_PATHS="triton flex gather" adds FlexAttention (an H200,
#             2026-11-27: 1.46x sequential at 64 clients, 737 µs of kernels a token) and the
#             gather road; `all` serves triton alone, without async steps or the anatomy   (150 s)
#   serve-invariant  serve.py --batch-invariant: the same workload served with serve.batch_invariant
#             (ember.kernels.invariant's fixed-order products, the triton paged kernel), 16 and 64
#             clients in fp32, then 64 in bf16; every answer must equal the batch-1 engine's
#             (batch-invariant too) bit for bit, and the rate is against the plain graphed
#             engine's in the same dtype (issue 29 pt 4)                                     (150 s)
#   serve-host  serve.py --host: the scheduler's own work a token at 64 clients, the model stubbed,
#             on this machine's host (the 2-core CPU's figures: RESULTS.md)                (60 s)
# The figures go to benchmarks/RESULTS.md with the device named.
set -uo pipefail
cd "$(dirname "$0")/.."
SELF=$PWD/benchmarks/gpu.sh  # (`all` calls it again, from the repository root)
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
PY=${PY:-python3}
DEV=${DEV:-cuda}  # (DEV=cpu PY=.venv/bin/python: a dry run of the script's plumbing here)
export PYTHONPATH="$PWD:$PWD/.gpu${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # a stage stopped at its limit keeps all it printed (a pipe's buffer is lost)
failed=0

DEADLINE=${DEADLINE:-0}  # > 0: every stage ends by this many seconds after the start (a lease's budget)
export GPU_SH_T0=${GPU_SH_T0:-$(date +%s)} DEADLINE  # (the start, also for `all`'s inner call)

# decode-only steps padded to quarters of each doubling, as steps with prompt chunks are: 1.04x the
# tokens fed at 256 clients, 1.09x at 64, against 1.16x and 1.11x with powers of two (serve.py's
# workload, its scheduler stubbed, 2-core CPU)
SERVE_BUCKETS=${SERVE_BUCKETS:-[1,2,4,8,16,24,32,40,48,56,64,80,96,112,128,160,192,224,256]}

stage() {  # stage NAME SECONDS COMMAND...: run it with a limit, its output to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    if [ "$DEADLINE" -gt 0 ]; then  # what is left of the whole call, less 10 s to write the logs
        local left=$((DEADLINE - ($(date +%s) - GPU_SH_T0) - 10))
        if [ "$left" -lt 20 ]; then
            echo "== $name: skipped, ${left}s left of DEADLINE=$DEADLINE" | tee -a "$OUT/$name.log"
            failed=1
            return
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/$name.log"
    local start=$SECONDS
    timeout "$limit" bash -c "$*" >>"$OUT/$name.log" 2>&1
    local rc=$?
    [ "$rc" -eq 0 ] || failed=1
    echo "== $name: exit $rc after $((SECONDS - start))s" | tee -a "$OUT/$name.log"
    tail -n 25 "$OUT/$name.log"
}

summary() {  # summary STAGE...: $OUT/summary.md, the device, then each stage's tables and findings
    {
        # nvidia-smi's name column ("NVIDIA H100 80GB HBM3   On", "NVIDIA H200   On"), less the persistence mode
        local gpu
        gpu=$(grep -m1 -o 'NVIDIA [A-Z0-9][^|]*' "$OUT/env.log" 2>/dev/null | sed -E 's/ +(On|Off)? *$//')
        echo "# benchmarks/gpu.sh $*: $(date -u +%F), ${gpu:-$DEV}"
        grep -h -m1 '^[0-9.]*+cu' "$OUT/env.log" 2>/dev/null | sed 's/^/torch, GPU, transformers, peft: /'
        for s in "$@"; do
            [ "$s" = env ] && continue
            echo; echo "## $s ($(grep -h '^== '"$s"': ' "$OUT/$s.log" 2>/dev/null | tail -1 | sed 's/^== //'))"
            grep -h -E '^\||: loss |: refused|: failed|tokens/s, MFU|^anatomy of|in the GEMMs|^floor: |x sequential|^timed: |leaves the batch-1 answer|completions differ|^target|one request after another' "$OUT/$s.log" 2>/dev/null
        done
    } >"$OUT/summary.md"
    echo "== summary: $OUT/summary.md"
}

for what in "$@"; do
    case $what in
    env)
        stage env 45 "nvidia-smi; $PY -c 'import torch, transformers as t, peft; \
            print(torch.__version__, torch.cuda.get_device_name(), t.__version__, peft.__version__)'"
        ;;
    analyze)
        rm -rf runs/gpu-cq
        stage analyze 180 "$PY -m ember train cpu-quick run.name=gpu-cq train.device=$DEV train.max_time=0 \
            train.max_steps=30 && $PY -m ember analyze runs/gpu-cq profile --steps 3 \
            && $PY -m ember analyze runs/gpu-cq memory && ls -la runs/gpu-cq/analysis/*/ \
            && cp runs/gpu-cq/analysis/memory/results.json $OUT/memory.json \
            && cp runs/gpu-cq/analysis/memory/memory.png $OUT/memory.png \
            && cp runs/gpu-cq/analysis/profile/results.json $OUT/profile.json"
        ;;
    decode)
        stage decode 170 "$PY benchmarks/decode.py --device $DEV --model gpt2-small --dtype bf16 --quant none \
            --reps 1 --new-tokens 128 --variants ${DECODE_VARIANTS:-fused-graphs fused-graphs-no-pdl} --anatomy \
            ${DECODE_ARGS:-}"
        ;;
    decode-persistent)  # issue 29 pt 3: the whole step in one persistent kernel, beside the five-launch block
        stage decode-persistent 120 "$PY benchmarks/decode.py --device $DEV --model gpt2-small --dtype bf16 \
            --quant none --reps 1 --new-tokens 128 --variants fused-graphs-persistent fused-graphs-persistent-n8 --anatomy"
        ;;
    decode-floor)  # issue 29 pt 3's bound: the step's chain of 67 launches / 61 waits with no bytes in it
        stage decode-floor 60 "$PY benchmarks/decode_floor.py --device $DEV"
        ;;
    decode-tuned)  # issue 29 pt 3's next lever: frozen weights (q/k/v fused), max-autotune, against compiled
        stage decode-tuned 200 "$PY benchmarks/decode.py --device $DEV --model gpt2-small --dtype bf16 --quant none \
            --reps 1 --new-tokens 128 --variants compiled-graphs tuned-graphs --anatomy"
        ;;
    decode-wide)  # issue 29 pt 3 at a width whose GEMVs read at a share of the bandwidth (gpt2-large)
        stage decode-wide 200 "$PY benchmarks/decode.py --device $DEV --model ${WIDE_MODEL:-gpt2-large} --dtype bf16 \
            --quant none --reps 1 --new-tokens 128 --variants compiled-graphs fused-graphs --anatomy"
        ;;
    lora)
        stage lora 300 "$PY benchmarks/lora.py --device $DEV --model llama-small --batch 16 --data add-2"
        ;;
    plan)
        stage plan 240 "$PY -m ember plan gpt2-small --measure train.device=$DEV train.precision=bf16"
        ;;
    parallel)
        stage parallel 300 "$PY benchmarks/parallel.py --config gpt2-small --device $DEV --batch-tokens 0 \
            --steps 30 --layouts single"
        ;;
    kernels-test)  # the kernels' own tests, on the GPU: the CPU runs them interpreted
        stage kernels-test 150 "$PY -m pytest -q -p no:cacheprovider tests/test_kernels_norm.py \
            tests/test_kernels_ce.py tests/test_kernels_attention.py tests/test_kernels_int8.py \
            tests/test_paged_triton.py tests/test_fused_decode.py tests/test_persistent_decode.py \
            tests/test_invariant.py -k 'not cpp'"
        ;;
    kernels)
        stage kernels 300 "$PY benchmarks/kernels.py --device $DEV --json $OUT/kernels.json && \
            $PY benchmarks/kernels.py --device $DEV --host"
        ;;
    kernels-norms)  # issue 28 pt 5's rows against Liger that were host-bound: launched, from graphs, host
        stage kernels-norms 200 "$PY benchmarks/kernels.py --device $DEV --ops rms_norm layer_norm softmax \
            rope_qk paged_attention && $PY benchmarks/kernels.py --device $DEV --host"
        ;;
    kernels-train)
        for k in torch triton; do
            stage kernels-train 150 "$PY benchmarks/parallel.py train.kernels=$k --config ${KCFG:-gpt2-small} \
                --device $DEV --batch-tokens ${KTOK:-131072} --micro-batch ${KMB:-16} --steps 25 --warmup 10 \
                --layouts single"
        done
        ;;
    train)
        stage train 120 "$PY benchmarks/gpu_train.py --device $DEV ${TRAIN_ARGS---anatomy --floor} \
            --rows ember hf-compiled ember-muon"
        ;;
    cli)  # issue 29 pt 1 as worded: `ember train gpt2-small` itself, its preset's 524,288-token steps
        stage cli 150 "$PY benchmarks/parallel.py train.report=false train.log_every=5 --config ${CCFG:-gpt2-small} \
            --device $DEV --batch-tokens 0 --micro-batch ${CMB:-64} --steps 15 --warmup 5 --layouts single"
        ;;
    fp8-loss)  # issue 29 point 2: tokens/s and the loss after 300 steps against bf16's, one run each
        stage fp8-loss 150 "$PY benchmarks/gpu_train.py --device $DEV --loss-steps 300 --rows ember ember-fp8"
        ;;
    fp8-filters)  # issue 29 pt 2's next lever: which linears go to fp8 (train.fp8_linears), speed then loss
        stage fp8-filters 240 "$PY benchmarks/gpu_train.py --device $DEV --rows ember ember-fp8 ember-fp8-mlp \
            ember-fp8-all && $PY benchmarks/gpu_train.py --device $DEV --loss-steps 300 --rows ember ember-fp8-all"
        ;;
    fp8-wide)  # issue 29 pt 2 where float8 can pay: gpt2-small 2048 wide (16 heads of 128), bf16 against fp8
        stage fp8-wide 180 "$PY benchmarks/gpu_train.py --device $DEV --set ${WIDE:-model.d_model=2048 model.n_head=16} \
            --steps 10 --warmup 3 --floor --rows ember ember-fp8"
        ;;
    levers)  # issue 29's levers one by one, the unmeasured first (each row prints as it ends)
        stage levers 300 "$PY benchmarks/gpu_train.py --device $DEV --model llama-small --floor \
            --rows ember hf-compiled ember-block && \
            $PY -m ember plan gpt2-small train.device=$DEV && \
            $PY benchmarks/gpu_train.py --device $DEV --rows ember ember-whole-graphs ember-cudnn ember-flash && \
            $PY benchmarks/gpu_train.py --device $DEV --batch 64 --rows ember && \
            $PY benchmarks/gpu_train.py --device $DEV --accum 32 --steps 5 --warmup 2 --rows ember ember-muon && \
            $PY benchmarks/gpu_train.py --device $DEV --rows hf-compiled ember-block ember-triton hf-eager"
        ;;
    autotune)  # one more lever: inductor's max-autotune picks each GEMM's kernel by timing (slow to compile)
        stage autotune 300 "$PY benchmarks/gpu_train.py --device $DEV --rows ember ember-autotune"
        ;;
    serve)
        stage serve 150 "$PY benchmarks/serve.py serve.max_seqs=256 serve.max_batch_tokens=2048 \
            serve.kv_memory=8e9 serve.decode_buckets=$SERVE_BUCKETS ${SERVE_ARGS:-} --device $DEV \
            --model ${SCFG:-gpt2-small} --clients 1 16 64 256 --requests 256 \
            --attention ${SERVE_PATHS:-triton} --async-steps ${SERVE_ASYNC:-both} ${SERVE_ANATOMY---anatomy}"
        ;;
    serve-invariant)  # pt 4's equality: products and attention in an order that does not depend on the batch
        # fp32 at 16 and 64 clients, then bf16 at 64: with the sums' order fixed, equality no longer needs
        # fp32, and bf16's products run on tensor cores where fp32's (no TF32) run on FMA units (the third
        # lease's 64 clients: 69 µs of kernels in ~120 µs of wall an output token, fp32)
        inv="$PY benchmarks/serve.py serve.max_seqs=256 serve.max_batch_tokens=2048 serve.kv_memory=8e9 \
            serve.decode_buckets=$SERVE_BUCKETS --device $DEV --model ${SCFG:-gpt2-small} \
            --requests 256 --attention triton --batch-invariant"
        stage serve-invariant 150 "$inv --dtype fp32 --clients 16 64; rc=\$?; $inv --dtype bf16 --clients 64 && exit \$rc"
        ;;
    serve-host)  # the scheduler's host work a token on the GPU machine's own host, model stubbed
        # (CUDA hidden: the host's own work on its cores, as on the CPU; the triton cache plans
        # under the interpreter there, and with the model stubbed no kernel runs)
        CUDA_VISIBLE_DEVICES= stage serve-host 60 "$PY benchmarks/serve.py --host --attention gather flex triton"
        ;;
    all)  # issue 29 in one call: env, train, fp8-loss, cli, decode, serve (<= 9 min together)
        # the points' own rows only (the anatomies and floors measured before, the old roads, FlexAttention
        # and the gather road: their own stages), the unmeasured first
        [ "$DEADLINE" -gt 0 ] || DEADLINE=540
        TRAIN_ARGS= DECODE_VARIANTS=fused-graphs SERVE_PATHS=${SERVE_PATHS:-triton} SERVE_ASYNC=${SERVE_ASYNC:-off} SERVE_ANATOMY= \
            DEADLINE=$DEADLINE bash "$SELF" env train fp8-loss cli decode serve || failed=1
        summary env train fp8-loss cli decode serve
        ;;
    *)
        echo "unknown stage $what: env analyze decode decode-persistent decode-floor decode-tuned decode-wide lora plan parallel kernels-test kernels kernels-norms kernels-train train cli fp8-loss fp8-filters fp8-wide levers autotune serve serve-invariant serve-host all" >&2
        exit 2
        ;;
    esac
done
exit $failed
