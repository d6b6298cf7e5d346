"""The peer tier: every node's KV readable from every other node, with no central master (seed 002).

A map of the design: ``ring`` (who owns a key's directory record), ``directory`` (this node's shard),
``pool`` (the host memory remote readers read from), ``dataplane`` and ``auth`` (pages over TCP, only to
holders of the cluster secret), ``discovery`` (embedded multi-master membership), ``node`` (all of it in
one process), ``store`` (``PeerStore``, the public API) and ``adapter`` (the ``peer`` L2 tier).
"""

from kvdepot.peer.config import PeerConfig
from kvdepot.peer.store import PeerStore

__all__ = ["PeerConfig", "PeerStore"]
