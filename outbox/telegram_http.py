"""python-telegram-bot's HTTP layer on aiohttp: the outbox's Bot API requests, cheaper.

python-telegram-bot talks HTTP through a `BaseRequest`; its default, `HTTPXRequest`, costs
several times this class's CPU per request (docs/PERFORMANCE.md). The contract is
python-telegram-bot's: errors come out as `TimedOut` and `NetworkError`, whose cause tells
whether the request can have left (`never_sent`). Kept from `HTTPXRequest`: the pool's size,
the connect, read and pool timeouts, a proxy from the environment (read once per host),
certifi's CA bundle, no cookies. Why: docs/DESIGN.md."""

from __future__ import annotations

import ssl
import urllib.request
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import certifi
import orjson
from telegram.error import NetworkError, TimedOut
from telegram.request import BaseRequest, RequestData


def never_sent(cause: BaseException | None) -> bool:
    """Did the request fail before a byte of it could reach the server? A refused or
    unreachable connection (DNS, TLS, a proxy), or a connect or pool timeout."""
    return isinstance(cause, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError)


def failure_name(cause: BaseException | None) -> str:
    """The failure in the words an operator reads in a message's last error."""
    if isinstance(cause, aiohttp.ConnectionTimeoutError):
        return "ConnectTimeout"
    if isinstance(cause, aiohttp.ClientConnectorError):
        return "ConnectError"
    if isinstance(cause, TimeoutError):
        return "ReadTimeout"
    return type(cause).__name__ if cause is not None else "timeout"


class AiohttpRequest(BaseRequest):
    """A `telegram.request.BaseRequest` on one `aiohttp.ClientSession` (made in `initialize`,
    on the loop that will use it)."""

    def __init__(
        self,
        *,
        connection_pool_size: int,
        connect_timeout: float,
        read_timeout: float | None,
        pool_timeout: float,
    ) -> None:
        self._pool_size = connection_pool_size
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._pool_timeout = pool_timeout
        self._session: aiohttp.ClientSession | None = None
        self._proxies: dict[tuple[str, str], str | None] = {}

    @property
    def read_timeout(self) -> float | None:
        return self._read_timeout

    async def initialize(self) -> None:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._pool_size, ssl=ssl.create_default_context(cafile=certifi.where())
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                # Not trust_env: aiohttp would read the environment (and ~/.netrc) again for
                # every request; `_proxy` reads it once per host.
                skip_auto_headers=("User-Agent",),
            )

    async def shutdown(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def do_request(
        self,
        url: str,
        method: str,
        request_data: RequestData | None = None,
        read_timeout: Any = BaseRequest.DEFAULT_NONE,
        write_timeout: Any = BaseRequest.DEFAULT_NONE,
        connect_timeout: Any = BaseRequest.DEFAULT_NONE,
        pool_timeout: Any = BaseRequest.DEFAULT_NONE,
    ) -> tuple[int, bytes]:
        if self._session is None or self._session.closed:
            raise RuntimeError("This AiohttpRequest is not initialized!")
        read = self._read_timeout if read_timeout is BaseRequest.DEFAULT_NONE else read_timeout
        connect = self._connect_timeout if connect_timeout is BaseRequest.DEFAULT_NONE else connect_timeout
        pool = self._pool_timeout if pool_timeout is BaseRequest.DEFAULT_NONE else pool_timeout
        timeout = aiohttp.ClientTimeout(
            # aiohttp's `connect` covers the wait for a pooled connection and the connecting.
            connect=None if connect is None or pool is None else connect + pool,
            sock_connect=connect,
            sock_read=read,
        )
        body, headers = _body(request_data)
        try:
            async with self._session.request(
                method,
                url,
                data=body,
                headers=headers,
                timeout=timeout,
                proxy=self._proxy(url),
            ) as response:
                return response.status, await response.read()
        except TimeoutError as exc:
            raise TimedOut from exc  # classify() names it (failure_name)
        except aiohttp.ClientError as exc:
            raise NetworkError(f"aiohttp.{type(exc).__name__}: {exc}") from exc

    @staticmethod
    def parse_json_payload(payload: bytes) -> dict[str, Any]:
        """The answer's JSON by orjson (python-telegram-bot's documented hook for another JSON
        library), a third of json's CPU; what orjson refuses (bytes that are not UTF-8, a lone
        surrogate, a number past a double) goes to python-telegram-bot's own parser, whose
        result or "Invalid server response" stands. orjson reads an integer past 64 bits as
        a float: the Bot API's integers fit in 64 bits (its ids in 52)."""
        try:
            return orjson.loads(payload)
        except orjson.JSONDecodeError:
            return BaseRequest.parse_json_payload(payload)

    def _proxy(self, url: str) -> str | None:
        """The proxy from the environment for this URL's host (HTTPS_PROXY, HTTP_PROXY,
        NO_PROXY, as httpx reads them), looked up once per host."""
        parts = urlsplit(url)
        key = (parts.scheme, parts.hostname or "")
        if key not in self._proxies:
            proxies = urllib.request.getproxies()
            bypass = not key[1] or urllib.request.proxy_bypass(key[1])
            self._proxies[key] = None if bypass else proxies.get(key[0])
        return self._proxies[key]


_HEADERS = {"User-Agent": BaseRequest.USER_AGENT}
_JSON_HEADERS = {**_HEADERS, "Content-Type": "application/json"}


def _body(request_data: RequestData | None) -> tuple[aiohttp.FormData | bytes | None, dict[str, str]]:
    """The request's body as python-telegram-bot encodes it: its JSON payload (an object of
    the parameters' JSON values, which the Bot API reads as it reads the same form fields), and a
    multipart form when it uploads files. Not the form: urlencoding quotes the text byte by byte
    in Python."""
    if request_data is None:
        return None, _HEADERS
    if not request_data.contains_files:
        return request_data.json_payload, _JSON_HEADERS
    files = request_data.multipart_data
    form = aiohttp.FormData(request_data.json_parameters)
    for name, part in files.items():
        # (filename, content, mimetype), or bare content.
        if isinstance(part, tuple):
            filename, content, *rest = part
            form.add_field(name, content, filename=filename, content_type=rest[0] if rest else None)
        else:
            form.add_field(name, part)
    return form, _HEADERS
