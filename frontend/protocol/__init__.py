"""The client protocol, version 1 (``docs/PROTOCOL.md``): ``wire`` (the contract's constants, limits,
requests and wire types, shared with the clients), ``parse`` (the server's validation) and ``encode``
(both directions' frames)."""
