"""An S3 clear whose credentials may not list (or abort) multipart uploads. Aborting uploads a
killed server left is housekeeping on top of the clear; a clear that deleted every object must not
fail for it (it took the tier down, reported -1, and never announced the deleted objects removed)."""

from __future__ import annotations

import os

from botocore.stub import Stubber

from kvdepot.events import TierCleared, TierRemoved
from kvdepot.storage.l2.contract import TierServices
from kvdepot.storage.l2.s3_adapter import S3Adapter, S3Config

from support.adapter_tasks import EventRecorder, run


def test_an_s3_clear_is_not_failed_by_an_upload_listing_it_may_not_make() -> None:
    sink = EventRecorder()
    cfg = S3Config(bucket="b", prefix="kv/", endpoint_url="http://127.0.0.1:1", access_key_id="AKIAEXAMPLE", secret_access_key="wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY")
    adapter = S3Adapter("s3", cfg, TierServices(sink=sink))
    # Nothing listens at the endpoint: the stubbed client answers the clear, but the tier's own probe
    # (a real request, on its own thread) would find nobody there and take the tier down meanwhile.
    adapter._probe = lambda: None
    adapter.start()
    try:
        key = os.urandom(16)
        name = adapter.object_name(key)
        with Stubber(adapter._client) as stub:
            stub.add_response("list_objects_v2", {"Contents": [{"Key": name, "Size": 10}], "IsTruncated": False})
            stub.add_response("delete_objects", {"Deleted": [{"Key": name}]})
            # A policy without s3:ListBucketMultipartUploads (common: Get/Put/Delete/ListBucket only)
            stub.add_client_error("list_multipart_uploads", service_error_code="AccessDenied", http_status_code=403)
            result = run(adapter, adapter.submit_clear())
        assert result.ok and result.value == 1, result.error
        assert adapter.usage().healthy
        removed = [k for e in sink.events if isinstance(e, TierRemoved) for k in e.keys]
        cleared = [e for e in sink.events if isinstance(e, TierCleared)]
        assert cleared or key in [bytes(k) for k in removed], sink.events
    finally:
        adapter.close()
