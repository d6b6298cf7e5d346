"""`kvdepot server` arguments: the flags are generated from the config structs, their defaults are the
structs' defaults, and a bad value raises ValueError (ConfigError) naming the flag, on the command line
and in code alike."""

from __future__ import annotations

import importlib.util
import re

import msgspec
import pytest

from kvdepot.cli import build_parser
from kvdepot.config import (
    ConfigError,
    ConfigStruct,
    EvictionPolicyName,
    GiB,
    HttpConfig,
    Placement,
    RpcConfig,
    ServerConfig,
    StorageConfig,
    server_from_args,
)
from kvdepot.hashing import HashAlgorithm
from kvdepot.limits import MAX_FRAME_BYTES
from kvdepot.storage.eviction import POLICIES, make_policy
from kvdepot.storage.l2.registry import adapter_types


def parse(*argv: str):
    return build_parser().parse_args(["server", *argv])


def test_server_defaults_equal_the_dataclass_defaults():
    config = server_from_args(parse())
    assert config == ServerConfig()
    assert config.rpc == RpcConfig()
    assert config.storage == StorageConfig()
    assert config.http == HttpConfig()
    assert config.rpc.max_frame_bytes == MAX_FRAME_BYTES
    assert config.storage.l1_size_bytes == 2 * GiB


def test_every_flag_reaches_its_field():
    config = server_from_args(
        parse(
            "--host", "0.0.0.0", "--port", "6000", "--ipc-path", "/tmp/kv.sock", "--workers", "2",
            "--max-frame-mib", "4", "--heartbeat-interval-s", "0.5", "--client-timeout-s", "3",
            "--l1-size-gb", "0.5", "--chunk-size", "64", "--hash-algorithm", "blake3",
            "--eviction-policy", "noop", "--high-watermark", "0.9", "--low-watermark", "0.5",
            "--lease-ttl-s", "30", "--no-prefault", "--shm-dir", "/tmp",
            "--http-host", "127.0.0.2", "--http-port", "0", "--log-level", "debug", "--insecure",
        )
    )
    assert config == ServerConfig(
        rpc=RpcConfig(host="0.0.0.0", port=6000, ipc_path="/tmp/kv.sock", workers=2, max_frame_mib=4,
                      heartbeat_interval_s=0.5, client_timeout_s=3.0),
        storage=StorageConfig(l1_size_gb=0.5, chunk_size=64, hash_algorithm="blake3", eviction_policy="noop",
                              high_watermark=0.9, low_watermark=0.5, lease_ttl_s=30.0, prefault=False, shm_dir="/tmp"),
        http=HttpConfig(host="127.0.0.2", port=0),
        log_level="debug",
        insecure=True,
    )
    assert config.storage.l1_size_bytes == GiB // 2
    assert config.rpc.max_frame_bytes == 4 << 20
    assert config.rpc.endpoints == ["tcp://0.0.0.0:6000", "ipc:///tmp/kv.sock"]


def test_repeatable_and_list_flags():
    config = server_from_args(
        parse("--l2", "memory:size_gb=1", "--l2", "fs:path=/x", "--l1-over-memory", "--http-allowed-hosts", "a.example, b", "--l2-placement", "skip_l1")
    )
    assert config.storage.l2 == ("memory:size_gb=1", "fs:path=/x")
    assert config.storage.l1_over_memory and config.storage.l2_placement is Placement.SKIP_L1
    assert config.http.allowed_hosts == ("a.example", "b")


def cli_choices(flag: str) -> list[str]:
    [action] = [a for a in build_parser()._subparsers._group_actions[0].choices["server"]._actions if flag in a.option_strings]
    return list(action.choices)


@pytest.mark.parametrize(
    "flag, enum",
    [("--eviction-policy", EvictionPolicyName), ("--hash-algorithm", HashAlgorithm), ("--l2-placement", Placement)],
)
def test_the_cli_choices_are_the_enum(flag, enum):
    # one source: the enum types the field, and the flag's choices are derived from it
    assert cli_choices(flag) == [m.value for m in enum]


def test_every_eviction_policy_name_has_its_policy():
    assert set(POLICIES) == set(EvictionPolicyName)
    for name in EvictionPolicyName:
        assert make_policy(name.value).name is name


def test_a_plain_string_in_code_becomes_the_member():
    config = StorageConfig(eviction_policy="noop", hash_algorithm="blake3", l2_placement="skip_l1", l2=("memory:size_gb=1",))
    assert config.eviction_policy is EvictionPolicyName.NOOP
    assert config.hash_algorithm is HashAlgorithm.BLAKE3
    assert config.l2_placement is Placement.SKIP_L1
    assert config == StorageConfig(eviction_policy=EvictionPolicyName.NOOP, hash_algorithm=HashAlgorithm.BLAKE3, l2_placement=Placement.SKIP_L1,
                                   l2=("memory:size_gb=1",))


@pytest.mark.parametrize("kind", sorted(adapter_types()))
def test_every_tier_config_is_a_config_struct_with_help_for_each_key(kind):
    config = adapter_types()[kind].config
    assert issubclass(config, ConfigStruct) and config._flag_prefix is None  # errors name the key, not a flag
    for f in msgspec.inspect.type_info(config).fields:
        assert isinstance(f.type, msgspec.inspect.Metadata) and f.type.extra_json_schema.get("description"), f"{kind}: {f.name} has no help"


@pytest.mark.parametrize(
    "make, flag",
    [
        (lambda: StorageConfig(chunk_size=0), "--chunk-size"),
        (lambda: StorageConfig(l1_size_gb=float("nan")), "--l1-size-gb"),
        (lambda: StorageConfig(eviction_policy="fifo"), "--eviction-policy"),
        (lambda: StorageConfig(l2_placement="nowhere"), "--l2-placement"),
        (lambda: StorageConfig(l2_placement="skip_l1"), "--l2-placement"),  # with no tier, it means nothing
        (lambda: StorageConfig(low_watermark=0.9, high_watermark=0.5), "--low-watermark"),
        (lambda: RpcConfig(workers=True), "--workers"),
        (lambda: RpcConfig(port=0), "--port"),
        (lambda: HttpConfig(port=-1), "--http-port"),
    ],
)
def test_a_config_built_in_code_is_checked_too(make, flag):
    with pytest.raises(ConfigError, match=flag):
        make()


def test_http_host_defaults_to_the_rpc_host():
    assert server_from_args(parse("--host", "10.0.0.1", "--insecure")).http.host == "10.0.0.1"


def test_port_zero_with_ipc_only_has_one_endpoint():
    config = server_from_args(parse("--port", "0", "--ipc-path", "/tmp/kv.sock"))
    assert config.rpc.endpoints == ["ipc:///tmp/kv.sock"]


def test_default_endpoints():
    assert RpcConfig().endpoints == ["tcp://127.0.0.1:5555"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--l1-size-gb", "0"],
        ["--l1-size-gb", "-1"],
        ["--chunk-size", "0"],
        ["--chunk-size", "-256"],
        ["--chunk-size", "5000000"],  # every client would be refused: refuse at start
        ["--l1-size-gb", "0.000001"],  # no chunk fits
        ["--low-watermark", "0.9", "--high-watermark", "0.8"],
        ["--low-watermark", "0"],
        ["--high-watermark", "1.5"],
        ["--lease-ttl-s", "0"],
        ["--lease-ttl-s", "-5"],
        ["--port", "0"],
        ["--workers", "0"],
        ["--max-frame-mib", "0"],
        ["--max-frame-mib", "257"],
    ],
    ids=lambda a: " ".join(a),
)
def test_invalid_values_raise_value_error(argv):
    args = parse(*argv)
    with pytest.raises(ValueError):
        server_from_args(args)


@pytest.mark.parametrize(
    "argv",
    [["--heartbeat-interval-s", "-1"], ["--client-timeout-s", "0"], ["--port", "-1"], ["--http-port", "70000"]],
    ids=lambda a: " ".join(a),
)
def test_unchecked_values_raise_value_error(argv):
    with pytest.raises(ValueError):
        server_from_args(parse(*argv))


@pytest.mark.parametrize(
    "argv",
    [["--hash-algorithm", "md5"], ["--eviction-policy", "fifo"], ["--log-level", "trace"], ["--port", "abc"]],
    ids=lambda a: " ".join(a),
)
def test_choices_and_types_are_enforced_by_the_parser(argv):
    with pytest.raises(SystemExit):
        parse(*argv)


def test_server_command_rejects_bad_config_with_exit_code_2(capsys):
    args = parse("--chunk-size", "0")
    assert args.func(args) == 2
    assert "kvdepot server: --chunk-size 0 is outside [1, 65536]" in capsys.readouterr().err


def test_configs_are_frozen():
    with pytest.raises(AttributeError):
        StorageConfig().chunk_size = 1  # type: ignore[misc]


def test_every_subcommand_module_exists():
    # cmd_demo imports its workloads lazily: a missing module would only show when a user runs it
    assert importlib.util.find_spec("kvdepot.bench.synthetic_demo") is not None
    assert importlib.util.find_spec("kvdepot.bench.engine_demo") is not None
    assert importlib.util.find_spec("kvdepot.server.main") is not None
    args = build_parser().parse_args(["demo"])
    assert (args.command, args.port, args.l1_size_gb) == ("demo", 0, 1.0)


# --- security off loopback ---------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_needs_no_authentication(host):
    assert server_from_args(parse("--host", host)).rpc.host == host


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "kv.example"])
def test_off_loopback_the_zeromq_port_needs_curve_or_insecure(host, monkeypatch):
    monkeypatch.delenv("KVDEPOT_ADMIN_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=r"is not loopback .*--curve-server-key and --curve-clients.*--insecure"):
        server_from_args(parse("--host", host, "--http-port", "0"))
    curve = ("--curve-server-key", "/k/server.key_secret", "--curve-clients", "/k/clients")
    config = server_from_args(parse("--host", host, "--http-port", "0", *curve))
    assert config.rpc.curve and config.rpc.curve_server_key == "/k/server.key_secret" and config.rpc.curve_clients == "/k/clients"
    with pytest.raises(ConfigError, match="--admin-token"):
        server_from_args(parse("--host", host, *curve))  # the HTTP port follows --host off loopback
    assert server_from_args(parse("--host", host, *curve, "--http-host", "127.0.0.1")).http.admin_token == ""
    assert server_from_args(parse("--host", host, "--insecure")).insecure


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://10.1.2.3:5557", "tcp://kv.example:5557"])
@pytest.mark.parametrize("flag", ["--kv-events-endpoint", "--kv-events-replay-endpoint"])
def test_off_loopback_the_kv_event_sockets_need_insecure(flag, endpoint):
    """They name every chunk hash and tenant's cache_salt and have no authentication: the same rule as
    the RPC and HTTP ports (they used to bind anywhere without a word)."""
    local = ("--kv-events-endpoint", "tcp://127.0.0.1:5556")  # not 5557: one port for both sockets is refused
    args = (flag, endpoint) if flag == "--kv-events-endpoint" else (*local, flag, endpoint)
    with pytest.raises(ConfigError, match=rf"{re.escape(flag)} {re.escape(endpoint)} is not loopback .*--insecure"):
        server_from_args(parse(*args))
    assert server_from_args(parse(*args, "--insecure")).insecure
    for here in ("tcp://127.0.0.1:5558", "tcp://localhost:5558", "ipc:///tmp/kv-events"):
        server_from_args(parse(*local, "--kv-events-replay-endpoint", here))


@pytest.mark.parametrize(
    ("publish", "replay"),
    [("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557"), ("tcp://*:5557", "tcp://127.0.0.1:5557"), ("tcp://localhost:5557", "tcp://127.0.0.1:5557")],
)
def test_the_two_kv_event_sockets_on_one_port_are_refused_naming_both_flags(publish, replay):
    """They passed the check and the second bind failed at start; the server's other ports on one number
    were already refused here."""
    args = ("--kv-events-endpoint", publish, "--kv-events-replay-endpoint", replay, "--insecure")
    with pytest.raises(ConfigError, match="--kv-events-endpoint and --kv-events-replay-endpoint are both port 5557"):
        server_from_args(parse(*args))


def test_kv_event_sockets_that_cannot_clash_are_accepted():
    """Two ports, two addresses, or a PUB socket that connects (it listens on nothing)."""
    for publish, replay in (("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"), ("tcp://127.0.0.1:5557", "tcp://127.0.0.2:5557"),
                            ("tcp://127.0.0.1:5557", "ipc:///tmp/kv-events-replay"), ("ipc:///tmp/kv-events", "tcp://127.0.0.1:5557")):  # fmt: skip
        server_from_args(parse("--kv-events-endpoint", publish, "--kv-events-replay-endpoint", replay))
    connected = server_from_args(parse("--kv-events-endpoint", "tcp://127.0.0.1:5557", "--kv-events-connect",
                                       "--kv-events-replay-endpoint", "tcp://127.0.0.1:5557"))  # fmt: skip
    assert connected.observability.kv_events_connect


@pytest.mark.parametrize("flag", ["--kv-events-endpoint", "--kv-events-replay-endpoint"])
@pytest.mark.parametrize("connect", [False, True])
def test_a_kv_event_port_out_of_range_is_refused_naming_the_flag(flag, connect):
    """ZeroMQ takes a port above 65535 modulo 65536: tcp://127.0.0.1:99999 was bound (or connected to) on
    port 34463 without a word, where no router looks, and the own-ports check compared 99999."""
    local = ("--kv-events-endpoint", "tcp://127.0.0.1:5556")
    args = (flag, "tcp://127.0.0.1:99999") if flag == "--kv-events-endpoint" else (*local, flag, "tcp://127.0.0.1:99999")
    with pytest.raises(ConfigError, match=rf"{re.escape(flag)} tcp://127.0.0.1:99999: the port must be a number up to 65535"):
        server_from_args(parse(*args, *(["--kv-events-connect"] if connect else [])))
    for fine in ("tcp://127.0.0.1:65535", "tcp://127.0.0.1:*", "ipc:///tmp/kv-events-99999"):
        server_from_args(parse(*local, "--kv-events-replay-endpoint", fine))


@pytest.mark.parametrize("endpoint", ["http://10.0.0.9:4318/v1/traces", "http://collector:4318/v1/traces"])
def test_spans_go_off_this_machine_in_clear_text_only_with_insecure(endpoint):
    """Every span names its request's cache_salt: an http:// collector elsewhere used to be accepted
    without a word, where the KV-event sockets, which carry the same salts, were refused."""
    with pytest.raises(ConfigError, match=rf"--otlp-endpoint {re.escape(endpoint)} sends .* clear text .*--insecure"):
        server_from_args(parse("--otlp-endpoint", endpoint))
    assert server_from_args(parse("--otlp-endpoint", endpoint, "--insecure")).insecure
    for fine in ("https://collector:4318/v1/traces", "http://127.0.0.1:4318/v1/traces", "http://localhost:4318/v1/traces"):
        assert server_from_args(parse("--otlp-endpoint", fine)).observability.otlp_endpoint == fine


def test_a_lookup_log_keeps_at_least_one_backup():
    """With none, the standard rotation reopens the same file and it grows past --lookup-log-max-mb."""
    with pytest.raises((ConfigError, SystemExit, ValueError)):
        server_from_args(parse("--lookup-log", "/tmp/ll.log", "--lookup-log-backups", "0"))
    assert server_from_args(parse("--lookup-log", "/tmp/ll.log", "--lookup-log-backups", "1")).observability.lookup_log_backups == 1


def test_a_replay_endpoint_without_the_event_stream_is_refused():
    """It replays what --kv-events-endpoint publishes: alone it used to be accepted and bind nothing."""
    with pytest.raises(ConfigError, match="--kv-events-replay-endpoint replays what --kv-events-endpoint publishes"):
        server_from_args(parse("--kv-events-replay-endpoint", "tcp://127.0.0.1:5558"))


def test_curve_needs_both_flags():
    with pytest.raises(ConfigError, match="both --curve-server-key and --curve-clients"):
        server_from_args(parse("--curve-server-key", "/k/server.key_secret"))
    with pytest.raises(ConfigError, match="both --curve-server-key and --curve-clients"):
        RpcConfig(curve_clients="/k/clients")


def test_the_admin_token_comes_from_the_flag_or_the_environment_and_is_never_shown(monkeypatch):
    monkeypatch.setenv("KVDEPOT_ADMIN_TOKEN", "from-env")
    config = server_from_args(parse("--host", "0.0.0.0", "--port", "0", "--ipc-path", "/tmp/kv.sock"))
    assert config.http.admin_token == "from-env" and config.http.host == "0.0.0.0"
    config = server_from_args(parse("--http-host", "0.0.0.0", "--admin-token", "from-flag"))
    assert config.http.admin_token == "from-flag"  # the flag wins
    for shown in (repr(config), repr(config.http), str(config)):
        assert "from-flag" not in shown and "admin_token=<set>" in shown


def test_kv_events_connect_needs_an_address_to_connect_to():
    from kvdepot.config import ObservabilityConfig

    with pytest.raises(ConfigError, match="--kv-events-connect connects to --kv-events-endpoint"):
        ObservabilityConfig(kv_events_connect=True)
    with pytest.raises(ConfigError, match="every interface"):
        ObservabilityConfig(kv_events_endpoint="tcp://*:5557", kv_events_connect=True)
    assert ObservabilityConfig(kv_events_endpoint="tcp://indexer:5557", kv_events_connect=True).kv_events_connect


@pytest.mark.parametrize("endpoint", ["http://kv:s3cr3t-token@collector.example:4318/v1/traces", "grpc://kv:s3cr3t-token@collector.example:4317"])
def test_config_errors_withhold_the_otlp_endpoints_password(endpoint):
    """An OTLP/HTTP endpoint may carry credentials (sent as basic auth): the errors printed it whole."""
    from kvdepot.config import ObservabilityConfig

    with pytest.raises(ConfigError) as err:
        ServerConfig(observability=ObservabilityConfig(otlp_endpoint=endpoint))
    assert "s3cr3t-token" not in str(err.value)


def test_status_with_a_port_out_of_range_is_a_message_not_a_traceback(capsys):
    from kvdepot.cli import main

    assert main(["status", "--url", "http://127.0.0.1:99999"]) == 1
    assert "kvdepot status:" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["0", "-1", "nan"])
def test_status_with_a_timeout_that_is_no_timeout_is_a_usage_error_not_a_traceback(timeout, capsys):
    """``kvdepot status --timeout-s -1`` ended in a ValueError traceback ("Timeout value out of range"
    from the socket module), and ``0`` in "cannot connect: Operation now in progress"."""
    from kvdepot.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["status", "--timeout-s", timeout, "--http-port", "1"])
    assert exit_.value.code == 2
    assert "--timeout-s" in capsys.readouterr().err


@pytest.mark.parametrize(
    "spec",
    [
        "fs:path=/data/kv,size_gb=100,fsync=false,size_gb=1",  # a flag appended to a long spec, or a copy-paste
        "fs:path=/data/kv, path=/data/other",
        '{"type": "fs", "path": "/data/kv", "size_gb": 100, "size_gb": 1}',
        '{"type": "fs", "type": "memory", "path": "/data/kv"}',
    ],
)
def test_a_key_given_twice_in_a_tier_spec_is_refused_naming_it(spec):
    """The last one won without a word: a 100 GiB tier became a 1 GiB one."""
    from kvdepot.storage.l2.registry import parse_spec

    with pytest.raises(ConfigError, match=r"--l2 .*: '(size_gb|path|type)' is given twice"):
        parse_spec(spec)
