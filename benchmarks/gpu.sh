#!/usr/bin/env bash
# Everything that needs a GPU, in one call: the GPU tests, the kernel/model/optimizer benchmarks
# and short training runs. Each stage is independent (a failing one is logged, the rest go on).
#
#   bash benchmarks/gpu.sh [tests] [bench] [train] [speed] [train2]   (default: tests bench train)
#
#   tests   python -m pytest -m gpu tests/, over GPU_TEST_WORKERS processes with pytest-xdist
#           (default: one per CPU core); where the wall time went: gpu_tests_timeline.txt
#           (ELEPHANT_GPU_SLOW=1 adds the slow opt-in FlexAttention tests)
#   bench   kernels.py ssd, kernels.py layers, bench_optim.py, kernels.py model, bench_packing.py,
#           bench_generate.py -> benchmarks/results/*.json (BENCHES="model ssd" for a subset, by
#           those names; generate: decoding speed and memory, ~3 min)
#   train   train.py on the wt103-70m model shape (pycode text, bytes), 1 GPU; its log summed up by
#           `summarize.py train-run` into benchmarks/results/train_<gpu>_1gpu.json
#   speed   benchmarks/train_speed.py: plain GPT vs attention-only vs hybrid through Trainer.train_step
#           at equal tokens per step, and streaming evaluation speed (~5 min; SPEED_ARGS passed on)
#   train2  the same on 1 GPU and on 2 GPUs with torchrun (for the 2-GPU speed-up; TRAIN2_GPUS=4: on 4; TRAIN_EXTRA: more
#           overrides for both, e.g. train.compile=graphs; TRAIN2_BEFORE=<folder holding an older
#           checkout's train.py, elephant/ and data_packing/>: its 2-GPU run too, the A/B)
#   recall  benchmarks/recall_study.py: the recall recipe and its ablations, trained side by side
#           for RECALL_BUDGET seconds each, scored by distance up to 64K and 1M tokens
#   recall-long  one recall run spread over calls (carry runs/recall-long-parts: see the stage);
#           RECALL_INIT=<folder of checkpoint parts> starts it from that run's weights
#   recall-seeds  several seeds of the recall recipe side by side, over calls (see the stage)
#           recall-long and recall-seeds train on every token (RECALL_LOSS=lm, the default) or
#           on the answer digits alone (RECALL_LOSS=answer: the 1M-token figure's objective)
#   recall-seeds-eval  those runs scored to 1M: ablations, offset 1M, two facts
#   recall-long-eval  that checkpoint scored up to 1M tokens: one, two and four facts, from rotary
#           position 1,014,000, and each carried part of the state dropped (RECALL_EVAL_NAME)
#   verify  the GPU checks of what was last built on the CPU only: the head, CUDA-graph evaluation
#           and compiled-model GPU tests, then train_speed with train.compile=model and the
#           CUDA-graph evaluation beside the defaults (~4 min)
#   eval-side  the GPU tests of the captured graphs (optimizer, evaluation, the side batch on its
#           stream), then train_speed's 64-lane evaluation compacted and with its side batch, in
#           turns (--eval-modes compact,side; ~8 min)
#   speed-ab  the hybrid step of this checkout and of an older one (SPEED_BEFORE=<folder>) by
#           train_speed.py, in turns over SPEED_AB_ROUNDS rounds: a speed lever's A/B in one call
#   packing-model  bench_packing.py --only paths --compile model --profile: packing with the whole
#           chunk step compiled, the paths timed in turns, every kernel of five of them
#           (with one round and no profile it took about 6 minutes on the H100, compiling included)
#   packing-verify  the GPU tests of packing and the model, then the packing paths compiled
#           (PACK_COMPILE="model graphs": also as CUDA graphs)
#   conv-forms  the Mamba conv's two forms with segments (conv_triton.SEGMENT_FORM "tiles" and
#           "starts"): the op in turns, the GPU tests of both, the packed step with each in turns
#   packing-shapes  issue 11's measure at two shapes, the window compiled: the padded and packed
#           steps beside the unpacked code on the same rows with every slot real (fill1_today_path),
#           at the wt103-70m shape (32 x 512) and the FineWeb recipe's (fineweb-124m, 32 lanes of
#           1,024), with the GPU's clock and power sampled beside them; ~8 min on an H100
#   lmstudy benchmarks/lm_study.py (LM_VARIANTS, default hybrid,transformer): hybrid with memory vs a transformer of the same size, the same
#           GPU minutes (LM_BUDGET seconds each) on the stdlib + site-packages, loss by position,
#           and the context ablation: the hybrid carried against reset every LM_RESET tokens
#           (default 2048) on the documents over 32K tokens (context_gain_8k_32k); LM_ARGS:
#           overrides for every variant (train.seed=1)
#   copy    benchmarks/copy_study.py: in-chunk copying under the LM loss, variants (COPY_VARIANTS,
#           default attn,hybrid) beside all attention, trained at once on the recall corpus with
#           BPTT over 8 chunks (COPY_ARGS) for COPY_STEPS steps (~5 min for two variants);
#           COPY_SHAPE=recall-recipe (memory, window, kept tokens) or wt103-70m-recipe: run alone;
#           COPY_SHAPE=recall-text: the filler is Python source, where the hybrid fails on the CPU
#           (COPY_VARIANTS=attn,hybrid,x0,attn-x0 COPY_ARGS=); COPY_SHAPE=a,b runs both at once;
#           COPY_SHAPE=recall-recipe-text COPY_VARIANTS=hybrid COPY_ARGS= COPY_DISTANCES=128,4096,65536:
#           the recall recipe on every byte among real text, scored past its window (issue 57);
#           COPY_SHAPE=recall-text,recall-recipe-text:hybrid:128+4096+65536 gives a shape its own
#           variants and distances; issue 57's levers beside the recipe:
#           COPY_SHAPE=recall-recipe-text:hybrid+mem-windows-4+gate-half-open:128+4096+65536;
#           COPY_EVERY=4096 scores that distance at every checkpoint, COPY_ABLATE=memory,keep the
#           last checkpoint again with each part dropped after every chunk, COPY_KEEP_EVAL=512,2048
#           the same with that many kept tokens instead of the trained number; COPY_WEIGHTS=$OUT
#           returns each run's last weights (w-<variant>/part.*: 2 files a variant; at most 8
#           files come back) before it is scored, for a later call to score without training;
#           COPY_PARALLEL=3: at most 3 variants at once, the rest as they end (four of wt103-70m's
#           width ran out of memory on an 80 GB H100):
#   long    benchmarks/long_study.py (issues 70, 71): the wt103-70m recipe's model on Python source
#           with Pythia's tokens (carry shared/data/tokenizers/gpt-neox-20b), LONG_VARIANTS (default
#           "today transformer") trained side by side for LONG_STEPS, scored (loss by position over
#           files of 64K+ tokens, the needle test, the drops), LONG_SPEED timed alone;
#           LONG_RECIPE=fineweb-124m: that recipe (GPT-2's tokens: carry shared/data/tokenizers/gpt2), or default
#   copy-score  those weights, carried back (runs/w-*), scored at COPY_DISTANCES, COPY_ABLATE and
#           COPY_KEEP_EVAL, one process each, at once
#   field   kernels.py field (issue 72): the SSD scan, the Mamba conv and attention beside mamba-ssm's
#           and fla's kernels (causal-conv1d and flash-attn-4 where installed) at the wt103-70m and
#           fineweb-124m shapes -> benchmarks/results/field_kernels_<gpu>.json; fla-core and
#           mamba-ssm installed from the wheels in .whl/ (`make field-wheels`; carry .whl; FIELD_ARGS)
#   eval-speed  benchmarks/eval_speed.py (issue 72): eval.py timed as a whole command, launch to
#           exit, on a random wt103-70m model and its kv_keep=0 shape: 64 lanes over ~16M tokens
#           of source files and one 1M-token document, cold and warm, and where a warm run's time
#           goes phase by phase -> benchmarks/results/eval_speed_<gpu>.json (carry
#           shared/data/tokenizers/gpt-neox-20b; EVAL_SPEED_ARGS passed on, e.g. "--profile 20":
#           steady chunks under torch's profiler, or "--recipes recall --kv-keep recipe": the
#           recall recipe as loaded, 4,096 kept tokens, kept4096_bytes_s; ~3 min on an H100)
#   kept-read  the GPU tests of the kept read (the dense and the fused kernel for part 2, the
#           fused op compiled), then kernels.py kept-read: every path of the read of 4,096 kept
#           tokens at 64 lanes, part2_fused beside part2_kept (issue 72; ~3 min)
# The device's copy of the repository carries stale git metadata: run it as
# `ELEPHANT_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu.sh ...`, the hash written
# into the command here, so that result files name the commit sent (benchmarks/common.commit).
# Results land in benchmarks/results/; when $OUT is set (the device machine) they are also
# packed into $OUT/results.tar.gz together with the logs.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
RES=benchmarks/results
LOGS=${OUT:-/tmp}/gpu-logs
mkdir -p "$RES" "$LOGS"
stages=${*:-tests bench train}
# what a stage reads that only a carry brings: missing, the call stops here, not minutes into it
# (2026-12-07: a long stage without the tokenizer ran on to its deadline and trained nothing)
for stage in $stages; do
  case $stage in long|eval-speed)
    tok=gpt-neox-20b
    if [ $stage = long ]; then   # the recipe's tokenizer (default: bytes, none to carry)
      case ${LONG_RECIPE:-wt103-70m} in fineweb-124m) tok=gpt2 ;; default) continue ;; esac
    fi
    for d in shared/data/tokenizers/$tok ../shared/data/tokenizers/$tok; do
      [ -f $d/tokenizer.json ] && continue 2
    done
    echo "gpu.sh $stage: no shared/data/tokenizers/$tok/tokenizer.json here; carry it" \
      "(and have shared/ in the checkout: ln -s ../shared shared)"; exit 2 ;;
  esac
done
# The device's Python packages come without bytecode, so every process (each test worker, each
# of its compile workers) compiled torch's source at import: about 12 s of CPU each. Compile it
# once, over all cores.
t0=$(date +%s)
started=$t0
python -m compileall -q -j 0 $(python -c "import os, importlib.util as u
print(*(os.path.dirname(u.find_spec(m).origin) for m in ('torch', 'triton')))") > /dev/null 2>&1
echo "bytecode compiled in $(( $(date +%s) - t0 )) s"
nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1
python - <<'PY' > "$LOGS/versions.txt" 2>&1
import torch, sys
print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda)
import triton; print("triton", triton.__version__)
print(torch.cuda.get_device_name(), torch.cuda.device_count())
PY
TRAIN_ARGS="--config configs/wt103-70m.toml --no-progress data.source=pycode data.tokenizer=bytes
  data.cache_dir=/tmp/elephant-cache train.max_steps=${TRAIN_STEPS:-300} train.log_every=25
  train.eval_every=0 train.eval_docs=64 train.ckpt_every=0 optim.warmup_steps=30 ${TRAIN_EXTRA:-}"

for stage in $stages; do
  echo "=== $stage $(date -Is)"
  case $stage in
    tests)
      # in parallel over GPU_TEST_WORKERS processes on the one GPU (most of the time is compiling,
      # on the host's cores); pytest-xdist from PyPI, or from wheels carried in .whl/ (the device
      # machine has no index); without it, serially
      python -c "import xdist" 2>/dev/null || pip install -q --no-index --find-links .whl pytest-xdist 2>/dev/null
      par=$(python -c "import xdist" 2>/dev/null && echo "-n ${GPU_TEST_WORKERS:-$(nproc)} --dist worksteal")
      # inductor's compile processes: none in a worker (nor in what a test starts), a pool of 4
      # for a test marked heavy (tests/conftest.py); TEST_COMPILE_THREADS and
      # HEAVY_COMPILE_THREADS set them otherwise
      [ -n "$par" ] && export TORCHINDUCTOR_COMPILE_THREADS=${TEST_COMPILE_THREADS:-1}
      [ -n "${HEAVY_COMPILE_THREADS:-}" ] && export ELEPHANT_HEAVY_COMPILE_THREADS=$HEAVY_COMPILE_THREADS
      # each test's start and end on its worker (tests/conftest.py), summed up by summarize.py
      export ELEPHANT_TEST_TIMELINE=$LOGS/gpu_tests_timeline.jsonl
      python -c "import json, time; print(json.dumps({'event': 'launch', 'at': time.time()}))" > "$ELEPHANT_TEST_TIMELINE"
      timeout ${TEST_TIMEOUT:-500} python -m pytest -m gpu -q -p no:cacheprovider --durations=30 $par tests/ 2>&1 | tee "$LOGS/gpu_tests.log" | tail -40
      # (gpu_seconds.json: each test's seconds; copied to tests/, the quickest follow the long ones)
      python benchmarks/summarize.py test-timeline "$ELEPHANT_TEST_TIMELINE" --json "$LOGS/gpu_tests_timeline.json" \
        --seconds "$LOGS/gpu_seconds.json" | tee "$LOGS/gpu_tests_timeline.txt"
      unset ELEPHANT_TEST_TIMELINE ;;
    bench)
      for b in ${BENCHES:-ssd layers optim model packing generate}; do
        echo "--- $b"
        case $b in   # the kernel benchmarks are subcommands of kernels.py, the others scripts
          ssd|layers|model) cmd="benchmarks/kernels.py $b" ;;
          *) cmd="benchmarks/bench_$b.py" ;;
        esac
        timeout $([ "$b" = generate ] && echo 420 || echo 300) python $cmd 2>&1 | tee "$LOGS/bench_$b.log" | tail -25
      done ;;
    train)
      timeout 900 python train.py $TRAIN_ARGS train.run_dir=/tmp/run-1gpu 2>&1 | tee "$LOGS/train_1gpu.log" | tail -8
      python benchmarks/summarize.py train-run /tmp/run-1gpu 1 ;;
    speed)
      timeout ${SPEED_TIMEOUT:-540} python benchmarks/train_speed.py --cache /tmp/elephant-cache ${SPEED_ARGS:-} 2>&1 \
        | tee "$LOGS/train_speed.log" | grep -v "profiler_st" | tail -25
      echo "train_speed exit status ${PIPESTATUS[0]}" ;;
    train2)
      rm -rf /tmp/run-1gpu /tmp/run-2gpu /tmp/run-2gpu-before
      CUDA_VISIBLE_DEVICES=0 timeout ${TRAIN2_TIMEOUT:-900} python train.py $TRAIN_ARGS train.run_dir=/tmp/run-1gpu 2>&1 | tee "$LOGS/train_1gpu.log" | tail -5
      python benchmarks/summarize.py train-run /tmp/run-1gpu 1
      timeout ${TRAIN2_TIMEOUT:-900} torchrun --standalone --nproc_per_node=${TRAIN2_GPUS:-2} train.py $TRAIN_ARGS train.run_dir=/tmp/run-2gpu 2>&1 | tee "$LOGS/train_${TRAIN2_GPUS:-2}gpu.log" | tail -5
      python benchmarks/summarize.py train-run /tmp/run-2gpu ${TRAIN2_GPUS:-2} /tmp/run-1gpu
      if [ -n "${TRAIN2_BEFORE:-}" ]; then
        timeout ${TRAIN2_TIMEOUT:-900} torchrun --standalone --nproc_per_node=${TRAIN2_GPUS:-2} $TRAIN2_BEFORE/train.py $TRAIN_ARGS train.run_dir=/tmp/run-2gpu-before 2>&1 | tee "$LOGS/train_${TRAIN2_GPUS:-2}gpu_before.log" | tail -5
        SUMMARY_TAG=before python benchmarks/summarize.py train-run /tmp/run-2gpu-before ${TRAIN2_GPUS:-2} /tmp/run-1gpu
      fi ;;
    recall)
      timeout 580 python benchmarks/recall_study.py --variants ${RECALL_VARIANTS:-hybrid,attention,replace,nomem} \
        --budget-s ${RECALL_BUDGET:-290} --out $RES/recall_study --runs /tmp/recall-runs --long 1M \
        data.cache_dir=/tmp/elephant-cache 2>&1 | tee "$LOGS/recall_study.log" | grep -v "step " | tail -60 ;;
    recall-long)
      # one long recall run over several calls: each resumes from the checkpoint the last one
      # returned (carry runs/recall-long-parts, the parts of $OUT/ckpt), trains for
      # RECALL_LONG_S seconds of train.max_steps' schedule, scores by distance and returns the
      # newest checkpoint in parts of 15 MiB (RECALL_LONG_DIST: the distances scored)
      RUN=runs/recall-long
      if ls runs/recall-long-parts/part.* > /dev/null 2>&1; then
        mkdir -p $RUN && cat runs/recall-long-parts/part.* | tar xzf - -C $RUN
      fi
      RESUME=$([ -f $RUN/checkpoints/latest ] && echo --resume)
      INIT=""
      if [ -n "${RECALL_INIT:-}" ] && [ -z "$RESUME" ]; then
        # a new stage from another run's weights (RECALL_INIT: a folder of its checkpoint's parts)
        mkdir -p runs/recall-init && cat $RECALL_INIT/part.* | tar xzf - -C runs/recall-init
        INIT=train.init_from=runs/recall-init
      fi
      timeout ${RECALL_LONG_TIMEOUT:-540} python -m elephant.recall train --config configs/recall.toml \
        $RESUME --stop-after-s ${RECALL_LONG_S:-400} --no-progress --lanes 16 --${RECALL_LOSS:-lm}-loss \
        --distances ${RECALL_LONG_DIST:-128,512,1K,4K,16K,64K,1M} --json $RES/recall_long.json train.run_dir=$RUN $INIT ${RECALL_LONG_ARGS:-} \
        2>&1 | tee "$LOGS/recall_long.log" | grep -v "answer loss" | tail -20
      if [ -n "${OUT:-}" ] && [ -f $RUN/checkpoints/latest ]; then
        mkdir -p $OUT/ckpt
        tar czf - -C $RUN checkpoints/latest checkpoints/$(cat $RUN/checkpoints/latest) |
          split -b 15m - $OUT/ckpt/part.
      fi ;;
    recall-seeds)
      # several seeds of a recall recipe trained side by side (a 5M-parameter model leaves most of
      # the GPU idle): RECALL_CONFIG=recall (configs/recall.toml, the default) or recall-stage2,
      # each seed in runs/<config>-seed<S>, resumed from there while the machine is still warm,
      # else from the checkpoint parts carried in runs/<config>-seed<S>-parts. A run that does
      # not resume starts from the weights carried in runs/recall-init<S>-parts if there are any,
      # and a later stage else from runs/<RECALL_FROM>-seed<S> (default recall: the first stage,
      # machine still warm).
      # Each trains RECALL_LONG_S seconds of the schedule and is scored at RECALL_LONG_DIST; the
      # newest checkpoint of the first seed comes back whole in $OUT/ckpt<S>/ (parts of 15 MiB),
      # the weights of the others in $OUT/w<S>/ (RECALL_SEEDS, RECALL_LONG_ARGS)
      SEEDS=${RECALL_SEEDS:-7 1337}
      NAME=${RECALL_CONFIG:-recall}
      for s in $SEEDS; do
        RUN=runs/$NAME-seed$s
        if [ ! -f $RUN/checkpoints/latest ] && ls $RUN-parts/part.* > /dev/null 2>&1; then
          mkdir -p $RUN && cat $RUN-parts/part.* | tar xzf - -C $RUN
        fi
        RESUME=$([ -f $RUN/checkpoints/latest ] && echo --resume)
        INIT=""
        if [ -z "$RESUME" ] && ls runs/recall-init$s-parts/part.* > /dev/null 2>&1; then
          mkdir -p runs/recall-init$s && cat runs/recall-init$s-parts/part.* | tar xzf - -C runs/recall-init$s
          INIT=train.init_from=runs/recall-init$s
        elif [ -z "$RESUME" ] && [ $NAME != recall ] && [ -f runs/${RECALL_FROM:-recall}-seed$s/checkpoints/latest ]; then
          INIT=train.init_from=runs/${RECALL_FROM:-recall}-seed$s
        fi
        timeout ${RECALL_LONG_TIMEOUT:-560} python -m elephant.recall train --config configs/$NAME.toml \
          $RESUME --stop-after-s ${RECALL_LONG_S:-480} --no-progress --lanes 16 --${RECALL_LOSS:-lm}-loss \
          --distances ${RECALL_LONG_DIST:-128,4K,64K} --json $RES/${NAME}_seed$s.json \
          train.run_dir=$RUN train.seed=$s $INIT ${RECALL_LONG_ARGS:-} > "$LOGS/${NAME}_seed$s.log" 2>&1 &
      done
      wait
      first=1
      for s in $SEEDS; do
        RUN=runs/$NAME-seed$s
        echo "--- seed $s"; grep -v "answer loss" "$LOGS/${NAME}_seed$s.log" | tail -12
        grep "answer loss" "$LOGS/${NAME}_seed$s.log" | tail -3
        [ -n "${OUT:-}" ] && [ -f $RUN/checkpoints/latest ] || continue
        last=checkpoints/$(cat $RUN/checkpoints/latest)
        if [ $first = 1 ]; then
          mkdir -p $OUT/ckpt$s && tar czf - -C $RUN checkpoints/latest $last | split -b 15m - $OUT/ckpt$s/part.
        else
          mkdir -p $OUT/w$s && tar czf - -C $RUN checkpoints/latest $last/model.safetensors \
            $last/meta.json | split -b 15m - $OUT/w$s/part.
        fi
        first=0
      done ;;
    recall-seeds-eval)
      # the runs of recall-seeds (RECALL_CONFIG, RECALL_SEEDS) scored side by side: one fact to 1M
      # (RECALL_EVAL_LANES documents), with the kept tokens or the memory dropped, from rotary
      # position 1,014,000, two facts (RECALL_EVAL_FULL= empty: the first alone)
      NAME=${RECALL_CONFIG:-recall}
      for s in ${RECALL_SEEDS:-7 1337}; do
        EV="python -m elephant.recall eval --checkpoint runs/$NAME-seed$s --no-progress --lanes ${RECALL_EVAL_LANES:-32}"
        J=$RES/${NAME}_seed${s}_eval
        { $EV --distances 128,512,1K,4K,16K,64K,1M --json ${J}.json
          [ -n "${RECALL_EVAL_FULL-1}" ] || exit 0
          for a in keep memory; do $EV --distances 4K,64K,1M --ablate $a --json ${J}_ablate_$a.json; done
          $EV --distances 4K,64K,1M --offset 1014000 --json ${J}_offset1M.json
          $EV --distances 128,4K,64K,1M --pairs 2 --json ${J}_pairs2.json
        } > "$LOGS/${NAME}_seed${s}_eval.log" 2>&1 &
      done
      wait
      for s in ${RECALL_SEEDS:-7 1337}; do
        echo "--- seed $s"; grep -E "^\| (dist|digit)|recall of|chance" "$LOGS/${NAME}_seed${s}_eval.log"
      done ;;
    recall-long-eval)
      # the checkpoint in runs/recall-long-parts scored by distance: one fact, several facts,
      # read from rotary position 1,014,000, and with each carried part of the state dropped
      # (RECALL_EVAL_PARTS: another folder of checkpoint parts)
      RUN=runs/recall-long-eval; mkdir -p $RUN
      cat ${RECALL_EVAL_PARTS:-runs/recall-long-parts}/part.* | tar xzf - -C $RUN
      EV="python -m elephant.recall eval --checkpoint $RUN --no-progress --lanes ${RECALL_EVAL_LANES:-32}"
      J=$RES/recall_long_${RECALL_EVAL_NAME:-eval}
      { $EV --distances 128,512,1K,4K,16K,64K,1M --json ${J}.json
        for p in 2 4; do
          $EV --distances 128,4K,64K,1M --pairs $p --json ${J}_pairs$p.json
        done
        $EV --distances 4K,64K,1M --offset 1014000 --json ${J}_offset1M.json
        for a in memory keep kv ssm; do
          $EV --distances 128,4K,64K --ablate $a --json ${J}_ablate_$a.json
        done; } 2>&1 | tee "$LOGS/recall_long_eval.log" | grep -v "^$" | tail -60 ;;
    verify)
      timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_model.py \
        -k "head or cuda_graph or recompile" 2>&1 | tee "$LOGS/gpu_verify_tests.log" | grep -E "^E |passed|failed|Error" | tail -30
      timeout 300 python benchmarks/train_speed.py --cache /tmp/elephant-cache --only baseline,hybrid,eval \
        --set train.compile=model --eval-cuda-graph --out $RES/train_speed_compile_model_$(python -c \
        "import torch;print(torch.cuda.get_device_name().replace(' ','_'))").json 2>&1 \
        | tee "$LOGS/train_speed_model.log" | grep -v "profiler_st" | tail -12 ;;
    eval-side)
      # the GPU tests of the captured graphs (the optimizer's, evaluation's, the side batch's on its
      # stream), then the 64-lane evaluation compacted and with its side batch (eval.py's
      # default), timed in turns over 16M tokens of source files (~8 min on an H100, compiling
      # included; the tests ~100 s)
      timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_model.py \
        tests/test_gpu_optim.py tests/test_gpu_trainer.py -k "side_batch or cuda_graph or graphed" \
        2>&1 | tee "$LOGS/gpu_eval_side_tests.log" | grep -E "^E |passed|failed|Error" | tail -30
      timeout 440 python benchmarks/train_speed.py --cache /tmp/elephant-cache --only hybrid,eval \
        --eval-modes compact,side --eval-rounds 2 --eval-tokens 16000000 --set data.site_packages=true \
        --out $RES/train_speed_eval_side_$(python -c \
        "import torch;print(torch.cuda.get_device_name().replace(' ','_'))").json 2>&1 \
        | tee "$LOGS/train_speed_eval_side.log" | grep -v "profiler_st" | tail -14 ;;
    speed-ab)
      # the hybrid step of this checkout against an older one (SPEED_BEFORE: a folder holding its
      # benchmarks/, elephant/, data_packing/ and configs/, e.g. from git archive), each in a
      # process of its own, in turns over SPEED_AB_ROUNDS rounds (default 2), so that a drift of
      # the GPU's clock falls on both; SPEED_ARGS passed on (~7 min on a cold H100, each tree
      # compiling once). The order alternates (before, after; then after, before; ...): the first
      # run on a fresh machine ran slower in the one-round A/Bs of 2026-11-27
      abs_res=$(pwd)/$RES
      for round in $(seq ${SPEED_AB_ROUNDS:-2}); do
        order="before after"
        [ $((round % 2)) = 0 ] && order="after before"
        for tree in $order; do
          dir=$([ $tree = before ] && echo "${SPEED_BEFORE:?SPEED_BEFORE: the older checkout}" || echo .)
          (cd "$dir" && timeout ${SPEED_AB_TIMEOUT:-240} python benchmarks/train_speed.py \
            --cache /tmp/elephant-cache --only hybrid ${SPEED_ARGS:-} \
            --out "$abs_res/train_speed_ab_${tree}_${round}.json") 2>&1 \
            | tee "$LOGS/train_speed_ab_${tree}_${round}.log" | grep -E "^hybrid:|failures" | sed "s/^/$tree $round: /"
        done
      done ;;
    packing-model)
      timeout 500 python benchmarks/bench_packing.py --only paths --compile model --profile 2>&1 \
        | tee "$LOGS/bench_packing_model.log" | tail -12 ;;
    packing-verify)
      # the GPU tests of the packed path and the model (the Triton conv, the CUDA-graph step, the
      # fast model against the reference), then the packing paths timed with the whole chunk
      # compiled (PACK_COMPILE: also graphs, the chunk replayed as CUDA graphs)
      timeout ${TEST_TIMEOUT:-330} python -m pytest -m gpu -q -p no:cacheprovider --durations=8 \
        tests/test_gpu_packing.py tests/test_gpu_model.py 2>&1 | tee "$LOGS/gpu_packing_tests.log" | tail -25
      for c in ${PACK_COMPILE:-model}; do
        timeout ${PACK_TIMEOUT:-230} python benchmarks/bench_packing.py --only paths --compile $c \
          --rounds 2 --paths fill1_today_path,fill1_boundary_path_forced_no_inner_starts,lognormal_unpacked,lognormal_packed \
          2>&1 | tee "$LOGS/bench_packing_$c.log" | grep -E "^summary|^fill1|^lognormal|Error|skipping" | cut -c1-300
      done ;;
    conv-forms)
      # the Mamba conv's two forms with segments (conv_triton.SEGMENT_FORM): the op in turns at a
      # start every ~1,000 and ~150 tokens, the GPU tests of the conv and the packed model in
      # both forms, then the packed step in each form in turns with the unpacked one (~8 min)
      for every in 1000 150; do
        timeout 90 python benchmarks/kernels.py conv-launch --segments --starts --silu --every $every \
          --tokens 64 --channels 128 --warps 4 2>&1 | tee "$LOGS/conv_forms_every$every.log" | grep "^a/b" | cut -c1-400
        cp $RES/conv_launch_segments_silu_*.json "$LOGS/conv_forms_every$every.json" 2>/dev/null
      done
      par=$(python -c "import xdist" 2>/dev/null && echo "-n ${GPU_TEST_WORKERS:-$(nproc)} --dist worksteal")
      TORCHINDUCTOR_COMPILE_THREADS=1 timeout ${TEST_TIMEOUT:-200} python -m pytest -m gpu -q \
        -p no:cacheprovider --durations=5 $par tests/test_gpu_packing.py tests/test_gpu_model.py \
        -k "conv or packed_fast or leaks" 2>&1 | tee "$LOGS/conv_forms_tests.log" | tail -4
      timeout ${PACK_TIMEOUT:-330} python benchmarks/bench_packing.py --only paths --compile window \
        --rounds 2 --paths lognormal_unpacked,lognormal_packed,lognormal_packed_conv_tiles 2>&1 \
        | tee "$LOGS/conv_forms_packing.log" | grep -E "^summary|^lognormal|Error" | cut -c1-300 ;;
    packing-shapes)
      # the GPU's clock and power every 200 ms beside the runs (the results' `spans` say when each
      # path ran; `summarize.py clocks` reads both): is the padded step faster because the GPU
      # clocks higher on padding?
      nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu \
        --format=csv -lms 200 > "$LOGS/packing_shapes_clocks.csv" 2>&1 &
      smi=$!
      for shape in "" "--config configs/fineweb-124m.toml --lanes 32"; do
        timeout ${PACK_TIMEOUT:-330} python benchmarks/bench_packing.py --only paths --compile window \
          --rounds 2 $shape --paths fill1_today_path,lognormal_unpacked,lognormal_packed 2>&1 \
          | tee -a "$LOGS/packing_shapes.log" | grep -E "^summary|^fill1|^lognormal|Error" | cut -c1-300
        cp $RES/packing_compile_window_$( [ -n "$shape" ] && echo fineweb-124m_)NVIDIA*.json "$LOGS/" 2>/dev/null
      done
      kill $smi 2>/dev/null ;;
    lmstudy)
      timeout 580 python benchmarks/lm_study.py --budget-s ${LM_BUDGET:-150} --out $RES/lm_study \
        --variants ${LM_VARIANTS:-hybrid,transformer} --reset-every ${LM_RESET:-2048} \
        --cache /tmp/elephant-cache ${LM_ARGS:-} 2>&1 | tee "$LOGS/lm_study.log" | grep -v "step " | tail -30 ;;
    copy)
      # COPY_SHAPE may name several shapes (a,b): their studies run at once, sharing the GPU; a
      # shape written shape:v1+v2[:d1+d2] has its own variants (and distances)
      shapes=${COPY_SHAPE:-recall}
      for spec in ${shapes//,/ }; do
        IFS=: read -r shape variants distances <<< "$spec"
        rm -rf /tmp/copy_runs_$shape   # scratch of this call: an earlier call's runs would be refused
        variants=${variants:+${variants//+/,}}
        distances=${distances:+${distances//+/,}}
        timeout 560 python benchmarks/copy_study.py --corpus ${COPY_CORPUS:-recall} --shape $shape \
          --variants ${variants:-${COPY_VARIANTS:-attn,hybrid}} --steps ${COPY_STEPS:-800} --ckpt-every 100 \
          --deadline-s ${COPY_DEADLINE:-420} --distances ${distances:-${COPY_DISTANCES:-128}} \
          --out $RES/copy_study_$shape --runs /tmp/copy_runs_$shape data.cache_dir=/tmp/elephant-cache-$shape \
          ${COPY_ARGS-model.bptt_chunks=8} > "$LOGS/copy_study_$shape.log" 2>&1 &
      done
      wait
      for spec in ${shapes//,/ }; do tail -15 "$LOGS/copy_study_${spec%%:*}.log"; done ;;
    copy-score)
      # weights an earlier copy call saved (COPY_WEIGHTS=$OUT there: folders w-<variant> of parts),
      # carried back in COPY_SCORE_DIRS (default runs/w-*), each scored at once at COPY_DISTANCES
      # with COPY_ABLATE and COPY_KEEP_EVAL, no training; several GPUs are taken in turn
      ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); i=0
      for w in ${COPY_SCORE_DIRS:-runs/w-*}; do
        n=$(basename $w)
        gpu=$(( ${ngpu:-0} > 1 ? i % ngpu : 0 )); i=$((i + 1))
        CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$gpu} timeout ${COPY_SCORE_TIMEOUT:-540} python benchmarks/copy_study.py --score $w \
          --distances ${COPY_DISTANCES:-128,65536,1048576} --out $RES/copy_study_scored \
          --runs /tmp/copy_scored > "$LOGS/copy_score_$n.log" 2>&1 &
      done
      wait
      tail -n 3 "$LOGS"/copy_score_*.log ;;
    long)
      # benchmarks/long_study.py: LONG_VARIANTS trained side by side on this GPU for LONG_STEPS
      # steps, stopped with a checkpoint LONG_END_AT seconds after gpu.sh started (a later call
      # on the same machine resumes them; LONG_END_AT=0: no training), then LONG_SCORE's
      # variants scored side by side (LONG_HYBRID, default today, with LONG_HYBRID_SCORE: the
      # drops and the 1M needle; LONG_SCORE=skip: none), LONG_SPEED's variants timed alone, and
      # one results file. LONG_VARIANTS="a b / c d": a and b side by side, then c and d;
      # LONG_LITE's variants scored by their test loss alone; LONG_SCORE_KEEP (below)
      # LONG_RECIPE=fineweb-124m: that recipe (carry shared/data/tokenizers/gpt2), runs of its own
      runs=/tmp/long-study${LONG_RECIPE:+-$LONG_RECIPE}
      L="python benchmarks/long_study.py --runs $runs --cache /tmp/elephant-cache --steps ${LONG_STEPS:-2000} --recipe ${LONG_RECIPE:-wt103-70m}"
      variants=${LONG_VARIANTS:-today transformer}
      # train_one VARIANT SECONDS: train (or go on training) until its steps or SECONDS
      train_one() { timeout $(( $2 + 120 )) $L train $1 --stop-after-s $2 >> "$LOGS/long_train_$1.log" 2>&1; }
      # score_spec "v" or "v:N" (LONG_SCORE_KEEP): sets v, k (N or empty) and the scorer's log
      score_spec() { v=${1%%:*}; k=${1#"$v"}; k=${k#:}; log="$LOGS/long_score_$v${k:+_keep$k}.log"; }
      if [ "${LONG_END_AT:-540}" != 0 ]; then
        all=$(echo ${variants//\// })
        # the corpora count against LONG_END_AT: a recall mix's took ~75 s to prepare on the H100
        # host (2026-12-07: two of them, one after the other, left no time to train)
        p0=$(date +%s)
        timeout 300 $L prepare ${all// /,} 2>&1 | tee "$LOGS/long_prepare.log" | tail -8
        echo "long: corpora prepared in $(( $(date +%s) - p0 )) s"
        # groups split by " / " train in turn, each group's variants side by side
        IFS=/ read -ra groups <<< "$variants"
        for group in "${groups[@]}"; do
          left=$(( ${LONG_END_AT:-540} - $(date +%s) + started ))
          [ $left -lt 30 ] && { echo "long: only $left s left before LONG_END_AT: $group not trained"; continue; }
          pids=()
          for v in $group; do
            train_one $v $left &
            pids+=($!)
          done
          failed=(); i=0
          for v in $group; do wait ${pids[$i]} || failed+=($v); i=$((i + 1)); done
          # a run that died beside another (five times a CUDA launch failure, never alone) goes on
          # alone from its last checkpoint (or from the start) in the time left
          for v in "${failed[@]}"; do
            left=$(( ${LONG_END_AT:-540} - $(date +%s) + started ))
            [ $left -lt 60 ] && { echo "long: $v failed, $left s left: not trained again"; continue; }
            echo "long: $v failed beside the others; trained again alone ($left s)"
            train_one $v $left
          done
        done
        variants=$all
        for v in $variants; do echo "--- $v"; grep -E "^step|\\[$v\\]|rror" "$LOGS/long_train_$v.log" | tail -3; done
      fi
      score=${LONG_SCORE:-$variants}
      [ "$score" = skip ] && score=""
      # LONG_SCORE_KEEP="v:N ...": v scored again read with N kept tokens a layer (its test loss
      # and needle with the kept tokens it trained with, say, instead of kv_keep_infer's;
      # LONG_KEEP_SCORE: the flags those scorings take, e.g. --needle-1m)
      # LONG_SCORE_PARALLEL scorers at a time (default 2: four on one H100 ran out of memory in
      # a needle pass)
      n=0
      for spec in $score ${LONG_SCORE_KEEP:-}; do
        score_spec $spec
        [ -d $runs/$v ] || { echo "long: $v has no run to score"; continue; }
        extra=$([ $v = ${LONG_HYBRID:-today} ] && echo "${LONG_HYBRID_SCORE---drops --needle-1m}")
        [[ " ${LONG_LITE:-} " == *" $v "* ]] && extra=--lite   # the test loss alone
        [ -n "$k" ] && extra="--kv-keep $k ${LONG_KEEP_SCORE:-}"
        timeout ${LONG_SCORE_TIMEOUT:-300} $L score $v $extra > "$log" 2>&1 &
        n=$((n + 1)); [ $((n % ${LONG_SCORE_PARALLEL:-2})) = 0 ] && wait
      done
      wait
      for spec in $score ${LONG_SCORE_KEEP:-}; do
        score_spec $spec
        grep -hE "needle|nats/byte|rror" "$log" 2>/dev/null | tail -14
      done
      for v in ${LONG_SPEED:-}; do
        timeout 200 $L speed $v --steps ${LONG_SPEED_STEPS:-80} 2>&1 | tee "$LOGS/long_speed_$v.log" | tail -2
      done
      # LONG_IMPORT="FILE:v,w": those variants' scores from an earlier results file, for the report
      [ -n "${LONG_IMPORT:-}" ] && $L import ${LONG_IMPORT#*:} --from ${LONG_IMPORT%%:*}
      $L report --hybrid ${LONG_HYBRID:-today} 2>&1 | tee "$LOGS/long_report.log" | tail -30 ;;
    field)
      # the field's wheels (.whl/, made by `make field-wheels` and carried: no index here) into
      # a folder of their own, searched first by this stage alone: fla-core, and mamba-ssm (an
      # sdist on PyPI) as a wheel of its Python and Triton code, no CUDA extension, so the
      # benchmark imports its Triton scan without the package's __init__; einops only if the
      # image lacks it. Not
      # carried: flash-attn-4 (its nvidia-cutlass-dsl-libs wheel alone is 88 MiB, over a call's
      # 64) and causal-conv1d (a CUDA build)
      site=/tmp/field-site
      pip_whl="python -m pip install -q --no-index --no-deps --upgrade --find-links .whl --target $site"
      $pip_whl fla-core mamba-ssm 2>&1 | tail -3
      python -c "import einops" 2>/dev/null || $pip_whl einops 2>&1 | tail -3
      PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} timeout ${FIELD_TIMEOUT:-420} \
        python benchmarks/kernels.py field ${FIELD_ARGS:-} 2>&1 | tee "$LOGS/field_kernels.log" | tail -30 ;;
    kept-read)
      timeout ${TEST_TIMEOUT:-200} python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_layers.py \
        -k "kept" 2>&1 | tee "$LOGS/kept_read_tests.log" | tail -8
      timeout ${KEPT_TIMEOUT:-200} python benchmarks/kernels.py kept-read --iters ${KEPT_ITERS:-10} 2>&1 \
        | tee "$LOGS/kept_read.log" | tail -16 ;;
    eval-speed)
      # each eval.py run's own JSON and the breakdowns' marks beside the log
      timeout ${EVAL_SPEED_TIMEOUT:-420} python benchmarks/eval_speed.py --work /tmp/eval-speed \
        ${EVAL_SPEED_ARGS:-} 2>&1 | tee "$LOGS/eval_speed.log" | tail -50
      mkdir -p "$LOGS/eval_speed_json" && cp /tmp/eval-speed/json/*.json "$LOGS/eval_speed_json/" 2>/dev/null ;;
    *) echo "unknown stage $stage" ;;
  esac
  # pack after every stage: a call cut short still returns what was measured
  if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/results.tar.gz.tmp" "$RES" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" &&
      mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
  fi
done
