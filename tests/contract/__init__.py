"""Contract tests: one suite that every L2 adapter (memory, fs, valkey, a valkey cluster, s3) must pass unchanged."""
