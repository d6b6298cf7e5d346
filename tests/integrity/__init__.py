"""The integrity suite: each test reproduces a way kvdepot used to return wrong KV without an error,
crash, or mislead its operator, on real processes (servers, paused and killed workers, a real tmpfs, a
second PID namespace, a real browser) and checks that it no longer can.
"""
