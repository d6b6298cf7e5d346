"""Contract tests: one suite that every L2 adapter (memory, fs, valkey, s3) must pass unchanged."""
