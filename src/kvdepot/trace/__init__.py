"""Traces: record what a server does (``recorder``), read recorded and Mooncake-format traces
(``reader``), size L1 from one with an LRU simulation (``simulate``, ``plan``), and replay one
against a running server (``replay``)."""
