"""Engine harnesses for the e2e tests, the benchmarks and the demo: a random-weight Llama made on the spot
(``vllm_engines.make_tiny_model``), a vLLM engine in its own process (``engine_worker``, run with
``python -m kvdepot.bench.engines.engine_worker``), vLLM's OpenAI server and SGLang servers
(``sglang_engines``). Nothing here imports vLLM, SGLang or torch at import time.

(The modules are not called ``vllm.py`` / ``sglang.py``: a script run by path gets its own directory
first on ``sys.path``, and such names would shadow the engines.)
"""
