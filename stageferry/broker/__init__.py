"""The two planes of the broker, one subpackage each.

The dependency runs one way: the data plane uses the control plane's key layout and Redis error
translation (agent records, claims and resend streams live in Redis); the control plane never imports
the data plane.

- :mod:`stageferry.broker.control` — the control plane over Redis: key layout, the connection factory,
  stage streams (Lua), request records and events.  Only small envelopes travel here.
- :mod:`stageferry.broker.data` — the data plane: the connector contract, the inline codec, the payload
  codec, registered pools, the NIXL agent and the NIXL connector (producer and consumer sides).
"""
