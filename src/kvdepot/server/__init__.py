"""The kvdepot server: ROUTER loop (rpc), capability modules, and the composition root (main)."""
