"""The wire protocol: typed messages (``messages``) and their framing (``codec``). No sockets here."""
