"""The Lua of an entry's life (:mod:`stageferry.broker.control.entry_records`): one library, a function per step.

The steps share :data:`LIBRARY` (the held check, the record read once and saved once, the admission, the
status write, ...); each step is a body of its own, and the comment above each names its keys and
arguments in order, which :class:`~stageferry.broker.control.entry_records.EntryRecords` and the stores
that call them (``RequestStore``, ``StageStream``, ``RecordLoss``) build from named parameters.  They are
loaded as one Redis Functions library, :data:`ENTRY_LIBRARY` (:mod:`~stageferry.broker.control.functions`:
``FUNCTION LOAD`` once, ``FCALL`` per step), so the shared functions are defined once, at load, not on
every call as a script's are; the constants (``HAND_OFF``, ...) are its functions.  They use only the
commands of the stage ACL user (:data:`stageferry.acl.STAGE_COMMANDS`).

These steps are most of what Redis does per request (``benchmarks/script_instructions.py``), and most of
their cost is Lua's own work, not its commands: so they build no table they can do without (a status
write is read from ``ARGV`` where it lies, the record's writes gather in one flat ``HSET`` argument list,
the entry's fields are passed on with ``unpack(ARGV, i)``), pass Redis strings, never Lua numbers (Redis
formats each number argument with ``%.17g``), and compare status orders as fixed-width strings
(:meth:`StatusOrder.key`), not field by field.  A library's locals outlive a call and are shared by every
client: each step sets ``KEYS``, ``ARGV`` and ``clock`` first (:func:`_callback`).
"""

from __future__ import annotations

from stageferry.broker.control.functions import LibraryFunction, library
from stageferry.broker.control.held import HELD_FN

#: The Lua functions the steps share, in definition order: (name, Lua).  A function may call those
#: defined before it.
LIBRARY: tuple[tuple[str, str], ...] = (
    (
        "TERMINAL",
        """
local TERMINAL = {done=true, failed=true, rejected=true, cancelled=true}
""",
    ),
    ("held", HELD_FN),
    (
        "owns",
        """
-- Whether `consumer` owns entry `id` of `stream` (a lost group raises NOGROUP: the caller makes it again).
local function owns(stream, group, consumer, id)
  local p = redis.call('XPENDING', stream, group, id, id, '1')
  return #p > 0 and p[1][2] == consumer
end
""",
    ),
    (
        "ack_and_delete",
        """
-- Acknowledge and delete a settled entry.
local function ack_and_delete(stream, group, id)
  redis.call('XACK', stream, group, id)
  redis.call('XDEL', stream, id)
end
""",
    ),
    (
        "clock",
        """
-- The server's clock, as the id of an entry this script added (the stage user has no TIME): the id, whose
-- milliseconds `save` reads when it needs them.
local clock = nil
""",
    ),
    (
        "record",
        """
-- The request's record, read once (false: no such field), with `ttl` (s), the script's TTL.  The steps
-- below change it in `rec`: a field's write goes into `rec.h` (name, value, ...; each field once a
-- script) and a status write leaves the ARGV index of its arguments in `rec.w`; `save` writes them all in
-- one HSET.  The status JSON is read only for a script that returns it (`status`): its bytes cost Lua a
-- string of them.  `ttl_at`: when the record and its events expire, as of their last refresh (ms).
local function record(key, ttl, run, crash, status)
  local v = redis.call('HMGET', key, 'job_sha', 'state', 'order', 'ttl_at', run or 'ttl_at', crash or 'ttl_at',
                       status and 'status' or 'ttl_at')
  return {key=key, ttl=ttl, job_sha=v[1], state=v[2], order=v[3], ttl_at=v[4], run=run and v[5],
          crash=crash and v[6], status=status and v[7], h={}, w=false, unsent=false, events=false}
end

local function put(rec, name, value)
  local h = rec.h
  h[#h + 1] = name
  h[#h + 1] = value
end
""",
    ),
    (
        "own_run",
        """
-- Which entry owns the run (request, stage, attempt) the record's field `run` stands for: the one that
-- took it first ({taken now, owner}); the field is written with the record's save.
local function own_run(rec, run, id)
  if rec.run then return 0, rec.run end
  put(rec, run, id)
  return 1, id
end
""",
    ),
    (
        "unmark",
        """
-- Clear the entry's crash mark (the record's field `crash`): its work is settled, and did not kill the
-- stage.  Set to '' (no mark) with the record's save, when there is one to clear.
local function unmark(rec, crash)
  if rec.crash and rec.crash ~= '' then put(rec, crash, '') end
end
""",
    ),
    (
        "save",
        """
-- Write what the steps changed in one HSET (a status write's state, status and order last).  The record's
-- and its events' TTLs are set again for a record without a known refresh, or when the clock is not known;
-- else once less than `ttl` is left.  A refresh sets them to `ttl` and its margin (a tenth of it, a minute
-- at most), so after every write — the terminal status's too — they live at least `ttl` (at most the margin
-- more), and the writes of a request that ends within the margin of its last refresh pay no PEXPIREs.
local function save(rec)
  local h, w = rec.h, rec.w
  if w then
    local n = #h
    h[n + 1], h[n + 2], h[n + 3], h[n + 4], h[n + 5], h[n + 6] =
      'state', ARGV[w], 'status', ARGV[w + 1], 'order', ARGV[w + 5]
  end
  if #h == 0 then return end
  local ttl_ms = tonumber(rec.ttl) * 1000
  local now = clock and tonumber(string.match(clock, '^(%d+)'))
  local refresh = not now or not rec.ttl_at or tonumber(rec.ttl_at) - now < ttl_ms
  local keep
  if refresh then
    ttl_ms = ttl_ms + math.min(ttl_ms / 10, 60000)
    keep = string.format('%d', ttl_ms)
    if now and rec.events then put(rec, 'ttl_at', string.format('%d', now + ttl_ms)) end
  end
  redis.call('HSET', rec.key, unpack(h))
  if refresh then
    redis.call('PEXPIRE', rec.key, keep)
    if rec.events then redis.call('PEXPIRE', rec.events, keep) end
  end
end
""",
    ),
    (
        "admit",
        """
-- Bind the record to the job with `digest` unless it is bound: 2 (now this job's), 1 (this job's
-- already), -1 (taken: another job's, or ended without one).
local function admit(rec, digest)
  local job = rec.job_sha
  if job then
    if job == digest then return 1 end
    return -1
  end
  if rec.state and TERMINAL[rec.state] then return -1 end
  put(rec, 'job_sha', digest)
  rec.job_sha = digest
  return 2
end
""",
    ),
    (
        "emit",
        """
-- The event of the status whose six arguments start at ARGV[at] (StatusWrite.args: state, status, ttl,
-- events' maxlen, mode, order) on the events stream (a terminal one names the record's job, ``job_sha``;
-- one that replaced another status written by the same script at the same instant, `folded` (its ARGV
-- index), carries that status as its field ``folded``, so that a trace still shows it); it tells the
-- script the server's clock.
local function emit(rec, events, at, folded)
  local state = ARGV[at]
  local job = TERMINAL[state] and rec.job_sha  -- whose job ended: a waiter needs no HGET of job_sha
  local more = {}
  if job then more[1], more[2] = 'job_sha', job end
  if folded then more[#more + 1], more[#more + 2] = 'folded', ARGV[folded + 1] end
  clock = redis.call('XADD', events, 'MAXLEN', '~', ARGV[at + 3], '*', 'kind', 'status', 'state', state,
                     'status', ARGV[at + 1], unpack(more))
  rec.events = events
end
""",
    ),
    (
        "set_status",
        """
-- Whether order `a` comes before order `b` (four numbers, space-separated): two in StatusOrder.key's
-- fixed-width form (19 characters) compare as strings; any other (a record written before it) number by number.
local function before(a, b)
  if #a == 19 and #b == 19 then return a < b end
  local fields = string.gmatch(b, '%d+')
  for value in string.gmatch(a, '%d+') do
    local m, n = tonumber(value), tonumber(fields() or '0')
    if m ~= n then return m < n end
  end
  return false
end

-- Write the status whose six arguments start at ARGV[at] unless the record is terminal or the mode
-- forbids it (0), or it is older than the stored one (-1: a late writer never moves a request back); 1 if
-- written, with its event on the events stream.  `quiet`: a write that the next one of the same script
-- replaces (a script makes one quiet write at a time), whose event waits (``rec.unsent``): the next
-- write's event carries it (``emit``), and ``flush`` sends it alone when no next write is written.
local function set_status(rec, events, at, quiet)
  local state = rec.state
  if state and TERMINAL[state] then return 0 end
  local mode = ARGV[at + 4]
  if (mode == 'create' and state) or (mode == 'update' and not state) or (mode == 'unowned' and rec.job_sha) then
    return 0
  end
  local order = ARGV[at + 5]
  if rec.order and not TERMINAL[ARGV[at]] and before(order, rec.order) then return -1 end
  rec.state, rec.order, rec.w = ARGV[at], order, at
  local folded = rec.unsent
  rec.unsent = false
  if quiet then
    rec.unsent = at
  else
    emit(rec, events, at, folded)
  end
  return 1
end
""",
    ),
    (
        "flush",
        """
-- Send the event of a quiet write that no later write replaced (``set_status``).
local function flush(rec, events)
  if rec.unsent then
    emit(rec, events, rec.unsent, false)
    rec.unsent = false
  end
end
""",
    ),
)


def _callback(body: str) -> str:
    """A step's body as a library function: it takes ``KEYS`` and ``ARGV`` (the library's locals, which
    the shared functions read) and starts with the clock unknown (``clock`` outlives a call: each call sets
    it afresh, so that no call reads the clock of the one before)."""
    return f"function(keys, args)\nKEYS, ARGV, clock = keys, args, nil\n{body}end"


#: A status write on its own.  KEYS: record, events [, the entry's stream: an owned write].  ARGV: the
#: status (six), then group, consumer, entry id (owned writes).  1 written, 0 terminal or refused by the
#: mode, -1 older than the record's, -2 not held (nothing written).
_SET_STATUS = """
if #KEYS > 2 and not held(KEYS[3], ARGV[7], ARGV[8], ARGV[9]) then return -2 end
local rec = record(KEYS[1], ARGV[3])
local written = set_status(rec, KEYS[2], 1)
save(rec)
return written
"""

#: An admission alone (a redelivery's, whose crash marks are checked first; or a tool's).  KEYS: record
#: [, the entry's stream].  ARGV: job digest, ttl, group, consumer, entry id.  Returns what ``admit``
#: returns, 0 when the entry is not held.
_ADMIT = """
if #KEYS > 1 and not held(KEYS[2], ARGV[3], ARGV[4], ARGV[5]) then return 0 end
local rec = record(KEYS[1], ARGV[2])
local admitted = admit(rec, ARGV[1])
save(rec)
return admitted
"""

#: A first delivery's admission and crash mark (the record's field ``crash:<stage>:<entry>``).  KEYS:
#: record [, the entry's stream].  ARGV: job digest, ttl, group, consumer, entry id, crash field.  A taken
#: id (-1) gets no mark; a first delivery's mark is set to 1, not counted up (a script run twice after a
#: lost connection must not count one crash as two).
_ADMIT_AND_MARK = """
if #KEYS > 1 and not held(KEYS[2], ARGV[3], ARGV[4], ARGV[5]) then return 0 end
local rec = record(KEYS[1], ARGV[2])
local admitted = admit(rec, ARGV[1])
if admitted ~= -1 then put(rec, ARGV[6], '1') end
save(rec)
return admitted
"""

#: A first delivery's whole start in one step: the admission, the crash mark, what the stage must know
#: before it runs the entry (the look: the record's status, the cancel flag, and which entry owns this run —
#: the record's field ``run:<stage>:<attempt>``, taken by the first entry that looks), and the statuses that
#: start it (up to two, written only when it will run: not cancelled, and this entry owns the run; with one
#: status event, the last start's, which carries the first as its ``folded`` field: a first stage's
#: ``queued`` and ``running``, written at one instant, never showed apart in the record).  KEYS:
#: record, cancel flag, events [, the entry's stream].  ARGV: job digest, ttl, group, consumer, entry id,
#: run field, crash field, number of starts, then each start's six.  Returns {admitted} for a taken
#: id (-1: no mark, no look) or an entry not held (0: nothing), else {admitted, status, cancelled, claimed,
#: owner, started} (the status as it was before this entry's start).
_ADMIT_MARK_AND_LOOK = """
if #KEYS > 3 and not held(KEYS[4], ARGV[3], ARGV[4], ARGV[5]) then return {0} end
local id = ARGV[5]
local rec = record(KEYS[1], ARGV[2], ARGV[6], nil, true)
local admitted = admit(rec, ARGV[1])
if admitted == -1 then
  save(rec)
  return {admitted}
end
put(rec, ARGV[7], '1')
local status = rec.status
local cancelled = redis.call('EXISTS', KEYS[2])
local claimed, owner = own_run(rec, ARGV[6], id)
local started = 0
if cancelled == 0 and owner == id then
  local n = tonumber(ARGV[8])
  for i = 1, n do  -- one event for them all: every start but the last is folded into the next one's
    set_status(rec, KEYS[3], 3 + i * 6, i < n)
    started = 1
  end
  flush(rec, KEYS[3])
end
save(rec)
return {admitted, status, cancelled, claimed, owner, started}
"""

#: The look alone (a redelivery's, after its admission).  KEYS: record, cancel flag.  ARGV: entry id, run
#: field, ttl.  Returns {status, cancelled, claimed, owner}.  A record gone since the admission (Redis came
#: back empty) is not made again with only the run in it: nothing is written (no status, no owner), and
#: the entry's end is ``record_loss``'s, which ends a request without a record as lost.
_LOOK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {false, redis.call('EXISTS', KEYS[2]), 0, false} end
local rec = record(KEYS[1], ARGV[3], ARGV[2], nil, true)
local cancelled = redis.call('EXISTS', KEYS[2])
local claimed, owner = own_run(rec, ARGV[2], ARGV[1])
save(rec)
return {rec.status, cancelled, claimed, owner}
"""

#: Count one more crash of an entry (a redelivery's, admitted first: its record exists).  KEYS: record.
#: ARGV: crash field, the delivery's number (the stream's delivery count).  The mark is written as
#: ``<count>:<delivery>``: the same delivery marked again (the script run twice after a lost connection,
#: redis-py's retry) returns the count it made and counts nothing.  Returns the count (0: no record,
#: nothing written).
_MARK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local n, by = string.match(redis.call('HGET', KEYS[1], ARGV[1]) or '', '^(%d*):?(%d*)$')
n = tonumber(n) or 0
if by == ARGV[2] then return n end
redis.call('HSET', KEYS[1], ARGV[1], (n + 1) .. ':' .. ARGV[2])
return n + 1
"""

#: The hand-off with the next stage's status in one step.  KEYS: source stream, next stage's stream,
#: record, events, next stage's wake list.  ARGV: group, consumer, entry id, crash field, the status's six,
#: then the new entry's field, value, ...  Returns 0 when this consumer no longer owns the entry (nothing
#: written), 1 handed on.  The crash mark is cleared once the entry is handed on or found not ours.  The
#: status (the next stage's ``queued``) goes into the record only, with no event of its own: the next
#: stage's admission writes it again, dated by the hand-off, with its ``running`` and one event for both
#: (``folded``).  The new entry's id tells the script the clock.  The cancel flag is not read here: the
#: next stage's admission reads it before it spends anything.  The events stream's TTL is not refreshed
#: here (no event is added): a refresh writes ``ttl_at`` for both keys, and the stream may not exist
#: (expired before the record, which writes without events refresh alone); the next event refreshes it.
_HAND_OFF = """
if not owns(KEYS[1], ARGV[1], ARGV[2], ARGV[3]) then
  redis.call('HDEL', KEYS[3], ARGV[4])
  return 0
end
clock = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 11))
if redis.call('LPUSH', KEYS[5], '1') > 16 then redis.call('LTRIM', KEYS[5], '0', '7') end
ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
local rec = record(KEYS[3], ARGV[7], nil, ARGV[4])
set_status(rec, KEYS[4], 5, true)  -- quiet: its event comes with the next stage's running
unmark(rec, ARGV[4])
save(rec)
return 1
"""

#: The last stage's whole ending in one step.  KEYS: source stream, record, events, cancel flag, result
#: key.  ARGV: group, consumer, entry id, crash field, the status's six, then '1', the result's ttl and
#: bytes to store it (SET NX), or '0'.  Returns {-2, 0} when the request is cancelled (nothing written),
#: else {owned, written}: owned is 0 (nothing written) when another consumer holds the entry, -1 when its
#: stream or group is gone (Redis lost it, and the record with it: ``record_loss`` ends it instead).  The
#: crash mark is cleared either way.
_FINISH = """
if redis.call('EXISTS', KEYS[4]) == 1 then return {-2, 0} end
local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], '1')
if type(p) ~= 'table' or p.err or #p == 0 or p[1][2] ~= ARGV[2] then
  redis.call('HDEL', KEYS[2], ARGV[4])
  if type(p) ~= 'table' or p.err then return {-1, 0} end
  return {0, 0}
end
if ARGV[11] == '1' then redis.call('SET', KEYS[5], ARGV[13], 'EX', ARGV[12], 'NX') end
local rec = record(KEYS[2], ARGV[7], nil, ARGV[4])
local written = set_status(rec, KEYS[3], 5)
unmark(rec, ARGV[4])
save(rec)
ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
return {1, written}
"""

#: The end of a request whose entry is gone.  KEYS: record, events, the entry's stream.  ARGV: entry id,
#: then the status's six (mode 'create').  Returns 'recorded' (it has a record), 'queued' (its entry is
#: still in its stream) or 'ended' (the status written).
_END_IF_LOST = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 'recorded' end
local e = redis.pcall('XRANGE', KEYS[3], ARGV[1], ARGV[1])
if type(e) == 'table' and not e.err and #e > 0 then return 'queued' end
local rec = record(KEYS[1], ARGV[4])
set_status(rec, KEYS[2], 2)
save(rec)
return 'ended'
"""


#: The steps' library (:mod:`~stageferry.broker.control.functions`): every :data:`LIBRARY` entry defined
#: once, at load, after the ``KEYS`` and ``ARGV`` its functions read; then one function per step.
ENTRY_LIBRARY = library(
    "stageferry_entries",
    "local KEYS, ARGV = {}, {}\n" + "".join(lua for _, lua in LIBRARY),
    {
        name: _callback(body)
        for name, body in (
            ("set_status", _SET_STATUS),
            ("admit", _ADMIT),
            ("admit_and_mark", _ADMIT_AND_MARK),
            ("admit_mark_and_look", _ADMIT_MARK_AND_LOOK),
            ("look", _LOOK),
            ("mark", _MARK),
            ("hand_off", _HAND_OFF),
            ("finish", _FINISH),
            ("end_if_lost", _END_IF_LOST),
        )
    },
)
SET_STATUS: LibraryFunction = ENTRY_LIBRARY.function("set_status")
ADMIT: LibraryFunction = ENTRY_LIBRARY.function("admit")
ADMIT_AND_MARK: LibraryFunction = ENTRY_LIBRARY.function("admit_and_mark")
ADMIT_MARK_AND_LOOK: LibraryFunction = ENTRY_LIBRARY.function("admit_mark_and_look")
LOOK: LibraryFunction = ENTRY_LIBRARY.function("look")
MARK: LibraryFunction = ENTRY_LIBRARY.function("mark")
HAND_OFF: LibraryFunction = ENTRY_LIBRARY.function("hand_off")
FINISH: LibraryFunction = ENTRY_LIBRARY.function("finish")
END_IF_LOST: LibraryFunction = ENTRY_LIBRARY.function("end_if_lost")
