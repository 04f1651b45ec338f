"""Data plane: the connector contract and its implementations (inline, NIXL), payload codec and pools.

Import the concrete modules (``stageferry.broker.data.nixl.connector`` pulls in NIXL and torch); this
package itself imports nothing heavy.
"""
