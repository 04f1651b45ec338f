"""Data plane: the connector contract and its implementations (inline, NIXL), payload codec and pools.

- ``connector`` — the :class:`~stageferry.broker.data.connector_contract.Connector` contract; ``connectors``
  picks a stage's connectors from the pipeline file; ``inline`` — payload bytes in the stream entry;
- ``payload_plan`` / ``payload_validation`` / ``payload_codec`` — manifest planning, the checks run
  before any native call, and packing/unpacking (the codec re-exports the other two's public names);
- ``pool`` — registered pools and back-pressure; ``metrics`` — the Prometheus series;
- ``nixl/`` — the NIXL connector, one concept per module (see :mod:`stageferry.broker.data.nixl`).

Import the concrete modules (``stageferry.broker.data.nixl.connector`` pulls in NIXL and torch); this
package itself imports nothing heavy.
"""
