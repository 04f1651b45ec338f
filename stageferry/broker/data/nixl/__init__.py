"""The NIXL data plane, one concept per module.

- :mod:`.agent` — the one boundary to the ``nixl`` library (agent, registrations, READs, notifications);
- :mod:`.ucx_log` — which UCX transport carried the bytes, read back from UCX's own log;
- :mod:`.endpoint` — this process's identity, agent, pools and settings, shared by the parts below;
- :mod:`.producer` — put into a leased pool slot, release notifications, the resend service;
- :mod:`.consumer` — claim, READ into our own pool, unpack, ask for a resend;
- :mod:`.leases` — the producer's lease table, expiry, settling and the claim key;
- :mod:`.peers` — this agent's record in Redis, the cache of producer agents, the handshake;
- :mod:`.connector` — :class:`~.connector.NixlConnector`, which composes them behind the
  :class:`~stageferry.broker.data.connector_contract.Connector` contract.

The side-channel wire formats (agent record, lease seal, resend request and reply, release tag) are in
:mod:`stageferry.schemas.nixl`.  Import the modules themselves (they pull in torch); this package
imports nothing.
"""
