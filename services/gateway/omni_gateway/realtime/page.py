"""`GET /talk`: a page to talk to the served model (talk.html), in any browser, with barge-in.

The page carries no data and a browser cannot send a key when it opens a page, so it is open
like /health; the socket it opens takes the key the person types in (as a subprotocol).
"""

from __future__ import annotations

from importlib.resources import files
from typing import Final

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

PAGE_PATH: Final = "/talk"

router = APIRouter()


@router.get(PAGE_PATH, response_class=HTMLResponse, include_in_schema=False)
async def talk() -> HTMLResponse:
    return HTMLResponse(files("omni_gateway.realtime").joinpath("talk.html").read_text())
