"""The RPC layer both sides share: typed requests over ZeroMQ, one reply per request.

- ``channel``: ``RpcChannel``, the calling side (request ids, deadlines, pipelining, thread-safe) and
  ``Heartbeat``. A ``KVClient`` uses one; so does a node calling another node (the peer tier).
- ``dispatch``: what a served request is (``Call``), what a handler returns (``Reply``) and how it runs
  (``HandlerSpec``: SYNC on the loop thread, BLOCKING on a pool).
- ``server``: ``RpcServer``, the ROUTER loop that receives, decodes, dispatches and answers exactly once;
  it knows nothing of contexts, leases or storage (a kvdepot server and a peer node both run one).
- ``endpoints``: one server per ``ipc://`` path.

It sits above the wire format (``kvdepot.protocol``) and below everything that calls or serves: the
client, the server's capability modules and the peer tier import it; it imports none of them.
"""
