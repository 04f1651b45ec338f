"""The Lua scripts behind :class:`~stageferry.broker.control.streams.StageStream`, one per step.

The scripts that also write the request's record (the hand-off with the next stage's status, the last
stage's finish) are :mod:`~stageferry.broker.control.entry_records`'.  Every script that changes an entry
(hand on, ack, renew) starts with the same ownership
fragment, :data:`OWNED`: it checks in the group's pending list that this consumer still owns the entry,
and returns 0 without writing anything if not.  Built from one fragment so that no step can forget the
check: a replica that stalled past the visibility timeout and lost its entry to another replica can
never hand the same work on twice.  :data:`READ_CAPPED` reads (own pending, reclaimed, new) in one
round trip, measures entries inside Redis and claims a new entry's lease (see the ``streams`` module
docstring for why each).  Every writer of ours pushes the stage's wake list in the script of its XADD
(:data:`WAKE_LUA`).
"""

from __future__ import annotations

from stageferry.broker.control.intake import MOVE_FN

OWNED = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
"""

#: Pushed to a stage's wake list after every XADD by our own writers; bounded (16 items: cut to 8 when it passes
#: them, so that a busy stage's pushes trim it once in eight), so a list nobody pops stays small.
WAKE_LUA = """
if redis.call('LPUSH', KEYS[#KEYS], '1') > 16 then redis.call('LTRIM', KEYS[#KEYS], 0, 7) end
"""

#: Acknowledge the source entry and delete it (KEYS[1]; ARGV: group, consumer, entry id).
ACK_AND_DELETE = """
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
"""


def _hand_on(first_field: int) -> str:
    """XADD ``ARGV[first_field..]`` (field, value, ...) to KEYS[2], wake its stage (the last key), then
    acknowledge and delete the source entry."""
    return (
        f"""
local fields = {{}}
for i = {first_field}, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', KEYS[2], '*', unpack(fields))
"""
        + WAKE_LUA
        + ACK_AND_DELETE
    )


# KEYS: src stream, dst stream, dst wake list. ARGV: group, consumer, entry id, field, value, field, value, ...
HANDOFF = OWNED + _hand_on(4) + "return 1\n"

# KEYS: src stream. ARGV: group, consumer, entry id.
ACK = OWNED + ACK_AND_DELETE + "return 1\n"

# KEYS: src stream. ARGV: group, consumer, entry id. Resets the idle time, only while still the owner.
RENEW = (
    OWNED
    + """
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return 1
"""
)

# KEYS: the streams, in order (the stage's own, then tenants' intakes). ARGV: group, consumer, count, max
# entry bytes, starts (comma-separated phases, tried in order until one yields entries: '0' own pending,
# 'claim' to XAUTOCLAIM entries idle at least ARGV[6] ms, '>' new), then the lease claim: key prefix ('' for
# none), holder, milliseconds.
# Returns {id, fields, size, stream index, deliveries, phase, claimed}: size is 0 for an entry returned whole;
# an oversized one keeps only a short request_id, the rest never leaves Redis.  Stops at ``count`` entries
# across the streams.  Deliveries come from XPENDING in the same script (a new entry's is 1), so a read is
# one round trip however many phases it tries (was one per phase, plus one for the counts).  ``claimed``
# is 1 (won) or 0 (taken already) for a new whole entry naming a lease, when a claim prefix is given; -1
# when no claim was tried.  A first stage's read moves its clients' submissions into its stream in the
# same call (:data:`READ_CAPPED_MOVING`, the same read with
# :data:`~stageferry.broker.control.intake.MOVE_FN`): then KEYS end with the intake lists, and
# ARGV go on with the number of streams, the surplus (how many submissions more than it takes now a move
# may put into the stream, for the next reads of any replica), the most bytes an item may have and one
# tenant per list.  The move comes when the new entries already in the stream fall short of ``count``
# (then the stream is read again): a busy stage's reads pay it once per surplus, not once per read.
# Starts beginning with 'ifmoved,' (a first stage's poll) move first, and read the streams only if the
# move moved something (an idle first stage polls its intake often, and its stream less often).
# Every entry read passes through Lua (a string made of each of its bytes), so the script makes nothing it
# can do without: no move functions where there is no intake (READ_CAPPED), Redis strings rather than Lua
# numbers as arguments (Redis formats each number with %.17g), one table per entry returned.
_READ = """
local cap = tonumber(ARGV[4])
local want = tonumber(ARGV[3])
local streams = #KEYS
local phases = ARGV[5]
local lazy = string.sub(phases, 1, 8) == 'ifmoved,'
if lazy then phases = string.sub(phases, 9) end
local mover = #ARGV >= 10
if mover then
  streams = tonumber(ARGV[10])
  if lazy then
    local moved, oversized = move_intake(KEYS[1], streams + 1, want, tonumber(ARGV[12]), 13)
    if moved + oversized == 0 then return {} end
    mover = false
  end
end
local out = {}
local claim = ARGV[7] ~= ''

local function take(entries, k, start)
  for _, e in ipairs(entries) do
    local fields = e[2]
    local size = 0
    local claimed = -1
    if type(fields) ~= 'table' then
      fields = {}
    else
      for i = 1, #fields do size = size + #fields[i] end
      if size > cap then
        local rid = ''
        for i = 1, #fields - 1, 2 do
          if fields[i] == 'request_id' and #fields[i + 1] <= 128 then rid = fields[i + 1] end
        end
        fields = {'request_id', rid}
      else
        size = 0
        if claim and start == '>' then
          for i = 1, #fields - 1, 2 do
            local lease = fields[i + 1]
            if fields[i] == 'lease' and #lease > 0 and #lease <= 200 then
              claimed = redis.call('SET', ARGV[7] .. lease, ARGV[8], 'NX', 'PX', ARGV[9]) and 1 or 0
            end
          end
        end
      end
    end
    local deliveries = 1
    if start ~= '>' then
      local p = redis.call('XPENDING', KEYS[k], ARGV[1], e[1], e[1], '1')
      if #p > 0 then deliveries = p[1][4] end
    end
    out[#out + 1] = {e[1], fields, size, k, deliveries, start, claimed}
  end
end

local function read(k, start)
  local count = #out == 0 and ARGV[3] or string.format('%d', want - #out)
  if start == 'claim' then
    take(redis.call('XAUTOCLAIM', KEYS[k], ARGV[1], ARGV[2], ARGV[6], '0-0', 'COUNT', count)[2], k, start)
  else
    local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', count, 'STREAMS', KEYS[k], start)
    if reply then take(reply[1][2], k, start) end
  end
end

for start in string.gmatch(phases, '[^,]+') do
  for k = 1, streams do
    read(k, start)
    if #out >= want then break end
  end
  if start == '>' and mover and #out < want then  -- short: move submissions in, then read them
    local moved, oversized = move_intake(KEYS[1], streams + 1, want - #out + tonumber(ARGV[11]),
                                         tonumber(ARGV[12]), 13)
    if moved + oversized > 0 then read(1, '>') end
  end
  if #out > 0 then break end
end
return out
"""

#: A stage's read (see above), for a stage without an intake: no move.
READ_CAPPED = _READ

#: A first stage's read: the same, moving its clients' submissions from the intake lists.
READ_CAPPED_MOVING = MOVE_FN + _READ
