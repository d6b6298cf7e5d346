"""The engine side: ``KVClient`` and how it reaches the server's arena."""
