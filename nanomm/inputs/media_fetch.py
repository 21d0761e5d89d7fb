"""http(s) pictures and videos, fetched behind an allowlist of hosts: a URL in a request becomes the bytes that a
data URL would have carried (lessons/01-preprocessing.md, section 5, "Bad input fails early, with a name").

A URL makes the server a client of whatever host the request names, so every defence is the fetcher's:
  - The host must be listed (`MediaUrlPolicy.allowed_domains`: `nanomm-serve --allowed-media-domains`,
    `LLM(allowed_media_domains=[...])`); exact, case-insensitive; "*.example.com" lists every subdomain of
    example.com, not example.com itself. None is listed by default: every URL is refused.
  - The name is resolved once (`policy.resolver`, injectable). A loopback, private, link-local, shared, reserved,
    unspecified or multicast address is refused there unless `allow_private_addresses`; a cloud metadata address
    (169.254.169.254, fd00:ec2::254) always. The connection goes to the address that was checked, with the name in
    the Host header and in TLS (SNI and the certificate check): no second lookup for a rebinding DNS to answer.
  - Redirects are refused unless `allow_redirects`; a redirect to a host off the list is refused either way, and
    each hop is checked as the first (at most MAX_REDIRECTS).
  - One deadline for the whole fetch, redirects included (5 s a picture, 30 s a video by default): a timer shuts
    the socket, so a server that trickles a byte at a time cannot stretch it.
  - A byte cap, checked against Content-Length before the body, and again while reading (a chunked body).
  - The Content-Type: image/* for a picture; video/* or image/* for a video (an animated GIF is a video too).
    application/octet-stream and anything else is refused: the server must say it sends a picture.
  - Every failure is an InvalidInputError naming the part, the URL (cut short) and the reason.

Standard library only (http.client, socket, ssl): the offline LLM fetches with the same code, on a few threads
(`fetch_prompt_media`); the server runs the same threads off its event loop (`fetch_prompt_media_async`) and stops
them when its client goes away.
"""

from __future__ import annotations

import asyncio
import http.client
import ipaddress
import math
import socket
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Callable
from urllib.parse import urljoin, urlsplit

from nanomm.errors import InvalidInputError

MAX_REDIRECTS = 5
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
READ_SIZE = 64 * 1024
METADATA_ADDRESSES = (ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254"))
FLAG_HINT = "--allowed-media-domains (LLM(allowed_media_domains=[...]) offline)"


def system_resolver(host: str, port: int) -> list[str]:
    """Every address the system's resolver gives for host (the default `MediaUrlPolicy.resolver`)."""
    return [info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


@dataclass(frozen=True)
class MediaUrlPolicy:
    """Which http(s) URLs a request may name, and how they are fetched."""
    allowed_domains: tuple[str, ...] = ()  # host names (or "*.example.com"); empty: every URL is refused
    allow_redirects: bool = False  # follow a redirect (its host must be listed too)
    allow_private_addresses: bool = False  # loopback and private networks (a test's 127.0.0.1); never metadata
    image_timeout_s: float = 5.0  # the whole fetch of a picture, redirects included
    video_timeout_s: float = 30.0
    max_image_bytes: int = 32 * 2**20
    max_video_bytes: int = 256 * 2**20  # load_video's own cap (VideoLimits.max_bytes)
    resolver: Callable[[str, int], list[str]] = system_resolver  # (host, port) -> addresses

    def __post_init__(self):
        domains = self.allowed_domains
        if isinstance(domains, str) or not all(isinstance(d, str) and _is_host_pattern(d) for d in domains):
            raise ValueError("allowed_media_domains must be a list of host names (e.g. ['images.example.com', "
                             f"'*.cdn.example.com']), got {domains!r}")
        object.__setattr__(self, "allowed_domains", tuple(d.lower().strip("[]").rstrip(".") for d in domains))
        for name in ("allow_redirects", "allow_private_addresses"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"media URLs: {name} must be True or False, got {getattr(self, name)!r}")
        for name in ("image_timeout_s", "video_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"media URLs: {name} must be a number of seconds > 0, got {value!r}")
        for name in ("max_image_bytes", "max_video_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"media URLs: {name} must be an integer > 0, got {value!r}")
        if not callable(self.resolver):
            raise ValueError(f"media URLs: resolver must be callable (host, port) -> addresses, got {self.resolver!r}")

    @classmethod
    def of(cls, value) -> "MediaUrlPolicy | None":
        """None, a MediaUrlPolicy, or a dict of its fields (an engine argument)."""
        if value is None or isinstance(value, cls):
            return value
        known = {f.name for f in fields(cls)}
        if not isinstance(value, dict) or set(value) - known:
            raise ValueError(f"media_url_policy must be a MediaUrlPolicy or a dict of {sorted(known)}, got {value!r}")
        return cls(**value)

    def allows_host(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == d or (d.startswith("*.") and host.endswith(d[1:])) for d in self.allowed_domains)

    def limits(self, kind: str) -> tuple[float, int]:
        """(timeout_s, max_bytes) of an "image" or a "video"."""
        if kind == "video":
            return self.video_timeout_s, self.max_video_bytes
        return self.image_timeout_s, self.max_image_bytes


def _is_host_pattern(text: str) -> bool:
    name = text.removeprefix("*.")
    return bool(name) and not any(c in name for c in "/:@?#* ") or _is_ip_literal(text)


def _is_ip_literal(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]"))
        return True
    except ValueError:
        return False


def is_remote(source) -> bool:
    return isinstance(source, str) and source.lower().startswith(("http://", "https://"))


# -- one URL ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Target:
    url: str
    https: bool
    host: str
    port: int
    path: str  # with the query


def check_media_url(url: str, policy: MediaUrlPolicy | None, name: str) -> _Target:
    """The URL's parts, if its host is listed; an InvalidInputError naming the host and the flag otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidInputError(f"{name}: {_short(url)} is not a valid URL ({exc})") from None
    host = (parts.hostname or "").rstrip(".")
    if parts.scheme.lower() not in ("http", "https") or not host:
        raise InvalidInputError(f"{name}: {_short(url)} is not an http(s) URL with a host")
    if parts.username is not None or parts.password is not None:
        raise InvalidInputError(f"{name}: {_short(url)} carries credentials; they are refused")
    if policy is None or not policy.allowed_domains:
        raise InvalidInputError(f"{name}: URLs are not fetched unless their host is allowed; to fetch "
                                f"{_short(url)}, list {host!r} with {FLAG_HINT}, or send the bytes as a data URL")
    if not policy.allows_host(host):
        raise InvalidInputError(f"{name}: the host {host!r} of {_short(url)} is not an allowed media domain: "
                                f"list it with {FLAG_HINT}, or send the bytes as a data URL")
    https = parts.scheme.lower() == "https"
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Target(url, https, host, port or (443 if https else 80), path)


def fetch_url(url: str, kind: str, policy: MediaUrlPolicy | None, name: str | None = None,
              stopper: "_Stopper | None" = None) -> bytes:
    """The body of an "image" or "video" URL, with every defence of the module docstring. Blocking."""
    name = name or kind
    target = check_media_url(url, policy, name)
    timeout_s, max_bytes = policy.limits(kind)
    stopper = stopper or _Stopper()
    stopper.arm(timeout_s)  # the socket's own timeout (each connect and read) is the same, a second guard
    try:
        for _ in range(MAX_REDIRECTS + 1):
            body, location = _fetch_once(target, kind, policy, stopper, max_bytes, name)
            if stopper.why is not None:  # a socket shut mid-body reads as its end: never a truncated body
                raise TimeoutError(f"the fetch was stopped ({stopper.why})")
            if location is None:
                return body
            target = _redirect_target(target, location, policy, name)
        raise InvalidInputError(f"{name}: {_short(url)} redirects more than {MAX_REDIRECTS} times")
    except (OSError, http.client.HTTPException) as exc:
        if stopper.why == "timeout":
            raise InvalidInputError(f"{name}: fetching {_short(url)} took longer than {timeout_s} s") from None
        if stopper.why == "cancelled":
            raise FetchCancelled(url) from None
        raise InvalidInputError(f"{name}: {_short(url)} cannot be fetched ({type(exc).__name__}: {exc})") from None
    finally:
        stopper.disarm()


class FetchCancelled(Exception):
    """A fetch stopped because its request went away (nobody reads this error)."""


def _redirect_target(current: _Target, location: str | None, policy: MediaUrlPolicy, name: str) -> _Target:
    if not location:
        raise InvalidInputError(f"{name}: {_short(current.url)} redirects without a Location")
    url = urljoin(current.url, location)
    host = urlsplit(url).hostname or ""
    if not policy.allows_host(host):
        raise InvalidInputError(f"{name}: {_short(current.url)} redirects to {_short(url)}, whose host {host!r} "
                                f"is not an allowed media domain ({FLAG_HINT})")
    if not policy.allow_redirects:
        raise InvalidInputError(f"{name}: {_short(current.url)} redirects to {_short(url)}; redirects are not "
                                "followed unless allowed (--media-url-allow-redirects)")
    return check_media_url(url, policy, name)


def _fetch_once(target: _Target, kind: str, policy: MediaUrlPolicy, stopper: "_Stopper", max_bytes: int,
                name: str) -> tuple[bytes, str | None]:
    """(the body, None), or (b"", the Location) of a redirect."""
    address = _checked_address(target, policy, name)
    connection_type = _PinnedHTTPSConnection if target.https else _PinnedHTTPConnection
    connection = connection_type(target.host, target.port, address, stopper)
    try:
        connection.request("GET", target.path, headers={
            "Accept": f"{kind}/*" if kind == "image" else "video/*, image/*", "Accept-Encoding": "identity",
            "User-Agent": "nanomm"})
        response = connection.getresponse()
        if response.status in REDIRECT_STATUSES:
            return b"", response.getheader("Location")
        if response.status != 200:
            raise InvalidInputError(f"{name}: {_short(target.url)} answered {response.status} {response.reason}")
        _check_content_type(response.getheader("Content-Type"), kind, target, name)
        return _read_capped(response, max_bytes, target, name), None
    finally:
        connection.close()


def _checked_address(target: _Target, policy: MediaUrlPolicy, name: str) -> str:
    """The one address the fetch connects to: the resolver's first, after every address was checked."""
    try:
        addresses = list(policy.resolver(target.host, target.port))
    except (OSError, UnicodeError) as exc:
        raise InvalidInputError(f"{name}: the host {target.host!r} of {_short(target.url)} does not resolve "
                                f"({exc})") from None
    if not addresses:
        raise InvalidInputError(f"{name}: the host {target.host!r} of {_short(target.url)} resolves to nothing")
    for address in addresses:  # every one: a name with one public and one private address is refused
        reason = _forbidden_address(address, policy.allow_private_addresses)
        if reason:
            raise InvalidInputError(f"{name}: the host {target.host!r} of {_short(target.url)} resolves to "
                                    f"{address}, {reason}; refused (--allow-private-media-addresses lets "
                                    "private ones through)")
    return addresses[0]


def _forbidden_address(address: str, allow_private: bool) -> str | None:
    """Why the fetch may not connect to this address, or None."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])  # an IPv6 zone id ("fe80::1%eth0") is not an address
    except ValueError:
        return "not an IP address"
    if ip.version == 6 and ip.ipv4_mapped is not None:  # ::ffff:10.0.0.5 is 10.0.0.5
        ip = ip.ipv4_mapped
    if ip in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if allow_private:
        return None
    for label, flag in (("a loopback address", ip.is_loopback), ("a link-local address", ip.is_link_local),
                        ("a multicast address", ip.is_multicast), ("an unspecified address", ip.is_unspecified),
                        ("a reserved address", ip.is_reserved), ("a private address", ip.is_private),
                        ("not a public address", not ip.is_global)):
        if flag:
            return label
    return None


def _check_content_type(header: str | None, kind: str, target: _Target, name: str) -> None:
    media_type = (header or "").split(";")[0].strip().lower()
    if media_type.startswith("image/") or (kind == "video" and media_type.startswith("video/")):
        return
    expected = "image/*" if kind == "image" else "video/* or image/*"
    what = "an image" if kind == "image" else "a video"
    raise InvalidInputError(f"{name}: {_short(target.url)} has Content-Type {media_type or 'none'!r}, not "
                            f"{what} ({expected})")


def _read_capped(response: http.client.HTTPResponse, max_bytes: int, target: _Target, name: str) -> bytes:
    too_big = f"{name}: {_short(target.url)} is larger than the {max_bytes:,}-byte cap on fetched media"
    declared = (response.getheader("Content-Length") or "").strip()
    if declared.isdigit() and int(declared) > max_bytes:
        raise InvalidInputError(f"{too_big} (Content-Length {int(declared):,})")
    body = bytearray()
    while chunk := response.read(min(READ_SIZE, max_bytes + 1 - len(body))):
        body += chunk
        if len(body) > max_bytes:
            raise InvalidInputError(f"{too_big} (more than {max_bytes:,} bytes read)")
    return bytes(body)


class _Stopper:
    """Stops one fetch at its deadline (a timer) or when cancelled: shutting its socket down wakes a read blocked in
    the kernel at once, whatever the server sends or withholds."""

    def __init__(self):
        self.why: str | None = None  # None, "timeout" or "cancelled"
        self.seconds: float | None = None
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._timer: threading.Timer | None = None

    def arm(self, seconds: float) -> None:
        self.seconds = seconds
        self._timer = threading.Timer(seconds, self.stop, ("timeout",))
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def attach(self, sock: socket.socket) -> None:
        with self._lock:
            self._socket = sock
            stopped = self.why is not None
        if stopped:
            self._shut(sock)

    def stop(self, why: str) -> None:
        with self._lock:
            if self.why is not None:
                return
            self.why = why
            sock = self._socket
        if sock is not None:
            self._shut(sock)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected yet, or already closed
            pass


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """HTTP to the checked address: the name goes in the Host header only."""

    def __init__(self, host: str, port: int, address: str, stopper: _Stopper):
        super().__init__(host, port)
        self.address, self.stopper = address, stopper

    def _open_socket(self) -> socket.socket:
        if self.stopper.why is not None:
            raise TimeoutError(f"the fetch was stopped ({self.stopper.why})")
        sock = socket.socket(socket.AF_INET6 if ":" in self.address else socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(self.stopper.seconds)
        self.stopper.attach(sock)
        sock.connect((self.address, self.port))
        return sock

    def connect(self) -> None:
        self.sock = self._open_socket()


class _PinnedHTTPSConnection(_PinnedHTTPConnection):
    """HTTPS to the checked address: the name goes in SNI, in the certificate check and in the Host header."""
    default_port = 443

    def connect(self) -> None:
        self.sock = ssl.create_default_context().wrap_socket(self._open_socket(), server_hostname=self.host)


# -- a prompt's URLs -------------------------------------------------------------------------------------------

def remote_parts(prompt) -> list[tuple[str, int | None, str]]:
    """(kind, index in its list or None for a lone item, URL) of each http(s) picture and video of a prompt."""
    mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    if not isinstance(mm_data, dict):
        return []
    found = []
    for kind in ("image", "video"):
        items = mm_data.get(kind)
        if is_remote(items):
            found.append((kind, None, items))
        elif isinstance(items, (list, tuple)):
            found += [(kind, i, item) for i, item in enumerate(items) if is_remote(item)]
    return found


def fetch_prompt_media(prompt, policy: MediaUrlPolicy | None, name: str = "prompt"):
    """The prompt with each http(s) picture and video replaced by its fetched bytes (all fetched at once, on
    threads); the prompt itself when it names none. Blocking: the offline LLM's."""
    parts = remote_parts(prompt)
    if not parts:
        return prompt
    targets = [check_media_url(url, policy, _part_name(name, kind, i)) for kind, i, url in parts]  # all, first
    stoppers = [_Stopper() for _ in parts]
    with ThreadPoolExecutor(max_workers=min(8, len(parts)), thread_name_prefix="nanomm-fetch") as pool:
        futures = [pool.submit(fetch_url, target.url, kind, policy, _part_name(name, kind, i), stopper)
                   for (kind, i, _), target, stopper in zip(parts, targets, stoppers)]
        try:
            bodies = [f.result() for f in futures]
        except BaseException:
            for stopper in stoppers:  # the first failure ends the others' fetches too
                stopper.stop("cancelled")
            raise
    return _with_bodies(prompt, parts, bodies)


async def fetch_prompt_media_async(prompt, policy: MediaUrlPolicy | None, name: str = "request"):
    """fetch_prompt_media off the event loop: each URL on a thread of its own, all at once. Cancelled (the client
    went away) or failed, every fetch still running is stopped (its socket shut)."""
    parts = remote_parts(prompt)
    if not parts:
        return prompt
    for kind, i, url in parts:
        check_media_url(url, policy, _part_name(name, kind, i))  # a host off the list: refused before any fetch
    stoppers = [_Stopper() for _ in parts]
    fetches = [_on_a_thread(fetch_url, url, kind, policy, _part_name(name, kind, i), stopper)
               for (kind, i, url), stopper in zip(parts, stoppers)]
    try:
        bodies = await asyncio.gather(*fetches)
    except BaseException:
        for stopper in stoppers:
            stopper.stop("cancelled")
        for fetch in fetches:
            fetch.cancel()
        raise
    return _with_bodies(prompt, parts, bodies)


def _on_a_thread(function, *args) -> asyncio.Future:
    """function(*args) on a thread of its own (not the loop's shared executor, which a 30 s video would hold)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error):
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run():
        try:
            result, error = function(*args), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=run, name="nanomm-fetch", daemon=True).start()
    return future


def _with_bodies(prompt: dict, parts: list, bodies: list[bytes]) -> dict:
    mm_data = {kind: list(items) if isinstance(items, (list, tuple)) else items
               for kind, items in prompt["multi_modal_data"].items()}
    for (kind, i, _), body in zip(parts, bodies):
        if i is None:
            mm_data[kind] = body
        else:
            mm_data[kind][i] = body
    return {**prompt, "multi_modal_data": mm_data}


def _part_name(name: str, kind: str, index: int | None) -> str:
    return f"{name}, {kind} {index or 0}"  # the engine's own naming: "prompt 1, image 0"


def _short(text: str, limit: int = 80) -> str:
    """repr() of a URL, cut short: a long URL must not fill an error message."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"
