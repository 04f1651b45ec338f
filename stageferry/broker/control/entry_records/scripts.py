"""The Lua scripts of an entry's life (:mod:`stageferry.broker.control.entry_records`), whole, one per step.

Each script is :data:`LIBRARY` (the functions every script shares: the held check, the record read once and
saved once, the admission, the status write, the TTL refresh) and a body of its own; the comment above each
names its keys and arguments in order, which :class:`~stageferry.broker.control.entry_records.EntryRecords`
and the stores that register them (``RequestStore``, ``StageStream``, ``RecordLoss``) build from named
parameters.  Scripts use only the commands of the stage ACL user (:data:`stageferry.acl.STAGE_COMMANDS`).
"""

from __future__ import annotations

#: The Lua functions the scripts below share (one library, prefixed to each script).
LIBRARY = """
local TERMINAL = {done=true, failed=true, rejected=true, cancelled=true}

-- Whether `consumer` holds entry `id` in `group` of `stream` (a missing stream or group holds nothing).
local function held(stream, group, consumer, id)
  local p = redis.pcall('XPENDING', stream, group, id, id, 1)
  if type(p) ~= 'table' or p.err then return false end
  return #p > 0 and p[1][2] == consumer
end

-- A key's TTL (ms), set once per script: every write of the script happens at the same instant.
local ttl_set = {}
local function expire(key, ttl_ms)
  if not ttl_set[key] then
    redis.call('PEXPIRE', key, ttl_ms)
    ttl_set[key] = true
  end
end

-- How much longer than `ttl` (s) a refresh lets the keys live, in ms: a tenth of it, a minute at most.
local function margin_ms(ttl)
  local ttl_ms = tonumber(ttl) * 1000
  return math.min(ttl_ms / 10, 60000)
end

-- The server's clock in ms, once a status event's XADD told it (the stage user has no TIME).
local clock = nil

-- The request's record, read once (false: no such field); the steps below change it in `rec` and
-- `save` writes what they changed in one HSET.  `ttl_at`: when the record and its events expire, as of
-- their last refresh (ms).
local function record(key, run, crash)
  local v = redis.call('HMGET', key, 'job_sha', 'state', 'status', 'order', 'ttl_at', run or 'ttl_at',
                       crash or 'ttl_at')
  return {key=key, job_sha=v[1], state=v[2], status=v[3], order=v[4], ttl_at=v[5], run=run and v[6],
          crash=crash and v[7], changed={}, names={}}
end

local function put(rec, name, value, ttl)
  if rec.changed[name] == nil then rec.names[#rec.names + 1] = name end
  rec.changed[name] = value
  rec[name] = value
  rec.ttl = ttl
end

-- Which entry owns the run (request, stage, attempt) the record's field `run` stands for: the one that
-- took it first ({taken now, owner}); the field is written with the record's next save.
local function own_run(rec, run, id, ttl)
  if rec.run then return 0, rec.run end
  put(rec, run, id, ttl)
  return 1, id
end

-- Clear the entry's crash mark (the record's field `crash`): its work is settled, and did not kill the
-- stage.  Set to '' (no mark) with the record's next save, when there is one to clear.
local function unmark(rec, crash, ttl)
  if rec.crash and rec.crash ~= '' then put(rec, crash, '', ttl) end
end

-- Whether the record's and its events' TTLs must be set again: for a record without a known refresh, or
-- when the clock is not known; else once less than `ttl` is left.  A refresh sets them to `ttl` and its
-- margin, so after every write — the terminal status's too — they live at least `ttl` (at most the margin
-- more), and the writes of a request that ends within the margin of its last refresh pay no EXPIREs.
local function refresh_due(rec)
  if not clock or not rec.ttl_at then return true end
  return tonumber(rec.ttl_at) - clock < tonumber(rec.ttl) * 1000
end

local function save(rec)
  if #rec.names == 0 then return end
  local refresh = refresh_due(rec)
  local ttl_ms = tonumber(rec.ttl) * 1000 + margin_ms(rec.ttl)
  if refresh and clock and rec.events then put(rec, 'ttl_at', clock + ttl_ms, rec.ttl) end
  local args = {}
  for _, name in ipairs(rec.names) do
    args[#args + 1] = name
    args[#args + 1] = rec.changed[name]
  end
  redis.call('HSET', rec.key, unpack(args))
  if refresh then
    expire(rec.key, ttl_ms)
    if rec.events then expire(rec.events, ttl_ms) end
  end
  rec.changed, rec.names = {}, {}
end

-- Bind the record to the job with `digest` unless it is bound: 2 (now this job's), 1 (this job's
-- already), -1 (taken: another job's, or ended without one).
local function admit(rec, digest, ttl)
  if rec.job_sha then
    if rec.job_sha == digest then return 1 end
    return -1
  end
  if rec.state and TERMINAL[rec.state] then return -1 end
  put(rec, 'job_sha', digest, ttl)
  return 2
end

-- A status write's arguments, the block of nine from ARGV[at] (StatusWrite.args).
local function status_at(at)
  return {state=ARGV[at], status=ARGV[at + 1], ttl=ARGV[at + 2], maxlen=ARGV[at + 3], mode=ARGV[at + 4],
          order={ARGV[at + 5], ARGV[at + 6], ARGV[at + 7], ARGV[at + 8]}}
end

-- The event of status `w` on the events stream (a terminal one names the record's job, ``job_sha``; one
-- that replaced `folded`, a status written by the same script at the same instant, carries that status
-- as its field ``folded``, so that a trace still shows it); it tells the script the server's clock.
local function emit(rec, events, w, folded)
  local fields = {'kind', 'status', 'state', w.state, 'status', w.status}
  if TERMINAL[w.state] and rec.job_sha then  -- whose job ended: a waiter needs no HGET of job_sha
    fields[#fields + 1] = 'job_sha'
    fields[#fields + 1] = rec.job_sha
  end
  if folded then
    fields[#fields + 1] = 'folded'
    fields[#fields + 1] = folded.status
  end
  local id = redis.call('XADD', events, 'MAXLEN', '~', w.maxlen, '*', unpack(fields))
  clock = tonumber(string.match(id, '^(%d+)'))
  rec.events = events
end

-- Write status `w` unless the record is terminal or the mode forbids it (0), or it is older than the
-- stored one (-1: orders compared field by field, so a late writer never moves a request back); 1 if
-- written, with its event on the events stream.  `quiet`: a write that the next one of the same script
-- may replace (a script makes one quiet write at a time), whose event waits (``rec.unsent``): the next
-- write's event carries it (``emit``), and ``flush`` sends it alone when no next write is written.
local function set_status(rec, events, w, quiet)
  if rec.state and TERMINAL[rec.state] then return 0 end
  if (w.mode == 'create' and rec.state) or (w.mode == 'update' and not rec.state) then return 0 end
  if w.mode == 'unowned' and rec.job_sha then return 0 end
  if not TERMINAL[w.state] and rec.order then
    local i = 0
    for value in string.gmatch(rec.order, '%d+') do
      i = i + 1
      local a, b = tonumber(w.order[i]), tonumber(value)
      if a > b then break end
      if a < b then return -1 end
    end
  end
  put(rec, 'state', w.state, w.ttl)
  put(rec, 'status', w.status, w.ttl)
  put(rec, 'order', table.concat(w.order, ' '), w.ttl)
  local folded = rec.unsent
  rec.unsent = nil
  if quiet then
    rec.unsent = {w=w, events=events}
  else
    emit(rec, events, w, folded and folded.w)
  end
  return 1
end

-- Send the event of a quiet write that no later write replaced (``set_status``).
local function flush(rec)
  if rec.unsent then
    emit(rec, rec.unsent.events, rec.unsent.w, nil)
    rec.unsent = nil
  end
end

-- Whether `consumer` owns entry `id` of `stream` (a lost group raises NOGROUP: the caller makes it again).
local function owns(stream, group, consumer, id)
  local p = redis.call('XPENDING', stream, group, id, id, 1)
  return #p > 0 and p[1][2] == consumer
end

-- Acknowledge and delete a settled entry.
local function ack_and_delete(stream, group, id)
  redis.call('XACK', stream, group, id)
  redis.call('XDEL', stream, id)
end
"""

#: A status write on its own.  KEYS: record, events [, the entry's stream: an owned write].  ARGV: the
#: status (nine), then group, consumer, entry id (owned writes).  1 written, 0 terminal or refused by the
#: mode, -1 older than the record's, -2 not held (nothing written).
SET_STATUS = (
    LIBRARY
    + """
if #KEYS > 2 and not held(KEYS[3], ARGV[10], ARGV[11], ARGV[12]) then return -2 end
local rec = record(KEYS[1])
local written = set_status(rec, KEYS[2], status_at(1))
save(rec)
return written
"""
)

#: An admission alone (a redelivery's, whose crash marks are checked first; or a tool's).  KEYS: record
#: [, the entry's stream].  ARGV: job digest, ttl, group, consumer, entry id.  Returns what ``admit``
#: returns, 0 when the entry is not held.
ADMIT = (
    LIBRARY
    + """
if #KEYS > 1 and not held(KEYS[2], ARGV[3], ARGV[4], ARGV[5]) then return 0 end
local rec = record(KEYS[1])
local admitted = admit(rec, ARGV[1], ARGV[2])
save(rec)
return admitted
"""
)

#: A first delivery's admission and crash mark (the record's field ``crash:<stage>:<entry>``).  KEYS:
#: record [, the entry's stream].  ARGV: job digest, ttl, group, consumer, entry id, crash field.  A taken
#: id (-1) gets no mark; a first delivery's mark is set to 1, not counted up (a script run twice after a
#: lost connection must not count one crash as two).
ADMIT_AND_MARK = (
    LIBRARY
    + """
if #KEYS > 1 and not held(KEYS[2], ARGV[3], ARGV[4], ARGV[5]) then return 0 end
local rec = record(KEYS[1])
local admitted = admit(rec, ARGV[1], ARGV[2])
if admitted ~= -1 then put(rec, ARGV[6], '1', ARGV[2]) end
save(rec)
return admitted
"""
)

#: A first delivery's whole start in one step: the admission, the crash mark, what the stage must know
#: before it runs the entry (the look: the record's status, the cancel flag, and which entry owns this run —
#: the record's field ``run:<stage>:<attempt>``, taken by the first entry that looks), and the statuses that
#: start it (up to two, written only when it will run: not cancelled, and this entry owns the run; with one
#: status event, the last start's, which carries the first as its ``folded`` field: a first stage's
#: ``queued`` and ``running``, written at one instant, never showed apart in the record).  KEYS:
#: record, cancel flag, events [, the entry's stream].  ARGV: job digest, ttl, group, consumer, entry id,
#: run field, crash field, number of starts, then each start's nine.  Returns {admitted} for a taken
#: id (-1: no mark, no look) or an entry not held (0: nothing), else {admitted, status, cancelled, claimed,
#: owner, started}.
ADMIT_MARK_AND_LOOK = (
    LIBRARY
    + """
if #KEYS > 3 and not held(KEYS[4], ARGV[3], ARGV[4], ARGV[5]) then return {0} end
local id = ARGV[5]
local rec = record(KEYS[1], ARGV[6])
local admitted = admit(rec, ARGV[1], ARGV[2])
if admitted == -1 then
  save(rec)
  return {admitted}
end
put(rec, ARGV[7], '1', ARGV[2])
local status = rec.status
local cancelled = redis.call('EXISTS', KEYS[2])
local claimed, owner = own_run(rec, ARGV[6], id, ARGV[2])
local started = 0
if cancelled == 0 and owner == id then
  local n = tonumber(ARGV[8])
  for i = 1, n do  -- one event for them all: every start but the last is folded into the next one's
    set_status(rec, KEYS[3], status_at(9 + (i - 1) * 9), i < n)
    started = 1
  end
  flush(rec)
end
save(rec)
return {admitted, status, cancelled, claimed, owner, started}
"""
)

#: The look alone (a redelivery's, after its admission).  KEYS: record, cancel flag.  ARGV: entry id, run
#: field, ttl.  Returns {status, cancelled, claimed, owner}.
LOOK = (
    LIBRARY
    + """
local rec = record(KEYS[1], ARGV[2])
local cancelled = redis.call('EXISTS', KEYS[2])
local claimed, owner = own_run(rec, ARGV[2], ARGV[1], ARGV[3])
save(rec)
return {rec.status, cancelled, claimed, owner}
"""
)

#: Count one more crash of an entry (a redelivery's, admitted first: its record exists).  KEYS: record.
#: ARGV: crash field.  Returns the count (0: no record, nothing written).
MARK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local n = (tonumber(redis.call('HGET', KEYS[1], ARGV[1])) or 0) + 1
redis.call('HSET', KEYS[1], ARGV[1], n)
return n
"""

#: The hand-off with the next stage's status in one step.  KEYS: source stream, next stage's stream,
#: record, events, next stage's wake list.  ARGV: group, consumer, entry id, crash field, the status's nine,
#: then the new entry's field, value, ...  Returns 0 when this consumer no longer owns the entry (nothing
#: written), 1 handed on.  The crash mark is cleared once the entry is handed on or found not ours.  The
#: status (the next stage's ``queued``) goes into the record only, with no event of its own: the next
#: stage's admission writes it again, dated by the new entry's id (the hand-off's instant), with its
#: ``running`` and one event for both (``folded``).  The new entry's id tells the script the clock.  The
#: cancel flag is not read here: the next stage's admission reads it before it spends anything.
HAND_OFF = (
    LIBRARY
    + """
if not owns(KEYS[1], ARGV[1], ARGV[2], ARGV[3]) then
  redis.call('HDEL', KEYS[3], ARGV[4])
  return 0
end
local fields = {}
for i = 14, #ARGV do fields[#fields + 1] = ARGV[i] end
local handed = redis.call('XADD', KEYS[2], '*', unpack(fields))
clock = tonumber(string.match(handed, '^(%d+)'))
if redis.call('LPUSH', KEYS[5], '1') > 16 then redis.call('LTRIM', KEYS[5], 0, 7) end
ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
local rec = record(KEYS[3], nil, ARGV[4])
rec.events = KEYS[4]  -- refreshed with the record, though this step adds no event to it
local w = status_at(5)
set_status(rec, KEYS[4], w, true)
rec.unsent = nil  -- its event comes with the next stage's running
unmark(rec, ARGV[4], w.ttl)
save(rec)
return 1
"""
)

#: The last stage's whole ending in one step.  KEYS: source stream, record, events, cancel flag, result
#: key.  ARGV: group, consumer, entry id, crash field, the status's nine, then '1', the result's ttl and
#: bytes to store it (SET NX), or '0'.  Returns {-2, 0} when the request is cancelled (nothing written),
#: else {owned, written}: owned is 0 (nothing written) when another consumer holds the entry, -1 when its
#: stream or group is gone (Redis lost it, and the record with it: ``record_loss`` ends it instead).  The
#: crash mark is cleared either way.
FINISH = (
    LIBRARY
    + """
if redis.call('EXISTS', KEYS[4]) == 1 then return {-2, 0} end
local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if type(p) ~= 'table' or p.err or #p == 0 or p[1][2] ~= ARGV[2] then
  redis.call('HDEL', KEYS[2], ARGV[4])
  if type(p) ~= 'table' or p.err then return {-1, 0} end
  return {0, 0}
end
if ARGV[14] == '1' then redis.call('SET', KEYS[5], ARGV[16], 'EX', ARGV[15], 'NX') end
local rec = record(KEYS[2], nil, ARGV[4])
local w = status_at(5)
local written = set_status(rec, KEYS[3], w)
unmark(rec, ARGV[4], w.ttl)
save(rec)
ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
return {1, written}
"""
)

#: The end of a request whose entry is gone.  KEYS: record, events, the entry's stream.  ARGV: entry id,
#: then the status's nine (mode 'create').  Returns 'recorded' (it has a record), 'queued' (its entry is
#: still in its stream) or 'ended' (the status written).
END_IF_LOST = (
    LIBRARY
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 'recorded' end
local e = redis.pcall('XRANGE', KEYS[3], ARGV[1], ARGV[1])
if type(e) == 'table' and not e.err and #e > 0 then return 'queued' end
local rec = record(KEYS[1])
set_status(rec, KEYS[2], status_at(2))
save(rec)
return 'ended'
"""
)
