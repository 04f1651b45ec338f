"""Reading a form body (multipart/form-data, urlencoded, or a JSON object) as it streams in, with hard caps,
straight into memory.

Media end up as bytes in Redis (``Client.submit(uploads=...)``), so there is nothing to spool to disk;
what matters is refusing an oversized body *before* it has been read whole.  Three bounds apply:

* ``Content-Length`` against the whole-body cap, before a byte is read (413 at once);
* each file part against ``limits.max_upload_bytes``, counted as its bytes arrive (413 naming the part);
* each text part against a small cap (64 KiB; data-URL fields get room for one upload), and the number
  of parts, so that a hostile form cannot grow without bound either.
"""

from __future__ import annotations

import codecs
import json
import urllib.parse
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field

import anyio
import python_multipart
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header

from stageferry.errors import field_error
from stageferry.gateway.codes import GatewayCode
from stageferry.gateway.errors import ApiError, clip, invalid
from stageferry.schemas import json_text

#: How long a request body may go without a byte before it is refused (``read_form``'s ``idle_s``).
BODY_IDLE_S = 30.0

#: A text part larger than this is refused (prompts are at most 8 KiB; extra_params is small JSON).
MAX_TEXT_BYTES = 64 * 1024
#: A part's header line longer than this is refused.
MAX_HEADER_BYTES = 8192
#: More parts than this is not a video request.
MAX_PARTS = 64
#: Headers, boundaries and text fields on top of the files themselves.
FORM_OVERHEAD_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class UploadedFile:
    """One file part, read whole (within its cap)."""

    field: str
    filename: str
    content_type: str
    data: bytes


@dataclass(slots=True)
class ParsedForm:
    """Text fields (each name once) and file parts (in order; a name may repeat)."""

    fields: dict[str, str] = field(default_factory=dict)
    files: list[UploadedFile] = field(default_factory=list)


def body_cap(max_file_bytes: int, max_files: int) -> int:
    """The whole-body bound: every media input at its cap, plus room for the rest of the form."""
    return max_files * max_file_bytes + FORM_OVERHEAD_BYTES


def too_large(field_name: str, limit: int, what: str) -> ApiError:
    message = f"{what} is larger than the limit of {limit} bytes"
    return ApiError.of(GatewayCode.UPLOAD_TOO_LARGE, f"{field_name}: {message}", field_errors=[
        field_error(field_name, message, GatewayCode.UPLOAD_TOO_LARGE.code)
    ])  # fmt: skip


def check_content_length(headers: Mapping[str, str], cap: int) -> None:
    """413 before reading when the declared length is already above ``cap``; 400 when it is garbage."""
    raw = headers.get("content-length")
    if raw is None:
        return  # chunked: counted while streaming
    try:
        length = int(raw)
    except ValueError:
        raise ApiError.of(GatewayCode.INVALID_FORM, "Content-Length is not a number") from None
    if length > cap:
        raise too_large("body", cap, f"the request body ({length} bytes)")


class _Collector:
    """python-multipart callbacks that build a :class:`ParsedForm`, enforcing the caps as data arrives."""

    def __init__(self, *, charset: str, max_file_bytes: int, large_text_fields: Iterable[str]) -> None:
        self.form = ParsedForm()
        self._charset = charset
        self._max_file = max_file_bytes
        self._large_text = frozenset(large_text_fields)
        self._parts = 0
        self._header_name = b""
        self._header_value = b""
        self._headers: dict[bytes, bytes] = {}
        self._name = ""
        self._filename: str | None = None
        self._data = bytearray()
        self._limit = MAX_TEXT_BYTES
        self.complete = False

    def callbacks(self) -> dict[str, object]:
        return {
            "on_part_begin": self.on_part_begin,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_end": self.on_end,
        }

    def on_end(self) -> None:
        self.complete = True

    def on_part_begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise ApiError.of(GatewayCode.INVALID_FORM, f"more than {MAX_PARTS} form parts")
        self._headers = {}
        self._data = bytearray()
        self._filename = None

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]
        self._check_header()

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]
        self._check_header()

    def _check_header(self) -> None:
        if len(self._header_name) + len(self._header_value) > MAX_HEADER_BYTES:
            raise ApiError.of(GatewayCode.INVALID_FORM, f"a form part's header is longer than {MAX_HEADER_BYTES} bytes")

    def on_header_end(self) -> None:
        if len(self._headers) < 16:
            self._headers[self._header_name.strip().lower()] = self._header_value.strip()
        self._header_name = self._header_value = b""

    def on_headers_finished(self) -> None:
        _disposition, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        if b"name" not in options:
            raise ApiError.of(GatewayCode.INVALID_FORM, "a form part has no name (Content-Disposition)")
        self._name = self._decode(options[b"name"])
        filename = options.get(b"filename")
        self._filename = None if filename is None else self._decode(filename)
        self._limit = self._max_file if self._filename is not None else self._text_limit(self._name)

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if len(self._data) + (end - start) > self._limit:
            what = "the upload" if self._filename is not None else "the field"
            raise too_large(self._name, self._limit, what)
        self._data += data[start:end]

    def on_part_end(self) -> None:
        if self._filename is None:
            self.add_text(self._name, self._decode(bytes(self._data)))
            return
        content_type = self._decode(self._headers.get(b"content-type", b"application/octet-stream"))
        self.form.files.append(UploadedFile(self._name, self._filename, content_type.lower(), bytes(self._data)))

    def add_text(self, name: str, value: str) -> None:
        """A text field: each name once, within its size cap."""
        if name in self.form.fields:
            raise ApiError.of(GatewayCode.INVALID_FORM, f"{name}: given more than once", field_errors=[
                field_error(name, "given more than once", "duplicate_field")
            ])  # fmt: skip
        limit = self._text_limit(name)
        if len(value) > limit:
            raise too_large(name, limit, "the field")
        self.form.fields[name] = value

    def _text_limit(self, name: str) -> int:
        """Bytes a text field may hold: a data-URL field has room for one base64 upload."""
        return self._max_file * 4 // 3 + 4096 if name in self._large_text else MAX_TEXT_BYTES

    def _decode(self, raw: bytes) -> str:
        try:
            return raw.decode(self._charset)
        except UnicodeDecodeError:
            raise ApiError.of(GatewayCode.INVALID_FORM, f"a form part is not valid {self._charset}") from None


async def read_form(
    headers: Mapping[str, str],
    stream: AsyncIterator[bytes],
    *,
    max_file_bytes: int,
    max_body_bytes: int,
    large_text_fields: Iterable[str] = (),
    idle_s: float = BODY_IDLE_S,
) -> ParsedForm:
    """Parse a form body from ``stream`` (multipart, urlencoded as FastAPI's ``Form`` also takes, or a JSON
    object as OpenAI's create-video also takes); :class:`ApiError` (400/413/415) as soon as a rule breaks,
    408 when no bytes came for ``idle_s``."""
    content_type, params = parse_options_header(headers.get("content-type", ""))
    if content_type not in (b"multipart/form-data", b"application/x-www-form-urlencoded", b"application/json"):
        message = "send the request as multipart/form-data (curl -F), or as a JSON object"
        raise ApiError.of(GatewayCode.UNSUPPORTED_MEDIA_TYPE, message)
    charset = _charset(params.get(b"charset", b"utf-8").decode("latin-1"))
    check_content_length(headers, max_body_bytes)
    collector = _Collector(charset=charset, max_file_bytes=max_file_bytes, large_text_fields=large_text_fields)
    if content_type == b"application/x-www-form-urlencoded":
        return await _read_urlencoded(stream, collector, max_body_bytes, idle_s)
    if content_type == b"application/json":
        return await _read_json(stream, collector, max_body_bytes, idle_s)
    boundary = params.get(b"boundary")
    if not boundary:
        raise ApiError.of(GatewayCode.INVALID_FORM, "multipart/form-data without a boundary")
    try:
        parser = python_multipart.MultipartParser(boundary, collector.callbacks())  # type: ignore[arg-type]
        async for chunk in _bounded(stream, max_body_bytes, idle_s):
            parser.write(chunk)
        parser.finalize()
    except FormParserError as exc:
        raise ApiError.of(GatewayCode.INVALID_FORM, f"malformed multipart body: {exc}") from exc
    if not collector.complete:
        raise ApiError.of(GatewayCode.INVALID_FORM, "malformed multipart body: it ends before its closing boundary")
    return collector.form


#: The charsets a form's text parts may come in (codec names): what browsers and HTTP clients send.
#: Python knows other codecs by name, some not text (``hex``, ``zlib``), some raising other errors than a
#: decoding error's (``punycode``, ``undefined``): those are refused.
CHARSETS = frozenset({"utf-8", "ascii", "iso8859-1", "cp1252", "utf-16", "utf-16-le", "utf-16-be"})


def _charset(name: str) -> str:
    """The codec of a form's ``charset`` parameter: a name no codec has is read as utf-8 (as before), a
    codec not in :data:`CHARSETS` is a 400 that says so."""
    try:
        codec = codecs.lookup(name).name
    except LookupError:
        return "utf-8"
    if codec not in CHARSETS:
        shown = clip(name, 40)
        raise ApiError.of(GatewayCode.INVALID_FORM, f"charset {shown!r} is not supported (send utf-8)")
    return codec


async def _read_urlencoded(
    stream: AsyncIterator[bytes], collector: _Collector, max_body_bytes: int, idle_s: float
) -> ParsedForm:
    """A urlencoded body (text fields only), through the same per-field rules as multipart."""
    body = bytearray()
    async for chunk in _bounded(stream, max_body_bytes, idle_s):
        body += chunk
    for name, value in urllib.parse.parse_qsl(body.decode("latin-1"), keep_blank_values=True):
        collector.add_text(name, value)
    return collector.form


async def _read_json(
    stream: AsyncIterator[bytes], collector: _Collector, max_body_bytes: int, idle_s: float
) -> ParsedForm:
    """A JSON object body as the form it stands for (no file parts: images come as data URLs), through the
    same per-field rules: strings as they are, numbers and booleans as their JSON text, OpenAI's
    ``input_reference`` object as its ``input_reference[image_url]`` / ``[file_id]`` fields (what the SDK
    sends in a form), any other object or array as its JSON text (``extra_params``)."""
    body = bytearray()
    async for chunk in _bounded(stream, max_body_bytes, idle_s):
        body += chunk
    try:
        data = json_text.loads(body)
    except ValueError as exc:  # also not UTF-8
        raise ApiError.of(GatewayCode.INVALID_FORM, f"the JSON body does not parse: {clip(str(exc), 120)}") from None
    if not isinstance(data, dict):
        raise ApiError.of(GatewayCode.INVALID_FORM, "the JSON body must be an object of the form's fields")
    for name, value in data.items():
        if value is None:
            continue
        if name == "input_reference" and isinstance(value, dict):
            for key, inner in value.items():
                if key not in ("image_url", "file_id") or not isinstance(inner, str):
                    message = "an object with a string image_url (a data URL) or file_id"
                    raise invalid("input_reference", message, "invalid_reference")
                collector.add_text(f"input_reference[{key}]", inner)
            continue
        collector.add_text(name, value if isinstance(value, str) else json.dumps(value, separators=(",", ":")))
    return collector.form


async def _bounded(stream: AsyncIterator[bytes], max_body_bytes: int, idle_s: float) -> AsyncIterator[bytes]:
    """``stream``'s chunks, at most ``max_body_bytes`` of them (413), each within ``idle_s`` of the last
    (408: a body that stops short of its Content-Length, or a chunked one without its last chunk, would
    hold the request and its connection for as long as the client likes)."""
    received = 0
    chunks = stream.__aiter__()
    while True:
        with anyio.move_on_after(idle_s) as waited:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                return
        if waited.cancelled_caught:
            raise ApiError.of(GatewayCode.BODY_STALLED, f"no bytes of the request body came for {idle_s:g} s")
        received += len(chunk)
        if received > max_body_bytes:
            raise too_large("body", max_body_bytes, "the request body")
        yield chunk
