"""A misconfigured ``--l2`` tier is one clear error at start, and the error never prints the credentials
the spec carries (an S3 secret key, a Valkey password, a peer tier's cluster secret): start-up errors go
to terminals, CI logs and log collectors."""

from __future__ import annotations

import pytest

from kvdepot.errors import ConfigError
from kvdepot.redact import WITHHELD, mask_tier_spec, mask_url
from kvdepot.storage.l2.registry import parse_spec
from kvdepot.storage.l2.valkey_adapter import ValkeyAdapter, ValkeyConfig

SECRET = "TOPSECRETPW"


@pytest.mark.parametrize(
    "spec",
    [
        f"valkey:url=redis://:{SECRET}@127.0.0.1:6379/0,pool_sise=4",  # a typo in another key
        f"valkey:url=http://:{SECRET}@127.0.0.1:6379/0",  # a scheme the tier does not take
        f"valkey:url=redis://127.0.0.1:6379/0?password={SECRET},pool_size=0",
        f"s3:bucket=b,endpoint_url=http://127.0.0.1:9000,access_key_id=AK,secret_access_key={SECRET},regoin=x",
        f"s3:bucket=b,secret_access_key=ab,{SECRET}",  # a secret with a comma: its tail is an item of its own
        f"nosuchtier:secret={SECRET}",
        f'{{"type": "valkey", "url": "redis://:{SECRET}@h:6379/0", "pool_size": "many"}}',
        f'{{"url": "redis://:{SECRET}@h:6379/0"}}',  # no type
        f'{{"type": "s3", "secret_access_key": "{SECRET}",',  # not JSON
    ],
)
def test_a_bad_tier_spec_is_named_without_its_secrets(spec):
    with pytest.raises(ConfigError) as err:
        parse_spec(spec)
    assert SECRET not in str(err.value)
    assert "--l2" in str(err.value)


def test_the_masks_keep_what_is_not_secret():
    assert mask_url(f"redis://user:{SECRET}@h:6379/0") == f"redis://user:{WITHHELD}@h:6379/0"
    assert mask_url("redis://h:6379/0") == "redis://h:6379/0"
    masked = mask_tier_spec(f"s3:bucket=b,endpoint_url=http://h:9000,secret_access_key={SECRET},region=eu")
    assert masked == f"s3:bucket=b,endpoint_url=http://h:9000,secret_access_key={WITHHELD},region=eu"


def test_a_valkey_tier_shows_its_url_without_the_password():
    adapter = ValkeyAdapter("v", ValkeyConfig(url=f"redis://:{SECRET}@127.0.0.1:6379/0"))
    assert SECRET not in repr(adapter) and "127.0.0.1:6379" in repr(adapter)
