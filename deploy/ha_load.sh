# Sourced by deploy/kubernetes/ha_smoke.sh and compose/ha_smoke.sh: the load through the gateway with the
# primary Redis killed under it, the timed failover, and the audit of every accepted job.
# The caller sets: py (a Python with stageferry), root (the repository), work (its scratch directory), gw
# (the gateway's base URL), prefix (the key prefix), requests, kill_after, spacing, steps, job_timeout,
# since, say and fail; and defines
#   sentinel_master        print the master's node name, as the first sentinel that answers names it
#   probe_write NODE       exit 0 once a SET on NODE answered OK (a write the master accepted)
#   node_container NODE    print the container that runs NODE
#   audit_redis            print "host user password" of the current master (user, password: "-" for none)

submit() {  # n: POST /v1/videos; writes <n>.at (when), <n>.code (HTTP status, seconds) and <n>.json
  date +%s.%N >"$work/sub/$1.at"
  curl -sS -m 120 -o "$work/sub/$1.json" -w '%{http_code} %{time_total}' "$gw/v1/videos" -F "prompt=ha smoke job $1" \
    -F width=160 -F height=96 -F num_inference_steps="$steps" -F seed="$1" -F 'extra_params={"task":"t2va","duration":1.0}' \
    >"$work/sub/$1.code" 2>"$work/sub/$1.err" || true
}

time_failover() {  # old master: kill -> the sentinels name another -> first successful write there
  local deadline=$((SECONDS + 120)) m
  until m="$(sentinel_master)" && [[ -n "$m" && "$m" != "$1" ]]; do
    ((SECONDS < deadline)) || { echo "no new master named in 120 s" >"$work/failover.err"; return; }
    sleep 0.2
  done
  date +%s.%N >"$work/named_at"
  echo "$m" >"$work/new_master"
  until probe_write "$m"; do
    ((SECONDS < deadline)) || { echo "no write succeeded on $m" >"$work/failover.err"; return; }
    sleep 0.1
  done
  date +%s.%N >"$work/written_at"
}

load_and_kill() {  # 1 and 2: the jobs, the primary SIGKILLed after $kill_after of them and started a second
  # later (what the kubelet or a restart policy does); sets primary, victim, killed_at, new and accepted,
  # and writes $work/ids.txt (id, job, submitted at, curl's total)
  local n code took pids=()   # its own background jobs: `wait` alone would wait for the caller's too
  mkdir -p "$work/sub"
  say "1. $requests jobs through the gateway, one every ${spacing}s; the primary is killed after $kill_after"
  primary="$(sentinel_master)"
  for n in $(seq 1 "$requests"); do
    submit "$n" &
    pids+=($!)
    if ((n == kill_after)); then
      victim="$(node_container "$primary")"
      killed_at=$(date +%s.%N)
      podman kill -s KILL "$victim" >/dev/null
      say "  after job $n: podman kill -s KILL $victim (the primary, $primary)"
      ( sleep 1; podman start "$victim" >/dev/null 2>&1; date +%s.%N >"$work/restarted_at" ) &
      pids+=($!)
      time_failover "$primary" &
      pids+=($!)
    fi
    sleep "$spacing"
  done
  wait "${pids[@]}"
  [[ -s "$work/written_at" ]] || fail "the failover did not end: $(cat "$work/failover.err" 2>/dev/null)"
  new="$(cat "$work/new_master")"
  say "2. failover $primary -> $new: the sentinels named it $(since "$(cat "$work/named_at")" "$killed_at") s after the kill, first write on it $(since "$(cat "$work/written_at")" "$killed_at") s after the kill"
  accepted=0
  : >"$work/ids.txt"
  for n in $(seq 1 "$requests"); do
    read -r code took <<<"$(cat "$work/sub/$n.code" 2>/dev/null)"
    if [[ "$code" == 200 || "$code" == 202 ]]; then
      echo "$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["id"])' "$work/sub/$n.json") $n $(cat "$work/sub/$n.at") $took" >>"$work/ids.txt"
      accepted=$((accepted + 1))
    else
      say "  job $n not accepted: HTTP $code $(head -c 200 "$work/sub/$n.json" 2>/dev/null) $(cat "$work/sub/$n.err")"
    fi
  done
  say "  accepted $accepted of $requests submissions (HTTP 200/202)"
}

audit() {  # [table]: "not-terminal lost duplicated stuck states" of the accepted jobs; table: per job on stderr
  # shellcheck disable=SC2046  # audit_redis prints three words
  PYTHONPATH="$root" "$py" - "$work/ids.txt" $(audit_redis) "$prefix" "$killed_at" "${1:-}" <<'EOF'
import sys
import redis
from stageferry.broker.control.keys import Keys
from stageferry.chaos.audit import outcomes
ids, host, user, password, prefix, killed_at, table = sys.argv[1:8]
rows = {line.split()[0]: line.split()[1:] for line in open(ids) if line.strip()}
client = redis.Redis(host=host, username=None if user == "-" else user, password=None if password == "-" else password)
found = outcomes(client, Keys(prefix), {rid: "done" for rid in rows}, ["encoder", "diffusion"])
if table == "table":  # per job, times from the kill: submitted, accepted (curl's total), ended
    kill = float(killed_at)
    print("    job  submitted  accepted    ended  state  terminal events  (s from the kill)", file=sys.stderr)
    for o in found:
        n, at, took = rows[o.request_id]
        end = "-" if o.ended_ms is None else f"{o.ended_ms / 1000 - kill:+8.1f}"
        flag = "  in flight at the kill" if float(at) < kill and o.ended_ms and o.ended_ms / 1000 > kill else ""
        print(f"    {n:>3}  {float(at) - kill:+9.1f}  {float(took):7.1f}s  {end:>8}  {o.state}   {o.terminal_events}{flag}", file=sys.stderr)
states = {}
for o in found:
    states[o.state] = states.get(o.state, 0) + 1
lost = sum(o.lost for o in found); stuck = sum(o.stuck for o in found); dup = sum(o.duplicated for o in found)
pending = sum(1 for o in found if not o.terminal)
print(f"{pending} {lost} {dup} {stuck} {' '.join(f'{k}={v}' for k, v in sorted(states.items(), key=str))}")
EOF
}

audit_jobs() {  # 3: every accepted job followed to its end (up to $job_timeout s), then audited
  local pending lost dup stuck states deadline=$((SECONDS + job_timeout))
  while :; do
    read -r pending lost dup stuck states <<<"$(audit)"
    ((pending == 0)) && break
    ((SECONDS < deadline)) || break
    sleep 5
  done
  read -r pending lost dup stuck states <<<"$(audit table 2>"$work/table.txt")"
  cat "$work/table.txt"
  say "3. $accepted accepted: $states; lost=$lost duplicated=$dup stuck=$stuck (not terminal: $pending)"
  [[ "$states" == "done=$accepted" && $lost == 0 && $dup == 0 && $stuck == 0 ]] || fail "not every accepted job ended done exactly once"
}

await_rejoin() {  # 4: the killed primary back as a replica of the new master, link up (up to 120 s); the caller
  # defines `replication NODE` (its INFO replication) and `announced NODE` (the name the sentinels give it)
  local deadline=$((SECONDS + 120)) want
  want="role:slave master_host:$(announced "$new") master_link_status:up "
  until [[ "$(replication "$primary" 2>/dev/null | grep -E '^(role|master_host|master_link_status):' | tr '\n' ' ')" == "$want" ]]; do
    ((SECONDS < deadline)) || fail "$primary did not rejoin as a replica of $new: $(replication "$primary" 2>&1 | head -n 5 | tr '\n' ' ')"
    sleep 1
  done
}
