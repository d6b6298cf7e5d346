"""The test harness: real servers, backends and engines, shared by every suite (and the benchmarks)."""
