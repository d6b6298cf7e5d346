"""The answer to a clear or a delete whose ``tiers_removed`` has a tier that did not do it (-1: down,
failed, or still at it past the wait): 502, with the same body and a ``detail`` naming those tiers. It
was a 200: a script (``curl -f``) took it as done, and the tier kept what was cleared and served it
again once it answered (after new weights under one model name, the old weights' KV)."""

from __future__ import annotations

from fastapi.responses import JSONResponse


def tiers_answer(result: dict) -> dict | JSONResponse:
    failed = sorted(name for name, n in result.get("tiers_removed", {}).items() if n < 0)
    if not failed:
        return result
    detail = (
        f"L2 tier {', '.join(failed)} did not confirm the removal (down, failed, or still at it past the wait): "
        f"what it holds may stay and be served again; retry once it is up"
    )
    return JSONResponse(result | {"detail": detail}, status_code=502)
