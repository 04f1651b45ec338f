#!/usr/bin/env bash
# Issue 39 items 1 and 2 on the GPU machine (one H200), in one device call of about three minutes; no model
# downloads.  Every step's output goes to $OUT/<step>.txt, headed by its command line, the time and nproc.
#   bash benchmarks/issue39_device.sh [step ...]     # default: setup gpu_tests same_gpu cold_gpu
# Carry [".whl"] (../shared/tools/device-wheels.sh .whl): setup (device_steps.sh's device_setup) installs the
# wheels into python3's own site (the tests' producer processes get PYTHONPATH=<repo> only) and starts the
# carried redis-server on 6379 unless one answers.
#   setup     nixl, redis-py, ... and a Redis
#   gpu_tests the same-GPU copy and its fallback (two processes on GPU 0), the upstream watch, the
#             connector's VRAM tests: tests/broker/data/nixl/test_same_gpu.py, test_upstream.py, test_connector.py
#   same_gpu  torch device copy vs NIXL READ vs the same-GPU copy, 1 / 11 / 65 MB (benchmarks/same_gpu.py)
#   same_gpu_parts  where the same-GPU copy's fixed cost goes: each piece timed alone, two processes,
#             torch only (benchmarks/same_gpu_parts.py)
#   cold_gpu  the first hop against warm hops on the GPU, peers connected on request vs ahead
#             (benchmarks/cold_hop.py, T2VA and FL2VA sizes)
#   mps       same_gpu and same_gpu_parts again with the CUDA MPS control daemon running (one shared GPU
#             context for both processes: is the fixed cost the switch between contexts?); the daemon is
#             this call's own (pipe and log dirs under /tmp), quit at the end; no GPU setting is changed
#   tput      requests/s and commands per request with several submitting processes (throughput.py
#             --clients, default 4 here, TPUT_CLIENTS), 8 replicas a stage, 4000 requests, this tree against
#             .base (the base's stageferry with this tree's benchmarks: the same benchmark), 2 rounds
#   tput_io   this tree's throughput.py alone against a redis-server with io-threads 1 and 4 (reads too)
#   held      this tree's throughput.py, 8 replicas a stage, the leaders holding 1, 2 and 4 entries at once
#             (--entries-in-flight 1,2,4), 4000 requests, 4 clients, the default hot wait (HELD_HOT_WAIT to set
#             one: HELD_HOT_WAIT=0 held), HELD_REPLICAS for another replica count, HELD_STEPS=1 to time
#             each leader's steps (--steps), HELD_SUBMITS for each client's submissions in flight (--in-flight)
#   held_base the same benchmark (this tree's benchmarks) on the base's stageferry (.base), one entry at a
#             time: the side-by-side figure for held
#   held_pair the base's stageferry (.base) and this tree's, both holding HELD_IN_FLIGHT entries (default
#             16), one after the other, HELD_ROUNDS times (default 2): the side-by-side figure when the
#             base has entries_in_flight too; HELD_REQUESTS requests a run (default 4000); PIN_REDIS=<cpu>
#             restarts the Redis on 6379 bound to that CPU and runs both trees on the CPUs left once its core
#             (hyperthread siblings too) is taken out (device_steps.sh's pin_redis; the topology: pin.txt)
#   profile   where Redis's time goes: this tree's throughput.py as held_pair runs it, with --script-times (each
#             script's share of the main thread, SLOWLOG), then benchmarks/script_cost.py (each hot script's
#             µs against the commands it runs: Lua's own share), both on the call's Redis (6379)
#   server_pair  the same benchmark as held_pair (8 replicas, 16 held, HELD_REQUESTS, default 12000) three
#             ways, HELD_ROUNDS times (default 2): the base on the Redis on 6379, this tree on it, and this
#             tree on a valkey-server carried as .whl/valkey/valkey-server (built from source, `make
#             BUILD_TLS=no`, stripped; it needs libc alone) on 6393: what a newer server's Lua engine gives
#   sweep     this tree's throughput (8 replicas, HELD_REQUESTS, default 12000) under each setting SWEEP names
#             (default "k16 k32"): kN entries in flight N; hwS (16 held) hot wait S seconds; cN (16 held) N client
#             processes; ifN (16 held) N submissions in flight a client; base (16 held) the base's stageferry;
#             issue the issue's code (.issue_base, as trio makes it), one entry at a time; lN (16 held) N lanes:
#             N control planes, the Redis on 6379 and N-1 more of this run's own, each with its share of the
#             replicas and clients (throughput.py's comma-separated --redis-url);
#             outputs sweep<i>_<setting>_n<requests>.txt, i its place in SWEEP (a setting may come twice)
#   trio      the issue's own code against the round's base and this tree, HELD_ROUNDS times (default 2), 8 replicas,
#             HELD_REQUESTS (default 12000): .issue_base (d346e8a, the code the issue measured, one entry at a time: it
#             has no entries_in_flight), .base (16 held) and this tree (16 held).  .issue_base is made with
#               mkdir .issue_base && git archive d346e8a stageferry pyproject.toml | tar -x -C .issue_base
#               cp -r benchmarks .issue_base/ && rm -rf .issue_base/benchmarks/results
#               printf 'from stageferry.launcher import ServiceGroup, wait_for_workers  # noqa: F401\n' \
#                 > .issue_base/stageferry/cli/launcher.py   # where this tree's benchmarks import it from
#   spy       where a stage process's CPU goes at full rate: this tree's run as sweep's k16, with py-spy sampling
#             one encoder and one diffusion replica for 4 s each mid-run (raw stacks: spy_<stage>.raw, Python
#             frames only); carry it as .whl/py-spy (`pip install py-spy`, then copy its static binary there)
#   up_gpu    `stageferry up` at 1344x768 (the issue's measure of item 1: its own table, each hop's first transfer
#             beside the median of the warm runs: UP_WARM, default 6, the later 3 with longer prompts, payloads of
#             another structure) for each of UP_TASKS (default "t2va fl2va ref2va"), both stages on
#             GPU 0 as the planner places them on one GPU, with --mps UP_MPS (default auto: up's private daemon)
#   first_get_pair  first_get's two runs on the previous tree (.prev: `mkdir .prev && git archive <prev> stageferry
#             benchmarks pyproject.toml | tar -x -C .prev`, its own benchmarks) and on this one, side by side
#   wake      the same-GPU copy's runtime calls and a torch copy right after the thread slept 0 / 2 / 50 ms,
#             without and with CUDA MPS (benchmarks/wake_cost.py)
#   first_get a fresh process's first get's local steps (checks, slots, views) against its later gets, 4 processes
#             each for the T2VA and FL2VA structures (benchmarks/first_get_steps.py, CUDA pool, 1 s idle before each)
#   mps_copy  same_gpu alone under this call's own MPS control daemon (mps without same_gpu_parts)
#   copy_pair same_gpu.py (this tree's benchmark) on the previous tree (.prev, made as first_get_pair's, with this
#             tree's benchmarks copied in: `cp -r benchmarks .prev/`) and on this one, under one MPS daemon,
#             PAIR_ROUNDS rounds (default 3; which tree goes first alternates), at each of PAIR_LEVELS (the
#             consumer's log level, default "warning info": info is a stage's, its payload.get line per get)
#   repost_pair  same_gpu.py on this tree, VRAM READs making a handle each (as shipped) and posted again on
#             their kept handles (--recycled-routes DRAM<-DRAM,VRAM<-VRAM), under one MPS daemon, PAIR_ROUNDS
#             rounds (default 3; which goes first alternates), the consumer at warning: the NIXL READ column
#   up_pair   `stageferry up` (T2VA, 1344x768, up's MPS daemon) on .prev and on this tree, UP_ROUNDS times (default
#             1): up's own first/warm table and each get's payload.get line (steps_us), side by side
#   launch    where the same-GPU copy's launch time goes inside real gets, by variant (as is, without the
#             get's prime copy, a cheap call just before the launch, the driver's calls, the GIL kept, twice),
#             under this call's MPS daemon (again with a 100 ms progress-thread delay) and without it
#             (benchmarks/same_gpu_launch.py)
#   commands  Redis commands per T2VA request and requests/s, 8 replicas a stage, this tree against the
#             round's base (a copy of it carried as .base: `git archive <base> stageferry benchmarks tests
#             pyproject.toml | tar -x -C .base`), benchmarks/commands_compare.py
#   commands3 the same, 3 alternating rounds with each run's whole throughput.py output (its CPU table:
#             Redis's main thread, the client, the busiest stage process), about 3 minutes
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/issue39}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
. benchmarks/device_steps.sh  # run_step, run_tree, start_server, stop_server, mps_start, mps_stop
# The throughput run the steps below vary (each tree's own benchmarks/throughput.py, from its root).
T2VA=(python3 benchmarks/throughput.py --tasks T2VA --edges nixl --clients "${TPUT_CLIENTS:-4}")
for s in ${*:-setup gpu_tests same_gpu cold_gpu}; do
  case $s in
    setup) device_setup 2>&1 | tee "$out/setup.txt" ;;
    gpu_tests) run_step "$s" 240 python3 -m pytest -q -p no:cacheprovider -p no:randomly -rs --tb=short \
                 --durations=6 tests/broker/data/nixl/test_same_gpu.py tests/broker/data/nixl/test_cuda_runtime.py \
                 tests/broker/data/nixl/test_upstream.py tests/broker/data/nixl/test_reads.py tests/stages/process/test_mps.py \
                 tests/broker/data/test_payload_codec.py tests/broker/data/test_pool.py \
                 "tests/broker/data/nixl/test_connector.py::test_cuda_leaves_land_on_the_consumer_gpu" \
                 "tests/broker/data/nixl/test_connector.py::test_a_block_cancelled_with_cuda_slots_still_returns_them" \
                 "tests/broker/data/nixl/test_agent.py::test_a_vram_read_is_posted_again_on_its_recycled_handle" \
                 "tests/broker/data/nixl/test_agent.py::test_a_reads_transport_is_read_from_ucxs_log_whose_file_is_gone" ;;
    same_gpu) run_step "$s" 90 python3 benchmarks/same_gpu.py --iters 30 --warmup 5 --log "$out/same_gpu_producer.log" ;;
    same_gpu_parts) run_step "$s" 120 python3 benchmarks/same_gpu_parts.py --iters 50 --warmup 10 ;;
    cold_gpu) run_step "${s}_t2va" 45 python3 benchmarks/cold_hop.py --device cuda --bytes 359024 --rounds 3 --hops 20
              run_step "${s}_fl2va" 45 python3 benchmarks/cold_hop.py --device cuda --bytes 11158136 --rounds 3 --hops 20 ;;
    up_gpu) for task in ${UP_TASKS:-t2va fl2va ref2va}; do  # `up`'s own first/warm table, as the issue measured it
              name="up_${task}_mps_${UP_MPS:-auto}"
              n=2; base=$name; while [ -e "$out/$name.txt" ]; do name="${base}_$n"; n=$((n + 1)); done  # a task run again
              rm -rf "/tmp/$name"  # a machine kept warm between calls still has an earlier call's logs there
              # up starts its own private Redis: the carried redis-server (setup's) on its PATH
              run_step "$name" 200 env PATH="$PWD/.whl/redis:$PATH" LD_LIBRARY_PATH="$PWD/.whl/redis" \
                python3 -m stageferry --prefix "up39-$task" up --task "$task" \
                --width 1344 --height 768 --warm-runs "${UP_WARM:-6}" --mps "${UP_MPS:-auto}" --log-dir "/tmp/$name"
              grep -h '"placement\.\|"nixl\.\(same_gpu\|transport\)\|"mps\.\|"payload\.get' "/tmp/$name"/*.log > "$out/${name}_events.txt"
            done ;;
    up_pair) for r in $(seq "${UP_ROUNDS:-1}"); do  # up's own table (T2VA, 1344x768) on .prev, then on this tree
               for tree in prev this; do
                 name="up_pair${r}_$tree"
                 rm -rf "/tmp/$name"
                 cmd=(env PATH="$PWD/.whl/redis:$PATH" LD_LIBRARY_PATH="$PWD/.whl/redis" python3 -m stageferry
                      --prefix "up39-$name" up --task t2va --width 1344 --height 768 --warm-runs 3 --mps auto
                      --log-dir "/tmp/$name")
                 if [ "$tree" = prev ]; then run_tree .prev "$name" 200 "${cmd[@]}"; else run_step "$name" 200 "${cmd[@]}"; fi
                 grep -h '"payload\.get' "/tmp/$name"/*.log > "$out/${name}_events.txt"
               done
             done ;;
    first_get_pair) for task in "t2va 0" "fl2va 2"; do  # the previous tree (.prev) and this one, one after the other
                      set -- $task
                      run_tree .prev "first_get_prev_$1" 90 python3 benchmarks/first_get_steps.py --device cuda --processes 4 --frames "$2" --idle 1
                      run_step "first_get_this_$1" 90 python3 benchmarks/first_get_steps.py --device cuda --processes 4 --frames "$2" --idle 1
                    done ;;
    wake) run_step wake_cost 60 python3 benchmarks/wake_cost.py  # runtime calls after a sleep, no MPS, then under it
          if mps_start wake; then
            run_step wake_cost_mps 60 python3 benchmarks/wake_cost.py
            mps_stop
          fi ;;
    first_get) run_step first_get_t2va 90 python3 benchmarks/first_get_steps.py --device cuda --processes 4 --idle 1
               run_step first_get_fl2va 90 python3 benchmarks/first_get_steps.py --device cuda --processes 4 --frames 2 --idle 1 ;;
    mps|mps_copy) if mps_start "$s"; then
           run_step mps_same_gpu 90 python3 benchmarks/same_gpu.py --iters 30 --warmup 5 --log "$out/mps_producer.log"
           if [ "$s" = mps ]; then
             run_step mps_same_gpu_parts 120 python3 benchmarks/same_gpu_parts.py --iters 50 --warmup 10
             echo get_server_list | nvidia-cuda-mps-control > "$out/mps_servers.txt" 2>&1
           fi
           mps_stop
           [ "$s" = mps ] && cp /tmp/sf-mps-mps/log/*.log "$out/" 2>/dev/null
         fi ;;
    copy_pair) if mps_start pair; then  # same_gpu.py on .prev and on this tree, alternating which goes first
           for r in $(seq "${PAIR_ROUNDS:-3}"); do
             for level in ${PAIR_LEVELS:-warning info}; do
               pair=(benchmarks/same_gpu.py --iters 30 --warmup 5 --log-level "$level")
               for tree in $( ((r % 2)) && echo "prev this" || echo "this prev"); do
                 name="pair${r}_${level}_$tree"
                 if [ "$tree" = prev ]; then
                   run_tree .prev "$name" 90 python3 "${pair[@]}" --log "$out/${name}_producer.log" --consumer-log "$out/${name}_consumer.log"
                 else
                   run_step "$name" 90 python3 "${pair[@]}" --log "$out/${name}_producer.log" --consumer-log "$out/${name}_consumer.log"
                 fi
               done
             done
           done
           mps_stop
         fi ;;
    repost_pair) if mps_start repost; then  # VRAM READs on fresh handles and on kept ones, alternating
           for r in $(seq "${PAIR_ROUNDS:-3}"); do
             for kept in $( ((r % 2)) && echo "fresh kept" || echo "kept fresh"); do
               routes="DRAM<-DRAM"; [ "$kept" = kept ] && routes="DRAM<-DRAM,VRAM<-VRAM"
               run_step "repost${r}_$kept" 90 python3 benchmarks/same_gpu.py --iters 30 --warmup 5 \
                 --recycled-routes "$routes" --log "$out/repost${r}_${kept}_producer.log"
             done
           done
           mps_stop
         fi ;;
    launch) if mps_start launch; then  # the launch's calls inside gets, by variant (same_gpu_launch.py)
           run_step launch_mps 120 python3 benchmarks/same_gpu_launch.py --log "$out/launch_producer.log"
           run_step launch_mps_slow_progress 90 python3 benchmarks/same_gpu_launch.py --variants as_is,driver_api \
             --progress-delay-us 100000 --log "$out/launch_producer.log"
           mps_stop
         fi
         run_step launch_no_mps 120 python3 benchmarks/same_gpu_launch.py --log "$out/launch_producer.log" ;;
    commands) run_step "$s" 150 env PATH="$PWD/.whl/redis:$PATH" LD_LIBRARY_PATH="$PWD/.whl/redis" \
                python3 benchmarks/commands_compare.py --base .base --replicas 8 --requests 2000 --rounds 1 ;;
    commands3) run_step "$s" 330 env PATH="$PWD/.whl/redis:$PATH" LD_LIBRARY_PATH="$PWD/.whl/redis" \
                python3 benchmarks/commands_compare.py --base .base --replicas 8 --requests 2000 --rounds 3 --verbose ;;
    tput) run_step "$s" 420 env PATH="$PWD/.whl/redis:$PATH" LD_LIBRARY_PATH="$PWD/.whl/redis" \
            python3 benchmarks/commands_compare.py --base .base --replicas 8 --requests 4000 --rounds 2 \
            --clients "${TPUT_CLIENTS:-4}" --verbose ;;
    tput_io) port=6391
         for io in 1 4; do
           start_server $port .whl/redis/redis-server --appendonly no --io-threads $io --io-threads-do-reads yes \
             --logfile /tmp/sf-io$io.log
           run_step "tput_io$io" 150 "${T2VA[@]}" --replicas 8 --requests 4000 --redis-url "redis://127.0.0.1:$port/0"
           stop_server $port
         done ;;
    held) hot=${HELD_HOT_WAIT:+--hot-wait $HELD_HOT_WAIT}
          run_step "held_r${HELD_REPLICAS:-8}_hot${HELD_HOT_WAIT:-default}" 400 "${T2VA[@]}" \
            --replicas "${HELD_REPLICAS:-8}" --requests 4000 --entries-in-flight "${HELD_IN_FLIGHT:-1,2,4}" $hot \
            ${HELD_STEPS:+--steps} ${HELD_SUBMITS:+--in-flight $HELD_SUBMITS} ;;
    held_base) hot=${HELD_HOT_WAIT:+--hot-wait $HELD_HOT_WAIT}
          run_tree .base "held_base_r${HELD_REPLICAS:-8}_hot${HELD_HOT_WAIT:-default}" 200 \
            "${T2VA[@]}" --replicas "${HELD_REPLICAS:-8}" --requests 4000 $hot ;;
    held_pair) hot=${HELD_HOT_WAIT:+--hot-wait $HELD_HOT_WAIT}
          pin=(); tag=""
          if [ -n "${PIN_REDIS:-}" ]; then rest=$(pin_redis "$PIN_REDIS" 2>"$out/pin.txt"); pin=(taskset -c "$rest"); tag=_pinned; fi
          n=${HELD_REQUESTS:-4000}
          run=("${pin[@]}" "${T2VA[@]}" --replicas "${HELD_REPLICAS:-8}" --requests "$n" \
               --entries-in-flight "${HELD_IN_FLIGHT:-16}" $hot)
          for round in $(seq "${HELD_ROUNDS:-2}"); do
            for tree in base this; do
              name="pair${round}_${tree}_r${HELD_REPLICAS:-8}_k${HELD_IN_FLIGHT:-16}_n$n$tag"
              if [ $tree = base ]; then
                run_tree .base "$name" 200 "${run[@]}"
              else
                run_step "$name" 200 "${run[@]}"
              fi
            done
          done ;;
    server_pair) n=${HELD_REQUESTS:-12000}
          start_server 6393 .whl/valkey/valkey-server --appendonly no --logfile /tmp/sf-valkey.log
          .whl/valkey/valkey-server --version > "$out/valkey_version.txt"
          run=("${T2VA[@]}" --replicas 8 --requests "$n" --entries-in-flight 16)
          for round in $(seq "${HELD_ROUNDS:-2}"); do
            run_tree .base "srv${round}_base_redis_n$n" 200 "${run[@]}"
            for server in redis:6379 valkey:6393; do
              run_step "srv${round}_this_${server%%:*}_n$n" 200 "${run[@]}" --redis-url "redis://127.0.0.1:${server##*:}/0"
            done
          done ;;
    sweep) n=${HELD_REQUESTS:-12000}
          i=0
          for v in ${SWEEP:-k16 k32}; do
            i=$((i + 1)) extra=(--entries-in-flight 16) switch=()
            case $v in
              k*) extra=(--entries-in-flight "${v#k}") ;;
              hw*) extra+=(--hot-wait "${v#hw}") ;;
              c*) extra+=(--clients "${v#c}") ;;
              if*) extra+=(--in-flight "${v#if}") ;;
              sw*) switch=(env SF_SWITCH_INTERVAL="${v#sw}" PYTHONPATH="$PWD/benchmarks/switch_interval") ;;
              l*) urls=redis://127.0.0.1:6379/0  # N lanes (16 held): N-1 more servers, 6394 on, this run's own
                  for k in $(seq 2 "${v#l}"); do
                    start_server $((6392 + k)) .whl/redis/redis-server --appendonly no --logfile /tmp/sf-lane$k.log
                    urls+=,redis://127.0.0.1:$((6392 + k))/0
                  done
                  extra+=(--redis-url "$urls") ;;
            esac
            extra+=(${SWEEP_STEPS:+--steps})
            if [ "$v" = base ]; then
              run_tree .base "sweep${i}_base_n$n" 200 "${T2VA[@]}" --replicas 8 --requests "$n" "${extra[@]}"
            elif [ "$v" = issue ]; then  # the issue's code (.issue_base, see trio): no entries_in_flight
              run_tree .issue_base "sweep${i}_issue_n$n" 200 "${T2VA[@]}" --replicas 8 --requests "$n"
            else
              run_step "sweep${i}_${v}_n$n" 200 "${switch[@]}" "${T2VA[@]}" --replicas 8 --requests "$n" "${extra[@]}"
            fi
            case $v in l*) for k in $(seq 2 "${v#l}"); do stop_server $((6392 + k)); done ;; esac
          done ;;
    trio) n=${HELD_REQUESTS:-12000}
          run=("${T2VA[@]}" --replicas 8 --requests "$n")
          for round in $(seq "${HELD_ROUNDS:-2}"); do
            run_tree .issue_base "trio${round}_issue_k1_n$n" 200 "${run[@]}"
            run_tree .base "trio${round}_base_k16_n$n" 200 "${run[@]}" --entries-in-flight 16
            run_step "trio${round}_this_k16_n$n" 200 "${run[@]}" --entries-in-flight 16
          done ;;
    spy) run_step spy_run 200 "${T2VA[@]}" --replicas 8 --requests 20000 --entries-in-flight 16 &
         for stage in encoder diffusion; do
           for _ in $(seq 120); do pgrep -f "stageferry serve $stage" >/dev/null && break; sleep 0.5; done
         done
         # sample once Redis runs the measured requests (40,000 commands/s and more: over 1,000 req/s)
         python3 -c "
import time, redis
r, deadline = redis.Redis(), time.monotonic() + 120
while r.info('stats')['instantaneous_ops_per_sec'] < 40000 and time.monotonic() < deadline:
    time.sleep(0.2)"
         sleep 1
         for stage in encoder diffusion; do
           pid=$(pgrep -f "stageferry serve $stage" | head -1)
           .whl/py-spy record -p "$pid" -d 4 -r 250 -f raw -o "$out/spy_$stage.raw" --nonblocking ${SPY_THREADS:+--threads} \
             > "$out/spy_$stage.log" 2>&1 &
         done
         wait ;;
    profile) run_step "profile_r${HELD_REPLICAS:-8}_k${HELD_IN_FLIGHT:-16}" 200 "${T2VA[@]}" \
               --replicas "${HELD_REPLICAS:-8}" --requests 4000 --entries-in-flight "${HELD_IN_FLIGHT:-16}" --script-times
             run_step script_cost 120 python3 benchmarks/script_cost.py --redis-url redis://127.0.0.1:6379/0 --calls 5000 ;;
    *) echo "unknown step $s" >&2 ;;
  esac
done
# The device tool brings back at most 8 files from $OUT: once more than 6 are there, the steps' outputs are
# appended to one archive (steps.tar; a later invocation in the same call appends to it), leaving room for
# a caller's own all_stdout.txt.
if [ "$(find "$out" -maxdepth 1 -type f ! -name steps.tar | wc -l)" -gt 6 ]; then
  (cd "$out" && find . -maxdepth 1 -type f ! -name steps.tar ! -name all_stdout.txt -printf '%P\n' \
     | tar rf steps.tar -T - --remove-files)
fi
