"""Integration tests: a real kvdepot server process over real sockets."""
